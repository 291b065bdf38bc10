"""``model.compile``: ``torch.compile`` (inductor) on the parts of the step where it pays.

As timm's and open_clip's ``--torchcompile``: inductor, ``mode`` ``default`` or ``max-autotune``, on the parts
``model.compile_scope`` names: the ``backbone`` (the step's largest share: inductor fuses a ViT block's norms,
activations and attention epilogues, a CNN's batch norms and activations), the embedding ``head`` (pooling, norm,
projection: a few fused kernels) and the ``instance_loss`` (its B × B similarities and per-anchor terms; the
all-gather around them stays eager, :meth:`~dmltrain.distributed.gathered_loss.GatheredInstanceLoss.compile`).
The class-sharded classifier is never compiled: its call runs kernels of its own (Triton, or blocked GEMMs into
lent buffers) behind an autograd Function, which inductor could not fuse with anything.

Each part is compiled in place (``nn.Module.compile``): the module keeps its parameters, their names and its
``state_dict`` keys, so the DeepSpeed engine (which wraps the model and hooks its parameters), the optimizer's
parameter groups, gradient accumulation, the EMA, checkpoints and exports see the same module as in eager mode.
bf16 and channels_last are the engine's and the input's business, seen by the compiled code as they are; gradient
checkpointing is compiled too (the recomputation becomes part of the compiled backward). Compilation is lazy: the
first step compiles, and :class:`CompileWatch` reports its time and the graph breaks once.

Shapes are static (``dynamic=False``: no ``mark_dynamic``), and nothing recompiles from step to step: every
training micro-batch has the same shape by construction (the batch plan gives every worker ``data.batch_size / W``
samples, drops the pieces past an epoch's last full global batch, and substitutes an unreadable image), so a
dynamic graph would only cost speed. Evaluation runs the model in eval mode without gradients (one
more graph per part, compiled at the first evaluation), and pads a split's last, partial batch to the batch size
(:func:`has_compiled_parts`, :func:`~dmltrain.evaluate.embedding.embed_batches`): in eval mode every sample's
embedding is its own, so the padding changes nothing, and no batch shape recompiles.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dmltrain.config import ModelConfig
from dmltrain.errors import UserError

#: the backend training compiles with (tests trace with ``aot_eager``: no code generated)
BACKEND = "inductor"
# dynamo's own timers of a compilation (seconds per call): a frame's whole compile (tracing, AOTAutograd, inductor's
# forward, or a cached graph's load), and the backward's inductor compile, which runs at the first backward
_COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def check_compiler(device: torch.device) -> None:
    """A one-line :class:`UserError` when inductor cannot build code on ``device``'s side: a CPU needs a C++ compiler."""
    if device.type != "cpu" or BACKEND != "inductor":
        return
    from torch._inductor import config as inductor_config

    names = [c for c in inductor_config.cpp.cxx if c]
    if not any(shutil.which(c) for c in names):
        raise UserError(
            f"model.compile: inductor builds CPU code with a C++ compiler and none was found ({', '.join(names)}); "
            f"install g++ or set model.compile=false"
        )


def compile_parts(
    parts: Mapping[str, nn.Module | None], mode: str, scope: Iterable[str], backend: str = "inductor"
) -> list[str]:
    """Compile in place the ``parts`` that ``scope`` names (``mode``: ``default`` or ``max-autotune``; static
    shapes); a part that is None (a run without an instance loss) is left out. The names compiled, in scope order.
    ``backend``: inductor; tests trace with ``aot_eager`` (dynamo and AOTAutograd, no code generated)."""
    kwargs = {"backend": backend, "dynamic": False}
    if backend == "inductor" and mode != "default":
        kwargs["mode"] = mode
    done = []
    for name in scope:
        part = parts.get(name)
        if part is None:
            continue
        part.compile(**kwargs)
        done.append(name)
    return done


def has_compiled_parts(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule of it was compiled in place (``nn.Module.compile``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def graph_breaks() -> dict[str, int]:
    """Every graph break dynamo met in this process so far: its reason (first line) and how often."""
    from torch._dynamo.utils import counters  # dynamo loads in seconds: only once something was compiled

    out: dict[str, int] = {}
    for reason, n in counters["graph_break"].items():
        key = str(reason).strip().splitlines()[0] if str(reason).strip() else "?"
        out[key] = out.get(key, 0) + int(n)
    return out


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's timers)."""
    from torch._dynamo.utils import compilation_time_metrics as times

    return float(sum(sum(times.get(name, ())) for name in _COMPILE_TIMERS))


def compile_step(cfg: ModelConfig, model: nn.Module, instance_loss: nn.Module | None, device: torch.device):
    """Compile the parts of a training step that ``cfg.compile_scope`` names (``model``'s backbone and head, the
    instance loss when the run has one) when ``cfg.compile`` asks; a :class:`CompileWatch` of them, or None (eager)."""
    if not cfg.compile:
        return None
    check_compiler(device)
    parts = {"backbone": model.backbone, "head": model.head, "instance_loss": instance_loss}
    watch = CompileWatch([], str(cfg.compile))
    watch.parts = compile_parts(parts, str(cfg.compile), cfg.compile_scope, BACKEND)
    return watch


class CompileWatch:
    """What compiling ``parts`` cost: the compile seconds and graph breaks since it was made (process-wide counters:
    make it just before the first compiled call)."""

    def __init__(self, parts: list[str], mode: str) -> None:
        self.parts, self.mode = parts, mode
        self._seconds0 = compile_seconds()
        self._breaks0 = graph_breaks()
        self.reported = False

    def seconds(self) -> float:
        return compile_seconds() - self._seconds0

    def breaks(self) -> dict[str, int]:
        """The graph breaks met since the watch was made, by reason."""
        now = graph_breaks()
        return {k: n - self._breaks0.get(k, 0) for k, n in now.items() if n > self._breaks0.get(k, 0)}

    def summary(self) -> str:
        """One line: what was compiled, how long it took, the graph breaks (with their first reason)."""
        breaks = self.breaks()
        total = sum(breaks.values())
        line = f"compiled {', '.join(self.parts) or 'nothing'} ({self.mode}) in {self.seconds():.1f} s, {total} graph breaks"
        if total:
            reason, n = max(breaks.items(), key=lambda kv: kv[1])
            line += f" (most often, {n}x: {reason})"
        return line
