"""World-size-independent state of the data-parallel model: full fp32 weights and per-parameter optimizer state.

DeepSpeed's own engine checkpoint is exact but tied to the data-parallel world size once
ZeRO partitions the optimizer (stage >= 1), and its universal-checkpoint converter only
knows Adam's state. So beside the engine checkpoint we keep every parameter's fp32 master
weight and optimizer state (SGD momentum, Adam moments and step) keyed by parameter name;
a run resumed at another world size rebuilds its partitions from them.

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


def _flat_state_keys(engine) -> list[str]:
    """Optimizer-state keys of the flat partitions: the same on every rank, unlike per-fragment keys."""
    base = _base_optimizer(engine)
    keys: set[str] = set()
    for g in base.param_groups:
        for q in g["params"]:
            keys |= {k for k, v in base.state.get(q, {}).items() if torch.is_tensor(v) and v.shape == q.shape}
    return sorted(keys)


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
    """``{'weights': {name: fp32}, 'optim': {name: {key: tensor}}, 'scalars': {key: value}}`` on every rank."""
    if _zero_stage(engine) >= 3:
        raise NotImplementedError("portable state of ZeRO-3 engines")
    ds_utils = import_deepspeed().utils
    weights: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, Any] = {}
    base = _base_optimizer(engine)
    if _uses_hp_mapping(engine):
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


def load_full_dp_state(engine, state: dict[str, Any]) -> None:
    """Write a :func:`full_dp_state` into a freshly initialised engine of any world size."""
    if _zero_stage(engine) >= 3:
        raise NotImplementedError("portable state of ZeRO-3 engines")
    ds_utils = import_deepspeed().utils
    weights, optim, scalars = state["weights"], state["optim"], state["scalars"]
    base = _base_optimizer(engine)
    keys = sorted({k for per in optim.values() for k in per})

    def fresh_state(like: torch.Tensor) -> dict[str, Any]:
        st: dict[str, Any] = {k: torch.zeros_like(like) for k in keys}
        for k, v in scalars.items():
            st[k] = torch.tensor(v, dtype=torch.float32) if isinstance(v, float) else v
        return st

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
