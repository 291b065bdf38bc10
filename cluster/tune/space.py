"""The search space of ``dmltrain tune``: the file, its checks against the config, sampled values into a config.

A space maps dotted config keys to distributions (see :mod:`cluster.tune`). :func:`load_space`
checks it against the resolved config before anything starts; :func:`apply_params` turns a
sample into the config tree a trial trains, and :func:`~dmltrain.config.build_config` checks that tree as the
trial will (the losses' values included).
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel
from ray import tune

from dmltrain.config import Config, build_config
from dmltrain.config_tree import parse_yaml, set_dotted
from dmltrain.errors import UserError
from dmltrain.text import finite_number
from dmltrain.tracking.names import report_key

DISTRIBUTIONS = ("uniform", "loguniform", "choice", "grid")
SPACE_KEYS = ("metric", "mode", "space")
COMBINATIONS_CHECKED = 512  # discrete combinations validated up front; beyond this only each value alone


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
        return report_key(self.metric)

    @property
    def grid_size(self) -> int:
        return math.prod(len(d.values) for d in self.dims if d.kind == "grid")

    def param_space(self) -> dict[str, Any]:
        return {d.key: d.domain() for d in self.dims}


def _unwrap_model(annotation: Any):
    """The config section class inside ``annotation`` (``X``, ``X | None``), or None."""
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
                raise UserError(
                    f"{where}: {here} is null in the config, so {key} cannot be tuned; set {here} in the config first"
                )
            model, node = section, node[part]
        elif _is_mapping(annotation):
            model, node = None, node.get(part) or {}
        else:
            raise UserError(f"{where}: {here} is a value, not a section")
    return Any


def apply_params(tree: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``tree`` (copied) with each dotted key of ``params`` set in order.

    A mapping value is merged into the section it lands on, so one choice can set keys together
    (P×K: ``data: {choice: [{batch_size: 75, samples_per_class: 5}, ...]}``); None replaces.
    Missing sections are created; a key through a value is a :class:`ConfigError` (the space's
    keys are checked against the config first, :func:`check_key`).
    """
    tree = copy.deepcopy(tree)
    for key, value in params.items():
        set_dotted(tree, key, value, merge=True)
    return tree


def refusal(tree: dict[str, Any]) -> str | None:
    """Why the config refuses ``tree`` (one line naming the key), or None when it is a valid run config."""
    try:
        build_config(tree, source="config")
    except UserError as e:
        msg = str(e)
        return msg[len("config: ") :] if msg.startswith("config: ") else msg
    return None


def _parse_dimension(key: str, spec: Any, where: str) -> Dimension:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise UserError(
            f"{where}: give one distribution as a mapping, e.g. {{uniform: [0.03, 0.1]}} "
            f"({', '.join(DISTRIBUTIONS)}), got {spec!r}"
        )
    kind, values = next(iter(spec.items()))
    if kind not in DISTRIBUTIONS:
        raise UserError(f"{where}: unknown distribution '{kind}' (use {', '.join(DISTRIBUTIONS)})")
    if kind in ("uniform", "loguniform"):
        if not (isinstance(values, list) and len(values) == 2 and all(finite_number(v) for v in values)):
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
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--space {path}: file not found")
    text = path.read_text()
    doc = parse_yaml(text, path)
    if not isinstance(doc, dict):
        raise UserError(f"{path}: a search space is a YAML mapping with keys {', '.join(SPACE_KEYS)}")
    unknown = [k for k in doc if k not in SPACE_KEYS]
    if unknown:
        raise UserError(f"{path}: {unknown[0]}: unknown key (a search space has {', '.join(SPACE_KEYS)})")
    space = doc.get("space")
    if not isinstance(space, dict) or not space:
        raise UserError(f"{path}: space: give a mapping of dotted config keys to distributions")

    base = build_config(base_tree, source="config")
    metric = str(doc.get("metric", base.eval.metric))
    metrics = base.eval.metric_names()
    if metric not in metrics:
        raise UserError(
            f"{path}: metric: '{metric}' is not reported by the evaluation of this config (it reports: {', '.join(metrics)})"
        )
    if base.eval.mode == "async":  # asynchronous evaluations arrive after the scheduler has to decide on them
        raise UserError(
            f"{path}: eval.mode: async evaluations do not reach Tune's scheduler; tune with eval.mode=inline"
        )
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
            problem = refusal(apply_params(base_tree, {key: value}))
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
        raise UserError(
            f"{space.path}: space: no combination of the values is a valid config, e.g. {shown}: {bad[0][1]}"
        )
    print(
        f"dmltrain: warning: {space.path}: {len(bad)} of {len(combos)} value combinations are refused by the config "
        f"(e.g. {shown}: {bad[0][1]}); trials drawing them will fail",
        file=sys.stderr,
    )
