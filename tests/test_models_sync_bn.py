"""SyncBatchNorm on gloo: W workers with their parts of a batch see what one process sees with the whole batch.

The reference is plain BatchNorm in one process over the concatenated global batch: outputs,
running statistics, input gradients (each worker's rows of the global gradient) and parameter
gradients (summed over the workers, as the data-parallel reduction does) must agree. Both sides run in
float64, so the comparison is of the algorithm, not of fp32 summation orders (which vary with the thread
schedule of a busy machine: a conv weight's summed gradient once differed by 2e-5 in fp32).
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_workers
from torch import nn

from dmltrain.config import ModelConfig
from dmltrain.models import build_model
from dmltrain.models.sync_bn import SyncBatchNorm, convert_sync_batchnorm

SIZES = (3, 5)  # uneven local batches: the statistics weigh each worker by its count


def _net(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 6),
        nn.BatchNorm1d(6, affine=False),
    )
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
        net[1].running_mean.uniform_(-1, 1)
    return net.to(dtype)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 3, 5, 5, generator=g) * 3 + 2  # an offset mean: catches E[x²] - mean² cancellation
    return x.double(), torch.randn(sum(SIZES), 6, generator=g).double()


def _step(net: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> dict:
    x = x.clone().requires_grad_(True)
    out = net(x)
    out2 = net(x * 0.5)  # a second step: running statistics follow the momentum rule
    ((out * weights).sum() + (out2 * weights).square().sum()).backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
        "buffers": {n: b.clone() for n, b in net.named_buffers()},
    }


def _worker(rank: int, world_size: int) -> dict:
    net = convert_sync_batchnorm(_net())
    assert isinstance(net[1], SyncBatchNorm) and isinstance(net[5], SyncBatchNorm)
    x, weights = _data()
    lo = sum(SIZES[:rank])
    res = _step(net, x[lo : lo + SIZES[rank]], weights[lo : lo + SIZES[rank]])
    net.eval()
    res["eval_out"] = net(x[lo : lo + SIZES[rank]]).detach()  # eval: running statistics, no collective
    # plain arrays: tensors would travel back as shared memory that dies with the worker
    return {k: ({n: t.numpy() for n, t in v.items()} if isinstance(v, dict) else v.numpy()) for k, v in res.items()}


@pytest.mark.multiprocess
def test_sync_batchnorm_equals_one_process_over_the_global_batch():
    ranks = run_workers(_worker, len(SIZES), timeout=120)
    ranks = [
        {
            k: ({n: torch.from_numpy(a) for n, a in v.items()} if isinstance(v, dict) else torch.from_numpy(v))
            for k, v in r.items()
        }
        for r in ranks
    ]
    x, weights = _data()
    ref_net = _net()
    ref = _step(ref_net, x, weights)
    ref_net.eval()
    ref_eval = ref_net(x).detach()
    cat = lambda key: torch.cat([r[key] for r in ranks])  # noqa: E731
    tol = {"rtol": 1e-10, "atol": 1e-10}  # float64 throughout
    torch.testing.assert_close(cat("out"), ref["out"], **tol)
    torch.testing.assert_close(cat("x_grad"), ref["x_grad"], **tol)
    for name, grad in ref["grads"].items():  # data parallelism sums the workers' parameter gradients
        torch.testing.assert_close(sum(r["grads"][name] for r in ranks), grad, **tol)
    for r in ranks:
        for name, buf in ref["buffers"].items():
            torch.testing.assert_close(r["buffers"][name], buf, **tol)
    torch.testing.assert_close(cat("eval_out"), ref_eval, **tol)
    # plain per-worker BatchNorm differs: the test can fail
    assert not torch.allclose(_net()(x[: SIZES[0]]), ref["out"][: SIZES[0]], atol=1e-3)


def test_alone_it_is_plain_batchnorm_and_keeps_names():
    x, weights = _data()
    ref_net, net = _net(), convert_sync_batchnorm(_net())
    assert list(net.state_dict()) == list(ref_net.state_dict())
    a, b = _step(ref_net, x, weights), _step(net, x, weights)  # no process group: nothing to synchronize
    torch.testing.assert_close(b["out"], a["out"])
    torch.testing.assert_close(b["x_grad"], a["x_grad"])
    model = build_model(ModelConfig(backbone="small_cnn", embedding_dim=64, head="batchnorm"))
    plain_keys = list(model.state_dict())
    converted = convert_sync_batchnorm(model)
    assert converted is model and list(model.state_dict()) == plain_keys
    n_sync = sum(isinstance(m, SyncBatchNorm) for m in model.modules())
    assert (
        n_sync == sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) > 8
    )  # backbone and head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("affine", [True, False])
def test_the_synchronized_function_in_every_precision(dtype, affine):
    """The layer's autograd function (its collectives are no-ops without a process group) against
    float64 BatchNorm: output, running statistics' inputs and all gradients, in the input's precision
    (bf16 runs torch's mixed-type kernels with float32 statistics and parameters)."""
    from dmltrain.models.sync_bn import _SyncBatchNormCPU

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 4, 5, 5, generator=g) * 3 + 2).to(dtype).requires_grad_(True)
    params = [torch.rand(4, generator=g).to(dtype).requires_grad_(True) for _ in range(2)] if affine else [None, None]
    out, mean, var = _SyncBatchNormCPU.apply(x, *params, 1e-5, None)
    dy = torch.randn(out.shape, generator=g).to(dtype)
    inputs = [x, *params] if affine else [x]
    grads = torch.autograd.grad(out, inputs, dy)
    ref_inputs = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = nn.functional.batch_norm(
        ref_inputs[0], None, None, *(ref_inputs[1:] if affine else [None, None]), True, 0.0, 1e-5
    )
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double())
    tol = {torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert out.dtype == dtype and all(gr.dtype == dtype for gr in grads)
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    x64 = x.detach().double()
    stat_tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # bf16: the kernel's own bf16 statistics
    torch.testing.assert_close(mean, x64.mean((0, 2, 3)), rtol=stat_tol, atol=1e-6)
    torch.testing.assert_close(var, x64.var((0, 2, 3)), rtol=stat_tol, atol=1e-6)
