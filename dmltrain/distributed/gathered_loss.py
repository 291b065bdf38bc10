"""Instance losses over the embeddings all-gathered from every worker.

``GatheredInstanceLoss(loss, group, mode)`` wraps any :class:`~dmltrain.losses.base.InstanceLoss`
and returns the loss of the *global* batch (the same value on every worker).

* ``mode="local_anchors"`` (for losses with ``decomposes = True``): each worker computes the
  terms of its own anchors against the whole gathered batch; the loss is
  ``Σ_workers total / Σ_workers count``. The gradient of each worker's output w.r.t. the
  gathered batch is its own terms' share; the gather's backward sums the shares, so each
  worker's embeddings receive exactly ∂(global loss)/∂(its embeddings).
* ``mode="full"`` (any loss): every worker computes the whole global loss; the gather's
  backward then keeps each worker's own rows of its (identical) gradient without summing.

In both modes the backbone gradient on a worker is the global loss's gradient through that
worker's samples; DeepSpeed *averages* over workers, so feed the backbone output through
:func:`~dmltrain.distributed.collectives.grad_scale` ``(emb, world_size)`` first.

``wrapper.stats`` holds the global statistics: means as Σsum / Σcount, totals summed. The
loss must report the same statistic names on every worker (they are reduced together). On a
CPU they are host floats (a mean over no anchors is left out); on an accelerator, in
``local_anchors`` mode, a :class:`~dmltrain.distributed.sharded_softmax.CallStats` that keeps them
on the device until read (a mean over no anchors reads 0), so a step never waits for them.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain.distributed.collectives import (
    all_gather_sizes,
    all_reduce_sum,
    gather_rows,
    gather_with_grad,
    group_rank_size,
)
from dmltrain.distributed.sharded_softmax import CallStats
from dmltrain.errors import ConfigError

MODES = ("local_anchors", "full")


class GatheredInstanceLoss(nn.Module):
    _MISMATCH = "GatheredInstanceLoss: {} reported different statistics on different workers"

    def __init__(self, loss: nn.Module, group: Any = None, mode: str = "local_anchors") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"GatheredInstanceLoss: mode must be one of {', '.join(MODES)}, got {mode!r}")
        name = getattr(loss, "registry_name", "") or type(loss).__name__
        if mode == "local_anchors":
            if not getattr(loss, "decomposes", False) or not hasattr(loss, "anchor_terms"):
                raise ConfigError(f"loss.instance.mode: {name} does not decompose over anchors; use mode=full")
        self.loss, self.group, self.mode = loss, group, mode
        self.stats: Mapping[str, float] = {}

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.compile`` (``model.compile_scope: instance_loss``) the loss's own computation, in place: its
        per-anchor terms (``local_anchors``) or its forward (``full``); the size exchange and the gathers around
        it stay eager (collectives, and the gathered rows' autograd function)."""
        if self.mode == "local_anchors":
            self.loss.anchor_terms = torch.compile(self.loss.anchor_terms, *args, **kwargs)
        else:
            self.loss.compile(*args, **kwargs)

    def forward(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        if embeddings.dim() != 2 or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
            raise ValueError(
                f"GatheredInstanceLoss: expected embeddings B×D and labels B, got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        rank, world = group_rank_size(self.group)
        labels = labels.to(embeddings.device)
        sizes = all_gather_sizes(embeddings.shape[0], self.group, embeddings.device)
        ref_labels = gather_rows(labels, sizes, self.group)
        if self.mode == "full":
            refs = gather_with_grad(embeddings, self.group, sizes, reduce_grad=False)
            out = self.loss(refs, ref_labels)
            self.stats = dict(getattr(self.loss, "stats", {}))
            return out
        refs = gather_with_grad(embeddings, self.group, sizes)
        start = sum(sizes[:rank])
        index = torch.arange(start, start + embeddings.shape[0], device=embeddings.device)
        terms = self.loss.anchor_terms(embeddings, labels, refs, ref_labels, index)
        return self._reduce(terms, world, embeddings)

    def _reduce(self, terms: Any, world: int, like: Tensor) -> Tensor:
        mean_keys, total_keys = sorted(terms.means), sorted(terms.totals)
        key_hash = zlib.crc32("\0".join(mean_keys + ["|"] + total_keys).encode()) % (1 << 20)
        vals = [terms.count, terms.total.detach()]
        for k in mean_keys:
            vals.extend(terms.means[k])
        vals.extend(terms.totals[k] for k in total_keys)
        packed = torch.stack([torch.as_tensor(v, device=like.device).detach().double().reshape(()) for v in vals])
        packed = torch.cat([packed, torch.tensor([float(key_hash)], dtype=torch.float64, device=like.device)])
        all_reduce_sum(packed, self.group)
        anchors = packed[0].clamp_min(1.0)
        total, count = terms.total, anchors.to(terms.total.dtype)
        # value: the global loss, bit-identical on every worker; gradient: this worker's terms / global count
        out = (total - total.detach()) / count + packed[1].to(total.dtype) / count
        totals = {k: packed[2 + 2 * len(mean_keys) + i] for i, k in enumerate(total_keys)}
        if like.device.type != "cpu":
            # no host read on an accelerator: the check fails at a later kernel, a mean over no anchors reads 0
            torch._assert_async(packed[-1] == key_hash * world, self._MISMATCH.format(type(self.loss).__name__))
            means = {k: packed[2 + 2 * i] / packed[3 + 2 * i].clamp_min(1.0) for i, k in enumerate(mean_keys)}
            self.stats = CallStats({**totals, **means, "loss": packed[1] / anchors}, {})
            return out
        host = packed.tolist()
        if host[-1] != key_hash * world:
            raise RuntimeError(self._MISMATCH.format(type(self.loss).__name__))
        stats = {k: float(v) for k, v in totals.items()}
        for i, k in enumerate(mean_keys):
            s, c = host[2 + 2 * i], host[3 + 2 * i]
            if c > 0:
                stats[k] = s / c
        stats["loss"] = host[1] / max(host[0], 1.0)
        self.stats = stats
        return out
