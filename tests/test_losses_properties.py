"""Properties the papers and the distributed layer rely on: ICE's eq. 15, RLL's anchor-only
gradient and mining thresholds, SPCE = CE with class means, ArcFace's numerics, numerical
safety at s = 64 / T = 0.05 (fp32 and bf16 autocast), degenerate batches, the exact
decomposition over anchor sets, statistics, and the registry/config contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dmltrain.losses import build_loss, check_params, is_proxy_loss, loss_names, make_loss, smoothed_nll
from dmltrain.losses.base import InstanceLoss
from dmltrain.losses.registry import accepted_params

F64 = torch.float64
ALL_NAMES = [
    "normsoftmax", "cosface", "arcface", "softmax_ce", "proxy_nca", "spce", "ice", "ranked_list",
    "contrastive", "triplet", "multi_similarity", "snca", "lifted_structure", "npair", "center",
]  # fmt: skip
INSTANCE_NAMES = [n for n in ALL_NAMES if not is_proxy_loss(n)]
PROXY_NAMES = [n for n in ALL_NAMES if is_proxy_loss(n)]


def make(name: str, num_classes: int = 6, dim: int = 8, **params):
    return make_loss(name, params, num_classes=num_classes, dim=dim)


def batch(labels, dim=8, seed=0, spread=0.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(max(labels) + 1, dim, generator=g, dtype=F64)
    x = centers[torch.tensor(labels)] + spread * torch.randn(len(labels), dim, generator=g, dtype=F64)
    return x.to(dtype), torch.tensor(labels)


def valid_anchors_only(name: str) -> dict:
    """Params that make a loss divide by the anchors with a positive (ICE, RLL, MS default to the batch size)."""
    return {"normalize": "valid_anchors"} if "normalize" in accepted_params(name) else {}


def unit_rows(x):
    return x / x.norm(dim=1, keepdim=True)


# -- ICE: eq. 15 with the weights of eqs. 13-14 ------------------------------------------------------
def ice_eq15_weights(f, y, s):
    """w̄(i;a) for positives and w̄(j;a) for negatives, loop by loop (ICE eqs. 11-14)."""
    n = len(y)
    w = torch.zeros(n, n, dtype=F64)
    for a in range(n):
        pos = [i for i in range(n) if i != a and y[i] == y[a]]
        neg = [j for j in range(n) if y[j] != y[a]]
        neg_sum = sum(math.exp(s * float(f[a] @ f[j])) for j in neg)
        p_hat = {i: math.exp(s * float(f[a] @ f[i])) / (math.exp(s * float(f[a] @ f[i])) + neg_sum) for i in pos}
        norm = sum(1 - p for p in p_hat.values())
        for i in pos:
            w[a, i] = (1 - p_hat[i]) / (2 * n * norm)  # eq. 13
        for j in neg:
            p_neg = sum(math.exp(s * float(f[a] @ f[j])) / (math.exp(s * float(f[a] @ f[i])) + neg_sum) for i in pos)
            w[a, j] = p_neg / (2 * n * norm)  # eq. 14
    return w


@pytest.mark.parametrize("labels", [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 1, 1, 1, 2, 2, 2]])
def test_ice_gradients_equal_eq15(labels):
    s = 8.0
    x, y = batch(labels, dim=5, seed=1, spread=0.7, dtype=F64)
    f = unit_rows(x)
    w = ice_eq15_weights(f, labels, s)
    sign = torch.tensor(
        [[(1.0 if labels[j] != labels[a] else -1.0) for j in range(len(labels))] for a in range(len(labels))], dtype=F64
    )
    project = lambda k, g: g - (f[k] @ g) * f[k]  # noqa: E731  (Jacobian of the L2 normalisation at a unit vector)
    loss = build_loss("ice", scale=s)
    idx = torch.arange(len(labels))

    # as positives/negatives of the other anchors: ∂L/∂f_i = -f_a w̄(i;a), ∂L/∂f_j = +f_a w̄(j;a), summed over anchors
    refs = f.clone().requires_grad_(True)
    t = loss.anchor_terms(f, y, refs, y, idx)
    (t.total / t.count).backward()
    for k in range(len(labels)):
        expected = sum(sign[a, k] * w[a, k] * f[a] for a in range(len(labels)) if a != k)
        torch.testing.assert_close(refs.grad[k], project(k, expected), rtol=1e-9, atol=1e-12)

    # as the anchor, by the symmetry of fₐᵀfᵢ: ∂L/∂f_a = Σ_i -f_i w̄(i;a) + Σ_j f_j w̄(j;a)
    anchors = f.clone().requires_grad_(True)
    t = loss.anchor_terms(anchors, y, f, y, idx)
    (t.total / t.count).backward()
    for a in range(len(labels)):
        expected = sum(sign[a, k] * w[a, k] * f[k] for k in range(len(labels)) if k != a)
        torch.testing.assert_close(anchors.grad[a], project(a, expected), rtol=1e-9, atol=1e-12)

    # positive and negative sets each carry 1/(2N) per anchor
    pos_total = sum(float(w[a, i]) for a in range(len(labels)) for i in range(len(labels)) if sign[a, i] < 0 and i != a)
    assert pos_total == pytest.approx(0.5)


# -- RLL ------------------------------------------------------------------------------------------
def test_ranked_list_gradient_flows_only_through_each_lists_anchor():
    labels = [0, 0, 0, 1, 1, 1, 2, 2]
    x, y = batch(labels, seed=2, spread=1.0, dtype=F64)
    loss = build_loss("ranked_list")
    full = x.clone().requires_grad_(True)
    loss(full, y).backward()
    summed = torch.zeros_like(x)
    for k in range(len(labels)):
        xk = x.clone().requires_grad_(True)
        t = loss.anchor_terms(xk[k : k + 1], y[k : k + 1], xk, y, torch.tensor([k]))
        t.total.backward()
        others = torch.cat([xk.grad[:k], xk.grad[k + 1 :]])
        assert torch.count_nonzero(others) == 0, "a gallery embedding received gradient"
        summed += xk.grad
    assert torch.count_nonzero(summed) > 0
    torch.testing.assert_close(full.grad, summed / len(labels), rtol=1e-10, atol=1e-14)


def points_at_distances(distances):
    """Unit vectors in 2-D whose Euclidean distance to (1, 0) are ``distances``."""
    rows = [[1.0, 0.0]]
    for d in distances:
        phi = 2 * math.asin(d / 2)
        rows.append([math.cos(phi), math.sin(phi)])
    return torch.tensor(rows, dtype=F64)


def test_ranked_list_mining_thresholds():
    alpha, margin, T = 1.2, 0.4, 10.0
    # positives at 0.79 (< α-m: trivial) and 0.83 (mined); negatives at 1.15, 1.19 (< α: mined) and 1.21 (trivial)
    x = points_at_distances([0.79, 0.83, 1.15, 1.19, 1.21]).requires_grad_(True)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    loss = build_loss("ranked_list", alpha=alpha, margin=margin, temperature=T)
    t = loss.anchor_terms(x[:1], y[:1], x, y, torch.tensor([0]))
    w = [math.exp(T * (alpha - 1.15)), math.exp(T * (alpha - 1.19))]
    expected = (0.83 - (alpha - margin)) + (w[0] * (alpha - 1.15) + w[1] * (alpha - 1.19)) / sum(w)
    assert float(t.total.detach()) == pytest.approx(expected, rel=1e-9)
    assert float(t.totals["active_pairs"]) == 3
    # each mined pair pulls/pushes the anchor with unit force (eq. 10) times its weight
    t.total.backward()
    g = x.grad[0]
    unit_dir = lambda j: (x[0] - x[j]).detach() / (x[0] - x[j]).detach().norm()  # noqa: E731
    expected_g = unit_dir(2) - (w[0] * unit_dir(3) + w[1] * unit_dir(4)) / sum(w)
    expected_g = expected_g - (expected_g @ x[0].detach()) * x[0].detach()
    torch.testing.assert_close(g, expected_g, rtol=1e-7, atol=1e-10)


# -- triplet: FaceNet semi-hard selection ---------------------------------------------------------
@pytest.mark.parametrize(
    "neg_distances, chosen",
    [([1.6, 1.9, 0.3], 1.6), ([0.5, 1.0, 0.2], 1.0), ([1.5, 1.7], 1.7)],
    ids=["semi-hard: closest farther negative", "none farther: farthest negative", "a tie is not farther"],
)
def test_triplet_negative_selection(neg_distances, chosen):
    x = points_at_distances([1.5, *neg_distances]).requires_grad_(True)  # anchor, positive at 1.5, negatives
    y = torch.tensor([0, 0] + [1] * len(neg_distances))
    loss = build_loss("triplet", margin=0.2, squared=False)
    t = loss.anchor_terms(x[:1], y[:1], x, y, torch.tensor([0]))
    assert float(t.total.detach()) == pytest.approx(max(1.5 - chosen + 0.2, 0.0), abs=1e-9)
    assert float(t.count) == 1


# -- SPCE -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [None, 0.1])
def test_spce_is_cross_entropy_with_class_means(temperature):
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3]
    x, y = batch(labels, seed=3, dtype=F64)
    loss = build_loss("spce", temperature=temperature, normalize=temperature is not None)
    x1 = x.clone().requires_grad_(True)
    value = loss(x1, y)
    value.backward()

    x2 = x.clone().requires_grad_(True)
    z = F.normalize(x2, dim=1) if temperature is not None else x2
    means = torch.stack([z[y == k].mean(0) for k in range(4)])
    weight = means * (y.bincount().to(F64)[:, None] / len(labels)) if temperature is None else means / temperature
    expected = F.cross_entropy(z @ weight.t(), y)  # CE with each class weight set to its (scaled) batch mean
    expected.backward()
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)


# -- ArcFace numerics ------------------------------------------------------------------------------
def arcface_case(theta: float, margin=0.5, dtype=torch.float32):
    """One example at angle θ from its class weight (class 0); class 1 orthogonal to both."""
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    x = torch.tensor([[math.cos(theta), math.sin(theta), 0.0]], dtype=F64)
    loss = build_loss("arcface", num_classes=2, dim=3, scale=64.0, margin=margin).to(dtype)
    with torch.no_grad():
        loss.weight.copy_(w)
    return loss, x.to(dtype).requires_grad_(True), torch.tensor([0])


@pytest.mark.parametrize("theta", [0.0, 1e-7, 1e-4, 1e-2])
def test_arcface_is_finite_and_exact_near_zero_angle(theta):
    loss, x, y = arcface_case(theta)
    logits = loss.scores(x, y)[0]
    loss(x, y).backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(loss.weight.grad).all()
    assert float(logits[0, 0].detach()) == pytest.approx(64 * math.cos(theta + 0.5), rel=1e-6)
    if theta > 0:
        # the true gradient: d/dθ of s·cos(θ+m) has norm s·sin(θ+m) along the tangent; compare with float64 autograd of acos
        loss64, x64, _ = arcface_case(theta, dtype=F64)
        cos = F.normalize(x64, dim=1) @ F.normalize(loss64.weight, dim=1).t()
        target = 64 * torch.cos(torch.acos(cos[0, 0]) + 0.5)
        ref = F.cross_entropy(torch.stack([target, 64 * cos[0, 1]])[None], y)
        ref.backward()
        if theta >= 1e-4:  # below, float64 acos itself loses the digits
            torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2e-3, atol=1e-6)
        assert float(x.grad.norm()) < 64  # bounded by s · |d CE/d logit|
    # exactly at θ = 0 the angle has no direction: the subgradient 0 for the target term


def test_arcface_beyond_pi_minus_margin_keeps_penalising():
    m = 0.5
    thetas = [math.pi - m - 0.2, math.pi - m + 0.05, math.pi - m + 0.3, math.pi - 1e-4, math.pi]
    targets, grads = [], []
    for theta in thetas:
        loss, x, y = arcface_case(theta, margin=m, dtype=F64)
        target = float(loss.scores(x, y)[0][0, 0].detach()) / 64
        if theta + m > math.pi:
            assert target == pytest.approx(math.cos(theta) - m * math.sin(m), rel=1e-9, abs=1e-12)
        else:
            assert target == pytest.approx(math.cos(theta + m), rel=1e-9)
        assert target < math.cos(theta)  # the margin still lowers the target logit
        loss(x, y).backward()
        assert torch.isfinite(x.grad).all()
        targets.append(target)
        grads.append(x.grad.norm())
    assert all(a > b for a, b in zip(targets, targets[1:])), "target logit must keep decreasing with the angle"
    assert all(g > 0 for g in grads[:-1])  # θ = π exactly: antipodal, no direction


# -- numerical safety ----------------------------------------------------------------------------
EXTREME = {
    "normsoftmax": {"temperature": 0.05}, "cosface": {"scale": 64.0}, "arcface": {"scale": 64.0},
    "ice": {"scale": 64.0}, "snca": {"temperature": 0.05}, "spce": {"temperature": 0.05, "normalize": True},
    "proxy_nca": {"scale": 64.0},
}  # fmt: skip


def separated_batch(dtype=torch.float32, scale=1.0):
    """Tight, far-apart clusters: every naive exp(s·cos) overflows or underflows."""
    labels = [0, 0, 0, 1, 1, 1, 2, 2, 3]  # class 3: a single image
    x, y = batch(labels, dim=16, seed=4, spread=1e-3)
    return (x * scale).to(dtype), y


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_no_nan_or_inf_at_extreme_scales(name, precision):
    torch.manual_seed(0)
    loss = make(name, num_classes=4, dim=16, **EXTREME.get(name, {}))
    if is_proxy_loss(name):
        with torch.no_grad():  # proxies at the class centres, as after training
            x0, y0 = separated_batch()
            for c in range(4):
                loss.weight[c] = x0[y0 == c].mean(0)
    for scale in (1.0, 1e3):  # raw-embedding losses (npair, spce, softmax_ce, center) at large norms
        x, y = separated_batch(scale=scale)
        x = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            value = loss(x, y)
        value.backward()
        assert torch.isfinite(value), (name, scale, float(value.detach()))
        assert torch.isfinite(x.grad).all(), (name, scale)
        for p in loss.parameters():
            assert torch.isfinite(p.grad).all()
        assert all(math.isfinite(v) for v in loss.stats.values()), loss.stats
        loss.zero_grad()


@pytest.mark.parametrize("name", ALL_NAMES)
def test_bf16_autocast_close_to_fp32(name):
    loss = make(name, num_classes=4, dim=16)
    x, y = batch([0, 0, 1, 1, 1, 2, 2, 3, 3], dim=16, seed=5, spread=0.8)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in loss.parameters():  # away from the init (softmax_ce's zeros give log C whatever the precision)
            p.normal_(0, 0.5)
        ref = loss(x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = loss(x, y)
            low_in = loss(x.bfloat16(), y)  # a bf16 backbone output
    assert low.dtype == torch.float32 and low_in.dtype == torch.float32
    if is_proxy_loss(name):  # the classifier GEMM follows autocast
        assert float(low) == pytest.approx(float(ref), rel=1.5e-2)  # bf16 logits: measured 0.06-0.3 %
    else:  # the instance losses' similarity GEMM stays float32
        assert float(low) == pytest.approx(float(ref), rel=1e-6)
    assert float(low_in) == pytest.approx(float(ref), rel=1.5e-2)  # bf16-rounded inputs: measured up to 0.6 %


# -- degenerate batches --------------------------------------------------------------------------
@pytest.mark.parametrize("name", INSTANCE_NAMES)
def test_single_image_classes_are_skipped(name):
    x, y = batch([0, 0, 0, 1, 1, 2, 3], seed=6)  # classes 2 and 3: one image each
    loss = make(name, **valid_anchors_only(name))  # batch normalisation: tests/test_losses_reference.py
    x.requires_grad_(True)
    loss(x, y).backward()
    assert loss.stats["skipped_anchors"] == 2
    assert torch.isfinite(x.grad).all()
    # the skipped anchors' own terms are absent: the loss equals the one over the valid anchors only
    t = loss.anchor_terms(x[:5], y[:5], x, y, torch.arange(5))
    assert float((t.total / t.count).detach()) == pytest.approx(float(loss(x, y).detach()), rel=1e-6)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_one_class_batch(name):
    x, y = batch([2, 2, 2, 2], seed=7)
    loss = make(name)
    x.requires_grad_(True)
    value = loss(x, y)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(x.grad).all()
    if name in ("ice", "ranked_list", "contrastive", "triplet", "multi_similarity", "snca", "lifted_structure"):
        # nothing to contrast: these are zero (contrastive/RLL keep their positive pull)
        if name not in ("contrastive", "ranked_list"):
            assert float(value.detach()) == 0.0
    assert loss.stats["skipped_anchors"] == 0


@pytest.mark.parametrize("name", INSTANCE_NAMES)
def test_no_valid_anchor_gives_a_connected_zero(name):
    x, y = batch([0, 1, 2, 3], seed=8)
    x.requires_grad_(True)
    loss = make(name, **valid_anchors_only(name))  # with normalize=batch RLL keeps these anchors' negative terms
    value = loss(x, y)
    assert float(value.detach()) == 0.0
    value.backward()  # must not fail
    assert torch.count_nonzero(x.grad) == 0
    assert loss.stats["skipped_anchors"] == 4


# -- decomposition over anchor sets (what the distributed layer relies on) --------------------------
@pytest.mark.parametrize("name", INSTANCE_NAMES)
def test_decomposition_over_three_anchor_sets_is_exact(name):
    labels = [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4]
    x, y = batch(labels, seed=9, spread=0.8, dtype=F64)
    loss = make(name)
    assert isinstance(loss, InstanceLoss) and loss.decomposes
    whole = x.clone().requires_grad_(True)
    expected = loss(whole, y)
    expected.backward()
    whole_stats = dict(loss.stats)

    pieces = x.clone().requires_grad_(True)
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    parts = [perm[:4], perm[4:9], perm[9:]]
    terms = [loss.anchor_terms(pieces[idx], y[idx], pieces, y, idx) for idx in parts]
    total = sum(t.total for t in terms)
    count = sum(t.count for t in terms)
    value = total / count
    value.backward()
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pieces.grad, whole.grad, rtol=1e-10, atol=1e-14)
    # the statistics too: means as Σsum/Σcount, totals as sums
    for key in terms[0].totals:
        assert sum(float(t.totals[key]) for t in terms) == pytest.approx(whole_stats[key])
    for key in terms[0].means:
        c = sum(float(t.means[key][1]) for t in terms)
        if c:
            assert sum(float(t.means[key][0]) for t in terms) / c == pytest.approx(
                whole_stats[key], rel=1e-9, abs=1e-12
            )


# -- statistics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_NAMES)
def test_stats_after_each_call(name):
    loss = make(name)
    x, y = batch([0, 0, 1, 1, 1, 2, 2, 3], seed=10)
    loss(x, y)
    for key in ("active_pairs", "pos_sim", "neg_sim", "nontrivial_fraction", "skipped_anchors"):
        assert key in loss.stats, (name, key, loss.stats)
        assert isinstance(loss.stats[key], float)
    assert -1 <= loss.stats["pos_sim"] <= 1 and -1 <= loss.stats["neg_sim"] <= 1
    assert 0 <= loss.stats["nontrivial_fraction"] <= 1
    first = dict(loss.stats)
    loss(x[:4], y[:4])
    assert loss.stats != first  # replaced by the latest call


def test_stats_pos_neg_similarity_values():
    x, y = batch([0, 0, 1, 1], seed=11, dtype=F64)
    loss = build_loss("contrastive")
    loss(x, y)
    f = unit_rows(x)
    assert loss.stats["pos_sim"] == pytest.approx(float(f[0] @ f[1] + f[2] @ f[3]) / 2)
    neg = [float(f[i] @ f[j]) for i in range(4) for j in range(4) if y[i] != y[j]]
    assert loss.stats["neg_sim"] == pytest.approx(sum(neg) / len(neg))


# -- the margin and smoothing maths shared with the sharded classifier --------------------------------
def test_margin_targets_against_scalar_formulas():
    """The kinds' ``target_logit`` (which the registry losses and the sharded classifier both call)
    against float64 scalar formulas through ``acos``, away from θ = 0 where acos is exact enough."""
    from dmltrain.losses.kinds import KINDS

    g = torch.Generator().manual_seed(21)
    x, w = unit_rows(torch.randn(64, 5, generator=g, dtype=F64)), unit_rows(torch.randn(64, 5, generator=g, dtype=F64))
    cases = [
        ("normsoftmax", {"temperature": 0.05}),
        ("cosface", {"scale": 30.0, "margin": 0.35}),
        ("arcface", {"scale": 30.0, "margin": 0.5}),
        ("arcface", {"scale": 30.0, "margin": 1.2}),
    ]
    for kind, params in cases:
        got = KINDS[kind].target_logit(x, w, **params)
        for i in range(x.shape[0]):
            cos = float(x[i] @ w[i])
            if kind == "normsoftmax":
                ref = cos / params["temperature"]
            elif kind == "cosface":
                ref = params["scale"] * (cos - params["margin"])
            else:
                s, m = params["scale"], params["margin"]
                theta = math.acos(cos)
                ref = s * (math.cos(theta + m) if theta + m <= math.pi else cos - m * math.sin(m))
            assert float(got[i]) == pytest.approx(ref, rel=1e-9, abs=1e-9), (kind, params, i)


@pytest.mark.parametrize("num_classes,smoothing", [(7, 0.0), (7, 0.1), (2, 0.3), (1, 0.1)])
def test_smoothed_nll_gradient_is_softmax_minus_smoothed_target(num_classes, smoothing):
    """The sharded classifier's backward writes ``p - q`` with ``q`` from ``smoothing_weights``:
    it must be the gradient of ``smoothed_nll`` through its three reductions."""
    from dmltrain.losses.margins import smoothing_weights

    g = torch.Generator().manual_seed(22)
    z = (3 * torch.randn(5, num_classes, generator=g, dtype=F64)).requires_grad_(True)
    y = torch.randint(num_classes, (5,), generator=g)
    target = z.gather(1, y[:, None]).squeeze(1)
    smoothed_nll(torch.logsumexp(z, 1), target, z.sum(1), num_classes, smoothing).sum().backward()
    on, off = smoothing_weights(num_classes, smoothing)
    q = torch.full_like(z, off)
    q[torch.arange(5), y] = on
    assert float(q.sum(1).sub(1).abs().max()) < 1e-12  # a distribution
    torch.testing.assert_close(z.grad, torch.softmax(z.detach(), 1) - q, rtol=1e-12, atol=1e-12)
    if smoothing and num_classes > 1:  # and the loss is CE against that distribution
        ce = -(q * torch.log_softmax(z.detach(), 1)).sum(1)
        torch.testing.assert_close(
            smoothed_nll(torch.logsumexp(z, 1), target, z.sum(1), num_classes, smoothing).detach(), ce
        )


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_smoothed_nll_from_reductions_equals_the_loss(smoothing):
    loss = make("softmax_ce", num_classes=7, dim=8, smoothing=smoothing)
    torch.nn.init.normal_(loss.weight)
    x, y = batch([0, 1, 2, 3, 4, 5, 6, 6], seed=13)
    torch.set_grad_enabled(False)
    try:
        check_smoothed_nll(loss, x, y, smoothing)
    finally:
        torch.set_grad_enabled(True)


def check_smoothed_nll(loss, x, y, smoothing):
    z = loss.scores(x, y)[0]
    parts = smoothed_nll(torch.logsumexp(z, 1), z.gather(1, y[:, None]).squeeze(1), z.sum(1), 7, smoothing)
    assert float(parts.mean()) == pytest.approx(float(loss(x, y)), rel=1e-6)
    if smoothing == 0:
        assert float(loss(x, y)) == pytest.approx(float(F.cross_entropy(z, y)), rel=1e-6)


def test_softmax_ce_starts_at_zero_with_bias():
    loss = make("softmax_ce", num_classes=5, dim=8)
    assert torch.count_nonzero(loss.weight) == 0 and torch.count_nonzero(loss.bias) == 0
    x, y = batch([0, 1, 2], seed=14)
    assert float(loss(x, y).detach()) == pytest.approx(math.log(5))


def test_proxy_labels_out_of_range_fail_loudly():
    loss = make("normsoftmax", num_classes=3, dim=8)
    x, _ = batch([0, 1], seed=15)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\)"):
        loss(x, torch.tensor([0, 3]))


# -- registry and config ------------------------------------------------------------------------------
def test_every_name_is_registered():
    assert sorted(loss_names()) == sorted(ALL_NAMES)
    assert check_params("ice", {"scale": 32}) is None
    assert check_params("ice", {"temperature": 1}).startswith("params.temperature: not a parameter of ice")
    assert check_params("ranked_list", {"alpha": 1.2, "margin": 0.4, "temperature": 10.0}) is None
    for name, key in [("normsoftmax", "temperature"), ("cosface", "scale"), ("cosface", "margin"), ("arcface", "scale"),
                      ("softmax_ce", "smoothing"), ("multi_similarity", "epsilon"), ("triplet", "margin")]:  # fmt: skip
        assert check_params(name, {key: 1.0}) is None, (name, key)


def test_defaults_follow_the_spec():
    assert make("normsoftmax").temperature == 0.05
    assert (make("cosface").scale, make("cosface").margin) == (64.0, 0.35)
    assert (make("arcface").scale, make("arcface").margin) == (64.0, 0.5)
    assert make("softmax_ce").smoothing == 0.1
    assert make("ice").scale == 64.0
    rll = make("ranked_list")
    assert (rll.alpha, rll.margin, rll.temperature, rll.balance) == (1.2, 0.4, 10.0, 1.0)
    ms = make("multi_similarity")
    assert (ms.alpha, ms.beta, ms.base, ms.epsilon) == (2.0, 50.0, 0.5, 0.1)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_every_name_builds_from_a_config(name):
    from dmltrain.config import load_config
    from dmltrain.losses.kinds import CLASSIFIER_KINDS

    part = "classifier" if name in CLASSIFIER_KINDS else "instance"
    cfg = load_config(None, [f"loss.{part}.kind={name}"])
    section = getattr(cfg.loss, part)
    loss = make_loss(section.kind, section.params, num_classes=5, dim=cfg.model.embedding_dim)
    assert loss.registry_name == name


def test_bench_runs_and_prints_its_summary(capsys):
    """A smoke run of ``dmltrain bench losses`` (tiny sizes; times are reported, never asserted)."""
    import argparse

    from dmltrain.losses import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    threads = torch.get_num_threads()
    try:
        assert (
            bench.run(
                parser.parse_args(["--batch", "12", "--dim", "8", "--repeat", "1", "--warmup", "0", "--threads", "1"])
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("losses bench: batch 12 (4×3), dim 8")
    assert sum(line.split()[0] in INSTANCE_NAMES for line in lines) == len(INSTANCE_NAMES)
    assert lines[-1].startswith("summary: fwd+bwd median") and "ours/PML geometric mean" in lines[-1]
