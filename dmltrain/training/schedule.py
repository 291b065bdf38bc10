"""Learning-rate schedule of a run: head-only start, linear warm-up, then constant, step or cosine decay.

Everything is a pure function of the global step, so a resumed run continues the schedule
exactly. Lengths given in epochs are converted with the (rank-identical) number of batches
per epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dmltrain.config import ScheduleConfig


@dataclass(frozen=True)
class LRSchedule:
    cfg: ScheduleConfig
    steps_per_epoch: int
    total_steps: int

    def _steps(self, n: int) -> int:
        return n * self.steps_per_epoch if self.cfg.unit == "epoch" else n

    def head_only(self, step: int) -> bool:
        """True while only the new parameters (head, classifier) train; the backbone's lr is 0."""
        return step < self._steps(self.cfg.head_only)

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate at ``step`` (0-based; the step about to run)."""
        cfg = self.cfg
        warmup = self._steps(cfg.warmup)
        if step < warmup:
            return (step + 1) / warmup
        if cfg.kind == "constant":
            return 1.0
        if cfg.kind == "step":
            passed = sum(step >= self._steps(m) for m in cfg.milestones)
            return cfg.gamma**passed
        # cosine from the end of warm-up to the last step
        span = max(1, self.total_steps - warmup)
        t = min(1.0, (step - warmup) / span)
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
