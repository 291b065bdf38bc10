"""Elastic runs, cheaply: a run that changes its worker count mid-epoch is the same optimization.

The trainer itself (DeepSpeed engines, the sharded classifier, the shard stream) runs in processes joined
by gloo on loopback (:mod:`multiproc`), without Ray:

* a reference run trains 6 steps at 3 workers without a break, leaving its checkpoint of step 2;
* the "elastic" run resumes that checkpoint at 2 workers (the classifier resharded 3 -> 2, the engine's
  state loaded through the portable path, each step taken in 3 micro-batches instead of 1), checkpoints
  at step 4, and resumes that at 3 workers again to step 6.

Its losses equal the reference's step for step, and its final classifier rows (with their momentum) and
weights equal the reference's, to float rounding: the sharded softmax is invariant to the worker count,
and a step's global batch, augmentation included, is the same at every worker count. Tolerance: 1e-5
relative on the losses, 1e-5 absolute on weights (fp32 on CPU: only the order of the sums differs).

The portable state of the data-parallel engine is checked on its own for every ZeRO stage (0-3): saved
at 2 workers, loaded at 3, the next step is the one the 2 workers take.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from multiproc import run_workers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REFERENCE_STEPS, RESIZE_AT, BACK_AT = 6, 2, 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from shards.build.synthetic import build_synthetic_shards

    out = tmp_path_factory.mktemp("elastic") / "shards"
    build_synthetic_shards(out, classes=12, per_class=8, image_size=16, seed=0, shard_size=30, progress=False)
    return out


def _config(shards: Path, out: Path, zero_stage: int) -> dict:
    from dmltrain.config import load_config

    overrides = {
        "data.shards": str(shards),
        "data.synthetic": "null",
        "data.batch_size": 24,  # P = 6 classes of K = 4: 2 a worker at 3 workers, 1 at 2 (3 micro-batches)
        "data.samples_per_class": 4,
        "data.loader_workers": 0,
        "data.image_size": 16,
        "data.eval_batch_size": 64,
        "model.backbone": "small_cnn",
        "model.pretrained": "none",
        "model.embedding_dim": 64,
        "model.freeze_bn": "true",  # a forward pass per sample: nothing depends on how a step is cut up
        "loss.classifier.sample_ratio": 1.0,
        "loss.instance": "null",
        "optim.lr": 0.05,
        "train.max_steps": REFERENCE_STEPS,
        "train.zero_stage": zero_stage,
        "train.checkpoint_every": 2,
        "train.log_every": 1,
        "train.output_dir": str(out),
        "eval.before_training": "false",
        "eval.every": 0,
        "eval.plots": "false",
        "tracking.enabled": "false",
        "cluster.num_workers": "[1,3]",
        "cluster.max_failures": -1,
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()]).to_dict()


def _train_phase(rank: int, world: int, cfg: dict, steps: int, start: str | None, keep: tuple[int, str]) -> dict | None:
    """Train to ``steps`` from the checkpoint folder ``start`` (None: from scratch), keeping the checkpoint of step
    ``keep[0]`` in the folder ``keep[1]``; rank 0 returns each step's loss, the classifier's rows and the weights."""
    from dmltrain.config import Config
    from dmltrain.distributed.class_checkpoint import gather_state
    from dmltrain.training.dp_state import full_module_state_dict
    from dmltrain.training.reporting import RunContext
    from dmltrain.training.trainer import Trainer, quiet_worker_logs

    quiet_worker_logs()
    config = Config.model_validate(cfg)
    config = config.model_copy(update={"train": config.train.model_copy(update={"max_steps": steps})})
    storage = Path(config.train.output_dir) / f"phase-{world}-{steps}"
    trainer = Trainer(config, RunContext("elastic", str(storage), "", None, report_to_ray=False))
    assert trainer.world == world and trainer.accum == {3: 1, 2: 3}[world]
    if start is not None:
        trainer.reporter.latest_checkpoint = lambda: contextlib.nullcontext(Path(start))

    def report(metrics, step, checkpoint_dir=None, validation=None):  # every rank's files, merged as Ray does
        if checkpoint_dir is not None and step == keep[0]:
            shutil.copytree(checkpoint_dir, keep[1], dirs_exist_ok=True)

    trainer.reporter.report = report
    losses: dict[int, list[float]] = {}
    forward = trainer.objective.forward

    def recording(embeddings, labels, step):
        loss = forward(embeddings, labels, step=step)
        losses.setdefault(step, []).append(float(loss.detach()))
        return loss

    trainer.objective.forward = recording
    trainer.fit()
    clf = trainer.head.classifier_head
    rows = gather_state(clf.classifier, clf.optimizer)
    weights = full_module_state_dict(trainer.engine)
    if rank != 0:
        return None
    momentum = rows["optimizer"]["rows"]["weight"]
    return {
        "losses": {s: float(np.mean(v)) for s, v in losses.items()},
        "rows": rows["weight"].numpy(),
        "momentum": {k: v.numpy() for k, v in momentum.items()},
        "weights": {k: v.numpy() for k, v in weights.items()},
        "step": trainer.state.step,
        "epoch": (trainer.state.epoch, trainer.state.batch),
    }


def _destroy_group() -> None:
    """End the process group; DeepSpeed's own call, once it has seen the group, also forgets what it derived."""
    import torch.distributed as dist

    from dmltrain.training.engine import import_deepspeed

    try:
        import_deepspeed().comm.destroy_process_group()
    except AttributeError:  # DeepSpeed has not started its communication backend: nothing of its to forget
        dist.destroy_process_group()


def _resized_run(rank: int, world: int, cfg: dict, ports: list[int], folder: str) -> dict | None:
    """The three phases in one group of processes (imports cost more than training here): the process group is
    started again at each phase's worker count, the processes beyond it sitting the phase out."""
    import gc
    import os

    import torch.distributed as dist

    def regroup(size: int, port: int) -> bool:
        dist.barrier()
        _destroy_group()
        os.environ["WORLD_SIZE"] = str(size)
        if rank < size:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        return rank < size

    def group_of_all(port: int) -> None:  # everybody back, for the next phase's start
        if dist.is_initialized():
            _destroy_group()
        os.environ["WORLD_SIZE"] = str(world)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    at_2, at_4 = f"{folder}/ckpt-{RESIZE_AT}", f"{folder}/ckpt-{BACK_AT}"
    ref = _train_phase(rank, 3, cfg, REFERENCE_STEPS, None, (RESIZE_AT, at_2))
    gc.collect()
    # 3 -> 2 workers after step 2, mid-epoch (an epoch is 96 / 24 = 4 steps), to step 4 and its checkpoint ...
    down = _train_phase(rank, 2, cfg, BACK_AT, at_2, (BACK_AT, at_4)) if regroup(2, ports[0]) else None
    group_of_all(ports[1])
    gc.collect()
    # ... and back to 3 workers from there, to the end
    up = _train_phase(rank, 3, cfg, REFERENCE_STEPS, at_4, (-1, ""))
    return None if rank else {"ref": ref, "down": down, "up": up}


def _engine_step(engine, world: int, rank: int, step: int) -> None:
    """One optimizer step on a global batch of 6 samples fixed by ``step``, this rank taking its share."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
    share = slice(rank * 6 // world, (rank + 1) * 6 // world)
    engine.backward((engine(x[share]) - y[share]).pow(2).mean())
    engine.step()


def _engines(stage: int, world: int, rank: int):
    """A small engine at ZeRO ``stage`` for each optimizer, the same initial weights at every worker count."""
    from dmltrain.training.engine import import_deepspeed

    for make in (lambda p: torch.optim.AdamW(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        opt = make(model.parameters())
        config = {
            "train_batch_size": 6,
            "train_micro_batch_size_per_gpu": 6 // world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, *_ = import_deepspeed().initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
        yield type(opt).__name__, engine


def _portable_state(rank: int, world: int, folder: str, ports: list[int]) -> dict | None:
    """At 2 workers, for every ZeRO stage and optimizer: two steps, the portable state saved, a third step (the
    reference); at 3 workers: the state loaded, the third step. Rank 0 returns both results. ZeRO-3 comes last
    in each process: building a ZeRO-3 engine leaves DeepSpeed's patches behind for the engines built after it."""
    import os

    import torch.distributed as dist

    from dmltrain.training.dp_state import full_dp_state, full_module_state_dict, load_full_dp_state
    from dmltrain.training.engine import import_deepspeed

    out: dict = {}
    ports = iter(ports)
    _destroy_group()
    for stages in ([0, 1, 2], [3]):
        os.environ["WORLD_SIZE"] = "2"
        if rank < 2:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{next(ports)}", rank=rank, world_size=2)
            for stage in stages:
                for name, engine in _engines(stage, 2, rank):
                    _engine_step(engine, 2, rank, 0)
                    _engine_step(engine, 2, rank, 1)
                    state = full_dp_state(engine)
                    module = full_module_state_dict(engine)
                    if rank == 0:
                        torch.save({"dp": state, "module": module}, f"{folder}/{stage}-{name}.pt")
                    _engine_step(engine, 2, rank, 2)
                    out[(stage, name, 2)] = {k: v.numpy() for k, v in full_module_state_dict(engine).items()}
            import_deepspeed().comm.destroy_process_group()
        else:
            next(ports)
        os.environ["WORLD_SIZE"] = str(world)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{next(ports)}", rank=rank, world_size=world)
        for stage in stages:
            for name, engine in _engines(stage, 3, rank):
                saved = torch.load(f"{folder}/{stage}-{name}.pt", weights_only=True)
                load_full_dp_state(engine, saved["dp"], module_weights=saved["module"])
                _engine_step(engine, 3, rank, 2)
                out[(stage, name, 3)] = {k: v.numpy() for k, v in full_module_state_dict(engine).items()}
        import_deepspeed().comm.destroy_process_group()
    return None if rank else out


def _both(rank: int, world: int, cfg: dict, ports: list[int], folder: str) -> dict | None:
    """Both checks in one group of 3 processes (each new group of processes imports torch and DeepSpeed again)."""
    resized = _resized_run(rank, world, cfg, ports[:2], folder)
    portable = _portable_state(rank, world, folder, ports[2:])
    return None if rank else {**resized, "portable": portable}


@pytest.fixture(scope="module")
def checked(shards, tmp_path_factory) -> dict:
    from multiproc import free_port

    folder = tmp_path_factory.mktemp("checked")
    cfg = _config(shards, folder / "runs", zero_stage=1)
    return run_workers(_both, 3, cfg, [free_port() for _ in range(6)], str(folder), timeout=800)[0]


@pytest.mark.timeout(900)
def test_a_run_resized_3_2_3_mid_epoch_is_the_run_without_the_resizes(checked):
    ref, down, up = checked["ref"], checked["down"], checked["up"]
    assert sorted(ref["losses"]) == list(range(REFERENCE_STEPS)) and ref["step"] == REFERENCE_STEPS
    assert sorted(down["losses"]) == [2, 3] and sorted(up["losses"]) == [4, 5]
    resized = {**down["losses"], **up["losses"]}
    for step in range(RESIZE_AT, REFERENCE_STEPS):
        assert resized[step] == pytest.approx(ref["losses"][step], rel=1e-5), (step, resized[step], ref["losses"][step])
    np.testing.assert_allclose(up["rows"], ref["rows"], rtol=0, atol=1e-5)
    for k, v in ref["momentum"].items():
        np.testing.assert_allclose(up["momentum"][k], v, rtol=0, atol=1e-5, err_msg=k)
    for k, v in ref["weights"].items():
        np.testing.assert_allclose(up["weights"][k], v, rtol=0, atol=1e-5, err_msg=k)
    assert up["epoch"] == ref["epoch"]


@pytest.mark.timeout(900)
def test_the_engine_state_moves_to_another_worker_count_at_every_zero_stage(checked):
    """Saved at 2 workers and loaded at 3 (weights, Adam's moments and step, SGD's momentum): the next step is the
    one the 2 workers take, for ZeRO 0, 1, 2 and 3."""
    got = checked["portable"]
    for stage in range(4):
        for name in ("AdamW", "SGD"):
            two, three = got[(stage, name, 2)], got[(stage, name, 3)]
            for k, v in two.items():
                np.testing.assert_allclose(three[k], v, rtol=0, atol=1e-6, err_msg=f"ZeRO-{stage} {name} {k}")
