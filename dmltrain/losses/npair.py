"""Multi-class N-pair loss (Sohn, NeurIPS 2016), generalised to P×K batches.

Inner products of the raw (not normalised) embeddings, as in the paper. For each anchor
``a`` and each positive ``p``, against all of the anchor's negatives::

    ℓ_ap = log(1 + Σ_{n∈neg(a)} exp(fₐᵀfₙ - fₐᵀfₚ))

The anchor's term is the mean of ``ℓ_ap`` over its positives plus ``l2_reg/2 · ||fₐ||²``;
the loss is the mean over anchors. Every image is an anchor, and an anchor's negatives
are all other-class images of the batch (the paper, with K = 2, uses the other pairs'
positives only: N - 1 of the 2(N - 1)). The regulariser equals TensorFlow's
``npairs_loss`` (``reg_lambda · ¼ (mean ||anchor||² + mean ||positive||²)``), whose default
``l2_reg = 0.002`` is ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    NONTRIVIAL_NLL,
    label_masks,
    masked_logsumexp,
    masked_mean_stat,
    masked_sum,
    masked_sum_rows,
    similarity,
    similarity_stats,
    upcast,
)
from dmltrain.losses.registry import register


@register("npair")
class NPairLoss(InstanceLoss):
    """N-pair-mc loss with embedding-norm regularisation; ``stats`` adds ``nll`` and ``sq_norm``."""

    def __init__(self, l2_reg: float = 0.002) -> None:
        super().__init__()
        if l2_reg < 0:
            raise ValueError(f"npair: l2_reg must be >= 0, got {l2_reg}")
        self.l2_reg = float(l2_reg)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        a, r = upcast(anchors), upcast(refs)
        S = similarity(a, r)
        lse_neg, has_neg = masked_logsumexp(S, m.neg)
        active = m.pos & has_neg[:, None]
        nll = F.softplus(torch.where(active, lse_neg[:, None] - S, torch.zeros_like(S)))
        nll = torch.where(active, nll, torch.zeros_like(nll))
        n_pos = m.pos.sum(dim=1)
        sq_norm = a.square().sum(dim=1)
        per_anchor = masked_sum_rows(nll, m.pos) / n_pos.clamp_min(1) + 0.5 * self.l2_reg * sq_norm
        total = masked_sum(per_anchor, m.valid)

        with torch.no_grad():
            cos = S / (a.norm(dim=1)[:, None] * r.norm(dim=1)[None, :]).clamp_min(1e-12)
        nontrivial = active & (nll.detach() > NONTRIVIAL_NLL)
        means = similarity_stats(cos, m)
        means["nll"] = masked_mean_stat(nll, active)
        means["sq_norm"] = masked_mean_stat(sq_norm, m.valid)
        means["nontrivial_fraction"] = nontrivial.sum(), active.sum()
        totals = {"active_pairs": nontrivial.sum(), "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=m.valid.sum(), means=means, totals=totals)
