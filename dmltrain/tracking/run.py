"""The failure-safe handle on one MLflow run, used by every writer: training, tune, study.

One MLflow run per training: ``dmltrain train`` (the driver) opens it with
:meth:`RunHandle.open`, tagged with the run name, before any worker starts and hands its id to
the workers; rank 0 attaches to it (:meth:`RunHandle.attach`) and logs metrics, artifacts and
models. A worker group restarted after a failure, or the same command run again with the same
``train.run_name``, logs into the same run. A Tune search or a study opens a parent run the same
way; its trials or points are child runs.

Tracking never stops the work it records: the first failure to reach MLflow or to write to it is
reported once on stderr (``dmltrain: warning: ...; training continues without tracking``), and
the handle is off for the rest of the process. A model that cannot be logged to MLflow's Models
(:meth:`RunHandle.log_model`) is reported once too, and only model logging stops.

Besides metrics, params and artifacts a run carries its description (MLflow's note,
:meth:`RunHandle.set_description`, written by :mod:`dmltrain.tracking.description`), its datasets
(:meth:`RunHandle.log_inputs`, from :mod:`dmltrain.tracking.datasets`) and one logged model per
kind (``model``, ``best_model``: a new one replaces the run's earlier one of that name, whose files are removed).

What a handle writes as text (params, tags, text artifacts) and every warning it prints is redacted first
(:mod:`dmltrain.redact`): no URL's password and no storage option outside the allow-list reaches MLflow.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import numbers
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import mlflow
import mlflow.pytorch
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, LoggedModel, LoggedModelOutput, LoggedModelStatus, Metric, Param, RunTag
from mlflow.entities.run import Run
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.utils.file_utils import local_file_uri_to_path
from mlflow.utils.uri import append_to_uri_path, is_local_uri
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_param_name

from dmltrain.redact import redact, redact_url
from dmltrain.text import printable
from dmltrain.tracking.links import run_url, ui_base
from dmltrain.tracking.names import (
    DESCRIPTION_TAG,
    EVAL_PREFIX,
    PARENT_RUN_TAG,
    RESUMED_PARAM_PREFIX,
    RUN_NAME_TAG,
    metric_key,
)
from dmltrain.tracking.queries import child_runs, run_by_name

PARAM_CHARS = 6000  # MLflow's limit on a param value
TAG_CHARS = 5000  # ... and on a tag value, with room to spare
PARAMS_PER_BATCH = 100  # MLflow's log_batch limits
METRICS_PER_BATCH = 500

T = TypeVar("T")


def warn(message: str) -> None:
    print(f"dmltrain: warning: {redact_url(message)}", file=sys.stderr, flush=True)


def _reason(error: BaseException) -> str:
    """``Type: message`` on one line (some errors, torch.export's, span many), clipped."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def artifact_location(uri: str) -> str | None:
    """Artifacts of a SQLite store live beside the database file.

    MLflow's default is ``./mlruns`` under the current directory, which for a Ray job is a
    temporary working directory: the plots and models would vanish with it.
    """
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).resolve().parent / "mlartifacts")
    return None


class RunHandle:
    """One MLflow run. Every call is failure-safe (see the module doc) and a no-op once the handle is off.

    ``RunHandle(uri, run_id)`` contacts nothing; ``run_id=None`` is a handle that is off (tracking
    disabled, or the run could not be opened). ``owner`` names what goes on without tracking in
    the warning (training, the search, the study).
    """

    def __init__(self, uri: str, run_id: str | None, *, owner: str = "training", client: MlflowClient | None = None):
        self.uri, self.run_id, self.owner = uri, run_id, owner
        self.resumed = False  # set by open(): an existing run of this name was found
        self._experiment_id: str | None = None
        self._client = None if run_id is None else (client or MlflowClient(tracking_uri=uri))
        self._monitor: SystemMetricsMonitor | None = None
        self._models = True  # model logging still on
        self._logged_through: int | None = None  # metrics at steps up to this one are not logged (skip_logged_steps)

    # -- opening ---------------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
        *,
        tags: Mapping[str, str] | None = None,
        parent_run_id: str | None = None,
        owner: str = "training",
    ) -> RunHandle:
        """The run tagged ``run_name`` in ``experiment`` (created with its artifacts beside a SQLite
        store), resumed (``resumed`` True, status RUNNING again) or else created with ``params``, ``tags``
        and ``parent_run_id``. Params are immutable in MLflow, so a resumed run keeps its original
        params and the values that changed are recorded as ``resumed.<key>`` tags. An unreachable
        server gives a handle that is off, after one warning."""
        try:
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(experiment)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else client.create_experiment(experiment, artifact_location=artifact_location(uri))
            )
            found = run_by_name(client, exp_id, run_name)
            if found is not None:
                handle = cls(uri, found.info.run_id, owner=owner, client=client)
                handle.resumed, handle._experiment_id = True, exp_id
                old = found.data.params
                for k, v in redact(dict(params)).items():
                    if k in old and old[k] != str(v)[:PARAM_CHARS]:
                        client.set_tag(handle.run_id, RESUMED_PARAM_PREFIX + k, str(v)[:TAG_CHARS])
                client.update_run(handle.run_id, status="RUNNING")
                return handle
            all_tags = {RUN_NAME_TAG: run_name, **(tags or {})}
            if parent_run_id:
                all_tags[PARENT_RUN_TAG] = parent_run_id
            run = client.create_run(exp_id, run_name=run_name, tags=redact(all_tags))
            handle = cls(uri, run.info.run_id, owner=owner, client=client)
            handle._experiment_id = exp_id
            _log_params(client, handle.run_id, params)
            return handle
        except Exception as e:  # noqa: BLE001 — any failure to reach tracking must not stop the work
            cls._unreachable(uri, e, owner)
            return cls(uri, None, owner=owner)

    @classmethod
    def for_config(
        cls,
        cfg: Any,
        run_name: str,
        params: Mapping[str, Any],
        *,
        tags: Mapping[str, str] | None = None,
        parent_run_id: str | None = None,
        owner: str = "training",
    ) -> RunHandle:
        """:meth:`open` on the config's store and experiment (``tracking.*``); a handle that is off when
        ``tracking.enabled`` is false."""
        uri = cfg.tracking.resolved_uri()
        if not cfg.tracking.enabled:
            return cls(uri, None, owner=owner)
        return cls.open(
            uri, cfg.tracking.experiment, run_name, params, tags=tags, parent_run_id=parent_run_id, owner=owner
        )

    @classmethod
    def attach(
        cls, uri: str, run_id: str | None, *, system_metrics: bool = False, owner: str = "training"
    ) -> RunHandle:
        """The handle of an existing run, checked to be reachable (rank 0 on a worker); with
        ``system_metrics``, MLflow's CPU/GPU/memory monitor logs into the run until :meth:`close`."""
        handle = cls(uri, run_id, owner=owner)
        if run_id is None:
            return handle
        try:
            handle._client.get_run(run_id)
            if system_metrics:
                # resume_logging: a restarted worker group continues the system-metric steps
                handle._monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=uri)
                handle._monitor.start()
        except Exception as e:  # noqa: BLE001
            cls._unreachable(uri, e, owner)
            handle._client = None
        return handle

    @property
    def experiment_id(self) -> str | None:
        """The run's experiment (read once from MLflow when the handle was not opened here); None when off."""
        if self._experiment_id is None and self.run_id is not None:
            self._experiment_id = self.query("read the run", lambda c: c.get_run(self.run_id).info.experiment_id)
        return self._experiment_id

    def url(self, tab: str = "", ui: str | None = None) -> str | None:
        """The run's page in MLflow's UI (``ui``, default: the tracking server's, or ``mlflow ui``'s), opening
        in its model-training view (:mod:`dmltrain.tracking.links`); None when tracking is off."""
        exp = self.experiment_id if self.enabled else None
        return run_url(ui or ui_base(self.uri), exp, self.run_id, tab) if exp is not None else None

    def child(self, run_id: str) -> RunHandle:
        """A handle on another run of the same store (a child run), sharing this one's client."""
        return RunHandle(self.uri, run_id, owner=self.owner, client=self._client)

    # -- failure handling --------------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self._client is not None

    @staticmethod
    def _unreachable(uri: str, error: BaseException, owner: str) -> None:
        warn(f"MLflow at {uri} is unreachable ({_reason(error)}); {owner} continues without tracking")

    def query(self, what: str, fn: Callable[[MlflowClient], T], default: T = None) -> T:
        """``fn(client)``, or ``default`` when the handle is off or the call fails (``what`` names it in
        the one warning; the handle is off afterwards). Reads and writes alike go through here."""
        if self._client is None:
            return default
        try:
            return fn(self._client)
        except Exception as e:  # noqa: BLE001 — tracking never stops the work
            warn(f"MLflow at {self.uri}: could not {what} ({_reason(e)}); {self.owner} continues without tracking")
            self._client = None
            return default

    # -- writing -------------------------------------------------------------------------------------------------
    def log_params(self, params: Mapping[str, Any]) -> None:
        self.query("log params", lambda c: _log_params(c, self.run_id, params))

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0, *, again: bool = False) -> None:
        """Log ``metrics`` at ``step`` under their MLflow keys (:func:`~dmltrain.tracking.names.metric_key`);
        NaN and values that are not numbers are left out. ``again``: even at a step the run already holds
        (a value that changes when the workers restart there, such as their number)."""
        if not again and self._logged_through is not None and step <= self._logged_through:
            return  # the run holds this step already: a resumed run replaying the steps after its checkpoint
        ts = int(time.time() * 1000)
        items = [
            Metric(metric_key(k), float(v), ts, step)
            for k, v in metrics.items()
            if isinstance(v, numbers.Real) and v == v
        ]
        if not items:
            return

        def send(c: MlflowClient) -> None:
            for i in range(0, len(items), METRICS_PER_BATCH):
                c.log_batch(self.run_id, metrics=items[i : i + METRICS_PER_BATCH])

        self.query("log metrics", send)

    def skip_logged_steps(self) -> int | None:
        """From now on log no metric at a step up to the last one the run already holds, so that a resumed run,
        which replays the steps after its checkpoint, leaves one value per step in the history; returns that
        step (None: the run holds none, or it cannot be read). System metrics count their own steps: left out."""

        def last(c: MlflowClient) -> int | None:
            metrics = c.get_run(self.run_id).data.to_proto().metrics
            return max((m.step for m in metrics if not m.key.startswith("system/")), default=None)

        self._logged_through = self.query("read the run's last logged step", last)
        return self._logged_through

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.query("log an artifact", lambda c: c.log_artifact(self.run_id, str(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        """``text`` as the artifact ``artifact_file`` (e.g. ``tune/space.yaml``), URL userinfo redacted."""
        self.query("log a text artifact", lambda c: c.log_text(self.run_id, redact_url(text), artifact_file))

    def set_description(self, text: str) -> None:
        """The run's description, shown on its MLflow page (Markdown; MLflow's note)."""
        self.set_tags({DESCRIPTION_TAG: text})

    def description(self) -> str | None:
        """The run's description; None when it has none or it cannot be read."""
        return self.query("read the run description", lambda c: c.get_run(self.run_id).data.tags.get(DESCRIPTION_TAG))

    def log_inputs(self, datasets: list[DatasetInput]) -> None:
        """Datasets the run reads (:func:`dmltrain.tracking.datasets.dataset_inputs`), logged again after a
        concurrent run inserted the same dataset first (:func:`~dmltrain.tracking.datasets.log_dataset_inputs`)."""
        from dmltrain.tracking.datasets import log_dataset_inputs

        self.query("log the datasets", lambda c: log_dataset_inputs(c, self.run_id, datasets))

    def set_tag(self, key: str, value: Any) -> None:
        self.set_tags({key: value})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set ``tags`` (values as text, clipped to MLflow's limit, redacted) in one request."""
        items = [RunTag(k, str(v)[:TAG_CHARS]) for k, v in redact(dict(tags)).items()]
        if items:
            self.query("set tags", lambda c: c.log_batch(self.run_id, tags=items))

    def delete_tag(self, key: str) -> None:
        """Remove tag ``key`` if the run has it (MLflow refuses to delete a tag that is not there)."""

        def delete(c: MlflowClient) -> None:
            if key in c.get_run(self.run_id).data.tags:
                c.delete_tag(self.run_id, key)

        self.query("delete a tag", delete)

    def finish(self, status: str) -> None:
        """Set the final status: FINISHED, FAILED or KILLED (the driver's or the search's call, not the workers')."""
        self.query("set the run status", lambda c: c.set_terminated(self.run_id, status=status))

    def status(self) -> str | None:
        """The run's MLflow status (RUNNING, FINISHED, FAILED, KILLED); None when the handle is off or it cannot be read."""
        return self.query("read the run status", lambda c: c.get_run(self.run_id).info.status)

    def children(self) -> list[Run]:
        """The child runs (a search's trials, a study's points), oldest first; [] when they cannot be read."""
        return self.query(
            "list the child runs", lambda c: child_runs(c, c.get_run(self.run_id).info.experiment_id, self.run_id), []
        )

    def log_model(
        self,
        model: Any,
        name: str,
        *,
        step: int,
        input_example: np.ndarray,
        tags: Mapping[str, Any] | None = None,
    ) -> str | None:
        """Log ``model`` the MLflow 3 way: a LoggedModel named ``name``, output of this run at ``step``,
        tagged with ``tags`` (e.g. its step and score), replacing the run's earlier model of that name.

        The model is linked to the evaluation this run logged at ``step`` (its ``eval/`` metrics: log
        the evaluation first), so the Models view shows those beside it and
        ``mlflow.search_logged_models`` ranks it by them; the run's other metrics at that step (time,
        memory) are not linked. The run keeps one logged model per name: the earlier ones (the previous
        best) are deleted once this one is logged, and their files removed (:func:`remove_model_files`).
        The model is saved as ``pt2`` (``torch.export``: loads with torch alone and runs no pickled code),
        traced on ``input_example`` (a batch of at least 2, so the batch size stays free); it must be an
        ``nn.Module`` holding its full weights, in eval mode, on the CPU. Returns the model id, or None when tracking is off or the model could
        not be logged (one warning, then model logging is off; metrics and files go on).
        """
        if self._client is None or not self._models:
            return None
        client, model_id = self._client, None
        try:
            run = client.get_run(self.run_id)
            logged = client.create_logged_model(
                run.info.experiment_id,
                name=name,
                source_run_id=self.run_id,
                params=dict(run.data.params),
                tags={k: str(v) for k, v in (tags or {}).items()},
            )
            model_id = logged.model_id
            with _fluent_tracking_uri(self.uri):  # log_model reads the process-wide tracking URI
                mlflow.pytorch.log_model(  # no run_id: the output and its metrics are linked below
                    model,
                    name=name,
                    model_id=model_id,
                    input_example=input_example,
                    serialization_format="pt2",
                    pip_requirements=[_torch_requirement()],
                )
            client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step=step)])
            _link_evaluation(client, run, model_id, step)
            earlier = client.search_logged_models(
                [run.info.experiment_id],
                filter_string=f"source_run_id = '{self.run_id}' AND name = '{name}'",
            )
            replaced = [m for m in earlier if m.model_id != model_id]
            if replaced:
                root = client.get_experiment(run.info.experiment_id).artifact_location
                for m in replaced:
                    client.delete_logged_model(m.model_id)
                    remove_model_files(m, root)
            return model_id
        except Exception as e:  # noqa: BLE001 — the model files are logged apart from this
            self._models = False
            warn(
                f"MLflow at {self.uri}: could not log model {name} to MLflow's Models ({_reason(e)}); "
                "its files are still logged as artifacts, later models are not logged there"
            )
            if model_id is not None:
                with contextlib.suppress(Exception):
                    client.finalize_logged_model(model_id, LoggedModelStatus.FAILED)
            return None

    def attach_model_files(
        self, name: str, files: list[str | os.PathLike[str]], artifact_path: str, tags: Mapping[str, Any]
    ) -> str | None:
        """Add ``files`` under ``artifact_path`` to this run's latest LoggedModel called ``name`` (one is created,
        output of this run, when it logged none), and set ``tags`` on it; returns its id, or None when tracking
        is off or the call failed (one warning). An exported serving model and its contract land here."""

        def attach(c: MlflowClient) -> str:
            run = c.get_run(self.run_id)
            found = c.search_logged_models(
                [run.info.experiment_id],
                filter_string=f"source_run_id = '{self.run_id}' AND name = '{name}'",
                order_by=[{"field_name": "creation_time", "ascending": False}],
                max_results=1,
            )
            model_id = found[0].model_id if found else None
            if model_id is None:
                model_id = c.create_logged_model(run.info.experiment_id, name=name, source_run_id=self.run_id).model_id
            for f in files:
                c.log_model_artifact(model_id, str(f), artifact_path)
            c.set_logged_model_tags(model_id, {k: str(v)[:TAG_CHARS] for k, v in tags.items()})
            if not found:
                c.finalize_logged_model(model_id, LoggedModelStatus.READY)
            return model_id

        return self.query(f"attach files to the logged model {name}", attach)

    def close(self) -> None:
        """Stop the system-metrics monitor; the run's final status is the driver's to set (:meth:`finish`)."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None


_MODEL_ID = re.compile(r"^m-[0-9a-f]+$")  # MLflow's logged-model ids


def remove_model_files(model: LoggedModel, experiment_location: str) -> bool:
    """Remove the files of a replaced (deleted) logged model, which MLflow's delete keeps until ``mlflow gc``: a
    run replacing its ``best_model`` at every improvement would otherwise keep every earlier one on disk. Only the
    model's own folder where the store puts it, ``<experiment artifacts>/models/<model id>``, is removed, on a
    local disk without following a link (a location elsewhere, a link in its place, an id that is not MLflow's:
    nothing is), or through the artifact store's own delete for a remote one. Returns whether files were
    removed; a failure is not raised (the model is deleted in MLflow either way)."""
    if not _MODEL_ID.match(model.model_id) or not experiment_location:
        return False
    expected = append_to_uri_path(experiment_location, "models", model.model_id, "artifacts")
    if model.artifact_location.rstrip("/") != expected.rstrip("/"):
        return False
    try:
        if is_local_uri(experiment_location, is_tracking_or_registry_uri=False):
            models = Path(local_file_uri_to_path(experiment_location)) / "models"
            folder = models / model.model_id
            if models.is_symlink() or folder.is_symlink() or not folder.is_dir():
                return False
            shutil.rmtree(folder)  # removes links inside it, never what they point to
        else:
            get_artifact_repository(model.artifact_location).delete_artifacts()
        return True
    except Exception:  # noqa: BLE001 — disk space, not correctness: the model is deleted in MLflow
        return False


def _link_evaluation(client: MlflowClient, run: Run, model_id: str, step: int) -> None:
    """Link the run's evaluation at ``step`` to a logged model: each ``eval/`` value of that step logged
    again with the model's id and its original timestamp, so the run's own history gains no point."""
    linked = [
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model_id)
        for key in run.data.metrics
        if key.startswith(EVAL_PREFIX)
        for m in client.get_metric_history(run.info.run_id, key)
        if m.step == step
    ]
    for i in range(0, len(linked), METRICS_PER_BATCH):
        client.log_batch(run.info.run_id, metrics=linked[i : i + METRICS_PER_BATCH])


# MLflow lists a run's params in the order they were logged: what defines the run first, the plumbing
# (storage, remote reads, tracking) last; within a group the config's own order
PARAM_ORDER = ("model.", "loss.", "optim.", "schedule.", "train.", "data.", "eval.", "cluster.", "tracking.")
PARAMS_LAST = ("data.remote.", "data.storage_options", "data.loader_workers", "data.decode", "eval.async_")


def param_rank(key: str) -> int:
    """Where a param goes in the order it is logged in (:data:`PARAM_ORDER`; :data:`PARAMS_LAST` after all)."""
    if key.startswith(PARAMS_LAST):
        return len(PARAM_ORDER) + 1
    return next((i for i, prefix in enumerate(PARAM_ORDER) if key.startswith(prefix)), len(PARAM_ORDER))


def _log_params(client: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    """Params as MLflow keeps them, redacted (:func:`dmltrain.redact.redact`): no URL userinfo, and storage
    options outside the allow-list as ``<redacted>``. A key MLflow refuses (a storage option named with a
    character MLflow does not allow, ``!`` or ``@``) is left out with a warning naming it: one bad key would
    otherwise fail the whole batch, and with it the run's tracking."""
    ordered = sorted(redact(dict(params)).items(), key=lambda kv: param_rank(kv[0]))  # stable within a group
    rejected = [k for k, _ in ordered if not _param_key_ok(k)]
    if rejected:
        names = ", ".join(repr(printable(k, 120)) for k in rejected[:5]) + (" ..." if len(rejected) > 5 else "")
        warn(
            f"MLflow refuses the param key{'s' if len(rejected) > 1 else ''} {names} (letters, digits and _ - . "
            "space : / only): not logged; the run is tracked without it"
        )
    items = [Param(k, str(v)[:PARAM_CHARS]) for k, v in ordered if k not in rejected]
    for i in range(0, len(items), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + PARAMS_PER_BATCH])


def _param_key_ok(key: str) -> bool:
    """Whether MLflow accepts ``key`` as a param name (its own check: characters, length, no ``..`` path)."""
    try:
        _validate_param_name(key)
    except MlflowException:
        return False
    return len(key) <= MAX_ENTITY_KEY_LENGTH


def _torch_requirement() -> str:
    """``torch==X.Y.Z`` without the local build label (``+cu128``), which pip cannot resolve."""
    return f"torch=={importlib.metadata.version('torch').split('+')[0]}"


@contextlib.contextmanager
def _fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide tracking URI at ``uri`` for the block, then restore it (and the
    ``MLFLOW_TRACKING_URI`` variable, which ``set_tracking_uri`` rewrites)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(before)
        if env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = env
