"""The per-step class draw of class subsampling (NormSoftmax paper, sec. 4.5), on the device, and the
classifier's named seeds.

Each step the softmax holds every class of the global batch plus classes drawn uniformly without
replacement from all the others, ``T = max(P, round(sample_ratio × C))`` classes in all (``P``:
distinct classes in the global batch, ``C``: all classes). How, without a host read:

* every class ``c`` has a key, a 32-bit hash of ``(seed, step, c)`` above the class id: unique
  keys in a uniformly random order that depends on nothing else (:func:`class_keys`);
* the ``E = T − P`` drawn others are the ``E`` non-batch classes of smallest key. Each shard finds
  the ``E``-th smallest key over every shard's non-batch classes by a radix select: three or four
  rounds of a histogram of 16 key bits over its own rows (65,536 bins), summed over the shards by
  one all-reduce each (none at ``W = 1``);
* each shard keeps its batch classes and its non-batch classes of key at most that threshold.

The drawn set is a function of (seed, step, classes of the global batch) alone: the same on every
rank, after a resume, and at every world size. Device work: ``O(local classes + global batch)``.

Sizes known on the host. Every shard returns a fixed number of rows, its *capacity*: the drawn
rows first (ascending), then undrawn ones, with the drawn count on the device (:class:`ActiveRows`);
the kernels stop at the count, the torch path masks the rest, the optimizer writes them back
unchanged. At ``W = 1`` with ``round(ratio × C)`` at least the global batch, the capacity is
exactly ``round(ratio × C)`` and no count is needed. Otherwise a shard's capacity is its possible
batch classes (``min(global batch, its rows)``) plus its expected share of the others with ten
standard deviations and 16 classes to spare; a draw beyond it (probability below 1e-20) would
keep the capacity's smallest keys, every batch class among them.

Nearest classes (``loss.classifier.sampling: hard | mixed``). Given every local row's *nearness key*
(:func:`~dmltrain.distributed.class_index.nearest_keys`: unique, smallest for the class whose index
row is nearest to the batch's classes), ``H = round(share × E)`` of the ``E`` others are the
non-batch classes of smallest nearness key (``share`` 1 for ``hard``), found by the same radix
select over every shard, and the remaining ``E − H`` are drawn uniformly as above from the classes
neither in the batch nor among them. A shard may hold all ``H``: its capacity counts them in full.

Log-Q correction (``offsets``): each uniformly drawn class stood for ``pool/(E − H)`` classes (the
``pool = C − P − H`` it was drawn from); adding ``log(pool/(E − H))`` to its logit makes the
softmax's normaliser an unbiased estimate of the full one's (the batch's and the nearest classes are
in it for sure: no correction), so the sampled loss is a consistent estimator of the full softmax's.
:attr:`ActiveRows.offsets` holds the per-column offsets (0 elsewhere), on the device.

Proportional (``loss.classifier.sampling: proportional``). Given every local row's log-weight ``w``
(the logit its nearness would make), the ``E`` others are the non-batch classes of largest ``w + g``,
``g = −log(−log u)`` a standard Gumbel variable, ``u`` the 32 hashed bits of the class's key over 2³²:
a draw without replacement in proportion to ``exp w`` (Gumbel top-k), found by one radix select of the
``(E+1)``-th largest, ``κ``. Each drawn other's logit gets ``−log q``, ``q = 1 − exp(−exp(w − κ))``
its probability of being drawn given ``κ``, so the drawn others' ``exp(z)/q`` sum to an unbiased
estimate of all the others' ``exp(z)`` (Kool et al., "Stochastic Beams and Where to Find Them", 2019:
priority sampling with Gumbel keys), whose variance is small where ``w`` is close to the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmltrain.distributed.class_index import key_score, order_keys
from dmltrain.distributed.class_partition import ClassPartition
from dmltrain.distributed.collectives import all_reduce_sum, group_rank_size

_MASK64 = (1 << 64) - 1
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2**27: a 32-bit value times it stays inside int64
_DIGIT_BITS = 16


# -- seeds ------------------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int, shard: int) -> int:
    """A 63-bit generator seed mixing (seed, step, shard); nearby inputs give unrelated seeds."""
    h = _splitmix64(int(seed) & _MASK64)
    h = _splitmix64(h ^ (int(step) & _MASK64))
    h = _splitmix64(h ^ (int(shard) & _MASK64))
    return h >> 1


def init_block_seed(seed: int, block: int) -> int:
    """The generator seed of the initial rows of class block ``block`` (the same at every world size)."""
    return draw_seed(seed, block, -1)


def rounding_seed(seed: int, rank: int) -> int:
    """The seed of a bf16 weight's stochastic rounding on ``rank`` (apart from every step's class keys)."""
    return draw_seed(seed, -1, rank)


# -- class keys ---------------------------------------------------------------------------------------
def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit mixer on int64 lanes holding values below 2**32 (in place, no overflow)."""
    for last in (False, False, True):
        x.bitwise_xor_(x >> 16)
        if not last:
            x.mul_(_MIX).bitwise_and_(_M32)
    return x


def _salts(seed: int, step: int) -> tuple[int, int]:
    h = draw_seed(seed, step, -2)
    return h & _M32, (h >> 32) & _M32


def id_bits(num_classes: int) -> int:
    """Bits of a class id inside a key."""
    return max(1, (num_classes - 1).bit_length())


def class_keys(start: int, end: int, num_classes: int, seed: int, step: int, device: torch.device) -> Tensor:
    """The draw keys (int64, unique, non-negative) of classes ``start … end−1`` at ``step``:
    ``mix((a·c + b) mod 2³²) << bits(C) | c``, the odd ``a < 2³¹`` and ``b`` drawn from (seed, step),
    so each step orders the classes by another bijection."""
    if num_classes > 1 << 31:
        raise ValueError(f"class subsampling: at most 2**31 classes, got {num_classes}")
    s1, s2 = _salts(seed, step)
    ids = torch.arange(start, end, dtype=torch.int64, device=device)
    h = _mix32((ids * ((s1 | 1) & 0x7FFFFFFF)).add_(s2).bitwise_and_(_M32))
    return h.bitwise_left_shift_(id_bits(num_classes)).bitwise_or_(ids)


def target_total(num_classes: int, num_batch_classes: int, sample_ratio: float) -> int:
    """Classes in one step's softmax: ``round(sample_ratio × C)``, never fewer than the batch's classes."""
    return max(num_batch_classes, min(num_classes, round_total(num_classes, sample_ratio)))


def round_total(num_classes: int, sample_ratio: float) -> int:
    """``round(sample_ratio × C)`` (halves up), the draw's size before the batch's classes."""
    return int(sample_ratio * num_classes + 0.5)


# -- the draw -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActiveRows:
    """This shard's rows in one step's softmax.

    ``rows``: ``capacity`` local row ids, the drawn ones first (ascending), then undrawn ones;
    ``count``: how many are drawn, a 0-d device tensor, or None when all are; ``sorted_keys``:
    ascending, the drawn rows as they are and the others plus the shard's row count, for
    looking rows up with ``searchsorted``; ``offsets``: the log-Q correction of each row's logit
    (fp32, 0 but for uniformly drawn rows; None without the correction).
    """

    rows: Tensor
    count: Tensor | None
    sorted_keys: Tensor
    offsets: Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.rows.numel()


def capacity(
    partition: ClassPartition, rank: int, batch: int, sample_ratio: float, nearest_share: float = 0.0
) -> tuple[int, bool]:
    """(rows returned by :func:`draw_active` on ``rank`` for a global batch of ``batch``, all of them drawn?);
    ``nearest_share``: the share of the others taken by nearness (0: a uniform draw)."""
    C, W = partition.num_classes, partition.world_size
    n = partition.size(rank)
    R = round_total(C, sample_ratio)
    if W == 1 and R >= min(batch, C):
        return min(R, C), True
    most = max(R, min(batch, C))  # T never exceeds it
    near = min(R, math.ceil(nearest_share * R))  # H = round(share × E) with E ≤ R: all may be on this shard
    uniform = R if nearest_share == 0 else min(R, math.ceil((1 - nearest_share) * R) + 1)
    mean = uniform * n / max(1, C - min(batch, C) - near)  # the most uniformly drawn others a shard expects
    extra = min(n, math.ceil(mean + 10 * math.sqrt(mean) + 16))
    return min(n, most, min(batch, n) + near + extra), False


def _kth_smallest(keys: Tensor, candidates: Tensor, k: Tensor, bits: int, group: Any) -> Tensor:
    """The ``k``-th smallest (0-based; ``k`` a 0-d device tensor below their number) of the candidate
    keys of every shard in ``group``: keys unique and below ``2**bits``, a radix select over 16-bit digits."""
    dev = keys.device
    prefix = torch.zeros((), dtype=torch.int64, device=dev)
    rank = k.clone()
    bins = 1 << _DIGIT_BITS
    ones = candidates.to(torch.int64)
    top = -(-bits // _DIGIT_BITS) * _DIGIT_BITS
    for shift in range(top - _DIGIT_BITS, -1, -_DIGIT_BITS):
        digit = (keys >> shift).bitwise_and_(bins - 1)
        weight = ones
        if shift + _DIGIT_BITS < top:  # only the keys sharing the digits found so far
            weight = ones * ((keys >> (shift + _DIGIT_BITS)) == (prefix >> (shift + _DIGIT_BITS)))
        hist = torch.zeros(bins, dtype=torch.int64, device=dev).index_add_(0, digit, weight)
        all_reduce_sum(hist, group)
        cum = hist.cumsum(0)
        b = torch.searchsorted(cum, rank.view(1), right=True).clamp_(max=bins - 1)  # first bin holding rank
        rank = rank - (cum.gather(0, b) - hist.gather(0, b)).view(())
        prefix = prefix | (b.view(()) << shift)
    return prefix


def draw_active(
    labels: Tensor,
    partition: ClassPartition,
    sample_ratio: float,
    seed: int,
    step: int,
    group: Any = None,
    nearest: Tensor | None = None,
    nearest_share: float = 1.0,
    offsets: bool = False,
    weights: Tensor | None = None,
) -> ActiveRows | None:
    """This shard's rows in step ``step``'s softmax (None: every row, the ratio reaches all classes).

    ``labels``: the global batch's class ids, the same on every rank (on the weight's device).
    ``nearest``: this shard's nearness keys (None: a uniform draw), of which ``nearest_share`` of the
    others are taken; ``offsets``: compute the log-Q correction (see the module doc). ``weights``: this
    shard's log-weights (fp32): all the others are drawn in proportion to their exponentials, each with
    its inclusion offset (see the module doc; ``nearest`` must be None).
    Collective over ``group`` when subsampling at ``W > 1`` (three or four all-reduces of 512 KiB per
    radix select: one select for a uniform or a proportional draw, two with nearest classes).
    """
    rank, _ = group_rank_size(group)
    C, N = partition.num_classes, labels.numel()
    R = round_total(C, sample_ratio)
    if R >= C:
        return None
    dev = labels.device
    start, n = partition.start(rank), partition.size(rank)
    if weights is not None and nearest is not None:
        raise ValueError("draw_active: give nearness keys or log-weights, not both")
    share = 1.0 if weights is not None else 0.0 if nearest is None else float(nearest_share)
    cap, exact = capacity(partition, rank, N, sample_ratio, share)
    local = labels - start
    own = (local >= 0) & (local < n)
    batch = torch.zeros(n + 1, dtype=torch.bool, device=dev)
    batch.index_put_((torch.where(own, local, n),), torch.ones_like(own))
    batch = batch[:n]
    keys = class_keys(start, start + n, C, seed, step, dev)
    bits = 32 + id_bits(C)
    labels_sorted = torch.sort(labels).values
    P = (labels_sorted[1:] != labels_sorted[:-1]).sum() + (N > 0)  # distinct classes of the global batch
    E = (R - P).clamp_(min=0)  # others to draw
    near_off = None
    if weights is not None:
        perturbed = weights.float() + gumbel(keys, C)
        pkeys = order_keys(perturbed, start, id_bits(C))  # smallest for the largest perturbed log-weight
        kappa = _kth_smallest(pkeys, ~batch, E, bits, group)  # the (E+1)-th: the threshold of Gumbel top-E
        near = ~batch & (pkeys < kappa)
        near_off = torch.where(near, inclusion_offsets(weights, key_score(kappa, id_bits(C))), 0.0)
        drawn_all = batch | near
        ranked = torch.where(batch, -2, pkeys)
    elif nearest is None:
        ranked = torch.where(batch, -1, keys)  # batch classes ahead of every other
        H = torch.zeros_like(E)
        drawn_all = None
    else:
        H = torch.floor(E.double() * share + 0.5).long()  # the nearest others
        tau_h = _kth_smallest(nearest, ~batch, (H - 1).clamp(min=0), bits, group)
        near = ~batch & (nearest <= torch.where(H > 0, tau_h, -1))
        U = E - H
        tau_u = _kth_smallest(keys, ~batch & ~near, (U - 1).clamp(min=0), bits, group)
        drawn_all = batch | near | (~batch & ~near & (keys <= torch.where(U > 0, tau_u, -1)))
        # batch first, then the nearest, then the uniformly drawn by key: what a full capacity would keep
        ranked = torch.where(batch, -2, torch.where(near, -1, keys))
    if exact and drawn_all is None:
        rows = torch.sort(torch.topk(ranked, cap, largest=False, sorted=False).indices).values
        return ActiveRows(rows, None, rows, _offsets(rows, batch, None, E, H, C, P, offsets))
    idx = torch.topk(ranked, cap, largest=False, sorted=False).indices if cap else ranked.new_zeros(0)
    if drawn_all is None:
        tau = _kth_smallest(keys, ~batch, (E - 1).clamp(min=0), bits, group)
        drawn = ranked.gather(0, idx) <= torch.where(E > 0, tau, -1)
    else:
        drawn = drawn_all.gather(0, idx)
    sorted_keys = torch.sort(torch.where(drawn, idx, idx + n)).values
    rows = torch.where(sorted_keys >= n, sorted_keys - n, sorted_keys)
    count = None if exact else drawn.sum()
    if exact:
        sorted_keys = rows
    if near_off is not None:  # undrawn rows are not near: offset 0
        return ActiveRows(rows, count, sorted_keys, near_off.gather(0, rows))
    near_rows = None if nearest is None else ranked.gather(0, rows) == -1
    return ActiveRows(rows, count, sorted_keys, _offsets(rows, batch, near_rows, E, H, C, P, offsets, count))


def gumbel(keys: Tensor, num_classes: int) -> Tensor:
    """Standard Gumbel noise (fp32), one independent value per class and step, from the 32 hashed bits
    of its :func:`class_keys` key."""
    u = ((keys >> id_bits(num_classes)).double() + 0.5) / 2.0**32
    return torch.log(u).neg_().log_().neg_().float()


def inclusion_offsets(weights: Tensor, kappa: Tensor) -> Tensor:
    """``−log q``, ``q = 1 − exp(−exp(w − κ))``: the probability that a class of log-weight ``w`` is among a
    Gumbel top-``E`` draw whose ``(E+1)``-th perturbed log-weight is ``κ``, given ``κ`` (priority sampling:
    the drawn classes' ``exp(z)/q`` sum to an unbiased estimate of all the others' ``exp(z)``)."""
    d = (weights.double() - kappa.double()).exp_()
    return torch.expm1(d.neg_()).neg_().clamp_(min=1e-300).log_().neg_().float()


def _offsets(
    rows: Tensor,
    batch: Tensor,
    near_rows: Tensor | None,
    E: Tensor,
    H: Tensor,
    C: int,
    P: Tensor,
    wanted: bool,
    count: Tensor | None = None,
) -> Tensor | None:
    """The log-Q correction of each active row: ``log(pool/(E − H))`` for the uniformly drawn, else 0."""
    if not wanted:
        return None
    U = E - H
    pool = C - P - H
    logw = torch.log(pool.double().clamp(min=1) / U.double().clamp(min=1)).float()
    uniform = ~batch.gather(0, rows)
    if near_rows is not None:
        uniform &= ~near_rows
    if count is not None:
        uniform &= torch.arange(rows.numel(), device=rows.device) < count
    return torch.where(uniform & (U > 0), logw, 0.0)
