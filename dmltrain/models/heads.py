"""Embedding heads: backbone feature maps -> one ``B × D`` embedding.

Every head takes the feature maps of one or more backbone stages (multi-level embeddings,
RLL paper sec. 4.3.3) and pools each globally. With ``embedding_dim`` set, each level is
projected to its share of ``D``: ``D // L`` each, the first ``D % L`` levels one wider
(512 over three levels: 171 + 171 + 170). With ``embedding_dim=None`` nothing is projected
and ``D`` is the sum of the levels' channels.

* :class:`LayerNormHead` (NormSoftmax paper sec. 3.2): pool → LayerNorm without affine →
  Linear without bias → L2 normalise, per level; several levels are concatenated and scaled
  by 1/√L, so the result has unit norm and its cosine similarity is the mean of the levels'.
  The LayerNorm centres every feature vector at zero, which makes sign bits meaningful
  (:meth:`~dmltrain.models.embedding_model.EmbeddingModel.binarize`).
* :class:`BatchNormHead` (CE paper sec. 5): pool → [Linear without bias] → BatchNorm1d
  without affine over the concatenation; not normalised (evaluation normalises).
* :class:`PlainHead` (``none``): pool → [Linear with bias], concatenated; not normalised.

Whatever the compute dtype (autocast, bf16 weights), normalisations run and embeddings come
out in float32 (float64 stays float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GlobalPool(nn.Module):
    """``B × C × H × W -> B × C``: ``avg``, ``max``, ``avgmax`` = (avg + max) / 2, or ``gem``, the generalised
    mean (mean of clamp(x, 1e-6)^p)^(1/p) (Radenović et al.; p = 1 is avg, p → ∞ max), computed in float32.
    GeM is meant for non-negative maps (a CNN's ReLU outputs): negative values count as 1e-6."""

    KINDS = ("avg", "max", "avgmax", "gem")
    GEM_EPS = 1e-6

    def __init__(self, kind: str = "avg", p: float = 3.0) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"pooling must be one of {self.KINDS}, got {kind!r}")
        self.kind, self.p = kind, float(p)

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "avg":
            return x.mean((2, 3))
        if self.kind == "max":
            return x.amax((2, 3))
        if self.kind == "gem":
            return _fp32(x).clamp(min=self.GEM_EPS).pow(self.p).mean((2, 3)).pow(1.0 / self.p)
        return 0.5 * (x.mean((2, 3)) + x.amax((2, 3)))

    def extra_repr(self) -> str:
        return f"gem, p={self.p:g}" if self.kind == "gem" else self.kind


def split_dim(total: int, levels: int) -> list[int]:
    """``total`` split over ``levels``: equal shares, the first ``total % levels`` one larger."""
    if levels < 1 or total < levels:
        raise ValueError(f"cannot split {total} dimensions over {levels} levels")
    return [total // levels + (i < total % levels) for i in range(levels)]


class Head(nn.Module):
    """Base of the heads: pools each level; subclasses project, normalise and combine.

    ``in_channels``: channels of each level's feature map, in the order of ``forward``'s list.
    ``level_dims``: each level's share of ``embedding_dim``.
    """

    kind: ClassVar[str] = ""
    normalized: ClassVar[bool] = False  # forward() returns unit-norm rows
    centred: ClassVar[bool] = True  # features are centred at zero, so sign bits carry information

    def __init__(
        self, in_channels: Sequence[int], embedding_dim: int | None, pooling: str = "avg", gem_p: float = 3.0
    ) -> None:
        super().__init__()
        if not in_channels:
            raise ValueError("a head needs at least one level")
        self.in_channels = tuple(int(c) for c in in_channels)
        self.projected = embedding_dim is not None
        self.level_dims = split_dim(embedding_dim, len(in_channels)) if self.projected else list(self.in_channels)
        self.embedding_dim = sum(self.level_dims)
        self.pool = GlobalPool(pooling, gem_p)

    def _check(self, features: Sequence[Tensor]) -> None:
        if len(features) != len(self.in_channels):
            raise ValueError(
                f"{type(self).__name__}: expected {len(self.in_channels)} feature maps, got {len(features)}"
            )

    def levels(self, features: Sequence[Tensor]) -> list[Tensor]:
        """Each level's embedding (``B × level_dims[i]``); ``forward`` is their combination."""
        return list(torch.split(self(features), self.level_dims, dim=1))

    def forward(self, features: Sequence[Tensor]) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, level_dims={self.level_dims}"


def _fp32(x: Tensor) -> Tensor:
    """At least float32 (float64 stays float64, so the heads pass float64 gradcheck)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _linear(layer: nn.Linear, x: Tensor) -> Tensor:
    # the float32 input meets bf16 weights when the model itself is bf16 (DeepSpeed bf16);
    # under autocast with float32 weights this is a no-op and autocast picks the dtype
    return layer(x.to(layer.weight.dtype))


class LayerNormHead(Head):
    """pool → LayerNorm (no affine) → Linear (no bias) → L2 normalise, per level; see the module doc."""

    kind = "layernorm"
    normalized = True

    def __init__(
        self, in_channels: Sequence[int], embedding_dim: int | None, pooling: str = "avg", gem_p: float = 3.0
    ) -> None:
        super().__init__(in_channels, embedding_dim, pooling, gem_p)
        self.norms = nn.ModuleList(nn.LayerNorm(c, elementwise_affine=False) for c in self.in_channels)
        self.proj = (
            nn.ModuleList(nn.Linear(c, d, bias=False) for c, d in zip(self.in_channels, self.level_dims))
            if self.projected
            else None
        )

    def levels(self, features: Sequence[Tensor]) -> list[Tensor]:
        self._check(features)
        out = []
        for i, f in enumerate(features):
            z = self.norms[i](_fp32(self.pool(f)))
            if self.proj is not None:
                z = _linear(self.proj[i], z)
            out.append(F.normalize(_fp32(z), dim=1))
        return out

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        parts = self.levels(features)
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim=1) / math.sqrt(len(parts))


class BatchNormHead(Head):
    """pool → [Linear, no bias] per level → concatenation → BatchNorm1d (no affine)."""

    kind = "batchnorm"

    def __init__(
        self, in_channels: Sequence[int], embedding_dim: int | None, pooling: str = "avg", gem_p: float = 3.0
    ) -> None:
        super().__init__(in_channels, embedding_dim, pooling, gem_p)
        self.proj = (
            nn.ModuleList(nn.Linear(c, d, bias=False) for c, d in zip(self.in_channels, self.level_dims))
            if self.projected
            else None
        )
        self.bn = nn.BatchNorm1d(self.embedding_dim, affine=False)

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        self._check(features)
        parts = [_fp32(self.pool(f)) for f in features]
        if self.proj is not None:
            parts = [_fp32(_linear(p, z)) for p, z in zip(self.proj, parts)]
        z = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        # BN per feature: one BN over the concatenation equals one BN per level
        if z.dtype != self.bn.running_mean.dtype:  # a bf16 model (DeepSpeed): its BN buffers are bf16 too
            z = z.to(self.bn.running_mean.dtype)
        return _fp32(self.bn(z))


class PlainHead(Head):
    """pool → [Linear with bias] per level → concatenation (head ``none``)."""

    kind = "none"

    def __init__(
        self, in_channels: Sequence[int], embedding_dim: int | None, pooling: str = "avg", gem_p: float = 3.0
    ) -> None:
        super().__init__(in_channels, embedding_dim, pooling, gem_p)
        self.proj = (
            nn.ModuleList(nn.Linear(c, d) for c, d in zip(self.in_channels, self.level_dims))
            if self.projected
            else None
        )
        # unprojected pooled features follow a ReLU: all >= 0, so their sign bits are constant
        self.centred = self.projected  # type: ignore[misc]

    def forward(self, features: Sequence[Tensor]) -> Tensor:
        self._check(features)
        parts = [_fp32(self.pool(f)) for f in features]
        if self.proj is not None:
            parts = [_fp32(_linear(p, z)) for p, z in zip(self.proj, parts)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


HEADS: dict[str, type[Head]] = {h.kind: h for h in (LayerNormHead, BatchNormHead, PlainHead)}


def build_head(
    kind: str, in_channels: Sequence[int], embedding_dim: int | None, pooling: str = "avg", gem_p: float = 3.0
) -> Head:
    if kind not in HEADS:
        raise ValueError(f"unknown head {kind!r} (choose from {', '.join(HEADS)})")
    return HEADS[kind](in_channels, embedding_dim, pooling, gem_p)
