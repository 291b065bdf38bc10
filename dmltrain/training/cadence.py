"""When the trainer logs, evaluates and checkpoints: a pure function of the step, the same on every rank.

Evaluation and checkpoints are collectives, so every rank must reach the same decision
without talking to the others; :meth:`Cadence.due` decides from the step (and, at an
epoch's end, the number of epochs completed) alone.

The run's last step is never due for an evaluation or a checkpoint here: the end of
training does both, in its own order (final evaluation, final model, then the checkpoint
that records the run as finished).
"""

from __future__ import annotations

from dataclasses import dataclass

from dmltrain.config import Config


@dataclass(frozen=True)
class Due:
    """What to do now, in this order: log the training metrics, evaluate, checkpoint."""

    log: bool = False
    evaluate: bool = False
    checkpoint: bool = False

    def __or__(self, other: Due) -> Due:
        """Both at once (a step that ends an epoch): each action at most once."""
        return Due(self.log or other.log, self.evaluate or other.evaluate, self.checkpoint or other.checkpoint)


@dataclass(frozen=True)
class Cadence:
    total_steps: int
    log_every: int
    eval_every: int  # 0: evaluate only at the end
    eval_unit: str  # "step" or "epoch"
    checkpoint_every: int  # steps; 0: at each epoch's end

    @classmethod
    def from_config(cls, cfg: Config, total_steps: int) -> Cadence:
        return cls(total_steps, cfg.train.log_every, cfg.eval.every, cfg.eval.unit, cfg.train.checkpoint_every)

    def due(self, step: int, epoch_end: int | None = None) -> Due:
        """What is due after ``step`` optimizer steps (called once after each step and once at each epoch's end).

        ``epoch_end``: at an epoch's end, the number of epochs completed (1 after the first);
        None after a step. Logging follows steps (and always logs the last one); evaluation
        follows ``eval_unit``; checkpoints follow steps, or epoch ends when ``checkpoint_every`` is 0.
        """
        more = step < self.total_steps
        if epoch_end is None:
            return Due(
                log=step % self.log_every == 0 or not more,
                evaluate=more and self.eval_unit == "step" and _every(step, self.eval_every),
                checkpoint=more and _every(step, self.checkpoint_every),
            )
        return Due(
            evaluate=more and self.eval_unit == "epoch" and _every(epoch_end, self.eval_every),
            checkpoint=more and self.checkpoint_every == 0,
        )


def _every(n: int, period: int) -> bool:
    return period > 0 and n % period == 0
