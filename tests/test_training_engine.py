"""The DeepSpeed engine with a channels_last model: it starts (DeepSpeed's broadcast views parameters as
bytes) and trains exactly like the same model in the default layout, at ZeRO 0-2, fp32 and bf16 (fp16 is
refused on CPU workers by the config, as DeepSpeed's fp16 optimizers need CUDA; it takes the same path)."""

from __future__ import annotations

import pytest
import torch
from multiproc import end_process_group

from dmltrain.config import load_config


def _engine(precision: str, stage: int, channels_last: bool):
    from dmltrain.models import build_model, param_groups
    from dmltrain.training.engine import build_engine

    cfg = load_config(
        None,
        [
            "model.backbone=small_cnn",
            "model.embedding_dim=64",
            "data.batch_size=4",
            "cluster.num_workers=1",
            f"train.zero_stage={stage}",
            f"train.precision={precision}",
            f"model.channels_last={str(channels_last).lower()}",
            "optim.lr=0.05",
            "optim.momentum=0.9",
            "optim.weight_decay=0",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, _ = build_engine(model, param_groups(model, cfg.optim), cfg, 1)
    return engine


def _is_channels_last(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


@pytest.fixture(scope="module")
def process_group():
    """One gloo group of one for the module, ended through DeepSpeed so that it forgets the groups it cloned
    from it (a later test's new group would otherwise meet them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        mp.setenv("LOCAL_RANK", "0")
        from dmltrain.distributed.process_group import ensure_process_group

        ensure_process_group()
        try:
            yield
        finally:
            end_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_channels_last_engine_starts_and_steps_like_the_default_layout(precision, process_group):
    """Each parameter's update after two steps equals that of the default-layout engine; the conv weights
    that own their storage (ZeRO 0) are channels_last, those inside DeepSpeed's flat buffers (ZeRO 1-2)
    keep the default layout and still receive the updates."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1)
    images, target = torch.randn(4, 3, 32, 32, generator=g).to(dtype), torch.randn(4, 64, generator=g)
    # both engines see a channels_last batch (the channels_last model converts its input anyway), so both
    # convolve with the same kernels: in bf16 another layout's rounding would blur a lost update
    images = images.contiguous(memory_format=torch.channels_last)
    for stage in (0, 1, 2):
        runs = {}
        for cl in (False, True):
            engine = _engine(precision, stage, cl)
            start = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
            for _ in range(2):
                loss = (engine(images).float() * target).sum()
                engine.backward(loss)
                engine.step()
            runs[cl] = {n: p.detach().float() - start[n] for n, p in engine.module.named_parameters()}
            convs = [p for p in engine.module.parameters() if p.dim() == 4]
            assert convs and all(_is_channels_last(p) == (cl and stage == 0) for p in convs), (precision, stage, cl)
        for name, ref in runs[False].items():
            got = runs[True][name]
            assert ref.norm() > 0, (stage, name)  # every parameter moved, so an update lost would show
            assert (got - ref).norm() <= 1e-5 * ref.norm(), (
                precision,
                stage,
                name,
                float((got - ref).norm() / ref.norm()),
            )
