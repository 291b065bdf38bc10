"""Checks of the arrays handed to the evaluation: embeddings and labels, one-line ``ValueError`` each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

ArrayLike = np.ndarray | Tensor | Sequence[Any]


def as_embeddings(x: ArrayLike, name: str) -> np.ndarray:
    """A C-contiguous float32 ``N × D`` array; one-line ``ValueError`` for anything else."""
    if isinstance(x, Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    try:
        arr = np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: embeddings must be numeric, got {type(x).__name__}") from None
    if arr.ndim != 2:
        raise ValueError(f"{name}: embeddings must be a 2-D N × D array, got shape {tuple(arr.shape)}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name}: embeddings are empty (shape {tuple(arr.shape)})")
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise ValueError(f"{name}: {len(bad)} embedding rows contain NaN or inf (first at row {bad[0]})")
    return np.ascontiguousarray(arr)


def as_labels(y: ArrayLike, n: int, name: str) -> np.ndarray:
    """A 1-D label array of length ``n`` (an ``N × 1`` column is flattened); one-line ``ValueError`` otherwise."""
    if isinstance(y, Tensor):
        y = y.detach().cpu().numpy()
    arr = np.asarray(y)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name}: labels must be 1-D, got shape {tuple(arr.shape)}")
    if len(arr) != n:
        raise ValueError(f"{name}: {len(arr)} labels for {n} embeddings")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"{name}: labels contain NaN or inf")
    return arr
