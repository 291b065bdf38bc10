"""Single-process checks of the distributed core: partition, class draw, row-sparse optimizers,
gradient-buffer bookkeeping, checkpoints by class and argument errors.

The multi-worker equalities live in test_distributed_multiproc.py.
"""

from __future__ import annotations

import pytest
import torch
from distributed_reference import dense_classifier_loss, reference_draw, rel_err

from dmltrain.distributed import (
    ClassPartition,
    GatheredInstanceLoss,
    RowSparseAdamW,
    RowSparseSGD,
    ShardedClassifier,
    draw_active,
    gather_state,
    grad_scale,
    load_state,
    make_classifier_optimizer,
)
from dmltrain.distributed.class_sampling import capacity, target_total
from dmltrain.distributed.row_sparse import RowSet
from dmltrain.errors import ConfigError
from dmltrain.losses.base import AnchorTerms, InstanceLoss


# -- partition ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("C,W", [(23, 4), (8, 8), (3, 5), (1, 1), (100, 7)])
def test_partition_covers_every_class_once(C, W):
    p = ClassPartition(C, W)
    bounds = p.bounds()
    assert bounds[0][0] == 0 and bounds[-1][1] == C
    assert all(bounds[r][1] == bounds[r + 1][0] for r in range(W - 1))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == C
    owner = p.owner(torch.arange(C))
    for r, (s, e) in enumerate(bounds):
        assert (owner[s:e] == r).all()


# -- the class draw ----------------------------------------------------------------------------------
def _drawn(labels: torch.Tensor, C: int, ratio: float, seed: int, step: int) -> torch.Tensor:
    """The global class ids one process (W = 1) draws: the draw's rows up to its count."""
    a = draw_active(labels, ClassPartition(C, 1), ratio, seed, step)
    return a.rows if a.count is None else a.rows[: int(a.count)]


@pytest.mark.parametrize(
    "C,B,ratio",
    [(50, 20, 0.3), (1000, 30, 0.1), (1000, 40, 0.01), (300, 200, 0.05), (7, 12, 0.5), (11318, 64, 0.001)],
)
def test_class_draw_equals_the_slow_reference(C, B, ratio):
    """The drawn classes are the reference's: every batch class plus the others of smallest key, round(ratio × C)
    in all (never fewer than the batch's classes), sorted without duplicates; the ratio at least the global batch
    draws exactly its size, without a count to read."""
    g = torch.Generator().manual_seed(C + B)
    for step in (0, 7):
        labels = torch.randint(0, C, (B,), generator=g)
        rows = _drawn(labels, C, ratio, seed=3, step=step)
        want = reference_draw(C, labels.tolist(), ratio, seed=3, step=step)
        assert rows.tolist() == want
        assert rows.numel() == target_total(C, torch.unique(labels).numel(), ratio)
        assert torch.isin(labels, rows).all()
        a = draw_active(labels, ClassPartition(C, 1), ratio, 3, step)
        assert (a.count is None) == (int(ratio * C + 0.5) >= B) and a.capacity == capacity(
            ClassPartition(C, 1), 0, B, ratio
        )[0]


def test_class_draw_depends_on_seed_and_step_only():
    C, labels = 1000, torch.tensor([3, 17, 999, 500])
    rows = _drawn(labels, C, 0.1, seed=1, step=5)
    assert torch.equal(rows, _drawn(labels.flip(0), C, 0.1, seed=1, step=5)), "reproducible from (seed, step, classes)"
    assert not torch.equal(rows, _drawn(labels, C, 0.1, seed=1, step=6)), "differs across steps"
    assert not torch.equal(rows, _drawn(labels, C, 0.1, seed=2, step=5)), "differs across seeds"
    assert target_total(1000, 200, 0.1) == 200 and target_total(1000, 4, 0.1) == 100 and target_total(10, 1, 1.0) == 10
    many = torch.arange(0, 1000, 5)  # more batch classes than the ratio allows: exactly them
    assert torch.equal(_drawn(many, C, 0.1, 0, 0), many)
    assert draw_active(labels, ClassPartition(C, 1), 0.9996, 0, 0) is None  # the ratio rounds to every class


def test_class_draw_is_uniform_over_the_other_classes():
    """Over many steps every non-batch class is drawn equally often (the draw is the same at every W:
    the multi-process tests compare each shard's part with the same reference)."""
    C, ratio, steps = 200, 0.1, 2000
    batch = torch.tensor([0, 1, 2, 3, 150])
    counts = torch.zeros(C)
    for step in range(steps):
        counts[_drawn(batch, C, ratio, seed=0, step=step)] += 1
    assert (counts[batch] == steps).all()
    others = torch.ones(C, dtype=torch.bool)
    others[batch] = False
    expected = (target_total(C, 5, ratio) - 5) / (C - 5)
    # binomial sd ≈ sqrt(p(1-p)/steps) ≈ 0.0047; allow 5 sd per class
    assert (counts[others] / steps - expected).abs().max() < 0.024, (
        counts[others].min(),
        counts[others].max(),
        expected,
    )


# -- row-sparse optimizers -----------------------------------------------------------------------------
def _grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize(
    "ours,theirs",
    [
        (
            lambda p: RowSparseSGD([p], lr=0.1, momentum=0.9, weight_decay=1e-2),
            lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=1e-2),
        ),
        (
            lambda p: RowSparseSGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
            lambda p: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        ),
        (
            lambda p: RowSparseSGD([p], lr=0.1, weight_decay=1e-2),
            lambda p: torch.optim.SGD([p], lr=0.1, weight_decay=1e-2),
        ),
        (
            lambda p: RowSparseAdamW([p], lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
            lambda p: torch.optim.AdamW([p], lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
        ),
    ],
)
def test_dense_optimizers_match_torch(ours, theirs):
    w0 = torch.randn(7, 5)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa, ob = ours(a), theirs(b)
    for g in _grads(w0.shape, 4):
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert rel_err(a.detach(), b.detach()) < 1e-6


class _FixedRows:
    """A RowGrads stand-in reporting given rows (what the classifier's does after a subsampled backward)."""

    def __init__(self) -> None:
        self.set = None

    def rows(self):
        return self.set

    def cleared(self) -> None:
        pass


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_sparse_rows_update_like_a_dense_optimizer_on_their_own_steps(name):
    """A row active at steps {0, 2} of 3 ends exactly as torch's optimizer fed only those steps."""
    make = {
        "sgd": lambda ps, rows: RowSparseSGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2, grads=rows),
        "adamw": lambda ps, rows: RowSparseAdamW(ps, lr=0.01, weight_decay=0.1, grads=rows),
    }[name]
    torch_make = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    }[name]
    w0 = torch.randn(6, 4)
    p = torch.nn.Parameter(w0.clone())
    src = _FixedRows()
    opt = make([p], src)
    active = [torch.tensor([0, 2, 5]), torch.tensor([1, 2]), torch.tensor([0, 1, 5])]
    # as the draw hands them: the counted rows first, then rows that hold no gradient (left alone)
    padded = [RowSet(torch.tensor([0, 2, 5, 3]), torch.tensor(3)), RowSet(torch.tensor([1, 2])),
              RowSet(torch.tensor([0, 1, 5, 2, 4]), torch.tensor(3))]  # fmt: skip
    grads = _grads(w0.shape, 3, seed=1)
    for rows, rowset, g in zip(active, padded, grads):
        before = p.detach().clone()
        state_before = {k: v.clone() for k, v in opt.state[p].items()}
        src.set = rowset
        p.grad = g.clone()
        opt.step()
        idle = torch.ones(6, dtype=torch.bool)
        idle[rows] = False
        assert torch.equal(p.detach()[idle], before[idle]), "rows without gradient must not move"
        for k, v in opt.state[p].items():
            assert torch.equal(v[idle], state_before[k][idle]), f"state {k} of idle rows must not change"
    for r in range(6):
        q = torch.nn.Parameter(w0[r : r + 1].clone())
        ref = torch_make([q])
        for rows, g in zip(active, grads):
            if r in rows.tolist():
                q.grad = g[r : r + 1].clone()
                ref.step()
        assert rel_err(p.detach()[r], q.detach()[0]) < 1e-6, f"row {r}"
    if name == "adamw":
        assert opt.state[p]["step"].tolist() == [2, 2, 2, 0, 0, 2]


# -- the classifier in one process ---------------------------------------------------------------------
def _batch(C=50, D=12, B=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_subsampled_steps_leave_undrawn_rows_and_state_untouched(name):
    C, D = 300, 12
    clf = ShardedClassifier(C, D, "cosface", sample_ratio=0.1, seed=3, scale=16.0, margin=0.2)
    opt = make_classifier_optimizer(clf, name, lr=0.1, momentum=0.9, weight_decay=1e-3)
    seen = []
    for step in range(4):
        x, y = _batch(C, D, seed=step)
        w_before = clf.weight.detach().clone()
        s_before = {k: v.clone() for k, v in opt.state[clf.weight].items()}
        loss = clf(x, y, step=step)
        loss.backward()
        rows = clf.active_rows
        seen.append(rows)
        assert rows.numel() == target_total(C, torch.unique(y).numel(), 0.1)
        assert torch.isin(y, rows).all()
        idle = torch.ones(C, dtype=torch.bool)
        idle[rows] = False
        # the reused gradient buffer holds exactly this step's gradient
        assert (clf.weight.grad[idle] == 0).all()
        wr = w_before.double().requires_grad_(True)
        dense_classifier_loss(x.double(), y, wr, None, "cosface", clf.params, rows).backward()
        assert rel_err(clf.weight.grad, wr.grad) < 1e-5
        assert clf.stats["active_rows"] == rows.numel() == clf.stats["active_classes"]
        opt.step()
        opt.zero_grad()
        assert torch.equal(clf.weight.detach()[idle], w_before[idle])
        for k, v in opt.state[clf.weight].items():
            assert torch.equal(v[idle], s_before[k][idle])
        assert (clf.weight.detach()[rows] != w_before[rows]).any(dim=1).all()
    assert not torch.equal(seen[0], seen[1])


def test_gradient_accumulates_without_zero_grad():
    C, D = 40, 6
    for ratio in (1.0, 0.3):
        clf = ShardedClassifier(C, D, "normsoftmax", sample_ratio=ratio, temperature=0.1)
        (x1, y1), (x2, y2) = _batch(C, D, seed=1), _batch(C, D, seed=2)
        clf(x1, y1, step=0).backward()
        r1 = clf.active_rows
        clf(x2, y2, step=1).backward()
        r2 = clf.active_rows
        w = clf.weight.detach().double().requires_grad_(True)
        ref = dense_classifier_loss(x1.double(), y1, w, None, "normsoftmax", clf.params, None if ratio == 1 else r1)
        ref = ref + dense_classifier_loss(
            x2.double(), y2, w, None, "normsoftmax", clf.params, None if ratio == 1 else r2
        )
        ref.backward()
        assert rel_err(clf.weight.grad, w.grad) < 1e-5
        expected_rows = torch.arange(C) if ratio == 1 else torch.unique(torch.cat([r1, r2]))
        assert (clf.row_grads.rows().rows is None) == (ratio == 1)
        assert torch.equal(clf.row_grads.row_ids(), expected_rows)


@pytest.mark.parametrize("ratio", [1.0, 0.3])
def test_two_forwards_before_their_backwards(ratio):
    """A call's kept logits must survive another call made before its backward."""
    C, D = 40, 6
    clf = ShardedClassifier(C, D, "arcface", sample_ratio=ratio, scale=8.0, margin=0.3)
    (x1, y1), (x2, y2) = _batch(C, D, seed=3), _batch(C, D, seed=4)
    l1 = clf(x1, y1, step=0)
    r1 = clf.active_rows
    l2 = clf(x2, y2, step=1)
    r2 = clf.active_rows
    assert clf.stats["logits_kept"] == 1.0
    l2.backward()  # the later call first
    l1.backward()
    w = clf.weight.detach().double().requires_grad_(True)
    ref = dense_classifier_loss(x1.double(), y1, w, None, "arcface", clf.params, None if ratio == 1 else r1)
    ref = ref + dense_classifier_loss(x2.double(), y2, w, None, "arcface", clf.params, None if ratio == 1 else r2)
    ref.backward()
    assert rel_err(clf.weight.grad, w.grad) < 1e-5


def test_dense_and_subsampled_calls_alternate_on_the_reused_buffer():
    C, D = 60, 6
    clf = ShardedClassifier(C, D, "normsoftmax", temperature=0.1)
    for step, ratio in enumerate([1.0, 0.2, 0.2, 1.0, 0.2]):
        clf.sample_ratio = ratio
        x, y = _batch(C, D, seed=step)
        clf(x, y, step=step).backward()
        rows = None if ratio == 1 else clf.active_rows
        w = clf.weight.detach().double().requires_grad_(True)
        dense_classifier_loss(x.double(), y, w, None, "normsoftmax", clf.params, rows).backward()
        assert rel_err(clf.weight.grad, w.grad) < 1e-5, f"step {step}"
        clf.zero_grad()


def test_bf16_embeddings_keep_fp32_math():
    C, D = 30, 8
    clf = ShardedClassifier(C, D, "arcface", scale=16.0, margin=0.3)
    x, y = _batch(C, D)
    xb = x.bfloat16().requires_grad_(True)
    loss = clf(xb, y)
    assert loss.dtype == torch.float32
    loss.backward()
    assert xb.grad.dtype == torch.bfloat16
    ref = dense_classifier_loss(xb.detach().double(), y, clf.weight.detach().double(), None, "arcface", clf.params)
    assert rel_err(float(loss.detach()), float(ref)) < 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the classifier opts out of autocast
        again = clf(xb, y)
    assert again.dtype == torch.float32 and rel_err(float(again.detach()), float(ref)) < 1e-5


@pytest.mark.parametrize("kind", ["normsoftmax", "cosface", "arcface", "softmax_ce"])
def test_agrees_with_the_registry_proxy_loss(kind):
    """In one process the sharded classifier and ``build_loss(kind)`` are the same loss."""
    from dmltrain.losses import build_loss

    C, D = 50, 16
    x, y = _batch(C, D, B=32, seed=5)
    ref = build_loss(kind, num_classes=C, dim=D)
    with torch.no_grad():
        ref.weight.normal_()
        if getattr(ref, "bias", None) is not None:
            ref.bias.normal_()
    clf = ShardedClassifier(C, D, kind)
    clf.load_full_weight(ref.weight.detach(), None if getattr(ref, "bias", None) is None else ref.bias.detach())
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, theirs = clf(xa, y), ref(xb, y)
    ours.backward()
    theirs.backward()
    assert rel_err(float(ours.detach()), float(theirs.detach())) < 1e-5
    assert rel_err(xa.grad, xb.grad) < 1e-5
    assert rel_err(clf.weight.grad, ref.weight.grad) < 1e-5


def test_label_smoothing_with_a_single_class_has_no_gradient():
    """With one class the softmax is certain: loss 0 and gradient 0 even with ε > 0 (the
    smoothing has no other class to spread to), as in the registry loss."""
    x, y = _batch(1, 6, B=8, seed=6)
    clf = ShardedClassifier(1, 6, "softmax_ce", smoothing=0.1)
    with torch.no_grad():
        clf.weight.normal_()
        clf.bias.normal_()
    xa = x.clone().requires_grad_(True)
    loss = clf(xa, y)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert float(clf.weight.grad.abs().max()) == 0.0 and float(clf.bias.grad.abs().max()) == 0.0
    assert float(xa.grad.abs().max()) == 0.0


def test_eval_call_without_grad():
    clf = ShardedClassifier(30, 8, "normsoftmax", logits_budget_mb=1e-3)
    x, y = _batch(30, 8)
    with torch.no_grad():
        loss = clf(x, y)
    assert torch.isfinite(loss) and clf.weight.grad is None
    assert {"loss", "accuracy", "target_cos", "target_logit", "active_rows", "active_classes"} <= set(clf.stats)


def test_weight_init_does_not_depend_on_world_size():
    a = ShardedClassifier(70_000, 4, "normsoftmax", seed=3)  # spans two init blocks
    b = ShardedClassifier(70_000, 4, "normsoftmax", seed=3)
    assert torch.equal(a.weight, b.weight)
    std = float(a.weight.detach().std())
    assert abs(std - 0.5) < 0.01
    ce = ShardedClassifier(10, 4, "softmax_ce")
    assert (ce.weight == 0).all() and (ce.bias == 0).all()
    # init_std scales the same draws (the directions, hence the initial loss, are unchanged)
    big = ShardedClassifier(70_000, 4, "normsoftmax", seed=3, init_std=2.0)
    assert torch.allclose(big.weight, a.weight * 4) and abs(float(big.weight.detach().std()) - 2.0) < 0.04
    with pytest.raises(ValueError, match="init_std must be positive"):
        ShardedClassifier(10, 4, init_std=0.0)


def test_init_std_config_reaches_the_classifier():
    from dmltrain.config import load_config
    from dmltrain.training.objective import Objective

    cfg = load_config(None, ["loss.classifier.init_std=1.0"])
    assert Objective(cfg, 50, 16, world_size=1).classifier.init_std == 1.0
    assert Objective(load_config(None, []), 50, 16, world_size=1).classifier.init_std is None


def test_argument_errors_name_the_culprit():
    with pytest.raises(ValueError, match="unknown kind 'softmax'"):
        ShardedClassifier(10, 4, "softmax")
    with pytest.raises(TypeError, match="margin"):
        ShardedClassifier(10, 4, "normsoftmax", margin=0.1)
    with pytest.raises(ValueError, match="sample_ratio"):
        ShardedClassifier(10, 4, sample_ratio=0.0)
    clf = ShardedClassifier(10, 4)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 10\)"):
        clf(torch.randn(3, 4), torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match="B×4"):
        clf(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="unknown name 'sgdw'"):
        make_classifier_optimizer(clf, "sgdw")


@pytest.mark.parametrize("kind,ratio,margin", [("arcface", 1.0, 0.5), ("arcface", 0.5, 3.0), ("softmax_ce", 0.5, None)])
def test_float64_classifier_computes_in_float64(kind, ratio, margin):
    """``.double()`` is honoured: loss, embeddings' and rows' gradients in float64, to float64 accuracy
    (ArcFace with θ + m past π too: InsightFace's continuation)."""
    C, D = 40, 8
    clf = (
        ShardedClassifier(C, D, kind, sample_ratio=ratio, scale=16.0, margin=margin)
        if kind == "arcface"
        else ShardedClassifier(C, D, kind, sample_ratio=ratio)
    )
    clf = clf.double()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        clf.weight.copy_(torch.randn(C, D, generator=g, dtype=torch.float64))
        if clf.bias is not None:
            clf.bias.copy_(0.1 * torch.randn(C, generator=g, dtype=torch.float64))
    x, y = _batch(C, D, seed=8)
    x = x.double().requires_grad_(True)
    loss = clf(x, y, step=0)
    loss.backward()
    assert loss.dtype == clf.weight.grad.dtype == x.grad.dtype == torch.float64
    xr, wr = x.detach().clone().requires_grad_(True), clf.weight.detach().clone().requires_grad_(True)
    br = None if clf.bias is None else clf.bias.detach().clone().requires_grad_(True)
    ref = dense_classifier_loss(xr, y, wr, br, kind, clf.params, None if ratio == 1 else clf.active_rows)
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) < 1e-12
    assert rel_err(x.grad, xr.grad) < 1e-12 and rel_err(clf.weight.grad, wr.grad) < 1e-12


def test_precision_and_storage_errors_are_one_line():
    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    for kwargs, words in [
        ({"precision": "bf16"}, "precision 'bf16' needs the fused CUDA kernels"),
        ({"precision": "tf32"}, "precision 'tf32' needs the fused CUDA kernels"),
        ({"weight_storage": "bf16"}, "bf16 weight"),
        ({"backend": "triton"}, "TRITON_INTERPRET=1"),  # this process compiled the kernels for a GPU
    ]:
        with pytest.raises(ValueError, match=words) as err:
            ShardedClassifier(10, 4, **kwargs)(x, y)
        assert "\n" not in str(err.value)
    for kwargs, words in [({"precision": "fp16"}, "precision must be one of"), ({"weight_storage": "fp8"}, "weight_storage"),
                          ({"backend": "cuda"}, "backend must be one of")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            ShardedClassifier(10, 4, **kwargs)
    with pytest.raises(ValueError, match="margin must be in \\[0, pi\\), got 4"):
        ShardedClassifier(10, 4, "arcface", margin=4.0)
    with pytest.raises(ValueError, match="float16 weight"):
        ShardedClassifier(10, 4).half()(x, y)


def test_stochastic_rounding_is_unbiased_and_bf16_rows_learn_below_resolution():
    from dmltrain.distributed.row_sparse import round_stochastic

    vals = torch.tensor([1.0 + 2**-10, -1.0 - 3 * 2**-10, 3.3e-5, -7.77])
    x = vals.repeat(40_000, 1)
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    # every result is within one bf16 step of its value, and their mean is the value
    ulp = torch.tensor([2**-7, 2**-7, 2.0**-22, 2**-5])
    assert ((r - x).abs() < ulp).all()
    assert ((r.mean(0) - vals).abs() < 0.02 * ulp).all(), (r.mean(0) - vals, ulp)
    # an SGD step 1e-4 (below bf16's resolution 2^-8 at 1.0) still moves a bf16 row on average
    p = torch.nn.Parameter(torch.ones(500, 4, dtype=torch.bfloat16))
    opt = RowSparseSGD([p], lr=1e-4)
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    for _ in range(50):
        p.grad = torch.ones_like(p)
        opt.step()
    assert abs(float(p.detach().float().mean()) - (1 - 50 * 1e-4)) < 2e-4


_BF16_OPTIMIZERS = {
    "sgd": lambda p: RowSparseSGD([p], lr=1e-3, momentum=0.9, weight_decay=1e-2, seed=3),
    "adamw": lambda p: RowSparseAdamW([p], lr=1e-4, weight_decay=0.1, seed=3),
}


def _saved_and_loaded(opt, make, p):
    """A new optimizer over a copy of ``p`` loaded from ``opt``'s state_dict (through torch.save, as a checkpoint)."""
    import io

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = torch.nn.Parameter(p.detach().clone())
    other = make(q)
    other.load_state_dict(torch.load(buf, weights_only=True))
    return q, other


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_bf16_parameter_s_loaded_optimizer_state_stays_fp32(name):
    """torch's load_state_dict casts floating state to the parameter's dtype: a bf16 parameter's fp32 state is
    restored as it was saved, and the loaded optimizer's next step updates it as the saved one's does."""
    make = _BF16_OPTIMIZERS[name]
    p = torch.nn.Parameter(torch.randn(50, 6).bfloat16())
    opt = make(p)
    g1, g2 = (g.bfloat16() for g in _grads(p.shape, 2, seed=4))
    p.grad = g1
    opt.step()
    q, other = _saved_and_loaded(opt, make, p)
    for step in range(2):  # as loaded, then after a step
        for k, v in opt.state[p].items():
            assert other.state[q][k].dtype == v.dtype and torch.equal(other.state[q][k], v), f"{k} after {step}"
        p.grad, q.grad = g2.clone(), g2.clone()
        opt.step()
        other.step()


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_bf16_stochastic_rounding_resumes_bit_for_bit(name):
    """Two steps straight equal one step, the state saved and loaded into a new optimizer, one step: the
    rounding noise comes from (seed, step), nothing of it saved. A resumed optimizer replaying step 0's noise
    (what a generator restarted from the seed did) rounds otherwise."""
    make = _BF16_OPTIMIZERS[name]
    w0 = (1 + torch.rand(200, 8)).bfloat16()  # updates far below bf16's resolution: the rounding decides
    grads = [g.bfloat16() for g in _grads(w0.shape, 2, seed=5)]
    p = torch.nn.Parameter(w0.clone())
    straight = make(p)
    for step, g in enumerate(grads):
        p.grad = g.clone()
        straight.step(rounding_step=step)
    first = torch.nn.Parameter(w0.clone())
    opt = make(first)
    first.grad = grads[0].clone()
    opt.step(rounding_step=0)
    ends = {}
    for key in (1, 0):
        q, resumed = _saved_and_loaded(opt, make, first)
        q.grad = grads[1].clone()
        resumed.step(rounding_step=key)
        ends[key] = q.detach()
    assert torch.equal(ends[1], p.detach())
    assert not torch.equal(ends[0], p.detach())


# -- checkpoints by class id (one process; the W=3 → W=2/1 round trip is multi-process) -----------------
def test_checkpoint_round_trip_and_gaps():
    C, D = 40, 5
    clf = ShardedClassifier(C, D, "softmax_ce", sample_ratio=0.5)
    opt = make_classifier_optimizer(clf, "adamw", lr=0.01, weight_decay=0.1)
    with torch.no_grad():
        clf.weight.normal_()
    x, y = _batch(C, D)
    clf(x, y, step=0).backward()
    opt.step()
    state = gather_state(clf, opt)
    other = ShardedClassifier(C, D, "softmax_ce")
    other_opt = make_classifier_optimizer(other, "adamw", lr=0.5)
    # two pieces that together cover every class
    halves = []
    for s, e in [(0, 17), (17, 40)]:
        piece = dict(state, class_start=s, class_end=e, weight=state["weight"][s:e], bias=state["bias"][s:e])
        piece["optimizer"] = dict(
            state["optimizer"],
            rows={n: {k: v[s:e] for k, v in r.items()} for n, r in state["optimizer"]["rows"].items()},
        )
        halves.append(piece)
    load_state(other, halves, other_opt)
    assert torch.equal(other.full_weight(), clf.full_weight()) and torch.equal(other.full_bias(), clf.full_bias())
    for p, q in [(clf.weight, other.weight), (clf.bias, other.bias)]:
        for k, v in opt.state[p].items():
            assert torch.equal(v, other_opt.state[q][k])
    assert other_opt.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="missing"):
        load_state(other, halves[:1], other_opt)
    with pytest.raises(ValueError, match="dim"):
        load_state(ShardedClassifier(C, D + 1, "softmax_ce"), state)
    with pytest.raises(ValueError, match="RowSparseAdamW"):
        load_state(other, state, make_classifier_optimizer(other, "sgd"))


def test_load_full_weight_checks_shape():
    clf = ShardedClassifier(10, 4)
    w = torch.randn(10, 4)
    clf.load_full_weight(w)
    assert torch.equal(clf.full_weight(), w)
    with pytest.raises(ValueError, match="10×4"):
        clf.load_full_weight(torch.randn(9, 4))


def test_bench_classifier_smoke(capsys, monkeypatch):
    """``dmltrain bench classifier`` runs on a tiny size (figures not checked; configurations run
    in this process instead of a fresh one each, to save the interpreter start-ups)."""
    import argparse
    import json

    from dmltrain.distributed import bench, bench_runs

    monkeypatch.setattr(bench, "_child", lambda job: json.loads(json.dumps(bench_runs.run_job(job))))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args("--classes 3000 --dim 16 --batch 32 --sample-ratio 1 0.1 --steps 1 --no-peer".split())
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "step / GEMMs" in out and "R=0.1: step" in out and "faster than R=1" in out
    args = parser.parse_args("--classes 3000 --dim 16 --batch 32 --steps 1".split())  # with the peers
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "Cut Cross-Entropy (bf16, its default gradient filter): not available on the CPU" in out
    assert "Cut Cross-Entropy exact (bf16, no gradient filter): not available on the CPU" in out
    if not torch.cuda.is_available():  # --device cuda says so in one line
        args = parser.parse_args("--classes 3000 --dim 16 --batch 32 --steps 1 --device cuda".split())
        assert bench.run(args) == 1
        assert "R=1: failed, no CUDA GPU" in capsys.readouterr().out


# -- collectives and the instance-loss wrapper alone -------------------------------------------------------
def test_grad_scale_is_identity_forward_and_scales_backward():
    x = torch.randn(4, 3, requires_grad=True)
    y = grad_scale(x, 3.0)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


class _PairSum(InstanceLoss):
    """A toy instance loss: mean over (anchor, positive) pairs of their squared distance."""

    def anchor_terms(self, anchors, anchor_labels, refs, ref_labels, anchor_index):
        pos = anchor_labels[:, None] == ref_labels[None, :]
        pos[torch.arange(anchors.shape[0]), anchor_index] = False
        d = torch.cdist(anchors, refs) ** 2
        return AnchorTerms(total=(d * pos).sum(), count=pos.sum(), means={"d": ((d * pos).sum().detach(), pos.sum())})


class _Global(_PairSum):
    decomposes = False


def test_gathered_loss_in_one_process_is_the_loss():
    x, y = torch.randn(8, 3), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    for mode in ("local_anchors", "full"):
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        wrapper = GatheredInstanceLoss(_PairSum(), mode=mode)
        got = wrapper(xa, y)
        want = _PairSum()(xb, y)
        got.backward()
        want.backward()
        assert rel_err(float(got.detach()), float(want.detach())) < 1e-6
        assert rel_err(xa.grad, xb.grad) < 1e-6
        assert abs(wrapper.stats["d"] - float(want.detach())) < 1e-5
    with pytest.raises(ConfigError, match="mode=full"):
        GatheredInstanceLoss(_Global(), mode="local_anchors")
    with pytest.raises(ValueError, match="mode"):
        GatheredInstanceLoss(_PairSum(), mode="everything")


def test_classifier_index_cannot_name_a_file_outside_its_folder(tmp_path):
    """A tampered index.json naming ``../x`` is refused before anything is opened."""
    import json

    from dmltrain.distributed import load_by_class, save_by_class
    from dmltrain.distributed.class_checkpoint import INDEX_NAME
    from dmltrain.errors import UserError

    clf = ShardedClassifier(10, 4, "normsoftmax")
    save_by_class(clf, tmp_path / "ckpt")
    secret = tmp_path / "outside.pt"
    torch.save({"weight": torch.zeros(10, 4)}, secret)
    index = json.loads((tmp_path / "ckpt" / INDEX_NAME).read_text())
    index["pieces"][0]["file"] = "../outside.pt"
    (tmp_path / "ckpt" / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"'\.\./outside\.pt' is not a file name inside the checkpoint folder"):
        load_by_class(ShardedClassifier(10, 4, "normsoftmax"), tmp_path / "ckpt")


# -- no host reads in a step ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,params,ratio",
    [
        ("softmax_ce", {"smoothing": 0.1}, 0.1),  # a drawn count on the device (the ratio below the batch)
        ("arcface", {"scale": 16.0, "margin": 0.5}, 0.5),  # the draw's size known on the host
        ("cosface", {"scale": 16.0, "margin": 0.35}, 1.0),
    ],
)
def test_a_training_step_reads_nothing_back_from_the_device(kind, params, ratio):
    """Forward, backward and the optimizer step of the classifier head with every Python-level device read
    refused (what a CUDA step must not do: tests/host_reads.py); the result still equals one float64 process."""
    from host_reads import HostRead, no_host_reads

    from dmltrain.distributed import ClassifierHead

    C, D = 50, 8
    clf = ShardedClassifier(C, D, kind, sample_ratio=ratio, seed=1, **params)
    w0 = torch.randn(C, D, generator=torch.Generator().manual_seed(2))
    clf.load_full_weight(w0, None if clf.bias is None else torch.zeros(C))
    head = ClassifierHead(clf, "adamw", lr=0.1, weight_decay=0.01)
    for step in range(2):  # the second step reuses the gradient buffers
        x, y = _batch(C, D, seed=step)
        x.requires_grad_(True)
        w_before = clf.weight.detach().clone()
        b_before = None if clf.bias is None else clf.bias.detach().clone()
        with no_host_reads():
            loss = head(x, y, step=step, sizes=[x.shape[0]])
            loss.backward()
            head.step()
        with pytest.raises(HostRead), no_host_reads():  # the guard does catch a read: the stats are one
            clf.stats["loss"]
        xr = x.detach().double().requires_grad_(True)
        wr = w_before.double().requires_grad_(True)
        br = None if b_before is None else b_before.double().requires_grad_(True)
        active = None if ratio == 1 else clf.active_rows
        ref = dense_classifier_loss(xr, y, wr, br, kind, clf.params, active)
        ref.backward()
        assert rel_err(float(loss.detach()), float(ref.detach())) < 1e-5
        assert rel_err(x.grad, xr.grad) < 1e-5
        idle = torch.ones(C, dtype=torch.bool)
        idle[clf.active_rows] = False
        assert torch.equal(clf.weight.detach()[idle], w_before[idle])  # undrawn rows untouched by the step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ratio", [1.0, 0.1])
def test_a_cuda_training_step_never_synchronises(ratio):
    """The same step on a GPU under torch.cuda.set_sync_debug_mode("error") (after a warm-up step that
    tunes the kernels' tiles), label smoothing and a drawn count included."""
    from dmltrain.distributed import ClassifierHead

    C, D = 5000, 64
    clf = ShardedClassifier(C, D, "softmax_ce", sample_ratio=ratio, smoothing=0.1).cuda()
    head = ClassifierHead(clf, "sgd", lr=0.1)
    for step in range(3):
        x, y = _batch(C, D, B=256, seed=step)
        x, y = x.cuda().requires_grad_(True), y.cuda()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            head(x, y, step=step, sizes=[x.shape[0]]).backward()
            head.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(clf.weight).all()


def test_a_resumed_run_draws_and_trains_as_an_uninterrupted_one(tmp_path):
    """Saved by class id after step 1 and loaded into a fresh head, steps 2-3 draw the same classes and end
    with bit-identical rows and optimizer state (the draw is a function of seed, step and batch only)."""
    from dmltrain.distributed import ClassifierHead

    C, D = 300, 8

    def head() -> ClassifierHead:
        return ClassifierHead(ShardedClassifier(C, D, "cosface", sample_ratio=0.05, seed=4), "adamw", lr=0.05)

    def train(h: ClassifierHead, steps) -> list[torch.Tensor]:
        drawn = []
        for step in steps:
            x, y = _batch(C, D, seed=10 + step)
            h(x, y, step=step).backward()
            drawn.append(h.classifier.active_rows.clone())
            h.step()
        return drawn

    whole = head()
    drawn = train(whole, range(4))
    first = head()
    train(first, range(2))
    first.save(tmp_path / "ckpt")
    resumed = head()
    with torch.no_grad():
        resumed.classifier.weight.normal_()  # loading must overwrite everything
    resumed.load(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(train(resumed, range(2, 4)), drawn[2:]))
    assert torch.equal(resumed.classifier.weight, whole.classifier.weight)
    for k, v in whole.optimizer.state[whole.classifier.weight].items():
        assert torch.equal(resumed.optimizer.state[resumed.classifier.weight][k], v), k


def test_tuned_configs_are_chosen_once_and_kept_across_processes(tmp_path, monkeypatch):
    """The first choice times every candidate and is written to a private JSON file; another Tuner (another
    rank or run) reads it without timing; an entry that is not one of the candidates, or a file others may
    write, is not trusted."""
    import json
    import stat

    from dmltrain.kernel_tuning import LaunchConfig, Tuner, tuning_dir

    monkeypatch.setenv("DMLTRAIN_TUNING_DIR", str(tmp_path / "tuning"))
    assert stat.S_IMODE(tuning_dir().stat().st_mode) == 0o700
    cands = [LaunchConfig.of(8, 3, BLOCK_B=128), LaunchConfig.of(4, 3, BLOCK_B=64)]
    timed = []

    def time_config(cfg):
        timed.append(cfg)
        return {128: 2.0, 64: 1.0}[cfg["BLOCK_B"]]

    assert Tuner("NVIDIA H100 80GB HBM3", "3.8.0").choose("lse", (512, 1024), cands, time_config) == cands[1]
    assert len(timed) == 2
    other = Tuner("NVIDIA H100 80GB HBM3", "3.8.0")
    assert other.choose("lse", (512, 1024), cands, time_config) == cands[1] and len(timed) == 2
    path = other.path
    data = json.loads(path.read_text())
    data["lse|512|1024"] = {"meta": {"BLOCK_B": 4096}, "num_warps": 1, "num_stages": 1}  # not a candidate
    path.write_text(json.dumps(data))
    assert Tuner("NVIDIA H100 80GB HBM3", "3.8.0").choose("lse", (512, 1024), cands, time_config) == cands[1]
    assert len(timed) == 4  # timed again, and the file repaired
    path.chmod(0o666)
    assert Tuner("NVIDIA H100 80GB HBM3", "3.8.0").choose("lse", (512, 1024), cands, time_config) == cands[1]
    assert len(timed) == 6  # a file others may write is ignored


def test_deterministic_kernels_take_fixed_tiles_whatever_each_rank_and_run_tuned(tmp_path, monkeypatch):
    """Two ranks tuning at once on one folder (timings favouring different candidates), then a later run
    reading the file: the tuned choices may differ, so the deterministic kernels (whose tiles set the order
    of their sums) take each kind's first candidate, untimed, on every rank and in every run. CUDA is
    stubbed: the tuners' timings and the device."""
    import functools

    from dmltrain.distributed import softmax_kernels as sk
    from dmltrain.kernel_tuning import Tuner

    monkeypatch.setenv("DMLTRAIN_TUNING_DIR", str(tmp_path))
    cuda = torch.device("cuda", 0)
    key = (512, 1024, 1 << 20, "bf16", True, True)
    timed = []
    ranks = [Tuner("NVIDIA H100 80GB HBM3", "3.8.0") for _ in range(2)]
    for t in ranks:
        t._entries()  # both read the (empty) file before either writes: tuning at once

    def timing(prefer: int, launch, cfg) -> float:  # the rank's timings favour its candidate `prefer`
        timed.append(cfg)
        cands = next(c for c in sk._CONFIGS.values() if cfg in c)
        return 1.0 if cands.index(cfg) == prefer % len(cands) else 2.0

    def choices(tuner: Tuner, prefer: int, deterministic: bool) -> dict:
        monkeypatch.setattr(sk, "_tuner", lambda index: tuner)
        monkeypatch.setattr(sk, "time_launch", functools.partial(timing, prefer))
        kinds = ("lse", "grad_x", "grad_w")
        return {k: sk._choose(k, key, "bf16", cuda, None, deterministic) for k in kinds}

    tuned = [choices(t, prefer, False) for prefer, t in enumerate(ranks)]
    assert tuned[0]["lse"] != tuned[1]["lse"] and timed, "the default path tunes, each rank its own way"
    timed.clear()
    later_run = Tuner("NVIDIA H100 80GB HBM3", "3.8.0")
    fixed = {k: sk._CONFIGS[(k, "bf16")][0] for k in ("lse", "grad_x", "grad_w")}
    for prefer, t in [(0, ranks[0]), (1, ranks[1]), (1, later_run)]:
        assert choices(t, prefer, True) == fixed
    assert not timed, "deterministic tiles are never timed"


@pytest.mark.parametrize(("name", "states"), [("sgd", 1), ("adamw", 2)])
def test_the_classifier_memory_a_run_logs_is_what_its_tensors_hold(name, states):
    """``memory_bytes`` (the run's ``classifier_mb`` tag, the study's memory factor) counts the rows and the
    optimizer state actually allocated after a step, at both ratios: C x D fp32 rows plus ``states`` buffers of the
    same size (momentum; Adam's two moments) plus any smaller state; a subsampled step draws fewer rows but holds
    them all, so the factor is measured as 1, not assumed."""
    from dmltrain.distributed import ClassifierHead

    C, D = 400, 16
    held = {}
    for ratio in (1.0, 0.1):
        head = ClassifierHead(ShardedClassifier(C, D, "cosface", sample_ratio=ratio, seed=1), name, lr=0.1)
        before = head.memory_bytes()  # the row-sparse optimizers allocate their state for every row up front
        x, y = _batch(C, D, B=32)
        head(x.requires_grad_(True), y, step=0, sizes=[32]).backward()
        head.step()
        scalars = sum(
            v.numel() * v.element_size()
            for st in head.optimizer.state.values()
            for v in st.values()
            if hasattr(v, "numel") and v.numel() < C * D
        )
        held[ratio] = head.memory_bytes()
        assert held[ratio] == C * D * 4 * (1 + states) + scalars == before
    assert held[1.0] == held[0.1]
