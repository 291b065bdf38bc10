"""Learning-rate schedule of a run: head-only start, linear warm-up, then constant, step or cosine decay.

Everything is a pure function of the global step, so a resumed run continues the schedule
exactly. Lengths given in epochs are converted with the (rank-identical) number of batches
per epoch. :class:`LRSchedule` computes; :class:`ScheduledLR` applies it to the engine's
parameter groups, the backbone's trainability and the loss head before each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

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


class ScheduledLR:
    """Sets every learning rate of a run for the step about to run.

    The engine's groups get their base lr (as built: ``lr × lr_mult``) times the schedule's
    factor; during the head-only start the backbone groups get lr 0 and no weight decay (the
    backbone stays exactly as it is) and the backbone stops taking part in autograd. The loss
    head gets its own base lr times the factor.
    """

    def __init__(self, schedule: LRSchedule, optimizer: torch.optim.Optimizer, model: Any, head: Any, base_lr: float):
        self.schedule, self.optimizer, self.model, self.head, self.base_lr = schedule, optimizer, model, head, base_lr
        self.group_lr = [g["lr"] for g in optimizer.param_groups]
        self.group_wd = [g["weight_decay"] for g in optimizer.param_groups]

    def apply(self, step: int) -> float:
        """Set the rates for ``step`` (0-based); returns the base rate it implies (logged as ``lr``)."""
        factor = self.schedule.factor(step)
        head_only = self.schedule.head_only(step)
        if self.model.backbone_trainable == head_only:
            self.model.set_backbone_trainable(not head_only)  # no backbone autograd while it cannot move
        for g, lr, wd in zip(self.optimizer.param_groups, self.group_lr, self.group_wd):
            frozen = head_only and str(g.get("name", "")).startswith("backbone")
            g["lr"] = 0.0 if frozen else lr * factor
            g["weight_decay"] = 0.0 if frozen else wd
        self.head.set_lr(factor)
        return self.base_lr * factor
