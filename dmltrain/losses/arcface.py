"""ArcFace / additive angular margin (Deng et al., CVPR 2019).

Logits ``s·cos θ_j`` for the other classes and ``s·cos(θ_y + m)`` for the target, with the
true gradient of the margin (:func:`~dmltrain.losses.margins.arcface_target`: the angle from
``atan2`` of the unit vectors, accurate at every angle, and InsightFace's continuation
``cos θ - m·sin m`` beyond ``θ + m > π``; see :mod:`~dmltrain.losses.margins`). Defaults
``s = 64, m = 0.5`` are the ArcFace paper's; ``0 <= margin < π`` (:data:`~dmltrain.losses.kinds.KINDS`).
"""

from __future__ import annotations

from dmltrain.losses.classifier import MarginClassifierLoss
from dmltrain.losses.kinds import KINDS
from dmltrain.losses.registry import register


@register("arcface")
class ArcFaceLoss(MarginClassifierLoss):
    """Additive angular margin on the target logit only."""

    spec = KINDS["arcface"]
