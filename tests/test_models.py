"""dmltrain.models: backbones, heads, options, pretrained weights, files, precision, sign bits.

The big torchvision networks are built once each and run at 64×64 on one
image; everything else uses the small CNN.
"""

from __future__ import annotations

import http.client
import http.server
import math
import socket
import threading
import urllib.error

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.models as tvm
from torch import nn

from dmltrain.config import Config, ModelConfig, OptimConfig
from dmltrain.errors import UserError
from dmltrain.models import (
    autocast,
    build_model,
    hamming_distances,
    load_model,
    pack_sign_bits,
    param_groups,
    save_model,
)
from dmltrain.models import pretrained as pretrained_mod
from dmltrain.models.backbones import build_backbone
from dmltrain.models.heads import BatchNormHead, GlobalPool, LayerNormHead, PlainHead, split_dim


def small(**kw) -> nn.Module:
    kw.setdefault("backbone", "small_cnn")
    kw.setdefault("embedding_dim", 64)
    return build_model(ModelConfig(**kw))


def one_line_user_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg.strip() == msg
    return msg


@pytest.fixture(scope="module")
def images64():
    torch.manual_seed(0)
    return torch.randn(1, 3, 64, 64)


@pytest.fixture(scope="module")
def images32():
    torch.manual_seed(1)
    return torch.randn(6, 3, 32, 32)


# -- backbones ----------------------------------------------------------------------------------
BIG = {
    "resnet18": (64, 128, 256, 512),
    "resnet34": (64, 128, 256, 512),
    "resnet50": (256, 512, 1024, 2048),
    "resnet101": (256, 512, 1024, 2048),
}


@pytest.mark.parametrize("name", list(BIG))
def test_resnet_stages_and_embedding(name, images64):
    model = build_model(ModelConfig(backbone=name, embedding_dim=64)).eval()
    bb = model.backbone
    assert bb.stage_names == ("layer1", "layer2", "layer3", "layer4")
    with torch.no_grad():
        maps = bb(images64, bb.stage_names)
        emb = model.head([maps[-1]])
    assert [m.shape[1] for m in maps] == list(BIG[name]) == list(bb.stage_channels.values())
    assert [m.shape[-1] for m in maps] == [16, 8, 4, 2]  # strides 4, 8, 16, 32
    assert emb.shape == (1, 64) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(1))
    # the backbone's keys are torchvision's without the classifier
    ref = set(getattr(tvm, name)(weights=None).state_dict()) if name == "resnet18" else None
    if ref is not None:
        assert set(bb.state_dict()) == {k for k in ref if not k.startswith("fc.")}


def test_googlenet_stages_multilevel_and_state_dict(images64):
    levels = ["inception3b", "inception4e", "inception5b"]  # RLL's L, M, H
    model = build_model(ModelConfig(backbone="googlenet", embedding_dim=512, multilevel=levels)).eval()
    assert model.backbone.input_transform is None  # only pretrained GoogLeNet expects transform_input
    with torch.no_grad():
        emb = model(images64)
    assert [model.backbone.stage_channels[s] for s in levels] == [480, 832, 1024]
    assert model.head.level_dims == [171, 171, 170] and emb.shape == (1, 512)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(1))
    # a torchvision GoogLeNet checkpoint (which has aux classifiers) loads: covered with keys here
    ref = tvm.googlenet(weights=None, aux_logits=True, init_weights=False).state_dict()
    assert set(model.backbone.state_dict()) == {k for k in ref if not k.startswith(("fc.", "aux1.", "aux2."))}


def test_small_cnn_sizes():
    model = small().eval()
    n = sum(p.numel() for p in model.backbone.parameters())
    assert 100_000 <= n <= 1_000_000
    assert model.backbone.stage_names == ("stage1", "stage2", "stage3", "stage4")
    with torch.no_grad():
        for size, side in ((32, 2), (224, 14)):
            maps = model.backbone(torch.randn(1, 3, size, size), model.backbone.stage_names)
            assert [m.shape[1] for m in maps] == list(model.backbone.stage_channels.values())
            assert maps[-1].shape[-1] == side


def test_small_cnn_downsamples_by_max_pooling():
    """Stride-1 convolutions only; each stage halves the size with a 2×2 max-pool, after stage 1's first
    convolution (raw pixels are never pooled) and before the convolutions of stages 2-4."""
    bb = build_backbone("small_cnn")
    convs = [m for m in bb.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 8 and all(c.stride == (1, 1) and c.kernel_size == (3, 3) for c in convs)
    for i, name in enumerate(bb.stage_names):
        kinds = [type(m).__name__ for m in getattr(bb, name)]
        assert kinds.count("MaxPool2d") == 1 and kinds.count("Conv2d") == 2
        assert kinds.index("MaxPool2d") == (3 if i == 0 else 0), kinds
    x = torch.randn(2, 3, 40, 24)
    with torch.no_grad():
        maps = bb.eval()(x, bb.stage_names)
        assert [tuple(m.shape[-2:]) for m in maps] == [(20, 12), (10, 6), (5, 3), (2, 1)]
        # stage 2 is exactly a max-pool of stage 1's output followed by its convolutions
        stage2 = bb.stage2
        assert torch.equal(stage2[1:](torch.nn.functional.max_pool2d(maps[0], 2)), maps[1])


def test_unknown_names_are_one_line_user_errors():
    with pytest.raises(UserError) as e:
        build_model(ModelConfig(backbone="resnet9000"))
    assert "model.backbone" in one_line_user_error(e) and "resnet9000" in str(e.value)
    with pytest.raises(UserError) as e:
        small(multilevel=["stage2", "layer4"])
    msg = one_line_user_error(e)
    assert "model.multilevel" in msg and "'layer4'" in msg and "stage1" in msg


def test_global_pool():
    x = torch.randn(3, 5, 4, 6)
    torch.testing.assert_close(GlobalPool("avg")(x), x.flatten(2).mean(-1))
    torch.testing.assert_close(GlobalPool("max")(x), x.flatten(2).max(-1).values)
    torch.testing.assert_close(GlobalPool("avgmax")(x), 0.5 * (x.flatten(2).mean(-1) + x.flatten(2).max(-1).values))


# -- heads --------------------------------------------------------------------------------------------
def test_layernorm_head_matches_per_sample_reference():
    torch.manual_seed(0)
    head = LayerNormHead([6], 4).double()
    assert all(not n.elementwise_affine and n.weight is None and n.bias is None for n in head.norms)
    assert head.proj[0].bias is None and [n for n, _ in head.named_parameters()] == ["proj.0.weight"]
    fmap = torch.randn(3, 6, 2, 2, dtype=torch.float64)
    out = head([fmap])
    W = head.proj[0].weight
    for b in range(3):  # the paper's pipeline, one image at a time
        pooled = [sum(float(fmap[b, c, i, j]) for i in range(2) for j in range(2)) / 4 for c in range(6)]
        mu = sum(pooled) / 6
        var = sum((p - mu) ** 2 for p in pooled) / 6
        normed = torch.tensor([(p - mu) / math.sqrt(var + 1e-5) for p in pooled], dtype=torch.float64)
        z = W @ normed
        torch.testing.assert_close(out[b], z / z.norm())
    # gradients of the whole head, float64
    fmap.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda f: head([f]), (fmap,))
    weight = head.proj[0].weight.detach().clone().requires_grad_(True)
    call = lambda w: torch.func.functional_call(head, {"proj.0.weight": w}, ([fmap.detach()],))  # noqa: E731
    assert torch.autograd.gradcheck(call, (weight,))


def test_batchnorm_and_plain_heads():
    torch.manual_seed(0)
    bn = BatchNormHead([16], 10)
    assert not bn.bn.affine and bn.bn.weight is None and bn.proj[0].bias is None
    assert not bn.normalized and bn.centred
    out = bn([torch.randn(32, 16, 2, 2) * 3 + 1])  # train mode: batch statistics
    torch.testing.assert_close(out.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(0, unbiased=False), torch.ones(10), atol=1e-3, rtol=0)
    plain = PlainHead([16], 10)
    assert plain.proj[0].bias is not None and not plain.normalized and plain.centred
    for head in (BatchNormHead([4, 3], 6).double(), PlainHead([4, 3], 6).double()):  # two levels, float64 gradients
        maps = (torch.randn(5, 4, 2, 2, dtype=torch.float64, requires_grad=True),
                torch.randn(5, 3, 1, 1, dtype=torch.float64, requires_grad=True))  # fmt: skip
        assert torch.autograd.gradcheck(lambda a, b, head=head: head([a, b]), maps)
    unprojected = PlainHead([16], None)
    assert unprojected.embedding_dim == 16 and not unprojected.centred and not list(unprojected.parameters())


def test_model_flags_per_head(images32):
    for head, normalized in (("layernorm", True), ("batchnorm", False), ("none", False)):
        model = small(head=head, embedding_dim=96, dropout=0.5)
        emb = model(images32)
        assert model.normalized is normalized and model.embedding_dim == 96 and emb.shape == (6, 96)
        assert model.classifier_dropout == 0.5
        if normalized:
            torch.testing.assert_close(emb.norm(dim=1), torch.ones(6))
        else:
            assert not torch.allclose(emb.norm(dim=1), torch.ones(6), atol=1e-2)
    unprojected = small(head="layernorm", embedding_dim=None)
    assert unprojected.embedding_dim == 192 and unprojected.head.proj is None
    torch.testing.assert_close(unprojected(images32).norm(dim=1), torch.ones(6))


def test_multilevel_split_and_levels(images32):
    assert split_dim(512, 3) == [171, 171, 170] and split_dim(100, 3) == [34, 33, 33] and split_dim(64, 1) == [64]
    stages = ["stage2", "stage3", "stage4"]
    model = small(embedding_dim=100, multilevel=stages)
    assert model.head.in_channels == (64, 128, 192)
    assert [p.in_features for p in model.head.proj] == [64, 128, 192]
    assert [p.out_features for p in model.head.proj] == [34, 33, 33]
    emb = model(images32)
    levels = model.forward_levels(images32)
    assert emb.shape == (6, 100) and [t.shape[1] for t in levels] == [34, 33, 33]
    for part in levels:  # each level unit norm, the whole unit norm, cosine = mean of levels' cosines
        torch.testing.assert_close(part.norm(dim=1), torch.ones(6))
    torch.testing.assert_close(emb, torch.cat(levels, 1) / math.sqrt(3))
    cos = emb @ emb.T
    torch.testing.assert_close(cos, sum(p @ p.T for p in levels) / 3)
    # the levels are really the stages: changing the stage2 projection changes only the first part
    with torch.no_grad():
        model.head.proj[0].weight.mul_(-1)
    flipped = model.forward_levels(images32)
    torch.testing.assert_close(flipped[0], -levels[0])
    torch.testing.assert_close(flipped[2], levels[2])
    # unprojected and batchnorm multi-level
    assert small(embedding_dim=None, multilevel=stages).embedding_dim == 64 + 128 + 192
    bn = small(head="batchnorm", embedding_dim=96, multilevel=["stage3", "stage4"])
    assert bn(images32).shape == (6, 96) and bn.head.bn.num_features == 96


# -- training options -------------------------------------------------------------------------------
def _groups_by_name(groups):
    return {g["name"]: g for g in groups}


def test_param_groups():
    model = small(head="none", embedding_dim=64)
    model.backbone.stage1[0].weight.requires_grad_(False)  # a frozen parameter belongs to no group
    classifier = nn.Linear(64, 10)  # a new module from the trainer (e.g. a classifier)
    cfg = OptimConfig(weight_decay=5e-4, decay_norm_and_bias=False, new_param_lr_mult=10.0)
    groups = param_groups(model, cfg, extra_new=[classifier])
    by = _groups_by_name(groups)
    assert set(by) == {"backbone", "backbone_no_decay", "head", "head_no_decay"}
    ids = [id(p) for g in groups for p in g["params"]]
    trainable = [p for p in list(model.parameters()) + list(classifier.parameters()) if p.requires_grad]
    assert len(ids) == len(set(ids)) == len(trainable) and set(ids) == {id(p) for p in trainable}
    named_bb = dict(model.backbone.named_parameters())
    no_decay_names = {n for n, p in named_bb.items() if any(p is q for q in by["backbone_no_decay"]["params"])}
    bn_param = lambda n: isinstance(model.backbone.get_submodule(n.rpartition(".")[0]), nn.BatchNorm2d)  # noqa: E731
    assert no_decay_names and all(n.endswith("bias") or bn_param(n) for n in no_decay_names)  # BN slots
    assert all(p.ndim == 4 for p in by["backbone"]["params"])  # only conv weights decayed
    assert {id(p) for p in by["head_no_decay"]["params"]} == {id(model.head.proj[0].bias), id(classifier.bias)}
    assert by["backbone"]["weight_decay"] == 5e-4 and by["backbone_no_decay"]["weight_decay"] == 0.0
    assert by["head"]["lr_mult"] == 10.0 and by["head_no_decay"]["lr_mult"] == 10.0 and by["backbone"]["lr_mult"] == 1.0
    torch.optim.SGD(groups, lr=0.1, momentum=0.9)  # a valid optimizer spec
    # decay everything: two groups; a bias-free layernorm head has no no-decay group anyway
    both = _groups_by_name(param_groups(small(), OptimConfig(weight_decay=1e-4, decay_norm_and_bias=True)))
    assert set(both) == {"backbone", "head"} and both["head"]["weight_decay"] == 1e-4
    ln = _groups_by_name(param_groups(small(), OptimConfig(decay_norm_and_bias=False)))
    assert set(ln) == {"backbone", "backbone_no_decay", "head"}


def _bn_layers(module):
    return [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]


def test_freeze_bn_keeps_statistics(images32):
    for freeze in (True, False):
        torch.manual_seed(0)
        model = small(head="batchnorm", freeze_bn=freeze)
        model.eval()
        model.train()  # train() after eval() must re-freeze
        before = [(m.running_mean.clone(), m.running_var.clone()) for m in _bn_layers(model.backbone)]
        head_before = model.head.bn.running_mean.clone()
        model(images32 * 2 + 1).sum().backward()
        after = [(m.running_mean, m.running_var) for m in _bn_layers(model.backbone)]
        same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
        assert same is freeze
        assert all(m.training is not freeze for m in _bn_layers(model.backbone))
        assert not torch.equal(model.head.bn.running_mean, head_before)  # the new head's BN always learns
        # decision: frozen statistics, trainable affine parameters
        assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in _bn_layers(model.backbone))


def test_backbone_warmup_trains_only_new_parameters(images32):
    model = small()
    model.set_backbone_trainable(False)
    model(images32).sum().backward()
    assert all(p.grad is None for p in model.pretrained_parameters())
    assert all(p.grad is not None for p in model.new_parameters())
    model.set_backbone_trainable(True)
    model(images32).pow(2).sum().backward()
    assert all(p.grad is not None for p in model.pretrained_parameters())
    assert {id(p) for p in model.new_parameters()} | {id(p) for p in model.pretrained_parameters()} == {
        id(p) for p in model.parameters()
    }


def test_channels_last_same_outputs(images32):
    torch.manual_seed(0)
    plain = small().eval()
    cl = small(channels_last=True).eval()
    cl.load_state_dict(plain.state_dict())
    conv = cl.backbone.stage1[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    with torch.no_grad():
        torch.testing.assert_close(cl(images32), plain(images32), atol=1e-5, rtol=1e-4)


def test_autocast_bf16_finite_and_close(images32):
    torch.manual_seed(0)
    images = images32[:4, :, :16, :16]
    for head in ("layernorm", "batchnorm"):
        model = small(head=head, multilevel=["stage3", "stage4"])
        ref = model(images)
        with autocast("cpu", "bf16"):
            emb = model(images)
        assert emb.dtype == torch.float32 and torch.isfinite(emb).all()
        assert F.cosine_similarity(emb, ref.detach()).min() > 0.99
        emb.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    bf16_model = small().to(torch.bfloat16).eval()  # bf16 weights (DeepSpeed bf16) take float32 images
    out = bf16_model(images)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    with autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(UserError):
        autocast("cpu", "fp8")


# -- sign bits -----------------------------------------------------------------------------------------
def test_binarize(images32):
    model = small(embedding_dim=100).eval()
    codes = model.binarize(images32)
    emb = model(images32).detach()
    assert codes.dtype == np.uint8 and codes.shape == (6, 13)
    bits = np.unpackbits(codes, axis=1)
    assert (bits[:, :100] == (emb > 0).numpy()).all() and not bits[:, 100:].any()
    np.testing.assert_array_equal(codes, pack_sign_bits(emb))
    expected = ((emb[:, None, :] > 0) != (emb[None, :, :] > 0)).sum(-1).numpy()
    np.testing.assert_array_equal(hamming_distances(codes, codes), expected)
    # the centred LayerNorm head gives balanced bits: neither all ones nor all zeros
    assert 0.2 < bits[:, :100].mean() < 0.8
    with pytest.raises(ValueError, match="sign bits"):
        small(head="none", embedding_dim=None).binarize(images32)


# -- pretrained weights ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet18_file(tmp_path_factory):
    torch.manual_seed(3)
    state = tvm.resnet18(weights=None).state_dict()  # random weights, torchvision key layout with fc
    path = tmp_path_factory.mktemp("weights") / "resnet18-random.pth"
    torch.save(state, path)
    return path, state


def test_pretrained_local_file_round_trip(resnet18_file, tmp_path):
    path, state = resnet18_file
    model = build_model(ModelConfig(backbone="resnet18", pretrained=str(path)))
    own = model.backbone.state_dict()
    assert all(torch.equal(own[k], state[k]) for k in own)
    fresh = build_model(ModelConfig(backbone="resnet18"))
    assert not torch.equal(fresh.backbone.conv1.weight, state["conv1.weight"])
    # a wrapped checkpoint with DataParallel prefixes loads the same
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, wrapped)
    pretrained_mod.load_pretrained(fresh.backbone, str(wrapped))
    assert torch.equal(fresh.backbone.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])


def test_pretrained_file_errors(resnet18_file, tmp_path):
    path, state = resnet18_file
    backbone34 = build_backbone("resnet34")
    with pytest.raises(UserError) as e:
        pretrained_mod.load_pretrained(backbone34, str(path))
    msg = one_line_user_error(e)
    assert str(path) in msg and "resnet34" in msg and "missing keys" in msg
    small_bb = build_backbone("small_cnn")
    bad_shape = {k: torch.zeros(3, *v.shape[1:]) if v.ndim == 4 else v for k, v in small_bb.state_dict().items()}
    torch.save(bad_shape, tmp_path / "shapes.pth")
    with pytest.raises(UserError) as e:
        pretrained_mod.load_pretrained(small_bb, str(tmp_path / "shapes.pth"))
    assert "shape mismatches" in one_line_user_error(e) and "stage1.0.weight" in str(e.value)
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint at all")
    for bad, words in ((tmp_path / "garbage.pth", "cannot read"), (tmp_path / "absent.pth", "not found")):
        with pytest.raises(UserError) as e:
            build_model(ModelConfig(backbone="small_cnn", pretrained=str(bad)))
        assert str(bad) in one_line_user_error(e) and words in str(e.value)


def test_googlenet_pretrained_file_with_aux_classifiers(tmp_path):
    state = tvm.googlenet(weights=None, aux_logits=True, init_weights=False).state_dict()
    torch.save(state, tmp_path / "googlenet.pth")
    model = build_model(ModelConfig(backbone="googlenet", pretrained=str(tmp_path / "googlenet.pth")))
    assert torch.equal(model.backbone.inception5b.branch4[1].conv.weight, state["inception5b.branch4.1.conv.weight"])
    assert model.backbone.input_transform is not None  # as torchvision does for its pretrained GoogLeNet


class _FakeWeights:
    def __init__(self, url: str) -> None:
        self.url = url


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the with block ends: connecting is refused


def test_imagenet_offline_one_line_error(monkeypatch, tmp_path, resnet18_file):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(pretrained_mod, "DOWNLOAD_TIMEOUT_S", 3.0)
    # 1) a real download attempt that cannot connect
    url = f"http://127.0.0.1:{_closed_port()}/resnet18-f37072fd.pth"
    monkeypatch.setattr(pretrained_mod, "imagenet_weights", lambda name: _FakeWeights(url))
    with pytest.raises(UserError) as e:
        build_model(ModelConfig(backbone="resnet18", pretrained="imagenet"))
    msg = one_line_user_error(e)
    assert "model.pretrained=/path/to/resnet18-f37072fd.pth" in msg and url in msg
    # 2) the real torchvision URL with name resolution failing (no network), never hanging
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(pretrained_mod.urllib.request, "urlopen", offline)
    with pytest.raises(UserError) as e:
        build_model(ModelConfig(backbone="resnet18", pretrained="imagenet"))
    msg = one_line_user_error(e)
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in msg and "name resolution" in msg
    assert not list((tmp_path / "torch").rglob("*.pth")) and not list((tmp_path / "torch").rglob("*.tmp"))
    # 3) the file already in the torch hub cache: used without any network
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    path, state = resnet18_file
    (cache / "resnet18-f37072fd.pth").write_bytes(path.read_bytes())
    model = build_model(ModelConfig(backbone="resnet18", pretrained="imagenet"))
    assert torch.equal(model.backbone.conv1.weight, state["conv1.weight"])
    with pytest.raises(UserError, match="small_cnn has no ImageNet weights"):
        small(pretrained="imagenet")


class _TruncatingHandler(http.server.BaseHTTPRequestHandler):
    """Serves a body that stops early: ``/short/*`` promises more bytes than it sends, ``/chunked/*``
    breaks off inside a chunk; ``/cut/*`` sends part of the promised body and then stops (for
    a client read that raises mid-stream)."""

    def do_GET(self):
        self.send_response(200)
        if self.path.startswith("/chunked/"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"4000\r\n" + b"x" * 1000)
        else:
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"x" * 3000)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def truncating_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TruncatingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_imagenet_partial_download_one_line_error_and_no_file(monkeypatch, tmp_path, truncating_server):
    """A download that breaks off (short body, broken chunked body, IncompleteRead mid-stream) is
    the same one-line error as no network, and leaves nothing in the torch hub cache."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(pretrained_mod, "DOWNLOAD_TIMEOUT_S", 5.0)
    for route in ("short", "chunked"):
        url = f"{truncating_server}/{route}/resnet18-f37072fd.pth"
        monkeypatch.setattr(pretrained_mod, "imagenet_weights", lambda name, url=url: _FakeWeights(url))
        with pytest.raises(UserError) as e:
            build_model(ModelConfig(backbone="resnet18", pretrained="imagenet"))
        msg = one_line_user_error(e)
        assert url in msg and "model.pretrained=/path/to/resnet18-f37072fd.pth" in msg, msg
        assert ("3000 of 100000 bytes" in msg) if route == "short" else ("IncompleteRead" in msg), msg
        assert not [p for p in (tmp_path / "torch").rglob("*") if p.is_file()]

    class Broken:  # what urlopen returns when the peer resets the stream inside a read
        headers = {"Content-Length": "100"}

        def __init__(self):
            self.calls = 0

        def read(self, n):
            self.calls += 1
            if self.calls == 1:
                return b"y" * 10
            raise http.client.IncompleteRead(b"y" * 5, 85)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(
        pretrained_mod, "imagenet_weights", lambda name: _FakeWeights("http://example.invalid/resnet18-f37072fd.pth")
    )
    monkeypatch.setattr(pretrained_mod.urllib.request, "urlopen", lambda *a, **k: Broken())
    with pytest.raises(UserError) as e:
        build_model(ModelConfig(backbone="resnet18", pretrained="imagenet"))
    assert "IncompleteRead(5 bytes read, 85 more expected)" in one_line_user_error(e)
    assert not [p for p in (tmp_path / "torch").rglob("*") if p.is_file()]


# -- saving and loading -------------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path, images32):
    torch.manual_seed(0)
    cfg = Config(
        model=ModelConfig(backbone="small_cnn", embedding_dim=80, head="batchnorm", multilevel=["stage3", "stage4"])
    )
    model = build_model(cfg.model)
    model(images32 * 3).sum().backward()  # move the BN statistics away from their initial values
    model.eval()
    with torch.no_grad():
        expected = model(images32)
    path = tmp_path / "out" / "model.pt"
    save_model(path, model, cfg.to_dict(), {"recall@1": np.float32(0.5), "step": 7, "ks": (1, 2)})
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # nothing temporary left
    loaded, config, extra = load_model(path)
    assert not loaded.training and loaded.embedding_dim == 80 and loaded.stages == ("stage3", "stage4")
    assert config == cfg.to_dict() and extra == {"recall@1": 0.5, "step": 7, "ks": [1, 2]}
    with torch.no_grad():
        torch.testing.assert_close(loaded(images32), expected, rtol=0, atol=0)


def test_load_model_does_not_read_pretrained_weights(tmp_path, images32):
    small_state = build_backbone("small_cnn").state_dict()
    weights = tmp_path / "init.pth"
    torch.save(small_state, weights)
    model = build_model(ModelConfig(backbone="small_cnn", pretrained=str(weights))).eval()
    save_model(tmp_path / "m.pt", model, {"model": model.config})
    weights.unlink()  # gone: loading must not need it
    # weights given separately (as gathered from ZeRO partitions) are the ones stored
    other = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    save_model(tmp_path / "other.pt", model, {"model": model.config}, state_dict=other)
    assert torch.equal(load_model(tmp_path / "other.pt")[0].head.proj[0].weight, other["head.proj.0.weight"])
    loaded, _, extra = load_model(tmp_path / "m.pt")
    assert extra == {}
    with torch.no_grad():
        torch.testing.assert_close(loaded(images32), model(images32), rtol=0, atol=0)
    # a dmltrain model file is itself a valid pretrained source (its backbone part)
    again = build_model(ModelConfig(backbone="small_cnn", pretrained=str(tmp_path / "m.pt")))
    assert torch.equal(again.backbone.stage4[1].weight, model.backbone.stage4[1].weight)


def test_load_model_errors(tmp_path):
    with pytest.raises(UserError) as e:
        load_model(tmp_path / "nope.pt")
    assert "nope.pt" in one_line_user_error(e) and "not found" in str(e.value)
    (tmp_path / "junk.pt").write_bytes(b"\x00" * 64)
    with pytest.raises(UserError) as e:
        load_model(tmp_path / "junk.pt")
    assert "junk.pt" in one_line_user_error(e)
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not a dmltrain model file"):
        load_model(tmp_path / "other.pt")
    # a file whose stored model config this version no longer accepts: the file and the key
    good = tmp_path / "good.pt"
    save_model(good, small(), {})
    payload = torch.load(good, weights_only=True)
    for change, key in (
        ({"pooling": "median"}, "model.pooling"),
        ({"removed_option": 1}, "model.removed_option"),
        ({"backbone": "vit"}, "model.backbone"),
    ):
        torch.save({**payload, "model_config": {**payload["model_config"], **change}}, tmp_path / "stale.pt")
        with pytest.raises(UserError) as e:
            load_model(tmp_path / "stale.pt")
        msg = one_line_user_error(e)
        assert msg.startswith(f"{tmp_path / 'stale.pt'}: stored model config") and f"{key}:" in msg, msg
    with pytest.raises(ValueError, match="state_dict keys"):
        save_model(tmp_path / "x.pt", small(), {}, state_dict={"stage1.0.weight": torch.zeros(1)})
    with pytest.raises(TypeError, match="extra"):
        save_model(tmp_path / "x.pt", small(), {}, {"bad": object()})
    assert not (tmp_path / "x.pt").exists()


# -- end to end ------------------------------------------------------------------------------------------------
def test_small_cnn_learns_with_param_groups():
    """The small CNN, its groups and lr multipliers train a normalised-softmax classifier: the loss falls."""
    torch.manual_seed(0)
    classes, per_class = 6, 4
    labels = torch.arange(classes).repeat_interleave(per_class)
    prototypes = torch.randn(classes, 3, 1, 1) * 2  # each class a colour plus noise
    images = prototypes[labels] + 0.5 * torch.randn(len(labels), 3, 16, 16)
    model = build_model({"backbone": "small_cnn", "embedding_dim": 64})  # a plain dict config works too
    proxies = nn.Linear(64, classes, bias=False)
    groups = param_groups(model, OptimConfig(new_param_lr_mult=10.0), extra_new=[proxies])
    for g in groups:
        g["lr"] = 0.003 * g["lr_mult"]
    opt = torch.optim.SGD(groups, lr=0.003, momentum=0.9)
    losses = []
    for _ in range(5):
        logits = model(images) @ F.normalize(proxies.weight, dim=1).T / 0.05
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.25 * losses[0]
