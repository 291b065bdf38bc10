"""Simplified pairwise cross-entropy (SPCE; Boudiaf et al., ECCV 2020, sec. 5.1).

SPCE is the cross-entropy in which every class weight is replaced by the batch's hard
class mean: with ``n`` the batch size and ``θ_k = (1/n) Σ_{j: y_j = k} z_j``::

    L = (1/n) Σ_i [ -z_iᵀθ_{y_i} + log Σ_k exp(z_iᵀθ_k) ]

(the first part is the paper's tightness term ``-(1/n²) Σ_i Σ_{j: y_j=y_i} z_iᵀz_j``, the
second its contrastive term). ``k`` runs over the classes present in the batch: an absent
class has ``θ_k = 0`` and would only add a constant to the partition function. Gradients
flow through the class means into every embedding (a pairwise loss, not a proxy loss).

The paper's form suits raw (e.g. BatchNorm-head) embeddings. For unit-norm embeddings the
``1/n`` scale leaves the logits tiny; pass ``temperature=T`` to use ``θ_k = c_k / T`` with
``c_k`` the plain class mean instead, and ``normalize=True`` to L2-normalise inside.

It decomposes over anchors: the class means come from the reference set (the global batch).

The paper's PCE (Prop. 1, eq. 10), which SPCE simplifies, is deliberately not a loss here: it
is written in a classifier's softmax probabilities ``p_jk`` (not a function of the embeddings
alone) and divides every term by ``λ = min eig A_k``, ``A_k = (1/n) Σ_i (p_ik - p_ik²) z_i z_iᵀ``,
a ``d × d`` matrix of rank ``≤ n`` and so singular (``λ = 0``) whenever ``d > n``: the usual
case, and the paper's own MNIST set-up (``d = 100``, ``n = 64``). Its proof also takes the
stationary point of ``f_2`` as its minimum, but ``f_2`` is concave along a common shift of all
``θ_k`` for any ``λ > 0``. PCE is the object of the bound argument; SPCE is its trainable form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    NONTRIVIAL_NLL,
    label_masks,
    masked_mean_stat,
    masked_sum,
    normalize,
    normalize_both,
    similarity,
    similarity_stats,
    upcast,
)
from dmltrain.losses.registry import register


@register("spce")
class SPCELoss(InstanceLoss):
    """SPCE; ``temperature=None`` is the paper's ``θ_k = (1/n) Σ_{y_j=k} z_j``, a number gives ``θ_k = mean_k / T``.

    Anchors that are alone in their class are skipped (their class mean is themselves); they
    still form a class in the other anchors' softmax.
    """

    def __init__(self, temperature: float | None = None, normalize: bool = False) -> None:
        super().__init__()
        if temperature is not None and temperature <= 0:
            raise ValueError(f"spce: temperature must be positive, got {temperature}")
        self.temperature = None if temperature is None else float(temperature)
        self.normalize = bool(normalize)

    def class_weights(self, refs: Tensor, ref_labels: Tensor) -> tuple[Tensor, Tensor]:
        """The classes present in ``ref_labels`` (sorted) and their weights θ (one row each)."""
        z = normalize(refs) if self.normalize else upcast(refs)
        classes, inverse = torch.unique(ref_labels, return_inverse=True)
        sums = torch.zeros(classes.shape[0], z.shape[1], dtype=z.dtype, device=z.device).index_add(0, inverse, z)
        if self.temperature is None:
            return classes, sums / z.shape[0]
        counts = torch.bincount(inverse, minlength=classes.shape[0]).to(z.dtype)
        return classes, sums / (counts[:, None] * self.temperature)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        z = normalize(anchors) if self.normalize else upcast(anchors)
        classes, theta = self.class_weights(refs, ref_labels)
        logits = similarity(z, theta)
        target = torch.searchsorted(classes, anchor_labels).clamp_max(classes.shape[0] - 1)
        tight = -logits.gather(1, target[:, None]).squeeze(1)
        contrast = torch.logsumexp(logits, dim=1)
        per_anchor = tight + contrast
        total = masked_sum(per_anchor, m.valid)

        with torch.no_grad():
            cos = similarity(*normalize_both(anchors, refs))
        nontrivial = m.valid & (per_anchor.detach() > NONTRIVIAL_NLL)
        means = similarity_stats(cos, m)
        means["tightness"] = masked_mean_stat(tight, m.valid)
        means["contrastive"] = masked_mean_stat(contrast, m.valid)
        means["nontrivial_fraction"] = nontrivial.sum(), m.valid.sum()
        totals = {"active_pairs": nontrivial.sum(), "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=m.valid.sum(), means=means, totals=totals)
