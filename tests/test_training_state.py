"""World-size-independent state of DeepSpeed engines, and the learning-rate schedule.

A real DeepSpeed engine is trained a few steps at W=2, its full per-parameter state is
taken, and an engine at W=1 is rebuilt from it (W=3: tests/test_elastic.py): every fp32 master weight and every
optimizer-state tensor must come back bit for bit, and the next step must match a single
process continuing from the same state.
"""

from __future__ import annotations

import math

import pytest
import torch
from multiproc import run_workers

# (zero stage, precision, optimizer)
SETUPS = [(0, "fp32", "sgd"), (1, "bf16", "sgd"), (2, "fp32", "adamw")]


def _engine(stage: int, precision: str, opt_name: str):
    from dmltrain.training.engine import import_deepspeed

    deepspeed = import_deepspeed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    groups = [
        {"params": list(model[0].parameters()), "weight_decay": 1e-3},
        {"params": list(model[2].parameters()), "weight_decay": 0.0},
    ]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9) if opt_name == "sgd" else torch.optim.AdamW(groups, lr=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=False)
    return engine


def _step(engine, rank: int, i: int, precision: str) -> None:
    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randn(2, 6, generator=g)
    out = engine(x.bfloat16() if precision == "bf16" else x)
    engine.backward(out.float().pow(2).mean())
    engine.step()


def _save(rank, world, path):
    from dmltrain.training.dp_state import full_dp_state

    states = []
    for stage, precision, opt in SETUPS:
        engine = _engine(stage, precision, opt)
        for i in range(3):
            _step(engine, rank, i, precision)
        states.append(full_dp_state(engine))
    if rank == 0:
        torch.save(states, path)
    return [sorted(s["optim"]["0.weight"]) for s in states]


def _load(rank, world, path):
    from dmltrain.training.dp_state import full_dp_state, load_full_dp_state

    saved = torch.load(path, weights_only=True)
    out = []
    for (stage, precision, opt), state in zip(SETUPS, saved):
        engine = _engine(stage, precision, opt)
        load_full_dp_state(engine, state)
        again = full_dp_state(engine)
        same = all(torch.equal(again["weights"][k], v) for k, v in state["weights"].items()) and all(
            torch.equal(again["optim"][k][s], t) for k, per in state["optim"].items() for s, t in per.items()
        )
        module_ok = all(
            torch.allclose(p.float(), state["weights"][n], atol=1e-2 if precision == "bf16" else 0)
            for n, p in engine.module.named_parameters()
        )
        out.append((same, module_ok, again["scalars"] == state["scalars"]))
    return out


@pytest.mark.multiprocess
def test_portable_state_round_trips_across_world_sizes(tmp_path):
    path = str(tmp_path / "state.pt")
    keys = run_workers(_save, 2, path, timeout=240)[0]
    assert keys[0] == ["momentum_buffer"] and keys[1] == ["momentum_buffer"] and keys[2] == ["exp_avg", "exp_avg_sq"]
    # loaded by one process: growing 2 -> 3 is checked at every ZeRO stage by tests/test_elastic.py
    (rank_result,) = run_workers(_load, 1, path, timeout=240)
    assert rank_result == [(True, True, True)] * len(SETUPS), rank_result


def test_schedule_shapes():
    from dmltrain.config import ScheduleConfig
    from dmltrain.training.schedule import LRSchedule

    step = LRSchedule(ScheduleConfig(kind="step", unit="epoch", milestones=[2, 3], gamma=0.1, head_only=1), 10, 50)
    assert [step.factor(s) for s in (0, 19, 20, 29, 30, 49)] == [
        1,
        1,
        pytest.approx(0.1),
        pytest.approx(0.1),
        pytest.approx(0.01),
        pytest.approx(0.01),
    ]
    assert step.head_only(9) and not step.head_only(10)
    cos = LRSchedule(ScheduleConfig(kind="cosine", unit="step", warmup=4, min_lr_ratio=0.1), 10, 104)
    assert [cos.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.factor(54) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos.factor(104) == pytest.approx(0.1)


def test_scheduled_lr_freezes_the_backbone_during_the_head_only_start():
    from dmltrain.config import ScheduleConfig
    from dmltrain.training.schedule import LRSchedule, ScheduledLR

    class Model:
        backbone_trainable = True

        def set_backbone_trainable(self, on):
            self.backbone_trainable = on

    class Head:
        def set_lr(self, factor):
            self.factor = factor

    w = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD(
        [
            {"params": [w[0]], "lr": 0.1, "weight_decay": 1e-4, "name": "backbone"},
            {"params": [w[1]], "lr": 0.1, "weight_decay": 0.0, "name": "backbone_no_decay"},
            {"params": [w[2]], "lr": 1.0, "weight_decay": 1e-4, "name": "head"},
        ],
        lr=0.1,
    )
    model, head = Model(), Head()
    lr = ScheduledLR(
        LRSchedule(ScheduleConfig(kind="step", unit="step", milestones=[3], gamma=0.5, head_only=2), 10, 10),
        opt,
        model,
        head,
        0.1,
    )
    assert lr.apply(0) == 0.1 and not model.backbone_trainable and head.factor == 1.0
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.0, 0.0), (0.0, 0.0), (1.0, 1e-4)]
    assert lr.apply(3) == pytest.approx(0.05) and model.backbone_trainable and head.factor == pytest.approx(0.5)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.05, 1e-4), (0.05, 0.0), (0.5, 1e-4)]


def test_a_changed_batch_plan_moves_a_mid_epoch_position_to_the_next_epoch(tmp_path):
    from dmltrain.training.state import TrainState, realign_to_plan

    plan = {"plan_version": 2, "batch_size": 32, "seed": 0, "manifest_digest": "ab"}
    # the same plan: the position stands (and survives a JSON round trip)
    st = TrainState(step=7, epoch=1, batch=3, plan=dict(plan))
    (tmp_path / "s.json").write_text(__import__("json").dumps(__import__("dataclasses").asdict(st)))
    st = TrainState.from_json(tmp_path / "s.json")
    assert realign_to_plan(st, plan) == [] and (st.epoch, st.batch) == (1, 3)
    # a position of an older plan version (or other shards) mid-epoch: the next epoch's start, the changed keys named
    st = TrainState(step=7, epoch=1, batch=3, plan={**plan, "plan_version": 1})
    assert realign_to_plan(st, {**plan, "manifest_digest": "cd"}) == ["manifest_digest", "plan_version"]
    assert (st.step, st.epoch, st.batch) == (7, 2, 0) and st.plan["plan_version"] == 2
    # at an epoch boundary nothing moves; a state saved before plans were recorded keeps its position
    st = TrainState(step=8, epoch=2, batch=0, plan=dict(plan))
    assert realign_to_plan(st, {**plan, "seed": 1}) == ["seed"] and (st.epoch, st.batch) == (2, 0)
    st = TrainState(step=8, epoch=1, batch=4)
    assert realign_to_plan(st, plan) == [] and (st.epoch, st.batch) == (1, 4) and st.plan == plan
