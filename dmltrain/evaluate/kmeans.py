"""k-means in torch, on any device: NMI's clustering on a GPU without faiss's GPU build.

Lloyd's algorithm as faiss runs it for :mod:`.clustering`: ``niter`` rounds of (assign every
point to its nearest centroid, move each centroid to the mean of its points), then a final
assignment to the trained centroids. Seeding: ``random`` (``k`` distinct points drawn with
``seed``) or ``kmeans++`` (D² sampling, sequential in ``k``). A centroid left without points
is moved onto the point farthest from its own centroid, the one worst served (scikit-learn's
rule; faiss splits a large cluster instead; both only matter when a cluster empties).

Distances are ``‖c‖² − 2⟨x, c⟩`` from one GEMM per block of points (``‖x‖²`` is the same for
every centroid of a point), blocks bounded by ``block_bytes``. Centroid sums use
``index_add_``, whose float atomics make GPU runs differ in the last bits from run to run:
the NMI moves within the noise of the k-means itself, not beyond it.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BLOCK_BYTES = 512 << 20


def _nearest(x: Tensor, centroids: Tensor, block_bytes: int) -> tuple[Tensor, Tensor]:
    """Each point's nearest centroid and the squared distance to it."""
    c_norm = (centroids * centroids).sum(1)
    rows = max(1, block_bytes // (4 * len(centroids)))
    assign = torch.empty(len(x), dtype=torch.int64, device=x.device)
    dist = torch.empty(len(x), dtype=x.dtype, device=x.device)
    for lo in range(0, len(x), rows):
        xb = x[lo : lo + rows]
        d = torch.addmm(c_norm[None, :], xb, centroids.t(), alpha=-2.0)
        best, idx = d.min(1)
        assign[lo : lo + rows] = idx
        dist[lo : lo + rows] = (best + (xb * xb).sum(1)).clamp_min(0)
    return assign, dist


def _kmeans_pp(x: Tensor, k: int, gen: torch.Generator) -> Tensor:
    """k-means++ seeding: each next centroid drawn with probability proportional to D²."""
    n = len(x)
    chosen = [int(torch.randint(n, (1,), generator=gen))]
    d2 = ((x - x[chosen[0]]) ** 2).sum(1)
    for _ in range(1, k):
        total = float(d2.sum())
        if total <= 0:  # fewer distinct points than k: any unchosen point
            taken = torch.zeros(n, dtype=torch.bool)
            taken[chosen] = True
            nxt = int(torch.nonzero(~taken)[0])
        else:
            target = float(torch.rand(1, generator=gen, dtype=torch.float64)) * total
            nxt = min(
                int(
                    torch.searchsorted(
                        torch.cumsum(d2.double(), 0), torch.tensor([target], dtype=torch.float64, device=x.device)
                    )
                ),
                n - 1,
            )
        chosen.append(nxt)
        d2 = torch.minimum(d2, ((x - x[nxt]) ** 2).sum(1))
    return x[torch.tensor(chosen, device=x.device)].clone()


def torch_kmeans(
    x: Tensor,
    k: int,
    *,
    seed: int = 0,
    niter: int = 20,
    init: str = "random",
    centroids: Tensor | None = None,
    block_bytes: int = _BLOCK_BYTES,
) -> Tensor:
    """Cluster index (int64, on ``x``'s device) of every row of ``x`` (float32 ``n × d``).

    ``k`` between 1 and ``n``; ``init``: ``random`` or ``kmeans++``; ``centroids``: start
    from these instead (``k × d``). Deterministic on the CPU for a given ``seed``.
    """
    n = len(x)
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: k={k} must be between 1 and the {n} points")
    gen = torch.Generator().manual_seed(seed)
    if centroids is not None:
        c = centroids.to(x.device, x.dtype).clone()
    elif init == "kmeans++":
        c = _kmeans_pp(x, k, gen)
    elif init == "random":
        c = x[torch.randperm(n, generator=gen)[:k].to(x.device)].clone()
    else:
        raise ValueError(f"kmeans: init must be random or kmeans++, got '{init}'")
    for _ in range(niter):
        assign, dist = _nearest(x, c, block_bytes)
        sums = torch.zeros_like(c).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k)
        c = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None].to(x.dtype), c)
        empty = torch.nonzero(counts == 0).flatten()
        if len(empty):
            far = torch.topk(dist, min(len(empty), n)).indices
            c[empty[: len(far)]] = x[far]
    return _nearest(x, c, block_bytes)[0]
