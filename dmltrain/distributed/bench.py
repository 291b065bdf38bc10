"""``dmltrain bench classifier``: sharded classifier step time and peak memory vs its GEMM bound.

Each configuration runs in a fresh process (``W`` processes joined by gloo when
``--workers W`` > 1) so that peak RSS is its own. One step = forward, backward and the
row-sparse SGD-momentum step on random embeddings and uniformly random labels. In the same
process, after the run, the three bare GEMMs of that step (``B×D`` by ``D×K`` for the forward
logits, and the two backward products, with ``K = R·N/W`` active classes per worker) are
timed; the ratio of step time to them is the overhead of everything else (normalisation,
softmax, margins, collectives, optimizer). Alongside, pytorch-metric-learning's
``NormalizedSoftmaxLoss`` with ``torch.optim.SGD`` (one process, full softmax) runs at the
same N, D, B when it is installed and fits in memory.

Peak RSS is the process's high-water mark, read before the GEMM measurement. Times are
wall clock (median over the timed steps); the ratios are also given in process CPU time,
which a machine shared with other jobs distorts less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

GIB = 2**30


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--classes", type=int, default=1_000_000, metavar="N", help="number of classes (default 1e6)")
    parser.add_argument("--dim", type=int, default=512, metavar="D", help="embedding dimension (default 512)")
    parser.add_argument("--batch", type=int, default=256, metavar="B", help="global batch (default 256)")
    parser.add_argument(
        "--sample-ratio", type=float, nargs="+", default=[1.0], metavar="R", help="share of classes per step; several values compare them"
    )
    parser.add_argument("--workers", type=int, default=1, metavar="W", help="gloo processes sharing the classes (default 1)")
    parser.add_argument("--steps", type=int, default=3, metavar="S", help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--kind", default="normsoftmax", choices=["normsoftmax", "cosface", "arcface", "softmax_ce"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--logits-budget-mb", type=float, default=256.0, metavar="MB", help="the classifier's logits budget (default 256, as the config)")
    parser.add_argument("--no-peer", action="store_true", help="skip pytorch-metric-learning's NormalizedSoftmaxLoss")


def _check(args: argparse.Namespace) -> None:
    from dmltrain.errors import UserError

    if args.classes < 1 or args.dim < 1 or args.batch < 1 or args.steps < 1 or args.workers < 1:
        raise UserError("bench classifier: --classes, --dim, --batch, --steps and --workers must be positive")
    if args.batch % args.workers:
        raise UserError(f"bench classifier: --batch {args.batch} is not divisible by --workers {args.workers}")
    for r in args.sample_ratio:
        if not 0 < r <= 1:
            raise UserError(f"bench classifier: --sample-ratio {r} is not in (0, 1]")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _child(job: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter and return its JSON result."""
    cmd = [sys.executable, "-m", "dmltrain.distributed.bench", json.dumps(job)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit code {proc.returncode}" + (" (killed: out of memory?)" if proc.returncode in (-9, 137) else "")}
    return json.loads(lines[-1])


def _fmt_step(r: dict[str, Any]) -> str:
    return f"{r['step']:.3f} s (forward {r['forward']:.3f}, backward {r['backward']:.3f}, optimizer {r['optimizer']:.3f})"


def run(args: argparse.Namespace) -> int:
    _check(args)
    N, D, B, W = args.classes, args.dim, args.batch, args.workers
    print(
        f"bench classifier: {args.kind}, N={N:,} classes, D={D}, global batch B={B}, W={W} worker(s), {args.optimizer}, "
        f"logits budget {args.logits_budget_mb:g} MB, {args.steps} timed steps (median) on {os.cpu_count()} CPU cores",
        flush=True,
    )
    ours: dict[float, dict[str, Any]] = {}
    for R in args.sample_ratio:
        job = dict(role="ours", N=N, D=D, B=B, W=W, R=R, steps=args.steps, kind=args.kind, optimizer=args.optimizer, budget=args.logits_budget_mb)
        res = _child(job)
        ours[R] = res
        if "error" in res:
            print(f"R={R:g}: failed, {res['error']}", flush=True)
            continue
        K = res["gemm_classes"]
        print(f"R={R:g}: step {_fmt_step(res)}; logits {'kept' if res['kept'] else 'recomputed in class blocks'}", flush=True)
        print(
            f"R={R:g}: peak RSS {_size(res['rss'])} per worker; weight + optimizer state {_size(res['state_bytes'])}; "
            f"ratio {res['rss'] / res['state_bytes']:.2f}",
            flush=True,
        )
        print(
            f"R={R:g}: bare GEMMs (3 × {B}×{D} by {D}×{K:,}) {res['gemm']:.3f} s; step / GEMMs = {res['step'] / res['gemm']:.2f} "
            f"(in process CPU time: {res['step_cpu']:.3f} / {res['gemm_cpu']:.3f} s = {res['step_cpu'] / res['gemm_cpu']:.2f})",
            flush=True,
        )
    done = {R: r for R, r in ours.items() if "error" not in r}
    if 1.0 in done:
        for R, r in done.items():
            if R < 1.0:
                print(
                    f"R={R:g}: step {done[1.0]['step'] / r['step']:.1f}x faster than R=1 "
                    f"(CPU time {done[1.0]['step_cpu'] / r['step_cpu']:.1f}x)",
                    flush=True,
                )
    if not args.no_peer:
        peer = _peer(N, D, B, args.steps)
        if "error" in peer:
            print(f"peer pytorch-metric-learning NormalizedSoftmaxLoss: {peer['error']}", flush=True)
        else:
            print(f"peer pytorch-metric-learning NormalizedSoftmaxLoss + torch SGD (1 process, full softmax): step {_fmt_step(peer)}; "
                  f"peak RSS {_size(peer['rss'])}", flush=True)
            if 1.0 in done:
                r = done[1.0]
                print(
                    f"ours at R=1 vs peer: step {peer['step'] / r['step']:.2f}x faster (CPU time {peer['step_cpu'] / r['step_cpu']:.2f}x), "
                    f"peak RSS {r['rss'] / peer['rss']:.2f}x of the peer's",
                    flush=True,
                )
    return 0 if done else 1


def _peer(N: int, D: int, B: int, steps: int) -> dict[str, Any]:
    try:
        import importlib.util

        if importlib.util.find_spec("pytorch_metric_learning") is None:
            return {"error": "not installed"}
    except (ImportError, ValueError):
        return {"error": "not installed"}
    # W, its gradient, momentum, the normalised copy (twice, PML normalises again) and B×N logits + grads
    need = 5 * N * D * 4 + 3 * B * N * 4
    if need > 0.8 * _mem_available():
        return {"error": f"skipped: needs about {need / GIB:.1f} GiB, {_mem_available() / GIB:.1f} GiB available"}
    return _child(dict(role="peer", N=N, D=D, B=B, steps=steps))


# -- child processes ------------------------------------------------------------------------------------
def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _timed_phases(forward, opt) -> dict[str, float]:
    """Seconds of one training step's forward (``forward()`` returns the loss), backward and optimizer step."""
    t0 = time.perf_counter()
    loss = forward()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}


def _time_steps(step_fn, steps: int, desc: str) -> dict[str, float]:
    from tqdm import tqdm


    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    cpu: list[float] = []
    for i in tqdm(range(steps + 1), desc=desc, file=sys.stderr, leave=False):
        c0 = time.process_time()
        t = step_fn(i)
        if i:  # the first step warms up
            cpu.append(time.process_time() - c0)
            for k in parts:
                parts[k].append(t[k])
    out = {k: _median(v) for k, v in parts.items()}
    totals = [sum(parts[k][i] for k in parts) for i in range(steps)]
    out["step"] = _median(totals)
    out["step_cpu"] = _median(cpu)
    return out


def _gemm_bound(x, weight, K: int, steps: int) -> float:
    """Median time of the step's three bare GEMMs on the first K rows of ``weight``."""

    import torch

    w = weight.detach()[:K]
    B = x.shape[0]
    # Whole products while the B×K logits stay under 1 GiB, else column blocks of 256 MiB
    # (N = 1e7 would need 10 GiB of logits and 5 GiB of weight gradient on top of the run).
    cols = K if B * K * 4 <= GIB else max(1, (GIB // 4) // (4 * B))
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(0, K, cols):
            wb = w[s : s + cols]
            z = torch.mm(x, wb.t())
            torch.mm(z, wb)
            torch.mm(z.t(), x)
            del z
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return _median(times), _median(cpu)


def _ours_rank(rank: int, job: dict[str, Any]) -> dict[str, Any]:

    import torch

    from dmltrain.distributed import ShardedClassifier, make_classifier_optimizer

    N, D, B, W, R = job["N"], job["D"], job["B"], job["W"], job["R"]
    b = B // W
    clf = ShardedClassifier(N, D, job["kind"], sample_ratio=R, seed=0, logits_budget_mb=job["budget"])
    opt = make_classifier_optimizer(clf, job["optimizer"], lr=0.01, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(rank)

    def step(i: int) -> dict[str, float]:
        x = torch.randn(b, D, generator=gen).requires_grad_(True)
        y = torch.randint(0, N, (b,), generator=gen)
        return _timed_phases(lambda: clf(x, y, step=i), opt)

    res: dict[str, Any] = _time_steps(step, job["steps"], f"R={R:g} rank {rank}")
    res["rss"] = _peak_rss()
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    res["state_bytes"] = state + sum(p.numel() * p.element_size() for p in clf.parameters())
    res["kept"] = bool(clf.stats.get("logits_kept", 0))
    K = max(1, min(clf.num_local, int(round(R * N / W))))
    res["gemm_classes"] = K
    x = torch.randn(B, D)
    res["gemm"], res["gemm_cpu"] = _gemm_bound(x, clf.weight, K, job["steps"])
    return res


def _dist_entry(rank: int, job: dict[str, Any], port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job["W"]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=job["W"])
    try:
        queue.put((rank, _ours_rank(rank, job)))
    finally:
        dist.destroy_process_group()


def _ours(job: dict[str, Any]) -> dict[str, Any]:
    if job["W"] == 1:
        return _ours_rank(0, job)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_dist_entry, args=(r, job, port, queue)) for r in range(job["W"])]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, res = queue.get()
        results[rank] = res
    for p in procs:
        p.join()
    # the slowest worker sets the pace; memory is per worker
    worst = max(results.values(), key=lambda r: r["step"])
    out = dict(worst)
    out["rss"] = max(r["rss"] for r in results.values())
    out["state_bytes"] = max(r["state_bytes"] for r in results.values())
    return out


def _peer_run(job: dict[str, Any]) -> dict[str, Any]:

    import torch
    from pytorch_metric_learning.losses import NormalizedSoftmaxLoss

    N, D, B = job["N"], job["D"], job["B"]
    loss_fn = NormalizedSoftmaxLoss(N, D, temperature=0.05)
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> dict[str, float]:
        x = torch.randn(B, D, generator=gen).requires_grad_(True)
        y = torch.randint(0, N, (B,), generator=gen)
        return _timed_phases(lambda: loss_fn(x, y), opt)

    res: dict[str, Any] = _time_steps(step, job["steps"], "peer")
    res["rss"] = _peak_rss()
    return res


def _child_main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    res = _ours(job) if job["role"] == "ours" else _peer_run(job)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1:])
