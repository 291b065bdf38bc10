"""The loss head: the trainable state of the objective that lives outside the DeepSpeed engine.

Two kinds of parameters train beside the engine, each with its own optimizer:

* the class-sharded classifier's rows (model-parallel: DeepSpeed's data-parallel averaging
  must never touch them), a :class:`~dmltrain.distributed.classifier_head.ClassifierHead`: the
  classifier with its row-sparse optimizer, which moves only the rows drawn this step, saved and
  loaded by class id;
* the replicated proxies of a proxy instance loss (``proxy_nca``, ``center``): the same on
  every worker, kept so by averaging their gradients before the step.

The trainer calls :meth:`LossHead.set_lr` with the schedule's learning rate and
:meth:`LossHead.step` right after ``engine.step()``. Their gradients come from
``engine.backward``, so under fp16 they carry the engine's loss scale; ``step`` divides it
out, and skips the head's step whenever the engine skipped its own for an overflow.
"""

from __future__ import annotations

from typing import Any

import torch

from dmltrain.config import OptimConfig
from dmltrain.distributed.classifier_head import ClassifierHead
from dmltrain.training.engine import build_optimizer
from dmltrain.training.objective import Objective


class LossHead:
    """The objective's classifier and replicated proxies with their optimizers.

    ``state_dict`` / ``load_state_dict`` hold what is the same on every rank (the proxies and
    their optimizer; ``{}`` without a proxy loss). The classifier's rows are no rank's whole
    state: :class:`~dmltrain.training.checkpoint.Checkpointer` saves them by global class id.
    """

    def __init__(self, objective: Objective, optim: OptimConfig):
        self.objective = objective
        self.optim = optim
        self.classifier_head = None
        if objective.classifier is not None:
            self.classifier_head = ClassifierHead(
                objective.classifier,
                optimizer=optim.name,
                lr=self.base_lr,
                momentum=optim.momentum,
                nesterov=optim.nesterov,
                weight_decay=optim.weight_decay,
                betas=optim.betas,
                # softmax_ce's bias: the CE recipe decays weights only
                bias_weight_decay=None if optim.decay_norm_and_bias else 0.0,
            )
        self.proxies = objective.replicated
        self.proxy_optimizer = None
        if self.proxies is not None:
            self.proxy_optimizer = build_optimizer(
                [{"params": objective.replicated_parameters(), "lr_mult": optim.new_param_lr_mult}], optim
            )

    @property
    def classifier(self):
        """The sharded classifier (None without one)."""
        return None if self.classifier_head is None else self.classifier_head.classifier

    @property
    def classifier_optimizer(self):
        """The classifier rows' optimizer (None without a classifier)."""
        return None if self.classifier_head is None else self.classifier_head.optimizer

    @property
    def base_lr(self) -> float:
        """The head's learning rate before the schedule: new parameters train at ``lr × new_param_lr_mult``."""
        return self.optim.lr * self.optim.new_param_lr_mult

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.classifier_optimizer, self.proxy_optimizer) if o is not None]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.objective.classifier_parameters() + self.objective.replicated_parameters()

    def set_lr(self, factor: float) -> None:
        """Every group's learning rate to ``base_lr × factor`` (``factor``: the schedule's multiplier)."""
        if self.classifier_head is not None:
            self.classifier_head.set_lr(self.base_lr * factor)
        if self.proxy_optimizer is not None:
            for g in self.proxy_optimizer.param_groups:
                g["lr"] = self.base_lr * factor

    def step(self, loss_scale: float = 1.0, applied: bool = True) -> None:
        """One optimizer step of the classifier rows and the proxies, after ``engine.step()``.

        ``loss_scale``: the fp16 scale ``engine.backward`` multiplied the gradients by (read
        before ``engine.step()``, which may change it); ``applied``: whether the engine's step
        went through (False after an fp16 overflow: the head skips its step too). Gradients
        are cleared either way.
        """
        if loss_scale != 1.0 or not applied:
            for p in self.parameters():
                if p.grad is not None:
                    if applied:
                        p.grad.div_(loss_scale)
                    else:
                        p.grad = None
        if self.proxies is not None:
            self.objective.average_replicated_grads()
            self.proxy_optimizer.step()
            self.proxy_optimizer.zero_grad(set_to_none=True)
        if self.classifier_head is not None:
            self.classifier_head.step()

    def state_dict(self) -> dict[str, Any]:
        if self.proxies is None:
            return {}
        return {"params": self.proxies.state_dict(), "optimizer": self.proxy_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.proxies is None:
            return
        self.proxies.load_state_dict(state["params"])
        self.proxy_optimizer.load_state_dict(state["optimizer"])

    def classifier_memory_mb(self) -> float | None:
        """The classifier shard held by this rank: its rows plus their optimizer state, in MB (None without one)."""
        return None if self.classifier_head is None else self.classifier_head.memory_bytes() / 2**20
