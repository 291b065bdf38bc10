"""The cluster files stay usable: the launcher YAML passes Ray's own schema, the KubeRay manifests
have what the operator needs, and both run the same, valid ``dmltrain train`` command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from cluster.submit import ENTRYPOINT_PREFIX
from dmltrain.cli import build_parser
from dmltrain.config import load_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
SHARED = "/mnt/shared"


def load(name: str):
    return yaml.safe_load((CLUSTER / name).read_text())


def train_command(entrypoint: str):
    """The entrypoint parsed by the real CLI parser; it must be ``python -m dmltrain train CONFIG overrides``."""
    tokens = shlex.split(entrypoint)
    assert tuple(tokens[:4]) == ENTRYPOINT_PREFIX, entrypoint
    argv = tokens[3:]
    args = build_parser(argv).parse_args(argv)
    assert args.command == "train"
    return args


def overrides_of(args) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.overrides)


@pytest.fixture(scope="module")
def launcher():
    return load("ray-cluster.yaml")


@pytest.fixture(scope="module")
def rayjob():
    return load("rayjob.yaml")


@pytest.fixture(scope="module")
def shared():
    return {d["kind"]: d for d in yaml.safe_load_all((CLUSTER / "k8s-shared.yaml").read_text())}


# -- `ray up` ---------------------------------------------------------------------------------------------
def test_launcher_yaml_passes_rays_schema(launcher):
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(launcher, schema)  # what `ray up` checks first (unknown keys are errors)
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type"):
        assert key in launcher
    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    workers = {k: v for k, v in types.items() if k != launcher["head_node_type"]}
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    assert workers and all(w["resources"]["GPU"] > 0 and w.get("max_workers", 0) > 0 for w in workers.values())
    assert sum(w["max_workers"] for w in workers.values()) <= launcher["max_workers"]


def test_launcher_starts_the_job_api_mlflow_and_shared_storage(launcher):
    head_cmds = " ; ".join(launcher["head_start_ray_commands"])
    assert (
        re.search(r"ray start --head\b", head_cmds) and "mlflow server" in head_cmds and f"{SHARED}/mlflow" in head_cmds
    )
    assert any("ray start --address=$RAY_HEAD_IP:" in c for c in launcher["worker_start_ray_commands"])
    assert launcher["file_mounts"]["/home/ray/dmltrain"] == "."
    assert any("pip install" in c and "-e '/home/ray/dmltrain[cluster]'" in c for c in launcher["setup_commands"])
    opts = " ".join(launcher["docker"]["run_options"])
    assert f"-v {SHARED}:{SHARED}" in opts and "--shm-size" in opts
    assert any(f" {SHARED})" in c for c in launcher["initialization_commands"])  # mounted on every host


def _ray_starts(commands):
    return [c for c in commands if "ray start" in c]


def test_launcher_is_closed_to_strangers(launcher):
    """Token auth on every node, the dashboard/Job API on the head's loopback (reached by `ray dashboard`'s
    SSH tunnel), and the MLflow server, which every node must reach, behind a password."""
    for c in _ray_starts(launcher["head_start_ray_commands"]) + _ray_starts(launcher["worker_start_ray_commands"]):
        assert re.search(r"(export )?RAY_AUTH_MODE=token;? .*ray start", c), c
        assert "--dashboard-host" not in c, "the dashboard stays on loopback (Ray's default)"
    assert launcher["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"  # one token on every node
    (mlflow,) = [c for c in launcher["head_start_ray_commands"] if "mlflow server --" in c]
    if "0.0.0.0" in mlflow or "--host" not in mlflow:
        assert (
            "--app-name basic-auth" in mlflow
            and "MLFLOW_AUTH_ADMIN_PASSWORD=" in mlflow
            and "MLFLOW_FLASK_SERVER_SECRET_KEY=" in mlflow
        )
    setup = " ; ".join(launcher["setup_commands"])
    assert "umask 077" in setup and "~/.mlflow/credentials" in setup  # what MLflow clients on every node read
    assert "mlflow_tracking_password" in setup and f"{SHARED}/mlflow/basic_auth.ini" in setup


def test_no_hint_to_open_the_dashboard_to_all_hosts():
    for path in (
        REPO / "README.md",
        *(REPO / "docs").rglob("*.md"),
        CLUSTER / "submit.py",
        CLUSTER / "ray-cluster.yaml",
    ):
        assert not re.search(r"dashboard[-_]host[= ]+['\"]?0\.0\.0\.0", path.read_text()), path


# -- KubeRay ------------------------------------------------------------------------------------------------
def test_rayjob_has_what_kuberay_needs(rayjob, shared):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert re.fullmatch(
        r"[a-z0-9]([-a-z0-9]{0,45}[a-z0-9])?", rayjob["metadata"]["name"]
    )  # a DNS label short enough for its pods
    spec = rayjob["spec"]
    assert spec["entrypoint"] and spec["shutdownAfterJobFinishes"] is True
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(env, dict) and env["working_dir"].startswith("/")
    rc = spec["rayClusterSpec"]
    head = rc["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0"
    # the dashboard faces the pod network (KubeRay's submitter), so the cluster must require its token
    assert rc["authOptions"] == {"mode": "token"}
    assert head["template"]["spec"]["containers"][0]["image"]
    groups = rc["workerGroupSpecs"]
    assert groups and all(
        g["groupName"] and g["replicas"] >= 1 and g["template"]["spec"]["containers"][0]["image"] for g in groups
    )
    claim = shared["PersistentVolumeClaim"]["metadata"]["name"]
    for pod in [head["template"]["spec"], *(g["template"]["spec"] for g in groups)]:
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert vols[mounts[SHARED]]["persistentVolumeClaim"]["claimName"] == claim
        assert vols[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_shared_k8s_resources(shared):
    assert set(shared) == {"PersistentVolumeClaim", "Deployment", "Service"}
    assert shared["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    dep = shared["Deployment"]["spec"]
    assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate"  # a single writer to SQLite
    pod_labels = dep["template"]["metadata"]["labels"]
    svc = shared["Service"]["spec"]
    assert all(pod_labels.get(k) == v for k, v in svc["selector"].items())
    assert dep["selector"]["matchLabels"] == {k: pod_labels[k] for k in dep["selector"]["matchLabels"]}
    args = " ".join(dep["template"]["spec"]["containers"][0]["args"])
    assert f"--port {svc['ports'][0]['targetPort']}" in args and f"sqlite:///{SHARED}/mlflow" in args
    assert "mlflow:*" in args  # MLflow 3 refuses Host headers it does not know
    # on the pod's interfaces, so behind MLflow's basic-auth app, its secrets from a Secret
    assert "--app-name basic-auth" in args
    env = {e["name"]: e for e in dep["template"]["spec"]["containers"][0]["env"]}
    for name in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "dmltrain-mlflow-auth"


def test_rayjob_pods_log_to_mlflow_with_the_secrets_credentials(rayjob, shared):
    rc = rayjob["spec"]["rayClusterSpec"]
    pods = [rc["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in rc["workerGroupSpecs"])]
    secret = shared["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"][
        "name"
    ]
    for pod in pods:
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in pod["containers"][0]["env"]}
        assert env["MLFLOW_TRACKING_USERNAME"] == {"name": secret, "key": "username"}
        assert env["MLFLOW_TRACKING_PASSWORD"] == {"name": secret, "key": "password"}


# -- the entry point ----------------------------------------------------------------------------------------
def test_both_run_the_same_valid_training(launcher, rayjob, shared):
    a = train_command(launcher["metadata"]["dmltrain_entrypoint"])
    b = train_command(rayjob["spec"]["entrypoint"])
    assert a.config == b.config and (REPO / a.config).is_file() and a.config.startswith("configs/")
    oa, ob = overrides_of(a), overrides_of(b)
    assert {k: v for k, v in oa.items() if k != "tracking.uri"} == {k: v for k, v in ob.items() if k != "tracking.uri"}
    cfg = load_config(REPO / b.config, b.overrides)  # the whole resolved config is valid
    assert cfg.cluster.address == "auto" and cfg.cluster.use_gpu
    assert cfg.data.shards.startswith(SHARED + "/") and cfg.cluster.storage_path.startswith(SHARED + "/")
    load_config(REPO / a.config, a.overrides)

    # the MLflow server each one names is the one its cluster runs
    assert urlparse(ob["tracking.uri"]).hostname == shared["Service"]["metadata"]["name"]
    assert urlparse(ob["tracking.uri"]).port == shared["Service"]["spec"]["ports"][0]["port"]
    head_cmds = " ".join(launcher["head_start_ray_commands"])
    assert f"--port {urlparse(oa['tracking.uri']).port}" in head_cmds

    # enough GPUs, and CPUs for the workers, on each cluster
    n, cpus = cfg.cluster.num_workers, cfg.cluster.cpus_per_worker
    types = launcher["available_node_types"]
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert sum(t["max_workers"] * t["resources"]["GPU"] for t in gpu_types) >= n
    assert all(t["resources"]["CPU"] >= cpus * t["resources"]["GPU"] for t in gpu_types)
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    lim = [g["template"]["spec"]["containers"][0]["resources"]["limits"] for g in groups]
    assert sum(g["replicas"] * int(lm["nvidia.com/gpu"]) for g, lm in zip(groups, lim)) >= n
    assert all(float(lm["cpu"]) >= cpus * int(lm["nvidia.com/gpu"]) for lm in lim)
