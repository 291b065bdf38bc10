"""The training system end to end: Ray Train V2 + DeepSpeed workers + shards + MLflow.

One local Ray for the module. The three runs share one config (2 gloo workers, tiny
synthetic shards, sharded NormSoftmax with class subsampling plus ICE):

1. a plain run trains, evaluates, logs an MLflow run and leaves checkpoints;
2. the same config under another name, with one worker process killed (SIGKILL) while the
   workers hold before step 3 (``DMLTRAIN_FAULT_HOLD``: a live worker of this run, whatever the
   machine's load): Ray restarts the group, training resumes from step 2's checkpoint, ends at
   the same step in a single MLflow run, one value per step, with the same weights as run 1;
3. a run saved at 2 workers mid-epoch is resumed at 1 worker by re-running it under its name: it continues the
   epoch (the global batch of a step does not depend on the worker count);
4. a copy of run 1 with a pickle planted in its checkpoint is refused before any worker starts;
5. a loss made NaN at step 3 stops the run FAILED, keeping the checkpoints of steps 1-2 only;
6. a `dmltrain train` process killed outright (SIGKILL) while its workers hold before step 4: its
   workers, released, log nothing more; `dmltrain train CONFIG --resume` (no run name) continues the
   run in the same MLflow run, which ends FINISHED with one value per step.
7. a timm ViT fine-tunes from weights timm saved, with the fine-tuning controls on, and exports its
   weights' average.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs/demo.yaml"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from cluster.launch import start_local_ray
    from shards.build.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("train")
    shards = root / "shards"
    build_synthetic_shards(shards, classes=16, per_class=6, image_size=32, seed=0, shard_size=40, progress=False)
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield root, shards
    ray.shutdown()


def _config(root: Path, shards: Path, **over):
    from dmltrain.config import load_config

    return load_config(DEMO, _overrides(root, shards, **over))


def _overrides(root: Path, shards: Path, **over) -> list[str]:
    overrides = {
        "data.shards": str(shards),
        "data.synthetic": "null",
        "data.batch_size": 32,
        "data.samples_per_class": 4,
        "data.loader_workers": 0,
        "data.eval_batch_size": 64,
        "model.backbone": "small_cnn",
        "model.embedding_dim": 64,
        "loss.classifier.sample_ratio": 0.5,
        "loss.instance.kind": "ice",
        "loss.instance.weight": 0.5,
        "train.epochs": 2,
        "train.checkpoint_every": 2,
        "train.keep_checkpoints": 2,
        "train.log_every": 1,
        "train.output_dir": str(root / "runs"),
        "eval.every": 1,
        "eval.plots": True,
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
        "tracking.system_metrics": False,
        "tracking.log_models": False,  # the plain run checks the Models view; the others need no torch.export
        "cluster.num_workers": 2,
        "cluster.cpus_per_worker": 0.5,
        "cluster.max_failures": 1,
    }
    overrides.update(over)
    return [f"{k}={v}" for k, v in overrides.items()]


def _final_weights(summary) -> dict[str, torch.Tensor]:
    return torch.load(Path(summary.storage_dir) / "model" / "model.pt", weights_only=True)["state_dict"]


def _runs(root: Path, name: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dmltrain-demo")
    return client, client.search_runs([exp.experiment_id], filter_string=f"tags.`dmltrain.run_name` = '{name}'")


@pytest.fixture(scope="module")
def plain_run(env):
    from cluster.launch import train

    root, shards = env
    summary = train(_config(root, shards, **{"train.run_name": "plain", "tracking.log_models": True}), progress=False)
    assert summary.ok, summary.error
    return summary


def test_trains_evaluates_logs_and_checkpoints(env, plain_run):
    root, _ = env
    s = plain_run
    steps = s.metrics["step"]
    assert steps > 4 and s.metrics["final"]["recall@1"] > 0
    assert set(s.metrics["initial"]) >= {"recall@1", "nmi", "map@r"}
    # checkpoints: Ray kept the last two, each holding every rank's files
    ckpts = sorted(Path(s.storage_dir).glob("checkpoint-step*"))
    assert len(ckpts) == 2 and ckpts[-1].name == f"checkpoint-step{steps:08d}"
    names = {p.name for p in ckpts[-1].iterdir()}
    assert {
        "model.pt",
        "classifier",
        "dp_optimizer.pt",
        "train_state.json",
        "rng-rank0.pt",
        "rng-rank1.pt",
        "engine",
    } <= names
    assert len(list((ckpts[-1] / "engine").glob("*optim_states.pt"))) == 2  # one ZeRO partition per rank
    assert len(list((ckpts[-1] / "classifier").glob("classifier-*.pt"))) == 2  # one row piece per rank
    # MLflow: one run with params, metric curves and artifacts
    client, runs = _runs(root, "plain")
    assert len(runs) == 1
    run = runs[0]
    assert (
        run.info.status == "FINISHED"
        and run.data.params["optim.lr"] == "0.003"
        and run.data.params["cluster.num_workers"] == "2"
    )
    losses = client.get_metric_history(run.info.run_id, "batch/loss")
    assert len(losses) == steps and all(m.value == m.value for m in losses)
    for key in (
        "eval/recall_at_1",
        "eval/ranking/map_at_r",
        "softmax/loss",
        "instance/loss",
        "images_per_s",
        "time/forward_ms",
        "batch/lr",
    ):
        assert key in run.data.metrics, key
    # the untrained model's evaluation is the step-0 point of the same series as every later one
    recall = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/recall_at_1")}
    assert min(recall) == 0 and recall[0] == pytest.approx(s.metrics["initial"]["recall@1"])
    assert recall[steps] == pytest.approx(s.metrics["final"]["recall@1"])
    assert not any(k.startswith(("initial/", "softmax/active")) or "num_queries" in k for k in run.data.metrics)
    # what does not change while a run trains is a tag (the classifier's draw, its memory, the evaluation's counts)
    from mlflow.entities import LoggedModelStatus

    from dmltrain.tracking import names

    tags = run.data.tags
    # 2 workers, 16 classes: each step's softmax holds round(0.5 x 16) = 8 classes, 8 of them over both shards
    assert tags[names.ACTIVE_CLASSES_TAG] == "8" and tags[names.ACTIVE_SHARE_TAG] == "0.5"
    assert 0 < float(tags[names.ACTIVE_ROWS_TAG]) <= 8 and float(tags[names.CLASSIFIER_MB_TAG]) > 0
    assert tags[names.eval_count_tag("num_queries")] == "96" and tags[names.eval_count_tag("gallery_size")] == "96"
    # what tune, study and report read back is what the trainer logs
    read_back = {names.LOSS, names.LR, names.IMAGES_PER_S, names.STEP_MS, names.RSS_MB, names.eval_key("recall@1")}
    assert read_back <= set(run.data.metrics), read_back - set(run.data.metrics)
    # the run explains itself: its description (completed at the end) and the shards as its datasets
    note = tags[names.DESCRIPTION_TAG]
    assert note.startswith(f"**normsoftmax (50% of the classes) + ice on small_cnn → 64-d, {steps} steps**")
    assert "`shards` (synthetic layout): train 16 classes, 96 images; test 16 classes, 96 images" in note
    assert f"**recall@1 {s.metrics['final']['recall@1']:.4f}** at step {steps} (final)" in note
    assert f"untrained {s.metrics['initial']['recall@1']:.4f}" in note
    contexts = {d.tags[0].value: d.dataset for d in run.inputs.dataset_inputs}
    assert set(contexts) == {"training", "evaluation"} and contexts["training"].name == "shards"
    # MLflow 3 logged models: one per kind (best_model replaced at each improvement), each tagged with its
    # step and score and linked to the evaluation of its step
    models = [m for m in client.search_logged_models([run.info.experiment_id]) if m.source_run_id == run.info.run_id]
    assert sorted(m.name for m in models) == ["best_model", "model"] and all(
        m.status == LoggedModelStatus.READY for m in models
    )
    (final,) = [m for m in models if m.name == "model"]
    (best,) = [m for m in models if m.name == "best_model"]
    linked = {x.key: x.value for x in final.metrics if x.step == steps}
    assert linked["eval/recall_at_1"] == pytest.approx(s.metrics["final"]["recall@1"])
    assert best.tags["step"] == str(s.metrics["best_step"])
    assert best.tags["recall_at_1"] == f"{s.metrics['best']['recall@1']:.4f}"
    assert {x.key.split("/")[0] for x in best.metrics} == {"eval"}  # its evaluation, not the step's time or memory
    outputs = {o.model_id: o.step for o in client.get_run(run.info.run_id).outputs.model_outputs}
    assert outputs[final.model_id] == steps and outputs[best.model_id] == s.metrics["best_step"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "data", "plots", "model", "best_model"} <= artifacts
    assert any(a.path.endswith(".png") for a in client.list_artifacts(run.info.run_id, "plots"))
    # the exported model is the model the run evaluated: every rank evaluated rank 0's BatchNorm statistics
    # (each worker's own differ: per-worker BatchNorm), the ones model.pt holds
    from dmltrain.config import build_config
    from dmltrain.evaluate.embedding import evaluate_model
    from dmltrain.models import load_model

    model, config, extra = load_model(Path(s.storage_dir) / "model" / "model.pt")
    assert extra["step"] == steps and config["train"]["run_name"] == "plain"
    cfg = build_config(config)
    metrics, _ = evaluate_model(model.eval(), cfg.data.shards, cfg.data.eval_splits, cfg.eval, cfg.data, progress=False)
    assert metrics["recall@1"] == pytest.approx(s.metrics["final"]["recall@1"], abs=1e-9)


def _registered_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoints Ray has committed (a directory alone may still be uploading)."""
    import json

    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results", [])]


def _held_workers(hold: Path) -> dict[int, int]:
    """rank -> pid of the workers holding before a step (``DMLTRAIN_FAULT_HOLD``, :mod:`dmltrain.training.faults`)."""
    out = {}
    for p in hold.glob("held-rank*-*"):
        rank, pid = p.name[len("held-rank") :].split("-")
        out[int(rank)] = int(pid)
    return out


def _kill_a_held_worker(run_dir: Path, hold: Path, killed: list[int]) -> None:
    """Once the run's first checkpoint is committed and its workers hold before step 3 (the run cannot end
    meanwhile), SIGKILL rank 1, then release the others."""
    try:
        _wait_for(lambda: _registered_checkpoints(run_dir) and 1 in _held_workers(hold), "a held worker of the run")
        victim = _held_workers(hold)[1]
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
    finally:
        (hold / "release").touch()


def test_worker_killed_mid_run_resumes_to_the_same_weights(env, plain_run, tmp_path, monkeypatch):
    from cluster.launch import train
    from dmltrain.training.faults import HOLD_ENV

    root, shards = env
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, f"3:{hold}")  # every worker waits before step 3 until the test releases it
    cfg = _config(root, shards, **{"train.run_name": "killed"})
    killed: list[int] = []
    watcher = threading.Thread(target=_kill_a_held_worker, args=(root / "runs" / "killed", hold, killed), daemon=True)
    watcher.start()
    summary = train(cfg, progress=False)
    watcher.join(5)
    assert killed, "no worker process was found to kill"
    assert summary.ok, summary.error
    assert summary.metrics["step"] == plain_run.metrics["step"]
    client, runs = _runs(root, "killed")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # the restarted group resumed from the checkpoint of step 2; the history holds one value per step
    assert runs[0].data.tags["dmltrain.resumed_from_step"] == "2", sorted(runs[0].data.tags)
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "batch/loss")]
    assert sorted(steps) == list(range(1, summary.metrics["step"] + 1)), steps
    # killed and resumed reaches the same weights as the uninterrupted run (CPU, fp32, same seed and W)
    a, b = _final_weights(plain_run), _final_weights(summary)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_resume_at_a_different_worker_count(env):
    """Also the recipes' bf16 engine and head-only start (the backbone frozen for the first step), and the
    classifier of #26: mixed hard/uniform draws from the nearness index, 2 sub-centers per class with samples
    dropped from step 2, the probe of the full softmax at every step (its figures in MLflow)."""
    from cluster.launch import train

    root, shards = env
    common = {"train.run_name": "reshard", "train.precision": "bf16", "schedule.unit": "step", "schedule.head_only": 1,
              "loss.classifier.sampling": "mixed", "loss.classifier.refresh_every": 3,
              "loss.classifier.params.subcenters": 2, "loss.classifier.drop_after": 2,
              "loss.classifier.probe_every": 1}  # fmt: skip
    first = train(_config(root, shards, **common, **{"train.max_steps": 2}), progress=False)
    assert first.ok and first.metrics["step"] == 2, first.error
    again = train(_config(root, shards, **common, **{"train.max_steps": 4, "cluster.num_workers": 1}), progress=False)
    assert again.ok, again.error
    assert again.metrics["step"] == 4
    client, runs = _runs(root, "reshard")
    assert len(runs) == 1
    tags = runs[0].data.tags
    assert tags["dmltrain.resumed_from_step"] == "2" and tags["resumed.cluster.num_workers"] == "1"
    # step 2 was mid-epoch: the 1-worker run continues that epoch, the same steps (the plan does not depend on W)
    assert "dmltrain.resumed_at_epoch_start" not in tags
    assert [int(m.value) for m in client.get_metric_history(runs[0].info.run_id, "cluster/workers")] == [2, 1]
    cosines = [m.value for m in client.get_metric_history(runs[0].info.run_id, "softmax/probe/grad_cos")]
    assert len(cosines) == 4 and all(0.0 < c <= 1.0 + 1e-9 for c in cosines), cosines
    chance = client.get_metric_history(runs[0].info.run_id, "softmax/probe/uniform_loss_gap")
    assert len(chance) == 4 and all(m.value <= 1e-4 for m in chance), (
        chance
    )  # normsoftmax: a subset's normaliser, never more
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "softmax/dropped")] == [1, 2, 3, 4]


def test_a_timm_vit_fine_tunes_end_to_end(env, tmp_path):
    """timm's test_vit at 32 px through the whole system: started from a state dict timm saved at 160 px (position
    embeddings resampled), normalized with its own mean and std, bicubic crops with RandAugment, 2 micro-batches per
    optimizer step, layer-wise lr decay with a 10x head, drop path, gradient checkpointing, and the weights' average,
    which is what is evaluated and exported; checkpoints fall between optimizer steps."""
    import json

    import timm

    from cluster.launch import train
    from dmltrain.models import load_model

    root, shards = env
    torch.manual_seed(0)
    torch.save(timm.create_model("test_vit").state_dict(), tmp_path / "vit.pth")
    over = {
        "train.run_name": "vit",
        "model.backbone": "test_vit",
        "model.pretrained": str(tmp_path / "vit.pth"),
        "data.image_size": 32,
        "data.eval_resize": 32,
        "data.batch_size": 16,
        "data.augment.randaugment": "[2,9]",
        "model.drop_path": 0.1,
        "model.grad_checkpointing": "true",
        "optim.layer_decay": 0.75,
        "optim.new_param_lr_mult": 10,
        "train.grad_accum": 2,
        "train.ema_decay": 0.5,
        "train.epochs": 1,
        "eval.plots": "false",
        "eval.before_training": "false",
    }
    summary = train(_config(root, shards, **over), progress=False)
    assert summary.ok, summary.error
    # 8 batches of 16 in the epoch: 4 optimizer steps
    assert summary.metrics["step"] == 4 and 0 <= summary.metrics["final"]["recall@1"] <= 1
    run_dir = Path(summary.storage_dir)
    last = sorted(run_dir.glob("checkpoint-step*"))[-1]
    state = json.loads((last / "train_state.json").read_text())
    assert (state["step"], state["grad_accum"], state["batch"] % 2) == (4, 2, 0)
    model, config, extra = load_model(run_dir / "model" / "model.pt")
    assert type(model.backbone.net).__name__ == "VisionTransformer" and extra["step"] == 4
    assert model.input_spec == {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic"}
    exported = torch.load(run_dir / "model" / "model.pt", weights_only=True)["state_dict"]
    average = torch.load(last / "ema.pt", weights_only=True)["shadow"]
    trained = torch.load(last / "model.pt", weights_only=True)["state_dict"]
    assert average.keys() == {k for k, v in trained.items() if v.is_floating_point()} - {
        k for k in trained if k.endswith(("running_mean", "running_var"))
    }
    assert all(torch.equal(exported[k], average[k]) for k in average)
    assert any(not torch.equal(average[k], trained[k]) for k in average)
    _, runs = _runs(root, "vit")
    params = runs[0].data.params
    assert (params["train.grad_accum"], params["data.interpolation"], params["model.image_size"]) == (
        "2",
        "bicubic",
        "32",
    )


class _Planted:
    """A pickle payload: unpickling it calls ``open(marker, 'w')``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_tampered_checkpoint_is_refused_before_any_worker_starts(env, plain_run):
    from cluster.launch import train
    from dmltrain.errors import UserError

    root, shards = env
    copy = root / "runs" / "tampered"
    shutil.copytree(plain_run.storage_dir, copy, ignore=shutil.ignore_patterns("driver.json"))
    latest = sorted(copy.glob("checkpoint-step*"))[-1]
    states = latest / "engine" / "mp_rank_00_model_states.pt"  # DeepSpeed's module states, read by every worker
    marker = root / "code-ran"
    torch.save({**torch.load(states, weights_only=False), "module": _Planted(marker)}, states)
    with pytest.raises(
        UserError, match=r"mp_rank_00_model_states\.pt: refused to load a checkpoint file that holds .*open"
    ):
        train(_config(root, shards, **{"train.run_name": "tampered"}), progress=False)
    assert not marker.exists()
    assert _runs(root, "tampered")[1] == []  # refused before its MLflow run was opened


def test_a_diverged_loss_stops_the_run_failed_keeping_the_last_good_checkpoint(env, monkeypatch):
    from cluster.launch import train
    from dmltrain.tracking.names import ERROR_TAG
    from dmltrain.training.faults import FAULT_ENV

    root, shards = env
    monkeypatch.setenv(FAULT_ENV, "3")  # the embeddings of step 3 become NaN on every worker
    over = {"train.run_name": "diverged", "train.checkpoint_every": 1, "eval.before_training": "false", "eval.every": 0}
    summary = train(_config(root, shards, **over), progress=False)
    assert not summary.ok
    assert (
        summary.error
        == "loss diverged: the classifier loss is nan at step 3; training stopped, the last checkpoint is step 2"
    )
    run_dir = Path(summary.storage_dir)
    assert [p.name for p in sorted(run_dir.glob("checkpoint-step*"))] == [
        "checkpoint-step00000001",
        "checkpoint-step00000002",
    ]
    assert not (run_dir / "model" / "model.pt").exists() and "models:" not in summary.render()
    client, runs = _runs(root, "diverged")
    assert len(runs) == 1 and runs[0].info.status == "FAILED" and runs[0].data.tags[ERROR_TAG] == summary.error
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "batch/loss")] == [
        1,
        2,
    ]  # nothing logged from step 3


def _wait_for(predicate, what: str, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_driver_is_resumed_by_config_in_the_same_mlflow_run(env, tmp_path, capsys):
    """Killed while its workers hold before step 4 (steps 1-3 logged, step 2's checkpoint committed): the killed
    driver's workers, released, stop by themselves at their next log point (their driver is dead) and log nothing
    more; the resumed run replays step 3 from the checkpoint without logging it again: one value per step."""
    import psutil
    import ray

    from cluster.resume import latest_checkpoint_step
    from cluster.run_records import RunRecord
    from dmltrain.cli import main
    from dmltrain.tracking.names import RESUMED_FROM_STEP_TAG
    from dmltrain.training.faults import HOLD_ENV

    root, shards = env
    short = {"train.max_steps": 4, "train.checkpoint_every": 2, "eval.before_training": "false", "eval.every": 0}
    args = [
        "train",
        str(DEMO),
        "--no-progress",
        *_overrides(root, shards, **short),
        f"cluster.address={ray.get_runtime_context().gcs_address}",
    ]
    hold = tmp_path / "hold"
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-m", "dmltrain", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                HOLD_ENV: f"4:{hold}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            },
        )
    try:

        def running(found):
            assert driver.poll() is None, "the driver ended before it was killed:\n" + log.read_text()[-3000:]
            return found

        run_dir = _wait_for(
            lambda: running(
                next(
                    (
                        p.parent
                        for p in (root / "runs").glob("*/driver.json")
                        if RunRecord.read(p.parent).pid == driver.pid
                    ),
                    None,
                )
            ),
            "the driver's run record",
        )
        _wait_for(
            lambda: running(_registered_checkpoints(run_dir) and len(_held_workers(hold)) == 2), "the held workers"
        )
    finally:
        driver.kill()
        driver.wait()
        (hold / "release").touch()  # the killed driver's workers go on, if Ray has not stopped them yet
    orphans = set(_held_workers(hold).values())
    _wait_for(lambda: not any(psutil.pid_exists(p) for p in orphans), "the killed driver's workers to go", timeout=120)
    name = run_dir.name
    assert f"run {name}: MLflow run " in log.read_text()  # the name and run id, printed before the workers started
    client, runs = _runs(root, name)
    assert len(runs) == 1 and runs[0].info.status == "RUNNING"  # what a killed driver leaves behind
    logged = [m.step for m in client.get_metric_history(runs[0].info.run_id, "batch/loss")]
    assert logged == [1, 2, 3], logged  # released after their driver died, its workers logged no step 4
    saved = latest_checkpoint_step(run_dir)
    assert saved == 2
    assert main([*args, "--resume"]) == 0
    assert f"resuming run {name} at step {saved}: MLflow run {runs[0].info.run_id}" in capsys.readouterr().err
    _, runs = _runs(root, name)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags[RESUMED_FROM_STEP_TAG] == str(saved)
    history = client.get_metric_history(runs[0].info.run_id, "batch/loss")
    steps = [m.step for m in history]
    assert sorted(steps) == list(range(1, latest_checkpoint_step(run_dir) + 1)), steps  # one value per step
    assert RunRecord.read(run_dir).status == "FINISHED" and RunRecord.read(run_dir).generation == 2
    assert (run_dir / "model" / "model.pt").is_file()
