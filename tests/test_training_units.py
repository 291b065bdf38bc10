"""Pieces of the training system that need no Ray: DeepSpeed JSON, the objective."""

from __future__ import annotations

import json

import pytest
import torch

from dmltrain.config import load_config
from dmltrain.errors import UserError


def test_deepspeed_config_generated_and_overridden(tmp_path):
    from dmltrain.training.engine import deepspeed_config

    cfg = load_config(
        None,
        [
            "train.precision=bf16",
            "train.zero_stage=2",
            "train.grad_clip=1.5",
            "data.batch_size=64",
            "cluster.num_workers=2",
        ],
    )
    ds = deepspeed_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["train_batch_size"] == 64
    assert ds["zero_optimization"] == {"stage": 2} and ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 1.5
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "gradient_clipping": 0.5}))
    ds = deepspeed_config(load_config(None, [f"train.deepspeed_config={user}", "cluster.num_workers=2"]), world_size=2)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True} and ds["gradient_clipping"] == 0.5
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 7}))
    with pytest.raises(UserError, match="train_micro_batch_size_per_gpu.*data.batch_size"):
        deepspeed_config(load_config(None, [f"train.deepspeed_config={user}"]), world_size=2)
    user.write_text("{not json")
    with pytest.raises(UserError, match=r"ds.json: invalid JSON at line 1"):
        deepspeed_config(load_config(None, [f"train.deepspeed_config={user}"]), world_size=2)


def test_objective_single_worker_is_the_plain_weighted_sum():
    """At W=1 the objective is w1 × NormSoftmax + w2 × ICE of the registry losses, gradients included."""
    from dmltrain.losses import build_loss
    from dmltrain.training.objective import Objective

    cfg = load_config(
        None,
        [
            "loss.classifier.weight=0.7",
            "loss.instance.kind=ice",
            "loss.instance.weight=0.3",
            "loss.classifier.params={temperature: 0.1}",
            "cluster.num_workers=1",
        ],
    )
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        obj = Objective(cfg, num_classes=10, dim=8, world_size=1)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(12, 8, generator=g, requires_grad=True)
        y = torch.arange(12) % 6
        loss = obj(x, y, step=0)
        loss.backward()
        ref_cls = build_loss("normsoftmax", num_classes=10, dim=8, temperature=0.1)
        with torch.no_grad():
            ref_cls.weight.copy_(obj.classifier.full_weight())
        x2 = x.detach().clone().requires_grad_(True)
        ref = 0.7 * ref_cls(x2, y) + 0.3 * build_loss("ice", scale=64.0)(x2, y)
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(obj.classifier.weight.grad, ref_cls.weight.grad)
        assert set(obj.stats) >= {"loss", "classifier/loss", "instance/loss"}
    finally:
        torch.distributed.destroy_process_group()


def _proxy_objective_worker(rank, world, kind):
    """Objective with a replicated proxy loss at W workers vs the loss of the concatenated batch."""
    from dmltrain.losses import make_loss
    from dmltrain.training.objective import Objective

    cfg = load_config(
        None,
        [
            "loss.classifier=null",
            f"loss.instance.kind={kind}",
            "loss.instance.params={}",
            f"cluster.num_workers={world}",
            "data.batch_size=48",
        ],
    )
    torch.manual_seed(100 + rank)  # different RNG per rank: the replicas must still start equal
    obj = Objective(cfg, num_classes=7, dim=6, world_size=world)
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(12, 6, generator=g, dtype=torch.float32)
    y_all = torch.arange(12) % 7
    lo, hi = (0, 5) if rank == 0 else (5, 12)
    x = x_all[lo:hi].clone().requires_grad_(True)
    loss = obj(x, y_all[lo:hi], step=0)
    loss.backward()
    obj.average_replicated_grads()
    ref = make_loss(kind, {}, num_classes=7, dim=6)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), obj.replicated_parameters()):
            a.copy_(b)
    xr = x_all.clone().requires_grad_(True)
    ref_loss = ref(xr, y_all)
    ref_loss.backward()
    # the objective scales embedding grads by W for DeepSpeed's averaging: undo it to compare
    return (
        float(loss.detach()),
        float(ref_loss.detach()),
        torch.allclose(x.grad / world, xr.grad[lo:hi], atol=1e-6),
        all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(obj.replicated_parameters(), ref.parameters())),
        [p.detach().tolist() for p in obj.replicated_parameters()],
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["proxy_nca", "center"])
def test_proxy_instance_losses_are_replicated_and_exact(kind):
    from multiproc import run_workers

    out = run_workers(_proxy_objective_worker, 2, kind)
    for loss, ref, emb_ok, proxy_ok, _ in out:
        assert loss == pytest.approx(ref, rel=1e-5) and emb_ok and proxy_ok
    assert out[0][4] == out[1][4]  # replicas identical


# -- the trainer's components ---------------------------------------------------------------------
def _old_loop_events(total, steps_per_epoch, log_every, eval_every, eval_unit, ckpt_every):
    """The event order of the trainer before it was split (its fit() loop transcribed, with its own bookkeeping)."""
    events, step, epoch, batch, last_eval, last_ckpt = [], 0, 0, 0, -1, -1
    while step < total:
        while step < total:
            if batch >= steps_per_epoch:
                break  # the stream's epoch is exhausted
            step, batch = step + 1, batch + 1
            if step % log_every == 0 or step == total:
                events.append(("log", step))
            if eval_unit == "step" and eval_every and step % eval_every == 0 and step < total:
                events.append(("eval", step))
                last_eval = step
            if ckpt_every and step % ckpt_every == 0 and step < total:
                events.append(("ckpt", step))
                last_ckpt = step
        if batch >= steps_per_epoch or step < total:
            epoch, batch = epoch + 1, 0
            done = step >= total
            if not done and eval_unit == "epoch" and eval_every and epoch % eval_every == 0:
                events.append(("eval", step))
                last_eval = step
            if not done and ckpt_every == 0:
                events.append(("ckpt", step))
                last_ckpt = step
    if last_eval != step:
        events.append(("final eval", step))
    if last_ckpt != step:
        events.append(("ckpt", step))
    return events


def _cadence_events(cadence, steps_per_epoch):
    """The same run driven by Cadence.due in the shape of Trainer.fit."""
    from dmltrain.training.cadence import Due

    events, step, epoch, batch = [], 0, 0, 0

    def act(due, at):
        events.extend(
            (name, at) for name, on in (("log", due.log), ("eval", due.evaluate), ("ckpt", due.checkpoint)) if on
        )

    while step < cadence.total_steps:
        for _ in range(min(steps_per_epoch - batch, cadence.total_steps - step)):
            step, batch = step + 1, batch + 1
            if batch < steps_per_epoch:
                act(cadence.due(step), step)
        if batch >= steps_per_epoch or step < cadence.total_steps:
            step_due = cadence.due(step) if batch >= steps_per_epoch else Due()
            epoch, batch = epoch + 1, 0
            act(step_due | cadence.due(step, epoch_end=epoch), step)
    return events + [("final eval", step), ("ckpt", step)]


def _in_step_order(events):
    """Events of one step in the trainer's order (log, evaluate, checkpoint), each at most once: an epoch's
    last step acts once with its epoch end (the old loop checkpointed before an epoch-end evaluation)."""
    rank = {"log": 0, "eval": 1, "final eval": 1.5, "ckpt": 2}
    return sorted(set(events), key=lambda e: (e[1], rank[e[0]]))


@pytest.mark.parametrize("total,spe", [(12, 4), (10, 4), (1, 3), (7, 1)])
@pytest.mark.parametrize("eval_every,unit", [(1, "epoch"), (2, "epoch"), (0, "epoch"), (3, "step")])
@pytest.mark.parametrize("ckpt_every,log_every", [(0, 1), (2, 5), (5, 3)])
def test_cadence_keeps_the_event_order_of_the_original_loop(total, spe, eval_every, unit, ckpt_every, log_every):
    from dmltrain.training.cadence import Cadence

    cadence = Cadence(total, log_every, eval_every, unit, ckpt_every)
    events = _cadence_events(cadence, spe)
    assert len(events) == len(set(events)) and events == _in_step_order(events)
    assert events == _in_step_order(_old_loop_events(total, spe, log_every, eval_every, unit, ckpt_every))


def test_cadence_by_hand():
    from dmltrain.training.cadence import Cadence, Due

    c = Cadence.from_config(
        load_config(None, ["train.max_steps=10", "train.log_every=4", "train.checkpoint_every=0", "eval.every=2"]), 10
    )
    assert c.due(4) == Due(log=True) and c.due(3) == Due() and c.due(10) == Due(log=True)
    assert c.due(6, epoch_end=2) == Due(evaluate=True, checkpoint=True) and c.due(3, epoch_end=1) == Due(
        checkpoint=True
    )
    assert c.due(10, epoch_end=4) == Due()  # the end of the run checkpoints and evaluates itself
    assert Due(log=True, checkpoint=True) | Due(evaluate=True, checkpoint=True) == Due(True, True, True)


def test_best_evaluation_tracking():
    from dmltrain.training.state import TrainState

    st = TrainState()
    assert not st.record_evaluation(
        {"recall@1": 0.9}, step=0, key="recall@1", initial=True
    )  # the untrained model never counts
    assert st.best_metric is None and st.last_metrics == {"recall@1": 0.9}
    assert st.record_evaluation({"recall@1": 0.5}, step=3, key="recall@1")
    assert not st.record_evaluation({"recall@1": 0.5}, step=6, key="recall@1")  # a tie is not an improvement
    assert not st.record_evaluation({"nmi": 0.7}, step=7, key="recall@1") and st.last_metrics == {"nmi": 0.7}
    assert st.record_evaluation({"recall@1": 0.6, "nmi": 0.1}, step=9, key="recall@1")
    assert (st.best_metric, st.best_step, st.best_metrics) == (0.6, 9, {"recall@1": 0.6, "nmi": 0.1})
    assert st.summary("recall@1") == {
        "step": 0,
        "initial": {},
        "final": {"recall@1": 0.6, "nmi": 0.1},
        "best": {"recall@1": 0.6, "nmi": 0.1},
        "best_step": 9,
        "metric": "recall@1",
    }


def test_train_metrics_average_and_mlflow_names():
    from dmltrain.training.metrics import TrainMetrics, mlflow_names

    m = TrainMetrics()
    m.add({"loss": 1.0, "classifier/loss": torch.tensor(2.0), "active_pairs": 3.0, "classifier/active_rows": 10.0})
    m.add({"loss": 3.0, "classifier/loss": torch.tensor(4.0), "active_pairs": 5.0, "classifier/active_rows": 12.0})
    first = m.summary()
    assert first == {"loss": 2.0, "classifier/loss": 3.0, "active_pairs": 4.0, "classifier/active_rows": 11.0}
    assert m.summary() == {}
    m.add({"classifier/active_rows": 14.0, "classifier/active_classes": 7.0})
    m.summary()
    # run facts: each one's mean over every step it was seen (10, 12, 14), as tags; never metric series
    assert m.facts() == {"dmltrain.classifier.active_rows": 12.0, "dmltrain.classifier.active_classes": 7.0}
    assert mlflow_names(
        {
            "loss": 1,
            "lr": 2,
            "epoch": 3,
            "images_per_s": 4,
            "time/step_ms": 5,
            "active_pairs": 6,
            "classifier/accuracy": 7,
            "classifier/active_share": 1.0,
            "instance/loss": 8,
        }
    ) == {
        "batch/loss": 1,
        "batch/lr": 2,
        "epoch": 3,
        "images_per_s": 4,
        "time/step_ms": 5,
        "train/active_pairs": 6,
        "softmax/accuracy": 7,
        "instance/loss": 8,
    }


def _head(overrides, seed=0, dim=6):
    from dmltrain.training.head import LossHead
    from dmltrain.training.objective import Objective

    cfg = load_config(
        None,
        [
            "cluster.num_workers=1",
            "loss.instance.kind=proxy_nca",
            "loss.instance.params={}",
            "optim.name=sgd",
            "optim.momentum=0.9",
            "optim.new_param_lr_mult=2",
            *overrides,
        ],
    )
    torch.manual_seed(seed)
    return LossHead(Objective(cfg, num_classes=9, dim=dim, world_size=1), cfg.optim)


def test_loss_head_unscales_steps_and_skips_with_the_engine():
    """The head's optimizers see the gradient of the unscaled loss, step with the schedule's lr, and skip an overflowed step."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, 6, generator=g), torch.arange(10) % 9
    scaled, plain = _head([]), _head([])
    for p, q in zip(scaled.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    scaled.set_lr(0.5)
    plain.set_lr(0.5)
    assert {g["lr"] for o in scaled.optimizers for g in o.param_groups} == {0.01 * 2 * 0.5}
    (1024.0 * scaled.objective(x, y, step=0)).backward()  # what fp16's engine.backward does
    plain.objective(x, y, step=0).backward()
    scaled.step(loss_scale=1024.0)
    plain.step()
    for p, q in zip(scaled.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert p.grad is None
    before = [p.detach().clone() for p in scaled.parameters()]
    (1024.0 * scaled.objective(x, y, step=1)).backward()
    scaled.step(loss_scale=1024.0, applied=False)  # the engine skipped its step (overflow): so does the head
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, scaled.parameters()))
    other = _head([], seed=5)
    other.load_state_dict(scaled.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(other.proxies.parameters(), scaled.proxies.parameters()))
    assert other.proxy_optimizer.state_dict()["state"].keys() == scaled.proxy_optimizer.state_dict()["state"].keys()


def _checkpointed_engine(tmp_path, stage: int, seed: int, precision: str = "fp32"):
    """A small real DeepSpeed engine at W=1 with a proxy loss head, and its Checkpointer (the process group must exist)."""
    from dmltrain.models import build_model, param_groups
    from dmltrain.training.checkpoint import Checkpointer
    from dmltrain.training.engine import build_engine
    from dmltrain.training.reporting import Reporter, RunContext

    cfg = load_config(
        None,
        [
            "model.backbone=small_cnn",
            "model.embedding_dim=64",
            "model.pretrained=none",
            "data.batch_size=4",
            "cluster.num_workers=1",
            f"train.zero_stage={stage}",
            f"train.precision={precision}",
            "loss.instance.kind=proxy_nca",
            "loss.instance.params={}",
            "optim.name=adamw",
        ],
    )
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    engine, _ = build_engine(model, param_groups(model, cfg.optim), cfg, 1)
    head = _head(["optim.name=adamw"], seed=seed, dim=64)
    reporter = Reporter(RunContext("r", str(tmp_path), "", None, report_to_ray=False), 0, 10, 1)
    return (
        engine,
        head,
        Checkpointer(
            engine, head, reporter, rank=0, world_size=1, zero_stage=stage, seed=0, model_config=cfg.to_dict()
        ),
    )


def _train_two_steps(engine, head) -> None:
    g = torch.Generator().manual_seed(0)
    images, y = torch.randn(4, 3, 32, 32, generator=g), torch.tensor([0, 0, 4, 4])
    for step in range(2):
        loss = head.objective(engine(images.to(next(engine.module.parameters()).dtype)).float(), y, step=step)
        engine.backward(loss)
        engine.step()
        head.step()


def test_checkpointer_restores_engine_head_rngs_and_position(tmp_path, one_process_group):
    """A real DeepSpeed engine at W=1: DeepSpeed's own checkpoint (same layout) and the portable files (another ZeRO stage)."""
    from dmltrain.training.state import TrainState

    engine, head, ckpt = _checkpointed_engine(tmp_path, 1, seed=0)
    _train_two_steps(engine, head)
    state = TrainState(step=2, epoch=0, batch=2, zero_stage=1, last_metrics={"recall@1": 0.5}, plan={"seed": 0})
    ckpt.save_to(tmp_path / "c", state)
    assert {
        "engine",
        "model.pt",
        "dp_optimizer.pt",
        "instance_loss.pt",
        "classifier",
        "rng-rank0.pt",
        "train_state.json",
    } <= {p.name for p in (tmp_path / "c").iterdir()}
    want_rand = torch.rand(3)
    for stage in (1, 0):  # the same layout (DeepSpeed's checkpoint), then another ZeRO stage (the portable files)
        engine2, head2, ckpt2 = _checkpointed_engine(tmp_path, stage, seed=7)
        loaded = ckpt2.load_from(tmp_path / "c")
        assert (loaded.step, loaded.batch, loaded.last_metrics, loaded.zero_stage) == (2, 2, {"recall@1": 0.5}, stage)
        for (n, p), q in zip(engine.module.named_parameters(), engine2.module.parameters()):
            assert torch.equal(p, q), n
        for p, q in zip(head.parameters(), head2.parameters()):
            assert torch.equal(p, q)
        if stage == 1:
            assert torch.equal(torch.rand(3), want_rand)  # the RNG streams continue where they were saved
        assert all(
            torch.equal(s["exp_avg"], t["exp_avg"])
            for s, t in zip(head.classifier_optimizer.state.values(), head2.classifier_optimizer.state.values())
        )


class _Planted:
    """A pickle payload: unpickling it calls ``open(marker, 'w')`` — creating the marker proves code ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_checkpoint_scan_follows_links_and_refuses_those_leaving_the_checkpoint(tmp_path):
    from dmltrain.training.safe_load import scan_checkpoint

    ckpt, outside, marker = tmp_path / "checkpoint-step00000002", tmp_path / "outside", tmp_path / "code-ran"
    ckpt.mkdir()
    outside.mkdir()
    torch.save({"w": torch.zeros(2)}, ckpt / "model.pt")
    torch.save(_Planted(marker), outside / "mp_rank_00_model_states.pt")
    (ckpt / "engine").symlink_to(outside, target_is_directory=True)  # DeepSpeed would read the planted file
    with pytest.raises(UserError) as e:
        scan_checkpoint(ckpt)
    assert str(e.value).startswith(f"{ckpt / 'engine'}: a symbolic link to {outside}, outside the checkpoint")
    assert "\n" not in str(e.value)
    # a link inside the checkpoint stands for its target, scanned under the name a resume reads
    (ckpt / "engine").unlink()
    (ckpt / "inner").mkdir()
    torch.save(_Planted(marker), ckpt / "inner" / "state.bin")
    (ckpt / "rng-rank0.pt").symlink_to(ckpt / "inner" / "state.bin")
    with pytest.raises(UserError, match=r"rng-rank0\.pt: refused to load a checkpoint file that holds .*open"):
        scan_checkpoint(ckpt)
    (ckpt / "rng-rank0.pt").unlink()
    scan_checkpoint(ckpt)  # data only again
    # the checkpoint folder itself a link out (as the workers are handed it): refused, not resolved and walked
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"w": torch.zeros(2)}, elsewhere / "model.pt")  # data only: the walk alone would pass it
    linked = tmp_path / "checkpoint-step00000008"
    linked.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError) as e:
        scan_checkpoint(linked)
    assert str(e.value).startswith(f"{linked}: a symbolic link to {elsewhere}; refused") and "\n" not in str(e.value)
    assert not marker.exists()


def _safe_loading_worker(rank, world, tmp: str):
    """In a fresh process (DeepSpeed keeps its groups per process): ZeRO-2/3 round trips through the allow-list,
    then planted pickles in DeepSpeed's and in our own files."""
    from pathlib import Path

    from dmltrain.training.dp_state import full_module_state_dict
    from dmltrain.training.safe_load import scan_checkpoint
    from dmltrain.training.state import TrainState

    tmp = Path(tmp)
    out: dict = {}
    for stage, precision in ((2, "bf16"), (3, "fp32")):
        engine, head, ckpt = _checkpointed_engine(tmp, stage, seed=0, precision=precision)
        _train_two_steps(engine, head)
        ckpt.save_to(tmp / f"z{stage}", TrainState(step=2, batch=2, zero_stage=stage))
        scan_checkpoint(tmp / f"z{stage}")  # the driver's check passes a genuine checkpoint
        engine2, _, ckpt2 = _checkpointed_engine(tmp, stage, seed=7, precision=precision)
        step = ckpt2.load_from(tmp / f"z{stage}").step
        a, b = full_module_state_dict(engine), full_module_state_dict(engine2)
        out[stage] = (step, all(torch.equal(a[k], b[k]) for k in a), engine2.global_steps == engine.global_steps)
    engine, head, ckpt = _checkpointed_engine(tmp, 1, seed=0)
    _train_two_steps(engine, head)
    for victim in ("engine/mp_rank_00_model_states.pt", "rng-rank0.pt"):
        directory = tmp / f"planted-{victim.replace('/', '-')}"
        ckpt.save_to(directory, TrainState(step=2, batch=2, zero_stage=1))
        marker, bad = directory / "code-ran", directory / victim
        genuine = torch.load(bad, weights_only=False) if victim.startswith("engine") else None
        torch.save({**genuine, "module": _Planted(marker)} if genuine else _Planted(marker), bad)
        _, _, ckpt2 = _checkpointed_engine(tmp, 1, seed=7)
        messages = []
        attempts = (lambda d=directory: scan_checkpoint(d), lambda d=directory, c=ckpt2: c.load_from(d))
        for attempt in attempts:
            try:
                attempt()
                messages.append(None)
            except UserError as e:
                messages.append(str(e))
        ran_before = marker.exists()
        torch.load(bad, weights_only=False)  # the file is a live payload: an unrestricted load runs it
        out[victim] = (messages, ran_before, marker.exists())
    return out


@pytest.mark.multiprocess
def test_resume_loads_data_only_zero_2_and_3_and_refuses_planted_pickles(tmp_path, monkeypatch):
    """Resuming reads every checkpoint file weights-only with DeepSpeed's few state types allowed: ZeRO-2 (bf16) and
    ZeRO-3 engines come back exactly; a pickle planted in DeepSpeed's model states or in an RNG file is refused by the
    driver's scan and by the workers' load, with one line naming the file, and never runs."""
    from multiproc import run_workers

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (out,) = run_workers(_safe_loading_worker, 1, str(tmp_path), timeout=300)
    assert out[2] == (2, True, True) and out[3] == (2, True, True)
    for victim in ("engine/mp_rank_00_model_states.pt", "rng-rank0.pt"):
        messages, ran_before, ran_unrestricted = out[victim]
        for m in messages:
            assert (
                m is not None and "\n" not in m and victim.rsplit("/", 1)[-1] in m and "refused" in m and "open" in m
            ), m
        assert not ran_before and ran_unrestricted, victim


def _divergence_worker(rank, world):
    from dmltrain.training.divergence import Diverged, DivergenceGuard

    guard = DivergenceGuard(["classifier", "instance"], torch.device("cpu"))
    verdicts = []
    for step in range(1, 6):
        classifier = torch.tensor(float("inf") if (rank == 1 and step == 3) else 1.0)  # only rank 1 sees it
        instance = torch.tensor(float("nan") if step >= 4 else 0.5)
        guard.observe(step, {"classifier": classifier, "instance": instance})
        if step % 2 == 1:  # checked at some steps only, as at log points: the first bad step is remembered
            try:
                guard.check()
                verdicts.append(None)
            except Diverged as e:
                verdicts.append(str(e))
    return verdicts


@pytest.mark.multiprocess
def test_divergence_guard_stops_every_rank_at_the_same_check_naming_the_first_bad_step():
    from multiproc import run_workers

    r0, r1 = run_workers(_divergence_worker, 2)
    assert r0[0] is None and r1[0] is None
    assert r1[1] == "loss diverged: the classifier loss is inf at step 3"
    assert r0[1] == "loss diverged: the classifier loss is not finite at step 3"  # rank 0 stops too, at the same check
    assert r0[2] == r0[1] and r1[2] == r1[1]  # the later NaN of the instance loss does not hide the first


def test_divergence_guard_on_one_process():
    from dmltrain.training.divergence import Diverged, DivergenceGuard

    guard = DivergenceGuard(["instance"], torch.device("cpu"))
    guard.observe(1, {"instance": torch.tensor(2.0)})
    guard.check()
    guard.observe(2, {"instance": torch.tensor(float("-inf"))})
    guard.observe(3, {"instance": torch.tensor(float("nan"))})
    with pytest.raises(Diverged, match=r"^loss diverged: the instance loss is -inf at step 2$"):
        guard.check()


@pytest.mark.cuda
def test_divergence_guard_observes_without_synchronising_the_device():
    from dmltrain.training.divergence import DivergenceGuard

    guard = DivergenceGuard(["classifier", "instance"], torch.device("cuda"))
    losses = {"classifier": torch.tensor(1.0, device="cuda"), "instance": torch.tensor(float("nan"), device="cuda")}
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the device raises
    try:
        for step in range(1, 4):
            guard.observe(step, losses)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.first_bad.tolist() == [2**62, 1]


@pytest.mark.cuda
def test_objective_step_does_not_wait_for_the_device(one_process_group):
    """NormSoftmax + ICE on one GPU: forward, backward and the statistics never read the device
    (sample_ratio 1; subsampling draws its classes on the host), and the statistics read at the end
    equal those of the CPU objective."""
    from dmltrain.training.objective import Objective

    cfg = load_config(None, ["loss.classifier.kind=normsoftmax", "loss.instance.kind=ice", "cluster.num_workers=1"])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.arange(16) % 4
    torch.manual_seed(0)
    on_cpu = Objective(cfg, num_classes=10, dim=8, world_size=1)
    torch.manual_seed(0)
    on_gpu = Objective(cfg, num_classes=10, dim=8, world_size=1).cuda()
    ref = on_cpu(x.requires_grad_(True), y, step=0)
    xg = x.detach().cuda().requires_grad_(True)
    yg = y.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any call that waits for the device raises
    try:
        loss = on_gpu(xg, yg, step=0)
        loss.backward()
        stats = on_gpu.device_stats
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(loss.cpu(), ref.detach(), rtol=2e-3, atol=2e-3)
    expected = on_cpu.stats
    got = {k: float(v) for k, v in stats.items()}
    assert set(got) >= {"loss", "classifier/loss", "instance/loss"}
    for key in ("loss", "classifier/loss", "instance/loss"):
        assert abs(got[key] - expected[key]) <= 2e-3 * max(1.0, abs(expected[key])), key
