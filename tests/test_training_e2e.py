"""The training system end to end: Ray Train V2 + DeepSpeed workers + shards + MLflow.

One local Ray for the module. The three runs share one config (2 gloo workers, tiny
synthetic shards, sharded NormSoftmax with class subsampling plus ICE):

1. a plain run trains, evaluates, logs an MLflow run and leaves checkpoints;
2. the same config under another name, with one worker process killed (SIGKILL) after the
   first checkpoint: Ray restarts the group, training resumes from the checkpoint, ends at
   the same step in a single MLflow run, and with the same weights as run 1 (determinism);
3. a run saved at 2 workers is resumed at 1 worker by re-running it under its name.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray
    from cluster.launch import start_local_ray

    from shards.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("train")
    shards = root / "shards"
    build_synthetic_shards(shards, classes=16, per_class=6, image_size=32, seed=0, shard_size=40, progress=False)
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield root, shards
    ray.shutdown()


def _config(root: Path, shards: Path, **over):
    from dmltrain.config import load_config

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
        "cluster.num_workers": 2,
        "cluster.cpus_per_worker": 0.5,
        "cluster.max_failures": 1,
    }
    overrides.update(over)
    return load_config(Path(__file__).resolve().parents[1] / "configs/demo.yaml", [f"{k}={v}" for k, v in overrides.items()])


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
    summary = train(_config(root, shards, **{"train.run_name": "plain"}), progress=False)
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
    assert {"model.pt", "classifier", "dp_optimizer.pt", "train_state.json", "rng-rank0.pt", "rng-rank1.pt", "engine"} <= names
    assert len(list((ckpts[-1] / "engine").glob("*optim_states.pt"))) == 2  # one ZeRO partition per rank
    assert len(list((ckpts[-1] / "classifier").glob("classifier-*.pt"))) == 2  # one row piece per rank
    # MLflow: one run with params, metric curves and artifacts
    client, runs = _runs(root, "plain")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["optim.lr"] == "0.003" and run.data.params["cluster.num_workers"] == "2"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert len(losses) == steps and all(m.value == m.value for m in losses)
    for key in ("eval/recall_at_1", "initial/recall_at_1", "eval/map_at_r", "classifier/loss", "instance/loss", "images_per_s", "time/forward_ms", "lr"):
        assert key in run.data.metrics, key
    assert any(k.startswith("classifier/") and "active" in k for k in run.data.metrics)
    # what tune, study and report read back is what the trainer logs
    from mlflow.entities import LoggedModelStatus

    from dmltrain.tracking import names

    read_back = {names.LOSS, names.IMAGES_PER_S, names.STEP_MS, names.RSS_MB, names.CLASSIFIER_MB, names.ACTIVE_ROWS,
                 names.ACTIVE_CLASSES, names.eval_key("recall@1"), names.initial_key("recall@1")}
    assert read_back <= set(run.data.metrics), read_back - set(run.data.metrics)
    # MLflow 3 logged models: the final model and each new best, each linked to the metrics of its step
    models = [m for m in client.search_logged_models([run.info.experiment_id]) if m.source_run_id == run.info.run_id]
    assert {m.name for m in models} == {"model", "best_model"} and all(m.status == LoggedModelStatus.READY for m in models)
    (final,) = [m for m in models if m.name == "model"]
    linked = {x.key: x.value for x in final.metrics if x.step == steps}
    assert linked["eval/recall_at_1"] == pytest.approx(s.metrics["final"]["recall@1"])
    outputs = {o.model_id: o.step for o in client.get_run(run.info.run_id).outputs.model_outputs}
    assert outputs[final.model_id] == steps and set(outputs) == {m.model_id for m in models}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "data", "plots", "model", "best_model"} <= artifacts
    assert any(a.path.endswith(".png") for a in client.list_artifacts(run.info.run_id, "plots"))
    # the exported model evaluates through the CLI
    from dmltrain.models import load_model

    model, config, extra = load_model(Path(s.storage_dir) / "model" / "model.pt")
    assert extra["step"] == steps and config["train"]["run_name"] == "plain"


def _registered_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoints Ray has committed (a directory alone may still be uploading)."""
    import json

    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    return [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results", [])]


def _own_train_workers() -> list:
    """RayTrainWorker processes of this test's local Ray: the raylet it started is their parent,
    so this process is among their ancestors (other Ray sessions on the machine are left alone)."""
    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if "RayTrainWorker" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            if any(a.pid == me for a in p.parents()):
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def _train_worker_pids() -> set[int]:
    return {p.info["pid"] for p in _own_train_workers()}


def _kill_a_worker_after_first_checkpoint(run_dir: Path, killed: list[int], earlier: set[int]) -> None:
    """SIGKILL a training worker of this run (not a lingering one of an earlier run: ``earlier``)."""
    deadline = time.time() + 600
    while time.time() < deadline and not _registered_checkpoints(run_dir):
        time.sleep(0.05)
    for _ in range(100):
        workers = [p for p in _own_train_workers() if p.info["pid"] not in earlier]
        if workers:
            victim = max(workers, key=lambda p: p.info["pid"])
            os.kill(victim.info["pid"], signal.SIGKILL)
            killed.append(victim.info["pid"])
            return
        time.sleep(0.1)


def test_worker_killed_mid_run_resumes_to_the_same_weights(env, plain_run):
    from cluster.launch import train

    root, shards = env
    cfg = _config(root, shards, **{"train.run_name": "killed"})
    killed: list[int] = []
    earlier = _train_worker_pids()
    watcher = threading.Thread(target=_kill_a_worker_after_first_checkpoint, args=(root / "runs" / "killed", killed, earlier), daemon=True)
    watcher.start()
    summary = train(cfg, progress=False)
    watcher.join(5)
    assert killed, "no worker process was found to kill"
    assert summary.ok, summary.error
    assert summary.metrics["step"] == plain_run.metrics["step"]
    _, runs = _runs(root, "killed")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # the restarted group resumed from a checkpoint
    assert "dmltrain.resumed_from_step" in runs[0].data.tags, (killed, earlier, sorted(runs[0].data.tags))
    # killed and resumed reaches the same weights as the uninterrupted run (CPU, fp32, same seed and W)
    a, b = _final_weights(plain_run), _final_weights(summary)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_resume_at_a_different_worker_count(env):
    """Also the recipes' bf16 engine and head-only start (the backbone frozen for the first step)."""
    from cluster.launch import train

    root, shards = env
    common = {"train.run_name": "reshard", "train.precision": "bf16", "schedule.unit": "step", "schedule.head_only": 1}
    first = train(_config(root, shards, **common, **{"train.max_steps": 2}), progress=False)
    assert first.ok and first.metrics["step"] == 2, first.error
    again = train(_config(root, shards, **common, **{"train.max_steps": 4, "cluster.num_workers": 1}), progress=False)
    assert again.ok, again.error
    assert again.metrics["step"] == 4
    client, runs = _runs(root, "reshard")
    assert len(runs) == 1
    tags = runs[0].data.tags
    assert tags["dmltrain.resumed_from_step"] == "2" and tags["resumed.cluster.num_workers"] == "1"
    # step 2 was mid-epoch under a 2-worker batch plan: the 1-worker run starts the next epoch instead
    assert "world_size" in tags["dmltrain.resumed_at_epoch_start"]
