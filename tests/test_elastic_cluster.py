"""An elastic run on a real multi-node Ray on loopback: a head and two worker nodes started by ``dmltrain cluster
local --nodes 2`` (each node its own ``ray start`` with its own raylet, resources, folder and ports), one CPU each,
so that each node holds one of the run's ``cluster.num_workers: [1, 3]`` workers.

While the run trains, a thread of the test acts through the same command, on what the run shows (its registered
checkpoints, the ``cluster/workers`` metric, the workers holding), never on sleeps:

1. node 2's processes are killed (``--kill-node 2``: SIGKILL, a machine gone): the run goes on at 2 workers from its
   last checkpoint;
2. node 2 is started again (``--start-node 2``): the run grows back to 3 workers;
3. node 2 is preempted (``--preempt-node 2``: SIGTERM to its ``ray start``, as a cloud or Kubernetes does): Ray
   drains it, the workers checkpoint at the next step (an odd one, which the cadence of 2 would not save) and stop,
   and the run goes on at 2 workers from that very step.

The workers hold before step :data:`HOLD_AT` until the last act is under way (``DMLTRAIN_FAULT_HOLD``), so that the
run cannot end first on a slow machine. The run finishes in one MLflow run (sqlite, absolute URI) whose
``cluster/workers`` reads 3, 2, 3, 2, with one value per step and a tag for each restart. Everything the cluster
and the run listen on is loopback; Ray's own lines went to the run's ``driver.log``, not to the terminal.

This test checks the flow on real raylets; that the resized run is the same optimization (losses step for step,
the resharded classifier rows) is ``tests/test_elastic.py``'s, on gloo without Ray. It prints the restarts' times
(docs/results/benchmarks.md, "Elastic runs").
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]
HOLD_AT, STEPS, EVERY = 9, 10, 2  # the preempted step is odd: only the preemption's own checkpoint saves it


def _local(folder: Path, *args: str) -> str:
    """``dmltrain cluster local ARGS --dir FOLDER`` as a user types it; its output. Fails on a non-zero exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "dmltrain", "cluster", "local", *args, "--dir", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, f"cluster local {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


@pytest.fixture
def cluster(tmp_path):
    from cluster.local import LocalCluster, session_pids

    folder = tmp_path / "cluster"
    out = _local(folder, "--nodes", "2", "--no-dashboard")
    local = LocalCluster.load(folder)
    assert f"local Ray cluster at {local.address}: a head and 2 worker nodes" in out
    sessions = {n.sid for n in local.nodes}
    try:
        assert _local(folder, "--status").count("running") == 3
        yield folder
    finally:
        sessions |= {n.sid for n in LocalCluster.load(folder).nodes}  # node 2's second life too
        try:
            _local(folder, "--stop")
        except BaseException:
            LocalCluster.load(folder).stop()
            raise
    # --stop leaves nothing of any node that ran
    assert not [pid for sid in sessions if sid for pid in session_pids(sid)]


def _wait(what: str, ready, timeout: float = 300.0):
    """Poll ``ready()`` until it returns something true; its value. Fails after ``timeout`` s (naming ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _registered_step(run_dir: Path) -> int:
    """The step of the latest checkpoint Ray Train registered (0: none yet)."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        return int(snapshot["latest_checkpoint_result"]["metrics"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _history(client, name: str, key: str) -> list:
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"tags.`dmltrain.run_name` = '{name}'") if experiments else []
    return sorted(client.get_metric_history(runs[0].info.run_id, key), key=lambda m: m.timestamp) if runs else []


def _workers(client, name: str) -> list[int]:
    return [int(m.value) for m in _history(client, name, "cluster/workers")]


def _live_held(hold: Path) -> set[int]:
    """Pids of live workers holding before step HOLD_AT (``held-rank<r>-<pid>``)."""
    return {pid for p in hold.glob("held-rank*-*") if psutil.pid_exists(pid := int(p.name.rsplit("-", 1)[1]))}


def _not_loopback(folder: Path) -> list[tuple[str, str]]:
    """(process, address) of what any process of the cluster's nodes (their GCS, raylets and agents, the run's
    workers) or this driver listens on beyond loopback."""
    from cluster.local import LocalCluster, session_pids

    pids = [os.getpid(), *(pid for n in LocalCluster.load(folder).nodes if n.sid for pid in session_pids(n.sid))]
    wide = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            sockets, title = process.net_connections(kind="inet"), " ".join(process.cmdline())[:60]
        except psutil.Error:
            continue
        for s in sockets:
            ip = ipaddress.ip_address(s.laddr.ip)
            ip = getattr(ip, "ipv4_mapped", None) or ip
            if s.status == psutil.CONN_LISTEN and not ip.is_loopback:
                wide.append((title, f"{s.laddr.ip}:{s.laddr.port}"))
    return wide


def _act(folder: Path, run_dir: Path, hold: Path, client, name: str, seen: dict, errors: list) -> None:
    from cluster.local import LocalCluster

    try:
        seen["checkpoint"] = _wait(
            "a checkpoint at 3 workers", lambda: _workers(client, name) == [3] and _registered_step(run_dir)
        )
        seen["not loopback"] = _not_loopback(folder)  # the workers run: every process of the run listens
        seen["killed"] = time.time()
        _local(folder, "--kill-node", "2")  # SIGKILL to every process of the node
        _wait("the run going on at 2 workers", lambda: _workers(client, name)[-1:] == [2])
        _local(folder, "--start-node", "2")
        seen["started"] = time.time()
        _wait(
            "the run back at 3 workers, holding before step HOLD_AT",
            lambda: _workers(client, name)[-1:] == [3] and len(_live_held(hold)) == 3,
        )
        seen["preempted"] = time.time()
        _local(folder, "--preempt-node", "2")  # SIGTERM to the node's `ray start`: Ray drains the node, then stops it
        _wait("node 2 draining", lambda: LocalCluster.load(folder).draining(2))
        _wait("the held workers told of it", lambda: list(hold.glob("notice-rank*")))
    except BaseException as e:  # noqa: BLE001 — reported by the test
        errors.append(e)
    finally:
        (hold / "release").touch()  # they take step HOLD_AT, checkpoint it and stop


def _first_step_after(tag: str, logged: dict[int, float], since: float) -> float:
    """Seconds from ``since`` to the restarted group's first step: the tag counts from the previous group's last
    step (``at step R``, logged at ``logged[R]``)."""
    reached, first = re.search(r"at step (\d+): .*first step ([\d.]+) s after", tag).groups()
    return logged[int(reached)] + float(first) - since


def test_an_elastic_run_loses_a_node_grows_back_and_saves_the_step_a_preempted_node_asks_for(
    cluster, tmp_path, monkeypatch, capfd
):
    import ray
    from mlflow import MlflowClient

    from cluster.launch import train
    from cluster.local import LocalCluster
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
        "train.checkpoint_every": EVERY,
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
        "cluster.address": LocalCluster.load(cluster).address,
        "cluster.num_workers": "[1,3]",
        "cluster.cpus_per_worker": 1,
        "cluster.max_failures": -1,
        "cluster.resize_interval_s": 5,
    }
    cfg = load_config(REPO / "configs/demo.yaml", [f"{k}={v}" for k, v in overrides.items()])
    client = MlflowClient(tracking_uri=uri)
    run_dir = tmp_path / "runs" / name
    seen: dict = {}
    errors: list[BaseException] = []
    # what this process listens on before the run: the tests before it in the same pytest process may have left
    # a process group's store open (torch's TCPStore binds every interface)
    already = set(_not_loopback(cluster))
    actor = threading.Thread(target=_act, args=(cluster, run_dir, hold, client, name, seen, errors), daemon=True)
    actor.start()
    try:
        summary = train(cfg, progress=False)
    finally:
        (hold / "release").touch()
        actor.join(60)
        ray.shutdown()
    terminal = "".join(capfd.readouterr())
    assert not errors, errors
    assert summary.ok, summary.error
    assert summary.metrics["step"] == STEPS
    # Ray listens on loopback only; one exception, not Ray's: torch's TCPStore, the rendezvous Ray Train starts on
    # rank 0, binds every interface whatever its host unless handed a bound socket, which Ray Train does not do (the
    # groups dmltrain starts itself are handed one: process_group.init_local_group)
    wide = [w for w in seen["not loopback"] if w not in already]
    assert len(wide) <= 1 and all("RayTrainWorker" in title for title, _ in wide), wide
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`dmltrain.run_name` = '{name}'")
    assert run.info.status == "FINISHED"
    assert _workers(client, name) == [3, 2, 3, 2]
    losses = _history(client, name, "batch/loss")
    assert sorted(m.step for m in losses) == list(range(1, STEPS + 1))  # one value per step, the replayed ones once
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("dmltrain.resize.")}
    assert sorted(tags) == ["dmltrain.resize.1", "dmltrain.resize.2", "dmltrain.resize.3"], tags
    lost, back, preempted = (tags[f"dmltrain.resize.{i}"] for i in (1, 2, 3))
    # the lost node: from the last checkpoint registered before the kill (or a later one, saved meanwhile)
    resumed = int(re.search(r"resumed from step (\d+)", lost).group(1))
    assert lost.startswith("3 -> 2 workers") and seen["checkpoint"] <= resumed and resumed % EVERY == 0, lost
    assert back.startswith("2 -> 3 workers"), back
    # the preempted node asked for a checkpoint at the step after its notice: the run resumed from that very step
    assert preempted.startswith(f"3 -> 2 workers at step {HOLD_AT}: resumed from step {HOLD_AT},"), preempted
    assert ", 0 steps replayed," in preempted
    # Ray's own lines are in the run's log, not the terminal: "Connecting to existing Ray cluster" at every join, its
    # token notice only at the first ray.init of a process (earlier tests in this one may have made it), if at all
    log = (run_dir / "driver.log").read_text()
    assert "Connecting to existing Ray cluster" in log and "Connecting to existing Ray cluster" not in terminal
    assert "Token authentication is enabled" not in terminal
    assert "workers: 3 -> 2 workers at step" in terminal and "workers: 3 -> 2 workers at step" in log
    logged = {m.step: m.timestamp / 1000 for m in losses}
    print(
        f"\nelastic, loopback (3 nodes x 1 CPU, small_cnn, 24 images a step): node 2 killed -> first step at 2 "
        f"workers {_first_step_after(lost, logged, seen['killed']):.1f} s, {lost.split(', ')[-2]}; "
        f"node 2 started -> first step at 3 workers {_first_step_after(back, logged, seen['started']):.1f} s, "
        f"{back.split(', ')[-2]}; node 2 preempted -> first step at 2 workers "
        f"{_first_step_after(preempted, logged, seen['preempted']):.1f} s, {preempted.split(', ')[-2]}"
    )
    print("\n".join(f"{k}: {v}" for k, v in sorted(tags.items())))
