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
) -> Tensor:
    """Mean softmax loss of the batch over all classes (or the sorted ``active`` class ids)."""
    rows = torch.arange(labels.numel())
    if kind == "softmax_ce":
        logits = x @ weight.t() + bias
    else:
        xn = x / x.norm(dim=1, keepdim=True)
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
    eps = params.get("smoothing", 0.0)
    if not eps:
        return F.cross_entropy(logits, labels)
    K = logits.shape[1]
    q = torch.full_like(logits, eps / (K - 1))
    q[rows, labels] = 1 - eps
    return -(q * F.log_softmax(logits, dim=1)).sum(1).mean()


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


def reference_draw(num_classes: int, batch_labels, sample_ratio: float, seed: int, step: int) -> list[int]:
    """The sorted global class ids of one step's softmax: every batch class, plus the non-batch classes
    of smallest key up to ``round(ratio × C)`` classes in all."""
    batch = sorted({int(c) for c in batch_labels})
    total = max(len(batch), min(num_classes, int(sample_ratio * num_classes + 0.5)))
    others = [c for c in range(num_classes) if c not in set(batch)]
    others.sort(key=lambda c: reference_class_key(c, num_classes, seed, step))
    return sorted(batch + others[: total - len(batch)])
