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

from dmltrain import gpu_check as gc

REPO = Path(__file__).resolve().parents[1]


def test_rows_from_pytest_junit_report(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        """<?xml version="1.0"?><testsuites><testsuite>
        <testcase classname="tests.test_a" name="test_ok"/>
        <testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>
        <testcase classname="tests.test_b" name="test_skip[cuda]"><skipped message="needs a CUDA device"/></testcase>
        <testcase classname="tests.test_b" name="test_err"><error message="fixture broke">tb</error></testcase>
        </testsuite></testsuites>"""
    )
    summary, bad, err = gc.test_rows(xml, cuda=True)
    assert summary.figure == "1 passed, 1 failed, 1 errors, 1 skipped" and summary.verdict == "FAIL"
    assert (bad.what, bad.figure, bad.verdict) == ("test_a::test_bad", "assert 1 == 2", "FAIL")
    assert (err.what, err.figure) == ("test_b::test_err", "fixture broke")
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>')
    assert gc.test_rows(xml, cuda=True)[0].verdict == "pass" and gc.test_rows(xml, cuda=False)[0].verdict == "info"


def test_classifier_rows_hold_each_figure_to_its_target():
    gib = 2**30
    res = {"step": 0.009, "gemm": 0.005, "peak_gpu": 4.5 * gib, "param_bytes": gib, "opt_bytes": 2 * gib}
    step, memory = gc.classifier_rows("10^6x512 B=1,024", 1.0, res, cuda=True)
    assert (step.figure, step.reference, step.target, step.verdict) == (
        "9.0 ms", "bf16 3-GEMM bound 5.0 ms", "<= 2x", "pass")  # fmt: skip
    assert step.ratio == pytest.approx(1.8)
    assert memory.figure == "4.50 GiB" and memory.reference == "weight+grad+state 4.00 GiB" and memory.verdict == "pass"
    slow = gc.classifier_rows("s", 1.0, {**res, "step": 0.011, "peak_gpu": 5.5 * gib}, cuda=True)
    assert [r.verdict for r in slow] == ["FAIL", "FAIL"]
    (cpu,) = gc.classifier_rows("s", 1.0, {"step": 0.3, "gemm": 0.1}, cuda=False)
    assert cpu.verdict == "info" and cpu.target == "" and cpu.reference == "fp32 3-GEMM 100.0 ms"


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


def test_tiny_cpu_run_prints_one_table_and_writes_its_json(tmp_path, monkeypatch, capsys):
    """The real parts on toy sizes: the CUDA tests (all skipped here), the classifier's bench runs (fresh
    processes) and the eval bench."""
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
        ("tests", "done"), ("classifier", "done"), ("eval", "done")]  # fmt: skip
    tests = report["rows"][0]
    assert tests["what"] == "pytest -m cuda" and tests["figure"].startswith("0 passed, 0 failed, 0 errors, ")
    whats = [r["what"] for r in report["rows"]]
    assert whats[1:4] == ["2,000x16 B=32 R=1 step", "2,000x16 B=32 R=0.5 step", "2,000x16 B=32 R=0.5 vs R=1"]
    assert "n=400 D=32 Recall@K" in whats and "binary 64 bits (native)" in whats
    assert all(r["verdict"] == "info" for r in report["rows"]) and report["tiny"] and report["device"] == "cpu"
    assert (out / "r.md").read_text().count("| classifier |") == 3
    assert "bench_runs" in (out / "r.log").read_text()


def test_doctor_rows_from_the_lines_it_printed_before_a_cut():
    from dmltrain.doctor import Check

    checks = [Check("torch", True, "2.14 (CUDA 13.0 build)", "always"), Check("cuda", False, "no CUDA device", "cluster.use_gpu: true"),
              Check("faiss", False, "faiss is not installed")]  # fmt: skip
    text = "dmltrain doctor: the default config on gpu-node\n" + "\n".join(c.line() for c in checks) + "\n"
    rows = gc.doctor_rows(gc.printed_checks(text))
    assert [(r.what, r.verdict, r.target) for r in rows] == [
        ("torch", "pass", ""), ("cuda", "FAIL", "works"), ("faiss", "info", "")]  # fmt: skip
    assert rows[1].figure == "no CUDA device (needed: cluster.use_gpu: true)"
