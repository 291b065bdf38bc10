"""``dmltrain report``: compare MLflow runs in one Markdown and one HTML page.

``dmltrain report --experiment NAME [--runs ID,...] [--out DIR]`` collects the runs of an
experiment (all of them, or the ids / run names given; a parent run, such as a Tune search or
a study, stands for its children) and writes to ``DIR`` (default ``reports/<experiment>``):

* ``report.md`` and ``report.html``: a table of the runs with the params that differ between
  them, a table of final metrics (best value of each column in bold), the loss and Recall@1
  curves of all runs overlaid, each run's own plots (latest of each kind shown, all linked),
  and links back to the MLflow UI (each run, the experiment, the run comparison view);
* ``loss.png``, ``recall_at_1.png``: the overlaid curves;
* ``runs.csv``: both tables as one CSV;
* ``runs/<run>/plots/``: each run's plot artifacts.

The HTML page embeds its images, so it can be mailed or attached on its own. Every file is
written atomically. MLflow does not allow ``@`` in metric keys, so ``eval/recall@1`` is stored
as ``eval/recall_at_1`` (:func:`dmltrain.tracking.names.metric_key`); the report shows ``recall@1`` again.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from mlflow import MlflowClient
from tqdm import tqdm

from dmltrain.errors import UserError
from dmltrain.evaluate.plots import plot_curves, run_colors
from dmltrain.fileio import write_text
from dmltrain.text import MISSING, clip, csv_text, format_duration, markdown_table, safe_name
from dmltrain.tracking.names import (
    BINARY_PREFIX,
    EVAL_PREFIX,
    IMAGES_PER_S,
    LOSS,
    RUN_NAME_TAG,
    STEP_MS,
    STORAGE_DIR_TAG,
    display_key,
    eval_key,
    initial_key,
)
from dmltrain.tracking.queries import best_point, child_runs, experiment_runs, find_run, history, leaf_runs

DEFAULT_UI = "http://127.0.0.1:5000"
IGNORED_PARAMS = frozenset({"train.run_name"})  # differs between any two runs; the run column names it
LOSS_KEY = LOSS
RECALL1_KEYS = (eval_key("recall@1"),)
INITIAL_RECALL1_KEYS = (initial_key("recall@1"),)
SPEED_KEYS = (IMAGES_PER_S, STEP_MS)
LOWER_IS_BETTER = (LOSS, STEP_MS)
# evaluation bookkeeping logged beside the metrics (query and gallery counts), not compared
EVAL_COUNTS = re.compile(r"(^|/)(num_\w+|\w+_size|excluded_\w+|\w+_count)$")


# -- what is collected --------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    """One compared run: identity, params, final metrics, the curves and its downloaded plots."""

    run_id: str
    name: str
    experiment_id: str
    status: str
    start_time: int | None
    end_time: int | None
    params: dict[str, str]
    metrics: dict[str, float]
    tags: dict[str, str]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    plots: list[Path] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float | None:
        return (self.end_time - self.start_time) / 1000 if self.start_time and self.end_time else None


@dataclass
class Report:
    experiment: str
    experiment_id: str
    records: list[RunRecord]
    markdown: Path
    html: Path
    figures: dict[str, Path]
    csv: Path


def _first_key(keys, candidates) -> str | None:
    return next((k for k in candidates if k in keys), None)


def _natural(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


# -- MLflow ----------------------------------------------------------------------------------------------------
def resolve_tracking_uri(uri: str | None) -> str:
    """``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``mlflow.db`` in the current directory (as ``dmltrain train``)."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
            raise UserError(f"--tracking-uri {uri}: no such SQLite file")
        return uri
    db = Path.cwd() / "mlflow.db"
    if not db.is_file():
        raise UserError(f"no MLflow store at {db}; pass --tracking-uri (an MLflow server URL or sqlite:///PATH)")
    return "sqlite:///" + str(db.resolve())


def _get_experiment(client, name: str, uri: str):
    try:
        exp = client.get_experiment_by_name(name)
    except Exception as e:  # noqa: BLE001 — a server that cannot be reached is the user's to fix
        raise UserError(f"--tracking-uri {uri}: cannot read MLflow ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                        exit_code=1) from None
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        known = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
        raise UserError(f"--experiment {name}: no such experiment in {uri} (experiments: {known or 'none'})", exit_code=1)
    return exp


def _find_run(client, exp, token: str):
    run = find_run(client, exp.experiment_id, token)
    if run is None:
        raise UserError(f"--runs {token}: no run with this id or name in experiment {exp.name}", exit_code=1)
    return run


def select_runs(client, exp, tokens: list[str] | None = None, max_runs: int = 100) -> list:
    """The runs to compare, oldest first: the given ones (or all of the experiment), parents replaced by their children."""
    if tokens:
        chosen = [_find_run(client, exp, t) for t in tokens]
        out, seen = [], set()
        while chosen:
            run = chosen.pop(0)
            if run.info.run_id in seen:
                continue
            seen.add(run.info.run_id)
            kids = child_runs(client, exp.experiment_id, run.info.run_id)
            if kids:
                chosen = kids + chosen
            else:
                out.append(run)
        runs = out
    else:
        runs = leaf_runs(experiment_runs(client, exp.experiment_id))
    if not runs:
        raise UserError(f"--experiment {exp.name}: no runs to compare", exit_code=1)
    if len(runs) > max_runs:
        print(f"dmltrain: warning: {len(runs)} runs; the report shows the {max_runs} most recent (--max-runs)", file=sys.stderr)
        runs = runs[-max_runs:]
    return runs


def _display_names(runs) -> list[str]:
    names = [r.data.tags.get(RUN_NAME_TAG) or r.info.run_name or r.info.run_id[:8] for r in runs]
    counts = {n: names.count(n) for n in names}
    return [f"{n} ({r.info.run_id[:6]})" if counts[n] > 1 else n for n, r in zip(names, runs)]


def collect(client, runs, out_dir: Path, progress: bool = True) -> list[RunRecord]:
    """Params, final metrics, loss / Recall@1 histories and plot artifacts (downloaded under ``out_dir/runs``)."""
    records = []
    for run, name in tqdm(list(zip(runs, _display_names(runs))), desc="runs", unit="run", file=sys.stderr,
                          disable=not progress, leave=False):
        info, data = run.info, run.data
        rec = RunRecord(info.run_id, name, info.experiment_id, info.status, info.start_time, info.end_time,
                        dict(data.params), dict(data.metrics), dict(data.tags))
        for key in (LOSS_KEY, _first_key(rec.metrics, RECALL1_KEYS), _first_key(rec.metrics, INITIAL_RECALL1_KEYS)):
            if key:
                rec.history[key] = history(client, info.run_id, key)
        try:
            rec.artifacts = [a.path for a in client.list_artifacts(info.run_id)]
            if any(a == "plots" for a in rec.artifacts):
                rec.plots = _download_plots(client, info.run_id, out_dir / "runs" / safe_name(name) / "plots")
        except Exception as e:  # noqa: BLE001 — a missing artifact store costs the plots, not the report
            print(f"dmltrain: warning: run {name}: cannot read its artifacts ({type(e).__name__}: {str(e)[:150]})", file=sys.stderr)
        records.append(rec)
    return records


def _download_plots(client, run_id: str, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    pngs = [a.path for a in client.list_artifacts(run_id, "plots") if a.path.lower().endswith(".png")]
    out = []
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        for rel in pngs:
            local = Path(client.download_artifacts(run_id, rel, tmp))
            target = dest / Path(rel).name
            os.replace(local, target)
            out.append(target)
    return sorted(out, key=lambda p: _natural(p.name))


# -- comparison ---------------------------------------------------------------------------------------------------
def differing_params(records: list[RunRecord]) -> list[str]:
    """Param keys whose values are not the same in every run (a missing param counts as a value)."""
    keys = sorted({k for r in records for k in r.params} - IGNORED_PARAMS, key=_natural)
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
        return (kind, _natural(p))

    cols = sorted((k for k in keys if k.startswith(EVAL_PREFIX)), key=order)
    cols += [k for k in (_first_key(keys, INITIAL_RECALL1_KEYS), LOSS_KEY, *SPEED_KEYS) if k and k in keys]
    return cols


def best_recall(rec: RunRecord) -> tuple[float, int] | None:
    key = _first_key(rec.history, RECALL1_KEYS)
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
            key = _first_key(rec.history, RECALL1_KEYS)
            points = list(rec.history.get(key, [])) if key else []
            init = _first_key(rec.history, INITIAL_RECALL1_KEYS)
            if init and rec.history[init] and points:
                points = sorted(rec.history[init][:1] + points)
        if points:
            out[rec.name] = ([s for s, _ in points], [v for _, v in points])
    return out


# -- rendering -------------------------------------------------------------------------------------------------------
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


def _best_rows(records: list[RunRecord], cols: list[str]) -> dict[str, set[int]]:
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


class _Links:
    def __init__(self, ui: str, exp_id: str, records: list[RunRecord]):
        self.ui = ui.rstrip("/")
        self.exp_id = exp_id
        self.records = records

    def run(self, rec: RunRecord) -> str:
        return f"{self.ui}/#/experiments/{rec.experiment_id}/runs/{rec.run_id}"

    def experiment(self) -> str:
        return f"{self.ui}/#/experiments/{self.exp_id}"

    def compare(self) -> str:
        runs = json.dumps([r.run_id for r in self.records], separators=(",", ":"))
        exps = json.dumps(sorted({r.experiment_id for r in self.records}), separators=(",", ":"))
        return f"{self.ui}/#/compare-runs?runs={quote(runs, safe='[],')}&experiments={quote(exps, safe='[],')}"


def _tables(records: list[RunRecord]) -> tuple[list[str], list[list[str]], list[str], list[list[str]]]:
    params = differing_params(records)
    run_head = ["run", "status", "started", "duration", *params]
    run_rows = []
    for r in records:
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.start_time / 1000)) if r.start_time else "—"
        run_rows.append([r.name, r.status, started, format_duration(r.duration_s), *(_clip(r.params.get(p)) for p in params)])
    cols = metric_columns(records)
    met_head = ["run", *(display_key(c) for c in cols), "best recall@1 (step)"]
    met_rows = []
    for r in records:
        b = best_recall(r)
        met_rows.append([r.name, *(_fmt_value(r.metrics.get(c), c) for c in cols), f"{b[0]:.4f} ({b[1]})" if b else "—"])
    return run_head, run_rows, met_head, met_rows


def _plot_groups(plots: list[Path]) -> dict[str, list[Path]]:
    """Plots grouped by kind (``recall_at_k-step0000010.png`` -> ``recall_at_k``), each group in step order."""
    groups: dict[str, list[Path]] = {}
    for p in plots:
        kind = re.sub(r"[-_]?step\d+$", "", p.stem) or p.stem
        groups.setdefault(kind, []).append(p)
    return groups


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def render_markdown(exp_name: str, records: list[RunRecord], figures: dict[str, Path], out_dir: Path, links: _Links,
                    uri: str) -> str:
    run_head, run_rows, met_head, met_rows = _tables(records)
    cols = metric_columns(records)
    best = _best_rows(records, cols)
    bold = {j + 1: best.get(c, set()) for j, c in enumerate(cols)}
    run_links = [links.run(r) for r in records]
    parts = [f"# Experiment `{exp_name}`: {len(records)} run{'s' * (len(records) != 1)}", "",
             f"Tracking store `{uri}` · [experiment in MLflow]({links.experiment()}) · [compare in MLflow]({links.compare()}) · "
             f"generated {time.strftime('%Y-%m-%d %H:%M')}", "", "## Runs", ""]
    if not differing_params(records):
        parts += ["All runs share the same params." if len(records) > 1 else "One run: no params to compare.", ""]
    parts += [markdown_table(run_head, run_rows, links=run_links), "", "## Final metrics", "",
              markdown_table(met_head, met_rows, bold=bold, links=run_links), ""]
    for key, title in (("loss", "Loss"), ("recall_at_1", "Recall@1")):
        if key in figures:
            parts += [f"## {title}", "", f"![{title}]({figures[key].relative_to(out_dir).as_posix()})", ""]
    parts += ["## Runs' plots", ""]
    for r in records:
        parts += [f"### [{r.name}]({links.run(r)})", ""]
        storage = r.tags.get(STORAGE_DIR_TAG)
        if storage:
            parts += [f"Checkpoints and models: `{storage}`", ""]
        if not r.plots:
            parts += ["No plots logged.", ""]
            continue
        for kind, paths in _plot_groups(r.plots).items():
            latest = paths[-1]
            parts += [f"![{kind}]({latest.relative_to(out_dir).as_posix()})", ""]
            if len(paths) > 1:
                parts += ["All: " + ", ".join(f"[{p.stem}]({p.relative_to(out_dir).as_posix()})" for p in paths), ""]
    return "\n".join(parts)


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px;display:block;overflow-x:auto}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;white-space:nowrap}
th{background:#f4f4f4;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.best{font-weight:bold;background:#eef7ee}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
.plots{display:flex;flex-wrap:wrap;gap:1em}.plots figure{margin:0;max-width:48%}
figcaption{font-size:12px;color:#555}
.meta{color:#555;font-size:13px}
"""


def _html_table(head: list[str], rows: list[list[str]], links: list[str], bold: dict[int, set[int]] | None = None,
                full: list[list[str | None]] | None = None) -> str:
    bold = bold or {}
    esc = html.escape
    out = ["<table><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cells = []
        for j, cell in enumerate(row):
            if j == 0:
                cells.append(f'<td><a href="{esc(links[i])}">{esc(cell)}</a></td>')
                continue
            cls = ["num"] if re.fullmatch(r"[-+0-9.,e ()—]+", cell) else []
            if i in bold.get(j, ()):
                cls.append("best")
            title = full[i][j] if full and full[i][j] and full[i][j] != cell else None
            attrs = (f' class="{" ".join(cls)}"' if cls else "") + (f' title="{esc(title)}"' if title else "")
            cells.append(f"<td{attrs}>{esc(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def render_html(exp_name: str, records: list[RunRecord], figures: dict[str, Path], out_dir: Path, links: _Links, uri: str) -> str:
    esc = html.escape
    run_head, run_rows, met_head, met_rows = _tables(records)
    params = differing_params(records)
    full = [[None, None, None, None, *(r.params.get(p) for p in params)] for r in records]
    cols = metric_columns(records)
    best = _best_rows(records, cols)
    bold = {j + 1: best.get(c, set()) for j, c in enumerate(cols)}
    run_links = [links.run(r) for r in records]
    body = [f"<h1>Experiment <code>{esc(exp_name)}</code>: {len(records)} run{'s' * (len(records) != 1)}</h1>",
            f'<p class="meta">Tracking store <code>{esc(uri)}</code> · <a href="{esc(links.experiment())}">experiment in MLflow</a> · '
            f'<a href="{esc(links.compare())}">compare in MLflow</a> · generated {esc(time.strftime("%Y-%m-%d %H:%M"))}</p>',
            "<h2>Runs</h2>"]
    if not params:
        body.append(f"<p>{'All runs share the same params.' if len(records) > 1 else 'One run: no params to compare.'}</p>")
    body += [_html_table(run_head, run_rows, run_links, full=full), "<h2>Final metrics</h2>",
             _html_table(met_head, met_rows, run_links, bold=bold)]
    for key, title in (("loss", "Loss"), ("recall_at_1", "Recall@1")):
        if key in figures:
            body += [f"<h2>{title}</h2>", f'<img alt="{title}" src="{_data_uri(figures[key])}">']
    body.append("<h2>Runs' plots</h2>")
    for r in records:
        body.append(f'<h3><a href="{esc(links.run(r))}">{esc(r.name)}</a> <span class="meta">{esc(r.status)}</span></h3>')
        storage = r.tags.get(STORAGE_DIR_TAG)
        if storage:
            body.append(f'<p class="meta">Checkpoints and models: <code>{esc(storage)}</code></p>')
        if not r.plots:
            body.append("<p>No plots logged.</p>")
            continue
        figs = []
        for kind, paths in _plot_groups(r.plots).items():
            latest = paths[-1]
            others = " ".join(f'<a href="{esc(p.relative_to(out_dir).as_posix())}">{esc(p.stem)}</a>' for p in paths[:-1])
            figs.append(f'<figure><img alt="{esc(kind)}" src="{_data_uri(latest)}"><figcaption>{esc(latest.stem)}'
                        + (f" · earlier: {others}" if others else "") + "</figcaption></figure>")
        body.append('<div class="plots">' + "".join(figs) + "</div>")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(exp_name)}: run comparison</title>'
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_csv(path: Path, records: list[RunRecord]) -> None:
    params = differing_params(records)
    cols = metric_columns(records, everything=True)
    head = ["run", "run_id", "status", "duration_s", *params, *(display_key(c) for c in cols)]
    rows = [[r.name, r.run_id, r.status, None if r.duration_s is None else f"{r.duration_s:.1f}",
             *(r.params.get(p) for p in params), *(float(r.metrics[c]) if c in r.metrics else None for c in cols)] for r in records]
    write_text(path, csv_text(head, rows))


# -- the whole report ---------------------------------------------------------------------------------------------------
def build_report(experiment: str, runs: list[str] | None = None, out: str | os.PathLike[str] | None = None,
                 tracking_uri: str | None = None, ui_url: str = DEFAULT_UI, max_runs: int = 100,
                 progress: bool = True) -> Report:
    """Collect the runs and write every file of the report; raises :class:`UserError` on unknown input."""
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    exp = _get_experiment(client, experiment, uri)
    chosen = select_runs(client, exp, runs, max_runs=max_runs)
    out_dir = Path(out) if out else Path("reports") / safe_name(experiment)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = collect(client, chosen, out_dir, progress=progress)
    colors = run_colors([r.name for r in records])
    figures = {}
    for key, which, ylabel, title in (("loss", "loss", "loss", "Training loss"),
                                      ("recall_at_1", "recall", "Recall@1", "Recall@1 (step 0: untrained model)")):
        p = plot_curves(curves(records, which), out_dir / f"{key}.png", ylabel, title, colors)
        if p is not None:
            figures[key] = p
    links = _Links(ui_url, exp.experiment_id, records)
    md, page, table = out_dir / "report.md", out_dir / "report.html", out_dir / "runs.csv"
    write_text(md, render_markdown(exp.name, records, figures, out_dir, links, uri) + "\n")
    write_text(page, render_html(exp.name, records, figures, out_dir, links, uri))
    write_csv(table, records)
    return Report(exp.name, exp.experiment_id, records, md, page, figures, table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experiment", required=True, help="MLflow experiment name (tracking.experiment of the runs)")
    parser.add_argument("--runs", help="comma-separated run ids or run names (default: every run); a parent run stands for its children")
    parser.add_argument("--out", help="output directory (default reports/<experiment>)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db)")
    parser.add_argument("--ui-url", default=DEFAULT_UI, help=f"MLflow UI base URL for the links (default {DEFAULT_UI})")
    parser.add_argument("--max-runs", type=int, default=100, help="compare at most the N most recent runs (default 100)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    tokens = [t.strip() for t in (args.runs or "").split(",") if t.strip()] or None
    if args.max_runs < 1:
        raise UserError(f"--max-runs {args.max_runs}: must be at least 1")
    rep = build_report(args.experiment, tokens, args.out, args.tracking_uri, args.ui_url, args.max_runs, progress=not args.no_progress)
    _, _, head, rows = _tables(rep.records)
    print(markdown_table(head, rows))
    print(f"\nreport of {len(rep.records)} run{'s' * (len(rep.records) != 1)} from experiment {rep.experiment}:")
    print(f"  {rep.markdown}\n  {rep.html}\n  {rep.csv}")
    return 0
