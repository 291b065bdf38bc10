"""Epoch plans: which images form each step's global batch, and which part of it each rank takes.

The unit of sampling is a *piece*: K images of one class group (P×K sampler) or a single
image (random sampler). A group of ``n`` images gives ``m = max(1, round(n / K))`` pieces
per epoch from a fresh permutation of its images, so an epoch sees about every image once:

* ``n < K``: one piece, all ``n`` images plus ``K - n`` drawn with replacement from the class;
* ``n ≥ K``: ``m`` disjoint pieces; at most K/2 images are left out (different ones each
  epoch), or the last piece is topped up with images from the class's other pieces.

The plan does not depend on the number of workers. A step's global batch is ``L`` pieces
(``data.batch_size × train.grad_accum`` images: P classes of K, or single images); per epoch
(seeded by ``(seed, epoch)``) the shards are put in a random order, the pieces of their groups
laid end to end, the sequence rotated by a random offset and cut into ``L`` *lanes* of
``steps_per_epoch`` pieces; lane ``i`` gives the ``i``-th piece of every step. The few pieces past
the last full step are dropped (different ones each epoch). Each lane is shuffled in windows of
``window_steps`` steps (the shuffle buffer: a plan, not a copy of data; the last window also takes
the remainder). So the global batch of step ``s`` of an epoch is a pure function of (seed, epoch, s,
shards, L, K, window), and a class repeats within a step only where a lane boundary cuts its group,
or when it has more pieces than a lane (two pieces of K positives: harmless to any loss).

Whichever ``W`` workers run take each step in ``accum`` micro-batches (:class:`BatchShape`):
micro-batch ``j`` is the ``j``-th run of ``L / accum`` pieces, and rank ``r`` takes the ``r``-th
``L / (accum × W)`` of it. A rank therefore reads ``L / W`` whole lanes, contiguous stretches
of the shards, and a resume at another ``W`` (or another accumulation) continues the same steps:
``batches(epoch, start=...)`` is a pure function of (epoch, rank, W, accum, start).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from shards.manifest import GroupTable, SplitInfo

_ORDER, _PIECES, _WINDOW = 0x0D3E, 0x91EC, 0x317D
PLAN_VERSION = 2  # bump when this module changes which samples a (seed, epoch, step) plan names; 2: W-independent
SAMPLERS = ("pk", "random")


@dataclass(frozen=True)
class BatchShape:
    """How a step's global batch splits over the ``world_size`` workers running now.

    A step is ``pieces_per_step`` pieces of ``k`` images (``data.batch_size × train.grad_accum``
    images, whatever the worker count): P×K (``sampler="pk"``) pieces are classes of K images,
    random ones single images. Each worker takes it in ``accum`` micro-batches of ``pieces_per_rank``
    pieces. Build it with :func:`batch_shape`.
    """

    sampler: str
    batch_size: int  # data.batch_size: the global micro-batch at the largest worker count
    k: int
    world_size: int
    accum: int  # micro-batches per step at this worker count
    pieces_per_step: int

    @property
    def pieces_per_rank(self) -> int:
        return self.pieces_per_step // (self.accum * self.world_size)

    @property
    def local_batch_size(self) -> int:
        return self.pieces_per_rank * self.k

    @property
    def class_balanced(self) -> bool:
        return self.sampler == "pk"


def batch_shape(
    sampler: str,
    batch_size: int,
    samples_per_class: int,
    world_size: int,
    classes_per_batch: int | None = None,
    *,
    grad_accum: int = 1,
    max_world: int | None = None,
) -> BatchShape:
    """The :class:`BatchShape` of a step over ``world_size`` workers, or :class:`ValueError` with the
    one-line message that names the key at fault (the config check and the stream share it).

    ``batch_size`` (P × K for P×K) is the global micro-batch of ``max_world`` workers (default
    ``world_size``), ``grad_accum`` micro-batches a step. At fewer workers a step keeps its
    ``batch_size × grad_accum`` images and the accumulation grows instead: the fewest micro-batches
    that split the step evenly without a worker's micro-batch outgrowing its share at ``max_world``
    (its memory). ``classes_per_batch`` (P), when given, must agree with ``batch_size`` = P × K.
    """
    w, top = world_size, max_world or world_size
    if w < 1:
        raise ValueError(f"cluster.num_workers: must be >= 1, got {w}")
    if top < w:
        raise ValueError(f"cluster.num_workers: {w} workers, more than the largest count {top}")
    if batch_size < 1:
        raise ValueError(f"data.batch_size: must be >= 1, got {batch_size}")
    if grad_accum < 1:
        raise ValueError(f"train.grad_accum: must be >= 1, got {grad_accum}")
    if sampler == "random":
        k = 1
        if batch_size % top:
            raise ValueError(f"data.batch_size: {batch_size} is not divisible by cluster.num_workers = {top}")
    elif sampler == "pk":
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
        if (batch_size // k) % top:
            raise ValueError(
                f"data.classes_per_batch: P = {batch_size // k} classes cannot be split evenly over "
                f"cluster.num_workers = {top} (each class's K images stay on one worker)"
            )
    else:
        raise ValueError(f"data.sampler: {sampler!r} is not 'pk' or 'random'")
    per_step = batch_size // k * grad_accum
    share = batch_size // k // top  # a worker's pieces per micro-batch at the largest count: the memory bound
    accum = next(
        (a for a in range(1, per_step // w + 1) if per_step % (w * a) == 0 and per_step // (w * a) <= share), None
    )
    if accum is None:
        what = f"P = {per_step} classes" if sampler == "pk" else f"{per_step} images"
        raise ValueError(
            f"cluster.num_workers: at {w} workers the {what} of a step (data.batch_size × train.grad_accum) cannot be "
            f"split evenly{' (each class stays on one worker)' if sampler == 'pk' else ''}; use worker counts "
            f"that divide {per_step}"
        )
    return BatchShape(sampler, batch_size, k, w, accum, per_step)


@dataclass(frozen=True)
class Piece:
    group: int  # row of the group table
    label: int
    positions: tuple[int, ...]  # sample positions inside the group


class MicroBatch(NamedTuple):
    """One micro-batch of one rank: its index in the rank's epoch (``step × accum + j``), its pieces, the
    step it belongs to, and the position of its first image among the step's global batch."""

    index: int
    pieces: list[Piece]
    step: int
    first_slot: int


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
    """The global batch of every step of every epoch, computed from a :class:`GroupTable`, and each rank's part.

    ``pieces_per_step`` (L, the lanes) pieces of ``k`` images make a step, whatever the worker count.
    """

    def __init__(self, table: GroupTable, *, k: int, pieces_per_step: int, seed: int, window_steps: int):
        if k < 1 or pieces_per_step < 1 or window_steps < 1:
            raise ValueError("k, pieces_per_step and window_steps must be >= 1")
        self.table = table
        self.k, self.per_step = k, pieces_per_step
        self.seed, self.window_steps = int(seed), window_steps
        self.pieces = pieces_per_group(table.count, k)
        self.total_pieces = int(self.pieces.sum())
        self.steps_per_epoch = self.total_pieces // pieces_per_step
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

    # -- public -----------------------------------------------------------------------------
    def batches(
        self, epoch: int, *, rank: int = 0, world_size: int = 1, accum: int = 1, start: int = 0
    ) -> Iterator[MicroBatch]:
        """``rank``'s micro-batches of ``epoch`` among ``world_size`` workers taking each step in ``accum``
        micro-batches, from micro-batch ``start`` (``step × accum + j``) to the end of the epoch."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        p = self.per_step // (world_size * accum)
        if p < 1 or p * world_size * accum != self.per_step:
            raise ValueError(f"{self.per_step} pieces a step do not split into {accum} × {world_size} equal parts")
        steps = self.steps_per_epoch
        if steps == 0 or start >= steps * accum:
            return
        # this rank's piece positions in a step (= its lanes), micro-batch by micro-batch
        firsts = [j * world_size * p + rank * p for j in range(accum)]
        lanes = np.concatenate([np.arange(f, f + p) for f in firsts])
        gseq, cum, offset = self._sequence(epoch)
        ws = self.window_steps
        n_windows = max(1, steps // ws)  # the last window takes the remainder: no tiny tail window
        for w in range(min(start // accum // ws, n_windows - 1), n_windows):
            s0 = w * ws
            s1 = steps if w == n_windows - 1 else s0 + ws
            # lane i holds sequence positions offset + i * steps + s, shuffled within the window
            order = np.stack(
                [s0 + np.random.default_rng([self.seed, epoch, int(i), w, _WINDOW]).permutation(s1 - s0) for i in lanes]
            )
            positions = (offset + lanes[:, None] * steps + order) % self.total_pieces
            flat = self._pieces_at(epoch, gseq, cum, positions.ravel(), {})
            width = s1 - s0
            for s in range(s0, s1):
                for j in range(accum):
                    index = s * accum + j
                    if index >= start:
                        rows = range(j * p, (j + 1) * p)
                        yield MicroBatch(index, [flat[r * width + s - s0] for r in rows], s, firsts[j] * self.k)


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
