"""Normalized softmax (NormSoftmax; Zhai & Wu, BMVC 2019, sec. 3).

``-log softmax(x̂ᵀŵ_y / T)`` with L2-normalised embeddings and class weights, no bias.
Default ``T = 0.05`` is the paper's.
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.classifier import ClassifierLoss
from dmltrain.losses.pairs import normalize, similarity
from dmltrain.losses.registry import register


@register("normsoftmax")
class NormSoftmaxLoss(ClassifierLoss):
    """Cosine softmax with temperature; safe at ``T = 0.05`` in fp32 and under bf16 autocast (logits ≤ 1/T)."""

    def __init__(self, num_classes: int, dim: int, temperature: float = 0.05) -> None:
        if temperature <= 0:
            raise ValueError(f"normsoftmax: temperature must be positive, got {temperature}")
        super().__init__(num_classes, dim)
        self.temperature = float(temperature)

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        cos = similarity(normalize(embeddings), normalize(self.weight), allow_autocast=True)
        return cos / self.temperature, cos
