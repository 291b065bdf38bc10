"""Epoch plans: which images form each batch of each rank, from the manifest's class groups alone.

The unit of sampling is a *piece*: K images of one class group (P×K sampler) or a single
image (random sampler). A group of ``n`` images gives ``m = max(1, round(n / K))`` pieces
per epoch from a fresh permutation of its images, so an epoch sees about every image once:

* ``n < K``: one piece, all ``n`` images plus ``K - n`` drawn with replacement from the class;
* ``n ≥ K``: ``m`` disjoint pieces; at most K/2 images are left out (different ones each
  epoch), or the last piece is topped up with images from the class's other pieces.

Per epoch (seeded by ``(seed, epoch)``, the same on every rank) the shards are put in a
random order and the pieces of their groups laid end to end; the sequence is rotated by a
random offset and cut into ``W`` equal runs of ``batches_per_epoch × pieces_per_batch``
pieces, one per rank; the few pieces past the last full global batch are dropped (different
ones each epoch). So every rank has exactly ``batches_per_epoch`` batches, known from the
manifest before any data is read, and reads contiguous stretches of the shards.

Within a rank, pieces are shuffled in windows of ``window_batches`` batches (the class-level
shuffle buffer: a plan, not a copy of data; the last window also takes the remainder). P×K
windows deal their pieces, sorted by a random per-class key, round-robin into batches, so a
batch never holds two pieces of one class when the class has no more pieces in the window
than the window has batches. A class lands on two ranks only where a run boundary cuts its
group, or when it is bigger than a shard (then it is several groups), so a global batch
repeats a class only in those rare cases (two pieces of K positives: harmless to any loss).

Everything is a pure function of (seed, epoch, rank, batch): killing a run and resuming at
(epoch, start_batch) replays the same batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shards.manifest import GroupTable, SplitInfo

_ORDER, _PIECES, _WINDOW = 0x0D3E, 0x91EC, 0x317D
PLAN_VERSION = 1  # bump when this module changes which samples a (seed, epoch, rank, batch) plan names
SAMPLERS = ("pk", "random")


@dataclass(frozen=True)
class BatchShape:
    """How one global batch splits over ranks: each rank takes ``pieces_per_rank`` pieces of ``k`` images.

    P×K (``sampler="pk"``): P = batch_size / K classes, P / W whole classes per rank.
    Random: ``k`` = 1 and batch_size / W single images per rank. Build it with :func:`batch_shape`.
    """

    sampler: str
    batch_size: int
    k: int
    world_size: int

    @property
    def pieces_per_rank(self) -> int:
        return self.batch_size // (self.k * self.world_size)

    @property
    def local_batch_size(self) -> int:
        return self.pieces_per_rank * self.k

    @property
    def class_balanced(self) -> bool:
        return self.sampler == "pk"


def batch_shape(
    sampler: str, batch_size: int, samples_per_class: int, world_size: int, classes_per_batch: int | None = None
) -> BatchShape:
    """The :class:`BatchShape` of a global batch over ``world_size`` workers, or :class:`ValueError` with the
    one-line message that names the ``data.*`` key at fault (the config check and the stream share it).

    ``classes_per_batch`` (P), when given, must agree with ``batch_size`` = P × K.
    """
    w = world_size
    if w < 1:
        raise ValueError(f"cluster.num_workers: must be >= 1, got {w}")
    if batch_size < 1:
        raise ValueError(f"data.batch_size: must be >= 1, got {batch_size}")
    if sampler == "random":
        if batch_size % w:
            raise ValueError(f"data.batch_size: {batch_size} is not divisible by cluster.num_workers = {w}")
        return BatchShape(sampler, batch_size, 1, w)
    if sampler != "pk":
        raise ValueError(f"data.sampler: {sampler!r} is not 'pk' or 'random'")
    k = samples_per_class
    if k < 1:
        raise ValueError(f"data.samples_per_class: must be >= 1, got {k}")
    if batch_size % k:
        raise ValueError(
            f"data.batch_size: {batch_size} is not divisible into P×K with K = data.samples_per_class = {k}"
        )
    if classes_per_batch is not None and classes_per_batch * k != batch_size:
        raise ValueError(
            f"data.classes_per_batch: {classes_per_batch} × samples_per_class {k} != data.batch_size {batch_size}"
        )
    p = batch_size // k
    if p % w:
        raise ValueError(
            f"data.classes_per_batch: P = {p} classes cannot be split evenly over cluster.num_workers = {w} "
            "(each class's K images stay on one worker)"
        )
    return BatchShape(sampler, batch_size, k, w)


@dataclass(frozen=True)
class Piece:
    group: int  # row of the group table
    label: int
    positions: tuple[int, ...]  # sample positions inside the group


def pieces_per_group(counts: np.ndarray, k: int) -> np.ndarray:
    """Pieces each group gives per epoch (``round(n / K)``, at least one; ``n`` when K = 1)."""
    counts = np.asarray(counts, dtype=np.int64)
    if k == 1:
        return counts.copy()
    return np.maximum(1, (2 * counts + k) // (2 * k))  # round half up, integer-exact


def group_pieces(n: int, k: int, m: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The ``m`` pieces of K positions drawn from a group of ``n`` images (see the module docstring)."""
    perm = rng.permutation(n)
    if k == 1:
        return [(int(p),) for p in perm[:m]]
    if n < k:
        fill = rng.integers(0, n, k - n)
        return [tuple(int(p) for p in np.concatenate([perm, perm[fill]]))]
    need = m * k
    if need <= n:
        return [tuple(int(p) for p in row) for row in perm[:need].reshape(m, k)]
    head = perm[: (m - 1) * k]
    tail = perm[(m - 1) * k :]
    extra = rng.choice(head, need - n, replace=False)
    out = [tuple(int(p) for p in row) for row in head.reshape(m - 1, k)]
    out.append(tuple(int(p) for p in np.concatenate([tail, extra])))
    return out


class EpochPlanner:
    """Batches of pieces for every (epoch, rank), computed from a :class:`GroupTable`.

    ``pieces_per_batch`` is per rank: P/W classes for P×K, ``batch_size / W`` images for random.
    """

    def __init__(
        self,
        table: GroupTable,
        *,
        world_size: int,
        k: int,
        pieces_per_batch: int,
        seed: int,
        class_balanced: bool,
        window_batches: int,
    ):
        if world_size < 1 or k < 1 or pieces_per_batch < 1 or window_batches < 1:
            raise ValueError("world_size, k, pieces_per_batch and window_batches must be >= 1")
        self.table = table
        self.world_size, self.k, self.per_batch = world_size, k, pieces_per_batch
        self.seed, self.class_balanced, self.window_batches = int(seed), class_balanced, window_batches
        self.pieces = pieces_per_group(table.count, k)
        self.total_pieces = int(self.pieces.sum())
        self.batches_per_epoch = self.total_pieces // (pieces_per_batch * world_size)
        shards = table.shard
        self._shard_bounds = np.searchsorted(shards, np.arange(int(shards.max()) + 2 if len(shards) else 1))

    # -- the epoch's global order ------------------------------------------------------------
    def _sequence(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(group order, cumulative pieces along it, rotation offset) of ``epoch``."""
        rng = np.random.default_rng([self.seed, epoch, _ORDER])
        b = self._shard_bounds
        order = rng.permutation(len(b) - 1)
        gseq = np.concatenate([np.arange(b[s], b[s + 1]) for s in order]) if len(order) else np.zeros(0, np.int64)
        cum = np.cumsum(self.pieces[gseq])
        offset = int(rng.integers(self.total_pieces)) if self.total_pieces else 0
        return gseq, cum, offset

    def _pieces_at(
        self, epoch: int, gseq: np.ndarray, cum: np.ndarray, positions: np.ndarray, cache: dict
    ) -> list[Piece]:
        seq_index = np.searchsorted(cum, positions, side="right")
        first = np.where(seq_index > 0, cum[np.maximum(seq_index - 1, 0)], 0)
        out = []
        for si, j in zip(seq_index.tolist(), (positions - first).tolist()):
            g = int(gseq[si])
            if g not in cache:
                rng = np.random.default_rng([self.seed, epoch, g, _PIECES])
                cache[g] = group_pieces(int(self.table.count[g]), self.k, int(self.pieces[g]), rng)
            out.append(Piece(g, int(self.table.label[g]), cache[g][j]))
        return out

    def _arrange(self, pieces: list[Piece], rng: np.random.Generator) -> list[list[Piece]]:
        nb = len(pieces) // self.per_batch
        if not self.class_balanced:
            perm = rng.permutation(len(pieces))
            return [[pieces[i] for i in perm[b * self.per_batch : (b + 1) * self.per_batch]] for b in range(nb)]
        labels = np.array([p.label for p in pieces])
        uniq, inverse = np.unique(labels, return_inverse=True)
        key = rng.random(len(uniq))[inverse]
        order = np.lexsort((np.arange(len(pieces)), key))  # by class key; a class's pieces stay adjacent
        batches = [[pieces[order[b + i * nb]] for i in range(self.per_batch)] for b in range(nb)]
        return [batches[b] for b in rng.permutation(nb)]

    # -- public -----------------------------------------------------------------------------
    def batches(self, epoch: int, rank: int, start: int = 0) -> Iterator[tuple[int, list[Piece]]]:
        """``(batch index, pieces)`` for ``rank`` in ``epoch``, from batch ``start`` to the end."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        if self.batches_per_epoch == 0 or start >= self.batches_per_epoch:
            return
        gseq, cum, offset = self._sequence(epoch)
        run = self.batches_per_epoch * self.per_batch
        wb = self.window_batches
        n_windows = max(1, self.batches_per_epoch // wb)  # the last window takes the remainder: no tiny tail window
        for w in range(min(start // wb, n_windows - 1), n_windows):
            b0 = w * wb
            b1 = self.batches_per_epoch if w == n_windows - 1 else b0 + wb
            local = np.arange(b0 * self.per_batch, b1 * self.per_batch, dtype=np.int64)
            positions = (offset + rank * run + local) % self.total_pieces
            pieces = self._pieces_at(epoch, gseq, cum, positions, {})
            rng = np.random.default_rng([self.seed, epoch, rank, w, _WINDOW])
            for i, batch in enumerate(self._arrange(pieces, rng)):
                if b0 + i >= start:
                    yield b0 + i, batch


def eval_batch_ranges(num_samples: int, world_size: int, rank: int, batch_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sample ranges of ``rank``'s eval batches: contiguous rank shares differing by at most one,
    cut into the same number of batches on every rank (sizes within one of each other, at most ``batch_size``)."""
    per_rank = -(-num_samples // world_size)
    n_batches = -(-per_rank // batch_size) if per_rank else 0
    lo = rank * num_samples // world_size
    hi = (rank + 1) * num_samples // world_size
    n = hi - lo
    out, pos = [], lo
    for i in range(n_batches):
        size = n // n_batches + (1 if i < n % n_batches else 0)
        out.append((pos, pos + size))
        pos += size
    return out


def plan_digest(split: SplitInfo, table: GroupTable | None = None) -> str:
    """SHA-256 (first 16 hex digits) of what a split contributes to a batch plan: its name, label-space size
    and class-group table (shard, label, count per group). Re-encoding the same images keeps it; a
    rebuild with another class order, seed or shard size, or other images per class, changes it."""
    t = table if table is not None else split.group_table()
    h = hashlib.sha256(f"{split.name}\0{split.num_labels}\0{len(t)}\0".encode())
    for arr in (t.shard, t.label, t.count):
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return h.hexdigest()[:16]
