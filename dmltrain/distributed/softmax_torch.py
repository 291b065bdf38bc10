"""The sharded softmax's compute in torch block GEMMs: the CPU path (and any device with ``backend="torch"``).

Two pure functions over one shard's :class:`~dmltrain.distributed.shard_operands.ShardOperands`,
the same two the Triton backend (:mod:`~dmltrain.distributed.softmax_kernels`) exposes:

* :func:`partials`: each sample's log-sum-exp, max and (for label smoothing) sum of its logits
  over this shard's active columns, *its own target column and the padding columns left out*;
* :func:`gradients`: the embeddings' gradient and the active rows' gradients of those columns,
  given the global log-sum-exp and the gradient coefficients (device scalars).

Beyond the fused kernels, this backend also takes (and is the path for, on CUDA too):

* **sub-centers** (``op.subcenters`` k > 1; weight ``rows × k × D``): a column is a class, its logit
  the largest of its k sub-centers' (the block scores the ``k·block`` sub-center rows, then takes
  the max and remembers which); in backward each column's gradient goes to that sub-center alone,
  so the sub-center rows are ordinary columns with a gradient that is zero off the max;
* **per-column logit offsets** (``op.offsets``, the log-Q correction): added to the logits of the
  softmax, not to the logits' sum nor to the row normalisation's backward;
* **per-sample weights** (``op.sample_weight``, samples dropped from the loss): each sample's row of
  the softmax's gradient scaled by its weight.

The gathered batch is scored against the active rows a block of classes at a time, the
log-sum-exp accumulated online. When the whole ``global batch × active rows`` logit matrix (plus,
when subsampling, the gathered active rows) fits ``budget`` bytes it is kept for the backward pass
in the caller's ``kept`` workspace; otherwise backward recomputes each block (one more GEMM; peak
extra memory ``O((global batch + D) × block)`` with blocks no larger than the budget).

Everything runs in the operands' dtype: float32, or float64 for a classifier moved to float64.
The CPU allocator caches nothing and fresh large tensors cost a page fault per 4 KiB, so the
logit blocks, gathered rows and gradient blocks live in the caller's reusable workspaces.
No value is read back to the host: the target and padding columns are masked on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dmltrain.distributed.row_sparse import RowGradTarget, add_rows
from dmltrain.distributed.shard_operands import ShardOperands
from dmltrain.distributed.workspace import BLOCK_ELEMENTS, Workspace

NORM_EPS = 1e-12


@dataclass
class Saved:
    """What :func:`partials` hands to :func:`gradients`: block size, inverse row norms (one per sub-center
    row), kept buffers."""

    block: int
    inv: Tensor | None
    kept: Workspace | None


def _columns(op: ShardOperands) -> int:
    return op.weight.shape[0] if op.rows is None else op.rows.numel()


def _sub(op: ShardOperands) -> int:
    return op.subcenters


def _blocks(k: int, block: int):
    for c0 in range(0, k, block):
        yield c0, min(k, c0 + block)


def _block_weight(op: ShardOperands, saved: Saved, c0: int, c1: int, forward: bool, ws: Workspace):
    """The block's weight rows (``k·block × D``: a view, kept rows, or gathered into a scratch buffer) and bias."""
    dt, dev, D = op.x.dtype, op.x.device, op.x.shape[1]
    if op.rows is None:
        wb = op.weight[c0:c1].reshape(-1, D)
        bb = None if op.bias is None else op.bias[c0:c1]
        return wb.to(dt), None if bb is None else bb.to(dt)
    k, tail = _columns(op), tuple(op.weight.shape[1:])
    if saved.kept is not None:
        wb = saved.kept.get("w", (k, *tail), dev, op.weight.dtype)[c0:c1]
        bb = None if op.bias is None else saved.kept.get("b", (k,), dev, op.bias.dtype)[c0:c1]
        if not forward:  # gathered in forward
            return wb.reshape(-1, D).to(dt), None if bb is None else bb.to(dt)
    else:
        wb = ws.get("w", (c1 - c0, *tail), dev, op.weight.dtype)
        bb = None if op.bias is None else ws.get("b", (c1 - c0,), dev, op.bias.dtype)
    r = op.rows[c0:c1]
    torch.index_select(op.weight, 0, r, out=wb)
    if bb is not None:
        torch.index_select(op.bias, 0, r, out=bb)
    return wb.reshape(-1, D).to(dt), None if bb is None else bb.to(dt)


def _exclude(t: Tensor, op: ShardOperands, c0: int, c1: int, value: float) -> Tensor:
    """Set each sample's target entry in columns ``[c0, c1)`` and the padding columns to ``value``."""
    nb = c1 - c0
    inside = (op.tcol >= c0) & (op.tcol < c1)
    col = (op.tcol - c0).clamp_(0, nb - 1)[:, None]
    t.scatter_(1, col, torch.where(inside[:, None], value, t.gather(1, col)))
    if op.count is not None:
        t.masked_fill_((torch.arange(c0, c1, device=t.device) >= op.count)[None, :], value)
    return t


def _block_logits(op: ShardOperands, saved: Saved, c0: int, c1: int, forward: bool, ws: Workspace):
    """Logits of the block (every column), its weight rows, their inverse norms and, with sub-centers,
    which sub-center gave each logit (``N × block`` int8; None without)."""
    N, nb, dt = op.x.shape[0], c1 - c0, op.x.dtype
    sub = _sub(op)
    if forward and saved.kept is not None:
        out = saved.kept.get("z", (N * _columns(op),), op.x.device, dt)[N * c0 : N * c1].view(N, nb)
    else:
        out = ws.get("z", (N, nb), op.x.device, dt)
    wb, bb = _block_weight(op, saved, c0, c1, forward, ws)
    if not op.normalized:
        z = torch.mm(op.x, wb.t(), out=out) if bb is None else torch.addmm(bb, op.x, wb.t(), out=out)
        return z, wb, None, None
    s0, s1 = c0 * sub, c1 * sub
    if forward:
        torch.linalg.vector_norm(wb, dim=1, out=saved.inv[s0:s1])
        saved.inv[s0:s1].clamp_min_(NORM_EPS).reciprocal_()
    inv = saved.inv[s0:s1]
    if sub == 1:
        z = torch.mm(op.x, wb.t(), out=out)
        return z.mul_(inv * op.scale), wb, inv, None
    zk = torch.mm(op.x, wb.t(), out=ws.get("zk", (N, nb * sub), op.x.device, dt)).mul_(inv * op.scale)
    if forward and saved.kept is not None:
        arg = saved.kept.get("arg", (N * _columns(op),), op.x.device, torch.int8)[N * c0 : N * c1].view(N, nb)
    else:
        arg = ws.get("arg", (N, nb), op.x.device, torch.int8)
    z, idx = torch.max(zk.view(N, nb, sub), 2)
    out.copy_(z)
    arg.copy_(idx)
    return out, wb, inv, arg


def partials(
    op: ShardOperands, sum_logits: bool, ws: Workspace, kept: Workspace | None, budget: float
) -> tuple[Tensor, Tensor, Tensor | None, Saved]:
    """Per sample: log-sum-exp (with ``op.offsets`` added), max and (``sum_logits``) sum of the active
    columns' logits but its target's (−inf, −inf, 0 where there is none), and what :func:`gradients` needs.

    ``kept``: a workspace for the logits kept until backward (None: nothing is kept, e.g. without
    gradients); ``budget``: the bytes they may take.
    """
    x, (N, D), dt, dev = op.x, op.x.shape, op.x.dtype, op.x.device
    k, sub = _columns(op), _sub(op)
    offsets = op.offsets
    size = x.element_size()
    rows_d = D * sub if op.rows is not None else 0
    keep = kept is not None and k * (size * (N + rows_d) + (N if sub > 1 else 0)) <= budget
    # A block of logits (N × block·k) and of gathered rows or their gradient (block·k × D) is at
    # most BLOCK_ELEMENTS and, when chunking, at most the budget.
    cap = BLOCK_ELEMENTS if keep else min(BLOCK_ELEMENTS, int(budget // size))
    block = max(1, min(k, cap // (sub * max(N, D if op.rows is not None or sub > 1 else 1, 1))))
    inv = torch.empty(k * sub, device=dev, dtype=dt) if op.normalized else None
    saved = Saved(block, inv, kept if keep else None)
    m = torch.full((N,), -math.inf, device=dev, dtype=dt)
    lse = torch.full((N,), -math.inf, device=dev, dtype=dt)
    sz = torch.zeros(N, device=dev, dtype=dt) if sum_logits else None
    for c0, c1 in _blocks(k, block):
        z, _, _, _ = _block_logits(op, saved, c0, c1, True, ws)
        _exclude(z, op, c0, c1, -math.inf)
        zs = z  # the softmax's logits: with the offsets when there are some
        if offsets is not None:
            zs = torch.add(z, offsets[c0:c1].to(dt), out=ws.get("zo", tuple(z.shape), dev, dt))
            m = torch.maximum(m, z.amax(1))
        # the block's log-sum-exp from torch's fused log_softmax (one vectorised pass),
        # read at each row's maximum where it is most precise: lse = max − log_softmax(max)
        zmax, arg = torch.max(zs, 1)
        lsm = torch.ops.aten._log_softmax.out(zs, 1, False, out=ws.get("lsm", tuple(z.shape), dev, dt))
        lse_b = zmax - lsm.gather(1, arg[:, None]).squeeze(1)
        lse = torch.logaddexp(lse, torch.where(zmax == -math.inf, -math.inf, lse_b))  # a row with nothing left: -inf
        if offsets is None:
            m = torch.maximum(m, zmax)
        if keep or sz is not None:
            _exclude(z, op, c0, c1, 0.0)  # finite again for backward's Σ G·z and the sum
        if sz is not None:
            sz.add_(z.sum(1))
    return lse, m, sz, saved


def gradients(
    op: ShardOperands,
    saved: Saved,
    lse: Tensor,
    alpha: Tensor,
    off: Tensor | None,
    need_x: bool,
    out: RowGradTarget | None,
    ws: Workspace,
) -> Tensor | None:
    """The embeddings' gradient (None unless ``need_x``) and, into ``out`` at ``op.rows``, the active
    rows' gradients, of ``Σ_ij G_ij z_ij`` over the non-target, non-padding columns with
    ``G_ij = (exp(z_ij + o_j − lse_i) − off)·alpha·w_i`` (the softmax's gradient; ``o``: the offsets,
    ``w``: the sample weights, when there are; ``off``: label smoothing's weight of each other class,
    None for none)."""
    x, N = op.x, op.x.shape[0]
    k, sub = _columns(op), _sub(op)
    offsets, weights = op.offsets, op.sample_weight
    if not need_x and (out is None or (out.weight is None and out.bias is None)):
        return None
    grad_x = torch.zeros_like(x) if need_x else None
    neg_lse = lse.neg()[:, None]
    for c0, c1 in _blocks(k, saved.block):
        nb = c1 - c0
        if saved.kept is not None:
            z = saved.kept.get("z", (N * k,), x.device, x.dtype)[N * c0 : N * c1].view(N, nb)
            wb, _ = _block_weight(op, saved, c0, c1, False, ws)
            inv = saved.inv[c0 * sub : c1 * sub] if op.normalized else None
            arg = (
                saved.kept.get("arg", (N * k,), x.device, torch.int8)[N * c0 : N * c1].view(N, nb) if sub > 1 else None
            )
        else:
            z, wb, inv, arg = _block_logits(op, saved, c0, c1, False, ws)
        G = torch.add(z, neg_lse, out=ws.get("g", (N, nb), x.device, x.dtype))
        if offsets is not None:
            G.add_(offsets[c0:c1].to(x.dtype))
        G.exp_()  # probabilities
        if off is not None:
            G.sub_(off)
        _exclude(G, op, c0, c1, 0.0)
        if weights is not None:
            G.mul_(weights.to(x.dtype)[:, None])
        if not op.normalized:
            G.mul_(alpha)
            if grad_x is not None:
                grad_x.addmm_(G, wb)
            _write_rows(op, out, c0, c1, G, None, None, G.sum(0), ws)
            continue
        # Off target, cos_ij = z_ij / s and dL/dcos_ij = s·G_ij. The row normalisation's
        # backward needs S_j = Σ_i dL/dcos_ij · cos_ij = Σ_i G_ij z_ij.
        if sub == 1:
            S = z.mul_(G).sum(0).mul_(alpha)
        else:  # each column's G goes to the sub-center that gave its logit: the sub-center rows are columns
            idx = arg.long()[:, :, None]
            S = ws.get("sk", (N, nb, sub), x.device, x.dtype).zero_().scatter_(2, idx, z.mul_(G)[:, :, None])
            S = S.sum(0).view(-1).mul_(alpha)
            Gk = ws.get("gk", (N, nb, sub), x.device, x.dtype).zero_().scatter_(2, idx, G[:, :, None])
            G = Gk.view(N, nb * sub)
        G.mul_(inv * (alpha * op.scale))  # now dL/d(x·w_j) off target
        if grad_x is not None:
            grad_x.addmm_(G, wb)
        _write_rows(op, out, c0, c1, G, wb, inv * inv * S, None, ws)
    return grad_x


def _write_rows(
    op: ShardOperands,
    out: RowGradTarget | None,
    c0: int,
    c1: int,
    G: Tensor,
    wb: Tensor | None,
    coef: Tensor | None,
    gb: Tensor | None,
    ws: Workspace,
) -> None:
    """Active columns ``c0:c1`` (their ``k`` sub-center rows each): weight gradient ``Gᵀx − coef·wb`` (coef
    None: no such term), bias ``gb``."""
    if out is None:
        return
    x, D = op.x, op.x.shape[1]
    rows = None if op.rows is None else op.rows[c0:c1]
    if out.weight is not None:
        if rows is None:
            dst = out.weight[c0:c1].view(-1, D)
            if out.accumulate:
                dst.addmm_(G.t(), x)
            else:
                torch.mm(G.t(), x, out=dst)
            if coef is not None:
                dst.addcmul_(wb, coef[:, None], value=-1)
        else:
            gw = torch.mm(G.t(), x, out=ws.get("gw", (G.shape[1], D), x.device, x.dtype))
            if coef is not None:
                gw.addcmul_(wb, coef[:, None], value=-1)
            _put(out.weight, rows, c0, c1, gw.view(c1 - c0, *out.weight.shape[1:]), out.accumulate)
    if out.bias is not None and gb is not None:
        _put(out.bias, rows, c0, c1, gb, out.accumulate)


def _put(dst: Tensor, rows: Tensor | None, c0: int, c1: int, g: Tensor, accumulate: bool) -> None:
    """Write (or add) the gradient of active columns ``c0:c1`` into ``dst``'s rows."""
    if rows is None:
        if accumulate:
            dst[c0:c1] += g
        else:
            dst[c0:c1] = g
    elif accumulate:
        add_rows(dst, rows, g)
    else:  # the buffer's rows are zero and the active rows are distinct
        dst.index_copy_(0, rows, g.to(dst.dtype))
