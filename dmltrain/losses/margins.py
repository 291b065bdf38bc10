"""The target-logit margins and the label smoothing of the softmax classifiers, in one place.

Each kind's record in :mod:`~dmltrain.losses.kinds` names its target-logit function here;
both the registry losses (:mod:`~dmltrain.losses.normsoftmax`, :mod:`~dmltrain.losses.cosface`,
:mod:`~dmltrain.losses.arcface`, :mod:`~dmltrain.losses.softmax_ce`) and the class-sharded
classifier (:mod:`dmltrain.distributed.sharded_softmax`) call them through it, so the two
cannot drift apart.

Target logits are computed on *paired* rows (each example's unit embedding with its own
class's unit weight), O(batch × D), and differentiated by autograd: the batch × classes GEMM
only carries the plain ``scale · cos`` of the other classes.

ArcFace numerics. ``acos`` of the cosine loses all precision and has an infinite derivative as
``θ → 0`` (an embedding on its class weight), and ``sin θ = sqrt(1 - cos²θ)`` has the same
problem; so does any formula through ``d/d cosθ`` (``sin(θ + m) / sin θ``). The angle comes
from the two unit vectors instead, ``θ = 2·atan2(||x̂ - ŵ||, ||x̂ + ŵ||)``, accurate to the last
bit at every angle, with a gradient w.r.t. the vectors bounded by ``s·sin(θ + m)`` (at
``θ = 0`` exactly the subgradient 0). Beyond ``θ + m > π``, ``cos(θ + m)`` turns upward (a
larger angle would *raise* the target logit); there we use, as InsightFace does,
``cos θ - m·sin m``: still below ``cos θ`` and still decreasing in ``θ``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def pair_cos(x_hat: Tensor, w_hat: Tensor) -> Tensor:
    """Cosine of paired rows of unit vectors (row ``i`` of each)."""
    return (x_hat * w_hat).sum(1)


def unit_angle(u: Tensor, v: Tensor) -> Tensor:
    """Angle between paired rows of unit vectors, accurate at every angle (unlike ``acos``)."""
    return 2.0 * torch.atan2(torch.linalg.vector_norm(u - v, dim=1), torch.linalg.vector_norm(u + v, dim=1))


def arc_margin(theta: Tensor, margin: float) -> Tensor:
    """``cos(θ + m)`` for ``θ + m ≤ π``, else ``cos θ - m·sin m`` (InsightFace's monotone continuation)."""
    inside = theta + margin <= math.pi
    return torch.where(inside, torch.cos(theta + margin), torch.cos(theta) - margin * math.sin(margin))


def normsoftmax_target(x_hat: Tensor, w_hat: Tensor, temperature: float) -> Tensor:
    """NormSoftmax has no margin: ``cos θ / T`` (kept so every normalised kind has a target path)."""
    return pair_cos(x_hat, w_hat) / temperature


def cosface_target(x_hat: Tensor, w_hat: Tensor, scale: float, margin: float) -> Tensor:
    """CosFace: ``s·(cos θ - m)``."""
    return scale * (pair_cos(x_hat, w_hat) - margin)


def arcface_target(x_hat: Tensor, w_hat: Tensor, scale: float, margin: float) -> Tensor:
    """ArcFace: ``s·cos(θ + m)`` with θ from :func:`unit_angle`, continued beyond ``θ + m > π``."""
    return scale * arc_margin(unit_angle(x_hat, w_hat), margin)


def smoothing_weights(num_classes: int, smoothing: float) -> tuple[float, float]:
    """Target distribution of label smoothing: (weight of the true class, of each other class).

    ``(1 - ε, ε/(K-1))`` over ``K`` classes; ``(1, 0)`` without smoothing or with a single
    class (then the loss and its gradient are exactly zero).
    """
    if smoothing == 0.0 or num_classes < 2:
        return 1.0, 0.0
    return 1.0 - smoothing, smoothing / (num_classes - 1)


def smoothed_nll(lse: Tensor, target_logit: Tensor, logit_sum: Tensor, num_classes: int, smoothing: float) -> Tensor:
    """Per-example cross-entropy with label smoothing, from three per-example reductions.

    ``lse`` = log Σ_j exp(z_j), ``target_logit`` = z_y, ``logit_sum`` = Σ_j z_j over all ``K =
    num_classes`` classes of the softmax (the sharded classifier all-reduces them). Its gradient
    w.r.t. ``z_j`` is ``p_j`` minus the :func:`smoothing_weights` target. ``ε = 0`` (or ``K = 1``)
    is the plain ``lse - z_y`` and ignores ``logit_sum``.
    """
    on, off = smoothing_weights(num_classes, smoothing)
    if off == 0.0:
        return lse - target_logit
    return lse - on * target_logit - off * (logit_sum - target_logit)
