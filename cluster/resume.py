"""Which run a ``dmltrain train`` continues, and what must hold before it may.

* :func:`resolve_run_name`: ``--resume [RUN]`` to a run name (the latest run of the config by default);
* :func:`claim_run`: no live driver trains the run already, and the checkpoint it resumes from
  holds only data (:func:`~dmltrain.training.safe_load.scan_checkpoint`, before any worker loads it);
* :func:`close_crashed_runs`: runs left RUNNING by a dead driver are marked FAILED, with the
  command that resumes them;
* :func:`announce`: the run's name and MLflow run id, printed before anything else happens.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from mlflow.exceptions import MlflowException

from cluster.run_location import RunLocation, check_name
from cluster.run_records import RUNNING, RunRecord, crashed_runs, latest_run
from dmltrain.config import RUN_NAME_PATTERN, Config
from dmltrain.errors import UserError
from dmltrain.text import printable
from dmltrain.tracking.names import ERROR_TAG, REPORT_STEP, RUN_NAME_TAG, STORAGE_DIR_TAG
from dmltrain.tracking.run import RunHandle
from dmltrain.training.safe_load import scan_checkpoint

RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's list of the checkpoints it committed


def resolve_run_name(cfg: Config, where: RunLocation, config_file: str | None, resume: str | None) -> str | None:
    """The run to train: ``train.run_name`` (None when unset: a new run), or with ``resume`` the run to continue.

    ``resume``: None (start as configured), a run name, or "" for the latest run of ``config_file``
    under the runs root ``where``. A named run to resume must exist under a local root.
    """
    named = cfg.train.run_name
    if resume is None:
        return named
    if resume:
        check_name(resume, "--resume")
    if resume and named and resume != named:
        raise UserError(f"--resume {resume}: train.run_name is {named}; give one of them")
    name = resume or named
    root = where.folder
    if not name:
        if root is None:
            raise UserError(f"--resume: name the run to resume (--resume RUN): runs under {where.root} are not listed")
        name = latest_run(root, config_file)
        if name is None:
            raise UserError(
                f"--resume: no earlier run of {config_file or 'this config'} in {root}; start one without --resume"
            )
    elif root is not None and not (root / name).is_dir():
        raise UserError(f"--resume {name}: no run of that name in {root}")
    return name


def resume_checkpoint(run_dir: Path) -> tuple[Path, int] | None:
    """The checkpoint Ray Train will resume the run from (its latest committed one) and its step; None when there is none.

    Ray lists what it committed in the run folder's snapshot; a checkpoint folder not listed there
    (a driver killed while it was being written) is never loaded. A snapshot naming anything but a
    folder of the run (``../elsewhere``, an absolute path) is refused in one line: Ray would load it.
    """
    try:
        latest = json.loads((run_dir / RAY_SNAPSHOT).read_text())["latest_checkpoint_result"]
        name, step = latest["checkpoint_dir_name"], int(latest["metrics"][REPORT_STEP])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or not re.match(RUN_NAME_PATTERN, name):
        raise UserError(
            f"{printable(run_dir / RAY_SNAPSHOT)}: names the checkpoint {printable(json.dumps(name), 80)}, "
            "not a folder of the run; refused"
        )
    folder = run_dir / name
    if folder.is_symlink() or not folder.resolve().is_relative_to(run_dir.resolve()):
        raise UserError(
            f"{printable(folder)}: a symbolic link to {printable(folder.resolve())}, not a folder of the run; refused"
        )
    return folder, step


def latest_checkpoint_step(run_dir: Path) -> int | None:
    """The step a resumed run continues from; None when it has no checkpoint."""
    found = resume_checkpoint(run_dir)
    return None if found is None else found[1]


def claim_run(run_dir: Path, run_name: str) -> RunRecord | None:
    """Refuse a run whose recorded driver is still running, or whose checkpoint to resume from holds more than data;
    returns the record of the run's previous driver (None for a new run), whose generation this driver's follows.

    A record that is not one dmltrain wrote (:meth:`RunRecord.read`) refuses the run in one line too: whether a
    driver still trains it cannot be told."""
    try:
        record = RunRecord.read(run_dir)
    except UserError as e:
        raise UserError(f"{e}; remove it to train run {run_name}") from None
    if record is not None and record.status == RUNNING and record.driver_alive(run_dir):
        raise UserError(
            f"run {run_name} is being trained by another driver ({record.describe()}); stop it first, or wait"
        )
    found = resume_checkpoint(run_dir)
    if found is not None:
        scan_checkpoint(found[0])
    return record


def close_crashed_runs(root: Path, keep: str, tracking_uri: str | None) -> None:
    """Mark FAILED every run under ``root`` left RUNNING by a driver that died (all but ``keep``, about to be resumed).

    The record is data: its MLflow run is closed in this config's store ``tracking_uri`` (None: tracking off),
    never in the store the record names, and only if that run is this folder's (its run-name and storage tags
    say so); otherwise the message says what to do."""
    for run_dir, record in crashed_runs(root):
        name = run_dir.name  # the record's run_name is checked to be the folder's
        if name == keep:
            continue
        reason = f"the driver ({record.describe()}) died without ending the run"
        closed = tracking_uri is not None and _close_mlflow_run(tracking_uri, record.mlflow_run_id, run_dir, reason)
        record.status = "FAILED"
        record.write(run_dir)
        resume = (
            shlex.join(["dmltrain", "train", printable(record.config), "--resume", name])
            if record.config
            else f"train.run_name={name}"
        )
        where = "" if closed else "; its MLflow run, not found in this config's store, was left as it is"
        print(f"dmltrain: run {name}: {reason}; marked FAILED{where} (resume it with: {resume})", file=sys.stderr)


def _close_mlflow_run(uri: str, run_id: str | None, run_dir: Path, reason: str) -> bool:
    """End MLflow run ``run_id`` of the store ``uri`` FAILED with ``reason`` if it is the RUNNING run of ``run_dir``;
    whether it was."""
    if run_id is None:
        return False

    def find(client):
        try:
            return client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    handle = RunHandle(uri, run_id)
    run = handle.query(f"read MLflow run {run_id}", find)
    tags = run.data.tags if run is not None else {}
    if tags.get(RUN_NAME_TAG) != run_dir.name or tags.get(STORAGE_DIR_TAG) != str(run_dir):
        return False  # another run's id: a record copied or planted elsewhere names it
    if run.info.status == RUNNING:
        handle.set_tag(ERROR_TAG, reason)
        handle.finish("FAILED")
    return True


def announce(
    run_name: str, run_id: str | None, cfg: Config, config_path: str | None, resumed_step: int | None, resumed: bool
) -> None:
    """The run's name and MLflow run id, before anything else happens (a crash can then be resumed by name)."""
    mlflow = f"MLflow run {run_id} in experiment {printable(cfg.tracking.experiment)}" if run_id else "tracking off"
    if resumed or resumed_step is not None:
        at = f"at step {resumed_step}" if resumed_step is not None else "(no checkpoint yet: from step 0)"
        print(f"resuming run {run_name} {at}: {mlflow}", file=sys.stderr)
        return
    again = f"dmltrain train {config_path} --resume {run_name}" if config_path else f"train.run_name={run_name}"
    print(f"run {run_name}: {mlflow} (to resume it after a crash: {again})", file=sys.stderr)
