"""Slow, independent references for the distributed tests: one process, the whole weight, float64.

Written from SPEC.md's formulas with plain autograd, sharing no code with dmltrain.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def dense_classifier_loss(
    x: Tensor,
    labels: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kind: str,
    params: dict,
    active: Tensor | None = None,
    offsets: Tensor | None = None,
    keep: Tensor | None = None,
) -> Tensor:
    """Mean softmax loss of the batch over all classes (or the sorted ``active`` class ids).

    ``weight`` ``C × k × D``: k sub-centers per class, a class's cosine the largest of theirs (its
    gradient reaches that one alone, as autograd's max gives it). ``offsets``: added to the logits of
    the ``active`` columns (the log-Q correction); ``keep``: the samples in the mean (the others dropped).
    """
    rows = torch.arange(labels.numel())
    if kind == "softmax_ce":
        logits = x @ weight.t() + bias
    else:
        xn = x / x.norm(dim=1, keepdim=True)
        if weight.dim() == 3:
            wn = weight / weight.norm(dim=2, keepdim=True)
            cos = torch.einsum("bd,ckd->bck", xn, wn).amax(2)
        else:
            wn = weight / weight.norm(dim=1, keepdim=True)
            cos = xn @ wn.t()
        if kind == "normsoftmax":
            logits = cos / params["temperature"]
        else:
            s, m = params["scale"], params["margin"]
            c = cos[rows, labels]
            if kind == "cosface":
                target = s * (c - m)
            else:  # arcface; beyond θ + m > π the monotone continuation cosθ − m·sin m
                theta = torch.acos(c.clamp(-1, 1))
                target = s * torch.where(theta + m <= math.pi, torch.cos(theta + m), c - m * math.sin(m))
            logits = (s * cos).index_put((rows, labels), target)
    if active is not None:
        labels = torch.searchsorted(active, labels)
        logits = logits[:, active]
        if offsets is not None:
            logits = logits + offsets.to(logits.dtype)
    eps = params.get("smoothing", 0.0)
    if not eps:
        per = F.cross_entropy(logits, labels, reduction="none")
    else:
        K = logits.shape[1]
        q = torch.full_like(logits, eps / (K - 1))
        q[rows, labels] = 1 - eps
        per = -(q * F.log_softmax(logits, dim=1)).sum(1)
    if keep is None:
        return per.mean()
    return per[keep].sum() / max(1, int(keep.sum()))


def rel_err(a, r) -> float:
    """max |a − r| / max |r| (0 when both vanish)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    r = torch.as_tensor(r, dtype=torch.float64)
    scale = float(r.abs().max()) if r.numel() else 0.0
    diff = float((a - r).abs().max()) if r.numel() else 0.0
    return diff / scale if scale > 0 else diff


# -- the class draw, transcribed loop by loop -----------------------------------------------------------
_M64, _M32 = (1 << 64) - 1, (1 << 32) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    x ^= x >> 16
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def reference_class_key(c: int, num_classes: int, seed: int, step: int) -> int:
    """The draw key of class ``c``: a 32-bit hash of (seed, step, c) above the class id (SPEC: uniform
    order from (seed, step) alone)."""
    h = _splitmix64(seed & _M64)
    h = _splitmix64(h ^ (step & _M64))
    h = _splitmix64(h ^ (-2 & _M64)) >> 1
    s1, s2 = h & _M32, (h >> 32) & _M32
    bits = max(1, (num_classes - 1).bit_length())
    return (_mix32((c * ((s1 | 1) & 0x7FFFFFFF) + s2) & _M32) << bits) | c


def _batch_and_others(num_classes: int, batch_labels, sample_ratio: float) -> tuple[list[int], list[int], int]:
    """(the batch's classes sorted, every other class, how many others a step draws: ``round(ratio × C) − P``,
    at least 0)."""
    batch = sorted({int(c) for c in batch_labels})
    total = max(len(batch), min(num_classes, int(sample_ratio * num_classes + 0.5)))
    return batch, [c for c in range(num_classes) if c not in set(batch)], total - len(batch)


def reference_draw(num_classes: int, batch_labels, sample_ratio: float, seed: int, step: int) -> list[int]:
    """The sorted global class ids of one step's softmax: every batch class, plus the non-batch classes
    of smallest key up to ``round(ratio × C)`` classes in all."""
    batch, others, E = _batch_and_others(num_classes, batch_labels, sample_ratio)
    others.sort(key=lambda c: reference_class_key(c, num_classes, seed, step))
    return sorted(batch + others[:E])


# -- hard-class sampling: the nearness index and the draw, transcribed -----------------------------------
def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def reference_index(weight: Tensor) -> tuple[list, list]:
    """Each class's index rows (``C × k`` lists of integer lists) and scales: the unit row times
    ``L / max|component|``, rounded, ``L = min(127, ⌊√((2²⁴ − 1)/D)⌋)`` (exact fp32 products)."""
    w = weight.double() if weight.dim() == 3 else weight.double()[:, None, :]
    D = w.shape[2]
    L = min(127, math.isqrt(((1 << 24) - 1) // D))
    codes, scales = [], []
    for c in range(w.shape[0]):
        cc, cs = [], []
        for s in range(w.shape[1]):
            u = w[c, s].float()
            u = u / u.norm()
            top = float(u.abs().max())
            cc.append([int(v) for v in torch.round(u * (L / torch.tensor(top, dtype=torch.float32))).tolist()])
            cs.append(_f32(top / L))
        codes.append(cc)
        scales.append(cs)
    return codes, scales


def reference_nearness(weight: Tensor, batch_labels, embeddings: Tensor | None = None) -> list[float]:
    """Every class's nearness to the batch: its largest index cosine to a batch sample's class, over
    every pair of sub-centers (whole-number dot products, then the two fp32 scale products); with
    ``embeddings`` (the batch as the loss sees it), to a sample's embedding, quantised as a row is."""
    codes, scales = reference_index(weight)
    if embeddings is None:
        queries = [(q, s) for b in batch_labels for q, s in zip(codes[b], scales[b])]
    else:
        q_codes, q_scales = reference_index(embeddings)
        queries = [(q[0], s[0]) for q, s in zip(q_codes, q_scales)]
    out = []
    for c in range(len(codes)):
        best = -math.inf
        for qb, sb in queries:
            for qc, sc in zip(codes[c], scales[c]):
                dot = float(sum(i * j for i, j in zip(qb, qc)))
                best = max(best, _f32(_f32(dot * sb) * sc))
        out.append(best)
    return out


def reference_hard_draw(
    num_classes: int,
    batch_labels,
    sample_ratio: float,
    seed: int,
    step: int,
    weight: Tensor,
    share: float,
    embeddings: Tensor | None = None,
) -> tuple[list[int], dict[int, float]]:
    """(sorted class ids of the step's softmax, each uniformly drawn class's log-Q offset): every batch
    class, ``H = round(share × E)`` of the others nearest the batch (ties to the smaller id), then the
    remaining ``E − H`` uniformly by key from the classes in neither; ``E = round(ratio × C) − P``."""
    batch, others, E = _batch_and_others(num_classes, batch_labels, sample_ratio)
    H = int(math.floor(E * share + 0.5))
    near = reference_nearness(weight, [int(c) for c in batch_labels], embeddings)
    hard = sorted(others, key=lambda c: (-near[c], c))[:H]
    rest = sorted(
        (c for c in others if c not in set(hard)), key=lambda c: reference_class_key(c, num_classes, seed, step)
    )
    uniform = rest[: E - H]
    pool = num_classes - len(batch) - H
    offsets = {c: math.log(pool / len(uniform)) for c in uniform}
    return sorted(batch + hard + uniform), offsets


def reference_proportional_draw(
    num_classes: int,
    batch_labels,
    sample_ratio: float,
    seed: int,
    step: int,
    weight: Tensor,
    scale: float,
    embeddings: Tensor | None = None,
) -> tuple[list[int], dict[int, float]]:
    """(sorted class ids of the step's softmax, each drawn other's offset): every batch class, then the
    ``E`` others of largest ``w + g`` (Gumbel top-E: a draw without replacement in proportion to ``exp w``),
    ``w = scale × nearness`` and ``g = −log(−log u)`` with ``u`` the class's 32 hashed key bits over 2³²;
    each drawn other's offset is ``−log(1 − exp(−exp(w − κ)))``, ``κ`` the ``(E+1)``-th largest ``w + g``."""
    batch, others, E = _batch_and_others(num_classes, batch_labels, sample_ratio)
    near = reference_nearness(weight, [int(c) for c in batch_labels], embeddings)
    bits = max(1, (num_classes - 1).bit_length())
    logw, perturbed = {}, {}
    for c in range(num_classes):
        u = ((reference_class_key(c, num_classes, seed, step) >> bits) + 0.5) / 2.0**32
        logw[c] = _f32(near[c] * scale)
        perturbed[c] = _f32(logw[c] + _f32(-math.log(-math.log(u))))
    others.sort(key=lambda c: (-perturbed[c], c))
    kappa = perturbed[others[E]]
    offsets = {c: -math.log(-math.expm1(-math.exp(logw[c] - kappa))) for c in others[:E]}
    return sorted(batch + others[:E]), offsets
