"""Row-sparse optimizers for the class-sharded classifier.

Every parameter's first dimension is the shard's class rows (weight ``C_local × D``, bias
``C_local``). Each step updates only the rows that received a gradient this step (the rows
drawn by class subsampling, reported by the classifier); every other row, and its optimizer
state, is left bit-for-bit unchanged: no weight decay, no momentum decay, no Adam moment
decay. When all rows are active the update runs in place on whole blocks of rows; otherwise
it gathers the active rows, updates them and scatters them back, a block at a time, so
temporary memory stays bounded whatever the shard size.

* :class:`RowSparseSGD`: SGD with momentum (optionally Nesterov) and coupled weight decay,
  as ``torch.optim.SGD`` (dampening 0) on the rows that step.
* :class:`RowSparseAdamW`: AdamW with *per-row* step counts: a row's bias correction counts
  the steps in which that row was updated, because its moments hold exactly that many
  gradients (a shared global count would over-correct rows that skip steps, as LazyAdam does).
  A row active at every step follows ``torch.optim.AdamW`` exactly.

With no row source (``rows=None``) they behave as dense optimizers. Optimizer state is
created eagerly (zeros) so that it can be saved by class id before the first step.

A bf16 parameter (the classifier's ``weight_storage="bf16"``) keeps fp32 optimizer state; its
rows are updated in fp32 and written back with stochastic rounding (:func:`round_stochastic`:
unbiased, so updates far below bf16's resolution still move the weight on average, without an
fp32 master copy). The rounding draws from the optimizer's own generator (``seed``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from dmltrain.distributed.workspace import Workspace

#: Elements per block of rows processed at once (bounds temporaries: 16 Mi floats = 64 MiB).
BLOCK_ELEMENTS = 1 << 24

_FUSED_SGD = getattr(torch, "_fused_sgd_", None)
#: parameter dtypes stored in low precision: fp32 state, fp32 update, stochastic rounding back
LOW_PRECISION = (torch.bfloat16,)


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


class RowSource(Protocol):
    """What a row-sparse optimizer asks its classifier each step."""

    def grad_rows(self) -> Tensor | None:
        """Local rows holding a gradient since it was last cleared; None means every row."""

    def grad_cleared(self) -> None:
        """The gradients were cleared (set to None or zeroed)."""


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base class: row-blocked, row-sparse updates over parameters sharing their row count."""

    #: names of the per-row state tensors (same leading dim as the parameter)
    row_state: tuple[str, ...] = ()

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], rows: RowSource | None = None, seed: int = 0
    ) -> None:
        super().__init__(params, defaults)
        self.row_source = rows
        self.seed = int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
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
        _base("load_state_dict")(self, state_dict)

    # -- subclass hooks ---------------------------------------------------------------------------
    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _update(self, group: dict[str, Any], p: Tensor, g: Tensor, state: dict[str, Tensor]) -> None:
        """Update one block of rows in place: ``p``, ``g`` and state values are ``rows × cols``."""
        raise NotImplementedError

    # -- driver -----------------------------------------------------------------------------------
    def _rows(self) -> Tensor | None:
        return None if self.row_source is None else self.row_source.grad_rows()

    def _store(self, p: Tensor, rounded_from: Tensor) -> Tensor:
        """fp32 rows updated for a low-precision parameter, rounded stochastically to its dtype."""
        gen = self._generators.get(p.device)
        if gen is None:
            gen = self._generators[p.device] = torch.Generator(device=p.device).manual_seed(self.seed)
        return round_stochastic(rounded_from, gen)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rows = self._rows()
        if rows is not None and rows.numel() == 0:
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__}: sparse .grad tensors are not supported; gradients are dense row blocks"
                    )
                self._step_param(group, p, rows)
        return loss

    def _step_param(self, group: dict[str, Any], p: Tensor, rows: Tensor | None) -> None:
        n = p.shape[0]
        if n == 0:  # a shard that owns no class
            return
        cols = p[0].numel()
        low = p.dtype in LOW_PRECISION
        pv, gv = p.view(n, cols), p.grad.view(n, cols)
        state = self.state[p]
        sv = {k: state[k].view(n, -1) for k in self.row_state}
        block = max(1, BLOCK_ELEMENTS // max(cols, 1))
        if rows is None:
            for s in range(0, n, block):
                sl = slice(s, min(n, s + block))
                sb = {k: v[sl] for k, v in sv.items()}
                if low:
                    pb = pv[sl].float()
                    self._update(group, pb, gv[sl].float(), sb)
                    pv[sl] = self._store(p, pb)
                else:
                    self._update(group, pv[sl], gv[sl], sb)
            return
        rows = rows.to(p.device)
        ws = self._workspace
        for s in range(0, rows.numel(), block):
            idx = rows[s : s + block]
            n_b = idx.numel()

            def gather(name: str, src: Tensor, idx: Tensor = idx, n_b: int = n_b) -> Tensor:
                return torch.index_select(src, 0, idx, out=ws.get(name, (n_b, src.shape[1]), src.device, src.dtype))

            pb = gather("param", pv)
            gb = gather("grad", gv)
            if low:
                pb, gb = pb.float(), gb.float()
            sb = {k: gather(f"state.{k}", v) for k, v in sv.items()}
            self._update(group, pb, gb, sb)
            pv.index_copy_(0, idx, self._store(p, pb) if low else pb)
            for k, v in sv.items():
                v.index_copy_(0, idx, sb[k])

    def zero_grad(self, set_to_none: bool = True) -> None:
        _base("zero_grad")(self, set_to_none=set_to_none)
        if self.row_source is not None:
            self.row_source.grad_cleared()


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
        rows: RowSource | None = None,
        seed: int = 0,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(
                f"RowSparseSGD: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}"
            )
        if nesterov and momentum <= 0:
            raise ValueError("RowSparseSGD: nesterov needs momentum > 0")
        super().__init__(
            params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay), rows, seed
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
        rows: RowSource | None = None,
        seed: int = 0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"RowSparseAdamW: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), rows, seed)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        st = self.state[p]
        st["exp_avg"] = state_like(p)
        st["exp_avg_sq"] = state_like(p)
        st["step"] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)

    def _step_param(self, group: dict[str, Any], p: Tensor, rows: Tensor | None) -> None:
        st = self.state[p]
        if st["step"].device != p.device:  # torch's load_state_dict leaves "step" where it was saved
            st["step"] = st["step"].to(p.device)
        super()._step_param(group, p, rows)

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


def make_classifier_optimizer(
    clf: Any,
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
    """The classifier's own optimizer (it stays out of DeepSpeed's data-parallel reduction).

    One param group for ``clf.weight`` and, for ``softmax_ce``, one for ``clf.bias`` (its weight
    decay is ``bias_weight_decay``, default ``weight_decay``); each group carries a ``name``.
    Set ``param_groups[i]["lr"]`` from the schedule; call ``step()`` after ``engine.step()``.
    ``seed`` seeds the stochastic rounding of a bf16 weight (give each worker its own).
    """
    groups: list[dict[str, Any]] = [{"params": [clf.weight], "weight_decay": weight_decay, "name": "classifier.weight"}]
    if getattr(clf, "bias", None) is not None:
        bwd = weight_decay if bias_weight_decay is None else bias_weight_decay
        groups.append({"params": [clf.bias], "weight_decay": bwd, "name": "classifier.bias"})
    if name == "sgd":
        return RowSparseSGD(
            groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, rows=clf, seed=seed
        )
    if name == "adamw":
        return RowSparseAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rows=clf, seed=seed)
    raise ValueError(f"classifier optimizer: unknown name {name!r} (choose sgd or adamw)")
