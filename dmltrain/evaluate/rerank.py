"""Re-ranking after the exact search: query expansion and k-reciprocal re-ranking of each query's top candidates.

Both re-order the ``candidates`` best gallery items of every query (taken in the evaluation's exact order:
score, then lower gallery index) and leave everything after them where it was, so Recall@K for K at or
beyond ``candidates`` is unchanged; equal new scores are ordered by gallery index, lower first, as the
plain ranking is.

* ``qe``, query expansion (Chum et al., ICCV 2007; α-weighted, Radenović et al., TPAMI 2018): the query
  becomes ``normalize(q + Σ_{i≤n} w_i g_i)`` over its ``n = qe_k`` nearest candidates ``g_i``, with
  ``w_i = 1`` (average QE, ``qe_alpha = 0``) or ``w_i = max(cos(q, g_i), 0)^α``; the candidates are
  ordered by their cosine to it.
* ``kr``, k-reciprocal re-ranking (Zhong et al., CVPR 2017), computed as the authors' code does, on the
  set made of the query and its candidates: squared Euclidean distances of the L2-normalized
  embeddings, each row divided by its largest entry; k-reciprocal neighbours ``R(i, k1)`` (each of
  the other's ``k1 + 1`` nearest, itself included), expanded by ``R(j, round(k1/2))`` of a member
  ``j`` when more than 2/3 of that set lies in ``R(i, k1)``; Gaussian-kernel vectors
  ``V_i ∝ exp(-d(i, ·))`` on that set, averaged over the ``k2`` nearest (local query expansion);
  Jaccard distance ``1 - Σ min(V_q, V_g) / Σ max(V_q, V_g)``; final distance
  ``(1 - λ) d_J + λ d``, ``λ = kr_lambda``. The paper builds the sets over every query and gallery
  image; here each query's own candidates stand for them, which keeps the cost per query bounded
  (``candidates``³ operations) at any gallery size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

KINDS = ("none", "qe", "kr")
# elements of the largest per-chunk tensor (queries × candidates × max(dim, candidates)): about 128 MiB in float32
_CHUNK_ELEMENTS = 32 << 20


@dataclass(frozen=True)
class Rerank:
    """What re-ranking to do (``kind``: ``qe`` or ``kr``) and its parameters (see the module doc)."""

    kind: str
    candidates: int = 100
    qe_k: int = 2
    qe_alpha: float = 0.0
    kr_k1: int = 20
    kr_k2: int = 6
    kr_lambda: float = 0.3

    def __post_init__(self) -> None:
        if self.kind not in KINDS[1:]:
            raise ValueError(f"rerank: kind must be qe or kr, got {self.kind!r}")
        if self.candidates < 2 or self.qe_k < 1 or self.kr_k1 < 1 or self.kr_k2 < 1:
            raise ValueError("rerank: candidates must be >= 2 and qe_k, kr_k1, kr_k2 >= 1")
        if not 0.0 <= self.kr_lambda <= 1.0 or self.qe_alpha < 0:
            raise ValueError("rerank: kr_lambda must be in [0, 1] and qe_alpha >= 0")

    @classmethod
    def of(cls, kind: str | None, params: Any = None) -> Rerank | None:
        """``None`` for ``none``; else a :class:`Rerank` from ``params`` (a mapping or an object with the fields)."""
        if kind in (None, "none"):
            return None
        if params is None:
            return cls(kind)
        get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
        values = {f: get(f) for f in ("candidates", "qe_k", "qe_alpha", "kr_k1", "kr_k2", "kr_lambda")}
        return cls(kind, **{k: v for k, v in values.items() if v is not None})

    def order(self, query: Tensor, cands: Tensor, scores: Tensor, ids: Tensor) -> Tensor:
        """The new order of each query's candidates: ``perm[b, p]`` is the position (in the given order) of the
        candidate that comes ``p``-th. ``query`` B × D and ``cands`` B × K × D L2-normalized, ``scores`` B × K their
        cosines and ``ids`` B × K their gallery indices, both in the plain order."""
        if self.kind == "qe":
            new = -qe_scores(query, cands, scores, self.qe_k, self.qe_alpha)
        else:
            new = kr_distances(universe_cosines(query, cands), self.kr_k1, self.kr_k2, self.kr_lambda)
        return order_by(new, ids)

    def reranked_ranks(
        self,
        query: Tensor,
        gallery: Callable[[Tensor], Tensor],
        block: Tensor,
        ranks: np.ndarray,
        rows: np.ndarray,
        n_candidates: int,
    ) -> np.ndarray:
        """The ranks of (query, relevant item) pairs after re-ranking, from their plain ``ranks``: a pair within
        the top ``K = min(candidates, n_candidates)`` moves to its new place there, any other keeps its rank.
        ``query``: the block's normalized queries (B × D); ``gallery(ids)``: the normalized gallery rows of
        ``ids``; ``block``: the cosines (the query's own column masked in self-retrieval, where
        ``n_candidates`` is one less than the gallery); ``rows``: each pair's row in the block."""
        from dmltrain.evaluate.knn import lexicographic_topk

        k = min(self.candidates, n_candidates)
        out = ranks.copy()
        if k < 2:
            return out
        per_query = k * max(query.shape[1], k + 1)
        step = max(1, _CHUNK_ELEMENTS // per_query)
        inside = np.flatnonzero(ranks <= k)
        for lo in range(0, len(query), step):
            hi = min(lo + step, len(query))
            scores, ids = lexicographic_topk(block[lo:hi], k, True)
            perm = self.order(query[lo:hi].float(), gallery(ids).float(), scores.float(), ids).cpu().numpy()
            inverse = np.empty_like(perm)
            np.put_along_axis(inverse, perm, np.arange(k)[None, :], axis=1)
            sel = inside[(rows[inside] >= lo) & (rows[inside] < hi)]
            out[sel] = inverse[rows[sel] - lo, ranks[sel] - 1] + 1
        return out


def order_by(key: Tensor, ids: Tensor) -> Tensor:
    """Positions of each row sorted by ``key`` ascending, equal keys by ``ids`` ascending (the tie rule)."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    by_key = torch.argsort(key.gather(1, by_id), dim=1, stable=True)
    return by_id.gather(1, by_key)


def qe_scores(query: Tensor, cands: Tensor, scores: Tensor, n: int, alpha: float) -> Tensor:
    """Cosines of the candidates to the expanded query ``normalize(q + Σ_{i≤n} w_i g_i)`` (module doc), B × K.

    Computed as elementwise products summed per row, so identical candidates get identical scores."""
    n = min(n, cands.shape[1])
    w = torch.ones_like(scores[:, :n]) if alpha == 0 else scores[:, :n].clamp_min(0) ** alpha
    expanded = query + (w[:, :, None] * cands[:, :n]).sum(1)
    expanded = expanded / expanded.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (cands * expanded[:, None, :]).sum(2)


def universe_cosines(query: Tensor, cands: Tensor) -> Tensor:
    """Cosines among the query and its candidates, B × (K+1) × (K+1), the query first; made symmetric, so a
    distance is the same both ways whatever the GEMM's rounding."""
    u = torch.cat([query[:, None, :], cands], 1)
    s = torch.bmm(u, u.transpose(1, 2))
    return (s + s.transpose(1, 2)) / 2


def kr_distances(cos: Tensor, k1: int, k2: int, lam: float) -> Tensor:
    """k-reciprocal final distances (module doc) of item 0 of each set to the others, B × (M-1), from the
    cosines ``cos`` (B × M × M) among the M items of each set."""
    b, m, _ = cos.shape
    d = (2 - 2 * cos).clamp_min(0)
    d = d / d.amax(dim=2, keepdim=True).clamp_min(1e-12)
    rank = torch.argsort(d, dim=2, stable=True)  # equal distances: the lower position in the set first

    def reciprocal(k: int) -> Tensor:
        near = torch.zeros((b, m, m), dtype=torch.bool, device=cos.device)
        near.scatter_(2, rank[:, :, : min(k, m - 1) + 1], True)  # near[i, j]: j among i's k+1 nearest (i included)
        return near & near.transpose(1, 2)

    r = reciprocal(k1).float()
    rh = reciprocal(round(k1 / 2)).float()  # Python's round, as numpy's around: halves to even
    shared = torch.bmm(r, rh.transpose(1, 2))  # |R(i) ∩ R(j, k1/2)|
    expand = (r > 0) & (shared > (2.0 / 3.0) * rh.sum(2)[:, None, :])
    rstar = (r > 0) | (torch.bmm(expand.float(), rh) > 0)
    v = torch.where(rstar, torch.exp(-d), torch.zeros_like(d))
    v = v / v.sum(2, keepdim=True)
    if k2 > 1:
        near = rank[:, :, : min(k2, m)]  # B × M × k2
        v = v.gather(1, near.reshape(b, -1, 1).expand(-1, -1, m)).reshape(b, m, near.shape[2], m).mean(2)
    tmin = torch.minimum(v[:, :1, :], v[:, 1:, :]).sum(2)
    jaccard = 1 - tmin / (2 - tmin)
    return (1 - lam) * jaccard + lam * d[:, 0, 1:]
