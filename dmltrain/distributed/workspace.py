"""Named scratch buffers reused from call to call.

The CPU allocator caches nothing: every large fresh tensor is new memory, and its first touch
costs a page fault per 4 KiB page, as much CPU time as copying it. The classifier and its
optimizer therefore write their large temporaries (logit blocks, gathered weight rows, weight
gradient blocks) into buffers that live as long as they do. On CUDA the caching allocator
would do the same; the buffers are harmless there.

Each name holds one live tensor at a time: asking for a name again hands out the same memory.
:data:`BLOCK_ELEMENTS` bounds every blocked pass of the classifier and its optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: elements of one block of a blocked pass (logits, gathered rows, gradient rows, optimizer rows): 16 Mi
#: numbers, 64 MiB in fp32. Few large element-wise passes beat many small ones (each is a parallel region).
BLOCK_ELEMENTS = 1 << 24


class Workspace:
    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """A contiguous tensor of ``shape`` in the buffer ``name`` (grown, never shrunk)."""
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.device != torch.device(device) or buf.dtype != dtype:
            self._bufs.pop(name, None)  # free the old one first
            buf = self._bufs[name] = torch.empty(max(n, 1), device=device, dtype=dtype)
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
