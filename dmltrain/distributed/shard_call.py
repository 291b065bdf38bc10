"""One call of the sharded softmax on one shard: what its two implementations share.

A call scores the gathered batch ``x`` (``N × D``, unit rows for the normalised kinds)
against this shard's ``k_local`` active rows. :class:`ShardCall` holds what does not depend
on how the block products are computed:

* the *owned targets*: the samples whose class this shard holds among its active rows
  (``t_idx``), their column among the active rows (``t_col``) and local row (``t_row``);
* the *pair path*: each owned sample's target logit computed on its (embedding, class row)
  pair with the kind's margin (:mod:`~dmltrain.losses.kinds`), differentiated by autograd,
  ``O(targets × D)``;
* the *combine*: one all-gather of per-sample partial statistics (shard log-sum-exp, shard
  max, shard sum of logits for label smoothing, target logit and cosine) plus the active-row
  count, from which every worker gets the same loss, normalised over every active class of
  every shard.

Subclasses: :class:`~dmltrain.distributed.block_softmax.BlockSoftmax` (torch block GEMMs,
the CPU path) and :class:`~dmltrain.distributed.fused_softmax.FusedSoftmax` (Triton kernels).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dmltrain.distributed.collectives import all_gather_stack
from dmltrain.distributed.grad_rows import GradWriter, add_rows
from dmltrain.distributed.workspace import Workspace
from dmltrain.losses.kinds import ClassifierKind
from dmltrain.losses.margins import pair_cos, smoothed_nll, smoothing_weights

NORM_EPS = 1e-12


class ShardOwner(Protocol):
    """What a call reads from its classifier (:class:`~dmltrain.distributed.sharded_softmax.ShardedClassifier`)."""

    weight: Tensor
    bias: Tensor | None
    spec: ClassifierKind
    params: dict[str, float]
    class_start: int
    group: Any
    logits_budget_mb: float
    workspace: Workspace

    def grad_writer(self, rows: Tensor | None) -> GradWriter: ...

    def kept_workspace(self, call: ShardCall) -> Workspace: ...

    def release_kept(self, call: ShardCall) -> None: ...


class CallStats(Mapping[str, float]):
    """A call's statistics, kept where they were computed.

    Read as a mapping (``stats["loss"]``) they are host floats, all brought over at the first read (one
    device sync); :meth:`on_device` gives them without any sync (0-d tensors for the device values,
    floats for those known on the host), for a reader that sums them on the device and reads the
    sums back at log time.
    """

    def __init__(self, device: Mapping[str, Tensor], host: Mapping[str, float]) -> None:
        self._device, self._host = dict(device), dict(host)
        self._read: dict[str, float] | None = None

    def on_device(self) -> dict[str, Tensor | float]:
        return {**self._device, **self._host}

    def _values(self) -> dict[str, float]:
        if self._read is None:
            keys = list(self._device)
            vals = torch.stack([self._device[k].detach().double() for k in keys]).tolist() if keys else []
            self._read = {**dict(zip(keys, vals)), **self._host}
        return self._read

    def __getitem__(self, key: str) -> float:
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**self._device, **self._host})

    def __len__(self) -> int:
        return len(self._device) + len(self._host)


class ShardCall:
    """Forward and backward of one call over this shard's active rows (no autograd inside).

    ``rows``: the sorted local rows taking part (None: all). ``dtype``: the compute dtype
    (float32, or float64 for a classifier moved to float64).
    """

    def __init__(self, clf: ShardOwner, x: Tensor, labels: Tensor, rows: Tensor | None) -> None:
        self.clf, self.x, self.labels, self.rows = clf, x, labels, rows
        self.dtype = x.dtype
        self.weight = clf.weight.detach()
        self.bias = None if clf.bias is None else clf.bias.detach()
        self.spec, self.params = clf.spec, clf.params
        self.normalized = clf.spec.normalized
        self.scale = clf.spec.logit_scale(clf.params)
        self.eps = float(clf.params.get("smoothing", 0.0))
        n_local = self.weight.shape[0]
        self.k_local = n_local if rows is None else rows.numel()
        # samples whose class this shard owns: their local row and column among the active rows
        local = labels - clf.class_start
        owned = (local >= 0) & (local < n_local)
        if rows is not None and self.k_local:
            col = torch.searchsorted(rows, local.clamp(0, n_local - 1))
            owned &= rows[col.clamp(max=self.k_local - 1)] == local
        else:
            col = local
        self.t_idx = owned.nonzero().squeeze(1)
        self.t_col = col[self.t_idx]
        self.t_row = local[self.t_idx]
        self.consumed = False

    # -- the pair path ----------------------------------------------------------------------------
    def target_pairs(self, grad: bool) -> tuple[tuple[Tensor, ...], Tensor, Tensor]:
        """(leaves, target logits, target cosines) of the owned samples.

        The leaves are (embeddings, class rows[, biases]), differentiable if ``grad``;
        normalised kinds take the kind's margin on the unit rows, ``softmax_ce`` is ``x·w + b``.
        """
        xt = self.x[self.t_idx].to(self.dtype)
        wt = self.weight[self.t_row].to(self.dtype)
        leaves: tuple[Tensor, ...] = (xt, wt)
        if self.bias is not None:
            leaves = (xt, wt, self.bias[self.t_row].to(self.dtype))
        if grad:
            for t in leaves:
                t.requires_grad_(True)
        with torch.set_grad_enabled(grad):
            if self.normalized:
                wt_hat = F.normalize(wt, dim=1, eps=NORM_EPS)
                zt = self.spec.target_logit(xt, wt_hat, **self.params)
                return leaves, zt, pair_cos(xt, wt_hat).detach()
            zt = (xt * wt).sum(1) + leaves[2]
            return leaves, zt, torch.zeros_like(zt).detach()

    def pair_backward(self, G_t: Tensor, writer: GradWriter, grad_x: Tensor | None) -> None:
        """Back-propagate ``dL/d(target logit) = G_t`` through the pair path into ``grad_x``
        and the owned rows' gradients."""
        if not self.t_idx.numel():
            return
        leaves, zt, _ = self.target_pairs(grad=True)
        grads = torch.autograd.grad(zt, leaves, G_t.to(zt.dtype))
        if grad_x is not None:
            add_rows(grad_x, self.t_idx, grads[0])
        writer.add_rows(self.t_row, grads[1], grads[2] if len(grads) > 2 else None)

    # -- the combine ------------------------------------------------------------------------------
    def combine(self, lse_local: Tensor, m: Tensor, sz: Tensor, z_t: Tensor, cos_t: Tensor) -> Tensor:
        """Loss over every shard from this shard's per-sample statistics (one all-gather).

        ``lse_local``, ``m``, ``sz``: log-sum-exp, max and sum of this shard's logits per sample,
        targets included; ``z_t``, ``cos_t``: target logits and cosines of the owned samples.
        Sets ``lse`` (global, per sample), ``K`` (active classes over all shards: an int with label
        smoothing, else a device scalar), the smoothed target weights ``on``/``off`` and ``stats_tensor``
        (loss, accuracy, mean target logit, mean target cosine, K; on the device).
        """
        N, dev = self.x.shape[0], self.x.device

        def per_sample(v: Tensor) -> Tensor:
            out = torch.zeros(N, dtype=torch.float64, device=dev)
            out[self.t_idx] = v.double()
            return out

        packed = torch.cat(
            [
                torch.stack(
                    [lse_local.double(), m.double(), sz.double(), per_sample(z_t), per_sample(cos_t)]
                ).flatten(),
                torch.tensor([float(self.k_local)], dtype=torch.float64, device=dev),
            ]
        )
        allp = all_gather_stack(packed, self.clf.group)
        parts = allp[:, :-1].view(allp.shape[0], 5, N)
        lse = torch.logsumexp(parts[:, 0], 0)
        zmax = parts[:, 1].amax(0)
        sum_z, tgt, cos_tgt = parts[:, 2].sum(0), parts[:, 3].sum(0), parts[:, 4].sum(0)
        k_total = allp[:, -1].sum()
        # the active classes of all shards: read to the host only when label smoothing needs the number
        self.K = int(k_total) if self.eps else k_total
        self.on, self.off = (
            smoothing_weights(self.K, self.eps) if self.eps else (1.0, 0.0)
        )  # the smoothed target distribution
        per = smoothed_nll(lse, tgt, sum_z, self.K, self.eps)
        self.lse = lse.to(self.dtype)
        loss = per.mean().to(self.dtype)
        self.stats_tensor = torch.stack(
            [loss.double(), (tgt >= zmax).double().mean(), tgt.mean(), cos_tgt.mean(), k_total]
        )
        return loss

    def grad_scale(self, grad_out: Tensor) -> Tensor:
        """``dL_total/dL · 1/N``: the factor of every per-sample softmax gradient."""
        return grad_out.to(self.dtype) / self.x.shape[0]

    def forward(self) -> Tensor:
        raise NotImplementedError

    def backward(self, grad_out: Tensor, need_x: bool) -> Tensor | None:
        raise NotImplementedError
