"""Lifted structured loss (Song, Xiang, Jegelka & Savarese, CVPR 2016), smooth form (their eq. 4).

Euclidean distance ``D`` between L2-normalised embeddings, margin ``α``. For each positive
pair ``(i, j)``::

    J_ij = log( Σ_{k∈neg(i)} exp(α - D_ik) + Σ_{l∈neg(j)} exp(α - D_jl) ) + D_ij

and ``L = 1/(2|P|) Σ_{(i,j)∈P} [J_ij]₊²`` over unordered positive pairs. Decomposed over
anchors, each ordered pair (anchor ``i``, positive ``j``) adds ``[J_ij]₊²`` with normaliser
2 per ordered pair (every unordered pair is seen from both ends). The negatives of the
positive ``j`` come from the reference set, so a worker needs only its anchors' positives'
rows of the distance matrix. Default ``α = 1`` is the paper's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    label_masks,
    masked_logsumexp,
    masked_sum,
    normalize_both,
    similarity,
    similarity_stats,
    unit_distance,
)
from dmltrain.losses.registry import register


@register("lifted_structure")
class LiftedStructureLoss(InstanceLoss):
    """Smooth lifted structure loss. A pair whose two ends have no negatives contributes zero."""

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.margin = float(margin)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        anchor_hat, ref_hat = normalize_both(anchors, refs)
        cos = similarity(anchor_hat, ref_hat)
        D = unit_distance(cos)
        lse_a, has_a = masked_logsumexp(self.margin - D, m.neg)

        # the same log-sum for every reference that is some anchor's positive
        if anchors is refs:  # one process, whole batch: every reference is an anchor, its row's log-sum is lse_a
            lse_r, has_r = lse_a, has_a
        else:
            cols = m.pos.any(dim=0).nonzero().squeeze(1)
            D_cols = unit_distance(similarity(ref_hat[cols], ref_hat))
            neg_cols = ref_labels[cols][:, None] != ref_labels[None, :]
            lse_c, has_c = masked_logsumexp(self.margin - D_cols, neg_cols)
            lse_r = torch.zeros(ref_labels.shape[0], dtype=lse_c.dtype, device=lse_c.device).index_put((cols,), lse_c)
            has_r = torch.zeros(ref_labels.shape[0], dtype=torch.bool, device=lse_c.device).index_put((cols,), has_c)

        neg_inf = torch.tensor(float("-inf"), device=D.device)
        any_neg = has_a[:, None] | has_r[None, :]
        a_part = torch.where(has_a, lse_a, neg_inf)[:, None].expand_as(D)
        r_part = torch.where(has_r, lse_r, neg_inf)[None, :].expand_as(D)
        zero = torch.zeros((), device=D.device)
        # both -inf would give NaN gradients in logaddexp: feed zeros there, masked below
        J = torch.logaddexp(torch.where(any_neg, a_part, zero), torch.where(any_neg, r_part, zero)) + D
        pair = m.pos & any_neg
        term = J.clamp_min(0.0).square()
        total = masked_sum(term, pair)
        active = pair & (J.detach() > 0)

        means = similarity_stats(cos, m)
        means["nontrivial_fraction"] = active.sum(), m.pos.sum()
        totals = {"active_pairs": active.sum(), "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=2 * m.pos.sum(), means=means, totals=totals)
