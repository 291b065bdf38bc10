"""Collectives over a process group with uneven local batch sizes, and their autograd rules.

Every function works without ``torch.distributed`` being initialised (or with a group of one):
it then does no communication, so the same code runs in one process.

* :func:`gather_rows` concatenates every worker's rows given their counts (no gradient, no size
  exchange: nothing is read back to the host when the counts are known);
* :func:`all_gather_uneven` concatenates each worker's rows in rank order (no gradient).
* :func:`gather_with_grad` does the same with a backward that hands every worker the gradient
  of its own rows summed over all workers (each worker back-propagates its own terms of a
  global loss through the gathered batch; the sum is the gradient of the global loss).
* :func:`grad_scale` is the identity whose backward multiplies the gradient by a constant:
  put the backbone output through ``grad_scale(emb, world_size)`` before global losses so
  that DeepSpeed's *averaging* of data-parallel gradients yields the gradient of the global
  loss (the gathered losses already *sum* every worker's contribution into each worker's
  embeddings).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def group_rank_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; (0, 1) when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    return group_rank_size(group)[1] > 1


def all_gather_sizes(n: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> list[int]:
    """Each worker's ``n``, in rank order (one small collective)."""
    _, world = group_rank_size(group)
    if world == 1:
        return [int(n)]
    t = torch.tensor([int(n)], dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return [int(x) for x in torch.cat(out).tolist()]


def gather_rows(x: Tensor, sizes: Sequence[int], group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate every worker's ``x`` (rows differ, trailing shape equal) in rank order."""
    if len(sizes) == 1:
        return x
    biggest = max(sizes)
    x = x.contiguous()
    if x.shape[0] < biggest:  # pad so that every worker sends the same shape
        pad = x.new_zeros((biggest - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad])
    out = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(out, x, group=group)
    if all(s == biggest for s in sizes):
        return torch.cat(out)
    return torch.cat([t[:s] for t, s in zip(out, sizes)])


def all_gather_uneven(
    x: Tensor, group: dist.ProcessGroup | None = None, sizes: Sequence[int] | None = None
) -> tuple[Tensor, list[int]]:
    """Concatenate each worker's ``x`` along dim 0 in rank order; returns it and the row counts.

    Workers may hold different numbers of rows (zero included); the trailing shape and dtype
    must agree. Pass ``sizes`` when already known to skip the size exchange.
    """
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device)
    return gather_rows(x, sizes, group), list(sizes)


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, sizes: tuple[int, ...], group, reduce_grad: bool) -> Tensor:
        rank, _ = group_rank_size(group)
        ctx.sizes, ctx.group, ctx.reduce_grad, ctx.rank = sizes, group, reduce_grad, rank
        return gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        sizes, rank = ctx.sizes, ctx.rank
        start = sum(sizes[:rank])
        if len(sizes) > 1 and ctx.reduce_grad:
            grad = grad.contiguous()
            # Summing the whole gathered gradient and keeping our rows is what every backend
            # supports for uneven sizes; its volume equals the forward gather's.
            dist.all_reduce(grad, group=ctx.group)
        return grad[start : start + sizes[rank]], None, None, None


def gather_with_grad(
    x: Tensor,
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    reduce_grad: bool = True,
) -> Tensor:
    """All-gather ``x`` (uneven row counts allowed) keeping the autograd graph.

    Backward: with ``reduce_grad`` (default) each worker receives the sum over workers of the
    gradient on its own rows, i.e. the gradient of Σ_workers (local objective). With
    ``reduce_grad=False`` each worker keeps its own rows of its local gradient: right when
    every worker computes the *same* global objective (``mode="full"`` losses).
    """
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device)
    if len(sizes) == 1:
        return x
    return _GatherWithGrad.apply(x, tuple(sizes), group, reduce_grad)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


def grad_scale(x: Tensor, factor: float) -> Tensor:
    """Identity in the forward pass; multiplies the incoming gradient by ``factor``."""
    if factor == 1:
        return x
    return _GradScale.apply(x, float(factor))


def all_reduce_sum(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """In-place sum over the group (no-op alone); returns ``t``."""
    if is_distributed(group):
        dist.all_reduce(t, group=group)
    return t


def all_gather_stack(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Stack every worker's same-shaped ``t`` along a new leading dim (rank order)."""
    _, world = group_rank_size(group)
    if world == 1:
        return t.unsqueeze(0)
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    return torch.stack(out)
