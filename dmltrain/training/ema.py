"""An exponential moving average of the model's weights (``train.ema_decay``), evaluated and exported in their place.

After every optimizer step :meth:`WeightEMA.update` moves each float parameter's average towards the
parameter: ``ema ← d·ema + (1 − d)·w``, starting from the weights as built (the pretrained ones). With
``warmup`` (``train.ema_warmup``, timm's ``ModelEmaV3(use_warmup=True)`` with its defaults) the ``t``-th update
(``t = 1, 2, ...``) uses ``d_t = min(d, 1 − t^(−2/3))`` instead: the first copies the weights, 0.999 is reached
after 31,623 updates, so a short run's average does not keep the weights as built (a new head's random ones:
0.999^960 = 38% of them after 960 plain updates). The count is part of the saved state, so a resumed average
goes on with the same ``d_t``.

The average is kept in float32 whatever the engine's precision, so its small updates are not rounded away;
under bf16 the ``w`` it averages are the engine's bf16 copies of the fp32 master weights. Buffers
(BatchNorm statistics) are not averaged: the model's current ones are used. The average covers the
engine's model, backbone and embedding head; the classifier rows are not part of it (nothing that is
evaluated or exported uses them).

:meth:`WeightEMA.swapped` puts the average into the model for an evaluation or an export and the
trained weights back afterwards. Every rank keeps the same average (ZeRO 0-2 give every rank whole,
identical parameters), so it is saved once in a checkpoint and loaded by every rank
(:class:`~dmltrain.training.checkpoint.Checkpointer`'s replicated states, ``ema.pt``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


class WeightEMA:
    """The average of ``module``'s floating-point parameters with decay ``decay`` (see the module doc)."""

    def __init__(self, module: nn.Module, decay: float, warmup: bool = False):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.module, self.decay, self.warmup = module, float(decay), warmup
        self.params = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
        self.shadow = {n: p.detach().float().clone() for n, p in self.params.items()}
        self.updates = 0

    def decay_at(self, t: int) -> float:
        """The decay of the ``t``-th update (1-based): ``d``, or with warm-up ``min(d, 1 − t^(−2/3))``."""
        return min(self.decay, 1.0 - t ** (-2.0 / 3.0)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self) -> None:
        """One step of the average, after the optimizer's step."""
        self.updates += 1
        d = self.decay_at(self.updates)
        # one fused launch for every parameter (timm's ModelEmaV3 does the same), not one per tensor
        shadows = [self.shadow[n] for n in self.params]
        weights = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.params.values()]
        torch._foreach_lerp_(shadows, weights, 1.0 - d)  # d·ema + (1 − d)·w

    def state_dict_of_module(self) -> dict[str, Tensor]:
        """``module.state_dict()`` with the averaged parameters (float32) in place of the trained ones."""
        own = self.module.state_dict()
        return {k: self.shadow[k].clone() if k in self.shadow else v for k, v in own.items()}

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Within: the module holds the average (cast to each parameter's dtype); the trained weights after."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        try:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(self.shadow[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(saved[name])

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": {k: v.cpu() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self.shadow) - set(state["shadow"])
        if missing:
            raise ValueError(f"ema state lacks parameters {sorted(missing)[:3]}")
        for k, v in self.shadow.items():
            v.copy_(state["shadow"][k])
        self.updates = int(state["updates"])
