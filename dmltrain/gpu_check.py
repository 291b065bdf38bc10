"""``make gpu-check`` (``python -m dmltrain.gpu_check``): every GPU path of the project proved in one call.

GPU time comes in short leases, so one command runs, within 8 minutes:

1. ``doctor``: ``dmltrain doctor`` for a one-GPU training (``cluster.use_gpu=true cluster.num_workers=1``);
2. ``tests``: the suite's CUDA tests (``pytest -m cuda``);
3. ``classifier``: the fused classifier step at 10⁶×512 with B = 1,024 and 8,192 and at 10⁷×128 with
   B = 4,096, each at sample ratios 1 and 0.1 (``dmltrain bench classifier``'s runs, one process each);
4. ``train``: ``dmltrain bench train`` with ResNet-50 at 224 px, bf16, channels_last, B = 128;
5. ``eval``: ``dmltrain bench eval`` at the SOP test set's size.

Each part runs in child processes (their own process groups) under a time budget; a part over its
budget is cut (its processes killed) and says so, a part that fails gives its error line, and the
next part runs either way. The result is ONE table (part, what, figure, its bound or peer measured
in the same run, ratio, target, verdict), printed as Markdown (to paste into a note or the README),
and written as JSON with the same rows, each part's status and time, beside a log of every child's
output (``--out``: default ``gpu-check/``, files named by the start time).

``--device cpu --tiny`` runs the same parts on the CPU at toy sizes (seconds; the tests use it):
no targets apply there, its verdicts are ``info``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

#: part -> seconds it may take (the whole run: at most TOTAL_BUDGET_S)
BUDGETS = {"doctor": 60.0, "tests": 120.0, "classifier": 165.0, "train": 70.0, "eval": 55.0}
TOTAL_BUDGET_S = 470.0
PARTS = tuple(BUDGETS)
GIB = 2**30

#: (classes, dim, batch) of the classifier part; sample ratios
CLASSIFIER_SHAPES = ((1_000_000, 512, 1024), (1_000_000, 512, 8192), (10_000_000, 128, 4096))
RATIOS = (1.0, 0.1)
TINY_SHAPES = ((2000, 16, 32), (3000, 8, 16))
TINY_RATIOS = (1.0, 0.5)
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

    def child(self, args: Sequence[str], what: str) -> subprocess.CompletedProcess:
        """Run ``python args...`` in its own process group until the part's deadline; its output goes to the
        log (and comes back). Over the deadline the whole group is killed and :class:`Cut` raised."""
        left = self.left()
        if left <= 0:
            raise Cut(f"no time left for {what}")
        cmd = [sys.executable, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {what}: {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the child and everything it started (loaders, bench runs)
                out, _ = proc.communicate()
                log.write(out or "")
                raise Cut(f"{what} was still running", out or "") from None
            log.write(out or "")
        return subprocess.CompletedProcess(cmd, proc.returncode, out or "", "")


def _last_error(out: str) -> str:
    """The line that says what went wrong in a child's output (its last error line, else its last line)."""
    from dmltrain.text import one_line

    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "Error" in ln or "FAILED" in ln]
    return one_line((errors or lines or ["no output"])[-1], 200)


def _check(ok: bool, cuda: bool) -> str:
    return ("pass" if ok else "FAIL") if cuda else "info"


# -- part 1: dmltrain doctor ---------------------------------------------------------------------------------
def part_doctor(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "doctor.json"
    overrides = ["cluster.use_gpu=true", "cluster.num_workers=1"] if ctx.cuda else []
    skip = ["--skip", "ray"] if ctx.tiny else []  # a local Ray takes 5-25 s to start on a small CPU machine
    try:
        proc = ctx.child(["-m", "dmltrain", "doctor", *overrides, *skip, "--json", str(path)], "dmltrain doctor")
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


# -- part 2: the CUDA tests ---------------------------------------------------------------------------------
def part_tests(ctx: Context, rows: list[Row]) -> None:
    xml = ctx.work / "cuda-tests.xml"
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not tests.is_dir():
        raise RuntimeError(f"no test suite at {tests}: run it from a checkout of the project")
    # only the modules that hold CUDA tests: the others need not even import here (a GPU machine with the
    # bundle lacks the S3 test stack, for one)
    files = [str(p) for p in sorted(tests.glob("test_*.py")) if "mark.cuda" in p.read_text()]
    args = ["-m", "pytest", *files, *ctx.pytest_args, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    proc = ctx.child(args, "pytest " + " ".join(ctx.pytest_args))
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no report (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    rows += test_rows(xml, ctx.cuda)


def test_rows(xml: Path, cuda: bool) -> list[Row]:
    """A summary row from pytest's JUnit XML, and one row per failed or erroring test with its message."""
    root = ET.parse(xml).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    rows = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}".rsplit(".", 2)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            rows.append(Row("tests", "::".join(name[-2:]), message[0][:150] if message else bad.tag, verdict="FAIL"))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    figure = ", ".join(f"{v} {k}" for k, v in counts.items())
    ok = counts["failed"] == counts["errors"] == 0 and counts["passed"] > 0
    summary = Row("tests", "pytest -m cuda", figure, target="all pass, at least one ran", verdict=_check(ok, cuda))
    return [summary, *rows]


# -- part 3: the fused classifier ---------------------------------------------------------------------------
def _sci(n: int) -> str:
    e = len(str(n)) - 1
    return f"10^{e}" if n == 10**e else f"{n:,}"


def classifier_job(ctx: Context, N: int, D: int, B: int, R: float) -> dict[str, Any]:
    """The job of ``dmltrain bench classifier`` (:mod:`~dmltrain.distributed.bench_runs`) for one shape and ratio."""
    job = dict(role="ours", device=ctx.device, N=N, D=D, B=B, W=1, R=R, steps=2 if ctx.tiny else 3, kind="normsoftmax")
    job |= dict(optimizer="sgd", budget=256.0, precision="auto" if ctx.cuda else "fp32", storage="fp32")
    return job


def part_classifier(ctx: Context, rows: list[Row]) -> None:
    shapes, ratios = (TINY_SHAPES, TINY_RATIOS) if ctx.tiny else (CLASSIFIER_SHAPES, RATIOS)
    for N, D, B in shapes:
        shape = f"{_sci(N)}x{D} B={B:,}"
        done: dict[float, dict[str, Any]] = {}
        for R in ratios:
            job = classifier_job(ctx, N, D, B, R)
            proc = ctx.child(["-m", "dmltrain.distributed.bench_runs", json.dumps(job)], f"classifier {shape} R={R:g}")
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            res = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": _last_error(proc.stdout)}
            if "error" in res:
                rows.append(Row("classifier", f"{shape} R={R:g}", res["error"], verdict="error"))
                continue
            done[R] = res
            rows += classifier_rows(shape, R, res, ctx.cuda)
        if ratios[0] in done:
            for R in ratios[1:]:
                if R in done:
                    base, r = done[ratios[0]]["step"], done[R]["step"]
                    rows.append(Row("classifier", f"{shape} R={R:g} vs R={ratios[0]:g}", f"step {1e3 * r:.1f} ms",
                                    f"R={ratios[0]:g}: {1e3 * base:.1f} ms", base / r, f">= {SUBSAMPLE_SPEEDUP:g}x faster" if ctx.cuda else "",
                                    _check(base / r >= SUBSAMPLE_SPEEDUP, ctx.cuda)))  # fmt: skip


def classifier_rows(shape: str, R: float, res: dict[str, Any], cuda: bool) -> list[Row]:
    """Step time against the 3-GEMM bound of the same run; on CUDA peak memory against the state it holds."""
    what = f"{shape} R={R:g}"
    step, gemm = res["step"], res["gemm"]
    kind = "bf16 3-GEMM bound" if cuda else "fp32 3-GEMM"
    rows = [Row("classifier", f"{what} step", f"{1e3 * step:.1f} ms", f"{kind} {1e3 * gemm:.1f} ms", step / gemm,
                f"<= {STEP_BOUND_X:g}x" if cuda else "", _check(step <= STEP_BOUND_X * gemm, cuda))]  # fmt: skip
    if cuda and "peak_gpu" in res:
        state = 2 * res["param_bytes"] + res["opt_bytes"]  # weight, its gradient, optimizer state
        peak = res["peak_gpu"]
        rows.append(Row("classifier", f"{what} peak memory", f"{peak / GIB:.2f} GiB",
                        f"weight+grad+state {state / GIB:.2f} GiB", peak / state, "<= state + 1 GiB",
                        _check(peak - state <= MEMORY_EXCESS, cuda)))  # fmt: skip
    return rows


# -- part 4: the training step ------------------------------------------------------------------------------
def train_args(ctx: Context, path: Path) -> list[str]:
    if ctx.tiny:
        sizes = ["--backbone", "small_cnn", "--image-size", "32", "--batch", "16", "--precision", "fp32"]
        sizes += ["--steps", "2", "--warmup", "1", "--synthetic", "8,4,40", "--loader-workers", "1"]
    else:  # 1,024 synthetic images: built in seconds, enough for 20 + 5 steps of 128 (the stream repeats)
        sizes = ["--backbone", "resnet50", "--image-size", "224", "--batch", "128", "--precision", "bf16"]
        sizes += ["--channels-last", "--steps", "20", "--warmup", "5", "--synthetic", "128,8,256"]
    return ["-m", "dmltrain", "bench", "train", "--device", ctx.device, *sizes, "--json", str(path)]


def part_train(ctx: Context, rows: list[Row]) -> None:
    path = ctx.work / "train.json"
    proc = ctx.child(train_args(ctx, path), "bench train")
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"bench train failed (exit code {proc.returncode}): {_last_error(proc.stdout)}")
    what = "small_cnn 32 fp32" if ctx.tiny else "ResNet-50 224 bf16 channels_last"
    rows += train_rows(json.loads(path.read_text()), ctx.cuda, what)


def train_rows(f: dict[str, Any], cuda: bool, what: str) -> list[Row]:
    full, bare, wait = f["full_images_per_s"], f["bare_images_per_s"], f["data_wait"]
    return [
        Row("train", f"{what} B={f['batch']}: full pipeline", f"{full:.0f} images/s", f"bare backbone {bare:.0f} images/s",
            full / bare, f">= {TRAIN_RATIO:g}x" if cuda else "", _check(full >= TRAIN_RATIO * bare, cuda)),
        Row("train", f"{what}: waiting for data (decode={f['decode']})", f"{100 * wait:.1f}% of step time",
            target=f"<= {100 * DATA_WAIT:g}%" if cuda else "", verdict=_check(wait <= DATA_WAIT, cuda)),
    ]  # fmt: skip


# -- part 5: evaluation -------------------------------------------------------------------------------------
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
    rows = [Row("eval", f"{size} Recall@K", f"{recall:.2f} s", f"similarity GEMM {gemm:.2f} s", recall / gemm,
                f"<= {f['recall_target']:g}x" if cuda else "", _check(recall <= f["recall_target"] * gemm, cuda)),
            Row("eval", f"{size} Recall@K + MAP@R", f"{f['recall_map_s']:.2f} s", f"similarity GEMM {gemm:.2f} s",
                f["recall_map_s"] / gemm)]  # fmt: skip
    if "kmeans_s" in f:
        ok = f["kmeans_s"] <= KMEANS_S
        rows.append(Row("eval", f"k-means ({f['kmeans_engine']}), k={f['classes']:,}", f"{f['kmeans_s']:.2f} s",
                        target=f"<= {KMEANS_S:g} s" if cuda else "", verdict=_check(ok, cuda)))  # fmt: skip
    for engine, seconds in f.get("binary_s", {}).items():
        x = f["float_s"] / seconds
        rows.append(Row("eval", f"binary {f['binary_dim']} bits ({engine})", f"{seconds:.2f} s",
                        f"float {f['binary_dim']} dims {f['float_s']:.2f} s", x, f">= {BINARY_X:g}x faster" if cuda else "",
                        _check(x >= BINARY_X, cuda)))  # fmt: skip
    return rows


#: each part appends its rows as it measures them, so a part cut half-way keeps what it measured
RUNNERS: dict[str, Callable[[Context, list[Row]], None]] = {
    "doctor": part_doctor,
    "tests": part_tests,
    "classifier": part_classifier,
    "train": part_train,
    "eval": part_eval,
}


# -- the run ------------------------------------------------------------------------------------------------
def run_parts(
    ctx: Context,
    parts: Sequence[str],
    budgets: dict[str, float],
    total_s: float,
    runners: dict[str, Callable[[Context, list[Row]], None]] = RUNNERS,
    echo: Callable[[str], None] = print,
) -> tuple[list[Row], list[PartResult]]:
    """Each part in turn under ``min(its budget, what is left of total_s)``; rows of a cut or failed part are
    kept up to where it stopped, with a row saying so."""
    from dmltrain.text import one_line

    start = time.monotonic()
    rows: list[Row] = []
    results: list[PartResult] = []
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
        got: list[Row] = []
        try:
            runners[name](ctx, got)
        except Cut as e:
            res.status, res.error = "cut", f"cut after {time.monotonic() - t0:.0f} s (its budget): {e}"
        except Exception as e:  # noqa: BLE001 — a broken part is a row of the table; the next part still runs
            res.status, res.error = "error", one_line(e)
        res.seconds = time.monotonic() - t0
        rows += got
        if res.status != "done":
            rows.append(Row(name, "(part)", res.error, verdict=res.status))
        echo(f"gpu-check: {name}: {res.status} in {res.seconds:.0f} s" + (f": {res.error}" if res.error else ""))
    return rows, results


HEAD = ("part", "what", "figure", "bound or peer (same run)", "ratio", "target", "verdict")


def table(rows: Sequence[Row]) -> str:
    from dmltrain.text import markdown_table

    cells = [[r.part, r.what, r.figure, r.reference, None if r.ratio is None else f"{r.ratio:.2f}", r.target, r.verdict]
             for r in rows]  # fmt: skip
    return markdown_table(HEAD, cells)


def device_name(device: str) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


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
    parser.add_argument("--pytest-args", default="-m cuda", help="what the tests part passes to pytest (default '-m cuda')")  # fmt: skip


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
    parts = [p for p in (args.only or PARTS) if p not in args.skip]
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
    print(f"gpu-check: {args.device} ({device}){', tiny sizes' if args.tiny else ''}; parts {', '.join(parts)}; "
          f"at most {args.total:.0f} s; log {log_path}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dmltrain-gpu-check-") as tmp:
        ctx = Context(args.device, args.tiny, Path(tmp), log_path, args.pytest_args.split())
        rows, results = run_parts(ctx, parts, budgets, args.total, echo=lambda s: print(s, flush=True))
    text = table(rows)
    print(text)
    report = {
        "device": args.device,
        "device_name": device,
        "tiny": args.tiny,
        "started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
        "seconds": time.time() - started,
        "total_budget_s": args.total,
        "parts": [asdict(r) for r in results],
        "rows": [asdict(r) for r in rows],
    }
    write_json(json_path, report)
    write_text(json_path.with_suffix(".md"), f"`make gpu-check` on {device}, {report['started']}\n\n{text}\n")
    failed = [r for r in rows if r.verdict in ("FAIL", "error", "cut")]
    print(f"gpu-check: {len(rows)} rows, {len(failed)} failed, cut or broken; {time.time() - started:.0f} s; "
          f"{json_path} and {json_path.with_suffix('.md')}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
