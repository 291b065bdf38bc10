"""The next batch on its way to the device while the current one trains.

:class:`Prefetcher` wraps the stream's host batches: batch ``i + 1`` is taken from the stream and
its preparation (``prepare``: the copies from pinned memory, device decoding and augmentation,
normalization) queued before batch ``i`` is handed to the caller. On a CUDA device the preparation
runs on a side stream: the caller's stream waits only for that batch's event (never for the side
stream as a whole, which by then holds the next batch's work), and every tensor handed over is
marked as used by the caller's stream (``record_stream``), so the caching allocator does not give
its memory to the side stream while the step still reads it. Elsewhere the preparation runs in
the caller's thread, one batch ahead. Either way batches come out in the stream's order, each
prepared exactly once: what a step sees does not depend on the device or on the lookahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

Prepared = tuple[Tensor, ...]


class Prefetcher:
    """``Prefetcher(prepare, device)(batches)``: the prepared batches, one ahead (see the module docstring).

    ``prepare(*batch)`` returns a tuple of device tensors; it must not wait for the device.
    """

    def __init__(self, prepare: Callable[..., Prepared], device: torch.device):
        self.prepare, self.device = prepare, torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, batches: Iterable[tuple[Any, ...]]) -> Iterator[Prepared]:
        pending = None
        for batch in batches:
            ready = self._start(batch)
            if pending is not None:
                yield self._finish(*pending)
            pending = ready
        if pending is not None:
            yield self._finish(*pending)

    def _start(self, batch: tuple[Any, ...]) -> tuple[Prepared, torch.cuda.Event | None]:
        if self.stream is None:
            return self.prepare(*batch), None
        with torch.cuda.stream(self.stream):
            out = self.prepare(*batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def _finish(self, out: Prepared, event: torch.cuda.Event | None) -> Prepared:
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in out:
                t.record_stream(current)
        return out
