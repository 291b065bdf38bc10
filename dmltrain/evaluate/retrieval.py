"""Retrieval metrics: Recall@K, MAP@R, R-precision and NMI, on float and binary embeddings.

Protocol (SPEC "Evaluation"; MAP@R and R-precision as in Musgrave et al. 2020):

* Cosine similarity of L2-normalized embeddings; binary: Hamming distance of the sign bits
  (:func:`dmltrain.models.binary.pack_sign_bits`), keys prefixed ``binary/``.
* Without a gallery the query set is searched against itself, each query excluded (SOP, CUB,
  Cars); with one, query→gallery (In-Shop).
* Ranking: by score, equal scores by gallery index, lower first. Every metric is read off
  the exact rank of each (query, relevant item) pair (:mod:`.ranks`), so a tie straddling
  a cut-off is decided by that rule and not by an engine's top-k.
* ``recall@K``: share of queries with an item of their label among their K nearest.
* ``R`` = number of gallery items with the query's label (itself excluded).
  ``map@r`` = mean of (1/R) Σ_{i≤R} P(i)·rel(i); ``r_precision`` = mean of (hits in top R)/R.
* Queries with ``R = 0`` (label absent from the gallery, or a singleton class) cannot be
  retrieved: they are excluded from every retrieval metric and counted in
  ``excluded_queries``; ``num_queries`` counts the evaluated ones.
* ``nmi``: k-means of the (normalized) query embeddings with k = number of distinct query
  labels, scored by scikit-learn's NMI (:mod:`.clustering`: faiss, or a torch k-means on a GPU
  without faiss's GPU build). Float only.
* Where it runs: ``device`` (CUDA: the GEMMs, the binary codes' int8 GEMMs and the rank
  counting in a Triton kernel, :mod:`.gallery`, :mod:`.ranks`); the results are the same on
  every device up to the float rounding of the cosines themselves.
* K larger than the number of candidates: Recall@K is 1 for every evaluated query, which is
  what it means; a ``RuntimeWarning`` says so.
* ``rerank`` (:mod:`.rerank`: query expansion or k-reciprocal re-ranking of each query's top
  candidates): the float metrics again after re-ranking, keys prefixed ``rerank/``, read off the
  same score blocks; a pair beyond the re-ranked candidates keeps its exact rank.

All values are fractions in [0, 1]; counts are ints.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from dmltrain.evaluate.clustering import clustering_nmi
from dmltrain.evaluate.gallery import (
    Gallery,
    binary_gallery,
    default_block_bytes,
    float_gallery,
    mask_self,
    resolve_device,
)
from dmltrain.evaluate.inputs import ArrayLike, as_embeddings, as_labels
from dmltrain.evaluate.ranks import pair_ranks, row_starts
from dmltrain.evaluate.rerank import Rerank

# Per-block budget of (query, relevant item) pairs, ranked together.
_MAX_PAIRS = 4 << 20


# -- input checks ----------------------------------------------------------------------------
def check_ks(ks: Sequence[int]) -> list[int]:
    try:
        out = sorted({int(k) for k in ks})
    except (TypeError, ValueError):
        raise ValueError(f"ks: expected positive integers, got {ks!r}") from None
    if not out or out[0] < 1:
        raise ValueError(f"ks: expected positive integers, got {list(ks)!r}")
    return out


# -- the label structure ---------------------------------------------------------------------
@dataclass
class _Labels:
    """Integer label codes and the gallery grouped by label (gallery indices ascending per label)."""

    q: np.ndarray  # query label codes
    g: np.ndarray  # gallery label codes
    order: np.ndarray  # gallery indices sorted by (label, index)
    start: np.ndarray  # order[start[c]:start[c] + count[c]] are label c's gallery items
    count: np.ndarray
    R: np.ndarray  # per query: relevant gallery items, itself excluded

    @classmethod
    def build(cls, q_labels: np.ndarray, g_labels: np.ndarray | None) -> _Labels:
        if g_labels is None:
            _, q = np.unique(q_labels, return_inverse=True)
            g = q
        else:
            try:
                _, codes = np.unique(np.concatenate([q_labels, g_labels]), return_inverse=True)
            except TypeError:
                raise ValueError("query and gallery labels have incomparable types") from None
            q, g = codes[: len(q_labels)], codes[len(q_labels) :]
        n_codes = int(max(q.max(initial=-1), g.max(initial=-1))) + 1
        count = np.bincount(g, minlength=n_codes)
        start = np.concatenate(([0], np.cumsum(count)[:-1]))
        R = count[q] - (1 if g_labels is None else 0)
        return cls(
            q.astype(np.int64), g.astype(np.int64), np.argsort(g, kind="stable"), start, count, R.astype(np.int64)
        )

    def positive_pairs(self, queries: np.ndarray, self_search: bool) -> tuple[np.ndarray, np.ndarray]:
        """``(row, column)`` of every (query, relevant gallery item) pair; row indexes ``queries``."""
        lab = self.q[queries]
        cnt = self.count[lab]
        rows = np.repeat(np.arange(len(queries)), cnt)
        offset = np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        cols = self.order[np.repeat(self.start[lab], cnt) + offset]
        if self_search:
            keep = cols != queries[rows]
            rows, cols = rows[keep], cols[keep]
        return rows, cols


# -- metric accumulation ---------------------------------------------------------------------
@dataclass
class _Totals:
    ks: list[int]
    hits: np.ndarray = field(init=False)
    ap: list[np.ndarray] = field(default_factory=list)  # per-query AP@R, summed exactly at the end
    rp: list[np.ndarray] = field(default_factory=list)  # so results do not depend on the blocking
    n: int = 0

    def __post_init__(self) -> None:
        self.hits = np.zeros(len(self.ks), dtype=np.int64)


def _ranked_metrics(
    gal: Gallery,
    queries: Tensor | np.ndarray | None,
    labels: _Labels,
    valid: np.ndarray,
    ks: list[int],
    map_at_r: bool,
    block_bytes: int,
    progress: str | None,
    rerank: Rerank | None = None,
) -> tuple[_Totals, _Totals | None]:
    """Recall@K hits, AP@R and R-precision of the ``valid`` queries, block by block; with ``rerank``
    (a float gallery) the same after re-ranking, else None.

    ``queries`` is None for self-retrieval (query i is gallery row i). In each block every
    (query, relevant item) pair gets its exact rank (:func:`.ranks.pair_ranks`); Recall@K
    reads the best rank of each query, MAP@R and R-precision all of them.
    """
    self_search = queries is None
    larger = gal.larger_is_better
    tot = _Totals(ks)
    tot_rr = _Totals(ks) if rerank is not None else None
    n_cand = gal.size - self_search
    # Similar R together keeps the per-position passes of the fallback engines dense.
    order = valid[np.argsort(labels.R[valid], kind="stable")]
    max_rows = gal.rows_per_block(block_bytes)
    bar = tqdm(
        total=len(order), desc=progress, unit="query", leave=False, disable=progress is None or len(order) < 20000
    )
    lo = 0
    while lo < len(order):
        hi = min(lo + max_rows, len(order))
        hi = lo + max(1, int(np.searchsorted(np.cumsum(labels.R[order[lo:hi]] + 1), _MAX_PAIRS, side="right")))
        qi = order[lo:hi]
        block = gal.scores(gal.query_rows(qi) if self_search else gal.take(queries, qi))
        if self_search:
            mask_self(block, torch.from_numpy(qi), larger)
        rows, cols = labels.positive_pairs(qi, self_search)
        if not map_at_r and rerank is None:  # Recall@K needs only each query's best-ranked relevant item
            rows, cols = _best_pairs(block, rows, cols, larger)
        ranks = pair_ranks(block, rows, cols, larger)
        if tot_rr is not None:
            qv = gal.query_rows(qi) if self_search else gal.take(queries, qi)
            moved = rerank.reranked_ranks(qv, gal.rows, block, ranks, rows, n_cand)  # type: ignore[union-attr]
            _accumulate(tot_rr, moved, rows, labels.R[qi], map_at_r)
        del block
        _accumulate(tot, ranks, rows, labels.R[qi], map_at_r)
        bar.update(len(qi))
        lo = hi
    bar.close()
    return tot, tot_rr


def _accumulate(tot: _Totals, ranks: np.ndarray, rows: np.ndarray, R: np.ndarray, map_at_r: bool) -> None:
    """Add a block's queries to ``tot`` from the ranks of their relevant items (``rows``: each pair's query
    in the block, every query with at least one pair; ``R``: each query's relevant items)."""
    # Ranks of each query's relevant items, ascending: r_1 < r_2 < ... < r_R.
    srt = np.lexsort((ranks, rows))
    ranks, rows = ranks[srt], rows[srt]
    starts = row_starts(rows)
    tot.hits += (ranks[starts][:, None] <= np.asarray(tot.ks)[None, :]).sum(0)
    if map_at_r:
        m = np.arange(1, len(ranks) + 1) - np.repeat(starts, np.diff(np.r_[starts, len(ranks)]))
        inside = ranks <= R[rows]  # the m-th relevant item is within the top R
        tot.ap.append(np.add.reduceat(np.where(inside, m / ranks, 0.0), starts) / R)
        tot.rp.append(np.add.reduceat(inside.astype(np.float64), starts) / R)
    tot.n += len(R)


def _best_pairs(block: Tensor, rows: np.ndarray, cols: np.ndarray, larger: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best pair in the rank order (best score, then lowest column): the one whose
    rank decides Recall@K. ``rows`` grouped and ``cols`` ascending within a row, as built."""
    if len(rows) == 0:
        return rows, cols
    at = (torch.from_numpy(rows).to(block.device), torch.from_numpy(cols).to(block.device))
    score = block[at].double().cpu().numpy()
    pick = np.lexsort((cols, -score if larger else score, rows))  # stable: first of a row is its best
    pick = pick[row_starts(rows[pick])]
    return rows[pick], cols[pick]


def _report(tot: _Totals, prefix: str, map_at_r: bool) -> dict[str, float]:
    out: dict[str, float] = {f"{prefix}recall@{k}": float(h) / tot.n for k, h in zip(tot.ks, tot.hits)}
    if map_at_r:
        out[f"{prefix}map@r"] = math.fsum(np.concatenate(tot.ap)) / tot.n
        out[f"{prefix}r_precision"] = math.fsum(np.concatenate(tot.rp)) / tot.n
    return out


def path_metrics(
    q: np.ndarray,
    g: np.ndarray | None,
    labels: _Labels,
    valid: np.ndarray,
    ks: list[int],
    map_at_r: bool,
    kind: str,
    device: torch.device,
    block_bytes: int | None = None,
    progress: bool = False,
    binary_engine: str | None = None,
    rerank: Rerank | None = None,
) -> dict[str, float]:
    """Recall@K (and MAP@R, R-precision) of one path, ``float`` (cosine) or ``binary`` (Hamming
    of the sign bits, keys prefixed ``binary/``; ``binary_engine`` as in
    :func:`~.gallery.binary_gallery`), from checked inputs (see :func:`retrieval_metrics`); with
    ``rerank`` (float only) also the re-ranked ones, keys prefixed ``rerank/``."""
    if kind == "float":
        gal = float_gallery(q if g is None else g, device)
    elif kind == "binary":
        gal = binary_gallery(q if g is None else g, device, binary_engine)
    else:
        raise ValueError(f"path_metrics: kind must be 'float' or 'binary', got '{kind}'")
    queries = None if g is None else gal.queries(q)
    block_bytes = block_bytes or default_block_bytes(device)
    if rerank is not None and kind != "float":
        raise ValueError("path_metrics: re-ranking works on float embeddings only")
    tot, tot_rr = _ranked_metrics(
        gal, queries, labels, valid, ks, map_at_r, block_bytes, kind if progress else None, rerank
    )
    out = _report(tot, "" if kind == "float" else "binary/", map_at_r)
    if tot_rr is not None:
        out.update(_report(tot_rr, "rerank/", map_at_r))
    return out


# -- the public entry point ------------------------------------------------------------------
def retrieval_metrics(
    query: ArrayLike,
    query_labels: ArrayLike,
    gallery: ArrayLike | None = None,
    gallery_labels: ArrayLike | None = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    nmi: bool = True,
    map_at_r: bool = True,
    binary: bool = False,
    seed: int = 0,
    *,
    device: str | torch.device | None = "auto",
    block_bytes: int | None = None,
    nmi_iters: int = 20,
    progress: bool = False,
    rerank: Rerank | None = None,
) -> dict[str, float]:
    """Recall@K, MAP@R, R-precision, NMI (and their ``binary/`` twins, and with ``rerank`` their
    ``rerank/`` twins) as fractions in [0, 1].

    ``query``/``gallery``: ``N × D`` float arrays or tensors (any device and float dtype);
    labels: 1-D, any comparable values. ``gallery=None``: self-retrieval, each query
    excluded. ``binary``: also evaluate the sign bits by Hamming distance. ``device``: where
    the scoring, the ranking and NMI's k-means run (``auto``: CUDA when available).
    ``block_bytes`` bounds one dense score block (default: 256 MiB on a CPU, 1 GiB on a GPU).
    See the module doc for every definition.

    Raises a one-line ``ValueError`` for mismatched lengths or dims, NaN/inf embeddings,
    empty inputs, a gallery without labels, or no query with any relevant gallery item.
    """
    q = as_embeddings(query, "query")
    ql = as_labels(query_labels, len(q), "query_labels")
    if (gallery is None) != (gallery_labels is None):
        raise ValueError("gallery and gallery_labels must be given together")
    g = gl = None
    if gallery is not None:
        g = as_embeddings(gallery, "gallery")
        gl = as_labels(gallery_labels, len(g), "gallery_labels")  # type: ignore[arg-type]
        if g.shape[1] != q.shape[1]:
            raise ValueError(f"gallery: embedding dim {g.shape[1]} differs from the query's {q.shape[1]}")
    ks = check_ks(ks)
    labels = _Labels.build(ql, gl)
    valid = np.flatnonzero(labels.R > 0)
    excluded = len(q) - len(valid)
    if len(valid) == 0:
        where = "in the gallery" if gallery is not None else "among the other queries"
        raise ValueError(f"no query has an item of its label {where}: nothing to evaluate ({len(q)} queries)")
    n_gallery = len(q) if g is None else len(g)
    n_cand = n_gallery - (g is None)
    if ks[-1] > n_cand:
        warnings.warn(
            f"recall@K for K > {n_cand} (the gallery candidates) is 1 for every query: K={[k for k in ks if k > n_cand]}",
            RuntimeWarning,
            stacklevel=2,
        )
    dev = resolve_device(device)
    metrics = path_metrics(q, g, labels, valid, ks, map_at_r, "float", dev, block_bytes, progress, rerank=rerank)
    if nmi:
        metrics["nmi"] = clustering_nmi(q, labels.q, seed=seed, niter=nmi_iters, device=dev)
    if binary:
        metrics.update(path_metrics(q, g, labels, valid, ks, map_at_r, "binary", dev, block_bytes, progress))
    metrics["num_queries"] = int(len(valid))
    metrics["excluded_queries"] = int(excluded)
    metrics["gallery_size"] = int(n_gallery)
    return metrics
