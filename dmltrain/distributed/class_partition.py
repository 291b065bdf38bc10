"""Which global class ids each worker's classifier shard owns.

Classes are split into contiguous blocks in rank order; when ``C`` is not a multiple of ``W``
the first ``C mod W`` workers own one class more. A worker may own no class (``C < W``).
Contiguous blocks keep a shard's rows one slice of the full weight, so saving by class id
and reloading at another world size is a matter of slicing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ClassPartition:
    num_classes: int
    world_size: int

    def __post_init__(self) -> None:
        if self.num_classes < 1 or self.world_size < 1:
            raise ValueError(f"need num_classes >= 1 and world_size >= 1, got {self.num_classes}, {self.world_size}")

    def size(self, rank: int) -> int:
        q, r = divmod(self.num_classes, self.world_size)
        return q + (rank < r)

    def start(self, rank: int) -> int:
        q, r = divmod(self.num_classes, self.world_size)
        return rank * q + min(rank, r)

    def end(self, rank: int) -> int:
        return self.start(rank) + self.size(rank)

    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) of every rank's block."""
        return [(self.start(r), self.end(r)) for r in range(self.world_size)]

    def owner(self, class_ids: Tensor) -> Tensor:
        """The rank owning each global class id (same shape as ``class_ids``)."""
        q, r = divmod(self.num_classes, self.world_size)
        big = r * (q + 1)  # classes held by the ranks that own q + 1 classes
        ids = class_ids.long()
        low = torch.div(ids, q + 1, rounding_mode="floor")
        if q == 0:
            return low
        high = r + torch.div(ids - big, q, rounding_mode="floor")
        return torch.where(ids < big, low, high)
