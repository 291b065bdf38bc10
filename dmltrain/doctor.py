"""``dmltrain doctor [CONFIG]``: what this node can and cannot do, one line each, in seconds.

Like DeepSpeed's ``ds_report``, but each line is a check that ran: torch and its CUDA build, the
NVIDIA driver, the GPUs and their memory, NCCL, Triton (on a GPU: one fused classifier step against
the torch path), nvJPEG (on a GPU: a JPEG decoded on the device against the CPU decode), Ray (a
local instance started on 127.0.0.1 that runs a task), the MLflow tracking URI (writable), faiss
(a search, on a GPU with its GPU build) and DeepSpeed's accelerator.

Each line is ``ok``, ``absent`` (not here, and the config does not need it) or ``MISSING`` (the
config needs it: the line says which key). The exit code is 1 when something is MISSING, else 0.
Without CONFIG the embedded defaults are the config; dotted overrides apply as everywhere
(``dmltrain doctor cluster.use_gpu=true`` asks what a GPU training would need). A check that
breaks is its own line, never a traceback.

A command module: torch and the rest are imported by the checks that need them.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError

#: the checks, in the order they run and print (``--skip`` takes these names)
CHECKS = ("torch", "cuda", "gpus", "nccl", "triton", "nvjpeg", "ray", "mlflow", "faiss", "deepspeed")
RAY_TIMEOUT_S = 60.0


@dataclass
class Check:
    """One line: ``ok`` says whether it works here; ``needed`` why the config needs it ("" when it does not)."""

    name: str
    ok: bool
    detail: str
    needed: str = ""
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.ok:
            return "ok"
        return "MISSING" if self.needed else "absent"

    def line(self) -> str:
        need = f" (needed: {self.needed})" if self.needed and not self.ok else ""
        return f"{self.status:<8}{self.name:<10}{self.detail}{need}"


class Absent(Exception):
    """A check's thing is not here (a one-line reason)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config whose needs to check (default: the embedded defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.use_gpu=true")
    parser.add_argument(
        "--skip", nargs="+", default=[], choices=CHECKS, metavar="CHECK", help=f"checks to skip: {', '.join(CHECKS)}"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the checks as JSON")


def run(args: argparse.Namespace) -> int:
    from dmltrain.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # `dmltrain doctor cluster.use_gpu=true`: defaults + overrides
        config, overrides = None, [config, *overrides]
    cfg = load_config(config, overrides)
    print(
        f"dmltrain doctor: {config or 'the default config'}{' with ' + ' '.join(overrides) if overrides else ''} "
        f"on {socket.gethostname()} ({platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()})",
        flush=True,
    )
    checks = run_checks(cfg, skip=set(args.skip), echo=lambda c: print(c.line(), flush=True))
    missing = [c.name for c in checks if c.status == "MISSING"]
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "absent", "MISSING")}
    print(
        f"{counts['ok']} ok, {counts['absent']} absent, {counts['MISSING']} missing"
        + (f": the config needs {', '.join(missing)}" if missing else "")
        + (f"; skipped {', '.join(args.skip)}" if args.skip else ""),
        flush=True,
    )
    if args.json:
        from dmltrain.fileio import write_json

        write_json(args.json, {"checks": [asdict(c) | {"status": c.status} for c in checks], "missing": missing})
    return 1 if missing else 0


def run_checks(cfg: Any, skip: set[str] = frozenset(), echo: Callable[[Check], None] | None = None) -> list[Check]:
    """Every check of :data:`CHECKS` not in ``skip``, in order; ``echo`` sees each as it finishes."""
    needs = config_needs(cfg)
    facts: dict[str, Any] = {}
    out = []
    for name in CHECKS:
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            # libraries that print on import (DeepSpeed's accelerator detection) would break the one-line layout
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                detail = _PROBES[name](cfg, facts)
            ok = True
        except Absent as e:
            ok, detail = False, str(e)
        except Exception as e:  # noqa: BLE001 — a check that breaks is reported as its line, never a traceback
            from dmltrain.text import one_line

            ok, detail = False, f"failed: {one_line(e)}"
        check = Check(name, ok, detail, needs.get(name, ""), time.perf_counter() - t0)
        out.append(check)
        if echo is not None:
            echo(check)
    return out


def config_needs(cfg: Any) -> dict[str, str]:
    """Check name -> the config key that makes this node need it (a local training: this node's GPUs)."""
    from shards.config import resolve_decode

    c = cfg.cluster
    needs = {"torch": "always", "deepspeed": "always (the training engine)", "ray": "always (training runs on Ray)"}
    if cfg.tracking.enabled:
        needs["mlflow"] = "tracking.enabled: true"
    if (cfg.eval.nmi or cfg.eval.binary) and not c.use_gpu:
        needs["faiss"] = "eval.nmi or eval.binary on CPU workers"
    if c.use_gpu and not c.address:  # a local Ray puts every worker on this node's GPUs
        why = "cluster.use_gpu: true"
        needs |= {"cuda": why, "gpus": f"{why}, cluster.num_workers: {c.max_workers}"}
        if c.max_workers > 1:
            needs["nccl"] = f"{why}, cluster.num_workers: {c.max_workers}"
        if cfg.loss.classifier is not None:
            needs["triton"] = f"{why} with loss.classifier (the fused kernels)"
        if resolve_decode(cfg.data.decode, "cuda", cfg.data.augment) == "device":
            needs["nvjpeg"] = f"{why}, data.decode: {cfg.data.decode}"
    return needs


# -- the checks: each returns its line's detail, or raises Absent (or anything) -----------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _torch(cfg: Any, facts: dict[str, Any]) -> str:
    import torch

    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if cuda else None  # 92400: 9.24.0
    if cudnn:
        cudnn = f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}"
    build = f"CUDA {cuda} build" + (f", cuDNN {cudnn}" if cudnn else "") if cuda else "CPU-only build"
    return f"{torch.__version__} ({build}), {torch.get_num_threads()} threads"


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def _cuda(cfg: Any, facts: dict[str, Any]) -> str:
    import torch

    driver = _driver_version()
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise Absent("this torch is a CPU-only build")
        seen = f"NVIDIA driver {driver}" if driver else "no NVIDIA driver (nvidia-smi not found)"
        raise Absent(f"no CUDA device: torch.cuda.is_available() is False; {seen}")
    facts["cuda"] = True
    return f"runtime {torch.version.cuda}, NVIDIA driver {driver or 'version unknown (no nvidia-smi)'}"


def _gpus(cfg: Any, facts: dict[str, Any]) -> str:
    import torch

    if not facts.get("cuda"):
        raise Absent("none")
    n = torch.cuda.device_count()
    parts = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        parts.append(
            f"{i}: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {_gib(free)} free of {_gib(total)}"
        )
    c = cfg.cluster
    if c.use_gpu and not c.address and n < c.min_workers:
        raise Absent(f"{n} GPU(s) for cluster.num_workers: {c.min_workers} GPU workers: " + "; ".join(parts))
    return f"{n}: " + "; ".join(parts) if n > 1 else parts[0][3:]


def _nccl(cfg: Any, facts: dict[str, Any]) -> str:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        raise Absent("this torch has no NCCL backend" + ("" if dist.is_available() else " (nor torch.distributed)"))
    version = ".".join(map(str, torch.cuda.nccl.version()))
    if not facts.get("cuda"):
        raise Absent(f"NCCL {version} built in, but no CUDA device to run it on")
    return f"NCCL {version}; gloo {'available' if dist.is_gloo_available() else 'absent'}"


def _triton(cfg: Any, facts: dict[str, Any]) -> str:
    try:
        import triton
    except ImportError:
        raise Absent("Triton is not installed: no fused classifier kernels") from None
    if not facts.get("cuda"):
        raise Absent(f"{triton.__version__} installed; no CUDA device, so the fused classifier does not run here")
    return f"{triton.__version__}: {fused_step_check()}"


def fused_step_check(classes: int = 4096, dim: int = 64, batch: int = 256, device: str = "cuda") -> str:
    """One fused classifier step (bf16 products, subsampled rows) against the torch path in fp32 on the same
    device and weights; the loss within 2e-3 and the gradients within 3e-2 (relative to their largest entry),
    the bf16 tolerances of the fused tests. Raises when they differ. (``device="cpu"`` under
    ``TRITON_INTERPRET=1`` runs the same on the CPU: the tests do.)"""
    import torch

    from dmltrain.distributed.sharded_softmax import ShardedClassifier

    dev = torch.device(device)
    torch.manual_seed(0)

    def make(**kw: Any) -> ShardedClassifier:
        return ShardedClassifier(classes, dim, "normsoftmax", sample_ratio=0.5, temperature=0.1, **kw).to(dev)

    fused, ref = make(precision="bf16", backend="triton"), make(backend="torch")
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(batch, dim, device=dev)
    y = torch.randint(0, classes, (batch,), device=dev)
    t0 = time.perf_counter()
    out = {}
    for name, clf in (("fused", fused), ("torch", ref)):
        xi = x.clone().requires_grad_(True)
        loss = clf(xi, y, step=0)
        loss.backward()
        out[name] = (loss.detach(), xi.grad, clf.weight.grad)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    errs = [rel(a, b) for a, b in zip(out["fused"], out["torch"])]
    if errs[0] > 2e-3 or max(errs[1:]) > 3e-2:
        raise RuntimeError(
            f"the fused step differs from the torch path: loss {errs[0]:.1e}, gradients {max(errs[1:]):.1e}"
        )
    return (
        f"a fused classifier step (bf16, {classes} classes, D={dim}, B={batch}) matches the torch path "
        f"(loss {errs[0]:.0e}, gradients {max(errs[1:]):.0e}); {seconds:.1f} s with compiling and tuning"
    )


def _nvjpeg(cfg: Any, facts: dict[str, Any]) -> str:
    if not facts.get("cuda"):
        raise Absent("no CUDA device (JPEGs are decoded in the loader processes instead)")
    return nvjpeg_check()


def nvjpeg_check() -> str:
    """A smooth 4:4:4 JPEG decoded by nvJPEG (``torchvision.io.decode_jpeg`` on CUDA) against the CPU decode:
    the two inverse DCTs may differ by rounding, a level or two, never more than 8 levels."""
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    yy, xx = np.mgrid[0:96, 0:128]
    img = np.stack([xx * 2, yy * 2, (xx + yy)], -1).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=0)
    data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    cpu = decode_jpeg(data, mode=ImageReadMode.RGB)
    gpu = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda").cpu()
    diff = (cpu.int() - gpu.int()).abs()
    worst, mean = int(diff.max()), float(diff.float().mean())
    if cpu.shape != gpu.shape or worst > 8 or mean > 1.0:
        raise RuntimeError(
            f"nvJPEG's decode differs from the CPU's: shape {tuple(gpu.shape)}, max {worst}, mean {mean:.2f} levels"
        )
    return f"a 128x96 JPEG decoded on the GPU matches the CPU decode (max {worst}, mean {mean:.2f} levels)"


_RAY_CHILD = """
import json, ray
from cluster.launch import start_local_ray
start_local_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42
res = ray.cluster_resources()
ray.shutdown()
print("RESULT " + json.dumps({"version": ray.__version__, "gpus": res.get("GPU", 0)}))
"""


def _ray(cfg: Any, facts: dict[str, Any]) -> str:
    import importlib.util
    import json

    if importlib.util.find_spec("ray") is None:
        raise Absent("Ray is not installed")
    if cfg.cluster.address:
        return f"installed; the config joins cluster.address {cfg.cluster.address} (not contacted)"
    root = Path(__file__).resolve().parents[1]  # the checkout holding cluster/ (PYTHONPATH for an uninstalled tree)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RAY_CHILD], capture_output=True, text=True, timeout=RAY_TIMEOUT_S, env=env
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"a local Ray did not start and run a task within {RAY_TIMEOUT_S:.0f} s") from None
    seconds = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        from dmltrain.text import one_line

        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln] or proc.stderr.splitlines() or ["no output"]
        raise RuntimeError(f"a local Ray failed (exit code {proc.returncode}): {one_line(errors[-1])}")
    got = json.loads(lines[-1][len("RESULT ") :])
    return f"{got['version']}: a local instance started on 127.0.0.1 and ran a task in {seconds:.1f} s ({got['gpus']:g} GPUs seen)"


def _mlflow(cfg: Any, facts: dict[str, Any]) -> str:
    from urllib.parse import urlparse

    if not cfg.tracking.enabled:
        raise Absent("tracking.enabled: false")
    import mlflow

    uri = cfg.tracking.resolved_uri()
    scheme = urlparse(uri).scheme
    if scheme == "sqlite":
        return f"{mlflow.__version__}: {uri}: {_sqlite_writable(uri)}"
    if scheme in ("", "file"):
        folder = Path(urlparse(uri).path if scheme else uri)
        _folder_writable(folder, "tracking.uri")
        return f"{mlflow.__version__}: {uri}: the folder is writable"
    if scheme in ("http", "https"):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        return f"{mlflow.__version__}: {uri} answers (a search; writing was not tried)"
    return f"{mlflow.__version__}: {uri}: not checked (a {scheme}:// store)"


def _folder_writable(folder: Path, what: str) -> None:
    from dmltrain.fileio import check_output_dir

    try:
        check_output_dir(folder, what)
    except UserError as e:
        raise RuntimeError(str(e)) from None


def _sqlite_writable(uri: str) -> str:
    """An existing database takes a write lock (then lets go, nothing written); a new one's folder takes a file."""
    import sqlite3

    path = Path(uri[len("sqlite:///") :])
    if not path.exists():
        _folder_writable(path.parent, "tracking.uri")
        return "its folder is writable (the database is created by the first run)"
    conn = sqlite3.connect(path, timeout=5)
    try:
        conn.execute("BEGIN IMMEDIATE")  # the write lock: fails on a read-only file or folder
        conn.rollback()
    finally:
        conn.close()
    return "the database is writable"


def _faiss(cfg: Any, facts: dict[str, Any]) -> str:
    try:
        import faiss
    except ImportError:
        raise Absent("faiss is not installed") from None
    import numpy as np

    x = np.random.default_rng(0).standard_normal((64, 16), dtype=np.float32)
    gpus = faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0
    index = faiss.IndexFlatL2(16)
    where = "CPU build"
    if gpus:
        index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        where = f"GPU build, {gpus} GPU(s)"
    index.add(x)
    _, nn = index.search(x, 1)
    if not (nn[:, 0] == np.arange(64)).all():
        raise RuntimeError("a flat L2 index did not find each vector as its own nearest neighbour")
    engine = "" if gpus or not facts.get("cuda") else "; k-means on the GPU uses torch (no faiss GPU build)"
    return f"{faiss.__version__} ({where}): a flat index searched{engine}"


def _deepspeed(cfg: Any, facts: dict[str, Any]) -> str:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise Absent("DeepSpeed is not installed")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    name = acc.device_name()
    if cfg.cluster.use_gpu and name != "cuda" and not cfg.cluster.address:
        raise Absent(
            f"{deepspeed.__version__}: accelerator {name}, not cuda (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})"
        )
    return f"{deepspeed.__version__}: accelerator {name}"


_PROBES: dict[str, Callable[[Any, dict[str, Any]], str]] = {
    "torch": _torch,
    "cuda": _cuda,
    "gpus": _gpus,
    "nccl": _nccl,
    "triton": _triton,
    "nvjpeg": _nvjpeg,
    "ray": _ray,
    "mlflow": _mlflow,
    "faiss": _faiss,
    "deepspeed": _deepspeed,
}
