"""``dmltrain train``: the driver of a training run on Ray.

The driver checks the config and the shards (building synthetic ones when asked), joins or
starts Ray, creates (or finds) the run's MLflow run, and hands both to a Ray Train V2
``TorchTrainer`` whose workers run :func:`dmltrain.training.trainer.train_loop_per_worker`.
Ray restarts the worker group after a failure (``cluster.max_failures``) and the workers
resume from the latest checkpoint; running the same command again with the same
``train.run_name`` resumes the run the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.config import Config
from dmltrain.errors import UserError
from dmltrain.text import safe_name
from dmltrain.tracking.names import STORAGE_DIR_TAG
from dmltrain.tracking.run import RunHandle
from shards.storage import is_url, location_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=0.01 cluster.num_workers=4")
    parser.add_argument("--no-progress", action="store_true", help="no live progress line")


def run(args: argparse.Namespace) -> int:
    from dmltrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, progress=not args.no_progress, config_name=Path(args.config).stem)
    print(summary.render())
    return 0 if summary.ok else 1


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

    def render(self) -> str:
        m = self.metrics or {}
        key = m.get("metric", "recall@1")
        lines = [f"run {self.run_name}: {'finished' if self.ok else 'FAILED'} in {self.seconds:.0f}s after {m.get('step', '?')} steps"]
        if self.error:
            lines.append(f"  error: {self.error}")
        for label in ("initial", "final", "best"):
            vals = m.get(label) or {}
            if vals:
                shown = ", ".join(f"{k} {v:.4f}" for k, v in vals.items() if k.startswith(("recall@", "map@r", "nmi", "binary/recall@1")))
                suffix = f" (step {m.get('best_step')})" if label == "best" else ""
                lines.append(f"  {label:<7} {shown}{suffix}")
        if m.get("initial") and m.get("final") and key in m["initial"] and key in m["final"]:
            lines.append(f"  {key}: {m['initial'][key]:.4f} before training -> {m['final'][key]:.4f} after")
        lines.append(f"  MLflow run id: {self.mlflow_run_id or '(tracking off)'}")
        if self.checkpoint:
            lines.append(f"  checkpoint: {self.checkpoint}   (dmltrain eval {self.checkpoint} --shards ...)")
        lines.append(f"  models: {self.storage_dir}/model/model.pt, {self.storage_dir}/best_model/model.pt")
        if self.tracking_uri.startswith("sqlite:///"):
            lines.append(f"  open MLflow: mlflow ui --backend-store-uri {self.tracking_uri}")
        else:
            lines.append(f"  open MLflow: {self.tracking_uri}")
        return "\n".join(lines)


def default_run_name(config_name: str | None) -> str:
    return f"{safe_name(config_name)}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def storage_root(cfg: Config) -> str:
    raw = cfg.cluster.storage_path or cfg.train.output_dir
    return raw if "://" in raw else str(Path(raw).expanduser().resolve())


def prepare_data(cfg: Config) -> None:
    """Build synthetic shards if configured and missing; then check the shards and splits exist."""
    from shards.manifest import Manifest

    shards_dir = location_of(cfg.data)  # a local folder or a URL
    if cfg.data.synthetic is not None and shards_dir.size("manifest.json") is None:
        from shards.synthetic import build_synthetic_shards

        s = cfg.data.synthetic
        print(f"building synthetic shards in {shards_dir} ({s.classes} classes x {s.per_class} images, {s.image_size}px)", file=sys.stderr)
        build_synthetic_shards(shards_dir, classes=s.classes, per_class=s.per_class, image_size=s.image_size, seed=s.seed,
                               shard_size=s.shard_size, overwrite=False)
    manifest = Manifest.load(shards_dir)
    for key, split in [("data.train_split", cfg.data.train_split), *(("data.eval_splits", s) for s in cfg.data.eval_splits)]:
        try:
            manifest.split(split)
        except UserError as e:
            raise UserError(f"{key}: {e}") from None


def check_run(cfg: Config) -> None:
    """What the workers would otherwise find out one by one, after retries: checked once on the driver."""
    from dmltrain.training.engine import deepspeed_config
    from shards.stream import TrainStream

    c = cfg.cluster
    deepspeed_config(cfg, c.num_workers)  # reads and checks a user DeepSpeed JSON
    # refuses (UserError) a global batch the split cannot fill once per epoch at this worker count
    TrainStream.from_config(cfg, 0, c.num_workers, loader_workers=0)


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
    if model.pretrained not in ("none", "imagenet"):
        model = model.model_copy(update={"pretrained": str(Path(model.pretrained).expanduser().resolve())})
    tracking = cfg.tracking.model_copy(update={"uri": cfg.tracking.resolved_uri()})
    return cfg.model_copy(update={"data": data, "train": train, "model": model, "tracking": tracking})


LOOPBACK = "127.0.0.1"
# Ray binds its servers (GCS, raylet, workers, agents, metrics) to the node's IP, and replaces a
# loopback node IP by the machine's outbound address while multi-node clusters are enabled, which
# Ray reads from this variable (Linux default: on). Off for the start of a local instance, the node
# IP stays 127.0.0.1 and nothing listens beyond loopback; joining other nodes is what it rules out.
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_env() -> dict[str, str]:
    """Environment for a ``ray start --head --node-ip-address=127.0.0.1`` that must stay on loopback
    (what :func:`start_local_ray` does in-process)."""
    return {_CLUSTERS_ENV: "0"}


def start_local_ray(**init_kwargs: Any) -> None:
    """Start a Ray instance on this machine, every server on 127.0.0.1 (dashboard included).

    Every local Ray of dmltrain starts here: ``train``, ``tune`` and ``study`` without
    ``cluster.address``, and the test fixtures. Ray >= 2.59 runs it with token authentication
    (``RAY_AUTH_MODE`` unset: a token in ``~/.ray/auth_token``, made if missing); an explicit
    ``RAY_AUTH_MODE=disabled`` is respected. ``init_kwargs`` go to ``ray.init``.
    """
    import ray
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by ray.init when it resolves the node IP (see above)
    try:
        ray.init(_node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **init_kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def init_ray(cfg: Config) -> None:
    """Join ``cluster.address`` when set, else start a local Ray on loopback (:func:`start_local_ray`)."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.address
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            start_local_ray(log_to_driver=True)
    except ConnectionError as e:
        raise UserError(f"cluster.address: cannot join the Ray cluster at {address}: {e}") from None


def build_trainer(cfg: Config, run_name: str, run_context: dict[str, Any], callbacks: list | None = None):
    """The Ray Train V2 TorchTrainer of one run (also used by ``tune`` and ``study``)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dmltrain.training.trainer import train_loop_per_worker

    c = cfg.cluster
    resources = {"CPU": c.cpus_per_worker}
    if c.use_gpu:
        resources["GPU"] = 1
    env = {"OMP_NUM_THREADS": str(max(1, int(c.cpus_per_worker))), "TOKENIZERS_PARALLELISM": "false",
           "MLFLOW_LOGGING_LEVEL": "WARNING"}
    if not c.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed otherwise warns that it found no GPU
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.to_dict(), "run": run_context},
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=c.num_workers, use_gpu=c.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_root(cfg),
            failure_config=FailureConfig(max_failures=c.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            callbacks=callbacks,
            worker_runtime_env={"env_vars": env},
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )


def train(cfg: Config, *, progress: bool = True, config_name: str | None = None, parent_run_id: str | None = None) -> TrainSummary:
    """Run one training to completion (or failure) and summarise it."""
    import ray

    from dmltrain.training.progress import ProgressBoard, ProgressPrinter

    started = time.time()
    prepare_data(cfg)
    cfg = absolutize(cfg)
    check_run(cfg)
    run_name = cfg.train.run_name or default_run_name(config_name)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"run_name": run_name})})
    storage_dir = f"{storage_root(cfg).rstrip('/')}/{run_name}"
    tracked = RunHandle.for_config(cfg, run_name, cfg.flat(), tags={STORAGE_DIR_TAG: storage_dir}, parent_run_id=parent_run_id)
    uri, run_id = tracked.uri, tracked.run_id
    if tracked.resumed:
        print(f"resuming run {run_name} (MLflow run {run_id})", file=sys.stderr)
    init_ray(cfg)
    board_name = f"dmltrain-progress-{uuid.uuid4().hex[:8]}"
    board = ProgressBoard.options(name=board_name).remote()
    context = {"run_name": run_name, "storage_dir": storage_dir, "tracking_uri": uri, "mlflow_run_id": run_id, "board_name": board_name}
    trainer = build_trainer(cfg, run_name, context)
    error = None
    result = None
    status = "FAILED"
    try:
        try:
            if progress:
                with ProgressPrinter(board):
                    result = trainer.fit()
            else:
                result = trainer.fit()
            failure = result.error
        except Exception as e:  # noqa: BLE001 — reported below, and by the exit code
            failure = e
        if failure is not None:
            user = user_error_in(failure)
            if user is not None:  # a config or input problem a worker found: one line, exit 2
                raise UserError(str(user), user.exit_code) from None
            text = str(failure).strip()
            error = f"{type(failure).__name__}: {text.splitlines()[-1] if text else ''}"
        status = "FINISHED" if error is None else "FAILED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        _, summary = ray.get(board.get.remote())
        ray.kill(board)
        tracked.finish(status)
    ckpt = result.checkpoint.path if result is not None and result.checkpoint is not None else None
    return TrainSummary(run_name, error is None, run_id, uri, ckpt, storage_dir, summary, error, time.time() - started)
