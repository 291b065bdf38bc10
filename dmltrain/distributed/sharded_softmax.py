"""The class-sharded softmax classifier: model-parallel NormSoftmax, CosFace, ArcFace and softmax CE.

``ShardedClassifier(num_classes, dim, kind)`` holds the rows of the class weight that this worker
owns (:class:`~dmltrain.distributed.class_partition.ClassPartition`: contiguous blocks, uneven
``C/W`` allowed) and is called as ``clf(local_embeddings, local_labels, step=global_step)``. It
returns the mean loss over the *global* batch, the same value on every worker.

The algorithm, top to bottom in this file (:meth:`ShardedClassifier.forward` does steps 1 and 2,
then calls :func:`sharded_softmax` for the rest):

1. **Gather.** The local embeddings (L2-normalised first, except for ``softmax_ce``) and labels
   are all-gathered (uneven local batch sizes allowed); labels are global class ids.
2. **Draw.** With ``sample_ratio < 1`` the shard takes its active rows from the step's class draw
   (:func:`~dmltrain.distributed.class_sampling.draw_active`: every class of the global batch plus
   uniformly drawn others, ``round(ratio × C)`` in all, computed on the device; with ``sampling``
   ``hard`` or ``mixed`` all or part of the others are the classes nearest the batch (its
   embeddings, or its classes' rows), from the nearness index of :mod:`~dmltrain.distributed.class_index`, and with ``sampling_correction`` the
   uniformly drawn ones carry their log-Q offsets; ``proportional`` draws the others in proportion to the
   exponential of the logit their nearness makes, each with the log of its inclusion probability).
3. **Targets.** Each sample whose class this shard holds among its active rows gets its column
   (:func:`_targets`); its target logit, with the kind's margin (:mod:`~dmltrain.losses.kinds`),
   is computed on its (embedding, class row) pair and differentiated by autograd there
   (:func:`_target_pairs`), for every sample with a mask, so every size is known on the host.
4. **Partials.** A backend scores the gathered batch against the active rows and returns each
   sample's log-sum-exp, max and sum of its non-target logits on this shard: torch block GEMMs
   (:mod:`~dmltrain.distributed.softmax_torch`, the CPU path, fp32 or float64) or fused Triton
   kernels (:mod:`~dmltrain.distributed.softmax_kernels`, the CUDA path, the logits never in
   memory). Both expose the same two pure functions, ``partials`` and ``gradients``.
5. **Combine.** One all-gather of the per-sample statistics (shard log-sum-exp, shard max, sum of
   logits for label smoothing, target logit and cosine) plus the active-row count
   (:func:`_combine`): the softmax is normalised over every active class of every shard, and no
   worker holds more than its own logits. ``5 × global batch`` numbers per worker.
6. **Backward.** The backend's ``gradients`` writes the active rows' gradients into the shard's
   :class:`~dmltrain.distributed.row_sparse.RowGrads` (which the row-sparse optimizer reads; rows
   not drawn stay exactly zero) and returns its share of the gathered embeddings' gradient; the
   pair path adds the targets'; the gather's backward sums the shards' shares and hands each
   worker its own samples'.

Sub-centers (``params.subcenters`` k > 1): k rows per class, a class's logit its best sub-center's;
they, the log-Q offsets and dropped samples (``drop_after``) run the torch backend on every device.
:meth:`ShardedClassifier.probe` compares a batch's sampled loss and embedding gradient with the full
softmax's, writing nothing but the nearness index the step's own draw would build.

No host sync. Nothing in a call reads a device value back, at any ratio: the draw, the targets,
the label-smoothing weights (device scalars) and the gradient coefficient stay on the device.
With ``sizes`` given (every rank's local batch size, e.g. equal batches) not even the batch sizes
are exchanged. The one check, labels in ``[0, C)``, is an asynchronous device assertion on CUDA.

Margins act on the target logit only: CosFace ``s(cosθ − m)``, ArcFace ``s·cos(θ + m)`` with its
true gradient (θ from ``atan2`` of the unit vectors, InsightFace's continuation beyond ``θ + m >
π``). Label smoothing (softmax CE) spreads ``ε`` over the other ``K − 1`` classes taking part,
``K`` counted over all shards, using the global sum of logits.

The call and the module. :func:`sharded_softmax` (steps 3 to 6, an autograd Function) takes tensors and
one frozen :class:`SoftmaxPlan` (the kind, this step's draw, the backend, the buffers the module lends)
and returns a :class:`SoftmaxResult` (the loss, its :class:`SoftmaxStats` by name, the sub-centers its
samples were nearest to); it changes no module state. The module applies what it returns (its
``stats``, the sub-center counts of sample dropping) after the call (:meth:`ShardedClassifier._take`).

The one deliberate exception to autograd: the module's weight gradient is written into
``clf.weight.grad`` (and ``clf.bias.grad``) directly, through :attr:`ShardedClassifier.row_grads`, the
active rows only, accumulating when it already exists, as Megatron's fused gradient accumulation does;
backward returns None for the weight, so a dense ``C_local × D`` gradient is never materialised (the
reasons: :func:`sharded_softmax`). ``torch.autograd.grad(loss, embeddings)`` works as usual (and still
writes the rows' ``.grad``); a plan without ``row_grads`` returns the weight's gradient through autograd,
dense.

Precision (``precision``): ``auto`` is bf16 products on CUDA and fp32 on the CPU. The torch path
computes in fp32, or in float64 for a classifier moved to float64 (``.double()``). The weight is
fp32 unless ``weight_storage="bf16"`` (fused path; its gradient is then bf16 and the optimizer
keeps fp32 state and rounds stochastically). Embeddings in bf16/fp16 are cast to the compute
dtype, autocast is disabled inside, and the embeddings' gradient returns in their dtype.
``deterministic`` (fused path): bit-identical gradients run to run, at one more product per step, and
fixed kernel tiles (a tuned choice could differ between ranks and runs).

Memory (torch path): besides the weight, its gradient and the optimizer state, the classifier
keeps reusable scratch buffers and the kept logits (at most ``logits_budget_mb``) from call to
call, because the CPU allocator caches nothing; ``release_buffers()`` frees them.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmltrain.config import NEAREST_TO, PRODUCT_PRECISIONS, SAMPLING_MODES, WEIGHT_STORAGES, gpu_only
from dmltrain.distributed import softmax_torch
from dmltrain.distributed.class_index import ClassIndex, build_index, nearest_keys, nearest_scores
from dmltrain.distributed.class_partition import ClassPartition
from dmltrain.distributed.class_sampling import ActiveRows, draw_active, id_bits, init_block_seed, round_total
from dmltrain.distributed.collectives import (
    all_gather_sizes,
    all_gather_stack,
    all_reduce_sum,
    gather_rows,
    gather_with_grad,
    group_rank_size,
)
from dmltrain.distributed.row_sparse import RowGrads, RowSet, add_rows, dense_target
from dmltrain.distributed.shard_operands import ShardOperands
from dmltrain.distributed.workspace import Workspace
from dmltrain.losses.kinds import KINDS, ClassifierKind
from dmltrain.losses.margins import pair_cos

STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # by loss.classifier.weight_storage
BACKENDS = ("auto", "torch", "triton")
NORM_EPS = 1e-12
#: classes per block of the W-independent weight initialisation
_INIT_BLOCK = 1 << 16

# The kernels (and Triton, ~75 MiB of resident memory) are loaded only where they can run: with a
# CUDA device, or under Triton's CPU interpreter. A CPU-only process keeps the torch path alone.
_UNLOADED = None
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    try:
        from dmltrain.distributed import softmax_kernels
    except ImportError:  # a torch build without Triton
        softmax_kernels, _UNLOADED = None, "Triton is not installed"
else:
    softmax_kernels = None
    _UNLOADED = "no CUDA device and no TRITON_INTERPRET=1 when dmltrain.distributed.sharded_softmax was imported"


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused kernels cannot run on ``device`` (None when they can)."""
    if softmax_kernels is None:
        return f"the kernels are not loaded ({_UNLOADED})"
    if device.type != "cuda" and not softmax_kernels.INTERPRET:
        return f"the weight is on {device.type}: the kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported"
    return None


class CallStats(Mapping[str, float]):
    """A call's statistics, kept where they were computed.

    Read as a mapping (``stats["loss"]``) they are host floats, all brought over at the first read (one
    device sync); :meth:`on_device` gives them without any sync (0-d tensors for the device values,
    floats for those known on the host), for a reader that sums them on the device and reads the
    sums back at log time.
    """

    def __init__(self, device: Mapping[str, Tensor], host: Mapping[str, float]) -> None:
        self._device, self._host = dict(device), dict(host)
        self._read: dict[str, float] | None = None

    def on_device(self) -> dict[str, Tensor | float]:
        return {**self._device, **self._host}

    def with_device(self, extra: Mapping[str, Tensor]) -> CallStats:
        """These statistics and ``extra`` (device values), still unread."""
        return CallStats({**self._device, **extra}, self._host)

    def _values(self) -> dict[str, float]:
        if self._read is None:
            keys = list(self._device)
            vals = torch.stack([self._device[k].detach().double() for k in keys]).tolist() if keys else []
            self._read = {**dict(zip(keys, vals)), **self._host}
        return self._read

    def __getitem__(self, key: str) -> float:
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**self._device, **self._host})

    def __len__(self) -> int:
        return len(self._device) + len(self._host)


# -- the steps of one call ------------------------------------------------------------------------------
def _targets(labels: Tensor, start: int, n_local: int, active: ActiveRows | None) -> tuple[Tensor, Tensor, Tensor]:
    """(column among the active rows or −1, local row (clamped), owned?) of every sample's class."""
    local = labels - start
    owned = (local >= 0) & (local < n_local)
    row = local.clamp(0, max(n_local - 1, 0))
    col = row
    if active is not None:
        if active.capacity == 0:
            owned = torch.zeros_like(owned)
        else:
            col = torch.searchsorted(active.sorted_keys, row).clamp_(max=active.capacity - 1)
            owned &= active.sorted_keys.gather(0, col) == local
    return torch.where(owned, col, -1), row, owned


def _target_pairs(
    spec: ClassifierKind,
    params: dict[str, float],
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    row: Tensor,
    grad: bool,
) -> tuple[tuple[Tensor, ...], Tensor, Tensor, Tensor | None]:
    """(leaves, target logits, target cosines, cosines to each sub-center) of every sample against its
    class row ``row``.

    The leaves are (embeddings, class rows[, biases]), differentiable if ``grad``; normalised kinds
    take the kind's margin (``params``: the target logit's) on the unit rows, with sub-centers (a
    ``rows × k × D`` weight) on the sub-center nearest the sample (the max's gradient: that one alone
    gets it; the last value is then the ``N × k`` cosines, else None); ``softmax_ce`` is ``x·w + b``.
    Unowned samples get a value that the caller masks.
    """
    xt = x.detach()
    wt = weight.index_select(0, row).to(x.dtype)
    leaves: tuple[Tensor, ...] = (xt, wt) if bias is None else (xt, wt, bias.index_select(0, row).to(x.dtype))
    if grad:
        leaves = tuple(t.detach().requires_grad_(True) for t in leaves)
    with torch.set_grad_enabled(grad):
        if spec.normalized:
            sub_cos = None
            if wt.dim() == 3:  # sub-centers: the nearest one
                w_all = F.normalize(leaves[1], dim=2, eps=NORM_EPS)
                sub_cos = torch.einsum("nd,nkd->nk", leaves[0], w_all).detach()
                best = sub_cos.argmax(1)
                wt_hat = w_all.gather(1, best[:, None, None].expand(-1, 1, w_all.shape[2])).squeeze(1)
            else:
                wt_hat = F.normalize(leaves[1], dim=1, eps=NORM_EPS)
            zt = spec.target_logit(leaves[0], wt_hat, **params)
            return leaves, zt, pair_cos(leaves[0], wt_hat).detach(), sub_cos
        zt = (leaves[0] * leaves[1]).sum(1) + leaves[2]
        return leaves, zt, torch.zeros_like(zt).detach(), None


class SoftmaxStats(NamedTuple):
    """A call's statistics, 0-d float64 device tensors, the same on every worker: the loss; the share of the
    global batch whose target logit is the largest (``accuracy``); the mean target logit and target cosine
    (0 for ``softmax_ce``); the active classes of all shards; the share of the batch beyond the drop angle
    (0 without dropping)."""

    loss: Tensor
    accuracy: Tensor
    target_logit: Tensor
    target_cos: Tensor
    active_classes: Tensor
    beyond_drop_angle: Tensor


class SubcenterHits(NamedTuple):
    """Which sub-center each sample of the global batch was nearest to, for the caller's counts:
    ``counts[rows, subcenters] += owned`` (``rows`` clamped local rows, ``owned`` 1.0 where this shard
    holds the sample's class, else 0.0; float64 like the counts)."""

    rows: Tensor
    subcenters: Tensor
    owned: Tensor


class SoftmaxResult(NamedTuple):
    """What one call of :func:`sharded_softmax` returns: ``loss`` (differentiable, the embeddings' dtype),
    its :class:`SoftmaxStats`, ``logits_kept`` (the torch path kept the logits for backward) and, for a
    call that counts sub-centers (:attr:`SoftmaxPlan.count_subcenters`), its :class:`SubcenterHits`."""

    loss: Tensor
    stats: SoftmaxStats
    logits_kept: bool
    hits: SubcenterHits | None


@dataclass(frozen=True)
class DropPlan:
    """Sample dropping in a call: ``counts`` (local rows × k, read only: how often each class's samples
    were nearest to each sub-center, from before this call), ``cos`` (the cosine of the drop angle),
    ``dropping`` (the samples beyond it leave the loss; else they are only counted)."""

    counts: Tensor
    cos: float
    dropping: bool


@dataclass(frozen=True)
class SoftmaxPlan:
    """Everything one call of :func:`sharded_softmax` takes besides its tensors, fixed for the call.

    The kind (``spec``, the target logit's ``margin_params``, the logit ``scale``, ``subcenters``, label
    ``smoothing``); the shard (``class_start``: the global id of its first row; ``group``: the classes'
    process group); this step's draw (``active``, None: every row); the backend (``fused``, the products'
    ``precision``, ``deterministic``, the torch path's ``logits_budget`` in bytes); sample dropping
    (``drop``, None: none); ``count_subcenters`` (return :class:`SubcenterHits`: a training call);
    ``need_grad`` (a backward will follow: the fused path keeps its row copies for it).

    Buffers are the caller's, lent for the call: ``workspace`` (scratch, within the forward and within the
    backward) and ``kept`` (what the forward keeps for its backward; None: keep nothing). ``lease`` is held
    by the call until its backward has run (or its graph is freed): while it lives, ``kept`` is not the
    caller's to lend again (:meth:`ShardedClassifier._claim_kept` watches it through a weak reference).

    ``row_grads``: where backward hands the active rows' gradients over to the row-sparse optimizer
    (:class:`~dmltrain.distributed.row_sparse.RowGrads`, writing ``.grad`` directly); None: they are
    returned through autograd as dense gradients of ``weight`` and ``bias``. See :func:`sharded_softmax`.
    """

    spec: ClassifierKind
    margin_params: Mapping[str, float]
    scale: float
    subcenters: int
    smoothing: float
    class_start: int
    group: Any
    active: ActiveRows | None
    fused: bool
    precision: str
    deterministic: bool
    logits_budget: float
    workspace: Workspace
    kept: Workspace | None
    lease: object | None = None
    row_grads: RowGrads | None = None
    drop: DropPlan | None = None
    count_subcenters: bool = False
    need_grad: bool = True


class _Combined(NamedTuple):
    loss: Tensor
    lse: Tensor  # the global log-sum-exp per sample
    on: Tensor | float  # label smoothing's weight of the target class
    off: Tensor | None  # ... and of each other class (None: no smoothing)
    stats: SoftmaxStats
    weight: Tensor | None  # each sample's weight, N/kept for kept samples and 0 for dropped (None: none dropped)


def _combine(
    lse_local: Tensor,
    m: Tensor,
    sz: Tensor,
    z_t: Tensor,
    cos_t: Tensor,
    k_local: Tensor,
    eps: float,
    group: Any,
    drop: Tensor | None = None,
    apply_drop: bool = True,
) -> _Combined:
    """The loss over every shard from this shard's per-sample statistics (one all-gather).

    ``lse_local``, ``m``, ``sz``: log-sum-exp, max and sum of this shard's logits per sample, targets
    included; ``z_t``, ``cos_t``: target logits and cosines, zero where this shard does not hold the
    class; ``k_local``: this shard's active columns (a 0-d tensor); ``drop``: 1 for a sample this shard
    finds beyond the drop angle (its class is here), else 0 (None: no sample is). With ``apply_drop`` those
    are dropped: the loss is then the mean over the kept samples; else they are only counted.
    """
    N = lse_local.shape[0]
    rows = [lse_local, m, sz, z_t, cos_t] + ([] if drop is None else [drop.to(lse_local.dtype)])
    packed = torch.cat([torch.stack(rows).double().flatten(), k_local.double().view(1)])
    allp = all_gather_stack(packed, group)
    parts = allp[:, :-1].view(allp.shape[0], len(rows), N)
    lse = torch.logsumexp(parts[:, 0], 0)
    zmax = parts[:, 1].amax(0)
    sum_z, tgt, cos_tgt = parts[:, 2].sum(0), parts[:, 3].sum(0), parts[:, 4].sum(0)
    k_total = allp[:, -1].sum()
    on: Tensor | float = 1.0
    off = None
    if eps:  # the smoothed target distribution over the K active classes of all shards; (1, 0) for K < 2
        smooth = (k_total >= 2).double() * eps
        on, off = 1.0 - smooth, smooth / (k_total - 1).clamp_min(1.0)
        per = lse - on * tgt - off * (sum_z - tgt)
    else:
        per = lse - tgt
    weight = None
    dropped = torch.zeros((), dtype=torch.float64, device=lse.device)
    if drop is None:
        loss = per.mean()
    else:
        keep = 1.0 - parts[:, 5].sum(0)
        kept = keep.sum()
        dropped = 1.0 - kept / max(N, 1)
        if apply_drop:
            weight = keep * (N / kept.clamp_min(1.0))
            loss = (per * weight).mean()
        else:
            loss = per.mean()
    stats = SoftmaxStats(
        loss=loss.clone(),  # its own tensor: the call returns the loss and its statistics as two outputs
        accuracy=(tgt >= zmax).double().mean(),
        target_logit=tgt.mean(),
        target_cos=cos_tgt.mean(),
        active_classes=k_total,
        beyond_drop_angle=dropped,
    )
    return _Combined(loss, lse, on, off, stats, weight)


def _beyond(drop: DropPlan | None, sub_cos: Tensor | None, row: Tensor, owned: Tensor) -> Tensor | None:
    """The samples of the global batch this shard finds beyond the drop angle of their class's dominant
    sub-center (the one its samples were nearest to most often, in ``drop.counts``); None without dropping.

    ``sub_cos``: each sample's cosines to its class's sub-centers (None on a shard without classes: an empty
    mask, for every shard packs as many numbers for :func:`_combine`'s all-gather). A class none of whose
    samples was counted yet has no dominant sub-center: nothing of it is beyond."""
    if drop is None:
        return None
    if sub_cos is None:
        return torch.zeros_like(owned)
    seen = drop.counts.index_select(0, row)
    dominant = seen.argmax(1)
    return owned & (seen.sum(1) > 0) & (sub_cos.gather(1, dominant[:, None]).squeeze(1) < drop.cos)


def _flat(result: SoftmaxResult) -> tuple:
    """``result`` as the flat tuple an autograd Function returns (its fields in order, nested ones spread)."""
    hits = result.hits if result.hits is not None else SubcenterHits(None, None, None)
    return (result.loss, *result.stats, result.logits_kept, *hits)


def _unflat(flat: Sequence) -> SoftmaxResult:
    """The inverse of :func:`_flat`."""
    n = len(SoftmaxStats._fields)
    stats = SoftmaxStats(*flat[1 : 1 + n])
    hits = SubcenterHits(*flat[2 + n :])
    return SoftmaxResult(flat[0], stats, bool(flat[1 + n]), None if hits.rows is None else hits)


def sharded_softmax(x: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, plan: SoftmaxPlan) -> SoftmaxResult:
    """Steps 3 to 6 of one call (the module docstring) as a function: the loss of the gathered batch ``x``
    (``N × D`` in the compute dtype, unit rows for the normalised kinds) with global class ids ``labels``
    against this shard's ``weight``/``bias``, and its statistics.

    Pure but for one deliberate exception: it reads only its arguments, changes none of them and no state
    of any module; the caller applies what it returns (statistics, sub-center counts). Its buffers are the
    ones the plan lends. The exception is the row gradients' hand-off: with ``plan.row_grads`` set, backward
    writes the active rows' gradients into the row-sparse optimizer's buffers (the parameters' ``.grad``,
    accumulating like Megatron's fused gradient accumulation) and returns None for ``weight`` and ``bias``.
    Autograd would need a dense ``C_local × D`` gradient per call, zeroed and written in full (and summed
    into ``.grad`` in full), when a subsampled step touches ``sample_ratio`` of its rows: at a million
    classes of 512 floats that is 2 GiB written per step for the ~10 % of rows that hold a gradient, and
    the optimizer would then have to find those rows again. With ``plan.row_grads`` None (a caller without
    a row-sparse optimizer, ``torch.autograd.grad`` over the weight) that dense gradient is what backward
    returns. The embeddings' gradient always returns through autograd.
    """
    return _unflat(_ShardedSoftmax.apply(x, weight, bias, labels, plan))


class _ShardedSoftmax(torch.autograd.Function):
    """:func:`sharded_softmax`'s autograd node; autocast is off inside (the plan chooses the precision)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, plan: SoftmaxPlan):
        active = plan.active
        with torch.autocast(device_type=x.device.type, enabled=False):
            n_local = weight.shape[0]
            tcol, row, owned = _targets(labels, plan.class_start, n_local, active)
            rows, count, offsets = (None, None, None) if active is None else (active.rows, active.count, active.offsets)
            op = ShardOperands(
                x=x.detach(),
                weight=weight.detach(),
                bias=None if bias is None else bias.detach(),
                rows=rows,
                count=count,
                tcol=tcol,
                scale=plan.scale,
                normalized=plan.spec.normalized,
                subcenters=plan.subcenters,
                offsets=offsets,
            )
            eps = plan.smoothing
            if plan.fused:
                lse_nt, mx, sz, saved = softmax_kernels.partials(
                    op, bool(eps), plan.precision, plan.deterministic,
                    keep_copies=plan.need_grad and any(ctx.needs_input_grad[:3]),  # not under no_grad
                )  # fmt: skip
                lse_nt, mx = lse_nt.to(x.dtype), mx.to(x.dtype)
                sz = None if sz is None else sz.to(x.dtype)
            else:
                lse_nt, mx, sz, saved = softmax_torch.partials(
                    op, bool(eps), plan.workspace, plan.kept, plan.logits_budget
                )
            if sz is None:
                sz = torch.zeros_like(lse_nt)
            sub_cos = None
            if n_local:
                _, z_t, cos_t, sub_cos = _target_pairs(
                    plan.spec, plan.margin_params, op.x, op.weight, op.bias, row, grad=False
                )
            else:
                z_t = cos_t = torch.zeros_like(lse_nt)
            z_own = torch.where(owned, z_t, -math.inf)
            lse_local = torch.logaddexp(lse_nt, z_own)
            m = torch.maximum(mx, z_own)
            z_t, cos_t = torch.where(owned, z_t, 0.0), torch.where(owned, cos_t, 0.0)
            if active is None or active.count is None:
                k_local = torch.full((), float(n_local if active is None else active.capacity), device=x.device)
            else:
                k_local = active.count
            drop = plan.drop
            beyond = _beyond(drop, sub_cos, row, owned)
            out = _combine(
                lse_local, m, sz + z_t, z_t, cos_t, k_local, eps, plan.group, beyond, drop is not None and drop.dropping
            )
            hits = None
            if plan.count_subcenters and drop is not None and sub_cos is not None:
                hits = SubcenterHits(row, sub_cos.argmax(1), owned.to(drop.counts.dtype))
        if out.weight is not None:
            op = op._replace(sample_weight=out.weight.to(x.dtype))
        ctx.plan, ctx.op, ctx.saved = plan, op, saved
        # not the loss: an output kept on ctx (the same tensor in float64) would tie the graph in a cycle
        ctx.row, ctx.owned, ctx.z_t, ctx.out = row, owned, z_t, out._replace(loss=None, stats=None)
        result = SoftmaxResult(out.loss.to(x.dtype), out.stats, getattr(saved, "kept", None) is not None, hits)
        ctx.mark_non_differentiable(*result.stats, *(() if hits is None else hits))
        return _flat(result)

    @staticmethod
    def backward(ctx, grad_out: Tensor, *_):
        plan, op, out = ctx.plan, ctx.op, ctx.out
        if op is None:
            raise RuntimeError("ShardedClassifier: backward through the same call twice is not supported")
        x = op.x
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            alpha = grad_out.to(x.dtype) / x.shape[0]  # dL/dloss · 1/N: the factor of every per-sample gradient
            lse = out.lse.to(x.dtype)
            off = None if out.off is None else out.off.to(x.dtype)
            need_x, need_w, need_b = ctx.needs_input_grad[:3]
            target = None
            if need_w or need_b:
                rows = RowSet(op.rows, op.count)
                if plan.row_grads is not None:  # the hand-off (sharded_softmax's docstring)
                    target = plan.row_grads.target(rows)
                else:
                    target = dense_target(rows, op.weight if need_w else None, op.bias if need_b else None)
            if plan.fused:
                grad_x = softmax_kernels.gradients(
                    op, ctx.saved, lse, alpha, off, need_x, target, plan.precision, plan.deterministic
                )
            else:
                grad_x = softmax_torch.gradients(op, ctx.saved, lse, alpha, off, need_x, target, plan.workspace)
            if op.weight.shape[0]:  # the targets: dL/d(target logit) through their pairs
                on = out.on if isinstance(out.on, float) else out.on.to(x.dtype)
                g_t = torch.where(ctx.owned, (torch.exp(ctx.z_t - lse) - on) * alpha, 0.0)
                if op.sample_weight is not None:
                    g_t = g_t * op.sample_weight
                leaves, zt, _, _ = _target_pairs(
                    plan.spec, plan.margin_params, x, op.weight, op.bias, ctx.row, grad=True
                )
                # a scalar's gradient: no grad_outputs, whose check would import torch.fx (seconds, once a process)
                with torch.enable_grad():
                    grads = torch.autograd.grad((zt * g_t.to(zt.dtype)).sum(), leaves)
                if need_x:
                    grad_x = grads[0] if grad_x is None else grad_x.add_(grads[0])
                if target is not None:
                    if target.weight is not None:
                        add_rows(target.weight, ctx.row, grads[1])
                    if target.bias is not None:
                        add_rows(target.bias, ctx.row, grads[2])
            elif need_x and grad_x is None:
                grad_x = torch.zeros_like(x)
            if target is not None:
                target.finish()
        # the call is over: dropping the plan ends its lease of the kept buffers
        ctx.plan = ctx.op = ctx.saved = ctx.out = None
        grad_w = grad_b = None
        if target is not None and target.grads is None:  # returned through autograd
            grad_w, grad_b = target.weight, target.bias
        return None if grad_x is None else grad_x.to(x.dtype), grad_w, grad_b, None, None


class _KeptLease:
    """Marks the classifier's kept-logits workspace as lent to a call, until that call's plan is dropped."""


# -- the module -------------------------------------------------------------------------------------------
class ShardedClassifier(nn.Module):
    """Class-sharded proxy classifier; see the module docstring for the algorithm.

    Args:
        num_classes: ``C``, global class ids are ``0 … C−1``.
        dim: embedding dimension ``D``.
        kind: ``normsoftmax`` (``temperature``), ``cosface`` (``scale``, ``margin``),
            ``arcface`` (``scale``, ``margin``) or ``softmax_ce`` (``smoothing``; a linear
            layer with bias on unnormalised features, both zero-initialised); the
            hyperparameters, defaults and bounds are :data:`dmltrain.losses.kinds.KINDS`'.
        sample_ratio: share of all classes in each step's softmax, in (0, 1].
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
        deterministic: fused path: the two-kernel backward, bit-identical run to run (the
            default's atomics agree to fp32 rounding only); the torch path always is.
        sampling: the class draw with ``sample_ratio < 1``: ``uniform`` (NormSoftmax's), ``hard``
            (the classes nearest the batch, :mod:`~dmltrain.distributed.class_index`) or ``mixed``
            (``nearest_share`` of the others nearest, the rest uniform) or ``proportional`` (drawn in
            proportion to ``exp(scale × nearness)``, each drawn other's logit corrected by the log of its
            inclusion probability; :mod:`~dmltrain.distributed.class_sampling`).
        nearest_to: ``classes`` (a class is as near as its best cosine to the rows of the batch's
            classes) or ``samples`` (to the batch's embeddings).
        refresh_every: steps between two snapshots of the rows in the nearness index.
        nearest_after: ``hard``, ``mixed`` and ``proportional`` draw uniformly (as ``sampling: uniform``,
            ``sampling_correction`` included) before this step, and build the index at it: a schedule
            that lets the rows spread before the nearest classes are drawn (0: from the first step).
        sampling_correction: the log-Q correction of the uniformly drawn classes' logits (``proportional``
            always corrects its draw).
        drop_after, drop_angle: with sub-centers (``params.subcenters`` k > 1), from step ``drop_after``
            on, a sample whose angle to its class's dominant sub-center (the one the class's samples
            were nearest to most often, counted from the start) exceeds ``drop_angle`` degrees is left
            out of the loss (sub-center ArcFace's noisy-label recipe); None: no sample is dropped.

    Sub-centers (``params.subcenters`` k > 1, normalised kinds): the weight is ``rows × k × D``, a
    class's logit its best sub-center's; saved and resharded by class id with its k rows. Sub-centers
    and the log-Q correction run the torch backend on every device (the fused kernels take one row
    per class and no per-column offset): on CUDA the block GEMMs of :mod:`softmax_torch`, still
    without a host sync.

    Attributes: ``weight`` (local rows × D), ``bias`` (softmax_ce), ``class_start``/``class_end``
    (global ids of the local rows), ``row_grads`` (the rows' gradients, for the optimizer),
    ``active_rows`` of the last call and ``stats``: ``loss``, ``accuracy`` (target logit is the
    largest), ``target_logit`` and ``target_cos`` (means over the global batch), ``active_rows``
    (this shard), ``active_classes`` and ``active_share`` (all shards), ``logits_kept`` (1 when
    backward reuses the logits): a :class:`CallStats`, on the device until read.

    The parameters are model-parallel: keep them out of DeepSpeed's data-parallel engine and
    step them with a row-sparse optimizer over :attr:`row_grads`
    (:class:`~dmltrain.distributed.classifier_head.ClassifierHead` does both). ``.grad`` is this
    shard's exact gradient (not an average); it lives in a buffer reused across steps, so copy it
    if you need it after the next backward.
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
        deterministic: bool = False,
        sampling: str = "uniform",
        nearest_to: str = "classes",
        nearest_share: float = 0.5,
        refresh_every: int = 100,
        nearest_after: int = 0,
        sampling_correction: bool = False,
        drop_after: int | None = None,
        drop_angle: float = 75.0,
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
        for name, value, choices in (
            ("precision", precision, PRODUCT_PRECISIONS),
            ("weight_storage", weight_storage, WEIGHT_STORAGES),
            ("backend", backend, BACKENDS),
        ):
            if value not in choices:
                raise ValueError(f"ShardedClassifier: {name} must be one of {', '.join(choices)}, got {value!r}")
        if sampling not in SAMPLING_MODES:
            raise ValueError(
                f"ShardedClassifier: sampling must be one of {', '.join(SAMPLING_MODES)}, got {sampling!r}"
            )
        if nearest_to not in NEAREST_TO:
            raise ValueError(
                f"ShardedClassifier: nearest_to must be one of {', '.join(NEAREST_TO)}, got {nearest_to!r}"
            )
        if not 0.0 <= nearest_share <= 1.0:
            raise ValueError(f"ShardedClassifier: nearest_share must be in [0, 1], got {nearest_share}")
        if refresh_every < 1:
            raise ValueError(f"ShardedClassifier: refresh_every must be at least 1, got {refresh_every}")
        if nearest_after < 0:
            raise ValueError(f"ShardedClassifier: nearest_after must be at least 0, got {nearest_after}")
        if not 0.0 < drop_angle < 180.0:
            raise ValueError(f"ShardedClassifier: drop_angle must be in (0, 180) degrees, got {drop_angle}")
        self.subcenters = self.spec.subcenters(self.params)
        self.margin_params = self.spec.logit_params(self.params)
        if drop_after is not None and self.subcenters < 2:
            raise ValueError(
                "ShardedClassifier: drop_after drops samples far from their dominant sub-center; "
                "it needs params.subcenters >= 2"
            )
        self.sampling, self.refresh_every, self.nearest_after = sampling, int(refresh_every), int(nearest_after)
        self.nearest_share = 1.0 if sampling == "hard" else float(nearest_share)
        self.nearest_to = nearest_to
        self.sampling_correction = bool(sampling_correction)
        self.drop_after = None if drop_after is None else int(drop_after)
        self.drop_cos = math.cos(math.radians(drop_angle))
        self.index: ClassIndex | None = None  # the nearness index (hard and mixed sampling)
        self.num_classes, self.dim, self.kind = int(num_classes), int(dim), kind
        self.sample_ratio, self.seed = float(sample_ratio), int(seed)
        if init_std is not None and not init_std > 0:
            raise ValueError(f"ShardedClassifier: init_std must be positive, got {init_std}")
        self.init_std = None if init_std is None else float(init_std)
        self.logits_budget_mb = float(logits_budget_mb)
        self.precision, self.backend, self.deterministic = precision, backend, bool(deterministic)
        self.scale = float(self.spec.logit_scale(self.params))
        self.smoothing = float(self.params.get("smoothing", 0.0))
        self.group = group
        self.rank, self.world_size = group_rank_size(group)
        self.partition = ClassPartition(self.num_classes, self.world_size)
        self.class_start, self.class_end = self.partition.start(self.rank), self.partition.end(self.rank)
        n_local = self.class_end - self.class_start
        if self.torch_only and weight_storage != "fp32":
            raise ValueError(
                f"ShardedClassifier: weight_storage {weight_storage!r} needs the fused kernels, which take no "
                f"{self.torch_only}; use fp32"
            )
        rows = (n_local, dim) if self.subcenters == 1 else (n_local, self.subcenters, dim)
        self.weight = nn.Parameter(torch.empty(*rows, dtype=STORAGE_DTYPES[weight_storage]))
        # sub-center dropping: how often each class's samples were nearest to each of its sub-centers
        self.register_buffer(
            "subcenter_counts",
            torch.zeros(n_local, self.subcenters, dtype=torch.float64) if self.drop_after is not None else None,
            persistent=False,
        )
        if self.spec.has_bias:
            self.bias = nn.Parameter(torch.zeros(n_local, dtype=self.weight.dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.row_grads = RowGrads({"weight": self.weight, "bias": self.bias})
        self.stats: Mapping[str, float] = {}
        self._active: ActiveRows | None = None
        self._calls = self._step = 0
        self.fused, self.fused_precision = False, "fp32"
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
                gen = torch.Generator().manual_seed(init_block_seed(self.seed, blk))
                rows = torch.randn(hi - lo, *self.weight.shape[1:], generator=gen).mul_(std)
                self.weight[s - self.class_start : e - self.class_start] = rows[s - lo : e - lo].to(self.weight.device)

    def extra_repr(self) -> str:
        p = ", ".join(f"{k}={v:g}" for k, v in self.params.items())
        return (
            f"kind={self.kind}, classes={self.num_classes} (local {self.class_start}:{self.class_end}), dim={self.dim}, "
            f"sample_ratio={self.sample_ratio:g}, sampling={self.sampling}, precision={self.precision}, "
            f"weight={str(self.weight.dtype)[6:]}, {p}"
        )

    @property
    def torch_only(self) -> str | None:
        """What keeps this classifier on the torch backend (the fused kernels lack it), or None."""
        if self.subcenters > 1:
            return "sub-centers"
        if self.sampling_correction or self.sampling == "proportional":
            return "log-Q correction"
        return None

    # -- the call ---------------------------------------------------------------------------------
    def forward(
        self, embeddings: Tensor, labels: Tensor, step: int | None = None, sizes: Sequence[int] | None = None
    ) -> Tensor:
        """Global-batch mean loss (same on every worker).

        ``step`` (the global optimizer step) keys the class draw with the seed; without it the
        classifier counts its own calls. Labels are global class ids. ``sizes``: every rank's local
        batch size, when the caller knows them (else they are exchanged: one host read at W > 1).
        """
        return self._call(embeddings, labels, step, sizes, self.weight, self.bias, draw="step", train=True)

    def _call(
        self,
        embeddings: Tensor,
        labels: Tensor,
        step: int | None,
        sizes: Sequence[int] | None,
        weight: Tensor,
        bias: Tensor | None,
        draw: str,
        train: bool,
    ) -> Tensor:
        """One call: the classes of ``draw`` (``step``: the step's draw; ``full``: every class; ``uniform``: the
        uniform draw of the same size and step, uncorrected), then the sharded softmax of ``weight``/``bias``
        (the parameters, or detached views of them for a call that must not write their gradient)."""
        if draw not in ("step", "full", "uniform"):
            raise ValueError(f"ShardedClassifier: draw must be step, full or uniform, got {draw!r}")
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"ShardedClassifier: expected embeddings B×{self.dim}, got {tuple(embeddings.shape)}")
        if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"ShardedClassifier: expected {embeddings.shape[0]} labels, got shape {tuple(labels.shape)}"
            )
        self._choose_path()
        if step is None:
            step = self._calls
        self._calls = int(step) + 1
        dev = self.weight.device
        x = embeddings.to(device=dev, dtype=torch.float64 if self.weight.dtype == torch.float64 else torch.float32)
        if sizes is None:
            sizes = all_gather_sizes(x.shape[0], self.group, dev)
        elif len(sizes) != self.world_size or sizes[self.rank] != x.shape[0]:
            raise ValueError(
                f"ShardedClassifier: sizes {list(sizes)} do not match {self.world_size} workers with {x.shape[0]} here"
            )
        labels_g = gather_rows(labels.to(device=dev, dtype=torch.int64), sizes, self.group)
        N = labels_g.numel()
        if N:
            self._check_labels(labels_g)
        if self.spec.normalized:
            x = F.normalize(x, dim=1)
        x_g = gather_with_grad(x, self.group, sizes)
        self._step = int(step)
        active = None if draw == "full" else self.draw(labels_g, int(step), x_g, uniform=draw == "uniform")
        self._active = active
        if N == 0:
            self.stats = {"loss": 0.0, "active_rows": float(self._num_active()), "active_classes": 0.0}
            return x_g.sum() * 0.0
        params = [p for p in (weight, bias) if p is not None]
        need_grad = torch.is_grad_enabled() and (x_g.requires_grad or any(p.requires_grad for p in params))
        plan = self.plan(active, need_grad=need_grad, train=train and need_grad)
        result = sharded_softmax(x_g, weight, bias, labels_g, plan)
        self._take(result)
        return result.loss

    def plan(self, active: ActiveRows | None, need_grad: bool = True, train: bool = False) -> SoftmaxPlan:
        """The :class:`SoftmaxPlan` of a call over the draw ``active`` (see :meth:`draw`), lending this module's
        buffers; ``need_grad``: a backward will follow (the torch path keeps its logits for it, the kept buffers
        then leased to the call); ``train``: a training call, which counts the sub-centers its samples are
        nearest to (sample dropping). Reads the module's state, changes none of it but the lease."""
        self._choose_path()
        lease, kept = self._claim_kept() if need_grad and not self.fused else (None, None)
        drop = None
        if self.subcenter_counts is not None:
            if self.subcenter_counts.device != self.weight.device:
                self.subcenter_counts = self.subcenter_counts.to(self.weight.device)
            drop = DropPlan(self.subcenter_counts, self.drop_cos, self._step >= self.drop_after)
        return SoftmaxPlan(
            spec=self.spec,
            margin_params=self.margin_params,
            scale=self.scale,
            subcenters=self.subcenters,
            smoothing=self.smoothing,
            class_start=self.class_start,
            group=self.group,
            active=active,
            fused=self.fused,
            precision=self.fused_precision,
            deterministic=self.deterministic,
            logits_budget=self.logits_budget_mb * 2**20,
            workspace=self.workspace,
            kept=kept,
            lease=lease,
            row_grads=self.row_grads,
            drop=drop,
            count_subcenters=train,
            need_grad=need_grad,
        )

    def _take(self, result: SoftmaxResult) -> None:
        """What a call changes in this module, from what it returned: the sub-center counts of sample dropping
        (a training call's), and :attr:`stats`."""
        if result.hits is not None:
            h = result.hits
            self.subcenter_counts.index_put_((h.rows, h.subcenters), h.owned, accumulate=True)
        s = result.stats
        on_device = {
            "loss": s.loss,
            "accuracy": s.accuracy,
            "target_logit": s.target_logit,
            "active_classes": s.active_classes,
            "active_share": s.active_classes / self.num_classes,
        }
        if self.drop_after is not None:
            dropping = self._step >= self.drop_after
            on_device["beyond_drop_angle"] = s.beyond_drop_angle
            on_device["dropped"] = s.beyond_drop_angle if dropping else torch.zeros_like(s.beyond_drop_angle)
        if self.spec.normalized:
            on_device["target_cos"] = s.target_cos
        rows = self._num_active()
        host = {"logits_kept": float(result.logits_kept)}
        if isinstance(rows, Tensor):
            on_device["active_rows"] = rows
        else:
            host["active_rows"] = float(rows)
        self.stats = CallStats(on_device, host)

    def draw(self, labels_g: Tensor, step: int, x_g: Tensor, uniform: bool = False) -> ActiveRows | None:
        """This shard's rows in step ``step``'s softmax (None: all of them); ``x_g``: the gathered batch;
        ``uniform``: the uniform draw of the same size instead, without log-Q offsets."""
        if round_total(self.num_classes, self.sample_ratio) >= self.num_classes:
            return None
        nearest = None
        if uniform:
            return draw_active(labels_g, self.partition, self.sample_ratio, self.seed, step, self.group)
        if self._draws_nearest(step):
            index = self.nearness_index(step)
            queries = x_g if self.nearest_to == "samples" else None
            if self.sampling == "proportional":  # in proportion to exp(the logit a class's best cosine makes)
                score = nearest_scores(index, labels_g, self.class_start, self.group, queries)
                return draw_active(
                    labels_g,
                    self.partition,
                    self.sample_ratio,
                    self.seed,
                    step,
                    self.group,
                    weights=score.mul_(self.scale),
                )
            nearest = nearest_keys(index, labels_g, self.class_start, id_bits(self.num_classes), self.group, queries)
        return draw_active(
            labels_g,
            self.partition,
            self.sample_ratio,
            self.seed,
            step,
            self.group,
            nearest,
            self.nearest_share,
            self.sampling_correction,
        )

    def _draws_nearest(self, step: int) -> bool:
        """Whether step ``step`` draws from the nearness index (``hard``, ``mixed``, ``proportional`` from
        ``nearest_after`` on, below ratio 1) rather than uniformly."""
        subsampled = round_total(self.num_classes, self.sample_ratio) < self.num_classes
        return subsampled and self.sampling != "uniform" and step >= self.nearest_after

    def nearness_index(self, step: int) -> ClassIndex:
        """The nearness index of step ``step``: rebuilt from the rows as they are when ``refresh_every``
        steps have passed since the last one was built (or none is held), else the one held."""
        # an index from before nearest_after (a resume that raised it) is not the one built at it
        if self.index is None or self.index.stale(step, self.refresh_every) or self.index.built_at < self.nearest_after:
            self.index = build_index(self.weight, self.subcenters, step)
        return self.index

    # -- the price of subsampling -----------------------------------------------------------------------
    def probe(
        self, embeddings: Tensor, labels: Tensor, step: int, sizes: Sequence[int] | None = None
    ) -> dict[str, Tensor]:
        """What subsampling costs this batch: the full softmax's loss and embedding gradient against the
        sampled one's (the same draw as the step's), computed without writing any gradient or state (but
        the nearness index, which the step's draw would build the same at a refresh).

        Returns 0-d device tensors (no host read): ``grad_cos`` (cosine of the two gradients over the
        whole global batch), ``grad_norm_ratio`` (sampled norm / full norm), ``loss_gap`` (sampled −
        full loss) and ``full_loss``; a draw other than ``uniform`` (below ``sample_ratio`` 1, from
        ``nearest_after`` on) also ``uniform_loss_gap``, the loss gap of the uniform draw of the same size,
        step and batch without correction. For an uncorrected draw of a normalised kind (or ``softmax_ce``
        without smoothing) ``exp(gap)`` is the share of a sample's normaliser the drawn classes hold,
        geometric mean over the batch (its kept samples, once ``drop_after`` drops): the two compare a
        draw with chance on one model.
        Costs one sampled and one full forward and backward of the classifier for the embeddings only
        (no row gradient), and one more sampled forward for ``uniform_loss_gap``. At ``sample_ratio`` 1
        the two are one.
        """
        stats, active, calls = self.stats, self._active, self._calls
        x = embeddings.detach().requires_grad_(True)
        w = self.weight.detach()
        b = None if self.bias is None else self.bias.detach()
        out = []
        with torch.enable_grad():
            for draw in ("step", "full"):
                loss = self._call(x, labels, step, sizes, w, b, draw=draw, train=False)
                (g,) = torch.autograd.grad(loss, x)
                out.append((loss.detach().double(), g.double()))
        (ls, gs), (lf, gf) = out
        extra = {}
        if self._draws_nearest(step):  # else the step's draw is the uniform one
            with torch.no_grad():
                lu = self._call(x, labels, step, sizes, w, b, draw="uniform", train=False)
            extra["uniform_loss_gap"] = lu.double() - lf
        sums = torch.stack([(gs * gf).sum(), (gs * gs).sum(), (gf * gf).sum()])
        all_reduce_sum(sums, self.group)
        self.stats, self._active, self._calls = stats, active, calls
        tiny = torch.finfo(torch.float64).tiny
        return {
            "grad_cos": sums[0] / (sums[1] * sums[2]).sqrt().clamp_min(tiny),
            "grad_norm_ratio": (sums[1] / sums[2].clamp_min(tiny)).sqrt(),
            "loss_gap": ls - lf,
            "full_loss": lf,
            **extra,
        }

    def _check_labels(self, labels: Tensor) -> None:
        lo, hi = torch.aminmax(labels)
        msg = f"ShardedClassifier: labels must be in [0, {self.num_classes})"
        try:  # no host read: on CUDA a bad label fails at a later kernel, not here
            torch._assert_async((lo >= 0) & (hi < self.num_classes), msg)
        except RuntimeError:  # on the CPU the assertion is checked at once
            raise ValueError(f"{msg}, got [{int(lo)}, {int(hi)}]") from None

    def _choose_path(self) -> None:
        """The backend and product precision for the weight as it is now; one clear line when the
        combination cannot run."""
        dev, dt = self.weight.device, self.weight.dtype
        fused = self.backend == "triton" or (self.backend == "auto" and dev.type == "cuda" and dt != torch.float64)
        fused = fused and self.torch_only is None  # sub-centers, the correction: the torch backend (class doc)
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
            self.fused, self.fused_precision = True, precision
            return
        if gpu_only("loss.classifier.precision", self.precision):
            raise ValueError(
                f"ShardedClassifier: precision {self.precision!r} needs the fused CUDA kernels; the torch path "
                f"(weight on {dev.type}) computes in fp32, use precision 'auto' or 'fp32'"
            )
        if dt == torch.bfloat16:
            raise ValueError("ShardedClassifier: a bf16 weight (weight_storage 'bf16') needs the fused CUDA kernels")
        self.fused, self.fused_precision = False, "fp32"

    def _num_active(self) -> int | Tensor:
        if self._active is None:
            return self.num_local
        return self._active.capacity if self._active.count is None else self._active.count

    # -- buffers kept from forward to backward (torch path) ---------------------------------------------
    def _claim_kept(self) -> tuple[_KeptLease, Workspace]:
        """A lease and the kept-buffers it lends: the reused ones, or private ones while an earlier call still
        holds them (forward, forward, backward, backward must stay correct). The lease lives in the call's
        plan; a call drops it when its backward ends (or its graph is freed), and the buffers are free again."""
        lease = _KeptLease()
        holder = None if self._kept_owner is None else self._kept_owner()
        if holder is not None:
            return lease, Workspace()
        self._kept_owner = weakref.ref(lease)
        return lease, self._kept

    def release_buffers(self) -> None:
        """Free the reusable scratch and kept buffers (they are rebuilt on the next call)."""
        self.workspace.clear()
        self._kept.clear()
        self._kept_owner = None

    # -- the last call ------------------------------------------------------------------------------------
    @property
    def last_step(self) -> int:
        """The step of the last call (its draw's key; 0 before any)."""
        return self._step

    @property
    def active_rows(self) -> Tensor:
        """Local row indices that took part in the last call (sorted; reads the drawn count when there is one)."""
        if self._active is None:
            return torch.arange(self.num_local, device=self.weight.device)
        rows = self._active.rows
        return rows if self._active.count is None else rows[: int(self._active.count)]

    @property
    def active_class_ids(self) -> Tensor:
        """Global class ids of :attr:`active_rows`."""
        return self.active_rows + self.class_start

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.row_grads.cleared()

    # -- per-class state beside the rows (saved and resharded with them) ---------------------------------
    def class_state(self) -> tuple[dict[str, Tensor], dict[str, int]]:
        """This shard's per-class tensors besides the rows (first dimension: its classes) and their scalars:
        the nearness index (``index.codes``, ``index.scales``; ``index.built_at``) and the sub-center counts
        of sample dropping (``subcenter_counts``); empty when there is none."""
        tensors: dict[str, Tensor] = {}
        scalars: dict[str, int] = {}
        if self.index is not None:
            tensors["index.codes"], tensors["index.scales"] = self.index.codes, self.index.scales
            scalars["index.built_at"] = self.index.built_at
        if self.subcenter_counts is not None:
            tensors["subcenter_counts"] = self.subcenter_counts
        return tensors, scalars

    def load_class_state(self, tensors: Mapping[str, Tensor], scalars: Mapping[str, int]) -> None:
        """This shard's rows of a :meth:`class_state` (sliced to its classes); names it does not use are ignored."""
        dev = self.weight.device
        if self.sampling != "uniform" and "index.codes" in tensors:
            codes, scales = tensors["index.codes"].to(dev), tensors["index.scales"].to(dev)
            self.index = ClassIndex(codes, scales, int(scalars["index.built_at"]))
        if self.subcenter_counts is not None and "subcenter_counts" in tensors:
            self.subcenter_counts = tensors["subcenter_counts"].to(device=dev, dtype=torch.float64)

    # -- the whole weight ------------------------------------------------------------------------------
    def full_weight(self) -> Tensor:
        """The whole ``C × D`` (``C × k × D``) weight on every worker (an all-gather: mind the memory for large C)."""
        return self.gather_rows_all(self.weight.detach())

    def full_bias(self) -> Tensor | None:
        return None if self.bias is None else self.gather_rows_all(self.bias.detach())

    def gather_rows_all(self, t: Tensor) -> Tensor:
        """Every worker's rows of a per-class tensor (``C_local × …``), concatenated in class order."""
        sizes = [e - s for s, e in self.partition.bounds()]
        return gather_rows(t.contiguous(), sizes, self.group).clone()

    @torch.no_grad()
    def load_full_weight(self, weight: Tensor, bias: Tensor | None = None) -> None:
        """Keep this worker's rows of a whole ``C × D`` weight (and ``C`` bias)."""
        want = (self.num_classes, *self.weight.shape[1:])
        if tuple(weight.shape) != want:
            raise ValueError(
                f"load_full_weight: expected a {'×'.join(map(str, want))} weight, got {tuple(weight.shape)}"
            )
        self.weight.copy_(weight[self.class_start : self.class_end])
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"load_full_weight: {self.kind} has no bias")
            self.bias.copy_(bias[self.class_start : self.class_end])
