"""``make gpu-check`` (``python -m dmltrain.gpu_check``): every GPU path of the project proved in one call.

GPU time comes in short leases (15 minutes, a few of them starting the machine), so one command runs,
within 7 minutes, the scarcest figures first:

1. ``classifier``: the kernels compiled and tuned once at every width (timed: the first call's cost),
   then the fused classifier step at 10⁶×512 with B = 1,024 and 8,192 and at 10⁷×128 with B = 4,096,
   each at sample ratios 1 and 0.1 (forward + backward against the bf16 3-GEMM bound, the optimizer's
   row update apart, peak memory), and beside each shape the peers in the same call: Cut
   Cross-Entropy (default filter and exact), Liger-Kernel's fused linear cross-entropy, naive torch
   where its logits fit (``dmltrain bench classifier``'s jobs, :class:`ClassifierJob`);
2. ``train``: ``dmltrain bench train`` with ResNet-50 at 224 px, bf16, channels_last, B = 128;
3. ``eval``: ``dmltrain bench eval`` at the SOP test set's size;
4. ``doctor``: ``dmltrain doctor`` for a one-GPU training (``cluster.use_gpu=true cluster.num_workers=1``);
5. ``tests``: the suite's CUDA tests (``pytest -m cuda``), each under its own timeout, each result
   written as it ends;
6. ``compile``: ``dmltrain bench train --compile`` with timm's ViT-S/16 at 224 px, bf16, B = 64: eager and
   ``torch.compile``'d images/s side by side, compile time and graph breaks; last, in the time the others
   left (``--only compile`` runs it alone).

Each part runs in child processes (their own process groups) under a time budget; a part over its
budget is cut (its processes killed) and says so, a part that fails gives its error line, and the
next part runs either way. Rows are kept as they are measured: the JSON (and its Markdown table) is
rewritten after every row, so a cut part, or a cut call, keeps what it measured. The result is ONE
table (part, what, figure, its bound or peer measured in the same run, ratio, target, verdict),
printed as Markdown (to paste into a note or the README), and written as JSON with the same rows,
each part's status and time and the torch, Triton and CUDA versions, beside a log of every child's
output (``--out``: default ``gpu-check/``, files named by the start time).

``--dry-run`` builds every full-size job of every part and checks each against what its child reads
(the classifier jobs against :class:`~dmltrain.distributed.bench_job.ClassifierJob` and the classifier's
signature, the bench and doctor command lines against the ``dmltrain`` parser), in seconds, no GPU needed.
``--device cpu --tiny`` runs the same parts on the CPU at toy sizes (seconds; the tests use it):
no targets apply there, its verdicts are ``info``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from dmltrain.distributed.bench_job import CUDA_PEERS, ClassifierJob

#: part -> seconds it may take, in the order they run (the whole run: at most TOTAL_BUDGET_S)
BUDGETS = {"classifier": 210.0, "train": 60.0, "eval": 50.0, "doctor": 30.0, "tests": 120.0, "compile": 150.0}
TOTAL_BUDGET_S = 420.0
PARTS = tuple(BUDGETS)
GIB = 2**30
#: seconds one CUDA test may take before pytest-timeout ends it (the rest still run)
TEST_TIMEOUT_S = 45

#: (classes, dim, batch) of the classifier part; sample ratios; the peers measured at each shape
CLASSIFIER_SHAPES = ((1_000_000, 512, 1024), (1_000_000, 512, 8192), (10_000_000, 128, 4096))
RATIOS = (1.0, 0.1)
PEERS = ("cce", "cce_exact", "liger", "naive")
#: the naive peer's bytes per logit: bf16 logits (2), autocast's fp32 log-softmax (4) and, in backward, its fp32
#: gradient (4) and the logits' bf16 one (2), and a cast's fp32 copy (4); the share of the GPU's memory they may take
NAIVE_BYTES_PER_LOGIT = 16
NAIVE_MEMORY_SHARE = 0.6
TINY_SHAPES = ((2000, 16, 32), (3000, 8, 16))
TINY_RATIOS = (1.0, 0.5)
#: the warm-up's classes and batch: small, multiples of 16 at both ratios (the integers a launch specialises on)
WARM_N, WARM_B = 10_240, 64
#: targets (issue 27 and the README's benchmark table); on CUDA only
STEP_BOUND_X = 2.0  # step <= 2x the bf16 3-GEMM bound
MEMORY_EXCESS = GIB  # peak GPU memory <= weight + gradient + optimizer state + 1 GiB
SUBSAMPLE_SPEEDUP = 7.0  # R = 0.1 at least 7x faster than R = 1
TRAIN_RATIO = 0.85  # full pipeline >= 0.85x the bare backbone
DATA_WAIT = 0.05  # <= 5% of step time waiting for data
RECALL_X = 2.0  # Recall within 2x the GEMM on a GPU
BINARY_X = 4.0  # the binary path >= 4x faster than float at 2048 dims
KMEANS_S = 3.0  # k-means at SOP size within 3 s on a GPU


@dataclass
class Row:
    """One line of the table; ``verdict`` is pass, FAIL, info (no target), cut, error or skipped."""

    part: str
    what: str
    figure: str
    reference: str = ""
    ratio: float | None = None
    target: str = ""
    verdict: str = "info"


@dataclass
class PartResult:
    name: str
    status: str = "done"  # done, cut, error, skipped
    seconds: float = 0.0
    budget_s: float = 0.0
    error: str = ""


class Cut(Exception):
    """A part ran past its budget (its child processes are killed); ``output``: what the child printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass
class Context:
    """What every part gets: the device, the sizes, a log, and a clock with the part's deadline."""

    device: str
    tiny: bool
    work: Path
    log_path: Path
    pytest_args: list[str] = field(default_factory=lambda: ["-m", "cuda"])
    deadline: float = 0.0

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def child(
        self, args: Sequence[str], what: str, on_line: Callable[[str], None] | None = None, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``python args...`` in its own process group until the part's deadline; its output goes to the
        log (and comes back), each line also to ``on_line`` as it arrives. Over the deadline the whole group is
        killed and :class:`Cut` raised, with what the child printed until then."""
        left = self.left()
        if left <= 0:
            raise Cut(f"no time left for {what}")
        cmd = [sys.executable, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        lines: list[str] = []
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {what}: {' '.join(cmd)}\n")
            log.flush()
            # errors="replace": one undecodable byte must not end the reading (the part would wait for its cut)
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
                start_new_session=True,
            )
            got: queue.Queue[str | None] = queue.Queue()

            def pump() -> None:
                for line in proc.stdout:
                    got.put(line)
                got.put(None)

            threading.Thread(target=pump, daemon=True).start()
            try:
                while True:
                    try:
                        line = got.get(timeout=max(0.0, self.left()))
                    except queue.Empty:
                        raise Cut(f"{what} was still running", "".join(lines)) from None
                    if line is None:
                        break
                    lines.append(line)
                    log.write(line)
                    log.flush()
                    if on_line is not None:
                        on_line(line)
            except BaseException:  # a cut, or a line its reader could not take: no child outlives the part
                os.killpg(proc.pid, signal.SIGKILL)  # the child and everything it started (loaders, bench runs)
                proc.wait()
                raise
            proc.wait()
        return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), "")


def _last_error(out: str) -> str:
    """The line that says what went wrong in a child's output (its last error line, else its last line)."""
    from dmltrain.text import one_line

    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "Error" in ln or "FAILED" in ln]
    return one_line((errors or lines or ["no output"])[-1], 200)


def _check(ok: bool, cuda: bool) -> str:
    return ("pass" if ok else "FAIL") if cuda else "info"


# -- dmltrain doctor ---------------------------------------------------------------------------------------
def doctor_args(ctx: Context, path: Path) -> list[str]:
    overrides = ["cluster.use_gpu=true", "cluster.num_workers=1"] if ctx.cuda else []
    skip = ["--skip", "ray"] if ctx.tiny else []  # a local Ray takes 5-25 s to start on a small CPU machine
    return ["-m", "dmltrain", "doctor", *overrides, *skip, "--json", str(path)]


def part_doctor(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "doctor.json"
    try:
        proc = ctx.child(doctor_args(ctx, path), "dmltrain doctor")
    except Cut as e:  # the lines it printed before the cut still say what works
        rows += doctor_rows(printed_checks(e.output))
        raise
    if not path.exists():
        raise RuntimeError(f"dmltrain doctor wrote no result (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    checks = json.loads(path.read_text())["checks"]
    rows += doctor_rows(checks)
    missing = [c["name"] for c in checks if c["status"] == "MISSING"]
    summary = f"{sum(c['status'] == 'ok' for c in checks)} ok, {len(missing)} missing"
    target = "nothing a one-GPU training needs missing"
    rows.append(Row("doctor", "summary", summary, target=target, verdict="FAIL" if missing else "pass"))


def printed_checks(text: str) -> list[dict[str, str]]:
    """The checks in ``dmltrain doctor``'s printed lines (``status name detail``), for a run cut short."""
    from dmltrain.doctor import CHECKS

    out = []
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] in ("ok", "absent", "MISSING") and parts[1] in CHECKS:
            needed = "yes" if "(needed: " in parts[2] else ""
            out.append({"name": parts[1], "status": parts[0], "detail": parts[2], "needed": needed})
    return out


def doctor_rows(checks: list[dict[str, str]]) -> list[Row]:
    """One row per check: ok passes, absent is information, MISSING fails."""
    from dmltrain.text import clip

    verdicts = {"ok": "pass", "absent": "info", "MISSING": "FAIL"}
    return [
        Row(
            "doctor",
            c["name"],
            clip(c["detail"], 110),
            target="works" if c["needed"] else "",
            verdict=verdicts[c["status"]],
        )
        for c in checks
    ]


# -- the CUDA tests ----------------------------------------------------------------------------------
def tests_args(ctx: Context, log: Path) -> tuple[list[str], dict[str, str]]:
    """pytest's command line (the modules that hold CUDA tests, a timeout per test where pytest-timeout is
    installed) and the environment that makes ``tests/conftest.py`` write each result to ``log`` as it ends."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not tests.is_dir():
        raise RuntimeError(f"no test suite at {tests}: run it from a checkout of the project")
    # only the modules that hold CUDA tests: the others need not even import here (a GPU machine with the
    # bundle lacks the S3 test stack, for one)
    files = [str(p) for p in sorted(tests.glob("test_*.py")) if "mark.cuda" in p.read_text()]
    timeout = [f"--timeout={TEST_TIMEOUT_S}"] if _installed("pytest_timeout") else []
    args = ["-m", "pytest", *files, *ctx.pytest_args, *timeout, "-q", "-p", "no:cacheprovider"]
    return args, {"DMLTRAIN_TEST_LOG": str(log)}


def part_tests(ctx: Context, rows: list[Row]) -> None:
    log = ctx.work / "cuda-tests.jsonl"
    args, env = tests_args(ctx, log)
    try:
        proc = ctx.child(args, "pytest " + " ".join(ctx.pytest_args), env=env)
    except Cut:
        rows += test_rows(log, ctx.cuda)  # the tests that ended before the cut
        raise
    if not log.exists():
        raise RuntimeError(f"pytest ran no test (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    rows += test_rows(log, ctx.cuda)


def test_rows(log: Path, cuda: bool) -> list[Row]:
    """A summary row from the tests' results (``tests/conftest.py`` writes one JSON line per test as it ends),
    and one row per failed or erroring test with its message."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    rows = []
    lines = log.read_text().splitlines() if log.exists() else []
    for r in map(json.loads, filter(None, lines)):
        if r["outcome"] in ("failed", "error"):
            counts["failed" if r["outcome"] == "failed" else "errors"] += 1
            name = "::".join(r["nodeid"].split("/")[-1].removesuffix(".py").split("::")[-2:]).replace(".py", "")
            rows.append(Row("tests", name, r["message"][:150] or r["outcome"], verdict="FAIL"))
        else:
            counts[r["outcome"]] += 1
    figure = ", ".join(f"{v} {k}" for k, v in counts.items())
    ok = counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
    summary = Row("tests", "pytest -m cuda", figure, target="all pass, at least one ran", verdict=_check(ok, cuda))
    return [summary, *rows]


# -- the fused classifier -----------------------------------------------------------------------------
def _sci(n: int) -> str:
    e = len(str(n)) - 1
    return f"10^{e}" if n == 10**e else f"{n:,}"


def _shapes(ctx: Context) -> tuple[tuple[tuple[int, int, int], ...], tuple[float, ...]]:
    return (TINY_SHAPES, TINY_RATIOS) if ctx.tiny else (CLASSIFIER_SHAPES, RATIOS)


def classifier_job(ctx: Context, N: int, D: int, B: int, R: float, peer: str = "") -> ClassifierJob:
    """The ``dmltrain bench classifier`` job of one shape and ratio, ours or ``peer``'s."""
    precision = "auto" if ctx.cuda else "fp32"
    role = "peer" if peer else "ours"
    return ClassifierJob(role, ctx.device, N, D, B, steps=2 if ctx.tiny else 3, R=R, precision=precision, peer=peer)


def warm_jobs(ctx: Context) -> list[ClassifierJob]:
    """One step at a small size for every width and ratio of the part: every kernel its jobs launch is compiled
    (the same specialisation: the sizes are multiples of 16) and tuned once, before any timed job."""
    shapes, ratios = _shapes(ctx)
    widths = sorted({D for _, D, _ in shapes})
    return [classifier_job(ctx, WARM_N, D, WARM_B, R).replace(steps=1) for D in widths for R in ratios]


def peer_jobs(ctx: Context, N: int, D: int, B: int, memory: int) -> list[ClassifierJob]:
    """The peers at one shape on CUDA (``memory``: the GPU's bytes), naive torch only where its logits fit."""
    if not ctx.cuda:
        return []
    names = [p for p in PEERS if p != "naive" or NAIVE_BYTES_PER_LOGIT * B * N <= NAIVE_MEMORY_SHARE * memory]
    return [classifier_job(ctx, N, D, B, 1.0, peer=p) for p in names]


@dataclass(frozen=True)
class Child:
    """One child process of the classifier part: the jobs it runs in turn; ``warm``: the warm-up, whose
    results make one row of its time rather than rows of their own."""

    what: str
    jobs: tuple[ClassifierJob, ...]
    warm: bool = False


def classifier_plan(ctx: Context, memory: int) -> list[Child]:
    """The part's children in order: the warm-up, then per shape each ratio (a process each: its peak memory
    its own) and the peers (one process)."""
    shapes, ratios = _shapes(ctx)
    plan = [Child("warm-up: kernels compiled and tuned", tuple(warm_jobs(ctx)), warm=True)]
    for N, D, B in shapes:
        shape = f"{_sci(N)}x{D} B={B:,}"
        plan += [Child(f"{shape} R={R:g}", (classifier_job(ctx, N, D, B, R),)) for R in ratios]
        peers = peer_jobs(ctx, N, D, B, memory)
        if peers:
            plan.append(Child(f"{shape} peers", tuple(peers)))
    return plan


def _gpu_memory(ctx: Context) -> int:
    if not ctx.cuda:
        return 0
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0


def part_classifier(ctx: Context, rows: list[Row]) -> None:
    """Each child of :func:`classifier_plan` in turn, the rows of each job as its result line arrives."""
    base_R = _shapes(ctx)[1][0]
    ours: dict[tuple[int, int, int], dict[float, dict[str, Any]]] = {}
    for child in classifier_plan(ctx, _gpu_memory(ctx)):
        results: list[dict[str, Any]] = []

        def on_line(line: str, child: Child = child, results: list = results) -> None:
            if not line.startswith("{") or len(results) == len(child.jobs):
                return
            job, res = child.jobs[len(results)], json.loads(line)
            results.append(res)
            mine = ours.setdefault((job.N, job.D, job.B), {})
            if job.role == "ours":
                mine[job.R] = res
            if not child.warm:
                rows.extend(job_rows(job, res, mine, ctx.cuda))
                if job.role == "ours" and job.R != base_R:
                    rows.extend(speedup_rows(job, mine, base_R, ctx.cuda))

        t0 = time.monotonic()
        args = ["-m", "dmltrain.distributed.bench_runs", *(j.to_json() for j in child.jobs)]
        proc = ctx.child(args, f"classifier {child.what}", on_line=on_line)
        failed = len(results) < len(child.jobs) or any("error" in r for r in results)
        if child.warm:
            widths = ", ".join(str(D) for D in sorted({j.D for j in child.jobs}))
            ratios = ", ".join(sorted({f"{j.R:g}" for j in child.jobs}))
            figure = _first_error(results, proc.stdout) if failed else f"{time.monotonic() - t0:.0f} s"
            rows.append(
                Row(
                    "classifier",
                    f"{child.what} (D = {widths}; R = {ratios})",
                    figure,
                    verdict="error" if failed else "info",
                )
            )
        elif len(results) < len(child.jobs):
            rows.append(Row("classifier", child.what, _first_error(results, proc.stdout), verdict="error"))


def _first_error(results: list[dict[str, Any]], out: str) -> str:
    errors = [r["error"] for r in results if "error" in r]
    return errors[0] if errors else f"the child stopped early: {_last_error(out)}"


def job_rows(job: ClassifierJob, res: dict[str, Any], ours: dict[float, dict[str, Any]], cuda: bool) -> list[Row]:
    """The rows of one job's result: ours against its bound (:func:`classifier_rows`), a peer against ours."""
    shape = f"{_sci(job.N)}x{job.D} B={job.B:,}"
    if job.role == "ours":
        if "error" in res:
            return [Row("classifier", f"{shape} R={job.R:g}", res["error"], verdict="error")]
        return classifier_rows(shape, job.R, res, cuda)
    label = CUDA_PEERS[job.peer][1] if job.peer in CUDA_PEERS else job.peer
    what = f"{shape} peer {label}"
    if "absent" in res:
        return [Row("classifier", what, f"absent: {res['absent']}", verdict="info")]
    if "error" in res:  # a peer is a reference, not a target of ours: its failure is information
        return [Row("classifier", what, f"failed: {res['error']}", verdict="info")]
    mine = ours.get(1.0)
    ref = f"ours R=1 forward + backward {1e3 * mine['fwd_bwd']:.1f} ms" if mine else "ours R=1 not measured"
    ratio = res["fwd_bwd"] / mine["fwd_bwd"] if mine else None
    figure = f"forward + backward {1e3 * res['fwd_bwd']:.1f} ms, peak {res.get('peak_gpu', 0) / GIB:.2f} GiB"
    return [Row("classifier", what, figure, ref, ratio, "info: peer / ours")]


def speedup_rows(job: ClassifierJob, ours: dict[float, dict[str, Any]], base_R: float, cuda: bool) -> list[Row]:
    """Ratio ``job.R`` against ``base_R``: the whole step (optimizer included) per ratio."""
    if base_R not in ours or job.R not in ours or "error" in ours[base_R] or "error" in ours[job.R]:
        return []
    shape = f"{_sci(job.N)}x{job.D} B={job.B:,}"
    base, r = ours[base_R]["step"], ours[job.R]["step"]
    return [
        Row(
            "classifier",
            f"{shape} R={job.R:g} vs R={base_R:g}",
            f"step {1e3 * r:.1f} ms",
            f"R={base_R:g}: {1e3 * base:.1f} ms",
            base / r,
            f">= {SUBSAMPLE_SPEEDUP:g}x faster" if cuda else "",
            _check(base / r >= SUBSAMPLE_SPEEDUP, cuda),
        )
    ]


def classifier_rows(shape: str, R: float, res: dict[str, Any], cuda: bool) -> list[Row]:
    """Forward + backward against the 3-GEMM bound of the same run (the bound has no optimizer step, so neither
    has the figure), the optimizer's row update apart; on CUDA peak memory against the state it holds."""
    what = f"{shape} R={R:g}"
    fb, gemm = res["fwd_bwd"], res["gemm"]
    kind = "bf16 3-GEMM bound" if cuda else "fp32 3-GEMM"
    rows = [
        Row(
            "classifier",
            f"{what} forward + backward",
            f"{1e3 * fb:.1f} ms",
            f"{kind} {1e3 * gemm:.1f} ms",
            fb / gemm,
            f"<= {STEP_BOUND_X:g}x" if cuda else "",
            _check(fb <= STEP_BOUND_X * gemm, cuda),
        ),
        Row(
            "classifier",
            f"{what} optimizer row update",
            f"{1e3 * res['optimizer']:.1f} ms",
            f"forward + backward {1e3 * fb:.1f} ms",
            res["optimizer"] / fb,
        ),
    ]
    if cuda and "peak_gpu" in res:
        state = 2 * res["param_bytes"] + res["opt_bytes"]  # weight, its gradient, optimizer state
        peak = res["peak_gpu"]
        rows.append(
            Row(
                "classifier",
                f"{what} peak memory",
                f"{peak / GIB:.2f} GiB",
                f"weight+grad+state {state / GIB:.2f} GiB",
                peak / state,
                "<= state + 1 GiB",
                _check(peak - state <= MEMORY_EXCESS, cuda),
            )
        )
    return rows


#: ``bench train`` at toy sizes (``--tiny``), for the train and compile parts
TINY_TRAIN = (
    "--backbone",
    "small_cnn",
    "--image-size",
    "32",
    "--batch",
    "16",
    "--precision",
    "fp32",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--synthetic",
    "8,4,40",
    "--loader-workers",
    "1",
)


def bench_train_figures(ctx: Context, argv: list[str], path: Path, label: str) -> dict[str, Any]:
    """Run one ``bench train`` child and read the figures it wrote to ``path``; its error line if it failed."""
    proc = ctx.child(argv, label)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"{label} failed (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    return json.loads(path.read_text())


# -- the training step --------------------------------------------------------------------------------------
def train_args(ctx: Context, path: Path) -> list[str]:
    if ctx.tiny:
        sizes = list(TINY_TRAIN)
    else:  # 1,024 synthetic images: built in seconds, enough for 20 + 5 steps of 128 (the stream repeats)
        sizes = ["--backbone", "resnet50", "--image-size", "224", "--batch", "128", "--precision", "bf16"]
        sizes += ["--channels-last", "--steps", "20", "--warmup", "5", "--synthetic", "128,8,256"]
    return ["-m", "dmltrain", "bench", "train", "--device", ctx.device, *sizes, "--json", str(path)]


def part_train(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "train.json"
    figures = bench_train_figures(ctx, train_args(ctx, path), path, "bench train")
    what = "small_cnn 32 fp32" if ctx.tiny else "ResNet-50 224 bf16 channels_last"
    rows += train_rows(figures, ctx.cuda, what)


def train_rows(f: dict[str, Any], cuda: bool, what: str) -> list[Row]:
    full, bare, wait = f["full_images_per_s"], f["bare_images_per_s"], f["data_wait"]
    return [
        Row(
            "train",
            f"{what} B={f['batch']}: full pipeline",
            f"{full:.0f} images/s",
            f"bare backbone {bare:.0f} images/s",
            full / bare,
            f">= {TRAIN_RATIO:g}x" if cuda else "",
            _check(full >= TRAIN_RATIO * bare, cuda),
        ),
        Row(
            "train",
            f"{what}: waiting for data (decode={f['decode']})",
            f"{100 * wait:.1f}% of step time",
            target=f"<= {100 * DATA_WAIT:g}%" if cuda else "",
            verdict=_check(wait <= DATA_WAIT, cuda),
        ),
    ]


# -- the compiled step -------------------------------------------------------------------------------------
def compile_args(ctx: Context, path: Path) -> list[str]:
    if ctx.tiny:
        sizes = list(TINY_TRAIN)
    else:  # a transformer, where compiling pays most; 2 warm-up steps: the compile, then one compiled step
        sizes = ["--backbone", "vit_small_patch16_224", "--image-size", "224", "--batch", "64", "--precision", "bf16"]
        sizes += ["--steps", "10", "--warmup", "2", "--synthetic", "64,8,256"]
    return ["-m", "dmltrain", "bench", "train", "--device", ctx.device, *sizes, "--compile", "--json", str(path)]


def part_compile(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "compile.json"
    figures = bench_train_figures(ctx, compile_args(ctx, path), path, "bench train --compile")
    what = "small_cnn 32 fp32" if ctx.tiny else "ViT-S/16 224 bf16"
    rows += compile_rows(figures, ctx.cuda, what)


def compile_rows(f: dict[str, Any], cuda: bool, what: str) -> list[Row]:
    """One row per loop (bare backbone, full pipeline): compiled against eager images/s, measured in turn."""
    rows = []
    c = f["compiled"]
    for loop, name in (("bare", "bare backbone"), ("full", "full pipeline")):
        if loop not in c:
            continue
        x = c[loop]
        rows.append(
            Row(
                "compile",
                f"{what} B={f['batch']}: {name}, torch.compile ({c['mode']})",
                f"{x['compiled_images_per_s']:.0f} images/s, compiled in {x['compile_s']:.0f} s, "
                f"{x['graph_breaks']} graph breaks",
                f"eager {x['eager_images_per_s']:.0f} images/s",
                x["compiled_images_per_s"] / x["eager_images_per_s"],
                ">= 1x, no graph break" if cuda else "",
                _check(x["compiled_images_per_s"] >= x["eager_images_per_s"] and x["graph_breaks"] == 0, cuda),
            )
        )
    return rows


# -- evaluation ---------------------------------------------------------------------------------------------
def eval_args(ctx: Context, path: Path) -> list[str]:
    sizes = ["--n", "400", "--dim", "32", "--binary-dim", "64", "--nmi-iters", "2", "--ks", "1,10"] if ctx.tiny else []
    # the faiss index timings are a CPU figure (faiss-cpu on the GPU machine) and minutes long: not a GPU check
    return ["-m", "dmltrain", "bench", "eval", "--device", ctx.device, *sizes, "--index", "", "--json", str(path)]


def part_eval(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "eval.json"
    proc = ctx.child(eval_args(ctx, path), "bench eval")
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"bench eval failed (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    rows += eval_rows(json.loads(path.read_text()), ctx.cuda)


def eval_rows(f: dict[str, Any], cuda: bool) -> list[Row]:
    size = f"n={f['n']:,} D={f['dim']}"
    gemm, recall = f["gemm_s"], f["recall_s"]
    rows = [
        Row(
            "eval",
            f"{size} Recall@K",
            f"{recall:.2f} s",
            f"similarity GEMM {gemm:.2f} s",
            recall / gemm,
            f"<= {f['recall_target']:g}x" if cuda else "",
            _check(recall <= f["recall_target"] * gemm, cuda),
        ),
        Row(
            "eval",
            f"{size} Recall@K + MAP@R",
            f"{f['recall_map_s']:.2f} s",
            f"similarity GEMM {gemm:.2f} s",
            f["recall_map_s"] / gemm,
        ),
    ]
    if "kmeans_s" in f:
        ok = f["kmeans_s"] <= KMEANS_S
        rows.append(
            Row(
                "eval",
                f"k-means ({f['kmeans_engine']}), k={f['classes']:,}",
                f"{f['kmeans_s']:.2f} s",
                target=f"<= {KMEANS_S:g} s" if cuda else "",
                verdict=_check(ok, cuda),
            )
        )
    for engine, seconds in f.get("binary_s", {}).items():
        x = f["float_s"] / seconds
        rows.append(
            Row(
                "eval",
                f"binary {f['binary_dim']} bits ({engine})",
                f"{seconds:.2f} s",
                f"float {f['binary_dim']} dims {f['float_s']:.2f} s",
                x,
                f">= {BINARY_X:g}x faster" if cuda else "",
                _check(x >= BINARY_X, cuda),
            )
        )
    return rows


#: each part appends its rows as it measures them, so a part cut half-way keeps what it measured
RUNNERS: dict[str, Callable[[Context, list[Row]], None]] = {
    "classifier": part_classifier,
    "train": part_train,
    "eval": part_eval,
    "doctor": part_doctor,
    "tests": part_tests,
    "compile": part_compile,
}


class Rows(list):
    """The table's rows; every addition is passed to ``on_add`` (which rewrites the JSON), so nothing measured
    waits for the end of the call."""

    def __init__(self, on_add: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self.on_add = on_add

    def append(self, row: Row) -> None:
        super().append(row)
        self.on_add()

    def extend(self, rows: Iterable[Row]) -> None:
        super().extend(rows)
        self.on_add()

    def __iadd__(self, rows: Iterable[Row]) -> Rows:
        self.extend(rows)
        return self


# -- the dry run ----------------------------------------------------------------------------------------
def dry_run_rows(ctx: Context) -> list[Row]:
    """Every job of every part at the size it would run, checked against what its child reads, nothing run:
    each classifier job through the child's JSON reader and into the classifier's signature (the arguments
    :func:`~dmltrain.distributed.bench_runs.classifier_kwargs` takes from it), each command line through the
    ``dmltrain`` parser, pytest's files and plugins. One row per job: ``pass`` or ``FAIL`` with what is wrong."""
    import inspect

    from dmltrain.distributed import bench_runs
    from dmltrain.distributed.sharded_softmax import ShardedClassifier

    rows = []
    signature = inspect.signature(ShardedClassifier)
    for child in classifier_plan(ctx, memory=80 * GIB):
        for job in child.jobs:
            what = f"{child.what}: {job.role}{' ' + job.peer if job.peer else ''} R={job.R:g}"
            try:
                read = ClassifierJob.from_json(job.to_json())
                if read.role == "ours":
                    signature.bind(read.N, read.D, **bench_runs.classifier_kwargs(read))
                problem = "" if read == job else "the child reads another job"
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                problem = f"{type(e).__name__}: {e}"
            rows.append(
                Row(
                    "classifier", what, job.to_json() if not problem else problem, verdict="FAIL" if problem else "pass"
                )
            )
    work = ctx.work
    for part, argv in (
        ("train", train_args(ctx, work / "t.json")),
        ("eval", eval_args(ctx, work / "e.json")),
        ("doctor", doctor_args(ctx, work / "d.json")),
        ("compile", compile_args(ctx, work / "c.json")),
    ):
        rows.append(Row(part, " ".join(argv[1:4]), *_parse_problem(argv[2:])))
    args, _ = tests_args(ctx, work / "t.jsonl")
    files = [a for a in args if a.endswith(".py")]
    timeout = any(a.startswith("--timeout") for a in args)
    problem = "" if files else "no test module holds a CUDA test"
    rows.append(
        Row(
            "tests",
            f"pytest {len(files)} modules" + (f", --timeout={TEST_TIMEOUT_S}" if timeout else ""),
            problem or " ".join(Path(f).name for f in files),
            verdict="FAIL" if problem else "pass",
        )
    )
    return rows


def _parse_problem(argv: list[str]) -> tuple[str, str, None, str, str]:
    """(figure, reference, ratio, target, verdict) of one ``dmltrain`` command line through the real parser."""
    from dmltrain import bench, cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.parse(argv)
            if args.command == "bench":  # a benchmark parses its own options
                bench.bench_parser(args.bench).parse_args(args.bench_args)
    except SystemExit:
        return _last_error(err.getvalue()), "", None, "", "FAIL"
    return " ".join(argv), "", None, "", "pass"


# -- the run ------------------------------------------------------------------------------------------------
def run_parts(
    ctx: Context,
    parts: Sequence[str],
    budgets: dict[str, float],
    total_s: float,
    runners: dict[str, Callable[[Context, list[Row]], None]] | None = None,
    echo: Callable[[str], None] = print,
    rows: list[Row] | None = None,
    results: list[PartResult] | None = None,
) -> tuple[list[Row], list[PartResult]]:
    """Each part in turn under ``min(its budget, what is left of total_s)``; rows of a cut or failed part are
    kept up to where it stopped, with a row saying so. ``rows`` and ``results`` (when given) are filled as
    the parts go, each row as its part measures it."""
    from dmltrain.text import one_line

    runners = RUNNERS if runners is None else runners
    start = time.monotonic()
    rows = [] if rows is None else rows
    results = [] if results is None else results
    for name in parts:
        budget = min(budgets[name], total_s - (time.monotonic() - start))
        res = PartResult(name, budget_s=budget)
        results.append(res)
        if budget <= 1:
            res.status = "skipped"
            rows.append(Row(name, "(not run)", f"the {total_s:.0f} s of the whole check were used up", verdict="cut"))
            echo(f"gpu-check: {name}: not run, no time left")
            continue
        echo(f"gpu-check: {name} (at most {budget:.0f} s) ...")
        t0 = time.monotonic()
        ctx.deadline = t0 + budget
        try:
            runners[name](ctx, rows)
        except Cut as e:
            res.status, res.error = "cut", f"cut after {time.monotonic() - t0:.0f} s (its budget): {e}"
        except Exception as e:  # noqa: BLE001 — a broken part is a row of the table; the next part still runs
            res.status, res.error = "error", one_line(e)
        res.seconds = time.monotonic() - t0
        if res.status != "done":
            rows.append(Row(name, "(part)", res.error, verdict=res.status))
        echo(f"gpu-check: {name}: {res.status} in {res.seconds:.0f} s" + (f": {res.error}" if res.error else ""))
    return rows, results


HEAD = ("part", "what", "figure", "bound or peer (same run)", "ratio", "target", "verdict")


def table(rows: Sequence[Row]) -> str:
    from dmltrain.text import markdown_table

    cells = [
        [r.part, r.what, r.figure, r.reference, None if r.ratio is None else f"{r.ratio:.2f}", r.target, r.verdict]
        for r in rows
    ]
    return markdown_table(HEAD, cells)


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def versions() -> dict[str, str]:
    """torch, its CUDA build, Triton and the peers the check ran with (``absent`` for one not installed)."""
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    for name in ("triton", "cut-cross-entropy", "liger-kernel"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cuda (default); cpu with --tiny for a dry run"
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes: the whole check in seconds (no targets)")
    parser.add_argument("--only", nargs="+", choices=PARTS, metavar="PART", help=f"parts to run: {', '.join(PARTS)}")
    parser.add_argument("--skip", nargs="+", default=[], choices=PARTS, metavar="PART", help="parts to leave out")
    parser.add_argument("--budget", nargs="+", default=[], metavar="PART=S", help="a part's time budget in seconds")
    parser.add_argument(
        "--total", type=float, default=TOTAL_BUDGET_S, help=f"seconds for everything (default {TOTAL_BUDGET_S:g})"
    )
    parser.add_argument(
        "--out", default="gpu-check", help="folder of the JSON, the table and the log (default gpu-check/)"
    )
    parser.add_argument("--json", default=None, help="the JSON's path (default: OUT/gpu-check-<start>.json)")
    parser.add_argument(
        "--pytest-args", default="-m cuda", help="what the tests part passes to pytest (default '-m cuda')"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build every job of every part at full size and check it against what its child reads; "
        "run nothing (seconds, no GPU)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from dmltrain.errors import UserError
    from dmltrain.fileio import check_output_dir, write_json, write_text

    parser = argparse.ArgumentParser(prog="python -m dmltrain.gpu_check", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    budgets = dict(BUDGETS)
    for item in args.budget:
        name, _, value = item.partition("=")
        try:
            if name not in budgets:
                raise ValueError
            budgets[name] = float(value)
        except ValueError:
            parser.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(PARTS)}")
    parts = [p for p in PARTS if p in (args.only or PARTS) and p not in args.skip]  # always in PARTS' order
    if args.dry_run:
        with tempfile.TemporaryDirectory(prefix="dmltrain-gpu-check-") as tmp:
            rows = dry_run_rows(Context(args.device, args.tiny, Path(tmp), Path(tmp) / "log", args.pytest_args.split()))
        rows = [r for r in rows if r.part in parts]
        print(table(rows))
        failed = [r for r in rows if r.verdict == "FAIL"]
        print(f"gpu-check --dry-run: {len(rows)} jobs, {len(failed)} that their child would refuse", flush=True)
        return 1 if failed else 0
    try:
        out = check_output_dir(args.out, "--out")
    except UserError as e:
        print(f"gpu-check: error: {e}", file=sys.stderr)
        return 2
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = Path(args.json) if args.json else out / f"gpu-check-{stamp}.json"
    log_path = json_path.with_suffix(".log")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    device = device_name(args.device)
    report: dict[str, Any] = {
        "device": args.device,
        "device_name": device,
        "versions": versions(),
        "tiny": args.tiny,
        "started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "total_budget_s": args.total,
    }
    stack = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    results: list[PartResult] = []

    def save() -> None:  # after every row: a cut call keeps what it measured
        report.update(
            {
                "seconds": time.time() - started,
                "parts": [asdict(r) for r in results],
                "rows": [asdict(r) for r in rows],
            }
        )
        write_json(json_path, report)
        write_text(
            json_path.with_suffix(".md"),
            f"`make gpu-check` on {device} ({stack}), {report['started']}\n\n{table(rows)}\n",
        )

    rows = Rows(save)
    print(
        f"gpu-check: {args.device} ({device}; {stack}){', tiny sizes' if args.tiny else ''}; parts {', '.join(parts)}; "
        f"at most {args.total:.0f} s; log {log_path}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="dmltrain-gpu-check-") as tmp:
        ctx = Context(args.device, args.tiny, Path(tmp), log_path, args.pytest_args.split())
        run_parts(ctx, parts, budgets, args.total, echo=lambda s: print(s, flush=True), rows=rows, results=results)
    save()
    print(table(rows))
    failed = [r for r in rows if r.verdict in ("FAIL", "error", "cut")]
    print(
        f"gpu-check: {len(rows)} rows, {len(failed)} failed, cut or broken; {time.time() - started:.0f} s; "
        f"{json_path} and {json_path.with_suffix('.md')}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
