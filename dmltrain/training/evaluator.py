"""Evaluation during training: metrics, the best model so far, plots and model export.

:meth:`Evaluator.evaluate` embeds the eval splits on every rank (each its part of the test
shards), computes the metrics on rank 0 and hands the same dict to every rank, records them
in the run's :class:`~dmltrain.training.state.TrainState` (last and best), logs them to
MLflow at ``step`` under their ``eval/`` keys (the untrained model's too, at step 0, so every
curve starts there) with the evaluation's counts (queries, gallery) as tags, completes the
run's description with the results so far, draws the plots, exports ``best_model`` when the
tracked metric improved, and reports the evaluation to Ray (Tune reads these reports). Every
rank calls it: it holds collectives.

With ``train.ema_decay`` the model holds the weights' average while it is evaluated
(:meth:`~dmltrain.training.ema.WeightEMA.swapped`), and the exporter writes the average.

The metrics come from the model alone, so the same steps run on a saved checkpoint's
``model.pt`` elsewhere (``eval.mode: async``, :mod:`.async_eval`, through :func:`log_evaluation`)
and land at that checkpoint's step.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import torch

from dmltrain.config import Config
from dmltrain.distributed.process_group import broadcast_buffers, broadcast_object
from dmltrain.evaluate import evaluate_model
from dmltrain.tracking.description import describe_results, with_results
from dmltrain.tracking.names import (
    BEST_MODEL,
    EVAL_COUNTS,
    EVAL_PREFIX,
    MODEL,
    REPORT_EPOCH,
    REPORT_EVALUATION,
    REPORT_STEP,
    eval_count_tag,
    report_key,
)
from dmltrain.training.artifacts import ModelExporter
from dmltrain.training.reporting import Reporter
from dmltrain.training.state import TrainState


class Evaluator:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: Config,
        exporter: ModelExporter,
        reporter: Reporter,
        logger,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        ema=None,
        total_steps: int | None = None,
    ):
        self.model, self.cfg, self.ema = model, cfg, ema
        self.exporter, self.reporter, self.logger = exporter, reporter, logger
        self.rank, self.world_size, self.device = rank, world_size, device
        self.total_steps = total_steps

    def evaluate(self, state: TrainState, step: int, phase: str) -> dict[str, float]:
        """Evaluate at ``step``; ``phase``: ``initial`` (untrained, never the best), ``eval`` or ``final``."""
        self.reporter.progress(state, phase=f"evaluating ({phase})")
        metrics, embeddings = self._metrics()
        key = self.cfg.eval.metric
        improved = state.record_evaluation(metrics, step, key, initial=phase == "initial")
        if self.rank == 0:
            log_evaluation(self.logger, self.cfg, metrics, embeddings, step, phase, state, self.total_steps)
            self.reporter.progress(state, last_eval=f"{key} {metrics.get(key, float('nan')):.4f}")
        if improved:
            self.exporter.export(BEST_MODEL, extra={"step": step, "metrics": metrics})
        # `evaluation: 1` tells evaluation reports from checkpoint reports, which repeat the latest metrics
        self.reporter.report(
            {report_key(k): v for k, v in metrics.items()}
            | {REPORT_STEP: step, REPORT_EPOCH: state.epoch, REPORT_EVALUATION: 1},
            step=step,
        )
        return metrics

    def export_final(self, state: TrainState) -> None:
        """The trained model as ``model/model.pt`` with the last evaluation (every rank calls it)."""
        self.exporter.export(MODEL, extra={"step": state.step, "metrics": state.last_metrics})

    def _metrics(self) -> tuple[dict[str, float], Any]:
        """The metrics on every rank; the embeddings (for plots) on rank 0, None elsewhere."""
        was_training = self.model.training
        # per-worker BatchNorm statistics differ by rank: evaluate rank 0's model on every rank, the one it saves
        broadcast_buffers(self.model)
        self.model.eval()
        # with train.ema_decay the weights' average is what is evaluated (and exported)
        with torch.no_grad(), self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            metrics, embeddings = evaluate_model(
                self.model,
                self.cfg.data.shards,
                self.cfg.data.eval_splits,
                self.cfg.eval,
                self.cfg.data,
                # the engine already holds the weights in its precision; autocast on top would feed
                # fp32 activations to bf16 norm layers
                rank=self.rank,
                world_size=self.world_size,
                device=str(self.device),
                precision="fp32",
                progress=False,
                channels_last=self.cfg.model.channels_last,
            )
        self.model.train(was_training)
        return broadcast_object(metrics) or {}, embeddings


def log_evaluation(
    logger,
    cfg: Config,
    metrics: dict[str, float],
    embeddings: Any,
    step: int,
    phase: str,
    record: TrainState | None = None,
    total_steps: int | None = None,
) -> None:
    """An evaluation in the run's MLflow run: the metrics under their ``eval/`` keys at ``step`` (the
    untrained model's at step 0), the counts (queries, gallery, ...) as tags, the description's Results
    from ``record`` (the run's evaluations so far, this one recorded), and with ``eval.plots`` the
    Recall@K curve and the embedding map."""
    counts = {eval_count_tag(k): f"{metrics[k]:g}" for k in EVAL_COUNTS if k in metrics}
    logger.log_metrics({f"{EVAL_PREFIX}{k}": v for k, v in metrics.items() if k not in EVAL_COUNTS}, step=step)
    if counts:
        logger.set_tags(counts)
    if record is not None and logger.enabled:
        results = describe_results(
            cfg.eval.metric,
            record.initial_metrics,
            metrics,
            record.best_metrics,
            record.best_step,
            step,
            total_steps,
            finished=phase == "final",
        )
        logger.set_description(with_results(logger.description(), results))
    if not cfg.eval.plots or embeddings is None:
        return
    # imported here: matplotlib is part of every training worker's start-up otherwise, with or without eval.plots
    from dmltrain.evaluate import plot_embedding_map, plot_recall_at_k

    emb, labels = embeddings.get("query", next(iter(embeddings.values())))
    with tempfile.TemporaryDirectory() as tmp:
        curve = plot_recall_at_k({f"{phase} step {step}": metrics}, Path(tmp) / f"recall_at_k-step{step:07d}.png")
        emap = plot_embedding_map(emb, labels, Path(tmp) / f"embeddings-step{step:07d}.png", seed=cfg.train.seed)
        for p in (curve, emap):
            logger.log_artifact(p, "plots")
