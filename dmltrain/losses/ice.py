"""Instance cross entropy (ICE; Wang et al., ICE paper eqs. 3, 5, 11-15).

For anchor ``a`` and each positive ``i`` (``f`` L2-normalised, scale ``s``)::

    p̂(i|a) = exp(s fₐᵀfᵢ) / (exp(s fₐᵀfᵢ) + Σ_{j∈neg(a)} exp(s fₐᵀfⱼ))

and the anchor's term is ``Σᵢ -log p̂(i|a) / (2 s Σᵢ (1 - p̂(i|a)))`` with the denominator a
constant. Summed over anchors and divided by ``N`` this gives exactly the paper's eq. 15
gradients: ``∂L/∂fᵢ = -fₐ w̄(i;a)`` and ``∂L/∂fⱼ = fₐ w̄(j;a)`` with the weights of eqs. 13-14
(the positive and the negative sets each carry ``1/(2N)``).

``N`` is the number of instances in the batch (eqs. 13-14: ``N = Σ_c N_c``, every instance
serves as the anchor). An instance whose class has no other image has no positive, so no
term, but it still counts in ``N``: that is ``normalize="batch"``, the default.
``normalize="valid_anchors"`` divides by the anchors that have a positive instead; the two
agree on P×K batches and differ once a batch holds single-image classes (``data.sampler: random``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    NONTRIVIAL_NLL,
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

# Below this, log(softplus(z)) is z to float32 precision (log1p(e^z) = e^z (1 - e^z/2 + ...)).
_LOG_SOFTPLUS_LINEAR_BELOW = -20.0


def log_softplus(z: Tensor) -> Tensor:
    """``log(log(1 + e^z))`` without underflow for very negative ``z`` (finite gradients everywhere)."""
    small = z < _LOG_SOFTPLUS_LINEAR_BELOW
    safe = torch.where(small, torch.zeros_like(z), z)
    return torch.where(small, z, torch.log(F.softplus(safe)))


@register("ice")
class ICELoss(InstanceLoss):
    """ICE with scale ``s`` (default 64, the paper's best on SOP, its Table 2).

    Edge cases: anchors without a positive add no term (``skipped_anchors``) but count in ``N``
    unless ``normalize="valid_anchors"``; an anchor without negatives has ``p̂ = 1`` for every
    positive and contributes zero (it counts in ``N`` in both modes).
    The weighting is computed in log space, so it stays finite when every ``1 - p̂``
    underflows (s = 64 and well-separated classes). ``stats['nll']`` is the plain mean of
    ``-log p̂(i|a)`` over (anchor, positive) pairs, the number to watch in logs (the
    weighted loss value itself is scaled by ``1/(2s)``).
    """

    def __init__(self, scale: float = 64.0, normalize: str = "batch") -> None:
        super().__init__()
        if scale <= 0:
            raise ValueError(f"ice: scale must be positive, got {scale}")
        self.scale = float(scale)
        self.normalize = check_normalize("ice", normalize)

    def log_weight_norm(self, z: Tensor, active: Tensor) -> Tensor:
        """``log Σᵢ (1 - p̂(i|a))`` per anchor (eqs. 13-14's denominator), a constant of the loss.

        ``z = log((1 - p̂)/p̂)`` on the (anchor, positive) entries marked ``active``.
        """
        log_norm, _ = masked_logsumexp(F.logsigmoid(z), active)
        return log_norm.detach()

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        cos = similarity(*normalize_both(anchors, refs))
        logits = self.scale * cos
        lse_neg, has_neg = masked_logsumexp(logits, m.neg)
        active = m.pos & has_neg[:, None]
        # z = log((1 - p̂) / p̂): -log p̂ = softplus(z) and log(1 - p̂) = logsigmoid(z)
        z = torch.where(active, lse_neg[:, None] - logits, torch.zeros_like(logits))
        log_norm = self.log_weight_norm(z.detach(), active)
        weighted = torch.exp(log_softplus(z) - log_norm[:, None])
        total = masked_sum(weighted, active) / (2.0 * self.scale)

        nll = F.softplus(z).detach()
        means = similarity_stats(cos, m)
        means["nll"] = masked_mean_stat(nll, active)
        nontrivial = ((nll > NONTRIVIAL_NLL) & active).sum()
        means["nontrivial_fraction"] = nontrivial, active.sum()
        totals = {"active_pairs": nontrivial, "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=anchor_rows(m, self.normalize).sum(), means=means, totals=totals)
