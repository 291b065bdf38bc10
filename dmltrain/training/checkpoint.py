"""Training checkpoints: the only code that writes or reads a run's checkpoint files.

Every worker writes into its own local directory; Ray Train merges the directories of all
workers into one checkpoint, so every per-rank file has a rank-unique name:

==========================  ======  ==========================================================
``engine/``                 all     DeepSpeed's engine checkpoint (tag ``engine``): module,
                                    ZeRO optimizer partitions (one file per rank), counters
``model.pt``                rank 0  full fp32 weights + resolved config (``dmltrain eval`` reads it)
``dp_optimizer.pt``         rank 0  per-parameter optimizer state of the data-parallel model
``<name>.pt``               rank 0  each replicated stateful object's ``state_dict()``: the loss
                                    head's proxies and their optimizer as ``instance_loss.pt``,
                                    the weights' average (``train.ema_decay``) as ``ema.pt``
``classifier/``             each    classifier rows and their optimizer state by global class id:
                                    one piece per rank plus an index (no rank ever holds all C rows)
``rng-rank{r}.pt``          each    torch / numpy / python RNG states of rank r
``train_state.json``        rank 0  step, epoch, batch within the epoch, world size, metrics
==========================  ======  ==========================================================

Resuming at the same world size and ZeRO stage loads DeepSpeed's own checkpoint (exact,
bit for bit); at another world size or ZeRO stage the data-parallel state comes from ``model.pt``
and ``dp_optimizer.pt`` (ZeRO 0-3: :mod:`.dp_state`), the classifier reshards by class id (its rows,
their optimizer state and per-class state such as the hard-class index), and RNG streams are
re-derived from (seed, step, rank).

Nothing is unpickled beyond data: every file, DeepSpeed's included, is read weights-only with an
explicit allow-list of DeepSpeed's state types (:mod:`.safe_load`); a file naming any other type
stops the resume with one line.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from ray.train.v2.api.validation_config import ValidationTaskConfig

from dmltrain.errors import UserError
from dmltrain.fileio import write_json
from dmltrain.models import load_model, save_model
from dmltrain.models.embedding_model import EmbeddingModel
from dmltrain.training.dp_state import full_dp_state, full_module_state_dict, load_full_dp_state
from dmltrain.training.head import LossHead
from dmltrain.training.reporting import Reporter, position_metrics
from dmltrain.training.rng import rng_state, seed_rngs, set_rng_state
from dmltrain.training.safe_load import load_file, restricted_loads
from dmltrain.training.state import TrainState

ENGINE_TAG = "engine"
CLASSIFIER_DIR = "classifier"
STATE_FILE = "train_state.json"


class Stateful(Protocol):
    """State the same on every rank (``torch.distributed.checkpoint.stateful.Stateful``'s shape)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves and restores a run: the DeepSpeed engine, the loss head, ``states``, RNG streams and the position.

    ``states`` maps a file stem to a replicated :class:`Stateful` (rank 0 writes
    ``<stem>.pt``, every rank loads it); the head's proxies are added as ``instance_loss``
    when the objective has them. The classifier's rows are saved by class id, one piece per
    rank. ``save`` and ``load_from`` are collectives: every rank calls them.
    """

    def __init__(
        self,
        engine,
        head: LossHead,
        reporter: Reporter,
        *,
        rank: int,
        world_size: int,
        zero_stage: int,
        seed: int,
        model_config: dict[str, Any],
        states: Mapping[str, Stateful] | None = None,
    ):
        self.engine, self.head, self.reporter = engine, head, reporter
        self.rank, self.world_size, self.zero_stage, self.seed = rank, world_size, zero_stage, seed
        self.model_config = model_config
        self.states: dict[str, Stateful] = dict(states or {})
        self.last_step: int | None = None  # the step of the latest checkpoint saved or restored by this run
        self.restored_world_size: int | None = None  # the worker count that saved the restored checkpoint
        if head.proxies is not None:
            self.states["instance_loss"] = head

    # -- through Ray Train --------------------------------------------------------------------------
    def save(self, state: TrainState, validation: ValidationTaskConfig | None = None) -> None:
        """A checkpoint of ``state`` through Ray Train: every rank writes its files, Ray merges and uploads them
        (and, with ``validation``, evaluates the checkpoint asynchronously: :mod:`.async_eval`)."""
        self.reporter.progress(state, phase="checkpointing")
        tmp = Path(tempfile.mkdtemp(prefix=f"dmltrain-ckpt-rank{self.rank}-"))
        try:
            self.save_to(tmp, state)
            self.reporter.report(position_metrics(state), step=state.step, checkpoint_dir=tmp, validation=validation)
            self.last_step = state.step
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def restore(self) -> TrainState | None:
        """Load Ray's latest checkpoint of this run into the engine, head and RNGs; its position, or None if there is none."""
        with self.reporter.latest_checkpoint() as directory:
            state = None if directory is None else self.load_from(directory)
        self.last_step = None if state is None else state.step
        return state

    # -- one directory ------------------------------------------------------------------------------
    def save_to(self, directory: Path, state: TrainState) -> None:
        """Write this rank's part of a checkpoint of ``state`` into ``directory``."""
        engine = self.engine
        directory.mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(str(directory), tag=ENGINE_TAG)
        dp = full_dp_state(engine)  # collectives under ZeRO
        weights = full_module_state_dict(engine)
        if self.head.classifier_head is not None:
            self.head.classifier_head.save(directory / CLASSIFIER_DIR)  # collective
        torch.save(rng_state(), directory / f"rng-rank{self.rank}.pt")
        if self.rank != 0:
            return
        weights.update(dp["weights"])  # fp32 masters over the (possibly bf16) module copy
        torch.save({"optim": dp["optim"], "scalars": dp["scalars"]}, directory / "dp_optimizer.pt")
        extra = {"step": state.step, "metrics": state.last_metrics}
        save_model(directory / "model.pt", engine.module, self.model_config, extra=extra, state_dict=weights)
        for stem, obj in self.states.items():
            torch.save(obj.state_dict(), directory / f"{stem}.pt")
        write_json(directory / STATE_FILE, state.to_dict())

    def load_from(self, directory: Path) -> TrainState:
        """Restore everything from a merged checkpoint directory; returns the saved position (now at this layout).

        Every file is read as data only (:func:`~.safe_load.restricted_loads`): one that names a type
        outside the allow-list raises a one-line :class:`UserError` before anything of it is built.
        """
        with restricted_loads(self.engine, directory):
            return self._load_from(directory)

    def _load_from(self, directory: Path) -> TrainState:
        state = TrainState.from_json(directory / STATE_FILE)
        self.restored_world_size = state.world_size
        same_layout = state.world_size == self.world_size and state.zero_stage == self.zero_stage
        if same_layout:
            load_path, _ = self.engine.load_checkpoint(str(directory), tag=ENGINE_TAG, load_lr_scheduler_states=False)
            if load_path is None:
                raise RuntimeError(f"{directory}: DeepSpeed could not load the engine checkpoint")
        else:
            self._load_portable(directory, state)
        if self.head.classifier_head is not None:
            self.head.classifier_head.load(directory / CLASSIFIER_DIR)  # reads only overlapping pieces
        for stem, obj in self.states.items():
            obj.load_state_dict(_load(directory / f"{stem}.pt"))
        rng_file = directory / f"rng-rank{self.rank}.pt"
        if same_layout and rng_file.exists():
            set_rng_state(_load(rng_file))
        else:
            seed_rngs(self.seed, state.step, self.rank)
        state.world_size, state.zero_stage = self.world_size, self.zero_stage
        return state

    def _load_portable(self, directory: Path, state: TrainState) -> None:
        """The data-parallel state saved at another world size or ZeRO stage: full weights and per-parameter
        optimizer state (a checkpoint without them, a ZeRO-3 one of an older dmltrain, is one line)."""
        if not (directory / "dp_optimizer.pt").exists():
            raise UserError(
                f"{directory}: saved with ZeRO-{state.zero_stage} at {state.world_size} workers without the portable "
                f"optimizer state; resume it with cluster.num_workers={state.world_size} and "
                f"train.zero_stage={state.zero_stage}"
            )
        module = self.engine.module
        weights = _load(directory / "model.pt")["state_dict"]
        opt = _load(directory / "dp_optimizer.pt")
        params = dict(module.named_parameters())
        dp = {"weights": {k: weights[k] for k in params}, "optim": opt["optim"], "scalars": opt["scalars"]}
        load_full_dp_state(self.engine, dp, module_weights=weights)
        if self.zero_stage < 3:  # ZeRO-3's buffers were loaded with its partitions
            buffers = {k: v for k, v in weights.items() if k not in params}
            module.load_state_dict({**module.state_dict(), **buffers})


EMA_STATE = "ema"  # the stem of the weights' average in a checkpoint (train.ema_decay)


def load_checkpoint_model(directory: Path, map_location: str | torch.device = "cpu") -> EmbeddingModel:
    """The model of a merged checkpoint directory (its ``model.pt``: full fp32 weights, read weights-only),
    in eval mode on ``map_location``: what an asynchronous evaluation evaluates and exports. With a weights'
    average in the checkpoint (``ema.pt``), the average in place of the trained weights, as inline
    evaluation and export use it."""
    model = load_model(directory / "model.pt", map_location=map_location)[0]
    ema_file = directory / f"{EMA_STATE}.pt"
    if ema_file.exists():
        shadow = _load(ema_file)["shadow"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in shadow:
                    p.copy_(shadow[name])
    return model


def _load(path: Path) -> Any:
    return load_file(path)
