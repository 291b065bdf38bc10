"""What a worker tells the outside besides MLflow: Ray Train reports and the driver's progress board.

* :meth:`Reporter.report` is the only call to ``ray.train.report``: metrics of an evaluation,
  or a checkpoint directory for Ray to merge (every rank's files) and upload. It is a
  barrier: every rank calls it the same number of times.
* :meth:`Reporter.latest_checkpoint` is the only read of Ray's latest checkpoint.
* :meth:`Reporter.progress` / :meth:`Reporter.summary` post to the driver's progress board (rank 0).

With ``report_to_ray`` off (a direct call outside Ray Train) reports are dropped and there is
no checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
from ray.train.v2.api.validation_config import ValidationTaskConfig

from dmltrain.tracking.names import REPORT_EPOCH, REPORT_STEP, report_key
from dmltrain.training.progress import post
from dmltrain.training.state import TrainState


@dataclass
class RunContext:
    """What the driver hands every worker besides the config."""

    run_name: str
    storage_dir: str  # <storage_path>/<run_name>: where best/final models are published
    tracking_uri: str
    mlflow_run_id: str | None
    board_name: str | None = None
    report_to_ray: bool = True
    driver: dict[str, Any] | None = None  # the driver to watch (:class:`~.fence.DriverInfo`); None: none

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunContext:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def position_metrics(state: TrainState) -> dict[str, Any]:
    """A report of where the run stands: step, epoch and the latest evaluation as ``eval/<name>``."""
    return {
        REPORT_STEP: state.step,
        REPORT_EPOCH: state.epoch,
        **{report_key(k): v for k, v in state.last_metrics.items()},
    }


class Reporter:
    def __init__(self, run: RunContext, rank: int, total_steps: int, num_epochs: int):
        self.run, self.rank = run, rank
        self.total_steps, self.num_epochs = total_steps, num_epochs

    def report(
        self,
        metrics: dict[str, Any],
        step: int,
        checkpoint_dir: Path | None = None,
        validation: ValidationTaskConfig | None = None,
    ) -> None:
        """Hand ``metrics`` (and this rank's checkpoint files, if any) to Ray Train; all ranks call it.
        ``validation``: Ray evaluates the checkpoint asynchronously with these arguments (:mod:`.async_eval`)."""
        if not self.run.report_to_ray:
            return
        ckpt = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir is not None else None
        name = f"checkpoint-step{step:08d}" if checkpoint_dir is not None else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name, validation=validation or False)

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[Path | None]:
        """The local directory of Ray's latest checkpoint of this run while the block runs; None if there is none."""
        ckpt = ray.train.get_checkpoint() if self.run.report_to_ray else None
        if ckpt is None:
            yield None
            return
        with ckpt.as_directory() as d:
            yield Path(d)

    def progress(self, state: TrainState, **info: Any) -> None:
        """Post the run's position and ``info`` (phase, loss, images/s, ETA, last evaluation) to the driver's line."""
        if self.rank != 0:
            return
        # at an epoch boundary the work in hand (eval, checkpoint) belongs to the epoch just completed
        epoch = state.epoch - 1 if state.batch == 0 and state.step > 0 else state.epoch
        post(
            self.run.board_name,
            {
                "epochs": self.num_epochs,
                "total_steps": self.total_steps,
                "step": state.step,
                "epoch": max(0, epoch),
                **info,
            },
        )

    def summary(self, summary: dict[str, Any]) -> None:
        if self.rank == 0:
            post(self.run.board_name, summary, summary=True)
