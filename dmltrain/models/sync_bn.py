"""BatchNorm over the global batch: every worker normalizes with the statistics of all workers' samples.

``model.sync_bn`` replaces each BatchNorm layer by :class:`SyncBatchNorm` (:func:`convert_sync_batchnorm`,
called where the trainer builds its model). With small per-worker batches (a P×K batch split
over W workers holds P/W classes each) plain BatchNorm would normalize every worker's features
over a few classes; with it, a training step sees the statistics one process holding the whole
global batch would see, and its gradients account for them.

On CUDA (NCCL) this is torch's :class:`torch.nn.SyncBatchNorm`. torch's kernels refuse CPU
tensors, so on the CPU (gloo) the same computation runs here: the per-channel count, sum and
squared deviations are summed over the process group (the mean first, then the variance
around it, in float64) and the sums' backward is again a sum over the group, so each
worker's input gradient includes every worker's contribution. Scale and shift gradients stay
local, as in torch: the data-parallel reduction sums them. Alone (no process group or one
worker), in eval mode, or with frozen statistics it is plain BatchNorm. Parameter and buffer
names are BatchNorm's, so checkpoints load either way.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dmltrain.distributed.collectives import all_reduce_sum, group_rank_size


class _SumOverGroup(torch.autograd.Function):
    """Sum of a tensor over the process group; its gradient is the sum of the gradients (every worker used it)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce_sum(grad.clone(), ctx.group), None


class SyncBatchNorm(nn.SyncBatchNorm):
    """:class:`torch.nn.SyncBatchNorm` that also synchronizes CPU tensors (gloo); see the module docstring."""

    def forward(self, input: Tensor) -> Tensor:
        if input.device.type != "cpu":
            return super().forward(input)
        if not (self.training and group_rank_size(self.process_group)[1] > 1):
            return _BatchNorm.forward(self, input)  # plain BatchNorm: torch's class refuses CPU tensors before falling back
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = input.new_full((1,), input.numel() // input.shape[1], dtype=torch.float64)
        summed = _SumOverGroup.apply(torch.cat([input.sum(dims, dtype=torch.float64), count]), self.process_group)
        n = summed[-1]
        mean = summed[:-1] / n
        centred = input - mean.to(input.dtype).view(shape)
        # the variance around the global mean (not E[x²] - mean², which cancels badly in float32 inputs)
        var = _SumOverGroup.apply(centred.pow(2).sum(dims, dtype=torch.float64), self.process_group) / n
        out = centred * torch.rsqrt(var + self.eps).to(input.dtype).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            with torch.no_grad():  # torch's update: the unbiased variance of the global batch
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_((var * n / (n - 1).clamp(min=1)).to(self.running_var.dtype), momentum)
        return out


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """``module`` with every BatchNorm layer (1d/2d/3d, backbone and head) replaced by :class:`SyncBatchNorm`
    sharing its parameters and buffers (same device and dtype, same train/eval mode); returns the module
    (a new one when ``module`` itself is a BatchNorm). Synchronizes over ``process_group`` (default: all workers)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, process_group,
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
