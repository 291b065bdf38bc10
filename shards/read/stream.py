"""Stream training and evaluation batches from a shard directory on any number of workers.

:class:`TrainStream` yields each rank's part of each step's global batch: class-balanced P×K
(rank r gets whole classes, K images each) or plain random images, in ``accum`` micro-batches a
step. Every rank yields exactly :attr:`TrainStream.batches_per_epoch` micro-batches, a number
computed from the manifest before reading anything, so uneven shards never leave a rank short
inside a collective. The global batch of a step (:mod:`shards.read.sampler`) is a pure function
of (seed, epoch, step) and the batch settings, not of the worker count, and so is each image's
augmentation, whichever loader process decodes it and whichever rank takes it:
``epoch(e, start_batch=s × accum)`` continues an interrupted epoch from step ``s`` exactly, at any
worker count, provided :meth:`TrainStream.plan_signature` (batch settings, seed, shards) is unchanged.

Reading (:mod:`shards.read.tar_index`): the manifest gives each class group's byte range in its
shard, so a loader process reads just the groups its batches need; nothing holds an index of
images, and the memory in use is a batch's worth of encoded images. Decoding
(:mod:`shards.read.datasets`, :mod:`shards.decode.transforms`): each image slot draws its
augmentation from (seed, epoch, step, its place in the step). With ``loader_workers = n > 0`` a torch
DataLoader runs ``n`` processes; process ``i`` builds batches ``start + i, start + i + n, ...``
and the main process puts them back in order, so the output does not depend on ``n``. Loader
processes hand over uint8 ``b×C×S×S`` batches; normalization to float32 happens in the
consumer's process (``normalize=True``) or on its device (``normalize=False`` +
:func:`shards.decode.transforms.normalize_batch`). With ``decode="device"`` they hand over encoded JPEG
bytes with each image's augmentation record instead (:mod:`shards.decode.encoded`), drawn from the
same generators, and a :class:`~shards.decode.device.DeviceDecoder` decodes and augments the batch
on the consumer's device.

Unreadable members (missing, truncated, not decodable) are logged (the first few) and counted;
they never stop a run. In *training* batch shapes stay fixed: another image of the same group
takes the slot, or, when the whole group is unreadable, another image of the batch together
with its label (``index`` still names the planned sample); see :attr:`TrainStream.skipped`.
In *evaluation* nothing is substituted (it would inflate Recall@K and MAP@R): the sample is
dropped from its batch and counted in :attr:`EvalBatches.skipped`.

:func:`eval_batches` gives each rank a contiguous, disjoint part of a split (the union is
the whole split minus any unreadable samples), the same number of batches on every rank,
and the position of each sample in the split for gathering. :meth:`TrainStream.from_config` builds the training
stream from a run config.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from dmltrain.errors import UserError
from shards.config import AugmentConfig, DataConfig
from shards.decode.encoded import EncodedImages, EncodedTransform
from shards.decode.transforms import IMAGENET, EvalTransform, PixelNorm, TrainTransform, normalize_batch
from shards.manifest import Manifest, SplitInfo
from shards.read.datasets import EvalBatchDataset, TrainBatchDataset
from shards.read.sampler import PLAN_VERSION, EpochPlanner, Piece, batch_shape, eval_batch_ranges, plan_digest
from shards.storage.retries import RETRY_KINDS, IOStats

log = logging.getLogger(__name__)

DEFAULT_SHUFFLE_IMAGES = 16384  # images per shuffle window (the plan of a window, not its pixels, is in memory)


def _worker_init(_worker_id: int) -> None:
    torch.set_num_threads(1)


def _in_order(dataset: IterableDataset, loader_workers: int, first: int, pin_memory: bool) -> Iterator[dict[str, Any]]:
    """Run ``dataset`` in ``loader_workers`` processes (0: here) and yield its batches by batch number."""
    if loader_workers <= 0:
        yield from dataset
        return
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=loader_workers,
        pin_memory=pin_memory,
        worker_init_fn=_worker_init,
        prefetch_factor=2,
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
        self.io: dict[
            str, int
        ] = {}  # remote requests, bytes, retries by kind (shards.storage.retries.IOStats), all loader processes

    def add(self, batch: dict[str, Any]) -> None:
        self.count += int(batch["skipped"])
        for k, v in batch.get("io", {}).items():
            self.io[k] = self.io.get(k, 0) + int(v)
        for note in batch["notes"]:
            if self.lines < self.MAX_LINES:
                log.warning("skipped corrupt shard member %s", note)
            elif self.lines == self.MAX_LINES:
                log.warning("more corrupt shard members skipped; see the skipped count")
            self.lines += 1


def _pin_available(pin_memory: bool) -> bool:
    # page-locked memory needs CUDA; without it pinning is a no-op request (DataLoader would only warn)
    return bool(pin_memory) and torch.cuda.is_available()


def _deliver(
    images: torch.Tensor | EncodedImages, normalize: bool, pin: bool, norm: PixelNorm = IMAGENET
) -> torch.Tensor | EncodedImages:
    """The tensor handed to the caller: normalized float32 with ``norm`` (written straight into pinned memory when ``pin``)
    or the uint8 batch itself (pinned when ``pin``; the DataLoader's pin thread already did it when it ran);
    encoded batches as they are (the device decoder reads the bytes on the host)."""
    if isinstance(images, EncodedImages):
        return images
    if normalize:
        b, _, h, w = images.shape  # a grayscale channel is broadcast to 3
        return normalize_batch(images, out=torch.empty((b, 3, h, w), dtype=torch.float32, pin_memory=pin), norm=norm)
    return images.pin_memory() if pin and not images.is_pinned() else images


# -- public API -----------------------------------------------------------------------------


class TrainStream:
    """Training batches of one rank (see the module docstring); :meth:`from_config` builds it from a run config.

    ``batch_size`` is the global micro-batch over ``max_world`` ranks (default ``world_size``), and a
    step's global batch is ``grad_accum`` of them, whatever the number of ranks running:
    ``sampler="pk"``: P = batch_size × grad_accum // K classes a step, each rank's micro-batch holding
    whole classes of K images (a class with fewer than K images is sampled with replacement);
    ``sampler="random"``: single images. At fewer ranks than ``max_world`` each takes the step in more
    micro-batches (:attr:`accum`) of at most its share at ``max_world``. Labels are int64 contiguous
    training ids. A batch shape the world size cannot split is a one-line :class:`UserError` naming the
    key (:func:`shards.read.sampler.batch_shape`, the config check's own test).

    Images: ``image_size`` crops augmented as ``augment`` says (:class:`~shards.config.AugmentConfig`,
    default: RandomResizedCrop + flip), resampled with ``interpolation`` (bilinear by default). With
    ``normalize=True`` (default) float32 ``b×3×S×S`` normalized with ``norm`` (the backbone's mean and std;
    ImageNet's by default) in this process; with ``normalize=False`` the
    ``b×C×S×S`` batch as decoded (uint8, a quarter of the bytes to pin and copy; C = 1 with
    ``augment.grayscale=1``; float32 pixel values with ``augment.noise``), which the caller
    normalizes where it wants, usually after the copy to the accelerator:
    ``shards.decode.transforms.normalize_batch(images.to(device), norm=norm)``.
    ``pin_memory`` (only with CUDA) pins what is yielded: the decoded batch, or the float32 one.
    ``decode="device"``: the images of a batch come as :class:`~shards.decode.encoded.EncodedImages`
    (JPEG bytes and augmentation records, the same records the CPU path would apply), for a
    :class:`~shards.decode.device.DeviceDecoder`; ``normalize`` must then be False.

    ``shuffle_images`` bounds the shuffle window (in images of whole steps); larger mixes classes more widely.
    A resumed run sees the same steps when :meth:`plan_signature` is unchanged (shards, seed, batch
    settings; not the world size: ``loader_workers``, ``normalize`` and the augmentation do not matter
    either): store it with the (epoch, step) position and resume mid-epoch only under an equal one.
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
        grad_accum: int = 1,
        max_world: int | None = None,
        seed: int = 0,
        image_size: int = 224,
        augment: AugmentConfig | None = None,
        loader_workers: int = 2,
        shuffle_images: int = DEFAULT_SHUFFLE_IMAGES,
        pin_memory: bool = False,
        draft: bool = True,
        normalize: bool = True,
        decode: str = "cpu",
        storage_options: dict[str, Any] | None = None,
        remote: Any = None,
        norm: PixelNorm = IMAGENET,
        interpolation: str | None = None,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if decode not in ("cpu", "device") or (decode == "device" and normalize):
            raise ValueError(
                f"decode={decode!r}: choose 'cpu', or 'device' with normalize=False (the device decoder normalizes)"
            )
        self.decode = decode
        self.manifest = Manifest.load(shard_dir, storage_options, remote)
        self.split = self.manifest.split(split)
        try:
            shape = batch_shape(
                sampler, batch_size, samples_per_class, world_size, grad_accum=grad_accum, max_world=max_world
            )
        except ValueError as e:
            raise UserError(str(e)) from None
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.sampler, self.batch_size, self.samples_per_class = sampler, batch_size, shape.k
        self.grad_accum, self.shape = grad_accum, shape
        self.accum = shape.accum  # micro-batches per step at this world size
        self.local_batch_size = shape.local_batch_size
        self.loader_workers, self.pin_memory, self.normalize = loader_workers, pin_memory, bool(normalize)
        self.table = self.split.group_table()
        self.planner = EpochPlanner(
            self.table,
            k=shape.k,
            pieces_per_step=shape.pieces_per_step,
            seed=self.seed,
            window_steps=max(1, shuffle_images // (shape.pieces_per_step * shape.k)),
        )
        self.steps_per_epoch = self.planner.steps_per_epoch
        self.batches_per_epoch = self.steps_per_epoch * self.accum  # this rank's micro-batches
        if self.steps_per_epoch == 0:
            unit = f"groups of K = {shape.k}" if shape.class_balanced else "images"
            raise UserError(
                f"{self.manifest.path}: split {split!r} has {self.planner.total_pieces} {unit}, fewer than one step's "
                f"global batch ({shape.pieces_per_step}); lower data.batch_size or train.grad_accum"
            )
        self.num_classes = self.split.num_labels
        self.norm = norm
        self.transform = TrainTransform(image_size, augment, draft=draft, norm=norm, interpolation=interpolation)
        self._skips = _SkipLog()

    @classmethod
    def from_config(
        cls,
        data: DataConfig,
        seed: int,
        rank: int,
        world_size: int,
        *,
        loader_workers: int | None = None,
        normalize: bool = True,
        pin_memory: bool = False,
        draft: bool = True,
        decode: str = "cpu",
        grad_accum: int = 1,
        max_world: int | None = None,
    ) -> TrainStream:
        """The training stream a run's ``data`` section describes (shards, train split, sampler, P×K, image
        size, augmentation, normalization and resampling, loader processes), drawn from ``seed``, for ``rank``
        of ``world_size``; ``grad_accum`` (``train.grad_accum``) and ``max_world`` (the largest
        ``cluster.num_workers``) as in the constructor.

        The keywords are how this process consumes it: ``loader_workers`` (default
        ``data.loader_workers``), ``normalize``, ``pin_memory``, ``draft`` and ``decode`` (resolved:
        ``cpu`` or ``device``; see :func:`resolve_decode` for ``data.decode``) as in the constructor.
        """
        d = data
        return cls(
            d.shards,
            d.train_split,
            rank=rank,
            world_size=world_size,
            sampler=d.sampler,
            batch_size=d.batch_size,
            samples_per_class=d.samples_per_class,
            grad_accum=grad_accum,
            max_world=max_world,
            seed=seed,
            image_size=d.image_size,
            augment=d.augment,
            loader_workers=d.loader_workers if loader_workers is None else loader_workers,
            pin_memory=pin_memory,
            draft=draft,
            normalize=normalize,
            decode=decode,
            storage_options=d.storage_options,
            remote=d.remote,
            norm=PixelNorm.of(d.mean, d.std),
            interpolation=d.interpolation,
        )

    @property
    def skipped(self) -> int:
        """Corrupt or truncated members met so far (each replaced; counted per occurrence)."""
        return self._skips.count

    @property
    def remote(self) -> bool:
        """Whether the shards are read from a URL (the same on every rank of a run)."""
        return self.manifest.location.remote

    def io_counts(self) -> dict[str, float]:
        """Remote reads so far on this rank, all loader processes: ``requests``, ``bytes``, ``retries`` and
        ``retries/<kind>`` (timeout, throttled, server_error, connection, truncated), ``failed``, ``cache_downloads``;
        always the same keys in the same order (empty for local shards)."""
        if not self.remote:
            return {}
        io = self._skips.io
        out = {k: float(io.get(k, 0)) for k in IOStats.COUNTERS}
        out["retries"] = float(sum(io.get(f"retries/{k}", 0) for k in RETRY_KINDS))
        return out

    def plan_signature(self) -> dict[str, Any]:
        """Everything that decides which samples each (epoch, step) gets, as a JSON-ready dict.

        Keys: ``plan_version``, ``split``, ``sampler``, ``batch_size``, ``grad_accum``,
        ``samples_per_class``, ``seed``, ``shuffle_window_steps``, ``manifest_digest``
        (:func:`plan_digest`); not the world size, which only decides each rank's part. A position
        (epoch, step) saved with one signature continues the same steps only under an equal
        signature; under another, resume at the next epoch boundary (``start_batch=0``). The same on
        every rank and at every worker count.
        """
        return {
            "plan_version": PLAN_VERSION,
            "split": self.split.name,
            "sampler": self.sampler,
            "batch_size": self.batch_size,
            "grad_accum": self.grad_accum,
            "samples_per_class": self.samples_per_class,
            "seed": self.seed,
            "shuffle_window_steps": self.planner.window_steps,
            "manifest_digest": plan_digest(self.split, self.table),
        }

    def plan(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[int, list[Piece]]]:
        """This rank's micro-batches' content, ``(index, pieces)`` (group, label, positions), without reading any image."""
        for mb in self.planner.batches(
            epoch, rank=self.rank, world_size=self.world_size, accum=self.accum, start=start_batch
        ):
            yield mb.index, mb.pieces

    def epoch(
        self, epoch: int, start_batch: int = 0, *, with_index: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """``(images, labels)`` (``+ index`` of each sample in the split with ``with_index``) for micro-batches
        ``start_batch .. batches_per_epoch - 1`` of ``epoch`` on this rank (step ``s`` is micro-batches
        ``s × accum .. s × accum + accum - 1``).

        ``start_batch`` must lie in ``0..batches_per_epoch`` (the end: nothing left), else
        :class:`UserError` right here, before any batch: a position saved under another plan
        (see :meth:`plan_signature`) cannot be resumed mid-epoch.
        """
        if (
            isinstance(start_batch, bool)
            or not isinstance(start_batch, (int, np.integer))
            or not 0 <= start_batch <= self.batches_per_epoch
        ):
            raise UserError(
                f"start_batch {start_batch!r}: outside 0..{self.batches_per_epoch}, the micro-batches per epoch of split "
                f"{self.split.name!r} of {self.manifest.root} at world size {self.world_size}, batch size {self.batch_size}; "
                f"a position saved under another plan (plan_signature) cannot be resumed mid-epoch: start the next epoch"
            )
        return self._epoch(int(epoch), int(start_batch), with_index)

    def _epoch(self, epoch: int, start_batch: int, with_index: bool) -> Iterator[tuple[torch.Tensor, ...]]:
        if start_batch == self.batches_per_epoch:
            return
        transform = EncodedTransform(self.transform) if self.decode == "device" else self.transform
        ds = TrainBatchDataset(
            self.split,
            self.table,
            self.planner,
            transform,
            epoch=epoch,
            start=start_batch,
            rank=self.rank,
            world_size=self.world_size,
            accum=self.accum,
            seed=self.seed,
        )
        pin = _pin_available(self.pin_memory) and self.decode == "cpu"
        n, skipped_before = 0, self.skipped
        # the loader pins uint8 batches itself; normalized ones are written straight into pinned memory here
        for item in _in_order(ds, self.loader_workers, start_batch, pin and not self.normalize):
            self._skips.add(item)
            images = _deliver(item["images"], self.normalize, pin, self.norm)
            n += 1
            yield (images, item["labels"], item["index"]) if with_index else (images, item["labels"])
        if n != self.batches_per_epoch - start_batch:
            raise RuntimeError(
                f"rank {self.rank}: epoch {epoch} produced {n} batches, expected {self.batches_per_epoch - start_batch}"
            )
        if self.skipped > skipped_before:
            new = self.skipped - skipped_before
            log.warning(
                "rank %d epoch %d: %d corrupt shard members skipped (%d so far)", self.rank, epoch, new, self.skipped
            )


class EvalBatches:
    """The iterable :func:`eval_batches` returns: ``(images, labels, index)`` batches of one rank's share.

    Each pass reads the shards again. ``skipped`` is the number of this rank's samples left out of
    the latest pass because their member was missing, truncated or would not decode (0 before a
    pass); ``num_samples`` is the size of the whole split (all ranks), ``len()`` the batches per pass.
    """

    def __init__(
        self,
        info: SplitInfo,
        root: Path,
        ranges: list[tuple[int, int]],
        transform: EvalTransform,
        *,
        rank: int,
        loader_workers: int,
        pin_memory: bool,
        normalize: bool,
        norm: PixelNorm = IMAGENET,
    ):
        self.split, self.root, self.ranges, self.transform = info, root, ranges, transform
        self.rank, self.loader_workers, self.pin_memory, self.normalize = rank, loader_workers, pin_memory, normalize
        self.norm = norm
        self.num_samples = info.num_images
        self.skipped = 0
        self.io: dict[
            str, int
        ] = {}  # remote requests and retries of the latest pass (shards.storage.retries.IOStats keys)

    def __len__(self) -> int:
        return len(self.ranges)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        self.skipped = 0
        skips = _SkipLog()
        ds = EvalBatchDataset(self.split, self.split.group_table(), self.ranges, self.transform)
        pin = _pin_available(self.pin_memory)
        for item in _in_order(ds, self.loader_workers, 0, pin and not self.normalize):
            skips.add(item)
            self.skipped, self.io = skips.count, skips.io
            yield _deliver(item["images"], self.normalize, pin, self.norm), item["labels"], item["index"]
        if self.skipped:
            log.warning(
                "rank %d: %d unreadable samples of split %r (%s) left out of the evaluation",
                self.rank,
                self.skipped,
                self.split.name,
                self.root,
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
    grayscale: int = 0,
    loader_workers: int = 2,
    pin_memory: bool = False,
    draft: bool = True,
    normalize: bool = True,
    storage_options: dict[str, Any] | None = None,
    remote: Any = None,
    norm: PixelNorm = IMAGENET,
    interpolation: str | None = None,
    samples: tuple[int, int] | None = None,
) -> EvalBatches:
    """``(images, labels, index)`` batches of ``rank``'s contiguous share of ``split`` (an :class:`EvalBatches`);
    with ``samples = (lo, hi)`` of the split's samples ``lo <= index < hi`` alone (one rank: a chunk of a large
    split, as ``dmltrain embed`` reads it).

    Every rank yields the same number of batches (sizes may differ by one; a batch is empty
    only when the split has fewer samples than ranks × batches). Labels are the split's label
    space (In-Shop query and gallery share it); ``index`` is each sample's position in the
    split. An unreadable sample is *dropped*, never replaced (a stand-in image would inflate
    the retrieval metrics): its batch comes out smaller, its index is absent, it is logged and
    counted in the returned object's ``skipped``. Images: shorter side to ``resize``, centre
    ``crop``, ``grayscale`` and ``interpolation`` as in training (:class:`shards.decode.transforms.EvalTransform`);
    otherwise as in :class:`TrainStream` (``normalize`` with ``norm``, ``pin_memory``, and for a URL
    ``storage_options``, ``remote``).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    manifest = Manifest.load(shard_dir, storage_options, remote)
    info = manifest.split(split)
    if samples is None:
        ranges = eval_batch_ranges(info.num_images, world_size, rank, batch_size)
    else:
        lo, hi = samples
        if not 0 <= lo <= hi <= info.num_images or world_size != 1:
            raise ValueError(f"samples {samples} outside split {split!r} of {info.num_images}, or world_size > 1")
        ranges = [(s, min(s + batch_size, hi)) for s in range(lo, hi, batch_size)]
    return EvalBatches(
        info,
        manifest.root,
        ranges,
        EvalTransform(resize, crop, draft=draft, grayscale=grayscale, interpolation=interpolation),
        rank=rank,
        loader_workers=loader_workers,
        pin_memory=pin_memory,
        normalize=normalize,
        norm=norm,
    )
