"""Center loss (Wen et al., ECCV 2016).

``L = ½ mean_i ||x_i - c_{y_i}||²`` over raw (not normalised) embeddings, with one learnable
centre per class (``weight``). The paper updates the centres with its own rate α; here
they are ordinary parameters moved by the optimiser by this gradient (as in common
reimplementations; scale the loss's learning-rate multiplier to mimic α). On its own it
collapses every embedding to one point: it is the *tightness* term of the CE paper's
Table 2 and is meant to be combined with a softmax loss (``loss.classifier`` + this).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dmltrain.losses.base import ProxyLoss
from dmltrain.losses.pairs import normalize, similarity, upcast
from dmltrain.losses.registry import register


@register("center")
class CenterLoss(ProxyLoss):
    """Center loss; ``stats``: ``tightness`` (the loss), ``pos_sim``/``neg_sim`` (cosine to own/other centres)."""

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if (
            embeddings.dim() != 2
            or labels.dim() != 1
            or labels.shape[0] != embeddings.shape[0]
            or embeddings.shape[1] != self.dim
        ):
            raise ValueError(
                f"center: expected embeddings B×{self.dim} and labels B, got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        self.check_labels(labels)
        x = upcast(embeddings)
        per_example = 0.5 * (x - upcast(self.weight[labels])).square().sum(dim=1)
        loss = per_example.mean() if labels.numel() else self.weight.sum() * 0.0
        with torch.no_grad():
            cos = similarity(normalize(x), normalize(self.weight))
            rows = torch.arange(labels.shape[0], device=labels.device)
            pos = cos[rows, labels]
            self.stats = {
                "tightness": float(loss.detach()),
                "active_pairs": float((per_example > 0).sum()),
                "skipped_anchors": 0.0,
            }
            if labels.numel():
                self.stats["pos_sim"] = float(pos.mean())
                self.stats["nontrivial_fraction"] = float((per_example > 0).float().mean())
                if self.num_classes > 1:
                    self.stats["neg_sim"] = float(((cos.sum(dim=1) - pos) / (self.num_classes - 1)).mean())
        return loss
