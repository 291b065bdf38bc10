"""Where a training step's time goes: data / forward / backward / optimizer, and the throughput between log points.

The one place that times steps. On the CPU each part is wall-clock time between :meth:`StepTimer.lap`
calls. On a CUDA device a lap records an event on the current stream instead of waiting for the
device, so the host keeps queueing work ahead and the next batch's copy and decoding (a side
stream) overlap compute; :meth:`StepTimer.summary` waits for the last event once per log point and
sums the intervals between events. The parts are then device time: ``data`` runs from the end of
the previous step to the moment the device could start this one (a device waiting for its batch,
or for a host that is late to queue it, counts here), ``forward``, ``backward`` and ``optimizer`` each
the device time of their own kernels (``optimizer``: the engine's and the classifier's steps;
``time/step_ms`` is the wall time per step). Work outside training steps (evaluation, checkpoints) runs
inside :meth:`StepTimer.aside` and is left out of ``time/step_ms`` and ``images_per_s``; so is work
inside a step that is not the step's (the classifier's probe), and out of the part it falls in too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from dmltrain.tracking.names import IMAGES_PER_S, STEP_MS


class StepTimer:
    """``start()`` before fetching a batch, ``lap(part)`` after each part of the step, in ``PARTS`` order."""

    PARTS = ("data", "forward", "backward", "optimizer")

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.total = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self.window_start = time.perf_counter()
        self._last = self.window_start
        self._events: list[list[torch.cuda.Event]] = []  # per step: its start, then one per part
        self._current: list[torch.cuda.Event] = []
        self._boundary: torch.cuda.Event | None = None  # the end of the previous step, where the next one starts
        self._asides: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # (part, start, end) inside steps

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self, from_now: bool = False) -> None:
        """A step begins (its ``data`` part counts from here: on CUDA, from the previous step's end, unless
        ``from_now``: a loop whose steps take turns with another's, ``dmltrain bench train --compile``)."""
        self._last = time.perf_counter()
        if self.cuda:
            self._current = [self._boundary if self._boundary is not None and not from_now else self._record()]

    def lap(self, part: str) -> None:
        """``part`` of the current step has finished; the last part (``optimizer``) completes the step."""
        done = part == self.PARTS[-1]
        if self.cuda:
            self._current.append(self._record())
            if done:
                self._events.append(self._current)
                self._boundary = self._current[-1]
                self.steps += 1
            return
        now = time.perf_counter()
        self.total[part] += now - self._last
        self._last = now
        if done:
            self.steps += 1

    @contextlib.contextmanager
    def aside(self, sync: bool = False) -> Iterator[None]:
        """Time spent in the block is left out of the throughput (evaluation, checkpoints) and, inside a
        step, out of the part it falls in. ``sync``: on CUDA, wait for the device before the block (that
        wait is the step's) and at its end, so that the block's device work is left out of the wall time
        too (the probe: two synchronisations on the steps that run it)."""
        if sync and self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        start = self._record() if self.cuda and self._current else None
        try:
            yield
        finally:
            if sync and self.cuda:
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - t0
            self.window_start += elapsed
            self._last += elapsed
            if start is not None:
                self._asides.append((len(self._current) - 1, start, self._record()))
            else:
                self._boundary = None  # the next step's data part starts after the block, not before it

    def _device_totals(self) -> None:
        if not self._events:
            return
        self._events[-1][-1].synchronize()  # the one wait, once per log point
        for events in self._events:
            for i, part in enumerate(self.PARTS):
                self.total[part] += events[i].elapsed_time(events[i + 1]) / 1000
        for i, start, end in self._asides:
            self.total[self.PARTS[i]] -= start.elapsed_time(end) / 1000

    def summary(self, global_batch: int) -> dict[str, float]:
        """Mean ms per part, wall ms per step and images/s since the last summary; starts a new window."""
        if self.cuda:
            self._device_totals()
        n = max(1, self.steps)
        wall = max(1e-9, time.perf_counter() - self.window_start)
        out = {f"time/{k}_ms": 1000 * v / n for k, v in self.total.items()}
        out[STEP_MS] = 1000 * wall / n
        out[IMAGES_PER_S] = global_batch * self.steps / wall
        self.reset()
        return out
