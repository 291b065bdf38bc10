"""Stream training and evaluation batches from a shard directory on any number of workers.

:class:`TrainStream` yields each rank's part of global batches: class-balanced P×K batches
(rank r gets P/W whole classes, K images each) or plain random batches. Every rank yields
exactly :attr:`TrainStream.batches_per_epoch` batches, a number computed from the manifest
before reading anything, so uneven shards never leave a rank short inside a collective.
The plan (:mod:`shards.sampler`) is a pure function of (seed, epoch, rank, batch), and so is
each batch's augmentation, whichever loader process decodes it: ``epoch(e, start_batch=b)``
replays an interrupted epoch from batch ``b`` exactly, provided
:meth:`TrainStream.plan_signature` (world size, batch settings, seed, shards) is unchanged.

Reading: the manifest gives each class group's byte range in its shard, so a loader process
seeks to the groups its batches need and parses just those tar members with WebDataset's
tar iterator; nothing holds an index of images, and the memory in use is a batch's worth of
encoded images. With ``loader_workers = n > 0`` a torch DataLoader runs ``n`` processes;
process ``i`` builds batches ``start + i, start + i + n, ...`` and the main process puts
them back in order, so the output does not depend on ``n``. Loader processes hand over
uint8 ``b×3×S×S`` batches; normalization to float32 happens in the consumer's process
(``normalize=True``) or on its device (``normalize=False`` + :func:`shards.transforms.normalize_batch`).

Unreadable members (missing, truncated, not decodable) are logged (the first few) and counted;
they never stop a run. In *training* batch shapes stay fixed: another image of the same group
takes the slot, or, when the whole group is unreadable, another image of the batch together
with its label (``index`` still names the planned sample); see :attr:`TrainStream.skipped`.
In *evaluation* nothing is substituted (it would inflate Recall@K and MAP@R): the sample is
dropped from its batch and counted in :attr:`EvalBatches.skipped`.

:func:`eval_batches` gives each rank a contiguous, disjoint part of a split (the union is
the whole split minus any unreadable samples), the same number of batches on every rank,
and the position of each sample in the split for gathering.
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dmltrain.errors import UserError
from shards.ingest import IMAGE_EXTENSIONS
from shards.manifest import GroupTable, Manifest, SplitInfo
from shards.sampler import EpochPlanner, Piece, eval_batch_ranges
from shards.transforms import EvalTransform, TrainTransform, normalize_batch

log = logging.getLogger(__name__)

_AUG = 0xA06
DEFAULT_SHUFFLE_IMAGES = 16384  # images per shuffle window (the plan of a window, not its pixels, is in memory)


# -- reading class groups --------------------------------------------------------------------
Sample = tuple[str, str, bytes]  # (key, image extension, image bytes)


def _parse_header(h: bytes) -> tuple[str, int, bytes] | None:
    """(name, size, typeflag) of a 512-byte ustar header; None for an end block, a short read or a bad checksum."""
    if len(h) < 512 or not any(h):
        return None
    try:
        stored = int(h[148:156].split(b"\0")[0].strip() or b"0", 8)
        size = int(h[124:136].split(b"\0")[0].strip() or b"0", 8)
    except ValueError:
        return None
    if stored != sum(h) - sum(h[148:156]) + 256:  # the checksum counts its own field as spaces
        return None
    name = h[0:100].split(b"\0")[0].decode("utf-8", "replace")
    prefix = h[345:500].split(b"\0")[0].decode("utf-8", "replace") if h[257:262] == b"ustar" else ""
    return (f"{prefix}/{name}" if prefix else name), size, h[156:157]


class _Unsupported(Exception):
    """A tar feature our ustar walker leaves to the tarfile module (pax or GNU long-name headers)."""


def _walk(read, offset: int, end: int, start: int, count: int, where: str, notes: list[str]) -> list[dict[str, tuple[int, int]]]:
    """Member table of a class group: per sample position, extension -> (data offset, size).

    ``read(offset, n)`` returns bytes of the shard. Stops (with a note) at a garbled or short header.
    """
    table: list[dict[str, tuple[int, int]]] = [{} for _ in range(count)]
    while offset + 512 <= end:
        head = _parse_header(read(offset, 512))
        if head is None:
            notes.append(f"{where}: bad or missing tar header at byte {offset}; the rest of the group is unreadable")
            break
        name, size, kind = head
        if kind not in (b"0", b"\0"):
            raise _Unsupported(kind)
        key, _, ext = name.rpartition("/")[2].partition(".")
        if key.isdigit() and 0 <= int(key) - start < count:
            table[int(key) - start][ext.lower()] = (offset + 512, size)
        offset += 512 + -(-size // 512) * 512
    return table


class GroupReader:
    """Random access to the samples of a split's class groups (byte ranges of the shards).

    A small group (<= ``whole_group_bytes``) is read in one go and its members located by
    walking the ustar headers in memory; a large one is walked on disk (the member table is
    cached per group) and only the samples asked for are read, so picking K images of a big
    class, or one image for the random sampler, does not read the whole class. Header
    checksums are verified; a missing, truncated or garbled member gives ``None`` and a note
    naming the shard. Tars with pax/GNU headers (not written by :mod:`shards.writer`) go
    through WebDataset's tar iterator instead. Files are opened lazily in each process.
    """

    def __init__(
        self, split: SplitInfo, table: GroupTable, whole_group_bytes: int = 1 << 20, cache_bytes: int = 64 << 20, cache_indexes: int = 4096
    ):
        self.split, self.table = split, table
        self.whole_group_bytes, self.cache_bytes, self.cache_indexes = whole_group_bytes, cache_bytes, cache_indexes
        self._files: dict[int, Any] = {}
        self._groups: dict[int, tuple[list[Sample | None], int]] = {}  # decoded small groups, LRU by bytes
        self._group_bytes = 0
        self._indexes: dict[int, list[dict[str, tuple[int, int]]]] = {}  # member tables of large groups
        self.notes: list[str] = []  # problems met while reading, for the batch being built

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._groups.clear()
        self._indexes.clear()

    def _file(self, shard: int):
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(self.split.shards[shard].path, "rb")
        return f

    def _name(self, g: int) -> str:
        return self.split.shards[int(self.table.shard[g])].file

    def _read(self, g: int, offset: int, size: int) -> bytes:
        try:
            f = self._file(int(self.table.shard[g]))
            f.seek(offset)
            return f.read(size)
        except OSError as e:
            self.notes.append(f"{self._name(g)}: cannot read ({e})")
            return b""

    @staticmethod
    def _pick(fields: dict[str, Any]) -> str | None:
        return next((x for x in fields if x in IMAGE_EXTENSIONS), None)

    def _whole(self, g: int) -> list[Sample | None]:
        hit = self._groups.pop(g, None)
        if hit is not None:
            self._groups[g] = hit  # most recently used goes last
            return hit[0]
        t = self.table
        count, start, base = int(t.count[g]), int(t.start[g]), int(t.offset[g])
        buf = self._read(g, base, int(t.length[g]))
        samples: list[Sample | None] = [None] * count
        try:
            members = _walk(lambda o, n: buf[o - base : o - base + n], base, base + len(buf), start, count, self._name(g), self.notes)
            for pos, fields in enumerate(members):
                ext = self._pick(fields)
                if ext is not None:
                    off, size = fields[ext]
                    data = buf[off - base : off - base + size]
                    if len(data) == size:
                        samples[pos] = (f"{start + pos:08d}", ext, data)
        except _Unsupported:
            samples = self._whole_with_tarfile(g, buf)
        self._groups[g] = (samples, len(buf))
        self._group_bytes += len(buf)
        while self._group_bytes > self.cache_bytes and len(self._groups) > 1:
            self._group_bytes -= self._groups.pop(next(iter(self._groups)))[1]
        return samples

    def _whole_with_tarfile(self, g: int, buf: bytes) -> list[Sample | None]:
        t = self.table
        count, start = int(t.count[g]), int(t.start[g])
        members: dict[str, dict[str, bytes]] = {}
        try:
            for m in wds.tariterators.tar_file_iterator(io.BytesIO(buf)):
                key, _, ext = m["fname"].rpartition("/")[2].partition(".")
                members.setdefault(key, {})[ext.lower()] = m["data"]
        except Exception as e:  # truncated or garbled: keep the samples before the damage
            self.notes.append(f"{self._name(g)}: tar stops after {len(members)} of {count} samples ({type(e).__name__}: {e})")
        samples: list[Sample | None] = [None] * count
        for key, fields in members.items():
            ext = self._pick(fields)
            if key.isdigit() and 0 <= int(key) - start < count and ext is not None:
                samples[int(key) - start] = (key, ext, fields[ext])
        return samples

    def _index(self, g: int) -> list[dict[str, tuple[int, int]]] | None:
        if g not in self._indexes:
            t = self.table
            try:
                off, end = int(t.offset[g]), int(t.offset[g]) + int(t.length[g])
                table = _walk(lambda o, n: self._read(g, o, n), off, end, int(t.start[g]), int(t.count[g]), self._name(g), self.notes)
            except _Unsupported:
                table = None
            if len(self._indexes) >= self.cache_indexes:
                self._indexes.pop(next(iter(self._indexes)))
            self._indexes[g] = table
        return self._indexes[g]

    def sample(self, g: int, pos: int) -> Sample | None:
        """Sample ``pos`` (0-based within the group) of group ``g``, or None when unreadable."""
        if int(self.table.length[g]) <= self.whole_group_bytes:
            return self._whole(g)[pos]
        table = self._index(g)
        if table is None:
            return self._whole(g)[pos]
        fields = table[pos]
        ext = self._pick(fields)
        if ext is None:
            return None
        off, size = fields[ext]
        data = self._read(g, off, size)
        return (f"{int(self.table.start[g]) + pos:08d}", ext, data) if len(data) == size else None


def _decode(reader: GroupReader, g: int, pos: int, transform, rng, notes: list[str], seen: set) -> np.ndarray | None:
    """Decode sample ``pos`` of group ``g``; None (noted once) when it is missing or does not decode."""
    s = reader.sample(g, pos)
    if s is not None:
        try:
            return transform(s[2], rng)
        except Exception as e:  # noqa: BLE001 — any decoder failure: the sample is unreadable, the run goes on
            note = f"{reader._name(g)}:{s[0]}.{s[1]}: cannot decode ({type(e).__name__}: {e})"
    else:
        note = f"{reader._name(g)}:{int(reader.table.start[g]) + pos:08d}: member missing or truncated"
    if (g, pos) not in seen:
        seen.add((g, pos))
        notes.append(note)
    return None


def slot_rngs(seed: int, epoch: int, rank: int, batch: int, slots: int) -> list[random.Random]:
    """One generator per image slot of a batch, all derived from (seed, epoch, rank, batch)."""
    seeds = np.random.default_rng([seed, epoch, rank, batch, _AUG]).integers(0, 2**63, size=slots)
    return [random.Random(int(x)) for x in seeds]


def build_batch(
    reader: GroupReader,
    pieces: list[Piece],
    transform,
    *,
    seed: int,
    epoch: int,
    rank: int,
    batch: int,
    image_size: int,
    substitute: bool = True,
) -> dict[str, Any]:
    """Decode and augment one batch: ``images`` uint8 ``b×3×S×S`` (contiguous), ``labels``, ``index``, ``skipped``, ``notes``.

    ``substitute=True`` (training): every slot is filled so the batch keeps its planned shape. An
    unreadable image is replaced by another image of its class group (seeded order); when the whole
    group is unreadable, by a decoded image of this batch *together with that image's label* (black
    if nothing in the batch decodes). ``index`` keeps naming the planned samples.
    ``substitute=False`` (evaluation): unreadable samples are dropped, so ``images``, ``labels``
    and ``index`` hold only the samples that decoded (a batch may come out smaller, or empty).
    Either way ``skipped`` counts the unreadable planned samples.
    """
    slots = [(p.group, p.label, pos) for p in pieces for pos in p.positions]
    images: list[np.ndarray | None] = [None] * len(slots)
    labels = np.array([lab for _, lab, _ in slots], dtype=np.int64)
    index = np.array([int(reader.table.start[g]) + pos for g, _, pos in slots], dtype=np.int64)
    notes: list[str] = []
    seen: set = set()
    skipped = 0
    rngs = slot_rngs(seed, epoch, rank, batch, len(slots)) if slots else []
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
            if im is None and good:  # the whole group is unreadable: borrow a decoded image (and its label) of this batch
                j = good[i % len(good)]
                images[i], labels[i] = images[j], labels[j]
    else:
        images, labels, index = [images[i] for i in good], labels[good], index[good]
    out = np.zeros((len(images), 3, image_size, image_size), np.uint8)  # a slot left None stays black
    for i, im in enumerate(images):
        if im is not None:
            out[i] = im.transpose(2, 0, 1)  # HWC -> CHW here, in the loader process
    notes.extend(reader.notes)
    reader.notes.clear()
    return {
        "batch": batch,
        "images": torch.from_numpy(out),
        "labels": torch.from_numpy(labels),
        "index": torch.from_numpy(index),
        "skipped": skipped,
        "notes": notes,
    }


# -- datasets run inside loader processes ----------------------------------------------------
def _worker_slice() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)


class _TrainBatches(IterableDataset):
    def __init__(
        self, split: SplitInfo, table: GroupTable, planner: EpochPlanner, transform: TrainTransform, *, epoch: int, start: int, rank: int, seed: int
    ):
        self.split, self.table, self.planner, self.transform = split, table, planner, transform
        self.epoch, self.start, self.rank, self.seed = epoch, start, rank, seed

    def __iter__(self):
        wid, nw = _worker_slice()
        reader = GroupReader(self.split, self.table)
        try:
            for b, pieces in self.planner.batches(self.epoch, self.rank, self.start):
                if (b - self.start) % nw == wid:
                    yield build_batch(
                        reader, pieces, self.transform, seed=self.seed, epoch=self.epoch, rank=self.rank, batch=b, image_size=self.transform.size
                    )
        finally:
            reader.close()


class _EvalBatches(IterableDataset):
    def __init__(self, split: SplitInfo, table: GroupTable, ranges: list[tuple[int, int]], transform: EvalTransform):
        self.split, self.table, self.ranges, self.transform = split, table, ranges, transform

    def __iter__(self):
        wid, nw = _worker_slice()
        reader = GroupReader(self.split, self.table)
        starts = self.table.start
        try:
            for b, (lo, hi) in enumerate(self.ranges):
                if b % nw != wid:
                    continue
                pos = np.arange(lo, hi, dtype=np.int64)
                groups = np.searchsorted(starts, pos, side="right") - 1
                pieces = [Piece(int(g), int(self.table.label[g]), (int(p - starts[g]),)) for g, p in zip(groups, pos)]
                yield build_batch(
                    reader, pieces, self.transform, seed=0, epoch=0, rank=0, batch=b, image_size=self.transform.crop, substitute=False
                )
        finally:
            reader.close()


def _in_order(dataset: IterableDataset, loader_workers: int, first: int, pin_memory: bool) -> Iterator[dict[str, Any]]:
    """Run ``dataset`` in ``loader_workers`` processes (0: here) and yield its batches by batch number."""
    if loader_workers <= 0:
        yield from dataset
        return
    loader = DataLoader(
        dataset, batch_size=None, num_workers=loader_workers, pin_memory=pin_memory, worker_init_fn=_worker_init, prefetch_factor=2
    )
    pending: dict[int, dict[str, Any]] = {}
    expect = first
    for item in loader:
        pending[item["batch"]] = item
        while expect in pending:
            yield pending.pop(expect)
            expect += 1
    if pending:
        raise RuntimeError(f"loader processes skipped batch {expect} (got {sorted(pending)[:5]}...)")


class _SkipLog:
    """Count skipped members; log the first notes (deduplicated within a batch), then only counts."""

    MAX_LINES = 20

    def __init__(self):
        self.count = 0
        self.lines = 0

    def add(self, batch: dict[str, Any]) -> None:
        self.count += int(batch["skipped"])
        for note in batch["notes"]:
            if self.lines < self.MAX_LINES:
                log.warning("skipped corrupt shard member %s", note)
            elif self.lines == self.MAX_LINES:
                log.warning("more corrupt shard members skipped; see the skipped count")
            self.lines += 1


def _pin_available(pin_memory: bool) -> bool:
    # page-locked memory needs CUDA; without it pinning is a no-op request (DataLoader would only warn)
    return bool(pin_memory) and torch.cuda.is_available()


def _deliver(images: torch.Tensor, normalize: bool, pin: bool) -> torch.Tensor:
    """The tensor handed to the caller: normalized float32 (written straight into pinned memory when ``pin``)
    or the uint8 batch itself (pinned when ``pin``; the DataLoader's pin thread already did it when it ran)."""
    if normalize:
        return normalize_batch(images, out=torch.empty(images.shape, dtype=torch.float32, pin_memory=pin))
    return images.pin_memory() if pin and not images.is_pinned() else images


def plan_digest(split: SplitInfo, table: GroupTable | None = None) -> str:
    """SHA-256 (first 16 hex digits) of what a split contributes to a batch plan: its name, label-space size
    and class-group table (shard, label, count per group). Re-encoding the same images keeps it; a
    rebuild with another class order, seed or shard size, or other images per class, changes it."""
    t = table if table is not None else split.group_table()
    h = hashlib.sha256(f"{split.name}\0{split.num_labels}\0{len(t)}\0".encode())
    for arr in (t.shard, t.label, t.count):
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return h.hexdigest()[:16]


# -- public API -----------------------------------------------------------------------------
PLAN_VERSION = 1  # bump when shards.sampler changes which samples a (seed, epoch, rank, batch) plan names


class TrainStream:
    """Training batches of one rank (see the module docstring).

    ``batch_size`` is the global batch over all ranks. ``sampler="pk"``: P = batch_size // K
    classes per global batch, P divisible by ``world_size``; each rank's batch holds P/W
    classes × K images (a class with fewer than K images is sampled with replacement).
    ``sampler="random"``: batch_size / W images per rank. Labels are int64 contiguous training ids.

    Images: with ``normalize=True`` (default) float32 ``b×3×S×S`` normalized with the ImageNet
    mean and std in this process; with ``normalize=False`` the uint8 ``b×3×S×S`` batch as decoded
    (a quarter of the bytes to pin and copy), which the caller normalizes where it wants, usually
    after the copy to the accelerator: ``shards.transforms.normalize_batch(images.to(device))``.
    ``pin_memory`` (only with CUDA) pins what is yielded: the uint8 batch, or the float32 one.

    ``shuffle_images`` bounds the shuffle window (in images); larger mixes classes more widely.
    A resumed run sees the same batches when :meth:`plan_signature` is unchanged (shards, seed,
    world size, batch settings; ``loader_workers``, ``normalize`` and the augmentation do not
    matter): store it with the (epoch, batch) position and resume mid-epoch only under an equal one.
    """

    def __init__(
        self,
        shard_dir: str | Path,
        split: str = "train",
        *,
        rank: int,
        world_size: int,
        sampler: str = "pk",
        batch_size: int,
        samples_per_class: int = 4,
        seed: int = 0,
        image_size: int = 224,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        color_jitter: float = 0.0,
        loader_workers: int = 2,
        shuffle_images: int = DEFAULT_SHUFFLE_IMAGES,
        pin_memory: bool = False,
        draft: bool = True,
        normalize: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.manifest = Manifest.load(shard_dir)
        self.split = self.manifest.split(split)
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.sampler = sampler
        self.loader_workers, self.pin_memory, self.normalize = loader_workers, pin_memory, bool(normalize)
        if sampler == "pk":
            k = samples_per_class
            if k < 1 or batch_size % k:
                raise UserError(f"data.batch_size: {batch_size} is not P×K with K = data.samples_per_class = {k}")
            p = batch_size // k
            if p % world_size:
                raise UserError(f"data.classes_per_batch: P = {p} classes cannot be split evenly over {world_size} workers")
            per_batch, self.local_batch_size = p // world_size, (p // world_size) * k
            self.samples_per_class = k
        elif sampler == "random":
            if batch_size % world_size:
                raise UserError(f"data.batch_size: {batch_size} cannot be split evenly over {world_size} workers")
            k, per_batch = 1, batch_size // world_size
            self.local_batch_size = per_batch
            self.samples_per_class = 1
        else:
            raise UserError(f"data.sampler: {sampler!r} is not 'pk' or 'random'")
        self.batch_size = batch_size
        self.table = self.split.group_table()
        window = max(1, shuffle_images // self.local_batch_size)
        self.planner = EpochPlanner(
            self.table, world_size=world_size, k=k, pieces_per_batch=per_batch, seed=self.seed, class_balanced=sampler == "pk", window_batches=window
        )
        self.batches_per_epoch = self.planner.batches_per_epoch
        if self.batches_per_epoch == 0:
            unit = f"groups of K = {k}" if sampler == "pk" else "images"
            raise UserError(
                f"{self.manifest.path}: split {split!r} has {self.planner.total_pieces} {unit}, fewer than one global batch "
                f"({per_batch * world_size}); lower data.batch_size"
            )
        self.num_classes = self.split.num_labels
        self.transform = TrainTransform(image_size, crop_scale, color_jitter=color_jitter, draft=draft)
        self._skips = _SkipLog()

    @property
    def skipped(self) -> int:
        """Corrupt or truncated members met so far (each replaced; counted per occurrence)."""
        return self._skips.count

    def plan_signature(self) -> dict[str, Any]:
        """Everything that decides which samples each (epoch, rank, batch) gets, as a JSON-ready dict.

        Keys: ``plan_version``, ``split``, ``world_size``, ``sampler``, ``batch_size``,
        ``samples_per_class``, ``seed``, ``shuffle_window_batches``, ``manifest_digest``
        (:func:`plan_digest`). A position (epoch, batch) saved with one signature replays the same
        batches only under an equal signature; under another, resume at the next epoch boundary
        (``start_batch=0``). The same on every rank.
        """
        return {
            "plan_version": PLAN_VERSION,
            "split": self.split.name,
            "world_size": self.world_size,
            "sampler": self.sampler,
            "batch_size": self.batch_size,
            "samples_per_class": self.samples_per_class,
            "seed": self.seed,
            "shuffle_window_batches": self.planner.window_batches,
            "manifest_digest": plan_digest(self.split, self.table),
        }

    def plan(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[int, list[Piece]]]:
        """The batches' content (group, label, positions) without reading any image."""
        return self.planner.batches(epoch, self.rank, start_batch)

    def epoch(self, epoch: int, start_batch: int = 0, *, with_index: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """``(images, labels)`` (``+ index`` of each sample in the split with ``with_index``) for batches
        ``start_batch .. batches_per_epoch - 1`` of ``epoch`` on this rank.

        ``start_batch`` must lie in ``0..batches_per_epoch`` (the end: nothing left), else
        :class:`UserError` right here, before any batch: a position saved under another plan
        (see :meth:`plan_signature`) cannot be resumed mid-epoch.
        """
        if isinstance(start_batch, bool) or not isinstance(start_batch, (int, np.integer)) or not 0 <= start_batch <= self.batches_per_epoch:
            raise UserError(
                f"start_batch {start_batch!r}: outside 0..{self.batches_per_epoch}, the batches per epoch of split "
                f"{self.split.name!r} of {self.manifest.root} at world size {self.world_size}, batch size {self.batch_size}; "
                f"a position saved under another plan (plan_signature) cannot be resumed mid-epoch: start the next epoch"
            )
        return self._epoch(int(epoch), int(start_batch), with_index)

    def _epoch(self, epoch: int, start_batch: int, with_index: bool) -> Iterator[tuple[torch.Tensor, ...]]:
        if start_batch == self.batches_per_epoch:
            return
        ds = _TrainBatches(
            self.split, self.table, self.planner, self.transform, epoch=epoch, start=start_batch, rank=self.rank, seed=self.seed
        )
        pin = _pin_available(self.pin_memory)
        n, skipped_before = 0, self.skipped
        # the loader pins uint8 batches itself; normalized ones are written straight into pinned memory here
        for item in _in_order(ds, self.loader_workers, start_batch, pin and not self.normalize):
            self._skips.add(item)
            images = _deliver(item["images"], self.normalize, pin)
            n += 1
            yield (images, item["labels"], item["index"]) if with_index else (images, item["labels"])
        if n != self.batches_per_epoch - start_batch:
            raise RuntimeError(f"rank {self.rank}: epoch {epoch} produced {n} batches, expected {self.batches_per_epoch - start_batch}")
        if self.skipped > skipped_before:
            new = self.skipped - skipped_before
            log.warning("rank %d epoch %d: %d corrupt shard members skipped (%d so far)", self.rank, epoch, new, self.skipped)


class EvalBatches:
    """The iterable :func:`eval_batches` returns: ``(images, labels, index)`` batches of one rank's share.

    Each pass reads the shards again. ``skipped`` is the number of this rank's samples left out of
    the latest pass because their member was missing, truncated or would not decode (0 before a
    pass); ``num_samples`` is the size of the whole split (all ranks), ``len()`` the batches per pass.
    """

    def __init__(self, info: SplitInfo, root: Path, ranges: list[tuple[int, int]], transform: EvalTransform, *,
                 rank: int, loader_workers: int, pin_memory: bool, normalize: bool):
        self.split, self.root, self.ranges, self.transform = info, root, ranges, transform
        self.rank, self.loader_workers, self.pin_memory, self.normalize = rank, loader_workers, pin_memory, normalize
        self.num_samples = info.num_images
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self.skipped = 0
        skips = _SkipLog()
        ds = _EvalBatches(self.split, self.split.group_table(), self.ranges, self.transform)
        pin = _pin_available(self.pin_memory)
        for item in _in_order(ds, self.loader_workers, 0, pin and not self.normalize):
            skips.add(item)
            self.skipped = skips.count
            yield _deliver(item["images"], self.normalize, pin), item["labels"], item["index"]
        if self.skipped:
            log.warning(
                "rank %d: %d unreadable samples of split %r (%s) left out of the evaluation", self.rank, self.skipped, self.split.name, self.root
            )


def eval_batches(
    shard_dir: str | Path,
    split: str,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    resize: int = 256,
    crop: int = 224,
    loader_workers: int = 2,
    pin_memory: bool = False,
    draft: bool = True,
    normalize: bool = True,
) -> EvalBatches:
    """``(images, labels, index)`` batches of ``rank``'s contiguous share of ``split`` (an :class:`EvalBatches`).

    Every rank yields the same number of batches (sizes may differ by one; a batch is empty
    only when the split has fewer samples than ranks × batches). Labels are the split's label
    space (In-Shop query and gallery share it); ``index`` is each sample's position in the
    split. An unreadable sample is *dropped*, never replaced (a stand-in image would inflate
    the retrieval metrics): its batch comes out smaller, its index is absent, it is logged and
    counted in the returned object's ``skipped``. Images as in :class:`TrainStream`
    (``normalize``, ``pin_memory``).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    manifest = Manifest.load(shard_dir)
    info = manifest.split(split)
    ranges = eval_batch_ranges(info.num_images, world_size, rank, batch_size)
    return EvalBatches(
        info, manifest.root, ranges, EvalTransform(resize, crop, draft=draft),
        rank=rank, loader_workers=loader_workers, pin_memory=pin_memory, normalize=normalize,
    )
