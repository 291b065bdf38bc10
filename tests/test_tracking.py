"""MLflow tracking (:mod:`dmltrain.tracking`) against a real SQLite-backed MLflow: the failure-safe run
handle, MLflow 3 logged models, and the queries that read runs back.

The logged model is checked by loading it back with MLflow and comparing its embeddings with the
original module's, at a batch size other than the one it was traced with.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus, Metric

from dmltrain.config import load_config
from dmltrain.models import build_model
from dmltrain.tracking.names import LOSS, LR, STEP_MS, display_key, eval_key, eval_name, metric_key
from dmltrain.tracking.queries import best_point, child_runs, find_run, history
from dmltrain.tracking.run import RunHandle


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SQLite store for the module (creating its tables takes seconds); each test its own experiment."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


def test_unreachable_tracking_server_warns_once_and_training_goes_on(capsys):
    uri = "http://127.0.0.1:9"  # discard port: connection refused at once
    opened = RunHandle.open(uri, "exp", "run", {"a": 1})
    assert (opened.run_id, opened.resumed) == (None, False)
    logger = RunHandle.attach(uri, "0123", system_metrics=False)
    assert not logger.enabled
    logger.log_metrics({"loss": 1.0}, step=1)  # no-ops, no exceptions
    logger.log_artifact(__file__)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("unreachable" in line and "training continues" in line for line in err)


def test_sqlite_runs_resume_by_name_and_keep_artifacts_beside_the_db(store):
    uri = store
    opened = RunHandle.open(uri, "exp", "name", {"optim.lr": 0.1, "x": "a"})
    first, resumed = opened.run_id, opened.resumed
    assert first and not resumed
    reopened = RunHandle.open(uri, "exp", "name", {"optim.lr": 0.2, "x": "a"})
    again, resumed = reopened.run_id, reopened.resumed
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(again)
    assert (
        again == first
        and resumed
        and run.data.tags["resumed.optim.lr"] == "0.2"
        and run.data.params["optim.lr"] == "0.1"
    )
    assert client.get_experiment_by_name("exp").artifact_location == str(
        Path(store[len("sqlite:///") :]).parent / "mlartifacts"
    )
    assert metric_key("eval/recall@10") == "eval/recall_at_10" and metric_key("eval/map@r") == "eval/ranking/map_at_r"


def test_names_map_to_mlflow_keys_and_back():
    # Recall@K has the eval/ section to itself; the other evaluation metrics sit in groups after it
    assert eval_key("recall@1") == "eval/recall_at_1" and eval_key("binary/map@r") == "eval/binary/ranking/map_at_r"
    assert eval_key("nmi") == "eval/clustering/nmi" and metric_key("eval/r_precision") == "eval/ranking/r_precision"
    assert metric_key("eval/weird key!") == "eval/other/weird key_" and metric_key("x@1 y!") == "x_at_1 y_"
    for name in ("eval/recall@1", "eval/map@r", "batch/loss", "time/step_ms", "eval/binary/recall@1000", "eval/nmi"):
        assert display_key(metric_key(name)) == name
    assert eval_name("eval/binary/ranking/map_at_r") == "binary/map@r" and eval_name("batch/loss") is None
    # MLflow's UI sorts sections by code unit: the objective and the learning rate lead, then Recall@K
    sections = sorted({k.rsplit("/", 1)[0] for k in (LOSS, LR, eval_key("recall@1"), eval_key("nmi"), STEP_MS)})
    assert sections[:2] == ["batch", "eval"] and LOSS < LR


def _embedding_model():
    cfg = load_config(None, ["model.backbone=small_cnn", "model.embedding_dim=64"])
    return build_model(cfg.model, load_pretrained=False).eval()


def test_log_model_is_an_mlflow3_logged_model_linked_to_its_evaluation(store, capsys):
    run = RunHandle.open(store, "models", "trained", {"optim.lr": 0.1})
    model = _embedding_model()
    uri_was_set = mlflow.is_tracking_uri_set()
    example = np.zeros((2, 3, 32, 32), np.float32)
    ids = []
    for step, r1 in ((2, 0.4), (4, 0.6), (6, 0.7)):  # three improvements: one best_model, replaced each time
        run.log_metrics({"batch/loss": 1.0 / step, "time/step_ms": 9.0, "eval/recall@1": r1}, step=step)
        ids.append(run.log_model(model, "best_model", step=step, input_example=example, tags={"step": step}))
    assert all(ids) and mlflow.is_tracking_uri_set() == uri_was_set  # the process-wide URI is left alone

    client = MlflowClient(tracking_uri=store)
    exp_id = client.get_experiment_by_name("models").experiment_id
    logged = {m.model_id: m for m in client.search_logged_models([exp_id])}
    assert set(logged) == {ids[-1]}  # one per kind: the earlier bests are gone
    # ... and so are their files (MLflow's delete keeps them until `mlflow gc`): one model's folder remains
    models = Path(client.get_experiment(exp_id).artifact_location.removeprefix("file://")) / "models"
    assert sorted(p.name for p in models.iterdir()) == [ids[-1]] and (models / ids[-1] / "artifacts").is_dir()
    m = logged[ids[-1]]
    assert (m.name, m.source_run_id, m.status, m.params["optim.lr"], m.tags["step"]) == (
        "best_model",
        run.run_id,
        LoggedModelStatus.READY,
        "0.1",
        "6",
    )
    # linked to its step's evaluation only (not to the time or loss logged at that step)
    assert {(x.key, x.step): x.value for x in m.metrics} == {("eval/recall_at_1", 6): 0.7}
    outputs = client.get_run(run.run_id).outputs.model_outputs
    assert (6, ids[-1]) in {(o.step, o.model_id) for o in outputs}
    assert [s for s, _ in history(client, run.run_id, "eval/recall_at_1")] == [2, 4, 6]  # linking logs nothing twice
    ranked = client.search_logged_models([exp_id], filter_string="metrics.`eval/recall_at_1` > 0.65")
    assert [r.model_id for r in ranked] == [ids[-1]]

    # pt2: loads back without the model's code and computes the same embeddings at any batch size
    loaded = mlflow.pytorch.load_model(m.artifact_location)
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
    assert "warning" not in capsys.readouterr().err


def test_a_replaced_models_files_are_removed_only_where_the_store_put_them(tmp_path):
    from types import SimpleNamespace

    from dmltrain.tracking.run import remove_model_files

    def model(root, model_id, location=None):
        folder = Path(root) / "models" / model_id / "artifacts"
        if location is None:
            folder.mkdir(parents=True)
            (folder / "model.pt2").write_bytes(b"x")
        return SimpleNamespace(model_id=model_id, artifact_location=str(location or folder))

    exp = tmp_path / "exp"
    m = model(exp, "m-0a1b")
    assert remove_model_files(m, str(exp)) and not (exp / "models" / "m-0a1b").exists()
    m = model(exp, "m-0a1c")  # a store whose locations are file: URIs
    m.artifact_location = Path(m.artifact_location).as_uri()
    assert remove_model_files(m, exp.as_uri()) and not (exp / "models" / "m-0a1c").exists()
    # a location that is not <experiment>/models/<id>/artifacts, an id that is not MLflow's, a link: kept
    other = model(tmp_path / "other", "m-0a1d")
    assert not remove_model_files(other, str(exp)) and Path(other.artifact_location).is_dir()
    odd = model(exp, "m-0a1e")
    odd.model_id = "m-0a1e/../m-0a1e"
    assert not remove_model_files(odd, str(exp)) and (exp / "models" / "m-0a1e" / "artifacts" / "model.pt2").exists()
    victim = model(tmp_path / "victim", "m-0a1f")
    (exp / "models" / "m-0a1f").symlink_to(tmp_path / "victim" / "models" / "m-0a1f")
    linked = SimpleNamespace(model_id="m-0a1f", artifact_location=str(exp / "models" / "m-0a1f" / "artifacts"))
    assert not remove_model_files(linked, str(exp)) and (Path(victim.artifact_location) / "model.pt2").exists()


def test_a_run_describes_itself_and_names_its_data(store, tmp_path):
    from dmltrain.tracking.datasets import dataset_inputs, split_digest
    from dmltrain.tracking.description import describe_results, describe_run, with_results
    from shards.build.synthetic import build_synthetic_shards
    from shards.manifest import Manifest

    shards = tmp_path / "syn"
    build_synthetic_shards(shards, classes=6, per_class=2, image_size=16, seed=0, shard_size=5, progress=False)
    manifest = Manifest.load(shards)
    cfg = load_config(None, ["model.backbone=small_cnn", "model.embedding_dim=64", "loss.classifier.sample_ratio=0.5"])
    params = {"data.remote.retries": 8, "tracking.uri": "x", "data.shards": "s", "model.backbone": "b", "loss.w": 1}
    run = RunHandle.open(store, "described", "r", params)
    run.set_description(describe_run(cfg, manifest.summary(), total_steps=30, steps_per_epoch=3))
    run.log_inputs(dataset_inputs(manifest, "train", ["test"]))
    results = describe_results("recall@1", {"recall@1": 0.1}, {"recall@1": 0.3}, {"recall@1": 0.35}, 20, 30, 30, True)
    run.set_description(with_results(run.description(), results))

    got = MlflowClient(tracking_uri=store).get_run(run.run_id)
    # MLflow lists params as logged: what defines the run first, remote-read plumbing last
    assert list(got.data.params) == ["model.backbone", "loss.w", "data.shards", "tracking.uri", "data.remote.retries"]
    note = got.data.tags["mlflow.note.content"]
    assert note.startswith("**normsoftmax (50% of the classes) on small_cnn → 64-d, 30 steps**\n\n### Results\n\n- **")
    assert "`syn` (synthetic layout): train 6 classes, 12 images; test 6 classes, 12 images" in note
    assert "30 steps = 10 epochs" in note and note.count("### Results") == 1 and "no evaluation yet" not in note
    assert "**recall@1 0.3000** at step 30 (final); best 0.3500 at step 20; untrained 0.1000: **+25.0 points**" in note
    inputs = {(d.dataset.name, d.tags[0].value): d.dataset for d in got.inputs.dataset_inputs}
    assert set(inputs) == {("syn", "training"), ("syn", "evaluation")}
    train = inputs[("syn", "training")]
    assert train.digest == split_digest(manifest.split("train")) != inputs[("syn", "evaluation")].digest
    assert str(shards) in train.source and json.loads(train.profile)["images"] == 12


class _DataDependent(torch.nn.Module):
    """A forward that branches on tensor values: torch.export cannot trace it."""

    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_a_model_that_cannot_be_logged_warns_once_and_tracking_goes_on(store, capsys):
    run = RunHandle.open(store, "unloggable", "r", {})
    run.log_metrics({"eval/recall@1": 0.5}, step=1)
    example = np.ones((2, 3), np.float32)
    assert run.log_model(_DataDependent(), "model", step=1, input_example=example) is None
    assert run.log_model(_DataDependent(), "model", step=1, input_example=example) is None  # model logging is off now
    run.log_metrics({"eval/recall@1": 0.7}, step=2)  # the rest of tracking is not
    ours = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("dmltrain:")
    ]  # not torch.export's own
    assert len(ours) == 1 and "could not log model model" in ours[0] and "still logged as artifacts" in ours[0]
    client = MlflowClient(tracking_uri=store)
    assert [v for _, v in history(client, run.run_id, "eval/recall_at_1")] == [0.5, 0.7]
    (failed,) = client.search_logged_models([client.get_run(run.run_id).info.experiment_id])
    assert failed.status == LoggedModelStatus.FAILED


def test_queries_find_runs_children_histories_and_the_best_point(store):
    parent = RunHandle.open(store, "queries", "search", {})
    kids = [RunHandle.open(store, "queries", f"search-t{i:03d}", {}, parent_run_id=parent.run_id) for i in range(2)]
    client = MlflowClient(tracking_uri=store)
    exp_id = client.get_run(parent.run_id).info.experiment_id
    assert [r.info.run_id for r in child_runs(client, exp_id, parent.run_id)] == [k.run_id for k in kids]
    assert [r.info.run_id for r in parent.children()] == [k.run_id for k in kids]
    client.set_tag(kids[1].run_id, "mlflow.runName", "nickname")
    for token, expected in ((kids[0].run_id, kids[0]), ("search-t000", kids[0]), ("nickname", kids[1])):
        assert find_run(client, exp_id, token).info.run_id == expected.run_id, token
    assert find_run(client, exp_id, "nobody") is None
    # a resumed run logs steps again: the later value comes last
    client.log_batch(
        kids[0].run_id,
        metrics=[Metric("m", v, ts, s) for s, v, ts in ((2, 0.5, 10), (1, 0.1, 5), (2, 0.7, 20), (3, 0.7, 30))],
    )
    points = history(client, kids[0].run_id, "m")
    assert points == [(1, 0.1), (2, 0.5), (2, 0.7), (3, 0.7)]
    assert best_point(points) == (2, 0.7) and best_point(points, "min") == (1, 0.1) and best_point([]) is None


def test_params_tags_and_the_config_artifact_are_redacted(store, tmp_path, capsys):
    """No URL password and no storage option outside the allow-list reaches MLflow (:mod:`dmltrain.redact`): params
    (also a resumed run's ``resumed.*`` tags), tags, the config and manifest artifacts, warnings."""
    from dmltrain.tracking.names import STORAGE_DIR_TAG
    from dmltrain.training.artifacts import log_run_files
    from shards.manifest import Manifest
    from shards.storage.location import Location

    leaks = ("hunter2", "s3cr3t")
    cfg = load_config(
        None,
        [
            "data.shards=https://reader:hunter2@files.example/shards",
            "data.storage_options.headers.X-Custom-Header=s3cr3t",
            "data.storage_options.anon=true",
        ],
    )
    run = RunHandle.open(store, "redacted", "r", cfg.flat(), tags={STORAGE_DIR_TAG: "s3://KEY:s3cr3t@bucket/runs/r"})
    run.set_tags({"note": "from https://u:hunter2@h/x"})
    loc = Location("https://reader:hunter2@files.example/shards")
    assert "hunter2" in loc.root and "hunter2" not in str(loc) + repr(loc)  # fsspec gets it; messages do not
    log_run_files(run, cfg, {"train_batch_size": 8}, Manifest(loc.root, {"splits": {}}, loc))
    again = RunHandle.open(store, "redacted", "r", {**cfg.flat(), "data.storage_options.headers.X-Custom-Header": "x"})
    assert again.resumed
    got = MlflowClient(tracking_uri=store).get_run(run.run_id).data
    assert got.params["data.storage_options.headers.X-Custom-Header"] == "<redacted>"
    assert got.params["data.storage_options.anon"] == "True" and got.params["data.shards"].startswith(
        "https://<redacted>@"
    )
    assert got.tags[STORAGE_DIR_TAG] == "s3://<redacted>@bucket/runs/r"
    assert not any(s in repr(got.params) + repr(got.tags) for s in leaks)
    artifacts = Path(MlflowClient(tracking_uri=store).download_artifacts(run.run_id, "", str(tmp_path / "art")))
    assert sorted(p.name for p in artifacts.rglob("*.*")) == ["config.yaml", "deepspeed.json", "manifest_summary.json"]
    for f in artifacts.rglob("*.*"):
        assert not any(s in f.read_text() for s in leaks), f
    assert "X-Custom-Header: <redacted>" in (artifacts / "config" / "config.yaml").read_text()
    RunHandle.open("http://u:hunter2@127.0.0.1:9", "redacted", "r", {})  # discard port: unreachable at once
    err = capsys.readouterr().err
    assert "unreachable" in err and "http://<redacted>@127.0.0.1:9" in err and "hunter2" not in err


def test_a_param_key_mlflow_refuses_is_a_warning_naming_it_and_the_run_is_tracked(store, capsys):
    """A storage option named with a character MLflow refuses in a param key ('!') used to fail the params' batch,
    leaving the run untracked behind an "unreachable" warning: now that key alone is left out, named."""
    cfg = load_config(None, ["data.storage_options.client_kwargs.weird!key=1", "data.storage_options.anon=true"])
    run = RunHandle.open(store, "bad-key", "r", cfg.flat())
    assert run.enabled
    run.log_metrics({"loss": 1.0}, step=1)
    got = MlflowClient(tracking_uri=store).get_run(run.run_id).data
    assert got.params["data.storage_options.anon"] == "True" and got.metrics["loss"] == 1.0
    assert not any("weird" in k for k in got.params) and len(got.params) == len(cfg.flat()) - 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'data.storage_options.client_kwargs.weird!key'" in err[0], err
    assert "unreachable" not in err[0] and "not logged; the run is tracked without it" in err[0]
