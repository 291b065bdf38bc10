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
