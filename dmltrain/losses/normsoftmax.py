"""Normalized softmax (NormSoftmax; Zhai & Wu, BMVC 2019, sec. 3).

``-log softmax(x̂ᵀŵ_y / T)`` with L2-normalised embeddings and class weights, no bias.
Default ``T = 0.05`` is the paper's (hyperparameters: :data:`~dmltrain.losses.kinds.KINDS`).
"""

from __future__ import annotations

from torch import Tensor

from dmltrain.losses.classifier import KindClassifierLoss
from dmltrain.losses.kinds import KINDS
from dmltrain.losses.pairs import normalize, similarity
from dmltrain.losses.registry import register


@register("normsoftmax")
class NormSoftmaxLoss(KindClassifierLoss):
    """Cosine softmax with temperature; safe at ``T = 0.05`` in fp32 and under bf16 autocast (logits ≤ 1/T)."""

    spec = KINDS["normsoftmax"]

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        cos = similarity(normalize(embeddings), normalize(self.weight), allow_autocast=True)
        return cos / self.temperature, cos
