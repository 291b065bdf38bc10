"""Every MLflow name dmltrain writes and reads back: tags, metric keys, and the keys of Ray reports.

Producers (the trainer, ``dmltrain train``, ``tune``, ``study``) and readers (``tune``, ``study``,
``report``, ``bench quality``) import these constants instead of repeating the strings, so a name
is changed here once. A new metric that a reader needs gets a constant here; the others may stay
where they are produced.

**Order.** MLflow's UI groups a run's metric charts into sections by the key's prefix (up to its
last ``/``; keys without one go to "Model metrics", shown last) and sorts sections and the charts
in them by code unit (``"-" < "0" < "A" < "_" < "a"``). The prefixes are chosen for that order:
``batch/`` (the objective and the learning rate) comes first, then ``eval/`` (Recall@K only), then
the other evaluation metrics (``eval/binary/``, ``eval/clustering/``, ``eval/ranking/``), then what
explains the cost and the losses (``instance/``, ``memory/``, ``softmax/`` (the classifier's
statistics), ``softmax/probe/`` (what class subsampling costs the gradient, right after them),
``time/``, ``train/``). ``data/`` (remote reads, skipped samples: empty for most
runs) sorts before ``eval/``. What does not change during a run (the classifier's active classes
and rows, its memory, the evaluation's query and gallery counts) is a tag, not a metric series.

Metric keys are MLflow keys: MLflow allows only alphanumerics and ``_ - . space / :``, so the
evaluation's ``recall@1`` is logged as ``eval/recall_at_1`` and ``map@r`` as
``eval/ranking/map_at_r`` (:func:`metric_key`, :func:`eval_key`), and read back as
``eval/recall@1``, ``eval/map@r`` (:func:`display_key`). The untrained model's evaluation is
logged at step 0 under the same keys as every later one.
"""

from __future__ import annotations

# -- tags ------------------------------------------------------------------------------------------
RUN_NAME_TAG = "dmltrain.run_name"  # the run's name: the Ray job, the MLflow run and the storage folder share it
STORAGE_DIR_TAG = "dmltrain.storage_dir"  # <storage>/<run name>: checkpoints and exported models
KIND_TAG = "dmltrain.kind"  # tune, tune-trial, study: what a parent or child run is
ERROR_TAG = "dmltrain.error"  # why a run failed, on the run that failed
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: a search's or a study's child runs
DESCRIPTION_TAG = "mlflow.note.content"  # MLflow's own: the run's description (Markdown), shown on its page
RESUMED_PARAM_PREFIX = (
    "resumed."  # resumed.<param>: a param that changed when the run was resumed (params are immutable)
)
RESUMED_FROM_STEP_TAG = "dmltrain.resumed_from_step"
RESUMED_AT_EPOCH_START_TAG = "dmltrain.resumed_at_epoch_start"
# dmltrain.resize.<n>: the n-th restart of the worker group in this run ("3 -> 2 workers at step 37: resumed from
# step 35, 2 steps replayed, 48.2 s lost"); the worker count itself is the metric cluster/workers
RESIZE_TAG_PREFIX = "dmltrain.resize."
TUNE_TRIAL_TAG = "dmltrain.tune.trial"  # Ray Tune's trial id, on a trial's run
TUNE_STOPPED_TAG = "dmltrain.tune.stopped_early"  # a trial the scheduler stopped
TUNE_BEST_TRIAL_TAG = "dmltrain.tune.best_trial"  # on a search's parent run
TUNE_BEST_RUN_TAG = "dmltrain.tune.best_run_id"
TUNE_BEST_VALUE_PREFIX = "dmltrain.tune.best."  # dmltrain.tune.best.<key>: the best trial's sampled values
STUDY_POINT_TAG = "dmltrain.study.point"  # a study's child run: the label of its point (r0.1-c100k)
STUDY_REPEAT_TAG = "dmltrain.study.repeat"  # ... and its repeat (0, 1, ...: the seed is train.seed + repeat)
STUDY_WALL_TAG = "dmltrain.study.wall_s"  # ... and the wall time of its training (kept when the study is run again)

# What does not change while a run trains: tags set once (the classifier's, at the first log point and
# again at the end with the run's mean; the evaluation's, at the first evaluation).
ACTIVE_CLASSES_TAG = "dmltrain.classifier.active_classes"  # classes in each step's softmax, over all shards
ACTIVE_SHARE_TAG = "dmltrain.classifier.active_share"  # ... as a share of all classes
ACTIVE_ROWS_TAG = "dmltrain.classifier.active_rows"  # rank 0's shard rows in each step's softmax (run mean)
LOGITS_KEPT_TAG = "dmltrain.classifier.logits_kept"  # 1: backward reused the forward's logits
CLASSIFIER_MB_TAG = "dmltrain.memory.classifier_mb"  # rank 0's classifier shard: rows and their optimizer state
COMPILE_SECONDS_TAG = "dmltrain.compile.seconds"  # model.compile: the first step's compile time (rank 0)
COMPILE_GRAPH_BREAKS_TAG = "dmltrain.compile.graph_breaks"  # ... the graph breaks dynamo met in the compiled parts
COMPILE_PARTS_TAG = "dmltrain.compile.parts"  # ... the parts compiled (model.compile_scope, those the run has)
EVAL_COUNT_TAG_PREFIX = "dmltrain.eval."  # dmltrain.eval.<count>: the evaluation's bookkeeping
EVAL_COUNTS = ("num_queries", "gallery_size", "excluded_queries", "unreadable_samples")

# the objective's statistics that are run facts (tags above), not metric series: stat name -> tag
CLASSIFIER_FACTS = {
    "classifier/active_classes": ACTIVE_CLASSES_TAG,
    "classifier/active_share": ACTIVE_SHARE_TAG,
    "classifier/active_rows": ACTIVE_ROWS_TAG,
    "classifier/logits_kept": LOGITS_KEPT_TAG,
}

# -- logged models ---------------------------------------------------------------------------------
MODEL = "model"  # the trained model, at the end
BEST_MODEL = "best_model"  # the best evaluation so far (eval.metric); one per run, replaced when beaten
MODEL_STEP_TAG = "step"  # on a logged model: the step it was taken at; its eval.metric is a tag too
SERVING_TAG_PREFIX = (
    "dmltrain.serving."  # dmltrain.serving.<format>.<field>: an exported model's contract, on its logged model
)

# -- metrics (MLflow keys) ---------------------------------------------------------------------------
LOSS = "batch/loss"  # the objective (weighted sum of the parts); the parts are softmax/loss, instance/loss
LR = "batch/lr"
EPOCH = "epoch"
IMAGES_PER_S = "images_per_s"
STEP_MS = "time/step_ms"  # wall time per step; time/<part>_ms splits it (data, forward, backward, optimizer)
RSS_MB = "memory/rss_mb"  # rank 0's resident memory
CUDA_PEAK_MB = "memory/cuda_peak_mb"
CLASSIFIER_PREFIX = "softmax/"  # softmax/<stat>: the sharded classifier's loss and statistics
# softmax/probe/<stat>: every loss.classifier.probe_every steps, the full softmax against the sampled one on the
# same batch: grad_cos (cosine of the embeddings' gradients), grad_norm_ratio (sampled / full), loss_gap (sampled −
# full), full_loss; uniform_loss_gap (a uniform draw of the same size − full) with another draw
PROBE_PREFIX = CLASSIFIER_PREFIX + "probe/"
PROBE_GRAD_COS = PROBE_PREFIX + "grad_cos"
PROBE_LOSS_GAP = PROBE_PREFIX + "loss_gap"
PROBE_UNIFORM_LOSS_GAP = PROBE_PREFIX + "uniform_loss_gap"
# the full softmax's loss on the step's batch: the loss that means the same at every sample_ratio (batch/loss, a
# softmax over the drawn classes only, is lower the fewer are drawn)
PROBE_FULL_LOSS = PROBE_PREFIX + "full_loss"
INSTANCE_PREFIX = "instance/"  # instance/<stat>: the instance loss's
CLASSIFIER_LOSS = CLASSIFIER_PREFIX + "loss"
INSTANCE_LOSS = INSTANCE_PREFIX + "loss"
SKIPPED_SAMPLES = "data/skipped_samples"
WORKERS = "cluster/workers"  # the worker group's size, logged at the start and at every change (elastic runs)
REMOTE_PREFIX = "data/remote/"  # data/remote/<counter>: remote shard reads, all ranks (requests, bytes, retries, retries/<kind>, failed)
REMOTE_RETRIES = "data/remote/retries"
TRAIN_PREFIX = "train/"  # the objective's other statistics
EVAL_PREFIX = "eval/"  # eval/<metric>: every evaluation, the untrained model's at step 0 included
BINARY_PREFIX = "binary/"  # eval/binary/<metric>: the same on sign bits
# eval/[binary/]<group>/<metric> for what is not Recall@K, so that Recall@K has the eval/ section to itself
EVAL_GROUPS = {"map@r": "ranking", "r_precision": "ranking", "nmi": "clustering"}
OTHER_EVAL_GROUP = "other"

# -- what the workers report to Ray (and so to Tune) ---------------------------------------------------
REPORT_STEP = "step"
REPORT_EPOCH = "epoch"
REPORT_EVALUATION = "evaluation"  # 1 on an evaluation's report; checkpoint reports repeat the last metrics without it

_GROUP_DIRS = {*EVAL_GROUPS.values(), OTHER_EVAL_GROUP}


def _mlflow_chars(name: str) -> str:
    name = name.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in name)


def metric_key(name: str) -> str:
    """The MLflow key of a metric name: an evaluation metric goes through :func:`eval_key`
    (``eval/recall@1`` -> ``eval/recall_at_1``, ``eval/map@r`` -> ``eval/ranking/map_at_r``); in any
    other name ``@`` becomes ``_at_`` and any other character MLflow refuses ``_``."""
    if name.startswith(EVAL_PREFIX):
        return eval_key(name[len(EVAL_PREFIX) :])
    return _mlflow_chars(name)


def eval_key(metric: str) -> str:
    """The MLflow key of an evaluation metric: ``recall@1`` -> ``eval/recall_at_1``,
    ``binary/map@r`` -> ``eval/binary/ranking/map_at_r``, ``nmi`` -> ``eval/clustering/nmi``."""
    binary = metric.startswith(BINARY_PREFIX)
    base = metric[len(BINARY_PREFIX) :] if binary else metric
    group = "" if base.startswith("recall@") else EVAL_GROUPS.get(base, OTHER_EVAL_GROUP) + "/"
    return _mlflow_chars(EVAL_PREFIX + (BINARY_PREFIX if binary else "") + group + base)


def display_key(key: str) -> str:
    """Inverse of :func:`metric_key` for the names dmltrain logs: ``eval/recall_at_1`` -> ``eval/recall@1``,
    ``eval/ranking/map_at_r`` -> ``eval/map@r``."""
    if key.startswith(EVAL_PREFIX):
        parts = key.split("/")
        key = "/".join(p for i, p in enumerate(parts) if not (0 < i < len(parts) - 1 and p in _GROUP_DIRS))
    return key.replace("_at_", "@")


def eval_name(key: str) -> str | None:
    """The evaluation's own name of an MLflow key (``eval/ranking/map_at_r`` -> ``map@r``); None for other keys."""
    return display_key(key)[len(EVAL_PREFIX) :] if key.startswith(EVAL_PREFIX) else None


def report_key(metric: str) -> str:
    """The key of an evaluation metric in the workers' Ray reports (Tune's results): ``eval/recall@1``."""
    return EVAL_PREFIX + metric


def eval_count_tag(name: str) -> str:
    """The tag of an evaluation count: ``num_queries`` -> ``dmltrain.eval.num_queries``."""
    return EVAL_COUNT_TAG_PREFIX + name
