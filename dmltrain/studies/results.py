"""What a subsampling study produces: its points, their repeats, the trade-off table and plots.

**Shape.** A :class:`Point` is one configuration: its place on the study's axes (the share of
classes in each softmax, the number of classes, and an optional ``variant``, another axis such as a
sampling mode), the dotted config ``overrides`` that make it, and a ``label`` that names it first in
run names and tables (``r0.1-c100k``). It is trained once per repeat (:class:`Repeat`, one seed
each). What is read of each run is a list of :class:`Measure` (an evaluation metric, an MLflow metric
history summarised one way, a tag, the wall time): add one and it is read, tabled and logged.

**Trade-off.** Every point is compared with its *reference*, the point of the same class count with
the largest ratio (ratio 1 when the study has it; of the same variant when there is one there,
:func:`reference_of`), repeat by
repeat (the same seed on both sides, :func:`relative`): the change of Recall@1 in points, the
speed-up of a step (the reference's step time over the point's), the classifier memory as a factor
of the reference's. Each figure is the mean over the paired seeds and its spread the standard
deviation of the per-seed figures (none with one seed). Speed is the
:func:`~dmltrain.tracking.queries.steady_state` of the run's logged windows, as ``dmltrain report``
reads it.

**Sampling modes.** A study of the class draw (``dmltrain study subsampling --sampling uniform,hard,mixed``)
has one variant per mode; its ratio-1 point is trained once, without a variant (a full softmax draws
nothing), and is every variant's reference. :func:`gap_closed` then says what share of the Recall@1
lost by the uniform draw at a ratio each other mode wins back, and a :class:`Measure` with ``curve``
(the probe's gradient cosine) is plotted over the training steps, one line per point.

**Files** (:func:`write_outputs`, each written atomically): ``study.md`` (the table with the points
as columns, so that it fits a page and MLflow's Markdown view, its notes and figures), ``study.csv``
(one row per point: every measure's mean and spread), ``study_runs.csv`` (one row per run),
``tradeoff.png`` (the study's figure: the change of Recall@1 with each point's verdict in its note, the speed-up,
the memory factor, the time in training steps and the start-up against the ratio, one line per class count;
panels whose values do not vary are left out and said so), ``recall_vs_ratio.png`` (Recall@K against the ratio, the paper's Fig. 4, zero-based) and,
with two class counts or more, ``vs_classes.png`` (the same trade-off and the step time against the
number of classes, one line per ratio), and ``<measure>.png`` for every curve measure (its history over
the training steps, one line per point, the mean over the seeds). :func:`render` is the text the command prints,
:func:`parent_metrics` and :func:`describe_study` what the parent MLflow run shows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.evaluate.plots import Panel, plot_curves, plot_panels, run_colors
from dmltrain.fileio import write_text
from dmltrain.redact import redact_url
from dmltrain.text import MISSING, csv_text, finite_number, markdown_table
from dmltrain.tracking.names import (
    ACTIVE_CLASSES_TAG,
    ACTIVE_ROWS_TAG,
    CLASSIFIER_MB_TAG,
    CUDA_PEAK_MB,
    IMAGES_PER_S,
    PROBE_FULL_LOSS,
    PROBE_GRAD_COS,
    PROBE_LOSS_GAP,
    PROBE_UNIFORM_LOSS_GAP,
    RSS_MB,
    STEP_MS,
    STUDY_WALL_TAG,
)
from dmltrain.tracking.queries import STEADY_STATE


# -- what is read of a run -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measure:
    """A figure read of each run: ``source`` ``eval`` (the final evaluation's metric ``key``), ``metric``
    (an MLflow metric history, summarised by ``how``: ``steady``, ``max``, ``mean`` or ``last``), ``tag``
    (an MLflow tag), ``timeline`` (part ``key`` of :func:`timeline`) or ``wall`` (the wall time of the run's
    training, kept as the tag ``key`` so that a
    study run again reads the first training's, not the resumed no-op's). ``name`` heads its column; ``mlflow`` is its key
    among the parent run's metrics; ``digits`` its decimals in the tables; ``curve``: a ``metric`` whose history
    is also plotted against the step (``<mlflow>.png``, within ``ylim``)."""

    name: str
    source: str
    key: str = ""
    how: str = "steady"
    mlflow: str = ""
    digits: int = 1
    curve: bool = False  # a metric whose history is kept and plotted against the step
    ylim: tuple[float, float] | None = None  # the curve's y range (None: matplotlib's)
    about: str = ""  # what the curve shows, in words (its plot's title)
    zero: bool = False  # the curve's y axis from 0 (a loss: its small changes would fill the plot)
    chance: bool = False  # a softmax loss over the classes: its chance level, ln C, drawn at each class count


@dataclass(frozen=True)
class Relative:
    """A figure of a point against its reference, seed by seed: ``delta_points`` (100 × (point − reference),
    for a fraction), ``speedup`` (reference / point, for a time) or ``factor`` (point / reference)."""

    name: str
    of: str  # a Measure's name
    kind: str
    mlflow: str
    axis: str  # the plot's y label


def default_measures(ks: Sequence[int], gpu: bool = False) -> list[Measure]:
    """Recall@K of the final evaluation, speed (steady state), memory (peak RSS; with ``gpu`` the CUDA peak),
    the classifier's draw, the wall time."""
    return [
        *([Measure("CUDA peak MB", "metric", CUDA_PEAK_MB, "max", "cuda_peak_mb", digits=0)] if gpu else []),
        *(Measure(f"recall@{k}", "eval", f"recall@{k}", mlflow=f"recall_at_{k}", digits=4) for k in ks),
        Measure("step ms", "metric", STEP_MS, "steady", "step_ms"),
        Measure("images/s", "metric", IMAGES_PER_S, "steady", "images_per_s"),
        Measure("classifier MB", "tag", CLASSIFIER_MB_TAG, mlflow="classifier_mb", digits=3),
        Measure("RSS MB", "metric", RSS_MB, "max", "rss_mb", digits=0),
        Measure("active classes", "tag", ACTIVE_CLASSES_TAG, mlflow="active_classes", digits=0),
        Measure("active rows", "tag", ACTIVE_ROWS_TAG, mlflow="active_rows", digits=1),
        Measure("wall s", "wall", STUDY_WALL_TAG, mlflow="wall_s", digits=0),
        *timeline_measures(),
    ]


def timeline_measures() -> list[Measure]:
    """The run's MLflow wall time in its parts (:func:`timeline`): start-up, time in training steps, the rest."""
    return [
        Measure("start-up s", "timeline", "startup", mlflow="startup_s", digits=0),
        Measure("steps s", "timeline", "steps", mlflow="steps_s", digits=1),
        Measure("eval and other s", "timeline", "other", mlflow="other_s", digits=0),
    ]


def timeline(
    start_ms: float | None, end_ms: float | None, windows: Sequence[tuple[int, float, float]], accum: int = 1
) -> dict[str, float]:
    """Where a run's MLflow wall time went, from what it logged: ``windows`` are the ``(step, timestamp ms,
    step ms)`` of each logged ``time/step_ms`` (the wall time per micro-batch of the steps since the previous
    log point, evaluations and checkpoints left out; ``accum`` micro-batches a step). ``steps`` is the time in
    training steps (Σ steps of a window × accum × its step ms), ``startup`` the time from the run's start to the
    first window's first step (the first log's time less that window's steps: Ray's workers, the data, the
    evaluation before training), ``other`` the rest of the wall time (evaluations, checkpoints, the models'
    logging). NaN where the run logged no window or has no end (a step logged twice, by a resumed run, counts
    once: its later value)."""
    nan = float("nan")
    by_step: dict[int, tuple[float, float]] = {}
    for step, ts, ms in sorted(windows, key=lambda w: (w[0], w[1])):
        if finite_number(ms):
            by_step[int(step)] = (float(ts), float(ms))
    if start_ms is None or not by_step:
        return {"startup": nan, "steps": nan, "other": nan}
    prev, steps_s, first = 0, 0.0, None
    for step in sorted(by_step):
        ts, ms = by_step[step]
        seconds = (step - prev) * accum * ms / 1000
        if first is None:
            first = (ts - start_ms) / 1000 - seconds
        steps_s += seconds
        prev = step
    other = nan if end_ms is None else (end_ms - start_ms) / 1000 - first - steps_s
    return {"startup": first, "steps": steps_s, "other": other}


def probe_measures() -> list[Measure]:
    """What the classifier's probe (``loss.classifier.probe_every``) adds: the cosine of the sampled and the full
    softmax's embedding gradients, its mean over training in the table and its history in ``grad_cos.png``; the
    mean loss gap (sampled − full) of the run's draw and of a uniform draw of the same size on the same batches
    (draws other than uniform): ``exp`` of an uncorrected draw's is the share of a sample's normaliser it holds
    (normalised kinds; see ShardedClassifier.probe)."""
    about = "cosine of the sampled and the full softmax's embedding gradients (the probe)"
    return [
        Measure(
            "grad cos", "metric", PROBE_GRAD_COS, "mean", "grad_cos", digits=3, curve=True, ylim=(0, 1.02), about=about
        ),
        Measure("loss gap", "metric", PROBE_LOSS_GAP, "mean", "loss_gap", digits=2),
        Measure("uniform draw's loss gap", "metric", PROBE_UNIFORM_LOSS_GAP, "mean", "uniform_loss_gap", digits=2),
    ]


def full_loss_measure() -> Measure:
    """The loss that compares across ratios: the probe's full-softmax loss on the training batch (the last
    logged and its history, ``full_loss.png``); the objective ``batch/loss`` is a softmax over the drawn classes
    only, lower the fewer are drawn, and is not read."""
    return Measure(
        "full-softmax loss",
        "metric",
        PROBE_FULL_LOSS,
        "last",
        "full_loss",
        digits=3,
        curve=True,
        about="the full softmax's loss on the training batch (the probe; the same loss at every ratio)",
        zero=True,
        chance=True,
    )


RELATIVES = (
    Relative("Δ recall@1 (points)", "recall@1", "delta_points", "delta_recall_at_1_points", "Δ Recall@1 (points)"),
    Relative("speed-up (×)", "step ms", "speedup", "speedup", "speed-up of a step (×)"),
    Relative("classifier memory (×)", "classifier MB", "factor", "memory_factor", "classifier memory (×)"),
)


# -- the study's shape --------------------------------------------------------------------------------------
@dataclass
class Repeat:
    """One training of a point, with one seed."""

    seed: int
    run_name: str
    status: str = "pending"  # finished, failed
    values: dict[str, float] = field(default_factory=dict)  # Measure name -> value
    final: dict[str, float] = field(default_factory=dict)  # the final evaluation, as the run reported it
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # curve Measure name -> (step, value)
    mlflow_run_id: str | None = None
    storage_dir: str | None = None
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Point:
    """One configuration of the study (see the module doc); ``repeats`` are its trainings."""

    ratio: float
    classes: int
    shards: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)
    variant: str = ""
    repeats: list[Repeat] = field(default_factory=list)

    @property
    def finished(self) -> list[Repeat]:
        return [r for r in self.repeats if r.status == "finished"]

    @property
    def status(self) -> str:
        done = len(self.finished)
        return "finished" if done == len(self.repeats) else "failed" if done == 0 else "partly failed"


def classes_label(n: int) -> str:
    """``100000`` -> ``100k``, ``1000000`` -> ``1M``, ``11318`` -> ``11318``."""
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def point_label(ratio: float, classes: int, variant: str = "") -> str:
    """What tells a point apart, first: ``r0.1-c100k`` (``hard-r0.1-c100k`` with a variant)."""
    return (f"{variant}-" if variant else "") + f"r{ratio:g}-c{classes_label(classes)}"


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
    measures: list[Measure] = field(default_factory=list)
    relatives: Sequence[Relative] = RELATIVES
    parent_url: str | None = None

    def __post_init__(self) -> None:
        if not self.measures:
            self.measures = default_measures(self.ks)

    @property
    def ok(self) -> bool:
        return all(p.status == "finished" for p in self.points)

    @property
    def runs(self) -> list[Repeat]:
        return [r for p in self.points for r in p.repeats]


# -- figures -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stat:
    """A mean over seeds and its spread (sample standard deviation; None with one seed); ``n`` seeds."""

    mean: float
    sd: float | None
    n: int

    def text(self, digits: int) -> str:
        if self.n == 0 or not math.isfinite(self.mean):
            return MISSING
        return f"{self.mean:.{digits}f}" + (f" ± {self.sd:.{digits}f}" if self.sd is not None else "")


NO_STAT = Stat(float("nan"), None, 0)


def summarise(values: Sequence[float]) -> Stat:
    vals = [float(v) for v in values if finite_number(v)]
    if not vals:
        return NO_STAT
    return Stat(statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else None, len(vals))


def stat(point: Point, name: str) -> Stat:
    """Measure ``name`` of ``point`` over its finished repeats."""
    return summarise([r.values.get(name, float("nan")) for r in point.finished])


def reference_of(point: Point, points: Sequence[Point]) -> Point | None:
    """The point ``point`` is compared with: of the same class count, the largest ratio with a finished run
    (ratio 1 when the study has it), of the same variant when that one has it, else of the first variant
    that does (a full softmax is the same whatever draws the subsets); None when there is none."""
    same = [p for p in points if p.classes == point.classes and p.finished]
    if not same:
        return None
    top = max(p.ratio for p in same)
    at_top = [p for p in same if p.ratio == top]
    return next((p for p in at_top if p.variant == point.variant), at_top[0])


def relative(point: Point, ref: Point | None, rel: Relative) -> Stat:
    """``rel`` of ``point`` against ``ref``, seed by seed (only seeds finished on both sides count)."""
    if ref is None:
        return NO_STAT
    theirs = {r.seed: r.values.get(rel.of) for r in ref.finished}
    out = []
    for r in point.finished:
        a, b = r.values.get(rel.of), theirs.get(r.seed)
        if not (finite_number(a) and finite_number(b)):
            continue
        if rel.kind == "delta_points":
            out.append(100 * (a - b))
        elif rel.kind == "speedup" and a > 0:
            out.append(b / a)
        elif rel.kind == "factor" and b > 0:
            out.append(a / b)
    return summarise(out)


# -- the verdict on Recall@1 ----------------------------------------------------------------------------------
#: the measure whose change against the reference the study's verdict is about
VERDICT_OF = "recall@1"


@dataclass(frozen=True)
class PairedDelta:
    """The change of a fraction (Recall@1) of a point against its reference, in points, seed by seed: ``deltas``
    (100 × (point − reference) of each seed finished on both sides), ``reference`` (the reference's own value
    over those seeds, so that a change reads against the level it is a change of). ``half`` is the half-width of
    the 95 % Student-t interval of the mean (None with fewer than two seeds)."""

    deltas: tuple[float, ...]
    reference: Stat

    @property
    def n(self) -> int:
        return len(self.deltas)

    @property
    def stat(self) -> Stat:
        return summarise(self.deltas)

    @property
    def half(self) -> float | None:
        s = self.stat
        if s.n < 2 or s.sd is None:
            return None
        from scipy.stats import t  # a dependency already; imported here as it takes a while

        return float(t.ppf(0.975, s.n - 1) * s.sd / math.sqrt(s.n))

    @property
    def interval(self) -> tuple[float, float] | None:
        h = self.half
        return None if h is None else (self.stat.mean - h, self.stat.mean + h)

    @property
    def within_noise(self) -> bool | None:
        """Whether the 95 % interval holds 0 (None without an interval: one seed)."""
        iv = self.interval
        return None if iv is None else iv[0] <= 0.0 <= iv[1]

    def digits(self) -> int:
        """1 decimal, 2 where the change and its interval are both under a point."""
        return 2 if max(abs(self.stat.mean), self.half or 0.0) < 1 else 1

    def change(self) -> str:
        """The mean change and the interval's half-width, rounded: ``-2.1 ± 0.4 points`` (``-2.0 points``
        with one seed)."""
        d = self.digits()
        mean = _signed(self.stat.mean, d)
        return f"{mean} points" if self.half is None else f"{mean} ± {self.half:.{d}f} points"

    def verdict(self) -> str:
        """In words: ``within noise (-0.5 ± 1.2 points)`` when the interval holds 0, ``-2.1 ± 0.4 points``
        when it does not, ``-2.0 points (one seed: no interval)``; :data:`~dmltrain.text.MISSING` without a pair."""
        if not self.n:
            return MISSING
        if self.half is None:
            return f"{self.change()} (one seed: no interval)"
        return f"within noise ({self.change()})" if self.within_noise else self.change()

    def sentence(self, ref_label: str) -> str:
        """The verdict with what it rests on: ``within noise: -0.5 ± 1.2 points (95 % interval over 3 paired
        seeds; r1-c100k at 0.8100)``, the reference's own Recall@1 over the same seeds last."""
        if not self.n:
            return MISSING
        if self.half is None:
            return f"{self.change()} (one seed: no interval; {ref_label} at {self.reference.text(4)})"
        words = "within noise: " if self.within_noise else ""
        return (
            f"{words}{self.change()} (95 % interval over {self.n} paired seeds; "
            f"{ref_label} at {self.reference.text(4)})"
        )


def _signed(x: float, digits: int) -> str:
    """``+1.2``, ``-0.5``, and ``0.0`` rather than ``-0.0`` or ``+0.0``."""
    text = f"{x:+.{digits}f}"
    return text[1:] if float(text) == 0 else text


def paired_delta(point: Point, ref: Point | None, name: str = VERDICT_OF) -> PairedDelta:
    """Measure ``name`` of ``point`` against ``ref`` in points, paired by seed (see :class:`PairedDelta`)."""
    if ref is None:
        return PairedDelta((), NO_STAT)
    theirs = {r.seed: r.values.get(name) for r in ref.finished}
    deltas, refs = [], []
    for r in point.finished:
        a, b = r.values.get(name), theirs.get(r.seed)
        if finite_number(a) and finite_number(b):
            deltas.append(100 * (a - b))
            refs.append(b)
    return PairedDelta(tuple(deltas), summarise(refs))


def verdicts(summary: StudySummary) -> list[tuple[Point, Point, PairedDelta]]:
    """Every point but a reference with its reference and the change of Recall@1 (pairs or not)."""
    out = []
    for p in summary.points:
        ref = reference_of(p, summary.points)
        if ref is not None and ref is not p:
            out.append((p, ref, paired_delta(p, ref)))
    return out


#: the variant whose Recall@1 loss the other variants' :func:`gap_closed` is measured against
GAP_BASELINE = "uniform"


def gap_closed(point: Point, points: Sequence[Point]) -> Stat:
    """The share (%) of the Recall@1 gap between the :data:`GAP_BASELINE` variant at ``point``'s ratio and
    its reference (the full softmax) that ``point`` closes, seed by seed: ``100·(point − uniform) /
    (reference − uniform)``; none for the baseline itself, a reference, or a seed without a gap."""
    if not point.variant or point.variant == GAP_BASELINE:
        return NO_STAT
    ref = reference_of(point, points)
    base = next(
        (p for p in points if p.variant == GAP_BASELINE and p.ratio == point.ratio and p.classes == point.classes),
        None,
    )
    if ref is None or base is None or ref is point:
        return NO_STAT
    r1 = "recall@1"
    theirs = {
        r.seed: (r.values.get(r1), u.values.get(r1)) for r in ref.finished for u in base.finished if u.seed == r.seed
    }
    out = []
    for r in point.finished:
        full, uniform = theirs.get(r.seed, (None, None))
        mine = r.values.get(r1)
        if finite_number(mine) and finite_number(full) and finite_number(uniform) and full != uniform:
            out.append(100 * (mine - uniform) / (full - uniform))
    return summarise(out)


def _ref_text(summary: StudySummary) -> str:
    refs = sorted({p.ratio for p in summary.points if (r := reference_of(p, summary.points)) is p and r is not None})
    return (
        "ratio 1"
        if refs == [1.0]
        else "the largest ratio of each class count (" + ", ".join(f"{r:g}" for r in refs) + ")"
    )


def notes(summary: StudySummary) -> list[str]:
    """What a reader of the table must know: the reference, the spread, how speed is read."""
    repeats = max((len(p.repeats) for p in summary.points), default=0)
    spread = (
        f"mean ± standard deviation over {repeats} seeds (seed by seed against the reference)"
        if repeats > 1
        else "one seed per point: no spread (use --repeats for one)"
    )
    return [
        f"Relative figures compare each point with {_ref_text(summary)} at the same class count.",
        f"Values: {spread}. Speed: the {STEADY_STATE}; speed-up = the reference's step time / the point's.",
        "Δ recall@1, 95 % interval: the mean change in points of the seeds finished on both sides and the half-width "
        "of its Student-t 95 % interval; 'within noise' when that interval holds 0.",
        "Wall s: the whole run (start-up, evaluations and checkpoints included); its parts, of the MLflow run's time: "
        "start-up s (to the first training step: workers, data, the evaluation before training), steps s (in "
        "training steps, as time/step_ms logged them), eval and other s (evaluations, checkpoints, the models).",
    ]


# -- the table ------------------------------------------------------------------------------------------------
def table(summary: StudySummary) -> tuple[list[str], list[list[str]]]:
    """The study's table with the points as columns: what defines them, every measure and every relative."""
    pts = summary.points
    rows: list[list[str]] = [
        ["ratio", *(f"{p.ratio:g}" for p in pts)],
        ["classes", *(f"{p.classes:,}" for p in pts)],
    ]
    if any(p.variant for p in pts):
        rows.append(["variant", *(p.variant or MISSING for p in pts)])
    rows.append(["runs", *(f"{len(p.finished)}/{len(p.repeats)}" for p in pts)])
    refs = [reference_of(p, pts) for p in pts]
    for rel in summary.relatives:
        rows.append([rel.name, *(relative(p, r, rel).text(2) for p, r in zip(pts, refs))])
    rows.append(
        [
            "Δ recall@1, 95 % interval",
            *(paired_delta(p, r).verdict() if r is not None and r is not p else MISSING for p, r in zip(pts, refs)),
        ]
    )
    gaps = [gap_closed(p, pts) for p in pts]
    if any(g.n for g in gaps):
        rows.append([f"R@1 gap to {GAP_BASELINE} closed (%)", *(g.text(0) for g in gaps)])
    for m in summary.measures:
        rows.append([m.name, *(stat(p, m.name).text(m.digits) for p in pts)])
    return ["point", *(p.label for p in pts)], rows


def point_rows(summary: StudySummary) -> tuple[list[str], list[list[Any]]]:
    """``study.csv``: one row per point, every measure's and relative's mean and spread (None when absent)."""
    head = ["point", "ratio", "classes", "variant", "runs", "status"]
    for name in [*(r.name for r in summary.relatives), "gap closed %", *(m.name for m in summary.measures)]:
        head += [name, f"{name} sd"]
    head += ["Δ recall@1 95% low", "Δ recall@1 95% high", "verdict"]
    rows = []
    for p in summary.points:
        ref = reference_of(p, summary.points)
        row: list[Any] = [p.label, p.ratio, p.classes, p.variant, len(p.finished), p.status]
        figures = [*(relative(p, ref, r) for r in summary.relatives), gap_closed(p, summary.points)]
        for s in [*figures, *(stat(p, m.name) for m in summary.measures)]:
            row += [s.mean if s.n else None, s.sd]
        pd = paired_delta(p, ref) if ref is not p else PairedDelta((), NO_STAT)
        iv = pd.interval
        row += [*(iv if iv else (None, None)), pd.verdict() if pd.n else None]
        rows.append(row)
    return head, rows


def run_rows(summary: StudySummary) -> tuple[list[str], list[list[Any]]]:
    """``study_runs.csv``: one row per run, as measured."""
    head = ["point", "seed", "run", "status", *(m.name for m in summary.measures), "mlflow_run_id", "error"]
    rows = [
        [
            p.label,
            r.seed,
            r.run_name,
            r.status,
            *(r.values.get(m.name) for m in summary.measures),
            r.mlflow_run_id,
            r.error,
        ]
        for p in summary.points
        for r in p.repeats
    ]
    return head, rows


# -- plots ----------------------------------------------------------------------------------------------------
def _varies(values: Sequence[float], rel_tol: float = 1e-3) -> bool:
    vals = [v for v in values if finite_number(v)]
    return bool(vals) and max(vals) - min(vals) > rel_tol * max(1e-12, max(abs(v) for v in vals))


def delta_label(points: float) -> str:
    """A change of Recall@1 in points as a figure labels it, with the verdict's decimals (2 under a point):
    ``+0.15``, ``-2.1``, ``0.00`` (never ``+0.0`` for a change that is not 0)."""
    return _signed(points, 2 if abs(points) < 1 else 1)


@dataclass(frozen=True)
class _Series:
    """What a panel plots for a point: (mean, spread), and how the panel reads (reference line, zero-based)."""

    ylabel: str
    of: Callable[[Point], Stat]
    baseline: float | None
    zero: bool
    values: str | Callable[[float], str]
    dropped: Callable[[list[Point]], str]  # the note when it does not vary


def _values_text(what: str, name: str, digits: int, unit: str) -> Callable[[list[Point]], str]:
    """A dropped panel's note: measure ``name`` at each class count of the points it is given."""

    def text(done: list[Point]) -> str:  # its value at each class count
        counts = sorted({p.classes for p in done})
        values = [summarise([stat(p, name).mean for p in done if p.classes == n]).mean for n in counts]
        if len(counts) == 1:
            return f"{what} {values[0]:.{digits}f}{unit}"
        return f"{what} " + ", ".join(f"{v:.{digits}f}{unit} at {n:,} classes" for v, n in zip(values, counts))

    return text


def _tradeoff_series(summary: StudySummary) -> list[_Series]:
    pts = summary.points
    by = {r.kind: r for r in summary.relatives}
    out = []

    def rel_of(rel: Relative) -> Callable[[Point], Stat]:
        return lambda p: relative(p, reference_of(p, pts), rel)

    if "delta_points" in by:
        r = by["delta_points"]
        out.append(_Series(r.axis, rel_of(r), 0.0, False, delta_label, lambda d: "Recall@1: no change"))
    if "speedup" in by:
        r = by["speedup"]
        out.append(_Series(r.axis, rel_of(r), 1.0, True, "{:.2f}×", _values_text("step time", "step ms", 1, " ms")))
    if "factor" in by:
        r = by["factor"]
        memory = _values_text("classifier memory", "classifier MB", 3, " MB")
        out.append(_Series(r.axis, rel_of(r), 1.0, True, "{:.2f}×", memory))
    # the wall time only in its parts: start-up would otherwise read as a gain of the ratio
    steps = _values_text("time in training steps", "steps s", 1, " s")
    out.append(_Series("time in training steps per run (s)", lambda p: stat(p, "steps s"), None, True, "{:.1f}", steps))
    startup = _values_text("start-up", "start-up s", 0, " s")
    out.append(_Series("start-up per run (s)", lambda p: stat(p, "start-up s"), None, True, "{:.0f}", startup))
    return out


def wall_parts(point: Point) -> str | None:
    """``run 97 s: start-up 60 s, training steps 15.2 s, evaluation and the rest 22 s`` (means over the seeds;
    the total is the MLflow run's time, the sum of the parts); the study's wall time alone where the parts are
    missing; None without either."""
    a, b, c = (stat(point, n) for n in ("start-up s", "steps s", "eval and other s"))
    if a.n and b.n and c.n:
        return (
            f"run {a.mean + b.mean + c.mean:.0f} s: start-up {a.mean:.0f} s, training steps {b.mean:.1f} s, "
            f"evaluation and the rest {c.mean:.0f} s"
        )
    wall = stat(point, "wall s")
    return f"{wall.mean:.0f} s per run" if wall.n else None


def _shared(point: Point, points: Sequence[Point]) -> bool:
    """A point without a variant in a study with variants (its full softmax, trained once): on every line."""
    return not point.variant and any(p.variant for p in points)


def _panels(
    summary: StudySummary,
    series: list[_Series],
    x_of: Callable[[Point], float],
    group_of: Callable[[Point], Any],
    group_label: Callable[[Any], str],
) -> tuple[list[Panel], list[str]]:
    """The panels of ``series`` (one line per group, error bars from the seeds; a point shared by the variants
    on each of their lines); those whose values do not vary are left out, each with a note of its one value."""
    done = [p for p in summary.points if p.finished]
    own = {group_of(p) for p in done if not _shared(p, done)}
    # a shared point joins the variants' lines of its other coordinates, or forms its own line where there is none
    alone = {group_of(p) for p in done if _shared(p, done) and not any(g[1:] == group_of(p)[1:] for g in own)}
    groups = sorted(own | alone, key=lambda g: (str(type(g)), g))

    def member(p: Point, g: Any) -> bool:
        return group_of(p) == g or (_shared(p, done) and g not in alone and group_of(p)[1:] == g[1:])

    panels, dropped = [], []
    for s in series:
        stats = {id(p): s.of(p) for p in done}
        if not _varies([st.mean for st in stats.values() if st.n]):
            text = s.dropped(done)
            if any(st.n for st in stats.values()):
                dropped.append(text)
            continue
        lines, errors = {}, {}
        for g in groups:
            pts = sorted((p for p in done if member(p, g) and stats[id(p)].n), key=x_of)
            lines[group_label(g)] = ([x_of(p) for p in pts], [stats[id(p)].mean for p in pts])
            errors[group_label(g)] = [stats[id(p)].sd if stats[id(p)].sd is not None else float("nan") for p in pts]
        panels.append(
            Panel(
                s.ylabel,
                lines,
                [x_of(p) for p in done],
                errors=errors,
                baseline=s.baseline,
                zero=s.zero,
                values=s.values,
            )
        )
    return panels, dropped


def _line_label(summary: StudySummary) -> Callable[[Point], Any]:
    variants = any(p.variant for p in summary.points)
    return (lambda p: (p.variant, p.classes)) if variants else (lambda p: p.classes)


def _classes_name(g: Any) -> str:
    return (
        f"{g[0]}, {g[1]:,} classes"
        if isinstance(g, tuple) and g[0]
        else f"{g[-1] if isinstance(g, tuple) else g:,} classes"
    )


def plot_tradeoff(summary: StudySummary, path: Path) -> tuple[Path | None, list[str]]:
    """The study's figure against the ratio (see the module doc); None when no panel has anything to show."""
    panels, dropped = _panels(
        summary, _tradeoff_series(summary), lambda p: p.ratio, _line_label(summary), _classes_name
    )
    note = "Not plotted, the same at every ratio:\n" + "\n".join(dropped) if dropped else ""
    told = [f"{p.label}: {pd.verdict()}; {ref.label} at {pd.reference.text(4)}" for p, ref, pd in verdicts(summary)]
    if any(pd.n for _, _, pd in verdicts(summary)):
        note = "\n".join(
            x for x in ("Δ Recall@1 against the reference, 95 % interval over paired seeds:", *told, note) if x
        )
    if not panels:
        return None, dropped
    ref = _ref_text(summary)
    reps = max(len(p.repeats) for p in summary.points)
    spread = f"bars: ± 1 s.d. over {reps} seeds" if reps > 1 else "one seed per point"
    plot_panels(
        panels,
        path,
        xlabel="class sampling ratio (share of classes in each softmax)",
        title=f"What subsampling costs and saves, against {ref} ({spread})",
        cols=2 if len(panels) > 1 else 1,
        panel_size=(5.0, 3.4),
        note=note or None,
    )
    return path, dropped


def plot_recall_vs_ratio(summary: StudySummary, path: Path) -> Path | None:
    """Recall@K (%) against the ratio, one panel per class count (NormSoftmax Fig. 4), zero-based, with spread."""
    done = [p for p in summary.points if p.finished]
    if not done:
        return None
    panels = []
    for n in sorted({p.classes for p in done}):
        pts = sorted((p for p in done if p.classes == n), key=lambda p: (p.variant, p.ratio))
        lines, errors = {}, {}
        for k in summary.ks:
            for v in sorted({p.variant for p in pts if not _shared(p, done)}):
                sel = [(p, stat(p, f"recall@{k}")) for p in pts if p.variant == v or _shared(p, done)]
                sel.sort(key=lambda ps: ps[0].ratio)
                sel = [(p, s) for p, s in sel if s.n]
                label = f"R@{k}" + (f" {v}" if v else "")
                lines[label] = ([p.ratio for p, _ in sel], [100 * s.mean for _, s in sel])
                errors[label] = [100 * s.sd if s.sd is not None else float("nan") for _, s in sel]
        panels.append(
            Panel("Recall@K (%)", lines, [p.ratio for p in pts], title=f"{n:,} classes", errors=errors, zero=True)
        )
    return plot_panels(
        panels,
        path,
        xlabel="class sampling ratio",
        title="Recall@K against the share of classes in each softmax",
        cols=len(panels),
        panel_size=(4.5, 3.6),
    )


def plot_vs_classes(summary: StudySummary, path: Path) -> tuple[Path | None, list[str]]:
    """The change of Recall@1 and the speed-up, and the step time and the classifier's memory themselves
    (which grow with the classes), against the number of classes, one line per ratio (and variant)."""
    series = _tradeoff_series(summary)[:2]
    series += [
        _Series(
            "time per step (ms)",
            lambda p: stat(p, "step ms"),
            None,
            True,
            "{:.0f}",
            _values_text("step time", "step ms", 1, " ms"),
        ),
        _Series(
            "classifier memory (MB, rank 0)",
            lambda p: stat(p, "classifier MB"),
            None,
            True,
            "{:.3g}",
            lambda d: "memory",
        ),
    ]
    variants = any(p.variant for p in summary.points)
    group = (lambda p: (p.variant, p.ratio)) if variants else (lambda p: p.ratio)
    name = (lambda g: f"{g[0] + ', ' if g[0] else ''}ratio {g[1]:g}") if variants else (lambda g: f"ratio {g:g}")
    panels, dropped = _panels(summary, series, lambda p: float(p.classes), group, name)
    if not panels:
        return None, dropped
    plot_panels(
        panels,
        path,
        xlabel="number of classes",
        title=f"The trade-off against the number of classes (relative to {_ref_text(summary)})",
        cols=2,
        panel_size=(5.0, 3.4),
        note=("Not plotted, the same at every point:\n" + "\n".join(dropped)) if dropped else None,
    )
    return path, dropped


def plot_curve(summary: StudySummary, measure: Measure, path: Path) -> Path | None:
    """``measure``'s history against the step, one line per point (the mean over its seeds at each step)."""
    data = {}
    for p in summary.points:
        by_step: dict[int, list[float]] = {}
        for r in p.finished:
            for step, value in r.curves.get(measure.name, []):
                if finite_number(value):
                    by_step.setdefault(int(step), []).append(float(value))
        if by_step:
            steps = sorted(by_step)
            data[p.label] = (steps, [statistics.fmean(by_step[s]) for s in steps])
    if not data:
        return None
    reps = max(len(p.repeats) for p in summary.points)
    counts = sorted({p.classes for p in summary.points if p.label in data})
    return plot_curves(
        data,
        path,
        measure.name,
        f"{measure.about or measure.name}\nover training" + (f", the mean over {reps} seeds" if reps > 1 else ""),
        run_colors(list(data)),
        ylim=measure.ylim,
        zero=measure.zero,
        levels=chance_levels(counts) if measure.chance else None,
    )


def chance_levels(classes: Sequence[int]) -> dict[str, float]:
    """The loss of a softmax that gives every class the same probability, ln C, per class count: where a
    softmax loss starts (an untrained model) and what it falls from."""
    return {f"ln C = {math.log(n):.2f}: a uniform softmax over {n:,} classes": math.log(n) for n in classes if n > 1}


# -- files, MLflow and the terminal ---------------------------------------------------------------------------
def write_outputs(summary: StudySummary) -> dict[str, Path]:
    """study.md, study.csv, study_runs.csv and the plots under ``summary.out_dir`` (each written atomically)."""
    out = summary.out_dir
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    figures: dict[str, Path] = {}
    tradeoff, dropped = plot_tradeoff(summary, out / "tradeoff.png")
    if tradeoff:
        figures["tradeoff.png"] = tradeoff
    recall = plot_recall_vs_ratio(summary, out / "recall_vs_ratio.png")
    if recall:
        figures["recall_vs_ratio.png"] = recall
    if len({p.classes for p in summary.points}) > 1:
        vs, _ = plot_vs_classes(summary, out / "vs_classes.png")
        if vs:
            figures["vs_classes.png"] = vs
    for m in summary.measures:
        if m.curve and (curve := plot_curve(summary, m, out / f"{m.mlflow}.png")):
            figures[f"{m.mlflow}.png"] = curve
    head, rows = table(summary)
    lines = [f"# Class-subsampling study {summary.name}", ""]
    told = [(p, ref, pd) for p, ref, pd in verdicts(summary) if pd.n]
    if told:
        lines += ["What each point loses against its reference:", ""]
        lines += [f"- **{p.label}**: Δ Recall@1 {pd.sentence(ref.label)}" for p, ref, pd in told] + [""]
    lines += [markdown_table(head, rows), ""]
    lines += [f"- {n}" for n in notes(summary)]
    if dropped:
        lines.append("- Not plotted (the same at every ratio): " + "; ".join(dropped) + ".")
    failed = [r for r in summary.runs if r.error]
    lines += [f"- {r.run_name} failed: {r.error}" for r in failed]
    described = {
        "tradeoff.png": "the change of Recall@1 (each point's verdict in its note), the speed-up of a steady step, "
        "the memory factor, the time in training steps and the start-up against the ratio, those that vary",
        "recall_vs_ratio.png": "Recall@K against the ratio",
        "vs_classes.png": "the trade-off and the step time against the number of classes",
        **{
            f"{m.mlflow}.png": f"{m.about or m.name} over training, one line per point"
            for m in summary.measures
            if m.curve
        },
    }
    if figures:
        lines += ["", "Figures, beside this file:"] + [f"- `{n}`: {described.get(n, '')}" for n in figures]
    files["study.md"] = out / "study.md"
    write_text(files["study.md"], "\n".join(lines) + "\n")
    files["study.csv"] = out / "study.csv"
    write_text(files["study.csv"], csv_text(*point_rows(summary)))
    files["study_runs.csv"] = out / "study_runs.csv"
    write_text(files["study_runs.csv"], csv_text(*run_rows(summary)))
    return files | figures


CHANGE_PREFIX, VALUE_PREFIX = "change/", "value/"  # MLflow sorts sections by name: the trade-off first
#: a relative's value at the reference itself, where it anchors its chart's line (no change, 1×)
IDENTITY = {"delta_points": 0.0, "speedup": 1.0, "factor": 1.0}


def parent_metrics(summary: StudySummary) -> dict[str, dict[int, float]]:
    """The parent run's metrics: one per quantity, its value at each point logged at the point's index in
    ``summary.points`` as the step (the order of the ``study.points`` param), so that MLflow's charts show one
    chart per quantity across the points, not one single-bar chart per point. ``change/<relative>`` against
    the reference (at the reference itself its identity: Δ 0, 1×, so that the line starts there),
    ``change/delta_recall_at_1_ci95_half`` and ``change/gap_closed_percent`` where they exist, and
    ``value/<measure>``: each point's mean over its seeds, :func:`rounded` (the wall time only in its parts). A quantity whose values are the
    same at every point (a memory factor of 1 where the draw keeps the whole classifier) is left out: a
    chart of a constant says nothing the description does not."""
    series: dict[str, dict[int, float]] = {}

    def put(key: str, step: int, value: float) -> None:
        if finite_number(value):
            series.setdefault(key, {})[step] = rounded(value)

    for i, p in enumerate(summary.points):
        ref = reference_of(p, summary.points)
        for rel in summary.relatives:
            if ref is p:
                put(f"{CHANGE_PREFIX}{rel.mlflow}", i, IDENTITY.get(rel.kind, float("nan")))
            elif (s := relative(p, ref, rel)).n:
                put(f"{CHANGE_PREFIX}{rel.mlflow}", i, s.mean)
        if ref is not None and ref is not p and (half := paired_delta(p, ref).half) is not None:
            put(f"{CHANGE_PREFIX}delta_recall_at_1_ci95_half", i, half)
        if (g := gap_closed(p, summary.points)).n:
            put(f"{CHANGE_PREFIX}gap_closed_percent", i, g.mean)
        for m in summary.measures:  # the wall time only in its parts, as the figure: start-up is not the ratio's gain
            if m.mlflow and m.source != "wall" and (s := stat(p, m.name)).n:
                put(f"{VALUE_PREFIX}{m.mlflow}", i, s.mean)
    return {k: v for k, v in series.items() if len(v) < 2 or len(set(v.values())) > 1}


def chart_steps(summary: StudySummary) -> str:
    """What the steps of the parent's charts are: ``step 0 r1-c500 (reference), step 1 r0.1-c500``."""
    return ", ".join(
        f"{i} {p.label}" + (" (reference)" if reference_of(p, summary.points) is p else "")
        for i, p in enumerate(summary.points)
    )


def rounded(x: float, significant: int = 4) -> float:
    """``x`` to ``significant`` digits, so that MLflow shows ``0.01``, not ``0.009999999999999998`` (and ``0``, not
    ``-0``)."""
    return float(f"{x:.{significant}g}") + 0.0 if finite_number(x) else x


def describe_study(summary: StudySummary, config_line: str) -> str:
    """The parent run's description: what was compared, and per point what it loses and gains."""
    seeds = max((len(p.repeats) for p in summary.points), default=0)
    lines = [
        f"**Class-subsampling study: {len(summary.points)} points × {seeds} seed{'s' * (seeds != 1)}: "
        f"what each share of classes loses and gains against {_ref_text(summary)}**",
        "",
        "### Results",
        "",
    ]
    refs, others = [], []
    for p in summary.points:
        ref = reference_of(p, summary.points)
        step = stat(p, "step ms")
        if not p.finished:
            others.append(f"- **{p.label}**: failed")
            continue
        if ref is p:  # the baseline: its own figures, not a change of 0 against itself
            shown = [f"{step.mean:.1f} ms per step" if step.n else None, wall_parts(p)]
            refs.append(f"- **{p.label}** (the reference): " + ", ".join(x for x in shown if x))
            continue
        by = {r.kind: relative(p, ref, r) for r in summary.relatives}
        sp, mem = (by.get(k, NO_STAT) for k in ("speedup", "factor"))
        pd = paired_delta(p, ref)
        gap = gap_closed(p, summary.points)
        parts = [
            f"Δ Recall@1 {pd.sentence(ref.label)}" if ref is not None and pd.n else None,
            f"{gap.text(0)}% of the {GAP_BASELINE} draw's Recall@1 gap closed" if gap.n else None,
            f"{sp.text(2)}× step speed" if sp.n else None,
            f"classifier memory {mem.text(2)}×" if mem.n else None,
            wall_parts(p),
        ]
        others.append(f"- **{p.label}**: " + ", ".join(x for x in parts if x))
    lines += others + refs
    lines += ["", "### Setup", "", config_line, "", *(f"- {n}" for n in notes(summary))]
    if parent_metrics(summary):
        lines.append(
            "- This run's charts: one per quantity (change/ against the reference, value/ each point's mean), "
            f"the points along the x axis, step = point: {chart_steps(summary)}."
        )
    return "\n".join(lines)


def render(summary: StudySummary) -> str:
    head, rows = table(summary)
    lines = [markdown_table(head, rows), "", *notes(summary), ""]
    for r in summary.runs:
        if r.error:
            lines.append(f"{r.run_name} failed: {r.error}")
    runs = summary.runs
    lines.append(
        f"study {summary.name}: {sum(p.status == 'finished' for p in summary.points)}/{len(summary.points)} points, "
        f"{sum(r.status == 'finished' for r in runs)}/{len(runs)} runs finished in {summary.seconds:.0f}s"
    )
    lines.append("files: " + ", ".join(str(p) for p in summary.files.values()))
    if summary.parent_run_id:
        lines.append(f"MLflow parent run: {summary.parent_url or summary.parent_run_id}")
    return redact_url("\n".join(lines))
