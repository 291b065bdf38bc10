"""The epoch plan (P×K and random) from the manifest alone, and the batch-shape checks the config shares."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from shard_fixtures import K, P, make_shards

from dmltrain.config import build_config
from dmltrain.errors import ConfigError
from shards.manifest import Manifest
from shards.read.sampler import EpochPlanner, batch_shape, group_pieces, pieces_per_group


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("sampler") / "shards")


def test_group_pieces():
    rng = np.random.default_rng(0)
    assert pieces_per_group(np.array([1, 2, 4, 5, 7, 8, 25]), 3).tolist() == [1, 1, 1, 2, 2, 3, 8]
    (piece,) = group_pieces(2, 3, 1, rng)  # fewer than K: all images, topped up with replacement
    assert len(piece) == 3 and set(piece) == {0, 1}
    pieces = group_pieces(7, 3, 2, rng)  # 7 -> two disjoint pieces, one image left out
    assert len(set(pieces[0]) | set(pieces[1])) == 6
    pieces = group_pieces(8, 3, 3, rng)  # 8 -> three pieces: the last topped up from the others
    assert len(set(sum(pieces, ()))) == 8 and all(len(set(p)) == 3 for p in pieces)
    assert sorted(p[0] for p in group_pieces(5, 1, 5, rng)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_pk_plan_properties(shard_dir, world_size):
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    per = P // world_size
    planner = EpochPlanner(
        table, world_size=world_size, k=K, pieces_per_batch=per, seed=5, class_balanced=True, window_batches=3
    )
    windows = max(1, planner.batches_per_epoch // 3)
    total = int(pieces_per_group(table.count, K).sum())
    assert planner.batches_per_epoch == total // P
    seen = []
    for rank in range(world_size):
        batches = list(planner.batches(0, rank))
        assert [b for b, _ in batches] == list(range(planner.batches_per_epoch))
        window_of = [min(b // 3, windows - 1) for b, _ in batches]
        for b, pieces in batches:
            assert len(pieces) == per and all(len(p.positions) == K for p in pieces)
            # distinct classes, unless a class has more pieces in the window than the window has batches
            in_window = Counter(p.label for (c, ps) in batches if window_of[c] == window_of[b] for p in ps)
            n_batches = window_of.count(window_of[b])
            for label, n in Counter(p.label for p in pieces).items():
                assert n == 1 or in_window[label] > n_batches, (b, label, n, in_window[label], n_batches)
            for p in pieces:
                assert p.label == table.label[p.group] and all(0 <= q < table.count[p.group] for q in p.positions)
        seen += [(p.group, q) for _, pieces in batches for p in pieces for q in p.positions]
    m = pieces_per_group(table.count, K)
    repeats = Counter(g for (g, q), n in Counter(seen).items() for _ in range(n - 1))
    for g, n in repeats.items():  # only groups too small for their pieces repeat images (the top-ups)
        assert n <= m[g] * K - table.count[g], (g, n)
    covered = len({(g, q) for g, q in seen if table.count[g] >= K}) / int(table.count[table.count >= K].sum())
    assert covered > 0.8, covered
    again = [[(p.group, p.positions) for p in ps] for _, ps in planner.batches(0, 0)]
    assert again == [[(p.group, p.positions) for p in ps] for _, ps in planner.batches(0, 0)]
    assert again != [[(p.group, p.positions) for p in ps] for _, ps in planner.batches(1, 0)]


def test_random_plan_covers_each_image_once(shard_dir):
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    planner = EpochPlanner(table, world_size=3, k=1, pieces_per_batch=5, seed=1, class_balanced=False, window_batches=2)
    n = int(table.count.sum())
    assert planner.batches_per_epoch == n // 15
    seen = [(p.group, p.positions[0]) for r in range(3) for _, ps in planner.batches(2, r) for p in ps]
    assert len(seen) == len(set(seen)) == planner.batches_per_epoch * 15


def test_batch_shape_is_the_config_check():
    """One check, two callers: the stream's error is the config's one-line message, naming the key."""
    shape = batch_shape("pk", 64, 4, 2)
    assert (shape.pieces_per_rank, shape.local_batch_size, shape.k, shape.class_balanced) == (8, 32, 4, True)
    shape = batch_shape("random", 64, 4, 2)
    assert (shape.pieces_per_rank, shape.local_batch_size, shape.k, shape.class_balanced) == (32, 32, 1, False)
    cases = [
        (("pk", 30, 4, 1, None), "data.batch_size: 30 is not divisible into P×K with K = data.samples_per_class = 4"),
        (("pk", 64, 4, 1, 10), "data.classes_per_batch: 10 × samples_per_class 4 != data.batch_size 64"),
        (
            ("pk", 64, 4, 3, None),
            "data.classes_per_batch: P = 16 classes cannot be split evenly over cluster.num_workers = 3",
        ),
        (("random", 64, 4, 3, None), "data.batch_size: 64 is not divisible by cluster.num_workers = 3"),
        (("other", 64, 4, 1, None), "data.sampler: 'other' is not 'pk' or 'random'"),
    ]
    for (sampler, b, k, w, p), text in cases:
        with pytest.raises(ValueError) as e:
            batch_shape(sampler, b, k, w, p)
        assert str(e.value).startswith(text)
        if sampler != "other":
            data = {"sampler": sampler, "batch_size": b, "samples_per_class": k, "classes_per_batch": p}
            with pytest.raises(ConfigError) as c:
                build_config({"data": data, "cluster": {"num_workers": w}})
            assert text in str(c.value) and "\n" not in str(c.value)
