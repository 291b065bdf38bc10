"""Batch decoding: the planned samples of one batch read, decoded and augmented into one array.

:func:`build_batch` turns a batch's pieces (:mod:`shards.read.sampler`) into ``b × C × S × S``
images (uint8, or float32 pixel values when the transform adds noise) with their labels
and indices in the split, applying the substitution policy for unreadable samples (below).
Each image slot of a step's global batch has its own ``random.Random`` derived from (seed, epoch,
step, slot) (:func:`slot_rngs`), so an image's augmentation is the same in whichever process builds
it, at whichever worker count. With an
:class:`~shards.decode.encoded.EncodedTransform` a training batch comes out as
:class:`~shards.decode.encoded.EncodedImages` (bytes and augmentation records, decoded on the
device) drawn from the same generators, under the same substitution policy.
:class:`TrainBatchDataset` and :class:`EvalBatchDataset` are what DataLoader processes run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shards.decode.encoded import EncodedTransform
from shards.decode.transforms import EvalTransform, TrainTransform
from shards.manifest import GroupTable, SplitInfo
from shards.read.sampler import EpochPlanner, Piece
from shards.read.tar_index import GroupReader

_AUG = 0xA06

# image bytes, slot rng -> S × S × C array (or, for an EncodedTransform, the bytes with their record)
Transform = Callable[[bytes, random.Random], Any]


def slot_rngs(seed: int, epoch: int, step: int, first: int, slots: int, step_slots: int) -> list[random.Random]:
    """The generators of image slots ``first .. first + slots - 1`` of a step's global batch of ``step_slots``
    images, all derived from (seed, epoch, step): the same for an image whichever worker takes it."""
    seeds = np.random.default_rng([seed, epoch, step, _AUG]).integers(0, 2**63, size=step_slots)
    return [random.Random(int(x)) for x in seeds[first : first + slots]]


def _decode(
    reader: GroupReader, g: int, pos: int, transform: Transform, rng: random.Random, notes: list[str], seen: set
) -> Any:
    """Decode sample ``pos`` of group ``g``; None (noted once) when it is missing or does not decode."""
    s = reader.sample(g, pos)
    if s is not None:
        try:
            return transform(s[2], rng)
        except Exception as e:  # noqa: BLE001 — any decoder failure: the sample is unreadable, the run goes on
            note = f"{reader.shard_name(g)}:{s[0]}.{s[1]}: cannot decode ({type(e).__name__}: {e})"
    else:
        note = f"{reader.shard_name(g)}:{reader.key(g, pos)}: member missing or truncated"
    if (g, pos) not in seen:
        seen.add((g, pos))
        notes.append(note)
    return None


def build_batch(
    reader: GroupReader,
    pieces: list[Piece],
    transform: Transform,
    *,
    batch: int,
    rngs: list[random.Random],
    image_size: int,
    channels: int = 3,
    dtype: Any = np.uint8,
    substitute: bool = True,
) -> dict[str, Any]:
    """Decode and augment one batch (number ``batch``; ``rngs``: one generator per image slot, see
    :func:`slot_rngs`): ``images`` ``b×channels×S×S`` of ``dtype`` (contiguous; an
    :class:`~shards.decode.encoded.EncodedImages` with an ``EncodedTransform``), ``labels``, ``index``,
    ``skipped``, ``notes``.

    ``substitute=True`` (training): every slot is filled so the batch keeps its planned shape. An
    unreadable image is replaced by another image of its class group (seeded order); when the whole
    group is unreadable, by a decoded image of this batch *together with that image's label* (black
    if nothing in the batch decodes). ``index`` keeps naming the planned samples.
    ``substitute=False`` (evaluation): unreadable samples are dropped, so ``images``, ``labels``
    and ``index`` hold only the samples that decoded (a batch may come out smaller, or empty).
    Either way ``skipped`` counts the unreadable planned samples.
    """
    slots = [(p.group, p.label, pos) for p in pieces for pos in p.positions]
    images: list[Any] = [None] * len(slots)
    labels = np.array([lab for _, lab, _ in slots], dtype=np.int64)
    index = np.array([int(reader.table.start[g]) + pos for g, _, pos in slots], dtype=np.int64)
    notes: list[str] = []
    seen: set = set()
    skipped = 0
    if len(rngs) != len(slots):
        raise ValueError(f"{len(rngs)} generators for {len(slots)} image slots")
    for i, (g, _, pos) in enumerate(slots):
        rng = rngs[i]
        img = _decode(reader, g, pos, transform, rng, notes, seen)
        if img is None:
            skipped += 1
            if substitute:  # another image of the same class group, in a seeded order
                count = int(reader.table.count[g])
                for alt in rng.sample(range(count), count):
                    if alt != pos and (img := _decode(reader, g, alt, transform, rng, notes, seen)) is not None:
                        break
        images[i] = img
    good = [i for i, im in enumerate(images) if im is not None]
    if substitute:
        for i, im in enumerate(images):
            if (
                im is None and good
            ):  # the whole group is unreadable: borrow a decoded image (and its label) of this batch
                j = good[i % len(good)]
                images[i], labels[i] = images[j], labels[j]
    else:
        images, labels, index = [images[i] for i in good], labels[good], index[good]
    if isinstance(transform, EncodedTransform):  # bytes and records for the device (a slot left None: black)
        collated: Any = transform.collate(images)
    else:
        out = np.zeros((len(images), channels, image_size, image_size), dtype)  # a slot left None stays black
        for i, im in enumerate(images):
            if im is not None:
                out[i] = im.transpose(2, 0, 1)  # HWC -> CHW here, in the loader process
        collated = torch.from_numpy(out)
    notes.extend(reader.notes)
    reader.notes.clear()
    return {
        "batch": batch,
        "images": collated,
        "labels": torch.from_numpy(labels),
        "index": torch.from_numpy(index),
        "skipped": skipped,
        "notes": notes,
    }


# -- the datasets loader processes run ------------------------------------------------------
def _worker_slice() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class TrainBatchDataset(IterableDataset):
    """Micro-batches ``start ..`` of (epoch, rank) among ``world_size`` workers taking a step in ``accum`` micro-batches;
    a DataLoader worker ``i`` of ``n`` builds every n-th."""

    def __init__(
        self,
        split: SplitInfo,
        table: GroupTable,
        planner: EpochPlanner,
        transform: TrainTransform | EncodedTransform,
        *,
        epoch: int,
        start: int,
        rank: int,
        world_size: int,
        accum: int,
        seed: int,
    ):
        self.split, self.table, self.planner, self.transform = split, table, planner, transform
        self.epoch, self.start, self.rank, self.seed = epoch, start, rank, seed
        self.world_size, self.accum = world_size, accum

    def __iter__(self):
        wid, nw = _worker_slice()
        reader = GroupReader(self.split, self.table)
        planned = self.planner.batches(
            self.epoch, rank=self.rank, world_size=self.world_size, accum=self.accum, start=self.start
        )
        mine = (mb for mb in planned if (mb.index - self.start) % nw == wid)
        step_slots = self.planner.per_step * self.planner.k
        try:
            for mb in reader.read_ahead(mine):
                t = self.transform
                slots = sum(len(p.positions) for p in mb.pieces)
                out = build_batch(
                    reader,
                    mb.pieces,
                    t,
                    batch=mb.index,
                    rngs=slot_rngs(self.seed, self.epoch, mb.step, mb.first_slot, slots, step_slots),
                    image_size=t.size,
                    channels=t.channels,
                    dtype=t.dtype,
                )
                yield {**out, "io": reader.take_io()}
        finally:
            reader.close()


class EvalBatchDataset(IterableDataset):
    """One eval batch per ``[lo, hi)`` sample range; unreadable samples dropped; worker ``i`` of ``n`` builds every n-th."""

    def __init__(self, split: SplitInfo, table: GroupTable, ranges: list[tuple[int, int]], transform: EvalTransform):
        self.split, self.table, self.ranges, self.transform = split, table, ranges, transform

    def __iter__(self):
        wid, nw = _worker_slice()
        reader = GroupReader(self.split, self.table)
        starts = self.table.start

        def mine():
            for b, (lo, hi) in enumerate(self.ranges):
                if b % nw == wid:
                    pos = np.arange(lo, hi, dtype=np.int64)
                    groups = np.searchsorted(starts, pos, side="right") - 1
                    yield (
                        b,
                        [Piece(int(g), int(self.table.label[g]), (int(p - starts[g]),)) for g, p in zip(groups, pos)],
                    )

        try:
            for b, pieces in reader.read_ahead(mine()):
                t = self.transform
                out = build_batch(
                    reader,
                    pieces,
                    t,
                    batch=b,
                    rngs=slot_rngs(0, 0, b, 0, len(pieces), len(pieces)),  # evaluation draws nothing
                    image_size=t.crop,
                    channels=t.channels,
                    substitute=False,
                )
                yield {**out, "io": reader.take_io()}
        finally:
            reader.close()
