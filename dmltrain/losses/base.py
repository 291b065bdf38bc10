"""Shared base classes of the loss library.

Two families:

* :class:`ProxyLoss` owns learnable class weights ``weight`` (``num_classes × dim``) and is
  called as ``loss(embeddings, labels) -> scalar``.
* :class:`InstanceLoss` compares the embeddings of a batch with each other. It is written as
  a sum of *anchor terms* over a reference set (:meth:`InstanceLoss.anchor_terms`), so the
  distributed layer can give each worker its local anchors against the all-gathered global
  batch and still get the exact global loss and gradients: the global loss is
  ``Σ_workers total / Σ_workers count``.

After each call ``loss.stats`` holds that call's statistics as plain floats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn


def _as_tensor(x: Tensor | float, like: Tensor) -> Tensor:
    return x if isinstance(x, Tensor) else torch.tensor(float(x), device=like.device)


@dataclass
class AnchorTerms:
    """What one set of anchors contributes to an instance loss.

    ``total``: differentiable scalar, the sum of the anchors' (already weighted) terms.
    ``count``: the anchors' share of the loss's normaliser (valid anchors, pairs or triplets,
    by the loss's definition); the loss is ``total / count`` summed over every anchor set.
    ``means``: statistic name -> (sum, count) whose global value is Σsum / Σcount.
    ``totals``: statistic name -> a count whose global value is its sum (active pairs, skipped anchors).
    """

    total: Tensor
    count: Tensor
    means: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    totals: dict[str, Tensor] = field(default_factory=dict)

    def finalize_stats(self) -> dict[str, float]:
        """Single-set statistics; means with a zero count are left out."""
        out = {k: float(v) for k, v in self.totals.items()}
        for k, (s, c) in self.means.items():
            if float(c) > 0:
                out[k] = float(s) / float(c)
        return out


class BaseLoss(nn.Module):
    """Common base: a registry name and the last call's ``stats``."""

    registry_name: ClassVar[str] = ""

    def __init__(self) -> None:
        super().__init__()
        self.stats: dict[str, float] = {}


class ProxyLoss(BaseLoss):
    """A loss with one learnable proxy (class weight) per class: ``weight`` is ``num_classes × dim``."""

    def __init__(self, num_classes: int, dim: int) -> None:
        super().__init__()
        if num_classes < 1 or dim < 1:
            raise ValueError(f"num_classes and dim must be positive, got {num_classes}, {dim}")
        self.num_classes, self.dim = num_classes, dim
        self.weight = nn.Parameter(torch.empty(num_classes, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=dim_std(self.dim))

    def check_labels(self, labels: Tensor) -> None:
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(
                f"{type(self).__name__}: labels must be in [0, {self.num_classes}), got [{int(labels.min())}, {int(labels.max())}]"
            )


def dim_std(dim: int) -> float:
    """Init scale for proxies: unit expected norm."""
    return dim**-0.5


class InstanceLoss(BaseLoss):
    """A loss over the pairs of a batch, decomposed over anchors.

    Subclasses implement :meth:`anchor_terms`. ``anchors`` are a subset of ``refs`` (the
    whole batch): ``anchor_index[i]`` is the row of ``refs`` holding anchor ``i``, so a
    loss can exclude the anchor from its own positives. Terms may use any rows of
    ``refs``; gradients may flow to refs (they are routed to their owners by the
    distributed gather) unless the loss's definition treats them as constants.

    Anchors whose terms a loss leaves out (as a rule those without a positive) are counted in
    ``totals['skipped_anchors']``; whether they still count in ``count`` is the loss's to say
    (ICE, RLL, MS: their ``normalize`` option).
    """

    #: False when the loss cannot be written as a sum over anchors; the distributed
    #: layer then computes the whole global loss on every worker.
    decomposes: ClassVar[bool] = True

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        raise NotImplementedError

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if embeddings.dim() != 2 or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"{type(self).__name__}: expected embeddings B×D and labels B, got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        idx = torch.arange(embeddings.shape[0], device=embeddings.device)
        terms = self.anchor_terms(embeddings, labels, embeddings, labels, idx)
        self.stats = terms.finalize_stats()
        return terms.total / terms.count.clamp_min(1)
