"""Where Ray's own messages go while dmltrain trains: the run's log file, not the terminal.

A run's terminal shows dmltrain: its progress line, its summary, and the lines its workers post to
the driver (a worker count that changed, a corrupt shard member). Ray speaks
through three channels, each configured here rather than filtered:

* the driver's Python loggers (``ray`` and below: "Started a local Ray instance", "Connecting to
  existing Ray cluster"; Ray's token-authentication WARNING is not even made, as
  :func:`cluster.launch.start_local_ray` chooses that mode itself): :func:`route_ray_logs` gives them
  the run's log file (``<run>/driver.log``), and keeps records of ERROR and above on stderr too, the
  ones a user must act on;
* what Ray's own actors and workers print (Ray Train's controller, its ``PlacementGroupCleaner``
  tracebacks when the GCS is slow to answer, the ``core_worker.cc`` error about the
  ``PreemptionWatcher`` actor's restart): :func:`cluster.launch.init_ray` starts or joins Ray with
  ``log_to_driver=False``, so they stay in the session's log folder on their node
  (``<session>/logs``, read with ``ray logs``), which :func:`where_logs_went` names once;
* dmltrain's own workers: their warnings reach the driver as board events
  (:class:`dmltrain.training.progress.WorkerEvents`), printed above the progress line and written to the log file.

The file is this user's alone (0600).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOG_FILE = "driver.log"  # in the run's folder
_RAY_LOGGER = "ray"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _RunLogs(logging.Handler):
    """The one handler on Ray's logger while runs train in this driver: each record goes to every active run's log
    file (a study trains several at once, in threads, over one Ray; Ray's messages are the driver's, not a run's).
    Ray's ``ray.init`` sets its format on the handlers it finds there: the files keep theirs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.files: list[logging.Handler] = []

    def emit(self, record: logging.LogRecord) -> None:
        for handler in list(self.files):
            handler.handle(record)


_lock = threading.Lock()
_router: _RunLogs | None = None
_saved: tuple[list[logging.Handler], bool, int] | None = None  # Ray's logger before the first active run


@contextmanager
def route_ray_logs(log_file: Path | None) -> Iterator[Path | None]:
    """While the block runs: Ray's Python loggers on this driver write to ``log_file`` (created 0600, appended to),
    records of ERROR and above also to stderr; once no run's block is active, they are as they were. Blocks may
    overlap in any order (runs in threads): meanwhile Ray's records go to every active run's file. ``log_file``
    None (a run under a URL, with no local folder): nothing changes."""
    global _router, _saved
    if log_file is None:
        yield None
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)
    to_file = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8"))
    to_file.setFormatter(logging.Formatter(_FORMAT))
    ray_logger = logging.getLogger(_RAY_LOGGER)
    with _lock:
        if _router is None:
            _saved = ray_logger.handlers[:], ray_logger.propagate, ray_logger.level
            must_act = logging.StreamHandler(sys.stderr)
            must_act.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            must_act.setLevel(logging.ERROR)
            _router = _RunLogs()
            ray_logger.handlers = [_router, must_act]
            ray_logger.propagate = False
            if ray_logger.level == logging.NOTSET or ray_logger.level > logging.INFO:
                ray_logger.setLevel(logging.INFO)
        _router.files.append(to_file)
    try:
        yield log_file
    finally:
        with _lock:
            _router.files.remove(to_file)
            if not _router.files:
                ray_logger.handlers, ray_logger.propagate = _saved[0], _saved[1]
                ray_logger.setLevel(_saved[2])
                _router = _saved = None
        to_file.close()


def append(log_file: Path | None, line: str) -> None:
    """``line`` at the end of the run's log file (a board event, printed on the terminal too)."""
    if log_file is None:
        return
    try:
        with open(log_file, "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
    except OSError:
        pass  # the terminal has it; a log file that cannot be written does not stop a run


def where_logs_went(log_file: Path | None) -> str:
    """One line naming where Ray's messages go: the driver's (``log_file``) and its processes' (the session folder)."""
    parts = []
    if log_file is not None:
        parts.append(f"Ray's messages on this driver: {log_file}")
    session = _session_logs()
    if session is not None:
        parts.append(f"its workers' and processes' logs: {session} on each node (`ray logs` lists them)")
    return "; ".join(parts)


def _session_logs() -> str | None:
    try:
        import ray

        node = ray._private.worker._global_node
        return None if node is None else str(Path(node.get_session_dir_path()) / "logs")
    except Exception:  # noqa: BLE001 — no local node (a Ray client): nothing to name
        return None
