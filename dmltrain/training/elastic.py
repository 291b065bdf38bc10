"""Elastic runs: when to stop for a leaving node, when a checkpoint is due by time, and what each restart cost.

* :class:`StepSignals` is polled after every optimizer step, on every rank (one all-reduce of two
  flags over a CPU group: no device synchronisation). It says ``leaving`` when any rank's node is
  going away, which a rank sees locally: its process got SIGTERM (a stopping node's raylet sends it
  to its workers, e.g. a spot VM or a Kubernetes pod being reclaimed; :class:`SigtermNotice` makes it
  a notice instead of Ray's immediate exit), its raylet exited, or Ray Train marked its node as
  draining (a preemption notice through Ray's drain API, e.g. the autoscaler or KubeRay). It says
  ``checkpoint`` when ``train.checkpoint_every_s`` seconds passed since the last checkpoint on rank
  0's clock. The trainer then checkpoints at that step
  boundary and, when leaving, raises :class:`NodeLeaving` on every rank, so that Ray Train restarts
  the group on the nodes left from that checkpoint: nothing is lost beyond the step in progress.
* :class:`Restarts` (rank 0) tells each worker group of a run what the previous one reached, through
  the driver's :class:`~.progress.ProgressBoard`, which outlives the groups: each (re)start logs the
  worker count as the metric ``cluster/workers`` (at the first start and whenever it changes), a line
  for the driver to print, and, once the group is back at the step the previous one had reached, the
  tag ``dmltrain.resize.<n>`` with the worker counts, the steps replayed and the seconds lost (from
  the previous group's last step to this group's return to it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from ray.train.v2._internal.execution.callback import WorkerCallback

from dmltrain.tracking.names import RESIZE_TAG_PREFIX, WORKERS

log = logging.getLogger(__name__)
_sigterm_at: list[float] = []  # when this worker process was sent SIGTERM (set by the handler)
_DRAINED = "Ray Train reports the node"


def _on_sigterm(signum, frame) -> None:
    if not _sigterm_at:
        _sigterm_at.append(time.time())


def install_sigterm_notice() -> bool:
    """On a worker process's main thread: SIGTERM becomes a notice that :class:`StepSignals` reads (the workers
    checkpoint at the next step boundary and stop) instead of Ray's handler, which exits at once and loses the
    steps since the last checkpoint. A process that must go after that is killed by Ray (SIGKILL). False off the
    main thread (nothing installed)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


class SigtermNotice(WorkerCallback):
    """Ray Train worker callback: :func:`install_sigterm_notice` where it can be, on each worker's main thread
    (the training function runs on another)."""

    def after_init_train_context(self) -> None:
        install_sigterm_notice()


class NodeLeaving(Exception):
    """Raised on every rank after the checkpoint a leaving node asked for: Ray Train restarts the group on the
    nodes left (one of ``cluster.max_failures``) and it resumes from that checkpoint."""


def _raylet_parent() -> int | None:
    """This process's parent when it is a Ray raylet (a Ray worker's is): the pid to watch; else None."""
    try:
        parent = psutil.Process().parent()
        return parent.pid if parent is not None and "raylet" in parent.name() else None
    except psutil.Error:
        return None


def ray_preemption() -> Any:
    """Ray Train's preemption notice for this worker's group (a drained node), read locally; None without one.

    Ray's public ``ray.train.get_preemption_info()`` is a barrier through an actor on every call; this
    reads the same value (set on each worker by Ray Train's PreemptionWatcher) without one, the
    all-reduce of :class:`StepSignals` sharing it."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().preemption_context.preemption_info
    except Exception:  # noqa: BLE001 — outside Ray Train, or another Ray: no notice to read
        return None


class StepSignals:
    """Per-step ``(leaving, checkpoint)`` decisions, the same on every rank (see the module docstring).

    ``every_s``: ``train.checkpoint_every_s`` (None: no checkpoints by time). A collective: every rank
    constructs it at the same point and calls :meth:`poll` after the same steps.
    """

    def __init__(self, rank: int, world: int, every_s: float | None):
        self.rank, self.world, self.every_s = rank, world, every_s
        self.raylet = _raylet_parent()
        self.reason: str | None = None  # why this rank's node is leaving
        self.last_checkpoint = time.monotonic()
        self.group = None
        if world > 1 and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # host flags: no wait on the device's stream

    def local_reason(self) -> str | None:
        """Why this rank's node is going away, seen from this process alone; None while it stays. (A drained node
        is told to every rank: only rank 0 says so.)"""
        if _sigterm_at:
            return "its process was sent SIGTERM (its node is stopping)"
        if self.raylet is not None and os.getppid() != self.raylet:
            return f"its raylet (pid {self.raylet}) exited"
        info = ray_preemption()
        if info is not None:
            deadline = getattr(info, "deadline_ms", None)
            left = f", {max(0.0, deadline / 1000 - time.time()):.0f} s before its deadline" if deadline else ""
            ranks = getattr(info, "preempted_ranks", None)
            return f"{_DRAINED} of rank(s) {ranks} draining{left}"
        return None

    def poll(self) -> tuple[bool, bool]:
        """``(leaving, checkpoint)`` after a step, agreed by every rank."""
        if self.reason is None:
            self.reason = self.local_reason()
            if self.reason is not None and (self.rank == 0 or not self.reason.startswith(_DRAINED)):
                log.warning("%s; the workers checkpoint at this step and stop", self.reason)
        due = self.rank == 0 and self.every_s is not None and time.monotonic() - self.last_checkpoint >= self.every_s
        flags = torch.tensor([float(self.reason is not None), float(due)])
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def checkpointed(self) -> None:
        """A checkpoint was just saved: the next one by time is ``every_s`` from now."""
        self.last_checkpoint = time.monotonic()


@dataclass
class Resize:
    """A restart of the worker group, accounted for once its first step is done and its replay is over."""

    number: int
    before: int  # workers of the previous group
    after: int
    reached: int  # the last step the previous group completed
    resumed: int  # the checkpoint's step
    reached_at: float  # when (time.time()) the previous group completed it
    first_step_s: float | None = None  # from then to this group's first step
    lost_s: float | None = None  # from then to this group's return to step ``reached``

    def text(self) -> str:
        replayed = self.reached - self.resumed
        return (
            f"{self.before} -> {self.after} workers at step {self.reached}: resumed from step {self.resumed}, "
            f"first step {self.first_step_s:.1f} s after the last at {self.before} workers, "
            f"{replayed} step{'s' * (replayed != 1)} replayed, {self.lost_s:.1f} s lost"
        )


class Restarts:
    """Rank 0's account of this worker group's start and of the restart it may be (see the module docstring).

    ``board``: the driver's :class:`~.progress.ProgressBoard` handle (None: no driver to tell, e.g. a Tune
    trial or a direct call: then only the worker count is logged); ``logger``: the run's
    :class:`~dmltrain.tracking.run.RunHandle`.
    """

    def __init__(self, board: Any, logger: Any, world: int):
        self.board, self.logger, self.world = board, logger, world
        self.pending: Resize | None = None

    def started(self, step: int, saved_world: int | None) -> None:
        """This group starts at ``step`` (the checkpoint's; 0 for a new run) whose state was saved by
        ``saved_world`` workers (None: a new run)."""
        previous, number = self._previous()
        before = previous["world"] if previous is not None else saved_world
        if before != self.world and self.logger is not None:
            self.logger.log_metrics({WORKERS: self.world}, step=step, again=True)
        if previous is None:
            if saved_world is not None and saved_world != self.world:
                self._say(f"resumed at {self.world} workers from a checkpoint saved by {saved_world} (step {step})")
            return
        r = Resize(number, previous["world"], self.world, previous["step"], step, previous["time"])
        if step >= r.reached:  # nothing to replay: back where the previous group was, once loaded
            r.lost_s = time.time() - r.reached_at
        self.pending = r
        self._say(
            f"{r.before} -> {self.world} workers: restarted from the checkpoint of step {step} "
            f"(the previous group had reached step {r.reached})"
        )

    def reached(self, step: int) -> None:
        """This group completed ``step``: posted to the board; the restart's account is done once this group took a
        step and is back at the step the previous one had reached (its replay over)."""
        now = time.time()
        if self.board is not None:
            self.board.reach.remote(step, self.world, now)
        r = self.pending
        if r is None:
            return
        if r.first_step_s is None:
            r.first_step_s = now - r.reached_at
        if r.lost_s is None and step >= r.reached:
            r.lost_s = now - r.reached_at
        if r.lost_s is None:
            return
        self.pending = None
        self._say(r.text())
        if self.logger is not None:
            self.logger.set_tag(f"{RESIZE_TAG_PREFIX}{r.number}", r.text())

    def _previous(self) -> tuple[dict[str, Any] | None, int]:
        if self.board is None:
            return None, 0
        import ray

        try:
            return ray.get(self.board.restarted.remote(), timeout=30)
        except Exception:  # noqa: BLE001 — no board to ask (the driver is gone): as if this were the first group
            return None, 0

    def _say(self, line: str) -> None:
        log.info("%s", line)
        if self.board is not None:
            self.board.event.remote(f"workers: {line}")
