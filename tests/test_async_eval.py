"""Asynchronous evaluation (``eval.mode: async``) end to end: a local Ray, Ray Train V2's checkpoint
validation, DeepSpeed workers, shards and a SQLite MLflow store.

One short run (1 worker, 2 epochs, an evaluation after each). Its evaluations must land in the
run's MLflow run at their checkpoints' steps with exactly the metrics an independent evaluation
of each checkpoint's ``model.pt`` gives; ``best_model`` must be the checkpoint whose metric was
best, linked to its metrics; the driver's summary must hold the final and best evaluations the
validation tasks posted. The validation task itself is also called directly, as Ray calls it,
on checkpoints of four different models (the untrained model's evaluation included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

DEMO = Path(__file__).resolve().parents[1] / "configs/demo.yaml"


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
        "loss.instance": "null",
        "train.epochs": 2,
        "train.checkpoint_every": 100,
        "train.keep_checkpoints": 10,
        "train.log_every": 1,
        "train.output_dir": str(root / "runs"),
        "train.run_name": "async",
        "eval.every": 1,
        "eval.plots": False,
        "eval.mode": "async",
        "eval.async_cpus": 0.5,
        "eval.before_training": False,
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
        "tracking.system_metrics": False,
        "cluster.num_workers": 1,
        "cluster.cpus_per_worker": 0.5,
        "cluster.max_failures": 0,
    }
    overrides.update(over)
    return load_config(DEMO, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A folder with tiny synthetic shards; its SQLite MLflow store is shared by the tests (created once)."""
    from shards.build.synthetic import build_synthetic_shards

    root = tmp_path_factory.mktemp("async")
    build_synthetic_shards(
        root / "shards", classes=12, per_class=6, image_size=32, seed=0, shard_size=40, progress=False
    )
    return root, root / "shards"


@pytest.fixture(scope="module")
def async_run(env):
    import ray

    from cluster.launch import start_local_ray, train

    root, shards = env
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = _config(root, shards)
        summary = train(cfg, progress=False)
    finally:
        ray.shutdown()
    assert summary.ok, summary.error
    return root, cfg, summary


def test_validations_land_in_the_run_at_their_checkpoints_steps(async_run):
    import numpy as np
    from mlflow import MlflowClient

    from dmltrain.evaluate import evaluate_model
    from dmltrain.models import load_model

    root, cfg, s = async_run
    steps = s.metrics["step"]
    ckpts = {int(p.name.removeprefix("checkpoint-step")): p for p in Path(s.storage_dir).glob("checkpoint-step*")}
    # the end of epoch 1 and the end: each a checkpoint that Ray validated
    assert len(ckpts) == 2 and 0 < min(ckpts) < max(ckpts) == steps
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    history = {m.step: m.value for m in client.get_metric_history(s.mlflow_run_id, "eval/recall_at_1")}
    map_r = {m.step: m.value for m in client.get_metric_history(s.mlflow_run_id, "eval/ranking/map_at_r")}
    assert sorted(history) == sorted(map_r) == sorted(ckpts)
    for step, path in ckpts.items():  # the same numbers an evaluation of the checkpoint's own weights gives
        model = load_model(path / "model.pt")[0]
        want, _ = evaluate_model(model, cfg.data.shards, cfg.data.eval_splits, cfg.eval, cfg.data, progress=False)
        assert history[step] == pytest.approx(want["recall@1"], abs=1e-12)
        assert map_r[step] == pytest.approx(want["map@r"], abs=1e-12)
    # the record and the driver's summary (posted by the validation tasks): the final and the best evaluation
    record = json.loads((Path(s.storage_dir) / "eval_record.json").read_text())
    best_step = max(sorted(history), key=lambda k: history[k])  # the first of equal values stays the best
    assert record["best_step"] == s.metrics["best_step"] == best_step
    assert s.metrics["final"]["recall@1"] == pytest.approx(history[steps]) and not s.metrics["initial"]
    assert np.isclose(s.metrics["best"]["recall@1"], history[best_step])


def test_best_model_is_the_best_checkpoint_linked_to_its_metrics(async_run):
    import torch
    from mlflow import MlflowClient

    root, cfg, s = async_run
    best_step = s.metrics["best_step"]
    best = torch.load(Path(s.storage_dir) / "best_model" / "model.pt", weights_only=True)
    source = torch.load(Path(s.storage_dir) / f"checkpoint-step{best_step:08d}" / "model.pt", weights_only=True)
    assert best["extra"]["step"] == best_step and best["extra"]["metrics"]["recall@1"] == s.metrics["best"]["recall@1"]
    assert all(torch.equal(best["state_dict"][k], v) for k, v in source["state_dict"].items())
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    run = client.get_run(s.mlflow_run_id)
    models = [m for m in client.search_logged_models([run.info.experiment_id]) if m.source_run_id == s.mlflow_run_id]
    (logged,) = [m for m in models if m.name == "best_model"][-1:]
    linked = {x.key: x.value for x in logged.metrics if x.step == best_step}
    assert linked["eval/recall_at_1"] == pytest.approx(s.metrics["best"]["recall@1"])
    assert (Path(s.storage_dir) / "model" / "model.pt").is_file()  # the final model, exported by the trainer


def test_tuning_refuses_asynchronous_evaluation(tmp_path):
    import yaml

    from cluster.tune.space import load_space
    from dmltrain.config import load_config
    from dmltrain.errors import UserError

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"metric": "recall@1", "space": {"optim.lr": {"choice": [0.1]}}}))
    with pytest.raises(UserError, match="eval.mode: async"):
        load_space(path, load_config(DEMO, ["eval.mode=async"]).to_dict())


def test_the_validation_task_records_logs_and_exports_the_best(env, tmp_path):
    """:func:`evaluate_checkpoint` called as Ray would call it, on three checkpoints of different weights:
    MLflow gets each evaluation at its step, the record and ``best_model`` follow the best after training started."""
    import torch
    from mlflow import MlflowClient
    from ray.train import Checkpoint

    from dmltrain.evaluate import evaluate_model
    from dmltrain.models import build_model, save_model
    from dmltrain.tracking.run import RunHandle
    from dmltrain.training.async_eval import evaluate_checkpoint, load_record

    root, shards = env
    cfg = _config(root, shards)
    run = RunHandle.open(cfg.tracking.uri, cfg.tracking.experiment, "direct", {})
    context = {
        "run_name": "direct",
        "storage_dir": str(tmp_path / "direct"),
        "tracking_uri": cfg.tracking.uri,
        "mlflow_run_id": run.run_id,
        "board_name": None,
    }
    want = {}
    for step, phase, seed in ((0, "initial", 0), (3, "eval", 1), (6, "eval", 2), (9, "final", 3)):
        torch.manual_seed(seed)
        model = build_model(cfg.model)
        folder = tmp_path / f"checkpoint-step{step:08d}"
        folder.mkdir()
        save_model(folder / "model.pt", model, cfg.to_dict(), extra={"step": step, "metrics": {}})
        want[step], _ = evaluate_model(
            model.eval(), cfg.data.shards, cfg.data.eval_splits, cfg.eval, cfg.data, progress=False
        )
        got = evaluate_checkpoint(
            Checkpoint.from_directory(str(folder)),
            config=cfg.to_dict(),
            run=context,
            step=step,
            epoch=step // 3,
            phase=phase,
        )
        assert got == {f"eval/{k}": v for k, v in want[step].items()}
    client = MlflowClient(tracking_uri=cfg.tracking.uri)
    # the untrained model's evaluation is the step-0 point of the same series; counts are tags
    logged = {m.step: m.value for m in client.get_metric_history(run.run_id, "eval/ranking/map_at_r")}
    assert logged == {s: want[s]["map@r"] for s in (0, 3, 6, 9)}
    tags = client.get_run(run.run_id).data.tags
    assert tags["dmltrain.eval.num_queries"] == f"{want[9]['num_queries']:g}" and "eval/num_queries" not in str(
        client.get_run(run.run_id).data.metrics
    )
    record = load_record(context["storage_dir"])
    trained = {s: want[s]["recall@1"] for s in (3, 6, 9)}
    best = max(sorted(trained), key=lambda s: trained[s])  # the first of equal values stays the best
    assert (record.best_step, record.step, record.initial_metrics, record.last_metrics) == (best, 9, want[0], want[9])
    exported = torch.load(Path(context["storage_dir"]) / "best_model" / "model.pt", weights_only=True)
    assert exported["extra"] == {"step": best, "metrics": want[best]}
    # the description's results: final, best (when another step) and the gain over the untrained model
    note = tags["mlflow.note.content"]
    gain = 100 * (max(want[9]["recall@1"], want[best]["recall@1"]) - want[0]["recall@1"])
    assert f"**recall@1 {want[9]['recall@1']:.4f}** at step 9 (final)" in note and f"{gain:+.1f} points" in note
    assert (f"best {want[best]['recall@1']:.4f} at step {best}" in note) == (best != 9)
    # one best_model however often it improved, tagged with its step and score
    models = client.search_logged_models([run.experiment_id])
    (best_model,) = [m for m in models if m.name == "best_model" and m.source_run_id == run.run_id]
    assert best_model.tags["step"] == str(best) and best_model.tags["recall_at_1"] == f"{want[best]['recall@1']:.4f}"
