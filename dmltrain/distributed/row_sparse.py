"""Row-sparse gradients of the class-sharded classifier, and the optimizers that step them.

Every parameter's first dimension is the shard's class rows (weight ``C_local × D``, bias
``C_local``). One :class:`RowGrads` object holds their gradients and which rows hold one; the
classifier's backward writes into it (:meth:`RowGrads.target`, then :meth:`RowGradTarget.finish`)
and the optimizer built over the same object (:class:`RowSparseSGD`, :class:`RowSparseAdamW`)
reads from it which rows to step. Nobody else is asked.

Gradients. The buffers are the parameters' ``.grad`` (so the usual readers see them), written
as Megatron's fused gradient accumulation does: overwritten when ``.grad`` was None (a fresh
gradient), added otherwise. A fresh gradient reuses the buffer of the last one and zeroes only
the rows written since, so a subsampled step never touches the ``C_local × D`` gradient in full.

Row sets. A step's rows come as a :class:`RowSet`: ``rows`` (local row ids, None for all) and
``count`` (None, or a 0-d device tensor: only ``rows[:count]`` hold a gradient; the entries after
it are distinct rows that hold none, there so that every size is known on the host and nothing is
read back from the device). Gradients accumulated over several calls keep the union, built on the
device (:meth:`RowGrads.rows`).

Optimizers. Each step updates only the rows holding a gradient; every other row, and its
optimizer state, is left bit-for-bit unchanged: no weight decay, no momentum decay, no Adam
moment decay. With all rows active the update runs in place on whole blocks of rows; otherwise
it gathers the rows, updates them and scatters them back, a block at a time, so temporary memory
stays bounded whatever the shard size (the entries past ``count`` are written back unchanged).

* :class:`RowSparseSGD`: SGD with momentum (optionally Nesterov) and coupled weight decay,
  as ``torch.optim.SGD`` (dampening 0) on the rows that step.
* :class:`RowSparseAdamW`: AdamW with *per-row* step counts: a row's bias correction counts
  the steps in which that row was updated, because its moments hold exactly that many
  gradients (a shared global count would over-correct rows that skip steps, as LazyAdam does).
  A row active at every step follows ``torch.optim.AdamW`` exactly.

Without a :class:`RowGrads` (``grads=None``) they behave as dense optimizers. Optimizer state is
created eagerly (zeros) so that it can be saved by class id before the first step.

A bf16 parameter (the classifier's ``weight_storage="bf16"``) keeps fp32 optimizer state; its
rows are updated in fp32 and written back with stochastic rounding (:func:`round_stochastic`:
unbiased, so updates far below bf16's resolution still move the weight on average, without an
fp32 master copy). The rounding noise of a step is drawn from a generator seeded by (``seed``, the
step, the parameter), so nothing of it is saved: a resumed run (at the same world size) rounds
as the uninterrupted one did, and a resharded one starts streams of its own. ``load_state_dict``
keeps such a parameter's state fp32.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from dmltrain.distributed.class_sampling import draw_seed
from dmltrain.distributed.workspace import BLOCK_ELEMENTS, Workspace

_FUSED_SGD = getattr(torch, "_fused_sgd_", None)
#: parameter dtypes stored in low precision: fp32 state, fp32 update, stochastic rounding back
LOW_PRECISION = (torch.bfloat16,)


class RowSet(NamedTuple):
    """Local rows: ``rows`` (None: every row) of which the first ``count`` (None: all) count."""

    rows: Tensor | None
    count: Tensor | None = None

    def valid(self) -> Tensor | None:
        """Which entries of ``rows`` count (None: all of them); on the device, no host read."""
        if self.rows is None or self.count is None:
            return None
        return torch.arange(self.rows.numel(), device=self.rows.device) < self.count


ALL_ROWS = RowSet(None)


def add_rows(dst: Tensor, rows: Tensor, src: Tensor) -> None:
    """``dst[rows] += src`` with repeated rows summed (index_put_ accumulates an order of magnitude
    faster than index_add_ on the CPU, and in a fixed order on CUDA)."""
    dst.index_put_((rows,), src.to(dst.dtype), accumulate=True)


def _union(a: RowSet, b: RowSet, num_rows: int) -> RowSet:
    """The rows of ``a`` or ``b``, as a row set whose size is known on the host (no sync)."""
    if a.rows is None or b.rows is None:
        return ALL_ROWS
    cap = min(num_rows, a.rows.numel() + b.rows.numel())
    marks = []
    for s in (a, b):  # the rows of one set are distinct: a plain scatter
        v = s.valid()
        m = torch.zeros(num_rows, dtype=torch.bool, device=s.rows.device)
        marks.append(m.index_put_((s.rows,), torch.ones_like(s.rows, dtype=torch.bool) if v is None else v))
    mask = marks[0] | marks[1]
    if cap == num_rows:
        rows = torch.arange(num_rows, device=mask.device)
    else:  # the marked rows first, then unmarked ones: distinct rows, the size known on the host
        rows = torch.topk(mask.to(torch.int8), cap, sorted=True).indices
    first = torch.sort(torch.where(mask[rows], rows, rows + num_rows)).values  # marked rows ascending, then the rest
    return RowSet(torch.where(first >= num_rows, first - num_rows, first), mask.sum())


@dataclass
class RowGradTarget:
    """Where one backward writes its row gradients: ``weight`` / ``bias`` (None when that parameter
    needs none) at ``rows`` (see :class:`RowSet`); ``accumulate``: add to what is there, else
    overwrite (every row of ``rows`` exactly once; the buffers' other rows are zero). ``grads``: the
    :class:`RowGrads` whose buffers these are, or None for fresh dense buffers (:func:`dense_target`)."""

    grads: RowGrads | None
    rows: RowSet
    weight: Tensor | None
    bias: Tensor | None
    accumulate: bool

    def finish(self) -> None:
        """Record the rows written (call after every write of this backward)."""
        if self.grads is not None and (self.weight is not None or self.bias is not None):
            self.grads._written(self.rows)


def dense_target(rows: RowSet, weight: Tensor | None, bias: Tensor | None) -> RowGradTarget:
    """A target of fresh zero buffers shaped like ``weight`` and ``bias`` (None: no gradient), for a backward
    that returns its row gradients through autograd rather than to a :class:`RowGrads`: ``C_local × D``
    written in full, which the row-sparse path avoids."""
    zeros = lambda t: None if t is None else torch.zeros_like(t, memory_format=torch.contiguous_format)  # noqa: E731
    return RowGradTarget(None, rows, zeros(weight), zeros(bias), accumulate=False)


class RowGrads:
    """The gradient buffers of a classifier shard's row parameters and the rows holding a gradient."""

    def __init__(self, params: dict[str, nn.Parameter | None]) -> None:
        self.params = {k: p for k, p in params.items() if p is not None}
        self._bufs: dict[str, Tensor] = {}
        self._dirty: dict[str, RowSet | None] = {}  # rows of a buffer that may be non-zero
        self._touched: RowSet | None = None  # rows holding a gradient since it was last cleared

    def _fresh(self, name: str, p: nn.Parameter, rows: RowSet) -> Tensor:
        """The reused gradient buffer of ``p``, zero outside ``rows`` (and, for a dense write, not zeroed)."""
        buf = self._bufs.get(name)
        dense = rows.rows is None
        if buf is None or buf.shape != p.shape or buf.device != p.device or buf.dtype != p.dtype:
            buf = torch.empty_like(p, memory_format=torch.contiguous_format) if dense else torch.zeros_like(p)
            self._bufs[name] = buf
        elif not dense:
            dirty = self._dirty.get(name)
            if dirty is not None and dirty.rows is None:
                buf.zero_()
            elif dirty is not None and dirty.rows.numel():
                buf.index_fill_(0, dirty.rows, 0)
        self._dirty[name] = None
        return buf

    def target(self, rows: RowSet) -> RowGradTarget:
        """The buffers one backward over ``rows`` writes into (``.grad`` set to them when it was None)."""
        need = {n: p for n, p in self.params.items() if p.requires_grad}
        fresh = {n: p.grad is None for n, p in need.items()}
        for n, p in need.items():
            if fresh[n]:
                p.grad = self._fresh(n, p, rows)
        accumulate = not all(fresh.values())
        if accumulate and rows.rows is None:  # a dense fresh buffer was not zeroed: make it addable
            for n, p in need.items():
                if fresh[n]:
                    p.grad.zero_()
        if any(fresh.values()) and not accumulate:
            self._touched = None  # a new gradient starts: forget the rows of the previous one
        w, b = need.get("weight"), need.get("bias")
        return RowGradTarget(self, rows, None if w is None else w.grad, None if b is None else b.grad, accumulate)

    def _written(self, rows: RowSet) -> None:
        n = next(iter(self.params.values())).shape[0]
        self._touched = rows if self._touched is None else _union(self._touched, rows, n)
        for name, p in self.params.items():
            if p.grad is not None and p.grad is self._bufs.get(name):
                dirty = self._dirty.get(name)
                # every written entry may be non-zero, padding included: zeroing them again is harmless
                self._dirty[name] = RowSet(rows.rows) if dirty is None else _union(dirty, RowSet(rows.rows), n)

    def rows(self) -> RowSet | None:
        """The rows holding a gradient since it was last cleared (None: no gradient)."""
        return self._touched

    def row_ids(self) -> Tensor:
        """The sorted local ids of :meth:`rows` (reads the count from the device: for tests and logs)."""
        rs = self._touched
        if rs is None:
            return torch.zeros(0, dtype=torch.int64)
        if rs.rows is None:
            return torch.arange(next(iter(self.params.values())).shape[0])
        rows = rs.rows if rs.count is None else rs.rows[: int(rs.count)]
        return torch.sort(rows).values

    def cleared(self) -> None:
        """The gradients were set to None or zeroed in place."""
        for name, p in self.params.items():
            if p.grad is not None and p.grad is self._bufs.get(name):
                self._dirty[name] = None  # zeroed in place
        self._touched = None


# -- stochastic rounding ------------------------------------------------------------------------------
def state_like(p: Tensor) -> Tensor:
    """Zero optimizer state for ``p``: fp32 for a low-precision parameter, else ``p``'s dtype."""
    dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)


def round_stochastic(src: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """bf16 of fp32 ``src``, rounded away from zero with probability equal to the discarded
    fraction of the magnitude (so ``E[result] = src``).

    On the bit patterns: adding uniform noise below the 16 kept bits and truncating rounds the
    magnitude up exactly when the noise carries over; the sign bit is untouched.
    """
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    return torch.bitwise_right_shift(bits + noise, 16).to(torch.int16).view(torch.bfloat16)


def _base(name: str) -> Callable[..., Any]:
    """``torch.optim.Optimizer.<name>``, without its dynamo-disabling wrapper while dynamo is not loaded.

    The wrapper exists so that torch.compile does not trace these methods; its first call
    imports ``torch._dynamo`` (seconds of CPU). Without dynamo loaded nothing is being
    compiled, so the plain method is equivalent; once it is loaded we use the wrapper.
    """
    fn = getattr(torch.optim.Optimizer, name)
    if "torch._dynamo" in sys.modules:
        return fn
    return getattr(fn, "__wrapped__", fn)


# -- the optimizers -----------------------------------------------------------------------------------
class RowSparseOptimizer(torch.optim.Optimizer):
    """Base class: row-blocked, row-sparse updates over parameters sharing their row count."""

    #: names of the per-row state tensors (same leading dim as the parameter)
    row_state: tuple[str, ...] = ()

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], grads: RowGrads | None = None, seed: int = 0
    ) -> None:
        super().__init__(params, defaults)
        self.grads = grads
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._steps = 0  # the rounding's step key when step() is given none
        self._workspace = Workspace()  # gathered rows of a block (reused: no page faults per step)
        n_rows = {p.shape[0] for g in self.param_groups for p in g["params"]}
        if len(n_rows) > 1:
            raise ValueError(
                f"{type(self).__name__}: all parameters must have the same number of rows, got {sorted(n_rows)}"
            )
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 0:
                    raise ValueError(f"{type(self).__name__}: parameters need a row dimension, got a scalar")
                self._init_state(p, group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _base("add_param_group")(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _base("state_dict")(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, but a low-precision parameter's floating state stays fp32 (:func:`state_like`): torch casts
        it to the parameter's dtype (losing its precision, and refused by the next step)."""
        _base("load_state_dict")(self, state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if p.dtype not in LOW_PRECISION:
                continue
            for k, v in state_dict["state"].get(i, {}).items():
                if isinstance(v, Tensor) and v.is_floating_point():
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32)

    # -- subclass hooks ---------------------------------------------------------------------------
    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Tensor]) -> None:
        """Update one block of rows in place: ``p``, ``g`` and state values are ``rows × cols``."""
        raise NotImplementedError

    # -- driver -----------------------------------------------------------------------------------
    def _rounding(self, p: Tensor, step: int, index: int) -> torch.Generator | None:
        """The generator of ``p``'s stochastic rounding at ``step`` (``index``: ``p``'s place among the
        parameters), seeded afresh from (seed, step, index); None for a parameter that is not rounded.
        Seeding sets the generator's state on the host: no device sync."""
        if p.dtype not in LOW_PRECISION:
            return None
        gen = self._generators.get(p.device)
        if gen is None:
            gen = self._generators[p.device] = torch.Generator(device=p.device)
        return gen.manual_seed(draw_seed(self.seed, step, index))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, rounding_step: int | None = None) -> Any:
        """Step the rows holding a gradient. ``rounding_step`` keys a low-precision parameter's rounding noise
        with the seed: the training step, so that a resumed run rounds as an uninterrupted one (default:
        this optimizer's count of its calls, which a new optimizer starts again at 0)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = self._steps if rounding_step is None else int(rounding_step)
        self._steps = key + 1
        rows = ALL_ROWS if self.grads is None else self.grads.rows()
        if rows is None or (rows.rows is not None and rows.rows.numel() == 0):
            return loss
        params = [(group, p) for group in self.param_groups for p in group["params"]]
        for index, (group, p) in enumerate(params):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__}: sparse .grad tensors are not supported; gradients are dense row blocks"
                )
            self._step_param(group, p, rows, self._rounding(p, key, index))
        return loss

    def _step_param(self, group: dict[str, Any], p: Tensor, rows: RowSet, gen: torch.Generator | None) -> None:
        """Update ``p``'s rows in ``rows``; ``gen``: the rounding's generator of a low-precision ``p``."""
        n = p.shape[0]
        if n == 0:  # a shard that owns no class
            return
        cols = p[0].numel()
        low = p.dtype in LOW_PRECISION
        pv, gv = p.view(n, cols), p.grad.view(n, cols)
        state = self.state[p]
        sv = {k: state[k].view(n, -1) for k in self.row_state}
        block = max(1, BLOCK_ELEMENTS // max(cols, 1))
        if rows.rows is None:
            for s in range(0, n, block):
                sl = slice(s, min(n, s + block))
                sb = {k: v[sl] for k, v in sv.items()}
                if low:
                    pb = pv[sl].float()
                    self._update(group, pb, gv[sl].float(), sb)
                    pv[sl] = round_stochastic(pb, gen)
                else:
                    self._update(group, pv[sl], gv[sl], sb)
            return
        index = rows.rows.to(p.device)
        valid = rows.valid()
        ws = self._workspace
        for s in range(0, index.numel(), block):
            idx = index[s : s + block]
            n_b = idx.numel()

            def gather(name: str, src: Tensor, idx: Tensor = idx, n_b: int = n_b) -> Tensor:
                return torch.index_select(src, 0, idx, out=ws.get(name, (n_b, src.shape[1]), src.device, src.dtype))

            pb = gather("param", pv)
            gb = gather("grad", gv)
            if low:
                pb, gb = pb.float(), gb.float()
            sb = {k: gather(f"state.{k}", v) for k, v in sv.items()}
            self._update(group, pb, gb, sb)
            new_p = round_stochastic(pb, gen) if low else pb
            if valid is None:
                pv.index_copy_(0, idx, new_p)
                for k, v in sv.items():
                    v.index_copy_(0, idx, sb[k])
                continue
            # the entries past the count are rows holding no gradient: written back as they were
            keep = valid[s : s + block, None]
            pv.index_copy_(0, idx, torch.where(keep, new_p, pv.index_select(0, idx)))
            for k, v in sv.items():
                v.index_copy_(0, idx, torch.where(keep, sb[k], v.index_select(0, idx)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        _base("zero_grad")(self, set_to_none=set_to_none)
        if self.grads is not None:
            self.grads.cleared()


class RowSparseSGD(RowSparseOptimizer):
    """SGD with momentum ``μ`` and coupled weight decay ``λ`` on the rows that step.

    ``buf ← μ·buf + g + λ·w``; ``w ← w − lr·buf`` (Nesterov: ``w ← w − lr·(g + λ·w + μ·buf)``).
    Without momentum: ``w ← w − lr·(g + λ·w)``. State: ``momentum_buffer`` (when μ > 0).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        grads: RowGrads | None = None,
        seed: int = 0,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"RowSparseSGD: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}"
            )
        if nesterov and momentum <= 0:
            raise ValueError("RowSparseSGD: nesterov needs momentum > 0")
        super().__init__(
            params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay), grads, seed
        )

    row_state = ("momentum_buffer",)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        # Created even when momentum is 0 so that the state layout does not depend on a hyperparameter.
        self.state[p]["momentum_buffer"] = state_like(p)

    def _update(self, group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Tensor]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if mu > 0 and _FUSED_SGD is not None and p.is_contiguous() and g.is_contiguous():
            # torch's own fused kernel (what SGD(fused=True) runs): one pass instead of four.
            # Zero-initialised buffers make every step a "not first" step, as torch's first
            # step (buf = g + λw) equals μ·0 + g + λw.
            _FUSED_SGD(
                [p],
                [g],
                [state["momentum_buffer"]],
                weight_decay=wd,
                momentum=mu,
                lr=lr,
                dampening=0.0,
                nesterov=group["nesterov"],
                maximize=False,
                is_first_step=False,
            )
            return
        if mu > 0:
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            if wd:
                buf.add_(p, alpha=wd)
            if group["nesterov"]:
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(g, alpha=-lr).add_(buf, alpha=-lr * mu)
            else:
                p.add_(buf, alpha=-lr)
        else:
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(g, alpha=-lr)


class RowSparseAdamW(RowSparseOptimizer):
    """AdamW (decoupled weight decay) with per-row step counts for bias correction.

    For the rows that step: ``t ← t + 1``, ``w ← w·(1 − lr·λ)``, ``m ← β₁m + (1−β₁)g``,
    ``v ← β₂v + (1−β₂)g²``, ``w ← w − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`` with ``t`` the row's
    own count. State: ``exp_avg``, ``exp_avg_sq``, ``step`` (int64, one per row).
    """

    row_state = ("exp_avg", "exp_avg_sq", "step")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        grads: RowGrads | None = None,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"RowSparseAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), grads, seed)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        st = self.state[p]
        st["exp_avg"] = state_like(p)
        st["exp_avg_sq"] = state_like(p)
        st["step"] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)

    def _step_param(self, group: dict[str, Any], p: Tensor, rows: RowSet, gen: torch.Generator | None) -> None:
        st = self.state[p]
        if st["step"].device != p.device:  # torch's load_state_dict leaves "step" where it was saved
            st["step"] = st["step"].to(p.device)
        super()._step_param(group, p, rows, gen)

    def _update(self, group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Tensor]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        t = state["step"]
        t.add_(1)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if wd:
            p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        tf = t.to(torch.float64)
        bc1 = 1 - torch.pow(beta1, tf)
        bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, tf))
        step_size = (lr / bc1).to(p.dtype)
        denom = torch.sqrt(v, out=self._workspace.get("denom", tuple(v.shape), v.device, v.dtype))
        denom.div_(bc2_sqrt.to(p.dtype)).add_(eps)
        p.sub_(torch.div(m, denom, out=denom).mul_(step_size))


def make_row_optimizer(
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    grads: RowGrads | None,
    name: str = "sgd",
    lr: float = 0.01,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    bias_weight_decay: float | None = None,
    seed: int = 0,
) -> RowSparseOptimizer:
    """A row-sparse optimizer over a shard's ``weight`` (and ``bias``) stepping the rows ``grads`` reports.

    One param group for the weight and, with a bias, one for it (its weight decay is
    ``bias_weight_decay``, default ``weight_decay``); each group carries a ``name``
    (``classifier.weight``, ``classifier.bias``). ``seed`` seeds the stochastic rounding of a bf16 weight
    (with the step: :meth:`RowSparseOptimizer.step`).
    """
    groups: list[dict[str, Any]] = [{"params": [weight], "weight_decay": weight_decay, "name": "classifier.weight"}]
    if bias is not None:
        bwd = weight_decay if bias_weight_decay is None else bias_weight_decay
        groups.append({"params": [bias], "weight_decay": bwd, "name": "classifier.bias"})
    if name == "sgd":
        return RowSparseSGD(
            groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, grads=grads, seed=seed
        )
    if name == "adamw":
        return RowSparseAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, grads=grads, seed=seed)
    raise ValueError(f"classifier optimizer: unknown name {name!r} (choose sgd or adamw)")
