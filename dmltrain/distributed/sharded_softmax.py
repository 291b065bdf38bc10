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
3. The gathered batch is scored against the active rows, and each sample's log-sum-exp over
   this shard accumulated online, by one of two implementations of the same call:
   torch block GEMMs (:mod:`~dmltrain.distributed.block_softmax`, the CPU path, fp32 or
   float64) or fused Triton kernels (:mod:`~dmltrain.distributed.fused_softmax`, the CUDA
   path, fp32/tf32/bf16 products with fp32 accumulation, the logits never in memory).
4. One all-gather of per-sample partial statistics (shard log-sum-exp, shard max, target
   logit, shard sum of logits for label smoothing) plus the active-row count combines the
   shards (:mod:`~dmltrain.distributed.shard_call`): the softmax is normalised over every
   active class of every shard, and no worker holds more than its own logits. The exchanged
   volume is ``5 × global batch`` numbers per worker, smaller than the embedding gather
   while ``W < D/5``.
5. Backward writes this shard's row gradients straight into ``weight.grad`` (rows not
   active stay exactly zero; :mod:`~dmltrain.distributed.grad_rows`) and returns its share
   of the gathered embeddings' gradient; the gather's backward sums the shards' shares and
   hands each worker its own samples'.

Margins act on the target logit only: CosFace ``s(cosθ − m)``, ArcFace ``s·cos(θ + m)`` with
its true gradient, each kind's maths described once in :mod:`dmltrain.losses.kinds` (θ from
``atan2`` of the unit vectors, InsightFace's continuation beyond ``θ + m > π``). Each
sample's target logit is computed on its (embedding, class row) pair and differentiated by
autograd there, O(batch × D); the block products carry the other classes. Label smoothing
(softmax CE, :func:`~dmltrain.losses.margins.smoothed_nll`) spreads ``ε`` over the other
``K − 1`` classes taking part, ``K`` counted over all shards, using the global sum of logits.

The weight gradient is written into ``clf.weight.grad`` (and ``clf.bias.grad``) directly,
accumulating when it already exists, as Megatron's fused gradient accumulation does. Hence
``torch.autograd.grad(loss, clf.weight)`` is not supported; read ``.grad`` after backward.

Precision (``precision``): ``auto`` is bf16 products on CUDA and fp32 on the CPU. The torch
path computes in fp32, or in float64 for a classifier moved to float64 (``.double()``). The
weight is fp32 unless ``weight_storage="bf16"`` (fused path; its gradient is then bf16 and
the optimizer keeps fp32 state and rounds stochastically). Embeddings in bf16/fp16 are cast
to the compute dtype, autocast is disabled inside, and the embeddings' gradient returns in
their dtype.

Memory (torch path): besides the weight, its gradient and the optimizer state, the classifier
keeps reusable scratch buffers and the kept logits (at most ``logits_budget_mb``) from call to
call, because the CPU allocator caches nothing; ``release_buffers()`` frees them.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmltrain.distributed.block_softmax import BlockSoftmax
from dmltrain.distributed.class_partition import ClassPartition
from dmltrain.distributed.class_sampling import draw_active_rows, draw_seed
from dmltrain.distributed.collectives import _gather_rows, all_gather_sizes, gather_with_grad, group_rank_size
from dmltrain.distributed.fused_softmax import FusedSoftmax, fused_unavailable
from dmltrain.distributed.grad_rows import GradWriter, RowGrads
from dmltrain.distributed.shard_call import CallStats, ShardCall
from dmltrain.distributed.workspace import Workspace
from dmltrain.losses.kinds import KINDS

PRECISIONS = ("auto", "fp32", "tf32", "bf16")
WEIGHT_STORAGES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BACKENDS = ("auto", "torch", "triton")
#: classes per block of the W-independent weight initialisation
_INIT_BLOCK = 1 << 16


class _ShardedSoftmaxFn(torch.autograd.Function):
    # Autocast is off inside: the classifier chooses its own precision.
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, call: ShardCall) -> Tensor:
        ctx.call = call
        with torch.autocast(device_type=x.device.type, enabled=False):
            return call.forward()

    @staticmethod
    def backward(ctx, grad: Tensor):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            grad_x = ctx.call.backward(grad, ctx.needs_input_grad[0])
        return grad_x, None, None, None


class ShardedClassifier(nn.Module):
    """Class-sharded proxy classifier; see the module docstring for the algorithm.

    Args:
        num_classes: ``C``, global class ids are ``0 … C−1``.
        dim: embedding dimension ``D``.
        kind: ``normsoftmax`` (``temperature``), ``cosface`` (``scale``, ``margin``),
            ``arcface`` (``scale``, ``margin``) or ``softmax_ce`` (``smoothing``; a linear
            layer with bias on unnormalised features, both zero-initialised); the
            hyperparameters, defaults and bounds are :data:`dmltrain.losses.kinds.KINDS`'.
        sample_ratio: share of each shard's classes in each step's softmax, in (0, 1].
        group: the process group sharing the classes (None: the default group, or one
            process when ``torch.distributed`` is not initialised).
        seed: seeds the weight initialisation (the same for any world size) and the class draws.
        init_std: std of the normalised kinds' initial rows (None: ``1/sqrt(dim)``, rows of norm
            about 1). The loss normalises the rows, so a larger norm turns them more slowly
            (by about ``lr·|g|/|w|²`` a step): pytorch-metric-learning starts at 1.
        logits_budget_mb: torch path: keep the ``global batch × active rows`` logits for
            backward while they fit; beyond it, work in class blocks and recompute in backward.
        precision: ``auto``, ``fp32``, ``tf32`` or ``bf16``: the products of the fused kernels.
        weight_storage: ``fp32`` or ``bf16`` (the fused path only).
        backend: ``auto`` (fused kernels for a CUDA weight, torch otherwise), ``torch`` or
            ``triton`` (on the CPU only under ``TRITON_INTERPRET=1``, for tests).

    Attributes: ``weight`` (local rows × D), ``bias`` (softmax_ce), ``class_start``/``class_end``
    (global ids of the local rows), ``active_rows`` and ``stats`` of the last call: ``loss``,
    ``accuracy`` (target logit is the largest), ``target_logit`` and ``target_cos`` (means
    over the global batch), ``active_rows`` (this shard), ``active_classes`` and
    ``active_share`` (all shards), ``logits_kept`` (1 when backward reuses the logits): a
    :class:`~dmltrain.distributed.shard_call.CallStats`, on the device until read.

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
        precision: str = "auto",
        weight_storage: str = "fp32",
        backend: str = "auto",
        init_std: float | None = None,
        **params: float,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"ShardedClassifier: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
        self.spec = KINDS[kind]
        self.params = self.spec.resolve(params)
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"ShardedClassifier: sample_ratio must be in (0, 1], got {sample_ratio}")
        if num_classes < 1 or dim < 1:
            raise ValueError(f"ShardedClassifier: num_classes and dim must be positive, got {num_classes}, {dim}")
        if logits_budget_mb <= 0:
            raise ValueError(f"ShardedClassifier: logits_budget_mb must be positive, got {logits_budget_mb}")
        for name, value, choices in (("precision", precision, PRECISIONS), ("weight_storage", weight_storage, WEIGHT_STORAGES),
                                     ("backend", backend, BACKENDS)):  # fmt: skip
            if value not in choices:
                raise ValueError(f"ShardedClassifier: {name} must be one of {', '.join(choices)}, got {value!r}")
        self.num_classes, self.dim, self.kind = int(num_classes), int(dim), kind
        self.sample_ratio, self.seed = float(sample_ratio), int(seed)
        if init_std is not None and not init_std > 0:
            raise ValueError(f"ShardedClassifier: init_std must be positive, got {init_std}")
        self.init_std = None if init_std is None else float(init_std)
        self.logits_budget_mb = float(logits_budget_mb)
        self.precision, self.backend = precision, backend
        self.group = group
        self.rank, self.world_size = group_rank_size(group)
        self.partition = ClassPartition(self.num_classes, self.world_size)
        self.class_start, self.class_end = self.partition.start(self.rank), self.partition.end(self.rank)
        n_local = self.class_end - self.class_start
        self.weight = nn.Parameter(torch.empty(n_local, dim, dtype=WEIGHT_STORAGES[weight_storage]))
        if self.spec.has_bias:
            self.bias = nn.Parameter(torch.zeros(n_local, dtype=self.weight.dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.stats: Mapping[str, float] = {}
        self._active: Tensor | None = None
        self._grads = RowGrads()
        self._calls = 0
        self.workspace = Workspace()  # transient buffers (within one forward or backward)
        self._kept = Workspace()  # what a call keeps for its backward
        self._kept_owner: weakref.ref | None = None

    # -- parameters -------------------------------------------------------------------------------
    @property
    def num_local(self) -> int:
        return self.class_end - self.class_start

    def reset_parameters(self) -> None:
        """Normalised kinds: N(0, init_std²) rows (default 1/D), generated per block of class ids so
        that every world size gets the same weight; softmax_ce: zeros (weight and bias)."""
        with torch.no_grad():
            if self.spec.has_bias:
                self.weight.zero_()
                self.bias.zero_()
                return
            std = self.init_std if self.init_std is not None else self.dim**-0.5
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
            f"sample_ratio={self.sample_ratio:g}, precision={self.precision}, weight={str(self.weight.dtype)[6:]}, {p}"
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
            raise ValueError(
                f"ShardedClassifier: expected {embeddings.shape[0]} labels, got shape {tuple(labels.shape)}"
            )
        fused, precision = self._path()
        if step is None:
            step = self._calls
        self._calls = int(step) + 1
        dev = self.weight.device
        x = embeddings.to(device=dev, dtype=torch.float64 if self.weight.dtype == torch.float64 else torch.float32)
        sizes = all_gather_sizes(x.shape[0], self.group, dev)
        labels_g = _gather_rows(labels.to(device=dev, dtype=torch.int64), sizes, self.group)
        N = labels_g.numel()
        if N:
            lo, hi = torch.aminmax(labels_g)
            if dev.type != "cpu":  # checked without a host read: it fails at a later kernel, not here
                torch._assert_async(
                    (lo >= 0) & (hi < self.num_classes), f"ShardedClassifier: labels must be in [0, {self.num_classes})"
                )
            elif int(lo) < 0 or int(hi) >= self.num_classes:
                raise ValueError(
                    f"ShardedClassifier: labels must be in [0, {self.num_classes}), got [{int(lo)}, {int(hi)}]"
                )
        if self.spec.normalized:
            x = F.normalize(x, dim=1)
        x_g = gather_with_grad(x, self.group, sizes)
        rows = self._draw(labels_g, int(step))
        self._active = rows
        if N == 0:
            self.stats = {"loss": 0.0, "active_rows": float(self._num_active()), "active_classes": 0.0}
            return x_g.sum() * 0.0
        params = [p for p in (self.weight, self.bias) if p is not None]
        need_grad = torch.is_grad_enabled() and (x_g.requires_grad or any(p.requires_grad for p in params))
        if fused:
            call: ShardCall = FusedSoftmax(self, x_g.detach(), labels_g, rows, precision)
        else:
            call = BlockSoftmax(self, x_g.detach(), labels_g, rows, need_grad)
        loss = _ShardedSoftmaxFn.apply(x_g, self.weight, self.bias, call)
        st = call.stats_tensor  # stays on the device until someone reads self.stats
        on_device = {
            "loss": st[0],
            "accuracy": st[1],
            "target_logit": st[2],
            "active_classes": st[4],
            "active_share": st[4] / self.num_classes,
        }
        if self.spec.normalized:
            on_device["target_cos"] = st[3]
        self.stats = CallStats(
            on_device, {"active_rows": float(call.k_local), "logits_kept": float(getattr(call, "keep", False))}
        )
        return loss

    def _path(self) -> tuple[bool, str]:
        """(fused kernels?, product precision) for the weight as it is now; one clear line when
        the combination cannot run."""
        dev, dt = self.weight.device, self.weight.dtype
        fused = self.backend == "triton" or (self.backend == "auto" and dev.type == "cuda" and dt != torch.float64)
        if dt not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(
                f"ShardedClassifier: a {str(dt)[6:]} weight is not supported (fp32, bf16 on the fused path, or float64)"
            )
        if fused:
            why = fused_unavailable(dev)
            if why is None and dt == torch.float64:
                why = "the fused kernels compute in fp32/tf32/bf16; a float64 classifier needs backend='torch'"
            if why:
                raise ValueError(f"ShardedClassifier: backend {self.backend!r} cannot run: {why}")
            precision = self.precision if self.precision != "auto" else ("bf16" if dev.type == "cuda" else "fp32")
            return True, precision
        if self.precision in ("tf32", "bf16"):
            raise ValueError(f"ShardedClassifier: precision {self.precision!r} needs the fused CUDA kernels; the torch path "
                             f"(weight on {dev.type}) computes in fp32, use precision 'auto' or 'fp32'")  # fmt: skip
        if dt == torch.bfloat16:
            raise ValueError("ShardedClassifier: a bf16 weight (weight_storage 'bf16') needs the fused CUDA kernels")
        return False, "fp32"

    def _draw(self, labels_g: Tensor, step: int) -> Tensor | None:
        if self.sample_ratio >= 1.0:
            return None
        rows = draw_active_rows(
            torch.unique(labels_g.cpu()), self.partition.bounds(), self.rank, self.sample_ratio, self.seed, step
        )
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

    # -- buffers kept from forward to backward (torch path) ---------------------------------------------
    def kept_workspace(self, call: ShardCall) -> Workspace:
        """The reused kept-buffers for ``call``, or private ones while an earlier call still
        awaits its backward (forward, forward, backward, backward must stay correct)."""
        owner = None if self._kept_owner is None else self._kept_owner()
        if owner is not None and not owner.consumed:
            return Workspace()
        self._kept_owner = weakref.ref(call)
        return self._kept

    def release_kept(self, call: ShardCall) -> None:
        if self._kept_owner is not None and self._kept_owner() is call:
            self._kept_owner = None

    def release_buffers(self) -> None:
        """Free the reusable scratch and kept buffers (they are rebuilt on the next call)."""
        self.workspace.clear()
        self._kept.clear()
        self._kept_owner = None

    # -- gradient bookkeeping (the row-sparse optimizers' RowSource) ------------------------------
    def _row_params(self) -> dict[str, nn.Parameter | None]:
        return {"weight": self.weight, "bias": self.bias}

    def grad_writer(self, rows: Tensor | None) -> GradWriter:
        """The writer of one backward's row gradients (``rows``: the active rows, None for all)."""
        return self._grads.writer(self._row_params(), rows)

    def grad_rows(self) -> Tensor | None:
        """Local rows holding a gradient since it was last cleared; None means all rows."""
        return self._grads.rows(self.weight.device)

    def grad_cleared(self) -> None:
        """Called when the gradients were set to None or zeroed in place."""
        self._grads.cleared(self._row_params())

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.grad_cleared()

    # -- the whole weight ------------------------------------------------------------------------------
    def full_weight(self) -> Tensor:
        """The whole ``C × D`` weight on every worker (an all-gather: mind the memory for large C)."""
        return self.gather_rows_all(self.weight.detach())

    def full_bias(self) -> Tensor | None:
        return None if self.bias is None else self.gather_rows_all(self.bias.detach())

    def gather_rows_all(self, t: Tensor) -> Tensor:
        """Every worker's rows of a per-class tensor (``C_local × …``), concatenated in class order."""
        sizes = [e - s for s, e in self.partition.bounds()]
        return _gather_rows(t.contiguous(), sizes, self.group).clone()

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Keep this worker's rows of a whole ``C × D`` weight (and ``C`` bias)."""
        if tuple(weight.shape) != (self.num_classes, self.dim):
            raise ValueError(
                f"load_full_weight: expected a {self.num_classes}×{self.dim} weight, got {tuple(weight.shape)}"
            )
        self.weight.copy_(weight[self.class_start : self.class_end])
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"load_full_weight: {self.kind} has no bias")
            self.bias.copy_(bias[self.class_start : self.class_end])
