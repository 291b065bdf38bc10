"""Pretrained backbone weights: ``model.pretrained`` is ``none``, ``imagenet`` or a file path.

* A file is a torchvision state dict of that backbone (also accepted: one wrapped under
  ``state_dict``/``model``, keys prefixed by ``module.``, or a dmltrain model file, whose
  ``backbone.*`` keys are used). The ImageNet classifier keys (``fc.*``, ``aux1.*``, ...) are
  ignored; every other key must match the backbone exactly, or a one-line error names the
  file and the first mismatches.
* ``imagenet`` is torchvision's weights enum for the backbone. The file is read from the
  torch hub cache (``$TORCH_HOME/hub/checkpoints``) or downloaded there with a timeout and
  its hash checked; without network the error says to fetch the file elsewhere and pass its
  path.

:func:`check_pretrained` is the driver's check before any worker starts: the same reading and
fitting, on a backbone built on the meta device (shapes only, no memory).
"""

from __future__ import annotations

import hashlib
import http.client
import sys
import urllib.request
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.hub import HASH_REGEX
from tqdm import tqdm

from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path
from dmltrain.models.backbones import CLASSIFIER_PREFIXES, Backbone, build_backbone, imagenet_weights

DOWNLOAD_TIMEOUT_S = 30.0  # per blocking socket operation, not for the whole file


def load_pretrained(backbone: Backbone, spec: str) -> None:
    """Fill ``backbone`` with the weights named by ``spec`` (``none`` leaves it as initialised)."""
    if spec in ("", "none"):
        return
    if spec == "imagenet":
        path = imagenet_file(backbone.name)
    else:
        path = Path(spec).expanduser()
    apply_state_dict(backbone, read_state_dict(path), str(path))


def check_pretrained(backbone_name: str, spec: str) -> None:
    """A one-line :class:`UserError` unless ``model.pretrained`` = ``spec`` would load into backbone
    ``backbone_name``: a readable state dict file that fits it, or ``imagenet`` for a backbone that has
    ImageNet weights (whether they can be downloaded is the workers' to find)."""
    if spec in ("", "none"):
        return
    if spec == "imagenet":
        if imagenet_weights(backbone_name) is None:
            raise UserError(
                f"model.pretrained=imagenet: backbone {backbone_name} has no ImageNet weights; use none or a file path"
            )
        return
    path = Path(spec).expanduser()
    state = read_state_dict(path)
    with torch.device("meta"):
        backbone = build_backbone(backbone_name, pretrained=True)
    fitted_state_dict(backbone, state, str(path))


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """A ``name -> tensor`` mapping from a ``torch.save`` file, read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"model.pretrained: file not found: {path}")
    try:
        obj: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — torch raises many types for a bad file: report them all the same way
        raise UserError(f"model.pretrained: cannot read {path} as a PyTorch state dict ({_one_line(e)})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise UserError(f"model.pretrained: {path} holds no state dict (a mapping of parameter names to tensors)")
    return obj


def apply_state_dict(backbone: Backbone, state: dict[str, Tensor], source: str) -> None:
    """Strictly load ``state`` into ``backbone``; a one-line :class:`UserError` names ``source`` on mismatch."""
    state = fitted_state_dict(backbone, state, source)
    try:
        backbone.load_state_dict(state, strict=True)
    except RuntimeError as e:  # pragma: no cover - fitted_state_dict catches what load_state_dict would
        raise UserError(f"model.pretrained: {source} does not fit backbone {backbone.name}: {_one_line(e)}") from None


def fitted_state_dict(backbone: Backbone, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """``state`` reduced to the backbone's keys (a wrapped model's prefix and the ImageNet classifier dropped);
    a one-line :class:`UserError` naming ``source`` when keys are missing or unexpected or shapes differ."""
    own = backbone.state_dict()
    prefix = _best_prefix(state, own)
    if prefix:  # a wrapped model: keep the backbone's part, ignore the rest (its head)
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    state = {k: v for k, v in state.items() if not k.startswith(CLASSIFIER_PREFIXES)}
    # BatchNorm fills num_batches_tracked itself when an old checkpoint lacks it
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} (file {_shape(state[k])}, model {_shape(own[k])})"
        for k in state
        if k in own and state[k].shape != own[k].shape
    ]
    problems = []
    for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
        if keys:
            more = f", +{len(keys) - 3} more" if len(keys) > 3 else ""
            problems.append(f"{len(keys)} {what} ({', '.join(keys[:3])}{more})")
    if problems:
        raise UserError(f"model.pretrained: {source} does not fit backbone {backbone.name}: {'; '.join(problems)}")
    return state


def imagenet_file(name: str) -> Path:
    """The cached ImageNet weights file of backbone ``name``, downloaded on first use."""
    weights = imagenet_weights(name)
    if weights is None:
        raise UserError(f"model.pretrained=imagenet: backbone {name} has no ImageNet weights; use none or a file path")
    url: str = weights.url
    filename = url.rsplit("/", 1)[-1]
    cache = Path(torch.hub.get_dir()) / "checkpoints" / filename
    if not cache.is_file():
        try:
            download(url, cache)
        # OSError covers URLError, timeouts and resets; HTTPException covers IncompleteRead and
        # the other broken-response errors of http.client. download() leaves no file behind.
        except (OSError, http.client.HTTPException, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise UserError(
                f"model.pretrained=imagenet: cannot download {url} ({_one_line(reason)}); "
                f"download {filename} on a machine with internet access and set model.pretrained=/path/to/{filename} "
                f"(or copy it to {cache.parent}/)"
            ) from None
    return cache


def download(url: str, dest: Path, timeout: float | None = None) -> None:
    """Stream ``url`` to ``dest`` atomically with a tqdm bar on stderr; check torch hub's hash prefix.

    ``ValueError`` when the content's SHA-256 does not start with the hash in the file name;
    ``ConnectionError`` when the body ends before its ``Content-Length`` (http.client reads a
    short body silently; a broken chunked body raises its ``IncompleteRead``). On any error
    nothing is left at ``dest`` or beside it.
    """

    expected = _hash_prefix(dest.name)
    request = urllib.request.Request(url, headers={"User-Agent": "dmltrain"})
    with urllib.request.urlopen(request, timeout=timeout or DOWNLOAD_TIMEOUT_S) as response, atomic_path(dest) as tmp:
        total = int(response.headers.get("Content-Length") or 0) or None
        digest = hashlib.sha256()
        received = 0
        with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, file=sys.stderr) as bar:
            while chunk := response.read(1 << 20):
                f.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                bar.update(len(chunk))
        if total is not None and received < total:
            raise ConnectionError(f"incomplete download: the connection closed after {received} of {total} bytes")
        if expected and not digest.hexdigest().startswith(expected):
            raise ValueError(f"downloaded file's SHA-256 {digest.hexdigest()[:12]}... does not match {expected}")


def _hash_prefix(filename: str) -> str | None:
    match = HASH_REGEX.search(filename)
    return match.group(1) if match else None


def _best_prefix(state: dict[str, Tensor], own: dict[str, Tensor]) -> str:
    """The key prefix under which ``state`` best covers the backbone's keys ('' if none does better)."""
    best, best_hits = "", sum(k in own for k in state)
    for prefix in ("module.", "backbone.", "module.backbone."):
        hits = sum(k[len(prefix) :] in own for k in state if k.startswith(prefix))
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def _shape(t: Tensor) -> str:
    return "×".join(map(str, t.shape)) or "scalar"


def _one_line(e: object) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."
