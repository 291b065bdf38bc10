"""``dmltrain submit``: run a training on a Ray cluster as a Ray Job, follow it, query or stop it.

``dmltrain submit CONFIG [overrides] --address http://HEAD:8265`` checks the config here,
uploads an allow-list of the working directory (the packages, ``configs/``, the config and the
files it extends; see :mod:`cluster.upload`, which refuses anything that looks like a credential)
as the job's working directory and starts ``python -m dmltrain train CONFIG
overrides cluster.address=auto`` on the cluster under a readable submission id
(``dmltrain-<config stem>-<date>-<time>-<4 hex>``), which is also the training's run name,
so the Ray job, the MLflow run and the checkpoint folder share one name. It then follows the
job's logs until the job ends and exits 0 only if the job succeeded; ``--no-wait`` returns
after the submission. ``--status``, ``--logs`` and ``--stop`` take a submission id; ``--list``
shows the cluster's jobs.

The cluster's image is expected to hold dmltrain's dependencies (``cluster/ray-cluster.yaml``
installs them); ``--requirements FILE`` adds a pip layer on top for extra packages. Paths in
the config are read on the cluster: shards, checkpoints and the MLflow store belong on
storage every node sees, and the command warns about paths that would land in the job's
temporary working directory instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ray.job_submission import JobSubmissionClient

from cluster.run_location import RunLocation, tracking_opens_files
from cluster.upload import Upload, plan_upload
from dmltrain.config import load_config
from dmltrain.config_tree import config_files
from dmltrain.errors import UserError
from dmltrain.redact import redact, redact_url
from dmltrain.text import format_duration, printable, safe_name
from shards.storage.location import is_url

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
ENTRYPOINT_PREFIX = ("python", "-m", "dmltrain", "train")


# -- the job description -------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSpec:
    """Everything sent to the Job API: ``client.submit_job(**spec.submit_kwargs())``."""

    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    upload: Upload | None = None  # the job's working directory, zipped at submission

    def submit_kwargs(self, working_dir: str | None = None) -> dict[str, Any]:
        """The Job API's arguments; ``working_dir``: the zip of :attr:`upload` (see :func:`submit`)."""
        env = dict(self.runtime_env, **({"working_dir": working_dir} if working_dir else {}))
        return {
            "entrypoint": self.entrypoint,
            "submission_id": self.submission_id,
            "runtime_env": env,
            "metadata": self.metadata,
        }


def submission_id_for(config_path: str | os.PathLike[str]) -> str:
    """``dmltrain-<config stem>-<YYYYmmdd-HHMMSS>-<4 hex>``: readable, sortable, unique per submission."""
    stem = safe_name(Path(config_path).stem)
    return f"dmltrain-{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def build_entrypoint(config: str, overrides: list[str]) -> str:
    """The shell command the job runs: ``python -m dmltrain train CONFIG OVERRIDES...`` (quoted)."""
    return shlex.join([*ENTRYPOINT_PREFIX, config, *overrides])


def _override_keys(overrides: list[str]) -> set[str]:
    return {item.partition("=")[0].strip() for item in overrides}


def placement_warnings(cfg: Any) -> list[str]:
    """Config paths that would end up in the job's temporary working directory on one node."""
    out = []
    if cfg.tracking.enabled and tracking_opens_files(cfg.tracking.uri):
        if cfg.tracking.uri:
            what = (
                f"'{cfg.tracking.uri}' is a local store: workers on other nodes cannot log to it, "
                "and its artifacts land in the job's temporary working directory"
            )
        else:
            what = "unset, so runs go to mlflow.db in the job's temporary working directory and are lost with it"
        out.append(f"tracking.uri: {what}; point tracking.uri at an MLflow server (see docs/how-to/cluster.md)")
    where = RunLocation.of(cfg)
    if where.relative:
        out.append(
            f"{where.key}: '{where.configured}' is relative, so checkpoints land in the job's temporary working directory; "
            "set cluster.storage_path to shared storage (an NFS path every node mounts, or s3://...)"
        )
    shards = cfg.data.shards
    if not is_url(shards) and not Path(shards).is_absolute():
        if cfg.data.synthetic is None:
            out.append(
                f"data.shards: '{shards}' is relative and is not uploaded with the job; "
                "give the path of the shards on shared storage"
            )
        else:
            out.append(
                f"data.shards: synthetic shards will be built in the job's working directory at '{shards}'; "
                "on a multi-node cluster give a path on shared storage"
            )
    return out


def plan_job(
    config: str | os.PathLike[str],
    overrides: list[str] | None = None,
    *,
    working_dir: str | os.PathLike[str] | None = None,
    requirements: str | os.PathLike[str] | None = None,
    excludes: list[str] | None = None,
    includes: list[str] | None = None,
    env: dict[str, str] | None = None,
    submission_id: str | None = None,
    allow_files: list[str] | None = None,
) -> JobSpec:
    """Check the config here and describe the job; raises :class:`UserError` before anything is sent.

    The config (and every file it extends) must lie inside ``working_dir`` (default: the
    current directory), whose allow-list (:func:`cluster.upload.plan_upload`, with ``includes``
    added and ``excludes`` left out, ``allow_files`` sent although they look like credentials) is uploaded;
    the entrypoint names the config by its relative path.
    ``cluster.address=auto`` is added so the driver joins the job's cluster, and
    ``train.run_name`` is set to the submission id unless the config or an override names
    the run (re-submitting with the same run name resumes that run).
    """

    overrides = list(overrides or [])
    wd = Path(working_dir or os.getcwd()).expanduser().resolve()
    if not wd.is_dir():
        raise UserError(f"--working-dir {working_dir}: not a directory")
    cfg = load_config(config, overrides)  # a bad config fails here, not minutes later on the cluster
    upload = plan_upload(
        wd, [path for path, _ in config_files(config)], includes or [], excludes or [], allow_files or []
    )
    rel_config = Path(config).resolve().relative_to(wd).as_posix()

    sid = submission_id or submission_id_for(config)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", sid):
        raise UserError(f"--submission-id {sid!r}: use letters, digits, '.', '_' and '-' only")
    keys = _override_keys(overrides)
    extra = []
    if "cluster.address" not in keys:
        extra.append("cluster.address=auto")
    run_name = cfg.train.run_name
    if run_name is None:
        run_name = sid
        extra.append(f"train.run_name={sid}")
    job_overrides = [*overrides, *extra]

    runtime_env: dict[str, Any] = {"env_vars": {"PYTHONUNBUFFERED": "1", **(env or {})}}
    if requirements is not None:
        runtime_env["pip"] = {"packages": read_requirements(requirements), "pip_check": False}
    metadata = {
        "dmltrain.config": rel_config,
        "dmltrain.overrides": shlex.join(overrides),
        "dmltrain.run_name": run_name,
        "dmltrain.experiment": cfg.tracking.experiment,
    }
    return JobSpec(
        sid, build_entrypoint(rel_config, job_overrides), runtime_env, metadata, placement_warnings(cfg), upload
    )


def read_requirements(path: str | os.PathLike[str]) -> list[str]:
    """The requirement lines of a pip requirements file (comments and blank lines dropped)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"--requirements {path}: cannot read it ({e.strerror or e})") from None
    lines = [line.split(" #", 1)[0].strip() for line in text.splitlines()]
    reqs = [line for line in lines if line and not line.startswith("#")]
    if not reqs:
        raise UserError(f"--requirements {path}: no requirements in the file")
    return reqs


# -- talking to the cluster ------------------------------------------------------------------------
def resolve_address(address: str | None) -> str:
    """``--address``, else $RAY_API_SERVER_ADDRESS, else an http $RAY_ADDRESS, else the local dashboard."""
    if not address:
        env_http = os.environ.get("RAY_ADDRESS", "")
        address = os.environ.get("RAY_API_SERVER_ADDRESS") or (env_http if is_url(env_http) else "") or DEFAULT_ADDRESS
    if not is_url(address):
        address = "http://" + address
    return address.rstrip("/")


def connect(address: str):
    """A ``JobSubmissionClient`` for the dashboard at ``address``; one clear line when it cannot be reached."""

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--address {address}: cannot reach the Ray Job API ({first}); is the head's dashboard "
            "running, and forwarded here (`ray dashboard CLUSTER.yaml`, or `kubectl port-forward svc/<cluster>-head-svc 8265:8265`)?",
            exit_code=1,
        ) from None


def _job_call(fn, job_id: str, *args):
    try:
        return fn(job_id, *args)
    except RuntimeError as e:
        text = str(e)
        if "404" in text or "does not exist" in text:
            raise UserError(
                f"job {job_id}: no such job on this cluster (dmltrain submit --list shows them)", exit_code=1
            ) from None
        raise


def _fmt_time(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _status(info: Any) -> str:
    return str(getattr(info.status, "value", info.status))


def describe(client, job_id: str, address: str) -> str:
    """A few lines on a job: status, message, entrypoint, times, run name, dashboard link."""
    info = _job_call(client.get_job_info, job_id)
    status = _status(info)
    lines = [f"job {job_id}: {status}"]
    if info.message:
        lines.append(f"  message:    {info.message.strip().splitlines()[-1]}")
    lines.append(f"  entrypoint: {info.entrypoint}")
    if info.start_time:
        end = info.end_time or time.time() * 1000
        verb = "ran" if info.end_time else "running for"
        lines.append(
            f"  started:    {_fmt_time(info.start_time)}, {verb} {format_duration((end - info.start_time) / 1000, exact=True)}"
        )
    meta = info.metadata or {}
    if meta.get("dmltrain.run_name"):
        lines.append(
            f"  run name:   {printable(meta['dmltrain.run_name'], 120)} "
            f"(MLflow experiment {printable(meta.get('dmltrain.experiment', '?'), 120)})"
        )
    lines.append(f"  dashboard:  {address}/#/jobs/{job_id}")
    return "\n".join(lines)


def wait_terminal(client, job_id: str, timeout: float | None = None, poll: float = 1.0) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED (or ``timeout`` s pass); returns the last status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = str(getattr(s := _job_call(client.get_job_status, job_id), "value", s))
        if status in TERMINAL or (deadline is not None and time.monotonic() >= deadline):
            return status
        time.sleep(poll)


def follow(client, job_id: str, out: TextIO | None = None, poll: float = 2.0) -> str:
    """Stream the job's logs to ``out`` until it ends; returns its final status.

    Uses the Job API's log stream; if that connection drops, it falls back to polling the
    logs, so a flaky network costs latency, not output.
    """
    out = out or sys.stdout
    shown = 0

    async def stream() -> None:
        nonlocal shown
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()
            shown += len(chunk)

    try:
        asyncio.run(stream())
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 — the stream is a convenience; polling below is the fallback
        print(
            f"dmltrain: warning: log stream interrupted ({type(e).__name__}: {str(e)[:200]}); polling instead",
            file=sys.stderr,
            flush=True,
        )
    while True:
        status = wait_terminal(client, job_id, timeout=poll, poll=min(poll, 1.0))
        try:
            text = client.get_job_logs(job_id)
        except Exception:  # noqa: BLE001
            text = ""
        if len(text) > shown:
            out.write(text[shown:])
            out.flush()
            shown = len(text)
        if status in TERMINAL:
            return status


def stop(client, job_id: str, wait: bool = True, timeout: float = 120.0) -> str:
    """Ask the job to stop (SIGTERM, then SIGKILL after Ray's grace period); returns the status after."""
    stopped = _job_call(client.stop_job, job_id)
    if not stopped:
        return str(getattr(s := client.get_job_status(job_id), "value", s))
    return wait_terminal(client, job_id, timeout=timeout) if wait else "STOPPING"


def list_jobs(client) -> str:
    jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    if not jobs:
        return "no jobs on this cluster"
    rows = [("SUBMISSION ID", "STATUS", "STARTED", "ENTRYPOINT")]
    for j in jobs:
        ep = j.entrypoint if len(j.entrypoint) <= 70 else j.entrypoint[:67] + "..."
        rows.append((j.submission_id or j.job_id or "-", _status(j), _fmt_time(j.start_time), ep))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)


def submit(client, spec: JobSpec) -> str:
    """Send the job, its :attr:`~JobSpec.upload` zipped in a private temporary folder as the working
    directory (Ray uploads the zip as it is); a duplicate id or a refused runtime environment becomes one line."""
    try:
        if spec.upload is None:
            return client.submit_job(**spec.submit_kwargs())
        with tempfile.TemporaryDirectory(prefix="dmltrain-submit-") as tmp:
            pkg = spec.upload.write_zip(Path(tmp) / f"{spec.submission_id}.zip")
            return client.submit_job(**spec.submit_kwargs(str(pkg)))
    except (RuntimeError, ValueError, TypeError, ConnectionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "already" in first and "exist" in first:
            raise UserError(
                f"--submission-id {spec.submission_id}: a job with this id already exists on the cluster", exit_code=1
            ) from None
        raise UserError(f"the cluster refused job {spec.submission_id}: {first}", exit_code=1) from None


def _follow_and_finish(client, job_id: str, address: str) -> int:
    """Follow the logs, then one line with the outcome; exit 0 only for SUCCEEDED. Ctrl-C leaves the job running."""
    try:
        status = follow(client, job_id)
    except KeyboardInterrupt:
        print(
            f"\ndmltrain: stopped following; job {job_id} keeps running "
            f"(dmltrain submit --stop {job_id} --address {address} stops it)",
            file=sys.stderr,
        )
        return 130
    info = client.get_job_info(job_id)
    took = (
        f" in {format_duration((info.end_time - info.start_time) / 1000, exact=True)}"
        if info.start_time and info.end_time
        else ""
    )
    msg = f": {info.message.strip().splitlines()[-1]}" if status != "SUCCEEDED" and info.message else ""
    print(f"job {job_id} {status}{took}{msg}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


# -- the command -------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config inside the working directory (see configs/)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. cluster.num_workers=8 cluster.use_gpu=true"
    )
    parser.add_argument(
        "--address",
        help=f"the head's dashboard (Job API), default $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS or {DEFAULT_ADDRESS}",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--status", metavar="ID", help="show a job's status and exit")
    what.add_argument(
        "--logs", metavar="ID", help="follow a job's logs until it ends (with --no-wait: print them so far)"
    )
    what.add_argument("--stop", metavar="ID", help="stop a job (and wait until it has stopped, unless --no-wait)")
    what.add_argument("--list", action="store_true", help="list the cluster's jobs")
    parser.add_argument("--no-wait", action="store_true", help="return after submitting instead of following the logs")
    parser.add_argument("--submission-id", help="the job's id (default dmltrain-<config stem>-<date>-<time>-<hex>)")
    parser.add_argument("--working-dir", help="directory uploaded with the job (default: the current directory)")
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="PATH",
        help="also upload this file or folder of the working directory (repeatable; the packages, configs/ "
        "and the config's files always go)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="gitignore-style pattern left out of the upload (repeatable; environments, data, weights, "
        "databases, caches and .gitignore'd files always are)",
    )
    parser.add_argument(
        "--allow-file",
        action="append",
        default=[],
        metavar="PATH",
        help="upload this file of the working directory although it looks like a credential (repeatable; "
        "a deliberate exception: its content travels with the job)",
    )
    parser.add_argument(
        "--requirements", metavar="FILE", help="pip requirements installed in the job's runtime environment"
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable for the job (repeatable)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the job (entrypoint, runtime environment, every file uploaded and its size) without submitting it",
    )


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return env


def run(args: argparse.Namespace) -> int:
    job_id = args.status or args.logs or args.stop
    if job_id or args.list:
        if args.config or args.overrides:
            raise UserError("submit: give a CONFIG to submit, or --status/--logs/--stop ID/--list, not both")
        address = resolve_address(args.address)
        client = connect(address)
        if args.list:
            print(list_jobs(client))
            return 0
        if args.status:
            print(describe(client, job_id, address))
            return 0
        if args.stop:
            status = stop(client, job_id, wait=not args.no_wait)
            print(f"job {job_id}: {status}")
            return 0
        if args.no_wait:
            sys.stdout.write(_job_call(client.get_job_logs, job_id))
            return 0
        return _follow_and_finish(client, job_id, address)

    if not args.config:
        raise UserError("submit: give a CONFIG to submit (or --status/--logs/--stop ID, --list)")
    spec = plan_job(
        args.config,
        args.overrides,
        working_dir=args.working_dir,
        requirements=args.requirements,
        excludes=args.exclude,
        includes=args.include,
        env=_parse_env(args.env),
        submission_id=args.submission_id,
        allow_files=args.allow_file,
    )
    for w in spec.warnings:
        print(f"dmltrain: warning: {w}", file=sys.stderr)
    upload = spec.upload.summary() if spec.upload else "nothing"
    if args.dry_run:
        job = spec.submit_kwargs("<a zip of the files under 'upload', made at submission>")
        print(json.dumps(redact({**job, "upload": spec.upload.describe() if spec.upload else None}), indent=2))
        print(f"would upload {upload} (listed under 'upload')", file=sys.stderr)
        return 0
    address = resolve_address(args.address)
    client = connect(address)
    print(f"uploading {upload}", file=sys.stderr)
    job_id = submit(client, spec)
    print(f"submitted job {job_id} to {address}", file=sys.stderr)
    print(f"  entrypoint: {redact_url(spec.entrypoint)}", file=sys.stderr)
    print(f"  dashboard:  {address}/#/jobs/{job_id}", file=sys.stderr)
    if args.no_wait:
        print(job_id)
        print(
            f"follow it: dmltrain submit --logs {job_id} --address {address}; stop it: dmltrain submit --stop {job_id} --address {address}",
            file=sys.stderr,
        )
        return 0
    return _follow_and_finish(client, job_id, address)
