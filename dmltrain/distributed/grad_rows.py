"""The sharded classifier's row gradients: reused ``.grad`` buffers and the rows that hold a gradient.

The classifier writes its weight (and bias) gradient straight into ``.grad``, as Megatron's
fused gradient accumulation does: overwritten when ``.grad`` was None (a fresh gradient),
added otherwise. A fresh gradient reuses the buffer of the last one and zeroes only the rows
written since, so that a subsampled step never touches the ``C_local × D`` gradient in full.
:class:`RowGrads` keeps that bookkeeping and answers the row-sparse optimizers' questions
(:class:`~dmltrain.distributed.sparse_optim.RowSource`); :class:`GradWriter` is one
backward's writer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class _AllRows:
    """Sentinel: every local row."""

    def __repr__(self) -> str:
        return "ALL_ROWS"


ALL_ROWS = _AllRows()


def add_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """``dst[rows] += src`` with repeated rows summed (index_put_ accumulates an order of
    magnitude faster than index_add_ on the CPU)."""
    dst.index_put_((rows,), src.to(dst.dtype), accumulate=True)


def union_rows(a: Tensor | _AllRows | None, b: Tensor | _AllRows) -> Tensor | _AllRows:
    if a is None:
        return b
    if a is ALL_ROWS or b is ALL_ROWS:
        return ALL_ROWS
    return torch.unique(torch.cat([a, b]))


class RowGrads:
    """Gradient buffers of a classifier's row parameters (``weight``, ``bias``) and their dirty rows."""

    def __init__(self) -> None:
        self.bufs: dict[str, Tensor] = {}
        self.dirty: dict[str, Tensor | _AllRows | None] = {}
        self.touched: Tensor | _AllRows | None = None  # rows with a gradient since it was cleared

    def fresh(self, name: str, p: nn.Parameter, dense: bool) -> Tensor:
        """The gradient buffer of ``p``, reused across steps (no full zeroing or page faults).

        A dense backward overwrites every row, so the buffer is not cleared; a sparse one
        first zeroes the rows written since the buffer was last all-zero.
        """
        buf = self.bufs.get(name)
        if buf is None or buf.shape != p.shape or buf.device != p.device or buf.dtype != p.dtype:
            buf = torch.empty_like(p, memory_format=torch.contiguous_format) if dense else torch.zeros_like(p)
            self.bufs[name] = buf
        elif not dense:
            dirty = self.dirty.get(name)
            if dirty is ALL_ROWS:
                buf.zero_()
            elif dirty is not None and dirty.numel():
                buf.index_fill_(0, dirty, 0)
        self.dirty[name] = None
        return buf

    def rows(self, device: torch.device) -> Tensor | None:
        """Local rows holding a gradient since it was last cleared; None means all rows."""
        if self.touched is ALL_ROWS:
            return None
        if self.touched is None:
            return torch.zeros(0, dtype=torch.int64, device=device)
        return self.touched

    def cleared(self, params: dict[str, nn.Parameter | None]) -> None:
        """The gradients were set to None or zeroed in place."""
        for name, p in params.items():
            if p is not None and p.grad is not None and p.grad is self.bufs.get(name):
                self.dirty[name] = None  # zeroed in place
        self.touched = None

    def writer(self, params: dict[str, nn.Parameter | None], rows: Tensor | None) -> GradWriter:
        return GradWriter(self, params, rows)


class GradWriter:
    """Writes one backward's row gradients into ``.grad`` (fresh buffer or accumulation).

    ``targets`` lists ``(name, parameter, overwrite)`` for the parameters that need a gradient;
    a fresh gradient (``.grad`` was None) is written, not added: every active row exactly once.
    """

    def __init__(self, grads: RowGrads, params: dict[str, nn.Parameter | None], rows: Tensor | None) -> None:
        self.grads, self.rows = grads, rows
        self.targets: list[tuple[str, nn.Parameter, bool]] = []
        fresh_any = False
        for name, p in params.items():
            if p is None or not p.requires_grad:
                continue
            fresh = p.grad is None
            if fresh:
                p.grad = grads.fresh(name, p, dense=rows is None)
                fresh_any = True
            self.targets.append((name, p, fresh))
        if fresh_any:  # a new gradient starts: forget the rows of the previous one
            grads.touched = None

    def target(self, name: str) -> tuple[nn.Parameter, bool] | None:
        """(parameter, overwrite) of ``name`` when it needs a gradient."""
        for n, p, overwrite in self.targets:
            if n == name:
                return p, overwrite
        return None

    def write(
        self, c0: int, c1: int, G: Tensor, x: Tensor, wb: Tensor | None, coef: Tensor | None, gb: Tensor | None, ws
    ) -> None:
        """Active rows ``c0:c1``: weight gradient ``Gᵀx − coef·wb`` (coef None: no such term), bias ``gb``."""
        for name, p, overwrite in self.targets:
            if name == "bias":
                self.put(p, c0, c1, gb, overwrite)
                continue
            if self.rows is None:
                dst = p.grad[c0:c1]
                if overwrite:
                    torch.mm(G.t(), x, out=dst)
                else:
                    dst.addmm_(G.t(), x)
                if coef is not None:
                    dst.addcmul_(wb, coef[:, None], value=-1)
                continue
            gw = torch.mm(G.t(), x, out=ws.get("gw", (c1 - c0, x.shape[1]), x.device, x.dtype))
            if coef is not None:
                gw.addcmul_(wb, coef[:, None], value=-1)
            self.put(p, c0, c1, gw, overwrite)

    def add_rows(self, local_rows: Tensor, gw: Tensor, gb: Tensor | None = None) -> None:
        """Add gradient rows at local row ids (after every block was written)."""
        for name, p, _ in self.targets:
            g = gw if name == "weight" else gb
            if g is not None:
                add_rows(p.grad, local_rows, g)

    def put(self, p: Tensor, c0: int, c1: int, g: Tensor, overwrite: bool) -> None:
        """Write (or add) the gradient of active rows ``c0:c1``."""
        if self.rows is None:
            if overwrite:
                p.grad[c0:c1] = g
            else:
                p.grad[c0:c1] += g
        elif overwrite:  # the buffer's rows are zero and the active rows are distinct
            p.grad.index_copy_(0, self.rows[c0:c1], g.to(p.grad.dtype))
        else:
            add_rows(p.grad, self.rows[c0:c1], g)

    def finish(self) -> None:
        if not self.targets:
            return
        rows = ALL_ROWS if self.rows is None else self.rows
        self.grads.touched = union_rows(self.grads.touched, rows)
        for name, p, _ in self.targets:
            if p.grad is self.grads.bufs.get(name):
                self.grads.dirty[name] = union_rows(self.grads.dirty.get(name), rows)
