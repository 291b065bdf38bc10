"""Evaluation that does not stall training: Ray Train validates saved checkpoints while the workers train on.

With ``eval.mode: async`` the workers do not evaluate. At every evaluation point (the untrained
model with ``eval.before_training``, every ``eval.every``, the end) they save a checkpoint and
ask Ray Train to validate it (``ray.train.report(..., validation=...)``, Ray 2.60's
``ValidationConfig`` on the trainer, :func:`validation_config`). Ray runs
:func:`evaluate_checkpoint` as a task (``eval.async_cpus`` CPUs, ``eval.async_gpus`` GPUs) on the
persisted checkpoint, one validation at a time in checkpoint order, keeps checkpoints with a
pending validation from deletion, and waits for the last one before ``fit()`` returns.

The task loads the checkpoint's ``model.pt`` (its fp32 weights; ``train.precision`` autocast and
``model.channels_last`` on a GPU), embeds the eval splits and computes the metrics with the same
:func:`~dmltrain.evaluate.evaluate_model` as inline evaluation, and then, as the inline
:class:`~.evaluator.Evaluator` does:

* logs them to the run's MLflow run at the checkpoint's step (under their ``eval/`` keys, the
  untrained model's at step 0), with the counts as tags, the description's Results and the plots;
* keeps the run's evaluation record, ``<storage_dir>/eval_record.json`` (initial, last and best
  metrics, the best's step). Validations run one at a time in checkpoint order, so two never
  write it at once, and it outlives a restart of the workers or of the whole run;
* exports ``best_model`` when ``eval.metric`` improved (file, MLflow artifact, logged model
  linked to these metrics);
* posts the record to the driver's progress line and summary;
* returns ``eval/<name>`` to Ray, which adds them to the checkpoint's metrics.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from ray.train import Checkpoint
from ray.train.v2.api.validation_config import ValidationConfig, ValidationTaskConfig

from dmltrain.config import Config
from dmltrain.evaluate import evaluate_model
from dmltrain.tracking.names import BEST_MODEL, report_key
from dmltrain.tracking.run import RunHandle
from dmltrain.training.artifacts import publish, publish_model, read_storage_text
from dmltrain.training.checkpoint import load_checkpoint_model
from dmltrain.training.evaluator import log_evaluation
from dmltrain.training.progress import post
from dmltrain.training.reporting import RunContext
from dmltrain.training.state import TrainState

RECORD_FILE = "eval_record.json"
_RECORD_KEYS = ("initial_metrics", "last_metrics", "best_metrics", "best_metric", "best_step", "step")


def validation_config(cfg: Config, run_context: dict[str, Any]) -> ValidationConfig | None:
    """The trainer's ``ValidationConfig`` with ``eval.mode: async`` (None inline): the task's
    resources and the run it reports to; each request adds its step and phase (:func:`validation_request`)."""
    if cfg.eval.mode != "async":
        return None
    if cfg.cluster.use_gpu and cfg.eval.async_gpus == 0:
        # not a GPU by default: every GPU usually trains, and a task waiting for one would never start
        print(
            "warning: eval.mode async: the evaluation tasks run on the CPU; set eval.async_gpus to evaluate on a GPU "
            "that training leaves free",
            file=sys.stderr,
        )
    env = {"OMP_NUM_THREADS": str(max(1, int(cfg.eval.async_cpus))), "MLFLOW_LOGGING_LEVEL": "WARNING"}
    return ValidationConfig(
        fn=evaluate_checkpoint,
        task_config=ValidationTaskConfig(fn_kwargs={"config": cfg.to_dict(), "run": dict(run_context)}),
        ray_remote_kwargs={
            "num_cpus": cfg.eval.async_cpus,
            "num_gpus": cfg.eval.async_gpus,
            "runtime_env": {"env_vars": env},
        },
    )


def validation_request(step: int, epoch: int, phase: str) -> ValidationTaskConfig:
    """What a checkpoint report asks Ray to validate: the evaluation of ``phase`` (initial, eval, final) at ``step``."""
    return ValidationTaskConfig(fn_kwargs={"step": int(step), "epoch": int(epoch), "phase": phase})


def load_record(storage_dir: str) -> TrainState:
    """The run's evaluation record (the evaluation fields of a :class:`TrainState`); empty before the first one."""
    text = read_storage_text(storage_dir, RECORD_FILE)
    data = json.loads(text) if text else {}
    return TrainState(**{k: v for k, v in data.items() if k in _RECORD_KEYS})


def _save_record(storage_dir: str, record: TrainState) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / RECORD_FILE
        path.write_text(json.dumps({k: getattr(record, k) for k in _RECORD_KEYS}, indent=2))
        publish(path, storage_dir, RECORD_FILE)


def record_summary(record: TrainState, metric: str) -> dict[str, Any]:
    """The evaluation part of a run's summary (``TrainState.summary`` without the position)."""
    summary = record.summary(metric)
    summary.pop("step")
    return summary


def evaluate_checkpoint(
    checkpoint: Checkpoint, *, config: dict[str, Any], run: dict[str, Any], step: int, epoch: int, phase: str
) -> dict[str, Any]:
    """Ray Train's validation function: evaluate ``checkpoint``'s model, log, record, export; ``eval/<name>`` to Ray."""
    cfg = Config.model_validate(config)
    ctx = RunContext.from_dict(run)
    use_gpu = cfg.eval.async_gpus > 0 and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    torch.set_num_threads(max(1, int(cfg.eval.async_cpus)))
    with checkpoint.as_directory() as local:
        directory = Path(local)
        model = load_checkpoint_model(directory, map_location=device)
        if cfg.model.channels_last and use_gpu:
            model = model.to(memory_format=torch.channels_last)
        metrics, embeddings = evaluate_model(
            model,
            cfg.data.shards,
            cfg.data.eval_splits,
            cfg.eval,
            cfg.data,
            rank=0,
            world_size=1,
            device=str(device),
            precision=cfg.train.precision if use_gpu else "fp32",
            progress=False,
            channels_last=cfg.model.channels_last and use_gpu,
        )
        metrics = metrics or {}
        key = cfg.eval.metric
        record = load_record(ctx.storage_dir)
        improved = record.record_evaluation(metrics, step, key, initial=phase == "initial")
        record.step = step
        if phase == "initial":
            record.initial_metrics = metrics
        logger = RunHandle.attach(ctx.tracking_uri, ctx.mlflow_run_id, owner="evaluation")
        try:
            # before the model: a logged model links to them
            log_evaluation(logger, cfg, metrics, embeddings, step, phase, record)
            if improved:  # the checkpoint's fp32 weights, on the CPU, as the trainer exports them
                publish_model(
                    logger,
                    load_checkpoint_model(directory),
                    BEST_MODEL,
                    extra={"step": step, "metrics": metrics},
                    storage_dir=ctx.storage_dir,
                    config=cfg.to_dict(),
                )
        finally:
            logger.close()
    _save_record(ctx.storage_dir, record)
    post(ctx.board_name, {"last_eval": f"{key} {metrics.get(key, float('nan')):.4f} (step {step})"})
    post(ctx.board_name, record_summary(record, key), summary=True)
    return {report_key(k): v for k, v in metrics.items()}
