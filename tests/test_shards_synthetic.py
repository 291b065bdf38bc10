"""The synthetic layout is learnable: a tiny CNN trained briefly on its train classes retrieves
unseen test classes clearly better than the same network untrained."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shards.build.synthetic import build_synthetic_shards, class_parts, render
from shards.config import AugmentConfig
from shards.manifest import Manifest
from shards.read.stream import TrainStream, eval_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CLASSES, PER_CLASS, SIZE = 40, 10, 32


class TinyCNN(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        layers, c = [], 3
        for width in (16, 32, 64):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
            c = width
        self.features = nn.Sequential(*layers[:-1], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def recall_at_1(model: nn.Module, shard_dir) -> float:
    model.eval()
    embs, labels = [], []
    with torch.no_grad():
        for images, y, _ in eval_batches(
            shard_dir, "test", rank=0, world_size=1, batch_size=200, resize=36, crop=SIZE, loader_workers=0
        ):
            embs.append(F.normalize(model(images), dim=1))
            labels.append(y)
    e, y = torch.cat(embs), torch.cat(labels)
    sim = e @ e.T
    sim.fill_diagonal_(-float("inf"))  # the query itself is excluded
    return (y[sim.argmax(1)] == y).float().mean().item()


def test_images_are_pure_functions_of_their_ids():
    a, b = render(3, 5, 1, 24), render(3, 5, 1, 24)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(render(3, 5, 2, 24)))
    assert [p.shape for p in class_parts(3, 5)] == [p.shape for p in class_parts(3, 5)]


def test_synthetic_is_learnable(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "synthetic"
    build_synthetic_shards(out, CLASSES, PER_CLASS, SIZE, seed=1, shard_size=100, workers=1, progress=False)
    m = Manifest.load(out)
    assert not set(m.split("train").classes) & set(m.split("test").classes)
    model = TinyCNN()
    untrained = recall_at_1(model, out)
    classifier = nn.Linear(64, CLASSES)
    opt = torch.optim.Adam([*model.parameters(), *classifier.parameters()], lr=3e-3)
    ts = TrainStream(
        out,
        rank=0,
        world_size=1,
        sampler="pk",
        batch_size=64,
        samples_per_class=4,
        seed=0,
        image_size=SIZE,
        augment=AugmentConfig(scale=(0.5, 1.0)),
        loader_workers=1,
    )
    steps, t0, epoch = 0, time.perf_counter(), 0
    while steps < 80:
        for images, labels in ts.epoch(epoch):
            model.train()
            loss = F.cross_entropy(classifier(model(images)), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        epoch += 1
    trained = recall_at_1(model, out)
    print(
        f"synthetic R@1: untrained {untrained:.3f}, trained {trained:.3f} after {steps} steps ({time.perf_counter() - t0:.1f}s)"
    )
    assert trained > untrained + 0.2 and trained > 2 * untrained, (untrained, trained)
