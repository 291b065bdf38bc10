"""``dmltrain study subsampling``: what class subsampling loses and gains, against the share of classes in
each softmax and the number of classes.

``dmltrain study subsampling CONFIG [overrides] --ratios 1,0.1,0.01 [--classes 1e4,1e5] [--repeats 3]``
trains the config once per point and seed: a point is a ratio × a class count (× a variant, an
axis later studies add), each repeat a Ray Train V2 training exactly as ``dmltrain train`` runs it,
with ``loss.classifier.sample_ratio`` set to the point's ratio and ``train.seed`` to the study's
seed plus the repeat's index: NormSoftmax sec. 4.5, where each step's softmax holds the batch's
classes plus uniformly drawn others, up to that share of all classes.
``configs/study/sop_synthetic.yaml`` is the built-in study: synthetic data at the scale of Stanford
Online Products (11,318 classes × 5 images); a real dataset's shards work the same way.

Shards are reused: every ratio of a class count trains on the same shards. ``--classes`` (integers or
``1e4`` notation) needs a synthetic config: the shards for ``N`` classes are built once, beside
``data.shards`` (``<data.shards>-<N>c``, or ``data.shards`` itself when ``N`` is
``data.synthetic.classes``), and found there by later studies.

The answer is relative: each point against the largest ratio of its class count (ratio 1 when the
study has it), seed by seed: the change of Recall@1 in points, the speed-up of a step, the
classifier memory as a factor, with their spread over the seeds, and the wall time of a run
(:mod:`dmltrain.studies.results`, which holds the points, the table, the plots and what the parent run
shows). Everything hangs under one MLflow parent run: the runs are its children (named with their
point first: ``r0.1-c100k-s1-<study>``), the table, the CSVs and the plots its artifacts, each
figure one of its metrics with the points along its steps (one chart per figure), and its description says
per point what it loses and gains. A run that fails is reported in the table and the others go on. Running the study again with
the same ``--name`` finds the runs already trained (they are resumed and end at once) and trains the
rest.

``--sampling uniform,hard,mixed`` adds the class draw as an axis (``loss.classifier.sampling``, one variant
per mode; the ratio-1 point, a full softmax, is trained once and is every mode's reference) and turns
the classifier's probe on (``loss.classifier.probe_every``, ``--probe-every``, default the config's or
``train.log_every``): the table then says, per mode and ratio, what share of the uniform draw's Recall@1
gap the mode closes, and the probe's gradient cosine, in the table and over training (``grad_cos.png``),
and its loss gaps (the run's draw, and a uniform draw of the same size on the same model) in the table.

Every study turns the probe on (every ``train.log_every`` steps unless set): its full-softmax loss on the
step's batch is the loss that means the same at every ratio (``full-softmax loss`` in the table,
``full_loss.png`` over training); ``batch/loss``, a softmax over the drawn classes only, is lower the fewer
are drawn and is not compared.

Runs train one at a time by default, so their speed figures are comparable; ``--parallel N`` runs
N at once when only the accuracy matters.

This module runs the study (inputs, the points' shards and configs, the measurements, the CLI);
MLflow goes through :mod:`dmltrain.tracking`, tables through :mod:`dmltrain.text` and plots
through :mod:`dmltrain.evaluate.plots`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cluster.launch import RunGroup, fixed_workers, init_ray, prepare_data, prepare_driver, train
from cluster.run_location import check_name
from dmltrain.config import SAMPLING_MODES, build_config, load_config
from dmltrain.config_tree import set_dotted
from dmltrain.errors import UserError
from dmltrain.studies.results import (
    Measure,
    Point,
    Repeat,
    StudySummary,
    default_measures,
    describe_study,
    full_loss_measure,
    parent_metrics,
    point_label,
    probe_measures,
    render,
    timeline,
    write_outputs,
)
from dmltrain.text import finite_number, one_line
from dmltrain.tracking.description import loss_line
from dmltrain.tracking.names import STEP_MS, STUDY_POINT_TAG, STUDY_REPEAT_TAG
from dmltrain.tracking.queries import history, steady_state
from dmltrain.tracking.run import RunHandle
from shards.build.synthetic import build_from_config
from shards.config import MAX_SYNTHETIC_CLASSES, MAX_SYNTHETIC_IMAGES
from shards.manifest import Manifest
from shards.storage.location import is_url, location_of


# -- inputs -----------------------------------------------------------------------------------------------
def _parse_list(text: str, flag: str, kind: type, what: str, example: str) -> list:
    """The comma-separated ``kind`` values of ``flag`` (blanks ignored); one-line :class:`UserError` otherwise."""
    out = []
    for token in (t.strip() for t in text.split(",")):
        if token:
            try:
                out.append(kind(token))
            except ValueError:
                raise UserError(f"{flag}: '{token}' is not {what}") from None
    if not out:
        raise UserError(f"{flag}: give at least one value, e.g. {flag} {example}")
    return out


def parse_ratios(text: str) -> list[float]:
    """``1,0.1,0.01`` -> ``[1.0, 0.1, 0.01]`` (deduplicated, largest first); each in (0, 1]."""
    out = _parse_list(text, "--ratios", float, "a number", "1,0.1,0.01")
    for r in out:
        if not 0 < r <= 1 or not math.isfinite(r):
            raise UserError(f"--ratios: {r:g} is not a share of classes in (0, 1]")
    return sorted(set(out), reverse=True)


def parse_sampling(text: str | None) -> list[str] | None:
    """``uniform,hard`` -> ``["uniform", "hard"]`` (deduplicated, in the order given); ``None`` stays ``None``."""
    if text is None:
        return None
    out = list(dict.fromkeys(_parse_list(text, "--sampling", str, "a mode", "uniform,hard,mixed")))
    for mode in out:
        if mode not in SAMPLING_MODES:
            raise UserError(f"--sampling: '{mode}' is not a sampling mode ({', '.join(SAMPLING_MODES)})")
    return out


def sampling_variants(modes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The study's variants of ``--sampling``: one per mode, setting ``loss.classifier.sampling``."""
    return [(mode, {"loss.classifier.sampling": mode}) for mode in modes]


def parse_classes(text: str | None) -> list[int] | None:
    """``1000,1e4`` -> ``[1000, 10000]`` (deduplicated, ascending); each a whole number of at least 2;
    ``None`` stays ``None``."""
    if text is None:
        return None
    out = []
    for value in _parse_list(text, "--classes", float, "a number", "1e4,1e5,1e6"):
        if not math.isfinite(value) or value != int(value):
            raise UserError(f"--classes: {value:g} is not a whole number of classes")
        out.append(int(value))
    for n in out:
        if n < 2:
            raise UserError(f"--classes: {n} classes is too few (at least 2)")
    return sorted(set(out))


def synthetic_shards_dir(cfg, classes: int) -> Path:
    """Where the synthetic shards of ``classes`` classes live for this config."""
    base = Path(cfg.data.shards).expanduser()
    if cfg.data.synthetic is not None and classes == cfg.data.synthetic.classes:
        return base
    return base.parent / f"{base.name}-{classes}c"


def check_synthetic_sizes(classes: list[int], per_class: int) -> None:
    """Refuse, before any shard is built, a class count no synthetic set can have: more than
    :data:`~shards.config.MAX_SYNTHETIC_CLASSES`, or ``classes x data.synthetic.per_class`` images per split beyond
    :data:`~shards.config.MAX_SYNTHETIC_IMAGES` (the one line names the ``per_class`` that fits: 10^6 classes
    take 2 images each)."""
    for n in classes:
        if n > MAX_SYNTHETIC_CLASSES:
            raise UserError(
                f"--classes: {n:,} classes is more than the {MAX_SYNTHETIC_CLASSES:,} a synthetic set may have"
            )
        if n * per_class > MAX_SYNTHETIC_IMAGES:
            raise UserError(
                f"--classes: {n:,} classes x data.synthetic.per_class={per_class} = {n * per_class:,} images per split, "
                f"more than the {MAX_SYNTHETIC_IMAGES:,} a synthetic set may have; set data.synthetic.per_class="
                f"{max(1, MAX_SYNTHETIC_IMAGES // n)} or fewer classes"
            )


def prepare_shards(cfg, classes: list[int] | None, progress: bool = True) -> dict[int, str]:
    """Class count -> shard directory, building missing synthetic shards once (``--classes``)."""
    s = cfg.data.synthetic
    if not classes or s is None:
        prepare_data(
            cfg, progress=progress
        )  # the config's own shards (built when synthetic and missing) and its splits
        shards = location_of(cfg.data)  # a local folder or a URL
        own = Manifest.load(shards).split(cfg.data.train_split).num_classes
        if classes and classes != [own]:
            raise UserError(
                f"--classes: {cfg.data.shards} is a dataset with {own} train classes; other class counts need a "
                "synthetic config (data.synthetic)"
            )
        return {own: shards.root if shards.remote else str(shards.path.resolve())}
    if is_url(cfg.data.shards):
        raise UserError(
            f"--classes: synthetic shards for other class counts are built beside data.shards on local disk; "
            f"{cfg.data.shards} is a URL"
        )
    check_synthetic_sizes(classes, s.per_class)
    out = {}
    for n in classes:
        d = synthetic_shards_dir(cfg, n)
        if not (d / "manifest.json").exists():
            print(
                f"building synthetic shards for {n} classes in {d} ({n} x {s.per_class} images, {s.image_size}px"
                + (f", {s.test_classes} test classes)" if s.test_classes is not None else ")"),
                file=sys.stderr,
            )
            build_from_config(d, s, classes=n, progress=progress)
        split = Manifest.load(d).split(cfg.data.train_split)
        if split.num_classes != n or split.num_images != n * s.per_class:
            raise UserError(
                f"{d}: holds {split.num_classes} classes x {split.num_images // max(1, split.num_classes)} images, "
                f"not the {n} x {s.per_class} this study needs; remove the folder to rebuild it"
            )
        prepare_data(
            cfg.model_copy(update={"data": cfg.data.model_copy(update={"shards": str(d)})})
        )  # the eval splits exist
        out[n] = str(d.resolve())
    return out


def plan_points(
    ratios: list[float],
    shards: dict[int, str],
    repeats: int,
    study: str,
    seed: int,
    variants: list[tuple[str, dict[str, Any]]] | None = None,
    full_once: bool = False,
) -> list[Point]:
    """Every (variant, class count, ratio) point with its overrides and its repeats (seeds ``seed + i``),
    each run named with its point first: ``r0.1-c100k-<study>`` (``-s<seed>`` before the study with
    repeats). ``variants``: a further axis, ``(label, overrides)`` each (default: one without either);
    ``full_once``: the variants act only under subsampling (the class draw), so ratio 1 is one point
    without a variant."""
    points = []
    full_done: set[int] = set()
    for variant, extra in variants or [("", {})]:
        for n, d in shards.items():
            for r in ratios:
                if full_once and r >= 1:
                    if n in full_done:
                        continue
                    full_done.add(n)
                    variant_r, extra_r = "", {}
                else:
                    variant_r, extra_r = variant, extra
                label = point_label(r, n, variant_r)
                overrides = {
                    "loss.classifier.sample_ratio": r,
                    "data.shards": d,
                    "data.synthetic.classes": n,
                    **extra_r,
                }
                p = Point(r, n, d, label, overrides, variant_r)
                for i in range(repeats):
                    s = seed + i
                    p.repeats.append(Repeat(s, f"{label}-s{s}-{study}" if repeats > 1 else f"{label}-{study}"))
                points.append(p)
    return points


def point_config(cfg, point: Point, repeat: Repeat, runs_root: str):
    """The config of one run: the point's overrides, the repeat's seed and run name, the study's storage.

    ``data.synthetic.classes`` applies to a synthetic config only. A value the config refuses is a
    one-line :class:`~dmltrain.errors.ConfigError` naming the point."""
    tree = cfg.to_dict()
    over = {
        **point.overrides,
        "train.seed": repeat.seed,
        "train.run_name": repeat.run_name,
        "cluster.storage_path": runs_root,
    }
    if tree["data"].get("synthetic") is None:
        over.pop("data.synthetic.classes", None)
    for key, value in over.items():
        set_dotted(tree, key, value)
    return build_config(tree, source=f"study point {point.label}")


def study_params(cfg, points: list[Point], repeats: int) -> dict[str, Any]:
    """The parent run's params: the config the points share (without what they set: the ratio, the
    shards, the class count, the seed, the run name), and the study's axes."""
    varied = {k for p in points for k in p.overrides} | {"train.seed", "train.run_name", "cluster.storage_path"}
    shared = {k: v for k, v in cfg.flat().items() if k not in varied and not k.startswith("data.synthetic.classes")}
    return {
        **shared,
        "study.kind": "subsampling",
        "study.ratios": ",".join(f"{r:g}" for r in sorted({p.ratio for p in points}, reverse=True)),
        "study.classes": ",".join(str(n) for n in sorted({p.classes for p in points})),
        "study.repeats": repeats,
        "study.seeds": ",".join(str(r.seed) for r in points[0].repeats) if points else "",
        "study.points": ",".join(p.label for p in points),
        **(
            {"study.variants": ",".join(v)}
            if (v := list(dict.fromkeys(p.variant for p in points if p.variant)))
            else {}
        ),
    }


# -- measurements -------------------------------------------------------------------------------------------
def summarise_history(values: list[float], how: str) -> float:
    """One figure from a metric's logged values: ``steady`` (:func:`~dmltrain.tracking.queries.steady_state`),
    ``max``, ``mean`` or ``last``; NaN without values."""
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan")
    if how == "steady":
        return steady_state(vals)
    if how == "max":
        return float(max(vals))
    if how == "last":
        return float(vals[-1])
    return float(sum(vals) / len(vals))


def run_measures(uri: str, run_id: str | None, measures: list[Measure]) -> dict[str, float]:
    """The ``metric``, ``tag`` and recorded ``wall`` measures of a run from MLflow (NaN when tracking was off or
    one is absent)."""
    wanted = [m for m in measures if m.source in ("metric", "tag", "wall", "timeline")]
    out = {m.name: float("nan") for m in wanted}
    if run_id is None or not wanted:
        return out

    def read(client) -> dict[str, float]:
        run = client.get_run(run_id)
        tags = run.data.tags
        got = {}
        if any(m.source == "timeline" for m in wanted):
            windows = [(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, STEP_MS)]
            try:
                accum = max(1, int(run.data.params.get("train.grad_accum", 1)))
            except ValueError:
                accum = 1
            parts = timeline(run.info.start_time, run.info.end_time, windows, accum)
        for m in wanted:
            if m.source == "timeline":
                got[m.name] = parts.get(m.key, float("nan"))
            elif m.source in ("tag", "wall"):
                try:
                    got[m.name] = float(tags[m.key])
                except (KeyError, ValueError):
                    got[m.name] = float("nan")
            else:
                got[m.name] = summarise_history([v for _, v in history(client, run_id, m.key)], m.how)
        return got

    # the accuracy columns stand without these
    out.update(RunHandle(uri, run_id, owner="the study").query(f"read the metrics of MLflow run {run_id}", read, {}))
    return out


def run_curves(uri: str, run_id: str | None, measures: list[Measure]) -> dict[str, list[tuple[int, float]]]:
    """The ``(step, value)`` history of every curve measure of a run (empty when tracking was off)."""
    wanted = [m for m in measures if m.curve]
    if run_id is None or not wanted:
        return {}

    def read(client) -> dict[str, list[tuple[int, float]]]:
        return {m.name: history(client, run_id, m.key) for m in wanted}

    return RunHandle(uri, run_id, owner="the study").query(f"read the curves of MLflow run {run_id}", read, {})


# -- the study -----------------------------------------------------------------------------------------------
def _train_repeat(
    cfg,
    point: Point,
    repeat: Repeat,
    runs_root: str,
    parent_run_id: str | None,
    progress: bool,
    index: str,
    measures: list[Measure],
    ui_url: str | None = None,
) -> Repeat:
    """Train one run of ``point`` and read its ``measures``; a failure is recorded on ``repeat``, never
    raised (a user error, which would fail every run alike, is)."""
    pcfg = point_config(cfg, point, repeat, runs_root)
    what = f"{point.label} seed {repeat.seed}"
    print(f"{index} {what}: started (run {repeat.run_name})", file=sys.stderr, flush=True)
    try:
        summary = train(
            pcfg, progress=progress, config_name=repeat.run_name, parent_run_id=parent_run_id, ui_url=ui_url
        )
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — one failed run does not end the study
        repeat.status, repeat.error = "failed", one_line(e)
        print(f"{index} {what}: FAILED ({repeat.error})", file=sys.stderr, flush=True)
        return repeat
    repeat.mlflow_run_id, repeat.storage_dir, repeat.seconds = (
        summary.mlflow_run_id,
        summary.storage_dir,
        summary.seconds,
    )
    repeat.final = dict((summary.metrics or {}).get("final") or {})
    repeat.values = {m.name: repeat.final.get(m.key, float("nan")) for m in measures if m.source == "eval"}
    repeat.values.update(run_measures(summary.tracking_uri, summary.mlflow_run_id, measures))
    repeat.curves = run_curves(summary.tracking_uri, summary.mlflow_run_id, measures)
    repeat.status = "finished" if summary.ok else "failed"
    repeat.error = None if summary.error is None else one_line(summary.error)
    tags = {STUDY_POINT_TAG: point.label, STUDY_REPEAT_TAG: repeat.seed - cfg.train.seed}
    for m in measures:  # the wall time of this training, unless an earlier study recorded the run's own
        if m.source == "wall" and not finite_number(repeat.values.get(m.name)):
            repeat.values[m.name] = summary.seconds
            if summary.ok:
                tags[m.key] = f"{summary.seconds:.1f}"
    if summary.mlflow_run_id:
        RunHandle(summary.tracking_uri, summary.mlflow_run_id, owner="the study").set_tags(tags)
    if summary.ok:
        r1, step = repeat.values.get("recall@1", float("nan")), repeat.values.get("step ms", float("nan"))
        print(
            f"{index} {what}: finished in {summary.seconds:.0f}s"
            + (f", recall@1 {r1:.4f}" if finite_number(r1) else "")
            + (f", {step:.0f} ms per step" if finite_number(step) else ""),
            file=sys.stderr,
            flush=True,
        )
    else:
        print(f"{index} {what}: FAILED after {summary.seconds:.0f}s ({repeat.error})", file=sys.stderr, flush=True)
    return repeat


def _note_small_draws(cfg, points: list[Point]) -> None:
    """Say where a ratio draws fewer classes than a batch holds (each softmax is then just the batch's)."""
    for p in points:
        drawn = int(p.ratio * p.classes + 0.5)  # the draw's count before the batch's classes (class_sampling)
        if drawn < cfg.data.P:
            print(
                f"note: {p.label}: ratio {p.ratio:g} x {p.classes} classes = {drawn} < the {cfg.data.P} classes of a "
                "batch: each softmax holds just the batch's classes",
                file=sys.stderr,
            )


def run_study(
    cfg,
    ratios: list[float],
    classes: list[int] | None = None,
    *,
    repeats: int = 1,
    name: str | None = None,
    out: str | Path | None = None,
    parallel: int = 1,
    progress: bool = True,
    config_name: str | None = None,
    variants: list[tuple[str, dict[str, Any]]] | None = None,
    measures: list[Measure] | None = None,
    full_once: bool = False,
    ui_url: str | None = None,
) -> StudySummary:
    """Train every point ``repeats`` times (see the module doc), write the table and plots, log them to the
    parent run; returns the summary. ``variants``: a further axis of points, ``(label, dotted overrides)``
    each (:func:`plan_points`, ``full_once`` too); ``measures``: what is read of each run (default:
    :func:`default_measures`; a study that logs more, such as the gradient probe, adds its own); ``ui_url``:
    the MLflow UI the printed parent link points into (default: the tracking server's, or ``mlflow ui``'s)."""
    started = time.time()
    if cfg.loss.classifier is None:
        raise UserError(
            "loss.classifier: a class-subsampling study needs a classifier loss (it is null in this config)"
        )
    if parallel < 1:
        raise UserError(f"--parallel {parallel}: must be at least 1")
    if repeats < 1:
        raise UserError(f"--repeats {repeats}: must be at least 1")
    if name is not None:  # the study is the folder <root>/<name>
        check_name(name, "--name", "study")
    shards: dict[int, str] = {}

    def shard_sets(c):  # every class count's shards (built when missing), each checked as a training
        shards.update(prepare_shards(c, classes, progress=progress))
        return [c.model_copy(update={"data": c.data.model_copy(update={"shards": d})}) for d in shards.values()]

    fixed_workers(cfg, "study")
    cfg = prepare_driver(cfg, shard_sets)
    study = RunGroup.place(cfg, "study", name=name, config_name=config_name, out=out)
    name, out_dir, runs_root = study.name, study.out_dir, study.runs_root
    points = plan_points(ratios, shards, repeats, name, cfg.train.seed, variants, full_once)
    measures = measures or default_measures(cfg.eval.ks)
    for p in points:  # every run's config is checked before anything starts
        point_config(cfg, p, p.repeats[0], runs_root)
    parent = study.open(cfg, study_params(cfg, points, repeats), owner="the study").parent
    runs = [(p, r) for i in range(repeats) for p in points for r in p.repeats[i : i + 1]]  # seed by seed
    print(
        f"study {name}: {len(points)} point{'s' * (len(points) != 1)} (ratios {', '.join(f'{r:g}' for r in ratios)} x "
        f"{', '.join(str(n) for n in shards)} classes) x {repeats} seed{'s' * (repeats != 1)} = {len(runs)} runs"
        + (f"; MLflow parent run {parent.url(ui=ui_url) or parent.run_id}" if parent.run_id else ""),
        file=sys.stderr,
        flush=True,
    )
    _note_small_draws(cfg, points)
    if not cfg.tracking.enabled:
        print(
            "dmltrain: warning: tracking.enabled is false: the speed and memory columns come from the points' MLflow runs "
            "and stay empty",
            file=sys.stderr,
        )
    init_ray(cfg)
    live = progress and parallel == 1  # one live progress line at a time
    try:
        if parallel == 1:
            for i, (p, r) in enumerate(runs):
                _train_repeat(cfg, p, r, runs_root, parent.run_id, live, f"[{i + 1}/{len(runs)}]", measures, ui_url)
        else:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                futures = [
                    pool.submit(
                        _train_repeat,
                        cfg,
                        p,
                        r,
                        runs_root,
                        parent.run_id,
                        False,
                        f"[{i + 1}/{len(runs)}]",
                        measures,
                        ui_url,
                    )
                    for i, (p, r) in enumerate(runs)
                ]
                for f in futures:
                    f.result()
    except BaseException:
        parent.finish("KILLED")
        raise
    summary = StudySummary(
        name, list(cfg.eval.ks), points, out_dir, {}, parent.run_id, parent.uri, time.time() - started, measures
    )
    summary.parent_url = parent.url(ui=ui_url)
    summary.files = write_outputs(summary)
    for path in summary.files.values():
        parent.log_artifact(path, "study")
    log_parent_metrics(parent, summary)
    parent.set_description(describe_study(summary, _config_line(cfg)))
    parent.finish("FINISHED" if summary.ok else "FAILED")
    return summary


def log_parent_metrics(parent: RunHandle, summary: StudySummary) -> None:
    """:func:`~dmltrain.studies.results.parent_metrics` into the parent run: each quantity one metric, its
    value at point ``i`` logged at step ``i``, so that MLflow draws one chart per quantity across the points."""
    by_step: dict[int, dict[str, float]] = {}
    for key, values in parent_metrics(summary).items():
        for step, value in values.items():
            by_step.setdefault(step, {})[key] = value
    for step, values in sorted(by_step.items()):
        parent.log_metrics(values, step)


def _config_line(cfg) -> str:
    """What every point trains: backbone, losses, steps (the base config)."""
    t = cfg.train
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs} epoch{'s' * (t.epochs != 1)}"
    return (
        f"Each run: {cfg.model.backbone} → {cfg.model.embedding_dim}-d, {loss_line(cfg, share=False)}; {length} of "
        f"{cfg.data.batch_size} images on {cfg.cluster.workers_text()}."
    )


# -- CLI --------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study", required=True, metavar="STUDY")
    p = sub.add_parser(
        "subsampling",
        help="train each class sampling ratio (and class count, and seed); what it loses and gains, table and plots",
        description="Class-subsampling scalability study: accuracy, speed and memory against the share of "
        "classes in each softmax and against the number of classes.",
    )
    p.add_argument("config", help="YAML config (the built-in study: configs/study/sop_synthetic.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every point, e.g. train.epochs=2")
    p.add_argument(
        "--ratios", required=True, help="comma-separated shares of classes per softmax, e.g. 1,0.1,0.01,0.001"
    )
    p.add_argument("--classes", help="comma-separated class counts (synthetic configs), e.g. 1e4,1e5,1e6")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per point, seeds train.seed, +1, ... (default 1; 3 for a spread)"
    )
    p.add_argument(
        "--sampling",
        help="comma-separated class draws to compare at each ratio below 1 (loss.classifier.sampling), e.g. "
        "uniform,hard,mixed; turns the gradient probe on",
    )
    p.add_argument(
        "--probe-every",
        type=int,
        help="steps between two probes of the full softmax (loss.classifier.probe_every; default: the config's, or "
        "train.log_every when it is 0; a study always probes, for the loss that compares across ratios)",
    )
    p.add_argument("--name", help="study name (default study-<config>-<time>); the same name resumes a study")
    p.add_argument("--out", help="directory of the table and plots (default <storage>/<name>)")
    p.add_argument(
        "--parallel", type=int, default=1, help="points trained at once (default 1: comparable speed figures)"
    )
    p.add_argument(
        "--ui-url",
        help="MLflow UI base URL of the printed links (default: the tracking server's, or mlflow ui's "
        "http://127.0.0.1:5000)",
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress line and no shard-build bars")


def run(args: argparse.Namespace) -> int:
    ratios = parse_ratios(args.ratios)
    classes = parse_classes(args.classes)
    modes = parse_sampling(args.sampling)
    if args.probe_every is not None and args.probe_every < 1:
        raise UserError(f"--probe-every {args.probe_every}: must be at least 1")
    cfg = load_config(args.config, args.overrides)
    c = cfg.loss.classifier
    asked = args.probe_every or (c.probe_every if c is not None else 0)
    # the probe is always on: its full-softmax loss is the one loss that compares across ratios (its time is left
    # out of the step times); its gradient figures are tabled where the draw is studied or the probe asked for
    probe = asked or cfg.train.log_every
    if c is not None and probe != c.probe_every:
        cfg = load_config(args.config, [*args.overrides, f"loss.classifier.probe_every={probe}"])
    measures = default_measures(cfg.eval.ks, gpu=cfg.cluster.use_gpu) + [full_loss_measure()]
    measures += probe_measures() if asked or modes else []
    summary = run_study(
        cfg,
        ratios,
        classes,
        repeats=args.repeats,
        name=args.name,
        out=args.out,
        parallel=args.parallel,
        progress=not args.no_progress,
        config_name=Path(args.config).stem,
        variants=sampling_variants(modes) if modes else None,
        measures=measures,
        full_once=bool(modes),
        ui_url=args.ui_url,
    )
    print(render(summary))
    return 0 if summary.ok else 1
