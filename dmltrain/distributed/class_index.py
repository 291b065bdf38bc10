"""The nearest-class index of hard-class sampling: each shard's class rows, quantised, and how near
every one of them is to a global batch: to its samples' embeddings, or to its classes' rows.

``loss.classifier.sampling: hard`` (or ``mixed``) draws, besides the batch's own classes, the classes
nearest to the batch. ``nearest_to: classes`` (the default) ranks a class by its best cosine to the
rows of the batch's classes; ``nearest_to: samples`` by its best cosine to any of the batch's
embeddings: the classes its samples score highest, i.e. confuse themselves with. The two differ
because a softmax pushes the rows of look-alike classes apart: on synthetic families (docs/semantics.md), a
trained full softmax's row nearest a class's is a sibling for 10 % of the classes, while a sample's
highest wrong logit is a sibling's for 66 % of the samples. How near is the cosine of the normalised
rows as an index holds them: a snapshot of the shard's rows taken every ``refresh_every`` steps (:func:`build_index`), each
unit row (each sub-center's) stored as integers in ``[−L, L]`` times a per-row scale (``L = 127``
for ``D ≤ 1040``, fewer levels beyond so that ``D·L² < 2²⁴``). One row's cosine resolution is
about ``1/(2L)`` of its largest component: ample to rank neighbours.

Why integers: the products of two rows are then whole numbers below ``2²⁴``, which fp32 GEMMs
(CPU, CUDA, TF32 included: 11 bits hold ``±127``) compute *exactly* in any order and any blocking.
So the nearness of every class, and the drawn set, is bit-identical on every rank, at every world
size and on every device; a float GEMM would round differently with the shard's shape.

Scoring (:func:`nearest_keys`): the queries are the batch's embeddings, quantised as the rows are
(the gathered batch is the same on every rank, so no collective), or the batch classes' index rows,
to which every shard contributes its own in one all-reduce (``N × k × (D + 1)`` numbers, each the sum
of zeros and one value: exact). Each shard then scores its own rows in exact blocked GEMMs: a class's
nearness is its largest cosine to any query (over its sub-centers, and the query class's). Keys order
the classes nearest first, ties by class id, for the radix select of
:func:`~dmltrain.distributed.class_sampling.draw_active`. Device work per step: ``O(N·k² × local
classes × D)`` (``O(N·k × ...)`` from the samples), no host read; memory ``O(local classes × k × D)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dmltrain.distributed.collectives import all_reduce_sum
from dmltrain.distributed.workspace import BLOCK_ELEMENTS

_EXACT = (1 << 24) - 1  # fp32 holds every whole number up to it


def levels(dim: int) -> int:
    """The integer levels ``L`` of a ``dim``-wide index row: ``D·L² < 2²⁴`` (exact fp32 products), at most 127."""
    return max(1, min(127, math.isqrt(_EXACT // max(1, dim))))


@dataclass
class ClassIndex:
    """A shard's rows as the index holds them: ``codes`` (``rows × k × D`` int8 in ``[−L, L]``),
    ``scales`` (``rows × k`` fp32: a unit row is ``codes · scale``), and the step it was built at."""

    codes: Tensor
    scales: Tensor
    built_at: int

    def stale(self, step: int, refresh_every: int) -> bool:
        """Whether step ``step`` needs a fresh index (``refresh_every`` steps after this one was built, or before it)."""
        return step < self.built_at or step >= self.built_at + refresh_every


@torch.no_grad()
def quantize(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows (``... × D``) as the index holds them: their unit vectors as int8 codes in ``[−L, L]``, and each
    one's fp32 scale (``codes · scale`` is the unit row). A zero row has zero codes."""
    w = F.normalize(rows.detach().float(), dim=-1)
    L = levels(rows.shape[-1])
    top = w.abs().amax(-1).clamp_min(1e-30)
    return torch.round(w * (L / top)[..., None]).to(torch.int8), (top / L).contiguous()


def build_index(weight: Tensor, subcenters: int, step: int) -> ClassIndex:
    """The index of a shard's ``weight`` (``rows × D``, or ``rows × k × D`` with sub-centers) at ``step``."""
    codes, scales = quantize(weight.reshape(weight.shape[0], subcenters, weight.shape[-1]))
    return ClassIndex(codes, scales, int(step))


def _ordered(score: Tensor) -> Tensor:
    """fp32 values as non-negative int64 in the same order (the IEEE bit pattern, sign folded)."""
    bits = score.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits | (1 << 31))


def nearest_keys(
    index: ClassIndex, labels: Tensor, start: int, id_bits: int, group=None, embeddings: Tensor | None = None
) -> Tensor:
    """Every local row's draw key by nearness to the global batch: unique int64, *smallest for the nearest*,
    ``(2³² − 1 − ordered cosine) << id_bits | class id`` (the cosine of :func:`nearest_scores`; its arguments)."""
    return order_keys(nearest_scores(index, labels, start, group, embeddings), start, id_bits)


def order_keys(score: Tensor, start: int, id_bits: int) -> Tensor:
    """Unique int64 keys of fp32 scores of the rows from global id ``start`` on, smallest for the largest score,
    ties by class id: ``(2³² − 1 − ordered score) << id_bits | class id``."""
    ids = torch.arange(start, start + score.numel(), dtype=torch.int64, device=score.device)
    return ((0xFFFFFFFF - _ordered(score)) << id_bits) | ids


def key_score(key: Tensor, id_bits: int) -> Tensor:
    """The fp32 score an :func:`order_keys` key was made of (its inverse, the class id dropped)."""
    o = 0xFFFFFFFF - (key >> id_bits)
    bits = torch.where(o >= 1 << 31, o - (1 << 31), 0xFFFFFFFF - o)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def nearest_scores(
    index: ClassIndex, labels: Tensor, start: int, group=None, embeddings: Tensor | None = None
) -> Tensor:
    """Every local row's nearness to the global batch (fp32, bit-identical on every rank and world size): its
    largest cosine, over its sub-centers, to any of ``embeddings`` (the gathered batch, ``N × D``, the same on
    every rank: no collective) or, None, to the rows of the batch's classes (``labels``, the same on every
    rank; one all-reduce over ``group``). ``start``: the global id of the shard's first row. Without a batch
    every row scores 0."""
    codes, scales = index.codes, index.scales
    n, k, D = codes.shape
    N = labels.numel()
    dev = codes.device
    if N == 0:  # nothing to rank (on every rank alike): every class ties
        return torch.zeros(n, device=dev, dtype=torch.float32)
    if embeddings is not None:  # no collective: a shard without classes scores nothing
        q_codes, q_scales = quantize(embeddings.to(dev))
        q, qs = q_codes.float(), q_scales[:, None]
    else:
        if n == 0:  # a shard without classes holds none of the batch's rows, but joins the all-reduce
            packed = torch.zeros(N * k * (D + 1), device=dev)
        else:  # the batch's rows: each shard fills the samples whose class it holds (zeros elsewhere); summed, exact
            local = labels - start
            own = (local >= 0) & (local < n)
            row = local.clamp(0, n - 1)
            packed = torch.cat(
                [
                    torch.where(own[:, None, None], codes.index_select(0, row).float(), 0.0).flatten(),
                    torch.where(own[:, None], scales.index_select(0, row), 0.0).flatten(),
                ]
            )
        all_reduce_sum(packed, group)
        q = packed[: N * k * D].view(N * k, D)
        qs = packed[N * k * D :].view(N * k, 1)
    Q = q.shape[0]
    best = torch.empty(n, device=dev, dtype=torch.float32)
    block = max(1, BLOCK_ELEMENTS // max(1, Q * k, D * k))
    for c0 in range(0, n, block):
        c1 = min(n, c0 + block)
        rows = codes[c0:c1].reshape(-1, D).float()
        dots = torch.mm(q, rows.t())  # whole numbers below 2**24: exact in any order
        cos = dots.mul_(qs).mul_(scales[c0:c1].reshape(1, -1))
        best[c0:c1] = cos.view(Q, c1 - c0, k).amax(dim=(0, 2))
    return best
