"""Triplet loss with semi-hard negative mining (Schroff, Kalenichenko & Philbin, FaceNet, CVPR 2015).

For every (anchor, positive) pair of the batch the negative is chosen as in FaceNet's
online semi-hard mining (and TensorFlow's ``triplet_semihard_loss``): the closest negative
that is farther than the positive (``d_an > d_ap``); when there is none, the farthest
negative. The loss is ``mean over (anchor, positive) pairs of [d_ap - d_an + margin]₊``.

``d`` is the squared Euclidean distance between L2-normalised embeddings (FaceNet; with
``squared=False`` the plain distance). Default ``margin = 0.2`` is FaceNet's. Mining is
vectorised: each anchor's negative distances are sorted once and every positive distance
is located in them with a batched binary search (O(B² log B), no B³ tensor).
"""

from __future__ import annotations

import torch
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


@register("triplet")
class TripletLoss(InstanceLoss):
    """Semi-hard triplet loss. Pairs of an anchor without negatives count in the mean with a zero term.

    ``stats`` adds ``semihard_fraction``: the share of pairs that found a semi-hard negative.
    """

    def __init__(self, margin: float = 0.2, squared: bool = True) -> None:
        super().__init__()
        if margin < 0:
            raise ValueError(f"triplet: margin must be >= 0, got {margin}")
        self.margin, self.squared = float(margin), bool(squared)

    def anchor_terms(
        self, anchors: Tensor, anchor_labels: Tensor, refs: Tensor, ref_labels: Tensor, anchor_index: Tensor
    ) -> AnchorTerms:
        m = label_masks(anchor_labels, ref_labels, anchor_index)
        cos = similarity(*normalize_both(anchors, refs))
        d = (2.0 - 2.0 * cos).clamp_min(0.0) if self.squared else unit_distance(cos)

        neg_col, semihard = semihard_negatives(d.detach(), m.pos, m.neg)
        d_an = d.gather(1, neg_col)
        n_neg = m.neg.sum(dim=1, keepdim=True)

        triplet = m.pos & (n_neg > 0)
        term = (d - d_an + self.margin).clamp_min(0.0)
        total = masked_sum(term, triplet)
        active = triplet & (term.detach() > 0)

        means = similarity_stats(cos, m)
        means["nontrivial_fraction"] = active.sum(), triplet.sum()
        means["semihard_fraction"] = (semihard & triplet).sum(), triplet.sum()
        means["neg_distance"] = masked_mean_stat(d_an, triplet)
        totals = {"active_pairs": active.sum(), "skipped_anchors": m.skipped}
        return AnchorTerms(total=total, count=m.pos.sum(), means=means, totals=totals)


def semihard_negatives(d: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
    """For every (anchor, ref) entry: the column of its FaceNet negative, and whether it is semi-hard.

    Semi-hard: the closest negative with ``d_an > d_ap`` (strictly: a tie is not farther);
    otherwise the anchor's farthest negative. Meaningful on ``pos`` entries of anchors with a
    negative. One sort per row; runs of equal distances and "first negative at or after
    position k" come from suffix minima (``cummin`` on the flipped rows).
    """
    rows, n = d.shape
    inf = torch.tensor(float("inf"), dtype=d.dtype, device=d.device)
    key = torch.where(pos | neg, d, inf)
    order = key.argsort(dim=1)
    v = key.gather(1, order)
    ar = torch.arange(n, device=d.device).expand(rows, n)
    sentinel = torch.full((rows, 1), n, dtype=ar.dtype, device=d.device)

    def suffix_min(x: Tensor) -> Tensor:
        return x.flip(1).cummin(dim=1).values.flip(1)

    run_last = torch.ones_like(neg)
    run_last[:, :-1] = v[:, :-1] != v[:, 1:]
    run_end = suffix_min(torch.where(run_last, ar, sentinel))  # last sorted position with the same distance
    first_neg = suffix_min(torch.where(neg.gather(1, order), ar, sentinel))  # first negative at or after k
    after_run = torch.cat([first_neg, sentinel], dim=1).gather(1, run_end + 1)  # first negative strictly farther
    rank = torch.empty_like(order).scatter_(1, order, ar)  # sorted position of every column
    cand = after_run.gather(1, rank)
    semihard = cand < n
    semihard_col = order.gather(1, cand.clamp_max(n - 1))
    farthest = torch.where(neg, d, -inf).argmax(dim=1, keepdim=True)
    return torch.where(semihard, semihard_col, farthest), semihard
