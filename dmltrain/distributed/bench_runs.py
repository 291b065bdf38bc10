"""The measured runs of ``dmltrain bench classifier``, in fresh processes.

``python -m dmltrain.distributed.bench_runs JOB_JSON [JOB_JSON ...]`` runs each job
(:class:`~dmltrain.distributed.bench_job.ClassifierJob`) in turn and prints each result as one
JSON line as soon as it has it (a job that fails gives ``{"error": ...}`` and the next one runs).
Jobs (``role``):

* ``ours``: the sharded classifier's steps (forward, backward, row-sparse optimizer, each timed
  apart) on random embeddings and uniform labels, ``W`` processes joined by gloo (CPU) or NCCL
  (one GPU each); then, in the same process, the step's three bare GEMMs (fp32 on the CPU, bf16
  on CUDA: the tensor-core bound of forward + backward). On CUDA the weight is made on the GPU.
* ``peer``: a peer's forward and backward at the same N, D, B: on the CPU
  pytorch-metric-learning's ``NormalizedSoftmaxLoss`` with ``torch.optim.SGD`` (its step is
  included, as ours); on CUDA (forward + backward only) Cut Cross-Entropy (its default
  gradient filter, and exact: no filter), Liger's fused linear cross-entropy, naive torch bf16
  (the ``B × N`` logits held) and pytorch-metric-learning, each on NormSoftmax's normalised logits
  at T = 0.05. A peer that is not installed gives ``{"absent": ...}``.

Times are medians over the timed steps after one warm-up step; on CUDA every phase ends with
a device synchronisation. Memory: peak RSS on the CPU, ``torch.cuda.max_memory_allocated``
on CUDA.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tqdm import tqdm

from dmltrain.distributed.bench_job import CUDA_PEERS, ClassifierJob
from dmltrain.distributed.classifier_head import make_classifier_optimizer
from dmltrain.distributed.process_group import free_port, init_local_group
from dmltrain.distributed.sharded_softmax import ShardedClassifier

GIB = 2**30
TEMPERATURE = 0.05


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_phases(forward: Callable[[], torch.Tensor], opt: Any, device: torch.device) -> dict[str, float]:
    """Seconds of one step's forward (``forward()`` returns the loss), backward and optimizer step."""
    _sync(device)
    t0 = time.perf_counter()
    loss = forward()
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    if opt is not None:
        opt.step()
        opt.zero_grad()
        _sync(device)
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}


def _time_steps(step_fn: Callable[[int], dict[str, float]], steps: int, desc: str) -> dict[str, float]:
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    cpu: list[float] = []
    for i in tqdm(range(steps + 1), desc=desc, file=sys.stderr, leave=False):
        c0 = time.process_time()
        t = step_fn(i)
        if i:  # the first step warms up (and autotunes the kernels)
            cpu.append(time.process_time() - c0)
            for k in parts:
                parts[k].append(t[k])
    out = {k: _median(v) for k, v in parts.items()}
    out["step"] = _median([sum(parts[k][i] for k in parts) for i in range(steps)])
    out["fwd_bwd"] = _median([parts["forward"][i] + parts["backward"][i] for i in range(steps)])
    out["step_cpu"] = _median(cpu)
    return out


def _gemm_bound(x: torch.Tensor, w: torch.Tensor, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of the step's three bare GEMMs, ``x`` (``B×D``) against the
    ``K×D`` rows ``w`` in the same dtype: the logits, then the two backward products."""
    B, K = x.shape[0], w.shape[0]
    # Whole products while the B×K logits stay under 1 GiB, else column blocks of 256 MiB
    # (N = 1e7 would need 10 GiB of logits and 5 GiB of weight gradient on top of the run).
    size = x.element_size()
    cols = K if B * K * size <= GIB else max(1, (GIB // size) // (4 * B))
    times, cpu = [], []
    for _ in range(steps):
        _sync(x.device)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(0, K, cols):
            wb = w[s : s + cols]
            z = torch.mm(x, wb.t())
            torch.mm(z, wb)
            torch.mm(z.t(), x)
            del z
        _sync(x.device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return _median(times), _median(cpu)


# -- ours -----------------------------------------------------------------------------------------------
def classifier_kwargs(job: ClassifierJob) -> dict[str, Any]:
    """The :class:`ShardedClassifier` arguments of ``job`` beyond ``(N, D)`` (what the child reads of it)."""
    kwargs: dict[str, Any] = dict(
        kind=job.kind,
        sample_ratio=job.R,
        seed=0,
        logits_budget_mb=job.budget,
        sampling=job.sampling,
        refresh_every=10**9,
    )
    if job.device == "cuda":
        kwargs |= dict(precision=job.precision, weight_storage=job.storage, deterministic=job.deterministic)
    return kwargs


def build_classifier(job: ClassifierJob, device: torch.device, drawn_there: bool | None = None) -> ShardedClassifier:
    """The classifier of ``job`` on ``device``. On CUDA (``drawn_there``) it is laid out on the meta device and
    its rows drawn where they live (N(0, 1/D), as its own initialisation; softmax_ce's zeros): a 10⁷-row weight
    is neither drawn nor copied on the host."""
    if not (device.type == "cuda" if drawn_there is None else drawn_there):
        return ShardedClassifier(job.N, job.D, **classifier_kwargs(job)).to(device)
    with torch.device("meta"):
        clf = ShardedClassifier(job.N, job.D, **classifier_kwargs(job))
    # swapped in place, not replaced: the classifier hands its row gradients to the optimizer through the very
    # Parameter objects it made (its RowGrads), which a plain to_empty from meta would replace with new ones
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        clf.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    gen = torch.Generator(device=device).manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    with torch.no_grad():
        if clf.bias is not None:
            clf.weight.zero_()
            clf.bias.zero_()
        else:
            clf.weight.normal_(0.0, job.D**-0.5, generator=gen)
    return clf


def _ours_rank(rank: int, job: ClassifierJob) -> dict[str, Any]:
    N, D, B, W, R = job.N, job.D, job.B, job.W, job.R
    device = torch.device("cuda", rank) if job.device == "cuda" else torch.device("cpu")
    b = B // W
    clf = build_classifier(job, device)
    opt = make_classifier_optimizer(clf, job.optimizer, lr=0.01, momentum=0.9, weight_decay=1e-4, seed=rank)
    gen = torch.Generator().manual_seed(rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i: int) -> dict[str, float]:
        x = torch.randn(b, D, generator=gen).to(device).requires_grad_(True)
        y = torch.randint(0, N, (b,), generator=gen).to(device)
        return _timed_phases(lambda: clf(x, y, step=i), opt, device)

    res: dict[str, Any] = _time_steps(step, job.steps, f"R={R:g} rank {rank}")
    if job.probe:
        times, cpu = [], []
        for i in range(job.steps):
            x = torch.randn(b, D, generator=gen).to(device)
            y = torch.randint(0, N, (b,), generator=gen).to(device)
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            clf.probe(x, y, step=i, sizes=[b] * W)
            _sync(device)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        res["probe"], res["probe_cpu"] = _median(times), _median(cpu)
    res["rss"] = _peak_rss()
    res["opt_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    res["param_bytes"] = sum(p.numel() * p.element_size() for p in clf.parameters())
    res["kept"] = bool(clf.stats.get("logits_kept", 0))
    K = max(1, min(clf.num_local, int(round(R * N / W))))
    res["gemm_classes"] = K
    w = clf.weight.detach()[:K]
    if device.type == "cuda":  # the tensor-core bound: bf16 operands (a copy made before the clock starts)
        res["peak_gpu"] = torch.cuda.max_memory_allocated(device)
        x, w = torch.randn(B, D, device=device, dtype=torch.bfloat16), w.to(torch.bfloat16)
    else:
        x = torch.randn(B, D)
    res["gemm"], res["gemm_cpu"] = _gemm_bound(x, w, job.steps)
    return res


def _dist_entry(rank: int, job: ClassifierJob, port: int, queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.W))
    backend = "nccl" if job.device == "cuda" else "gloo"
    if job.device == "cuda":
        torch.cuda.set_device(rank)
    init_local_group(backend, rank, job.W, port)
    try:
        queue.put((rank, _ours_rank(rank, job)))
    finally:
        dist.destroy_process_group()


def _ours(job: ClassifierJob) -> dict[str, Any]:
    if job.device == "cuda" and torch.cuda.device_count() < job.W:
        return {"error": f"--device cuda with --workers {job.W} needs {job.W} GPUs, found {torch.cuda.device_count()}"}
    if job.W == 1:
        return _ours_rank(0, job)
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_dist_entry, args=(r, job, port, queue)) for r in range(job.W)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, res = queue.get()
        results[rank] = res
    for p in procs:
        p.join()
    # the slowest worker sets the pace; memory is per worker
    out = dict(max(results.values(), key=lambda r: r["step"]))
    for key in ("rss", "opt_bytes", "param_bytes", "peak_gpu"):
        if key in out:
            out[key] = max(r[key] for r in results.values())
    return out


# -- peers ----------------------------------------------------------------------------------------------
# The peers' packages are optional: each is imported only by the job that measures it.
def _peer_cpu(job: ClassifierJob) -> dict[str, Any]:
    from pytorch_metric_learning.losses import NormalizedSoftmaxLoss

    N, D, B = job.N, job.D, job.B
    loss_fn = NormalizedSoftmaxLoss(N, D, temperature=TEMPERATURE)
    opt = torch.optim.SGD(loss_fn.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")

    def step(i: int) -> dict[str, float]:
        x = torch.randn(B, D, generator=gen).requires_grad_(True)
        y = torch.randint(0, N, (B,), generator=gen)
        return _timed_phases(lambda: loss_fn(x, y), opt, cpu)

    res: dict[str, Any] = _time_steps(step, job.steps, "peer")
    res["rss"] = _peak_rss()
    return res


def peer_loss(
    name: str, N: int, D: int, device: torch.device
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], list]:
    """The peer's loss of (embeddings, labels) with NormSoftmax's logits ``x̂·ŵ / T``, and its parameters (the
    Triton peers also run on the CPU under ``TRITON_INTERPRET=1``, which the tests use)."""
    if name == "pml":
        from pytorch_metric_learning.losses import NormalizedSoftmaxLoss

        module = NormalizedSoftmaxLoss(N, D, temperature=TEMPERATURE).to(device)
        return module, list(module.parameters())
    weight = torch.nn.Parameter(torch.randn(N, D, device=device) * D**-0.5)
    if name in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy

        # exact: no gradient filter (filter_eps=None, in every release; later ones also name it impl="cce_exact")
        exact = {"filter_eps": None} if name == "cce_exact" else {}

        def cce(x, y):
            e = (F.normalize(x, dim=1) / TEMPERATURE).bfloat16()
            return linear_cross_entropy(e, F.normalize(weight, dim=1).bfloat16(), y, **exact)

        return cce, [weight]
    if name == "liger":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()

        def fused(x, y):
            e = (F.normalize(x, dim=1) / TEMPERATURE).bfloat16()
            return liger(F.normalize(weight, dim=1).bfloat16(), e, y)

        return fused, [weight]

    def naive(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = F.normalize(x, dim=1) @ F.normalize(weight, dim=1).t() / TEMPERATURE
            return F.cross_entropy(logits, y)

    return naive, [weight]


def _peer_cuda(job: ClassifierJob) -> dict[str, Any]:
    N, D, B = job.N, job.D, job.B
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(0)
    try:
        loss_fn, params = peer_loss(job.peer, N, D, device)
        torch.cuda.reset_peak_memory_stats(device)

        def step(i: int) -> dict[str, float]:
            for p in params:
                p.grad = None
            x = torch.randn(B, D, generator=gen).to(device).requires_grad_(True)
            y = torch.randint(0, N, (B,), generator=gen).to(device)
            return _timed_phases(lambda: loss_fn(x, y), None, device)

        res: dict[str, Any] = _time_steps(step, job.steps, job.peer)
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}
    res["peak_gpu"] = torch.cuda.max_memory_allocated(device)
    return res


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def run_job(job: ClassifierJob) -> dict[str, Any]:
    """One job's result: its figures, ``{"error": ...}`` or, for a peer not installed, ``{"absent": ...}``."""
    if job.device == "cuda" and not torch.cuda.is_available():
        return {"error": "no CUDA GPU (torch.cuda.is_available() is False)"}
    if job.role == "peer":
        module = CUDA_PEERS[job.peer][0] if job.device == "cuda" else "pytorch_metric_learning"
        if not _installed(module):
            return {"absent": f"{module} is not installed"}
        return _peer_cuda(job) if job.device == "cuda" else _peer_cpu(job)
    try:
        return _ours(job)
    except torch.cuda.OutOfMemoryError:
        return {"error": "out of memory"}


def main(argv: list[str]) -> int:
    """Each job in turn, its result printed as one JSON line when it has it; the memory of one is freed before
    the next starts, so each peak is its own."""
    from dmltrain.text import one_line

    jobs = []
    for text in argv:
        try:
            jobs.append(ClassifierJob.from_json(text))
        except ValueError as e:
            print(json.dumps({"error": str(e)}), flush=True)
            return 2
    for job in jobs:
        try:
            res = run_job(job)
        except Exception as e:  # noqa: BLE001 — one job's failure is its result; the next job still runs
            res = {"error": one_line(e)}
        print(json.dumps(res), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
