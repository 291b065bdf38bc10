"""The report's pages: Markdown, and self-contained HTML (images embedded), with links to the MLflow UI.

Both pages hold the same parts: the runs (params that differ), their final metrics (best values
marked where runs are comparable), the overlaid curves, and per run its description (what was
trained, on what, how well: the run's MLflow note), its evaluations step by step when it is the only
run, and its plots. Links open MLflow in its model-training view (:mod:`dmltrain.tracking.links`).
"""

from __future__ import annotations

import base64
import html
import re
import time
from collections.abc import Sequence
from pathlib import Path

from dmltrain.redact import redact_url
from dmltrain.report.compare import (
    COMPARABLE_NOTE,
    STUDY_NOTE,
    Table,
    differing_params,
    evaluations_table,
    metrics_table,
    runs_table,
)
from dmltrain.report.runs import RunRecord
from dmltrain.report.study import StudySection
from dmltrain.text import markdown_table, md_code, md_text, md_url
from dmltrain.tracking.links import compare_url, experiment_url, run_url
from dmltrain.tracking.names import STORAGE_DIR_TAG


class Links:
    def __init__(self, ui: str, exp_id: str, records: list[RunRecord]):
        self.ui = ui.rstrip("/")
        self.exp_id = exp_id
        self.records = records

    def run(self, rec: RunRecord) -> str:
        return run_url(self.ui, rec.experiment_id, rec.run_id)

    def experiment(self) -> str:
        return experiment_url(self.ui, self.exp_id)

    def compare(self) -> str:
        return compare_url(self.ui, [r.run_id for r in self.records], [r.experiment_id for r in self.records])


def _plot_groups(plots: list[Path]) -> dict[str, list[Path]]:
    """Plots grouped by kind (``recall_at_k-step0000010.png`` -> ``recall_at_k``), each group in step order."""
    groups: dict[str, list[Path]] = {}
    for p in plots:
        kind = re.sub(r"[-_]?step\d+$", "", p.stem) or p.stem
        groups.setdefault(kind, []).append(p)
    return groups


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _runs_note(records: list[RunRecord]) -> str | None:
    if differing_params(records):
        return None
    return "All runs share the same params." if len(records) > 1 else None


FIGURES = (("loss", "Loss"), ("recall_at_1", "Recall@1"))


def _inert_html(markdown: str) -> str:
    """Markdown kept as Markdown, with HTML's ``& < >`` as entities: no tag or script of a run's author renders."""
    return markdown.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- Markdown -----------------------------------------------------------------------------------------
def _md_table(t: Table) -> str:
    bold: dict[int, set[int]] = {}
    for i, j in t.bold:
        bold.setdefault(j, set()).add(i)
    return markdown_table(t.head, t.rows, bold=bold, cell_links=t.links)


def _study_markdown(study: StudySection, out_dir: Path) -> list[str]:
    parts = [f"## Study {md_text(study.name)}", "", f"[The study's parent run in MLflow]({md_url(study.url)})"]
    if "study.md" in study.files:
        parts[-1] += f" · [study.md]({md_url(study.files['study.md'].relative_to(out_dir).as_posix())})"
    parts += [""] + [f"- {md_text(line)}" for line in study.verdicts] + ([""] if study.verdicts else [])
    parts += [markdown_table(study.head, study.rows), ""]
    for name, path in study.files.items():
        if name.endswith(".png"):
            parts += [f"![{md_text(name)}]({md_url(path.relative_to(out_dir).as_posix())})", ""]
    return parts


def _study_html(study: StudySection) -> list[str]:
    esc = html.escape
    body = [
        f"<h2>Study {esc(study.name)}</h2>",
        f'<p class="meta"><a href="{esc(study.url)}">the study\'s parent run in MLflow</a></p>',
    ]
    if study.verdicts:
        body.append("<ul>" + "".join(f"<li>{esc(line)}</li>" for line in study.verdicts) + "</ul>")
    body.append(_html_table(Table(study.head, study.rows)))
    body += [
        f'<figure><img alt="{esc(n)}" src="{_data_uri(p)}"><figcaption>{esc(n)}</figcaption></figure>'
        for n, p in study.files.items()
        if n.endswith(".png")
    ]
    return body


def heading(records: list[RunRecord], studies: Sequence[StudySection] = ()) -> str:
    """What the report is of: ``run <name>``, ``4 runs``, or for the runs of studies ``study sub: 2 points × 2
    seeds (4 runs)`` (a study's runs are its points' seeds, not runs to rank)."""
    if studies:
        n = len(records)
        return "; ".join(s.what() for s in studies) + f" ({n} run{'s' * (n != 1)})"
    return f"run {records[0].name}" if len(records) == 1 else f"{len(records)} runs"


def render_markdown(
    exp_name: str,
    records: list[RunRecord],
    figures: dict[str, Path],
    out_dir: Path,
    links: Links,
    uri: str,
    studies: Sequence[StudySection] = (),
) -> str:
    run_links = [links.run(r) for r in records]
    single = len(records) == 1
    parts = [
        f"# Experiment {md_code(exp_name)}: {md_text(heading(records, studies))}",
        "",
        f"Tracking store {md_code(redact_url(uri))} · [experiment in MLflow]({md_url(links.experiment())})"
        + ("" if single else f" · [compare in MLflow]({md_url(links.compare())})")
        + f" · generated {time.strftime('%Y-%m-%d %H:%M')}",
        "",
    ]
    if single and records[0].description:
        # the description is Markdown, but anyone who can write to the store can write it: no raw HTML of theirs
        about = _inert_html(records[0].description).replace("\n### ", "\n#### ")  # under the page's headings
        parts += ["## What was trained", "", about, ""]
    for study in studies:
        parts += _study_markdown(study, out_dir)
    parts += ["## Runs", ""]
    note = _runs_note(records)
    if note:
        parts += [note, ""]
    parts += [_md_table(runs_table(records, run_links)), "", "## Final metrics", ""]
    parts += [_md_table(metrics_table(records, run_links, mark_best=not studies)), ""]
    if not single:
        parts += [f"*{STUDY_NOTE if studies else COMPARABLE_NOTE}*", ""]
    if single:
        evals = evaluations_table(records[0])
        if evals.rows:
            parts += ["## Evaluations", "", _md_table(evals), ""]
    for key, title in FIGURES:
        if key in figures:
            parts += [f"## {title}", "", f"![{title}]({md_url(figures[key].relative_to(out_dir).as_posix())})", ""]
    parts += ["## Runs' plots" if not single else "## Plots", ""]
    for r in records:
        if not single:
            parts += [f"### [{md_text(r.name)}]({md_url(links.run(r))})", ""]
            if r.description:
                first = r.description.split("\n", 1)[0]
                parts += [_inert_html(first), ""]
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


# -- HTML ---------------------------------------------------------------------------------------------------
_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px;max-width:100%}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4;overflow-wrap:anywhere;max-width:14em}
td{overflow-wrap:anywhere}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.best{font-weight:bold;background:#eef7ee}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
.plots{display:flex;flex-wrap:wrap;gap:1em}.plots figure{margin:0;max-width:48%}
figcaption{font-size:12px;color:#555}
.meta{color:#555;font-size:13px}
.about{background:#fafafa;border:1px solid #eee;padding:.2em 1em;margin:1em 0}
"""
_NUMBER = re.compile(r"[-+0-9.,e ()—]+")


def _html_table(t: Table) -> str:
    esc = html.escape
    out = ["<table><thead><tr>"]
    for j, h in enumerate(t.head):
        link = t.links.get((-1, j))
        out.append(f'<th><a href="{esc(link)}">{esc(h)}</a></th>' if link else f"<th>{esc(h)}</th>")
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(t.rows):
        cells = []
        for j, cell in enumerate(row):
            link = t.links.get((i, j))
            if link:
                cells.append(f'<td><a href="{esc(link)}">{esc(cell)}</a></td>')
                continue
            cls = ["num"] if j > 0 and _NUMBER.fullmatch(cell) else []
            if (i, j) in t.bold:
                cls.append("best")
            title = t.titles.get((i, j))
            attrs = (f' class="{" ".join(cls)}"' if cls else "") + (f' title="{esc(title)}"' if title else "")
            cells.append(f"<td{attrs}>{esc(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def markdown_to_html(text: str) -> str:
    """The Markdown of a run's description as HTML: headings, bullets, paragraphs, ``**bold**``, ``code``."""
    esc = html.escape

    def inline(s: str) -> str:
        s = esc(s)
        s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
        return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", s)

    out, items = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("- "):
            items.append(f"<li>{inline(line[2:])}</li>")
            continue
        if items:
            out.append("<ul>" + "".join(items) + "</ul>")
            items = []
        if line.startswith("#"):
            level = min(6, len(line) - len(line.lstrip("#")) + 1)
            out.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    return "\n".join(out)


def render_html(
    exp_name: str,
    records: list[RunRecord],
    figures: dict[str, Path],
    out_dir: Path,
    links: Links,
    uri: str,
    studies: Sequence[StudySection] = (),
) -> str:
    esc = html.escape
    run_links = [links.run(r) for r in records]
    single = len(records) == 1
    title = heading(records, studies)
    body = [
        f"<h1>Experiment <code>{esc(exp_name)}</code>: {esc(title)}</h1>",
        f'<p class="meta">Tracking store <code>{esc(redact_url(uri))}</code> · <a href="{esc(links.experiment())}">experiment in MLflow</a>'
        + ("" if single else f' · <a href="{esc(links.compare())}">compare in MLflow</a>')
        + f" · generated {esc(time.strftime('%Y-%m-%d %H:%M'))}</p>",
    ]
    if single and records[0].description:
        body += ["<h2>What was trained</h2>", f'<div class="about">{markdown_to_html(records[0].description)}</div>']
    for study in studies:
        body += _study_html(study)
    body.append("<h2>Runs</h2>")
    note = _runs_note(records)
    if note:
        body.append(f"<p>{note}</p>")
    body += [
        _html_table(runs_table(records, run_links)),
        "<h2>Final metrics</h2>",
        _html_table(metrics_table(records, run_links, mark_best=not studies)),
    ]
    if not single:
        body.append(f'<p class="meta">{esc(STUDY_NOTE if studies else COMPARABLE_NOTE)}</p>')
    if single:
        evals = evaluations_table(records[0])
        if evals.rows:
            body += ["<h2>Evaluations</h2>", _html_table(evals)]
    for key, fig_title in FIGURES:
        if key in figures:
            body += [f"<h2>{fig_title}</h2>", f'<img alt="{fig_title}" src="{_data_uri(figures[key])}">']
    body.append("<h2>Plots</h2>" if single else "<h2>Runs' plots</h2>")
    for r in records:
        if not single:
            body.append(
                f'<h3><a href="{esc(links.run(r))}">{esc(r.name)}</a> <span class="meta">{esc(r.status)}</span></h3>'
            )
            if r.description:
                body.append(f'<div class="about">{markdown_to_html(r.description)}</div>')
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
