"""``dmltrain doctor`` on this CPU-only machine: what is here, what is absent, and what a config needs.

Real checks throughout (torch, NCCL, Triton, MLflow on SQLite, faiss, DeepSpeed's accelerator); the
local Ray start, which takes 5-25 s on two busy cores, is skipped where it is not what is tested (the
Ray check's own handling of its child process is tested with a stand-in child).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dmltrain import doctor
from dmltrain.cli import main
from dmltrain.config import load_config

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="the CPU answers")
def test_default_config_on_a_cpu_node_is_healthy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default tracking URI: sqlite:///<cwd>/mlflow.db
    assert main(["doctor", "--skip", "ray"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {ln.split()[1]: ln for ln in out[1:-1]}
    assert list(lines) == [c for c in doctor.CHECKS if c != "ray"]
    assert lines["torch"].startswith("ok") and torch.__version__ in lines["torch"]
    for name in ("cuda", "gpus", "nccl", "triton", "nvjpeg"):
        assert lines[name].startswith("absent"), lines[name]
    assert "no CUDA device" in lines["cuda"] and "no CUDA device" in lines["triton"]
    assert lines["mlflow"].startswith("ok") and f"sqlite:///{tmp_path}/mlflow.db" in lines["mlflow"]
    assert not (tmp_path / "mlflow.db").exists()  # looked at, not created
    assert lines["faiss"].startswith("ok") and "CPU build" in lines["faiss"]
    assert lines["deepspeed"].startswith("ok") and "accelerator cpu" in lines["deepspeed"]
    assert out[-1] == "4 ok, 5 absent, 0 missing; skipped ray"


@pytest.mark.skipif(not NO_CUDA, reason="the CPU answers")
def test_a_gpu_config_on_a_cpu_node_exits_nonzero_naming_what_it_needs(tmp_path):
    """The command itself, in a fresh process: one line per check, no traceback, exit code 1, the JSON."""
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(f"cluster:\n  use_gpu: true\n  num_workers: 2\ntracking:\n  uri: sqlite:///{tmp_path}/t.db\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    report = tmp_path / "doctor.json"
    cmd = [sys.executable, "-m", "dmltrain", "doctor", str(cfg), "--skip", "ray", "--json", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines()[1:-1]}
    for name in ("cuda", "gpus", "nccl", "triton", "nvjpeg"):
        assert lines[name].startswith("MISSING") and "(needed: cluster.use_gpu: true" in lines[name], lines[name]
    assert lines["deepspeed"].startswith("MISSING") and "accelerator cpu, not cuda" in lines["deepspeed"]
    assert proc.stdout.splitlines()[-1] == (
        "3 ok, 0 absent, 6 missing: the config needs cuda, gpus, nccl, triton, nvjpeg, deepspeed; skipped ray"
    )
    got = json.loads(report.read_text())
    assert got["missing"] == ["cuda", "gpus", "nccl", "triton", "nvjpeg", "deepspeed"]
    assert {c["name"]: c["status"] for c in got["checks"]}["mlflow"] == "ok"


def test_what_a_config_needs():
    needs = doctor.config_needs(load_config(None, []))
    assert set(needs) == {"torch", "deepspeed", "ray", "mlflow", "faiss"}
    gpu = doctor.config_needs(load_config(None, ["cluster.use_gpu=true", "cluster.num_workers=1"]))
    assert {"cuda", "gpus", "triton", "nvjpeg"} <= set(gpu) and "nccl" not in gpu and "faiss" not in gpu
    rotating = doctor.config_needs(load_config(None, ["cluster.use_gpu=true", "data.augment.rotation=10"]))
    assert "nvjpeg" not in rotating and "nccl" in rotating  # auto decoding stays on the CPU; two workers
    remote = doctor.config_needs(load_config(None, ["cluster.use_gpu=true", "cluster.address=10.0.0.1:6379"]))
    assert "cuda" not in remote  # the GPUs are the cluster's
    off = doctor.config_needs(load_config(None, ["tracking.enabled=false", "eval.nmi=false"]))
    assert "mlflow" not in off and "faiss" not in off


def test_mlflow_check_takes_the_write_lock_or_names_the_folder(tmp_path):
    import sqlite3

    db = tmp_path / "m.db"
    sqlite3.connect(db).close()
    (blocker := tmp_path / "a-file").write_text("")
    for uri, status, text in (
        (f"sqlite:///{db}", "ok", "the database is writable"),
        (f"sqlite:///{blocker}/m.db", "MISSING", "is not a folder"),
        (str(tmp_path / "mlruns"), "ok", "the folder is writable"),
    ):
        cfg = load_config(None, [f"tracking.uri={uri}"])
        (check,) = doctor.run_checks(cfg, skip=set(doctor.CHECKS) - {"mlflow"})
        assert check.status == status and text in check.detail, (uri, check)
    cfg = load_config(None, ["tracking.enabled=false"])
    (check,) = doctor.run_checks(cfg, skip=set(doctor.CHECKS) - {"mlflow"})
    assert check.status == "absent" and check.detail == "tracking.enabled: false"


def test_ray_check_reads_its_child_and_reports_a_failure_in_one_line(monkeypatch):
    cfg = load_config(None, [])
    only_ray = set(doctor.CHECKS) - {"ray"}
    monkeypatch.setattr(doctor, "_RAY_CHILD", 'print("RESULT " + \'{"version": "9.9", "gpus": 0}\')')
    (check,) = doctor.run_checks(cfg, skip=only_ray)
    assert check.ok and check.detail.startswith("9.9: a local instance started on 127.0.0.1 and ran a task in")
    monkeypatch.setattr(doctor, "_RAY_CHILD", "import sys; sys.exit('ConnectionError: the GCS did not start')")
    (check,) = doctor.run_checks(cfg, skip=only_ray)
    assert check.status == "MISSING" and check.needed == "always (training runs on Ray)"
    assert (
        check.detail == "failed: RuntimeError: a local Ray failed (exit code 1): ConnectionError: the GCS did not start"
    )
    (check,) = doctor.run_checks(load_config(None, ["cluster.address=10.0.0.1:6379"]), skip=only_ray)
    assert check.ok and "joins cluster.address 10.0.0.1:6379 (not contacted)" in check.detail


def test_a_check_that_breaks_is_a_line_not_a_traceback(monkeypatch):
    def broken(cfg, facts):
        raise KeyError("surprise")

    monkeypatch.setitem(doctor._PROBES, "faiss", broken)
    (check,) = doctor.run_checks(load_config(None, []), skip=set(doctor.CHECKS) - {"faiss"})
    assert check.status == "MISSING" and check.detail == "failed: KeyError: 'surprise'"
    assert check.line().startswith("MISSING faiss     failed: KeyError")


def _fused_step_interpreted(rank, world):
    from dmltrain.doctor import fused_step_check

    return fused_step_check(classes=60, dim=16, batch=24, device="cpu")


def test_fused_step_check_passes_under_the_interpreter(monkeypatch):
    """The doctor's GPU check of the fused classifier, run on the CPU by Triton's interpreter (spawned: the
    variable only acts on kernels defined after it is set)."""
    from multiproc import run_workers

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (line,) = run_workers(_fused_step_interpreted, 1, timeout=300)
    assert line.startswith("a fused classifier step (bf16, 60 classes, D=16, B=24) matches the torch path")
