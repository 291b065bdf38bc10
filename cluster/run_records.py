"""The driver's record in each run folder: which driver trains the run, from which config, into which MLflow run.

``dmltrain train`` writes ``<storage>/<run name>/driver.json`` when it starts and its final
status when it ends. A driver killed outright (SIGKILL, a lost machine) never writes that end, so
the record is also how a later start tells a crashed run from a live one:

* on the same host, the recorded pid must still be running and have been started when the
  record says (a reused pid is another process);
* from another host (a shared storage path), the live driver touches its record every
  :data:`HEARTBEAT_S` seconds; one untouched for ``fence.STALE_AFTER_S`` is dead
  (:func:`dmltrain.training.fence.driver_alive`, which the workers ask too).

One process may train several runs at once (a study's or a search's ``--parallel`` points, in threads): a record
of this process is alive while :func:`training` marks its run, so that one point starting never takes another,
still training, for a crashed run (which would end it: its workers stop when their record says FAILED).

Each driver that (re)starts a run raises the record's ``generation``: workers of an earlier driver
of the run see that they are not its current workers any more (:mod:`dmltrain.training.fence`).

A record is data, never instructions: whoever can write the storage folder can write one. Its
fields are checked when it is read (a record that fails is one line naming the file and the field),
the MLflow store it names is never contacted (the current config's is), and nothing printed from
it reaches the terminal with control characters.

:func:`latest_run` finds the most recent run of a config (``dmltrain train CONFIG --resume``);
:func:`crashed_runs` lists the runs whose record says RUNNING but whose driver is gone.
Records live only on a local or shared file system; a remote ``cluster.storage_path`` (``s3://``)
keeps none.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from dmltrain.config import RUN_NAME_PATTERN
from dmltrain.errors import UserError
from dmltrain.fileio import write_json
from dmltrain.redact import redact
from dmltrain.text import printable
from dmltrain.training.fence import driver_alive, pid_namespace

RECORD_FILE = "driver.json"
HEARTBEAT_S = 30.0
RUNNING = "RUNNING"
STATUSES = (RUNNING, "FINISHED", "FAILED", "KILLED")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # MLflow run ids (32 hex digits), with room for other stores'


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
    generation: int = 1  # raised by every driver that (re)starts the run
    pidns: str | None = None  # the driver's pid namespace: where its pid means it

    @classmethod
    def for_this_driver(
        cls,
        run_name: str,
        config: str | None,
        mlflow_run_id: str | None,
        tracking_uri: str,
        *,
        after: RunRecord | None = None,
    ) -> RunRecord:
        """This process's record of the run; ``after``: the record of the run's previous driver, if any."""
        return cls(
            run_name,
            config,
            mlflow_run_id,
            tracking_uri,
            socket.gethostname(),
            os.getpid(),
            psutil.Process().create_time(),
            time.time(),
            generation=after.generation + 1 if after is not None else 1,
            pidns=pid_namespace(),
        )

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord | None:
        """The record in ``run_dir``; None when there is none. One that cannot be read or whose fields are not
        what this module writes (a pid that is not an integer, a run name that is not the folder's, ...)
        raises a one-line :class:`UserError` naming the file and the field."""
        path = run_dir / RECORD_FILE
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise UserError(f"{printable(path)}: not a readable run record ({printable(e, 120)})") from None
        problem = _problem(data, run_dir.name)
        if problem:
            raise UserError(f"{printable(path)}: not a run record dmltrain wrote ({problem})")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / RECORD_FILE, redact(asdict(self)))  # a run folder is shared: no URL password in it

    def is_this_process(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid()

    def driver_alive(self, run_dir: Path) -> bool:
        """Whether the recorded driver is still running (see the module doc); this process's own record is alive
        while the process trains that run (:func:`training`), and not after."""
        if self.is_this_process():
            return _key(run_dir) in _TRAINING  # another thread of this process trains it now, or it has ended
        return driver_alive(self.host, self.pid, self.pid_started, self.pidns, run_dir / RECORD_FILE)

    def describe(self) -> str:
        return f"pid {self.pid} on {printable(self.host, 80)}"


_TRAINING: set[str] = set()  # the run folders this process trains now
_TRAINING_LOCK = threading.Lock()


def _key(run_dir: Path) -> str:
    return os.path.realpath(run_dir)


def training(run_dir: Path, now: bool) -> None:
    """Mark (``now``) or unmark the run in ``run_dir`` as trained by this process: its record then counts as a live
    driver's to the other threads of the process (:meth:`RunRecord.driver_alive`)."""
    with _TRAINING_LOCK:
        (_TRAINING.add if now else _TRAINING.discard)(_key(run_dir))


def _problem(data: Any, folder: str) -> str | None:
    """What is wrong with a record's fields (``folder``: the name of the run folder it lies in); None if nothing."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    checks = {
        "run_name": lambda v: isinstance(v, str) and re.match(RUN_NAME_PATTERN, v) is not None and v == folder,
        "config": lambda v: v is None or isinstance(v, str),
        "mlflow_run_id": lambda v: v is None or (isinstance(v, str) and _RUN_ID.fullmatch(v) is not None),
        "tracking_uri": lambda v: isinstance(v, str),
        "host": lambda v: isinstance(v, str) and 0 < len(v) <= 255,
        "pid": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
        "pid_started": number,
        "started": number,
        "status": lambda v: v in STATUSES,
        "generation": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "pidns": lambda v: v is None or (isinstance(v, str) and len(v) <= 64),
    }
    optional = {"status", "generation", "pidns"}
    for key, ok in checks.items():
        if key not in data:
            if key not in optional:
                return f"{key}: missing"
        elif not ok(data[key]):
            return f"{key}: {printable(json.dumps(data[key]), 60)} is not " + _EXPECTED[key]
    return None


_EXPECTED = {
    "run_name": "the run folder's name",
    "config": "a path or null",
    "mlflow_run_id": "an MLflow run id or null",
    "tracking_uri": "a string",
    "host": "a host name",
    "pid": "a process id (a positive integer)",
    "pid_started": "a time (a number)",
    "started": "a time (a number)",
    "status": "one of " + ", ".join(STATUSES),
    "generation": "a positive integer",
    "pidns": "a pid namespace or null",
}


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
    """The readable records of the runs under ``root``; each one that is not is left out, with one warning line."""
    out = []
    for path in sorted(root.glob(f"*/{RECORD_FILE}")):
        try:
            record = RunRecord.read(path.parent)
        except UserError as e:
            print(f"dmltrain: warning: {e}; left alone", file=sys.stderr)
            continue
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
