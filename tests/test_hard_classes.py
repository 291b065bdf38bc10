"""Class subsampling that knows which classes are hard, measures its price, and survives noisy labels (#26),
in one process: hard and mixed draws against a brute-force reference (contents, sizes, determinism, the
log-Q offsets), an exact resume of the nearness index, the full-softmax probe against float64
references, sub-centers at k = 1 against the plain kinds, a step without host reads, and the
configuration and metrics around them. The same at W = 1..4 over gloo: tests/test_distributed_multiproc.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from distributed_reference import dense_classifier_loss, reference_hard_draw, reference_proportional_draw

from dmltrain.distributed import ClassifierHead, ShardedClassifier
from dmltrain.distributed.class_partition import ClassPartition
from dmltrain.distributed.class_sampling import draw_active, target_total


def _batch(C, D, B=20, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, D, generator=g, dtype=dtype), torch.randint(0, C, (B,), generator=g)


# -- the draw ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode,share,ratio,k,near",
    [
        ("hard", 1.0, 0.3, 1, "samples"),
        ("hard", 1.0, 0.3, 2, "samples"),
        ("hard", 1.0, 0.3, 1, "classes"),
        ("mixed", 0.5, 0.3, 2, "classes"),
        ("mixed", 0.25, 0.1, 1, "samples"),  # 0.1: fewer than the batch
    ],
)
def test_hard_and_mixed_draws_equal_the_brute_force_reference(mode, share, ratio, k, near):
    """The drawn classes are the reference's (every batch class, the nearest others by the index's exact
    cosines to the batch's embeddings or its classes' rows, then uniform ones by key), ``target_total`` of
    them, the uniform ones with their log-Q offset; the same call draws the same again, another step or seed
    draws others."""
    C, D = 61, 8
    clf = ShardedClassifier(C, D, "cosface", sample_ratio=ratio, sampling=mode, nearest_share=share, seed=5,
                            sampling_correction=True, subcenters=k, nearest_to=near)  # fmt: skip
    w = clf.full_weight()

    def check_offsets(got, offs, offsets):
        assert {c: round(o, 6) for c, o in offs.items() if o} == {c: round(o, 6) for c, o in offsets.items()}

    got, offsets = _draws_equal_the_reference(
        clf, C, D, ratio, lambda step, y, q: reference_hard_draw(C, y, ratio, 5, step, w, share, q), check_offsets
    )
    assert clf.active_class_ids.tolist() != got or not offsets, "the uniform part changes with the step"


def _draws_equal_the_reference(clf, C, D, ratio, reference, check_offsets):
    """Steps 0 and 3 draw the ``reference(step, labels, queries)``'s classes, ``target_total`` of them, every
    batch class among them, with offsets ``check_offsets(got, {class: offset}, reference's)`` accepts; the same
    call draws the same again. Then step 4 is drawn: returns (step 3's classes, step 3's reference offsets)."""
    for step in (0, 3):
        x, y = _batch(C, D, B=12, seed=step)
        with torch.no_grad():
            clf(x, y, step=step)
        got = clf.active_class_ids.tolist()
        queries = torch.nn.functional.normalize(x, dim=1) if clf.nearest_to == "samples" else None
        want, offsets = reference(step, y.tolist(), queries)
        assert got == want, f"{clf.sampling} step {step}"
        assert len(got) == target_total(C, len(set(y.tolist())), ratio)
        assert set(y.tolist()) <= set(got)
        check_offsets(got, {c: float(o) for c, o in zip(got, clf._active.offsets[: len(got)])}, offsets)
        with torch.no_grad():
            clf(x, y, step=step)
        assert clf.active_class_ids.tolist() == got, "a function of (seed, step, batch, index)"
    with torch.no_grad():
        clf(x, y, step=4)
    return got, offsets


@pytest.mark.parametrize("k,near", [(1, "samples"), (2, "samples"), (1, "classes")])
def test_proportional_draws_equal_the_brute_force_reference(k, near):
    """The drawn classes are the reference's Gumbel top-E (every batch class, then the others of largest
    logit-scaled nearness plus Gumbel noise from their key), each drawn other with its inclusion offset;
    the same call draws the same again, the next step draws others."""
    C, D = 61, 8
    clf = ShardedClassifier(C, D, "cosface", sample_ratio=0.3, sampling="proportional", seed=5, subcenters=k,
                            nearest_to=near, scale=8.0)  # fmt: skip
    w = clf.full_weight()

    def check_offsets(got, offs, offsets):
        assert all(offs[c] == 0 for c in got if c not in offsets), "the batch's classes are in for sure"
        assert all(abs(offs[c] - o) < 1e-5 * max(1.0, o) for c, o in offsets.items())

    got, _ = _draws_equal_the_reference(
        clf, C, D, 0.3, lambda step, y, q: reference_proportional_draw(C, y, 0.3, 5, step, w, 8.0, q), check_offsets
    )
    assert clf.active_class_ids.tolist() != got


def test_the_proportional_draws_offsets_make_an_unbiased_estimate_of_the_other_classes_mass():
    """Over many steps, the drawn others' ``exp(z + offset)`` sum on average to all the others' ``exp(z)``
    (priority sampling); with a weight that matches ``z`` the estimate is within a few percent every step,
    while the offsets off by one (the uniform draw's ``log(pool/E)``, say) would be off by far more."""
    C, steps = 50, 1000
    g = torch.Generator().manual_seed(0)
    logw = torch.randn(C, generator=g) * 2
    z = logw.double() + 0.3 * torch.randn(C, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 2])
    est = torch.empty(steps, dtype=torch.float64)
    for step in range(steps):
        a = draw_active(labels, ClassPartition(C, 1), 0.2, 7, step, weights=logw)
        other = a.rows >= 3
        est[step] = (z[a.rows[other]] + a.offsets[other].double()).exp().sum()
    true = z[3:].exp().sum()
    se = est.std() / steps**0.5
    assert abs(est.mean() - true) < 4 * se, (float(est.mean()), float(true), float(se))
    assert se < 0.01 * true


def test_the_index_is_refreshed_every_refresh_every_steps_and_resumes_exactly(tmp_path):
    """The index is rebuilt at steps 0, 3, 6 from the rows as they are then; saved after step 4 and loaded
    into a fresh head, steps 5-6 draw what the uninterrupted run drew (step 5 from the index of step 3, not
    from the rows of step 5) and end with bit-identical rows and optimizer state."""
    C, D = 120, 8

    def head() -> ClassifierHead:
        clf = ShardedClassifier(C, D, "normsoftmax", sample_ratio=0.2, seed=4, sampling="hard", refresh_every=3,
                                temperature=0.1)  # fmt: skip
        return ClassifierHead(clf, "sgd", lr=2.0, momentum=0.9)

    def train(h: ClassifierHead, steps) -> list[list[int]]:
        drawn = []
        for step in steps:
            x, y = _batch(C, D, seed=10 + step)
            h(x, y, step=step).backward()
            drawn.append(h.classifier.active_class_ids.tolist())
            assert h.classifier.index.built_at == step // 3 * 3
            h.step()
        return drawn

    whole = head()
    drawn = train(whole, range(7))
    first = head()
    train(first, range(5))
    first.save(tmp_path / "ckpt")
    resumed = head()
    resumed.load(tmp_path / "ckpt")
    assert resumed.classifier.index.built_at == 3
    assert train(resumed, range(5, 7)) == drawn[5:]
    assert torch.equal(resumed.classifier.weight, whole.classifier.weight)
    for key, v in whole.optimizer.state[whole.classifier.weight].items():
        assert torch.equal(resumed.optimizer.state[resumed.classifier.weight][key], v), key
    # the test can fail: an index rebuilt from the rows at step 5 ranks other classes nearest
    rebuilt = head()
    rebuilt.load(tmp_path / "ckpt")
    rebuilt.classifier.index = None
    x, y = _batch(C, D, seed=15)
    with torch.no_grad():
        rebuilt(x, y, step=5)
    assert rebuilt.classifier.active_class_ids.tolist() != drawn[5]


def test_nearest_after_draws_uniformly_until_then_and_builds_the_index_there():
    """With ``nearest_after: 3`` a mixed draw is the reference's uniform one (log-Q offsets included, no index
    built) at steps 0-2, and the reference's mixed one from step 3 on, from an index first built at step 3 and
    refreshed every ``refresh_every`` steps from there."""
    C, D, ratio, share = 61, 8, 0.3, 0.5
    clf = ShardedClassifier(C, D, "cosface", sample_ratio=ratio, sampling="mixed", nearest_share=share, seed=5,
                            sampling_correction=True, nearest_to="samples", nearest_after=3, refresh_every=2)  # fmt: skip
    w = clf.full_weight()
    for step in range(6):
        x, y = _batch(C, D, B=12, seed=step)
        with torch.no_grad():
            clf(x, y, step=step)
        got = clf.active_class_ids.tolist()
        q = torch.nn.functional.normalize(x, dim=1)
        want, offsets = reference_hard_draw(C, y.tolist(), ratio, 5, step, w, 0.0 if step < 3 else share, q)
        assert got == want, f"step {step}"
        offs = {c: round(float(o), 6) for c, o in zip(got, clf._active.offsets[: len(got)]) if o}
        assert offs == {c: round(o, 6) for c, o in offsets.items()}, f"step {step}"
        assert (clf.index is None) if step < 3 else clf.index.built_at == (3 if step < 5 else 5), f"step {step}"
    # the test can fail: from step 0 on, step 2 draws its nearest classes
    early = ShardedClassifier(C, D, "cosface", sample_ratio=ratio, sampling="mixed", nearest_share=share, seed=5,
                              sampling_correction=True, nearest_to="samples")  # fmt: skip
    x, y = _batch(C, D, B=12, seed=2)
    with torch.no_grad():
        early(x, y, step=2)
    assert early.active_class_ids.tolist() != reference_hard_draw(C, y.tolist(), ratio, 5, 2, w, 0.0)[0]
    # a resume that raises nearest_after past the saved index's step builds a new one at it, not 10 steps on
    early.nearest_after = 3
    x, y = _batch(C, D, B=12, seed=3)
    with torch.no_grad():
        early(x, y, step=3)
    assert early.index.built_at == 3


# -- the probe --------------------------------------------------------------------------------------------
def _ref_grad(x, y, w, params, active=None, offsets=None):
    xr = x.detach().clone().requires_grad_(True)
    loss = dense_classifier_loss(xr, y, w.double(), None, "arcface", params, active, offsets)
    (g,) = torch.autograd.grad(loss, xr)
    return float(loss.detach()), g


@pytest.mark.parametrize("ratio,mode", [(1.0, "uniform"), (0.6, "mixed")])
def test_the_probe_measures_the_sampled_gradient_against_the_full_softmax(ratio, mode):
    """The probe's full loss and gradient are one float64 process's over every class, its sampled ones over
    the step's drawn classes (log-Q offsets included); at ratio 1 they are one: cosine 1, norm ratio 1, gap 0.
    A mixed draw's probe adds the loss gap of the reference's uniform draw of the same step, uncorrected.
    Nothing is written: no row gradient, the step's draw and statistics are kept."""
    C, D = 40, 8
    params = {"scale": 16.0, "margin": 0.5}
    clf = ShardedClassifier(C, D, "arcface", sample_ratio=ratio, sampling=mode, sampling_correction=mode != "uniform",
                            seed=2, **params).double()  # fmt: skip
    x, y = _batch(C, D, B=12, dtype=torch.float64)
    with torch.no_grad():
        loss = float(clf(x, y, step=7))
    active, stats = clf._active, dict(clf.stats)
    probe = {k: float(v) for k, v in clf.probe(x, y, 7).items()}
    assert clf.weight.grad is None and clf._active is active and dict(clf.stats) == stats
    w = clf.full_weight()
    full_loss, gf = _ref_grad(x, y, w, clf.params)
    if ratio == 1.0:
        assert probe == {"grad_cos": pytest.approx(1.0, abs=1e-12), "grad_norm_ratio": pytest.approx(1.0, abs=1e-12),
                         "loss_gap": 0.0, "full_loss": pytest.approx(loss, rel=1e-12)}  # fmt: skip
        sampled_loss, gs = full_loss, gf
    else:
        ids = clf.active_class_ids
        offsets = active.offsets[: ids.numel()]
        assert bool((offsets > 0).any()), "the uniform part is corrected"
        sampled_loss, gs = _ref_grad(x, y, w, clf.params, ids, offsets)
        assert probe["grad_cos"] < 0.999
        uniform_ids, _ = reference_hard_draw(C, y.tolist(), ratio, 2, 7, w, 0.0)
        assert uniform_ids != ids.tolist()
        uniform_loss, _ = _ref_grad(x, y, w, clf.params, torch.tensor(uniform_ids))
        assert probe["uniform_loss_gap"] == pytest.approx(uniform_loss - full_loss, abs=1e-10)
    assert probe["full_loss"] == pytest.approx(full_loss, rel=1e-10)
    assert probe["loss_gap"] == pytest.approx(sampled_loss - full_loss, abs=1e-10)
    cos = float((gs * gf).sum() / (gs.norm() * gf.norm()))
    assert probe["grad_cos"] == pytest.approx(cos, abs=1e-10)
    assert probe["grad_norm_ratio"] == pytest.approx(float(gs.norm() / gf.norm()), rel=1e-10)


def test_the_objective_probes_every_probe_every_steps():
    """``loss.classifier.probe_every``: on those steps the probe's figures join the classifier's statistics
    (MLflow: softmax/probe/...), and the metrics average them over the steps that have them."""
    from dmltrain.config import build_config
    from dmltrain.training.metrics import TrainMetrics, mlflow_names
    from dmltrain.training.objective import Objective

    cfg = build_config({"loss": {"classifier": {"sample_ratio": 0.5, "probe_every": 2}}})
    obj = Objective(cfg, num_classes=30, dim=8, world_size=1)
    metrics = TrainMetrics()
    seen = []
    for step in range(3):
        x, y = _batch(30, 8, seed=step)
        if obj.probe_due(step):  # as the trainer does, the probe's time aside
            obj.probe(x, y, step)
        obj(x.requires_grad_(True), y, step=step).backward()
        stats = obj.device_stats
        seen.append("classifier/probe/grad_cos" in stats)
        metrics.add(stats)
    assert seen == [True, False, True]
    summary = mlflow_names(metrics.summary())
    assert 0.0 < summary["softmax/probe/grad_cos"] < 1.0
    assert {"softmax/probe/grad_norm_ratio", "softmax/probe/loss_gap", "softmax/probe/full_loss"} <= set(summary)


def test_the_objective_turns_hard_at_nearest_after_and_the_probe_scores_chance_from_then_on():
    """``loss.classifier.nearest_after`` reaches the classifier: the index is first built at that step, and the
    probe's ``uniform_loss_gap`` (a uniform draw of the same size on the same model) starts there, where the
    step's draw stops being uniform."""
    from dmltrain.config import build_config
    from dmltrain.training.objective import Objective

    classifier = {
        "sample_ratio": 0.5,
        "sampling": "mixed",
        "nearest_to": "samples",
        "nearest_after": 2,
        "probe_every": 1,
    }
    obj = Objective(build_config({"loss": {"classifier": classifier}}), num_classes=30, dim=8, world_size=1)
    seen, built = [], []
    for step in range(4):
        x, y = _batch(30, 8, seed=step)
        obj.probe(x, y, step)
        obj(x.requires_grad_(True), y, step=step).backward()
        seen.append("classifier/probe/uniform_loss_gap" in obj.device_stats)
        built.append(None if obj.classifier.index is None else obj.classifier.index.built_at)
    assert seen == [False, False, True, True] and built == [None, None, 2, 2]


def test_metrics_average_a_statistic_over_the_steps_that_report_it():
    from dmltrain.training.metrics import TrainMetrics

    m = TrainMetrics()
    m.add({"a": 1.0, "b": torch.tensor(0.5)})
    m.add({"a": 3.0})
    assert m.summary() == {"a": 2.0, "b": 0.5}


# -- sub-centers ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,params", [("arcface", {"scale": 16.0, "margin": 0.5}), ("cosface", {"margin": 0.2})])
def test_one_subcenter_is_the_plain_kind_bit_for_bit(kind, params):
    C, D = 50, 8
    runs = []
    for extra in ({}, {"subcenters": 1}):
        clf = ShardedClassifier(C, D, kind, sample_ratio=0.5, seed=3, **params, **extra)
        x, y = _batch(C, D)
        x.requires_grad_(True)
        loss = clf(x, y, step=2)
        loss.backward()
        runs.append((loss.detach(), x.grad, clf.weight.grad.clone(), clf.weight.detach().clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert runs[0][2].shape == (C, D)


def test_subcenter_weight_starts_the_same_at_every_world_size_and_loads_by_class():
    """The k rows of a class come from its class block's generator (the same whatever the partition), and
    a whole weight of the wrong shape is refused in one line."""
    clf = ShardedClassifier(10, 4, "arcface", subcenters=3, seed=1)
    assert tuple(clf.weight.shape) == (10, 3, 4)
    again = ShardedClassifier(10, 4, "arcface", subcenters=3, seed=1)
    assert torch.equal(clf.weight, again.weight)
    with pytest.raises(ValueError, match="expected a 10×3×4 weight"):
        clf.load_full_weight(torch.zeros(10, 4))


def test_a_class_is_never_dropped_against_a_dominant_sub_center_it_has_not_got_yet():
    """Dropping from step 0: a class none of whose samples was counted yet has no dominant sub-center, so its
    samples stay in the loss (step 0 wholly, then a class first seen at step 1 whose samples lie on its third
    sub-center); once counted, a sample 90° from its class's dominant sub-center is dropped."""
    C, D, k = 2, 8, 3
    w = torch.eye(D)[: C * k].view(C, k, D)  # class c's sub-center j: the unit vector e_{3c+j}
    clf = ShardedClassifier(C, D, "cosface", seed=1, drop_after=0, drop_angle=75.0, subcenters=k, margin=0.2)
    clf.load_full_weight(w)
    on = lambda c, j, n: (w[c, j].repeat(n, 1), torch.full((n,), c))  # noqa: E731 — n samples on sub-center j
    batches = [
        [on(0, 1, 4)],  # class 0 seen first, on its sub-center 1
        [on(1, 2, 4), on(0, 1, 1), on(0, 0, 2)],  # class 1 first seen on sub-center 2; two of class 0's at 90°
    ]
    for step, parts in enumerate(batches):
        x, y = (torch.cat(t) for t in zip(*parts))
        x.requires_grad_(True)
        loss = clf(x, y, step=step)
        loss.backward()
        keep = torch.ones(len(y), dtype=torch.bool) if step == 0 else torch.tensor([True] * 5 + [False] * 2)
        assert clf.stats["dropped"] == pytest.approx(float((~keep).double().mean())), f"step {step}"
        xr, wr = x.detach().double().requires_grad_(True), w.double().requires_grad_(True)
        ref = dense_classifier_loss(xr, y, wr, None, "cosface", clf.params, keep=keep)
        ref.backward()
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
        assert torch.allclose(x.grad.double(), xr.grad, atol=1e-6)
        clf.zero_grad()
    assert clf.subcenter_counts.tolist() == [[2, 5, 0], [0, 0, 4]]  # dropped samples count too


def test_before_drop_after_the_samples_beyond_the_angle_are_counted_not_dropped():
    """Until ``drop_after`` the share beyond ``drop_angle`` is reported (``beyond_drop_angle``) while the loss
    and gradients stay the plain mean's (``dropped`` 0); from ``drop_after`` on the same share is dropped."""
    C, D, k = 2, 8, 3
    w = torch.eye(D)[: C * k].view(C, k, D)
    x = torch.cat([w[0, 1].repeat(4, 1), w[0, 0].repeat(2, 1), w[1, 2].repeat(2, 1)])  # 2 of class 0's at 90°
    y = torch.tensor([0] * 6 + [1] * 2)
    clf = ShardedClassifier(C, D, "cosface", seed=1, drop_after=2, drop_angle=75.0, subcenters=k, margin=0.2)
    clf.load_full_weight(w)
    for step in range(3):
        xs = x.clone().requires_grad_(True)
        loss = clf(xs, y, step=step)
        loss.backward()
        keep = torch.ones(8, dtype=torch.bool) if step < 2 else torch.tensor([True] * 4 + [False] * 2 + [True] * 2)
        assert clf.stats["beyond_drop_angle"] == pytest.approx(0.0 if step == 0 else 0.25), step
        assert clf.stats["dropped"] == pytest.approx(float((~keep).double().mean())), step
        xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
        ref = dense_classifier_loss(xr, y, wr, None, "cosface", clf.params, keep=keep)
        ref.backward()
        assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6), step
        assert torch.allclose(xs.grad.double(), xr.grad, atol=1e-6), step
        clf.zero_grad()


# -- no host reads ----------------------------------------------------------------------------------------
def test_a_hard_subcenter_step_with_probe_and_dropping_reads_nothing_back():
    """Mixed draws with the correction, 2 sub-centers, samples dropped, the probe: forward, backward and the
    optimizer step with every Python-level device read refused (tests/host_reads.py)."""
    from host_reads import no_host_reads

    C, D = 60, 8
    clf = ShardedClassifier(C, D, "arcface", sample_ratio=0.2, seed=1, sampling="mixed", sampling_correction=True,
                            refresh_every=2, drop_after=1, drop_angle=80.0, subcenters=2)  # fmt: skip
    head = ClassifierHead(clf, "sgd", lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _batch(C, D, seed=step)
        x.requires_grad_(True)
        with no_host_reads():
            probe = clf.probe(x, y, step, sizes=[x.shape[0]])
            head(x, y, step=step, sizes=[x.shape[0]]).backward()
            head.step()
    assert 0.0 < float(probe["grad_cos"]) < 1.0
    assert clf.stats["dropped"] > 0.0
    assert torch.isfinite(clf.weight).all()


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "classifier,message",
    [
        ({"drop_after": 10}, "loss.classifier.drop_after: drops samples far from their class's dominant sub-center"),
        ({"params": {"subcenters": 2.5}}, "loss.classifier.params.subcenters: subcenters must be a whole number"),
        (
            {"sampling": "nearest"},
            "loss.classifier.sampling: Input should be 'uniform', 'hard', 'mixed' or 'proportional'",
        ),
        (
            {"sampling": "proportional", "weight_storage": "bf16"},
            "needs the fused kernels, which take no log-Q correction",
        ),
        ({"nearest_share": 1.5}, "loss.classifier.nearest_share"),
        ({"nearest_after": -1}, "loss.classifier.nearest_after"),
        ({"kind": "softmax_ce", "params": {"subcenters": 2}}, "not a parameter of softmax_ce"),
    ],
)
def test_bad_sampling_and_subcenter_settings_are_one_line(classifier, message):
    from dmltrain.config import build_config
    from dmltrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_config({"loss": {"classifier": classifier}})


def test_the_replicated_margin_losses_refuse_subcenters():
    from dmltrain.losses import build_loss

    with pytest.raises(ValueError, match="subcenters > 1 is the class-sharded classifier's"):
        build_loss("arcface", num_classes=5, dim=4, subcenters=2)
    loss = build_loss("arcface", num_classes=5, dim=4, subcenters=1)(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    assert math.isfinite(float(loss.detach()))
