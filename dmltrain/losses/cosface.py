"""CosFace / large-margin cosine loss (LMCL; Wang et al., CVPR 2018), as in the NormSoftmax paper.

Logits ``s·cos θ_j`` for the other classes and ``s·(cos θ_y - m)`` for the target
(:func:`~dmltrain.losses.margins.cosface_target`). Defaults ``s = 64, m = 0.35`` are the
CosFace paper's; ``margin >= 0`` (:data:`~dmltrain.losses.kinds.KINDS`).
"""

from __future__ import annotations

from dmltrain.losses.classifier import MarginClassifierLoss
from dmltrain.losses.kinds import KINDS
from dmltrain.losses.registry import register


@register("cosface")
class CosFaceLoss(MarginClassifierLoss):
    """Additive cosine margin on the target logit only."""

    spec = KINDS["cosface"]
