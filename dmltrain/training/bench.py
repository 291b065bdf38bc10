"""``dmltrain bench train``: the whole training step against the bare backbone, in one run.

Two loops on the same device, model, batch and precision:

* **bare backbone**: the embedding model (backbone + head) in the run's precision and memory
  format, forward + backward + a plain ``torch.optim.SGD`` step on one random batch that lives
  on the device: what the device can do with no input and no loss to speak of;
* **full pipeline**: what a training worker does (``dmltrain.training.trainer``): shards read
  by the loader processes, JPEGs decoded and augmented (on the device with ``--decode
  device``, the default on CUDA; in the loader processes with ``cpu``), the next batch
  prepared on a side stream while the step runs, then the DeepSpeed engine, the class-sharded
  NormSoftmax classifier and ICE over the (here one-worker) gathered batch, and the row-sparse
  classifier step.

With ``--compile [MODE]`` each loop runs twice, eager and with ``model.compile`` (``default`` or
``max-autotune``: :mod:`dmltrain.models.compiled`; the parts of ``model.compile_scope``, ``--set`` it to
compile the instance loss too), their timed steps taken in turn (eager, compiled, eager, ...: on a shared
machine both meet the same load), and the images/s are printed side by side with their ratio, the compile
time (spent in the warm-up, at least one step) and the graph breaks.

Each loop is timed over ``--steps`` steps after ``--warmup``; the device is synchronized
only at the ends of the timed window (and, in the pipeline, by the step timer once, at its
end; with ``--compile``, around each step). Printed: images/s of each, their ratio, and the pipeline's share of step time spent
waiting for data (``StepTimer``'s ``data`` part: on CUDA the device time between the end of
one step and the start of the next one's kernels). Without ``--shards`` it builds synthetic
JPEG shards in a temporary directory first. Nothing is asserted: it reports.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from itertools import count
from pathlib import Path

import torch

from dmltrain.config import Config, load_config
from dmltrain.distributed.process_group import ensure_process_group
from dmltrain.errors import UserError
from dmltrain.fileio import write_json
from dmltrain.models import build_model, param_groups
from dmltrain.models.compiled import CompileWatch, compile_step
from dmltrain.models.precision import autocast_dtype
from dmltrain.training.engine import build_engine, loss_scale
from dmltrain.training.head import LossHead
from dmltrain.training.objective import Objective
from dmltrain.training.prefetch import Prefetcher
from dmltrain.training.timing import StepTimer
from shards.build.synthetic import build_synthetic_shards
from shards.config import resolve_decode
from shards.decode.device import DeviceInput
from shards.manifest import Manifest
from shards.read.stream import TrainStream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--backbone",
        default="resnet50",
        help="model.backbone: a torchvision name or any timm model (vit_base_patch16_224, convnext_base, ...; "
        "default resnet50; small_cnn or test_vit for a quick CPU run)",
    )
    parser.add_argument("--batch", type=int, default=128, help="batch size (default 128 = 32 classes x 4)")
    parser.add_argument("--image-size", type=int, default=224, help="training crop (default 224)")
    parser.add_argument(
        "--precision", default="bf16", choices=["fp32", "bf16", "fp16"], help="train.precision (default bf16)"
    )
    parser.add_argument("--channels-last", action="store_true", help="model.channels_last (convolutional models)")
    parser.add_argument(
        "--grad-checkpointing", action="store_true", help="model.grad_checkpointing: recompute activations in backward"
    )
    parser.add_argument(
        "--decode", default="auto", choices=["auto", "cpu", "device"], help="data.decode (default auto)"
    )
    parser.add_argument(
        "--loader-workers", type=int, default=None, help="loader processes (default: CPU cores - 1, at most 8)"
    )
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each loop (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument(
        "--shards", default=None, help="shard directory to train from (default: synthetic shards, built here)"
    )
    parser.add_argument(
        "--synthetic",
        default="500,12,256",
        help="without --shards: classes,images per class,pixels (default 500,12,256)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other config override for both loops, e.g. --set loss.classifier.sample_ratio=0.1",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="default",
        choices=["default", "max-autotune"],
        help="also run each loop with model.compile=MODE (default: default) and print eager and compiled side by side",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON (make gpu-check reads them)")


def _config(args: argparse.Namespace, shards: str, compile_mode: str | None = None) -> Config:
    workers = args.loader_workers if args.loader_workers is not None else max(1, min(8, (os.cpu_count() or 2) - 1))
    cuda = args.device == "cuda"
    return load_config(
        None,
        [
            f"data.shards={shards}",
            f"data.batch_size={args.batch}",
            "data.samples_per_class=4",
            f"data.image_size={args.image_size}",
            f"data.eval_crop={args.image_size}",  # a ViT is built for one input size
            f"data.eval_resize={args.image_size}",
            f"data.loader_workers={workers}",
            f"data.decode={args.decode}",
            f"model.backbone={args.backbone}",
            f"model.channels_last={str(args.channels_last).lower()}",
            f"model.grad_checkpointing={str(args.grad_checkpointing).lower()}",
            f"train.precision={args.precision}",
            "loss.instance.kind=ice",
            "cluster.num_workers=1",
            f"cluster.use_gpu={str(cuda).lower()}",
            *args.overrides,
            f"model.compile={compile_mode or 'false'}",
        ],
    )


def _synthetic(spec: str, out: Path) -> str:
    try:
        classes, per_class, size = (int(v) for v in spec.split(","))
    except ValueError:
        raise UserError(
            f"--synthetic: expected classes,images per class,pixels (e.g. 500,12,256), got {spec!r}"
        ) from None
    print(
        f"building synthetic shards: {classes} classes x {per_class} images of {size} px (train and test) ...",
        flush=True,
    )
    build_synthetic_shards(out, classes, per_class, size, seed=0, workers=min(8, os.cpu_count() or 1), progress=False)
    return str(out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> str:
    """The CUDA memory peak since :func:`_reset_peak`, for the printed line ('' on the CPU: no per-loop peak)."""
    return f"  peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""


def _compiled(cfg: Config, model: torch.nn.Module, instance, device: torch.device) -> CompileWatch | None:
    """:func:`~dmltrain.models.compiled.compile_step` for one loop, dynamo's caches emptied first: each loop
    compiles (or loads from inductor's cache on disk) what it runs, and reports its own compile time."""
    if cfg.model.compile:
        torch._dynamo.reset()
    return compile_step(cfg.model, model, instance, device)


class BareBackbone:
    """The bare loop: forward + backward + SGD of the embedding model on one random on-device batch, in the run's
    precision and memory format (compiled as ``cfg.model.compile`` asks: :attr:`watch`, else None)."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        dtype = autocast_dtype(cfg.train.precision) or torch.float32
        self.model = build_model(cfg.model).to(device=device, dtype=dtype).train()
        self.watch = _compiled(cfg, self.model, None, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        S, b = cfg.data.image_size, cfg.data.batch_size
        fmt = torch.channels_last if cfg.model.channels_last else torch.contiguous_format
        self.x = torch.randn(b, 3, S, S, device=device, dtype=dtype).contiguous(memory_format=fmt)
        self.timer = None

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).float().pow(2).sum().backward()
        self.opt.step()


class FullPipeline:
    """The training step from shards (see the module doc), one batch ahead; :attr:`timer` splits its steps,
    :attr:`decode` is the decoding used, :attr:`watch` what ``cfg.model.compile`` compiled (None: eager)."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        ensure_process_group()
        self.decode = resolve_decode(cfg.data.decode, device, cfg.data.augment)
        stream = TrainStream.from_config(
            cfg.data, cfg.train.seed, 0, 1, normalize=False, pin_memory=device.type == "cuda", decode=self.decode
        )
        model = build_model(cfg.model).to(device)
        self.engine, _ = build_engine(model, param_groups(model, cfg.optim), cfg, 1)
        dtype = autocast_dtype(cfg.train.precision) or torch.float32
        self.objective = Objective(
            cfg, stream.num_classes, model.embedding_dim, 1, classifier_dropout=model.classifier_dropout
        ).to(device)
        self.head = LossHead(self.objective, cfg.optim)
        self.watch = _compiled(cfg, self.engine.module, self.objective.instance, device)
        prefetch = Prefetcher(
            DeviceInput.from_config(cfg.data, device, dtype, channels_last=cfg.model.channels_last), device
        )
        self.batches = iter(prefetch(batch for epoch in count() for batch in stream.epoch(epoch)))
        self.timer = StepTimer(device)
        self.engine.train()
        self.steps = 0
        self.timer.start()

    def step(self) -> None:
        images, labels = next(self.batches)
        engine, timer = self.engine, self.timer
        timer.lap("data")
        loss = self.objective(engine(images), labels, step=self.steps)
        timer.lap("forward")
        engine.backward(loss)
        timer.lap("backward")
        scale = loss_scale(engine)
        engine.step()
        self.head.step(scale, applied=not engine.fp16_enabled() or engine.was_step_applied())
        timer.lap("optimizer")
        self.steps += 1
        timer.start()


def measure(loops: list[BareBackbone | FullPipeline], batch: int, steps: int, warmup: int, device) -> list[float]:
    """Images/s of each loop over ``steps`` steps after ``warmup`` (where a compiled loop compiles). One loop is
    timed as one window, the device synchronized at its ends only (a step timer's timer is reset at its start);
    several are timed step by step in turn (eager, compiled, eager, ...), the device synchronized around each step,
    so that they share whatever else the machine runs at the time."""
    for _ in range(warmup):
        for loop in loops:
            loop.step()
    _sync(device)
    for loop in loops:
        if loop.timer is not None:
            loop.timer.reset()
            loop.timer.start()
    spent = [0.0] * len(loops)
    if len(loops) == 1:
        t0 = time.perf_counter()
        for _ in range(steps):
            loops[0].step()
        _sync(device)
        spent[0] = time.perf_counter() - t0
    else:
        for _ in range(steps):
            for i, loop in enumerate(loops):
                if loop.timer is not None:  # its data part starts now, not where its last step ended
                    loop.timer.start(from_now=True)
                t0 = time.perf_counter()
                loop.step()
                _sync(device)
                spent[i] += time.perf_counter() - t0
    return [batch * steps / s for s in spent]


def _side_by_side(
    loop: str, eager: float, compiled: float, watch: CompileWatch | None, device: torch.device
) -> dict[str, float]:
    """Print one loop's eager and compiled images/s side by side; the figures for ``--json``."""
    seconds = watch.seconds() if watch is not None else 0.0
    breaks = sum(watch.breaks().values()) if watch is not None else 0
    mode = watch.mode if watch is not None else "?"
    print(
        f"{loop}: eager {eager:9.1f} images/s | compiled ({mode}) {compiled:9.1f} images/s | {compiled / eager:.2f}x; "
        f"compiled {', '.join(watch.parts) if watch else 'nothing'} in {seconds:.1f} s, {breaks} graph breaks "
        "(steps taken in turn)",
        flush=True,
    )
    return {
        "eager_images_per_s": eager,
        "compiled_images_per_s": compiled,
        "compile_s": seconds,
        "graph_breaks": breaks,
    }


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.compile and args.warmup < 1:
        raise UserError("--warmup: --compile compiles in the warm-up steps; give at least 1")
    if args.batch < 4 or args.batch % 4:
        raise UserError(f"--batch: {args.batch} is not a positive multiple of 4 (P x K batches with K = 4)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="dmltrain-bench-train-") as tmp:
        shards = args.shards or _synthetic(args.synthetic, Path(tmp) / "shards")
        cfg = _config(args, shards)
        info = Manifest.load(shards).split(cfg.data.train_split)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(
            f"train bench: {cfg.model.backbone}, batch {cfg.data.batch_size} ({cfg.data.P}x4), {cfg.data.image_size} px, {cfg.train.precision}, "
            f"{'channels_last' if cfg.model.channels_last else 'contiguous'}"
            f"{', gradient checkpointing' if cfg.model.grad_checkpointing else ''}, {device.type} ({name}); "
            f"{info.num_images} train images in "
            f"{shards}, {cfg.data.loader_workers} loader processes; {args.steps} steps after {args.warmup} warm-up"
        )
        b = cfg.data.batch_size
        cfg_c = _config(args, shards, args.compile) if args.compile else None
        compiled: dict[str, dict[str, float]] = {}
        _reset_peak(device)
        loops = [BareBackbone(cfg, device)] + ([BareBackbone(cfg_c, device)] if cfg_c else [])
        bare, *bare_c = measure(loops, b, args.steps, args.warmup, device)
        print(
            f"bare backbone (random batch on the device, SGD)     {bare:9.1f} images/s  {1000 * b / bare:8.1f} ms/step"
            + ("" if cfg_c else _peak(device)),
            flush=True,
        )
        if cfg_c:
            compiled["bare"] = _side_by_side("bare backbone", bare, bare_c[0], loops[1].watch, device)
        del loops
        _reset_peak(device)
        pipes = [FullPipeline(cfg, device)] + ([FullPipeline(cfg_c, device)] if cfg_c else [])
        full, *full_c = measure(pipes, b, args.steps, args.warmup, device)
        full_peak = "" if cfg_c else _peak(device)
        decode, split = pipes[0].decode, pipes[0].timer.summary(b)
        parts = {k: split[f"time/{k}_ms"] for k in StepTimer.PARTS}
        wait = parts["data"] / max(1e-9, sum(parts.values()))
        print(
            f"full pipeline (shards, decode={decode}, DeepSpeed, sharded NormSoftmax + ICE) {full:9.1f} images/s  "
            f"{1000 * b / full:8.1f} ms/step{full_peak}"
        )
        print(
            "  step split: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items())
            + f"; waiting for data {100 * wait:.1f}% of step time"
        )
        print(
            f"ratio full pipeline / bare backbone: {full / bare:.2f}x ({full:.1f} vs {bare:.1f} images/s), data wait {100 * wait:.1f}%"
        )
        if cfg_c:
            compiled["full"] = _side_by_side("full pipeline", full, full_c[0], pipes[1].watch, device)
        del pipes  # their loader processes end before the shards' folder goes
    if args.json:
        figures = {"bare_images_per_s": bare, "full_images_per_s": full, "data_wait": wait, "step_ms": parts}
        if compiled:
            figures["compiled"] = {"mode": args.compile, **compiled}
        write_json(args.json, {**figures, "decode": decode, "device": name, "batch": cfg.data.batch_size})
    return 0
