"""The classifier's call as a pure function: :func:`~dmltrain.distributed.sharded_softmax.sharded_softmax`.

Tensors and one frozen plan in, the loss and its statistics out, through ``torch.autograd.grad`` like any
differentiable function, and nothing of the module that lent its buffers changed by a call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from distributed_reference import dense_classifier_loss, rel_err

from dmltrain.distributed import ShardedClassifier
from dmltrain.distributed.sharded_softmax import SoftmaxPlan, SoftmaxResult, SoftmaxStats, sharded_softmax


def _classifier(kind: str, C: int, D: int, ratio: float, **kw) -> ShardedClassifier:
    params = {"softmax_ce": {"smoothing": 0.1}, "normsoftmax": {"temperature": 0.1}}.get(
        kind, {"scale": 16.0, "margin": 0.3}
    )
    clf = ShardedClassifier(C, D, kind, sample_ratio=ratio, **params, **kw).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        clf.weight.copy_(torch.randn(clf.weight.shape, generator=g, dtype=torch.float64))
        if clf.bias is not None:
            clf.bias.copy_(0.1 * torch.randn(C, generator=g, dtype=torch.float64))
    return clf


@pytest.mark.parametrize(
    "kind,ratio,extra",
    [("arcface", 1.0, {}), ("cosface", 0.5, {"subcenters": 3}), ("softmax_ce", 0.5, {}), ("normsoftmax", 0.4, {})],
)
def test_autograd_grad_through_the_function_equals_the_float64_reference(kind, ratio, extra):
    """``torch.autograd.grad`` over the embeddings, the weight and the bias of a call whose plan hands no
    row gradient over (``row_grads=None``): every gradient comes back through autograd, dense, equal to the
    independent float64 reference's; nothing is written to ``.grad``."""
    C, D, B = 30, 8, 12
    clf = _classifier(kind, C, D, ratio, **extra)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, D, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, C, (B,), generator=g)
    xg = F.normalize(x, dim=1) if clf.spec.normalized else x
    active = clf.draw(y, 0, xg.detach())
    plan = dataclasses.replace(clf.plan(active, need_grad=True), row_grads=None)
    w = clf.weight.detach().clone().requires_grad_(True)
    b = None if clf.bias is None else clf.bias.detach().clone().requires_grad_(True)
    result = sharded_softmax(xg, w, b, y, plan)
    assert isinstance(result, SoftmaxResult) and isinstance(result.stats, SoftmaxStats)
    inputs = [x, w] + ([] if b is None else [b])
    grads = torch.autograd.grad(result.loss, inputs)

    rows = _drawn(active)
    refs = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref = dense_classifier_loss(
        refs[0], y, refs[1], refs[2] if b is not None else None, kind, clf.params, rows, extra.get("offsets")
    )
    ref_grads = torch.autograd.grad(ref, refs)
    assert rel_err(result.loss.detach(), ref.detach()) < 1e-12
    assert rel_err(result.stats.loss, ref.detach()) < 1e-12
    for name, got, want in zip(("embeddings", "weight", "bias"), grads, ref_grads):
        assert got.dtype == torch.float64, name
        assert rel_err(got, want) < 1e-10, name
    assert clf.weight.grad is None and (clf.bias is None or clf.bias.grad is None)


def test_the_row_grad_hand_off_is_the_one_write_outside_autograd():
    """With the module's plan (``row_grads`` set) ``torch.autograd.grad`` over the embeddings returns their
    gradient, as the reference's, and the rows' gradient lands in ``.grad`` (the documented hand-off)."""
    C, D, B = 30, 8, 12
    clf = _classifier("arcface", C, D, 0.5)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, D, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, C, (B,), generator=g)
    xg = F.normalize(x, dim=1)
    active = clf.draw(y, 3, xg.detach())
    result = sharded_softmax(xg, clf.weight, None, y, clf.plan(active, need_grad=True))
    (gx,) = torch.autograd.grad(result.loss, [x])
    rows = _drawn(active)
    xr, wr = x.detach().clone().requires_grad_(True), clf.weight.detach().clone().requires_grad_(True)
    ref = dense_classifier_loss(xr, y, wr, None, "arcface", clf.params, rows)
    ref.backward()
    assert rel_err(gx, xr.grad) < 1e-10
    assert rel_err(clf.weight.grad, wr.grad) < 1e-10
    assert torch.equal(clf.row_grads.row_ids(), rows)


def _drawn(active) -> torch.Tensor | None:
    """The sorted drawn rows of a draw (None: every row)."""
    if active is None:
        return None
    return torch.sort(active.rows if active.count is None else active.rows[: int(active.count)]).values


def _state(clf: ShardedClassifier) -> dict:
    """Everything of the module a call could change, copied."""
    return {
        "params": {n: p.detach().clone() for n, p in clf.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in clf.named_parameters()},
        "buffers": {n: b.clone() for n, b in clf.named_buffers()},
        "stats": clf.stats,
        "calls": (clf._calls, clf._step, clf._active),
        "kept_owner": None if clf._kept_owner is None else clf._kept_owner(),
        "row_rows": clf.row_grads.rows(),
    }


def _same(a: dict, b: dict) -> None:
    for section in ("params", "grads", "buffers"):
        assert a[section].keys() == b[section].keys(), section
        for k in a[section]:
            u, v = a[section][k], b[section][k]
            assert (u is None and v is None) or torch.equal(u, v), f"{section} {k}"
    assert a["stats"] is b["stats"]
    assert a["calls"][:2] == b["calls"][:2] and a["calls"][2] is b["calls"][2]
    assert a["kept_owner"] is b["kept_owner"]
    assert a["row_rows"] is b["row_rows"]


@pytest.mark.parametrize("drop", [False, True])
def test_a_forward_without_backward_leaves_the_module_untouched(drop):
    """A call of the function, its graph then dropped without a backward: the module's parameters, gradients,
    buffers (the sub-center counts of sample dropping), statistics, call counters and row bookkeeping are as
    they were, and its kept workspace, lent to the call, is free again once the call is gone."""
    C, D, B = 24, 8, 10
    kw = {"subcenters": 3, "drop_after": 0, "drop_angle": 60.0} if drop else {}
    clf = _classifier("arcface" if drop else "normsoftmax", C, D, 0.5, **kw)
    g = torch.Generator().manual_seed(4)
    x = F.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1).requires_grad_(True)
    y = torch.randint(0, C, (B,), generator=g)
    first = clf(x, y, step=0)  # a first step: counts, stats, .grad and rows to keep
    first.backward()
    if drop:
        assert clf.subcenter_counts.sum() > 0
    before = _state(clf)
    assert before["kept_owner"] is None  # the first call's backward ended its lease, its graph still alive
    plan = clf.plan(clf.draw(y, 1, x.detach()), need_grad=True, train=True)
    assert plan.kept is clf._kept and plan.lease is not None  # lent
    assert clf._claim_kept()[1] is not clf._kept  # ... and not lent twice
    result = sharded_softmax(x, clf.weight, clf.bias, y, plan)
    if drop:
        assert result.hits is not None  # what the module would add to its counts
    assert float(result.loss.detach()) > 0
    del result, plan
    _same(before, _state(clf))
    assert clf._kept_owner is None or clf._kept_owner() is None  # the lease ended with the call
    assert clf._claim_kept()[1] is clf._kept


def test_the_plan_is_frozen():
    clf = ShardedClassifier(10, 4, "normsoftmax")
    plan = clf.plan(None, need_grad=False)
    assert isinstance(plan, SoftmaxPlan) and plan.kept is None and plan.lease is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.scale = 2.0
