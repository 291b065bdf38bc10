"""Every MLflow name dmltrain writes and reads back: tags, metric keys, and the keys of Ray reports.

Producers (the trainer, ``dmltrain train``, ``tune``, ``study``) and readers (``tune``, ``study``,
``report``) import these constants instead of repeating the strings, so a name is changed here
once. A new metric that a reader needs gets a constant here; the others may stay where they are
produced.

Metric keys are MLflow keys: MLflow allows only alphanumerics and ``_ - . space / :``, so the
evaluation's ``recall@1`` is logged as ``eval/recall_at_1`` (:func:`metric_key`) and shown as
``recall@1`` again (:func:`display_key`).
"""

from __future__ import annotations

# -- tags ------------------------------------------------------------------------------------------
RUN_NAME_TAG = "dmltrain.run_name"  # the run's name: the Ray job, the MLflow run and the storage folder share it
STORAGE_DIR_TAG = "dmltrain.storage_dir"  # <storage>/<run name>: checkpoints and exported models
KIND_TAG = "dmltrain.kind"  # tune, tune-trial, study: what a parent or child run is
ERROR_TAG = "dmltrain.error"  # why a run failed, on the run that failed
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: a search's or a study's child runs
RESUMED_PARAM_PREFIX = (
    "resumed."  # resumed.<param>: a param that changed when the run was resumed (params are immutable)
)
RESUMED_FROM_STEP_TAG = "dmltrain.resumed_from_step"
RESUMED_AT_EPOCH_START_TAG = "dmltrain.resumed_at_epoch_start"
TUNE_TRIAL_TAG = "dmltrain.tune.trial"  # Ray Tune's trial id, on a trial's run
TUNE_STOPPED_TAG = "dmltrain.tune.stopped_early"  # a trial the scheduler stopped
TUNE_BEST_TRIAL_TAG = "dmltrain.tune.best_trial"  # on a search's parent run
TUNE_BEST_RUN_TAG = "dmltrain.tune.best_run_id"
TUNE_BEST_VALUE_PREFIX = "dmltrain.tune.best."  # dmltrain.tune.best.<key>: the best trial's sampled values
SERVING_TAG_PREFIX = (
    "dmltrain.serving."  # dmltrain.serving.<format>.<field>: an exported model's contract, on its logged model
)

# -- metrics (MLflow keys) ---------------------------------------------------------------------------
LOSS = "loss"  # the objective (weighted sum of the parts); the parts are classifier/loss, instance/loss
LR = "lr"
EPOCH = "epoch"
IMAGES_PER_S = "images_per_s"
STEP_MS = "time/step_ms"  # wall time per step; time/<part>_ms splits it (data, forward, backward, optimizer)
RSS_MB = "memory/rss_mb"  # rank 0's resident memory
CLASSIFIER_MB = "memory/classifier_mb"  # rank 0's classifier shard: rows and their optimizer state
CUDA_PEAK_MB = "memory/cuda_peak_mb"
ACTIVE_ROWS = "classifier/active_rows"  # classifier rows in this step's softmax, on rank 0's shard
ACTIVE_CLASSES = "classifier/active_classes"  # classes in this step's softmax, over all shards
SKIPPED_SAMPLES = "data/skipped_samples"
REMOTE_PREFIX = "data/remote/"  # data/remote/<counter>: remote shard reads, all ranks (requests, bytes, retries, retries/<kind>, failed)
REMOTE_RETRIES = "data/remote/retries"
TRAIN_PREFIX = "train/"  # the objective's other statistics
EVAL_PREFIX = "eval/"  # eval/<metric>: every evaluation during and after training
INITIAL_PREFIX = "initial/"  # initial/<metric>: the untrained model's evaluation (step 0)
BINARY_PREFIX = "binary/"  # eval/binary/<metric>: the same on sign bits

# -- what the workers report to Ray (and so to Tune) ---------------------------------------------------
REPORT_STEP = "step"
REPORT_EPOCH = "epoch"
REPORT_EVALUATION = "evaluation"  # 1 on an evaluation's report; checkpoint reports repeat the last metrics without it


def metric_key(name: str) -> str:
    """The MLflow key of a metric name: ``eval/recall@1`` -> ``eval/recall_at_1``, ``map@r`` -> ``map_at_r``;
    any other character MLflow refuses becomes ``_``."""
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in name)


def display_key(key: str) -> str:
    """Inverse of :func:`metric_key` for the names dmltrain logs: ``eval/recall_at_1`` -> ``eval/recall@1``."""
    return key.replace("_at_", "@")


def eval_key(metric: str) -> str:
    """The MLflow key of an evaluation metric: ``recall@1`` -> ``eval/recall_at_1``."""
    return metric_key(EVAL_PREFIX + metric)


def initial_key(metric: str) -> str:
    """The MLflow key of the untrained model's value of a metric: ``recall@1`` -> ``initial/recall_at_1``."""
    return metric_key(INITIAL_PREFIX + metric)


def report_key(metric: str) -> str:
    """The key of an evaluation metric in the workers' Ray reports (Tune's results): ``eval/recall@1``."""
    return EVAL_PREFIX + metric
