"""Exact ranks of (query, item) pairs in dense score blocks: the one primitive behind the metrics.

For a pair (row r, column c) of a block, its rank is 1 + the number of columns ordered before
c in row r, the order being **score (best first), then column (lower first)**:

    rank = 1 + #{n < c : s[n] better than or equal to s[c]} + #{n > c : s[n] better than s[c]}

Recall@K needs each query's best-ranked relevant item; MAP@R and R-precision need the ranks of
all of them. Counting per pair costs O(row length) and needs no top-k, so a tie straddling a
cut-off is never an issue, and the result does not depend on the engine:

* ``native``: the C kernel of :mod:`.native` (CPU, auto-vectorized, a few threads);
* ``numpy``: one compare-and-count pass over the block per pair position (CPU fallback);
* ``triton``: the Triton kernel of :mod:`.gpu_kernels` (CUDA): one pass over each row counts
  for up to 32 of its pairs at once; the default on CUDA;
* ``torch``: the ``numpy`` passes on the block's device (CUDA without Triton).

Rows with very many relevant items switch to sorting each row once (O(N log N) per row).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from dmltrain.evaluate import native
from dmltrain.evaluate.threads import parallel_ranges

# The Triton kernels (and Triton itself) are loaded only where they can run: with CUDA, or
# under Triton's interpreter (TRITON_INTERPRET=1 before the import). Elsewhere None.
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        from dmltrain.evaluate import gpu_kernels
    except ImportError:  # a torch build without Triton
        gpu_kernels = None
else:
    gpu_kernels = None

# Mean relevant items per row above which sorting the rows beats counting per pair.
SORT_ABOVE = {"native": 1024, "numpy": 48, "torch": 48, "triton": 4096}
_SORT_CHUNK_ROWS = 64


def order_keys(scores: np.ndarray, larger_is_better: bool) -> np.ndarray:
    """int64 keys, ascending in the (score, column) order: best first, ties by lower column.

    Floats go through the order-preserving map of their IEEE bits (infinities included,
    ``-0.0`` equal to ``0.0``); the column breaks ties in the low part of the key.
    """
    n_cols = scores.shape[-1]
    if scores.dtype.kind == "f":
        bits = np.ascontiguousarray(scores, dtype=np.float32).view(np.int32).astype(np.int64)
        ordinal = np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)  # monotone in the float value
    else:
        ordinal = scores.astype(np.int64)
    if larger_is_better:
        ordinal = -ordinal
    return ordinal * n_cols + np.arange(n_cols)


def row_starts(rows: np.ndarray) -> np.ndarray:
    """Start of each run of equal values in ``rows`` (pairs are grouped by row)."""
    return np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.zeros(0, np.int64)


def engine_for(block: Tensor, engine: str | None = None) -> str:
    if engine is not None:
        return engine
    if block.device.type != "cpu":
        return "triton" if gpu_kernels is not None else "torch"
    return "native" if native.library() is not None else "numpy"


def pair_ranks(
    block: Tensor, rows: np.ndarray, cols: np.ndarray, larger_is_better: bool, engine: str | None = None
) -> np.ndarray:
    """1-based rank (int64) of each ``(rows[i], cols[i])`` pair within its row of ``block``.

    ``rows`` must be grouped (non-decreasing). A masked column (a self match set to the worst
    score) is never counted before anything. ``engine``: ``native``, ``numpy``, ``triton`` or
    ``torch`` (default: ``native`` on CPU when available, else ``numpy``; ``triton`` on CUDA,
    ``torch`` there without Triton).
    """
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    cols = np.ascontiguousarray(cols, dtype=np.int64)
    if len(rows) == 0:
        return np.zeros(0, np.int64)
    if len(rows) > 1 and (np.diff(rows) < 0).any():
        raise ValueError("pair_ranks: rows must be grouped in non-decreasing order")
    engine = engine_for(block, engine)
    n_rows_used = len(row_starts(rows))
    if len(rows) > SORT_ABOVE[engine] * n_rows_used:
        return _ranks_by_sort(block, rows, cols, larger_is_better)
    if engine == "native":
        return _ranks_native(block, rows, cols, larger_is_better)
    if engine == "numpy":
        return _ranks_by_passes(block.numpy(), rows, cols, larger_is_better, np)
    if engine == "triton":
        return _ranks_triton(block, rows, cols, larger_is_better)
    if engine == "torch":
        return _ranks_by_passes(block, rows, cols, larger_is_better, torch)
    raise ValueError(f"pair_ranks: unknown engine '{engine}'")


def _ranks_native(block: Tensor, rows: np.ndarray, cols: np.ndarray, larger: bool) -> np.ndarray:
    lib = native.library()
    if lib is None or block.device.type != "cpu":
        raise RuntimeError(
            f"pair_ranks: native engine unavailable ({native.unavailable_reason() or 'block not on the CPU'})"
        )
    fns = {
        torch.float32: lib.dml_pair_ranks_f32,
        torch.int16: lib.dml_pair_ranks_i16,
        torch.int32: lib.dml_pair_ranks_i32,
    }
    if block.dtype not in fns or block.stride(1) != 1:
        raise ValueError(f"pair_ranks: native engine needs a row-major float32/int16/int32 block, got {block.dtype}")
    fn = fns[block.dtype]
    S = block.numpy()
    ranks = np.empty(len(rows), np.int64)

    def run(lo: int, hi: int) -> None:
        fn(
            S.ctypes.data,
            S.strides[0] // S.itemsize,
            S.shape[1],
            rows[lo:].ctypes.data,
            cols[lo:].ctypes.data,
            hi - lo,
            int(larger),
            ranks[lo:].ctypes.data,
        )

    # Split at row boundaries into about as many parts as threads.
    starts = row_starts(rows)
    parts = max(1, min(torch.get_num_threads(), len(starts)))
    bounds = np.r_[starts[np.linspace(0, len(starts), parts, endpoint=False).astype(np.int64)], len(rows)]
    parallel_ranges(run, bounds)
    return ranks


def _ranks_triton(block: Tensor, rows: np.ndarray, cols: np.ndarray, larger: bool) -> np.ndarray:
    if gpu_kernels is None:
        raise RuntimeError(
            "pair_ranks: the Triton engine is not loaded (no CUDA device, no TRITON_INTERPRET=1, or no Triton)"
        )
    starts = row_starts(rows)
    dev = block.device

    def put(a: np.ndarray) -> Tensor:  # int32: pair and column counts of a block stay far below 2**31
        return torch.from_numpy(a.astype(np.int32)).to(dev)

    ranks = gpu_kernels.pair_ranks(block, put(rows[starts]), put(np.r_[starts, len(rows)]), put(cols), larger)
    return ranks.cpu().numpy()


def _ranks_by_passes(S, rows: np.ndarray, cols: np.ndarray, larger: bool, xp) -> np.ndarray:
    """One vectorized pass per position m: every row's m-th pair, compared against its whole row."""
    is_torch = xp is torch
    starts = row_starts(rows)
    pos = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    n_cols = S.shape[1]
    col_index = torch.arange(n_cols, device=S.device) if is_torch else np.arange(n_cols)
    ranks = np.empty(len(rows), np.int64)
    for m in range(int(pos.max()) + 1):
        sel = np.flatnonzero(pos == m)
        r, c = rows[sel], cols[sel]
        rt = torch.from_numpy(r).to(S.device) if is_torch else r
        ct = torch.from_numpy(c).to(S.device) if is_torch else c
        sub = S if len(r) == S.shape[0] and (r == np.arange(len(r))).all() else S[rt]  # m = 0: every row, no copy
        v = S[rt, ct][:, None]
        better = (sub > v) if larger else (sub < v)
        equal = sub == v
        if is_torch:
            count = better.sum(1) + (equal & (col_index[None, :] < ct[:, None])).sum(1)
            ranks[sel] = (count + 1).cpu().numpy()
        else:
            count = better.view(np.uint8).sum(1, dtype=np.int64)
            tied = equal.view(np.uint8).sum(1, dtype=np.int64)
            multi = np.flatnonzero(tied > 1)  # others share this score: count those with a lower column
            if len(multi):
                count[multi] += (
                    (equal[multi] & (col_index[None, :] < c[multi, None])).view(np.uint8).sum(1, dtype=np.int64)
                )
            ranks[sel] = count + 1
    return ranks


def _ranks_by_sort(block: Tensor, rows: np.ndarray, cols: np.ndarray, larger: bool) -> np.ndarray:
    """Sort each used row once by its (score, column) keys; a pair's rank is its column's position."""
    starts = row_starts(rows)
    used = rows[starts]
    ranks = np.empty(len(rows), np.int64)
    n_cols = block.shape[1]
    for lo in range(0, len(used), _SORT_CHUNK_ROWS):
        chunk = used[lo : lo + _SORT_CHUNK_ROWS]
        keys = order_keys(block[torch.from_numpy(chunk).to(block.device)].cpu().numpy(), larger)
        position = np.empty_like(keys)
        np.put_along_axis(position, np.argsort(keys, axis=1), np.arange(n_cols)[None, :], axis=1)
        first, last = starts[lo], (starts[lo + len(chunk)] if lo + len(chunk) < len(starts) else len(rows))
        local = np.searchsorted(chunk, rows[first:last])
        ranks[first:last] = position[local, cols[first:last]] + 1
    return ranks
