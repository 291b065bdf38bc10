"""Contrastive loss (Hadsell, Chopra & LeCun, CVPR 2006), with a positive margin.

Euclidean distance ``d`` between L2-normalised embeddings; over every ordered pair
(anchor, other) of the batch::

    positive: [d - pos_margin]₊²        negative: [neg_margin - d]₊²

The loss is the mean over the pairs with a non-zero term (as pytorch-metric-learning's
``AvgNonZeroReducer``): easy pairs do not dilute the gradient as training progresses.
Defaults ``pos_margin = 0``, ``neg_margin = 1`` are pytorch-metric-learning's; with
``pos_margin = 0`` the positive part is the tightness term of the CE paper's Table 2
(``Σ ||zᵢ - zⱼ||²``) and the negative part its contrastive term.
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    label_masks,
    masked_mean_stat,
    masked_sum,
    normalize_both,
    similarity,
    similarity_stats,
    unit_distance,
)
from dmltrain.losses.registry import register


@register("contrastive")
class ContrastiveLoss(InstanceLoss):
    """Squared-hinge contrastive loss; ``stats`` adds ``tightness`` and ``contrastive`` (mean pair terms)."""

    def __init__(self, pos_margin: float = 0.0, neg_margin: float = 1.0) -> None:
        super().__init__()
        if pos_margin < 0 or neg_margin <= pos_margin:
            raise ValueError(f"contrastive: need 0 <= pos_margin < neg_margin, got {pos_margin}, {neg_margin}")
        self.pos_margin, self.neg_margin = float(pos_margin), float(neg_margin)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        cos = similarity(*normalize_both(anchors, refs))
        d = unit_distance(cos)
        pos_term = (d - self.pos_margin).clamp_min(0.0).square()
        neg_term = (self.neg_margin - d).clamp_min(0.0).square()
        active_pos = m.pos & (pos_term > 0)
        active_neg = m.neg & (neg_term > 0)
        total = masked_sum(pos_term, m.pos) + masked_sum(neg_term, m.neg)
        n_active = active_pos.sum() + active_neg.sum()

        means = similarity_stats(cos, m)
        means["tightness"] = masked_mean_stat(pos_term, m.pos)
        means["contrastive"] = masked_mean_stat(neg_term, m.neg)
        means["nontrivial_fraction"] = n_active, m.pos.sum() + m.neg.sum()
        totals = {"active_pairs": n_active, "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=n_active, means=means, totals=totals)
