"""The per-step class draw of class subsampling (NormSoftmax paper, sec. 4.5).

Each step a shard keeps every class of the global batch that it owns (its *positives*) and
adds classes drawn uniformly without replacement from its other classes until it holds
``round(sample_ratio × shard classes)`` (never fewer than its positives). The draw depends
only on ``(seed, step, shard)`` and the positives: the same step redrawn after a restart gives
the same rows, and two shards or two steps draw independently. It runs on the CPU so that it
is the same on every device type.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


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


def target_count(num_local: int, sample_ratio: float) -> int:
    """Rows a shard of ``num_local`` classes takes part with (before counting positives)."""
    return min(num_local, int(sample_ratio * num_local + 0.5))


def sample_rows(num_local: int, positives: Tensor, sample_ratio: float, seed: int, step: int, shard: int) -> Tensor:
    """Sorted local row indices taking part this step.

    ``positives``: local rows (0 ≤ i < num_local) of the classes in the global batch, without
    duplicates. Returns all of them plus uniformly drawn others, ``max(len(positives),
    target_count(num_local, sample_ratio))`` rows in all, as a CPU int64 tensor.
    """
    positives = positives.to("cpu", torch.int64)
    want = max(target_count(num_local, sample_ratio), positives.numel())
    extra = want - positives.numel()
    taken = torch.zeros(num_local, dtype=torch.bool)
    taken[positives] = True
    if extra > 0:
        gen = torch.Generator().manual_seed(draw_seed(seed, step, shard))
        keys = torch.rand(num_local, generator=gen)
        keys[positives] = 2.0  # above every uniform draw: never picked as an extra
        taken[torch.topk(keys, extra, largest=False, sorted=False).indices] = True
    return taken.nonzero().squeeze(1)  # sorted, O(num_local)
