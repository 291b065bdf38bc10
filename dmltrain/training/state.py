"""The position of a run (step, epoch, batch, best and last metrics), saved with every checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError


@dataclass
class TrainState:
    """Position of a run; JSON-serialisable."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch the next step belongs to
    batch: int = 0  # steps of ``epoch`` already taken (whole global batches: the same at every worker count)
    grad_accum: int = 1  # train.grad_accum the position was reached with (a step: data.batch_size × grad_accum images)
    world_size: int = 1
    zero_stage: int = 0
    finished: bool = False
    best_metric: float | None = None
    best_step: int | None = None
    initial_metrics: dict[str, float] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    best_metrics: dict[str, float] = field(default_factory=dict)
    plan: dict[str, Any] | None = None  # TrainStream.plan_signature() under which (epoch, batch) was reached

    @classmethod
    def from_json(cls, path: Path) -> TrainState:
        data = json.loads(path.read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def record_evaluation(self, metrics: dict[str, float], step: int, key: str, initial: bool = False) -> bool:
        """Make ``metrics`` the last evaluation; True when they beat the best ``key`` so far (then also the best).

        The untrained model's evaluation (``initial``) never counts as the best; a missing ``key`` never improves.
        """
        self.last_metrics = metrics
        improved = not initial and key in metrics and (self.best_metric is None or metrics[key] > self.best_metric)
        if improved:
            self.best_metric, self.best_step, self.best_metrics = metrics[key], step, dict(metrics)
        return improved

    def summary(self, metric: str) -> dict[str, Any]:
        """What a training returns and the driver prints: final step, initial / final / best metrics."""
        return {
            "step": self.step,
            "initial": self.initial_metrics,
            "final": self.last_metrics,
            "best": self.best_metrics,
            "best_step": self.best_step,
            "metric": metric,
        }


def check_accumulation(state: TrainState, grad_accum: int) -> None:
    """Refuse to resume a position reached with another ``train.grad_accum``: a step would stand for another
    number of images (the schedule, the cadence and ``train.max_steps`` count steps). Positions are saved only
    between optimizer steps, so a resumed run never starts in the middle of an accumulation, whatever the
    number of micro-batches its worker count takes a step in."""
    if state.grad_accum != grad_accum:
        raise UserError(
            f"train.grad_accum: the checkpoint at step {state.step} was saved with train.grad_accum={state.grad_accum} "
            f"(step {state.batch} of epoch {state.epoch}); resume it with train.grad_accum={state.grad_accum}"
        )


def realign_to_plan(state: TrainState, plan: dict[str, Any]) -> list[str]:
    """Make ``state``'s (epoch, batch) valid under the batch ``plan`` (``TrainStream.plan_signature()``).

    A mid-epoch position continues the same steps only under the plan it was reached with, at any
    worker count; under another (batch settings, seed or shards changed, or a position saved by an
    older plan version) the run moves to the start of the next epoch. Returns the plan keys that
    changed (empty: nothing moved). A state saved without a plan, or at an epoch boundary, keeps its
    position. ``state.plan`` becomes ``plan``.
    """
    old, state.plan = state.plan, dict(plan)
    if old is None or old == plan:
        return []
    changed = sorted(k for k in {*old, *plan} if old.get(k) != plan.get(k))
    if state.batch > 0:
        state.epoch, state.batch = state.epoch + 1, 0
    return changed
