"""MLflow for a training run: the driver creates (or finds) the run, rank 0 logs into it.

One MLflow run per training: the driver creates it, tagged with the run name, before any
worker starts, and hands its id to the workers. A worker group restarted after a failure,
or the same command run again with the same ``train.run_name``, logs into the same run.

Tracking never stops training: the first failure to reach the server is reported once on
stderr, and tracking is then off for the rest of the process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

RUN_NAME_TAG = "dmltrain.run_name"

# Fail fast instead of retrying for minutes when the server is down (the user can override).
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def _warn(msg: str) -> None:
    print(f"dmltrain: warning: {msg}", file=sys.stderr, flush=True)


def create_or_resume_run(
    uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str] | None = None, parent_run_id: str | None = None
) -> tuple[str | None, bool]:
    """``(run_id, resumed)``: the existing run tagged ``run_name`` in ``experiment``, else a new one with ``params``.

    Returns ``(None, False)`` (after one warning) when the server cannot be reached. Params
    are immutable in MLflow, so a resumed run keeps its original params; values that
    changed are recorded as ``resumed.<key>`` tags.
    """
    from mlflow import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment, artifact_location=artifact_location(uri))
        found = client.search_runs([exp_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'", max_results=1)
        if found:
            run = found[0]
            old = run.data.params
            changed = {k: v for k, v in params.items() if k in old and old[k] != str(v)[:6000]}
            for k, v in changed.items():
                client.set_tag(run.info.run_id, f"resumed.{k}", str(v)[:5000])
            client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id, True
        all_tags = {RUN_NAME_TAG: run_name, **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = client.create_run(exp_id, run_name=run_name, tags=all_tags)
        log_params(client, run.info.run_id, params)
        return run.info.run_id, False
    except Exception as e:  # noqa: BLE001 — any failure to reach tracking must not stop training
        _warn(f"MLflow at {uri} is unreachable ({type(e).__name__}: {str(e)[:200]}); training continues without tracking")
        return None, False


def artifact_location(uri: str) -> str | None:
    """Artifacts of a SQLite store live beside the database file.

    MLflow's default is ``./mlruns`` under the current directory, which for a Ray job is a
    temporary working directory: the plots and models would vanish with it.
    """
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).resolve().parent / "mlartifacts")
    return None


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow's batch limit
        client.log_batch(run_id, params=items[i : i + 100])


def finish_run(uri: str, run_id: str | None, status: str) -> None:
    """Set the final status (FINISHED, FAILED, KILLED) from the driver."""
    if run_id is None:
        return
    try:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=uri).set_terminated(run_id, status=status)
    except Exception as e:  # noqa: BLE001
        _warn(f"could not set the MLflow run status ({type(e).__name__}: {str(e)[:200]})")


class RunLogger:
    """Rank 0's handle on the run: metrics, artifacts, system metrics. Every call is failure-safe."""

    def __init__(self, uri: str, run_id: str | None, system_metrics: bool = True):
        self.uri, self.run_id = uri, run_id
        self._client = None
        self._monitor = None
        if run_id is None:
            return
        try:
            import mlflow

            self._client = mlflow.MlflowClient(tracking_uri=uri)
            self._client.get_run(run_id)  # reachability check
            if system_metrics:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                # resume_logging: a restarted worker group continues the system-metric steps
                self._monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=uri)
                self._monitor.start()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def _fail(self, e: Exception) -> None:
        _warn(f"MLflow at {self.uri} is unreachable ({type(e).__name__}: {str(e)[:200]}); training continues without tracking")
        self._client = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled or not metrics:
            return
        from mlflow.entities import Metric
        import time

        ts = int(time.time() * 1000)
        items = [Metric(metric_key(k), float(v), ts, step) for k, v in metrics.items() if v == v]  # drop NaN
        try:
            for i in range(0, len(items), 500):
                self._client.log_batch(self.run_id, metrics=items[i : i + 500])
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        try:
            self._client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def set_tag(self, key: str, value: str) -> None:
        if not self.enabled:
            return
        try:
            self._client.set_tag(self.run_id, key, value)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def close(self) -> None:
        """Stop the system-metrics monitor; the driver sets the final run status."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None


def metric_key(k: str) -> str:
    """The MLflow key of a metric: MLflow allows only alphanumerics and ``_ - . space / :``,
    so ``eval/recall@1`` is stored as ``eval/recall_at_1`` and ``map@r`` as ``map_at_r``."""
    k = k.replace("@", "_at_")
    return "".join(c if c.isalnum() or c in "_-. /:" else "_" for c in k)


def display_key(k: str) -> str:
    """Inverse of :func:`metric_key` for the names we log: ``eval/recall_at_1`` -> ``eval/recall@1``."""
    return k.replace("_at_", "@")
