"""One trial of ``dmltrain tune``: its config, its MLflow child run, its training, its results to Tune.

A trial is a Tune function trial (:func:`run_trial`) that builds the run's ``TorchTrainer``
(the one ``dmltrain train`` uses) and calls ``fit()``. Its evaluations reach Tune through a
Ray Train callback (:func:`evaluation_callback`), one Tune result per evaluation.
"""

from __future__ import annotations

import re
from typing import Any

from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from cluster.launch import build_trainer
from cluster.tune.space import apply_params
from dmltrain.config import build_config
from dmltrain.errors import UserError
from dmltrain.tracking.names import ERROR_TAG, KIND_TAG, REPORT_EVALUATION, REPORT_STEP, STORAGE_DIR_TAG, TUNE_TRIAL_TAG
from dmltrain.tracking.run import TAG_CHARS, RunHandle


def trial_index(trial_id: str) -> int:
    """The trial's counter: Tune's trial ids end in it (``a1b2c_00003``), our trial folders are ``t003``."""
    m = re.search(r"(?:_|^t)(\d+)$", trial_id)
    return int(m.group(1)) if m else 0


def trial_run_name(search_name: str, index: int) -> str:
    return f"{search_name}-t{index:03d}"


def is_new_evaluation(metrics: dict[str, Any], result_key: str, last_step: int | None) -> bool:
    """Whether a worker report is an evaluation Tune has not seen: an evaluation report (the trainer
    marks them ``evaluation: 1``; checkpoint reports repeat the last metrics without it) holding the
    metric, at a step > 0 (step 0 is the untrained model) other than the last one forwarded."""
    step = metrics.get(REPORT_STEP)
    return metrics.get(REPORT_EVALUATION) == 1 and result_key in metrics and bool(step) and step != last_step


class EvaluationsToTune(TuneReportCallback):
    """A Ray Train callback (built inside the Tune trial) that forwards each new evaluation to Tune.

    Ray's ``TuneReportCallback`` forwards every ``ray.train.report``; forwarding only new
    evaluations (:func:`is_new_evaluation`) makes one Tune result per evaluation, so Tune's
    ``training_iteration`` counts evaluations. ``extra`` (the MLflow run) rides along.
    """

    def __init__(self, result_key: str, extra: dict[str, Any]) -> None:
        super().__init__()
        self.result_key, self.extra = result_key, extra
        self.last_step: int | None = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        m = metrics[0]  # rank 0's; every rank reports the same evaluation
        if is_new_evaluation(m, self.result_key, self.last_step):
            self.last_step = m[REPORT_STEP]
            self._training_actor_item_queue.put({**m, **self.extra})


def run_trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Tune function of one trial: validate the sampled config, open its MLflow child run, train.

    ``setup``: ``base`` (the resolved config tree), ``name`` (the search's), ``parent_run_id``,
    ``runs_root`` (Ray Train storage of the trials), ``result_key``. A sampled config the config
    refuses still gets its child run, FAILED and tagged with the reason, then fails the trial.
    """
    trial_id = tune.get_context().get_trial_id()
    index = trial_index(trial_id)
    run_name = trial_run_name(setup["name"], index)
    tree = apply_params(
        setup["base"], {**params, "train.run_name": run_name, "cluster.storage_path": setup["runs_root"]}
    )
    tracking = tree.get("tracking") or {}
    storage_dir = f"{setup['runs_root'].rstrip('/')}/{run_name}"
    tags = {KIND_TAG: "tune-trial", TUNE_TRIAL_TAG: trial_id, STORAGE_DIR_TAG: storage_dir}
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    try:
        cfg = build_config(tree, source=f"trial {index} ({shown})")
    except UserError as e:
        if tracking.get("enabled", True):
            failed = RunHandle.open(
                tracking.get("uri"),
                tracking.get("experiment", "dmltrain"),
                run_name,
                params,
                tags={**tags, ERROR_TAG: str(e)[:TAG_CHARS]},
                parent_run_id=setup["parent_run_id"],
            )
            failed.finish("FAILED")
        raise
    run = RunHandle.for_config(cfg, run_name, cfg.flat(), tags=tags, parent_run_id=setup["parent_run_id"])
    context = {
        "run_name": run_name,
        "storage_dir": storage_dir,
        "tracking_uri": run.uri,
        "mlflow_run_id": run.run_id,
        "board_name": None,
    }
    callback = EvaluationsToTune(setup["result_key"], {"mlflow_run_id": run.run_id or "", "run_name": run_name})
    trainer = build_trainer(cfg, run_name, context, callbacks=[callback])
    try:
        trainer.fit()
    except BaseException as e:
        run.set_tag(ERROR_TAG, f"{type(e).__name__}: {str(e)[:4000]}")
        run.finish("FAILED")
        raise
    run.finish("FINISHED")
