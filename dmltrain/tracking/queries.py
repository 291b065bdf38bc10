"""Reading runs back from MLflow: a run by name or token, child runs, metric histories, the best point,
and the one aggregation of a speed metric's history that every reader shares (:func:`steady_state`).

Each function takes an ``MlflowClient`` and lets MLflow's errors through: ``dmltrain report``
turns them into one line for the user, and a :class:`~dmltrain.tracking.run.RunHandle` runs
them failure-safe (:meth:`~dmltrain.tracking.run.RunHandle.query`) where the results on disk
stand without MLflow (tune, study).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException

from dmltrain.tracking.names import PARENT_RUN_TAG, RUN_NAME_TAG, display_key

MAX_CHILDREN = 5000
OLDEST_FIRST = ["attributes.start_time ASC"]


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "\\'") + "'"


def run_by_name(client: MlflowClient, experiment_id: str, run_name: str) -> Run | None:
    """The run of the experiment tagged with dmltrain's run name ``run_name``, or None."""
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = {_quoted(run_name)}", max_results=1
    )
    return found[0] if found else None


def find_run(client: MlflowClient, experiment_id: str, token: str) -> Run | None:
    """A run of the experiment by id, by dmltrain run name, or by MLflow run name; None when none matches."""
    try:
        run = client.get_run(token)
        if run.info.experiment_id == experiment_id:
            return run
    except MlflowException:
        pass
    found = run_by_name(client, experiment_id, token)
    if found is not None:
        return found
    by_mlflow_name = client.search_runs(
        [experiment_id], filter_string=f"attributes.run_name = {_quoted(token)}", max_results=1
    )
    return by_mlflow_name[0] if by_mlflow_name else None


def child_runs(client: MlflowClient, experiment_id: str, parent_run_id: str) -> list[Run]:
    """The runs whose parent is ``parent_run_id`` (a search's trials, a study's points), oldest first."""
    return list(
        client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{PARENT_RUN_TAG}` = {_quoted(parent_run_id)}",
            order_by=OLDEST_FIRST,
            max_results=MAX_CHILDREN,
        )
    )


def experiment_runs(client: MlflowClient, experiment_id: str, max_results: int = 50000) -> list[Run]:
    """Every run of the experiment, oldest first."""
    return list(client.search_runs([experiment_id], order_by=OLDEST_FIRST, max_results=max_results))


def leaf_runs(runs: Iterable[Run]) -> list[Run]:
    """``runs`` without those that are the parent of another of them (a parent stands for its children)."""
    runs = list(runs)
    parents = {r.data.tags.get(PARENT_RUN_TAG) for r in runs}
    return [r for r in runs if r.info.run_id not in parents]


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every logged value of metric ``key``, by step then time of logging.

    A resumed run logs the steps after its checkpoint again: both values are kept, the later last.
    """
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in points]


def values_at_step(client: MlflowClient, run: Run, step: int, prefix: str) -> dict[str, float]:
    """The run's metrics under ``prefix`` (e.g. ``eval/``) as logged at ``step`` (the latest value
    when logged twice), by display name (``eval/recall@1``); metrics without a value there are left out."""
    out = {}
    for key in run.data.metrics:
        if key.startswith(prefix):
            values = [v for s, v in history(client, run.info.run_id, key) if s == step]
            if values:
                out[display_key(key)] = float(values[-1])
    return out


def best_point(points: Iterable[tuple[int, float]], mode: str = "max") -> tuple[int, float] | None:
    """The ``(step, value)`` with the best value (highest, or lowest for ``mode='min'``); the earliest
    step among equal values (as Tune's ``idxmax``); None for no points."""
    sign = 1 if mode == "max" else -1
    points = list(points)
    if not points:
        return None
    return max(points, key=lambda sv: (sign * sv[1], -sv[0]))


STEADY_STATE = (
    "median over the logged windows after the first"  # how a run's speed is read: the first window holds the start-up
)


def steady_state(values: Iterable[float]) -> float:
    """A speed metric's figure for the whole run (images/s, step time): the median of its logged
    windows after the first, which holds the start-up (all of them when there is one); NaN values are
    left out; NaN when nothing is left. The report and the study both read speed this way."""
    vals = [float(v) for v in values if v == v]
    if not vals:
        return float("nan")
    return float(statistics.median(vals[1:] if len(vals) > 1 else vals))
