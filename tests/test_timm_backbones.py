"""timm backbones: features and stages, SDPA attention, the run config they fill in, pretrained weights that timm
saved (a file, or the local Hugging Face cache in its official layout), and a ConvNeXt trained, evaluated and
exported through the real DeepSpeed engine.

The models are timm's own test models (``test_vit``: a VisionTransformer of 6 blocks, width 64, patches of 16;
``test_convnext``: a ConvNeXt of 4 stages), built by timm's real classes, at 32 px.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from dmltrain.config import load_config
from dmltrain.errors import ConfigError, UserError

VIT, CONVNEXT = "test_vit", "test_convnext"
DEMO = Path(__file__).resolve().parents[1] / "configs/demo.yaml"
SMALL = ["data.image_size=32", "data.eval_crop=32", "data.eval_resize=36", "model.embedding_dim=64"]


def _cfg(*over: str):
    return load_config(None, [*SMALL, *over])


def _model(*over: str):
    from dmltrain.models import build_model

    torch.manual_seed(0)
    return build_model(_cfg(*over).model)


def test_vit_features_stages_and_sdpa_attention(monkeypatch):
    """Each ``model.features`` is what timm computes; stages are timm's intermediates; drop path reaches timm;
    attention runs through F.scaled_dot_product_attention even where timm was told not to use it."""
    import timm.layers

    cfg = _cfg(f"model.backbone={VIT}")
    assert (cfg.data.mean, cfg.data.std, cfg.data.interpolation, cfg.model.image_size) == (
        (0.5, 0.5, 0.5),
        (0.5, 0.5, 0.5),
        "bicubic",
        32,
    )
    was = timm.layers.use_fused_attn()
    timm.layers.set_fused_attn(False)  # as TIMM_FUSED_ATTN=0 would: dmltrain turns it back on per layer
    try:
        model = _model(f"model.backbone={VIT}").eval()
    finally:
        timm.layers.set_fused_attn(was)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    net, x = model.backbone.net, torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        emb = model(x)
        assert emb.shape == (2, 64) and len(calls) == len(net.blocks) == 6
        tokens = net.forward_features(x)
        pooled = net.forward_head(tokens, pre_logits=True)
        torch.testing.assert_close(emb, model.head([pooled[:, :, None, None]]))
        cls = _model(f"model.backbone={VIT}", "model.features=cls").backbone
        cls.load_state_dict(model.backbone.state_dict())
        torch.testing.assert_close(cls(x)[0][:, :, 0, 0], tokens[:, 0])
        patches = _model(f"model.backbone={VIT}", "model.features=patches", "model.pooling=gem").backbone
        patches.load_state_dict(model.backbone.state_dict())
        grid = patches(x)[0]
        assert grid.shape == (2, 64, 2, 2)
        torch.testing.assert_close(grid.flatten(2).transpose(1, 2), tokens[:, 1:])
        levels = model.backbone(x, ["blocks.4", "blocks.1", "output"])
        _, inter = net.forward_intermediates(x, indices=[1, 4])
        assert [t.shape for t in levels] == [(2, 64, 2, 2), (2, 64, 2, 2), (2, 64, 1, 1)]
        torch.testing.assert_close(levels[0], inter[1])
        torch.testing.assert_close(levels[1], inter[0])
    assert _model(f"model.backbone={VIT}", "model.multilevel=[blocks.2,output]")(x).shape == (2, 64)
    dropping = _model(f"model.backbone={VIT}", "model.drop_path=0.2").backbone.net
    assert dropping.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)  # timm's linear rule: the last block


def test_the_backbone_fills_in_and_refuses():
    """What comes from the backbone is filled in (torchvision: ImageNet's, bilinear, as before); what it cannot take
    is one line naming the key."""
    c = load_config(None, ["model.backbone=small_cnn"])
    assert (c.data.mean, c.data.interpolation, c.model.image_size) == ((0.485, 0.456, 0.406), "bilinear", 224)
    own = _cfg(f"model.backbone={VIT}", "data.mean=[0.1,0.2,0.3]", "data.interpolation=bilinear")
    assert (own.data.mean, own.data.std, own.data.interpolation) == ((0.1, 0.2, 0.3), (0.5, 0.5, 0.5), "bilinear")
    assert load_config(None, [*SMALL, "model.backbone=timm:resnet18"]).data.interpolation == "bicubic"  # timm's
    from dmltrain.config import TORCHVISION_BACKBONES
    from dmltrain.models.backbones import BACKBONES

    assert set(TORCHVISION_BACKBONES) == set(BACKBONES)
    for override, text in (
        (["model.backbone=vit_nonexistent"], "model.backbone: unknown backbone 'vit_nonexistent'"),
        (
            ["data.image_size=40", "data.eval_crop=40", "data.eval_resize=40", f"model.backbone={VIT}"],
            "data.image_size: 40 is not a multiple",
        ),
        (["data.eval_crop=24", f"model.backbone={VIT}"], "data.eval_crop: 24 differs from data.image_size 32"),
        ([f"model.backbone={VIT}", "model.channels_last=true"], "model.channels_last: test_vit is a transformer"),
        ([f"model.backbone={VIT}", "model.pooling=gem"], "model.pooling: gem pools patch tokens"),
        ([f"model.backbone={CONVNEXT}", "model.features=cls"], "model.features: test_convnext has no class token"),
        (["model.backbone=small_cnn", "model.drop_path=0.1"], "model.drop_path: small_cnn (torchvision)"),
        (["model.backbone=small_cnn", "model.features=cls"], "model.features: cls is for timm models"),
        (["train.ema_decay=0.99", "train.zero_stage=3"], "train.ema_decay: needs whole parameters"),
        (["data.std=[0.5,0,0.5]"], "data.std: every channel's std must be positive"),
    ):
        with pytest.raises(ConfigError) as e:
            _cfg(*override)
        assert text in str(e.value) and "\n" not in str(e.value), (override, str(e.value))


def _hf_cache(root, repo: str, files: dict[str, bytes]) -> None:
    """``files`` of ``repo`` in the Hugging Face hub cache's layout: content-addressed blobs, a snapshot of
    symbolic links named by the revision, and ``refs/main`` naming that revision."""
    folder = root / f"models--{repo.replace('/', '--')}"
    revision = hashlib.sha1(repo.encode()).hexdigest()
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / revision / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)


def test_timm_weights_load_from_a_file_and_the_local_hugging_face_cache(tmp_path, monkeypatch, capsys):
    """A state dict timm saved (its 160 px model with its classifier) loads into the 32 px backbone from a torch
    file, a safetensors file, ``timm`` and ``hf-hub:`` (the local cache, offline): the same weights, the position
    embeddings resampled as timm's own resampling does, the classifier left out. A missing cache entry, another
    architecture's file and a damaged file are one-line errors; nothing is ever downloaded unless allowed."""
    import huggingface_hub
    import safetensors.torch
    import timm
    from timm.layers import resample_abs_pos_embed

    from dmltrain.cli import main
    from dmltrain.models.pretrained import check_pretrained

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("downloaded"))
    torch.manual_seed(1)
    source = timm.create_model(VIT, pretrained=False)  # 160 px, 1000 classes: as timm publishes it
    state = source.state_dict()
    assert state["pos_embed"].shape == (1, 101, 64) and "head.weight" in state
    torch.save(state, tmp_path / "vit.pth")
    safetensors.torch.save_file(state, tmp_path / "vit.safetensors")
    _hf_cache(
        tmp_path / "hub", "timm/test_vit.r160_in1k", {"model.safetensors": (tmp_path / "vit.safetensors").read_bytes()}
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want_pos = resample_abs_pos_embed(state["pos_embed"], new_size=(2, 2), num_prefix_tokens=1)
    for spec in (tmp_path / "vit.pth", tmp_path / "vit.safetensors", "timm", "hf-hub:timm/test_vit.r160_in1k"):
        cfg = _cfg(f"model.backbone={VIT}", f"model.pretrained={spec}")
        check_pretrained(cfg.model.backbone, cfg.model.pretrained, cfg.model)
        net = _model(f"model.backbone={VIT}", f"model.pretrained={spec}").backbone.net
        torch.testing.assert_close(net.pos_embed, want_pos)
        for k, v in net.state_dict().items():
            if k != "pos_embed":
                assert torch.equal(v, state[k]), (spec, k)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        _model(f"model.backbone={VIT}", "model.pretrained=timm")
    assert "no weights of test_vit found locally" in str(e.value) and "model.pretrained_download=true" in str(e.value)
    assert "\n" not in str(e.value)
    # another architecture's weights through `dmltrain train`: one line, exit 2, before anything starts
    from shards.build.synthetic import build_synthetic_shards

    build_synthetic_shards(tmp_path / "shards", classes=4, per_class=4, image_size=32, seed=0, progress=False)
    safetensors.torch.save_file(timm.create_model(CONVNEXT).state_dict(), tmp_path / "convnext.safetensors")
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    capsys.readouterr()
    for bad, text in (
        ("convnext.safetensors", "convnext.safetensors does not fit backbone test_vit: 78 missing keys (cls_token,"),
        ("bad.pth", "bad.pth as a PyTorch state dict"),
    ):
        args = [
            *SMALL,
            f"model.backbone={VIT}",
            f"model.pretrained={tmp_path / bad}",
            f"data.shards={tmp_path / 'shards'}",
        ]
        args += ["data.batch_size=8", "cluster.num_workers=1", f"train.output_dir={tmp_path / 'runs'}"]
        assert main(["train", str(DEMO), *args]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dmltrain: error: model.pretrained") and text in err[0], err


def test_convnext_trains_evaluates_and_exports(tmp_path, one_process_group):
    """A timm ConvNeXt (channels_last, GeM over its last map and a middle stage, bf16 DeepSpeed engine, the sharded
    classifier) takes training steps, evaluates on shards with its own normalization, and its exported file
    rebuilds it offline with the same embeddings and input normalization."""
    from dmltrain.evaluate import evaluate_model
    from dmltrain.models import build_model, load_model, param_groups, save_model
    from dmltrain.training.engine import build_engine
    from dmltrain.training.head import LossHead
    from dmltrain.training.objective import Objective
    from shards.build.synthetic import build_synthetic_shards
    from shards.decode.device import DeviceInput

    shards = tmp_path / "shards"
    build_synthetic_shards(shards, classes=6, per_class=4, image_size=32, seed=0, progress=False)
    cfg = _cfg(
        f"model.backbone={CONVNEXT}",
        "model.features=patches",
        "model.pooling=gem",
        "model.multilevel=[stages.2,output]",
        "model.channels_last=true",
        "model.grad_checkpointing=true",
        "model.drop_path=0.1",
        "train.precision=bf16",
        "optim.name=adamw",
        "optim.lr=0.001",
        "optim.layer_decay=0.8",
        "data.batch_size=8",
        "data.eval_batch_size=16",
        "data.loader_workers=0",
        f"data.shards={shards}",
        "cluster.num_workers=1",
    )
    torch.manual_seed(0)
    model = build_model(cfg.model)
    engine, _ = build_engine(model, param_groups(model, cfg.optim), cfg, 1)
    objective = Objective(cfg, 6, model.embedding_dim, 1)
    head = LossHead(objective, cfg.optim)
    before = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    prepare = DeviceInput.from_config(cfg.data, "cpu", torch.bfloat16, channels_last=True)
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        images, labels = prepare(
            torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(8) % 6
        )
        assert images.is_contiguous(memory_format=torch.channels_last) and images.dtype == torch.bfloat16
        loss = objective(engine(images), labels, step=step)
        engine.backward(loss)
        engine.step()
        head.step()
        assert torch.isfinite(loss)
    assert any(not torch.equal(before[k], v.float()) for k, v in engine.module.state_dict().items())
    metrics, _ = evaluate_model(engine.module.eval(), str(shards), ["test"], cfg.eval, cfg.data, precision="fp32")
    assert 0 <= metrics["recall@1"] <= 1
    save_model(tmp_path / "model.pt", engine.module, cfg.to_dict(), state_dict=None)
    loaded, config, _ = load_model(tmp_path / "model.pt")
    assert loaded.input_spec == {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bicubic"}
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), engine.module.float()(x), rtol=1e-4, atol=1e-4)
