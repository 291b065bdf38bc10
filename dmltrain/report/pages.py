"""The report's pages: Markdown, and self-contained HTML (images embedded), with links to the MLflow UI."""

from __future__ import annotations

import base64
import html
import json
import re
import time
from pathlib import Path
from urllib.parse import quote

from dmltrain.redact import redact_url
from dmltrain.report.compare import best_rows, differing_params, metric_columns, tables
from dmltrain.report.runs import RunRecord
from dmltrain.text import markdown_table, md_code, md_text, md_url
from dmltrain.tracking.names import STORAGE_DIR_TAG


class Links:
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


def _plot_groups(plots: list[Path]) -> dict[str, list[Path]]:
    """Plots grouped by kind (``recall_at_k-step0000010.png`` -> ``recall_at_k``), each group in step order."""
    groups: dict[str, list[Path]] = {}
    for p in plots:
        kind = re.sub(r"[-_]?step\d+$", "", p.stem) or p.stem
        groups.setdefault(kind, []).append(p)
    return groups


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def render_markdown(
    exp_name: str, records: list[RunRecord], figures: dict[str, Path], out_dir: Path, links: Links, uri: str
) -> str:
    run_head, run_rows, met_head, met_rows = tables(records)
    cols = metric_columns(records)
    best = best_rows(records, cols)
    bold = {j + 1: best.get(c, set()) for j, c in enumerate(cols)}
    run_links = [links.run(r) for r in records]
    parts = [
        f"# Experiment {md_code(exp_name)}: {len(records)} run{'s' * (len(records) != 1)}",
        "",
        f"Tracking store {md_code(redact_url(uri))} · [experiment in MLflow]({md_url(links.experiment())}) · "
        f"[compare in MLflow]({md_url(links.compare())}) · generated {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "## Runs",
        "",
    ]
    if not differing_params(records):
        parts += ["All runs share the same params." if len(records) > 1 else "One run: no params to compare.", ""]
    parts += [
        markdown_table(run_head, run_rows, links=run_links),
        "",
        "## Final metrics",
        "",
        markdown_table(met_head, met_rows, bold=bold, links=run_links),
        "",
    ]
    for key, title in (("loss", "Loss"), ("recall_at_1", "Recall@1")):
        if key in figures:
            parts += [f"## {title}", "", f"![{title}]({md_url(figures[key].relative_to(out_dir).as_posix())})", ""]
    parts += ["## Runs' plots", ""]
    for r in records:
        parts += [f"### [{md_text(r.name)}]({md_url(links.run(r))})", ""]
        storage = r.tags.get(STORAGE_DIR_TAG)
        if storage:
            parts += [f"Checkpoints and models: {md_code(redact_url(storage))}", ""]
        if not r.plots:
            parts += ["No plots logged.", ""]
            continue
        for kind, paths in _plot_groups(r.plots).items():
            latest = paths[-1]
            parts += [f"![{md_text(kind)}]({md_url(latest.relative_to(out_dir).as_posix())})", ""]
            if len(paths) > 1:
                links_ = (f"[{md_text(p.stem)}]({md_url(p.relative_to(out_dir).as_posix())})" for p in paths)
                parts += ["All: " + ", ".join(links_), ""]
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


def _html_table(
    head: list[str],
    rows: list[list[str]],
    links: list[str],
    bold: dict[int, set[int]] | None = None,
    full: list[list[str | None]] | None = None,
) -> str:
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


def render_html(
    exp_name: str, records: list[RunRecord], figures: dict[str, Path], out_dir: Path, links: Links, uri: str
) -> str:
    esc = html.escape
    run_head, run_rows, met_head, met_rows = tables(records)
    params = differing_params(records)
    full = [[None, None, None, None, *(r.params.get(p) for p in params)] for r in records]
    cols = metric_columns(records)
    best = best_rows(records, cols)
    bold = {j + 1: best.get(c, set()) for j, c in enumerate(cols)}
    run_links = [links.run(r) for r in records]
    body = [
        f"<h1>Experiment <code>{esc(exp_name)}</code>: {len(records)} run{'s' * (len(records) != 1)}</h1>",
        f'<p class="meta">Tracking store <code>{esc(redact_url(uri))}</code> · <a href="{esc(links.experiment())}">experiment in MLflow</a> · '
        f'<a href="{esc(links.compare())}">compare in MLflow</a> · generated {esc(time.strftime("%Y-%m-%d %H:%M"))}</p>',
        "<h2>Runs</h2>",
    ]
    if not params:
        body.append(
            f"<p>{'All runs share the same params.' if len(records) > 1 else 'One run: no params to compare.'}</p>"
        )
    body += [
        _html_table(run_head, run_rows, run_links, full=full),
        "<h2>Final metrics</h2>",
        _html_table(met_head, met_rows, run_links, bold=bold),
    ]
    for key, title in (("loss", "Loss"), ("recall_at_1", "Recall@1")):
        if key in figures:
            body += [f"<h2>{title}</h2>", f'<img alt="{title}" src="{_data_uri(figures[key])}">']
    body.append("<h2>Runs' plots</h2>")
    for r in records:
        body.append(
            f'<h3><a href="{esc(links.run(r))}">{esc(r.name)}</a> <span class="meta">{esc(r.status)}</span></h3>'
        )
        storage = r.tags.get(STORAGE_DIR_TAG)
        if storage:
            body.append(f'<p class="meta">Checkpoints and models: <code>{esc(redact_url(storage))}</code></p>')
        if not r.plots:
            body.append("<p>No plots logged.</p>")
            continue
        figs = []
        for kind, paths in _plot_groups(r.plots).items():
            latest = paths[-1]
            others = " ".join(
                f'<a href="{esc(p.relative_to(out_dir).as_posix())}">{esc(p.stem)}</a>' for p in paths[:-1]
            )
            figs.append(
                f'<figure><img alt="{esc(kind)}" src="{_data_uri(latest)}"><figcaption>{esc(latest.stem)}'
                + (f" · earlier: {others}" if others else "")
                + "</figcaption></figure>"
            )
        body.append('<div class="plots">' + "".join(figs) + "</div>")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(exp_name)}: run comparison</title>'
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
