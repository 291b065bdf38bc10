"""Every loss against a slow, loop-by-loop transcription of its paper's formula (values and
gradients, float64), and ``torch.autograd.gradcheck`` of the vectorised implementation.

The references below share no code with :mod:`dmltrain.losses`: plain Python loops over
anchors and pairs, scalar torch ops so autograd gives the reference gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from dmltrain.losses import build_loss

F64 = torch.float64


# -- helpers of the references ------------------------------------------------------------------
def unit(v):
    return v / v.norm()


def dist(u, v):
    return (u - v).norm()


def lse(values):
    return torch.logsumexp(torch.stack(list(values)), 0)


def positives(y, a):
    return [i for i in range(len(y)) if i != a and y[i] == y[a]]


def negatives(y, a):
    return [j for j in range(len(y)) if y[j] != y[a]]


def valid_anchors(y):
    return [a for a in range(len(y)) if positives(y, a)]


# -- proxy losses ---------------------------------------------------------------------------------
def ref_normsoftmax(x, y, W, temperature):
    total = 0.0
    for i in range(len(y)):
        logits = [unit(x[i]) @ unit(W[c]) / temperature for c in range(W.shape[0])]
        total = total - (logits[y[i]] - lse(logits))
    return total / len(y)


def ref_cosface(x, y, W, scale, margin):
    total = 0.0
    for i in range(len(y)):
        logits = []
        for c in range(W.shape[0]):
            cos = unit(x[i]) @ unit(W[c])
            logits.append(scale * (cos - margin) if c == y[i] else scale * cos)
        total = total - (logits[y[i]] - lse(logits))
    return total / len(y)


def ref_arcface(x, y, W, scale, margin):
    total = 0.0
    for i in range(len(y)):
        logits = []
        for c in range(W.shape[0]):
            cos = unit(x[i]) @ unit(W[c])
            if c == y[i]:
                theta = torch.acos(cos)
                target = torch.cos(theta + margin) if theta + margin <= math.pi else cos - margin * math.sin(margin)
                logits.append(scale * target)
            else:
                logits.append(scale * cos)
        total = total - (logits[y[i]] - lse(logits))
    return total / len(y)


def ref_softmax_ce(x, y, W, b, smoothing):
    K = W.shape[0]
    total = 0.0
    for i in range(len(y)):
        logits = [x[i] @ W[c] + b[c] for c in range(K)]
        norm = lse(logits)
        for c in range(K):
            q = 1 - smoothing if c == y[i] else smoothing / (K - 1)
            total = total - q * (logits[c] - norm)
    return total / len(y)


def ref_proxy_nca(x, y, W, scale, exclude_positive):
    total = 0.0
    for i in range(len(y)):
        d2 = [dist(unit(x[i]), unit(W[c])) ** 2 for c in range(W.shape[0])]
        denom = [-scale * d2[c] for c in range(W.shape[0]) if c != y[i] or not exclude_positive]
        total = total + scale * d2[y[i]] + lse(denom)
    return total / len(y)


def ref_center(x, y, W):
    return sum(0.5 * ((x[i] - W[y[i]]) ** 2).sum() for i in range(len(y))) / len(y)


# -- instance losses ------------------------------------------------------------------------------
def ref_ice(x, y, scale, normalize="batch"):
    """ICE eqs. 3 and 13-15: every instance is an anchor; ``N`` (eqs. 13-14) counts them all."""
    f = [unit(v) for v in x]
    total = 0.0
    for a in range(len(y)):
        negs = negatives(y, a)
        if not positives(y, a) or not negs:
            continue
        nll, miss = 0.0, 0.0
        for i in positives(y, a):
            p = torch.exp(scale * f[a] @ f[i]) / (
                torch.exp(scale * f[a] @ f[i]) + sum(torch.exp(scale * f[a] @ f[j]) for j in negs)
            )
            nll = nll - torch.log(p)
            miss = miss + (1 - p)
        total = total + nll / (2 * scale * miss.detach())
    return total / (len(y) if normalize == "batch" else len(valid_anchors(y)))


def ref_ranked_list(x, y, alpha, margin, temperature, balance, normalize="batch"):
    """RLL eqs. 11-14: every image is a query (eq. 14 divides by the batch size); a query without a
    positive still has its negative term (eq. 12). ``valid_anchors``: only queries with a positive."""
    f = [unit(v) for v in x]
    queries = list(range(len(y))) if normalize == "batch" else valid_anchors(y)
    total = 0.0
    for a in queries:
        # the gallery of anchor a's list is constant
        d = {j: dist(f[a], f[j].detach()) for j in range(len(y)) if j != a}
        hard_pos = [i for i in positives(y, a) if d[i] > alpha - margin]
        hard_neg = [j for j in negatives(y, a) if d[j] < alpha]
        loss_p = sum(d[i] - (alpha - margin) for i in hard_pos) / len(hard_pos) if hard_pos else 0.0
        w = {j: math.exp(temperature * (alpha - float(d[j].detach()))) for j in hard_neg}
        loss_n = sum(w[j] / sum(w.values()) * (alpha - d[j]) for j in hard_neg) if hard_neg else 0.0
        total = total + loss_p + balance * loss_n
    return total / len(queries)


def ref_contrastive(x, y, pos_margin, neg_margin):
    f = [unit(v) for v in x]
    total, active = 0.0, 0
    for a in valid_anchors(y):
        for j in range(len(y)):
            if j == a:
                continue
            d = dist(f[a], f[j])
            term = torch.clamp(d - pos_margin, min=0) ** 2 if y[j] == y[a] else torch.clamp(neg_margin - d, min=0) ** 2
            total = total + term
            active += int(term > 0)
    return total / max(active, 1)


def ref_triplet(x, y, margin, squared):
    f = [unit(v) for v in x]

    def d(i, j):
        return dist(f[i], f[j]) ** 2 if squared else dist(f[i], f[j])

    total, pairs = 0.0, 0
    for a in valid_anchors(y):
        for p in positives(y, a):
            pairs += 1
            negs = negatives(y, a)
            if not negs:
                continue
            d_ap = d(a, p)
            farther = [n for n in negs if d(a, n) > d_ap]
            n = (
                min(farther, key=lambda n: float(d(a, n).detach()))
                if farther
                else max(negs, key=lambda n: float(d(a, n).detach()))
            )
            total = total + torch.clamp(d_ap - d(a, n) + margin, min=0)
    return total / max(pairs, 1)


def ref_multi_similarity(x, y, alpha, beta, base, epsilon, normalize="batch"):
    """MS loss with MS mining, ``1/m Σ_i`` over the batch (``m`` its size); ``valid_anchors``: over anchors with a positive."""
    f = [unit(v) for v in x]
    total = 0.0
    for a in range(len(y)):
        pos = {i: f[a] @ f[i] for i in positives(y, a)}
        neg = {j: f[a] @ f[j] for j in negatives(y, a)}
        if not pos or not neg:
            continue
        min_pos, max_neg = min(float(s.detach()) for s in pos.values()), max(float(s.detach()) for s in neg.values())
        mined_neg = [s for s in neg.values() if s + epsilon > min_pos]
        mined_pos = [s for s in pos.values() if s - epsilon < max_neg]
        if not mined_neg or not mined_pos:
            continue
        total = total + 1 / alpha * torch.log(1 + sum(torch.exp(-alpha * (s - base)) for s in mined_pos))
        total = total + 1 / beta * torch.log(1 + sum(torch.exp(beta * (s - base)) for s in mined_neg))
    return total / (len(y) if normalize == "batch" else len(valid_anchors(y)))


def ref_snca(x, y, temperature):
    f = [unit(v) for v in x]
    total, n = 0.0, 0
    for a in valid_anchors(y):
        n += 1
        num = sum(torch.exp(f[a] @ f[j] / temperature) for j in positives(y, a))
        den = sum(torch.exp(f[a] @ f[k] / temperature) for k in range(len(y)) if k != a)
        total = total - torch.log(num / den)
    return total / n


def ref_lifted_structure(x, y, margin):
    f = [unit(v) for v in x]
    total, pairs = 0.0, 0
    for i in range(len(y)):
        for j in range(i + 1, len(y)):  # unordered positive pairs, as in the paper
            if y[i] != y[j]:
                continue
            pairs += 1
            terms = [torch.exp(margin - dist(f[i], f[k])) for k in negatives(y, i)]
            terms += [torch.exp(margin - dist(f[j], f[n])) for n in negatives(y, j)]
            if not terms:
                continue
            J = torch.log(sum(terms)) + dist(f[i], f[j])
            total = total + torch.clamp(J, min=0) ** 2
    return total / (2 * max(pairs, 1))


def ref_npair(x, y, l2_reg):
    total, n = 0.0, 0
    for a in valid_anchors(y):
        n += 1
        pos = positives(y, a)
        term = 0.0
        for p in pos:
            term = term + torch.log(1 + sum(torch.exp(x[a] @ x[j] - x[a] @ x[p]) for j in negatives(y, a)))
        total = total + term / len(pos) + 0.5 * l2_reg * (x[a] @ x[a])
    return total / n


def ref_spce(x, y):
    """The CE paper's SPCE formula verbatim (sec. 5.1); all classes must have >= 2 images."""
    n = len(y)
    classes = sorted(set(y))
    total = 0.0
    for i in range(n):
        tight = -sum(x[i] @ x[j] for j in range(n) if y[j] == y[i]) / n
        contrast = lse([sum(x[i] @ x[j] for j in range(n) if y[j] == k) / n for k in classes])
        total = total + tight + contrast
    return total / n


# -- the comparisons ------------------------------------------------------------------------------
LABELS = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]  # class 3 has a single image: a skipped anchor
B, D, C = len(LABELS), 6, 5

PROXY_CASES = {
    "normsoftmax": ({"temperature": 0.1}, lambda x, y, p, h: ref_normsoftmax(x, y, p["weight"], h["temperature"])),
    "cosface": (
        {"scale": 8.0, "margin": 0.35},
        lambda x, y, p, h: ref_cosface(x, y, p["weight"], h["scale"], h["margin"]),
    ),
    "arcface": (
        {"scale": 8.0, "margin": 0.5},
        lambda x, y, p, h: ref_arcface(x, y, p["weight"], h["scale"], h["margin"]),
    ),
    "softmax_ce": ({"smoothing": 0.1}, lambda x, y, p, h: ref_softmax_ce(x, y, p["weight"], p["bias"], h["smoothing"])),
    "proxy_nca": ({"scale": 3.0}, lambda x, y, p, h: ref_proxy_nca(x, y, p["weight"], h["scale"], True)),
    "center": ({}, lambda x, y, p, h: ref_center(x, y, p["weight"])),
}

INSTANCE_CASES = {
    "ice": ({"scale": 4.0}, lambda x, y, h: ref_ice(x, y, h["scale"], h.get("normalize", "batch"))),
    "ranked_list": (
        {"alpha": 1.2, "margin": 0.4, "temperature": 10.0},
        lambda x, y, h: ref_ranked_list(x, y, 1.2, 0.4, 10.0, 1.0, h.get("normalize", "batch")),
    ),
    "contrastive": ({"pos_margin": 0.2, "neg_margin": 1.3}, lambda x, y, h: ref_contrastive(x, y, 0.2, 1.3)),
    "triplet": ({"margin": 0.2}, lambda x, y, h: ref_triplet(x, y, 0.2, True)),
    "multi_similarity": (
        {},
        lambda x, y, h: ref_multi_similarity(x, y, 2.0, 50.0, 0.5, 0.1, h.get("normalize", "batch")),
    ),
    "snca": ({"temperature": 0.5}, lambda x, y, h: ref_snca(x, y, 0.5)),
    "lifted_structure": ({"margin": 1.0}, lambda x, y, h: ref_lifted_structure(x, y, 1.0)),
    "npair": ({"l2_reg": 0.002}, lambda x, y, h: ref_npair(x, y, 0.002)),
}


def random_batch(seed: int, labels=LABELS, dim=D, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(max(labels) + 1, dim, generator=g, dtype=F64)
    x = centers[torch.tensor(labels)] + spread * torch.randn(len(labels), dim, generator=g, dtype=F64)
    return x, torch.tensor(labels)


def proxy_params(name: str, loss, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    params = {"weight": torch.randn(C, D, generator=g, dtype=F64)}
    if name == "softmax_ce":  # zero-initialised in the loss; random here so every term is exercised
        params["bias"] = torch.randn(C, generator=g, dtype=F64)
    return params


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(PROXY_CASES))
def test_proxy_loss_matches_reference(name, seed):
    hyper, ref = PROXY_CASES[name]
    loss = build_loss(name, num_classes=C, dim=D, **hyper).double()
    x, y = random_batch(seed)
    params = {k: v.clone().requires_grad_(True) for k, v in proxy_params(name, loss, seed).items()}
    x1 = x.clone().requires_grad_(True)
    value = functional_call(loss, params, (x1, y))
    value.backward()
    x2 = x.clone().requires_grad_(True)
    ref_params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    expected = ref(x2, y.tolist(), ref_params, hyper)
    expected.backward()
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)
    for k in params:
        torch.testing.assert_close(params[k].grad, ref_params[k].grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(INSTANCE_CASES))
def test_instance_loss_matches_reference(name, seed):
    hyper, ref = INSTANCE_CASES[name]
    loss = build_loss(name, **hyper)
    x, y = random_batch(seed)
    x1 = x.clone().requires_grad_(True)
    value = loss(x1, y)
    value.backward()
    x2 = x.clone().requires_grad_(True)
    expected = ref(x2, y.tolist(), hyper)
    assert float(expected.detach()) > 0, "degenerate case: the reference loss is zero"
    expected.backward()
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)
    # the single-image class's anchor adds no term, except in RLL, where it keeps its negatives (eq. 12)
    assert loss.stats["skipped_anchors"] == (0.0 if name == "ranked_list" else 1.0)


# -- normalisation: the papers' N (every anchor) or the anchors with a positive -------------------------
NORMALIZED = ["ice", "ranked_list", "multi_similarity"]
# a batch as data.sampler=random draws it: classes 0, 2, 4 and 5 have a single image
SINGLETONS = [0, 1, 1, 2, 3, 3, 3, 4, 5, 6, 6, 1]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("normalize", ["batch", "valid_anchors"])
@pytest.mark.parametrize("name", NORMALIZED)
def test_normalization_with_single_image_classes_matches_reference(name, normalize, seed):
    hyper, ref = INSTANCE_CASES[name]
    hyper = {**hyper, "normalize": normalize}
    loss = build_loss(name, **hyper)
    x, y = random_batch(seed, labels=SINGLETONS, spread=0.8)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    value = loss(x1, y)
    value.backward()
    expected = ref(x2, SINGLETONS, hyper)
    expected.backward()
    assert float(expected.detach()) > 0
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)
    singles = [a for a in range(len(SINGLETONS)) if SINGLETONS.count(SINGLETONS[a]) == 1]
    reaches_singles = bool(x1.grad[singles].abs().sum() > 0)
    # a single-image anchor still pulls on its own embedding only in RLL's batch mode (its negative term);
    # elsewhere its row gets gradient only as somebody else's negative
    if name == "ranked_list":
        assert reaches_singles == (normalize == "batch")


@pytest.mark.parametrize("name", ["ice", "multi_similarity"])
def test_batch_normalization_is_n_over_valid_anchors_times_the_other(name):
    x, y = random_batch(2, labels=SINGLETONS, spread=0.8)
    hyper = INSTANCE_CASES[name][0]
    batch = build_loss(name, **hyper)(x, y)
    valid = build_loss(name, **hyper, normalize="valid_anchors")(x, y)
    n, n_valid = len(SINGLETONS), len(valid_anchors(SINGLETONS))
    torch.testing.assert_close(batch * n, valid * n_valid, rtol=1e-12, atol=0)


def test_unknown_normalization_is_one_line():
    with pytest.raises(ValueError, match="ranked_list: normalize must be one of batch, valid_anchors, got 'mean'"):
        build_loss("ranked_list", normalize="mean")


def test_spce_matches_paper_formula():
    labels = [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3]  # the paper's formula has no skipping: every class >= 2
    x, y = random_batch(3, labels)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    value = build_loss("spce")(x1, y)
    value.backward()
    expected = ref_spce(x2, labels)
    expected.backward()
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)


# -- gradcheck ------------------------------------------------------------------------------------
# Inputs well inside the hinge/mining regions (a random batch is almost surely away from any
# kink; the margins are chosen so that hinges are active for a good share of pairs).
# ICE and RLL hold some quantities constant (stop-gradient): they are checked separately below.
GRADCHECK_INSTANCE = {
    "contrastive": {"pos_margin": 0.2, "neg_margin": 1.3},
    "triplet": {"margin": 0.5},
    "multi_similarity": {},
    "snca": {"temperature": 0.5},
    "lifted_structure": {"margin": 1.0},
    "npair": {"l2_reg": 0.002},
    "spce": {},
}


@pytest.mark.parametrize("name", list(GRADCHECK_INSTANCE))
def test_instance_gradcheck(name):
    loss = build_loss(name, **GRADCHECK_INSTANCE[name])
    x, y = random_batch(5)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", list(PROXY_CASES))
def test_proxy_gradcheck(name):
    hyper = PROXY_CASES[name][0]
    loss = build_loss(name, num_classes=C, dim=D, **hyper).double()
    x, y = random_batch(6)
    params = proxy_params(name, loss, 6)
    names = list(params)
    inputs = (x.requires_grad_(True), *(params[k].requires_grad_(True) for k in names))

    def fn(e, *ps):
        return functional_call(loss, dict(zip(names, ps)), (e, y))

    # fast mode (random projections of the Jacobian): the full one costs ~3 s per loss here
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_ice_gradcheck_with_constant_weights():
    """ICE's eqs. 13-14 denominator is a constant of the loss: freeze it at the point of the
    check (through the loss's own ``log_weight_norm`` seam), then finite differences apply."""
    from dmltrain.losses.ice import ICELoss

    x, y = random_batch(5)
    frozen = {}

    class Frozen(ICELoss):
        def log_weight_norm(self, z, active):
            if "value" not in frozen:
                frozen["value"] = super().log_weight_norm(z, active)
            return frozen["value"]

    loss = Frozen(scale=4.0)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ranked_list_gradcheck_through_anchor():
    """In RLL the gallery and the negative weights are constants: check the gradient with the
    gallery fixed (only the anchors vary) and the eq.-9 weights frozen at the point of the check."""
    from dmltrain.losses.ranked_list import RankedListLoss

    x, y = random_batch(5)
    frozen = {}

    class Frozen(RankedListLoss):
        def negative_weights(self, d, hard_neg):
            if "value" not in frozen:
                frozen["value"] = super().negative_weights(d, hard_neg)
            return frozen["value"]

    loss = Frozen()
    idx = torch.arange(len(y))

    def fn(anchors):
        t = loss.anchor_terms(anchors, y, x, y, idx)
        return t.total / t.count

    assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(True),), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_lifted_structure_matches_pytorch_metric_learning():
    """A second, independent implementation of the same definition (PML's LiftedStructureLoss:
    both ends' negatives, mean over ordered positive pairs of [J]₊²/2)."""
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    x, y = random_batch(7)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = build_loss("lifted_structure", margin=1.0)(x1, y)
    theirs = pml.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)(x2, y)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("squared", [True, False])
def test_triplet_with_many_exact_ties_matches_reference(squared):
    """Embeddings drawn from a few lattice directions: many distances tie exactly, so the
    strict "farther than the positive" rule and run handling of the mining are exercised."""
    g = torch.Generator().manual_seed(8)
    dirs = torch.tensor(
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0], [-1, 0, 0, 0], [0, 0, 1, 1], [1, 0, 1, 0]], dtype=F64
    )
    labels = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    x = dirs[torch.randint(len(dirs), (len(labels),), generator=g)]
    y = torch.tensor(labels)
    for margin in (0.1, 0.5, 1.0):
        ours = build_loss("triplet", margin=margin, squared=squared)(x, y)
        assert float(ours) == pytest.approx(float(ref_triplet(x, labels, margin, squared)), rel=1e-12, abs=1e-12)
