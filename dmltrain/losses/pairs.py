"""Building blocks shared by the instance losses: normalisation, label masks, safe reductions.

Every helper is NaN-free in forward *and* backward on empty masks: masked entries are
replaced by finite values before any ``exp``/``log``/``sqrt``, so autograd never multiplies
a zero upstream gradient by an infinite local derivative. Everything runs in (at
least) float32 even under ``torch.autocast``; see :func:`similarity` for the one GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: A likelihood term ``-log p`` counts as non-trivial (still teaching something) above this.
NONTRIVIAL_NLL = 1e-3

#: Floor of squared distances before ``sqrt``: keeps gradients finite for identical embeddings.
SQ_DIST_FLOOR = 1e-12

#: What the anchor-wise losses (ICE, RLL, MS) divide their summed anchor terms by: every anchor of
#: the batch (``batch``, their papers' N) or only the anchors that have a positive (``valid_anchors``).
#: The two agree on P×K batches; they differ when a batch holds classes with a single image.
NORMALIZATIONS = ("batch", "valid_anchors")


def upcast(x: Tensor) -> Tensor:
    """float16/bfloat16 to float32; float32 and float64 unchanged (float64 for gradcheck)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def normalize(x: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm, at least float32 (a zero row stays zero)."""
    return F.normalize(upcast(x), dim=1, eps=1e-12)


def normalize_both(anchors: Tensor, refs: Tensor) -> tuple[Tensor, Tensor]:
    """Both sets L2-normalised; once when they are the same tensor (the single-process call)."""
    r = normalize(refs)
    return (r if anchors is refs else normalize(anchors)), r


def similarity(a: Tensor, b: Tensor, allow_autocast: bool = False) -> Tensor:
    """``a @ b.T`` in (at least) float32.

    By default the GEMM itself runs in float32 even inside ``torch.autocast``: for a batch
    against itself it is cheap next to the backbone, and a bf16 cosine (8 bits of mantissa)
    times a scale of 64 would move logits by ±0.25. ``allow_autocast=True`` (the classifiers,
    whose batch × classes GEMM is the expensive one) lets autocast pick the precision and
    upcasts the result.
    """
    if not allow_autocast and torch.is_autocast_enabled(a.device.type):
        with torch.autocast(a.device.type, enabled=False):
            return upcast(a) @ upcast(b).t()
    return upcast(a @ b.t())


def unit_distance(cos: Tensor) -> Tensor:
    """Euclidean distance of unit vectors from their cosine: ``sqrt(2 - 2 cos)``, floored before the root."""
    return (2.0 - 2.0 * cos).clamp_min(SQ_DIST_FLOOR).sqrt()


@dataclass
class LabelMasks:
    """Anchor × ref masks. ``pos`` excludes the anchor itself; ``valid`` anchors have a positive."""

    pos: Tensor
    neg: Tensor
    other: Tensor
    valid: Tensor

    @property
    def skipped(self) -> Tensor:
        return (~self.valid).sum()


def label_masks(anchor_labels: Tensor, ref_labels: Tensor, anchor_index: Tensor) -> LabelMasks:
    """Positive / negative / not-self masks of anchors against refs, restricted to valid anchors.

    Rows of anchors without a positive are all-False in ``pos`` and ``neg``, so they drop out
    of every sum; ``valid`` marks the others.
    """
    same = anchor_labels[:, None] == ref_labels[None, :]
    cols = torch.arange(ref_labels.shape[0], device=ref_labels.device)
    other = cols[None, :] != anchor_index[:, None]
    pos = same & other
    valid = pos.any(dim=1)
    return LabelMasks(pos=pos, neg=~same & valid[:, None], other=other & valid[:, None], valid=valid)


def check_normalize(loss: str, normalize: str) -> str:
    """``normalize`` if it is one of :data:`NORMALIZATIONS`; else a one-line ``ValueError`` naming the loss."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"{loss}: normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    return normalize


def anchor_rows(masks: LabelMasks, normalize: str) -> Tensor:
    """The anchors counted in the normaliser: all of them (``batch``) or those with a positive (``valid_anchors``)."""
    return masks.valid if normalize == "valid_anchors" else torch.ones_like(masks.valid)


def masked_logsumexp(x: Tensor, mask: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``log Σ_{mask} exp(x)`` along ``dim`` and whether the set was non-empty.

    Empty sets return 0 (not ``-inf``) so that callers can ``torch.where`` them away without
    NaN gradients; use the returned flag to do so.
    """
    nonempty = mask.any(dim=dim)
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    # an empty set takes its row of x instead (finite; replaced by 0 below) so nothing is -inf - -inf
    lse = torch.logsumexp(torch.where(mask | ~nonempty.unsqueeze(dim), x, neg_inf), dim=dim)
    return torch.where(nonempty, lse, torch.zeros_like(lse)), nonempty


def masked_softmax(x: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Softmax of ``x`` over the entries in ``mask`` (zero elsewhere, an all-zero row when empty)."""
    lse, nonempty = masked_logsumexp(x, mask, dim)
    safe = torch.where(mask, x - lse.unsqueeze(dim), torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(mask & nonempty.unsqueeze(dim), safe.exp(), torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` over ``mask`` (a graph-connected zero when the mask is empty)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_sum_rows(x: Tensor, mask: Tensor) -> Tensor:
    """Row sums of ``x`` over ``mask`` (``x`` must be finite everywhere)."""
    return x.masked_fill(~mask, 0.0).sum(dim=1)


def masked_mean_stat(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum, count) of a detached statistic over ``mask``, for :attr:`AnchorTerms.means`."""
    x = x.detach()
    return masked_sum(x, mask), mask.sum()


def similarity_stats(cos: Tensor, masks: LabelMasks) -> dict[str, tuple[Tensor, Tensor]]:
    """Mean cosine similarity of positive and of negative pairs of the valid anchors."""
    return {"pos_sim": masked_mean_stat(cos, masks.pos), "neg_sim": masked_mean_stat(cos, masks.neg)}
