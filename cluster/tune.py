"""``dmltrain tune``: a Ray Tune search over Ray Train V2 trainings, every trial an MLflow child run.

``dmltrain tune CONFIG [overrides] --space SPACE.yaml --trials N [--scheduler asha]`` samples
configs from ``SPACE.yaml`` and trains each one. The search space is YAML over dotted config
keys (see ``configs/tune/``)::

    metric: recall@1          # an evaluation metric (the ASHA metric and the one that picks the best trial)
    mode: max                 # optional; every evaluation metric is better when higher
    space:
      optim.lr: {loguniform: [1.0e-4, 1.0e-1]}
      loss.classifier.params.temperature: {uniform: [0.03, 0.1]}
      loss.classifier.sample_ratio: {choice: [1.0, 0.5, 0.1]}
      data.samples_per_class: {grid: [2, 4]}

``uniform`` and ``loguniform`` take ``[low, high]``; ``choice`` samples one of its values;
``grid`` tries every value, and as in Ray Tune the grid is repeated ``--trials`` times (the
search runs grid size × trials trials). A key may name a whole section with mappings as
values, which are merged into it: ``data: {choice: [{batch_size: 75, samples_per_class: 5},
{batch_size: 150, samples_per_class: 3}]}`` tunes P×K as pairs. The file is checked against the config before anything
starts: an unknown distribution, bad bounds, a key the config does not have or a value the
config refuses stops with one line naming the key. Every sampled config is validated again in
its trial; a combination the config refuses fails that trial only.

Each trial is a Tune function trial that builds the run's ``TorchTrainer`` (the same one
``dmltrain train`` uses) and calls ``fit()``. Its evaluations reach Tune through a Ray Train
callback, one Tune result per evaluation during training (the untrained model's evaluation
is not one), so ``training_iteration`` counts evaluations and ``--scheduler asha`` stops weak
trials after ``--grace-period`` evaluations. Rank 0 logs the trial into its own MLflow run, a
child of the search's parent run; a trial stopped early ends ``KILLED`` and tagged
``dmltrain.tune.stopped_early``.

At the end: the results table is printed and saved (``results.md``, ``results.csv``), the best
trial's config is written as a ready-to-run YAML (``best_config.yaml``) and printed, and the
parent run receives the space, the table, the YAML and the best trial's metrics. The best trial
is the one with the best value of the metric at any of its evaluations, which is also the
checkpoint its training keeps as ``best_model``. Outputs live in ``<storage>/<name>/``
(``cluster.storage_path``, else ``train.output_dir``), the trials' trainings in its ``runs/``.
Running the same command with the same ``--name`` resumes an interrupted search: finished
trials are kept, unfinished ones continue from their last checkpoint.

On a small machine the trials share the CPUs: each trial's driver takes ``--trial-cpus``
(default 0.1) and its workers ``cluster.cpus_per_worker`` each (fractions allowed), and at most
as many trials run at once as the cluster's CPUs (GPUs with ``cluster.use_gpu``) can hold.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import itertools
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from dmltrain.errors import UserError

DISTRIBUTIONS = ("uniform", "loguniform", "choice", "grid")
SPACE_KEYS = ("metric", "mode", "space")
COMBINATIONS_CHECKED = 512  # discrete combinations validated up front; beyond this only each value alone
KIND_TAG = "dmltrain.kind"
TRIAL_TAG = "dmltrain.tune.trial"
STOPPED_TAG = "dmltrain.tune.stopped_early"
ERROR_TAG = "dmltrain.error"


# -- the search space ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dimension:
    """One tuned key: ``kind`` is a distribution name, ``values`` its bounds or its options."""

    key: str
    kind: str
    values: tuple[Any, ...]

    @property
    def continuous(self) -> bool:
        return self.kind in ("uniform", "loguniform")

    def domain(self):
        """The Ray Tune search-space object of this dimension."""
        from ray import tune

        if self.kind == "uniform":
            return tune.uniform(*self.values)
        if self.kind == "loguniform":
            return tune.loguniform(*self.values)
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return tune.grid_search(list(self.values))

    def representatives(self) -> list[Any]:
        """Values checked against the config before the search: the bounds, or every option."""
        return list(self.values)

    def describe(self) -> str:
        return f"{self.kind} {list(self.values)}"


@dataclass(frozen=True)
class SearchSpace:
    path: str
    metric: str  # as the evaluation names it: recall@1, map@r, nmi, binary/recall@1
    mode: str
    dims: tuple[Dimension, ...]
    text: str = ""  # the file as written (logged to MLflow)

    @property
    def result_key(self) -> str:
        """The key of the metric in the reports the workers send (and so in Tune's results)."""
        return f"eval/{self.metric}"

    @property
    def grid_size(self) -> int:
        return math.prod(len(d.values) for d in self.dims if d.kind == "grid")

    def param_space(self) -> dict[str, Any]:
        return {d.key: d.domain() for d in self.dims}


def _unwrap_model(annotation: Any):
    """The config section class inside ``annotation`` (``X``, ``X | None``), or None."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, type(int | None)):
        for arg in get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
    return None


def _is_mapping(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, type(int | None)):
        return any(_is_mapping(a) for a in get_args(annotation))
    return annotation is dict or get_origin(annotation) is dict


def _is_integer(annotation: Any) -> bool:
    args = get_args(annotation) if get_origin(annotation) in (Union, type(int | None)) else (annotation,)
    numeric = [a for a in args if a is not type(None)]
    return bool(numeric) and all(a is int for a in numeric)


def check_key(key: str, base_tree: dict[str, Any], where: str) -> Any:
    """Check that ``key`` names a field of the config (or an entry of a ``params`` mapping) whose
    enclosing sections are set in ``base_tree``; returns the field's type annotation."""
    from dmltrain.config import Config

    parts = key.split(".")
    if any(not p for p in parts):
        raise UserError(f"{where}: '{key}' is not a dotted config key")
    model, node = Config, base_tree
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if model is None:  # inside a free mapping such as loss.classifier.params: the loss checks the names
            if not last:
                raise UserError(f"{where}: {here} is a value inside {'.'.join(parts[:i])}, not a section")
            return Any
        fields = model.model_fields
        if part not in fields:
            known = ", ".join(fields)
            raise UserError(f"{where}: {here} is not a config key ({'.'.join(parts[:i]) or 'the config'} has: {known})")
        annotation = fields[part].annotation
        if last:
            return annotation
        section = _unwrap_model(annotation)
        if section is not None:
            if node.get(part) is None:
                raise UserError(f"{where}: {here} is null in the config, so {key} cannot be tuned; set {here} in the config first")
            model, node = section, node[part]
        elif _is_mapping(annotation):
            model, node = None, node.get(part) or {}
        else:
            raise UserError(f"{where}: {here} is a value, not a section")
    return Any


def set_key(tree: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``tree`` (copied) with the dotted ``key`` set to ``value``; missing mappings are created.

    A mapping value is merged into the section it lands on, so one choice can set keys together
    (P×K: ``data: {choice: [{batch_size: 75, samples_per_class: 5}, ...]}``); None replaces.
    """
    from dmltrain.config import deep_merge

    tree = copy.deepcopy(tree)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    old = node.get(parts[-1])
    node[parts[-1]] = deep_merge(old, value) if isinstance(value, dict) and isinstance(old, dict) else copy.deepcopy(value)
    return tree


def apply_params(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    for key, value in params.items():
        tree = set_key(tree, key, value)
    return tree


def check_losses(cfg) -> None:
    """Build the instance loss once at toy size: its constructor checks values (m <= alpha).

    The classifier part needs no build: config validation already checked its kind's
    parameters against their bounds (``dmltrain.losses.kinds``)."""
    from dmltrain.errors import ConfigError
    from dmltrain.losses.registry import build_loss

    c = cfg.loss.instance
    if c is None:
        return
    try:
        build_loss(c.kind, **c.params)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"loss.instance.params: {str(e).splitlines()[0]}") from None


def validate_config(tree: dict[str, Any], source: str):
    """``build_config`` plus the loss-value checks: the config a trial would train, or a ConfigError."""
    from dmltrain.config import build_config

    cfg = build_config(tree, source=source)
    check_losses(cfg)
    return cfg


def refusal(tree: dict[str, Any]) -> str | None:
    """Why the config refuses ``tree`` (one line naming the key), or None when it is a valid run config."""
    try:
        validate_config(tree, source="config")
    except UserError as e:
        msg = str(e)
        return msg[len("config: "):] if msg.startswith("config: ") else msg
    return None


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _parse_dimension(key: str, spec: Any, where: str) -> Dimension:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise UserError(f"{where}: give one distribution as a mapping, e.g. {{uniform: [0.03, 0.1]}} "
                        f"({', '.join(DISTRIBUTIONS)}), got {spec!r}")
    kind, values = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        raise UserError(f"{where}: unknown distribution '{kind}' (use {', '.join(DISTRIBUTIONS)})")
    if kind in ("uniform", "loguniform"):
        if not (isinstance(values, list) and len(values) == 2 and all(_number(v) for v in values)):
            raise UserError(f"{where}: {kind} takes [low, high] (two numbers), got {values!r}")
        lo, hi = values
        if not lo < hi:
            raise UserError(f"{where}: {kind} needs low < high, got [{lo}, {hi}]")
        if kind == "loguniform" and lo <= 0:
            raise UserError(f"{where}: loguniform needs low > 0, got [{lo}, {hi}]")
        return Dimension(key, kind, (float(lo), float(hi)))
    if not isinstance(values, list) or not values:
        raise UserError(f"{where}: {kind} takes a non-empty list of values, got {values!r}")
    return Dimension(key, kind, tuple(values))


def load_space(path: str | Path, base_tree: dict[str, Any]) -> SearchSpace:
    """Read and check a search-space file against the resolved config ``base_tree``."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--space {path}: file not found")
    text = path.read_text()
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise UserError(f"{path}: invalid YAML{f' at line {mark.line + 1}' if mark else ''}: {getattr(e, 'problem', e)}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: a search space is a YAML mapping with keys {', '.join(SPACE_KEYS)}")
    unknown = [k for k in doc if k not in SPACE_KEYS]
    if unknown:
        raise UserError(f"{path}: {unknown[0]}: unknown key (a search space has {', '.join(SPACE_KEYS)})")
    space = doc.get("space")
    if not isinstance(space, dict) or not space:
        raise UserError(f"{path}: space: give a mapping of dotted config keys to distributions")

    from dmltrain.config import build_config

    base = build_config(base_tree, source="config")
    metric = str(doc.get("metric", base.eval.metric))
    metrics = base.eval.metric_names()
    if metric not in metrics:
        raise UserError(f"{path}: metric: '{metric}' is not reported by the evaluation of this config (it reports: {', '.join(metrics)})")
    mode = str(doc.get("mode", "max"))
    if mode not in ("max", "min"):
        raise UserError(f"{path}: mode: '{mode}' must be max or min")

    dims = []
    for key, spec in space.items():
        key = str(key)
        where = f"{path}: space.{key}"
        dim = _parse_dimension(key, spec, where)
        annotation = check_key(key, base_tree, where)
        if dim.continuous and _is_integer(annotation):
            raise UserError(f"{where}: {key} is an integer; {dim.kind} draws fractions, use choice or grid")
        for value in dim.representatives():
            problem = refusal(set_key(base_tree, key, value))
            if problem:
                raise UserError(f"{where}: {value!r} is refused by the config: {problem}")
        dims.append(dim)
    spec = SearchSpace(str(path), metric, mode, tuple(dims), text)
    _check_combinations(spec, base_tree)
    return spec


def _check_combinations(space: SearchSpace, base_tree: dict[str, Any]) -> None:
    """Every value passed alone; now combinations of the discrete values (continuous ones at their low bound).

    All of them refused: stop. Some refused: warn, since those trials will fail."""
    discrete = [d for d in space.dims if not d.continuous]
    if len(discrete) < 2 and len(space.dims) < 2:
        return
    fixed = {d.key: d.values[0] for d in space.dims if d.continuous}
    combos = list(itertools.islice(itertools.product(*(d.values for d in discrete)), COMBINATIONS_CHECKED))
    bad = []
    for combo in combos:
        params = {**fixed, **{d.key: v for d, v in zip(discrete, combo)}}
        problem = refusal(apply_params(base_tree, params))
        if problem:
            bad.append((params, problem))
    if not bad:
        return
    shown = ", ".join(f"{k}={v!r}" for k, v in bad[0][0].items())
    if len(bad) == len(combos):
        raise UserError(f"{space.path}: space: no combination of the values is a valid config, e.g. {shown}: {bad[0][1]}")
    print(f"dmltrain: warning: {space.path}: {len(bad)} of {len(combos)} value combinations are refused by the config "
          f"(e.g. {shown}: {bad[0][1]}); trials drawing them will fail", file=sys.stderr)


# -- one trial ---------------------------------------------------------------------------------------------
def trial_index(trial_id: str) -> int:
    """The trial's counter: Tune's trial ids end in it (``a1b2c_00003``), our trial folders are ``t003``."""
    m = re.search(r"(?:_|^t)(\d+)$", trial_id)
    return int(m.group(1)) if m else 0


def trial_run_name(search_name: str, index: int) -> str:
    return f"{search_name}-t{index:03d}"


def is_new_evaluation(metrics: dict[str, Any], result_key: str, last_step: int | None) -> bool:
    """Whether a worker report is an evaluation Tune has not seen: an evaluation report (the trainer
    marks them ``evaluation: 1``; checkpoint reports repeat the last metrics without it) holding the
    metric, at a step > 0 (step 0 is the untrained model) other than the last one forwarded."""
    step = metrics.get("step")
    return metrics.get("evaluation") == 1 and result_key in metrics and bool(step) and step != last_step


def _evaluation_callback(result_key: str, extra: dict[str, Any]):
    """A Ray Train callback (built inside the Tune trial) that forwards each evaluation to Tune.

    Ray's ``TuneReportCallback`` forwards every ``ray.train.report``; forwarding only new
    evaluations (:func:`is_new_evaluation`) makes one Tune result per evaluation, so Tune's
    ``training_iteration`` counts evaluations. ``extra`` (the MLflow run) rides along.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class EvaluationsToTune(TuneReportCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last_step: int | None = None

        def after_report(self, run_context, metrics, checkpoint) -> None:
            m = metrics[0]  # rank 0's; every rank reports the same evaluation
            if is_new_evaluation(m, result_key, self.last_step):
                self.last_step = m["step"]
                self._training_actor_item_queue.put({**m, **extra})

    return EvaluationsToTune()


def run_trial(params: dict[str, Any], setup: dict[str, Any]) -> None:
    """The Tune function of one trial: validate the sampled config, open its MLflow child run, train.

    ``setup``: ``base`` (the resolved config tree), ``name`` (the search's), ``parent_run_id``,
    ``runs_root`` (Ray Train storage of the trials), ``result_key``.
    """
    from ray import tune

    from cluster.launch import build_trainer
    from dmltrain.training.tracking import create_or_resume_run, finish_run

    trial_id = tune.get_context().get_trial_id()
    index = trial_index(trial_id)
    run_name = trial_run_name(setup["name"], index)
    tree = apply_params(setup["base"], params)
    tree = set_key(tree, "train.run_name", run_name)
    tree = set_key(tree, "cluster.storage_path", setup["runs_root"])
    tracking = tree.get("tracking") or {}
    uri, experiment = tracking.get("uri"), tracking.get("experiment", "dmltrain")
    storage_dir = f"{setup['runs_root'].rstrip('/')}/{run_name}"
    tags = {KIND_TAG: "tune-trial", TRIAL_TAG: trial_id, "dmltrain.storage_dir": storage_dir}
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    try:
        cfg = validate_config(tree, source=f"trial {index} ({shown})")
    except UserError as e:
        if tracking.get("enabled", True):
            run_id, _ = create_or_resume_run(uri, experiment, run_name, params, tags={**tags, ERROR_TAG: str(e)[:5000]},
                                             parent_run_id=setup["parent_run_id"])
            finish_run(uri, run_id, "FAILED")
        raise
    run_id = None
    if cfg.tracking.enabled:
        run_id, _ = create_or_resume_run(uri, experiment, run_name, cfg.flat(), tags=tags, parent_run_id=setup["parent_run_id"])
    context = {"run_name": run_name, "storage_dir": storage_dir, "tracking_uri": uri, "mlflow_run_id": run_id, "board_name": None}
    callback = _evaluation_callback(setup["result_key"], {"mlflow_run_id": run_id or "", "run_name": run_name})
    trainer = build_trainer(cfg, run_name, context, callbacks=[callback])
    try:
        trainer.fit()
    except BaseException as e:
        if run_id is not None:
            from mlflow import MlflowClient

            try:
                MlflowClient(tracking_uri=uri).set_tag(run_id, ERROR_TAG, f"{type(e).__name__}: {str(e)[:4000]}")
            except Exception:  # noqa: BLE001 — the trial's error is what matters
                pass
        finish_run(uri, run_id, "FAILED")
        raise
    finish_run(uri, run_id, "FINISHED")


# -- the search ----------------------------------------------------------------------------------------------
@dataclass
class TrialRow:
    index: int
    trial_id: str
    run_name: str
    status: str  # finished, stopped early, failed
    params: dict[str, Any]
    best: float | None
    best_step: int | None
    last: float | None
    evaluations: int
    steps: int | None
    mlflow_run_id: str | None
    best_metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class TuneSummary:
    name: str
    metric: str
    mode: str
    rows: list[TrialRow]
    best: TrialRow | None
    out_dir: Path
    best_config: Path | None
    parent_run_id: str | None
    tracking_uri: str
    seconds: float
    keys: list[str] = field(default_factory=list)  # the tuned keys, in the space file's order


class ParentRun:
    """The MLflow run a search or a study hangs its children under; every call is failure-safe."""

    def __init__(self, cfg, name: str, params: dict[str, Any], tags: dict[str, str]):
        from dmltrain.training.tracking import create_or_resume_run

        self.uri = cfg.tracking.resolved_uri()
        self.run_id = None
        if cfg.tracking.enabled:
            self.run_id, _ = create_or_resume_run(self.uri, cfg.tracking.experiment, name, params, tags=tags)

    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def _safely(self, what: str, fn) -> None:
        if self.run_id is None:
            return
        try:
            fn(self._client())
        except Exception as e:  # noqa: BLE001 — the results on disk stand without MLflow
            print(f"dmltrain: warning: could not {what} in MLflow ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._safely("log an artifact", lambda c: c.log_artifact(self.run_id, str(path), artifact_path))

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        from dmltrain.training.tracking import metric_key

        ts = int(time.time() * 1000)
        items = [Metric(metric_key(k), float(v), ts, step) for k, v in metrics.items() if _number(v)]
        self._safely("log metrics", lambda c: c.log_batch(self.run_id, metrics=items) if items else None)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._safely("set tags", lambda c: [c.set_tag(self.run_id, k, str(v)[:5000]) for k, v in tags.items()])

    def children(self) -> list:
        out: list = []

        def fetch(c):
            run = c.get_run(self.run_id)
            out.extend(c.search_runs([run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}'",
                                     max_results=5000))

        self._safely("list the child runs", fetch)
        return out

    def finish(self, status: str) -> None:
        from dmltrain.training.tracking import finish_run

        finish_run(self.uri, self.run_id, status)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(head: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return _fmt(x).replace("|", "\\|")

    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def csv_text(head: list[str], rows: list[list[Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(head)
    for r in rows:
        w.writerow(["" if x is None else (repr(x) if isinstance(x, float) else x) for x in r])
    return buf.getvalue()


def results_table(summary: TuneSummary) -> tuple[list[str], list[list[Any]]]:
    keys = list(dict.fromkeys([*summary.keys, *(k for r in summary.rows for k in r.params)]))
    head = ["trial", "status", *keys, f"best {summary.metric}", "at step", f"last {summary.metric}", "evaluations", "MLflow run"]
    rows = []
    for r in summary.rows:
        status = r.status + (" (best)" if summary.best is r else "")
        rows.append([r.run_name, status, *(r.params.get(k) for k in keys), r.best, r.best_step, r.last, r.evaluations,
                     r.mlflow_run_id])
    return head, rows


def default_max_concurrent(cfg, trial_cpus: float) -> int:
    """Trials that fit the cluster at once: its CPUs (or GPUs) over one trial's demand."""
    import ray

    total = ray.cluster_resources()
    c = cfg.cluster
    if c.use_gpu:
        fit = int(total.get("GPU", 0) // c.num_workers)
    else:
        fit = int(total.get("CPU", 0) // (c.num_workers * c.cpus_per_worker + trial_cpus))
    return max(1, fit)


def _rows_from_results(results, space: SearchSpace, name: str) -> list[TrialRow]:
    sign = 1 if space.mode == "max" else -1
    key = space.result_key
    rows = []
    for res in results:
        trial_id = str((res.metrics or {}).get("trial_id") or (Path(res.path).name if res.path else ""))
        df = res.metrics_dataframe
        best = best_step = last = None
        best_metrics: dict[str, float] = {}
        evaluations = 0
        steps = None
        if df is not None and key in df.columns:
            vals = df[key].dropna()
            evaluations = len(vals)
            if evaluations:
                i = (vals * sign).idxmax()
                best, last = float(vals.loc[i]), float(vals.iloc[-1])
                best_step = int(df.loc[i, "step"]) if "step" in df.columns else None
                best_metrics = {c: float(df.loc[i, c]) for c in df.columns if c.startswith("eval/") and _number(df.loc[i, c])}
                steps = int(df["step"].max()) if "step" in df.columns else None
        run_id = (res.metrics or {}).get("mlflow_run_id") or None
        error = None
        if res.error is not None:
            error = str(res.error).strip().splitlines()[-1][:300] if str(res.error).strip() else type(res.error).__name__
        status = "failed" if res.error is not None else "finished"
        rows.append(TrialRow(0, trial_id, "", status, dict(res.config or {}), best, best_step, last, evaluations, steps, run_id,
                             best_metrics, error))
    for r in rows:
        r.index = trial_index(r.trial_id)
        r.run_name = trial_run_name(name, r.index)
    return sorted(rows, key=lambda r: r.index)


def _scores_from_mlflow(row: TrialRow, run, parent: ParentRun, result_key: str, mode: str) -> None:
    """Re-score a trial from its MLflow run when the run holds evaluations Tune never received.

    A trial the scheduler stops keeps training until its process is killed, so it may evaluate
    (and keep that model as ``best_model``) after its last Tune result; the run is the full record.
    """
    from dmltrain.training.tracking import display_key, metric_key

    key = metric_key(result_key)
    hist: list = []
    parent._safely("read a trial's evaluations", lambda c: hist.extend(c.get_metric_history(run.info.run_id, key)))
    by_step = {m.step: m.value for m in hist if m.step > 0}  # step 0: the untrained model, not an evaluation of the trial
    if len(by_step) <= row.evaluations:
        return
    sign = 1 if mode == "max" else -1
    steps = sorted(by_step)
    best_step = max(steps, key=lambda s: (sign * by_step[s], -s))  # the first of equal bests, as Tune's idxmax
    row.best, row.best_step, row.last, row.evaluations = by_step[best_step], best_step, by_step[steps[-1]], len(steps)
    row.steps = max(row.steps or 0, steps[-1])
    metrics: dict[str, float] = {}

    def at_best(c) -> None:
        for k in run.data.metrics:
            if k.startswith("eval/"):
                vals = [m.value for m in c.get_metric_history(run.info.run_id, k) if m.step == best_step]
                if vals:
                    metrics[display_key(k)] = float(vals[-1])

    parent._safely("read a trial's evaluation metrics", at_best)
    row.best_metrics = metrics or row.best_metrics


def _reconcile_with_mlflow(rows: list[TrialRow], parent: ParentRun, result_key: str | None = None, mode: str = "max") -> None:
    """Set the child runs' final status from how Tune saw each trial (and, given ``result_key``,
    complete their scores from the runs: :func:`_scores_from_mlflow`).

    A trial Tune ended without an error was stopped by the scheduler unless its run FINISHED: its
    process was killed mid-step (the run is still RUNNING) or its trainer died under it (the trial
    marked the run FAILED). Such runs end KILLED and tagged ``dmltrain.tune.stopped_early``.
    """
    from dmltrain.training.tracking import RUN_NAME_TAG, finish_run

    by_name = {r.run_name: r for r in rows}
    for run in parent.children():
        row = by_name.get(run.data.tags.get(RUN_NAME_TAG, ""))
        if row is None:
            continue
        row.mlflow_run_id = row.mlflow_run_id or run.info.run_id
        status, rid = run.info.status, run.info.run_id
        if result_key is not None and row.status != "failed":
            _scores_from_mlflow(row, run, parent, result_key, mode)
        if row.status == "failed":
            if status == "RUNNING":
                finish_run(parent.uri, rid, "FAILED")
            if row.error is None and run.data.tags.get(ERROR_TAG):
                row.error = run.data.tags[ERROR_TAG].splitlines()[0][:300]
        elif status in ("RUNNING", "FAILED", "KILLED"):
            # Tune ended the trial without an error of its own: the scheduler stopped it. Its process was
            # killed (the run is still RUNNING) or its trainer died under it (the trial marked the run FAILED).
            row.status = "stopped early"
            if status != "KILLED":
                finish_run(parent.uri, rid, "KILLED")

                def mark(c, rid=rid, had_error=ERROR_TAG in run.data.tags):
                    c.set_tag(rid, STOPPED_TAG, "true")
                    if had_error:
                        c.delete_tag(rid, ERROR_TAG)

                parent._safely("tag a stopped trial", mark)


def best_config_yaml(base_tree: dict[str, Any], best: TrialRow, summary_name: str, space: SearchSpace, base_storage: str | None) -> str:
    """The best trial's full config as YAML, ready for ``dmltrain train``, with a header saying where it came from."""
    from dmltrain.config import build_config

    tree = apply_params(base_tree, best.params)
    tree = set_key(tree, "train.run_name", None)
    tree = set_key(tree, "cluster.storage_path", base_storage)
    cfg = build_config(tree, source="best trial")
    sampled = "\n".join(f"#   {k}: {v!r}" for k, v in best.params.items())
    header = (f"# Best trial of Ray Tune search {summary_name}: {best.run_name}, {space.metric} {best.best:.4f} "
              f"at step {best.best_step} (MLflow run {best.mlflow_run_id or '-'}).\n"
              f"# Sampled values:\n{sampled}\n"
              f"# Train it: dmltrain train <this file>\n")
    return header + cfg.to_yaml()


def tune_search(
    cfg,
    space_path: str | Path,
    trials: int,
    *,
    scheduler: str = "fifo",
    grace_period: int = 1,
    reduction_factor: float = 2.0,
    max_concurrent: int | None = None,
    trial_cpus: float = 0.1,
    name: str | None = None,
    out: str | Path | None = None,
    seed: int | None = None,
    config_name: str | None = None,
    progress: bool = True,
) -> TuneSummary:
    """Run a search (see the module doc) and return its summary; raises :class:`UserError` on bad input."""
    from cluster.launch import absolutize, default_run_name, init_ray, prepare_data, storage_root
    from dmltrain.fileio import write_text

    started = time.time()
    if trials < 1:
        raise UserError(f"--trials {trials}: must be at least 1")
    if scheduler not in ("fifo", "asha"):
        raise UserError(f"--scheduler {scheduler}: use asha or fifo")
    if grace_period < 1:
        raise UserError(f"--grace-period {grace_period}: must be at least 1 evaluation")
    if reduction_factor <= 1:
        raise UserError(f"--reduction-factor {reduction_factor}: must be greater than 1")
    if trial_cpus < 0:
        raise UserError(f"--trial-cpus {trial_cpus}: must be >= 0")
    if max_concurrent is not None and max_concurrent < 1:
        raise UserError(f"--max-concurrent {max_concurrent}: must be at least 1")

    base_storage = cfg.cluster.storage_path
    space = load_space(space_path, cfg.to_dict())  # a bad space stops before anything is built or started
    prepare_data(cfg)  # synthetic shards are built once, here, for every trial
    cfg = absolutize(cfg)
    base_tree = cfg.to_dict()
    if scheduler == "asha" and cfg.eval.every == 0:
        print("dmltrain: warning: eval.every is 0, so trials evaluate only at the end and ASHA cannot stop any early",
              file=sys.stderr)

    name = name or default_run_name(f"tune-{config_name or 'run'}")
    root = storage_root(cfg).rstrip("/")
    experiment_dir = f"{root}/{name}"
    # the tables and the YAML are local files: beside the trials, or under ./runs when the storage is remote (s3://...)
    out_dir = Path(out) if out else (Path(experiment_dir) if "://" not in experiment_dir else Path.cwd() / "runs" / name)
    runs_root = f"{experiment_dir}/runs"
    parent = ParentRun(cfg, name, {**cfg.flat(), "tune.space": str(space_path), "tune.trials": trials, "tune.scheduler": scheduler,
                                   "tune.metric": space.metric, "tune.mode": space.mode},
                       tags={KIND_TAG: "tune", "dmltrain.storage_dir": experiment_dir})
    with tempfile.TemporaryDirectory() as tmp:
        copy_path = Path(tmp) / "space.yaml"
        copy_path.write_text(space.text)
        parent.log_artifact(copy_path, "tune")

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    init_ray(cfg)
    concurrent = max_concurrent or default_max_concurrent(cfg, trial_cpus)
    total = trials * space.grid_size
    print(f"tune {name}: {total} trial{'s' * (total != 1)}"
          + (f" ({space.grid_size} grid points x {trials})" if space.grid_size > 1 else "")
          + f", up to {concurrent} at once, {scheduler.upper()} on {space.metric} ({space.mode})"
          + (f"; MLflow parent run {parent.run_id}" if parent.run_id else ""), file=sys.stderr)

    setup = {"base": base_tree, "name": name, "parent_run_id": parent.run_id, "runs_root": runs_root, "result_key": space.result_key}
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"CPU": trial_cpus})
    if scheduler == "asha":
        sched = ASHAScheduler(time_attr="training_iteration", grace_period=grace_period, reduction_factor=reduction_factor,
                              max_t=max(grace_period, 100_000))
    else:
        sched = FIFOScheduler()

    def short_name(trial) -> str:
        return f"t{trial_index(trial.trial_id):03d}"

    run_config = tune.RunConfig(
        name=name, storage_path=root, verbose=1 if progress else 0,
        failure_config=tune.FailureConfig(max_failures=0, fail_fast=False),
    )
    if tune.Tuner.can_restore(experiment_dir):
        print(f"tune {name}: resuming the search found in {experiment_dir}", file=sys.stderr)
        tuner = tune.Tuner.restore(experiment_dir, trainable, resume_unfinished=True, resume_errored=True,
                                   param_space=space.param_space())
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=space.param_space(),
            tune_config=tune.TuneConfig(
                metric=space.result_key, mode=space.mode, scheduler=sched, num_samples=trials,
                search_alg=BasicVariantGenerator(max_concurrent=concurrent, random_state=cfg.train.seed if seed is None else seed),
                trial_name_creator=short_name, trial_dirname_creator=short_name,
            ),
            run_config=run_config,
        )
    try:
        results = tuner.fit()
    except BaseException:
        parent.finish("KILLED")
        raise

    rows = _rows_from_results(results, space, name)
    _reconcile_with_mlflow(rows, parent, space.result_key, space.mode)
    sign = 1 if space.mode == "max" else -1
    scored = [r for r in rows if r.best is not None]
    best = max(scored, key=lambda r: sign * r.best) if scored else None
    summary = TuneSummary(name, space.metric, space.mode, rows, best, out_dir, None, parent.run_id, parent.uri, time.time() - started,
                          [d.key for d in space.dims])

    head, body = results_table(summary)
    write_text(out_dir / "results.md", markdown_table(head, body) + "\n")
    write_text(out_dir / "results.csv", csv_text(head, body))
    for f in ("results.md", "results.csv"):
        parent.log_artifact(out_dir / f, "tune")
    if best is not None:
        path = out_dir / "best_config.yaml"
        write_text(path, best_config_yaml(base_tree, best, name, space, base_storage))
        summary.best_config = path
        parent.log_artifact(path, "tune")
        parent.log_metrics(best.best_metrics, step=best.best_step or 0)
        parent.set_tags({"dmltrain.tune.best_trial": best.run_name, "dmltrain.tune.best_run_id": best.mlflow_run_id or "",
                         **{f"dmltrain.tune.best.{k}": repr(v) for k, v in best.params.items()}})
    parent.finish("FINISHED" if best is not None else "FAILED")
    return summary


def render(summary: TuneSummary) -> str:
    head, body = results_table(summary)
    lines = [markdown_table(head, body), ""]
    failed = [r for r in summary.rows if r.error]
    for r in failed:
        lines.append(f"{r.run_name} failed: {r.error}")
    if failed:
        lines.append("")
    if summary.best is None:
        lines.append(f"no trial reported {summary.metric}: nothing to pick")
    else:
        b = summary.best
        vals = ", ".join(f"{k}={v!r}" for k, v in b.params.items())
        lines.append(f"best trial {b.run_name}: {summary.metric} {b.best:.4f} at step {b.best_step} ({vals})")
        lines.append(f"best config: {summary.best_config}   (dmltrain train {summary.best_config})")
        lines.append("")
        lines.append(summary.best_config.read_text().rstrip())
    lines.append("")
    counts = {s: sum(r.status == s for r in summary.rows) for s in ("finished", "stopped early", "failed")}
    lines.append(f"search {summary.name}: {len(summary.rows)} trials in {summary.seconds:.0f}s ("
                 + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ")")
    lines.append(f"results: {summary.out_dir / 'results.md'}, {summary.out_dir / 'results.csv'}")
    if summary.parent_run_id:
        lines.append(f"MLflow parent run: {summary.parent_run_id} ({len(summary.rows)} child runs)")
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config of the run to tune (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied before sampling, e.g. train.epochs=4")
    parser.add_argument("--space", required=True, help="search space YAML over dotted config keys (see configs/tune/)")
    parser.add_argument("--trials", type=int, default=8, help="samples drawn from the space (x the grid size, as in Ray Tune; default 8)")
    parser.add_argument("--scheduler", choices=("fifo", "asha"), default="fifo",
                        help="asha: stop weak trials early (async successive halving); fifo: run every trial to the end (default)")
    parser.add_argument("--grace-period", type=int, default=1, help="ASHA: evaluations a trial always gets (default 1)")
    parser.add_argument("--reduction-factor", type=float, default=2.0, help="ASHA: keep the top 1/factor at each rung (default 2)")
    parser.add_argument("--max-concurrent", type=int, help="trials at once (default: as many as the cluster's CPUs/GPUs hold)")
    parser.add_argument("--trial-cpus", type=float, default=0.1, help="CPUs reserved for each trial's driver (default 0.1)")
    parser.add_argument("--name", help="search name (default tune-<config>-<time>); an existing search of this name resumes")
    parser.add_argument("--out", help="directory of results.md/csv and best_config.yaml (default <storage>/<name>)")
    parser.add_argument("--seed", type=int, help="random seed of the sampling (default train.seed)")
    parser.add_argument("--no-progress", action="store_true", help="no Tune status table")


def run(args: argparse.Namespace) -> int:
    from dmltrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    summary = tune_search(
        cfg, args.space, args.trials, scheduler=args.scheduler, grace_period=args.grace_period,
        reduction_factor=args.reduction_factor, max_concurrent=args.max_concurrent, trial_cpus=args.trial_cpus,
        name=args.name, out=args.out, seed=args.seed, config_name=Path(args.config).stem, progress=not args.no_progress,
    )
    print(render(summary))
    return 0 if summary.best is not None else 1
