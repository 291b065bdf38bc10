"""BatchNorm over the global batch: every worker normalizes with the statistics of all workers' samples.

``model.sync_bn`` replaces each BatchNorm layer by :class:`SyncBatchNorm` (:func:`convert_sync_batchnorm`,
called where the trainer builds its model). With small per-worker batches (a P×K batch split
over W workers holds P/W classes each) plain BatchNorm would normalize every worker's features
over a few classes; with it, a training step sees the statistics one process holding the whole
global batch would see, and its gradients account for them.

On CUDA (NCCL) this is torch's :class:`torch.nn.SyncBatchNorm`. torch's kernels refuse CPU
tensors, so on the CPU (gloo) the same computation runs here, with torch's CPU BatchNorm kernels
for the local work and one all-reduce each way, as torch's CUDA layer has: forward sums every
worker's count, sum and sum of squares (in float64, built from its exact local mean and
variance, so nothing cancels), backward sums ``dy`` and ``dy·(x - mean)``, so each worker's input
gradient includes every worker's contribution. Scale and shift gradients stay local, as in
torch: the data-parallel reduction sums them. Alone (no process group or one
worker), in eval mode, or with frozen statistics it is plain BatchNorm. Parameter and buffer
names are BatchNorm's, so checkpoints load either way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from dmltrain.distributed.collectives import all_reduce_sum, group_rank_size


class _SyncBatchNormCPU(torch.autograd.Function):
    """BatchNorm with the statistics of the whole process group: one all-reduce forward, one backward.

    Returns the normalized ``x`` and, for the running statistics, the group's mean and unbiased variance
    (not differentiable). Backward returns the local scale and shift gradients, as torch does.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group
    ) -> tuple[Tensor, Tensor, Tensor]:
        # torch's BatchNorm kernel: the local mean and biased variance, several times faster than var_mean
        local_mean, local_var = torch.batch_norm_update_stats(x, None, None, 0.0)
        count = x.numel() // x.shape[1]
        m, v = local_mean.double(), local_var.double()
        summed = all_reduce_sum(torch.cat([m * count, (v + m * m) * count, m.new_full((1,), count)]), group)
        c = x.shape[1]
        n = summed[-1]
        mean = summed[:c] / n
        var = (summed[c : 2 * c] / n - mean * mean).clamp_(min=0)
        # statistics and affine parameters in float32 for a bf16 input: torch's CPU kernels' mixed-type path
        acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        weight_acc = weight.to(acc) if weight is not None else None
        mean_x, var_x = mean.to(acc), var.to(acc)
        out = F.batch_norm(x, mean_x, var_x, weight_acc, bias.to(acc) if bias is not None else None, False, 0.0, eps)
        invstd = torch.rsqrt(var_x + eps)
        ctx.save_for_backward(x, weight_acc, mean_x, invstd)
        ctx.param_dtype = weight.dtype if weight is not None else None
        ctx.group, ctx.n = group, n
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var * n / (n - 1).clamp(min=1)

    @staticmethod
    def backward(ctx, dy: Tensor, _mean, _var):
        x, weight, mean, invstd = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # torch's kernel gives the local sums: grad_weight = Σ dy·(x - mean)·invstd, grad_bias = Σ dy
        _, local_w, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, weight, None, None, mean, invstd, True, 0.0, [False, True, True]
        )
        dtype = ctx.param_dtype
        grad_w, grad_b = (local_w.to(dtype) if need_w else None), (sum_dy.to(dtype) if need_b else None)
        grad_x = None
        if need_x:
            c = x.shape[1]
            sums = all_reduce_sum(torch.cat([sum_dy, local_w / invstd]).double(), ctx.group) / ctx.n
            mean_dy, mean_dy_xmu = sums[:c].to(invstd.dtype), sums[c:].to(invstd.dtype)
            scale = invstd if weight is None else invstd * weight
            # dx = (dy - mean_dy - (x - mean)·invstd²·mean_dy_xmu)·invstd·w, as per-channel a·dy + b·x + c
            b = -scale * invstd * invstd * mean_dy_xmu
            c0 = -scale * mean_dy - b * mean
            shape = [1, -1] + [1] * (x.dim() - 2)
            grad_x = torch.addcmul(c0.view(shape), x, b.view(shape)).addcmul_(dy, scale.view(shape)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """:class:`torch.nn.SyncBatchNorm` that also synchronizes CPU tensors (gloo); see the module docstring."""

    def forward(self, input: Tensor) -> Tensor:
        if input.device.type != "cpu":
            return super().forward(input)
        if not (self.training and group_rank_size(self.process_group)[1] > 1):
            return _BatchNorm.forward(
                self, input
            )  # plain BatchNorm: torch's class refuses CPU tensors before falling back
        self._check_input_dim(input)
        out, mean, var = _SyncBatchNormCPU.apply(input, self.weight, self.bias, self.eps, self.process_group)
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            with torch.no_grad():  # torch's update: the unbiased variance of the global batch
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(var.to(self.running_var.dtype), momentum)
        return out


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """``module`` with every BatchNorm layer (1d/2d/3d, backbone and head) replaced by :class:`SyncBatchNorm`
    sharing its parameters and buffers (same device and dtype, same train/eval mode); returns the module
    (a new one when ``module`` itself is a BatchNorm). Synchronizes over ``process_group`` (default: all workers)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            device=module.running_mean.device if module.running_mean is not None else None,
        )
        if module.affine:
            sync.weight, sync.bias = module.weight, module.bias
        sync.running_mean, sync.running_var = module.running_mean, module.running_var
        sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        return sync
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module
