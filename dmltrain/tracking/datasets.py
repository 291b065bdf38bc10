"""The shards a run reads, as MLflow dataset inputs (the runs table's Dataset column, the run's Datasets).

One input per split the run reads: the train split with context ``training``, each evaluation split
with context ``evaluation``. Each is an :class:`mlflow.data.meta_dataset.MetaDataset`: no data, only
its name (the shard folder's), its digest (from the manifest: the SHA-256 of the split's shards'
SHA-256 sums, so the same shards give the same digest wherever they are), its source (the folder
or URL) and a profile (layout, classes, images, shards) that the UI shows beside it.

Runs that train on the same shards at the same time (a study's points, ``--parallel``) log the same dataset into
one experiment at once. MLflow looks a dataset up and inserts it when absent, in two steps: of two runs that both
find it absent, the second's insert breaks the dataset's unique key, and that failure used to turn the run's
tracking off for good (every later metric, its evaluations included, lost without a word on the driver's
terminal). :func:`log_dataset_inputs` logs them again after such a conflict (the dataset is there by then, and
MLflow keeps one input per dataset and run, so a retry adds nothing twice).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
import warnings
from typing import Any

from mlflow.data.dataset_source_registry import resolve_dataset_source
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

TRAINING, EVALUATION = "training", "evaluation"


def split_digest(split: Any) -> str:
    """12 hex digits naming a split's content: the SHA-256 of its shards' SHA-256 sums, in shard order."""
    h = hashlib.sha256()
    for shard in split.shards:
        h.update(shard.sha256.encode())
    return h.hexdigest()[:12]


def split_dataset(manifest: Any, split_name: str) -> Dataset:
    """The MLflow dataset entity of one split of a loaded :class:`shards.manifest.Manifest`."""
    split = manifest.split(split_name)
    root = str(manifest.root).rstrip("/")
    with warnings.catch_warnings():  # a local path matches two equal source types; MLflow warns and takes one
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(root)
    profile = {
        "split": split_name,
        "layout": manifest.layout,
        "classes": split.num_classes,
        "images": split.num_images,
        "shards": len(split.shards),
        "bytes": split.bytes,
    }
    d = MetaDataset(source, name=root.rsplit("/", 1)[-1] or root, digest=split_digest(split)).to_dict()
    return Dataset(d["name"], d["digest"], d["source_type"], d["source"], profile=json.dumps(profile))


def dataset_inputs(manifest: Any, train_split: str, eval_splits: list[str]) -> list[DatasetInput]:
    """The run's dataset inputs: the train split (``training``) and each evaluation split (``evaluation``)."""
    pairs = [(train_split, TRAINING)] + [(s, EVALUATION) for s in eval_splits if s != train_split]
    return [DatasetInput(split_dataset(manifest, s), [InputTag(MLFLOW_DATASET_CONTEXT, ctx)]) for s, ctx in pairs]


# how the stores word a broken unique key: SQLite, PostgreSQL, MySQL, SQL Server (through MLflow's messages)
_CONFLICT = ("unique constraint", "duplicate key", "duplicate entry", "integrityerror", "violation of primary key")
LOG_ATTEMPTS = 5


def is_conflict(error: BaseException) -> bool:
    """Whether ``error`` is a store's unique-key conflict (another writer inserted the same row first)."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(c in text for c in _CONFLICT)


def log_dataset_inputs(client: Any, run_id: str, inputs: list[DatasetInput], attempts: int = LOG_ATTEMPTS) -> None:
    """``client.log_inputs(run_id, inputs)``, again after a unique-key conflict with a run logging the same dataset at
    the same moment (see the module doc), up to ``attempts`` times with a short random pause; any other failure, or
    the last conflict, is raised (the caller's :meth:`~dmltrain.tracking.run.RunHandle.query` reports it)."""
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except Exception as e:  # MLflow wraps the store's error in its own type (MlflowException, RestException)
            if attempt == attempts - 1 or not is_conflict(e):
                raise
        time.sleep(random.uniform(0.05, 0.25) * (attempt + 1))
