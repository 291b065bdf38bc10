"""Where a training step's time goes: data / forward / backward / step, and the throughput between log points.

The one place that times steps (and so the one place that waits for the device to do so):
:meth:`StepTimer.lap` synchronises a CUDA device before reading the clock at the end of
``forward``, ``backward`` and ``step``, so each holds its own kernels; ``data`` ends on the
host (the batch's copies to the device are queued, not waited for). Work outside training steps (evaluation, checkpoints) runs inside
:meth:`StepTimer.aside` and is left out of ``time/step_ms`` and ``images_per_s``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from dmltrain.tracking.names import IMAGES_PER_S, STEP_MS


class StepTimer:
    """``start()`` before fetching a batch, ``lap(part)`` after each part of the step, in ``PARTS`` order."""

    PARTS = ("data", "forward", "backward", "step")

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.total = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self.window_start = time.perf_counter()
        self._last = self.window_start

    def start(self) -> None:
        """A step begins (its ``data`` part counts from here)."""
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        """``part`` of the current step has finished; the last part (``step``) completes the step."""
        if self.device.type == "cuda" and part != "data":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.total[part] += now - self._last
        self._last = now
        if part == self.PARTS[-1]:
            self.steps += 1

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Time spent in the block is left out of the throughput (evaluation, checkpoints)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - t0

    def summary(self, global_batch: int) -> dict[str, float]:
        """Mean ms per part, wall ms per step and images/s since the last summary; starts a new window."""
        n = max(1, self.steps)
        wall = max(1e-9, time.perf_counter() - self.window_start)
        out = {f"time/{k}_ms": 1000 * v / n for k, v in self.total.items()}
        out[STEP_MS] = 1000 * wall / n
        out[IMAGES_PER_S] = global_batch * self.steps / wall
        self.reset()
        return out
