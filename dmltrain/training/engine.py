"""The DeepSpeed engine around backbone + head: its JSON config, its optimizer, its creation.

The class-sharded classifier is deliberately NOT part of the engine: its rows are
model-parallel, so DeepSpeed's data-parallel gradient averaging must never touch them.

channels_last models: DeepSpeed (0.19) needs parameters in the default layout while it
starts (its broadcast views each parameter as bytes, ``p.data.view(torch.uint8)``, which a
channels_last convolution weight refuses) and for every parameter it keeps as a view of a
flat buffer (ZeRO 1-2: gradients are copied in with ``grad.view(-1)``, updates land in the
buffer). :func:`build_engine` therefore starts the engine on the default layout and
afterwards turns channels_last only the convolution weights that own their storage (ZeRO 0,
any precision). The others keep the default layout and still run channels_last kernels:
the input batch is channels_last, and cuDNN (like the CPU convolutions) then picks the
channels_last algorithm, transposing the weight (small next to the activations) per call.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from dmltrain.config import Config, OptimConfig
from dmltrain.config_tree import deep_merge
from dmltrain.errors import UserError
from shards.read.sampler import batch_shape

# Keys the data pipeline (data.batch_size, cluster.num_workers, train.grad_accum) owns; a user DeepSpeed JSON may
# not change them.
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def import_deepspeed():
    """Import DeepSpeed quietly.

    DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on first use
    (tens of seconds on a fresh machine); that op only serves ``inference_all_reduce``,
    which training never calls, so we skip building it. The one import deliberately inside
    a function: the driver imports this package to check configs and must not load
    DeepSpeed (seconds, and its accelerator probe) for that.
    """
    import deepspeed

    # `import deepspeed.comm.torch as m` would bind PyTorch itself (deepspeed.comm re-exports `torch`)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def deepspeed_config(cfg: Config, world_size: int) -> dict[str, Any]:
    """The engine's JSON, generated from ``cfg`` and overridden by ``train.deepspeed_config`` if set.

    Gradient clipping acts on the data-parallel parameters only (backbone and head);
    the sharded classifier's rows are not clipped. A step is ``data.batch_size × train.grad_accum``
    images at every worker count, taken in the micro-batches of
    :func:`~shards.read.sampler.batch_shape` (``train.grad_accum`` of ``data.batch_size`` at the largest
    ``cluster.num_workers``, more and smaller ones at fewer workers): DeepSpeed's
    ``gradient_accumulation_steps``, by which ``engine.backward`` divides the loss and at whose every
    multiple ``engine.step`` steps.
    """
    d = cfg.data
    shape = batch_shape(
        d.sampler,
        d.batch_size,
        d.samples_per_class,
        world_size,
        grad_accum=cfg.train.grad_accum,
        max_world=cfg.cluster.max_workers,
    )
    local_batch, accum = shape.local_batch_size, shape.accum
    precision = cfg.train.precision
    generated: dict[str, Any] = {
        "train_batch_size": local_batch * world_size * accum,
        "train_micro_batch_size_per_gpu": local_batch,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": cfg.train.zero_stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": cfg.train.grad_clip or 0.0,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16, "loss_scale_window": 500},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if precision != "fp32":
        # DeepSpeed casts parameters only; BatchNorm's running statistics must follow them, or
        # eval-mode BatchNorm meets half-precision weights next to fp32 statistics (an error on CPU)
        generated["data_types"] = {"buffer_dtype": precision}
    if not cfg.train.deepspeed_config:
        return generated
    path = Path(cfg.train.deepspeed_config)
    try:
        user = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"train.deepspeed_config: {path}: file not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"train.deepspeed_config: {path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(
            f"train.deepspeed_config: {path}: cannot read it as UTF-8 text ({getattr(e, 'strerror', None) or e})"
        ) from None
    if not isinstance(user, dict):
        raise UserError(f"train.deepspeed_config: {path}: expected a JSON object")
    for key in _BATCH_KEYS:
        if key in user and user[key] != generated[key]:
            raise UserError(
                f"{path}: '{key}' is set by data.batch_size, cluster.num_workers and train.grad_accum "
                f"({generated[key]} at {world_size} workers); remove it from the JSON"
            )
    return deep_merge(generated, user)


def build_optimizer(param_groups: list[dict[str, Any]], o: OptimConfig) -> torch.optim.Optimizer:
    """The torch optimizer of ``param_groups``; each group's lr is base lr × its ``lr_mult``."""
    groups = [{**g, "lr": o.lr * g.get("lr_mult", 1.0)} for g in param_groups]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


def build_engine(model: torch.nn.Module, param_groups: list[dict[str, Any]], cfg: Config, world_size: int):
    """``deepspeed.initialize`` over an already-initialised process group (Ray's, or a test's).

    A model whose convolution weights are channels_last is started in the default layout and
    given channels_last back where DeepSpeed allows it (see the module docstring).
    """
    deepspeed = import_deepspeed()
    channels_last = any(_is_channels_last(p) for p in model.parameters())
    if channels_last:
        model.to(memory_format=torch.contiguous_format)  # in place: the parameter objects stay those of param_groups
    optimizer = build_optimizer(param_groups, cfg.optim)
    ds_config = deepspeed_config(cfg, world_size)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)
    if channels_last and engine.zero_optimization_stage() == 0:
        # ZeRO 1-2 make every parameter a view of their flat buffers, even a buffer of one parameter
        restore_channels_last(engine.module)
    return engine, ds_config


def _is_channels_last(t: torch.Tensor) -> bool:
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is the whole of its storage (not a view of a flat buffer an optimizer updates)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def restore_channels_last(module: torch.nn.Module) -> int:
    """Turn channels_last each 4-D parameter of ``module`` that owns its storage; the number turned.

    Replacing ``p.data`` keeps the parameter object (the optimizer's) but gives it new storage, so
    parameters that are views of an engine's flat buffer are left alone: they would stop receiving
    the engine's updates (and DeepSpeed copies their gradients with ``view(-1)``).
    """
    turned = 0
    for p in module.parameters():
        if p.dim() == 4 and p.numel() and _owns_storage(p.data) and not _is_channels_last(p):
            p.data = p.data.contiguous(memory_format=torch.channels_last)
            turned += 1
    return turned


def loss_scale(engine) -> float:
    """The fp16 loss scale ``engine.backward`` applied (1.0 unless the engine runs fp16).

    Read it before ``engine.step()``, which may change it after an overflow.
    """
    if not engine.fp16_enabled():
        return 1.0
    opt = engine.optimizer
    for attr in ("loss_scale", "cur_scale"):  # FP16_Optimizer has loss_scale; ZeRO's has both
        value = getattr(opt, attr, None)
        if value is not None:
            return float(value)
    return float(opt.loss_scaler.cur_scale)
