"""Exporting an embedding model for serving (ONNX, TorchScript, ``torch.export``), checking it, loading it back.

:func:`export_model` writes one file with its :mod:`contract <dmltrain.models.contract>` beside it:

* ``onnx``: ``torch.onnx.export`` (the ``torch.export``-based exporter, torch's default), input ``images``
  and output ``embedding`` with a dynamic batch axis, at ``opset`` (default: the exporter's); weights
  inside the file up to 1.5 GiB, beside it (``<file>.data``) beyond;
* ``pt2``: a ``torch.export`` program with a dynamic batch (``torch.export.load(path).module()``), loaded
  only in the form this export writes (:func:`~dmltrain.models.pt2_archive.check_pt2`: torch's loader runs
  a file's pickles, expressions and guard code otherwise);
* ``torchscript``: ``torch.jit.trace`` (deprecated by torch, kept for stacks that still load it); a program,
  loaded again only when the caller trusts it (``--trust-torchscript``).

``fp16`` exports half-precision weights; inputs and outputs stay float32. Every export is checked before
it is put in place: the file is loaded back (ONNX through onnxruntime) and run on random batches of 1 and
7, and the largest absolute difference to the float32 PyTorch model is printed and must be within
``tolerance`` (default 1e-4, 1e-2 for fp16); beyond it nothing is written and a :class:`UserError` says by
how much. Generic over :class:`~dmltrain.models.embedding_model.EmbeddingModel`: any backbone that
``torch.export`` can trace exports the same way.

:func:`load_exported` returns a module for any of the three formats, so an exported file embeds through
the same code as a ``model.pt`` (``dmltrain embed``, ``dmltrain index query``). A model file is data: the loader
follows the file's extension (``.onnx``: onnxruntime; ``.pt2``: ``torch.export.load``, after
:func:`~dmltrain.models.pt2_archive.check_pt2`; ``.pt``: TorchScript), a contract that names another format is
refused, and a TorchScript file (a program ``torch.jit.load`` runs) only loads with ``trust_torchscript``
(``--trust-torchscript``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from dmltrain.errors import UserError
from dmltrain.models.contract import Contract, contract_path, image_side, load_contract
from dmltrain.models.pt2_archive import check_pt2
from dmltrain.text import printable

FORMATS = {"onnx": ".onnx", "pt2": ".pt2", "torchscript": ".torchscript.pt"}
EXTENSIONS = {".onnx": "onnx", ".pt2": "pt2", ".pt": "torchscript"}  # what loads a file: its name, never its contract
TRUST_TORCHSCRIPT = (
    "TorchScript programs can run arbitrary code (read and write files, start processes); "
    "pass --trust-torchscript to load one you trust"
)
CHECK_BATCHES = (1, 7)
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}
EXTERNAL_DATA_BYTES = 3 << 29  # 1.5 GiB: ONNX's protobuf stops at 2 GiB


class _Serving(nn.Module):
    """The model as served: float32 images in, float32 embeddings out, whatever the weights' precision."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images).float()


@dataclass
class ExportResult:
    path: Path
    contract: Contract
    files: list[Path]  # the model file (and its external data), then the contract
    max_abs_diff: float


def model_contract(
    model: nn.Module, config: dict[str, Any], *, fmt: str, precision: str, file: str, source: dict[str, Any]
) -> Contract:
    """The contract of ``model`` as trained with run ``config`` (its ``data`` and ``eval`` sections; defaults
    when absent), before the file's checksum and check are known."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    ev = config.get("eval") if isinstance(config.get("eval"), dict) else {}
    where = source.get("model_file") or file
    try:  # bounded before the model runs on a batch of that size
        crop = image_side(data.get("eval_crop", 224), "data.eval_crop")
        resize = image_side(data.get("eval_resize", 256), "data.eval_resize")
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    head = getattr(model, "head", None)
    device = next(model.parameters()).device
    with torch.no_grad():
        dim = int(model.eval()(torch.zeros(2, 3, crop, crop, device=device)).shape[1])
    from dmltrain.models.export import input_spec

    # what the model expects of its images: as loaded (model.input_spec), else from the run's config and backbone
    spec = getattr(model, "input_spec", None) or input_spec(config, config.get("model") or {})
    try:
        return Contract(
            file=file,
            format=fmt,
            precision=precision,
            sha256="",
            crop=crop,
            resize=resize,
            grayscale=int((data.get("augment") or {}).get("grayscale", 0)),
            mean=tuple(float(v) for v in spec["mean"]),
            std=tuple(float(v) for v in spec["std"]),
            interpolation=str(spec["interpolation"]),
            embedding_dim=dim,
            normalized=bool(getattr(model, "normalized", False)),
            binarizable=bool(getattr(head, "centred", False)),
            binary=bool(ev.get("binary", False)) and bool(getattr(head, "centred", False)),
            source=source,
        )
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: {e}") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch's exporters warn at length about what they handle themselves (deprecations, fallbacks)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _batch_dim() -> Any:
    return torch.export.Dim("batch", min=1, max=1 << 20)


def _write(module: nn.Module, fmt: str, path: Path, crop: int, opset: int | None) -> int | None:
    """Write ``module`` in ``fmt`` to ``path``; the ONNX opset written, or None."""
    example = (torch.randn(2, 3, crop, crop),)
    try:
        with _quiet(), torch.no_grad():
            if fmt == "onnx":
                program = torch.onnx.export(
                    module,
                    example,
                    None,
                    input_names=["images"],
                    output_names=["embedding"],
                    dynamic_shapes=({0: _batch_dim()},),
                    opset_version=opset,
                    verbose=False,
                )
                big = sum(p.numel() * p.element_size() for p in module.parameters()) > EXTERNAL_DATA_BYTES
                program.save(str(path), external_data=big)
                return next(
                    (int(o.version) for o in program.model_proto.opset_import if o.domain in ("", "ai.onnx")), None
                )
            if fmt == "pt2":
                torch.export.save(torch.export.export(module, example, dynamic_shapes=({0: _batch_dim()},)), str(path))
            else:
                torch.jit.save(torch.jit.trace(module, example), str(path))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — the exporters raise many types; one line says which step failed
        raise UserError(
            f"--format {fmt}: the model could not be exported ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
        ) from None
    return None


def export_model(
    model: nn.Module,
    config: dict[str, Any],
    fmt: str,
    out: str | os.PathLike[str],
    *,
    opset: int | None = None,
    fp16: bool = False,
    tolerance: float | None = None,
    source: dict[str, Any] | None = None,
    seed: int = 0,
) -> ExportResult:
    """Export ``model`` (an :class:`EmbeddingModel`, any device) to ``out`` in ``fmt`` with its contract beside
    it, checked against the float32 PyTorch model (module doc). ``out``'s folder receives the file only when
    the check passes (written to a temporary folder beside it, then moved in)."""
    if fmt not in FORMATS:
        raise UserError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if opset is not None and fmt != "onnx":
        raise UserError("--opset: only for --format onnx")
    if fmt == "onnx":
        missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"--format onnx: needs {', '.join(missing)} (pip install 'dmltrain[export]')")
    precision = "fp16" if fp16 else "fp32"
    tolerance = TOLERANCE[precision] if tolerance is None else float(tolerance)
    out = Path(out)
    if format_of(out) != fmt:  # the file's name is what loads it again (load_exported)
        ext = next(e for e, f in EXTENSIONS.items() if f == fmt)
        raise UserError(f"--out: {out.name} does not end in {ext}, the extension a {fmt} file is loaded by")
    reference = copy.deepcopy(getattr(model, "module", model)).float().cpu().eval()
    served = _Serving(copy.deepcopy(reference).half() if fp16 else reference).eval()
    contract = model_contract(reference, config, fmt=fmt, precision=precision, file=out.name, source=source or {})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        staged = tmp / out.name
        written_opset = _write(served, fmt, staged, contract.crop, opset)
        runner, _ = load_exported(staged, contract=contract, trust_torchscript=True)  # ours, just written
        diff = _max_abs_diff(reference, runner, contract.crop, seed)
        runtime = _runtime_name(fmt)
        check = {"batches": list(CHECK_BATCHES), "max_abs_diff": diff, "tolerance": tolerance, "runtime": runtime}
        if not diff <= tolerance:
            raise UserError(
                f"{out}: the {fmt} export differs from the PyTorch model by {diff:.3g} (largest absolute difference "
                f"of the embeddings on random batches of {' and '.join(map(str, CHECK_BATCHES))}, through {runtime}), "
                f"above the tolerance {tolerance:g}; nothing was written (--tolerance to accept it)",
                exit_code=1,
            )
        contract = contract.replace(opset=written_opset, sha256=_sha256(staged), check=check)
        contract.save(contract_path(staged))
        files = []
        for f in sorted(tmp.iterdir(), key=lambda p: p.suffix == ".json"):  # the contract last
            target = out.parent / f.name
            os.replace(f, target)
            files.append(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, contract, files, diff)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _runtime_name(fmt: str) -> str:
    if fmt == "onnx":
        import onnxruntime

        return f"onnxruntime {onnxruntime.__version__} CPUExecutionProvider"
    return f"torch {torch.__version__.split('+')[0]} ({'torch.export.load' if fmt == 'pt2' else 'torch.jit.load'})"


def _max_abs_diff(reference: nn.Module, runner: nn.Module, crop: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for n in CHECK_BATCHES:
            x = torch.randn(n, 3, crop, crop, generator=gen)
            want, got = reference(x).float(), runner(x).float()
            if got.shape != want.shape:
                return float("inf")
            worst = max(worst, float((got - want).abs().max()))
    return worst


class OnnxModule(nn.Module):
    """An ONNX embedding model run by onnxruntime, as a module: ``forward(images) -> embeddings`` (float32 tensors
    on the CPU; CUDA through onnxruntime's CUDA provider when it is installed and ``device`` asks for it)."""

    def __init__(self, path: str | os.PathLike[str], contract: Contract, device: str = "cpu"):
        super().__init__()
        try:
            import onnxruntime
        except ImportError:
            raise UserError(f"{path}: running ONNX models needs onnxruntime (pip install 'dmltrain[export]')") from None
        providers = ["CPUExecutionProvider"]
        if str(device).startswith("cuda") and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # errors only
        try:
            self.session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # noqa: BLE001 — onnxruntime's own exception types, one line either way
            raise UserError(f"{path}: onnxruntime cannot load it ({' '.join(str(e).split())[:200]})") from None
        self.input_name, self.output_name = contract.input_name, contract.output_name

    def forward(self, images: Tensor) -> Tensor:
        x = np.ascontiguousarray(images.detach().to("cpu", torch.float32).numpy())
        return torch.from_numpy(self.session.run([self.output_name], {self.input_name: x})[0])


def format_of(path: str | os.PathLike[str]) -> str | None:
    """The format a file's name says (:data:`EXTENSIONS`), None for any other name."""
    return EXTENSIONS.get(Path(path).suffix)


def load_exported(
    path: str | os.PathLike[str],
    device: str = "cpu",
    contract: Contract | None = None,
    *,
    trust_torchscript: bool = False,
) -> tuple[nn.Module, Contract]:
    """``(module, contract)`` of an exported file, loaded as its extension says (:func:`format_of`); its contract
    (read from beside it unless given) must name the same format. A ``.pt2`` file is checked first
    (:func:`~dmltrain.models.pt2_archive.check_pt2`); a TorchScript file loads only with ``trust_torchscript``.
    One-line :class:`UserError` otherwise, before anything is loaded. The module runs on ``device`` (ONNX: see
    :class:`OnnxModule`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: model file not found")
    fmt = format_of(path)
    if fmt is None:
        names = ", ".join(f"{ext} ({f})" for ext, f in EXTENSIONS.items())
        raise UserError(f"{path}: not an exported model's name (the extension says how it loads: {names})")
    contract = contract or load_contract(path)
    if contract.format != fmt:
        raise UserError(
            f"{contract_path(path)}: says format {printable(contract.format, 40)!r}, but {path.name} is a {fmt} file "
            "by its name; refused (a file loads as its extension says)"
        )
    if fmt == "onnx":
        return OnnxModule(path, contract, device), contract
    if fmt == "torchscript" and not trust_torchscript:
        raise UserError(f"{path}: a TorchScript file, not loaded: {TRUST_TORCHSCRIPT}")
    if fmt == "pt2":
        check_pt2(path)
    try:
        with _quiet():
            module = (
                torch.export.load(str(path)).module()
                if fmt == "pt2"
                else torch.jit.load(str(path), map_location=device)
            )
    except Exception as e:  # noqa: BLE001 — a truncated or foreign file: one line
        raise UserError(f"{path}: cannot load the {fmt} file ({' '.join(str(e).split())[:200]})") from None
    return _Inference(module.to(device)), contract


class _Inference(nn.Module):
    """A loaded program as a module whose ``train``/``eval`` only set the flag: an exported program is traced in
    eval mode once and for all (``torch.export``'s modules refuse ``train()``)."""

    def __init__(self, program: nn.Module):
        super().__init__()
        self.program = program

    def train(self, mode: bool = True) -> _Inference:
        self.training = mode
        return self

    def forward(self, images: Tensor) -> Tensor:
        return self.program(images)


def load_embedder(
    path: str | os.PathLike[str], device: str = "cpu", *, trust_torchscript: bool = False
) -> tuple[nn.Module, Contract, list[Path]]:
    """What embeds images for ``dmltrain embed`` and ``index query``: ``(module, contract, files)`` of a
    ``model.pt`` (or a folder holding one; its contract derived from the run config it stores) or of an exported
    file (:func:`load_exported`, ``trust_torchscript`` passed on); ``files`` are what the module was read from (for
    checksums)."""
    from dmltrain.models.export import load_model

    path = Path(path)
    if path.is_dir() and (path / "model.pt").is_file():
        path = path / "model.pt"
    exported = path.name.endswith(tuple(FORMATS.values())) or contract_path(path).is_file()
    if exported:
        module, contract = load_exported(path, device, trust_torchscript=trust_torchscript)
        return module, contract, [path, contract_path(path)]
    model, config, extra = load_model(path, map_location=device)
    source = {"model_file": str(path), **{k: extra[k] for k in ("step",) if k in extra}}
    return model, model_contract(model, config, fmt="model.pt", precision="fp32", file=path.name, source=source), [path]


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file, read in 1 MiB pieces."""
    return _sha256(Path(path))
