"""Softmax cross-entropy with label smoothing (the CE paper's recipe; Boudiaf et al., ECCV 2020).

A linear classifier **with** bias on the raw embeddings, weight and bias initialised to
zero; targets ``1 - ε`` on the true class and ``ε/(K-1)`` on each other class
(:func:`~dmltrain.losses.margins.smoothed_nll`; note:
``torch.nn.CrossEntropyLoss(label_smoothing=ε)`` spreads ``ε/K`` over all classes instead).
Default ``ε = 0.1`` is the paper's, ``0 <= ε < 1`` (:data:`~dmltrain.losses.kinds.KINDS`). The paper's dropout 0.5 before the classifier belongs
to the model's classifier branch, not to this loss.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dmltrain.losses.classifier import KindClassifierLoss
from dmltrain.losses.kinds import KINDS
from dmltrain.losses.pairs import upcast
from dmltrain.losses.registry import register


@register("softmax_ce")
class SoftmaxCELoss(KindClassifierLoss):
    """Linear (``weight``, ``bias``) + label-smoothed cross-entropy; inputs are not normalised."""

    spec = KINDS["softmax_ce"]

    def __init__(self, num_classes: int, dim: int, **params: float) -> None:
        super().__init__(num_classes, dim, **params)
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if hasattr(self, "bias"):
            nn.init.zeros_(self.bias)

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        x = upcast(embeddings)
        logits = upcast(torch.nn.functional.linear(x, self.weight, self.bias))
        with torch.no_grad():  # cosine for the statistics only: (z - b) / (|x| |w|)
            cos = (logits - upcast(self.bias)) / (
                x.norm(dim=1)[:, None] * upcast(self.weight).norm(dim=1)[None, :]
            ).clamp_min(1e-12)
        return logits, cos
