"""``make gpu-check`` (dmltrain/gpu_check.py) on the CPU: its rows, its table and JSON, and its time budgets.

The figures of a GPU run cannot be had here; what can: the rows built from each bench's JSON and
pytest's JUnit report (verdicts against the targets on CUDA, ``info`` on the CPU), a part over its
budget cut with its processes killed while the next part runs, and one real ``--device cpu --tiny``
run writing the table and the JSON.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from dmltrain import gpu_check as gc

REPO = Path(__file__).resolve().parents[1]


def test_rows_from_the_tests_log(tmp_path):
    log = tmp_path / "r.jsonl"
    lines = [{"nodeid": "tests/test_a.py::test_ok", "outcome": "passed", "message": ""},
             {"nodeid": "tests/test_a.py::test_bad", "outcome": "failed", "message": "assert 1 == 2"},
             {"nodeid": "tests/test_b.py::test_skip[cuda]", "outcome": "skipped", "message": "needs a CUDA device"},
             {"nodeid": "tests/test_b.py::test_err", "outcome": "error", "message": "fixture broke"}]  # fmt: skip
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary, bad, err = gc.test_rows(log, cuda=True)
    assert summary.figure == "1 passed, 1 failed, 1 errors, 1 skipped" and summary.verdict == "FAIL"
    assert (bad.what, bad.figure, bad.verdict) == ("test_a::test_bad", "assert 1 == 2", "FAIL")
    assert (err.what, err.figure) == ("test_b::test_err", "fixture broke")
    log.write_text(json.dumps(lines[0]) + "\n")
    assert gc.test_rows(log, cuda=True)[0].verdict == "pass" and gc.test_rows(log, cuda=False)[0].verdict == "info"
    (missing,) = gc.test_rows(tmp_path / "none.jsonl", cuda=True)  # cut before any test ended
    assert missing.figure.startswith("0 passed") and missing.verdict == "FAIL"


def test_classifier_rows_hold_each_figure_to_its_target():
    gib = 2**30
    res = {"fwd_bwd": 0.009, "optimizer": 0.003, "step": 0.012, "gemm": 0.005, "peak_gpu": 4.5 * gib,
           "param_bytes": gib, "opt_bytes": 2 * gib}  # fmt: skip
    step, optimizer, memory = gc.classifier_rows("10^6x512 B=1,024", 1.0, res, cuda=True)
    # forward + backward against the 3-GEMM bound, which holds no optimizer step: 9 ms, not the step's 12
    assert (step.what, step.figure, step.reference, step.target, step.verdict) == (
        "10^6x512 B=1,024 R=1 forward + backward", "9.0 ms", "bf16 3-GEMM bound 5.0 ms", "<= 2x", "pass")  # fmt: skip
    assert step.ratio == pytest.approx(1.8)
    assert optimizer.figure == "3.0 ms" and optimizer.verdict == "info" and optimizer.ratio == pytest.approx(1 / 3)
    assert memory.figure == "4.50 GiB" and memory.reference == "weight+grad+state 4.00 GiB" and memory.verdict == "pass"
    slow = gc.classifier_rows("s", 1.0, {**res, "fwd_bwd": 0.011, "peak_gpu": 5.5 * gib}, cuda=True)
    assert [r.verdict for r in slow] == ["FAIL", "info", "FAIL"]
    cpu = gc.classifier_rows("s", 1.0, {"fwd_bwd": 0.3, "optimizer": 0.1, "gemm": 0.1}, cuda=False)
    assert (
        [r.verdict for r in cpu] == ["info", "info"]
        and cpu[0].target == ""
        and cpu[0].reference == "fp32 3-GEMM 100.0 ms"
    )


def test_peer_rows_stand_beside_ours_or_say_they_are_absent():
    job = gc.ClassifierJob("peer", "cuda", 10**6, 512, 1024, peer="cce")
    ours = {1.0: {"fwd_bwd": 0.010}}
    (row,) = gc.job_rows(job, {"fwd_bwd": 0.025, "peak_gpu": 2**30}, ours, cuda=True)
    assert row.what == "10^6x512 B=1,024 peer Cut Cross-Entropy (bf16, its default gradient filter)"
    assert row.figure == "forward + backward 25.0 ms, peak 1.00 GiB" and row.ratio == pytest.approx(2.5)
    assert row.reference == "ours R=1 forward + backward 10.0 ms"
    (absent,) = gc.job_rows(job, {"absent": "cut_cross_entropy is not installed"}, ours, cuda=True)
    assert absent.figure == "absent: cut_cross_entropy is not installed" and absent.verdict == "info"
    (oom,) = gc.job_rows(job.replace(peer="naive"), {"error": "out of memory"}, ours, cuda=True)
    assert oom.figure == "failed: out of memory" and oom.verdict == "info"  # a reference, not a target: no FAIL


def test_the_plan_measures_the_scarcest_figures_first():
    ctx = gc.Context("cuda", False, Path("."), Path("log"))
    assert gc.PARTS == ("classifier", "train", "eval", "doctor", "tests", "compile")
    assert sum(gc.BUDGETS.values()) >= gc.TOTAL_BUDGET_S  # the last part takes what is left
    plan = gc.classifier_plan(ctx, memory=80 * 2**30)
    assert plan[0].warm and {(j.D, j.R) for j in plan[0].jobs} == {(128, 1.0), (128, 0.1), (512, 1.0), (512, 0.1)}
    assert all(j.N % 16 == 0 and round(j.N * j.R) % 16 == 0 and j.B % 16 == 0 for j in plan[0].jobs)
    assert [c.what for c in plan[1:4]] == ["10^6x512 B=1,024 R=1", "10^6x512 B=1,024 R=0.1", "10^6x512 B=1,024 peers"]
    assert [j.peer for j in plan[3].jobs] == ["cce", "cce_exact", "liger", "naive"]
    # naive torch holds B x N logits in bf16 and fp32 (16 bytes each with backward): not at 10^6 x 8,192 (131 GB)
    # nor 10^7 x 4,096 on an 80 GB GPU
    assert [j.peer for j in plan[6].jobs] == [j.peer for j in plan[-1].jobs] == ["cce", "cce_exact", "liger"]
    assert all(j.precision == "auto" and j.device == "cuda" for c in plan for j in c.jobs)


def test_eval_and_train_rows():
    f = {"n": 60502, "dim": 512, "classes": 11316, "gemm_s": 1.0, "recall_s": 1.5, "recall_map_s": 1.7,
         "recall_target": 2.0, "kmeans_s": 3.5, "kmeans_engine": "torch", "binary_dim": 2048, "float_s": 2.0,
         "binary_s": {"mma": 0.4, "popcount": 0.6}}  # fmt: skip
    rows = gc.eval_rows(f, cuda=True)
    assert [(r.what, r.verdict) for r in rows] == [
        ("n=60,502 D=512 Recall@K", "pass"),
        ("n=60,502 D=512 Recall@K + MAP@R", "info"),
        ("k-means (torch), k=11,316", "FAIL"),
        ("binary 2048 bits (mma)", "pass"),
        ("binary 2048 bits (popcount)", "FAIL"),
    ]
    assert rows[3].ratio == pytest.approx(5.0) and rows[3].reference == "float 2048 dims 2.00 s"
    t = {"full_images_per_s": 900.0, "bare_images_per_s": 1000.0, "data_wait": 0.08, "decode": "device", "batch": 128}
    full, wait = gc.train_rows(t, cuda=True, what="ResNet-50")
    assert full.verdict == "pass" and full.ratio == pytest.approx(0.9) and wait.verdict == "FAIL"
    assert "| part | what | figure | bound or peer (same run) | ratio | target | verdict |" in gc.table([full, wait])


def test_compile_rows_set_the_compiled_step_beside_the_eager_one():
    loop = {"eager_images_per_s": 1000.0, "compiled_images_per_s": 1300.0, "compile_s": 41.2, "graph_breaks": 0}
    f = {"batch": 64, "compiled": {"mode": "default", "bare": loop, "full": {**loop, "graph_breaks": 1}}}
    bare, full = gc.compile_rows(f, cuda=True, what="ViT-S/16 224 bf16")
    assert bare.what == "ViT-S/16 224 bf16 B=64: bare backbone, torch.compile (default)"
    assert bare.figure == "1300 images/s, compiled in 41 s, 0 graph breaks" and bare.reference == "eager 1000 images/s"
    assert bare.ratio == pytest.approx(1.3) and bare.verdict == "pass"
    assert full.verdict == "FAIL"  # a graph break in a supported backbone is a failure on a GPU
    assert [r.verdict for r in gc.compile_rows(f, cuda=False, what="x")] == ["info", "info"]


def _sleeper(pid_file):
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"

    def part(ctx, rows):
        rows.append(gc.Row("doctor", "before the wait", "1"))
        ctx.child(["-c", code], "a child that sleeps")

    return part


def test_a_part_over_its_budget_is_cut_and_the_next_part_runs(tmp_path):
    pid_file = tmp_path / "pid"

    def broken(ctx, rows):
        raise RuntimeError("no GPU found")

    def fine(ctx, rows):
        rows.append(gc.Row("classifier", "shape", "5 ms", verdict="pass"))

    runners = {"tests": broken, "classifier": fine, "doctor": _sleeper(pid_file), "train": fine}
    ctx = gc.Context("cpu", True, tmp_path, tmp_path / "log")
    budgets = {"tests": 10.0, "classifier": 10.0, "doctor": 3.0, "train": 10.0}
    t0 = time.monotonic()
    rows, parts = gc.run_parts(ctx, list(runners), budgets, total_s=3.5, runners=runners, echo=lambda s: None)
    assert time.monotonic() - t0 < 20
    assert [(p.name, p.status) for p in parts] == [
        ("tests", "error"), ("classifier", "done"), ("doctor", "cut"), ("train", "skipped")]  # fmt: skip
    assert [(r.part, r.what, r.verdict) for r in rows] == [
        ("tests", "(part)", "error"),
        ("classifier", "shape", "pass"),
        ("doctor", "before the wait", "info"),  # kept: measured before the cut
        ("doctor", "(part)", "cut"),
        ("train", "(not run)", "cut"),
    ]
    assert rows[0].figure == "RuntimeError: no GPU found"
    assert rows[3].figure.startswith("cut after 3 s (its budget): a child that sleeps was still running")
    with pytest.raises(ProcessLookupError):  # the child was killed with its process group
        os.kill(int(pid_file.read_text()), 0)
    assert "===== a child that sleeps" in (tmp_path / "log").read_text()


def test_a_child_whose_line_cannot_be_read_is_killed_with_the_error(tmp_path):
    """A line the part's reader refuses ends the child's process group too: no child outlives its part."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('{{broken', flush=True); time.sleep(60)"
    ctx = gc.Context("cpu", True, tmp_path, tmp_path / "log")
    ctx.deadline = time.monotonic() + 30

    def reader(line):
        json.loads(line)

    t0 = time.monotonic()
    with pytest.raises(json.JSONDecodeError):
        ctx.child(["-c", code], "a child printing a broken line", on_line=reader)
    assert time.monotonic() - t0 < 25
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_tiny_cpu_run_prints_one_table_and_writes_its_json(tmp_path, monkeypatch, capsys):
    """The real parts on toy sizes, in the plan's order: the classifier's bench runs (fresh processes, the
    warm-up first), the eval bench and the CUDA tests (all skipped here, each written to the log as it ends)."""
    monkeypatch.setattr(gc, "TINY_SHAPES", ((2000, 16, 32),))
    paths = [str(REPO), os.environ.get("PYTHONPATH")]  # the children import this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--tiny", "--only", "tests", "classifier", "eval", "--out", str(out)]
    assert gc.main([*argv, "--json", str(out / "r.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| part | what |") == 1
    report = json.loads((out / "r.json").read_text())
    assert [(p["name"], p["status"]) for p in report["parts"]] == [
        ("classifier", "done"), ("eval", "done"), ("tests", "done")]  # fmt: skip
    whats = [r["what"] for r in report["rows"]]
    assert whats[0] == "warm-up: kernels compiled and tuned (D = 16; R = 0.5, 1)"
    assert whats[1:6] == ["2,000x16 B=32 R=1 forward + backward", "2,000x16 B=32 R=1 optimizer row update",
                          "2,000x16 B=32 R=0.5 forward + backward", "2,000x16 B=32 R=0.5 optimizer row update",
                          "2,000x16 B=32 R=0.5 vs R=1"]  # fmt: skip
    assert "n=400 D=32 Recall@K" in whats and "binary 64 bits (native)" in whats
    tests = report["rows"][whats.index("pytest -m cuda")]
    assert tests["figure"].startswith("0 passed, 0 failed, 0 errors, ") and not tests["figure"].endswith(" 0 skipped")
    assert all(r["verdict"] == "info" for r in report["rows"]) and report["tiny"] and report["device"] == "cpu"
    assert report["versions"]["torch"] and report["versions"]["triton"]
    assert (out / "r.md").read_text().count("| classifier |") == 6
    assert "bench_runs" in (out / "r.log").read_text()


def test_rows_reach_the_json_as_they_are_measured(tmp_path, monkeypatch):
    """A part cut half-way (or a call killed) keeps what it measured on disk: the JSON is rewritten per row."""
    seen = []

    def measures_then_hangs(ctx, rows):
        rows.append(gc.Row("classifier", "first shape", "5 ms"))
        seen.append(json.loads((tmp_path / "r.json").read_text())["rows"])
        raise gc.Cut("the second shape was still running")

    monkeypatch.setitem(gc.RUNNERS, "classifier", measures_then_hangs)
    code = gc.main(
        ["--device", "cpu", "--only", "classifier", "--out", str(tmp_path), "--json", str(tmp_path / "r.json")]
    )
    assert code == 1
    assert [r["what"] for r in seen[0]] == ["first shape"]  # on disk before the part ended
    final = json.loads((tmp_path / "r.json").read_text())
    assert [(r["what"], r["verdict"]) for r in final["rows"]] == [("first shape", "info"), ("(part)", "cut")]


def test_dry_run_checks_every_full_size_job_against_what_its_child_reads(monkeypatch, capsys):
    """Every job of the real (CUDA, full-size) plan goes through the child's reader and into the classifier's
    signature, with the CUDA-only keys: the check that a missing job key (it once lacked ``deterministic``)
    fails here, on a CPU, rather than in every job of a lent GPU's window."""
    assert gc.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gpu-check --dry-run: 25 jobs, 0 that their child would refuse" in out
    assert '"N": 10000000, "D": 128, "B": 4096' in out and '"deterministic": false' in out
    doctor = (
        "| doctor | dmltrain doctor cluster.use_gpu=true | doctor cluster.use_gpu=true cluster.num_workers=1 --json"
    )
    for line in ("| train | dmltrain bench train | bench train --device cuda --backbone resnet50",
                 "| eval | dmltrain bench eval | bench eval --device cuda", doctor,
                 "| compile | dmltrain bench train | bench train --device cuda --backbone vit_small_patch16_224"):  # fmt: skip
        assert line in out

    from dmltrain.distributed import bench_runs

    reads = bench_runs.classifier_kwargs  # a child that reads a key the job does not carry
    monkeypatch.setattr(bench_runs, "classifier_kwargs", lambda job: {**reads(job), "bias": job.bias})
    assert gc.main(["--dry-run", "--only", "classifier"]) == 1
    assert "AttributeError: 'ClassifierJob' object has no attribute 'bias'" in capsys.readouterr().out
    monkeypatch.setattr(gc, "train_args", lambda ctx, path: ["-m", "dmltrain", "bench", "train", "--no-such-flag"])
    assert gc.main(["--dry-run", "--only", "train"]) == 1
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().out


def test_a_job_json_with_a_missing_or_unknown_key_is_refused_in_one_line():
    job = gc.ClassifierJob("ours", "cuda", 10**6, 512, 1024)
    assert gc.ClassifierJob.from_json(job.to_json()) == job
    data = json.loads(job.to_json())
    with pytest.raises(ValueError, match="classifier job: missing key 'D'"):
        gc.ClassifierJob.from_json(json.dumps({k: v for k, v in data.items() if k != "D"}))
    with pytest.raises(ValueError, match="classifier job: unknown key 'determinstic'"):
        gc.ClassifierJob.from_json(json.dumps({**data, "determinstic": True}))
    with pytest.raises(ValueError, match="classifier job: N = '1e6' is not a int"):
        gc.ClassifierJob.from_json(json.dumps({**data, "N": "1e6"}))
    with pytest.raises(ValueError, match="classifier job: peer 'cce2' is not one of"):
        gc.ClassifierJob("peer", "cuda", 10, 8, 4, peer="cce2")


def test_doctor_rows_from_the_lines_it_printed_before_a_cut():
    from dmltrain.doctor import Check

    checks = [Check("torch", True, "2.14 (CUDA 13.0 build)", "always"), Check("cuda", False, "no CUDA device", "cluster.use_gpu: true"),
              Check("faiss", False, "faiss is not installed")]  # fmt: skip
    text = "dmltrain doctor: the default config on gpu-node\n" + "\n".join(c.line() for c in checks) + "\n"
    rows = gc.doctor_rows(gc.printed_checks(text))
    assert [(r.what, r.verdict, r.target) for r in rows] == [
        ("torch", "pass", ""), ("cuda", "FAIL", "works"), ("faiss", "info", "")]  # fmt: skip
    assert rows[1].figure == "no CUDA device (needed: cluster.use_gpu: true)"


_PEER_CHECK = """
import json, sys, torch
from dmltrain.distributed.bench_runs import peer_loss
torch.manual_seed(0)
out = {}
for name in sys.argv[2:]:
    fn, (w,) = peer_loss(name, 300, 32, torch.device(sys.argv[1]))
    x = torch.randn(24, 32, device=w.device, requires_grad=True)
    y = torch.randint(0, 300, (24,), device=w.device)
    loss = fn(x, y)
    loss.backward()
    out[name] = {"loss": loss.item(), "x": x.tolist(), "w": w.tolist(), "y": y.tolist(), "gx": x.grad.tolist()}
print(json.dumps(out))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_peers_compute_normsoftmax_at_its_temperature(device):
    """Each peer's adapter is NormSoftmax's loss ``CE(x̂·ŵᵀ / T)`` and its embeddings' gradient, against a float64
    reference: a peer fed the wrong operand order or scale would be timed on another problem. On the CPU the
    Triton peers run under the interpreter (Cut Cross-Entropy's kernels do not: CUDA only)."""
    import subprocess
    import sys

    from dmltrain.distributed.bench_runs import TEMPERATURE

    pytest.importorskip("liger_kernel")
    peers = ["naive", "liger"] + (["cce", "cce_exact"] if device == "cuda" else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _PEER_CHECK, device, *peers], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    for name in peers:
        r = got[name]
        x = torch.tensor(r["x"], dtype=torch.float64, requires_grad=True)
        w, y = torch.tensor(r["w"], dtype=torch.float64), torch.tensor(r["y"])
        ref = torch.nn.functional.cross_entropy(
            torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(w, dim=1).t() / TEMPERATURE, y
        )
        ref.backward()
        # bf16 operands (8-bit mantissas) at scale 1/T = 20
        assert r["loss"] == pytest.approx(ref.item(), rel=2e-2), name
        gx = torch.tensor(r["gx"], dtype=torch.float64)
        assert ((gx - x.grad).abs().max() / x.grad.abs().max()).item() < 5e-2, name


@pytest.mark.parametrize("kind", ["normsoftmax", "softmax_ce"])
def test_a_classifier_drawn_where_it_lives_trains_like_one_built_on_the_host(kind):
    """The bench's CUDA build (laid out on the meta device, drawn in place) gives a classifier whose row-sparse
    optimizer sees its gradients: one step moves the rows a batch touched, as the host-built one's step does."""
    from dmltrain.distributed.bench_runs import build_classifier
    from dmltrain.distributed.classifier_head import make_classifier_optimizer

    job = gc.ClassifierJob("ours", "cpu", 300, 16, 8, R=0.5, kind=kind)
    moved = []
    for drawn_there in (False, True):
        clf = build_classifier(job, torch.device("cpu"), drawn_there=drawn_there)
        assert clf.weight.device.type == "cpu" and torch.isfinite(clf.weight).all()
        if kind == "normsoftmax":
            assert clf.weight.std().item() == pytest.approx(16**-0.5, rel=0.1)
        opt = make_classifier_optimizer(clf, "sgd", lr=0.1, momentum=0.9, weight_decay=0.0, seed=0)
        before = clf.weight.detach().clone()
        x, y = torch.randn(8, 16), torch.randint(0, 300, (8,))
        clf(x, y, step=0).backward()
        opt.step()
        moved.append((clf.weight.detach() != before).any(dim=-1).sum().item())
    assert moved[1] == moved[0] > 0
