"""Proxy-NCA (Movshovitz-Attias et al., ICCV 2017).

One proxy per class; with L2-normalised embeddings and proxies and ``d² = ||x̂ - p̂||²``::

    -log( exp(-s·d²(x, p_y)) / Σ_{z≠y} exp(-s·d²(x, p_z)) )

The paper's form excludes the target from the denominator (so the loss can be negative);
``exclude_positive=False`` gives the softmax form of Proxy-NCA++ (Teh et al., ECCV 2020).
The scale ``s`` (a ``1/T``) sharpens the distances of unit vectors (``d² ≤ 4``); the
default ``s = 9`` is the common reimplementation's norm scale 3 on both sides (3² = 9),
also Proxy-NCA++'s ``T = 1/9``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmltrain.losses.classifier import ClassifierLoss
from dmltrain.losses.pairs import masked_logsumexp, normalize, similarity
from dmltrain.losses.registry import register


@register("proxy_nca")
class ProxyNCALoss(ClassifierLoss):
    """Proxy-NCA; ``exclude_positive=True`` (the paper) needs at least 2 classes."""

    def __init__(self, num_classes: int, dim: int, scale: float = 9.0, exclude_positive: bool = True) -> None:
        if scale <= 0:
            raise ValueError(f"proxy_nca: scale must be positive, got {scale}")
        if exclude_positive and num_classes < 2:
            raise ValueError("proxy_nca: excluding the positive from the denominator needs num_classes >= 2")
        super().__init__(num_classes, dim)
        self.scale, self.exclude_positive = float(scale), bool(exclude_positive)

    def scores(self, embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        cos = similarity(normalize(embeddings), normalize(self.weight), allow_autocast=True)
        # -s ||x̂ - p̂||² = -s (2 - 2 cos) for unit vectors
        return -self.scale * (2.0 - 2.0 * cos), cos

    def nll(self, logits: Tensor, labels: Tensor) -> Tensor:
        if not self.exclude_positive:
            return super().nll(logits, labels)
        rows = torch.arange(labels.shape[0], device=labels.device)
        others = torch.ones_like(logits, dtype=torch.bool).index_put(
            (rows, labels), torch.tensor(False, device=logits.device)
        )
        lse, _ = masked_logsumexp(logits, others)
        return lse - logits[rows, labels]
