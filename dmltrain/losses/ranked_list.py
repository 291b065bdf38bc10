"""Ranked list loss (RLL; Wang et al., CVPR 2019, eqs. 8-14).

Euclidean distance ``d`` between L2-normalised embeddings. For each anchor (query):

* non-trivial positives ``P* = {j: d > α - m}`` give ``L_P = mean_{P*} (d - (α - m))`` (eq. 11);
* non-trivial negatives ``N* = {j: d < α}`` give ``L_N = Σ_{N*} w (α - d)`` with
  ``w = exp(T (α - d))`` normalised over ``N*`` and treated as constants (eqs. 9, 12);
* ``L = L_P + λ L_N`` (eq. 13), averaged over the ``N`` queries of the batch (eq. 14).

Every image is a query (eq. 14 divides by the batch size ``N``). A query whose class has no
other image has an empty ``P*`` but still its negative term ``L_N`` (eq. 12 needs no
positive): ``normalize="batch"``, the default. ``normalize="valid_anchors"`` keeps only the
queries that have a positive (both their terms) and divides by their number; the two agree
on P×K batches and differ once a batch holds single-image classes (``data.sampler: random``).

In each anchor's ranked list the other embeddings are constants (text after eq. 13): the
gradient reaches an embedding only through the lists where it is the query. Defaults
α = 1.2, m = 0.4, T = 10, λ = 1 are the paper's.
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.base import AnchorTerms, InstanceLoss
from dmltrain.losses.pairs import (
    anchor_rows,
    check_normalize,
    label_masks,
    masked_mean_stat,
    masked_softmax,
    masked_sum,
    masked_sum_rows,
    normalize,
    similarity,
    similarity_stats,
    unit_distance,
)
from dmltrain.losses.registry import register


@register("ranked_list")
class RankedListLoss(InstanceLoss):
    """RLL with boundary ``alpha``, margin ``margin``, weighting ``temperature`` and ``balance`` (λ).

    Edge cases: an empty ``P*`` or ``N*`` makes that part zero; with ``normalize="valid_anchors"``
    anchors without a positive are left out (``skipped_anchors``). ``stats`` adds ``pos_loss`` and
    ``neg_loss`` (means of L_P and L_N over the anchors counted).
    """

    def __init__(
        self,
        alpha: float = 1.2,
        margin: float = 0.4,
        temperature: float = 10.0,
        balance: float = 1.0,
        normalize: str = "batch",
    ) -> None:
        super().__init__()
        if not 0 <= margin <= alpha:
            raise ValueError(f"ranked_list: need 0 <= margin <= alpha, got margin={margin}, alpha={alpha}")
        if temperature < 0:
            raise ValueError(f"ranked_list: temperature must be >= 0, got {temperature}")
        self.alpha, self.margin, self.temperature, self.balance = (
            float(alpha),
            float(margin),
            float(temperature),
            float(balance),
        )
        self.normalize = check_normalize("ranked_list", normalize)

    def negative_weights(self, d: Tensor, hard_neg: Tensor) -> Tensor:
        """Eq. 9's ``exp(T (α - d))`` normalised over each anchor's non-trivial negatives (constants)."""
        return masked_softmax(self.temperature * (self.alpha - d), hard_neg).detach()

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        rows = anchor_rows(m, self.normalize)
        # a query without a positive keeps its negatives in "batch" mode (eq. 12); m.neg has only valid anchors'
        neg = (anchor_labels[:, None] != ref_labels[None, :]) & rows[:, None]
        # the gallery of each list is constant: only the query (anchor) receives gradient
        cos = similarity(normalize(anchors), normalize(refs).detach())
        d = unit_distance(cos)
        pos_bound = self.alpha - self.margin
        hard_pos = m.pos & (d > pos_bound)
        hard_neg = neg & (d < self.alpha)

        n_pos = hard_pos.sum(dim=1)
        pos_loss = masked_sum_rows(d - pos_bound, hard_pos) / n_pos.clamp_min(1)
        w = self.negative_weights(d.detach(), hard_neg)
        neg_loss = masked_sum_rows(w * (self.alpha - d), hard_neg)
        per_anchor = pos_loss + self.balance * neg_loss
        total = masked_sum(per_anchor, rows)

        means = similarity_stats(cos, m)
        means["pos_loss"] = masked_mean_stat(pos_loss, rows)
        means["neg_loss"] = masked_mean_stat(neg_loss, rows)
        n_active = hard_pos.sum() + hard_neg.sum()
        means["nontrivial_fraction"] = n_active, m.pos.sum() + neg.sum()
        totals = {"active_pairs": n_active, "skipped_anchors": (~rows).sum()}
        return AnchorTerms(total=total, count=rows.sum(), means=means, totals=totals)
