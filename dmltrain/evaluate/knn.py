"""Exact k nearest neighbours (cosine or Hamming), by blocked dense scoring.

The ranking rule, the same for every engine and device: gallery items are ordered by score
(highest cosine first, or lowest Hamming distance first), and **equal scores are ordered by
gallery index, lower first**. A brute-force reference is then one ``np.lexsort`` away.

Scores come in query blocks whose size is bounded by ``block_bytes`` (a prepared
:class:`~.gallery.Gallery`: one GEMM, one int8 GEMM or one all-pairs Hamming call per block, on
the GPU when one is asked for), so a 60k × 2048 float or a 1M-item gallery fits in bounded
memory. The metrics read the ranks of relevant items off each block (:mod:`.ranks`) and need
no top-k; :func:`knn` returns neighbour lists, exact under ties (see :func:`lexicographic_topk`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dmltrain.evaluate.gallery import binary_gallery, default_block_bytes, float_gallery, mask_self, resolve_device
from dmltrain.evaluate.inputs import as_embeddings
from dmltrain.evaluate.ranks import order_keys


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
    block_bytes: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact k nearest neighbours: ``(scores, indices)``, each ``nq × k``, best first.

    Scores are cosine similarities, or Hamming distances of the sign bits with ``binary``.
    Without ``gallery`` the query set is searched against itself with each query excluded.
    Order: score, then lower gallery index (see the module doc). ``k`` larger than the
    number of candidates is a ``ValueError``. ``block_bytes`` defaults to the device's
    (:func:`~.gallery.default_block_bytes`).
    """
    q = as_embeddings(query, "query")
    g = q if gallery is None else as_embeddings(gallery, "gallery")
    if g.shape[1] != q.shape[1]:
        raise ValueError(f"knn: query dim {q.shape[1]} != gallery dim {g.shape[1]}")
    n_cand = len(g) - (gallery is None)
    if not 1 <= k <= n_cand:
        raise ValueError(f"knn: k={k} must be between 1 and the {n_cand} gallery candidates")
    dev = resolve_device(device)
    gal = binary_gallery(g, dev) if binary else float_gallery(g, dev)
    qprep = None if gallery is None else gal.queries(q)
    out_s, out_i = [], []
    step = gal.rows_per_block(block_bytes or default_block_bytes(dev))
    for lo in range(0, len(q), step):
        rows = np.arange(lo, min(lo + step, len(q)))
        block = gal.scores(gal.query_rows(rows) if qprep is None else gal.take(qprep, rows))
        if gallery is None:
            mask_self(block, torch.from_numpy(rows), gal.larger_is_better)
        s, i = lexicographic_topk(block, k, gal.larger_is_better)
        if binary:
            s = gal.hamming(s)
        out_s.append(s.cpu().numpy())
        out_i.append(i.cpu().numpy())
    return np.concatenate(out_s), np.concatenate(out_i)
