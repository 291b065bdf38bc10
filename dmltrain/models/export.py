"""Saving and loading a trained embedding model as one self-describing file.

The file is a ``torch.save`` of plain data only (dicts, lists, numbers, strings, tensors), so
it loads with ``weights_only=True``: ``format``, ``version``, the run ``config`` (redacted as every
written config is: :func:`dmltrain.redact.redact`), the ``model_config`` that rebuilds the architecture (a
timm model from its name, ``image_size`` and ``features``, offline), the ``state_dict`` (on CPU), ``input``
(what the model expects of its images: ``mean``, ``std``, ``interpolation``, from the run's ``data`` section,
else the backbone's own) and ``extra``
(metrics, step, anything plain). Loading rebuilds the model from ``model_config`` without
reading or downloading the pretrained weights it was started from (gradient checkpointing off: a loaded
model is for inference and export), and sets ``model.input_spec``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from torch import Tensor

from dmltrain.backbone_facts import backbone_input
from dmltrain.config import _format_validation_error
from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path
from dmltrain.models.embedding_model import EmbeddingModel, build_model
from dmltrain.redact import redact

FORMAT = "dmltrain.model"
VERSION = 1


def save_model(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
    *,
    state_dict: dict[str, Tensor] | None = None,
) -> None:
    """Write ``model`` with ``config`` (the run's config dict, or just its model section) and ``extra``.

    ``state_dict`` replaces ``model.state_dict()`` when the full weights live elsewhere (the
    fp32 masters gathered from ZeRO partitions); its keys must be exactly the model's.
    Atomic: a reader sees the old file or the new one. A wrapped model (DeepSpeed engine,
    DDP) is unwrapped. ``TypeError`` names any ``config``/``extra`` entry that is not plain data.
    """
    module = getattr(model, "module", model)
    if not isinstance(module, EmbeddingModel):
        raise TypeError(f"save_model: expected an EmbeddingModel, got {type(module).__name__}")
    model_config = module.config or _model_section(config)
    if model_config is None:
        raise ValueError("save_model: the model has no stored config and `config` has no model section to rebuild it")
    own = module.state_dict()
    if state_dict is None:
        state_dict = own
    elif set(state_dict) != set(own):
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        raise ValueError(
            f"save_model: state_dict keys differ from the model's: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": _plain(redact(config), "config"),  # a model file travels: no URL password, no secret option
        "model_config": _plain(model_config, "model_config"),
        "state_dict": {k: v.detach().cpu().clone() for k, v in state_dict.items()},
        "input": input_spec(config, model_config),
        "extra": _plain(extra or {}, "extra"),
    }
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


def load_model(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu"
) -> tuple[EmbeddingModel, dict[str, Any], dict[str, Any]]:
    """``(model, config, extra)`` from a :func:`save_model` file; the model is on ``map_location``, in eval mode.

    One-line :class:`UserError` naming ``path`` when it is missing, unreadable, not a model
    file, its stored model config no longer validates (naming the key), or its weights do not
    fit the architecture that config describes.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: model file not found")
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 — truncated zip, pickle error, foreign class...: refused the same way
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"{path}: cannot read model file ({reason})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UserError(f"{path}: not a dmltrain model file (no '{FORMAT}' format tag)")
    if int(obj.get("version", 0)) > VERSION:
        raise UserError(f"{path}: model file version {obj['version']} is newer than this dmltrain reads ({VERSION})")
    _check_data(path, obj.get("config"))
    model = _rebuild(path, obj.get("model_config"))
    try:
        model.load_state_dict(obj["state_dict"], strict=True)
    except RuntimeError as e:
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"{path}: weights do not fit the stored model config ({reason})") from None
    model.input_spec = obj.get("input") or input_spec(obj.get("config") or {}, obj["model_config"])
    model.backbone.set_grad_checkpointing(
        False
    )  # a training-memory setting; inference and export trace the plain graph
    model.to(map_location).eval()
    return model, obj["config"], obj["extra"]


def _check_data(path: Path, config: Any) -> None:
    """The stored config's image sides, bounded where they are read (a model file is anyone's: a crop of 30000
    would make every batch gigabytes); one-line :class:`UserError` naming the file and the key."""
    from dmltrain.models.contract import image_side

    data = config.get("data") if isinstance(config, dict) else None
    if not isinstance(data, dict):
        return
    try:
        crop = image_side(data.get("eval_crop", 224), "data.eval_crop")
        resize = image_side(data.get("eval_resize", 256), "data.eval_resize")
        image_side(data.get("image_size", 224), "data.image_size")
    except ValueError as e:
        raise UserError(f"{path}: stored config {e}") from None
    if crop > resize:
        raise UserError(f"{path}: stored config data.eval_crop: {crop} is larger than data.eval_resize {resize}")


def input_spec(config: dict[str, Any], model_config: dict[str, Any]) -> dict[str, Any]:
    """What a model expects of its images: ``{mean, std, interpolation}`` (lists and a string) from the run
    config's ``data`` section, with the backbone's own (:func:`~dmltrain.backbone_facts.backbone_input`) where it has none
    (a file written before these keys, or saved with its model section only)."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    mean, std, interpolation = backbone_input(str(model_config.get("backbone", "")))
    return {
        "mean": [float(v) for v in (data.get("mean") or mean)],
        "std": [float(v) for v in (data.get("std") or std)],
        "interpolation": str(data.get("interpolation") or interpolation),
    }


def _rebuild(path: Path, model_config: Any) -> EmbeddingModel:
    """The architecture ``model_config`` describes; a config this dmltrain no longer accepts (a
    renamed or removed key or value) is a one-line :class:`UserError` naming the file and the key."""

    if not isinstance(model_config, dict):
        raise UserError(f"{path}: the model file stores no model_config to rebuild the model from")
    try:
        return build_model(model_config, load_pretrained=False)
    except ValidationError as e:
        text = _format_validation_error(e, "model")  # "model: key: what is wrong"
        if e.errors()[0]["loc"]:
            text = "model." + text.removeprefix("model: ")
        raise UserError(f"{path}: stored model config no longer valid: {text}") from None
    except UserError as e:  # e.g. a backbone or stage name this version does not know
        raise UserError(f"{path}: stored model config no longer valid: {e}") from None


def _model_section(config: dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(config.get("model"), dict):
        return config["model"]
    return config if "backbone" in config else None


def _plain(obj: Any, where: str) -> Any:
    """``obj`` as data ``torch.load(weights_only=True)`` accepts; numpy values become Python/tensors."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, dict):
        return {str(k): _plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"save_model: {where} is a {type(obj).__name__}, which a weights-only file cannot hold")
