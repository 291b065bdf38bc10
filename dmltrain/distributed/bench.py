"""``dmltrain bench classifier``: sharded classifier step time and peak memory vs its GEMM bound.

Each configuration runs in a fresh process (:mod:`~dmltrain.distributed.bench_runs`; ``W``
processes when ``--workers W`` > 1) so that its peak memory is its own. One step = forward,
backward and the row-sparse SGD-momentum step on random embeddings and uniformly random labels
(``--sampling hard|mixed``: the draw from the nearness index, built at the warm-up step; ``--probe``:
the probe of the full softmax timed apart, as a factor of the step).
In the same process, after the run, the three bare GEMMs of that step (``B×D`` by ``D×K`` for
the forward logits, and the two backward products, with ``K = R·N/W`` active classes per
worker) are timed; the ratio of step time to them is the overhead of everything else.

``--device cpu`` (default): the torch path in fp32 against fp32 GEMMs; peak RSS; the peer is
pytorch-metric-learning's ``NormalizedSoftmaxLoss`` with ``torch.optim.SGD`` (one process, full
softmax) when installed and it fits in memory. Times are wall clock (median over the timed
steps); the ratios are also given in process CPU time, which a machine shared with other jobs
distorts less.

``--device cuda``: the fused Triton kernels at ``--precision`` (default bf16) against the
bf16 tensor-core GEMMs (the 3-GEMM bound); peak GPU memory against weight + gradient +
optimizer state; our forward + backward apart from the optimizer step; peers (forward +
backward only, one process, NormSoftmax logits at T = 0.05), each when installed, else a line
saying it was skipped: Cut Cross-Entropy with its default gradient filter and exact
(``filter_eps=None``), Liger's fused linear cross-entropy, naive torch bf16 and
pytorch-metric-learning. ``--deterministic`` takes fixed, untuned tiles. Cut Cross-Entropy
runs on CUDA only: on the CPU its lines say so. Every run is a
:class:`~dmltrain.distributed.bench_job.ClassifierJob`, the schema ``make gpu-check`` shares.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from dmltrain.config import PRODUCT_PRECISIONS, WEIGHT_STORAGES, gpu_only
from dmltrain.distributed.bench_job import CUDA_PEERS, ClassifierJob
from dmltrain.distributed.roofline import GPUS
from dmltrain.errors import UserError

GIB = 2**30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--classes", type=int, default=1_000_000, metavar="N", help="number of classes (default 1e6)")
    parser.add_argument("--dim", type=int, default=512, metavar="D", help="embedding dimension (default 512)")
    parser.add_argument("--batch", type=int, default=256, metavar="B", help="global batch (default 256)")
    parser.add_argument(
        "--sample-ratio",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="R",
        help="share of classes per step; several values compare them",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="W",
        help="processes sharing the classes (default 1; one GPU each on CUDA)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, metavar="S", help="timed steps after one warm-up step (default 3)"
    )
    parser.add_argument("--kind", default="normsoftmax", choices=["normsoftmax", "cosface", "arcface", "softmax_ce"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cpu: the torch path; cuda: the fused kernels"
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=PRODUCT_PRECISIONS,
        help="CUDA: the kernels' products (auto: bf16)",
    )
    parser.add_argument(
        "--weight-storage", default="fp32", choices=WEIGHT_STORAGES, help="CUDA: the weight's dtype (default fp32)"
    )
    parser.add_argument(
        "--logits-budget-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="CPU: the classifier's logits budget (default 256, as the config)",
    )
    parser.add_argument(
        "--deterministic", action="store_true", help="CUDA: fixed, untuned tiles (bit-identical reruns)"
    )
    parser.add_argument(
        "--sampling",
        default="uniform",
        choices=["uniform", "hard", "mixed", "proportional"],
        help="the class draw below ratio 1 (hard, mixed: with the nearness index, refreshed at the warm-up step)",
    )
    parser.add_argument(
        "--probe", action="store_true", help="also time the probe of the full softmax (loss.classifier.probe_every)"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the peers")
    parser.add_argument(
        "--model",
        choices=sorted(GPUS),
        default=None,
        help="run nothing: print the roofline model of the fused kernels' step on this GPU (per launch and per step "
        "the FLOPs, the HBM, L2 and atomic bytes and each bound's time, beside the 3-GEMM bound, Cut Cross-Entropy "
        "and the step targets)",
    )
    parser.add_argument(
        "--shapes",
        choices=["issue"],
        default=None,
        help="with --model: the three reference shapes (10⁶ classes, D 512, B 1,024 and 8,192; 10⁷, 128, 4,096) "
        "instead of --classes, --dim, --batch",
    )


def _check(args: argparse.Namespace) -> None:
    if args.classes < 1 or args.dim < 1 or args.batch < 1 or args.steps < 1 or args.workers < 1:
        raise UserError("bench classifier: --classes, --dim, --batch, --steps and --workers must be positive")
    if args.batch % args.workers:
        raise UserError(f"bench classifier: --batch {args.batch} is not divisible by --workers {args.workers}")
    for r in args.sample_ratio:
        if not 0 < r <= 1:
            raise UserError(f"bench classifier: --sample-ratio {r} is not in (0, 1]")
    gpu_only_settings = gpu_only("loss.classifier.precision", args.precision) or gpu_only(
        "loss.classifier.weight_storage", args.weight_storage
    )
    if args.device == "cpu" and gpu_only_settings and not args.model:
        raise UserError(
            "bench classifier: --precision tf32/bf16 and --weight-storage bf16 need --device cuda (the CPU path computes in fp32)"
        )
    if args.sampling == "proportional" and gpu_only_settings:
        raise UserError(
            "bench classifier: --sampling proportional corrects its logits on the torch backend, in fp32: "
            "use --precision fp32 or auto and --weight-storage fp32"
        )


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def run_jobs(jobs: list[ClassifierJob], timeout: float | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run ``jobs`` in turn in one fresh interpreter (:mod:`~dmltrain.distributed.bench_runs`); their results
    (one per job: a missing one is ``{"error": ...}``) and the child's whole output. Over ``timeout`` seconds
    the child is killed: the jobs it finished keep their results."""
    cmd = [sys.executable, "-m", "dmltrain.distributed.bench_runs", *(j.to_json() for j in jobs)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        why = f"exit code {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode in (-9, 137) else "")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and the workers it started
        out, _ = proc.communicate()
        why = f"cut after {timeout:.0f} s"
    results = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    results += [{"error": why}] * (len(jobs) - len(results))
    return results[: len(jobs)], out


def _child(job: ClassifierJob) -> dict[str, Any]:
    """Run one job in a fresh interpreter and return its JSON result."""
    return run_jobs([job])[0][0]


def _fmt_step(r: dict[str, Any], unit: str = "s") -> str:
    k = 1e3 if unit == "ms" else 1.0
    return f"{r['step'] * k:.3f} {unit} (forward {r['forward'] * k:.3f}, backward {r['backward'] * k:.3f}, optimizer {r['optimizer'] * k:.3f})"


def _job(args: argparse.Namespace, R: float) -> ClassifierJob:
    return ClassifierJob(
        "ours",
        args.device,
        args.classes,
        args.dim,
        args.batch,
        args.steps,
        args.workers,
        R,
        kind=args.kind,
        optimizer=args.optimizer,
        budget=args.logits_budget_mb,
        precision=args.precision,
        storage=args.weight_storage,
        deterministic=args.deterministic,
        sampling=args.sampling,
        probe=args.probe,
    )


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.model:
        return _run_model(args)
    if args.shapes:
        raise UserError("bench classifier: --shapes goes with --model")
    return _run_cuda(args) if args.device == "cuda" else _run_cpu(args)


def _run_model(args: argparse.Namespace) -> int:
    """``--model``: the roofline tables (:mod:`~dmltrain.distributed.roofline`), no kernel run."""
    from dmltrain.distributed import roofline

    if args.sampling != "uniform" or args.probe:
        raise UserError("bench classifier --model: models the uniform draw only, without --probe")
    shapes = roofline.ISSUE_SHAPES if args.shapes == "issue" else [(args.classes, args.dim, args.batch)]
    precision = "bf16" if args.precision == "auto" else args.precision
    calls = [
        roofline.Call(
            C, D, B, args.workers, R, precision, args.deterministic, args.kind, weight_storage=args.weight_storage
        )
        for C, D, B in shapes
        for R in args.sample_ratio
    ]
    print(roofline.render(calls, GPUS[args.model]), flush=True)
    return 0


def _measure(
    args: argparse.Namespace, header: str, report: Callable[[float, dict[str, Any]], None]
) -> dict[float, dict[str, Any]]:
    """Run every sample ratio in its own process; ``report`` prints each one's lines."""
    print(header, flush=True)
    done: dict[float, dict[str, Any]] = {}
    for R in args.sample_ratio:
        res = _child(_job(args, R))
        if "error" in res:
            print(f"R={R:g}: failed, {res['error']}", flush=True)
            continue
        done[R] = res
        report(R, res)
        if "probe" in res:
            from dmltrain.distributed.class_sampling import round_total

            subsampled = round_total(args.classes, R) < args.classes
            chance = ", a uniform draw's loss" if subsampled and args.sampling != "uniform" else ""
            print(
                f"R={R:g}: probe (sampled and full softmax, embeddings' gradients only{chance}) {res['probe']:.3f} s = "
                f"{res['probe'] / res['step']:.2f}x the step (CPU time {res['probe_cpu'] / res['step_cpu']:.2f}x)",
                flush=True,
            )
    if 1.0 in done:
        for R, r in done.items():
            if R < 1.0:
                print(
                    f"R={R:g}: step {done[1.0]['step'] / r['step']:.1f}x faster than R=1 (CPU time {done[1.0]['step_cpu'] / r['step_cpu']:.1f}x)",
                    flush=True,
                )
    return done


def _run_cpu(args: argparse.Namespace) -> int:
    N, D, B, W = args.classes, args.dim, args.batch, args.workers

    def report(R: float, res: dict[str, Any]) -> None:
        K = res["gemm_classes"]
        state = res["param_bytes"] + res["opt_bytes"]
        print(
            f"R={R:g}: step {_fmt_step(res)}; logits {'kept' if res['kept'] else 'recomputed in class blocks'}",
            flush=True,
        )
        print(
            f"R={R:g}: peak RSS {_size(res['rss'])} per worker; weight + optimizer state {_size(state)}; ratio {res['rss'] / state:.2f}",
            flush=True,
        )
        print(
            f"R={R:g}: bare GEMMs (3 × {B}×{D} by {D}×{K:,}) {res['gemm']:.3f} s; step / GEMMs = {res['step'] / res['gemm']:.2f} "
            f"(in process CPU time: {res['step_cpu']:.3f} / {res['gemm_cpu']:.3f} s = {res['step_cpu'] / res['gemm_cpu']:.2f})",
            flush=True,
        )

    header = (
        f"bench classifier: {args.kind}, N={N:,} classes, D={D}, global batch B={B}, W={W} worker(s), {args.optimizer}, "
        f"{args.sampling} draws, "
        f"logits budget {args.logits_budget_mb:g} MB, {args.steps} timed steps (median) on {os.cpu_count()} CPU cores"
    )
    done = _measure(args, header, report)
    if not args.no_peer:
        for name in ("cce", "cce_exact"):
            print(f"peer {CUDA_PEERS[name][1]}: not available on the CPU (CUDA only)", flush=True)
        peer = _cpu_peer(N, D, B, args.steps)
        if "error" in peer:
            print(f"peer pytorch-metric-learning NormalizedSoftmaxLoss: {peer['error']}", flush=True)
        else:
            print(
                f"peer pytorch-metric-learning NormalizedSoftmaxLoss + torch SGD (1 process, full softmax): step {_fmt_step(peer)}; "
                f"peak RSS {_size(peer['rss'])}",
                flush=True,
            )
            if 1.0 in done:
                r = done[1.0]
                print(
                    f"ours at R=1 vs peer: step {peer['step'] / r['step']:.2f}x faster (CPU time {peer['step_cpu'] / r['step_cpu']:.2f}x), "
                    f"peak RSS {r['rss'] / peer['rss']:.2f}x of the peer's",
                    flush=True,
                )
    return 0 if done else 1


def _cpu_peer(N: int, D: int, B: int, steps: int) -> dict[str, Any]:
    if not _installed("pytorch_metric_learning"):
        return {"error": "not installed"}
    # W, its gradient, momentum, the normalised copy (twice, PML normalises again) and B×N logits + grads
    need = 5 * N * D * 4 + 3 * B * N * 4
    if need > 0.8 * _mem_available():
        return {"error": f"skipped: needs about {need / GIB:.1f} GiB, {_mem_available() / GIB:.1f} GiB available"}
    return _child(ClassifierJob("peer", "cpu", N, D, B, steps))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _run_cuda(args: argparse.Namespace) -> int:
    N, D, B, W = args.classes, args.dim, args.batch, args.workers
    precision = "bf16" if args.precision == "auto" else args.precision

    def report(R: float, res: dict[str, Any]) -> None:
        K = res["gemm_classes"]
        state = 2 * res["param_bytes"] + res["opt_bytes"]  # weight, its gradient, optimizer state
        print(f"R={R:g}: step {_fmt_step(res, 'ms')}", flush=True)
        print(
            f"R={R:g}: forward + backward {res['fwd_bwd'] * 1e3:.3f} ms (the bound's and the peers' like for like); "
            f"the optimizer's row update {res['optimizer'] * 1e3:.3f} ms",
            flush=True,
        )
        print(
            f"R={R:g}: peak GPU memory {_size(res['peak_gpu'])} per GPU; weight + gradient + optimizer state {_size(state)}; "
            f"excess {_size(res['peak_gpu'] - state)}",
            flush=True,
        )
        print(
            f"R={R:g}: bf16 3-GEMM bound (3 × {B}×{D} by {D}×{K:,}) {res['gemm'] * 1e3:.3f} ms; forward + backward / bound = "
            f"{res['fwd_bwd'] / res['gemm']:.2f}",
            flush=True,
        )

    header = (
        f"bench classifier (cuda, fused kernels): {args.kind}, N={N:,} classes, D={D}, global batch B={B}, W={W} GPU(s), "
        f"{precision} products, {args.weight_storage} weight, {args.optimizer}, "
        f"{'deterministic' if args.deterministic else 'atomic'} backward, {args.steps} timed steps (median)"
    )
    done = _measure(args, header, report)
    if not args.no_peer and done:
        for name in CUDA_PEERS:
            _print_cuda_peer(name, args, done.get(1.0))
    return 0 if done else 1


def _print_cuda_peer(name: str, args: argparse.Namespace, ours: dict[str, Any] | None) -> None:
    module, label = CUDA_PEERS[name]
    if not _installed(module):
        print(f"peer {label}: skipped, {module} is not installed", flush=True)
        return
    res = _child(ClassifierJob("peer", "cuda", args.classes, args.dim, args.batch, args.steps, peer=name))
    if "error" in res or "absent" in res:
        print(f"peer {label}: {res.get('error') or res['absent']}", flush=True)
        return
    fb = res["forward"] + res["backward"]
    line = f"peer {label}: forward + backward {fb * 1e3:.3f} ms, peak GPU memory {_size(res['peak_gpu'])}"
    if ours is not None:
        our_fb = ours["fwd_bwd"]
        line += f"; ours at R=1 (forward + backward {our_fb * 1e3:.3f} ms) is {fb / our_fb:.2f}x faster"
    print(line, flush=True)
