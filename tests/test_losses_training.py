"""Every registered loss, built from a config, trains the small CNN on synthetic images: the
loss falls over a few steps (a fixed P×K batch of learnable class patterns)."""

from __future__ import annotations

import pytest
import torch

from dmltrain.config import load_config
from dmltrain.losses import loss_names, make_loss
from dmltrain.losses.kinds import CLASSIFIER_KINDS

# losses defined on raw embeddings train the BatchNorm (CE paper) head; the others the NormSoftmax head
RAW_EMBEDDING_LOSSES = {"softmax_ce", "npair", "spce", "center"}
P, K, SIZE, STEPS = 4, 4, 16, 6


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny convolutions: a second thread only adds contention on a shared 2-core machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(P, 3, SIZE, SIZE, generator=g)
    labels = torch.arange(P).repeat_interleave(K)
    x = patterns[labels] + 0.5 * torch.randn(P * K, 3, SIZE, SIZE, generator=g)
    return x, labels


@pytest.mark.parametrize("name", sorted(loss_names()))
def test_loss_trains_the_small_cnn(name, images):
    from dmltrain.models import build_model

    part = "classifier" if name in CLASSIFIER_KINDS else "instance"
    head = "batchnorm" if name in RAW_EMBEDDING_LOSSES else "layernorm"
    overrides = [f"loss.{part}.kind={name}", "model.backbone=small_cnn", "model.embedding_dim=64", f"model.head={head}"]
    if part == "instance":
        overrides.append("loss.classifier=null")
    cfg = load_config(None, overrides)
    section = getattr(cfg.loss, part)

    torch.manual_seed(0)
    model = build_model(cfg.model)
    loss = make_loss(section.kind, section.params, num_classes=P, dim=cfg.model.embedding_dim)
    opt = torch.optim.Adam([{"params": model.parameters()}, {"params": loss.parameters(), "lr": 1e-2}], lr=1e-3)
    x, y = images
    history = []
    for _ in range(STEPS):
        value = loss(model(x), y)
        opt.zero_grad()
        value.backward()
        opt.step()
        history.append(float(value.detach()))
    assert all(torch.isfinite(torch.tensor(history)))
    assert history[-1] < history[0], f"{name}: loss did not fall: {history}"
    assert sum(history[-2:]) < sum(history[:2]), f"{name}: {history}"
