"""``dmltrain train``: the driver of a training run on Ray.

The driver checks the config and the shards (building synthetic ones when asked), joins or
starts Ray, creates (or finds) the run's MLflow run, and hands both to a Ray Train V2
``TorchTrainer`` whose workers run :func:`dmltrain.training.trainer.train_loop_per_worker`.
Ray restarts the worker group after a failure (``cluster.max_failures``) and the workers
resume from the latest checkpoint; running the same command again with the same
``train.run_name``, or with ``--resume [RUN]`` (the latest run of the config by default),
resumes the run the same way, in the same MLflow run.

Before Ray starts, the driver checks what the workers would otherwise find out one by one: the
output folder, the shards, the pretrained weights, a user DeepSpeed JSON, and the checkpoints it
would resume from (:func:`~dmltrain.training.safe_load.scan_checkpoint`). It prints the run's
name and MLflow run id at once, and keeps a record in the run's folder
(:mod:`cluster.run_records`) so that a run whose driver was killed is found later and marked
FAILED (or resumed), never left RUNNING.

A command module: what running the command needs is imported where it runs, so ``dmltrain train --help``
answers without loading torch, Ray or the data stack (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.resume import announce, claim_run, close_crashed_runs, latest_checkpoint_step, resolve_run_name
from cluster.run_location import RunLocation
from cluster.run_records import RECORD_FILE, Heartbeat, RunRecord, training
from dmltrain.config import Config
from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.redact import redact_url
from dmltrain.text import safe_name
from dmltrain.tracking.links import how_to_open
from dmltrain.tracking.names import ERROR_TAG, KIND_TAG, STORAGE_DIR_TAG
from dmltrain.tracking.run import RunHandle
from dmltrain.training.fence import DriverInfo
from shards.storage.location import is_url, location_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=0.01 cluster.num_workers=4")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN",
        help="continue a run from its latest checkpoint in the same MLflow run: RUN by name, "
        "or without RUN the latest run of this config in its output folder",
    )
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")
    parser.add_argument(
        "--ui-url",
        help="MLflow UI base URL of the printed run link (default: the tracking server's, or mlflow ui's "
        "http://127.0.0.1:5000)",
    )


def run(args: argparse.Namespace) -> int:
    from dmltrain.config import load_config

    overrides, resume = list(args.overrides), args.resume
    if resume and "=" in resume:  # `--resume optim.lr=0.1`: an override after a bare --resume
        overrides, resume = [*overrides, resume], ""
    cfg = load_config(args.config, overrides)
    main_thread = threading.current_thread() is threading.main_thread()
    # a stopped job (SIGTERM: `ray job stop`, a scheduler) ends its MLflow run as KILLED, not RUNNING
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        summary = train(
            cfg,
            progress=not args.no_progress,
            config_name=Path(args.config).stem,
            config_path=args.config,
            resume=resume,
            ui_url=args.ui_url,
        )
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(summary.render())
    return 0 if summary.ok else 1


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


# ------------------------------------------------------------------------------------------------


@dataclass
class TrainSummary:
    run_name: str
    ok: bool
    mlflow_run_id: str | None
    tracking_uri: str
    checkpoint: str | None
    storage_dir: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0
    mlflow_url: str | None = None  # the run's page in MLflow's UI (model-training view)

    def render(self) -> str:
        m = self.metrics or {}
        key = m.get("metric", "recall@1")
        lines = [
            f"run {self.run_name}: {'finished' if self.ok else 'FAILED'} in {self.seconds:.0f}s after {m.get('step', '?')} steps"
        ]
        if self.error:
            lines.append(f"  error: {self.error}")
        for label in ("initial", "final", "best"):
            vals = m.get(label) or {}
            if vals:
                shown = ", ".join(
                    f"{k} {v:.4f}"
                    for k, v in vals.items()
                    if k.startswith(("recall@", "map@r", "nmi", "binary/recall@1"))
                )
                suffix = f" (step {m.get('best_step')})" if label == "best" else ""
                lines.append(f"  {label:<7} {shown}{suffix}")
        if m.get("initial") and m.get("final") and key in m["initial"] and key in m["final"]:
            lines.append(f"  {key}: {m['initial'][key]:.4f} before training -> {m['final'][key]:.4f} after")
        lines.append(f"  MLflow run id: {self.mlflow_run_id or '(tracking off)'}")
        if self.checkpoint:
            lines.append(f"  checkpoint: {self.checkpoint}   (dmltrain eval {self.checkpoint} --shards ...)")
        models = self.written_models()
        if models:
            lines.append(f"  models: {', '.join(models)}")
        if self.mlflow_url:
            lines.append(f"  MLflow: {self.mlflow_url}")
        if self.mlflow_run_id:  # tracking off (or its store unreachable): no store to point at
            lines.append(f"  open MLflow: {how_to_open(self.tracking_uri)}")
        return redact_url("\n".join(lines))

    def written_models(self) -> list[str]:
        """The exported model files that exist (on remote storage: those a finished run writes)."""
        model, best = (f"{self.storage_dir}/{name}/model.pt" for name in ("model", "best_model"))
        if is_url(self.storage_dir):  # not listed: a finished run wrote its final model (and its best, if any)
            return ([model] + ([best] if (self.metrics or {}).get("best") else [])) if self.ok else []
        return [p for p in (model, best) if Path(p).is_file()]


def default_run_name(config_name: str | None) -> str:
    return f"{safe_name(config_name)}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def check_outputs(cfg: Config) -> None:
    """The run's output folder (and a synthetic shard folder still to be built) can be written: refused in one line if not."""
    RunLocation.of(cfg).check_writable()
    shards = location_of(cfg.data)
    if cfg.data.synthetic is not None and not shards.remote and not (shards.path / "manifest.json").exists():
        check_output_dir(shards.path, "data.shards")  # a URL is written through its SDK: nothing local to check


def prepare_data(cfg: Config, progress: bool = True) -> None:
    """Build synthetic shards if configured and missing (``progress``: with the builder's bars); then check
    the shards and splits exist."""
    from shards.manifest import Manifest

    shards_dir = location_of(cfg.data)  # a local folder or a URL
    if cfg.data.synthetic is not None and shards_dir.size("manifest.json") is None:
        from shards.build.synthetic import build_from_config

        s = cfg.data.synthetic
        extra = f", {s.test_classes} test classes" if s.test_classes is not None else ""
        extra += f", families of {s.family_size} at spread {s.family_spread}" if s.family_size > 1 else ""
        extra += f", {s.label_noise * 100:g}% {s.label_noise_mode} label noise" if s.label_noise else ""
        print(
            f"building synthetic shards in {shards_dir} ({s.classes} classes x {s.per_class} images, {s.image_size}px{extra})",
            file=sys.stderr,
        )
        build_from_config(shards_dir, s, progress=progress)
    manifest = Manifest.load(shards_dir)
    if cfg.data.synthetic is not None:
        from shards.build.synthetic import check_built_as

        check_built_as(manifest, cfg.data.synthetic)
    for key, split in [
        ("data.train_split", cfg.data.train_split),
        *(("data.eval_splits", s) for s in cfg.data.eval_splits),
    ]:
        try:
            manifest.split(split)
        except UserError as e:
            raise UserError(f"{key}: {e}") from None


def check_run(cfg: Config) -> None:
    """What the workers would otherwise find out one by one, after retries: checked once on the driver."""
    from dmltrain.models.pretrained import check_pretrained
    from dmltrain.training.engine import deepspeed_config
    from shards.read.stream import TrainStream

    c = cfg.cluster
    for w in c.worker_counts():  # reads and checks a user DeepSpeed JSON at every worker count of the run
        deepspeed_config(cfg, w)
    check_pretrained(cfg.model.backbone, cfg.model.pretrained, cfg.model)
    # refuses (UserError) a step's global batch the split cannot fill once per epoch (at any worker count)
    TrainStream.from_config(
        cfg.data, cfg.train.seed, 0, c.max_workers, loader_workers=0, grad_accum=cfg.train.grad_accum
    )


def user_error_in(error: BaseException | None) -> UserError | None:
    """The UserError a worker raised, if that is what ended the training (Ray wraps worker exceptions)."""
    seen: set[int] = set()
    stack = [error] + list(getattr(error, "worker_failures", {}).values()) if error is not None else []
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()]
    return None


def absolutize(cfg: Config) -> Config:
    """Paths made absolute: Ray workers run in another working directory."""
    shards = cfg.data.shards if is_url(cfg.data.shards) else str(Path(cfg.data.shards).expanduser().resolve())
    data = cfg.data.model_copy(update={"shards": shards})
    train = cfg.train
    if train.deepspeed_config:
        train = train.model_copy(update={"deepspeed_config": str(Path(train.deepspeed_config).resolve())})
    model = cfg.model
    if model.pretrained_is_file():  # not none, imagenet, timm or hf-hub:REPO
        model = model.model_copy(update={"pretrained": str(Path(model.pretrained).expanduser().resolve())})
    tracking = cfg.tracking.model_copy(update={"uri": cfg.tracking.resolved_uri()})
    return cfg.model_copy(update={"data": data, "train": train, "model": model, "tracking": tracking})


def fixed_workers(cfg: Config, command: str) -> None:
    """Refuse an elastic ``cluster.num_workers`` in one line where ``command`` (``tune``, ``study``) trains runs side
    by side that must compare at one worker count."""
    if cfg.cluster.elastic:
        raise UserError(
            f"cluster.num_workers: {list(cfg.cluster.num_workers)} is an elastic range, for dmltrain train; "
            f"dmltrain {command} compares runs at one worker count: give a number"
        )


def prepare_driver(
    cfg: Config, shards: Callable[[Config], list[Config]] | None = None, progress: bool = True
) -> Config:
    """Everything a driver checks before Ray starts, the same for ``train``, ``tune`` and ``study``; returns
    ``cfg`` with absolute paths (:func:`absolutize`).

    In order: the output folder (:func:`check_outputs`), the shards (:func:`prepare_data`: synthetic ones
    built when missing, the splits checked), then what the workers would find out one by one
    (:func:`check_run`). ``shards`` replaces :func:`prepare_data` where one config stands for several
    trainings (a study's class counts): it prepares their shards and returns one config per shard set,
    each checked by :func:`check_run`. Each problem is a one-line :class:`UserError`.
    """
    check_outputs(cfg)
    if shards is None:
        prepare_data(cfg, progress=progress)
        variants = [cfg]
    else:
        variants = shards(cfg)
    for variant in variants:
        check_run(absolutize(variant))
    return absolutize(cfg)


@dataclass
class RunGroup:
    """A search or a study: runs under one name, in ``<root>/<name>/runs``, children of one MLflow parent run.

    :meth:`place` names it and says where it lives; :meth:`open` opens its parent run, whose params may
    depend on what was planned in between (a study's points are named after the group)."""

    kind: str
    name: str
    location: RunLocation
    folder: str  # <root>/<name>
    out_dir: Path  # its tables and plots
    runs_root: str  # <root>/<name>/runs: the Ray Train storage of its runs
    parent: RunHandle | None = None

    @classmethod
    def place(
        cls, cfg: Config, kind: str, *, name: str | None, config_name: str | None, out: str | Path | None
    ) -> RunGroup:
        """Name the group (``<kind>-<config>-<time>-<hex>`` unless ``name``) under the config's runs root."""
        name = name or default_run_name(f"{kind}-{config_name or 'run'}")
        where = RunLocation.of(cfg)
        folder = where.run(name)
        return cls(kind, name, where, folder, where.outputs(name, out), f"{folder}/runs")

    def open(self, cfg: Config, params: dict[str, Any], *, owner: str) -> RunGroup:
        """Open the group's parent run with ``params`` (tagged with its kind and folder); returns the group."""
        tags = {KIND_TAG: self.kind, STORAGE_DIR_TAG: self.folder}
        self.parent = RunHandle.for_config(cfg, self.name, params, tags=tags, owner=owner)
        return self


LOOPBACK = "127.0.0.1"
# Ray binds its servers (GCS, raylet, workers, agents, metrics) to the node's IP, and replaces a
# loopback node IP by the machine's outbound address while multi-node clusters are enabled, which
# Ray reads from this variable (Linux default: on). Off for the start of a local instance, the node
# IP stays 127.0.0.1 and nothing listens beyond loopback; joining other nodes is what it rules out.
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
_USER_START_TIMEOUT = os.environ.get(START_TIMEOUT_ENV)  # the user's own choice wins over the defaults below
# An elastic run sizes its group from a view of the cluster that Ray refreshes every 20 s: after a lost node
# its first restart may still count the node and wait for a placement that cannot come; Ray tries again
# (smaller, once the view is fresh) after this many seconds instead of the 5 minutes a fixed local run waits.
ELASTIC_START_TIMEOUT_S = 10
PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"  # how often Ray Train looks for drained nodes (5 s)
LOCAL_START_TIMEOUT_S = 300


def local_ray_env() -> dict[str, str]:
    """Environment for a ``ray start --head --node-ip-address=127.0.0.1`` that must stay on loopback
    (what :func:`start_local_ray` does in-process)."""
    return {_CLUSTERS_ENV: "0"}


@contextmanager
def _loopback_stays_loopback():
    """Within: Ray keeps a 127.0.0.1 node IP or bootstrap address as it is (see ``_CLUSTERS_ENV``)."""
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by ray.init when it resolves the node IP and the address
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def start_local_ray(**init_kwargs: Any) -> None:
    """Start a Ray instance on this machine, every server on 127.0.0.1 (dashboard included).

    Ray Train's controller polls its workers every 0.5 s here instead of Ray's 2 s (an explicit
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` wins): a local run starts and ends seconds sooner. Its
    workers may take 5 minutes to start instead of 60 s (:func:`ray_train_env`).

    Every local Ray of dmltrain starts here: ``train``, ``tune`` and ``study`` without
    ``cluster.address``, and the test fixtures. Ray >= 2.59 runs it with token authentication
    (``RAY_AUTH_MODE`` unset: a token in ``~/.ray/auth_token``, made if missing; chosen here, so that
    Ray prints no WARNING about it: :func:`_choose_token_auth`); an explicit ``RAY_AUTH_MODE=disabled``
    is respected. The token file and the session folders are this
    user's alone (:mod:`cluster.ray_files`: 0600 in a 0700 ``~/.ray``; sessions under a 0700
    ``<tmp>/dmltrain-ray-<uid>``). ``init_kwargs`` go to ``ray.init``.
    """
    import ray

    from cluster.ray_files import private_temp_dir, private_token

    # Ray Train's controller acts once per health check (2 s by default): starting the workers
    # and noticing they finished took seconds of idle waiting; its processes inherit this
    os.environ.setdefault(HEALTH_CHECK_ENV, "0.5")
    os.environ.setdefault(START_TIMEOUT_ENV, str(LOCAL_START_TIMEOUT_S))
    private_token()
    _choose_token_auth(new_instance=True)
    init_kwargs.setdefault("_temp_dir", private_temp_dir())
    with _loopback_stays_loopback():
        ray.init(_node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **init_kwargs)


def init_ray(cfg: Config) -> None:
    """Join ``cluster.address`` when set, else start a local Ray on loopback (:func:`start_local_ray`).

    A loopback address (``127.0.0.1:port``, ``localhost:port``) joins that local instance as
    given; Ray would otherwise rewrite it to the machine's outward address, where a local
    instance started by :func:`start_local_ray` (or ``dmltrain cluster local``) does not listen.
    What Ray's actors and workers print stays in their node's session logs (``log_to_driver=False``,
    :mod:`cluster.ray_logging`): the terminal shows dmltrain."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.address
    try:
        if not address:
            start_local_ray(log_to_driver=False)
        elif address.rsplit(":", 1)[0] in (LOOPBACK, "localhost"):
            _local_token_auth()
            with _loopback_stays_loopback():
                ray.init(address=address, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise UserError(f"cluster.address: cannot join the Ray cluster at {address}: {e}") from None


def _local_token_auth() -> None:
    """Join a cluster of this machine with this user's token when ``RAY_AUTH_MODE`` is unset: Ray does so for the
    local cluster it finds by itself, never for an explicit address, but a loopback address is one of this machine's
    (``dmltrain cluster local`` starts its nodes with token authentication)."""
    _choose_token_auth(new_instance=False)


def _choose_token_auth(new_instance: bool) -> None:
    """With ``RAY_AUTH_MODE`` unset, turn on token authentication for this process and the Ray it starts or joins,
    as Ray itself would (a new local instance: always; a local cluster: when this user has a token), but without
    the WARNING Ray then prints on the terminal ("Token authentication is enabled for this Ray cluster. Set
    RAY_AUTH_MODE=disabled to opt out ..."): the documentation says so, and Ray stays silent about a mode it is
    given. An explicit ``RAY_AUTH_MODE`` is left as it is; no other message of Ray's is touched."""
    from ray._private.authentication import authentication_token_setup as auth
    from ray._raylet import AuthenticationTokenLoader

    if auth.AUTH_MODE_ENV_VAR in os.environ:
        return
    if new_instance or AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        auth._enable_token_auth()  # what Ray's default does before its warning: RAY_AUTH_MODE=token, config reloaded


def ray_train_env(cfg: Config) -> None:
    """Ray Train's settings for this run, through the environment its controller inherits (an explicit
    ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` wins): an elastic run waits :data:`ELASTIC_START_TIMEOUT_S` for a
    worker group's placement before sizing it again; a fixed run on a local Ray 5 minutes (a worker importing
    torch and DeepSpeed on a shared core of a busy machine took longer than Ray's 60 s). Ray Train looks for
    drained nodes (a preemption notice) every second instead of every 5 (an explicit
    ``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S`` wins): the workers have a few seconds' notice to save a step."""
    os.environ.setdefault(PREEMPTION_POLL_ENV, "1")
    if _USER_START_TIMEOUT:
        os.environ[START_TIMEOUT_ENV] = _USER_START_TIMEOUT
    elif cfg.cluster.elastic:
        os.environ[START_TIMEOUT_ENV] = str(ELASTIC_START_TIMEOUT_S)
    elif not cfg.cluster.address:
        os.environ[START_TIMEOUT_ENV] = str(LOCAL_START_TIMEOUT_S)
    else:
        os.environ.pop(START_TIMEOUT_ENV, None)


def build_trainer(cfg: Config, run_name: str, run_context: dict[str, Any], callbacks: list | None = None):
    """The Ray Train V2 TorchTrainer of one run (also used by ``tune`` and ``study``)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dmltrain.training.async_eval import validation_config
    from dmltrain.training.elastic import SigtermNotice
    from dmltrain.training.faults import fault_env
    from dmltrain.training.trainer import train_loop_per_worker

    c = cfg.cluster
    ray_train_env(cfg)
    resources = {"CPU": c.cpus_per_worker}
    if c.use_gpu:
        resources["GPU"] = 1
    env = {
        "OMP_NUM_THREADS": str(max(1, int(c.cpus_per_worker))),
        "TOKENIZERS_PARALLELISM": "false",
        "MLFLOW_LOGGING_LEVEL": "WARNING",
    }
    if not c.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed otherwise warns that it found no GPU
    env.update(fault_env())  # a test's fault injection reaches the workers
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "run": run_context},
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        validation_config=validation_config(cfg, run_context),  # eval.mode async: Ray evaluates checkpoints
        # an elastic run starts with what it gets of [min, max], restarts smaller after a failure and grows back when
        # Ray finds room again (checked every cluster.resize_interval_s)
        scaling_config=ScalingConfig(
            num_workers=c.num_workers,
            use_gpu=c.use_gpu,
            resources_per_worker=resources,
            elastic_resize_monitor_interval_s=c.resize_interval_s,
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=RunLocation.of(cfg).root,
            failure_config=FailureConfig(max_failures=c.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            # a worker sent SIGTERM (its node stopping) checkpoints at the next step boundary before it stops
            callbacks=[*(callbacks or []), SigtermNotice()],
            worker_runtime_env={"env_vars": env},
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )


def train(
    cfg: Config,
    *,
    progress: bool = True,
    config_name: str | None = None,
    parent_run_id: str | None = None,
    config_path: str | None = None,
    resume: str | None = None,
    ui_url: str | None = None,
) -> TrainSummary:
    """Run one training to completion (or failure) and summarise it.

    ``resume``: None trains as configured (a ``train.run_name`` that exists is resumed); a run
    name resumes that run; "" resumes the latest run of ``config_path`` in the output folder.
    ``ui_url``: the MLflow UI the summary's run link points into (default: the tracking server's, or
    ``mlflow ui``'s).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.ray_logging import LOG_FILE, append, route_ray_logs, where_logs_went
    from dmltrain.training.progress import ProgressBoard, ProgressPrinter

    started = time.time()
    cfg = prepare_driver(cfg, progress=progress)
    config_file = str(Path(config_path).resolve()) if config_path else None
    where = RunLocation.of(cfg)
    run_name = resolve_run_name(cfg, where, config_file, resume) or default_run_name(config_name)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_name": run_name})})
    storage_dir = where.run(run_name)
    run_dir = where.run_dir(run_name)  # None under a URL: records and checks need a file system
    resumed_step = None
    previous = None
    if run_dir is not None:
        previous = claim_run(run_dir, run_name)
        close_crashed_runs(
            where.folder, keep=run_name, tracking_uri=where.tracking_uri if cfg.tracking.enabled else None
        )
        resumed_step = latest_checkpoint_step(run_dir)
    tracked = RunHandle.for_config(
        cfg, run_name, cfg.flat(), tags={STORAGE_DIR_TAG: storage_dir}, parent_run_id=parent_run_id
    )
    uri, run_id = tracked.uri, tracked.run_id
    if tracked.resumed:  # a resumed run's earlier failure no longer describes it
        tracked.delete_tag(ERROR_TAG)
    record = heartbeat = None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        record = RunRecord.for_this_driver(run_name, config_file, run_id, uri, after=previous)
        training(run_dir, True)  # before the record: another point starting now must see this one as alive
        record.write(run_dir)
        heartbeat = Heartbeat(run_dir)
    announce(run_name, run_id, cfg, config_path, resumed_step, tracked.resumed)
    error = None
    result = None
    summary: dict[str, Any] = {}
    status = "FAILED"
    board = None
    log_file = None if run_dir is None else run_dir / LOG_FILE
    logs = ExitStack()  # Ray's messages to the run's log file while it trains
    logs.enter_context(route_ray_logs(log_file))
    try:
        try:
            started_ray = not ray.is_initialized()
            init_ray(cfg)
            if started_ray or parent_run_id is None:
                print(where_logs_went(log_file), file=sys.stderr)
            board_name = f"dmltrain-progress-{uuid.uuid4().hex[:8]}"
            # on this node: the board outlives every worker group of the run, whichever nodes they lose
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            board = ProgressBoard.options(name=board_name, scheduling_strategy=here).remote()
            context = {
                "run_name": run_name,
                "storage_dir": storage_dir,
                "tracking_uri": uri,
                "mlflow_run_id": run_id,
                "board_name": board_name,
                # the workers stop when this driver dies or another takes the run over (dmltrain.training.fence)
                "driver": DriverInfo.this_process(
                    None if record is None else record.generation, None if run_dir is None else run_dir / RECORD_FILE
                ).to_dict(),
            }
            trainer = build_trainer(cfg, run_name, context)
            # the workers' lines (a resize, a warning) are printed either way; the progress line when asked
            with ProgressPrinter(board, progress=progress, on_event=lambda line: append(log_file, line)):
                result = trainer.fit()
            failure = result.error
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 — reported below, and by the exit code
            failure = e
        if board is not None:
            _, summary = ray.get(board.get.remote())
        if summary.get("error") and (failure is None or user_error_in(failure) is None):
            # the workers stopped the run themselves (a diverged loss); a Ray error after that is its consequence
            # (under load the controller can find a worker it is shutting down already dead: seen)
            error = summary["error"]
        elif failure is not None:
            user = user_error_in(failure)
            if user is not None:  # a config or input problem a worker found: one line, exit 2
                error = str(user)
                raise UserError(str(user), user.exit_code) from None
            text = str(failure).strip()
            error = f"{type(failure).__name__}: {text.splitlines()[-1] if text else ''}"
        status = "FINISHED" if error is None else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        logs.close()
        if board is not None:
            ray.kill(board)
        if error is not None:
            tracked.set_tag(ERROR_TAG, error)
        tracked.finish(status)
        if record is not None:
            heartbeat.stop()
            record.status = status
            record.write(run_dir)
            training(run_dir, False)
    ckpt = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    return TrainSummary(
        run_name,
        error is None,
        run_id,
        uri,
        ckpt,
        storage_dir,
        summary,
        error,
        time.time() - started,
        tracked.url(ui=ui_url),
    )
