"""Whether a worker group still trains its run: its driver alive, and still the run's driver.

A driver killed outright (SIGKILL, a lost machine) can leave its workers running until Ray notices,
and they would go on logging into the run's MLflow run and saving checkpoints next to the workers
of a driver that resumes the run (two values at one step, a checkpoint from a dead schedule). So
wherever the workers write (a log point, an evaluation, a checkpoint), :meth:`Fence.check` asks,
on rank 0, and shares the verdict with one all-reduce, so that every rank stops at the same call:

* the run's record (``<run>/driver.json``, :mod:`cluster.run_records`) must still be this group's
  driver's: its ``generation`` (every driver that (re)starts the run raises it) and status RUNNING;
* the driver must be alive (:func:`driver_alive`): in the same process namespace of the same host,
  its pid, started when recorded; from elsewhere, the record's heartbeat (fresher than
  :data:`STALE_AFTER_S`).

A group that fails raises :class:`Superseded` on every rank: nothing more is logged or saved. A run
under a URL root keeps no record: there only the driver's pid is checked, where it can be.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

STALE_AFTER_S = 180.0  # a record untouched this long: its driver (heartbeat every 30 s) is gone


class Superseded(Exception):
    """This worker group's driver died, or another driver took the run over: the group stops, writing nothing."""


def pid_namespace() -> str | None:
    """This process's pid namespace (Linux), so that a pid is compared only where it means the same process."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def driver_alive(host: str, pid: int, pid_started: float, pidns: str | None, record: Path | None) -> bool:
    """Whether the driver (``pid`` started at ``pid_started`` on ``host`` in pid namespace ``pidns``) still runs:
    seen directly where its pid means it (same host and namespace; ``pidns`` None: same host is enough),
    else by its record's heartbeat (``record``: the file it touches; None: taken as alive)."""
    if host == socket.gethostname() and (pidns is None or pidns == pid_namespace()):
        try:
            return abs(psutil.Process(pid).create_time() - pid_started) < 1.0
        except psutil.Error:
            return False
    if record is None:
        return True
    try:
        return time.time() - record.stat().st_mtime < STALE_AFTER_S
    except OSError:
        return False


@dataclass(frozen=True)
class DriverInfo:
    """What the workers know of their driver (passed in the run context)."""

    host: str
    pid: int
    pid_started: float
    pidns: str | None
    generation: int | None  # the run's generation this driver trains; None without a record
    record: str | None  # the run record's path; None under a URL root

    @classmethod
    def this_process(cls, generation: int | None, record: Path | None) -> DriverInfo:
        return cls(
            socket.gethostname(),
            os.getpid(),
            psutil.Process().create_time(),
            pid_namespace(),
            generation,
            None if record is None else str(record),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def why_not_current(self) -> str | None:
        """Why a group of this driver must stop (see the module doc); None when it trains the run."""
        record = None if self.record is None else Path(self.record)
        if record is not None:
            try:
                data = json.loads(record.read_text())
                generation, status = data.get("generation", 1), data.get("status")
            except (OSError, ValueError, AttributeError):
                generation, status = None, None  # gone or unreadable: not this driver's record any more
            if generation != self.generation:
                return f"another driver took the run over (generation {generation}, this group's {self.generation})"
            if status != "RUNNING":
                return f"the driver ended the run ({status})"
        if not driver_alive(self.host, self.pid, self.pid_started, self.pidns, record):
            return f"the driver (pid {self.pid} on {self.host}) died"
        return None


class Fence:
    """:meth:`check` at every point where the workers write (a collective: every rank calls it); a no-op without a
    driver to watch (a Tune trial, which Tune supervises, or a direct call)."""

    def __init__(self, driver: dict[str, Any] | None, rank: int, device: Any):
        self.driver = None if driver is None else DriverInfo(**driver)
        self.rank, self.device = rank, device

    def check(self) -> None:
        """Raise :class:`Superseded` on every rank when rank 0 finds its group is not the run's current one."""
        if self.driver is None:
            return
        import torch  # here: the driver imports this module for driver_alive, without torch
        import torch.distributed as dist

        why = self.driver.why_not_current() if self.rank == 0 else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1.0 if why else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and why is None:
                why = "rank 0 found the group superseded"
        if why:
            raise Superseded(f"this worker group stops: {why}; nothing more is logged or saved")
