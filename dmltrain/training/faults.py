"""Fault injection for tests, through the environment (``dmltrain train`` passes every ``DMLTRAIN_FAULT_*``
variable on to its workers).

* ``DMLTRAIN_FAULT_NAN_AT_STEP=k``: step ``k``'s embeddings become NaN on every worker (a diverged loss,
  :mod:`.divergence`).
* ``DMLTRAIN_FAULT_HOLD=k:FOLDER``: every worker stops before step ``k`` (steps ``1..k-1`` done, their logs
  and checkpoints reported) and waits until ``FOLDER/release`` exists, having written
  ``FOLDER/held-rank<r>-<pid>``: a test knows a live worker of the run and its pid, kills it (or its driver)
  while the run cannot end, then releases. Once ``release`` exists no worker holds again (a restarted group,
  a resumed run). A hold gives up after :data:`HOLD_LIMIT_S`. A held worker that receives Ray Train's preemption
  notice (its node drained) writes ``FOLDER/notice-rank<r>``: a test releases the workers once they know, so that
  they save the step they are held before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_PREFIX = "DMLTRAIN_FAULT_"
FAULT_ENV = FAULT_PREFIX + "NAN_AT_STEP"
HOLD_ENV = FAULT_PREFIX + "HOLD"
RELEASE = "release"
HOLD_LIMIT_S = 600.0


def fault_env() -> dict[str, str]:
    """The fault-injection variables of this process's environment (for the workers' environment)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FAULT_PREFIX)}


def injected_nan_step() -> int | None:
    """The step at which a test asked for NaN embeddings (:data:`FAULT_ENV`), or None."""
    raw = os.environ.get(FAULT_ENV, "").strip()
    return int(raw) if raw else None


class Hold:
    """:data:`HOLD_ENV` for one worker: :meth:`before` each step waits at the asked one (see the module doc)."""

    def __init__(self, step: int, folder: Path, rank: int):
        self.step, self.folder, self.rank = step, folder, rank

    @classmethod
    def from_env(cls, rank: int) -> Hold | None:
        raw = os.environ.get(HOLD_ENV, "").strip()
        if not raw:
            return None
        step, _, folder = raw.partition(":")
        return cls(int(step), Path(folder), rank)

    def before(self, step: int) -> None:
        if step != self.step or (self.folder / RELEASE).exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"held-rank{self.rank}-{os.getpid()}").touch()
        from dmltrain.training.elastic import ray_preemption

        deadline, noticed = time.monotonic() + HOLD_LIMIT_S, False
        while not (self.folder / RELEASE).exists() and time.monotonic() < deadline:
            if not noticed and ray_preemption() is not None:
                (self.folder / f"notice-rank{self.rank}").touch()
                noticed = True
            time.sleep(0.05)
