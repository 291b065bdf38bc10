"""Softmax classifiers over learnable class weights: the shared machinery of the proxy losses.

A :class:`ClassifierLoss` turns embeddings into logits against class weights
(:meth:`ClassifierLoss.scores`) and takes a cross-entropy of them. The logits method
accepts any subset of the weight rows with their global class ids, so the sharded
classifier can score the gathered batch against its own rows (and a sampled subset of
classes) with the same margins; :func:`smoothed_nll` is the per-example loss from the
three reductions (log-sum-exp, target logit, logit sum) that the shards all-reduce.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmltrain.losses.base import ProxyLoss
from dmltrain.losses.pairs import NONTRIVIAL_NLL

#: A non-target class with softmax probability above this still pushes the embedding.
ACTIVE_PROB = 1e-3


def target_pairs(labels: Tensor, num_rows: int, class_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(example, column) index pairs of every example's own class among the weight rows.

    With ``class_ids`` None the rows are classes ``0..num_rows-1``; otherwise row ``c`` holds
    global class ``class_ids[c]`` and examples whose class is not among them get no pair.
    """
    if class_ids is None:
        return torch.arange(labels.shape[0], device=labels.device), labels
    rows, cols = (labels[:, None] == class_ids[None, :]).nonzero(as_tuple=True)
    return rows, cols


def smoothed_nll(lse: Tensor, target_logit: Tensor, logit_sum: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """Per-example cross-entropy with label smoothing ``1-ε`` on the target, ``ε/(K-1)`` elsewhere.

    ``lse`` = log Σ_j exp(z_j), ``target_logit`` = z_y, ``logit_sum`` = Σ_j z_j over all ``K``
    classes of the softmax. ``ε = 0`` (or ``K = 1``) is the plain ``lse - z_y``.
    """
    if smoothing == 0.0 or num_classes < 2:
        return lse - target_logit
    other = smoothing / (num_classes - 1)
    return lse - (1.0 - smoothing) * target_logit - other * (logit_sum - target_logit)


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

    def scores(
        self, embeddings: Tensor, labels: Tensor, weight: Tensor | None = None, class_ids: Tensor | None = None, bias: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(logits, cosine) of ``embeddings`` (B×D) against ``weight`` rows (default: all, ``self.weight``).

        ``class_ids`` gives the global class of each weight row (default ``arange``); the
        margin applies where it equals the example's label. ``bias`` only for ``softmax_ce``.
        """
        raise NotImplementedError

    def logits(
        self, embeddings: Tensor, labels: Tensor, weight: Tensor | None = None, class_ids: Tensor | None = None, bias: Tensor | None = None
    ) -> Tensor:
        """B×C' float32 logits with the loss's margin applied on each example's own class."""
        return self.scores(embeddings, labels, weight, class_ids, bias)[0]

    def nll(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-example loss from full logits (all ``num_classes`` columns)."""
        target = logits.gather(1, labels[:, None]).squeeze(1)
        return smoothed_nll(torch.logsumexp(logits, dim=1), target, logits.sum(dim=1), logits.shape[1], self.smoothing)

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if embeddings.dim() != 2 or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0] or embeddings.shape[1] != self.dim:
            raise ValueError(
                f"{type(self).__name__}: expected embeddings B×{self.dim} and labels B, got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        self.check_labels(labels)
        logits, cos = self.scores(embeddings, labels)
        loss = self.nll(logits, labels)
        self.stats = classifier_stats(logits.detach(), cos.detach(), labels)
        return loss.mean() if loss.numel() else logits.sum() * 0.0


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
