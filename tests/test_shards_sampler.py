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


def _global_steps(planner, epoch, world_size, accum):
    """Every step's pieces as the ranks take them, put back in step order: micro-batch by micro-batch, rank by rank."""
    per_rank = [list(planner.batches(epoch, rank=r, world_size=world_size, accum=accum)) for r in range(world_size)]
    steps = []
    for s in range(planner.steps_per_epoch):
        pieces = []
        for j in range(accum):
            for r in range(world_size):
                mb = per_rank[r][s * accum + j]
                assert (mb.index, mb.step) == (s * accum + j, s)
                assert mb.first_slot == len(pieces) * planner.k, "a micro-batch's place among the step's images"
                pieces += mb.pieces
        steps.append(pieces)
    return steps


def _ids(steps):
    return [[(p.group, p.positions) for p in pieces] for pieces in steps]


@pytest.mark.parametrize("lanes", [P, 2 * P])
def test_pk_plan_properties_and_independence_of_the_worker_count(shard_dir, lanes):
    """A step's global batch is the same whichever workers take it, in whichever micro-batches: so a run
    resumed at another worker count continues the same steps."""
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    planner = EpochPlanner(table, k=K, pieces_per_step=lanes, seed=5, window_steps=2)
    total = int(pieces_per_group(table.count, K).sum())
    assert planner.steps_per_epoch == total // lanes > 1
    ref = _global_steps(planner, 0, 1, 1)
    for world, accum in [(2, 1), (3, 1), (1, 2), (2, 3), (3, 2), (6, 1), (1, 6)][: 7 if lanes == P else 4]:
        assert _ids(_global_steps(planner, 0, world, accum)) == _ids(ref), (world, accum)
    pieces_of = Counter(
        int(table.label[g])
        for g in range(len(table))
        for _ in range(int(pieces_per_group(table.count[g : g + 1], K)[0]))
    )
    seen = []
    for pieces in ref:
        assert len(pieces) == lanes and all(len(p.positions) == K for p in pieces)
        for label, n in Counter(p.label for p in pieces).items():  # a class repeats only if it has pieces in two lanes
            assert n == 1 or pieces_of[label] >= n, (label, n)
        for p in pieces:
            assert p.label == table.label[p.group] and all(0 <= q < table.count[p.group] for q in p.positions)
        seen += [(p.group, q) for p in pieces for q in p.positions]
    m = pieces_per_group(table.count, K)
    repeats = Counter(g for (g, q), n in Counter(seen).items() for _ in range(n - 1))
    for g, n in repeats.items():  # only groups too small for their pieces repeat images (the top-ups)
        assert n <= m[g] * K - table.count[g], (g, n)
    covered = len({(g, q) for g, q in seen if table.count[g] >= K}) / int(table.count[table.count >= K].sum())
    assert covered > 0.8 * planner.steps_per_epoch * lanes / total, covered  # the pieces past the last step are dropped
    # resumed from a micro-batch: the rest of the same epoch
    tail = list(planner.batches(0, rank=1, world_size=2, accum=1, start=3))
    assert [mb.index for mb in tail] == list(range(3, planner.steps_per_epoch))
    assert _ids([mb.pieces for mb in tail]) == _ids([s[lanes // 2 :] for s in ref[3:]])
    assert _ids(_global_steps(planner, 0, 1, 1)) == _ids(ref), "a pure function of (seed, epoch, step)"
    assert _ids(_global_steps(planner, 1, 1, 1)) != _ids(ref)
    with pytest.raises(ValueError, match="equal parts"):
        next(planner.batches(0, rank=0, world_size=5, accum=1))


def test_a_rank_reads_its_own_stretches_of_the_shards(shard_dir):
    """Each rank takes whole lanes, contiguous runs of the epoch's sequence: few groups are read by two ranks."""
    table = Manifest.load(shard_dir).split("train").group_table()
    planner = EpochPlanner(table, k=1, pieces_per_step=4, seed=2, window_steps=3)
    groups = [{p.group for mb in planner.batches(0, rank=r, world_size=2) for p in mb.pieces} for r in range(2)]
    assert len(groups[0] & groups[1]) <= 2, groups  # only where a lane boundary cuts a group (two boundaries)


def test_random_plan_covers_each_image_once(shard_dir):
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    planner = EpochPlanner(table, k=1, pieces_per_step=15, seed=1, window_steps=2)
    n = int(table.count.sum())
    assert planner.steps_per_epoch == n // 15
    seen = [
        (p.group, p.positions[0])
        for r in range(3)
        for mb in planner.batches(2, rank=r, world_size=3)
        for p in mb.pieces
    ]
    assert len(seen) == len(set(seen)) == planner.steps_per_epoch * 15


def test_fewer_workers_take_a_step_in_more_micro_batches_of_at_most_their_share():
    """The global batch of a step stays data.batch_size × train.grad_accum; the accumulation adapts to the worker
    count so that no worker's micro-batch outgrows its share at the largest count (its memory)."""
    # P = 12 classes of K = 4 a micro-batch at 3 workers (4 each), grad_accum 1
    shapes = {w: batch_shape("pk", 48, 4, w, grad_accum=1, max_world=3) for w in (1, 2, 3)}
    assert {w: (s.accum, s.pieces_per_rank, s.local_batch_size) for w, s in shapes.items()} == {
        1: (3, 4, 16),
        2: (2, 3, 12),
        3: (1, 4, 16),
    }
    assert all(s.pieces_per_step == 12 for s in shapes.values())
    # a fixed worker count keeps its configured accumulation
    assert batch_shape("random", 64, 1, 4, grad_accum=3).accum == 3
    shape = batch_shape("random", 64, 1, 2, grad_accum=2, max_world=4)  # 128 images a step, at most 16 a worker
    assert (shape.accum, shape.local_batch_size) == (4, 16)
    with pytest.raises(ValueError) as e:
        batch_shape("pk", 24, 4, 5, grad_accum=1, max_world=6)
    assert str(e.value).startswith(
        "cluster.num_workers: at 5 workers the P = 6 classes of a step"
    ) and "divide 6" in str(e.value)
    with pytest.raises(ConfigError) as c:
        build_config(
            {
                "data": {"batch_size": 24, "samples_per_class": 4},
                "cluster": {"num_workers": [4, 6], "max_failures": -1},
            }
        )
    assert "cluster.num_workers: at 4 or 5 workers the P = 6 classes" in str(c.value) and "\n" not in str(c.value)
    with pytest.raises(ConfigError, match="cluster.max_failures: an elastic run"):
        build_config({"data": {"batch_size": 24, "samples_per_class": 4}, "cluster": {"num_workers": [1, 2]}})


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
