"""The serving contract: what an exported embedding model expects and returns, written beside it as JSON.

A serving stack that runs the exported file (``model.onnx``, ``model.pt2``, ``model.torchscript.pt``) reads
``<file>.json`` to prepare images as training's evaluation did and to compare what comes out:

* input: ``images``, float32, ``N × 3 × crop × crop`` (NCHW, RGB; any N): decode as RGB, resize the shorter
  side to ``resize`` (``interpolation``: bilinear or bicubic, antialiased as Pillow's), centre-crop
  ``crop × crop``, then per channel ``(pixel / 255 - mean) / std`` (the backbone's own ``mean`` and ``std``:
  ImageNet's for the torchvision networks, timm's pretrained config for a timm model); with ``grayscale``
  1 or 3 the luminance (ITU-R 601-2) is repeated on the three channels first
  (:class:`shards.decode.transforms.EvalTransform` and ``normalize_batch`` do exactly this);
* output: ``embedding``, float32, ``N × dim``; ``normalized`` says whether rows come L2-normalized
  (compare by dot product, which is then the cosine; otherwise normalize first);
* binary: ``binarizable`` when the sign bits carry information (a centred head), ``binary`` when the run
  evaluated them; codes are the bits ``x > 0`` packed eight to a byte, most significant first (``numpy.packbits``),
  compared by Hamming distance;
* the file's format, precision (the weights; inputs and outputs are float32 either way), opset, SHA-256, what
  it was exported from, and the export's check against PyTorch (largest absolute difference, tolerance).

:meth:`Contract.to_json` and :meth:`Contract.from_json` round-trip; :func:`load_contract` names the file and
the key in every error.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import read_json, write_json
from shards.config import MAX_IMAGE_SIDE
from shards.decode.transforms import RESAMPLE, PixelNorm

FORMAT = "dmltrain.serving-contract"
VERSION = 1
BINARY_CODES = (
    "sign bits (x > 0) packed 8 per byte, most significant bit first (numpy.packbits), compared by Hamming distance"
)
MIN_IMAGE_SIDE = 8
MAX_EMBEDDING_DIM = 1 << 16


def image_side(value: Any, key: str) -> int:
    """``value`` as an image side (a crop or resize) in ``[8, MAX_IMAGE_SIDE]``: a contract or a model file is
    anyone's, and the side decides the memory of every batch. ``ValueError`` naming ``key`` otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise ValueError(f"{key}: {str(value)[:40]!r} is not a whole number of pixels")
    if not MIN_IMAGE_SIDE <= value <= MAX_IMAGE_SIDE:
        raise ValueError(f"{key}: {int(value)} is outside [{MIN_IMAGE_SIDE}, {MAX_IMAGE_SIDE}] pixels")
    return int(value)


def check_input(
    crop: Any, resize: Any, grayscale: Any, mean: Any, std: Any, interpolation: Any, prefix: str = "input."
) -> None:
    """What images an embedding model expects, bounded: sides (:func:`image_side`), crop at most resize, grayscale
    0, 1 or 3, three finite means and positive stds, a known interpolation. ``ValueError`` naming the key."""
    crop, resize = image_side(crop, f"{prefix}crop"), image_side(resize, f"{prefix}resize")
    if crop > resize:
        raise ValueError(f"{prefix}crop: {crop} is larger than {prefix}resize {resize}")
    if grayscale not in (0, 1, 3) or isinstance(grayscale, bool):
        raise ValueError(f"{prefix}grayscale: {str(grayscale)[:40]!r} is not 0, 1 or 3")
    for key, values in (("mean", mean), ("std", std)):
        ok = isinstance(values, (list, tuple)) and len(values) == 3
        if not ok or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError(f"{prefix}{key}: expected three finite numbers, got {str(values)[:60]}")
    if not all(v > 0 for v in std):
        raise ValueError(f"{prefix}std: {list(std)} has a value that is not positive")
    if interpolation not in RESAMPLE:
        raise ValueError(f"{prefix}interpolation: {str(interpolation)[:40]!r} is not one of {', '.join(RESAMPLE)}")


def contract_path(model_file: str | os.PathLike[str]) -> Path:
    """Where the contract of an exported file lives: ``model.onnx`` -> ``model.onnx.json``."""
    p = Path(model_file)
    return p.with_name(p.name + ".json")


@dataclass(frozen=True)
class Contract:
    """One exported model's contract (see the module doc); the fields are flat, the JSON is grouped."""

    file: str  # the exported file's name, in the contract's folder
    format: str  # onnx, torchscript or pt2
    precision: str  # fp32 or fp16 weights
    sha256: str
    crop: int
    resize: int
    embedding_dim: int
    normalized: bool
    binarizable: bool
    binary: bool = False
    grayscale: int = 0
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    interpolation: str = "bilinear"
    opset: int | None = None
    input_name: str = "images"
    output_name: str = "embedding"
    source: dict[str, Any] = field(default_factory=dict)  # model file, run, step, metrics, model config
    check: dict[str, Any] = field(default_factory=dict)  # batches, max_abs_diff, tolerance, runtime

    def __post_init__(self) -> None:
        """Bounded values only (:func:`check_input`, the embedding dim): ``ValueError`` naming the key."""
        check_input(self.crop, self.resize, self.grayscale, self.mean, self.std, self.interpolation)
        if not 1 <= self.embedding_dim <= MAX_EMBEDDING_DIM:
            raise ValueError(f"output.dim: {self.embedding_dim} is outside [1, {MAX_EMBEDDING_DIM}]")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {
                "file": self.file,
                "format": self.format,
                "precision": self.precision,
                "opset": self.opset,
                "sha256": self.sha256,
            },
            "input": {
                "name": self.input_name,
                "dtype": "float32",
                "layout": "NCHW",
                "shape": ["batch", 3, self.crop, self.crop],
                "channel_order": "RGB",
                "resize": self.resize,
                "crop": self.crop,
                "interpolation": f"{self.interpolation}, antialiased",
                "grayscale": self.grayscale,
                "scale": 1 / 255,
                "mean": list(self.mean),
                "std": list(self.std),
                "recipe": f"decode as RGB{'' if not self.grayscale else ', convert to luminance and repeat it on 3 channels'}; "
                f"resize the shorter side to {self.resize} ({self.interpolation}); centre-crop {self.crop}×{self.crop}; "
                "x = (pixel / 255 - mean) / std per channel",
            },
            "output": {
                "name": self.output_name,
                "dtype": "float32",
                "shape": ["batch", self.embedding_dim],
                "dim": self.embedding_dim,
                "normalized": self.normalized,
                "similarity": "cosine: the dot product of L2-normalized rows"
                + ("" if self.normalized else " (the rows are not normalized)"),
            },
            "binary": {"binarizable": self.binarizable, "used": self.binary, "codes": BINARY_CODES},
            "source": self.source,
            "check": self.check,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "contract") -> Contract:
        """The contract of :meth:`to_json`'s dict; one-line :class:`UserError` naming ``where`` and the key."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(f"{where}: not a {FORMAT} file")
        version = data.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int):
            raise UserError(f"{where}: version: {str(version)[:40]!r} is not a whole number")
        if version > VERSION:
            raise UserError(f"{where}: contract version {version} is newer than this dmltrain reads")
        try:
            m, i, o, b = data["model"], data["input"], data["output"], data["binary"]
            return cls(
                file=str(m["file"]),
                format=str(m["format"]),
                precision=str(m["precision"]),
                sha256=str(m["sha256"]),
                opset=None if m.get("opset") is None else int(m["opset"]),
                crop=int(i["crop"]),
                resize=int(i["resize"]),
                grayscale=int(i["grayscale"]),
                mean=tuple(float(v) for v in i["mean"]),  # type: ignore[arg-type]
                std=tuple(float(v) for v in i["std"]),  # type: ignore[arg-type]
                interpolation=str(i.get("interpolation", "bilinear")).split(",")[0].strip(),
                input_name=str(i["name"]),
                output_name=str(o["name"]),
                embedding_dim=int(o["dim"]),
                normalized=bool(o["normalized"]),
                binarizable=bool(b["binarizable"]),
                binary=bool(b["used"]),
                source=dict(data.get("source") or {}),
                check=dict(data.get("check") or {}),
            )
        except KeyError as e:
            raise UserError(f"{where}: missing key {e}") from None
        except (TypeError, ValueError, OverflowError) as e:  # int(Infinity): JSON's parser takes it
            raise UserError(f"{where}: malformed contract ({e})") from None

    def norm(self) -> PixelNorm:
        """The input normalization as the data pipeline applies it."""
        return PixelNorm.of(self.mean, self.std)

    def save(self, path: str | os.PathLike[str]) -> Path:
        write_json(path, self.to_json())
        return Path(path)

    def replace(self, **changes: Any) -> Contract:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Contract(**{**values, **changes})

    def summary(self) -> dict[str, Any]:
        """Flat ``key: value`` pairs (tags of a logged model)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("source", "check")}
        out["mean"], out["std"] = ",".join(map(str, self.mean)), ",".join(map(str, self.std))
        return out


def load_contract(path: str | os.PathLike[str]) -> Contract:
    """The contract at ``path`` (a ``.json`` file, or the exported file it sits beside)."""
    p = Path(path)
    if p.suffix != ".json":
        p = contract_path(p)
    if not p.is_file():
        raise UserError(f"{p}: contract not found (dmltrain export writes it beside the model file)")
    data = read_json(p, "contract")
    return Contract.from_json(data, str(p))
