"""The sharded softmax in fused Triton kernels: the CUDA path.

Same call as :class:`~dmltrain.distributed.block_softmax.BlockSoftmax`, but the products of
the gathered batch with the active rows run in :mod:`~dmltrain.distributed.softmax_kernels`:
forward is one kernel (block products fused with the online log-sum-exp, the
``N × K`` logits only ever in registers) and backward two (the embeddings' gradient and
the rows' gradient, each recomputing the logits). The row normalisation's inverse norms come
from one more small kernel; the subsampled rows are read through their indices, never
gathered into a copy.

Targets: the kernels leave out each sample's own column; its logit (with the margin, or
``x·w + b`` for softmax_ce) is computed on (embedding, class row) pairs in torch and merged
into the shard's statistics before the cross-shard combine, and its gradient flows back
through the same pairs by autograd (ArcFace's true gradient included). Every other class
takes part in the gradient: nothing is filtered.

Precision: products in ``fp32``, ``tf32`` or ``bf16`` with fp32 accumulation; the
normalisation, log-sum-exp, margins and combine in fp32. The weight may be stored in bf16
(its gradient then is bf16 too); the loss and the embeddings' gradient are fp32.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from dmltrain.distributed.block_softmax import BLOCK_ELEMENTS
from dmltrain.distributed.grad_rows import GradWriter
from dmltrain.distributed.shard_call import NORM_EPS, ShardCall, ShardOwner

# The kernels (and Triton, ~75 MiB of resident memory) are loaded only where they can run: with
# a CUDA device, or under Triton's CPU interpreter. A CPU-only process keeps the torch path alone.
_UNLOADED = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        from dmltrain.distributed import softmax_kernels
    except ImportError:  # a torch build without Triton
        softmax_kernels, _UNLOADED = None, "Triton is not installed"
else:
    softmax_kernels = None
    _UNLOADED = "no CUDA device and no TRITON_INTERPRET=1 when dmltrain.distributed.fused_softmax was imported"


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on ``device`` (None when they can)."""
    if softmax_kernels is None:
        return f"the kernels are not loaded ({_UNLOADED})"
    if device.type != "cuda" and not softmax_kernels.INTERPRET:
        return f"the weight is on {device.type}: the kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported"
    return None


class FusedSoftmax(ShardCall):
    """One call in the fused kernels; ``precision`` is ``fp32``, ``tf32`` or ``bf16``."""

    def __init__(self, clf: ShardOwner, x: Tensor, labels: Tensor, rows: Tensor | None, precision: str) -> None:
        super().__init__(clf, x, labels, rows)
        N = x.shape[0]
        self.prec = softmax_kernels.kernel_precision(precision)
        self.xo = (x.to(torch.bfloat16) if precision == "bf16" else x).contiguous()
        self.tcol = torch.full((N,), -1, dtype=torch.int32, device=x.device)
        self.tcol[self.t_idx] = self.t_col.to(torch.int32)
        self.inv = (
            softmax_kernels.row_inv_norms(self.weight, rows, NORM_EPS) if self.normalized and self.k_local else None
        )
        self.splits = softmax_kernels.num_splits(N, self.k_local, x.device)

    def _kernel_args(self) -> tuple:
        return self.xo, self.weight, self.rows, self.inv, self.bias, self.tcol

    def forward(self) -> Tensor:
        N, dev = self.x.shape[0], self.x.device
        if self.k_local:
            lse_p, max_p, sum_p = softmax_kernels.lse_partials(
                *self._kernel_args(), self.scale, self.prec, bool(self.eps), self.splits
            )
            lse_local, m = torch.logsumexp(lse_p, 0), max_p.amax(0)
            sz = sum_p.sum(0) if sum_p is not None else torch.zeros(N, device=dev)
        else:
            lse_local = torch.full((N,), float("-inf"), device=dev)
            m, sz = lse_local.clone(), torch.zeros(N, device=dev)
        _, self.z_t, cos_t = self.target_pairs(grad=False)
        ti, zt = self.t_idx, self.z_t
        lse_local[ti] = torch.logaddexp(lse_local[ti], zt)
        m[ti] = torch.maximum(m[ti], zt)
        sz[ti] += zt
        return self.combine(lse_local, m, sz, zt, cos_t)

    def backward(self, grad_out: Tensor, need_x: bool) -> Tensor | None:
        a = self.grad_scale(grad_out)
        alpha = float(a)
        writer = self.clf.grad_writer(self.rows)
        grad_x = None
        if need_x:
            grad_x = torch.zeros_like(self.x)
            if self.k_local:
                grad_x = softmax_kernels.grad_embeddings(
                    *self._kernel_args(), self.lse, self.scale, self.off, alpha, self.prec, self.splits
                )
        if self.k_local:
            self._write_rows(writer, alpha)
        G_t = (torch.exp(self.z_t - self.lse[self.t_idx]) - self.on) * a  # dL/d(target logit)
        self.pair_backward(G_t, writer, grad_x)
        writer.finish()
        self.consumed = True
        return grad_x

    def _write_rows(self, writer: GradWriter, alpha: float) -> None:
        """Row gradients straight into ``.grad`` when it is fresh; else (accumulation, or a
        parameter without gradient) a chunk of classes at a time through scratch buffers."""
        w_t, b_t = writer.target("weight"), writer.target("bias")
        if w_t is None and b_t is None:
            return
        direct = w_t is not None and w_t[1] and (self.bias is None or (b_t is not None and b_t[1]))
        x, weight, rows, inv, bias, tcol = self._kernel_args()
        common = (self.lse, self.scale, self.off, alpha, self.prec)
        if direct:
            gb = None if b_t is None else b_t[0].grad
            softmax_kernels.grad_rows(x, weight, rows, inv, bias, tcol, *common, w_t[0].grad, gb, rows)
            return
        D, dev = x.shape[1], x.device
        ws = self.clf.workspace
        chunk = max(1, BLOCK_ELEMENTS // D)
        for c0 in range(0, self.k_local, chunk):
            c1 = min(self.k_local, c0 + chunk)
            gw = ws.get("fused_gw", (c1 - c0, D), dev)
            gb = None if bias is None else ws.get("fused_gb", (c1 - c0,), dev)
            if rows is None:  # the chunk's rows are a slice of the weight
                args = (
                    x,
                    weight[c0:c1],
                    None,
                    None if inv is None else inv[c0:c1],
                    None if bias is None else bias[c0:c1],
                )
            else:
                args = (x, weight, rows[c0:c1], None if inv is None else inv[c0:c1], bias)
            softmax_kernels.grad_rows(*args, tcol - c0, *common, gw, gb, None)
            for target, g in ((w_t, gw), (b_t, gb)):
                if target is not None:
                    writer.put(target[0], c0, c1, g, target[1])
