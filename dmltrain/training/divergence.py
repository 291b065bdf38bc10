"""Stopping a diverged run: a non-finite loss term ends training on every rank at the same step.

:meth:`DivergenceGuard.observe` records, on the device and without waiting for it, the first
step at which each loss term (``classifier``, ``instance``) was NaN or infinite.
:meth:`DivergenceGuard.check` reads that back with one all-reduce of a few integers, so every
rank reaches the same verdict at the same call; the trainer calls it where it stops for the
host anyway (log points) and before every evaluation and checkpoint, so nothing computed after
a non-finite loss is ever saved or evaluated.

Tests make a loss diverge with ``DMLTRAIN_FAULT_NAN_AT_STEP`` (:mod:`.faults`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

_NEVER = 2**62


class Diverged(Exception):
    """A loss term was not finite; the message names the term, its value and the step."""


class DivergenceGuard:
    """The first non-finite step of each loss term in ``terms``, kept on ``device``."""

    def __init__(self, terms: Sequence[str], device: torch.device):
        self.terms = list(terms)
        self.first_bad = torch.full((len(self.terms),), _NEVER, dtype=torch.int64, device=device)
        self.value = torch.zeros(len(self.terms), dtype=torch.float32, device=device)

    def observe(self, step: int, losses: Mapping[str, torch.Tensor]) -> None:
        """Record step ``step``'s loss terms (0-d tensors); no host synchronisation."""
        if not self.terms:
            return
        values = torch.stack([losses[t].detach().float().reshape(()) for t in self.terms])
        new = ~torch.isfinite(values) & (self.first_bad == _NEVER)
        self.first_bad = torch.where(new, torch.full_like(self.first_bad, step), self.first_bad)
        self.value = torch.where(new, values, self.value)

    def check(self) -> None:
        """Raise :class:`Diverged` when a term has been non-finite on any rank (a collective: every rank calls it)."""
        if not self.terms:
            return
        first = self.first_bad.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        steps = first.tolist()
        step = min(steps)
        if step == _NEVER:
            return
        i = steps.index(step)
        seen_here = int(self.first_bad[i]) == step
        value = str(float(self.value[i])) if seen_here else "not finite"  # another rank saw it
        raise Diverged(f"loss diverged: the {self.terms[i]} loss is {value} at step {step}")
