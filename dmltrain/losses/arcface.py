"""ArcFace / additive angular margin (Deng et al., CVPR 2019).

Logits ``s·cos θ_j`` for the other classes and ``s·cos(θ_y + m)`` for the target, with the
true gradient of the margin. Defaults ``s = 64, m = 0.5`` are the ArcFace paper's.

Numerics of the target angle. ``acos`` of the cosine loses all precision and has an
infinite derivative as ``θ → 0`` (an embedding on its class weight), and
``sin θ = sqrt(1 - cos²θ)`` has the same problem. We compute the angle from the two unit
vectors instead, ``θ = 2·atan2(||x̂ - ŵ||, ||x̂ + ŵ||)``, which is accurate to the last bit
at every angle and whose gradient with respect to the embedding stays bounded (norm
``sin(θ + m) ≤ 1`` times the normalisation Jacobian) — at ``θ = 0`` exactly it is the
subgradient 0. This costs O(B·D) extra, for the target pairs only.

Beyond ``θ + m > π`` the function ``cos(θ + m)`` turns upward, so a larger angle would
*raise* the target logit. There we use, as the reference implementation (InsightFace)
does, ``cos θ - m·sin m``: still below ``cos θ`` (the margin keeps penalising) and
decreasing in ``θ`` (the gradient keeps pulling the embedding toward its class).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmltrain.losses.classifier import ClassifierLoss, target_pairs
from dmltrain.losses.pairs import normalize, similarity
from dmltrain.losses.registry import register


def unit_angle(u: Tensor, v: Tensor) -> Tensor:
    """Angle between the rows of two sets of unit vectors, accurate near 0 and π."""
    return 2.0 * torch.atan2((u - v).norm(dim=1), (u + v).norm(dim=1))


def arc_margin(theta: Tensor, margin: float) -> Tensor:
    """``cos(θ + m)`` for ``θ + m ≤ π``, else ``cos θ - m·sin m`` (monotone continuation)."""
    inside = theta + margin <= math.pi
    return torch.where(inside, torch.cos(theta + margin), torch.cos(theta) - margin * math.sin(margin))


@register("arcface")
class ArcFaceLoss(ClassifierLoss):
    """Additive angular margin on the target logit only; see the module docstring for the numerics."""

    def __init__(self, num_classes: int, dim: int, scale: float = 64.0, margin: float = 0.5) -> None:
        if scale <= 0 or not 0 <= margin < math.pi:
            raise ValueError(f"arcface: need scale > 0 and 0 <= margin < pi, got {scale}, {margin}")
        super().__init__(num_classes, dim)
        self.scale, self.margin = float(scale), float(margin)

    def scores(self, embeddings: Tensor, labels: Tensor, weight: Tensor | None = None, class_ids: Tensor | None = None, bias: Tensor | None = None):
        x_hat = normalize(embeddings)
        w_hat = normalize(self.weight if weight is None else weight)
        cos = similarity(x_hat, w_hat, allow_autocast=True)
        rows, cols = target_pairs(labels, cos.shape[1], class_ids)
        theta = unit_angle(x_hat[rows], w_hat[cols])
        logits = (self.scale * cos).index_put((rows, cols), self.scale * arc_margin(theta, self.margin))
        return logits, cos
