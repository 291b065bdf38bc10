"""Mixed precision and memory format: autocast by ``train.precision``, channels_last tensors.

``autocast(device, "bf16")`` runs matmuls and convolutions in bfloat16 where the device
supports it (CPU always; CUDA from Ampere on) and raises a one-line :class:`UserError`
elsewhere rather than silently running in float32. ``fp16`` autocasts to float16; its loss
scaling (GradScaler or DeepSpeed's) is the caller's. ``fp32`` is a no-op context.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from dmltrain.config import TRAIN_PRECISIONS
from dmltrain.errors import UserError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device_type(device: str | torch.device) -> str:
    """``"cuda:1"`` or ``torch.device("cuda", 1)`` -> ``"cuda"``."""
    return torch.device(device).type


def supports_bf16(device: str | torch.device) -> bool:
    """Whether bfloat16 autocast runs natively on ``device``."""
    kind = device_type(device)
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.amp.is_autocast_available(kind)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name (None for fp32)."""
    if precision not in TRAIN_PRECISIONS:
        raise UserError(f"train.precision: unknown precision '{precision}' (choose from {', '.join(TRAIN_PRECISIONS)})")
    return _DTYPES.get(precision)


def autocast(device: str | torch.device, precision: str = "fp32") -> AbstractContextManager[object]:
    """A context under which the forward pass runs in ``precision`` (see the module doc)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    kind = device_type(device)
    if not torch.amp.is_autocast_available(kind):
        raise UserError(f"train.precision: {precision} autocast is not available on device '{device}'; use fp32")
    if dtype is torch.bfloat16 and not supports_bf16(device):
        raise UserError(f"train.precision: device '{device}' does not support bf16; use fp16 or fp32")
    return torch.autocast(device_type=kind, dtype=dtype)


def to_channels_last(x: Tensor) -> Tensor:
    """A 4-D image batch in channels_last layout (other tensors unchanged); free when it already is."""
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
