"""The per-worker training loop that Ray Train runs on every worker.

One :class:`Trainer` per worker process: it builds the DeepSpeed engine (backbone + head),
the model-parallel objective (sharded classifier + gathered instance loss) with the
classifier's own row-sparse optimizer, and the shard stream; resumes from Ray's latest
checkpoint if there is one; then trains, evaluates, checkpoints and logs (rank 0) until
the step budget is spent.

Every decision that involves a collective (when to evaluate, checkpoint or report) is a
pure function of the step, identical on every rank, so no rank ever waits alone.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dmltrain.config import Config
from dmltrain.models.sync_bn import convert_sync_batchnorm
from dmltrain.training.checkpoint import TrainState, load_training_state, realign_to_plan, save_training_state, seed_rngs
from dmltrain.training.objective import Objective
from dmltrain.training.progress import post
from dmltrain.training.schedule import LRSchedule
from dmltrain.training.tracking import RunLogger
from shards.transforms import normalize_batch

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What the driver hands every worker besides the config."""

    run_name: str
    storage_dir: str  # <storage_path>/<run_name>: where best/final models are published
    tracking_uri: str
    mlflow_run_id: str | None
    board_name: str | None = None
    report_to_ray: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunContext:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


class StepTimer:
    """Accumulates the split of step time between logging points (data / forward / backward / step)."""

    PARTS = ("data", "forward", "backward", "step")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = dict.fromkeys(self.PARTS, 0.0)
        self.steps = 0
        self.loss_sum = 0.0
        self.stats_sum: dict[str, float] = {}
        self.started = time.perf_counter()

    def add(self, times: dict[str, float], stats: dict[str, float]) -> None:
        for k, v in times.items():
            self.total[k] += v
        for k, v in stats.items():
            self.stats_sum[k] = self.stats_sum.get(k, 0.0) + v
        self.steps += 1

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (evaluation, checkpoints) out of the throughput."""
        self.started += seconds

    def summary(self, global_batch: int) -> dict[str, float]:
        n = max(1, self.steps)
        wall = max(1e-9, time.perf_counter() - self.started)
        out = {f"time/{k}_ms": 1000 * v / n for k, v in self.total.items()}
        out["time/step_ms"] = 1000 * wall / n
        out["images_per_s"] = global_batch * self.steps / wall
        out.update({k: v / n for k, v in self.stats_sum.items()})
        return out


def _is_backbone_group(group: dict[str, Any]) -> bool:
    return str(group.get("name", "")).startswith("backbone")


class Trainer:
    def __init__(self, cfg: Config, run: RunContext):
        self.cfg, self.run = cfg, run
        if not dist.is_initialized():  # Ray with one worker in local mode, or a direct call
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + str(_free_port()), rank=0, world_size=1)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = self._device()
        threads = max(1, int(cfg.cluster.cpus_per_worker)) if not cfg.cluster.use_gpu else max(1, torch.get_num_threads())
        torch.set_num_threads(threads)
        seed_rngs(cfg.train.seed, 0, self.rank)
        self.logger = RunLogger(run.tracking_uri, run.mlflow_run_id, cfg.tracking.system_metrics) if self.rank == 0 else None
        self._build()

    # -- construction --------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.cfg.cluster.use_gpu and torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        return torch.device("cpu")

    def _build(self) -> None:
        from dmltrain.distributed import make_classifier_optimizer
        from dmltrain.models import build_model, param_groups
        from dmltrain.models.precision import autocast_dtype
        from dmltrain.training.engine import build_engine
        from shards.stream import TrainStream

        cfg = self.cfg
        self.stream = TrainStream.from_config(
            cfg, self.rank, self.world,
            normalize=False,  # uint8 crosses to the device (a quarter of the bytes); _train_step normalizes there
            pin_memory=self.device.type == "cuda",
        )
        self.manifest = self.stream.manifest
        # the label space, not the classes with images: a class whose images were all skipped keeps its id
        self.num_classes = self.stream.num_classes
        model = build_model(cfg.model).to(self.device)
        if cfg.model.sync_bn:
            model = convert_sync_batchnorm(model)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.engine, self.ds_config = build_engine(model, param_groups(model, cfg.optim), cfg, self.world)
        self.model = self.engine.module
        self.zero_stage = cfg.train.zero_stage
        self.objective = Objective(
            cfg, self.num_classes, model.embedding_dim, self.world, classifier_dropout=model.classifier_dropout
        ).to(self.device)
        self.clf_opt = None
        if self.objective.classifier is not None:
            o = cfg.optim
            self.clf_opt = make_classifier_optimizer(
                self.objective.classifier, name=o.name, lr=o.lr * o.new_param_lr_mult, momentum=o.momentum,
                nesterov=o.nesterov, weight_decay=o.weight_decay, betas=o.betas,
                bias_weight_decay=None if o.decay_norm_and_bias else 0.0,  # softmax_ce's bias: the CE recipe decays weights only
            )
        self.rep_opt = None
        if self.objective.replicated is not None:
            from dmltrain.training.engine import build_optimizer

            self.rep_opt = build_optimizer([{"params": self.objective.replicated_parameters(), "lr_mult": cfg.optim.new_param_lr_mult}], cfg)
        self.input_dtype = autocast_dtype(cfg.train.precision) or torch.float32
        self.steps_per_epoch = self.stream.batches_per_epoch  # >= 1: TrainStream refuses a batch no epoch can fill
        t = cfg.train
        self.total_steps = t.max_steps if t.max_steps is not None else t.epochs * self.steps_per_epoch
        self.num_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.schedule = LRSchedule(cfg.schedule, self.steps_per_epoch, self.total_steps)
        groups = self.engine.optimizer.param_groups
        self.base_lr = [g["lr"] for g in groups]
        self.base_wd = [g["weight_decay"] for g in groups]
        self.state = TrainState(world_size=self.world, zero_stage=self.zero_stage, plan=self.stream.plan_signature())

    # -- schedule --------------------------------------------------------------------------------
    def _set_lr(self, step: int) -> float:
        factor = self.schedule.factor(step)
        head_only = self.schedule.head_only(step)
        if self.model.backbone_trainable == head_only:
            self.model.set_backbone_trainable(not head_only)  # no backbone autograd while it cannot move
        for g, lr, wd in zip(self.engine.optimizer.param_groups, self.base_lr, self.base_wd):
            frozen = head_only and _is_backbone_group(g)
            # lr 0 and no decay: the backbone stays exactly as it is while the head warms up
            g["lr"] = 0.0 if frozen else lr * factor
            g["weight_decay"] = 0.0 if frozen else wd
        for opt in (self.clf_opt, self.rep_opt):
            for g in opt.param_groups if opt is not None else ():
                g["lr"] = self.cfg.optim.lr * self.cfg.optim.new_param_lr_mult * factor
        return self.cfg.optim.lr * factor

    # -- resume ------------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load Ray's latest checkpoint if any; True when resumed."""
        import ray.train

        ckpt = ray.train.get_checkpoint() if self.run.report_to_ray else None
        if ckpt is None:
            return False
        with ckpt.as_directory() as d:
            self.state = load_training_state(
                Path(d), engine=self.engine, classifier=self.objective.classifier, classifier_optimizer=self.clf_opt,
                rank=self.rank, world_size=self.world, zero_stage=self.zero_stage, seed=self.cfg.train.seed,
                replicated=self.objective.replicated, replicated_optimizer=self.rep_opt,
            )
        self.state.finished = self.state.step >= self.total_steps  # a longer schedule continues a finished run
        st = self.state
        was = (st.epoch, st.batch)
        changed = realign_to_plan(st, self.stream.plan_signature())
        if changed and (st.epoch, st.batch) != was and self.rank == 0:
            log.warning("resuming step %d at the start of epoch %d, not at batch %d of epoch %d: the batch plan changed (%s)",
                        st.step, st.epoch, was[1], was[0], ", ".join(changed))
            if self.logger is not None:
                self.logger.set_tag("dmltrain.resumed_at_epoch_start", f"plan changed: {', '.join(changed)}")
        if self.logger is not None:
            self.logger.set_tag("dmltrain.resumed_from_step", str(self.state.step))
        return True

    # -- the loop --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        cfg, st = self.cfg, self.state
        resumed = self.resume()
        st = self.state
        if st.finished:  # the same command again on a finished run: nothing left to train
            self._publish_summary()
            self._report({"step": st.step, "epoch": st.epoch, **{f"eval/{k}": v for k, v in st.last_metrics.items()}}, checkpoint=False)
            return self._final_metrics()
        if not resumed:
            self._log_run_files()
            if cfg.eval.before_training:
                st.initial_metrics = self.evaluate(step=0, phase="initial")
        self.engine.train()
        self.objective.train()
        timer = StepTimer()
        last_eval = last_ckpt = -1
        while st.step < self.total_steps:
            epoch = st.epoch
            batches = iter(self.stream.epoch(epoch, start_batch=st.batch))
            while st.step < self.total_steps:
                t0 = time.perf_counter()
                try:
                    images, labels = next(batches)
                except StopIteration:
                    break
                times, stats = self._train_step(images, labels, t0)
                st.step += 1
                st.batch += 1
                timer.add(times, stats)
                if st.step % cfg.train.log_every == 0 or st.step == self.total_steps:
                    self._log_train(timer)
                t_aside = time.perf_counter()
                if cfg.eval.unit == "step" and cfg.eval.every and st.step % cfg.eval.every == 0 and st.step < self.total_steps:
                    self.evaluate(st.step, phase="eval")
                    last_eval = st.step
                if cfg.train.checkpoint_every and st.step % cfg.train.checkpoint_every == 0 and st.step < self.total_steps:
                    self.checkpoint()
                    last_ckpt = st.step
                timer.exclude(time.perf_counter() - t_aside)
            if st.batch >= self.steps_per_epoch or st.step < self.total_steps:
                st.epoch, st.batch = epoch + 1, 0  # the epoch is complete (or the stream ended it)
                done = st.step >= self.total_steps
                t_aside = time.perf_counter()
                if not done and cfg.eval.unit == "epoch" and cfg.eval.every and st.epoch % cfg.eval.every == 0:
                    self.evaluate(st.step, phase="eval")
                    last_eval = st.step
                if not done and cfg.train.checkpoint_every == 0:
                    self.checkpoint()
                    last_ckpt = st.step
                timer.exclude(time.perf_counter() - t_aside)
        if last_eval != st.step:
            self.evaluate(st.step, phase="final")
        st.finished = True
        self._export_final_model()
        if last_ckpt != st.step:
            self.checkpoint()
        self._publish_summary()
        return self._final_metrics()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor, t0: float) -> tuple[dict[str, float], dict[str, float]]:
        engine, step = self.engine, self.state.step
        images = images.to(self.device, non_blocking=True)
        if self.cfg.model.channels_last:  # on the uint8 batch: a quarter of the bytes; normalize_batch keeps the format
            images = images.contiguous(memory_format=torch.channels_last)
        images = normalize_batch(images, self.input_dtype)
        labels = labels.to(self.device, non_blocking=True)
        lr = self._set_lr(step)
        t1 = time.perf_counter()
        emb = engine(images)
        loss = self.objective(emb, labels, step=step)
        self._sync()
        t2 = time.perf_counter()
        engine.backward(loss)
        self._sync()
        t3 = time.perf_counter()
        scale = self._loss_scale()  # read before engine.step(), which may change it
        engine.step()
        if self.cfg.train.precision == "fp16":
            self._unscale_model_parallel_grads(scale, applied=engine.was_step_applied())
        if self.rep_opt is not None:
            self.objective.average_replicated_grads()
        for opt in (self.clf_opt, self.rep_opt):
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        self._sync()
        t4 = time.perf_counter()
        stats = dict(self.objective.stats)
        stats["lr"] = lr
        return {"data": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "step": t4 - t3}, stats

    def _loss_scale(self) -> float:
        if self.cfg.train.precision != "fp16":
            return 1.0
        opt = self.engine.optimizer
        for attr in ("loss_scale", "cur_scale"):  # FP16_Optimizer has loss_scale; ZeRO's has both
            value = getattr(opt, attr, None)
            if value is not None:
                return float(value)
        return float(opt.loss_scaler.cur_scale)

    def _unscale_model_parallel_grads(self, scale: float, applied: bool) -> None:
        """The classifier's and proxies' grads carry the fp16 loss scale of engine.backward: divide it
        out, and skip their step whenever the engine skipped its own for an overflow."""
        params = self.objective.classifier_parameters() + self.objective.replicated_parameters()
        for p in params:
            if p.grad is not None:
                if applied:
                    p.grad.div_(scale)
                else:
                    p.grad = None

    # -- logging, evaluation, checkpoints ---------------------------------------------------------------
    def _progress(self, **info: Any) -> None:
        if self.rank == 0:
            st = self.state
            # at an epoch boundary the work in hand (eval, checkpoint) belongs to the epoch just completed
            epoch = st.epoch - 1 if st.batch == 0 and st.step > 0 else st.epoch
            post(self.run.board_name, {"epochs": self.num_epochs, "total_steps": self.total_steps, "step": st.step,
                                       "epoch": max(0, epoch), **info})

    def _log_train(self, timer: StepTimer) -> None:
        summary = timer.summary(self.cfg.data.batch_size)
        timer.reset()
        if self.rank != 0:
            return
        summary["epoch"] = self.state.epoch + self.state.batch / self.steps_per_epoch
        summary.update(self._memory())
        if self.stream.skipped:
            summary["data/skipped_samples"] = float(self.stream.skipped)
        self.logger.log_metrics({k if "/" in k or k in ("lr", "epoch", "images_per_s", "loss") else f"train/{k}": v
                                 for k, v in summary.items()}, step=self.state.step)
        remaining = self.total_steps - self.state.step
        eta = remaining * summary["time/step_ms"] / 1000
        self._progress(loss=summary.get("loss", float("nan")), images_per_s=summary["images_per_s"], eta_s=eta, phase="train")

    def _log_run_files(self) -> None:
        """Resolved config, DeepSpeed JSON and manifest summary as MLflow artifacts (rank 0, once per run)."""
        if self.rank != 0 or not self.logger.enabled:
            return
        import json

        with tempfile.TemporaryDirectory() as tmp:
            files = {
                "config/config.yaml": self.cfg.to_yaml(),
                "config/deepspeed.json": json.dumps(self.ds_config, indent=2),
                "data/manifest_summary.json": json.dumps(self.manifest.summary(), indent=2, default=str),
            }
            for rel, text in files.items():
                path = Path(tmp) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                self.logger.log_artifact(path, rel.rsplit("/", 1)[0])

    def _memory(self) -> dict[str, float]:
        """Rank 0's resident memory and its classifier shard (rows + row optimizer state), in MB."""
        import psutil

        out = {"memory/rss_mb": psutil.Process().memory_info().rss / 2**20}
        if self.objective.classifier is not None:
            tensors = list(self.objective.classifier.parameters())
            tensors += [v for st in self.clf_opt.state.values() for v in st.values() if torch.is_tensor(v)]
            out["memory/classifier_mb"] = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        if self.device.type == "cuda":
            out["memory/cuda_peak_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return out

    def evaluate(self, step: int, phase: str) -> dict[str, float]:
        """Embed the eval splits on every rank, metrics on rank 0, then the same dict on every rank."""
        from dmltrain.evaluate import evaluate_model

        self._progress(phase=f"evaluating ({phase})")
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            metrics, embeddings = evaluate_model(
                self.model, self.cfg.data.shards, self.cfg.data.eval_splits, self.cfg.eval, self.cfg.data,
                # the engine already holds the weights in its precision; autocast on top would feed
                # fp32 activations to bf16 norm layers
                rank=self.rank, world_size=self.world, device=str(self.device), precision="fp32",
                progress=False,
            )
        self.model.train(was_training)
        box = [metrics]
        dist.broadcast_object_list(box, src=0)
        metrics = box[0] or {}
        st = self.state
        st.last_metrics = metrics
        key = self.cfg.eval.metric
        improved = key in metrics and (st.best_metric is None or metrics[key] > st.best_metric)
        if improved and phase != "initial":
            st.best_metric, st.best_step, st.best_metrics = metrics[key], step, dict(metrics)
        if self.rank == 0:
            prefix = "initial" if phase == "initial" else "eval"
            self.logger.log_metrics({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)
            if self.cfg.eval.plots and embeddings is not None:
                self._plot(metrics, embeddings, step, phase)
            self._progress(last_eval=f"{key} {metrics.get(key, float('nan')):.4f}")
        if improved and phase != "initial":
            self._export_model("best_model", extra={"step": step, "metrics": metrics})
        # `evaluation: 1` tells evaluation reports from checkpoint reports, which repeat the latest metrics
        self._report({f"eval/{k}": v for k, v in metrics.items()} | {"step": step, "epoch": st.epoch, "evaluation": 1}, checkpoint=False)
        return metrics

    def _plot(self, metrics: dict[str, float], embeddings: Any, step: int, phase: str) -> None:
        from dmltrain.evaluate import plot_embedding_map, plot_recall_at_k

        emb, labels = embeddings.get("query", next(iter(embeddings.values())))
        with tempfile.TemporaryDirectory() as tmp:
            curve = plot_recall_at_k({f"{phase} step {step}": metrics}, Path(tmp) / f"recall_at_k-step{step:07d}.png")
            emap = plot_embedding_map(emb, labels, Path(tmp) / f"embeddings-step{step:07d}.png", seed=self.cfg.train.seed)
            for p in (curve, emap):
                self.logger.log_artifact(p, "plots")

    def _export_model(self, name: str, extra: dict[str, Any]) -> None:
        """``<name>/model.pt`` to MLflow and to the run's storage directory (all ranks call; rank 0 writes)."""
        from dmltrain.models import save_model
        from dmltrain.training.dp_state import full_module_state_dict

        weights = full_module_state_dict(self.engine)  # a collective under ZeRO-3
        if self.rank != 0:
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.pt"
            save_model(path, self.model, self.cfg.to_dict(), extra=extra, state_dict=weights)
            self.logger.log_artifact(path, name)
            publish(path, self.run.storage_dir, f"{name}/model.pt")

    def _export_final_model(self) -> None:
        self._export_model("model", extra={"step": self.state.step, "metrics": self.state.last_metrics})

    def checkpoint(self) -> None:
        """A checkpoint through Ray Train; every rank writes its files, Ray merges and uploads them."""
        self._progress(phase="checkpointing")
        tmp = Path(tempfile.mkdtemp(prefix=f"dmltrain-ckpt-rank{self.rank}-"))
        try:
            save_training_state(
                tmp, engine=self.engine, classifier=self.objective.classifier, classifier_optimizer=self.clf_opt,
                state=self.state, rank=self.rank, model_config=self.cfg.to_dict(),
                replicated=self.objective.replicated, replicated_optimizer=self.rep_opt,
                extra={"step": self.state.step, "metrics": self.state.last_metrics},
            )
            self._report({"step": self.state.step, "epoch": self.state.epoch, **{f"eval/{k}": v for k, v in self.state.last_metrics.items()}},
                         checkpoint=True, directory=tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _report(self, metrics: dict[str, Any], checkpoint: bool, directory: Path | None = None) -> None:
        if not self.run.report_to_ray:
            return
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(str(directory)) if checkpoint else None
        name = f"checkpoint-step{self.state.step:08d}" if checkpoint else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=name)

    def _final_metrics(self) -> dict[str, Any]:
        st = self.state
        return {"step": st.step, "initial": st.initial_metrics, "final": st.last_metrics, "best": st.best_metrics,
                "best_step": st.best_step, "metric": self.cfg.eval.metric}

    def _publish_summary(self) -> None:
        if self.rank == 0:
            post(self.run.board_name, self._final_metrics(), summary=True)


def publish(local_file: Path, storage_dir: str, relpath: str) -> None:
    """Copy a file into the run's storage directory (a local/NFS path or a pyarrow URI such as s3://)."""
    import pyarrow.fs

    fs, root = pyarrow.fs.FileSystem.from_uri(storage_dir) if "://" in storage_dir else (pyarrow.fs.LocalFileSystem(), storage_dir)
    dest = f"{root.rstrip('/')}/{relpath}"
    fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
    tmp_dest = dest + ".tmp"
    pyarrow.fs.copy_files(str(local_file), tmp_dest, destination_filesystem=fs)
    fs.move(tmp_dest, dest)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_worker_logs() -> None:
    """Keep workers' output to what matters: the driver draws progress, rank 0 logs to MLflow."""
    import logging
    import warnings

    for name in ("faiss", "faiss.loader", "mlflow", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # Ray Train logs every report at INFO through a logger named by file path, outside LoggingConfig's reach
        from ray.train.v2._internal.execution import context as ray_train_context

        ray_train_context.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):
        logging.getLogger(__name__).debug("Ray Train's report logger not found; reports stay verbose")
    # DeepSpeed still calls the deprecated all_gather_into_tensor; not ours to fix
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*")


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    """Ray Train entry point: ``payload = {'config': Config dict, 'run': RunContext dict}``."""
    quiet_worker_logs()
    cfg = Config.model_validate(payload["config"])
    trainer = Trainer(cfg, RunContext.from_dict(payload["run"]))
    try:
        trainer.fit()
    finally:
        if trainer.logger is not None:
            trainer.logger.close()
