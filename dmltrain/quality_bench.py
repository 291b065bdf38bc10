"""``dmltrain bench quality``: does the distributed system learn as well as a plain loop, and at what cost?

The same backbone and head (:func:`dmltrain.models.build_model`), the same data, the same
number of steps, trained twice:

* **plain**: one process, a textbook PyTorch loop: the train shards read with plain WebDataset
  into memory, torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip`` + ``Normalize``,
  pytorch-metric-learning's ``MPerClassSampler`` (P×K batches) and ``NormalizedSoftmaxLoss``,
  one ``torch.optim.SGD`` over the model and the loss's class weights;
* **dmltrain**: ``dmltrain train`` run as a command (Ray Train V2, DeepSpeed engines over gloo,
  the shard stream, the class-sharded NormSoftmax classifier, MLflow) with ``--workers``
  workers, the global batch split between them. DeepSpeed runs at ZeRO stage 0: partitioning the
  optimizer state of a network this small saves nothing and costs collectives. BatchNorm is
  per worker, dmltrain's default (``--sync-bn`` normalizes over the global batch, as the one
  plain process does; on CPUs each of its layers costs a gloo round trip each way).

Both final models are then evaluated by the same code (Recall@1 on the test split, cosine,
the query excluded). Printed: both Recall@1 values, their difference, and both wall times
(each from start to a trained and evaluated model, so the plain loop's time includes its own
final evaluation as the command's does); the last lines hold the difference and the ratio, and
the time per step of each (the plain loop's measured around its iterations, dmltrain's as its
run logged it) with what dmltrain spends outside its steps (starting Ray, the workers and
DeepSpeed, the final evaluation and checkpoint, shutting down).
Nothing is asserted. The hyper-parameters default to the setting of issue 16's comparison
(P×K 16×4, SGD lr 0.01, momentum 0.9, weight decay 1e-4, T = 0.05, D = 128, LayerNorm head).

Both runs start their class weights from the same distribution (``--class-init-std``, default
N(0, 1): ``NormalizedSoftmaxLoss``'s own). It is not a detail: the weights are normalised in
the loss, so their initial norm sets how fast the class directions move under SGD (dmltrain's
default, 1/sqrt(D), moves them D times faster than N(0, 1)); on the synthetic demo data that
alone was worth 3.8 points of Recall@1 (one seed).
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torchvision import transforms
from tqdm import tqdm

from dmltrain.config import Config, EvalConfig, build_config
from dmltrain.errors import UserError
from dmltrain.evaluate.embedding import evaluate_model
from dmltrain.models import build_model, load_model
from dmltrain.tracking.names import STEP_MS
from dmltrain.tracking.queries import history, run_by_name
from shards.build.synthetic import build_synthetic_shards
from shards.decode.transforms import IMAGENET_MEAN, IMAGENET_STD
from shards.manifest import Manifest

try:  # a development dependency: the bench says so when it is missing
    from pytorch_metric_learning.losses import NormalizedSoftmaxLoss
    from pytorch_metric_learning.samplers import MPerClassSampler
except ImportError:  # pragma: no cover - present wherever the tests run
    NormalizedSoftmaxLoss = MPerClassSampler = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_mutually_exclusive_group()
    data.add_argument(
        "--shards", help="shard directory to train and evaluate on (train split; test, or query + gallery)"
    )
    data.add_argument(
        "--synthetic",
        default="100,20,32",
        metavar="C,N,S",
        help="build synthetic shards: C train classes (as many test classes), N images each, S pixels (default 100,20,32: the demo's data)",
    )
    parser.add_argument("--steps", type=int, required=True, help="training steps of each run")
    parser.add_argument("--workers", type=int, default=2, help="dmltrain workers (default 2)")
    parser.add_argument("--backbone", default="small_cnn")
    parser.add_argument("--dim", type=int, default=128, help="embedding dimension (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--k", type=int, default=4, help="images per class in a batch (default 4: P = batch / k)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=0.05)
    parser.add_argument(
        "--class-init-std",
        type=float,
        default=1.0,
        help="std of the initial class weights in both runs (default 1: NormalizedSoftmaxLoss's own init)",
    )
    parser.add_argument("--scale", default="0.5,1.0", help="RandomResizedCrop area range (default 0.5,1.0)")
    parser.add_argument(
        "--image-size", type=int, help="train crop and eval crop (default: the synthetic size, else 224)"
    )
    parser.add_argument(
        "--eval-resize", type=int, help="eval shorter side before the centre crop (default: the image size, else 256)"
    )
    parser.add_argument(
        "--sync-bn",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="dmltrain's BatchNorm over the global batch, as the one plain process has (default: per worker, dmltrain's default)",
    )
    parser.add_argument("--loader-workers", type=int, default=1, help="decoding processes of each run (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", help="keep the runs' files (shards, configs, logs, models) in this directory")


def _config(
    args: argparse.Namespace, shard_dir: Path, work: Path, size: int, resize: int, scale: tuple[float, float]
) -> Config:
    """The one config both runs follow (the plain loop reads its model, data and optimizer keys)."""
    return build_config(
        {
            "data": {
                "shards": str(shard_dir),
                "batch_size": args.batch,
                "samples_per_class": args.k,
                "image_size": size,
                "augment": {"scale": list(scale)},
                "eval_resize": resize,
                "eval_crop": size,
                "loader_workers": args.loader_workers,
                "eval_batch_size": 256,
            },
            "model": {
                "backbone": args.backbone,
                "embedding_dim": args.dim,
                "head": "layernorm",
                "sync_bn": args.sync_bn,
            },
            "loss": {
                "classifier": {
                    "kind": "normsoftmax",
                    "sample_ratio": 1.0,
                    "params": {"temperature": args.temperature},
                    "init_std": args.class_init_std,
                },
                "instance": None,
            },
            "optim": {"name": "sgd", "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay},
            "schedule": {"kind": "constant"},
            "train": {
                "epochs": None,
                "max_steps": args.steps,
                "seed": args.seed,
                "zero_stage": 0,
                "checkpoint_every": args.steps,
                "log_every": 50,
                "output_dir": str(work / "runs"),
                "run_name": "bench-quality",
            },
            "eval": {
                "every": 0,
                "before_training": False,
                "ks": [1],
                "nmi": False,
                "map_at_r": False,
                "binary": False,
                "plots": False,
            },
            "tracking": {
                "uri": f"sqlite:///{work / 'mlflow.db'}",
                "experiment": "bench-quality",
                "system_metrics": False,
                "log_models": False,
            },  # the plain loop registers no model either
            "cluster": {
                "num_workers": args.workers,
                "cpus_per_worker": max(0.25, (os.cpu_count() or 2) / (2 * args.workers)),
            },
        },
        source="bench quality",
    )


def recall_at_1(model: torch.nn.Module, cfg: Config, splits: list[str]) -> float:
    """Recall@1 of ``model`` on the test split(s), as dmltrain evaluates (single process)."""
    ev = EvalConfig(ks=[1], nmi=False, map_at_r=False, binary=False, before_training=False, plots=False)
    data = cfg.data.model_copy(update={"loader_workers": 0})
    metrics, _ = evaluate_model(model.eval(), cfg.data.shards, splits, ev, data, progress=False)
    return float(metrics["recall@1"])


# -- the plain loop -------------------------------------------------------------------------------
class _Images(torch.utils.data.Dataset):
    """Encoded images in memory, decoded and augmented per item by torchvision (as an ImageFolder would)."""

    def __init__(self, encoded: list[bytes], labels: np.ndarray, transform):
        self.encoded, self.labels, self.transform = encoded, labels, transform

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, i: int):
        with Image.open(io.BytesIO(self.encoded[i])) as img:
            return self.transform(img.convert("RGB")), int(self.labels[i])


def _read_train_split(shard_dir: Path) -> tuple[list[bytes], np.ndarray, int]:
    """(image bytes, labels, label-space size) of the train split, read with plain WebDataset."""
    split = Manifest.load(shard_dir).split("train")
    encoded, labels = [], []
    for sample in wds.WebDataset([str(s.path) for s in split.shards], shardshuffle=False, empty_check=False):
        image_key = next(k for k in ("jpg", "jpeg", "png", "webp") if k in sample)
        encoded.append(sample[image_key])
        labels.append(int(sample["cls"]))
    return encoded, np.asarray(labels), split.num_labels


def train_plain(cfg: Config, steps: int, seed: int) -> tuple[torch.nn.Module, float]:
    """The textbook single-process loop (see the module docstring); the trained model and its mean
    milliseconds per step (loading included, the first step's start of the loader processes not)."""
    torch.manual_seed(seed)
    np.random.seed(seed)  # MPerClassSampler draws from numpy's global generator: unseeded, the arm varied by ±2 points
    d, o = cfg.data, cfg.optim
    encoded, labels, num_classes = _read_train_split(Path(d.shards))
    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(d.image_size, scale=d.augment.scale, ratio=d.augment.ratio),
            transforms.RandomHorizontalFlip(d.augment.flip),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    sampler = MPerClassSampler(
        labels, m=d.samples_per_class, batch_size=d.batch_size, length_before_new_iter=steps * d.batch_size
    )
    loader = torch.utils.data.DataLoader(
        _Images(encoded, labels, tf),
        batch_size=d.batch_size,
        sampler=sampler,
        num_workers=d.loader_workers,
        drop_last=True,
    )
    model = build_model(cfg.model)
    c = cfg.loss.classifier
    loss_fn = NormalizedSoftmaxLoss(
        num_classes,
        model.embedding_dim,
        temperature=c.params["temperature"],
        weight_init_func=functools.partial(torch.nn.init.normal_, std=c.init_std),
    )
    opt = torch.optim.SGD(
        [*model.parameters(), *loss_fn.parameters()], lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
    )
    model.train()
    marks = []
    for images, y in tqdm(
        loader, total=steps, desc="plain loop", unit="step", file=sys.stderr, dynamic_ncols=True, leave=False
    ):
        loss = loss_fn(model(images), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        marks.append(time.perf_counter())
    step_ms = 1000 * (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else float("nan")
    return model, step_ms


def _logged_step_ms(cfg: Config) -> float:
    """dmltrain's mean step time as its run logged it (``time/step_ms`` per logging window), from its MLflow store."""
    client = mlflow.MlflowClient(cfg.tracking.uri)
    run = run_by_name(client, client.get_experiment_by_name(cfg.tracking.experiment).experiment_id, cfg.train.run_name)
    points = history(client, run.info.run_id, STEP_MS) if run is not None else []
    return float(np.mean([v for _, v in points])) if points else float("nan")


# -- the dmltrain run -------------------------------------------------------------------------------
def train_dmltrain(cfg: Config, work: Path) -> Path:
    """``dmltrain train`` on ``cfg`` as a child process (its output in ``work/dmltrain.log``); the final model's path."""
    config_path = work / "dmltrain.yaml"
    config_path.write_text(cfg.to_yaml())
    log_path = work / "dmltrain.log"
    with open(log_path, "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "dmltrain", "train", str(config_path), "--no-progress"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-15:]
        raise UserError(
            f"bench quality: dmltrain train failed (exit {done.returncode}); the end of {log_path}:\n" + "\n".join(tail)
        )
    return Path(cfg.train.output_dir) / "bench-quality" / "model" / "model.pt"


def _pair(text: str, name: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{name}: expected two numbers 'low,high', got {text!r}") from None
    return lo, hi


def _data(args: argparse.Namespace, work: Path) -> tuple[Path, str, int]:
    """(shard directory, description, native image size or 0)."""
    if args.shards:
        if not (Path(args.shards) / "manifest.json").is_file():
            raise UserError(f"--shards: {args.shards} holds no manifest.json")
        return Path(args.shards), args.shards, 0
    try:
        classes, per_class, size = (int(x) for x in args.synthetic.split(","))
    except ValueError:
        raise UserError(f"--synthetic: expected 'classes,per_class,size', got {args.synthetic!r}") from None
    out = work / "shards"
    build_synthetic_shards(out, classes, per_class, size, seed=args.seed, workers=1, progress=False)
    return out, f"synthetic {classes} classes x {per_class} images, {size}px (train and test)", size


def run(args: argparse.Namespace) -> int:
    if NormalizedSoftmaxLoss is None:
        raise UserError("bench quality: needs pytorch-metric-learning (pip install pytorch-metric-learning)")
    if args.steps < 1:
        raise UserError(f"--steps: must be >= 1, got {args.steps}")
    if not args.class_init_std > 0:
        raise UserError(f"--class-init-std: must be > 0, got {args.class_init_std}")
    scale = _pair(args.scale, "--scale")
    with tempfile.TemporaryDirectory(prefix="dmltrain-bench-quality-") as tmp:
        work = Path(args.keep).resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        shard_dir, described, native = _data(args, work)
        size = args.image_size or native or 224
        cfg = _config(args, shard_dir.resolve(), work, size, args.eval_resize or (native or 256), scale)
        splits = ["query", "gallery"] if "query" in Manifest.load(shard_dir).splits else ["test"]
        print(
            f"quality bench: {described}; {args.backbone} D={args.dim} LayerNorm head, NormSoftmax T={args.temperature}, "
            f"class weights N(0, {args.class_init_std:g}²), P×K {args.batch // args.k}×{args.k}, "
            f"SGD lr {args.lr} momentum {args.momentum} wd {args.weight_decay}, "
            f"crop {size} scale {scale[0]:g}-{scale[1]:g} + flip, {args.steps} steps",
            flush=True,
        )
        results: dict[str, tuple[float, float]] = {}
        t0 = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)  # the one plain process may use every core
        try:
            plain, plain_step_ms = train_plain(cfg, args.steps, args.seed)
            results["plain"] = (recall_at_1(plain, cfg, splits), time.perf_counter() - t0)
        finally:
            torch.set_num_threads(threads)
        print(
            f"plain PyTorch loop (1 process, PML NormalizedSoftmaxLoss)       Recall@1 {results['plain'][0]:.4f}   wall {results['plain'][1]:7.1f} s",
            flush=True,
        )
        print(
            f"running dmltrain train ({args.workers} workers; output in {work / 'dmltrain.log'}) ...",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.perf_counter()
        model_path = train_dmltrain(cfg, work)  # trains, then evaluates as the plain loop did
        seconds = time.perf_counter() - t0
        model, _, _ = load_model(model_path)
        results["dmltrain"] = (recall_at_1(model, cfg, splits), seconds)
        label = (
            f"dmltrain train (Ray + DeepSpeed + shards, {args.workers} workers{', sync BN' if args.sync_bn else ''})"
        )
        print(f"{label:<62} Recall@1 {results['dmltrain'][0]:.4f}   wall {results['dmltrain'][1]:7.1f} s")
        (r_plain, t_plain), (r_dml, t_dml) = results["plain"], results["dmltrain"]
        print(
            f"dmltrain - plain: {100 * (r_dml - r_plain):+.2f} points Recall@1 at {args.steps} steps; "
            f"wall time dmltrain / plain: {t_dml / t_plain:.2f}x"
        )
        dml_step_ms = _logged_step_ms(cfg)
        print(
            f"per step: plain {plain_step_ms:.1f} ms, dmltrain {dml_step_ms:.1f} ms ({dml_step_ms / plain_step_ms:.2f}x); "
            f"dmltrain outside its steps (start-up, final evaluation and checkpoint, shutdown): {t_dml - args.steps * dml_step_ms / 1000:.1f} s"
        )
    return 0
