"""An elastic run on a real multi-node Ray on loopback: a head and two worker nodes (``dmltrain cluster local``,
each node its own ``ray start`` with its own raylet, resources, folder and ports), one CPU each, so that each
node holds one of the run's ``cluster.num_workers: [1, 3]`` workers.

While the run trains, a thread of the test acts on what the run shows (its registered checkpoints, the
``cluster/workers`` metric), never on sleeps:

1. node 2's processes are killed (SIGKILL, a machine gone): the run goes on at 2 workers from its last
   checkpoint;
2. node 2 is started again: the run grows back to 3 workers;
3. node 2 is preempted (SIGTERM to its ``ray start``, as a cloud or Kubernetes does): Ray drains it, the
   workers checkpoint at the next step and stop, and the run goes on at 2 workers from that very step.

The workers hold before a late step until the last act is under way (``DMLTRAIN_FAULT_HOLD``), so that the
run cannot end first on a slow machine. The run finishes in one MLflow run whose ``cluster/workers`` reads
3, 2, 3, 2, one value per step, with a tag for each restart; the last one replayed nothing.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]
HOLD_AT, STEPS = 20, 30


@pytest.fixture
def cluster(tmp_path):
    from cluster.local import LocalCluster

    local = LocalCluster.start(tmp_path / "cluster", 2, cpus=1, dashboard=False)
    try:
        yield local
    finally:
        local.stop()


def _wait(what: str, ready, timeout: float = 300.0):
    """Poll ``ready()`` until it returns something true; its value. Fails after ``timeout`` s (naming ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _registered_step(run_dir: Path) -> int:
    """The step of the latest checkpoint Ray Train registered (0: none yet)."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        return int(snapshot["latest_checkpoint_result"]["metrics"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _workers(client, name: str) -> list[int]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`dmltrain.run_name` = '{name}'") if experiments else []
    if not runs:
        return []
    history = sorted(client.get_metric_history(runs[0].info.run_id, "cluster/workers"), key=lambda m: m.timestamp)
    return [int(m.value) for m in history]


def _act(cluster, run_dir: Path, hold: Path, client, name: str, done: list, errors: list) -> None:
    try:
        _wait("a checkpoint at 3 workers", lambda: _workers(client, name) == [3] and _registered_step(run_dir) >= 4)
        cluster.kill_node(2)  # SIGKILL to every process of the node
        done.append("killed")
        _wait("the run going on at 2 workers", lambda: _workers(client, name)[-1:] == [2])
        cluster.start_node(2)
        done.append("restarted")
        _wait("the run back at 3 workers", lambda: _workers(client, name)[-1:] == [3])
        cluster.preempt_node(2)  # SIGTERM to the node's `ray start`: Ray drains the node, then stops it
        _wait("node 2 draining", lambda: cluster.draining(2))
        done.append("preempted")
        (hold / "release").touch()  # Ray Train tells the workers within a second (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S)
    except BaseException as e:  # noqa: BLE001 — reported by the test
        errors.append(e)
        (hold / "release").touch()


def test_an_elastic_run_loses_a_node_grows_back_and_saves_the_step_a_preempted_node_asks_for(
    cluster, tmp_path, monkeypatch
):
    import ray
    from mlflow import MlflowClient

    from cluster.launch import train
    from dmltrain.config import load_config
    from dmltrain.training.faults import HOLD_ENV

    if ray.is_initialized():
        ray.shutdown()
    hold = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, f"{HOLD_AT}:{hold}")
    name, uri = "elastic", f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = {
        "data.shards": str(tmp_path / "shards"),
        "data.synthetic": "{classes: 24, per_class: 8, image_size: 32, seed: 0}",
        "data.batch_size": 24,
        "data.samples_per_class": 4,
        "data.loader_workers": 0,
        "loss.instance": "null",
        "train.max_steps": STEPS,
        "train.checkpoint_every": 2,
        "train.log_every": 1,
        "train.run_name": name,
        "train.output_dir": str(tmp_path / "runs"),
        "eval.before_training": "false",
        "eval.every": 0,
        "eval.binary": "false",
        "eval.plots": "false",
        "tracking.uri": uri,
        "tracking.system_metrics": "false",
        "tracking.log_models": "false",
        "cluster.address": cluster.address,
        "cluster.num_workers": "[1,3]",
        "cluster.cpus_per_worker": 1,
        "cluster.max_failures": -1,
        "cluster.resize_interval_s": 5,
    }
    cfg = load_config(REPO / "configs/demo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    client = MlflowClient(tracking_uri=uri)
    done: list[str] = []
    errors: list[BaseException] = []
    actor = threading.Thread(
        target=_act, args=(cluster, tmp_path / "runs" / name, hold, client, name, done, errors), daemon=True
    )
    actor.start()
    try:
        summary = train(cfg, progress=False)
    finally:
        (hold / "release").touch()
        actor.join(30)
        ray.shutdown()
    assert not errors, errors
    assert done == ["killed", "restarted", "preempted"]
    assert summary.ok, summary.error
    assert summary.metrics["step"] == STEPS
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`dmltrain.run_name` = '{name}'")
    assert run.info.status == "FINISHED"
    assert _workers(client, name) == [3, 2, 3, 2]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "batch/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1)), steps  # one value per step, the replayed ones kept once
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("dmltrain.resize.")}
    assert sorted(tags) == ["dmltrain.resize.1", "dmltrain.resize.2", "dmltrain.resize.3"], tags
    assert tags["dmltrain.resize.1"].startswith("3 -> 2 workers")
    assert tags["dmltrain.resize.2"].startswith("2 -> 3 workers")
    # the preempted node asked for a checkpoint: the run resumed from the very step it had reached
    assert tags["dmltrain.resize.3"].startswith("3 -> 2 workers") and ", 0 steps replayed," in tags["dmltrain.resize.3"]
    print("\n".join(f"{k}: {v}" for k, v in sorted(tags.items())))
