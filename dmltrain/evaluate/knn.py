"""Exact blocked nearest-neighbour search: cosine similarity (float) and Hamming distance (binary).

The ranking rule, the same for every engine and device: gallery items are ordered by score
(highest cosine first, or lowest Hamming distance first), and **equal scores are ordered by
gallery index, lower first**. A brute-force reference is then one ``np.lexsort`` away.

Everything works on dense score blocks of ``rows × gallery`` produced in query blocks whose
size is bounded by ``block_bytes``, so a 60k × 2048 float or a 1M-item gallery fits in
bounded memory. Each block is one GEMM (``torch.mm``, on the GPU when one is asked for) or
one all-pairs Hamming call (:mod:`.hamming`); the metrics read the ranks of relevant items
off the block (:mod:`.ranks`) and need no top-k; :func:`knn` returns neighbour lists.

Ties are exact: Hamming distances are integers, and identical float embeddings are searched
once (duplicate gallery rows are folded before the GEMM and expanded after), because BLAS
kernels may round the same dot product differently depending on the column it lands in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dmltrain.evaluate.hamming import hamming_block, pad_codes
from dmltrain.evaluate.inputs import as_embeddings
from dmltrain.evaluate.ranks import order_keys
from dmltrain.models.binary import pack_sign_bits

# Bytes of one dense score block (float32 or int32). Temporaries of the passes add ~2× this.
DEFAULT_BLOCK_BYTES = 256 << 20


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: the current CUDA device when available, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def _fp32_matmul() -> Iterator[None]:
    """Full-precision float32 GEMMs (no TF32) for the duration of a search."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def unique_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, inverse)``: indices of the first occurrence of each distinct row, and for every
    row the position of its distinct row in ``first`` (``x[first][inverse]`` equals ``x``).

    Rows are compared bit for bit (so ``-0.0`` and ``0.0`` differ, which only splits a tie).
    An exact integer fingerprint of a few columns groups candidates; groups are then
    verified on the full rows, so the result never depends on hash luck.
    """
    n, d = x.shape
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    bits = np.ascontiguousarray(x).view(np.uint32 if x.itemsize == 4 else np.uint8)
    cols = np.unique(np.linspace(0, bits.shape[1] - 1, num=min(bits.shape[1], 64)).astype(np.int64))
    weights = np.random.default_rng(1234).integers(1, 2**63, size=len(cols), dtype=np.uint64) | np.uint64(1)
    finger = (bits[:, cols].astype(np.uint64) * weights).sum(1)  # wraps mod 2**64: exact and order-free
    _, group_first, group = np.unique(finger, return_index=True, return_inverse=True)
    if len(group_first) == n:
        return np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    # Verify each multi-row group on the full rows.
    rep = np.arange(n, dtype=np.int64)  # rep[i]: lowest index of a row bit-identical to row i
    sizes = np.bincount(group)
    order = np.argsort(group, kind="stable")
    starts = np.concatenate(([0], np.cumsum(sizes)))
    row_view = np.ascontiguousarray(x).view(np.dtype((np.void, d * x.itemsize))).ravel()
    for gid in np.flatnonzero(sizes > 1):
        members = order[starts[gid] : starts[gid + 1]]  # ascending row index
        _, first_in, inv_in = np.unique(row_view[members], return_index=True, return_inverse=True)
        rep[members] = members[first_in][inv_in]
    first, inverse = np.unique(rep, return_inverse=True)
    return first.astype(np.int64), inverse.astype(np.int64)


def l2_normalize(x: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows divided by their L2 norm; an all-zero row stays zero (cosine 0 with everything)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(eps)


@dataclass
class Gallery:
    """A gallery prepared for dense scoring; build it with :func:`float_gallery` or :func:`binary_gallery`."""

    kind: str  # "float" or "binary"
    size: int
    device: torch.device
    data: Tensor | np.ndarray  # float: unique normalized rows (U × D); binary: padded codes (N × B)
    inverse: Tensor | None = None  # float: gallery row -> unique row, None when all rows are distinct

    @property
    def larger_is_better(self) -> bool:
        return self.kind == "float"

    def query_rows(self, rows: np.ndarray) -> Tensor | np.ndarray:
        """Prepared queries for gallery rows ``rows`` (self-retrieval)."""
        if self.kind == "float":
            assert isinstance(self.data, Tensor)
            idx = torch.as_tensor(rows, device=self.device)
            return self.data[self.inverse[idx]] if self.inverse is not None else self.data[idx]
        return self.data[rows]  # type: ignore[index]

    def scores(self, queries: Tensor | np.ndarray) -> Tensor:
        """Dense ``len(queries) × size`` block: cosine similarities (float32) or Hamming distances (int16/int32)."""
        if self.kind == "float":
            with _fp32_matmul():
                s = torch.mm(queries, self.data.t())  # type: ignore[arg-type, union-attr]
            return s[:, self.inverse] if self.inverse is not None else s
        codes = np.ascontiguousarray(queries)
        return torch.from_numpy(hamming_block(codes, self.data))  # type: ignore[arg-type]

    def rows_per_block(self, block_bytes: int) -> int:
        per_row = 4 * self.size * (2 if self.inverse is not None else 1)
        return max(1, block_bytes // max(per_row, 1))


def float_gallery(emb: np.ndarray, device: torch.device) -> Gallery:
    """Fold identical rows, L2-normalize the distinct ones, move them to ``device``.

    Rows are folded twice: bit-identical raw rows, then bit-identical normalized rows (``x``
    and ``2x`` are the same direction), so every exact cosine tie is computed once.
    """
    first, inverse = unique_rows(emb)
    rows = l2_normalize(torch.from_numpy(np.ascontiguousarray(emb[first] if len(first) < len(emb) else emb)))
    first2, inverse2 = unique_rows(rows.numpy())
    if len(first2) < len(first):
        rows, inverse = rows[torch.from_numpy(first2)], inverse2[inverse]
    distinct = len(rows) < len(emb)
    inv = torch.from_numpy(inverse).to(device) if distinct else None
    return Gallery("float", len(emb), device, rows.contiguous().to(device), inv)


def float_queries(emb: np.ndarray, device: torch.device) -> Tensor:
    return l2_normalize(torch.from_numpy(np.ascontiguousarray(emb)).to(device))


def binary_gallery(codes: np.ndarray) -> Gallery:
    """Packed sign codes (``N × ceil(D/8)`` uint8); the Hamming engine runs on the CPU."""
    return Gallery("binary", len(codes), torch.device("cpu"), pad_codes(codes))


def mask_self(block: Tensor, rows: Tensor, larger_is_better: bool) -> None:
    """Give each query's own gallery column a score worse than any real one (self-retrieval):
    -inf for similarities, the dtype's maximum for Hamming distances (codes are shorter)."""
    worst = float("-inf") if larger_is_better else torch.iinfo(block.dtype).max
    block[torch.arange(len(rows), device=block.device), rows.to(block.device)] = worst


def lexicographic_topk(block: Tensor, k: int, larger_is_better: bool) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` best columns, ordered by score then by column (lower first), exactly.

    ``torch.topk`` picks an arbitrary subset of a tie that straddles position ``k``; such rows
    (the ``k``-th and ``k+1``-th values equal) are redone exactly on the CPU with integer
    (score, column) keys. Needs ``k <= block.shape[1]``.
    """
    n_rows, n_cols = block.shape
    if k > n_cols:
        raise ValueError(f"lexicographic_topk: k={k} exceeds the {n_cols} columns")
    if k == 0 or n_rows == 0:
        return block.new_zeros((n_rows, k)), torch.zeros((n_rows, k), dtype=torch.int64, device=block.device)
    kk = min(k + 1, n_cols)
    vals, ids = torch.topk(block, kk, dim=1, largest=larger_is_better, sorted=True)
    # Order within the candidates by (score, column): sort by column, then stable sort by score.
    ids, by_id = torch.sort(ids, dim=1)
    vals = vals.gather(1, by_id)
    vals, by_val = torch.sort(vals, dim=1, descending=larger_is_better, stable=True)
    ids = ids.gather(1, by_val)
    if kk == k:
        return vals, ids
    straddle = torch.nonzero(vals[:, k - 1] == vals[:, k]).flatten()
    vals, ids = vals[:, :k].contiguous(), ids[:, :k].contiguous()
    if len(straddle):
        sub = block[straddle].cpu().numpy()
        keys = order_keys(sub, larger_is_better)
        top = np.argpartition(keys, k - 1, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(np.take_along_axis(keys, top, 1), axis=1), 1)
        chosen = torch.from_numpy(top).to(ids.device)
        ids[straddle] = chosen
        vals[straddle] = block[straddle].gather(1, chosen)
    return vals, ids


def knn(
    query: np.ndarray | Tensor,
    gallery: np.ndarray | Tensor | None = None,
    k: int = 10,
    *,
    binary: bool = False,
    device: str | torch.device | None = "cpu",
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours: ``(scores, indices)``, each ``nq × k``, best first.

    Scores are cosine similarities, or Hamming distances of the sign bits with ``binary``.
    Without ``gallery`` the query set is searched against itself with each query excluded.
    Order: score, then lower gallery index (see the module doc). ``k`` larger than the
    number of candidates is a ``ValueError``.
    """
    q = as_embeddings(query, "query")
    g = q if gallery is None else as_embeddings(gallery, "gallery")
    if g.shape[1] != q.shape[1]:
        raise ValueError(f"knn: query dim {q.shape[1]} != gallery dim {g.shape[1]}")
    n_cand = len(g) - (gallery is None)
    if not 1 <= k <= n_cand:
        raise ValueError(f"knn: k={k} must be between 1 and the {n_cand} gallery candidates")
    dev = resolve_device(device)
    if binary:
        gal = binary_gallery(pack_sign_bits(g))
        qprep: Tensor | np.ndarray = gal.data if gallery is None else pad_codes(pack_sign_bits(q))
    else:
        gal = float_gallery(g, dev)
        qprep = gal.query_rows(np.arange(len(g))) if gallery is None else float_queries(q, dev)
    out_s, out_i = [], []
    step = gal.rows_per_block(block_bytes)
    for lo in range(0, len(q), step):
        hi = min(lo + step, len(q))
        block = gal.scores(qprep[lo:hi])
        if gallery is None:
            mask_self(block, torch.arange(lo, hi), gal.larger_is_better)
        s, i = lexicographic_topk(block, k, gal.larger_is_better)
        out_s.append(s.cpu().numpy())
        out_i.append(i.cpu().numpy())
    return np.concatenate(out_s), np.concatenate(out_i)
