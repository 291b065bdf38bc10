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
import torch.nn.functional as F
from torch import Tensor, nn

from dmltrain.config import Config
from dmltrain.distributed import GatheredInstanceLoss, ShardedClassifier, grad_scale
from dmltrain.distributed.process_group import average_grads, broadcast_params
from dmltrain.losses import ProxyLoss, make_loss

PROBE = "probe/"  # the classifier's statistics from its probe of the full softmax (softmax/probe/ in MLflow)


class Objective(nn.Module):
    """Owns the model-parallel classifier and the gathered instance loss of a run.

    ``forward(embeddings, labels, step) -> loss``: local embeddings and global class ids in,
    the global objective out (the same value on every worker). Every worker's local batch has the
    same size (the trainer's batch plan checks it), so the classifier needs no size exchange. ``stats`` holds the parts and
    their statistics of the last call, prefixed ``classifier/`` and ``instance/``, as host
    floats; they are read from the device when ``stats`` is read, not during ``forward``
    (``device_stats``: the same without reading them).

    With ``loss.classifier.probe_every`` N, the trainer calls :meth:`probe` before every N-th step's
    ``forward`` (:meth:`probe_due`; the probe's time kept out of the step's): the classifier's full
    softmax against its sampled one on the same batch, nothing updated
    (:meth:`~dmltrain.distributed.sharded_softmax.ShardedClassifier.probe`), added to that step's
    statistics as ``classifier/probe/<stat>``.
    """

    def __init__(
        self, cfg: Config, num_classes: int, dim: int, world_size: int, classifier_dropout: float = 0.0, group=None
    ):
        super().__init__()
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
                num_classes,
                dim,
                c.kind,
                sample_ratio=c.sample_ratio,
                group=group,
                seed=cfg.train.seed,
                logits_budget_mb=c.logits_budget_mb,
                precision=c.precision,
                weight_storage=c.weight_storage,
                init_std=c.init_std,
                deterministic=c.deterministic,
                sampling=c.sampling,
                nearest_to=c.nearest_to,
                nearest_share=c.nearest_share,
                refresh_every=c.refresh_every,
                nearest_after=c.nearest_after,
                sampling_correction=c.sampling_correction,
                drop_after=c.drop_after,
                drop_angle=c.drop_angle,
                **c.params,
            )
        self.probe_every = c.probe_every if c is not None else 0
        self.replicated: nn.Module | None = None
        if i is not None:
            loss = make_loss(i.kind, i.params, num_classes=num_classes, dim=dim)
            if isinstance(loss, ProxyLoss):
                # replicated proxies: every worker computes the whole global loss, so all replicas get the same
                # gradient; they start equal (broadcast) and their gradients are averaged to stay bit-identical
                self.replicated = loss
                self.instance = GatheredInstanceLoss(loss, group=group, mode="full")
                broadcast_params(self.replicated_parameters(), group)
            else:
                self.instance = GatheredInstanceLoss(loss, group=group, mode=i.mode)
        self._parts: list[tuple[str, dict[str, Any], Tensor, float]] = []
        self._probe: tuple[int, dict[str, Tensor]] | None = None

    def forward(self, embeddings: Tensor, labels: Tensor, step: int) -> Tensor:
        # The losses run in fp32 whatever the engine's precision (bf16 logits at T = 0.05 lose the ranking).
        emb = embeddings.float()
        if self.world_size > 1:
            emb = grad_scale(emb, float(self.world_size))
        total = emb.new_zeros(())
        parts = []
        if self.classifier is not None:
            x = F.dropout(emb, self.classifier_dropout, self.training) if self.classifier_dropout else emb
            # the batch plan gives every worker the same local batch: no size exchange (no host read)
            loss = self.classifier(x, labels, step=step, sizes=[x.shape[0]] * self.world_size)
            total = total + self.w_classifier * loss
            stats = self.classifier.stats
            if self._probe is not None and self._probe[0] == step:
                stats = stats.with_device({f"{PROBE}{k}": v for k, v in self._probe[1].items()})
            self._probe = None
            parts.append(("classifier", stats, loss.detach(), self.w_classifier))
        if self.instance is not None:
            loss = self.instance(emb, labels)
            total = total + self.w_instance * loss
            parts.append(("instance", self.instance.stats, loss.detach(), self.w_instance))
        self._parts = parts
        return total

    def probe_due(self, step: int) -> bool:
        """Whether step ``step`` probes the classifier (every ``loss.classifier.probe_every`` steps)."""
        return self.classifier is not None and self.probe_every > 0 and step % self.probe_every == 0

    @torch.no_grad()
    def probe(self, embeddings: Tensor, labels: Tensor, step: int) -> None:
        """What class subsampling costs this batch's gradient (the full softmax against the sampled one,
        nothing updated); the figures join the next ``forward`` of the same step as ``classifier/probe/``."""
        x = embeddings.detach().float()
        self._probe = (step, self.classifier.probe(x, labels, step, sizes=[x.shape[0]] * self.world_size))

    @property
    def terms(self) -> list[str]:
        """The loss terms this objective sums: ``classifier``, ``instance`` or both."""
        return [
            name for name, part in (("classifier", self.classifier), ("instance", self.instance)) if part is not None
        ]

    @property
    def losses(self) -> dict[str, Tensor]:
        """Each term's loss of the last ``forward`` as a detached 0-d tensor on the device (reading it does not sync)."""
        return {name: loss for name, _, loss, _ in self._parts}

    @property
    def stats(self) -> dict[str, float]:
        """``loss`` (the weighted total) and each part's statistics as ``name/...`` of the last ``forward``.

        Reading ``stats`` brings the device values over (the objective's only sync).
        """
        return {k: float(v) for k, v in self.device_stats.items()}

    @property
    def device_stats(self) -> dict[str, Tensor | float]:
        """``stats`` without a device sync: 0-d tensors where a part keeps its statistics on the device
        (the sharded classifier; a part's loss it does not report), floats where they are on the host;
        for a reader that sums them on the device and reads the sums at log time (``TrainMetrics``)."""
        stats: dict[str, Tensor | float] = {"loss": 0.0}
        for name, part, loss, weight in self._parts:
            values = part.on_device() if hasattr(part, "on_device") else dict(part)
            value = values.get("loss", loss)
            stats.update({f"{name}/{k}": v for k, v in values.items()})
            stats[f"{name}/loss"] = value
            stats["loss"] = stats["loss"] + weight * value
        return stats

    def classifier_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.classifier.parameters()) if self.classifier is not None else []

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters of a proxy instance loss, the same on every worker (their own optimizer steps them)."""
        return list(self.replicated.parameters()) if self.replicated is not None else []

    def average_replicated_grads(self) -> None:
        """Mean of the replicas' (equal up to rounding) gradients, so the replicas never drift apart."""
        average_grads(self.replicated_parameters(), self.group)
