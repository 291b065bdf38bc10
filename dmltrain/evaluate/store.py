"""Saved embeddings: one folder, ``<split>.npy`` (float32 N × D) and ``<split>_labels.npy`` (int64 N).

Written by ``dmltrain eval --save-embeddings DIR`` (rows in sample-index order) and read back
by ``--embeddings DIR`` or by anyone with NumPy. Each file is written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path


def _paths(directory: str | os.PathLike[str], split: str) -> tuple[Path, Path]:
    d = Path(directory)
    return d / f"{split}.npy", d / f"{split}_labels.npy"


def save_embeddings(directory: str | os.PathLike[str], split: str, emb: np.ndarray, labels: np.ndarray) -> Path:
    """Write ``split``'s embeddings and labels into ``directory`` (created if needed); returns the embeddings path."""
    emb = np.asarray(emb, dtype=np.float32)
    labels = np.asarray(labels).astype(np.int64, copy=False)
    if emb.ndim != 2 or labels.shape != (len(emb),):
        raise ValueError(f"save_embeddings: {emb.shape} embeddings do not match {labels.shape} labels")
    emb_path, lab_path = _paths(directory, split)
    for path, arr in ((emb_path, emb), (lab_path, labels)):
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, arr, allow_pickle=False)
    return emb_path


def saved_splits(directory: str | os.PathLike[str]) -> list[str]:
    """Splits with both files present in ``directory``, sorted."""
    d = Path(directory)
    return sorted(
        p.stem for p in d.glob("*.npy") if not p.stem.endswith("_labels") and (d / f"{p.stem}_labels.npy").is_file()
    )


def load_embeddings(directory: str | os.PathLike[str], split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings float32, labels int64)`` of ``split``; one-line :class:`UserError` naming the file when unusable."""
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{d}: embeddings folder not found")
    emb_path, lab_path = _paths(d, split)
    arrays = []
    for path in (emb_path, lab_path):
        if not path.is_file():
            have = ", ".join(saved_splits(d)) or "none"
            raise UserError(f"{path}: not found (saved splits in {d}: {have})")
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable .npy file ({' '.join(str(e).split())[:120]})") from None
    emb, labels = arrays
    if emb.ndim != 2 or emb.dtype.kind != "f":
        raise UserError(f"{emb_path}: expected a 2-D float array, got {emb.dtype} of shape {emb.shape}")
    if labels.ndim != 1 or len(labels) != len(emb):
        raise UserError(f"{lab_path}: {labels.shape} labels for {len(emb)} embeddings in {emb_path.name}")
    return emb.astype(np.float32, copy=False), labels
