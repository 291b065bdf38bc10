"""Fine-tuning controls: gradient accumulation against one process holding the whole batch, gradient
checkpointing against the plain backward, layer-wise learning-rate decay, the weights' average, and resuming
only between optimizer steps.

Tolerances: fp32 everywhere. Accumulation sums the micro-batches' gradients in another order than one big
batch does: within 1e-5 relative (SPEC.md's bound for the distributed exactness). The accumulating side runs
the real DeepSpeed engine and sharded classifier in a process group of one (that W workers equal one process
is tests/test_distributed_multiproc.py's; spawning W = 2 here would cost tens of seconds of imports).
Checkpointing recomputes the very same operations: bit for bit, stated as ``rtol=0, atol=0``.
"""

from __future__ import annotations

import os

import pytest
import torch
from distributed_reference import dense_classifier_loss, rel_err

from dmltrain.config import load_config
from dmltrain.errors import UserError

SMALL = ["data.image_size=32", "data.eval_crop=32", "data.eval_resize=36", "model.embedding_dim=64"]
K, B, C = 2, 8, 12  # micro-batches per step, global micro-batch, classes


def _accum_config(world: int, accum: int):
    return load_config(
        None,
        [
            *SMALL,
            "model.backbone=test_vit",
            f"data.batch_size={B * K // accum}",
            f"cluster.num_workers={world}",
            "train.zero_stage=0",
            f"train.grad_accum={accum}",
            "loss.instance=null",
            "loss.classifier.params={temperature: 0.05}",
            "optim.lr=0.5",
            "optim.momentum=0",
            "optim.weight_decay=0",
        ],
    )


def _whole_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(K * B, 3, 32, 32, generator=g), torch.randint(0, C, (K * B,), generator=g)


def _accumulating_worker(rank: int, world: int) -> dict:
    """K micro-batches of the global batch B on ``world`` workers (each its B / world share) through the DeepSpeed
    engine (gradient_accumulation_steps = K) and the sharded classifier, then one step of each."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from dmltrain.models import build_model, param_groups
    from dmltrain.training.engine import build_engine
    from dmltrain.training.head import LossHead
    from dmltrain.training.objective import Objective

    cfg = _accum_config(world, K)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, ds = build_engine(model, param_groups(model, cfg.optim), cfg, world)
    objective = Objective(cfg, C, model.embedding_dim, world)
    head = LossHead(objective, cfg.optim)
    clf = objective.classifier
    out = {"gas": ds["gradient_accumulation_steps"], "weight": clf.full_weight(), "emb_grads": [], "losses": []}
    x, y = _whole_batch()
    local = B // world
    for j in range(K):
        part = slice(j * B + rank * local, j * B + (rank + 1) * local)
        emb = engine(x[part])
        emb.retain_grad()
        loss = objective(emb, y[part], step=0)
        engine.backward(loss)
        out["emb_grads"].append(emb.grad.clone())
        out["losses"].append(float(loss.detach()))
        if j < K - 1:
            engine.step()  # not a boundary: DeepSpeed only counts it
            assert torch.equal(clf.weight, out["weight"][clf.class_start : clf.class_end])
    out["backbone_grads"] = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    out["row_grad"] = clf.gather_rows_all(clf.weight.grad)
    engine.step()
    head.step()
    out["weight_after"] = clf.full_weight()
    out["params_after"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return out


def test_accumulation_equals_one_big_batch_in_one_process(one_process_group):
    """The classifier loss (a mean over samples) over K micro-batches through DeepSpeed's gradient accumulation and
    the sharded classifier: the same loss, embedding gradients (the engine's convention: W × the global mean's),
    row gradients, backbone gradients, and one optimizer step of each, as one process training on the K × B batch
    with a plain dense classifier."""
    from dmltrain.models import build_model

    workers = [_accumulating_worker(0, 1)]
    w = workers[0]
    assert w["gas"] == K
    cfg = _accum_config(1, 1)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    x, y = _whole_batch()
    weight = w["weight"].clone().requires_grad_(True)
    emb = model(x)
    emb.retain_grad()
    loss = dense_classifier_loss(emb, y, weight, None, "normsoftmax", {"temperature": 0.05})
    loss.backward()
    assert abs(sum(w["losses"]) / K - float(loss)) < 1e-5 * float(loss)
    for j in range(K):
        for rank, worker in enumerate(workers):
            local = B // len(workers)
            ref = emb.grad[j * B + rank * local : j * B + (rank + 1) * local]
            assert rel_err(worker["emb_grads"][j] / len(workers), ref) < 1e-5, (j, rank)
    assert rel_err(w["row_grad"], weight.grad) < 1e-5
    for name, p in model.named_parameters():
        for worker in workers:
            assert rel_err(worker["backbone_grads"][name], p.grad) < 1e-5, name
    # one SGD step of lr 0.5 each: the rows stepped once for the K micro-batches, the backbone too
    assert rel_err(w["weight_after"], weight.detach() - 0.5 * weight.grad) < 1e-5
    for name, p in model.named_parameters():
        assert rel_err(w["params_after"][name], p.detach() - 0.5 * p.grad) < 1e-5, name


@pytest.mark.parametrize("backbone", ["test_vit", "small_cnn"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(backbone):
    """timm's set_grad_checkpointing (ViT) and torch.utils.checkpoint per stage (torchvision-style chain, with
    BatchNorm): the same loss and gradients, bit for bit, and BatchNorm's running statistics moved once."""
    from dmltrain.models import build_model

    over = [*SMALL, f"model.backbone={backbone}"] + (["model.multilevel=[stage2,stage4]"] * (backbone == "small_cnn"))
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(load_config(None, [*over, f"model.grad_checkpointing={checkpointing}"]).model)
        emb = model(torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
        loss = (emb.square() + emb.pow(3)).sum()
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model.state_dict()))
    (l0, g0, s0), (l1, g1, s1) = runs
    assert torch.equal(l0, l1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)
    for n in s0:  # running statistics and their counters: updated by the forward pass only
        torch.testing.assert_close(s1[n], s0[n], rtol=0, atol=0, msg=n)


def test_layer_decay_gives_each_block_its_rate():
    """optim.layer_decay = d: a ViT's block i trains at lr × d^(L − i − 1) (timm's grouping: the stem one level
    below block 0, the final norm with the last block), the head at lr × new_param_lr_mult, all scaled by the
    schedule; a torchvision chain by stage."""
    from dmltrain.models import build_model, param_groups
    from dmltrain.training.engine import build_optimizer
    from dmltrain.training.schedule import LRSchedule, ScheduledLR

    d, lr = 0.5, 0.1
    cfg = load_config(
        None,
        [*SMALL, "model.backbone=test_vit", f"optim.layer_decay={d}", f"optim.lr={lr}", "optim.new_param_lr_mult=10"]
        + ["optim.decay_norm_and_bias=false", "schedule.kind=step", "schedule.milestones=[2]", "schedule.unit=step"],
    )
    model = build_model(cfg.model)
    opt = build_optimizer(param_groups(model, cfg.optim), cfg.optim)
    sched = ScheduledLR(LRSchedule(cfg.schedule, 10, 10), opt, model, _NoHead(), lr)
    rate = {id(p): g for g in opt.param_groups for p in g["params"]}
    depth = len(model.backbone.net.blocks)  # 6: layers 0 (stem) .. 6 (last block and the final norm)
    for step, factor in ((0, 1.0), (5, 0.1)):
        sched.apply(step)
        for name, p in model.named_parameters():
            g = rate[id(p)]
            if name.startswith("head."):
                want = lr * 10
            elif ".blocks." in name:
                want = lr * d ** (depth - 1 - int(name.split(".blocks.")[1].split(".")[0]))
            elif name.startswith(("backbone.net.norm.", "backbone.net.fc_norm.")):
                want = lr
            else:  # cls token, position embeddings, patch embedding
                want = lr * d**depth
            assert g["lr"] == pytest.approx(want * factor), (step, name)
            undecayed = p.ndim <= 1 or name in ("backbone.net.cls_token", "backbone.net.pos_embed")
            assert g["weight_decay"] == (0.0 if undecayed else cfg.optim.weight_decay), name
    chain = build_model(load_config(None, [*SMALL, "model.backbone=small_cnn", f"optim.layer_decay={d}"]).model)
    mults = {g["name"]: g["lr_mult"] for g in param_groups(chain, cfg.optim.model_copy(update={"layer_decay": d}))}
    want = {f"{g}.layer{i}": d ** (4 - i) for g in ("backbone", "backbone_no_decay") for i in (1, 2, 3, 4)}
    assert mults == want | {"head": 10.0}  # small_cnn has no stem: its stages are layers 1-4


def test_a_timm_models_tokens_and_position_embeddings_are_not_decayed():
    """With decay_norm_and_bias false, the names a timm model's ``no_weight_decay()`` lists (a ViT's class token and
    position embeddings) join the norms and biases in the undecayed groups, as timm's and BEiT's optimizer factories
    do, with and without layer decay; the patch embedding's weight stays decayed."""
    from dmltrain.models import build_model, param_groups

    model = build_model(load_config(None, [*SMALL, "model.backbone=test_vit"]).model)
    names = {id(p): n for n, p in model.named_parameters()}
    tokens = {"backbone.net.cls_token", "backbone.net.pos_embed"}
    for over in ({}, {"layer_decay": 0.8}):
        optim = load_config(None, ["optim.decay_norm_and_bias=false", "optim.weight_decay=0.05"]).optim
        groups = param_groups(model, optim.model_copy(update=over))
        undecayed = {names[id(p)] for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
        decayed = {names[id(p)] for g in groups if g["weight_decay"] == 0.05 for p in g["params"]}
        assert tokens <= undecayed and not tokens & decayed, over
        assert all(g["name"].split(".")[0].endswith("_no_decay") for g in groups if g["weight_decay"] == 0.0)
        assert "backbone.net.patch_embed.proj.weight" in decayed
        assert undecayed - tokens == {n for n, p in model.named_parameters() if p.ndim <= 1}
    everything = param_groups(model, load_config(None, ["optim.weight_decay=0.05"]).optim)  # decay_norm_and_bias
    assert {g["weight_decay"] for g in everything} == {0.05}


class _NoHead:
    def set_lr(self, factor: float) -> None:
        pass


def test_weight_average_follows_its_formula_and_swaps():
    """ema ← d·ema + (1 − d)·w after each step, from the weights as built, in float32 for bf16 weights; evaluation
    swaps it in and the trained weights back; its state reloads."""
    from dmltrain.training.ema import WeightEMA

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2).bfloat16())
    d = 0.9
    ema = WeightEMA(net, d)
    want = {n: p.detach().double().clone() for n, p in net.named_parameters()}
    for _ in range(5):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        for n, p in net.named_parameters():
            want[n] = d * want[n] + (1 - d) * p.detach().double()
    for n, v in ema.shadow.items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v.double(), want[n], rtol=1e-6, atol=1e-6, msg=n)
    trained = {n: p.detach().clone() for n, p in net.named_parameters()}
    with ema.swapped():
        for n, p in net.named_parameters():
            assert torch.equal(p, ema.shadow[n].to(p.dtype)), n
    assert all(torch.equal(p, trained[n]) for n, p in net.named_parameters())
    exported = ema.state_dict_of_module()
    assert torch.equal(exported["0.weight"], ema.shadow["0.weight"]) and "1.running_mean" in exported
    again = WeightEMA(net, d)
    again.load_state_dict(ema.state_dict())
    assert again.updates == 5 and all(torch.equal(again.shadow[n], v) for n, v in ema.shadow.items())


def test_weight_average_warms_up_as_timm_and_resumes_exactly():
    """train.ema_warmup: the t-th update's decay is min(d, 1 − t^(−2/3)) (timm's ModelEmaV3 with use_warmup, whose
    own get_decay is the reference): the first update copies the weights, d caps it from t = 4 for d = 0.6. An
    average saved after 3 updates and loaded into a fresh one goes on bit for bit as the uninterrupted one."""
    from timm.utils.model_ema import ModelEmaV3

    from dmltrain.config import TrainConfig
    from dmltrain.training.ema import WeightEMA

    assert TrainConfig.model_fields["ema_warmup"].default is True
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    d = 0.6
    ema, timm_ema = WeightEMA(net, d, warmup=True), ModelEmaV3(net, decay=d, use_warmup=True)
    want = {n: p.detach().double().clone() for n, p in net.named_parameters()}
    steps = [{n: torch.randn_like(p) for n, p in net.named_parameters()} for _ in range(6)]
    resumed = None
    for t, step in enumerate(steps, 1):
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.add_(step[n])
        dt = 0.0 if t == 1 else min(d, 1 - t ** (-2 / 3))
        assert ema.decay_at(t) == pytest.approx(dt, abs=1e-12) == pytest.approx(timm_ema.get_decay(t), abs=1e-12)
        for n, p in net.named_parameters():
            want[n] = dt * want[n] + (1 - dt) * p.detach().double()
        ema.update()
        if resumed is not None:
            resumed.update()
        if t == 3:
            resumed = WeightEMA(net, d, warmup=True)
            resumed.load_state_dict(ema.state_dict())
        if t == 1:
            assert all(torch.equal(ema.shadow[n], p.detach()) for n, p in net.named_parameters())
    assert [ema.decay_at(t) for t in (3, 4)] == [pytest.approx(1 - 3 ** (-2 / 3)), d]
    for n, v in ema.shadow.items():
        torch.testing.assert_close(v.double(), want[n], rtol=1e-6, atol=1e-6, msg=n)
        assert torch.equal(resumed.shadow[n], v), n
    assert resumed.updates == ema.updates == 6


def test_a_checkpoints_average_is_what_an_asynchronous_evaluation_loads(tmp_path):
    """``eval.mode: async`` evaluates a checkpoint's ``model.pt``: with ``ema.pt`` beside it, the average."""
    from dmltrain.models import build_model, save_model
    from dmltrain.training.checkpoint import load_checkpoint_model
    from dmltrain.training.ema import WeightEMA

    cfg = load_config(None, [*SMALL, "model.backbone=small_cnn", "model.grad_checkpointing=true"])
    model = build_model(cfg.model)
    ema = WeightEMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    save_model(tmp_path / "model.pt", model, cfg.to_dict())
    plain = load_checkpoint_model(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))
    assert not plain.backbone.grad_checkpointing  # a loaded model is for inference
    torch.save(ema.state_dict(), tmp_path / "ema.pt")
    averaged = dict(load_checkpoint_model(tmp_path).named_parameters())
    assert all(torch.equal(averaged[n], v) for n, v in ema.shadow.items())


def test_a_position_is_resumed_only_with_its_own_accumulation():
    """Checkpoints are taken between optimizer steps, so a saved position (``batch`` counts steps of the epoch) is
    resumed with its own train.grad_accum at any worker count; another one (a step would mean other images) is
    refused in one line."""
    from dmltrain.training.state import TrainState, check_accumulation

    for batch in (5, 6):
        check_accumulation(TrainState(step=3, batch=batch, grad_accum=2), 2)
    for accum in (1, 4):
        with pytest.raises(UserError) as e:
            check_accumulation(TrainState(step=3, batch=6, grad_accum=2), accum)
        assert "train.grad_accum: the checkpoint at step 3 was saved with train.grad_accum=2" in str(e.value)
    assert TrainState().grad_accum == 1  # a position saved before train.grad_accum existed: no accumulation
    from dmltrain.training.engine import deepspeed_config

    ds = deepspeed_config(_accum_config(2, K), 2)  # B = 8 over 2 workers, K micro-batches per step
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        B * K,
        B // 2,
        K,
    )
