"""Streaming: the batches the loader builds from the plans, resume, corruption, eval, several ranks.

Multi-process checks (gloo, W = 2 and 3) run every rank's epoch in real processes and
compare what they saw across ranks; the single-process checks compare the stream against
its plan and against the manifest.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from dataset_fixtures import make_inshop
from multiproc import run_workers
from shard_fixtures import IMG, SIZES, K, P, garble_members, make_shards, stream

from dmltrain.config import EvalConfig
from dmltrain.errors import UserError
from dmltrain.evaluate.embedding import evaluate_model
from dmltrain.evaluate.retrieval import retrieval_metrics
from shards.build.builder import build_layout
from shards.config import AugmentConfig, DataConfig
from shards.decode.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize_batch
from shards.manifest import Manifest
from shards.read.sampler import pieces_per_group
from shards.read.stream import TrainStream, eval_batches
from shards.read.tar_index import GroupReader

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# every augmentation option on: all of them must be functions of (seed, epoch, step, slot)
ALL_OPTIONS = AugmentConfig(
    resize=[24, 24],
    scale=(0.3, 1.0),
    ratio=(0.5, 2.0),
    flip=0.5,
    rotation=20,
    color_jitter=[0.3, 0.3, 0.3, 0.1],
    grayscale=3,
    noise=0.05,
    erase=0.5,
)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("stream") / "shards")


# -- the stream ----------------------------------------------------------------------------------
def test_stream_follows_plan_and_manifest(shard_dir):
    ts = stream(shard_dir)
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    plan = list(ts.plan(0))
    got = list(ts.epoch(0, with_index=True))
    assert len(got) == ts.batches_per_epoch == len(plan) and ts.num_classes == len(SIZES)
    for (images, labels, index), (_, pieces) in zip(got, plan):
        assert images.shape == (P * K, 3, IMG, IMG) and images.dtype == torch.float32 and labels.dtype == torch.int64
        assert labels.tolist() == [p.label for p in pieces for _ in p.positions]
        assert index.tolist() == [int(table.start[p.group]) + q for p in pieces for q in p.positions]
    # labels agree with what the shards themselves say about those samples (read with plain WebDataset)
    cls = {
        int(x["__key__"]): int(x["cls"])
        for x in wds.WebDataset(
            [str(sh.path) for sh in info.shards], shardshuffle=False, empty_check=False, nodesplitter=None
        )
    }
    for _, labels, index in got:
        assert labels.tolist() == [cls[i] for i in index.tolist()]
    # normalized ImageNet-style: roughly zero-centred, unit-scale values
    x = torch.cat([g[0] for g in got])
    assert -3 < x.mean() < 3 and 0.2 < x.std() < 3
    assert ts.skipped == 0
    # normalize=False: the same batches as uint8 NCHW; normalize_batch (the caller's, on any device) gives the same floats
    raw = list(stream(shard_dir, normalize=False, pin_memory=True).epoch(0, with_index=True))
    assert len(raw) == len(got)
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
    for (images, labels, index), (u8, labels2, index2) in zip(got, raw):
        assert u8.dtype == torch.uint8 and u8.shape == (P * K, 3, IMG, IMG) and u8.is_contiguous()
        assert torch.equal(labels, labels2) and torch.equal(index, index2)
        assert torch.equal(normalize_batch(u8), images)
        ref = (u8.double() / 255 - mean) / std  # the formula, independently
        assert torch.allclose(images.double(), ref, atol=1e-5)
    u8 = raw[0][0]
    channels_last = normalize_batch(u8.contiguous(memory_format=torch.channels_last), torch.bfloat16)
    assert channels_last.dtype == torch.bfloat16 and channels_last.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(channels_last.float(), got[0][0], atol=0.02)
    assert torch.equal(normalize_batch(u8.float()), got[0][0]), (
        "float pixel values work too, and the input is left alone"
    )
    with pytest.raises(ValueError, match="b×3×H×W"):
        normalize_batch(u8.permute(0, 2, 3, 1))


def test_loader_processes_resume_and_determinism(shard_dir):
    ts = stream(shard_dir, augment=ALL_OPTIONS)
    ref = list(ts.epoch(1, with_index=True))
    par = list(stream(shard_dir, augment=ALL_OPTIONS, loader_workers=2).epoch(1, with_index=True))
    assert len(par) == len(ref)
    for a, b in zip(ref, par):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "the same batches whatever the number of loader processes"
    start = 3
    resumed = list(
        stream(shard_dir, augment=ALL_OPTIONS, loader_workers=2).epoch(1, start_batch=start, with_index=True)
    )
    assert len(resumed) == len(ref) - start
    for a, b in zip(ref[start:], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "resume replays the same images and augmentation"
    other = list(ts.epoch(2, with_index=True))
    assert not torch.equal(other[0][2], ref[0][2])
    # the same images in two epochs get different crops
    flat = {int(i): img for im, _, ix in ref for img, i in zip(im, ix)}
    flat2 = {int(i): img for im, _, ix in other for img, i in zip(im, ix)}
    common = sorted(set(flat) & set(flat2))[:5]
    assert common and all(not torch.equal(flat[i], flat2[i]) for i in common)
    assert list(ts.epoch(1, start_batch=ts.batches_per_epoch)) == []  # the end of an epoch: nothing left


def test_grayscale_batches(shard_dir):
    """One channel crosses to the consumer (a third of the bytes); normalized, it is the three-channel batch."""
    gray = stream(shard_dir, augment=AugmentConfig(grayscale=1), normalize=False)
    three = stream(shard_dir, augment=AugmentConfig(grayscale=3), normalize=False)
    (g, labels, _), (t, labels3, _) = next(gray.epoch(0, with_index=True)), next(three.epoch(0, with_index=True))
    assert g.shape == (P * K, 1, IMG, IMG) and g.dtype == torch.uint8 and torch.equal(labels, labels3)
    assert torch.equal(g.expand(-1, 3, -1, -1), t) and torch.equal(normalize_batch(g), normalize_batch(t))
    normalized = next(stream(shard_dir, augment=AugmentConfig(grayscale=1)).epoch(0))[0]
    assert normalized.shape == (P * K, 3, IMG, IMG) and torch.equal(normalized, normalize_batch(t))
    evals = eval_batches(
        shard_dir,
        "test",
        rank=0,
        world_size=1,
        batch_size=8,
        resize=18,
        crop=IMG,
        grayscale=1,
        loader_workers=0,
        normalize=False,
    )
    assert next(iter(evals))[0].shape[1:] == (1, IMG, IMG)


def test_from_config(shard_dir):
    """The stream a run config describes: the same batches as the keyword constructor."""
    from dmltrain.config import build_config

    cfg = build_config(
        {
            "data": {
                "shards": str(shard_dir),
                "batch_size": P * K,
                "samples_per_class": K,
                "image_size": IMG,
                "augment": {"rotation": 10},
            },
            "train": {"seed": 11},
            "cluster": {"num_workers": 2},
        }
    )
    ts = TrainStream.from_config(cfg.data, cfg.train.seed, 1, 2, loader_workers=0)
    ref = stream(
        shard_dir,
        rank=1,
        world_size=2,
        augment=AugmentConfig(rotation=10),
        shuffle_images=TrainStream.__init__.__kwdefaults__["shuffle_images"],
    )
    assert ts.plan_signature() == ref.plan_signature() and ts.transform.augment == ref.transform.augment
    for a, b in zip(ts.epoch(0, with_index=True), ref.epoch(0, with_index=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_plan_signature_and_resume_position(shard_dir, tmp_path):
    base = stream(shard_dir)
    sig = base.plan_signature()
    assert json.loads(json.dumps(sig)) == sig, "JSON-ready, to store in a checkpoint"
    assert set(sig) == {
        "plan_version",
        "split",
        "sampler",
        "batch_size",
        "grad_accum",
        "samples_per_class",
        "seed",
        "shuffle_window_steps",
        "manifest_digest",
    }
    # what does not change the plan does not change the signature; every plan input does
    assert (
        stream(
            shard_dir, loader_workers=2, augment=AugmentConfig(color_jitter=0.4), image_size=IMG + 8, normalize=False
        ).plan_signature()
        == sig
    )
    assert (
        stream(shard_dir, rank=1, world_size=2).plan_signature()
        == stream(shard_dir, rank=0, world_size=2).plan_signature()
        == stream(shard_dir, rank=2, world_size=3).plan_signature()
        == sig
    ), "same on all ranks, at every worker count"
    changed = {
        "grad_accum": stream(shard_dir, grad_accum=2),
        "batch_size": stream(shard_dir, batch_size=2 * P * K),
        "samples_per_class": stream(shard_dir, batch_size=2 * P * K, samples_per_class=2 * K),
        "sampler": stream(shard_dir, sampler="random"),
        "seed": stream(shard_dir, seed=12),
        "shuffle_window_steps": stream(shard_dir, shuffle_images=600),
    }
    for key, ts in changed.items():
        assert ts.plan_signature()[key] != sig[key], key
    other = make_shards(tmp_path / "reseeded", seed=4)  # same images, another class order: another plan
    assert stream(other).plan_signature()["manifest_digest"] != sig["manifest_digest"]
    assert stream(other).plan_signature() != sig
    # a position outside this plan's epoch is a one-line UserError at the call, before any batch
    for bad in (-1, base.batches_per_epoch + 1, 10**6):
        with pytest.raises(UserError, match=rf"start_batch {bad}: outside 0\.\.{base.batches_per_epoch}"):
            base.epoch(0, start_batch=bad)
    # a doubled global batch halves the epoch: a position saved near the end of the old plan is refused
    bigger = changed["batch_size"]
    assert bigger.batches_per_epoch < base.batches_per_epoch - 1
    with pytest.raises(UserError, match="plan_signature"):
        bigger.epoch(0, start_batch=base.batches_per_epoch - 1)
    assert not hasattr(base, "state_dict") and not hasattr(base, "position")


def test_a_step_is_the_same_images_and_crops_at_every_worker_count(shard_dir):
    """The global batch of a step, pixels and augmentation included, whichever workers take it in whichever
    micro-batches, and from whichever step an epoch is resumed: a run resumed at another worker count continues
    the same optimization."""

    def steps(world, start_step=0, **kw):
        """Every step of epoch 1 from ``start_step``, the ranks' micro-batches put back in order."""
        ranks = [stream(shard_dir, rank=r, world_size=world, augment=ALL_OPTIONS, **kw) for r in range(world)]
        accum = ranks[0].accum
        got = [list(ts.epoch(1, start_batch=start_step * accum, with_index=True)) for ts in ranks]
        out = []
        for s in range(len(got[0]) // accum):
            parts = [got[r][s * accum + j] for j in range(accum) for r in range(world)]
            out.append(tuple(torch.cat([p[i] for p in parts]) for i in range(3)))
        return out

    ref = steps(1)
    assert len(ref) == stream(shard_dir).steps_per_epoch > 3
    for world, kw in [(2, {}), (3, {}), (3, {"max_world": 6}), (1, {"max_world": 3})]:
        other = steps(world, **kw)
        assert len(other) == len(ref)
        for a, b in zip(ref, other):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (world, kw)
    # P = 6 classes a step, at most 6 / 6 = 1 a worker at 3 of 6 workers: 2 micro-batches of one class each
    assert stream(shard_dir, rank=0, world_size=3, max_world=6).accum == 2
    for a, b in zip(ref[2:], steps(2, start_step=2)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "resumed mid-epoch at another worker count"


def test_random_sampler_batches(shard_dir):
    b = 8
    streams = [stream(shard_dir, rank=r, world_size=2, sampler="random", batch_size=b) for r in range(2)]
    assert streams[0].batches_per_epoch == sum(SIZES) // b == streams[1].batches_per_epoch
    seen = []
    for ts in streams:
        for images, _labels, index in ts.epoch(0, with_index=True):
            assert images.shape == (b // 2, 3, IMG, IMG)
            seen += index.tolist()
    assert len(seen) == len(set(seen)) == streams[0].batches_per_epoch * b


def test_config_errors(shard_dir):
    with pytest.raises(UserError, match="samples_per_class"):
        stream(shard_dir, batch_size=10, samples_per_class=3)
    with pytest.raises(UserError, match="evenly"):
        stream(shard_dir, world_size=4, batch_size=18)
    with pytest.raises(UserError, match="fewer than one step.s global batch"):
        stream(shard_dir, batch_size=3 * 200)
    with pytest.raises(UserError, match="no split 'val'"):
        TrainStream(shard_dir, "val", rank=0, world_size=1, batch_size=18)


def test_corrupt_members_are_skipped_and_counted(shard_dir, tmp_path, caplog):
    bad = tmp_path / "bad"
    shutil.copytree(shard_dir, bad)
    info = Manifest.load(bad).split("train")
    # garble the JPEG bytes of one member in place (the tar stays valid) ...
    victim = info.shards[0]
    raw = bytearray(victim.path.read_bytes())
    label, count, offset, length = victim.groups[0]
    jpg_at = raw.index(b"\xff\xd8\xff", offset)
    raw[jpg_at + 20 : jpg_at + 400] = b"\x00" * 380
    raw[jpg_at : jpg_at + 4] = b"JUNK"
    victim.path.write_bytes(bytes(raw))
    # ... and cut the last shard short in the middle of a member
    last = info.shards[-1]
    raw = last.path.read_bytes()
    group_at = last.groups[-1][2]
    with tarfile.open(fileobj=io.BytesIO(raw[group_at:]), mode="r|") as tf:
        second_sample_at = [t.offset for t in tf][3]  # members: cls, jpg, json per sample
    assert last.groups[-1][1] >= 2
    last.path.write_bytes(raw[: group_at + second_sample_at + 700])
    caplog.set_level(logging.WARNING, logger="shards.read.stream")
    for sampler, kw in (("pk", {}), ("random", {"batch_size": 8})):
        ts = stream(bad, sampler=sampler, **kw)
        n = 0
        for images, _labels in ts.epoch(0):
            assert images.shape[0] == ts.local_batch_size and torch.isfinite(images).all()
            n += 1
        assert n == ts.batches_per_epoch
        assert ts.skipped > 0
    assert any("skipped corrupt shard member" in r.message and victim.file in r.getMessage() for r in caplog.records)
    assert any(last.file in r.getMessage() for r in caplog.records)
    # both read paths lose exactly the members past the cut of the truncated shard
    table = info.group_table()
    g = len(table) - 1
    for reader in (GroupReader(info, table), GroupReader(info, table, whole_group_bytes=0)):
        got = [reader.sample(g, pos) is not None for pos in range(int(table.count[g]))]
        assert got[0] and not any(got[1:]), got


# -- evaluation -----------------------------------------------------------------------------------
class _TinyEmbedder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 * 4 * 4, 8)

    def forward(self, x):
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


def test_eval_drops_unreadable_samples(shard_dir, tmp_path, caplog):
    """Evaluation never substitutes: unreadable samples (one member, and a whole class group) are left
    out, counted, and the metrics are those of the readable samples alone."""
    bad = tmp_path / "bad"
    shutil.copytree(shard_dir, bad)
    info = Manifest.load(bad).split("test")
    table = info.group_table()
    whole = next(g for g in range(len(table)) if table.count[g] == 2)  # a class whose images are all unreadable
    part = next(g for g in range(len(table)) if table.count[g] >= 4)
    for g, positions in ((whole, [0, 1]), (part, [1])):
        sh = info.shards[int(table.shard[g])]
        garble_members(sh.path, next(row for row in sh.groups if row[0] == table.label[g]), positions)
    dropped = {int(table.start[whole]), int(table.start[whole]) + 1, int(table.start[part]) + 1}
    label_of = np.repeat(table.label, table.count)
    caplog.set_level(logging.WARNING, logger="shards.read.stream")
    for world_size, bs, workers in ((1, 8, 0), (2, 3, 1)):
        seen, skipped, n_batches = [], 0, set()
        for rank in range(world_size):
            batches = eval_batches(
                bad,
                "test",
                rank=rank,
                world_size=world_size,
                batch_size=bs,
                resize=18,
                crop=IMG,
                loader_workers=workers,
            )
            assert batches.skipped == 0 and batches.num_samples == info.num_images
            got = list(batches)
            n_batches.add(len(got))
            assert len(got) == len(batches)
            for images, labels, index in got:
                assert images.shape == (len(index), 3, IMG, IMG) and len(labels) == len(index)
                assert labels.tolist() == label_of[index.numpy()].tolist(), "every label is the sample's own"
                seen += index.tolist()
            skipped += batches.skipped
        assert sorted(seen) == sorted(set(range(info.num_images)) - dropped), (
            "readable samples once each, unreadable ones never"
        )
        assert skipped == len(dropped) and len(n_batches) == 1
        assert int(table.label[whole]) not in label_of[np.array(seen)].tolist()
    assert any("left out of the evaluation" in r.getMessage() for r in caplog.records)
    # evaluate_model reports the count, and its metrics are those of the readable samples alone
    model = _TinyEmbedder()
    data, ev = DataConfig(eval_batch_size=5, eval_resize=18, eval_crop=IMG, loader_workers=0), EvalConfig(ks=[1, 2])
    metrics, gathered = evaluate_model(model, str(bad), ["test"], ev, data, progress=False)
    clean, clean_gathered = evaluate_model(model, str(shard_dir), ["test"], ev, data, progress=False)
    assert metrics["unreadable_samples"] == 3.0 and "unreadable_samples" not in clean
    keep = np.array([i not in dropped for i in range(info.num_images)])
    emb, lab = clean_gathered["test"]
    assert np.allclose(gathered["test"][0], emb[keep], atol=1e-6) and np.array_equal(gathered["test"][1], lab[keep])
    ref = retrieval_metrics(
        emb[keep], lab[keep], ks=ev.ks, nmi=ev.nmi, map_at_r=ev.map_at_r, device="cpu", progress=False
    )
    assert {k: v for k, v in metrics.items() if k != "unreadable_samples"} == pytest.approx(ref)


def test_eval_batches_partition_the_split(shard_dir):
    info = Manifest.load(shard_dir).split("test")
    table = info.group_table()
    label_of = np.repeat(table.label, table.count)
    for world_size, bs, workers in ((1, 8, 0), (2, 5, 2), (3, 4, 0)):
        all_index, counts = [], []
        for rank in range(world_size):
            batches = list(
                eval_batches(
                    shard_dir,
                    "test",
                    rank=rank,
                    world_size=world_size,
                    batch_size=bs,
                    resize=18,
                    crop=IMG,
                    loader_workers=workers,
                )
            )
            counts.append(len(batches))
            for images, labels, index in batches:
                assert images.shape[1:] == (3, IMG, IMG) and 0 < len(index) <= bs
                assert labels.tolist() == label_of[index.numpy()].tolist()
                all_index += index.tolist()
        assert sorted(all_index) == list(range(info.num_images)) and len(set(counts)) == 1


def test_eval_inshop_shares_labels(tmp_path):
    fx = make_inshop(tmp_path / "src")
    build_layout("inshop", fx.root, tmp_path / "out", workers=1, progress=False)
    m = Manifest.load(tmp_path / "out")
    by_split = {}
    for split in ("query", "gallery"):
        ids = m.split(split).original_ids()
        batches = eval_batches(
            tmp_path / "out", split, rank=0, world_size=1, batch_size=4, resize=40, crop=32, loader_workers=0
        )
        by_split[split] = Counter(ids[int(lab)] for _, labels, _ in batches for lab in labels)
    assert by_split["query"] == Counter({f"id_{i:08d}": 2 for i in range(5, 9)})
    assert by_split["gallery"] == Counter({f"id_{i:08d}": 2 for i in range(5, 10)})


# -- several real processes ------------------------------------------------------------------------
def _one_world(rank: int, world_size: int, shard_dir: str, group) -> dict:
    import torch.distributed as dist

    out = {}
    ts = stream(shard_dir, rank=rank, world_size=world_size)  # no loader processes: run_workers makes daemons
    assert ts.local_batch_size == (P // world_size) * K
    batches = []
    for images, labels, index in ts.epoch(0, with_index=True):
        # a collective every step: a rank that ran short would hang here
        gathered = [None] * world_size
        dist.all_gather_object(gathered, (labels.tolist(), index.tolist()), group=group)
        batches.append((labels.tolist(), index.tolist(), float(images.double().sum())))
    out["epoch0"] = batches
    out["epoch0_again"] = [
        (lab.tolist(), i.tolist(), float(im.double().sum())) for im, lab, i in ts.epoch(0, with_index=True)
    ]
    resumed = stream(shard_dir, rank=rank, world_size=world_size).epoch(0, start_batch=2, with_index=True)
    out["resume"] = [(lab.tolist(), i.tolist(), float(im.double().sum())) for im, lab, i in resumed]
    out["epoch1"] = [i.tolist() for _, _, i in ts.epoch(1, with_index=True)]
    evals = eval_batches(
        shard_dir, "test", rank=rank, world_size=world_size, batch_size=4, resize=18, crop=IMG, loader_workers=0
    )
    out["eval"] = [i.tolist() for _, _, i in evals]
    return out


def _rank_epochs(rank: int, world_size: int, shard_dir: str) -> dict:
    """W = 3 on the whole group, then W = 2 on ranks 0 and 1 (one spawn serves both world sizes)."""
    import torch.distributed as dist

    assert world_size == 3
    pair = dist.new_group([0, 1])  # every rank must take part in creating it
    out = {3: _one_world(rank, 3, shard_dir, None)}
    if rank < 2:
        out[2] = _one_world(rank, 2, shard_dir, pair)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def rank_results(shard_dir) -> list[dict]:
    return run_workers(_rank_epochs, 3, str(shard_dir), timeout=240)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_equal_reproducible_batches(shard_dir, rank_results, world_size):
    results = [r[world_size] for r in rank_results[:world_size]]
    info = Manifest.load(shard_dir).split("train")
    table = info.group_table()
    n_batches = {len(r["epoch0"]) for r in results}
    assert len(n_batches) == 1 and n_batches.pop() == stream(shard_dir, world_size=world_size).batches_per_epoch
    seen = []
    for b in range(len(results[0]["epoch0"])):
        labels_by_rank = []
        for r in results:
            labels, index, _ = r["epoch0"][b]
            assert len(labels) == (P // world_size) * K
            counts = Counter(labels)
            assert len(counts) == P // world_size and set(counts.values()) == {K}, "P/W whole classes of K images"
            labels_by_rank.append(set(labels))
            seen += index
        assert sum(len(s) for s in labels_by_rank) - len(set().union(*labels_by_rank)) <= 1, "classes stay on one rank"
    m = pieces_per_group(table.count, K)
    group_of = np.searchsorted(table.start, np.array(seen), side="right") - 1
    repeats = Counter(int(group_of[seen.index(i)]) for i, n in Counter(seen).items() for _ in range(n - 1))
    for g, n in repeats.items():  # ranks see disjoint images: only small groups' top-ups repeat
        assert n <= m[g] * K - table.count[g], (g, n)
    for r in results:
        assert r["epoch0_again"] == r["epoch0"], "reproducible from (seed, epoch)"
        assert r["resume"] == r["epoch0"][2:], "mid-epoch resume continues with the same batches"
        assert r["epoch1"] != [i for _, i, _ in r["epoch0"]]
    eval_index = sorted(i for r in results for batch in r["eval"] for i in batch)
    assert eval_index == list(range(Manifest.load(shard_dir).split("test").num_images))
    assert len({len(r["eval"]) for r in results}) == 1
