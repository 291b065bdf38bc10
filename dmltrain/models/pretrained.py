"""Pretrained backbone weights: ``model.pretrained`` is ``none``, ``imagenet``, ``timm``, ``hf-hub:REPO`` or a file.

* A file is a state dict of that backbone: safetensors (``*.safetensors``) or a ``torch.save`` file read
  weights-only (also accepted: one wrapped under ``state_dict``/``model``, keys prefixed by
  ``module.``, or a dmltrain model file, whose ``backbone.*`` keys are used). For a torchvision
  backbone, torchvision's keys; for a timm model, timm's (a ``state_dict()`` timm saved, a Hugging Face
  ``model.safetensors``, or an original DINOv2 / OpenAI CLIP / ConvNeXt file: timm's checkpoint filter
  for the architecture converts it and resamples position embeddings to ``model.image_size``). The
  classifier keys (``fc.*``, ``aux1.*``, timm's ``head.*``, ...) are ignored; every other key must match
  the backbone exactly, or a one-line error names the file and the first mismatches.
* ``imagenet`` is torchvision's weights enum for the backbone. The file is read from the
  torch hub cache (``$TORCH_HOME/hub/checkpoints``) or downloaded there with a timeout and
  its hash checked; without network the error says to fetch the file elsewhere and pass its
  path. For a timm model ``imagenet`` means ``timm``.
* ``timm`` is the timm model's pretrained weights (the tag in ``model.backbone``, or timm's default
  tag), ``hf-hub:ORG/NAME`` any Hugging Face repository's ``model.safetensors`` (or
  ``pytorch_model.bin``): read from the local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
  ``~/.cache/huggingface/hub``, in its layout ``models--ORG--NAME/snapshots/<revision>/...``) or, for
  timm's older weights, the torch hub cache. Nothing is downloaded unless ``model.pretrained_download``
  allows it; without it a missing file is a one-line error saying where it was looked for.

:func:`check_pretrained` is the driver's check before any worker starts: the same reading and
fitting, on a backbone built on the meta device (shapes only, no memory).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.hub import HASH_REGEX
from tqdm import tqdm

from dmltrain.backbone_facts import timm_facts
from dmltrain.config import HF_PREFIX
from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path
from dmltrain.models.backbone_base import Backbone
from dmltrain.models.backbones import CLASSIFIER_PREFIXES, build_backbone, imagenet_weights

DOWNLOAD_TIMEOUT_S = 30.0  # per blocking socket operation, not for the whole file
HF_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a Hugging Face repository, in order


def load_pretrained(backbone: Backbone, spec: str, *, allow_download: bool = False) -> None:
    """Fill ``backbone`` with the weights named by ``spec`` (``none`` leaves it as initialised);
    ``allow_download``: fetch timm / Hugging Face weights missing from the local cache."""
    if spec in ("", "none"):
        return
    path = weights_file(backbone.name, spec, allow_download=allow_download, timm=hasattr(backbone, "net"))
    apply_state_dict(backbone, read_state_dict(path), str(path))


def check_pretrained(backbone_name: str, spec: str, model_cfg: Any = None) -> None:
    """A one-line :class:`UserError` unless ``model.pretrained`` = ``spec`` would load into backbone
    ``backbone_name`` (built as ``model_cfg``, a ``ModelConfig``, says, when given): a readable state dict file
    that fits it, ``imagenet`` for a torchvision backbone that has ImageNet weights (whether they can be
    downloaded is the workers' to find), or timm / Hugging Face weights in the local cache (or allowed to be
    downloaded: then the workers fetch them)."""
    if spec in ("", "none"):
        return
    kwargs = {}
    if model_cfg is not None:
        kwargs = {"image_size": model_cfg.image_size, "drop_path": model_cfg.drop_path, "features": model_cfg.features}
    with torch.device("meta"):
        backbone = build_backbone(backbone_name, pretrained=True, **kwargs)
    timm = hasattr(backbone, "net")
    if spec == "imagenet" and not timm:
        if imagenet_weights(backbone_name) is None:
            raise UserError(
                f"model.pretrained=imagenet: backbone {backbone_name} has no ImageNet weights; use none or a file path"
            )
        return
    allow = bool(getattr(model_cfg, "pretrained_download", False))
    path = weights_file(backbone_name, spec, allow_download=False, timm=timm, missing_ok=allow)
    if path is not None:
        fitted_state_dict(backbone, read_state_dict(path), str(path))


def weights_file(
    backbone_name: str, spec: str, *, allow_download: bool, timm: bool, missing_ok: bool = False
) -> Path | None:
    """The local file ``model.pretrained`` = ``spec`` names for backbone ``backbone_name`` (``timm``: a timm model),
    downloading it only where ``allow_download`` says so; ``missing_ok``: None rather than an error for cached
    weights that are not there (the workers will download them)."""
    if spec == "imagenet" and not timm:
        return imagenet_file(backbone_name)
    if spec in ("imagenet", "timm") or spec.startswith(HF_PREFIX):
        if spec == "timm" and not timm:
            raise UserError(
                f"model.pretrained={spec}: {backbone_name} is a torchvision backbone; use imagenet or a file path"
            )
        return _cached_weights(backbone_name, spec, allow_download, missing_ok)
    return Path(spec).expanduser()


def _hf_cache_dir() -> str | None:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _cached_weights(backbone_name: str, spec: str, allow_download: bool, missing_ok: bool) -> Path | None:
    """timm's pretrained weights of ``backbone_name``, or the ``hf-hub:`` repository ``spec`` names, from the
    local caches; downloaded only when ``allow_download``."""
    import huggingface_hub

    if spec.startswith(HF_PREFIX):
        repo, url = spec[len(HF_PREFIX) :], None
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise UserError(f"model.pretrained={spec}: expected hf-hub:ORG/NAME")
    else:
        facts = timm_facts(backbone_name)
        repo, url = facts.hf_hub_id, facts.url
        if repo is None and url is None:
            raise UserError(f"model.pretrained={spec}: timm has no pretrained weights for {backbone_name}")
    cache = _hf_cache_dir()
    looked = []
    if repo is not None:
        for filename in HF_FILES:
            found = huggingface_hub.try_to_load_from_cache(repo, filename, cache_dir=cache)
            if isinstance(found, str):
                return Path(found)
        looked.append(f"{repo} in the Hugging Face cache ({cache or huggingface_hub.constants.HF_HUB_CACHE})")
    if url is not None and url.endswith((".pth", ".pt", ".bin", ".safetensors")):  # not big_vision's .npz
        hub_file = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
        if hub_file.is_file():
            return hub_file
        looked.append(str(hub_file))
    if allow_download and repo is not None:
        try:
            return Path(huggingface_hub.hf_hub_download(repo, HF_FILES[0], cache_dir=cache))
        except Exception as e:  # noqa: BLE001 — offline, missing repo, HTTP errors: all one line
            raise UserError(f"model.pretrained={spec}: cannot download {repo}/{HF_FILES[0]} ({_one_line(e)})") from None
    if missing_ok:
        return None
    raise UserError(
        f"model.pretrained={spec}: no weights of {backbone_name} found locally (looked for "
        f"{' and '.join(looked)}); put them there, pass a file path, or allow a download with "
        f"model.pretrained_download=true"
    )


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """A ``name -> tensor`` mapping from a safetensors file or a ``torch.save`` file (read with ``weights_only=True``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"model.pretrained: file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            obj: Any = load_file(path, device="cpu")
        except Exception as e:  # noqa: BLE001 — a bad header or truncated data: reported the same way
            raise UserError(f"model.pretrained: cannot read {path} as safetensors ({_one_line(e)})") from None
        if not obj:
            raise UserError(f"model.pretrained: {path} holds no tensors")
        return obj
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 — torch raises many types for a bad file: report them all the same way
        raise UserError(f"model.pretrained: cannot read {path} as a PyTorch state dict ({_one_line(e)})") from None
    for key in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise UserError(f"model.pretrained: {path} holds no state dict (a mapping of parameter names to tensors)")
    return obj


def _target(backbone: Backbone) -> nn.Module:
    """The module a weights file fills: a timm backbone's timm model (timm's keys), else the backbone itself."""
    return getattr(backbone, "net", backbone)


def apply_state_dict(backbone: Backbone, state: dict[str, Tensor], source: str) -> None:
    """Strictly load ``state`` into ``backbone``; a one-line :class:`UserError` names ``source`` on mismatch."""
    state = fitted_state_dict(backbone, state, source)
    try:
        _target(backbone).load_state_dict(state, strict=True)
    except RuntimeError as e:  # pragma: no cover - fitted_state_dict catches what load_state_dict would
        raise UserError(f"model.pretrained: {source} does not fit backbone {backbone.name}: {_one_line(e)}") from None


def _timm_filtered(net: nn.Module, state: dict[str, Tensor], source: str, backbone: str) -> dict[str, Tensor]:
    """``state`` through timm's checkpoint filter for ``net`` (layouts converted, position embeddings resampled),
    without the classifier named by ``net``'s pretrained config."""
    from dmltrain.models.timm_backbones import checkpoint_filter

    prefix = _best_prefix(state, net.state_dict(), ("net.", "backbone.net.", "module.net."))
    if prefix:  # a dmltrain model file or checkpoint: its backbone's timm model
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    filter_fn = checkpoint_filter(net)
    if filter_fn is not None:
        try:
            state = filter_fn(state, net)
        except Exception as e:  # noqa: BLE001 — a file of another architecture fails anywhere in the filter
            raise UserError(
                f"model.pretrained: {source} does not fit backbone {backbone}: timm's checkpoint filter failed "
                f"({_one_line(e)})"
            ) from None
    classifier = net.pretrained_cfg.get("classifier") or ()
    heads = tuple(f"{c}." for c in ((classifier,) if isinstance(classifier, str) else classifier))
    own = net.state_dict()
    return {k: v for k, v in state.items() if k in own or not k.startswith(heads)}


def fitted_state_dict(backbone: Backbone, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """``state`` reduced to the backbone's keys (a wrapped model's prefix and the ImageNet classifier dropped;
    a timm model's file through timm's checkpoint filter); a one-line :class:`UserError` naming ``source`` when
    keys are missing or unexpected or shapes differ."""
    target = _target(backbone)
    own = target.state_dict()
    if target is not backbone:
        state = _timm_filtered(target, state, source, backbone.name)
    else:
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


def _best_prefix(
    state: dict[str, Tensor],
    own: dict[str, Tensor],
    prefixes: tuple[str, ...] = ("module.", "backbone.", "module.backbone."),
) -> str:
    """The key prefix under which ``state`` best covers the backbone's keys ('' if none does better)."""
    best, best_hits = "", sum(k in own for k in state)
    for prefix in prefixes:
        hits = sum(k[len(prefix) :] in own for k in state if k.startswith(prefix))
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def _shape(t: Tensor) -> str:
    return "×".join(map(str, t.shape)) or "scalar"


def _one_line(e: object) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 200 else text[:197] + "..."
