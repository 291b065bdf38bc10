"""``dmltrain study subsampling``: inputs, the table and plots, and a real two-point study on Ray.

The trade-off (each point against ratio 1, seed by seed, with its spread) is checked on fixed fake
runs whose figures are worked out by hand in the test. The Ray test runs the CLI on a synthetic
config of 16 classes asked for 12 (``--classes 12``), so the study builds and caches the 12-class
shards beside the config's, then trains two points (ratios 1 and 0.75) at once. The table and the
parent run are checked against the MLflow runs read back here and against what the sampler must do:
one worker holding all 12 rows activates 12 of them at ratio 1 and round(0.75 × 12) = 9 at 0.75
(more than the 6 classes of a batch). A ``dmltrain report`` over the study closes the loop.
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
from dmltrain.studies import results as sr

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.yaml"
PNG = b"\x89PNG\r\n\x1a\n"


# -- inputs ----------------------------------------------------------------------------------------------
def test_ratios_and_classes_parse_or_name_the_flag():
    assert st.parse_ratios("1, 0.01,0.1,1") == [1.0, 0.1, 0.01]
    assert st.parse_classes("11318,1000") == [1000, 11318] and st.parse_classes(None) is None
    assert st.parse_classes("1e6,1e4,100000") == [10_000, 100_000, 1_000_000]
    for text, words in (
        ("1,x", "'x' is not a number"),
        ("0", "0 is not a share of classes in (0, 1]"),
        ("1.5", "1.5 is not a share"),
        (",", "give at least one value, e.g. --ratios"),
    ):
        with pytest.raises(UserError) as e:
            st.parse_ratios(text)
        assert str(e.value).startswith(f"--ratios: {words}")
    for text, words in (("10,ten", "'ten' is not a number"), ("1", "1 classes is too few"), ("1e4,2.5", "2.5 is not")):
        with pytest.raises(UserError, match=f"^--classes: {words}"):
            st.parse_classes(text)


def test_points_name_their_runs_distinguishing_part_first_and_set_their_overrides(tmp_path):
    cfg = load_config(DEMO)
    points = st.plan_points([1.0, 0.1], {100_000: "/s/100k", 1_000_000: "/s/1M"}, 2, "study-demo-x", seed=7)
    assert [p.label for p in points] == ["r1-c100k", "r0.1-c100k", "r1-c1M", "r0.1-c1M"]
    p = points[1]
    assert [(r.seed, r.run_name) for r in p.repeats] == [
        (7, "r0.1-c100k-s7-study-demo-x"),
        (8, "r0.1-c100k-s8-study-demo-x"),
    ]
    one = st.plan_points([0.5], {12: "/s/12"}, 1, "sub", seed=0)
    assert one[0].repeats[0].run_name == "r0.5-c12-sub"
    run_cfg = st.point_config(cfg, p, p.repeats[1], str(tmp_path / "runs"))
    assert (run_cfg.loss.classifier.sample_ratio, run_cfg.data.shards, run_cfg.data.synthetic.classes) == (
        0.1,
        "/s/100k",
        100_000,
    )
    assert (run_cfg.train.seed, run_cfg.train.run_name, run_cfg.cluster.storage_path) == (
        8,
        "r0.1-c100k-s8-study-demo-x",
        str(tmp_path / "runs"),
    )
    # the parent run's params: what the points share, never a value one point overrides
    params = st.study_params(cfg, points, 2)
    assert "loss.classifier.sample_ratio" not in params and "data.shards" not in params and "train.seed" not in params
    assert params["study.ratios"] == "1,0.1" and params["study.classes"] == "100000,1000000"
    assert params["study.repeats"] == 2 and params["study.seeds"] == "7,8" and params["optim.lr"] == cfg.optim.lr


def test_synthetic_shards_of_other_class_counts_sit_beside_the_configs():
    cfg = load_config(ROOT / "configs/study/sop_synthetic.yaml")
    assert (
        cfg.data.synthetic.classes == 11318
        and cfg.data.synthetic.per_class == 5
        and cfg.loss.classifier.kind == "normsoftmax"
    )
    assert st.synthetic_shards_dir(cfg, 11318) == Path("data/synthetic-sop")
    assert st.synthetic_shards_dir(cfg, 1000) == Path("data/synthetic-sop-1000c")


def test_no_progress_builds_shards_without_bars(tmp_path, capfd):
    from cluster.launch import prepare_data

    tiny = "{classes: 4, per_class: 2, image_size: 16, shard_size: 8}"
    cfg = load_config(DEMO, [f"data.shards={tmp_path / 'syn'}", f"data.synthetic={tiny}"])
    capfd.readouterr()
    prepare_data(cfg, progress=False)  # the config's own shards (dmltrain train, tune, a study without --classes)
    assert st.prepare_shards(cfg, [3], progress=False) == {3: str((tmp_path / "syn-3c").resolve())}
    err = capfd.readouterr().err
    assert "building synthetic shards in" in err and "%|" not in err and "it/s" not in err
    prepare_data(cfg.model_copy(update={"data": cfg.data.model_copy(update={"shards": str(tmp_path / "b")})}))
    assert "%|" in capfd.readouterr().err  # the bars this test looks for, where they are asked for


def test_a_class_count_no_synthetic_set_can_hold_is_refused_before_anything_is_built(tmp_path):
    """10^6 classes fit at 2 images a class (2·10^6 per split); at 5 the study names the per_class that fits, in one
    line, before it builds the smaller counts' shards."""
    cfg = load_config(DEMO, [f"data.shards={tmp_path / 'syn'}", "data.synthetic.per_class=5"])
    with pytest.raises(UserError) as e:
        st.prepare_shards(cfg, [1000, 1_000_000], progress=False)
    assert str(e.value) == (
        "--classes: 1,000,000 classes x data.synthetic.per_class=5 = 5,000,000 images per split, more than the "
        "2,000,000 a synthetic set may have; set data.synthetic.per_class=2 or fewer classes"
    )
    assert list(tmp_path.iterdir()) == []  # nothing built for the 1,000 classes either
    st.check_synthetic_sizes([1000, 1_000_000], 2)  # the sweep to 10^6 on synthetic data
    with pytest.raises(UserError, match=r"^--classes: 2,000,000 classes is more than the 1,000,000"):
        st.check_synthetic_sizes([2_000_000], 1)


def test_cli_refuses_a_study_without_a_classifier_or_classes_of_a_real_dataset(tmp_path, capsys, monkeypatch):
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
    # a study is the folder <root>/<name>: its name is one folder name, checked before anything is built
    from cluster import study

    monkeypatch.setattr(study, "prepare_driver", lambda *a: pytest.fail("--name ../x was accepted"))
    rc = main(["study", "subsampling", str(DEMO), "--ratios", "1,0.1", "--name", "../x"])
    assert rc == 2 and capsys.readouterr().err.strip() == (
        "dmltrain: error: --name ../x: not a study name (letters, digits, _ . -)"
    )


def test_history_summaries():
    assert st.summarise_history([50.0, 100.0, 120.0, 110.0], "steady") == 110.0  # the first window (start-up) left out
    assert st.summarise_history([50.0], "steady") == 50.0 and st.summarise_history([1.0, 2.0], "last") == 2.0
    assert st.summarise_history([1.0, float("nan"), 3.0], "mean") == 2.0
    assert st.summarise_history([1.0, 3.0, 2.0], "max") == 3.0
    assert math.isnan(st.summarise_history([], "max"))


def _fake_study(tmp_path):
    """Two class counts; at 100 classes ratios 1 and 0.1, three seeds, seed 2 failed at ratio 1."""
    from dmltrain.studies.results import Repeat

    def run(seed, r1, step, wall, mb=2.0, ok=True):
        values = {"recall@1": r1, "recall@10": 0.95, "step ms": step, "classifier MB": mb, "wall s": wall}
        return Repeat(
            seed, f"x-s{seed}", "finished" if ok else "failed", values if ok else {}, error=None if ok else "boom"
        )

    points = st.plan_points([1.0, 0.1], {100: "/s/100", 1000: "/s/1k"}, 3, "s", seed=0)
    runs = {
        "r1-c100": [run(0, 0.80, 100.0, 60.0), run(1, 0.82, 110.0, 70.0), run(2, 0, 0, 0, ok=False)],
        "r0.1-c100": [run(0, 0.78, 50.0, 40.0), run(1, 0.79, 44.0, 30.0), run(2, 0.90, 47.0, 35.0)],
        "r1-c1k": [run(0, 0.70, 400.0, 200.0), run(1, 0.72, 420.0, 210.0), run(2, 0.71, 410.0, 205.0)],
        "r0.1-c1k": [run(0, 0.69, 100.0, 90.0), run(1, 0.70, 105.0, 95.0), run(2, 0.70, 110.0, 100.0)],
    }
    for p in points:
        p.repeats = runs[p.label]
    return sr.StudySummary("s", [1, 10], points, tmp_path / "out", {}, None, "", 1.0)


def test_the_trade_off_against_ratio_1_seed_by_seed(tmp_path):
    from dmltrain.studies.results import RELATIVES, reference_of, relative, stat

    summary = _fake_study(tmp_path)
    r1, r01 = summary.points[0], summary.points[1]
    assert reference_of(r01, summary.points) is r1 and reference_of(summary.points[3], summary.points).label == "r1-c1k"
    delta, speed, memory = (relative(r01, r1, rel) for rel in RELATIVES)
    # seed 2 failed at ratio 1, so only seeds 0 and 1 pair: Δ = -2.0 and -3.0 points, speed-up 100/50 and 110/44
    assert (delta.mean, delta.n) == (pytest.approx(-2.5), 2) and delta.sd == pytest.approx(math.sqrt(0.5))
    assert (speed.mean, speed.n) == (pytest.approx(2.25), 2) and speed.sd == pytest.approx(math.sqrt(2 * 0.25**2))
    assert (memory.mean, memory.sd) == (1.0, 0.0)
    # absolute figures use every finished seed: (0.78 + 0.79 + 0.90) / 3
    assert stat(r01, "recall@1").mean == pytest.approx(0.82333333) and stat(r1, "recall@1").n == 2
    assert relative(r1, r1, RELATIVES[0]).text(2) == "0.00 ± 0.00"
    head, rows = sr.table(summary)
    assert head == ["point", "r1-c100", "r0.1-c100", "r1-c1k", "r0.1-c1k"]
    cells = {r[0]: r[1:] for r in rows}
    assert cells["runs"] == ["2/3", "3/3", "3/3", "3/3"]
    assert cells["Δ recall@1 (points)"][1] == "-2.50 ± 0.71" and cells["speed-up (×)"][1] == "2.25 ± 0.35"
    # at 1000 classes: Δ -1, -2, -1 points; speed-up 4, 4, 3.7273
    assert cells["Δ recall@1 (points)"][3] == f"{-4 / 3:.2f} ± {statistics.stdev([-1, -2, -1]):.2f}"
    assert cells["speed-up (×)"][3] == f"{(4 + 4 + 410 / 110) / 3:.2f} ± {statistics.stdev([4, 4, 410 / 110]):.2f}"
    assert cells["wall s"][1] == "35 ± 5" and cells["recall@1"][0] == "0.8100 ± 0.0141"
    # the parent's metrics: one per quantity, point i at step i (a reference at its identity: Δ 0, 1×), rounded;
    # the quantities that are the same at every point (memory 1×, 2 MB, recall@10 0.95) are left out
    metrics = sr.parent_metrics(summary)
    assert metrics["change/delta_recall_at_1_points"] == {0: 0.0, 1: -2.5, 2: 0.0, 3: -1.333}
    assert metrics["change/speedup"] == {0: 1.0, 1: 2.25, 2: 1.0, 3: 3.909}  # (4 + 4 + 410 / 110) / 3
    assert metrics["value/recall_at_1"] == {0: 0.81, 1: 0.8233, 2: 0.71, 3: 0.6967}
    assert not {"change/memory_factor", "value/classifier_mb", "value/recall_at_10"} & set(metrics)
    assert all(k.count("/") == 1 for k in metrics)  # no chart per point
    text = sr.describe_study(summary, "Each run: ...")
    # seeds 0 and 1 pair: Δ -2, -3; the 95 % t interval's half-width t(0.975, 1) · s.d. / √2 = 12.706 · 0.5 = 6.35
    assert (
        "- **r0.1-c100**: Δ Recall@1 within noise: -2.5 ± 6.4 points (95 % interval over 2 paired seeds; "
        "r1-c100 at 0.8100 ± 0.0141), 2.25 ± 0.35× step speed"
    ) in text
    assert "- **r1-c100** (the reference): 105.0 ms per step, 65 s per run" in text
    assert text.index("r0.1-c1k**:") < text.index("r1-c100** (the reference)")  # the changes first
    # a variant (a later study's sampling mode) without its own ratio-1 point is compared with the full softmax
    variants = st.plan_points([1.0, 0.1], {100: "/s"}, 1, "v", 0, [("uniform", {}), ("hard", {"x.y": 1})])
    assert [p.label for p in variants] == ["uniform-r1-c100", "uniform-r0.1-c100", "hard-r1-c100", "hard-r0.1-c100"]
    assert variants[3].overrides["x.y"] == 1 and variants[3].repeats[0].run_name == "hard-r0.1-c100-v"
    for p in variants:
        p.repeats[0].status = "finished"
    variants[2].repeats[0].status = "failed"
    assert reference_of(variants[3], variants) is variants[0] and reference_of(variants[1], variants) is variants[0]


def test_the_parent_run_charts_each_quantity_across_the_points(tmp_path):
    """What MLflow draws of the parent: one metric per quantity, point i at step i, rounded; no constant."""
    from mlflow import MlflowClient

    from dmltrain.tracking.run import RunHandle

    summary = _fake_study(tmp_path)
    for r in summary.points[1].repeats:  # floats as arithmetic leaves them (0.009999999999999998)
        r.values["recall@1"] = 0.79 + 0.009999999999999998 * (r.seed == 2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = RunHandle.open(uri, "st", "s", {}, owner="the study")
    st.log_parent_metrics(parent, summary)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(parent.run_id)
    assert set(run.data.metrics) == {
        "change/delta_recall_at_1_points",
        "change/delta_recall_at_1_ci95_half",
        "change/speedup",
        "value/recall_at_1",
        "value/step_ms",
    }  # not value/wall_s: the wall time goes in its parts (start-up, steps), which these fake runs lack
    history = {m.step: m.value for m in client.get_metric_history(parent.run_id, "value/recall_at_1")}
    assert history == {0: 0.81, 1: 0.7933, 2: 0.71, 3: 0.6967}  # (0.79 + 0.79 + 0.8) / 3, 4 digits
    delta = {m.step: m.value for m in client.get_metric_history(parent.run_id, "change/delta_recall_at_1_points")}
    assert delta == {0: 0.0, 1: -2.0, 2: 0.0, 3: -1.333}  # seeds 0, 1 pair at 100 classes: -1, -3 points
    text = sr.describe_study(summary, "")
    assert "step = point: 0 r1-c100 (reference), 1 r0.1-c100, 2 r1-c1k (reference), 3 r0.1-c1k." in text


def test_the_figures_label_a_small_change_with_its_digits_and_draw_the_full_loss_from_zero(tmp_path, monkeypatch):
    from dmltrain.evaluate import plots

    # a change of 0.15 points reads +0.15, not +0.1 (nor 0.02 as +0.0); the verdict's decimals
    assert [sr.delta_label(x) for x in (0.15, 0.02, 0.004, -0.0, -2.14, 3.0)] == [
        "+0.15",
        "+0.02",
        "0.00",
        "0.00",
        "-2.1",
        "+3.0",
    ]
    summary = _fake_study(tmp_path)
    series = sr._tradeoff_series(summary)
    assert series[0].ylabel.startswith("Δ Recall@1") and series[0].values(0.15) == "+0.15"
    # the full-softmax loss of an untrained-scale model, 6.2146 -> 6.2046: drawn from 0 under its chance level
    for p in summary.points:
        for r in p.finished:
            r.curves = {"full-softmax loss": [(s, 6.2146 - 0.001 * s) for s in (0, 5, 10)]}
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or Path(path))
    sr.plot_curve(summary, sr.full_loss_measure(), tmp_path / "full_loss.png")
    ax = figures[0].axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > math.log(1000)
    assert [t.get_text() for t in ax.get_legend().get_texts()][-2:] == [
        "ln C = 4.61: a uniform softmax over 100 classes",
        "ln C = 6.91: a uniform softmax over 1,000 classes",
    ]


def _paired(ref_r1: list[float], point_r1: list[float]):
    ref = sr.Point(1.0, 100, "/s", "r1-c100", repeats=[])
    pt = sr.Point(0.1, 100, "/s", "r0.1-c100", repeats=[])
    for seed, (a, b) in enumerate(zip(ref_r1, point_r1)):
        ref.repeats.append(sr.Repeat(seed, f"a{seed}", "finished", {"recall@1": a}))
        pt.repeats.append(sr.Repeat(seed, f"b{seed}", "finished", {"recall@1": b}))
    return ref, pt


def test_paired_deltas_of_recall_at_1_checked_by_hand():
    # a clear loss: Δ -2, -2.5, -1.5 points; s.d. 0.5; t(0.975, 2) = 4.303: half-width 4.303 · 0.5 / √3 = 1.2421
    ref, pt = _paired([0.50, 0.52, 0.54], [0.48, 0.495, 0.525])
    pd = sr.paired_delta(pt, ref)
    assert pd.n == 3 and pd.stat.mean == pytest.approx(-2.0) and pd.stat.sd == pytest.approx(0.5)
    assert pd.half == pytest.approx(4.302653 * 0.5 / math.sqrt(3), rel=1e-6)
    assert pd.interval == pytest.approx((-3.2421, -0.7579), abs=1e-4) and pd.within_noise is False
    assert pd.reference.mean == pytest.approx(0.52) and pd.verdict() == "-2.0 ± 1.2 points"
    assert pd.sentence("r1-c100") == "-2.0 ± 1.2 points (95 % interval over 3 paired seeds; r1-c100 at 0.5200 ± 0.0200)"
    # the spread exceeds the effect: Δ +1, -3, -1; s.d. 2; half-width 4.303 · 2 / √3 = 4.97
    ref, pt = _paired([0.50, 0.52, 0.54], [0.51, 0.49, 0.53])
    pd = sr.paired_delta(pt, ref)
    assert pd.stat.mean == pytest.approx(-1.0) and pd.stat.sd == pytest.approx(2.0)
    assert pd.half == pytest.approx(4.969, abs=1e-3) and pd.within_noise is True
    assert pd.verdict() == "within noise (-1.0 ± 5.0 points)"
    # changes under a point get two decimals; no float noise, no "-0.00"
    ref, pt = _paired([0.0100, 0.0100], [0.0110, 0.0100])
    pd = sr.paired_delta(pt, ref)
    assert pd.verdict() == "within noise (+0.05 ± 0.64 points)"  # Δ 0.1, 0: 12.706 · 0.0707 / √2 = 0.635
    ref, pt = _paired([0.0100, 0.0100], [0.0100, 0.0100])
    assert sr.paired_delta(pt, ref).verdict() == "within noise (0.00 ± 0.00 points)"
    # one seed: a change, no interval, said so
    ref, pt = _paired([0.50], [0.48])
    pd = sr.paired_delta(pt, ref)
    assert pd.half is None and pd.within_noise is None
    assert pd.verdict() == "-2.0 points (one seed: no interval)"
    assert pd.sentence("r1-c100") == "-2.0 points (one seed: no interval; r1-c100 at 0.5000)"
    # only seeds finished on both sides pair; none: nothing to say
    pt.repeats[0].status = "failed"
    assert sr.paired_delta(pt, ref).n == 0 and sr.paired_delta(pt, ref).verdict() == sr.MISSING
    assert sr.rounded(0.009999999999999998) == 0.01 and sr.rounded(299.8512) == 299.9


def test_a_runs_wall_time_in_parts_sets_its_start_up_apart(tmp_path):
    # a run that starts at t = 1000 s, sleeps 60 s (start-up), then 3 windows of 10 steps at 100, 120, 100 ms a step
    # (one 10 s evaluation after step 20) and 5 s at the end; logged at the end of each window
    start = 1_000_000
    windows = [(10, start + 61_000, 100.0), (20, start + 62_200, 120.0), (30, start + 73_200, 100.0)]
    end = start + 78_200
    parts = sr.timeline(start, end, windows)
    assert parts == pytest.approx({"startup": 60.0, "steps": 3.2, "other": 15.0})
    # two micro-batches a step double the steps' time; a step logged again by a resumed run counts once
    parts = sr.timeline(start, end, [*windows, (20, start + 90_000, 120.0)], accum=2)
    assert parts["steps"] == pytest.approx(6.4) and parts["startup"] == pytest.approx(59.0)
    assert all(math.isnan(v) for v in sr.timeline(start, end, []).values())

    # read from a real MLflow run as the study reads it
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("t"), start_time=start)
    for step, ts, ms in windows:
        client.log_metric(run.info.run_id, "time/step_ms", ms, timestamp=int(ts), step=step)
    client.set_terminated(run.info.run_id, end_time=end)
    got = st.run_measures(uri, run.info.run_id, sr.timeline_measures())
    assert got == pytest.approx({"start-up s": 60.0, "steps s": 3.2, "eval and other s": 15.0})
    point = sr.Point(1.0, 100, "/s", "r1-c100", repeats=[sr.Repeat(0, "x", "finished", got)])
    assert sr.wall_parts(point) == "run 78 s: start-up 60 s, training steps 3.2 s, evaluation and the rest 15 s"


def test_the_full_softmax_loss_the_study_compares_is_the_same_at_every_ratio():
    """The probe's full-softmax loss of one model on one batch is the same at ratio 1 and 0.1 (a float64
    softmax over all 500 classes: the reference), while the objective, over the drawn classes, is lower at 0.1."""
    import torch
    from distributed_reference import dense_classifier_loss

    from dmltrain.distributed import ShardedClassifier

    C, D = 500, 16
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, D, generator=g, dtype=torch.float64), torch.randint(0, C, (24,), generator=g)
    losses = {}
    for ratio in (1.0, 0.1):
        clf = ShardedClassifier(C, D, "normsoftmax", sample_ratio=ratio, seed=3).double()
        with torch.no_grad():
            clf.weight.copy_(torch.randn(C, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
            sampled = float(clf(x, y, step=1))
        losses[ratio] = (float(clf.probe(x, y, 1)["full_loss"]), sampled, clf)
    full = {r: v[0] for r, v in losses.items()}
    assert full[1.0] == pytest.approx(full[0.1], rel=1e-12)
    clf = losses[1.0][2]
    reference = dense_classifier_loss(x, y, clf.full_weight().double(), None, "normsoftmax", clf.params)
    assert full[1.0] == pytest.approx(float(reference), rel=1e-9)
    assert losses[0.1][1] < losses[1.0][1] - 0.5  # the objective is not comparable across ratios
    m = sr.full_loss_measure()
    assert m.key == "softmax/probe/full_loss" and m.curve


def test_outputs_of_a_study(tmp_path):
    summary = _fake_study(tmp_path)
    files = sr.write_outputs(summary)
    assert set(files) == {
        "study.md",
        "study.csv",
        "study_runs.csv",
        "tradeoff.png",
        "recall_vs_ratio.png",
        "vs_classes.png",
    }
    for name in ("tradeoff.png", "recall_vs_ratio.png", "vs_classes.png"):
        assert files[name].read_bytes()[:8] == PNG
    md = files["study.md"].read_text()
    assert "| point | r1-c100 | r0.1-c100 | r1-c1k | r0.1-c1k |" in md and "compare each point with ratio 1" in md
    # the classifier memory is the same everywhere: not plotted, and said so
    assert "Not plotted (the same at every ratio): classifier memory 2.000 MB at 100 classes, 2.000 MB at 1,000" in md
    # the verdicts first, then the table with its row of them; Δ at 1000 classes -1, -2, -1: the interval holds 0
    assert "- **r0.1-c1k**: Δ Recall@1 within noise: -1.3 ± 1.4 points (95 % interval over 3 paired seeds; " in md
    assert "| Δ recall@1, 95 % interval | — | within noise (-2.5 ± 6.4 points) | — |" in md
    rows = list(csv.DictReader(files["study.csv"].open()))
    assert [r["point"] for r in rows] == ["r1-c100", "r0.1-c100", "r1-c1k", "r0.1-c1k"]
    assert rows[3]["verdict"] == "within noise (-1.3 ± 1.4 points)" and float(rows[3]["Δ recall@1 95% high"]) > 0
    metrics = sr.parent_metrics(summary)
    # 12.706 · 0.7071 / √2 at r0.1-c100; 4.303 · 0.5774 / √3 at r0.1-c1k, 4 digits; none at a reference
    assert metrics["change/delta_recall_at_1_ci95_half"] == {1: 6.353, 3: 1.434}
    assert not any("memory_factor" in k for k in metrics)  # 1× everywhere: no chart of a constant
    assert float(rows[1]["Δ recall@1 (points)"]) == pytest.approx(-2.5) and rows[0]["runs"] == "2"
    runs = list(csv.DictReader(files["study_runs.csv"].open()))
    assert len(runs) == 12 and runs[2]["status"] == "failed" and runs[2]["error"] == "boom"
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave nothing behind
    # one class count, one seed: no plot against the number of classes, no spread
    one = sr.StudySummary("s", [1, 10], summary.points[:2], tmp_path / "one", {}, None, "", 1.0)
    for p in one.points:
        p.repeats = p.repeats[:1]
    assert "vs_classes.png" not in sr.write_outputs(one)
    assert "one seed per point: no spread" in (tmp_path / "one" / "study.md").read_text()


# -- two points at once ----------------------------------------------------------------------------------------
def test_two_runs_starting_on_the_same_shards_at_once_both_keep_tracking(tmp_path, capsys):
    """Why a point of a ``--parallel`` study once had no evaluation in MLflow at all, made to happen every time.

    Each run's rank 0 logs its datasets when it starts (:meth:`Trainer._describe_run`); two points on the same
    shards log the same dataset into one experiment at the same moment. MLflow looks a dataset up, then inserts it:
    on a loaded machine both look before either inserts, the second insert breaks the dataset's unique key, and
    that failure used to turn the run's tracking off, so its evaluations were never logged. Here both runs are held
    (a barrier in the store's session) until both have looked, the interleaving load makes likely; both must then
    keep tracking, and both evaluations be in MLflow."""
    import threading
    from types import SimpleNamespace

    from mlflow import MlflowClient
    from mlflow.store.tracking.dbmodels.models import SqlDataset
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from dmltrain.tracking.run import RunHandle
    from dmltrain.training.trainer import Trainer
    from shards.build.synthetic import build_synthetic_shards
    from shards.manifest import Manifest

    build_synthetic_shards(tmp_path / "syn", 4, 2, 16, 0, shard_size=8, workers=0, progress=False)
    manifest = Manifest.load(tmp_path / "syn")
    cfg = load_config(DEMO, [f"data.shards={tmp_path / 'syn'}", "model.backbone=small_cnn"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    runs = [RunHandle.open(uri, "same-shards", f"point{i}", {}, owner="training") for i in range(2)]
    both_looked = threading.Barrier(2, timeout=60)

    def hold(session, flush_context, instances):  # a dataset about to be inserted: both have looked by now
        if any(isinstance(o, SqlDataset) for o in session.new) and not both_looked.broken:
            try:
                both_looked.wait()
            except threading.BrokenBarrierError:
                pass

    def start(handle: RunHandle, i: int) -> None:
        trainer = SimpleNamespace(logger=handle, stream=SimpleNamespace(manifest=manifest), cfg=cfg)
        trainer.total_steps, trainer.steps_per_epoch = 10, 5
        Trainer._describe_run(trainer)
        handle.log_metrics({"eval/recall@1": 0.5 + i / 10}, step=10)

    event.listen(Session, "before_flush", hold)
    try:
        threads = [threading.Thread(target=start, args=(h, i)) for i, h in enumerate(runs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        event.remove(Session, "before_flush", hold)
    assert not both_looked.broken and both_looked.n_waiting == 0  # the race was run, not avoided
    assert "could not" not in capsys.readouterr().err  # no run's tracking went off
    client = MlflowClient(tracking_uri=uri)
    for i, h in enumerate(runs):
        assert h.enabled
        assert [m.value for m in client.get_metric_history(h.run_id, "eval/recall_at_1")] == [0.5 + i / 10]
        inputs = client.get_run(h.run_id).inputs.dataset_inputs
        assert {(d.dataset.name, d.tags[0].value) for d in inputs} == {("syn", "training"), ("syn", "evaluation")}


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
    from dmltrain.tracking.queries import steady_state

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
    params = parent.data.params
    assert params["study.ratios"] == "1,0.75" and params["study.classes"] == "12" and params["study.repeats"] == "1"
    # no param of the parent says a value only some points had
    assert "loss.classifier.sample_ratio" not in params and "data.shards" not in params
    kids = {
        k.data.tags["dmltrain.run_name"]: k
        for k in client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
        )
    }
    # named with what tells them apart first (MLflow's runs table cuts long names)
    assert set(kids) == {"r1-c12-sub", "r0.75-c12-sub"}
    assert {k.info.run_name for k in kids.values()} == set(kids)
    assert {k.data.tags["dmltrain.study.point"] for k in kids.values()} == {"r1-c12", "r0.75-c12"}

    runs = list(csv.DictReader((out / "study_runs.csv").open()))
    assert [(r["point"], r["seed"], r["status"]) for r in runs] == [
        ("r1-c12", "0", "finished"),
        ("r0.75-c12", "0", "finished"),
    ]
    measured = {}
    for row in runs:
        kid = kids[row["run"]]
        assert kid.info.status == "FINISHED"
        assert float(kid.data.params["loss.classifier.sample_ratio"]) == float(row["point"][1:].split("-")[0])
        assert kid.data.params["data.shards"] == str((root / "syn-12c").resolve())
        for k in (1, 2, 4, 8):  # the final evaluation, as logged by the run
            last = max(client.get_metric_history(kid.info.run_id, f"eval/recall_at_{k}"), key=lambda m: m.step)
            assert float(row[f"recall@{k}"]) == pytest.approx(last.value, rel=1e-12)
        steps = sorted(client.get_metric_history(kid.info.run_id, "time/step_ms"), key=lambda m: m.step)
        assert float(row["step ms"]) == pytest.approx(steady_state(m.value for m in steps))
        assert float(row["classifier MB"]) == float(kid.data.tags["dmltrain.memory.classifier_mb"]) > 0
        kid = client.get_run(kid.info.run_id)  # the study tagged it after its training
        assert float(row["wall s"]) == pytest.approx(float(kid.data.tags["dmltrain.study.wall_s"]), abs=0.05)
        measured[row["point"]] = row
    # one worker holds all 12 rows: every class at ratio 1, round(0.75 x 12) = 9 (> the 6 classes of a batch) at 0.75
    assert [float(measured[p]["active rows"]) for p in ("r1-c12", "r0.75-c12")] == [12.0, 9.0]
    assert [float(measured[p]["active classes"]) for p in ("r1-c12", "r0.75-c12")] == [12.0, 9.0]

    # the point at 0.75 against ratio 1: the same figures in the CSV and among the parent's metrics
    ref, pt = measured["r1-c12"], measured["r0.75-c12"]
    delta = 100 * (float(pt["recall@1"]) - float(ref["recall@1"]))
    speedup = float(ref["step ms"]) / float(pt["step ms"])
    rows = {r["point"]: r for r in csv.DictReader((out / "study.csv").open())}
    assert float(rows["r0.75-c12"]["Δ recall@1 (points)"]) == pytest.approx(delta)
    assert float(rows["r0.75-c12"]["speed-up (×)"]) == pytest.approx(speedup)

    def chart(key):  # a quantity's values along the points (point i at step i)
        return {m.step: m.value for m in client.get_metric_history(parent.info.run_id, key)}

    assert chart("change/delta_recall_at_1_points") == ({0: 0.0, 1: sr.rounded(delta)} if sr.rounded(delta) else {})
    assert chart("change/speedup") == ({0: 1.0, 1: sr.rounded(speedup)} if sr.rounded(speedup) != 1 else {})
    note = parent.data.tags["mlflow.note.content"]
    assert f"- **r0.75-c12**: Δ Recall@1 {sr._signed(delta, 2 if abs(delta) < 1 else 1)} points (one seed" in note
    assert f"{speedup:.2f}× step speed" in note

    md = (out / "study.md").read_text()
    assert md.startswith("# Class-subsampling study sub") and "| point | r1-c12 | r0.75-c12 |" in md
    assert "| runs | 1/1 | 1/1 |" in md and "classifier memory" in md  # the same memory at both ratios: not plotted
    arts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert {"study/study.md", "study/study.csv", "study/study_runs.csv", "study/recall_vs_ratio.png"} <= arts
    assert ("study/tradeoff.png" in arts) == (out / "tradeoff.png").is_file() and "study/vs_classes.png" not in arts
    printed = study["printed"]
    assert "| point | r1-c12 | r0.75-c12 |" in printed and "2/2 points, 2/2 runs finished" in printed


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
    assert sorted(r.name for r in rep.records) == ["r0.75-c12-sub", "r1-c12-sub"]
    text = rep.markdown.read_text()
    assert "loss.classifier.sample_ratio" in text and rep.html.is_file()


# -- sampling modes (--sampling) --------------------------------------------------------------------------------
def _sampling_study(tmp_path):
    """Ratios 1 and 0.1 at 100 classes, modes uniform and hard, two seeds; the probe's cosine over training."""
    from dmltrain.studies.results import Repeat

    points = st.plan_points([1.0, 0.1], {100: "/s/100"}, 2, "s", 0, st.sampling_variants(["uniform", "hard"]), True)
    r1 = {"r1-c100": (0.80, 0.84), "uniform-r0.1-c100": (0.70, 0.74), "hard-r0.1-c100": (0.76, 0.82)}
    for p in points:
        p.repeats = [
            Repeat(
                s,
                f"{p.label}-s{s}",
                "finished",
                {
                    "recall@1": r1[p.label][s],
                    "step ms": 10.0,
                    "grad cos": 0.5,
                    "loss gap": -2.0 + 0.5 * s,
                    **({"uniform draw's loss gap": -2.5} if p.label.startswith("hard") else {}),
                },  # fmt: skip
                curves={"grad cos": [(0, 0.9), (10, 0.5 + 0.1 * s)]},
            )  # fmt: skip
            for s in (0, 1)
        ]
    measures = [*sr.default_measures([1]), *sr.probe_measures()]
    return sr.StudySummary("s", [1], points, tmp_path / "out", {}, None, "", 1.0, measures)


def test_sampling_modes_share_one_full_softmax_and_say_what_share_of_the_gap_they_close(tmp_path):
    summary = _sampling_study(tmp_path)
    pts = summary.points
    assert [p.label for p in pts] == ["r1-c100", "uniform-r0.1-c100", "hard-r0.1-c100"]
    assert pts[2].overrides["loss.classifier.sampling"] == "hard" and "loss.classifier.sampling" not in pts[0].overrides
    assert sr.reference_of(pts[2], pts) is pts[0] and sr.reference_of(pts[1], pts) is pts[0]
    # seed 0: (0.76 − 0.70) / (0.80 − 0.70) = 60 %; seed 1: (0.82 − 0.74) / (0.84 − 0.74) = 80 %
    gap = sr.gap_closed(pts[2], pts)
    assert (gap.mean, gap.n) == (pytest.approx(70.0), 2) and gap.sd == pytest.approx(math.sqrt(200))
    assert sr.gap_closed(pts[1], pts).n == 0 and sr.gap_closed(pts[0], pts).n == 0
    head, rows = sr.table(summary)
    cells = {r[0]: r[1:] for r in rows}
    assert cells["variant"] == ["—", "uniform", "hard"] and cells["R@1 gap to uniform closed (%)"] == [
        "—",
        "—",
        "70 ± 14",
    ]
    assert cells["grad cos"] == ["0.500 ± 0.000"] * 3
    assert cells["loss gap"] == ["-1.75 ± 0.35"] * 3 and cells["uniform draw's loss gap"][2] == "-2.50 ± 0.00"
    assert sr.parent_metrics(summary)["change/gap_closed_percent"] == {2: 70.0}
    assert "70 ± 14% of the uniform draw's Recall@1 gap closed" in sr.describe_study(summary, "")
    files = sr.write_outputs(summary)
    assert files["grad_cos.png"].read_bytes()[:8] == PNG and files["tradeoff.png"].read_bytes()[:8] == PNG
    assert (
        "`grad_cos.png`: cosine of the sampled and the full softmax's embedding gradients (the probe) over training"
        in files["study.md"].read_text()
    )
    rows = {r["point"]: r for r in csv.DictReader(files["study.csv"].open())}
    assert float(rows["hard-r0.1-c100"]["gap closed %"]) == pytest.approx(70.0)
    assert st.parse_sampling("hard, uniform,hard") == ["hard", "uniform"] and st.parse_sampling(None) is None
    with pytest.raises(UserError, match="^--sampling: 'nearest' is not a sampling mode"):
        st.parse_sampling("uniform,nearest")


def test_the_sampling_flag_sets_the_variants_and_turns_the_probe_on(monkeypatch, capsys):
    seen = {}

    def fake_run_study(cfg, ratios, classes, **kw):
        seen.update(kw, cfg=cfg, ratios=ratios)
        return sr.StudySummary("s", [1], [], Path("/nonexistent"), {}, None, "", 0.0)

    monkeypatch.setattr(st, "run_study", fake_run_study)
    main(["study", "subsampling", str(DEMO), "train.log_every=7", "--ratios", "1,0.1", "--sampling", "uniform,mixed"])
    assert seen["variants"] == [("uniform", {"loss.classifier.sampling": "uniform"}),
                                ("mixed", {"loss.classifier.sampling": "mixed"})]  # fmt: skip
    assert seen["full_once"] and seen["cfg"].loss.classifier.probe_every == 7
    assert "grad cos" in [m.name for m in seen["measures"]]
    main(["study", "subsampling", str(DEMO), "--ratios", "1,0.1", "--probe-every", "3"])
    assert seen["variants"] is None and seen["cfg"].loss.classifier.probe_every == 3
    # without --sampling or --probe-every the probe is on all the same, for the full-softmax loss alone
    main(["study", "subsampling", str(DEMO), "train.log_every=5", "--ratios", "1,0.1", "--ui-url", "http://ui:8080"])
    names = [m.name for m in seen["measures"]]
    assert seen["cfg"].loss.classifier.probe_every == 5 and "full-softmax loss" in names and "grad cos" not in names
    assert seen["ui_url"] == "http://ui:8080"
    capsys.readouterr()
