"""A study's section of a report: ``dmltrain report --runs <study parent>`` answers the study's question.

A class-subsampling study's parent run (tag ``dmltrain.kind`` ``study``) stands for its child runs in the
report's run tables, as any parent does; this section adds what only the study has: one column per point
(mean ± s.d. over the seeds of Recall@1 and the steady step time, the change of Recall@1 against the
reference paired by seed with its verdict, the speed-up), read from the children as the study reads them
(:mod:`dmltrain.studies.results`), a link to the parent run, and the study's own files (``study.md`` and its
figures, downloaded from the parent's ``study/`` artifacts).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from dmltrain.report.runs import RECALL1_KEY, RunRecord
from dmltrain.studies.results import RELATIVES, Measure, Point, Repeat, StudySummary, table, verdicts
from dmltrain.text import safe_name
from dmltrain.tracking.links import run_url
from dmltrain.tracking.names import KIND_TAG, PARENT_RUN_TAG, STEP_MS, STUDY_POINT_TAG, STUDY_REPEAT_TAG
from dmltrain.tracking.queries import steady_state

STUDY_KIND = "study"
#: a point's label (:func:`~dmltrain.studies.results.point_label`): ``[variant-]r<ratio>-c<classes>``
_LABEL = re.compile(r"^(?:(?P<variant>.+)-)?r(?P<ratio>[0-9.]+(?:e-?\d+)?)-c(?P<classes>\d+)(?P<unit>[kM]?)$")
#: what the section reads of each child run
MEASURES = [
    Measure("recall@1", "eval", "recall@1", mlflow="recall_at_1", digits=4),
    Measure("step ms", "metric", STEP_MS, "steady", "step_ms"),
]
#: the study's own files the section links (and shows, for the figures)
STUDY_FILES = (".png", "study.md")


@dataclass
class StudySection:
    """One study parent's part of the report: ``head``/``rows`` the per-point table, ``verdicts`` a line per
    point compared with its reference, ``files`` the study's files under the report's folder."""

    name: str
    url: str
    head: list[str]
    rows: list[list[str]]
    verdicts: list[str]
    files: dict[str, Path] = field(default_factory=dict)
    points: int = 0
    seeds: int = 0

    def what(self) -> str:
        """``study sub: 2 points × 2 seeds``: what a report of it holds, as its heading says."""
        return (
            f"study {self.name}: {self.points} point{'s' * (self.points != 1)} × {self.seeds} "
            f"seed{'s' * (self.seeds != 1)}"
        )


def parse_label(label: str) -> tuple[str, float, int] | None:
    """``hard-r0.1-c100k`` -> ``("hard", 0.1, 100000)``; None for another text."""
    m = _LABEL.match(label or "")
    if not m:
        return None
    classes = int(m["classes"]) * {"": 1, "k": 1000, "M": 1_000_000}[m["unit"]]
    return m["variant"] or "", float(m["ratio"]), classes


def points_of(parent_id: str, records: list[RunRecord]) -> list[Point]:
    """The study's points from its child runs among ``records`` (those with a point label), each with a repeat
    per run: its seed offset, finished when the run is, Recall@1 its last evaluation's, the step time the
    steady state of its logged windows. Ordered by class count, variant, then ratio from the largest."""
    by_label: dict[str, list[RunRecord]] = {}
    for rec in records:
        if rec.tags.get(PARENT_RUN_TAG) == parent_id and parse_label(rec.tags.get(STUDY_POINT_TAG, "")):
            by_label.setdefault(rec.tags[STUDY_POINT_TAG], []).append(rec)
    points = []
    for label, recs in by_label.items():
        variant, ratio, classes = parse_label(label)  # type: ignore[misc]
        repeats = []
        for i, rec in enumerate(recs):
            try:
                seed = int(rec.tags.get(STUDY_REPEAT_TAG, i))
            except ValueError:
                seed = i
            values = {
                "recall@1": rec.metrics.get(RECALL1_KEY, float("nan")),
                "step ms": steady_state(v for _, v in rec.history.get(STEP_MS, [])),
            }
            repeats.append(Repeat(seed, rec.name, "finished" if rec.status == "FINISHED" else "failed", values))
        points.append(Point(ratio, classes, "", label, variant=variant, repeats=sorted(repeats, key=lambda r: r.seed)))
    return sorted(points, key=lambda p: (p.classes, p.variant, -p.ratio))


def study_parents(runs) -> list:
    """The study parents among MLflow runs."""
    return [r for r in runs if r.data.tags.get(KIND_TAG) == STUDY_KIND]


def study_section(client, parent, records: list[RunRecord], out_dir: Path, ui: str) -> StudySection | None:
    """The section of study run ``parent`` (None when none of ``records`` is one of its points); its files are
    downloaded under ``out_dir/study/<name>/`` (missing ones are left out)."""
    points = points_of(parent.info.run_id, records)
    if not points:
        return None
    name = parent.data.tags.get("dmltrain.run_name") or parent.info.run_name or parent.info.run_id[:8]
    summary = StudySummary(name, [1], points, out_dir, {}, parent.info.run_id, "", 0.0, MEASURES, RELATIVES[:2])
    head, rows = table(summary)
    said = [f"{p.label}: Δ Recall@1 {pd.sentence(ref.label)}" for p, ref, pd in verdicts(summary) if pd.n]
    files = _download_study_files(client, parent.info.run_id, out_dir / "study" / safe_name(name, "study"))
    url = run_url(ui, parent.info.experiment_id, parent.info.run_id)
    seeds = len({r.seed for p in points for r in p.repeats})
    return StudySection(name, url, head, rows, said, files, len(points), seeds)


def _download_study_files(client, run_id: str, dest: Path) -> dict[str, Path]:
    try:
        names = [a.path for a in client.list_artifacts(run_id, "study") if a.path.endswith(STUDY_FILES)]
    except Exception:  # noqa: BLE001 — a missing artifact store costs the files, not the section
        return {}
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        for rel in names:
            local = Path(client.download_artifacts(run_id, rel, tmp))
            target = dest / Path(rel).name
            os.replace(local, target)
            out[target.name] = target
    return dict(sorted(out.items()))
