"""Training-state checkpoints: what one Ray Train checkpoint directory holds, and how a run resumes from it.

Every worker writes into its own local directory; Ray Train merges the directories of all
workers into one checkpoint, so every per-rank file has a rank-unique name:

==========================  ======  ==========================================================
``engine/``                 all     DeepSpeed's engine checkpoint (tag ``engine``): module,
                                    ZeRO optimizer partitions (one file per rank), counters
``model.pt``                rank 0  full fp32 weights + resolved config (``dmltrain eval`` reads it)
``dp_optimizer.pt``         rank 0  per-parameter optimizer state of the data-parallel model
``instance_loss.pt``        rank 0  replicated proxies of a proxy instance loss + their optimizer
``classifier/``             each    classifier rows and their optimizer state by global class id:
                                    one piece per rank plus an index (no rank ever holds all C rows)
``rng-rank{r}.pt``          each    torch / numpy / python RNG states of rank r
``train_state.json``        rank 0  step, epoch, batch within the epoch, world size, metrics
==========================  ======  ==========================================================

Resuming at the same world size and ZeRO stage loads DeepSpeed's own checkpoint (exact,
bit for bit); at another world size the data-parallel state comes from ``model.pt`` and
``dp_optimizer.pt``, the classifier reshards by class id, and RNG streams are re-derived
from (seed, step, rank).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmltrain.fileio import write_json
from dmltrain.training.dp_state import full_dp_state, full_module_state_dict, load_full_dp_state

ENGINE_TAG = "engine"


@dataclass
class TrainState:
    """Position of a run; JSON-serialisable."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch the next batch belongs to
    batch: int = 0  # batches of ``epoch`` already consumed
    world_size: int = 1
    zero_stage: int = 0
    finished: bool = False
    best_metric: float | None = None
    best_step: int | None = None
    initial_metrics: dict[str, float] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    best_metrics: dict[str, float] = field(default_factory=dict)
    plan: dict[str, Any] | None = None  # TrainStream.plan_signature() under which (epoch, batch) was reached

    @classmethod
    def from_json(cls, path: Path) -> TrainState:
        data = json.loads(path.read_text())
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def realign_to_plan(state: TrainState, plan: dict[str, Any]) -> list[str]:
    """Make ``state``'s (epoch, batch) valid under the batch ``plan`` (``TrainStream.plan_signature()``).

    A mid-epoch position replays the same batches only under the plan it was reached with; under
    another (world size, batch settings, seed or shards changed) the run moves to the start of
    the next epoch. Returns the plan keys that changed (empty: nothing moved). A state saved
    without a plan, or at an epoch boundary, keeps its position. ``state.plan`` becomes ``plan``.
    """
    old, state.plan = state.plan, dict(plan)
    if old is None or old == plan:
        return []
    changed = sorted(k for k in {*old, *plan} if old.get(k) != plan.get(k))
    if state.batch > 0:
        state.epoch, state.batch = state.epoch + 1, 0
    return changed


def rng_state() -> dict[str, Any]:
    """The process's RNG states as tensors and numbers only, so they load with ``weights_only=True``."""
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": np_pos, "has_gauss": np_has_gauss, "gauss": np_gauss},
        "python": {"version": py_version, "internal": torch.tensor(py_internal, dtype=torch.int64), "gauss": py_gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss"]))


def seed_rngs(seed: int, step: int, rank: int) -> None:
    """Deterministic RNG streams for (seed, step, rank), used at start and after a resharding resume."""
    s = (seed * 1_000_003 + step * 7_919 + rank) % (2**31 - 1)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def save_training_state(
    directory: Path,
    *,
    engine,
    classifier,
    classifier_optimizer,
    state: TrainState,
    rank: int,
    replicated=None,
    replicated_optimizer=None,
    model_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write this rank's part of a checkpoint into ``directory`` (a collective: all ranks call it)."""
    from dmltrain.models import save_model

    directory.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(directory), tag=ENGINE_TAG)
    # collectives under ZeRO; ZeRO-3 runs resume only at their own world size (DeepSpeed's checkpoint)
    dp = full_dp_state(engine) if state.zero_stage < 3 else None
    weights = full_module_state_dict(engine)
    if classifier is not None:
        from dmltrain.distributed import save_by_class

        save_by_class(classifier, directory / "classifier", classifier_optimizer)  # collective
    torch.save(rng_state(), directory / f"rng-rank{rank}.pt")
    if rank == 0:
        if dp is not None:
            weights.update(dp["weights"])  # fp32 masters over the (possibly bf16) module copy
            torch.save({"optim": dp["optim"], "scalars": dp["scalars"]}, directory / "dp_optimizer.pt")
        save_model(directory / "model.pt", engine.module, model_config, extra=extra, state_dict=weights)
        if replicated is not None:
            torch.save({"params": replicated.state_dict(), "optimizer": replicated_optimizer.state_dict()}, directory / "instance_loss.pt")
        write_json(directory / "train_state.json", asdict(state))


def load_training_state(
    directory: Path,
    *,
    engine,
    classifier,
    classifier_optimizer,
    rank: int,
    world_size: int,
    zero_stage: int,
    seed: int,
    replicated=None,
    replicated_optimizer=None,
) -> TrainState:
    """Restore everything from a merged checkpoint directory; returns the saved position."""
    state = TrainState.from_json(directory / "train_state.json")
    same_layout = state.world_size == world_size and state.zero_stage == zero_stage
    if same_layout:
        load_path, _ = engine.load_checkpoint(str(directory), tag=ENGINE_TAG, load_lr_scheduler_states=False)
        if load_path is None:
            raise RuntimeError(f"{directory}: DeepSpeed could not load the engine checkpoint")
    else:
        if zero_stage >= 3 or state.zero_stage >= 3:
            from dmltrain.errors import UserError

            raise UserError(
                f"{directory}: saved with ZeRO-{state.zero_stage} at {state.world_size} workers; a ZeRO-3 run resumes only "
                f"with the same cluster.num_workers and train.zero_stage"
            )
        weights = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)["state_dict"]
        opt = torch.load(directory / "dp_optimizer.pt", map_location="cpu", weights_only=True)
        params = dict(engine.module.named_parameters())
        load_full_dp_state(engine, {"weights": {k: weights[k] for k in params}, "optim": opt["optim"], "scalars": opt["scalars"]})
        buffers = {k: v for k, v in weights.items() if k not in params}
        engine.module.load_state_dict({**engine.module.state_dict(), **buffers})
    if classifier is not None:
        from dmltrain.distributed import load_by_class

        load_by_class(classifier, directory / "classifier", classifier_optimizer)  # reads only the pieces it overlaps
    if replicated is not None:
        rep = torch.load(directory / "instance_loss.pt", map_location="cpu", weights_only=True)
        replicated.load_state_dict(rep["params"])
        replicated_optimizer.load_state_dict(rep["optimizer"])
    rng_file = directory / f"rng-rank{rank}.pt"
    if same_layout and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        seed_rngs(seed, state.step, rank)
    state.world_size, state.zero_stage = world_size, zero_stage
    return state
