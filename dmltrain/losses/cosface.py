"""CosFace / large-margin cosine loss (LMCL; Wang et al., CVPR 2018), as in the NormSoftmax paper.

Logits ``s·cos θ_j`` for the other classes and ``s·(cos θ_y - m)`` for the target
(:func:`~dmltrain.losses.margins.cosface_target`). Defaults ``s = 64, m = 0.35`` are the
CosFace paper's.
"""

from __future__ import annotations

from dmltrain.losses.classifier import MarginClassifierLoss
from dmltrain.losses.registry import register


@register("cosface")
class CosFaceLoss(MarginClassifierLoss):
    """Additive cosine margin on the target logit only; ``margin >= 0``."""

    kind = "cosface"

    def __init__(self, num_classes: int, dim: int, scale: float = 64.0, margin: float = 0.35) -> None:
        super().__init__(num_classes, dim, scale, margin)
