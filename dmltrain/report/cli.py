"""``dmltrain report``: collect the runs, compare them, write every file of the report."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from mlflow import MlflowClient

from dmltrain.errors import UserError
from dmltrain.evaluate.plots import plot_curves, run_colors
from dmltrain.fileio import write_text
from dmltrain.report.compare import curves, loss_figure, loss_levels, metrics_table, write_csv
from dmltrain.report.pages import Links, heading, render_html, render_markdown
from dmltrain.report.runs import RunRecord, collect, get_experiment, named_run, resolve_tracking_uri, select_runs
from dmltrain.report.study import StudySection, study_parents, study_section
from dmltrain.text import markdown_table, printable, safe_name
from dmltrain.tracking.links import DEFAULT_UI


@dataclass
class Report:
    experiment: str
    experiment_id: str
    records: list[RunRecord]
    markdown: Path
    html: Path
    figures: dict[str, Path]
    csv: Path
    studies: list[StudySection] = field(default_factory=list)
    links: Links | None = None


def build_report(
    experiment: str,
    runs: list[str] | None = None,
    out: str | os.PathLike[str] | None = None,
    tracking_uri: str | None = None,
    ui_url: str = DEFAULT_UI,
    max_runs: int = 100,
    progress: bool = True,
) -> Report:
    """Collect the runs and write every file of the report; raises :class:`UserError` on unknown input."""
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    exp = get_experiment(client, experiment, uri)
    chosen = select_runs(client, exp, runs, max_runs=max_runs)
    out_dir = Path(out) if out else Path("reports") / safe_name(experiment, "experiment")  # inside reports/
    out_dir.mkdir(parents=True, exist_ok=True)
    records = collect(client, chosen, out_dir, progress=progress)
    colors = run_colors([r.name for r in records])
    figures = {}
    which, loss_title = loss_figure(records)
    loss, recall = curves(records, which), curves(records, "recall")
    if any(len(steps) > 1 for steps, _ in loss.values()):
        full = which == "full_loss"
        ylabel = "full-softmax loss" if full else "loss"
        levels = loss_levels(records) if full else None
        p = plot_curves(loss, out_dir / "loss.png", ylabel, loss_title, colors, zero=full, levels=levels)
        if p is not None:
            figures["loss"] = p
    if any(len(steps) > 1 for steps, _ in recall.values()):  # one evaluation is a value, not a curve
        untrained = any(steps[0] == 0 for steps, _ in recall.values())
        title = "Recall@1 over training" + (" (step 0: the untrained model)" if untrained else "")
        p = plot_curves(recall, out_dir / "recall_at_1.png", "Recall@1", title, colors)
        if p is not None:
            figures["recall_at_1"] = p
    links = Links(ui_url, exp.experiment_id, records)
    # a study parent among the runs asked for: its points' table, verdicts and files before the runs'
    parents = study_parents([named_run(client, exp, t) for t in runs]) if runs else []
    studies = [s for p in parents if (s := study_section(client, p, records, out_dir, ui_url)) is not None]
    md, page, table = out_dir / "report.md", out_dir / "report.html", out_dir / "runs.csv"
    write_text(md, render_markdown(exp.name, records, figures, out_dir, links, uri, studies) + "\n")
    write_text(page, render_html(exp.name, records, figures, out_dir, links, uri, studies))
    write_csv(table, records)
    return Report(exp.name, exp.experiment_id, records, md, page, figures, table, studies, links)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (tracking.experiment of the runs)")
    parser.add_argument(
        "--runs", help="comma-separated run ids or run names (default: every run); a parent run stands for its children"
    )
    parser.add_argument("--out", help="output directory (default reports/<experiment>)")
    parser.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db)"
    )
    parser.add_argument("--ui-url", default=DEFAULT_UI, help=f"MLflow UI base URL for the links (default {DEFAULT_UI})")
    parser.add_argument(
        "--max-runs", type=int, default=100, help="compare at most the N most recent runs (default 100)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    tokens = [t.strip() for t in (args.runs or "").split(",") if t.strip()] or None
    if args.max_runs < 1:
        raise UserError(f"--max-runs {args.max_runs}: must be at least 1")
    rep = build_report(
        args.experiment, tokens, args.out, args.tracking_uri, args.ui_url, args.max_runs, progress=not args.no_progress
    )
    for study in rep.studies:  # the study's answer first: per point, not per run
        print(f"study {printable(study.name)}:")
        print(markdown_table(study.head, study.rows))
        print("\n".join(f"  {line}" for line in study.verdicts) + "\n" if study.verdicts else "")
    table = metrics_table(rep.records, [""] * len(rep.records))
    print(markdown_table(table.head, table.rows))
    print(f"\nreport of {printable(heading(rep.records, rep.studies))} from experiment {printable(rep.experiment)}:")
    print(f"  {rep.markdown}\n  {rep.html}\n  {rep.csv}")
    if rep.links is not None:
        print(f"MLflow experiment: {rep.links.experiment()}")
        for study in rep.studies:
            print(f"MLflow study parent run {printable(study.name)}: {study.url}")
    return 0
