"""CosFace / large-margin cosine loss (LMCL; Wang et al., CVPR 2018), as in the NormSoftmax paper.

Logits ``s·cos θ_j`` for the other classes and ``s·(cos θ_y - m)`` for the target.
Defaults ``s = 64, m = 0.35`` are the CosFace paper's.
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.classifier import ClassifierLoss, target_pairs
from dmltrain.losses.pairs import normalize, similarity
from dmltrain.losses.registry import register


@register("cosface")
class CosFaceLoss(ClassifierLoss):
    """Additive cosine margin on the target logit only."""

    def __init__(self, num_classes: int, dim: int, scale: float = 64.0, margin: float = 0.35) -> None:
        if scale <= 0 or margin < 0:
            raise ValueError(f"cosface: need scale > 0 and margin >= 0, got {scale}, {margin}")
        super().__init__(num_classes, dim)
        self.scale, self.margin = float(scale), float(margin)

    def scores(self, embeddings: Tensor, labels: Tensor, weight: Tensor | None = None, class_ids: Tensor | None = None, bias: Tensor | None = None):
        cos = similarity(normalize(embeddings), normalize(self.weight if weight is None else weight), allow_autocast=True)
        rows, cols = target_pairs(labels, cos.shape[1], class_ids)
        logits = (self.scale * cos).index_put((rows, cols), self.scale * (cos[rows, cols] - self.margin))
        return logits, cos
