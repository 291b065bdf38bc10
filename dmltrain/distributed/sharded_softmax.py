"""The class-sharded softmax classifier: model-parallel NormSoftmax, CosFace, ArcFace and softmax CE.

``ShardedClassifier(num_classes, dim, kind)`` holds the rows of the class weight that this
worker owns (:class:`~dmltrain.distributed.class_partition.ClassPartition`: contiguous blocks,
uneven ``C/W`` allowed) and is called as ``clf(local_embeddings, local_labels, step=global_step)``.
It returns the mean loss over the *global* batch, the same value on every worker.

How one call works:

1. The local embeddings (L2-normalised first, except for ``softmax_ce``) and labels are
   all-gathered (uneven local batch sizes allowed); labels are global class ids.
2. With ``sample_ratio < 1`` the shard picks its active rows: every class of the global batch
   it owns plus its share of a global uniform draw of other classes, ``round(ratio × C)`` in
   all whatever the number of workers (:mod:`~dmltrain.distributed.class_sampling`).
3. The gathered batch is scored against the active rows a block of classes at a time. Each
   sample's log-sum-exp over this shard is accumulated online (block by block); if the whole
   ``global batch × active rows`` logit matrix (plus, when subsampling, the gathered active
   rows) fits ``logits_budget_mb`` it is kept for the backward pass, otherwise backward
   recomputes each block (one more GEMM; peak extra memory ``O((global batch + D) × block)``
   with blocks no larger than the budget).
4. One all-gather of per-sample partial statistics (shard log-sum-exp, shard max, target
   logit, shard sum of logits for label smoothing) plus the active-row count combines the
   shards: the softmax is normalised over every active class of every shard, and no worker
   holds more than its own logits. The exchanged volume is ``5 × global batch`` numbers per
   worker, smaller than the embedding gather while ``W < D/5``.
5. Backward writes this shard's row gradients straight into ``weight.grad`` (rows not
   active stay exactly zero) and returns its share of the gathered embeddings' gradient;
   the gather's backward sums the shards' shares and hands each worker its own samples'.

Margins act on the target logit only: CosFace ``s(cosθ − m)``, ArcFace ``s·cos(θ + m)`` with
its true gradient. The maths is the registry losses' own, :mod:`dmltrain.losses.margins` (θ
from ``atan2`` of the unit vectors, InsightFace's continuation beyond ``θ + m > π``). Each
sample's target logit is computed on its (embedding, class row) pair and differentiated by
autograd there, O(batch × D); the block GEMMs carry the other classes. Label smoothing
(softmax CE, :func:`~dmltrain.losses.margins.smoothed_nll`) spreads ``ε`` over the other
``K − 1`` classes taking part, ``K`` counted over all shards, using the global sum of logits.

The weight gradient is written into ``clf.weight.grad`` (and ``clf.bias.grad``) directly,
accumulating when it already exists, as Megatron's fused gradient accumulation does. When
``.grad`` is None the classifier reuses its own buffer, zeroing only the rows written since,
so that a subsampled step never touches the ``C_local × D`` gradient in full. Hence
``torch.autograd.grad(loss, clf.weight)`` is not supported; read ``.grad`` after backward.

Precision: embeddings in bf16/fp16 are cast to fp32 and autocast is disabled inside; all
classifier math is fp32, the loss is fp32 and the embeddings' gradient returns in their dtype.

Memory: besides the weight, its gradient and the optimizer state, the classifier keeps
reusable scratch buffers (a few blocks, at most ``BLOCK_ELEMENTS`` floats each) and the
kept logits (at most the budget) from call to call, because the CPU allocator caches nothing
and fresh large tensors cost a page fault per 4 KiB. ``release_buffers()`` frees them.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmltrain.distributed.class_partition import ClassPartition
from dmltrain.distributed.class_sampling import draw_active_rows, draw_seed
from dmltrain.distributed.collectives import (
    _gather_rows,
    all_gather_sizes,
    all_gather_stack,
    gather_with_grad,
    group_rank_size,
)
from dmltrain.distributed.workspace import Workspace
from dmltrain.losses.margins import TARGET_LOGIT, pair_cos, smoothed_nll, smoothing_weights

#: hyperparameters of each kind and their defaults (the registry losses' names and values)
KIND_PARAMS: dict[str, dict[str, float]] = {
    "normsoftmax": {"temperature": 0.05},
    "cosface": {"scale": 64.0, "margin": 0.35},
    "arcface": {"scale": 64.0, "margin": 0.5},
    "softmax_ce": {"smoothing": 0.1},
}

#: elements of one block of logits (global batch × classes): 16 Mi floats = 64 MiB. Few large
#: element-wise passes beat many small ones (each is a parallel region).
BLOCK_ELEMENTS = 1 << 24
#: classes per block of the W-independent weight initialisation
_INIT_BLOCK = 1 << 16
_NORM_EPS = 1e-12


class _AllRows:
    """Sentinel: every local row."""

    def __repr__(self) -> str:
        return "ALL_ROWS"


ALL_ROWS = _AllRows()


def _add_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """``dst[rows] += src`` with repeated rows summed (index_put_ accumulates an order of
    magnitude faster than index_add_ on the CPU)."""
    dst.index_put_((rows,), src.to(dst.dtype), accumulate=True)


def _union(a: Tensor | _AllRows | None, b: Tensor | _AllRows) -> Tensor | _AllRows:
    if a is None:
        return b
    if a is ALL_ROWS or b is ALL_ROWS:
        return ALL_ROWS
    return torch.unique(torch.cat([a, b]))


def logit_scale(kind: str, params: dict[str, float]) -> float:
    """The factor turning cosines into (non-target) logits."""
    return 1.0 / params["temperature"] if kind == "normsoftmax" else params["scale"]


class _ShardSoftmax:
    """One call's forward and backward over this shard's active rows (no autograd inside).

    Non-target logits come from block GEMMs; each sample's target logit (margins included)
    is computed apart on its (embedding, class row) pair, differentiably, and written into
    its block. In backward the target entries' gradient takes that small path instead of
    the GEMMs. ``softmax_ce`` has no margin and keeps its targets in the GEMMs.

    Kept for backward when they fit the budget: the logits and, when subsampling, the
    gathered active weight rows (so backward does not gather them again).
    """

    def __init__(self, clf: ShardedClassifier, x: Tensor, labels: Tensor, rows: Tensor | None, need_grad: bool) -> None:
        self.clf, self.x, self.labels, self.rows = clf, x, labels, rows
        self.weight = clf.weight.detach()
        self.bias = None if clf.bias is None else clf.bias.detach()
        self.kind, self.params = clf.kind, clf.params
        self.normalized = clf.kind != "softmax_ce"
        self.scale = logit_scale(clf.kind, clf.params) if self.normalized else 1.0
        self.eps = float(clf.params.get("smoothing", 0.0))
        n_local = self.weight.shape[0]
        self.k_local = n_local if rows is None else rows.numel()
        N, D = x.shape
        # samples whose class this shard owns: their local row and column among the active rows
        local = labels - clf.class_start
        owned = (local >= 0) & (local < n_local)
        if rows is not None and self.k_local:
            col = torch.searchsorted(rows, local.clamp(0, n_local - 1))
            owned &= rows[col.clamp(max=self.k_local - 1)] == local
        else:
            col = local
        self.t_idx = owned.nonzero().squeeze(1)
        self.t_col = col[self.t_idx]
        self.t_row = local[self.t_idx]
        sparse = rows is not None
        budget = clf.logits_budget_mb * 2**20
        self.keep = need_grad and 4 * self.k_local * (N + (D if sparse else 0)) <= budget
        # A block of logits (N × block) and of gathered rows or their gradient (block × D) is at
        # most BLOCK_ELEMENTS and, when chunking, at most the budget.
        cap = BLOCK_ELEMENTS if self.keep else min(BLOCK_ELEMENTS, int(budget // 4))
        self.block = max(1, min(self.k_local, cap // max(N, D if sparse else 1, 1)))
        self.ws = clf._workspace  # transient buffers, used within one forward or one backward
        self.kws = clf._kept_workspace(self) if self.keep else None  # buffers living until backward
        self.consumed = False

    # -- blocks -----------------------------------------------------------------------------------
    def blocks(self):
        for c0 in range(0, self.k_local, self.block):
            yield c0, min(self.k_local, c0 + self.block)

    def block_weight(self, c0: int, c1: int, forward: bool) -> tuple[Tensor, Tensor | None]:
        """The block's weight rows (a view, kept rows, or gathered into a scratch buffer) and bias."""
        if self.rows is None:
            wb = self.weight[c0:c1]
            bb = None if self.bias is None else self.bias[c0:c1]
            return wb.float(), None if bb is None else bb.float()
        if self.kws is not None:
            wb = self.kws.get("w", (self.k_local, self.x.shape[1]), self.x.device, self.weight.dtype)[c0:c1]
            bb = None if self.bias is None else self.kws.get("b", (self.k_local,), self.x.device, self.bias.dtype)[c0:c1]
            if not forward:  # gathered in forward
                return wb.float(), None if bb is None else bb.float()
        else:
            wb = self.ws.get("w", (c1 - c0, self.x.shape[1]), self.x.device, self.weight.dtype)
            bb = None if self.bias is None else self.ws.get("b", (c1 - c0,), self.x.device, self.bias.dtype)
        r = self.rows[c0:c1]
        torch.index_select(self.weight, 0, r, out=wb)
        if bb is not None:
            torch.index_select(self.bias, 0, r, out=bb)
        return wb.float(), None if bb is None else bb.float()

    def block_targets(self, c0: int, c1: int) -> tuple[Tensor, Tensor, Tensor]:
        """(positions in t_idx, sample rows, columns within the block) of targets in [c0, c1)."""
        sel = ((self.t_col >= c0) & (self.t_col < c1)).nonzero().squeeze(1)
        return sel, self.t_idx[sel], self.t_col[sel] - c0

    def block_logits(self, c0: int, c1: int, forward: bool):
        """Logits of the block (targets with their margin), its weight, inverse row norms, targets."""
        N, nb = self.x.shape[0], c1 - c0
        if forward and self.kws is not None:
            out = self.kws.get("z", (N * self.k_local,), self.x.device)[N * c0 : N * c1].view(N, nb)
        else:
            out = self.ws.get("z", (N, nb), self.x.device)
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
            self.inv[c0:c1].clamp_min_(_NORM_EPS).reciprocal_()
        inv = self.inv[c0:c1]
        z = torch.mm(self.x, wb.t(), out=out)
        z.mul_(inv * self.scale)
        z[ti, tc] = self.z_t[sel]
        return z, wb, inv, tgt

    def kept_block(self, c0: int, c1: int) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor, Tensor]]:
        N = self.x.shape[0]
        z = self.kws.get("z", (N * self.k_local,), self.x.device)[N * c0 : N * c1].view(N, c1 - c0)
        wb, _ = self.block_weight(c0, c1, forward=False)
        inv = self.inv[c0:c1] if self.normalized else None
        return z, wb, inv, self.block_targets(c0, c1)

    def target_pairs(self, grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(unit embeddings, class rows, unit class rows, target logits) of the owned samples;
        differentiable w.r.t. the first two if ``grad``."""
        xt = self.x[self.t_idx].float()
        wt = self.weight[self.t_row].float()
        if grad:
            xt.requires_grad_(True)
            wt.requires_grad_(True)
        with torch.set_grad_enabled(grad):
            wt_hat = F.normalize(wt, dim=1, eps=_NORM_EPS)
            return xt, wt, wt_hat, TARGET_LOGIT[self.kind](xt, wt_hat, **self.params)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self) -> Tensor:
        x, N = self.x, self.x.shape[0]
        dev = x.device
        n_t = self.t_idx.numel()
        m = torch.full((N,), -math.inf, device=dev)
        lse_local = torch.full((N,), -math.inf, device=dev)
        sz = torch.zeros(N, device=dev)
        z_t = torch.zeros(n_t, device=dev)
        cos_t = torch.zeros(n_t, device=dev)
        if self.normalized:
            xt, _, wt_hat, self.z_t = self.target_pairs(grad=False)
            cos_t = pair_cos(xt, wt_hat)
            self.inv = torch.empty(self.k_local, device=dev)
        for c0, c1 in self.blocks():
            z, _, _, (sel, ti, tc) = self.block_logits(c0, c1, forward=True)
            z_t[sel] = z[ti, tc]
            # the block's log-sum-exp from torch's fused log_softmax (one vectorised pass),
            # read at each row's maximum where it is most precise: lse = max − log_softmax(max)
            zmax, arg = torch.max(z, 1)
            lsm = torch.ops.aten._log_softmax.out(z, 1, False, out=self.ws.get("lsm", tuple(z.shape), dev))
            lse_b = zmax - lsm.gather(1, arg[:, None]).squeeze(1)
            lse_local = torch.logaddexp(lse_local, lse_b)
            m = torch.maximum(m, zmax)
            if self.eps:
                sz.add_(z.sum(1))

        # combine the shards: one all-gather of [lse, max, Σz, target logit, target cos | K]
        def per_sample(v: Tensor) -> Tensor:
            out = torch.zeros(N, dtype=torch.float64, device=dev)
            out[self.t_idx] = v.double()
            return out

        packed = torch.cat(
            [
                torch.stack([lse_local.double(), m.double(), sz.double(), per_sample(z_t), per_sample(cos_t)]).flatten(),
                torch.tensor([float(self.k_local)], dtype=torch.float64, device=dev),
            ]
        )
        allp = all_gather_stack(packed, self.clf.group)
        parts = allp[:, :-1].view(allp.shape[0], 5, N)
        lse = torch.logsumexp(parts[:, 0], 0)
        zmax = parts[:, 1].amax(0)
        sum_z, tgt, cos_tgt = parts[:, 2].sum(0), parts[:, 3].sum(0), parts[:, 4].sum(0)
        K = int(allp[:, -1].sum())
        self.K = K
        self.on, self.off = smoothing_weights(K, self.eps)  # the smoothed target distribution
        per = smoothed_nll(lse, tgt, sum_z, K, self.eps)
        self.lse = lse.float()
        loss = per.mean().float()
        self.stats_tensor = torch.stack([loss.double(), (tgt >= zmax).double().mean(), tgt.mean(), cos_tgt.mean()])
        return loss

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, grad_out: Tensor, need_x: bool) -> Tensor | None:
        if self.consumed and self.keep:
            raise RuntimeError("ShardedClassifier: backward through the same call twice is not supported (kept logits are consumed)")
        x, N = self.x, self.x.shape[0]
        a = grad_out.float() / N
        grad_x = torch.zeros_like(x) if need_x else None
        writer = self.clf._grad_writer(self.rows)
        on, off = self.on, self.off
        G_t = torch.zeros(self.t_idx.numel(), device=x.device)  # dL/d(target logit), for the pair path
        neg_lse = self.lse.neg()[:, None]
        for c0, c1 in self.blocks():
            nb = c1 - c0
            z, wb, inv, tgt = self.kept_block(c0, c1) if self.keep else self.block_logits(c0, c1, forward=False)
            sel, ti, tc = tgt
            G = torch.add(z, neg_lse, out=self.ws.get("g", (N, nb), x.device)).exp_()  # probabilities
            if off:
                G.sub_(off)
            G[ti, tc] -= on - off
            if not self.normalized:
                G.mul_(a)
                if grad_x is not None:
                    grad_x.addmm_(G, wb)
                writer.write(c0, c1, G, x, None, None, G.sum(0))
                continue
            G_t[sel] = G[ti, tc]
            G[ti, tc] = 0.0
            # Off target, cos_ij = z_ij / s and dL/dcos_ij = s·G_ij. The row normalisation's
            # backward needs S_j = Σ_i dL/dcos_ij · cos_ij = Σ_i G_ij z_ij.
            S = z.mul_(G).sum(0).mul_(a)
            G.mul_(inv * (a * self.scale))  # now dL/d(x·w_j) off target
            if grad_x is not None:
                grad_x.addmm_(G, wb)
            writer.write(c0, c1, G, x, wb, inv * inv * S, None)
        self.consumed = True
        self.clf._release_kept(self)
        if self.normalized and self.t_idx.numel():
            xt, wt, _, zt = self.target_pairs(grad=True)
            gx_t, gw_t = torch.autograd.grad(zt, (xt, wt), G_t * a)
            if grad_x is not None:
                _add_rows(grad_x, self.t_idx, gx_t)
            writer.add_rows(self.t_row, gw_t)
        writer.finish()
        return grad_x


class _ShardedSoftmaxFn(torch.autograd.Function):
    # Autocast is off inside: the classifier's math is fp32 whatever the surrounding precision.
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, plan: _ShardSoftmax) -> Tensor:
        ctx.plan = plan
        with torch.autocast(device_type=x.device.type, enabled=False):
            return plan.forward()

    @staticmethod
    def backward(ctx, grad: Tensor):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            grad_x = ctx.plan.backward(grad, ctx.needs_input_grad[0])
        return grad_x, None, None, None


class _GradWriter:
    """Writes one backward's row gradients into ``.grad`` (fresh buffer or accumulation).

    A fresh gradient (``.grad`` was None) is written, not added: every active row exactly once.
    """

    def __init__(self, clf: ShardedClassifier, rows: Tensor | None) -> None:
        self.clf, self.rows = clf, rows
        self.targets: list[tuple[nn.Parameter, bool]] = []
        fresh_any = False
        for p in (clf.weight, clf.bias):
            if p is None or not p.requires_grad:
                continue
            fresh = p.grad is None
            if fresh:
                p.grad = clf._fresh_grad(p, dense=rows is None)
                fresh_any = True
            self.targets.append((p, fresh))
        if fresh_any:  # a new gradient starts: forget the rows of the previous one
            clf._touched = None

    def write(self, c0: int, c1: int, G: Tensor, x: Tensor, wb: Tensor | None, coef: Tensor | None, gb: Tensor | None) -> None:
        for p, overwrite in self.targets:
            if p is self.clf.bias:
                self._put(p, c0, c1, gb, overwrite)
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
            gw = torch.mm(G.t(), x, out=self.clf._workspace.get("gw", (c1 - c0, x.shape[1]), x.device))
            if coef is not None:
                gw.addcmul_(wb, coef[:, None], value=-1)
            self._put(p, c0, c1, gw, overwrite)

    def add_rows(self, local_rows: Tensor, gw: Tensor) -> None:
        """Add weight-gradient rows at local row ids (after every block was written)."""
        for p, _ in self.targets:
            if p is self.clf.weight:
                _add_rows(p.grad, local_rows, gw)

    def _put(self, p: Tensor, c0: int, c1: int, g: Tensor, overwrite: bool) -> None:
        if self.rows is None:
            if overwrite:
                p.grad[c0:c1] = g
            else:
                p.grad[c0:c1] += g
        elif overwrite:  # the buffer's rows are zero and the active rows are distinct
            p.grad.index_copy_(0, self.rows[c0:c1], g.to(p.grad.dtype))
        else:
            _add_rows(p.grad, self.rows[c0:c1], g)

    def finish(self) -> None:
        if not self.targets:
            return
        rows = ALL_ROWS if self.rows is None else self.rows
        self.clf._touched = _union(self.clf._touched, rows)
        for p, _ in self.targets:
            name = "weight" if p is self.clf.weight else "bias"
            if p.grad is self.clf._grad_bufs.get(name):
                self.clf._buf_dirty[name] = _union(self.clf._buf_dirty.get(name), rows)


class ShardedClassifier(nn.Module):
    """Class-sharded proxy classifier; see the module docstring for the algorithm.

    Args:
        num_classes: ``C``, global class ids are ``0 … C−1``.
        dim: embedding dimension ``D``.
        kind: ``normsoftmax`` (``temperature``), ``cosface`` (``scale``, ``margin``),
            ``arcface`` (``scale``, ``margin``) or ``softmax_ce`` (``smoothing``; a linear
            layer with bias on unnormalised features, both zero-initialised).
        sample_ratio: share of each shard's classes in each step's softmax, in (0, 1].
        group: the process group sharing the classes (None: the default group, or one
            process when ``torch.distributed`` is not initialised).
        seed: seeds the weight initialisation (the same for any world size) and the class draws.
        logits_budget_mb: keep the ``global batch × active rows`` logits for backward while
            they fit; beyond it, work in class blocks and recompute in backward.

    Attributes: ``weight`` (local rows × D), ``bias`` (softmax_ce), ``class_start``/``class_end``
    (global ids of the local rows), ``active_rows`` and ``stats`` of the last call: ``loss``,
    ``accuracy`` (target logit is the largest), ``target_logit`` and ``target_cos`` (means
    over the global batch), ``active_rows`` (this shard), ``active_classes`` and
    ``active_share`` (all shards), ``logits_kept`` (1 when backward reuses the logits).

    The parameters are model-parallel: keep them out of DeepSpeed's data-parallel engine and
    step them with :func:`~dmltrain.distributed.sparse_optim.make_classifier_optimizer`.
    ``.grad`` is this shard's exact gradient (not an average); it lives in a buffer reused
    across steps, so copy it if you need it after the next backward.
    """

    def __init__(
        self,
        num_classes: int,
        dim: int,
        kind: str = "normsoftmax",
        sample_ratio: float = 1.0,
        group: Any = None,
        seed: int = 0,
        logits_budget_mb: float = 256.0,
        **params: float,
    ) -> None:
        super().__init__()
        if kind not in KIND_PARAMS:
            raise ValueError(f"ShardedClassifier: unknown kind {kind!r} (choose from {', '.join(KIND_PARAMS)})")
        unknown = sorted(set(params) - set(KIND_PARAMS[kind]))
        if unknown:
            raise TypeError(f"{kind}: unknown parameter(s) {', '.join(unknown)} (it takes: {', '.join(KIND_PARAMS[kind])})")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"ShardedClassifier: sample_ratio must be in (0, 1], got {sample_ratio}")
        if num_classes < 1 or dim < 1:
            raise ValueError(f"ShardedClassifier: num_classes and dim must be positive, got {num_classes}, {dim}")
        if logits_budget_mb <= 0:
            raise ValueError(f"ShardedClassifier: logits_budget_mb must be positive, got {logits_budget_mb}")
        self.params = {**KIND_PARAMS[kind], **{k: float(v) for k, v in params.items()}}
        if kind == "normsoftmax" and self.params["temperature"] <= 0:
            raise ValueError(f"normsoftmax: temperature must be positive, got {self.params['temperature']}")
        if kind == "softmax_ce" and not 0 <= self.params["smoothing"] < 1:
            raise ValueError(f"softmax_ce: smoothing must be in [0, 1), got {self.params['smoothing']}")
        if kind in ("cosface", "arcface"):
            scale, margin = self.params["scale"], self.params["margin"]
            top = math.pi if kind == "arcface" else math.inf
            if scale <= 0 or not 0 <= margin < top:
                raise ValueError(f"{kind}: need scale > 0 and 0 <= margin{' < pi' if kind == 'arcface' else ''}, got {scale}, {margin}")
        self.num_classes, self.dim, self.kind = int(num_classes), int(dim), kind
        self.sample_ratio, self.seed = float(sample_ratio), int(seed)
        self.logits_budget_mb = float(logits_budget_mb)
        self.group = group
        self.rank, self.world_size = group_rank_size(group)
        self.partition = ClassPartition(self.num_classes, self.world_size)
        self.class_start, self.class_end = self.partition.start(self.rank), self.partition.end(self.rank)
        n_local = self.class_end - self.class_start
        self.weight = nn.Parameter(torch.empty(n_local, dim))
        if kind == "softmax_ce":
            self.bias = nn.Parameter(torch.zeros(n_local))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.stats: dict[str, float] = {}
        self._active: Tensor | None = None
        self._touched: Tensor | _AllRows | None = None  # rows with a gradient since it was cleared
        self._grad_bufs: dict[str, Tensor] = {}
        self._buf_dirty: dict[str, Tensor | _AllRows | None] = {}
        self._calls = 0
        self._workspace = Workspace()  # transient buffers (within one forward or backward)
        self._kept = Workspace()  # what a call keeps for its backward
        self._kept_owner: weakref.ref | None = None

    # -- parameters -------------------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        return self.class_end - self.class_start

    def reset_parameters(self) -> None:
        """Normalised kinds: N(0, 1/D) rows, generated per block of class ids so that every
        world size gets the same weight; softmax_ce: zeros (weight and bias)."""
        with torch.no_grad():
            if self.kind == "softmax_ce":
                self.weight.zero_()
                self.bias.zero_()
                return
            std = self.dim**-0.5
            b0 = self.class_start // _INIT_BLOCK
            for blk in range(b0, (max(self.class_end - 1, self.class_start)) // _INIT_BLOCK + 1):
                lo, hi = blk * _INIT_BLOCK, min((blk + 1) * _INIT_BLOCK, self.num_classes)
                s, e = max(lo, self.class_start), min(hi, self.class_end)
                if s >= e:
                    continue
                gen = torch.Generator().manual_seed(draw_seed(self.seed, blk, -1))
                rows = torch.randn(hi - lo, self.dim, generator=gen).mul_(std)
                self.weight[s - self.class_start : e - self.class_start] = rows[s - lo : e - lo].to(self.weight.device)

    def extra_repr(self) -> str:
        p = ", ".join(f"{k}={v:g}" for k, v in self.params.items())
        return (
            f"kind={self.kind}, classes={self.num_classes} (local {self.class_start}:{self.class_end}), dim={self.dim}, "
            f"sample_ratio={self.sample_ratio:g}, {p}"
        )

    # -- the call ---------------------------------------------------------------------------------
    def forward(self, embeddings: Tensor, labels: Tensor, step: int | None = None) -> Tensor:
        """Global-batch mean loss (same on every worker).

        ``step`` (the global optimizer step) keys the class draw with the seed and shard;
        without it the classifier counts its own calls. Labels are global class ids.
        """
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"ShardedClassifier: expected embeddings B×{self.dim}, got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(f"ShardedClassifier: expected {embeddings.shape[0]} labels, got shape {tuple(labels.shape)}")
        if step is None:
            step = self._calls
        self._calls = int(step) + 1
        dev = self.weight.device
        x = embeddings.to(device=dev, dtype=torch.float32)
        sizes = all_gather_sizes(x.shape[0], self.group, dev)
        labels_g = _gather_rows(labels.to(device=dev, dtype=torch.int64), sizes, self.group)
        N = labels_g.numel()
        if N:
            lo, hi = torch.aminmax(labels_g)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self.num_classes:
                raise ValueError(f"ShardedClassifier: labels must be in [0, {self.num_classes}), got [{lo}, {hi}]")
        if self.kind != "softmax_ce":
            x = F.normalize(x, dim=1)
        x_g = gather_with_grad(x, self.group, sizes)
        rows = self._draw(labels_g, int(step))
        self._active = rows
        if N == 0:
            self.stats = {"loss": 0.0, "active_rows": float(self._num_active()), "active_classes": 0.0}
            return x_g.sum() * 0.0
        params = [p for p in (self.weight, self.bias) if p is not None]
        need_grad = torch.is_grad_enabled() and (x_g.requires_grad or any(p.requires_grad for p in params))
        plan = _ShardSoftmax(self, x_g.detach(), labels_g, rows, need_grad)
        loss = _ShardedSoftmaxFn.apply(x_g, self.weight, self.bias, plan)
        vals = plan.stats_tensor.tolist()
        self.stats = {
            "loss": vals[0],
            "accuracy": vals[1],
            "target_logit": vals[2],
            "active_rows": float(plan.k_local),
            "active_classes": float(plan.K),
            "active_share": plan.K / self.num_classes,
            "logits_kept": float(plan.keep),
        }
        if self.kind != "softmax_ce":
            self.stats["target_cos"] = vals[3]
        return loss

    def _draw(self, labels_g: Tensor, step: int) -> Tensor | None:
        if self.sample_ratio >= 1.0:
            return None
        rows = draw_active_rows(torch.unique(labels_g.cpu()), self.partition.bounds(), self.rank, self.sample_ratio, self.seed, step)
        return rows.to(self.weight.device)

    def _num_active(self) -> int:
        return self.num_local if self._active is None else self._active.numel()

    @property
    def active_rows(self) -> Tensor:
        """Local row indices that took part in the last call (sorted)."""
        if self._active is None:
            return torch.arange(self.num_local, device=self.weight.device)
        return self._active

    @property
    def active_class_ids(self) -> Tensor:
        """Global class ids of :attr:`active_rows`."""
        return self.active_rows + self.class_start

    # -- buffers kept from forward to backward --------------------------------------------------------
    def _kept_workspace(self, plan: _ShardSoftmax) -> Workspace:
        """The reused kept-buffers for ``plan``, or private ones while an earlier call still
        awaits its backward (forward, forward, backward, backward must stay correct)."""
        owner = None if self._kept_owner is None else self._kept_owner()
        if owner is not None and not owner.consumed:
            return Workspace()
        self._kept_owner = weakref.ref(plan)
        return self._kept

    def _release_kept(self, plan: _ShardSoftmax) -> None:
        if self._kept_owner is not None and self._kept_owner() is plan:
            self._kept_owner = None

    def release_buffers(self) -> None:
        """Free the reusable scratch and kept buffers (they are rebuilt on the next call)."""
        self._workspace.clear()
        self._kept.clear()
        self._kept_owner = None

    # -- gradient bookkeeping (used by the row-sparse optimizers) ---------------------------------
    def _grad_writer(self, rows: Tensor | None) -> _GradWriter:
        return _GradWriter(self, rows)

    def _fresh_grad(self, p: nn.Parameter, dense: bool) -> Tensor:
        """The gradient buffer of ``p``, reused across steps (no full zeroing or page faults).

        A dense backward overwrites every row, so the buffer is not cleared; a sparse one
        first zeroes the rows written since the buffer was last all-zero.
        """
        name = "weight" if p is self.weight else "bias"
        buf = self._grad_bufs.get(name)
        if buf is None or buf.shape != p.shape or buf.device != p.device or buf.dtype != p.dtype:
            buf = torch.empty_like(p, memory_format=torch.contiguous_format) if dense else torch.zeros_like(p)
            self._grad_bufs[name] = buf
        elif not dense:
            dirty = self._buf_dirty.get(name)
            if dirty is ALL_ROWS:
                buf.zero_()
            elif dirty is not None and dirty.numel():
                buf.index_fill_(0, dirty, 0)
        self._buf_dirty[name] = None
        return buf

    def grad_rows(self) -> Tensor | None:
        """Local rows holding a gradient since it was last cleared; None means all rows."""
        touched = self._touched
        if touched is ALL_ROWS:
            return None
        if touched is None:
            return torch.zeros(0, dtype=torch.int64, device=self.weight.device)
        return touched

    def grad_cleared(self) -> None:
        """Called when the gradients were set to None or zeroed in place."""
        for name in ("weight", "bias"):
            p = getattr(self, name)
            if p is not None and p.grad is not None and p.grad is self._grad_bufs.get(name):
                self._buf_dirty[name] = None  # zeroed in place
        self._touched = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.grad_cleared()

    # -- whole weight and checkpoints by class id ---------------------------------------------------
    def full_weight(self) -> Tensor:
        """The whole ``C × D`` weight on every worker (an all-gather: mind the memory for large C)."""
        return self._gather_rows_all(self.weight.detach())

    def full_bias(self) -> Tensor | None:
        return None if self.bias is None else self._gather_rows_all(self.bias.detach())

    def _gather_rows_all(self, t: Tensor) -> Tensor:
        sizes = [e - s for s, e in self.partition.bounds()]
        return _gather_rows(t.contiguous(), sizes, self.group).clone()

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Keep this worker's rows of a whole ``C × D`` weight (and ``C`` bias)."""
        if tuple(weight.shape) != (self.num_classes, self.dim):
            raise ValueError(f"load_full_weight: expected a {self.num_classes}×{self.dim} weight, got {tuple(weight.shape)}")
        self.weight.copy_(weight[self.class_start : self.class_end])
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"load_full_weight: {self.kind} has no bias")
            self.bias.copy_(bias[self.class_start : self.class_end])

    def state_dict_by_class(self, optimizer: Any = None, dst: int | None = 0) -> dict[str, Any] | None:
        """Rows by global class id, with their optimizer state, gathered on rank ``dst``.

        Returns the whole state on ``dst`` (every rank when ``dst`` is None) and None elsewhere.
        For very large C prefer :func:`~dmltrain.distributed.class_checkpoint.save_by_class`,
        which writes one file per worker and never gathers.
        """
        from dmltrain.distributed.class_checkpoint import gather_state

        return gather_state(self, optimizer, dst)

    def local_state_by_class(self, optimizer: Any = None) -> dict[str, Any]:
        """This worker's rows (``class_start``…``class_end``) with their optimizer state."""
        from dmltrain.distributed.class_checkpoint import local_state

        return local_state(self, optimizer)

    def load_state_dict_by_class(self, state: dict[str, Any] | list[dict[str, Any]], optimizer: Any = None) -> None:
        """Keep this worker's rows of a state saved at any world size (a whole state or pieces)."""
        from dmltrain.distributed.class_checkpoint import load_state

        load_state(self, state, optimizer)
