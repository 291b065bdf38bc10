"""Multi-similarity loss with its pair mining (Wang et al., CVPR 2019).

Cosine similarity ``S`` of L2-normalised embeddings. Mining per anchor (``ε = epsilon``):
negatives with ``S_an + ε > min_pos S_ap`` and positives with ``S_ap - ε < max_neg S_an``
(the thresholds are plain selections, no gradient). With ``λ = base``::

    L_a = 1/α log(1 + Σ_{P*} exp(-α (S_ap - λ))) + 1/β log(1 + Σ_{N*} exp(β (S_an - λ)))

As in the authors' code, an anchor whose mined positives or mined negatives are empty
contributes zero. The sum over anchors is divided by the batch size ``m`` (the paper's
``L = 1/m Σᵢ L_i``; ``normalize="batch"``, the default), so an anchor without a positive (a
single-image class) adds nothing but still counts. ``normalize="valid_anchors"`` divides by
the anchors that have a positive instead; the two agree on P×K batches. Defaults
``α = 2, β = 50, λ = 0.5, ε = 0.1`` are the paper's. ``stats`` splits the two parts into
``tightness`` and ``contrastive`` (CE paper, Table 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    anchor_rows,
    check_normalize,
    label_masks,
    masked_logsumexp,
    masked_mean_stat,
    masked_sum,
    normalize_both,
    similarity,
    similarity_stats,
)
from dmltrain.losses.registry import register


@register("multi_similarity")
class MultiSimilarityLoss(InstanceLoss):
    """MS loss with MS mining; ``active_pairs`` counts the mined pairs of contributing anchors."""

    def __init__(
        self, alpha: float = 2.0, beta: float = 50.0, base: float = 0.5, epsilon: float = 0.1, normalize: str = "batch"
    ) -> None:
        super().__init__()
        if alpha <= 0 or beta <= 0:
            raise ValueError(f"multi_similarity: alpha and beta must be positive, got {alpha}, {beta}")
        self.alpha, self.beta, self.base, self.epsilon = float(alpha), float(beta), float(base), float(epsilon)
        self.normalize = check_normalize("multi_similarity", normalize)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        S = similarity(*normalize_both(anchors, refs))
        s = S.detach()
        inf = torch.tensor(float("inf"), device=S.device)
        min_pos = torch.where(m.pos, s, inf).amin(dim=1, keepdim=True)
        max_neg = torch.where(m.neg, s, -inf).amax(dim=1, keepdim=True)
        mined_neg = m.neg & (s + self.epsilon > min_pos)
        mined_pos = m.pos & (s - self.epsilon < max_neg)
        both = mined_pos.any(dim=1) & mined_neg.any(dim=1)
        mined_pos &= both[:, None]
        mined_neg &= both[:, None]

        lse_pos, has_pos = masked_logsumexp(-self.alpha * (S - self.base), mined_pos)
        lse_neg, has_neg = masked_logsumexp(self.beta * (S - self.base), mined_neg)
        # log(1 + Σ exp(x)) = softplus(log Σ exp(x)); zero for an empty set
        pos_part = torch.where(has_pos, F.softplus(lse_pos), torch.zeros_like(lse_pos)) / self.alpha
        neg_part = torch.where(has_neg, F.softplus(lse_neg), torch.zeros_like(lse_neg)) / self.beta
        total = masked_sum(pos_part + neg_part, both)

        n_mined = mined_pos.sum() + mined_neg.sum()
        means = similarity_stats(S, m)
        means["tightness"] = masked_mean_stat(pos_part, m.valid)
        means["contrastive"] = masked_mean_stat(neg_part, m.valid)
        means["nontrivial_fraction"] = n_mined, m.pos.sum() + m.neg.sum()
        totals = {"active_pairs": n_mined, "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=anchor_rows(m, self.normalize).sum(), means=means, totals=totals)
