"""The driver's record in each run folder: which driver trains the run, from which config, into which MLflow run.

``dmltrain train`` writes ``<storage>/<run name>/driver.json`` when it starts and its final
status when it ends. A driver killed outright (SIGKILL, a lost machine) never writes that end, so
the record is also how a later start tells a crashed run from a live one:

* on the same host, the recorded pid must still be running and have been started when the
  record says (a reused pid is another process);
* from another host (a shared storage path), the live driver touches its record every
  :data:`HEARTBEAT_S` seconds; one untouched for :data:`STALE_AFTER_S` is dead.

:func:`latest_run` finds the most recent run of a config (``dmltrain train CONFIG --resume``);
:func:`crashed_runs` lists the runs whose record says RUNNING but whose driver is gone.
Records live only on a local or shared file system; a remote ``cluster.storage_path`` (``s3://``)
keeps none.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dmltrain.fileio import write_json
from dmltrain.redact import redact

RECORD_FILE = "driver.json"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 180.0
RUNNING = "RUNNING"


@dataclass
class RunRecord:
    run_name: str
    config: str | None  # the config file's absolute path; None when started from Python
    mlflow_run_id: str | None
    tracking_uri: str
    host: str
    pid: int
    pid_started: float  # the driver process's start time (psutil's create_time)
    started: float  # when this driver started the run (time.time())
    status: str = RUNNING  # RUNNING, FINISHED, FAILED or KILLED

    @classmethod
    def for_this_driver(
        cls, run_name: str, config: str | None, mlflow_run_id: str | None, tracking_uri: str
    ) -> RunRecord:
        return cls(
            run_name,
            config,
            mlflow_run_id,
            tracking_uri,
            socket.gethostname(),
            os.getpid(),
            psutil.Process().create_time(),
            time.time(),
        )

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord | None:
        """The record in ``run_dir``; None when there is none or it cannot be read (an older run's folder)."""
        try:
            data = json.loads((run_dir / RECORD_FILE).read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError):
            return None

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / RECORD_FILE, redact(asdict(self)))  # a run folder is shared: no URL password in it

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def driver_alive(self, run_dir: Path) -> bool:
        """Whether the recorded driver is still running (see the module doc); this process's own record is not."""
        if self.is_this_process():
            return False  # one process trains its runs one after another: an earlier one of ours has ended
        if self.host == socket.gethostname():
            try:
                return abs(psutil.Process(self.pid).create_time() - self.pid_started) < 1.0
            except psutil.Error:
                return False
        try:
            return time.time() - (run_dir / RECORD_FILE).stat().st_mtime < STALE_AFTER_S
        except OSError:
            return False

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


class Heartbeat:
    """Touches a record every :data:`HEARTBEAT_S` seconds from a daemon thread until :meth:`stop`."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / RECORD_FILE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dmltrain-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the folder went away: the run's own errors say why

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _records(root: Path) -> list[tuple[Path, RunRecord]]:
    out = []
    for path in sorted(root.glob(f"*/{RECORD_FILE}")):
        record = RunRecord.read(path.parent)
        if record is not None:
            out.append((path.parent, record))
    return out


def latest_run(root: Path, config: str | None) -> str | None:
    """The name of the most recently started run under ``root`` trained from ``config``; None if there is none."""
    mine = [r for _, r in _records(root) if r.config == config]
    return max(mine, key=lambda r: r.started).run_name if mine else None


def crashed_runs(root: Path) -> list[tuple[Path, RunRecord]]:
    """The runs under ``root`` recorded as RUNNING whose driver is gone."""
    return [(d, r) for d, r in _records(root) if r.status == RUNNING and not r.driver_alive(d)]
