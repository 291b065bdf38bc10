"""``dmltrain study subsampling``: accuracy, speed and memory against the share of classes in each softmax.

``dmltrain study subsampling CONFIG [overrides] --ratios 1,0.1,0.01,0.001 [--classes N1,N2,...]``
trains the config once per point (every ratio × every class count), each point a Ray Train V2
training exactly as ``dmltrain train`` runs it, with ``loss.classifier.sample_ratio`` set to the
point's ratio: NormSoftmax sec. 4.5, where each step's softmax holds the batch's classes plus
uniformly drawn others, up to that share of all classes. ``configs/study/sop_synthetic.yaml``
is the built-in study: synthetic data at the scale of Stanford Online Products (11,318
classes × 5 images); a real dataset's shards work the same way.

Shards are reused: every ratio of a class count trains on the same shards. ``--classes`` needs
a synthetic config: the shards for ``N`` classes are built once, beside ``data.shards``
(``<data.shards>-<N>c``, or ``data.shards`` itself when ``N`` is ``data.synthetic.classes``), and
found there by later studies.

Per point the study records the final evaluation (Recall@K for ``eval.ks``) and, from the run's
MLflow metrics, images/s and step time (medians over the logged windows after the first, which
holds the start-up), the classifier shard's memory (rows and their optimizer state, rank 0),
the process's resident memory, and the active rows per worker and active classes per step.
Then it writes into ``<storage>/<name>/`` (``--out``): ``study.md`` and ``study.csv`` (the
table, also printed), ``recall_vs_ratio.png`` (Recall@K against the ratio, the paper's Fig. 4),
``cost_vs_ratio.png`` (images/s, step time, classifier memory, active rows against the ratio)
and, with two class counts or more, ``vs_classes.png`` (the same and Recall@1 against the number
of classes). Everything hangs under one MLflow parent run: the points are its children, the
table and plots its artifacts. A point that fails is reported in the table and the others go
on. Running the study again with the same ``--name`` finds the points already trained (their
runs are resumed and end at once) and trains the rest.

Points run one at a time by default, so their speed figures are comparable; ``--parallel N``
runs N at once when only the accuracy matters.

This module runs the study (inputs, the points' shards and configs, the measurements, the CLI);
:mod:`cluster.study_results` holds what it produces (points, table, plots). MLflow goes through
:mod:`dmltrain.tracking`, tables through :mod:`dmltrain.text` and plots through
:mod:`dmltrain.evaluate.plots`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cluster.launch import RunGroup, init_ray, prepare_data, prepare_driver, train
from cluster.study_results import STAT_KEYS, Point, StudySummary, render, write_outputs
from dmltrain.config import load_config
from dmltrain.errors import UserError
from dmltrain.text import finite_number, one_line
from dmltrain.tracking.queries import history
from dmltrain.tracking.run import RunHandle
from shards.build.synthetic import build_synthetic_shards
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


def parse_classes(text: str | None) -> list[int] | None:
    """``1000,11318`` -> ``[1000, 11318]`` (deduplicated, ascending); each at least 2; ``None`` stays ``None``."""
    if text is None:
        return None
    out = _parse_list(text, "--classes", int, "an integer", "1000,11318")
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


def prepare_shards(cfg, classes: list[int] | None, progress: bool = True) -> dict[int, str]:
    """Class count -> shard directory, building missing synthetic shards once (``--classes``)."""
    s = cfg.data.synthetic
    if not classes or s is None:
        prepare_data(cfg)  # the config's own shards (built when synthetic and missing) and its splits
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
    out = {}
    for n in classes:
        d = synthetic_shards_dir(cfg, n)
        if not (d / "manifest.json").exists():
            print(
                f"building synthetic shards for {n} classes in {d} ({n} x {s.per_class} images, {s.image_size}px)",
                file=sys.stderr,
            )
            build_synthetic_shards(
                d,
                classes=n,
                per_class=s.per_class,
                image_size=s.image_size,
                seed=s.seed,
                shard_size=s.shard_size,
                overwrite=False,
                progress=progress,
            )
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


def point_config(cfg, point: Point, runs_root: str):
    """The config of one point: the ratio, the shards of its class count, its run name and storage."""
    c = cfg.loss.classifier.model_copy(update={"sample_ratio": point.ratio})
    data_update: dict[str, Any] = {"shards": point.shards}
    if cfg.data.synthetic is not None:
        data_update["synthetic"] = cfg.data.synthetic.model_copy(update={"classes": point.classes})
    return cfg.model_copy(
        update={
            "loss": cfg.loss.model_copy(update={"classifier": c}),
            "data": cfg.data.model_copy(update=data_update),
            "train": cfg.train.model_copy(update={"run_name": point.run_name}),
            "cluster": cfg.cluster.model_copy(update={"storage_path": runs_root}),
        }
    )


def point_run_name(study: str, ratio: float, classes: int) -> str:
    return f"{study}-c{classes}-r{ratio:g}"


# -- measurements -------------------------------------------------------------------------------------------
def summarise_history(values: list[float], how: str) -> float:
    """One figure from a metric's logged values; ``median`` leaves out the first window (start-up) when there are others."""
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan")
    if how == "median":
        return float(statistics.median(vals[1:] if len(vals) > 1 else vals))
    if how == "max":
        return float(max(vals))
    return float(sum(vals) / len(vals))


def training_stats(uri: str, run_id: str | None) -> dict[str, float]:
    """The cost columns of a point from its MLflow run (NaN when tracking was off or a metric is absent)."""
    out = {col: float("nan") for col in STAT_KEYS}
    if run_id is None:
        return out

    def read(client) -> dict[str, float]:
        return {
            col: summarise_history([v for _, v in history(client, run_id, key)], how)
            for col, (key, how) in STAT_KEYS.items()
        }

    # the accuracy columns stand without these
    out.update(RunHandle(uri, run_id, owner="the study").query(f"read the metrics of MLflow run {run_id}", read, {}))
    return out


# -- the study -----------------------------------------------------------------------------------------------
def _train_point(cfg, point: Point, runs_root: str, parent_run_id: str | None, progress: bool, index: str) -> Point:
    pcfg = point_config(cfg, point, runs_root)
    c = pcfg.loss.classifier
    drawn = int(
        point.ratio * point.classes + 0.5
    )  # the draw's count before the batch's classes (class_sampling.target_total)
    if drawn < pcfg.data.P:
        print(
            f"{index} note: ratio {point.ratio:g} x {point.classes} classes = {drawn} < the {pcfg.data.P} classes of a batch: "
            "each softmax holds just the batch's classes",
            file=sys.stderr,
        )
    print(f"{index} {point.label}: started (run {point.run_name}, {c.kind})", file=sys.stderr, flush=True)
    try:
        summary = train(pcfg, progress=progress, config_name=point.run_name, parent_run_id=parent_run_id)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — one failed point does not end the study
        point.status, point.error = "failed", one_line(e)
        print(f"{index} {point.label}: FAILED ({point.error})", file=sys.stderr, flush=True)
        return point
    point.mlflow_run_id, point.storage_dir, point.seconds = summary.mlflow_run_id, summary.storage_dir, summary.seconds
    point.final = dict((summary.metrics or {}).get("final") or {})
    point.recalls = {k: point.final[f"recall@{k}"] for k in cfg.eval.ks if f"recall@{k}" in point.final}
    point.stats = training_stats(summary.tracking_uri, summary.mlflow_run_id)
    point.status = "finished" if summary.ok else "failed"
    point.error = None if summary.error is None else one_line(summary.error)
    if summary.ok:
        shown = ", ".join(f"recall@{k} {v:.4f}" for k, v in list(point.recalls.items())[:2])
        speed = point.stats.get("images/s", float("nan"))
        print(
            f"{index} {point.label}: finished in {summary.seconds:.0f}s: {shown}"
            + (f", {speed:.0f} images/s" if finite_number(speed) else ""),
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"{index} {point.label}: FAILED after {summary.seconds:.0f}s ({point.error})", file=sys.stderr, flush=True
        )
    return point


def run_study(
    cfg,
    ratios: list[float],
    classes: list[int] | None = None,
    *,
    name: str | None = None,
    out: str | Path | None = None,
    parallel: int = 1,
    progress: bool = True,
    config_name: str | None = None,
) -> StudySummary:
    """Train every point (see the module doc), write the table and plots, log them; returns the summary."""
    started = time.time()
    if cfg.loss.classifier is None:
        raise UserError(
            "loss.classifier: a class-subsampling study needs a classifier loss (it is null in this config)"
        )
    if parallel < 1:
        raise UserError(f"--parallel {parallel}: must be at least 1")
    shards: dict[int, str] = {}

    def shard_sets(c):  # every class count's shards (built when missing), each checked as a training
        shards.update(prepare_shards(c, classes, progress=progress))
        return [c.model_copy(update={"data": c.data.model_copy(update={"shards": d})}) for d in shards.values()]

    cfg = prepare_driver(cfg, shard_sets)
    study = RunGroup.open(
        cfg,
        "study",
        {
            **cfg.flat(),
            "study.kind": "subsampling",
            "study.ratios": ",".join(f"{r:g}" for r in ratios),
            "study.classes": ",".join(str(n) for n in shards),
        },
        name=name,
        config_name=config_name,
        out=out,
        owner="the study",
    )
    name, parent, out_dir, runs_root = study.name, study.parent, study.out_dir, study.runs_root
    points = [Point(r, n, d, point_run_name(name, r, n)) for n, d in shards.items() for r in ratios]
    print(
        f"study {name}: {len(points)} point{'s' * (len(points) != 1)} (ratios {', '.join(f'{r:g}' for r in ratios)} x "
        f"{', '.join(str(n) for n in shards)} classes)"
        + (f"; MLflow parent run {parent.run_id}" if parent.run_id else ""),
        file=sys.stderr,
        flush=True,
    )
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
            for i, p in enumerate(points):
                _train_point(cfg, p, runs_root, parent.run_id, live, f"[{i + 1}/{len(points)}]")
        else:
            with ThreadPoolExecutor(max_workers=parallel) as pool:
                futures = [
                    pool.submit(_train_point, cfg, p, runs_root, parent.run_id, False, f"[{i + 1}/{len(points)}]")
                    for i, p in enumerate(points)
                ]
                for f in futures:
                    f.result()
    except BaseException:
        parent.finish("KILLED")
        raise
    summary = StudySummary(
        name, list(cfg.eval.ks), points, out_dir, {}, parent.run_id, parent.uri, time.time() - started
    )
    summary.files = write_outputs(summary)
    for fname, path in summary.files.items():
        parent.log_artifact(path, "study" if fname.endswith((".md", ".csv")) else "study/plots")
    parent.finish("FINISHED" if summary.ok else "FAILED")
    return summary


# -- CLI --------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study", required=True, metavar="STUDY")
    p = sub.add_parser(
        "subsampling",
        help="train one run per class sampling ratio (and class count); table and plots",
        description="Class-subsampling scalability study: accuracy, speed and memory against the share of "
        "classes in each softmax and against the number of classes.",
    )
    p.add_argument("config", help="YAML config (the built-in study: configs/study/sop_synthetic.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every point, e.g. train.epochs=2")
    p.add_argument(
        "--ratios", required=True, help="comma-separated shares of classes per softmax, e.g. 1,0.1,0.01,0.001"
    )
    p.add_argument("--classes", help="comma-separated class counts (synthetic configs), e.g. 1000,11318")
    p.add_argument("--name", help="study name (default study-<config>-<time>); the same name resumes a study")
    p.add_argument("--out", help="directory of the table and plots (default <storage>/<name>)")
    p.add_argument(
        "--parallel", type=int, default=1, help="points trained at once (default 1: comparable speed figures)"
    )
    p.add_argument("--no-progress", action="store_true", help="no live progress line")


def run(args: argparse.Namespace) -> int:
    ratios = parse_ratios(args.ratios)
    classes = parse_classes(args.classes)
    cfg = load_config(args.config, args.overrides)
    summary = run_study(
        cfg,
        ratios,
        classes,
        name=args.name,
        out=args.out,
        parallel=args.parallel,
        progress=not args.no_progress,
        config_name=Path(args.config).stem,
    )
    print(render(summary))
    return 0 if summary.ok else 1
