"""The per-worker training loop that Ray Train runs on every worker.

One :class:`Trainer` per worker process. It builds its parts, each in its own module, and
:meth:`Trainer.fit` runs the algorithm over them:

* the shard stream (``shards.read.stream.TrainStream``): this rank's share of each global batch,
  and its way onto the device (``shards.decode.device.DeviceInput``: a copy, or JPEG decoding
  and augmentation on the device), one batch ahead (:class:`~.prefetch.Prefetcher`);
* the DeepSpeed engine (:mod:`.engine`): backbone + embedding head, data-parallel;
* the :class:`~.objective.Objective` (sharded classifier + gathered instance loss) and the
  :class:`~.head.LossHead` that owns and steps their optimizers outside the engine;
* :class:`~.schedule.ScheduledLR` (learning rates per step), :class:`~.cadence.Cadence`
  (when to log, evaluate, checkpoint), :class:`~.timing.StepTimer` and
  :class:`~.metrics.TrainMetrics` (what is logged);
* with ``train.ema_decay``, the :class:`~.ema.WeightEMA` of the model's weights (evaluated and exported);
* the :class:`~.evaluator.Evaluator` (metrics, best model, plots, export), the
  :class:`~.checkpoint.Checkpointer` (save and resume) and the
  :class:`~.reporting.Reporter` (Ray Train reports, the driver's progress line).

A step is one global batch of ``data.batch_size × train.grad_accum`` images, the same at every worker
count (:mod:`shards.read.sampler`), which each worker takes in ``accum`` micro-batches (``train.grad_accum``
at the largest worker count, more at fewer): each is embedded, scored and back-propagated (DeepSpeed
accumulates the engine's gradients, the classifier adds its rows' into theirs), and the last one's
``engine.step()`` and :meth:`LossHead.step` make the one optimizer step of both. Checkpoints and every
other action happen between steps only, so a run never resumes in the middle of an accumulation, and a
run resumed at another worker count (an elastic run that lost or regained a node) continues mid-epoch.

After every step the :class:`~.elastic.StepSignals` say, the same on every rank, whether a checkpoint is
due by time (``train.checkpoint_every_s``) and whether a node is leaving (a worker was sent SIGTERM, its
raylet exited, or Ray drains its node): then the workers checkpoint at that step and stop
(:class:`~.elastic.NodeLeaving`), and Ray Train restarts them on the nodes left; :class:`~.elastic.Restarts`
accounts for each restart.

Every decision that involves a collective (when to evaluate, checkpoint or report) is a
pure function of the step, identical on every rank, so no rank ever waits alone. So is the
:class:`~.divergence.DivergenceGuard`'s check before each of them: a NaN or infinite loss
term stops every rank at the same point, with the last checkpoint taken before it kept; and
the :class:`~.fence.Fence`'s: a group whose driver died, or whose run another driver took over,
stops there too, writing nothing more. A resumed run logs no metric at a step its MLflow run
already holds (the steps replayed after the checkpoint), so its history has one value per step.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from itertools import islice
from typing import Any

import torch

from dmltrain.config import Config
from dmltrain.distributed.collectives import all_reduce_sum
from dmltrain.distributed.process_group import ensure_process_group
from dmltrain.models import build_model, param_groups
from dmltrain.models.compiled import compile_step
from dmltrain.models.precision import autocast_dtype
from dmltrain.models.sync_bn import convert_sync_batchnorm
from dmltrain.tracking.datasets import dataset_inputs
from dmltrain.tracking.description import describe_run
from dmltrain.tracking.names import (
    CLASSIFIER_MB_TAG,
    COMPILE_GRAPH_BREAKS_TAG,
    COMPILE_PARTS_TAG,
    COMPILE_SECONDS_TAG,
    EPOCH,
    IMAGES_PER_S,
    REMOTE_PREFIX,
    RESUMED_AT_EPOCH_START_TAG,
    RESUMED_FROM_STEP_TAG,
    SKIPPED_SAMPLES,
    STEP_MS,
)
from dmltrain.tracking.run import RunHandle
from dmltrain.training.artifacts import ModelExporter, log_run_files
from dmltrain.training.async_eval import load_record, record_summary, validation_request
from dmltrain.training.cadence import Cadence, Due
from dmltrain.training.checkpoint import EMA_STATE, Checkpointer
from dmltrain.training.divergence import Diverged, DivergenceGuard
from dmltrain.training.elastic import NodeLeaving, Restarts, StepSignals
from dmltrain.training.ema import WeightEMA
from dmltrain.training.engine import build_engine, loss_scale
from dmltrain.training.evaluator import Evaluator
from dmltrain.training.faults import Hold, injected_nan_step
from dmltrain.training.fence import Fence
from dmltrain.training.head import LossHead
from dmltrain.training.metrics import STAT_LOSS, STAT_LR, TrainMetrics, memory_metrics, mlflow_names
from dmltrain.training.objective import Objective
from dmltrain.training.prefetch import Prefetcher
from dmltrain.training.progress import WorkerEvents, board_handle
from dmltrain.training.reporting import Reporter, RunContext, position_metrics
from dmltrain.training.rng import seed_rngs
from dmltrain.training.schedule import LRSchedule, ScheduledLR
from dmltrain.training.state import TrainState, check_accumulation, realign_to_plan
from dmltrain.training.timing import StepTimer
from shards.config import resolve_decode
from shards.decode.device import DeviceInput
from shards.read.stream import TrainStream

try:  # Ray Train logs every report at INFO through a logger named by file path, outside LoggingConfig's reach
    from ray.train.v2._internal.execution import context as _ray_train_context
except ImportError:
    _ray_train_context = None

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, run: RunContext):
        self.cfg, self.run = cfg, run
        self.rank, self.world = ensure_process_group()
        WorkerEvents.install(board_handle(run.board_name), self.rank)  # dmltrain's warnings, to the driver's terminal
        self.device = worker_device(cfg.cluster.use_gpu)
        torch.set_num_threads(
            max(1, int(cfg.cluster.cpus_per_worker)) if not cfg.cluster.use_gpu else max(1, torch.get_num_threads())
        )
        seed_rngs(cfg.train.seed, 0, self.rank)
        self.logger = (
            RunHandle.attach(run.tracking_uri, run.mlflow_run_id, system_metrics=cfg.tracking.system_metrics)
            if self.rank == 0
            else None
        )

        t = cfg.train
        self.stream = TrainStream.from_config(
            cfg.data,
            cfg.train.seed,
            self.rank,
            self.world,
            normalize=False,  # uint8 (or encoded JPEGs) cross to the device; self.input normalizes there
            pin_memory=self.device.type == "cuda",
            decode=resolve_decode(cfg.data.decode, self.device, cfg.data.augment),
            grad_accum=t.grad_accum,
            max_world=cfg.cluster.max_workers,
        )
        self.accum = self.stream.accum  # micro-batches per optimizer step at this worker count
        self.steps_per_epoch = self.stream.steps_per_epoch  # at least 1 (the stream refuses less)
        self.total_steps = t.max_steps if t.max_steps is not None else t.epochs * self.steps_per_epoch
        self.num_epochs = math.ceil(self.total_steps / self.steps_per_epoch)

        model = build_model(cfg.model).to(self.device)
        if cfg.model.sync_bn:
            model = convert_sync_batchnorm(model)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.engine, self.ds_config = build_engine(model, param_groups(model, cfg.optim), cfg, self.world)
        self.model = self.engine.module
        self.ema = WeightEMA(self.model, t.ema_decay, t.ema_warmup) if t.ema_decay is not None else None
        self.input_dtype = autocast_dtype(t.precision) or torch.float32
        # the next batch is copied (or decoded and augmented) on a side stream while this one trains
        self.input = DeviceInput.from_config(
            cfg.data, self.device, self.input_dtype, channels_last=cfg.model.channels_last
        )
        self.prefetch = Prefetcher(self.input, self.device)
        # the label space, not the classes with images: a class whose images were all skipped keeps its id
        self.objective = Objective(
            cfg, self.stream.num_classes, model.embedding_dim, self.world, classifier_dropout=model.classifier_dropout
        ).to(self.device)
        self.head = LossHead(self.objective, cfg.optim)
        # model.compile: in place, after the engine, so that the compiled code sees its parameters as it trains them
        self.compiled = compile_step(cfg.model, self.model, self.objective.instance, self.device)

        schedule = LRSchedule(cfg.schedule, self.steps_per_epoch, self.total_steps)
        self.lr = ScheduledLR(schedule, self.engine.optimizer, self.model, self.head, cfg.optim.lr)
        self.cadence = Cadence.from_config(cfg, self.total_steps)
        self.timer = StepTimer(self.device)
        self.metrics = TrainMetrics()
        self._facts_logged = False  # the run facts (tags) are set at the first log point, and again at the end
        self.reporter = Reporter(run, self.rank, self.total_steps, self.num_epochs)
        exporter = ModelExporter(
            self.engine, self.logger, rank=self.rank, storage_dir=run.storage_dir, config=cfg.to_dict(), ema=self.ema
        )
        self.evaluator = Evaluator(
            self.model,
            cfg,
            exporter,
            self.reporter,
            self.logger,
            rank=self.rank,
            world_size=self.world,
            device=self.device,
            ema=self.ema,
            total_steps=self.total_steps,
        )
        self.checkpointer = Checkpointer(
            self.engine,
            self.head,
            self.reporter,
            rank=self.rank,
            world_size=self.world,
            zero_stage=t.zero_stage,
            seed=t.seed,
            model_config=cfg.to_dict(),
            states={EMA_STATE: self.ema} if self.ema is not None else None,
        )
        self.state = TrainState(
            world_size=self.world, zero_stage=t.zero_stage, grad_accum=t.grad_accum, plan=self.stream.plan_signature()
        )
        self._micro = 0  # micro-batches of the step in progress
        self.guard = DivergenceGuard(self.objective.terms, self.device)
        self.fence = Fence(run.driver, self.rank, self.device)
        self.signals = StepSignals(self.rank, self.world, t.checkpoint_every_s)
        self._leaving = False  # a node of the group is leaving (self.signals): stop after this step's checkpoint
        self.restarts = Restarts(board_handle(run.board_name), self.logger, self.world) if self.rank == 0 else None
        self.nan_at, self.hold = injected_nan_step(), Hold.from_env(self.rank)  # tests' fault injection

    # -- the algorithm ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps`` (resuming Ray's latest checkpoint if any); the run's summary (``TrainState.summary``).

        A non-finite loss term ends the training on every rank; the summary then holds ``error``
        (the term, its value, the step and the last checkpoint), and nothing is saved after it.
        """
        try:
            return self._fit()
        except Diverged as e:
            saved = self.checkpointer.last_step
            message = f"{e}; training stopped, " + (
                f"the last checkpoint is step {saved}" if saved is not None else "no checkpoint was saved"
            )
            if self.rank == 0:
                log.error("%s", message)
            summary = self._summary() | {"error": message}
            self.reporter.summary(summary)
            return summary

    def _fit(self) -> dict[str, Any]:
        saved_world = self._resume()
        resumed = saved_world is not None
        st = self.state
        if self.restarts is not None:
            self.restarts.started(st.step, saved_world)
        if st.finished:  # the same command again on a finished run: nothing left to train
            summary = self._summary()
            if self.cfg.eval.mode == "async":  # the evaluation tasks' record of the run
                summary |= record_summary(load_record(self.run.storage_dir), self.cfg.eval.metric)
            self.reporter.summary(summary)
            self.reporter.report(position_metrics(st), step=st.step)
            return summary
        if not resumed:
            log_run_files(self.logger, self.cfg, self.ds_config, self.stream.manifest)
            self._describe_run()
            if self.cfg.eval.before_training:
                st.initial_metrics = self._evaluate("initial")
        self.engine.train()
        self.objective.train()
        spe = self.steps_per_epoch
        while st.step < self.total_steps:
            epoch = st.epoch
            self.timer.start()
            # this epoch's steps from the position, or the steps left; each step is self.accum micro-batches
            left = min(spe - st.batch, self.total_steps - st.step)
            batches = islice(self.stream.epoch(epoch, start_batch=st.batch * self.accum), max(0, left) * self.accum)
            signalled = Due()
            for images, labels in self.prefetch(batches):
                if self._train_step(images, labels):
                    signalled = self._after_step()
                    if st.batch < spe:  # an epoch's last step acts once, with its epoch end
                        self._act(self.cadence.due(st.step) | signalled)
                        self._stop_if_leaving()
                self.timer.start()
            if st.batch >= spe or st.step < self.total_steps:
                step_due = (self.cadence.due(st.step) | signalled) if st.batch >= spe else Due()
                st.epoch, st.batch = epoch + 1, 0  # the epoch is complete (or the stream ended it)
                # one save for both: with asynchronous evaluation, a step checkpoint and the epoch's
                # validated one would otherwise be two checkpoints of the same step
                self._act(step_due | self.cadence.due(st.step, epoch_end=st.epoch))
                self._stop_if_leaving()
        self.guard.check()
        self.fence.check()
        inline = self.cfg.eval.mode == "inline"
        if inline:
            self.evaluator.evaluate(st, step=st.step, phase="final")
        st.finished = True
        self._log_facts()  # the run's means, now that it has trained
        self.evaluator.export_final(st)
        self.checkpointer.save(st, validation=None if inline else validation_request(st.step, st.epoch, "final"))
        summary = self._summary()
        self.reporter.summary(summary)
        return summary

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> bool:
        """One micro-batch; True when it completed an optimizer step (every ``train.grad_accum``-th)."""
        st, engine, timer = self.state, self.engine, self.timer  # images, labels: on the device (self.input)
        if self.hold is not None:
            self.hold.before(st.step + 1)
        lr = self.lr.apply(st.step)
        timer.lap("data")
        embeddings = engine(images)
        if self.nan_at == st.step + 1:  # fault injection (tests): a diverged step
            embeddings = embeddings * float("nan")
        # the price of class subsampling, on a step's first micro-batch, its time kept out of the step's
        if self._micro == 0 and self.objective.probe_due(st.step):
            with timer.aside(sync=True):
                self.objective.probe(embeddings, labels, st.step)
        # every micro-batch of a step draws the same classes (seed, step) besides its own
        loss = self.objective(embeddings, labels, step=st.step)
        timer.lap("forward")
        engine.backward(loss)  # divided by grad_accum; the classifier rows' gradients add up in their .grad
        timer.lap("backward")
        self._micro += 1
        boundary = self._micro == self.accum
        scale = loss_scale(engine)  # read before engine.step(), which may change it
        engine.step()  # DeepSpeed steps at the accumulation boundary only (and averages over ranks there)
        if boundary:
            self.head.step(scale, applied=not engine.fp16_enabled() or engine.was_step_applied())
            if self.ema is not None:
                self.ema.update()
        timer.lap("optimizer")
        self.metrics.add({**self.objective.device_stats, STAT_LR: lr})  # summed on the device, read at log points
        if boundary:
            st.step += 1
            st.batch += 1
            self._micro = 0
        self.guard.observe(st.step if boundary else st.step + 1, self.objective.losses)
        if boundary and self.compiled is not None and not self.compiled.reported:
            self._report_compile()
        return boundary

    def _report_compile(self) -> None:
        """Rank 0, once, after the first step (which compiled): the compile time and graph breaks, on stderr (the
        driver's console and the worker's log) and as run tags."""
        watch = self.compiled
        watch.reported = True
        if self.rank != 0:
            return
        print(f"dmltrain: {watch.summary()}", file=sys.stderr, flush=True)
        if self.logger is not None:
            self.logger.set_tags(
                {
                    COMPILE_SECONDS_TAG: f"{watch.seconds():.1f}",
                    COMPILE_GRAPH_BREAKS_TAG: str(sum(watch.breaks().values())),
                    COMPILE_PARTS_TAG: ",".join(watch.parts),
                }
            )

    def _after_step(self) -> Due:
        """After every step, on every rank: what the :class:`~.elastic.StepSignals` ask for (a checkpoint, at
        this step, when one is due by time or a node is leaving, unless the run ends here anyway)."""
        leaving, by_time = self.signals.poll()
        self._leaving = leaving
        if self.restarts is not None:
            self.restarts.reached(self.state.step)
        return Due(checkpoint=(leaving or by_time) and self.state.step < self.total_steps)

    def _stop_if_leaving(self) -> None:
        if self._leaving and self.state.step < self.total_steps:
            raise NodeLeaving(
                f"a node of this worker group is leaving; step {self.state.step} is checkpointed and the workers stop "
                "for Ray Train to restart them on the nodes left"
            )

    def _act(self, due: Due) -> None:
        if due.log or due.evaluate or due.checkpoint:
            self.guard.check()  # the same calls on every rank: all stop together, before anything is saved
            self.fence.check()  # ... and when their driver is gone or another took the run over
        if due.log:
            self._log_train()
        with self.timer.aside():
            if due.evaluate:
                self._evaluate("eval", checkpoint=due.checkpoint)
            elif due.checkpoint:
                self.checkpointer.save(self.state)
        if due.checkpoint:
            self.signals.checkpointed()

    def _evaluate(self, phase: str, checkpoint: bool = False) -> dict[str, float]:
        """``eval.mode: inline``: evaluate now (then checkpoint, when due); ``async``: checkpoint now and
        let Ray evaluate that checkpoint while training goes on (:mod:`.async_eval`; no metrics here)."""
        st = self.state
        if self.cfg.eval.mode == "async":
            self.checkpointer.save(st, validation=validation_request(st.step, st.epoch, phase))
            return {}
        metrics = self.evaluator.evaluate(st, step=st.step, phase=phase)
        if checkpoint:
            self.checkpointer.save(st)
        return metrics

    def _summary(self) -> dict[str, Any]:
        """What the run returns and the driver prints. With asynchronous evaluation the evaluation tasks
        post the metrics part (the board merges), so the workers' part is the position alone."""
        summary = self.state.summary(self.cfg.eval.metric)
        if self.cfg.eval.mode == "async":
            summary = {"step": summary["step"], "metric": summary["metric"]}
        return summary

    # -- around the loop ----------------------------------------------------------------------------
    def _resume(self) -> int | None:
        """Load Ray's latest checkpoint if any; the worker count that saved it when resumed, else None."""
        st = self.checkpointer.restore()
        if st is None:
            return None
        saved_world = self.checkpointer.restored_world_size
        st.finished = st.step >= self.total_steps  # a longer schedule continues a finished run
        check_accumulation(st, self.cfg.train.grad_accum)
        was = (st.epoch, st.batch)
        changed = realign_to_plan(st, self.stream.plan_signature())
        if changed and (st.epoch, st.batch) != was and self.rank == 0:
            log.warning(
                "resuming step %d at the start of epoch %d, not at batch %d of epoch %d: the batch plan changed (%s)",
                st.step,
                st.epoch,
                was[1],
                was[0],
                ", ".join(changed),
            )
            self.logger.set_tag(RESUMED_AT_EPOCH_START_TAG, f"plan changed: {', '.join(changed)}")
        if self.logger is not None:
            self.logger.set_tag(RESUMED_FROM_STEP_TAG, str(st.step))
            self.logger.skip_logged_steps()  # the steps replayed after the checkpoint keep their first values
        self.state = st
        return saved_world

    def _describe_run(self) -> None:
        """Rank 0, once per run: its description (completed after each evaluation) and its datasets."""
        if self.logger is None or not self.logger.enabled:
            return
        manifest, d = self.stream.manifest, self.cfg.data
        self.logger.set_description(describe_run(self.cfg, manifest.summary(), self.total_steps, self.steps_per_epoch))
        # race-safe: a study's points log the same shards at once (a conflict used to turn tracking off)
        self.logger.log_inputs(dataset_inputs(manifest, d.train_split, list(d.eval_splits)))

    def _log_facts(self) -> None:
        """Rank 0: what does not change while the run trains, as tags (the classifier's active classes and
        rows, averaged over the run so far; its memory)."""
        if self.logger is None:
            return
        facts = self.metrics.facts()
        mb = self.head.classifier_memory_mb()
        if mb is not None:
            facts[CLASSIFIER_MB_TAG] = mb
        self.logger.set_tags({k: f"{v:.6g}" for k, v in facts.items()})
        self._facts_logged = True

    def _log_train(self) -> None:
        summary = self.timer.summary(self.cfg.data.batch_size) | self.metrics.summary()
        io = self.stream.io_counts()  # remote shards: the same keys on every rank, summed over the ranks here
        if io:
            io = dict(
                zip(
                    io,
                    all_reduce_sum(torch.tensor(list(io.values()), dtype=torch.float64, device=self.device)).tolist(),
                )
            )
        if self.rank != 0:
            return
        summary.update({REMOTE_PREFIX + k: v for k, v in io.items()})
        st = self.state
        summary[EPOCH] = st.epoch + st.batch / self.steps_per_epoch
        summary.update(memory_metrics(self.device))
        if self.stream.skipped + self.input.skipped:
            summary[SKIPPED_SAMPLES] = float(self.stream.skipped + self.input.skipped)
        self.logger.log_metrics(mlflow_names(summary), step=st.step)
        if not self._facts_logged:
            self._log_facts()
        eta = (self.total_steps - st.step) * self.accum * summary[STEP_MS] / 1000  # STEP_MS: per micro-batch
        self.reporter.progress(
            st, loss=summary.get(STAT_LOSS, float("nan")), images_per_s=summary[IMAGES_PER_S], eta_s=eta, phase="train"
        )


def worker_device(use_gpu: bool) -> torch.device:
    """This worker's device: its local GPU when asked for and present, else the CPU."""
    if use_gpu and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def quiet_worker_logs() -> None:
    """Keep workers' output to what matters: the driver draws progress, rank 0 logs to MLflow."""
    for name in ("faiss", "faiss.loader", "mlflow", "DeepSpeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if _ray_train_context is not None and hasattr(_ray_train_context, "logger"):
        _ray_train_context.logger.setLevel(logging.WARNING)
    else:
        log.debug("Ray Train's report logger not found; reports stay verbose")
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
    except NodeLeaving as e:
        if trainer.rank == 0:
            log.warning("%s", e)
        raise
    finally:
        if trainer.logger is not None:
            trainer.logger.close()
