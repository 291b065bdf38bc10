"""Softmax classifiers over learnable class weights: the shared machinery of the proxy losses.

A :class:`ClassifierLoss` turns embeddings into logits against its class weights
(:meth:`ClassifierLoss.scores`) and takes a (label-smoothed) cross-entropy of them;
:class:`KindClassifierLoss` is one of the four classifier kinds, its hyperparameters,
defaults and bounds read from the kind's record (:mod:`~dmltrain.losses.kinds`);
:class:`MarginClassifierLoss` is the cosine classifier whose target logit carries a margin
(CosFace, ArcFace). The margin and smoothing maths live in :mod:`~dmltrain.losses.margins`,
shared with the class-sharded classifier.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from dmltrain.losses.base import ProxyLoss
from dmltrain.losses.kinds import ClassifierKind
from dmltrain.losses.margins import smoothed_nll
from dmltrain.losses.pairs import NONTRIVIAL_NLL, normalize, similarity

#: A non-target class with softmax probability above this still pushes the embedding.
ACTIVE_PROB = 1e-3


class ClassifierLoss(ProxyLoss):
    """A softmax cross-entropy over ``num_classes`` class weights (plus a margin or smoothing).

    Subclasses implement :meth:`scores`. The loss is the mean over the batch; labels must
    be in ``[0, num_classes)``. Under autocast the batch × classes GEMM runs in the autocast
    dtype (it is the expensive one); the logits and everything after are float32. ``stats`` holds
    ``nll`` (plain cross-entropy), ``accuracy``, ``pos_sim`` / ``neg_sim`` (mean cosine to
    the own / other class weights), ``nontrivial_fraction`` (examples with ``-log p_y >
    1e-3``), ``active_pairs`` (such examples plus (example, other class) pairs with
    ``p > 1e-3``) and ``skipped_anchors`` (always 0: every example has its class).
    """

    smoothing: float = 0.0

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(logits, cosine), both B × ``num_classes``: float32 logits with the loss's margin on
        each example's own class, and the cosine to every class weight (for the statistics)."""
        raise NotImplementedError

    def nll(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-example loss from full logits (all ``num_classes`` columns)."""
        target = logits.gather(1, labels[:, None]).squeeze(1)
        return smoothed_nll(torch.logsumexp(logits, dim=1), target, logits.sum(dim=1), logits.shape[1], self.smoothing)

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if (
            embeddings.dim() != 2
            or labels.dim() != 1
            or labels.shape[0] != embeddings.shape[0]
            or embeddings.shape[1] != self.dim
        ):
            raise ValueError(
                f"{type(self).__name__}: expected embeddings B×{self.dim} and labels B, got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        self.check_labels(labels)
        logits, cos = self.scores(embeddings, labels)
        loss = self.nll(logits, labels)
        self.stats = classifier_stats(logits.detach(), cos.detach(), labels)
        return loss.mean() if loss.numel() else logits.sum() * 0.0


class KindClassifierLoss(ClassifierLoss):
    """A classifier kind's loss: ``spec`` (its :class:`~dmltrain.losses.kinds.ClassifierKind`)
    gives the keyword hyperparameters, their defaults and bounds; each becomes an attribute
    (``loss.temperature``) and ``params`` holds them all."""

    spec: ClassVar[ClassifierKind]
    #: the constructor's keyword hyperparameters, for the registry
    hyperparameters: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.hyperparameters = cls.spec.param_names

    def __init__(self, num_classes: int, dim: int, **params: float) -> None:
        self.params = self.spec.resolve(params)
        if self.spec.subcenters(self.params) != 1:
            raise ValueError(
                f"{self.spec.name}: subcenters > 1 is the class-sharded classifier's (loss.classifier); "
                "this replicated loss keeps one row per class"
            )
        for name, value in self.params.items():
            setattr(self, name, value)
        super().__init__(num_classes, dim)


class MarginClassifierLoss(KindClassifierLoss):
    """Cosine classifier ``s·cos θ_j`` with the target logit from the kind's ``target_logit``,
    computed on each (embedding, own class weight) pair."""

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        x_hat, w_hat = normalize(embeddings), normalize(self.weight)
        cos = similarity(x_hat, w_hat, allow_autocast=True)
        target = self.spec.target_logit(x_hat, w_hat[labels], **self.spec.logit_params(self.params))
        rows = torch.arange(labels.shape[0], device=labels.device)
        return (self.spec.logit_scale(self.params) * cos).index_put((rows, labels), target), cos


def classifier_stats(logits: Tensor, cos: Tensor, labels: Tensor) -> dict[str, float]:
    b, c = logits.shape
    if b == 0:
        return {"active_pairs": 0.0, "skipped_anchors": 0.0}
    rows = torch.arange(b, device=labels.device)
    logp = torch.log_softmax(logits, dim=1)
    nll = -logp[rows, labels]
    nontrivial = nll > NONTRIVIAL_NLL
    others = logp.exp() > ACTIVE_PROB
    others[rows, labels] = False
    pos = cos[rows, labels]
    out = {
        "nll": float(nll.mean()),
        "accuracy": float((logits.argmax(dim=1) == labels).float().mean()),
        "pos_sim": float(pos.mean()),
        "nontrivial_fraction": float(nontrivial.float().mean()),
        "active_pairs": float(nontrivial.sum() + others.sum()),
        "skipped_anchors": 0.0,
    }
    if c > 1:
        out["neg_sim"] = float(((cos.sum(dim=1) - pos) / (c - 1)).mean())
    return out
