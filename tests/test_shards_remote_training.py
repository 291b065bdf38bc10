"""Training straight from object storage: the demo configuration on 2 Ray workers reads its shards from moto's
S3 server on loopback, through injected faults (503 SlowDown, hangs past the time limit, a truncated body),
and ends with the weights and metrics of the same training from local disk; the retry counters are in MLflow.
The trained model then evaluates from the S3 URL through ``dmltrain eval`` as from local disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

URL = "s3://train/shards"
REMOTE = {"timeout_s": 1.0, "retries": 8, "cache": False, "requests_in_flight": 4}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray
    from object_store import Faults, s3_server

    from cluster.launch import start_local_ray
    from shards.build.synthetic import build_synthetic_shards
    from shards.storage.location import Location

    root = tmp_path_factory.mktemp("remote_train")
    with s3_server(Faults(seed=11)) as s3:  # credentials in the environment, which the Ray workers inherit
        opts = {"endpoint_url": s3.endpoint}
        Location(URL, opts).fs.mkdir("train")
        for where in (root / "shards", URL):
            build_synthetic_shards(
                where,
                classes=8,
                per_class=6,
                image_size=32,
                seed=0,
                shard_size=16,
                progress=False,
                storage_options=opts if where == URL else None,
            )
        start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            yield root, s3, opts
        finally:
            ray.shutdown()


def _config(root: Path, name: str, shards: str, **over):
    from dmltrain.config import load_config

    overrides = {
        "data.shards": shards,
        "data.synthetic": "null",
        "data.batch_size": 16,
        "data.samples_per_class": 4,
        "data.loader_workers": 1,
        "data.eval_batch_size": 16,
        "train.epochs": 1,
        "train.log_every": 1,
        "train.run_name": name,
        "train.output_dir": str(root / "runs"),
        "eval.every": 0,
        "eval.plots": False,
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
        "tracking.system_metrics": False,
        "tracking.log_models": False,
        "cluster.num_workers": 2,
        "cluster.cpus_per_worker": 0.5,
    }
    overrides.update(over)
    return load_config(
        Path(__file__).resolve().parents[1] / "configs/demo.yaml", [f"{k}={v}" for k, v in overrides.items()]
    )


def _weights(summary) -> dict[str, torch.Tensor]:
    return torch.load(Path(summary.storage_dir) / "model" / "model.pt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def runs(env):
    from cluster.launch import train

    root, s3, opts = env
    local = train(_config(root, "local", str(root / "shards")), progress=False)
    assert local.ok, local.error
    s3.faults.set(p_503=0.25, p_hang=0.03, hang_s=2.5, truncate=1)
    remote_over = {
        "data.storage_options.endpoint_url": opts["endpoint_url"],
        **{f"data.remote.{k}": v for k, v in REMOTE.items()},
    }
    remote = train(_config(root, "s3", URL, **remote_over), progress=False)
    injected = dict(s3.faults.injected)
    s3.faults.clear()
    assert remote.ok, remote.error
    return local, remote, injected


def test_training_from_s3_through_faults_matches_local_disk(env, runs):
    from mlflow import MlflowClient

    from dmltrain.tracking import names

    root, _, _ = env
    local, remote, injected = runs
    assert injected["503"] > 0 and injected["hang"] + injected["truncated"] > 0
    a, b = _weights(local), _weights(remote)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert remote.metrics["step"] == local.metrics["step"] > 2 and remote.metrics["final"] == local.metrics["final"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dmltrain-demo")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`dmltrain.run_name` = 's3'")
    m = run.data.metrics
    assert (
        m[names.REMOTE_RETRIES] > 0
        and m[names.REMOTE_PREFIX + "retries/throttled"] > 0
        and m[names.REMOTE_PREFIX + "failed"] == 0
    )
    assert m[names.REMOTE_PREFIX + "requests"] > m[names.REMOTE_RETRIES]
    (plain,) = client.search_runs([exp.experiment_id], filter_string="tags.`dmltrain.run_name` = 'local'")
    assert not any(k.startswith(names.REMOTE_PREFIX) for k in plain.data.metrics)
    assert run.data.params["data.storage_options.endpoint_url"].startswith("http://127.0.0.1:")


def test_eval_cli_from_s3_matches_local_disk(env, runs, tmp_path):
    from dmltrain.cli import main

    root, s3, opts = env
    model = Path(runs[1].storage_dir) / "model" / "model.pt"
    out = {}
    for name, shards in (("local", str(root / "shards")), ("s3", URL)):
        s3.faults.set(p_503=0.2)
        args = [
            "eval",
            str(model),
            "--shards",
            shards,
            "--out",
            str(tmp_path / f"{name}.json"),
            "--no-nmi",
            "--device",
            "cpu",
        ]
        assert main(args) == 0  # the s3 run's config carries the endpoint in data.storage_options
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())["metrics"]
    assert out["s3"] == out["local"]
