"""The sharded softmax in torch block GEMMs: the CPU path (and any device with ``backend="torch"``).

The gathered batch is scored against the active rows a block of classes at a time. Each
sample's log-sum-exp over this shard is accumulated online (block by block); if the whole
``global batch × active rows`` logit matrix (plus, when subsampling, the gathered active
rows) fits the classifier's ``logits_budget_mb`` it is kept for the backward pass, otherwise
backward recomputes each block (one more GEMM; peak extra memory ``O((global batch + D) ×
block)`` with blocks no larger than the budget).

Non-target logits come from the block GEMMs; each sample's target logit (margins included)
is computed apart on its (embedding, class row) pair (:class:`~dmltrain.distributed.shard_call.ShardCall`)
and written into its block. In backward the target entries' gradient takes that pair path
instead of the GEMMs. ``softmax_ce`` has no margin and keeps its targets in the GEMMs.

Everything runs in the call's dtype: float32, or float64 for a classifier moved to float64.
The CPU allocator caches nothing and fresh large tensors cost a page fault per 4 KiB, so the
logit blocks, gathered rows and gradient blocks live in the classifier's reusable workspaces.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dmltrain.distributed.shard_call import NORM_EPS, ShardCall, ShardOwner

#: elements of one block of logits (global batch × classes): 16 Mi floats = 64 MiB. Few large
#: element-wise passes beat many small ones (each is a parallel region).
BLOCK_ELEMENTS = 1 << 24


class BlockSoftmax(ShardCall):
    """One call in block GEMMs. Kept for backward when they fit the budget: the logits and,
    when subsampling, the gathered active weight rows (so backward does not gather them again)."""

    def __init__(self, clf: ShardOwner, x: Tensor, labels: Tensor, rows: Tensor | None, need_grad: bool) -> None:
        super().__init__(clf, x, labels, rows)
        N, D = x.shape
        sparse = rows is not None
        size = x.element_size()
        budget = clf.logits_budget_mb * 2**20
        self.keep = need_grad and size * self.k_local * (N + (D if sparse else 0)) <= budget
        # A block of logits (N × block) and of gathered rows or their gradient (block × D) is at
        # most BLOCK_ELEMENTS and, when chunking, at most the budget.
        cap = BLOCK_ELEMENTS if self.keep else min(BLOCK_ELEMENTS, int(budget // size))
        self.block = max(1, min(self.k_local, cap // max(N, D if sparse else 1, 1)))
        self.ws = clf.workspace  # transient buffers, used within one forward or one backward
        self.kws = clf.kept_workspace(self) if self.keep else None  # buffers living until backward

    # -- blocks -----------------------------------------------------------------------------------
    def blocks(self):
        for c0 in range(0, self.k_local, self.block):
            yield c0, min(self.k_local, c0 + self.block)

    def block_weight(self, c0: int, c1: int, forward: bool) -> tuple[Tensor, Tensor | None]:
        """The block's weight rows (a view, kept rows, or gathered into a scratch buffer) and bias."""
        dt, dev, D = self.dtype, self.x.device, self.x.shape[1]
        if self.rows is None:
            wb = self.weight[c0:c1]
            bb = None if self.bias is None else self.bias[c0:c1]
            return wb.to(dt), None if bb is None else bb.to(dt)
        if self.kws is not None:
            wb = self.kws.get("w", (self.k_local, D), dev, self.weight.dtype)[c0:c1]
            bb = None if self.bias is None else self.kws.get("b", (self.k_local,), dev, self.bias.dtype)[c0:c1]
            if not forward:  # gathered in forward
                return wb.to(dt), None if bb is None else bb.to(dt)
        else:
            wb = self.ws.get("w", (c1 - c0, D), dev, self.weight.dtype)
            bb = None if self.bias is None else self.ws.get("b", (c1 - c0,), dev, self.bias.dtype)
        r = self.rows[c0:c1]
        torch.index_select(self.weight, 0, r, out=wb)
        if bb is not None:
            torch.index_select(self.bias, 0, r, out=bb)
        return wb.to(dt), None if bb is None else bb.to(dt)

    def block_targets(self, c0: int, c1: int) -> tuple[Tensor, Tensor, Tensor]:
        """(positions in t_idx, sample rows, columns within the block) of targets in [c0, c1)."""
        sel = ((self.t_col >= c0) & (self.t_col < c1)).nonzero().squeeze(1)
        return sel, self.t_idx[sel], self.t_col[sel] - c0

    def block_logits(self, c0: int, c1: int, forward: bool):
        """Logits of the block (targets with their margin), its weight, inverse row norms, targets."""
        N, nb, dt = self.x.shape[0], c1 - c0, self.dtype
        if forward and self.kws is not None:
            out = self.kws.get("z", (N * self.k_local,), self.x.device, dt)[N * c0 : N * c1].view(N, nb)
        else:
            out = self.ws.get("z", (N, nb), self.x.device, dt)
        wb, bb = self.block_weight(c0, c1, forward)
        tgt = self.block_targets(c0, c1)
        if not self.normalized:
            if bb is None:
                z = torch.mm(self.x, wb.t(), out=out)
            else:
                z = torch.addmm(bb, self.x, wb.t(), out=out)
            return z, wb, None, tgt
        sel, ti, tc = tgt
        if forward:
            torch.linalg.vector_norm(wb, dim=1, out=self.inv[c0:c1])
            self.inv[c0:c1].clamp_min_(NORM_EPS).reciprocal_()
        inv = self.inv[c0:c1]
        z = torch.mm(self.x, wb.t(), out=out)
        z.mul_(inv * self.scale)
        z[ti, tc] = self.z_t[sel]
        return z, wb, inv, tgt

    def kept_block(self, c0: int, c1: int) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor, Tensor]]:
        N = self.x.shape[0]
        z = self.kws.get("z", (N * self.k_local,), self.x.device, self.dtype)[N * c0 : N * c1].view(N, c1 - c0)
        wb, _ = self.block_weight(c0, c1, forward=False)
        inv = self.inv[c0:c1] if self.normalized else None
        return z, wb, inv, self.block_targets(c0, c1)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self) -> Tensor:
        x, N, dt = self.x, self.x.shape[0], self.dtype
        dev = x.device
        m = torch.full((N,), -math.inf, device=dev, dtype=dt)
        lse_local = torch.full((N,), -math.inf, device=dev, dtype=dt)
        sz = torch.zeros(N, device=dev, dtype=dt)
        z_t = torch.zeros(self.t_idx.numel(), device=dev, dtype=dt)
        cos_t = torch.zeros_like(z_t)
        if self.normalized:
            _, self.z_t, cos_t = self.target_pairs(grad=False)
            self.inv = torch.empty(self.k_local, device=dev, dtype=dt)
        for c0, c1 in self.blocks():
            z, _, _, (sel, ti, tc) = self.block_logits(c0, c1, forward=True)
            z_t[sel] = z[ti, tc]
            # the block's log-sum-exp from torch's fused log_softmax (one vectorised pass),
            # read at each row's maximum where it is most precise: lse = max − log_softmax(max)
            zmax, arg = torch.max(z, 1)
            lsm = torch.ops.aten._log_softmax.out(z, 1, False, out=self.ws.get("lsm", tuple(z.shape), dev, dt))
            lse_b = zmax - lsm.gather(1, arg[:, None]).squeeze(1)
            lse_local = torch.logaddexp(lse_local, lse_b)
            m = torch.maximum(m, zmax)
            if self.eps:
                sz.add_(z.sum(1))
        return self.combine(lse_local, m, sz, z_t, cos_t)

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, grad_out: Tensor, need_x: bool) -> Tensor | None:
        if self.consumed and self.keep:
            raise RuntimeError(
                "ShardedClassifier: backward through the same call twice is not supported (kept logits are consumed)"
            )
        x, N = self.x, self.x.shape[0]
        a = self.grad_scale(grad_out)
        grad_x = torch.zeros_like(x) if need_x else None
        writer = self.clf.grad_writer(self.rows)
        on, off = self.on, self.off
        G_t = torch.zeros(
            self.t_idx.numel(), device=x.device, dtype=self.dtype
        )  # dL/d(target logit), for the pair path
        neg_lse = self.lse.neg()[:, None]
        for c0, c1 in self.blocks():
            nb = c1 - c0
            z, wb, inv, tgt = self.kept_block(c0, c1) if self.keep else self.block_logits(c0, c1, forward=False)
            sel, ti, tc = tgt
            G = torch.add(z, neg_lse, out=self.ws.get("g", (N, nb), x.device, self.dtype)).exp_()  # probabilities
            if off:
                G.sub_(off)
            G[ti, tc] -= on - off
            if not self.normalized:
                G.mul_(a)
                if grad_x is not None:
                    grad_x.addmm_(G, wb)
                writer.write(c0, c1, G, x, None, None, G.sum(0), self.ws)
                continue
            G_t[sel] = G[ti, tc]
            G[ti, tc] = 0.0
            # Off target, cos_ij = z_ij / s and dL/dcos_ij = s·G_ij. The row normalisation's
            # backward needs S_j = Σ_i dL/dcos_ij · cos_ij = Σ_i G_ij z_ij.
            S = z.mul_(G).sum(0).mul_(a)
            G.mul_(inv * (a * self.scale))  # now dL/d(x·w_j) off target
            if grad_x is not None:
                grad_x.addmm_(G, wb)
            writer.write(c0, c1, G, x, wb, inv * inv * S, None, self.ws)
        self.consumed = True
        self.clf.release_kept(self)
        if self.normalized:
            self.pair_backward(G_t * a, writer, grad_x)
        writer.finish()
        return grad_x
