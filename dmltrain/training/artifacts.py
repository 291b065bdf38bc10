"""What a run leaves besides metrics: its files in MLflow and its models in the run's storage directory.

* :func:`log_run_files`: the resolved config, the DeepSpeed JSON and the manifest summary, once per run.
* :class:`ModelExporter`: ``<name>/model.pt`` (a :func:`~dmltrain.models.save_model` file) to
  MLflow (an artifact, and a logged model tagged with its step and score that replaces the run's
  earlier one of that name) and, through :func:`publish`, to ``<storage_dir>/<name>/model.pt``
  (``best_model`` when an evaluation improves, ``model`` at the end); :func:`publish_model` does
  the same for a model at hand (an asynchronous evaluation's checkpoint).
* :func:`read_storage_text`: a small file of the run's storage directory (local or remote).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs

from dmltrain.models import load_model, save_model
from dmltrain.tracking.names import MODEL_STEP_TAG, metric_key
from dmltrain.training.dp_state import full_module_state_dict
from shards.storage.location import is_url


def log_run_files(logger, cfg, ds_config: dict[str, Any], manifest) -> None:
    """The resolved config, DeepSpeed JSON and manifest summary as MLflow artifacts (a no-op without tracking)."""
    if logger is None or not logger.enabled:
        return
    files = {
        "config/config.yaml": cfg.to_yaml(),
        "config/deepspeed.json": json.dumps(ds_config, indent=2),
        "data/manifest_summary.json": json.dumps(manifest.summary(), indent=2, default=str),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for rel, text in files.items():
            path = Path(tmp) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            logger.log_artifact(path, rel.rsplit("/", 1)[0])


class ModelExporter:
    """Exports the engine's model: every rank calls :meth:`export` (a collective under ZeRO-3); rank 0 writes.
    With ``ema`` (a :class:`~dmltrain.training.ema.WeightEMA`) the exported weights are the average."""

    def __init__(self, engine, logger, *, rank: int, storage_dir: str, config: dict[str, Any], ema=None):
        self.engine, self.logger, self.rank = engine, logger, rank
        self.storage_dir, self.config, self.ema = storage_dir, config, ema

    def export(self, name: str, extra: dict[str, Any]) -> None:
        """``<name>/model.pt`` with ``extra`` (step, metrics) to MLflow and to the run's storage directory."""
        weights = full_module_state_dict(self.engine)
        if self.ema is not None:
            weights.update({k: v.detach().cpu().clone() for k, v in self.ema.shadow.items()})
        if self.rank != 0:
            return
        publish_model(
            self.logger,
            self.engine.module,
            name,
            extra=extra,
            storage_dir=self.storage_dir,
            config=self.config,
            state_dict=weights,
        )


def publish_model(
    logger,
    model,
    name: str,
    *,
    extra: dict[str, Any],
    storage_dir: str,
    config: dict[str, Any],
    state_dict: dict[str, Any] | None = None,
) -> None:
    """``<name>/model.pt`` of ``model`` (weights ``state_dict`` when given) with ``extra`` (step, metrics)
    to MLflow (artifact and logged model) and to the run's storage directory."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        save_model(path, model, config, extra=extra, state_dict=state_dict)
        logger.log_artifact(path, name)
        if logger.enabled and config["tracking"].get(
            "log_models", True
        ):  # MLflow 3's Models view: pt2, linked to this step's evaluation, tagged with its step and score
            crop = config["data"]["eval_crop"]
            logger.log_model(
                load_model(path)[0],
                name,
                step=extra["step"],
                input_example=np.zeros((2, 3, crop, crop), np.float32),
                tags=model_tags(extra, config["eval"]["metric"]),
            )
        publish(path, storage_dir, f"{name}/model.pt")


def model_tags(extra: dict[str, Any], metric: str) -> dict[str, str]:
    """A logged model's tags: the step it was taken at and its ``eval.metric`` there (when evaluated)."""
    tags = {MODEL_STEP_TAG: str(extra["step"])}
    value = (extra.get("metrics") or {}).get(metric)
    if value is not None:
        tags[metric_key(metric)] = f"{value:.4f}"
    return tags


def _storage(storage_dir: str) -> tuple[pyarrow.fs.FileSystem, str]:
    fs, root = (
        pyarrow.fs.FileSystem.from_uri(storage_dir)
        if is_url(storage_dir)
        else (pyarrow.fs.LocalFileSystem(), storage_dir)
    )
    return fs, root.rstrip("/")


def read_storage_text(storage_dir: str, relpath: str) -> str | None:
    """The text of ``<storage_dir>/<relpath>``; None when there is no such file."""
    fs, root = _storage(storage_dir)
    path = f"{root}/{relpath}"
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def publish(local_file: Path, storage_dir: str, relpath: str) -> None:
    """Copy a file into the run's storage directory (a local/NFS path or a pyarrow URI such as s3://).

    The copy lands under a temporary name and is then renamed, so a reader never sees half a file.
    """
    fs, root = _storage(storage_dir)
    dest = f"{root}/{relpath}"
    fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
    tmp_dest = dest + ".tmp"
    pyarrow.fs.copy_files(str(local_file), tmp_dest, destination_filesystem=fs)
    fs.move(tmp_dest, dest)
