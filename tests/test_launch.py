"""The driver of `dmltrain train` without Ray: up-front checks (one line, exit 2, before Ray starts), output
folders for every command, the run records that tell a crashed run from a live one, `--resume`, the summary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from dmltrain.cli import main
from dmltrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from shards.build.synthetic import build_synthetic_shards

    out = tmp_path_factory.mktemp("shards") / "s"
    build_synthetic_shards(out, classes=16, per_class=6, image_size=32, seed=0, shard_size=40, progress=False)
    return out


def _train_args(tmp_path: Path, shards: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(REPO / "configs/demo.yaml"),
        "--no-progress",
        f"data.shards={shards}",
        "data.synthetic=null",
        "data.batch_size=32",
        "data.samples_per_class=4",
        "model.backbone=small_cnn",
        f"train.output_dir={tmp_path / 'runs'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        *extra,
    ]


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    import ray

    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("dmltrain: error: ") and "\n" not in err, err
    assert not ray.is_initialized()  # refused before Ray started
    return err


def test_bad_configs_are_one_line_before_anything_starts(tmp_path, shards, capsys):
    bad = tmp_path / "extends.yaml"
    bad.write_text("extends: 42\n")
    assert "extends.yaml: extends: expected a config path" in _one_line_error(capsys, ["train", str(bad)])
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("optim:\n  lr: 0.1  # r\xe9glage\n".encode("latin-1"))
    assert "latin1.yaml: not UTF-8 text (byte 0xe9" in _one_line_error(capsys, ["train", str(latin1)])
    for value in (".inf", ".nan", "-.inf"):
        err = _one_line_error(capsys, _train_args(tmp_path, shards, f"optim.lr={value}"))
        assert "optim.lr: Input should be a finite number" in err
    assert not (tmp_path / "runs").exists()


def test_bad_pretrained_weights_are_refused_on_the_driver(tmp_path, shards, capsys):
    garbage = tmp_path / "weights.pth"
    garbage.write_bytes(os.urandom(1000))
    err = _one_line_error(capsys, _train_args(tmp_path, shards, f"model.pretrained={garbage}"))
    assert f"model.pretrained: cannot read {garbage} as a PyTorch state dict" in err
    other = tmp_path / "resnet18.pth"
    from dmltrain.models.backbones import build_backbone

    torch.save(build_backbone("resnet18").state_dict(), other)
    err = _one_line_error(capsys, _train_args(tmp_path, shards, f"model.pretrained={other}"))
    assert f"model.pretrained: {other} does not fit backbone small_cnn" in err
    err = _one_line_error(capsys, _train_args(tmp_path, shards, f"model.pretrained={tmp_path / 'missing.pth'}"))
    assert "model.pretrained: file not found" in err
    # a file that fits passes the driver's check
    from dmltrain.models.pretrained import check_pretrained

    fits = tmp_path / "small_cnn.pth"
    torch.save(build_backbone("small_cnn").state_dict(), fits)
    check_pretrained("small_cnn", str(fits))


def test_read_only_output_folders_are_refused_before_the_work(tmp_path, shards, read_only_dir, capsys):
    err = _one_line_error(capsys, _train_args(tmp_path, shards, f"train.output_dir={read_only_dir / 'runs'}"))
    assert f"train.output_dir: cannot write to {read_only_dir}" in err
    err = _one_line_error(
        capsys,
        [
            "shards",
            "build",
            "--layout",
            "synthetic",
            "--classes",
            "4",
            "--per-class",
            "2",
            "--quiet",
            "--out",
            str(read_only_dir / "s"),
        ],
    )
    assert f"--out: cannot write to {read_only_dir}" in err
    from dmltrain.evaluate.store import save_embeddings

    emb = tmp_path / "emb"
    g = torch.Generator().manual_seed(0)
    save_embeddings(
        emb,
        "test",
        torch.nn.functional.normalize(torch.randn(12, 8, generator=g), dim=1).numpy(),
        (torch.arange(12) % 4).numpy(),
    )
    for option, target in (
        ("--out", read_only_dir / "m.json"),
        ("--save-embeddings", read_only_dir / "again"),
        ("--plots", read_only_dir),
    ):
        err = _one_line_error(capsys, ["eval", "-", "--embeddings", str(emb), "--no-nmi", option, str(target)])
        assert f"{option}: cannot write to {read_only_dir}" in err, err
    assert list(read_only_dir.iterdir()) == []


def test_a_full_file_system_is_refused(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("dmltrain.fileio.shutil.disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    err = _one_line_error(
        capsys,
        [
            "shards",
            "build",
            "--layout",
            "synthetic",
            "--classes",
            "4",
            "--per-class",
            "2",
            "--quiet",
            "--out",
            str(tmp_path / "s"),
        ],
    )
    assert f"--out: {tmp_path} is full (1 MB free" in err
    assert not (tmp_path / "s").exists()


def test_an_os_error_anywhere_is_one_line_naming_the_path(monkeypatch, capsys):
    def fail(args):
        raise PermissionError(13, "Permission denied", "/srv/out/metrics.json")

    monkeypatch.setattr("dmltrain.cli.run", fail)
    assert main(["config", "show"]) == 1
    assert capsys.readouterr().err == "dmltrain: error: /srv/out/metrics.json: Permission denied\n"


def test_overrides_may_follow_options_and_a_bare_resume():
    from dmltrain.cli import parse

    args = parse(["train", "cfg.yaml", "a.b=1", "--no-progress", "c.d=2", "--resume", "e.f=3"])
    assert (args.config, args.overrides, args.resume, args.no_progress) == (
        "cfg.yaml",
        ["a.b=1", "c.d=2"],
        "e.f=3",
        True,
    )
    args = parse(["train", "cfg.yaml", "--resume", "my-run", "x.y=4"])
    assert (args.resume, args.overrides) == ("my-run", ["x.y=4"])
    with pytest.raises(SystemExit):
        parse(["train", "cfg.yaml", "--resume", "r", "stray"])


def test_the_summary_lists_only_models_that_were_written(tmp_path):
    from cluster.launch import TrainSummary

    failed = TrainSummary("r", False, None, "sqlite:///x.db", None, str(tmp_path), {"step": 3}, "loss diverged")
    assert "models:" not in failed.render()
    (tmp_path / "best_model").mkdir()
    (tmp_path / "best_model" / "model.pt").write_bytes(b"x")
    assert f"  models: {tmp_path}/best_model/model.pt\n" in failed.render() + "\n"
    assert "model/model.pt" not in failed.render().replace("best_model/model.pt", "")
    # tracking off: no MLflow store was written, so none is pointed at
    off = TrainSummary("r", True, None, "sqlite:///x.db", None, str(tmp_path), {"step": 3})
    assert "MLflow run id: (tracking off)" in off.render() and "open MLflow" not in off.render()
    on = TrainSummary("r", True, "abc", "sqlite:///x.db", None, str(tmp_path), {"step": 3})
    assert "open MLflow: mlflow ui --backend-store-uri sqlite:///x.db" in on.render()


def test_train_prints_its_run_link_into_the_ui_given_by_ui_url(tmp_path, monkeypatch, capsys):
    """``dmltrain train --ui-url`` reaches the printed link: the run's page in that UI, in MLflow's
    model-training view; without it the link is mlflow ui's, as before."""
    from cluster import launch
    from cluster.launch import TrainSummary
    from dmltrain.tracking.run import RunHandle

    handle = RunHandle.open(f"sqlite:///{tmp_path / 'mlflow.db'}", "exp", "r", {})
    seen = {}

    def train(cfg, **kw):  # the command's wiring, down to the link train() prints (its Ray part is not run)
        seen.update(kw)
        url = handle.url(ui=kw["ui_url"])
        return TrainSummary("r", True, handle.run_id, handle.uri, None, str(tmp_path), {"step": 1}, mlflow_url=url)

    monkeypatch.setattr(launch, "train", train)
    out = tmp_path / "o"
    assert main(["train", "configs/demo.yaml", f"train.output_dir={out}", "--ui-url", "http://ui.example:8080/"]) == 0
    printed = capsys.readouterr().out
    exp = handle.experiment_id
    link = f"http://ui.example:8080/#/experiments/{exp}/runs/{handle.run_id}?workflowType=machine_learning"
    assert seen["ui_url"] == "http://ui.example:8080/" and f"  MLflow: {link}\n" in printed
    assert main(["train", "configs/demo.yaml", f"train.output_dir={out}"]) == 0
    assert seen["ui_url"] is None and "  MLflow: http://127.0.0.1:5000/#/experiments/" in capsys.readouterr().out


# -- run records: a crashed driver is found and its run closed or resumed --------------------------------
def _record(tmp_path: Path, name: str, **over):
    from cluster.run_records import RunRecord

    record = RunRecord.for_this_driver(
        name, over.pop("config", "/cfg/a.yaml"), over.pop("run_id", None), over.pop("uri", "sqlite:///x.db")
    )
    for k, v in over.items():
        setattr(record, k, v)
    run_dir = tmp_path / name
    run_dir.mkdir(parents=True, exist_ok=True)
    record.write(run_dir)
    return run_dir, record


def test_run_records_tell_a_dead_driver_from_a_live_one(tmp_path):
    import psutil

    from cluster.run_records import RunRecord
    from dmltrain.training.fence import STALE_AFTER_S

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(sleeper.pid).create_time()
        run_dir, _ = _record(tmp_path, "live", pid=sleeper.pid, pid_started=started)
        assert RunRecord.read(run_dir).driver_alive(run_dir)
        _, reused = _record(
            tmp_path, "reused", pid=sleeper.pid, pid_started=started - 100
        )  # the pid, reused by another process
        assert not reused.driver_alive(tmp_path / "reused")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not RunRecord.read(run_dir).driver_alive(run_dir)
    far_dir, far = _record(tmp_path, "far", host="another-host", pid=1)
    assert far.driver_alive(far_dir)  # another host: its heartbeat is fresh
    old = time.time() - STALE_AFTER_S - 10
    os.utime(far_dir / "driver.json", (old, old))
    assert not far.driver_alive(far_dir)
    _, mine = _record(tmp_path, "mine")
    assert not mine.driver_alive(tmp_path / "mine")  # this process does not train it (any more): it has ended


def test_a_run_this_process_trains_is_no_crashed_run_to_a_point_starting_beside_it(tmp_path, shards, monkeypatch):
    """A ``--parallel`` study trains its points in threads of one driver. A point starting looks for crashed runs
    in the runs folder: one of this process's still training must not count as one (it used to, once its record
    was written: its record and MLflow run were marked FAILED, and its workers stop on a FAILED record). Here the
    other point starts while this one is between its record and its training."""
    import cluster.launch as launch
    from cluster.resume import close_crashed_runs
    from cluster.run_records import RunRecord
    from dmltrain.config import load_config

    argv = _train_args(tmp_path, shards, "train.run_name=point-a", "tracking.enabled=false")
    cfg = load_config(argv[1], argv[3:])
    seen = {}

    def second_point_starts(cfg):  # where init_ray runs: point-a's record is written, its training not begun
        close_crashed_runs(tmp_path / "runs", keep="point-b", tracking_uri=None)
        seen["status"] = RunRecord.read(tmp_path / "runs" / "point-a").status
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch, "init_ray", second_point_starts)
    summary = launch.train(cfg, progress=False)
    assert seen == {"status": "RUNNING"} and "stop here" in summary.error
    record = RunRecord.read(tmp_path / "runs" / "point-a")
    assert record.status == "FAILED" and not record.driver_alive(tmp_path / "runs" / "point-a")  # ended now


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite MLflow store for the module's record tests (creating one takes seconds): its URI and a client."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    return uri, MlflowClient(tracking_uri=uri)


def test_a_crashed_run_is_marked_failed_and_a_live_one_left_alone(tmp_path, store, capsys):
    from cluster.resume import claim_run, close_crashed_runs
    from dmltrain.tracking.names import ERROR_TAG

    uri, client = store
    exp = client.create_experiment("crashed")
    crashed, live = (client.create_run(exp, run_name=n).info.run_id for n in ("crashed", "live"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        crashed_dir, _ = _record(
            tmp_path, "crashed", pid=2**22 + 7, host=os.uname().nodename, run_id=crashed, uri=uri
        )  # no such pid
        client.set_tag(crashed, "dmltrain.run_name", "crashed")  # what `train` tags its run with
        client.set_tag(crashed, "dmltrain.storage_dir", str(crashed_dir))
        _record(
            tmp_path,
            "live",
            pid=sleeper.pid,
            pid_started=psutil.Process(sleeper.pid).create_time(),
            run_id=live,
            uri=uri,
        )
        _record(tmp_path, "resumed-now", pid=2**22 + 9, host=os.uname().nodename, run_id=None, uri=uri)
        close_crashed_runs(tmp_path, keep="resumed-now", tracking_uri=uri)
        with pytest.raises(UserError, match=r"run live is being trained by another driver \(pid \d+ on "):
            claim_run(tmp_path / "live", "live")
    finally:
        sleeper.kill()
        sleeper.wait()
    run = client.get_run(crashed)
    assert run.info.status == "FAILED" and "died without ending the run" in run.data.tags[ERROR_TAG]
    assert client.get_run(live).info.status == "RUNNING"
    err = capsys.readouterr().err
    assert (
        "run crashed: the driver (pid" in err
        and "dmltrain train /cfg/a.yaml --resume crashed" in err
        and "resumed-now" not in err
    )
    from cluster.run_records import RunRecord

    assert (
        RunRecord.read(tmp_path / "crashed").status == "FAILED"
        and RunRecord.read(tmp_path / "resumed-now").status == "RUNNING"
    )


def test_a_planted_run_record_is_data(tmp_path, store, capsys):
    """A record names no store to connect to, prints no control characters, and one with a bad field is one
    line: left alone as a sibling, refused as the run's own record."""
    import json

    from cluster.resume import claim_run, close_crashed_runs, latest_run

    uri, client = store
    victim = client.create_run(client.create_experiment("planted"), run_name="another").info.run_id  # another's id
    elsewhere = tmp_path / "elsewhere"
    runs = tmp_path / "runs"
    _record(
        runs,
        "planted",
        pid=2**22 + 7,
        host=os.uname().nodename,
        uri=f"sqlite:///{elsewhere / 'evil.db'}",  # once opened as the store: a database outside the folder
        run_id=victim,
        config="/cfg/\x1b[2J\x1b[31mred.yaml\r",
    )
    bad, _ = _record(runs, "bad-pid", started=1e12)  # the newest: --resume would pick it
    record = json.loads((bad / "driver.json").read_text())
    (bad / "driver.json").write_text(json.dumps({**record, "pid": "123"}))
    close_crashed_runs(runs, keep="x", tracking_uri=uri)
    assert not elsewhere.exists()
    assert client.get_run(victim).info.status == "RUNNING"  # not this folder's run: left alone
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "dmltrain train '/cfg/[2J[31mred.yaml' --resume planted" in err
    assert "its MLflow run, not found in this config's store, was left as it is" in err
    line = f'dmltrain: warning: {bad / "driver.json"}: not a run record dmltrain wrote (pid: "123" is not a process id'
    assert line in err and len([x for x in err.splitlines() if "bad-pid" in x]) == 1
    assert latest_run(runs, "/cfg/a.yaml") is None  # the bad record is skipped, with its warning
    with pytest.raises(UserError) as e:
        claim_run(bad, "bad-pid")
    assert 'pid: "123" is not a process id' in str(e.value) and str(e.value).endswith("remove it to train run bad-pid")
    (bad / "driver.json").write_text(json.dumps({**record, "run_name": "../planted"}))
    with pytest.raises(UserError, match='run_name: "../planted" is not the run folder\'s name'):
        claim_run(bad, "bad-pid")
    # Ray's snapshot names the checkpoint to resume from: a folder of the run, nothing else
    snapshot = {"latest_checkpoint_result": {"checkpoint_dir_name": "../planted", "metrics": {"step": 2}}}
    (runs / "planted" / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    with pytest.raises(UserError, match='names the checkpoint "../planted", not a folder of the run; refused'):
        claim_run(runs / "planted", "planted")


def test_a_checkpoint_folder_that_is_a_link_out_of_the_run_is_refused(tmp_path):
    """Ray's snapshot names ``checkpoint-step8``, a symbolic link to a folder outside the run: the resume would read
    that folder, so the run is refused in one line before anything of it is scanned or loaded."""
    import json

    from cluster.resume import claim_run

    run, outside = tmp_path / "runs" / "r", tmp_path / "outside"
    (outside / "engine").mkdir(parents=True)
    run.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, outside / "engine" / "a.pt")  # data only: the scan alone would pass it
    (run / "checkpoint-step8").symlink_to(outside, target_is_directory=True)
    snapshot = {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint-step8", "metrics": {"step": 8}}}
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
    with pytest.raises(UserError) as e:
        claim_run(run, "r")
    assert str(e.value).startswith(f"{run / 'checkpoint-step8'}: a symbolic link to {outside}, not a folder of the run")
    assert "\n" not in str(e.value)
    (run / "checkpoint-step8").unlink()
    (run / "checkpoint-step8").mkdir()
    assert claim_run(run, "r") is None  # a real folder of the run: resumed


def test_a_worker_group_stops_when_its_driver_dies_or_another_takes_the_run_over(tmp_path):
    import psutil

    from cluster.run_records import RECORD_FILE, RunRecord
    from dmltrain.training.fence import STALE_AFTER_S, DriverInfo, Fence, Superseded

    run_dir, record = _record(tmp_path, "r")  # this process is the run's driver, generation 1
    me = DriverInfo.this_process(record.generation, run_dir / RECORD_FILE)

    def fence(**over):
        return Fence({**me.to_dict(), **over}, 0, "cpu")

    fence().check()  # alive and current
    Fence(None, 0, "cpu").check()  # no driver to watch (a Tune trial)
    successor = RunRecord.for_this_driver("r", None, None, "x", after=record)
    successor.write(run_dir)
    with pytest.raises(Superseded, match=r"another driver took the run over \(generation 2, this group's 1\)"):
        fence().check()
    fence(generation=2).check()
    successor.status = "FAILED"
    successor.write(run_dir)
    with pytest.raises(Superseded, match=r"the driver ended the run \(FAILED\)"):
        fence(generation=2).check()
    successor.status = "RUNNING"
    successor.write(run_dir)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = {"pid": sleeper.pid, "pid_started": psutil.Process(sleeper.pid).create_time(), "generation": 2}
    fence(**gone).check()
    sleeper.kill()
    sleeper.wait()
    with pytest.raises(Superseded, match=rf"the driver \(pid {sleeper.pid} on .*\) died"):
        fence(**gone).check()
    far = {"host": "another-host", "generation": 2}  # another machine: the record's heartbeat tells
    fence(**far).check()
    old = time.time() - STALE_AFTER_S - 10
    os.utime(run_dir / RECORD_FILE, (old, old))
    with pytest.raises(Superseded, match="died"):
        fence(**far).check()


def test_resume_picks_the_latest_run_of_the_config(tmp_path):
    from cluster.resume import resolve_run_name
    from cluster.run_location import RunLocation
    from dmltrain.config import load_config

    cfg = load_config(None, [f"train.output_dir={tmp_path}"])
    _record(tmp_path, "a-old", config="/cfg/a.yaml", started=100.0)
    _record(tmp_path, "a-new", config="/cfg/a.yaml", started=200.0)
    _record(tmp_path, "b-newest", config="/cfg/b.yaml", started=300.0)
    root = RunLocation.of(cfg)
    assert resolve_run_name(cfg, root, "/cfg/a.yaml", "") == "a-new"
    assert resolve_run_name(cfg, root, "/cfg/a.yaml", "a-old") == "a-old"
    assert resolve_run_name(cfg, root, "/cfg/a.yaml", None) is None  # no --resume: a new run
    with pytest.raises(UserError, match="--resume: no earlier run of /cfg/c.yaml in"):
        resolve_run_name(cfg, root, "/cfg/c.yaml", "")
    with pytest.raises(UserError, match="--resume gone: no run of that name in"):
        resolve_run_name(cfg, root, "/cfg/a.yaml", "gone")
    with pytest.raises(UserError, match="not a run name"):
        resolve_run_name(cfg, root, "/cfg/a.yaml", "../a-new")
    named = load_config(None, ["train.run_name=a-old", f"train.output_dir={tmp_path}"])
    with pytest.raises(UserError, match="train.run_name is a-old"):
        resolve_run_name(named, root, "/cfg/a.yaml", "a-new")
    assert resolve_run_name(named, root, "/cfg/a.yaml", "") == "a-old"
