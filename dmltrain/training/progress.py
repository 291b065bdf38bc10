"""Live progress of a training on the driver.

Rank 0 posts small dicts (epoch, step, loss, images/s, ...) to a ``ProgressBoard`` actor;
the driver polls it from a thread and draws one status line. An actor rather than a file
because rank 0 and the driver may sit on different machines of a cluster.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from typing import Any

import ray

from dmltrain.text import format_duration


@ray.remote(num_cpus=0)
class ProgressBoard:
    """The driver's actor (on the driver's node: it outlives every worker group of the run) that rank 0
    posts to: the progress line, the summary, the last step reached (:mod:`.elastic`) and lines for the
    driver to print (``events``)."""

    def __init__(self) -> None:
        self._latest: dict[str, Any] = {}
        self._summary: dict[str, Any] = {}
        self._reached: dict[str, Any] | None = None
        self._events: list[str] = []
        self._restarts = 0

    def update(self, info: dict[str, Any]) -> None:
        self._latest = {**self._latest, **info}

    def reach(self, step: int, world: int, at: float) -> None:
        self._reached = {"step": step, "world": world, "time": at}

    def restarted(self) -> tuple[dict[str, Any] | None, int]:
        """The last step a previous group of this run reached (None: this is the first), and this group's number."""
        self._restarts += 1
        return self._reached, self._restarts - 1

    def event(self, line: str) -> None:
        self._events.append(line)

    def take_events(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def set_summary(self, summary: dict[str, Any]) -> None:
        # merged: with asynchronous evaluation the workers post the position and the evaluation tasks the metrics
        self._summary = {**self._summary, **summary}

    def get(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._latest, self._summary


def post(board_name: str | None, info: dict[str, Any], summary: bool = False) -> None:
    """Fire-and-forget update from a worker; silently absent boards are fine (e.g. under Tune).

    A ``summary`` is waited for (briefly): the driver reads it as soon as the training returns,
    and it may carry the reason the run failed.
    """
    if not board_name:
        return
    try:
        board = _board(board_name)
    except ValueError:
        return
    if summary:
        try:
            ray.get(board.set_summary.remote(info), timeout=30)
        except Exception:  # noqa: BLE001 — the driver reports a missing summary itself
            pass
    else:
        board.update.remote(info)


def board_handle(board_name: str | None):
    """The driver's board, or None when there is none (no name, or gone)."""
    if not board_name:
        return None
    try:
        return _board(board_name)
    except ValueError:
        return None


@functools.lru_cache(maxsize=4)
def _board(name: str):
    # one lookup on the Ray head per process, not one per log line (a missing board raises and is not cached)
    return ray.get_actor(name)


def format_line(info: dict[str, Any]) -> str:
    if not info:
        return "starting workers..."
    parts = [
        f"epoch {info.get('epoch', 0) + 1}/{info.get('epochs', '?')}",
        f"step {info.get('step', 0)}/{info.get('total_steps', '?')}",
    ]
    if "phase" in info:
        parts.append(info["phase"])
    if "loss" in info:
        parts.append(f"loss {info['loss']:.4f}")
    if "images_per_s" in info:
        parts.append(f"{info['images_per_s']:.0f} img/s")
    if info.get("eta_s") is not None:
        parts.append(f"ETA {format_duration(info['eta_s'])}")
    if "last_eval" in info:
        parts.append(info["last_eval"])
    return " | ".join(parts)


class ProgressPrinter:
    """Polls a board and prints: a rewritten line on a terminal, a line every ``interval`` s otherwise
    (``progress`` False: none); the workers' lines (board events) either way, each also handed to ``on_event``.
    ``stream`` None: the ``sys.stderr`` of the moment it is made (not of the module's import: it may be another now)."""

    def __init__(
        self,
        board,
        interval: float = 1.0,
        log_interval: float = 15.0,
        stream=None,
        *,
        progress: bool = True,
        on_event=None,
    ):
        stream = sys.stderr if stream is None else stream
        self.board, self.interval, self.log_interval, self.stream = board, interval, log_interval, stream
        self.progress, self.on_event = progress, on_event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._last_line = ""

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:  # the last lines the workers posted (a group's last words before the run ended)
            self._print_events(ray.get(self.board.take_events.remote(), timeout=5))
        except Exception:  # noqa: BLE001 — the board is gone: nothing more to print
            pass
        if self._tty and self._last_line:
            self.stream.write("\n")
            self.stream.flush()

    def _print_events(self, events: list[str]) -> None:
        for event in events:  # a line of its own, above the progress line
            self.stream.write(("\r\033[K" if self._tty and self._last_line else "") + event + "\n")
            self._last_line = ""
            if self.on_event is not None:
                self.on_event(event)
        if events:
            self.stream.flush()

    def _run(self) -> None:
        last_print = 0.0
        while not self._stop.wait(self.interval):
            try:
                info, _ = ray.get(self.board.get.remote(), timeout=5)
                events = ray.get(self.board.take_events.remote(), timeout=5)
            except Exception:  # noqa: BLE001 — the board may be restarting; the next poll will tell
                continue
            self._print_events(events)
            if not self.progress:
                continue
            line = format_line(info)
            now = time.monotonic()
            if self._tty:
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
                self._last_line = line
            elif line != self._last_line and now - last_print >= self.log_interval:
                self.stream.write(line + "\n")
                self.stream.flush()
                self._last_line, last_print = line, now


class WorkerEvents(logging.Handler):
    """On a worker: dmltrain's WARNING and above, posted to the driver's board as a line (``rank r: ...``) for it to
    print and log; at most ``limit`` lines a process, then one saying how to see the rest (the worker's own log)."""

    LOGGERS = ("dmltrain", "shards", "cluster")

    def __init__(self, board: Any, rank: int, limit: int = 50):
        super().__init__(logging.WARNING)
        self.board, self.rank, self.limit, self.sent = board, rank, limit, 0
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self.sent > self.limit:
            return
        self.sent += 1
        line = self.format(record) if self.sent <= self.limit else "more worker warnings: see the workers' logs"
        try:
            self.board.event.remote(f"rank {self.rank}: {line}")
        except Exception:  # noqa: BLE001 — the driver is gone: nobody to tell
            pass

    @classmethod
    def install(cls, board: Any, rank: int) -> WorkerEvents | None:
        """Attach one to dmltrain's loggers of this worker process (once); None without a board."""
        if board is None:
            return None
        handler = cls(board, rank)
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            logger.handlers = [h for h in logger.handlers if not isinstance(h, cls)] + [handler]
        return handler
