"""Binarized embeddings: sign bits packed eight to a byte, compared by Hamming distance.

With the centred (LayerNorm) head, thresholding at zero keeps most of the information
(NormSoftmax paper, sec. 3.2): 2048 bits take the memory of 64 floats.
"""

from __future__ import annotations

import numpy as np
import torch


def pack_sign_bits(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """``N × D`` floats -> ``N × ceil(D/8)`` uint8, bit = (x > 0), most significant bit first.

    Zero maps to bit 0. When ``D`` is not a multiple of 8 the last byte is padded with
    zero bits, which adds nothing to any Hamming distance.
    """
    arr = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.ndim != 2:
        raise ValueError(f"pack_sign_bits: expected an N × D array, got shape {arr.shape}")
    return np.packbits(arr > 0, axis=1)


def hamming_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """All-pairs Hamming distances between packed codes (a slow reference for tests)."""
    table = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(1)
    return table[np.bitwise_xor(a[:, None, :], b[None, :, :])].sum(-1)
