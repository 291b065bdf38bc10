"""What a subsampling study produces: its points, the table and the plots (``dmltrain study``'s outputs).

:class:`Point` is one (ratio, class count) training with its measurements; :class:`StudySummary`
the whole study. :func:`write_outputs` writes ``study.md``, ``study.csv`` and the plots
(``recall_vs_ratio.png``, ``cost_vs_ratio.png``, ``vs_classes.png`` with two class counts or more)
atomically; :func:`render` is the text the command prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.evaluate.plots import Panel, plot_panels
from dmltrain.fileio import write_text
from dmltrain.redact import redact_url
from dmltrain.text import csv_text, finite_number, markdown_table
from dmltrain.tracking.names import ACTIVE_CLASSES, ACTIVE_ROWS, CLASSIFIER_MB, IMAGES_PER_S, RSS_MB, STEP_MS

STAT_KEYS = {  # column -> (MLflow metric, how its history is summarised)
    "images/s": (IMAGES_PER_S, "median"),
    "step ms": (STEP_MS, "median"),
    "classifier MB": (CLASSIFIER_MB, "max"),
    "RSS MB": (RSS_MB, "max"),
    "active rows": (ACTIVE_ROWS, "mean"),
    "active classes": (ACTIVE_CLASSES, "mean"),
}


@dataclass
class Point:
    ratio: float
    classes: int
    shards: str
    run_name: str
    status: str = "pending"  # finished, failed
    recalls: dict[int, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    final: dict[str, float] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    storage_dir: str | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def label(self) -> str:
        return f"ratio {self.ratio:g}, {self.classes} classes"


@dataclass
class StudySummary:
    name: str
    ks: list[int]
    points: list[Point]
    out_dir: Path
    files: dict[str, Path]
    parent_run_id: str | None
    tracking_uri: str
    seconds: float

    @property
    def ok(self) -> bool:
        return all(p.status == "finished" for p in self.points)


def table(summary: StudySummary) -> tuple[list[str], list[list[Any]]]:
    head = ["ratio", "classes", "status", *(f"recall@{k}" for k in summary.ks), *STAT_KEYS, "run"]
    rows = []
    for p in summary.points:
        rows.append(
            [
                p.ratio,
                p.classes,
                p.status,
                *(p.recalls.get(k) for k in summary.ks),
                *(p.stats.get(c) for c in STAT_KEYS),
                p.run_name,
            ]
        )
    return head, rows


# -- plots ------------------------------------------------------------------------------------------------
def plot_recall_vs_ratio(summary: StudySummary, path: Path) -> Path | None:
    """Recall@K against the class sampling ratio, one panel per class count (NormSoftmax Fig. 4); None when no point has one."""
    counts = sorted({p.classes for p in summary.points})
    done = [p for p in summary.points if p.recalls]
    if not done:
        return None
    panels = []
    for n in counts:
        pts = sorted((p for p in done if p.classes == n), key=lambda p: p.ratio)
        lines = {
            f"R@{k}": _xy([(p.ratio, 100 * p.recalls[k]) for p in pts if finite_number(p.recalls.get(k))])
            for k in summary.ks
        }
        panels.append(Panel("Recall@K (%)", lines, [p.ratio for p in pts], title=f"{n} classes"))
    return plot_panels(
        panels,
        path,
        xlabel="class sampling ratio",
        title="Recall@K against the share of classes in each softmax",
        cols=len(counts),
        panel_size=(4.5, 3.6),
    )


COST_PANELS = (
    ("images/s", "images/s"),
    ("step ms", "step time (ms)"),
    ("classifier MB", "classifier memory (MB, rank 0)"),
    ("active rows", "active rows per worker"),
)


def _xy(points: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def _column(p: Point, col: str) -> float:
    return 100 * p.recalls.get(1, float("nan")) if col == "recall@1" else p.stats.get(col, float("nan"))


def plot_columns(
    summary: StudySummary,
    columns,
    path: Path,
    x_of: Callable[[Point], float],
    group_of: Callable[[Point], Any],
    xlabel: str,
    group_label: Callable[[Any], str],
    title: str,
) -> Path | None:
    """One panel per (column, label) of ``columns`` against ``x_of(point)``, a line per ``group_of(point)``; None when no point finished."""
    done = [p for p in summary.points if p.status == "finished"]
    if not done:
        return None
    groups = sorted({group_of(p) for p in done}, reverse=True)
    panels = []
    for col, ylabel in columns:
        lines = {}
        for g in groups:
            pts = sorted((p for p in done if group_of(p) == g), key=x_of)
            lines[group_label(g)] = _xy([(x_of(p), _column(p, col)) for p in pts if finite_number(_column(p, col))])
        panels.append(Panel(ylabel, lines, [x_of(p) for p in done]))
    return plot_panels(
        panels, path, xlabel=xlabel, title=title, cols=2 if len(columns) <= 4 else 3, panel_size=(4.8, 3.4)
    )


def write_outputs(summary: StudySummary) -> dict[str, Path]:
    """study.md, study.csv and the plots under ``summary.out_dir`` (each written atomically)."""
    out = summary.out_dir
    out.mkdir(parents=True, exist_ok=True)
    head, rows = table(summary)
    files = {"study.md": out / "study.md", "study.csv": out / "study.csv"}
    write_text(files["study.md"], f"# Class-subsampling study {summary.name}\n\n" + markdown_table(head, rows) + "\n")
    write_text(files["study.csv"], csv_text(head, rows))
    plots = {
        "recall_vs_ratio.png": lambda path: plot_recall_vs_ratio(summary, path),
        "cost_vs_ratio.png": lambda path: plot_columns(
            summary,
            COST_PANELS,
            path,
            lambda q: q.ratio,
            lambda q: q.classes,
            "class sampling ratio",
            lambda g: f"{g} classes",
            "Cost against the share of classes in each softmax",
        ),
    }
    if len({p.classes for p in summary.points}) > 1:
        plots["vs_classes.png"] = lambda path: plot_columns(
            summary,
            (("recall@1", "Recall@1 (%)"), *COST_PANELS),
            path,
            lambda q: q.classes,
            lambda q: q.ratio,
            "number of classes",
            lambda g: f"ratio {g:g}",
            "Accuracy and cost against the number of classes",
        )
    for fname, draw in plots.items():
        if draw(out / fname) is not None:
            files[fname] = out / fname
    return files


def render(summary: StudySummary) -> str:
    head, rows = table(summary)
    lines = [markdown_table(head, rows), ""]
    for p in summary.points:
        if p.error:
            lines.append(f"{p.run_name} failed: {p.error}")
    lines.append(
        f"study {summary.name}: {sum(p.status == 'finished' for p in summary.points)}/{len(summary.points)} points "
        f"finished in {summary.seconds:.0f}s"
    )
    lines.append("files: " + ", ".join(str(p) for p in summary.files.values()))
    if summary.parent_run_id:
        lines.append(f"MLflow parent run: {summary.parent_run_id}")
    return redact_url("\n".join(lines))
