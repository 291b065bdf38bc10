"""The per-step class draw of class subsampling (NormSoftmax paper, sec. 4.5).

Each step the softmax holds every class of the global batch plus classes drawn uniformly
without replacement from all the others, ``T = max(P, round(sample_ratio × C))`` classes in
all (``P``: distinct classes in the batch, ``C``: all classes). The draw is global but needs
no communication: every rank sees the gathered labels, so every rank splits the ``T − P``
extra classes over the shards with the same multivariate hypergeometric draw seeded by
``(seed, step)`` (how many of a uniform draw from the non-batch classes fall on each shard);
then each shard picks its share uniformly among its own non-batch rows, seeded by
``(seed, step, shard)``. Together that is exactly a uniform draw over the non-batch classes,
the count does not depend on the number of workers, and a step redrawn after a restart gives
the same rows. It runs on the CPU so that it is the same on every device type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_SPLIT_SALT = (1 << 63) - 25  # stands in for the shard index of the global split draw


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int, shard: int) -> int:
    """A 63-bit generator seed mixing (seed, step, shard); nearby inputs give unrelated seeds."""
    h = _splitmix64(int(seed) & _MASK64)
    h = _splitmix64(h ^ (int(step) & _MASK64))
    h = _splitmix64(h ^ (int(shard) & _MASK64))
    return h >> 1


def target_total(num_classes: int, num_batch_classes: int, sample_ratio: float) -> int:
    """Classes in one step's softmax: ``round(sample_ratio × C)``, never fewer than the batch's classes."""
    return max(num_batch_classes, min(num_classes, int(sample_ratio * num_classes + 0.5)))


def extras_per_shard(available: Sequence[int], extras: int, seed: int, step: int) -> list[int]:
    """How many of ``extras`` classes drawn uniformly from the non-batch classes fall on each shard.

    ``available[s]``: non-batch classes of shard ``s``. The same on every rank for the same
    arguments (a multivariate hypergeometric draw seeded by ``(seed, step)``).
    """
    if extras <= 0:
        return [0] * len(available)
    if extras >= sum(available):
        return list(available)
    rng = np.random.Generator(np.random.PCG64(draw_seed(seed, step, _SPLIT_SALT)))
    return rng.multivariate_hypergeometric(np.asarray(available, dtype=np.int64), extras, method="marginals").tolist()


def sample_rows(num_local: int, positives: Tensor, extra: int, seed: int, step: int, shard: int) -> Tensor:
    """Sorted local row indices taking part this step: ``positives`` plus ``extra`` uniformly drawn others.

    ``positives``: local rows (0 ≤ i < num_local) of the classes in the global batch, without
    duplicates. Returns a CPU int64 tensor of ``len(positives) + extra`` rows.
    """
    positives = positives.to("cpu", torch.int64)
    extra = min(int(extra), num_local - positives.numel())
    taken = torch.zeros(num_local, dtype=torch.bool)
    taken[positives] = True
    if extra > 0:
        gen = torch.Generator().manual_seed(draw_seed(seed, step, shard))
        keys = torch.rand(num_local, generator=gen)
        keys[positives] = 2.0  # above every uniform draw: never picked as an extra
        taken[torch.topk(keys, extra, largest=False, sorted=False).indices] = True
    return taken.nonzero().squeeze(1)  # sorted, O(num_local)


def draw_active_rows(
    batch_classes: Tensor, bounds: Sequence[tuple[int, int]], shard: int, sample_ratio: float, seed: int, step: int
) -> Tensor:
    """This shard's rows (local indices) in step ``step``'s softmax.

    ``batch_classes``: the distinct global class ids of the global batch; ``bounds``: every
    shard's ``[start, end)`` class range (contiguous, in rank order).
    """
    batch_classes = batch_classes.to("cpu", torch.int64)
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int64)
    sizes = [e - s for s, e in bounds]
    owner = torch.searchsorted(starts, batch_classes, right=True) - 1
    per_shard = torch.bincount(owner, minlength=len(bounds)).tolist()
    num_classes = bounds[-1][1]
    total = target_total(num_classes, batch_classes.numel(), sample_ratio)
    available = [n - p for n, p in zip(sizes, per_shard)]
    extra = extras_per_shard(available, total - batch_classes.numel(), seed, step)[shard]
    lo, _ = bounds[shard]
    positives = batch_classes[owner == shard] - lo
    return sample_rows(sizes[shard], positives, extra, seed, step, shard)
