"""Comparing the collected runs: the params that differ, the metric columns, which runs can be compared
on each, the curves, the tables of the pages and the CSV.

**Columns.** Final evaluation metrics (Recall@K in K order, then the others; of the binary ones only
Recall@1 unless ``everything``), the untrained model's Recall@1 (the step-0 point of the same series),
the last loss, and speed read as :func:`~dmltrain.tracking.queries.steady_state` (the median of the
logged windows after the first), the aggregation the study reads too.

**Best.** A value is marked best only among the runs it can be compared with (:data:`COMPARABLE`):
evaluation metrics among runs evaluated on the same data, the loss among runs with the same losses
and batches (a loss over half the classes is not comparable with one over all of them), speed among
runs on the same cluster, model and batch. A column compares within each such group of two runs or
more.

**Orientation.** With at most :data:`RUNS_AS_COLUMNS` runs the tables put the runs in columns and
the params or metrics in rows, so that they fit a page; with more, runs are rows.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dmltrain.fileio import write_text
from dmltrain.report.runs import FULL_LOSS_KEY, LOSS_KEY, RECALL1_KEY, RunRecord, natural_key
from dmltrain.studies.results import chance_levels
from dmltrain.text import MISSING, clip, csv_text, format_duration
from dmltrain.tracking.names import BINARY_PREFIX, EVAL_PREFIX, IMAGES_PER_S, STEP_MS, eval_key, eval_name
from dmltrain.tracking.queries import STEADY_STATE, best_point, steady_state

IGNORED_PARAMS = frozenset({"train.run_name", "train.output_dir", "cluster.storage_path"})  # differ between any runs
RUNS_AS_COLUMNS = 6
# evaluation bookkeeping that older runs logged as metrics (query and gallery counts): not compared
EVAL_COUNTS = re.compile(r"(^|/)(num_\w+|\w+_size|excluded_\w+|\w+_count|unreadable_\w+)$")
# a column kind -> the params (or param prefixes, ending in ".") runs must share for their values to be compared
COMPARABLE = {
    "eval": (
        "data.shards",
        "data.synthetic.",
        "data.eval_splits",
        "data.eval_resize",
        "data.eval_crop",
        "data.augment.grayscale",
    ),
    "loss": (
        "loss.",
        "data.shards",
        "data.synthetic.",
        "data.batch_size",
        "data.samples_per_class",
        "data.classes_per_batch",
        "data.sampler",
    ),
    "speed": (
        "cluster.",
        "model.",
        "data.batch_size",
        "data.image_size",
        "data.loader_workers",
        "data.decode",
        "train.precision",
        "train.zero_stage",
    ),
}
STUDY_NOTE = (
    "No value is bold: these are a study's runs, whose differences the study's table above weighs against the "
    "spread of its seeds."
)
COMPARABLE_NOTE = (
    "Bold: the best value among the runs it can be compared with: evaluation metrics among runs evaluated on the "
    "same data, the loss among runs with the same losses and batches, speed among runs on the same cluster, model "
    f"and batch. Speed is the {STEADY_STATE}; loss is the last logged value."
)


@dataclass(frozen=True)
class Column:
    """A metric column: its header, how a run's value is read, which runs it compares, which way is better."""

    header: str
    kind: str  # a COMPARABLE key
    better: str  # max or min
    value: Callable[[RunRecord], float | None]
    speed: bool = False  # formatted as a rate (1,234.5)


def differing_params(records: list[RunRecord]) -> list[str]:
    """Param keys whose values are not the same in every run (a missing param counts as a value)."""
    keys = sorted({k for r in records for k in r.params} - IGNORED_PARAMS, key=natural_key)
    return [k for k in keys if len({r.params.get(k) for r in records}) > 1]


def untrained_recall(rec: RunRecord) -> float | None:
    """The untrained model's Recall@1: the step-0 point of the evaluation series (None when not evaluated)."""
    return rec.at_step(RECALL1_KEY, 0)


def _metric(key: str) -> Callable[[RunRecord], float | None]:
    return lambda r: r.metrics.get(key)


def _steady(key: str) -> Callable[[RunRecord], float | None]:
    def read(r: RunRecord) -> float | None:
        value = steady_state(v for _, v in r.history.get(key, []))
        return value if value == value else None

    return read


def metric_columns(records: list[RunRecord], everything: bool = False) -> list[Column]:
    """The metric columns that some run has values for (see the module doc)."""
    keys = {k for r in records for k in r.metrics if k.startswith(EVAL_PREFIX) and not EVAL_COUNTS.search(k)}

    def order(k: str):
        name = eval_name(k) or k
        kind = 2 if name.startswith(BINARY_PREFIX) else 0 if name.startswith("recall@") else 1
        return (kind, natural_key(name))

    if not everything:
        keys = {k for k in keys if not (eval_name(k) or "").startswith(BINARY_PREFIX) or eval_name(k).endswith("@1")}
    cols = [Column(eval_name(k), "eval", "max", _metric(k)) for k in sorted(keys, key=order)]
    if any(untrained_recall(r) is not None for r in records):
        cols.append(Column("untrained recall@1", "eval", "max", untrained_recall))
    if any(LOSS_KEY in r.metrics for r in records):
        # the objective is a softmax over the drawn classes: lower the fewer are drawn, so say so where ratios differ
        differ = len({_ratio(r.params.get("loss.classifier.sample_ratio", "1")) for r in records}) > 1
        cols.append(
            Column("loss (last, drawn classes only)" if differ else "loss (last)", "loss", "min", _metric(LOSS_KEY))
        )
    if any(FULL_LOSS_KEY in r.metrics for r in records):
        cols.append(Column("full-softmax loss (last)", "loss", "min", _metric(FULL_LOSS_KEY)))
    for key, header, better in ((IMAGES_PER_S, "images/s", "max"), (STEP_MS, "step ms", "min")):
        if any(r.history.get(key) for r in records):
            cols.append(Column(header, "speed", better, _steady(key), speed=True))
    return cols


def comparable_groups(records: list[RunRecord], kind: str) -> list[list[int]]:
    """Indices of runs that can be compared on a column of ``kind`` (:data:`COMPARABLE`), group by group."""
    keys = sorted(
        {
            k
            for r in records
            for k in r.params
            if any(k == p or (p.endswith(".") and k.startswith(p)) for p in COMPARABLE[kind])
        }
    )
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(tuple(r.params.get(k) for k in keys), []).append(i)
    return list(groups.values())


def best_cells(records: list[RunRecord], cols: list[Column]) -> dict[int, set[int]]:
    """Column index -> the runs holding its best value within their comparable group (ties all marked;
    groups of one run and columns without two values in a group mark nothing)."""
    best: dict[int, set[int]] = {}
    for j, col in enumerate(cols):
        for group in comparable_groups(records, col.kind):
            vals = [(i, col.value(records[i])) for i in group]
            vals = [(i, v) for i, v in vals if v is not None and v == v]
            if len(vals) < 2:
                continue
            target = (max if col.better == "max" else min)(v for _, v in vals)
            best.setdefault(j, set()).update(i for i, v in vals if v == target)
    return best


def best_recall(rec: RunRecord) -> tuple[float, int] | None:
    """The best Recall@1 of the run's evaluations after training started (step > 0) and its step."""
    best = best_point((s, v) for s, v in rec.history.get(RECALL1_KEY, []) if s > 0)
    if best is None:
        return None
    step, value = best
    return value, step


def loss_figure(records: list[RunRecord]) -> tuple[str, str]:
    """Which loss the report's loss figure overlays and its title: the probe's full-softmax loss when every run
    with a loss logged it (the same loss at every sample ratio; drawn from 0, with its chance levels
    :func:`loss_levels`, so that a change of 0.01 on 6.2 does not fill the figure), else the objective, said
    not comparable across the runs' sample ratios when they differ (a softmax over fewer classes has a lower
    loss)."""
    with_loss = [r for r in records if r.history.get(LOSS_KEY)]
    if with_loss and all(len(r.history.get(FULL_LOSS_KEY, [])) > 1 for r in with_loss):
        return "full_loss", "Full-softmax loss on the training batch (the probe: the same loss at every sample ratio)"
    ratios = {_ratio(r.params.get("loss.classifier.sample_ratio", "1")) for r in with_loss}
    title = "Training loss (the objective, per log window)"
    if len(ratios) > 1:
        title += "\nnot comparable across sample ratios: each is a softmax over the drawn classes only"
    return "loss", title


def loss_levels(records: list[RunRecord]) -> dict[str, float]:
    """The chance levels (ln C) of the full-softmax loss figure: one per class count of the runs, when every run
    with the loss says its count (``data.synthetic.classes``); none otherwise."""
    counts = {r.params.get("data.synthetic.classes") for r in records if r.history.get(FULL_LOSS_KEY)}
    try:
        return chance_levels(sorted(int(c) for c in counts)) if counts and None not in counts else {}
    except ValueError:
        return {}


def _ratio(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def curves(records: list[RunRecord], which: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per run, ``(steps, values)`` of the loss (``loss``), the probe's full-softmax loss (``full_loss``) or
    of Recall@1 (from the untrained model's at step 0, when evaluated)."""
    key = {"loss": LOSS_KEY, "full_loss": FULL_LOSS_KEY}.get(which, RECALL1_KEY)
    out = {}
    for rec in records:
        points = rec.history.get(key, [])
        if points:
            out[rec.name] = ([s for s, _ in points], [v for _, v in points])
    return out


def format_value(v: float | None, speed: bool = False) -> str:
    if v is None or v != v:
        return MISSING
    if speed:
        return f"{v:,.1f}"
    if abs(v) >= 1000 or (v != 0 and abs(v) < 1e-3):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:.4f}"


@dataclass
class Table:
    """A table of the pages: ``head`` and ``rows`` of text cells; ``bold`` cells (row, column);
    ``links``: a cell's link target (row, column), row -1 for the header."""

    head: list[str]
    rows: list[list[str]]
    bold: set[tuple[int, int]] = field(default_factory=set)
    links: dict[tuple[int, int], str] = field(default_factory=dict)
    titles: dict[tuple[int, int], str] = field(default_factory=dict)  # a clipped cell's full text


def _orient(
    records: list[RunRecord],
    labels: list[str],
    cells: list[list[str]],
    run_links: list[str],
    bold: set[tuple[int, int]],
    corner: str,
    titles: dict[tuple[int, int], str] | None = None,
) -> Table:
    """``cells[i][j]``: run ``i``'s value of ``labels[j]``; runs as columns when they are few, else as rows."""
    titles = titles or {}
    if len(records) <= RUNS_AS_COLUMNS:
        head = [corner, *(r.name for r in records)]
        rows = [[label, *(cells[i][j] for i in range(len(records)))] for j, label in enumerate(labels)]
        return Table(
            head,
            rows,
            {(j, i + 1) for i, j in bold},
            {(-1, i + 1): link for i, link in enumerate(run_links)},
            {(j, i + 1): t for (i, j), t in titles.items()},
        )
    head = ["run", *labels]
    rows = [[r.name, *cells[i]] for i, r in enumerate(records)]
    return Table(
        head,
        rows,
        {(i, j + 1) for i, j in bold},
        {(i, 0): link for i, link in enumerate(run_links)},
        {(i, j + 1): t for (i, j), t in titles.items()},
    )


def runs_table(records: list[RunRecord], run_links: list[str]) -> Table:
    """Status, start, duration and the params that differ, per run."""
    params = differing_params(records)
    labels = ["status", "started", "duration", *params]
    cells, titles = [], {}
    for i, r in enumerate(records):
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.start_time / 1000)) if r.start_time else MISSING
        values = [r.params.get(p) for p in params]
        cells.append(
            [r.status, started, format_duration(r.duration_s), *(clip(v, 60) if v else MISSING for v in values)]
        )
        titles.update({(i, 3 + j): v for j, v in enumerate(values) if v and len(v) > 60})
    return _orient(records, labels, cells, run_links, set(), "", titles)


def metrics_table(records: list[RunRecord], run_links: list[str], mark_best: bool = True) -> Table:
    """The metric columns, the best Recall@1 with its step, the best values marked (:func:`best_cells`) unless
    ``mark_best`` is false (a study's runs, whose differences its own table weighs against their spread)."""
    cols = metric_columns(records)
    cells = []
    for r in records:
        b = best_recall(r)
        cells.append([*(format_value(c.value(r), c.speed) for c in cols), f"{b[0]:.4f} ({b[1]})" if b else MISSING])
    bold = {(i, j) for j, rows in best_cells(records, cols).items() for i in rows} if mark_best else set()
    return _orient(records, [c.header for c in cols] + ["best recall@1 (step)"], cells, run_links, bold, "metric")


def evaluations_table(rec: RunRecord) -> Table:
    """One run's evaluations, step by step (step 0: the untrained model): the columns of
    :func:`metric_columns` that are evaluation metrics (Recall@K first, binary Recall@1 only)."""
    cols = [c for c in metric_columns([rec]) if c.kind == "eval" and c.header != "untrained recall@1"]
    keys = [eval_key(c.header) for c in cols]
    steps = sorted({s for k in keys for s, _ in rec.history.get(k, [])})
    rows = [
        [str(s) + (" (untrained)" if s == 0 else ""), *(format_value(rec.at_step(k, s)) for k in keys)] for s in steps
    ]
    return Table(["step", *(c.header for c in cols)], rows)


def write_csv(path: Path, records: list[RunRecord]) -> None:
    params = differing_params(records)
    cols = metric_columns(records, everything=True)
    head = ["run", "run_id", "status", "duration_s", *params, *(c.header for c in cols)]
    rows = [
        [
            r.name,
            r.run_id,
            r.status,
            None if r.duration_s is None else f"{r.duration_s:.1f}",
            *(r.params.get(p) for p in params),
            *(c.value(r) for c in cols),
        ]
        for r in records
    ]
    write_text(path, csv_text(head, rows))
