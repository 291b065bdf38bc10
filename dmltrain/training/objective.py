"""The training objective: classifier loss × w₁ + instance loss × w₂, both over the global batch.

Both parts sum every worker's contribution into each worker's local embeddings (the sharded
classifier and the gathered instance loss route gradients back to their owners), while
DeepSpeed then *averages* backbone gradients over the W data-parallel workers. Scaling the
embeddings' gradient by W on the way into the losses makes the backbone gradient after that
averaging equal the single-process gradient of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dmltrain.config import Config


class Objective(nn.Module):
    """Owns the model-parallel classifier and the gathered instance loss of a run.

    ``forward(embeddings, labels, step) -> loss``: local embeddings and global class ids in,
    the global objective out (the same value on every worker). ``stats`` holds the parts and
    their statistics after each call, prefixed ``classifier/`` and ``instance/``.
    """

    def __init__(self, cfg: Config, num_classes: int, dim: int, world_size: int, classifier_dropout: float = 0.0, group=None):
        super().__init__()
        from dmltrain.distributed import GatheredInstanceLoss, ShardedClassifier
        from dmltrain.losses import ProxyLoss, make_loss

        self.world_size = world_size
        self.group = group
        self.classifier_dropout = classifier_dropout
        self.classifier = None
        self.instance = None
        c, i = cfg.loss.classifier, cfg.loss.instance
        self.w_classifier = c.weight if c is not None else 0.0
        self.w_instance = i.weight if i is not None else 0.0
        if c is not None:
            self.classifier = ShardedClassifier(
                num_classes, dim, c.kind, sample_ratio=c.sample_ratio, group=group, seed=cfg.train.seed,
                logits_budget_mb=c.logits_budget_mb, precision=c.precision, weight_storage=c.weight_storage, **c.params,
            )
        self.replicated: nn.Module | None = None
        if i is not None:
            loss = make_loss(i.kind, i.params, num_classes=num_classes, dim=dim)
            if isinstance(loss, ProxyLoss):
                # replicated proxies: every worker computes the whole global loss, so all replicas get the same
                # gradient; they start equal (broadcast) and their gradients are averaged to stay bit-identical
                self.replicated = loss
                self.instance = GatheredInstanceLoss(loss, group=group, mode="full")
                self._broadcast_replicated(group)
            else:
                self.instance = GatheredInstanceLoss(loss, group=group, mode=i.mode)
        self.stats: dict[str, float] = {}

    def forward(self, embeddings: Tensor, labels: Tensor, step: int) -> Tensor:
        # The losses run in fp32 whatever the engine's precision (bf16 logits at T = 0.05 lose the ranking).
        emb = embeddings.float()
        if self.world_size > 1:
            from dmltrain.distributed import grad_scale

            emb = grad_scale(emb, float(self.world_size))
        total = emb.new_zeros(())
        stats: dict[str, float] = {"loss": 0.0}
        if self.classifier is not None:
            x = F.dropout(emb, self.classifier_dropout, self.training) if self.classifier_dropout else emb
            loss = self.classifier(x, labels, step=step)
            total = total + self.w_classifier * loss
            _record(stats, "classifier", self.classifier.stats, loss, self.w_classifier)
        if self.instance is not None:
            loss = self.instance(emb, labels)
            total = total + self.w_instance * loss
            _record(stats, "instance", self.instance.stats, loss, self.w_instance)
        self.stats = stats
        return total

    def classifier_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.classifier.parameters()) if self.classifier is not None else []

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters of a proxy instance loss, the same on every worker (their own optimizer steps them)."""
        return list(self.replicated.parameters()) if self.replicated is not None else []

    def _broadcast_replicated(self, group) -> None:
        if self.world_size > 1:
            for p in self.replicated_parameters():
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)

    def average_replicated_grads(self) -> None:
        """Mean of the replicas' (equal up to rounding) gradients, so the replicas never drift apart."""
        if self.world_size > 1:
            for p in self.replicated_parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                    p.grad.div_(self.world_size)


def _record(stats: dict[str, float], name: str, part: dict[str, Any], loss: torch.Tensor, weight: float) -> None:
    """Add one loss's statistics as ``name/...`` and its weighted value to ``stats["loss"]``. The sharded
    and gathered losses already report ``loss`` on the host; reading it costs no extra device sync."""
    value = float(part["loss"]) if "loss" in part else float(loss.detach())
    stats.update({f"{name}/{k}": float(v) for k, v in part.items()})
    stats[f"{name}/loss"] = value
    stats["loss"] += weight * value
