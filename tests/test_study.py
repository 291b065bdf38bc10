"""``dmltrain study subsampling``: inputs, the table and plots, and a real two-point study on Ray.

The Ray test runs the CLI on a synthetic config of 16 classes asked for 12 (``--classes 12``),
so the study builds and caches the 12-class shards beside the config's, then trains two points
(ratios 1 and 0.75) at once. The table is checked against the MLflow runs read back here and
against what the sampler must do: one worker holding all 12 rows activates 12 of them at ratio
1 and round(0.75 × 12) = 9 at 0.75 (more than the 6 classes of a batch). A ``dmltrain report``
over the study closes the loop.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import statistics
from pathlib import Path

import pytest

from cluster import study as st
from dmltrain.cli import main
from dmltrain.config import load_config
from dmltrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


# -- inputs ----------------------------------------------------------------------------------------------
def test_ratios_and_classes_parse_or_name_the_flag():
    assert st.parse_ratios("1, 0.01,0.1,1") == [1.0, 0.1, 0.01]
    assert st.parse_classes("11318,1000") == [1000, 11318] and st.parse_classes(None) is None
    for text, words in (
        ("1,x", "'x' is not a number"),
        ("0", "0 is not a share of classes in (0, 1]"),
        ("1.5", "1.5 is not a share"),
        (",", "give at least one value, e.g. --ratios"),
    ):
        with pytest.raises(UserError) as e:
            st.parse_ratios(text)
        assert str(e.value).startswith(f"--ratios: {words}")
    for text, words in (("10,ten", "'ten' is not an integer"), ("1", "1 classes is too few")):
        with pytest.raises(UserError, match=f"^--classes: {words}"):
            st.parse_classes(text)


def test_synthetic_shards_of_other_class_counts_sit_beside_the_configs():
    cfg = load_config(ROOT / "configs/study/sop_synthetic.yaml")
    assert (
        cfg.data.synthetic.classes == 11318
        and cfg.data.synthetic.per_class == 5
        and cfg.loss.classifier.kind == "normsoftmax"
    )
    assert st.synthetic_shards_dir(cfg, 11318) == Path("data/synthetic-sop")
    assert st.synthetic_shards_dir(cfg, 1000) == Path("data/synthetic-sop-1000c")


def test_cli_refuses_a_study_without_a_classifier_or_classes_of_a_real_dataset(tmp_path, capsys):
    rc = main(["study", "subsampling", str(DEMO), "loss.classifier=null", "--ratios", "1,0.1"])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        "dmltrain: error: loss.classifier: a class-subsampling study needs a classifier loss (it is null in this config)"
    )
    from shards.build.synthetic import build_synthetic_shards

    build_synthetic_shards(tmp_path / "real", classes=4, per_class=2, image_size=16, seed=0, progress=False)
    rc = main(
        [
            "study",
            "subsampling",
            str(DEMO),
            f"data.shards={tmp_path / 'real'}",
            "data.synthetic=null",
            "--ratios",
            "1",
            "--classes",
            "8",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(
        f"dmltrain: error: --classes: {tmp_path / 'real'} is a dataset with 4 train classes"
    )
    rc = main(["study", "subsampling", str(DEMO), "--ratios", "2"])
    assert rc == 2 and "--ratios: 2 is not a share" in capsys.readouterr().err


def test_history_summaries():
    assert st.summarise_history([50.0, 100.0, 120.0, 110.0], "median") == 110.0  # the first window (start-up) left out
    assert st.summarise_history([50.0], "median") == 50.0
    assert st.summarise_history([1.0, float("nan"), 3.0], "mean") == 2.0
    assert st.summarise_history([1.0, 3.0, 2.0], "max") == 3.0
    assert math.isnan(st.summarise_history([], "max"))


def test_outputs_from_points(tmp_path):
    points = []
    for n in (100, 1000):
        for r in (1.0, 0.1, 0.01):
            p = st.Point(r, n, "/s", st.point_run_name("s", r, n), status="finished")
            p.recalls = {1: 0.5 + 0.2 * r, 10: 0.9}
            p.stats = {
                "images/s": 1000 / (1 + r),
                "step ms": 10 * (1 + r),
                "classifier MB": n / 100,
                "RSS MB": 900.0,
                "active rows": n * r,
                "active classes": n * r,
            }
            points.append(p)
    points.append(st.Point(0.001, 1000, "/s", "s-c1000-r0.001", status="failed", error="boom"))
    summary = st.StudySummary("s", [1, 10], points, tmp_path / "out", {}, None, "", 1.0)
    files = st.write_outputs(summary)
    assert set(files) == {"study.md", "study.csv", "recall_vs_ratio.png", "cost_vs_ratio.png", "vs_classes.png"}
    for name in ("recall_vs_ratio.png", "cost_vs_ratio.png", "vs_classes.png"):
        assert files[name].read_bytes()[:8] == PNG
    rows = list(csv.DictReader(files["study.csv"].open()))
    assert [(float(r["ratio"]), int(r["classes"]), r["status"]) for r in rows][:2] == [
        (1.0, 100, "finished"),
        (0.1, 100, "finished"),
    ]
    assert rows[-1]["status"] == "failed" and rows[-1]["recall@1"] == "" and rows[-1]["run"] == "s-c1000-r0.001"
    assert float(rows[1]["recall@1"]) == pytest.approx(0.52) and float(rows[4]["active rows"]) == pytest.approx(100.0)
    md = files["study.md"].read_text()
    assert "| ratio | classes | status | recall@1 | recall@10 | images/s | step ms | classifier MB |" in md
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave nothing behind
    # one class count: no plot against the number of classes
    one = st.StudySummary("s", [1, 10], points[:3], tmp_path / "one", {}, None, "", 1.0)
    assert "vs_classes.png" not in st.write_outputs(one)


# -- a real study ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study(tmp_path_factory):
    import ray
    from mlflow import MlflowClient

    from cluster.launch import start_local_ray

    root = tmp_path_factory.mktemp("study")
    overrides = {
        "data.shards": str(root / "syn"),
        "data.synthetic": "{classes: 16, per_class: 6, image_size: 32, shard_size: 40}",
        "data.batch_size": 24,
        "data.samples_per_class": 4,
        "data.loader_workers": 0,
        "data.eval_batch_size": 96,
        "model.embedding_dim": 64,
        "loss.instance": "null",
        "train.epochs": 1,
        "train.log_every": 1,
        "train.output_dir": str(root / "runs"),
        "eval.before_training": False,
        "eval.plots": False,
        "eval.binary": False,
        "eval.nmi": False,
        "tracking.uri": f"sqlite:///{root / 'mlflow.db'}",
        "tracking.experiment": "study-test",
        "tracking.system_metrics": False,
        "tracking.log_models": False,
        "cluster.num_workers": 1,
        "cluster.cpus_per_worker": 0.5,
    }
    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            rc = main(
                [
                    "study",
                    "subsampling",
                    str(DEMO),
                    *(f"{k}={v}" for k, v in overrides.items()),
                    "--ratios",
                    "1,0.75",
                    "--classes",
                    "12",
                    "--name",
                    "sub",
                    "--parallel",
                    "2",
                    "--no-progress",
                ]
            )
    finally:
        ray.shutdown()
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return {
        "rc": rc,
        "printed": printed.getvalue(),
        "root": root,
        "client": client,
        "exp": client.get_experiment_by_name("study-test"),
        "out": root / "runs" / "sub",
    }


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_point_study_writes_its_table_and_plots_under_one_parent_run(study, capsys):
    assert study["rc"] == 0
    client, exp, out, root = study["client"], study["exp"], study["out"], study["root"]
    # the 12-class shards were built beside the config's 16-class ones and used by both points
    from shards.manifest import Manifest

    assert Manifest.load(root / "syn-12c").split("train").num_classes == 12
    assert not (root / "syn").exists()  # --classes named every class count: the config's own were not needed

    parents = client.search_runs([exp.experiment_id], filter_string="tags.`dmltrain.run_name` = 'sub'")
    assert (
        len(parents) == 1 and parents[0].info.status == "FINISHED" and parents[0].data.tags["dmltrain.kind"] == "study"
    )
    parent = parents[0]
    assert parent.data.params["study.ratios"] == "1,0.75" and parent.data.params["study.classes"] == "12"
    kids = {
        k.data.tags["dmltrain.run_name"]: k
        for k in client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
    }
    assert set(kids) == {"sub-c12-r1", "sub-c12-r0.75"}

    rows = list(csv.DictReader((out / "study.csv").open()))
    assert [(r["ratio"], r["classes"], r["status"]) for r in rows] == [
        ("1.0", "12", "finished"),
        ("0.75", "12", "finished"),
    ]
    for row in rows:
        kid = kids[row["run"]]
        assert kid.info.status == "FINISHED"
        assert float(kid.data.params["loss.classifier.sample_ratio"]) == float(row["ratio"])
        assert kid.data.params["data.shards"] == str((root / "syn-12c").resolve())
        for k in (1, 2, 4, 8):  # the final evaluation, as logged by the run
            last = max(client.get_metric_history(kid.info.run_id, f"eval/recall_at_{k}"), key=lambda m: m.step)
            assert float(row[f"recall@{k}"]) == pytest.approx(last.value, rel=1e-12)
        speeds = [
            m.value for m in sorted(client.get_metric_history(kid.info.run_id, "images_per_s"), key=lambda m: m.step)
        ]
        assert float(row["images/s"]) == pytest.approx(statistics.median(speeds[1:] if len(speeds) > 1 else speeds))
        assert float(row["step ms"]) > 0 and float(row["classifier MB"]) > 0
    # one worker holds all 12 rows: every class at ratio 1, round(0.75 x 12) = 9 (> the 6 classes of a batch) at 0.75
    assert [float(r["active rows"]) for r in rows] == [12.0, 9.0] and [float(r["active classes"]) for r in rows] == [
        12.0,
        9.0,
    ]

    for name in ("recall_vs_ratio.png", "cost_vs_ratio.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert not (out / "vs_classes.png").exists()
    md = (out / "study.md").read_text()
    assert md.startswith("# Class-subsampling study sub") and "| 0.75 | 12 | finished |" in md
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert {"study/study.md", "study/study.csv", "study/plots"} <= arts
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "study/plots")} == {
        "study/plots/recall_vs_ratio.png",
        "study/plots/cost_vs_ratio.png",
    }
    printed = study["printed"]
    assert "| ratio | classes | status |" in printed and "2/2 points finished" in printed


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_report_over_the_study_compares_its_points(study, tmp_path):
    from dmltrain.report.cli import build_report

    rep = build_report(
        "study-test",
        runs=["sub"],
        out=tmp_path / "report",
        tracking_uri=f"sqlite:///{study['root'] / 'mlflow.db'}",
        progress=False,
    )
    assert sorted(r.name for r in rep.records) == ["sub-c12-r0.75", "sub-c12-r1"]
    text = rep.markdown.read_text()
    assert "loss.classifier.sample_ratio" in text and rep.html.is_file()
