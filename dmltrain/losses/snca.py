"""Scalable neighbourhood component analysis (SNCA; Wu, Efros & Yu, ECCV 2018), batch form.

Cosine similarity ``s`` of L2-normalised embeddings, temperature ``σ``; for each anchor::

    -log( Σ_{j∈pos(a)} exp(s_aj/σ) / Σ_{k≠a} exp(s_ak/σ) )

averaged over anchors. The default ``σ = 0.05`` is the paper's. As in the CE paper's
Table 2, ``stats`` splits it into ``tightness`` (``-log Σ_pos exp``) and ``contrastive``
(``log Σ_{k≠a} exp``), both means over anchors.
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    NONTRIVIAL_NLL,
    label_masks,
    masked_logsumexp,
    masked_mean_stat,
    masked_sum,
    normalize_both,
    similarity,
    similarity_stats,
)
from dmltrain.losses.registry import register


@register("snca")
class SNCALoss(InstanceLoss):
    """SNCA over the batch (no memory bank). A batch with one class gives zero (all neighbours are positives)."""

    def __init__(self, temperature: float = 0.05) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"snca: temperature must be positive, got {temperature}")
        self.temperature = float(temperature)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        cos = similarity(*normalize_both(anchors, refs))
        logits = cos / self.temperature
        lse_pos, _ = masked_logsumexp(logits, m.pos)
        lse_all, _ = masked_logsumexp(logits, m.other)
        per_anchor = lse_all - lse_pos
        total = masked_sum(per_anchor, m.valid)

        nontrivial = m.valid & (per_anchor.detach() > NONTRIVIAL_NLL)
        means = similarity_stats(cos, m)
        means["tightness"] = masked_mean_stat(-lse_pos, m.valid)
        means["contrastive"] = masked_mean_stat(lse_all, m.valid)
        means["nontrivial_fraction"] = nontrivial.sum(), m.valid.sum()
        totals = {"active_pairs": (m.other & nontrivial[:, None]).sum(), "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=m.valid.sum(), means=means, totals=totals)
