"""``model.compile``: the compiled step against the eager one, graph breaks, the evaluation's static batches.

Graph breaks are counted with dynamo's own counters, tracing with the ``aot_eager`` backend (dynamo and AOTAutograd,
forward and backward, no code generated: seconds). One test compiles with inductor, as training does, and steps
DeepSpeed engines eagerly and compiled side by side; a cold CPU compile takes a minute, so it compiles once per
backbone (scalar C++ kernels, quicker to build) and checks everything on those engines. Each C++ kernel is a
compiler run of its own, so each case compiles what no other test covers: gradient checkpointing is checked traced
(the graph-break tests compare its gradients and BatchNorm statistics with the eager step's). timm's ``test_vit``
stands in for ViT-S: the same ``VisionTransformer`` (patch embedding, SDPA attention, GELU MLP, LayerNorm) at 6
blocks of width 64, where a cold ViT-S compile takes two minutes here (ViT-S compiled: docs/results/benchmarks.md).
"""

from __future__ import annotations

import sys

import pytest
import torch
from multiproc import end_process_group

from dmltrain.config import load_config
from dmltrain.errors import UserError
from dmltrain.models import build_model, param_groups
from dmltrain.models.compiled import CompileWatch, compile_parts, compile_step, has_compiled_parts

SIZE = 64
BACKEND = "aot_eager"  # dynamo and AOTAutograd, forward and backward, no code generated


def _config(backbone: str, *extra: str):
    return load_config(
        None,
        [
            f"model.backbone={backbone}",
            f"data.image_size={SIZE}",
            f"data.eval_crop={SIZE}",
            f"data.eval_resize={SIZE}",
            "model.embedding_dim=64",
            "data.batch_size=8",
            "data.samples_per_class=2",
            "cluster.num_workers=1",
            "optim.lr=0.01",
            "optim.momentum=0",
            "loss.classifier.kind=normsoftmax",
            "loss.instance.kind=ice",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def process_group():
    """One gloo group of one for the module (DeepSpeed's engine), ended through DeepSpeed afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        mp.setenv("LOCAL_RANK", "0")
        from dmltrain.distributed.process_group import ensure_process_group

        ensure_process_group()
        try:
            yield
        finally:
            end_process_group()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces afresh (dynamo's caches are per process)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- graph breaks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "backbone,checkpointing",
    [
        ("resnet18", True),
        ("convnext_atto", False),
        ("test_vit", True),
    ],
)
def test_supported_backbones_compile_without_graph_breaks(backbone, checkpointing):
    """Backbone and head traced whole, forward and backward (gradient checkpointing too): no graph break, one
    graph for each, and the traced step's gradients equal the eager step's."""
    cfg = _config(backbone, f"model.grad_checkpointing={str(checkpointing).lower()}")
    torch.manual_seed(0)
    eager, traced = build_model(cfg.model), build_model(cfg.model)
    traced.load_state_dict(eager.state_dict())
    watch = CompileWatch(
        compile_parts(
            {"backbone": traced.backbone, "head": traced.head}, "default", ["backbone", "head"], backend=BACKEND
        ),
        "default",
    )
    assert watch.parts == ["backbone", "head"] and has_compiled_parts(traced)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    x = torch.randn(4, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    for model in (eager, traced):
        model(x).pow(2).sum().backward()
    assert watch.breaks() == {}, watch.summary()
    assert counters["stats"]["unique_graphs"] - graphs == 2
    for (name, p), q in zip(eager.named_parameters(), traced.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
    for (name, b), c in zip(eager.named_buffers(), traced.buffers()):  # BatchNorm statistics moved once
        assert torch.allclose(b.float(), c.float(), rtol=1e-5, atol=1e-6), name


def test_the_instance_loss_compiles_its_terms_whole():
    """``compile_scope: instance_loss`` compiles ICE's per-anchor terms, not the gathers: no graph break."""
    from dmltrain.distributed import GatheredInstanceLoss
    from dmltrain.losses import make_loss

    loss = GatheredInstanceLoss(make_loss("ice", {}, num_classes=4, dim=16))
    watch = CompileWatch(
        compile_parts({"instance_loss": loss}, "default", ["backbone", "instance_loss"], backend="aot_eager"), "default"
    )
    assert watch.parts == ["instance_loss"]
    x = torch.nn.functional.normalize(torch.randn(8, 16), dim=1).requires_grad_(True)
    loss(x, torch.arange(8) // 2).backward()
    assert watch.breaks() == {} and x.grad is not None


# -- evaluation ----------------------------------------------------------------------------------------------
def test_evaluation_pads_the_last_batch_of_a_compiled_model():
    """A compiled model embeds a split whose last batch is partial at one batch shape (no recompilation), and
    the embeddings equal the eager model's."""
    from torch._dynamo.utils import counters

    from dmltrain.evaluate.embedding import embed_batches

    cfg = _config("small_cnn")
    torch.manual_seed(0)
    eager, traced = build_model(cfg.model), build_model(cfg.model)
    traced.load_state_dict(eager.state_dict())
    compile_parts({"backbone": traced.backbone, "head": traced.head}, "default", ["backbone"], backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(n, 3, SIZE, SIZE, generator=g), torch.arange(n), torch.arange(n) + 10 * i)
        for i, n in enumerate((5, 5, 3))
    ]
    want, _, _ = embed_batches(eager, batches, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    got, labels, index = embed_batches(traced, batches, progress=False)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # eval mode, one batch shape
    assert got.shape == want.shape == (13, 64) and len(labels) == len(index) == 13
    assert torch.allclose(torch.from_numpy(got), torch.from_numpy(want), rtol=1e-4, atol=1e-5)


# -- the config and the report ---------------------------------------------------------------------------
def test_compile_config_and_a_missing_compiler(monkeypatch):
    cfg = _config("small_cnn")
    assert cfg.model.compile is False and cfg.model.compile_scope == ["backbone", "head"]
    model = build_model(cfg.model)
    assert compile_step(cfg.model, model, None, torch.device("cpu")) is None and not has_compiled_parts(model)
    cfg = _config("small_cnn", "model.compile=max-autotune", "model.compile_scope=[head,instance_loss]")
    assert cfg.model.compile == "max-autotune"
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(UserError, match=r"model\.compile: inductor builds CPU code with a C\+\+ compiler"):
        compile_step(cfg.model, model, None, torch.device("cpu"))
    for bad in ("model.compile=true", "model.compile_scope=[classifier]", "model.compile_scope=[]"):
        with pytest.raises(Exception, match=r"model\.compile"):
            _config("small_cnn", bad)


def test_the_compile_report_is_made_once(capsys):
    """The trainer's report after its first step: one line on stderr and three run tags, once."""
    from dmltrain.tracking.names import COMPILE_GRAPH_BREAKS_TAG, COMPILE_PARTS_TAG, COMPILE_SECONDS_TAG
    from dmltrain.training.trainer import Trainer

    class Logger:
        def __init__(self):
            self.tags = []

        def set_tags(self, tags):
            self.tags.append(dict(tags))

    trainer = Trainer.__new__(Trainer)  # the report alone, without a run around it
    trainer.rank, trainer.logger = 0, Logger()
    trainer.compiled = CompileWatch(["backbone", "head"], "default")
    trainer._report_compile()
    assert trainer.compiled.reported
    (tags,) = trainer.logger.tags
    assert set(tags) == {COMPILE_SECONDS_TAG, COMPILE_GRAPH_BREAKS_TAG, COMPILE_PARTS_TAG}
    assert tags[COMPILE_PARTS_TAG] == "backbone,head" and tags[COMPILE_GRAPH_BREAKS_TAG] == "0"
    err = capsys.readouterr().err
    assert err.count("compiled backbone, head (default) in") == 1 and "0 graph breaks" in err


# -- the compiled step (inductor) -------------------------------------------------------------------------
def _steps(cfg, compiled: bool, steps: int, data) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """``steps`` optimizer steps of the trainer's parts (DeepSpeed engine, objective, loss head, EMA) on ``data``;
    the losses, the backbone's gradients of the first micro-batch, and the EMA's average at the end."""
    from dmltrain.training.ema import WeightEMA
    from dmltrain.training.engine import build_engine, loss_scale
    from dmltrain.training.head import LossHead
    from dmltrain.training.objective import Objective

    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, _ = build_engine(model, param_groups(model, cfg.optim), cfg, 1)
    objective = Objective(cfg, 8, model.embedding_dim, 1)
    head = LossHead(objective, cfg.optim)
    ema = WeightEMA(engine.module, 0.9)
    watch = compile_step(cfg.model, engine.module, objective.instance, torch.device("cpu")) if compiled else None
    engine.train()
    losses, grads = [], {}
    for step in range(steps):
        for micro in range(cfg.train.grad_accum):
            images, labels = data[(step * cfg.train.grad_accum + micro) % len(data)]
            loss = objective(engine(images), labels, step=step)
            engine.backward(loss)
            if step == 0 and micro == 0:
                grads = {
                    n: None if p.grad is None else p.grad.detach().float().clone()
                    for n, p in engine.module.backbone.named_parameters()
                }
            losses.append(float(loss.detach()))
            scale = loss_scale(engine)
            engine.step()
        head.step(scale, applied=True)
        ema.update()
    if watch is not None:
        assert watch.breaks() == {}, watch.summary()
        assert watch.seconds() > 0
    return losses, grads, {k: v.clone() for k, v in ema.shadow.items()}


@pytest.mark.parametrize(
    "backbone,extra",
    [
        # a CNN with channels_last, two micro-batches a step and the instance loss compiled (its head stays eager:
        # the ViT compiles the default scope, backbone and head; gradient checkpointing is traced above)
        (
            "small_cnn",
            ("model.channels_last=true", "train.grad_accum=2", "model.compile_scope=[backbone,instance_loss]"),
        ),
        ("test_vit", ()),
    ],
)
def test_compiled_steps_agree_with_eager_ones(backbone, extra, process_group):
    """Five optimizer steps (SGD, lr 0.01) of the DeepSpeed engine, the sharded classifier, ICE and the EMA, eager
    and with ``model.compile=default`` (inductor), no graph break: every micro-batch's loss agrees to 5e-3 of the
    first loss (a step that missed an update would differ by the loss itself: 0.8 of it here), the first
    backward's backbone gradients to 5e-2 of each one's norm, and the EMA's averages to 1e-3 of the largest weight.

    The bounds are not fp32 rounding alone (about 2e-5 with two threads): a max-pool's gradient jumps when fp32
    sums in another order flip its argmax between two nearly equal inputs. With one thread (the count earlier
    tests leave in this process) eager flips a few against eager with two, and against the compiled step: 7% of a
    stage-2 gradient's largest entry, 2.4% of its norm, 1.4e-3 of the first loss after five steps. The test pins
    two threads so its figures do not depend on the tests before it."""
    from torch._inductor import config as inductor_config

    cfg = _config(backbone, "model.compile=default", *extra)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 3, SIZE, SIZE, generator=g), torch.arange(8) // 2) for _ in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loss_e, grad_e, ema_e = _steps(cfg, False, 5, data)
        # scalar C++ kernels: half the cold compile's time (gcc without the vector headers); the step is the same code
        with inductor_config.patch({"cpp.vec_isa_ok": False}):
            loss_c, grad_c, ema_c = _steps(cfg, True, 5, data)
    finally:
        torch.set_num_threads(threads)
    assert len(loss_e) == len(loss_c) == 5 * cfg.train.grad_accum
    assert max(abs(a - b) for a, b in zip(loss_e, loss_c)) <= 5e-3 * loss_e[0], (loss_e, loss_c)
    assert grad_e.keys() == grad_c.keys()
    for name, ge in grad_e.items():
        gc = grad_c[name]
        assert (ge is None) == (gc is None), name
        if ge is not None:
            assert (ge - gc).norm() <= 5e-2 * ge.norm(), name
    top = max(float(v.abs().max()) for v in ema_e.values())
    for name, e in ema_e.items():
        assert (e - ema_c[name]).abs().max() <= 1e-3 * top, name


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
