"""World-size-independent state of the data-parallel model: full fp32 weights and per-parameter optimizer state.

DeepSpeed's own engine checkpoint is exact but tied to the data-parallel world size once
ZeRO partitions the optimizer (stage >= 1), and its universal-checkpoint converter only
knows Adam's state. So beside the engine checkpoint we keep every parameter's fp32 master
weight and optimizer state (SGD momentum, Adam moments and step) keyed by parameter name;
a run resumed at another world size rebuilds its partitions from them, at every ZeRO stage:
ZeRO 1-2 through the fragments DeepSpeed links to each parameter, ZeRO-3 through its
partitioned parameters (``safe_get/set_full_*`` gather and scatter both kinds; ZeRO-3's working
copy of each parameter is written through ``GatheredParameters``).

Both functions are collectives under ZeRO (every rank must call them).
"""

from __future__ import annotations

from typing import Any

import torch

from dmltrain.training.engine import import_deepspeed


def _zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else 0


def _uses_hp_mapping(engine) -> bool:
    """True when DeepSpeed keeps flat fp32 partitions linked to the module's params (ZeRO 1/2, bf16 optimizer).

    Every rank has the ``_hp_mapping`` attribute on every trainable parameter; it is None
    where the rank holds no fragment of that parameter.
    """
    return any(hasattr(p, "_hp_mapping") for p in engine.module.parameters())


def _flat_partitions(engine) -> list[torch.Tensor]:
    """The flat fp32 partitions the base optimizer keeps its state for. ZeRO-3 lists them in its param groups
    only while it steps, so they are read from the ZeRO-3 optimizer itself."""
    if _zero_stage(engine) >= 3:
        return list(engine.optimizer.fp32_partitioned_groups_flat)
    return [q for g in _base_optimizer(engine).param_groups for q in g["params"]]


def _flat_state_keys(engine) -> list[str]:
    """Optimizer-state keys of the flat partitions: the same on every rank, unlike per-fragment keys."""
    base = _base_optimizer(engine)
    keys: set[str] = set()
    for q in _flat_partitions(engine):
        keys |= {k for k, v in base.state.get(q, {}).items() if torch.is_tensor(v) and v.shape == q.shape}
    return sorted(keys)


def _fresh_state(like: torch.Tensor, keys: list[str], scalars: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state for ``like`` with zero tensors under ``keys`` and ``scalars`` (Adam's step) set."""
    st: dict[str, Any] = {k: torch.zeros_like(like) for k in keys}
    for k, v in scalars.items():
        st[k] = torch.tensor(v, dtype=torch.float32) if isinstance(v, float) else v
    return st


def _relink_optimizer_state(engine) -> None:
    # DeepSpeed links optimizer-state fragments to parameters once, lazily, at the first step;
    # state created afterwards (SGD's momentum appears only after that first step) is not linked.
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _base_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def full_dp_state(engine) -> dict[str, Any]:
    """``{'weights': {name: fp32}, 'optim': {name: {key: tensor}}, 'scalars': {key: value}}`` on every rank
    (``weights``: the trainable parameters' fp32 masters; a frozen one's value is in the module's state dict)."""
    ds_utils = import_deepspeed().utils
    weights: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    base = _base_optimizer(engine)
    if _zero_stage(engine) >= 3:
        keys = _flat_state_keys(engine)
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                continue  # no fp32 master, no optimizer state: its value is the module's
            # each call all-gathers the partitions of every rank: same order on all ranks
            weights[name] = ds_utils.safe_get_full_fp32_param(p).detach().float().cpu().clone()
            optim[name] = {k: ds_utils.safe_get_full_optimizer_state(p, k).detach().float().cpu().clone() for k in keys}
        flat_states = [base.state[q] for q in _flat_partitions(engine) if q in base.state]
    elif _uses_hp_mapping(engine):
        _relink_optimizer_state(engine)
        keys = _flat_state_keys(engine)
        for name, p in engine.module.named_parameters():
            if not hasattr(p, "_hp_mapping"):
                continue  # frozen (requires_grad=False): no optimizer state
            # each call all-reduces the fragments of every rank: same order on all ranks
            weights[name] = ds_utils.safe_get_full_fp32_param(p).detach().float().cpu().clone()
            optim[name] = {k: ds_utils.safe_get_full_optimizer_state(p, k).detach().float().cpu().clone() for k in keys}
        flat_states = [base.state[q] for g in base.param_groups for q in g["params"] if q in base.state]
    else:
        for name, p in engine.module.named_parameters():
            weights[name] = p.detach().float().cpu().clone()
            state = base.state.get(p, {})
            optim[name] = {
                k: v.detach().float().cpu().clone()
                for k, v in state.items()
                if torch.is_tensor(v) and v.shape == p.shape
            }
        flat_states = [base.state[p] for p in engine.module.parameters() if p in base.state]
    if flat_states:  # per-parameter scalars (Adam's step) are equal across parameters: keep one
        scalars = {
            k: (v.item() if torch.is_tensor(v) else v)
            for k, v in flat_states[0].items()
            if not torch.is_tensor(v) or v.numel() == 1
        }
    return {"weights": weights, "optim": optim, "scalars": scalars}


def load_full_dp_state(engine, state: dict[str, Any], module_weights: dict[str, torch.Tensor] | None = None) -> None:
    """Write a :func:`full_dp_state` into a freshly initialised engine of any world size.

    Under ZeRO-3 ``module_weights`` (the full module state dict: frozen parameters and buffers too)
    becomes the partitioned working copy first; the other stages take the module's values from ``state``.
    """
    ds_utils = import_deepspeed().utils
    if _zero_stage(engine) >= 3:
        _load_zero3(engine, state, module_weights or {})
        return
    weights, optim, scalars = state["weights"], state["optim"], state["scalars"]
    base = _base_optimizer(engine)
    keys = sorted({k for per in optim.values() for k in per})

    def fresh_state(like: torch.Tensor) -> dict[str, Any]:
        return _fresh_state(like, keys, scalars)

    named = dict(engine.module.named_parameters())
    missing = sorted(set(named) - set(weights))
    if missing:
        raise KeyError(f"checkpoint lacks parameters {missing[:5]}")
    if _uses_hp_mapping(engine):
        if keys:
            for g in base.param_groups:
                for q in g["params"]:
                    base.state[q] = fresh_state(q)
            _relink_optimizer_state(engine)
        for name, p in named.items():
            if not hasattr(p, "_hp_mapping"):
                continue
            ds_utils.safe_set_full_fp32_param(p, weights[name].to(p.device))
            with torch.no_grad():
                p.copy_(weights[name].to(device=p.device, dtype=p.dtype))  # the low-precision copy the forward uses
            for k, v in optim.get(name, {}).items():
                ds_utils.safe_set_full_optimizer_state(p, v.to(p.device), k)
    else:
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(weights[name].to(device=p.device, dtype=p.dtype))
                if optim.get(name):
                    st = fresh_state(p)
                    st.update({k: v.to(device=p.device, dtype=p.dtype).clone() for k, v in optim[name].items()})
                    base.state[p] = st


def _load_zero3(engine, state: dict[str, Any], module_weights: dict[str, torch.Tensor]) -> None:
    """ZeRO-3: the working copy from ``module_weights`` (gathered, written on rank 0, scattered again), then each
    trainable parameter's fp32 master and optimizer state from ``state``."""
    weights, optim = state["weights"], state["optim"]
    module = engine.module
    named = dict(module.named_parameters())
    missing = sorted(n for n, p in named.items() if p.requires_grad and n not in weights)
    if missing:
        raise KeyError(f"checkpoint lacks parameters {missing[:5]}")
    full = {**module_weights, **weights}
    with import_deepspeed().zero.GatheredParameters(list(named.values()), modifier_rank=0), torch.no_grad():
        for name, p in named.items():
            if name in full:
                p.copy_(full[name].to(device=p.device, dtype=p.dtype))
    keys = sorted({k for per in optim.values() for k in per})
    base = _base_optimizer(engine)
    if keys:  # a new engine's optimizer has no state before its first step: made here, then filled
        for q in _flat_partitions(engine):
            base.state[q] = _fresh_state(q, keys, state["scalars"])
    for name, p in named.items():
        if p.requires_grad:
            _set_zero3_partition(p, weights[name])
            for k, v in optim.get(name, {}).items():
                _set_zero3_partition(p, v, k)
    with torch.no_grad():  # ZeRO-3 partitions parameters only: every rank holds the buffers whole
        for name, buf in module.named_buffers():
            if name in module_weights:
                buf.copy_(module_weights[name].to(device=buf.device, dtype=buf.dtype))


def _set_zero3_partition(param, value: torch.Tensor, key: str | None = None) -> None:
    """This rank's part of ZeRO-3 ``param``'s fp32 master (``key`` None) or optimizer state ``key`` from the full value.

    DeepSpeed's ``safe_set_full_*`` does the same but reads past the end of the value for the last rank when the
    parameter does not split evenly (0.19: it takes whole partitions, padding included); here the padding stays 0.
    """
    opt = param._z3_optimizer
    part, group = opt._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    flat = value.detach().flatten().to(device=part.device, dtype=part.dtype)
    lo = min(part.numel() * opt._get_param_partition_rank(param), flat.numel())
    hi = min(lo + part.numel(), flat.numel())
    with torch.no_grad():
        part.zero_()
        part[: hi - lo].copy_(flat[lo:hi])
    if opt._swappable_optimizer_subgroup(group):
        opt._optimizer_states_and_gradient_swap_out(group)


def full_module_state_dict(engine) -> dict[str, torch.Tensor]:
    """The module's state dict with every floating tensor in fp32 on CPU (a collective under ZeRO-3).

    ZeRO 0-2 keep whole parameters on every rank (in the engine's precision); ZeRO-3
    partitions them, so they are gathered first.
    """
    module = engine.module
    if _zero_stage(engine) >= 3:
        with import_deepspeed().zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {
                k: (v.float() if v.is_floating_point() else v).cpu().clone() for k, v in module.state_dict().items()
            }
    return {k: (v.float() if v.is_floating_point() else v).cpu().clone() for k, v in module.state_dict().items()}
