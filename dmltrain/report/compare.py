"""Comparing the collected runs: the params that differ, the metric columns and their best values,
the curves, the tables of the pages and the CSV."""

from __future__ import annotations

import re
import time
from pathlib import Path

from dmltrain.fileio import write_text
from dmltrain.report.runs import INITIAL_RECALL1_KEYS, LOSS_KEY, RECALL1_KEYS, RunRecord, first_key, natural_key
from dmltrain.text import MISSING, clip, csv_text, format_duration
from dmltrain.tracking.names import BINARY_PREFIX, EVAL_PREFIX, IMAGES_PER_S, LOSS, STEP_MS, display_key
from dmltrain.tracking.queries import best_point

IGNORED_PARAMS = frozenset({"train.run_name"})  # differs between any two runs; the run column names it
SPEED_KEYS = (IMAGES_PER_S, STEP_MS)
LOWER_IS_BETTER = (LOSS, STEP_MS)
# evaluation bookkeeping logged beside the metrics (query and gallery counts), not compared
EVAL_COUNTS = re.compile(r"(^|/)(num_\w+|\w+_size|excluded_\w+|\w+_count)$")


def differing_params(records: list[RunRecord]) -> list[str]:
    """Param keys whose values are not the same in every run (a missing param counts as a value)."""
    keys = sorted({k for r in records for k in r.params} - IGNORED_PARAMS, key=natural_key)
    return [k for k in keys if len({r.params.get(k) for r in records}) > 1]


def metric_columns(records: list[RunRecord], everything: bool = False) -> list[str]:
    """Final-metric columns: evaluation metrics (Recall@K in K order), the untrained Recall@1, loss and speed.

    Of the binarized-embedding metrics only Recall@1 is shown unless ``everything`` (the CSV has them all).
    """
    binary = "/" + BINARY_PREFIX
    keys = {k for r in records for k in r.metrics if not EVAL_COUNTS.search(k)}
    if not everything:
        keys = {k for k in keys if binary not in k or display_key(k).endswith(binary + "recall@1")}

    def order(k: str):
        p = display_key(k)
        kind = 0 if "/recall@" in p and binary not in p else 1 if binary not in p else 2
        return (kind, natural_key(p))

    cols = sorted((k for k in keys if k.startswith(EVAL_PREFIX)), key=order)
    cols += [k for k in (first_key(keys, INITIAL_RECALL1_KEYS), LOSS_KEY, *SPEED_KEYS) if k and k in keys]
    return cols


def best_recall(rec: RunRecord) -> tuple[float, int] | None:
    key = first_key(rec.history, RECALL1_KEYS)
    best = best_point(rec.history[key]) if key else None
    if best is None:
        return None
    step, value = best
    return value, step


def curves(records: list[RunRecord], which: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per run, ``(steps, values)`` of ``loss`` or of Recall@1 (starting from the untrained model's at step 0)."""
    out = {}
    for rec in records:
        if which == "loss":
            points = rec.history.get(LOSS_KEY, [])
        else:
            key = first_key(rec.history, RECALL1_KEYS)
            points = list(rec.history.get(key, [])) if key else []
            init = first_key(rec.history, INITIAL_RECALL1_KEYS)
            if init and rec.history[init] and points:
                points = sorted(rec.history[init][:1] + points)
        if points:
            out[rec.name] = ([s for s, _ in points], [v for _, v in points])
    return out


def _fmt_value(v: float | None, key: str = "") -> str:
    if v is None:
        return "—"
    if key in SPEED_KEYS:
        return f"{v:,.1f}"
    if abs(v) >= 1000 or (v != 0 and abs(v) < 1e-3):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:.4f}"


def _clip(text: str | None, n: int = 60) -> str:
    return MISSING if text is None else clip(text, n)


def best_rows(records: list[RunRecord], cols: list[str]) -> dict[str, set[int]]:
    """Row indices holding the best value of each metric column (ties all bold; single-run columns none)."""
    best: dict[str, set[int]] = {}
    for c in cols:
        vals = [(i, r.metrics[c]) for i, r in enumerate(records) if c in r.metrics]
        if len(vals) < 2:
            continue
        pick = min if c in LOWER_IS_BETTER else max
        target = pick(v for _, v in vals)
        best[c] = {i for i, v in vals if v == target}
    return best


def tables(records: list[RunRecord]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    params = differing_params(records)
    run_head = ["run", "status", "started", "duration", *params]
    run_rows = []
    for r in records:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.start_time / 1000)) if r.start_time else "—"
        run_rows.append(
            [r.name, r.status, started, format_duration(r.duration_s), *(_clip(r.params.get(p)) for p in params)]
        )
    cols = metric_columns(records)
    met_head = ["run", *(display_key(c) for c in cols), "best recall@1 (step)"]
    met_rows = []
    for r in records:
        b = best_recall(r)
        met_rows.append(
            [r.name, *(_fmt_value(r.metrics.get(c), c) for c in cols), f"{b[0]:.4f} ({b[1]})" if b else "—"]
        )
    return run_head, run_rows, met_head, met_rows


def write_csv(path: Path, records: list[RunRecord]) -> None:
    params = differing_params(records)
    cols = metric_columns(records, everything=True)
    head = ["run", "run_id", "status", "duration_s", *params, *(display_key(c) for c in cols)]
    rows = [
        [
            r.name,
            r.run_id,
            r.status,
            None if r.duration_s is None else f"{r.duration_s:.1f}",
            *(r.params.get(p) for p in params),
            *(float(r.metrics[c]) if c in r.metrics else None for c in cols),
        ]
        for r in records
    ]
    write_text(path, csv_text(head, rows))
