"""The distributed core against one process holding everything (gloo on loopback).

Each world size W ∈ {1, 2, 3, 4} is spawned once and runs every check inside
(:func:`_world_checks`); the tests then read its report. Uneven C/W (23 classes) and uneven
local batches (one worker with no sample at W = 4). Hard and mixed class draws (the nearness
index, the log-Q correction) and sub-centers (with sample dropping) are checked at every W against
the slow references too. The W = 2 run ends with a tiny backbone under a real DeepSpeed ZeRO-1 engine.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from distributed_reference import (
    dense_classifier_loss,
    reference_draw,
    reference_hard_draw,
    reference_proportional_draw,
    rel_err,
)
from multiproc import run_workers

pytestmark = pytest.mark.multiprocess

DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
C, D = 23, 8
SPLITS = {1: [16], 2: [9, 7], 3: [6, 3, 7], 4: [5, 0, 7, 4]}
TOL = 1e-5

CLASSIFIER_CASES = [
    ("normsoftmax", {"temperature": 0.05}),
    ("normsoftmax", {"temperature": 0.5}),
    ("cosface", {"scale": 16.0, "margin": 0.35}),
    ("cosface", {"scale": 16.0, "margin": 0.0}),
    ("arcface", {"scale": 16.0, "margin": 0.5}),
    ("arcface", {"scale": 16.0, "margin": 0.0}),
    ("softmax_ce", {"smoothing": 0.1}),
    ("softmax_ce", {"smoothing": 0.0}),
]
INSTANCE_LOSSES = ["ice", "ranked_list", "multi_similarity", "contrastive", "snca", "triplet", "spce"]


def _global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """16 embeddings of 8 classes × 2 (positives split across workers at every W)."""
    g = torch.Generator().manual_seed(seed)
    classes = torch.randperm(C, generator=g)[:8]
    labels = classes.repeat(2)[torch.randperm(16, generator=g)]
    x = torch.randn(16, D, generator=g)
    return x, labels


def _full_weight(kind: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C, D, generator=g) * (0.3 if kind == "softmax_ce" else 1.0)
    b = torch.randn(C, generator=g) * 0.1 if kind == "softmax_ce" else None
    return w, b


def _local(t: torch.Tensor, rank: int, W: int) -> torch.Tensor:
    sizes = SPLITS[W]
    s = sum(sizes[:rank])
    return t[s : s + sizes[rank]].clone()


def _classifier_case(rank, W, kind, params, budget, ratio=1.0, step=0):
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    x_full, y_full = _global_batch()
    w_full, b_full = _full_weight(kind)
    clf = ShardedClassifier(C, D, kind, sample_ratio=ratio, seed=7, logits_budget_mb=budget, **params)
    clf.load_full_weight(w_full, b_full)
    x = _local(x_full, rank, W).requires_grad_(True)
    loss = clf(x, _local(y_full, rank, W), step=step)
    loss.backward()
    active = all_gather_uneven(clf.active_class_ids)[0]
    out = {
        "loss": float(loss.detach()),
        "kept": clf.stats["logits_kept"],
        "active_classes": clf.stats["active_classes"],
        "w_grad": clf.gather_rows_all(clf.weight.grad),
        "x_grad": all_gather_uneven(x.grad)[0],
        "active": active,
        "local_active": clf.active_rows.clone(),
        "local_positives": torch.unique(y_full[(y_full >= clf.class_start) & (y_full < clf.class_end)])
        - clf.class_start,
        "num_local": clf.num_local,
    }
    if kind == "softmax_ce":
        out["b_grad"] = clf.gather_rows_all(clf.bias.grad)
    if rank != 0:
        return out, clf
    xr = x_full.double().requires_grad_(True)
    wr = w_full.double().requires_grad_(True)
    br = None if b_full is None else b_full.double().requires_grad_(True)
    ref = dense_classifier_loss(xr, y_full, wr, br, kind, clf.params, None if ratio >= 1 else torch.sort(active).values)
    ref.backward()
    out["err"] = {
        "loss": rel_err(out["loss"], float(ref.detach())),
        "weight grad": rel_err(out["w_grad"], wr.grad),
        "embedding grad": rel_err(out["x_grad"], xr.grad),
    }
    if br is not None:
        out["err"]["bias grad"] = rel_err(out["b_grad"], br.grad)
    return out, clf


def _few_classes_case(rank, W):
    """3 classes: at W = 4 one shard owns none (and at W = 4 one worker has no sample)."""
    from dmltrain.distributed import ShardedClassifier, make_classifier_optimizer
    from dmltrain.distributed.collectives import all_gather_uneven

    x_full, _ = _global_batch()
    y_full = torch.arange(16) % 3
    g = torch.Generator().manual_seed(2)
    w_full = torch.randn(3, D, generator=g)
    clf = ShardedClassifier(3, D, "cosface", scale=8.0, margin=0.2)
    clf.load_full_weight(w_full)
    opt = make_classifier_optimizer(clf, "sgd", lr=0.1)
    x = _local(x_full, rank, W).requires_grad_(True)
    loss = clf(x, _local(y_full, rank, W))
    loss.backward()
    opt.step()  # must cope with an empty shard
    w_grad, x_grad = clf.gather_rows_all(clf.weight.grad), all_gather_uneven(x.grad)[0]
    if rank != 0:
        return {}
    xr, wr = x_full.double().requires_grad_(True), w_full.double().requires_grad_(True)
    ref = dense_classifier_loss(xr, y_full, wr, None, "cosface", clf.params)
    ref.backward()
    return {
        "err": {
            "loss": rel_err(float(loss.detach()), float(ref.detach())),
            "weight grad": rel_err(w_grad, wr.grad),
            "embedding grad": rel_err(x_grad, xr.grad),
        }
    }


def _singleton_batch(seed: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """16 embeddings as data.sampler=random draws them: 3 single-image classes, the rest 2-3 images."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([0, 1, 2, 3, 3, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7])[torch.randperm(16, generator=g)]
    return torch.randn(16, D, generator=g), labels


def _instance_checks(rank, W):
    from dmltrain.distributed import GatheredInstanceLoss
    from dmltrain.distributed.collectives import all_gather_uneven
    from dmltrain.losses import build_loss, loss_names

    # every loss on P×K-like pairs; the normalised ones also on single-image classes, in both normalisations
    cases = [(name, {}, _global_batch(seed=3)) for name in INSTANCE_LOSSES]
    cases += [
        (name, {"normalize": n}, _singleton_batch())
        for name in ("ice", "ranked_list", "multi_similarity")
        for n in ("batch", "valid_anchors")
    ]
    report = {}
    for name, params, (x_full, y_full) in cases:
        assert name in loss_names(), f"{name} is not registered: its distributed check would be lost"
        loss = build_loss(name, **params)
        modes = ["local_anchors", "full"] if loss.decomposes else ["full"]
        tag = name + (f"[{params['normalize']}, single-image classes]" if params else "")
        for mode in modes:
            wrapper = GatheredInstanceLoss(loss, mode=mode)
            x = _local(x_full, rank, W).requires_grad_(True)
            value = wrapper(x, _local(y_full, rank, W))
            value.backward()
            x_grad = all_gather_uneven(x.grad)[0]
            stats = dict(wrapper.stats)
            if rank != 0:
                report[f"{tag}/{mode}"] = {"loss": float(value.detach())}
                continue
            xr = x_full.clone().requires_grad_(True)
            ref = build_loss(name, **params)(xr, y_full)
            ref.backward()
            ref_stats = build_loss(name, **params)
            ref_stats(x_full, y_full)
            stat_err = max((rel_err(stats[k], v) for k, v in ref_stats.stats.items()), default=0.0)
            report[f"{tag}/{mode}"] = {
                "loss": float(value.detach()),
                "err": {
                    "loss": rel_err(float(value.detach()), float(ref.detach())),
                    "embedding grad": rel_err(x_grad, xr.grad),
                    "stats": stat_err,
                },
                "missing_stats": sorted(set(ref_stats.stats) - set(stats)),
            }
    return report


def _sampling_checks(rank, W):
    """sample_ratio < 1: exactness on the drawn classes, the draw's rules, sparse optimizer updates."""
    from dmltrain.distributed import make_classifier_optimizer
    from dmltrain.distributed.class_sampling import target_total

    report = {}
    for kind, params in [
        ("normsoftmax", {"temperature": 0.1}),
        ("arcface", {"scale": 16.0, "margin": 0.5}),
        ("softmax_ce", {"smoothing": 0.1}),
    ]:
        for budget in (64.0, 1e-4):
            out, clf = _classifier_case(rank, W, kind, params, budget, ratio=0.5, step=11)
            local_active = out["local_active"]
            # the shard's part of the global draw: the slow reference's, the same at every W
            batch_classes = torch.unique(_global_batch()[1])
            ref = reference_draw(C, batch_classes.tolist(), 0.5, clf.seed, 11)
            want = [c - clf.class_start for c in ref if clf.class_start <= c < clf.class_end]
            inactive = torch.ones(clf.num_local, dtype=torch.bool)
            inactive[local_active] = False
            entry = {
                "loss": out["loss"],
                "positives_drawn": bool(torch.isin(out["local_positives"], local_active).all()),
                "equals_reference": local_active.tolist() == want,
                "count_ok": out["active"].numel() == target_total(C, batch_classes.numel(), 0.5),
                "inactive_grad_zero": bool((clf.weight.grad[inactive] == 0).all()),
            }
            # the same step draws the same rows again
            x_full, y_full = _global_batch()
            clf(_local(x_full, rank, W), _local(y_full, rank, W), step=11)
            entry["reproducible"] = torch.equal(clf.active_rows, local_active)
            if rank == 0:
                entry["err"] = out["err"]
            report[f"{kind}/budget={budget:g}"] = entry
    report["no host reads"] = _no_host_reads_step(rank, W)
    # optimizer steps touch only drawn rows (and their state), bit for bit
    for name in ("sgd", "adamw"):
        out, clf = _classifier_case(rank, W, "normsoftmax", {"temperature": 0.1}, 64.0, ratio=0.5, step=3)
        opt = make_classifier_optimizer(clf, name, lr=0.1, momentum=0.9, weight_decay=0.01)
        before_w = clf.weight.detach().clone()
        before_s = {k: v.clone() for k, v in opt.state[clf.weight].items()}
        opt.step()
        active = out["local_active"]
        inactive = torch.ones(clf.num_local, dtype=torch.bool)
        inactive[active] = False
        report[f"optimizer/{name}"] = {
            "undrawn_weight_unchanged": torch.equal(clf.weight.detach()[inactive], before_w[inactive]),
            "undrawn_state_unchanged": all(
                torch.equal(v[inactive], before_s[k][inactive]) for k, v in opt.state[clf.weight].items()
            ),
            "drawn_changed": bool((clf.weight.detach()[active] != before_w[active]).any(dim=1).all())
            if active.numel()
            else True,
        }
    return report


def _no_host_reads_step(rank, W):
    """One head step (label smoothing, the draw's count on the device) with every host read refused
    (tests/host_reads.py), the batch sizes given; the drawn classes are the reference's."""
    from host_reads import no_host_reads

    from dmltrain.distributed import ClassifierHead, ShardedClassifier

    x_full, y_full = _global_batch(seed=6)
    clf = ShardedClassifier(C, D, "softmax_ce", sample_ratio=0.2, seed=7, smoothing=0.1)
    head = ClassifierHead(clf, "sgd", lr=0.1, momentum=0.9)
    x = _local(x_full, rank, W).requires_grad_(True)
    with no_host_reads():
        head(x, _local(y_full, rank, W), step=5, sizes=SPLITS[W]).backward()
        head.step()
    want = [
        c - clf.class_start
        for c in reference_draw(C, y_full.tolist(), 0.2, 7, 5)
        if clf.class_start <= c < clf.class_end
    ]
    return {"drawn": clf.active_rows.tolist() == want, "count on the device": clf._active.count is not None}


def _hard_checks(rank, W):
    """Hard and mixed draws: every shard's part of the drawn set is the brute-force reference's (the same set
    at every W), the log-Q offsets are its, and the loss and gradients equal one float64 process's on them."""
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    report = {}
    x_full, y_full = _global_batch(seed=8)
    cases = [
        ("hard normsoftmax, nearest the samples", "hard", 1.0, False, "normsoftmax", {"temperature": 0.1}, "samples"),
        ("mixed arcface, 2 sub-centers, corrected, nearest the classes", "mixed", 0.5, True, "arcface",
         {"scale": 16.0, "margin": 0.5, "subcenters": 2}, "classes"),
        ("proportional cosface, nearest the samples", "proportional", 1.0, True, "cosface",
         {"scale": 8.0, "margin": 0.2}, "samples"),
    ]  # fmt: skip
    for name, mode, share, corr, kind, params, near in cases:
        k = params.get("subcenters", 1)
        g = torch.Generator().manual_seed(9)
        w_full = torch.randn(C, k, D, generator=g) if k > 1 else torch.randn(C, D, generator=g)
        clf = ShardedClassifier(C, D, kind, sample_ratio=0.6, seed=7, sampling=mode, nearest_share=share,
                                sampling_correction=corr, nearest_to=near, **params)  # fmt: skip
        clf.load_full_weight(w_full)
        x = _local(x_full, rank, W).requires_grad_(True)
        loss = clf(x, _local(y_full, rank, W), step=4)
        loss.backward()
        ids = clf.active_class_ids
        active = all_gather_uneven(ids)[0]
        offs = all_gather_uneven(clf._active.offsets[: ids.numel()])[0] if corr else None
        x_grad, w_grad = all_gather_uneven(x.grad)[0], clf.gather_rows_all(clf.weight.grad)
        queries = torch.nn.functional.normalize(x_full, dim=1) if near == "samples" else None
        if mode == "proportional":
            want, want_offs = reference_proportional_draw(C, y_full.tolist(), 0.6, 7, 4, w_full, clf.scale, queries)
        else:
            want, want_offs = reference_hard_draw(C, y_full.tolist(), 0.6, 7, 4, w_full, share, queries)
        entry = {
            "local part": ids.tolist() == [c for c in want if clf.class_start <= c < clf.class_end],
            "global set": sorted(active.tolist()) == want,
            "nearest drawn": mode != "hard" or len(want) > len(set(y_full.tolist())),
        }
        if corr:
            got_offs = {int(c): float(o) for c, o in zip(active, offs) if o != 0}
            entry["offsets"] = got_offs.keys() <= want_offs.keys() and all(  # an offset may round to 0 in fp32
                abs(got_offs.get(c, 0.0) - o) < 1e-5 * max(1.0, o) for c, o in want_offs.items()
            )
        if rank == 0:
            xr, wr = x_full.double().requires_grad_(True), w_full.double().requires_grad_(True)
            off_t = torch.tensor([want_offs.get(c, 0.0) for c in want]) if corr else None
            ref = dense_classifier_loss(xr, y_full, wr, None, kind, clf.params, torch.tensor(want), off_t)
            ref.backward()
            entry["err"] = {
                "loss": rel_err(float(loss.detach()), float(ref.detach())),
                "weight grad": rel_err(w_grad, wr.grad),
                "embedding grad": rel_err(x_grad, xr.grad),
            }
        report[name] = entry
    return report


def _reference_keep(counts, x_full, y_full, w_full, extra, step):
    """The samples one float64 process keeps at ``step`` with ``extra``'s ``drop_after`` and ``drop_angle`` (None:
    no dropping): those of a class not counted yet, and those near its dominant sub-center, counted over the
    earlier steps' samples; then counts this step's samples' nearest sub-centers into ``counts`` (C × k)."""
    xn = torch.nn.functional.normalize(x_full.double(), dim=1)
    wn = torch.nn.functional.normalize(w_full.double(), dim=2)
    sub_cos = torch.einsum("nd,nkd->nk", xn, wn[y_full])
    keep = None
    if extra.get("drop_after") is not None and step >= extra["drop_after"]:
        seen = counts[y_full]
        near = sub_cos.gather(1, seen.argmax(1)[:, None]).squeeze(1) >= math.cos(math.radians(extra["drop_angle"]))
        keep = (seen.sum(1) == 0) | near
    for i, c in enumerate(y_full.tolist()):
        counts[c, int(sub_cos[i].argmax())] += 1
    return keep


def _step_errors(step, loss, ref, weight_grads, embedding_grads) -> dict[str, float]:
    """A step's relative errors against the float64 reference: the loss, and the (got, want) gradient pairs."""
    return {
        f"loss {step}": rel_err(float(loss.detach()), float(ref.detach())),
        f"weight grad {step}": rel_err(*weight_grads),
        f"embedding grad {step}": rel_err(*embedding_grads),
    }


def _empty_shard_checks(rank, W):
    """2 classes: at W = 3 and 4 some shards own none, and still join every collective of a hard draw (the
    nearness index's all-reduce) and of sub-centers dropping samples from step 0 (the drops in the combine's
    all-gather); two steps against one float64 process."""
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    y_full = torch.arange(16) % 2
    cases = [
        ("hard normsoftmax", "normsoftmax", {"temperature": 0.1}, {"sample_ratio": 0.5, "sampling": "hard"}),
        ("hard normsoftmax, nearest the samples", "normsoftmax", {"temperature": 0.1},
         {"sample_ratio": 0.5, "sampling": "hard", "nearest_to": "samples"}),
        ("cosface 2 sub-centers, dropping from step 0", "cosface", {"scale": 16.0, "margin": 0.2, "subcenters": 2},
         {"drop_after": 0, "drop_angle": 80.0}),
    ]  # fmt: skip
    report = {}
    for name, kind, params, extra in cases:
        k = params.get("subcenters", 1)
        w_full = torch.randn(2, k, D, generator=torch.Generator().manual_seed(12)).squeeze(1)
        clf = ShardedClassifier(2, D, kind, seed=3, **extra, **params)
        clf.load_full_weight(w_full)
        counts = torch.zeros(2, k, dtype=torch.long)
        entry = {"err": {}}
        for step in range(2):
            x_full = _global_batch(seed=40 + step)[0]
            clf.zero_grad()
            x = _local(x_full, rank, W).requires_grad_(True)
            loss = clf(x, _local(y_full, rank, W), step=step)
            loss.backward()
            x_grad, w_grad = all_gather_uneven(x.grad)[0], clf.gather_rows_all(clf.weight.grad)
            if rank != 0:
                continue
            keep = _reference_keep(counts, x_full, y_full, w_full, extra, step) if k > 1 else None
            if keep is not None and step:
                entry["dropped"] = (int((~keep).sum()), clf.stats["dropped"] * len(y_full))
            xr, wr = x_full.double().requires_grad_(True), w_full.double().requires_grad_(True)
            ref = dense_classifier_loss(xr, y_full, wr, None, kind, clf.params, keep=keep)
            ref.backward()
            entry["err"].update(_step_errors(step, loss, ref, (w_grad, wr.grad), (x_grad, xr.grad)))
        report[name] = entry
    return report


def _subcenter_checks(rank, W):
    """Sub-centers: ArcFace with 3 (every class, logits kept and chunked) and CosFace with 2 (subsampled),
    the second over two steps with samples dropped at step 1 (far from the sub-center their class's samples
    were nearest to at step 0), against one float64 process."""
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    report = {}
    cases = [
        ("arcface k=3", "arcface", {"scale": 16.0, "margin": 0.5, "subcenters": 3}, 1.0, 64.0, {}),
        ("arcface k=3 chunked", "arcface", {"scale": 16.0, "margin": 0.5, "subcenters": 3}, 1.0, 1e-4, {}),
        ("cosface k=2 sub, dropping", "cosface", {"scale": 16.0, "margin": 0.35, "subcenters": 2}, 0.5, 64.0,
         {"drop_after": 1, "drop_angle": 90.0}),
    ]  # fmt: skip
    for name, kind, params, ratio, budget, extra in cases:
        k = params["subcenters"]
        w_full = torch.randn(C, k, D, generator=torch.Generator().manual_seed(11))
        clf = ShardedClassifier(C, D, kind, sample_ratio=ratio, seed=7, logits_budget_mb=budget, **extra, **params)
        clf.load_full_weight(w_full)
        steps = 2 if extra else 1
        entry = {"err": {}}
        counts = torch.zeros(C, k, dtype=torch.long)
        for step in range(steps):
            x_full, y_full = _global_batch(seed=20 + step)
            clf.zero_grad()
            x = _local(x_full, rank, W).requires_grad_(True)
            loss = clf(x, _local(y_full, rank, W), step=step)
            loss.backward()
            active = all_gather_uneven(clf.active_class_ids)[0]
            x_grad, w_grad = all_gather_uneven(x.grad)[0], clf.gather_rows_all(clf.weight.grad)
            if rank != 0:
                continue
            keep = _reference_keep(counts, x_full, y_full, w_full, extra, step)
            if keep is not None:
                entry["dropped"] = (int((~keep).sum()), clf.stats["dropped"] * len(y_full))
            xr, wr = x_full.double().requires_grad_(True), w_full.double().requires_grad_(True)
            act = None if ratio >= 1 else torch.sort(active).values
            ref = dense_classifier_loss(xr, y_full, wr, None, kind, clf.params, act, keep=keep)
            ref.backward()
            entry["err"].update(_step_errors(step, loss, ref, (w_grad, wr.grad), (x_grad, xr.grad)))
        report[name] = entry
    return report


def _train_for_checkpoint(rank, W, opt_name):
    """A classifier trained two subsampled steps at world size W (state depends on the draws)."""
    from dmltrain.distributed import ShardedClassifier, make_classifier_optimizer

    clf = ShardedClassifier(C, D, "normsoftmax", sample_ratio=0.4, seed=5, temperature=0.1)
    opt = make_classifier_optimizer(clf, opt_name, lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(2):
        x_full, y_full = _global_batch(seed=10 + step)
        x = _local(x_full, rank, W)
        clf(x, _local(y_full, rank, W), step=step).backward()
        opt.step()
        opt.zero_grad()
    return clf, opt


def _fresh(W, opt_name):
    from dmltrain.distributed import ShardedClassifier, make_classifier_optimizer

    clf = ShardedClassifier(C, D, "normsoftmax", sample_ratio=0.4, seed=99, temperature=0.1)
    return clf, make_classifier_optimizer(clf, opt_name, lr=0.5)


def _flatten_state(state):
    out = {"weight": state["weight"]}
    for pname, rows in state["optimizer"]["rows"].items():
        for k, v in rows.items():
            out[f"{pname}.{k}"] = v
    out["lr"] = torch.tensor([g["lr"] for g in state["optimizer"]["param_groups"]])
    return out


def _subcenter_classifier(seed):
    """Sub-center CosFace (3 per class) with hard draws and sample dropping: rows, index and counts to save."""
    from dmltrain.distributed import ShardedClassifier

    return ShardedClassifier(C, D, "cosface", sample_ratio=0.5, seed=seed, sampling="mixed", refresh_every=5,
                             drop_after=10, scale=16.0, margin=0.2, subcenters=3)  # fmt: skip


def _subcenter_checkpoint(rank, W, tmp):
    """Saved at W = 3 after two steps, loaded at the others: every class's 3 rows, their optimizer state, its
    index rows and its sub-center counts arrive together whatever the partition."""
    from dmltrain.distributed import load_by_class, make_classifier_optimizer, save_by_class

    def whole(clf):
        tensors, scalars = clf.class_state()
        return {"weight": clf.full_weight(), **{k: clf.gather_rows_all(v) for k, v in tensors.items()}}, scalars

    if W == 3:
        clf = _subcenter_classifier(5)
        opt = make_classifier_optimizer(clf, "adamw", lr=0.05)
        for step in range(2):
            x_full, y_full = _global_batch(seed=30 + step)
            clf(_local(x_full, rank, W), _local(y_full, rank, W), step=step).backward()
            opt.step()
            opt.zero_grad()
        save_by_class(clf, tmp / "subcenters", opt)
        saved, scalars = whole(clf)
        if rank == 0:
            torch.save({"tensors": saved, "scalars": scalars}, tmp / "subcenters.pt")
        return {}
    clf = _subcenter_classifier(99)
    opt = make_classifier_optimizer(clf, "adamw", lr=0.5)
    load_by_class(clf, tmp / "subcenters", opt)
    got, scalars = whole(clf)
    if rank != 0:
        return {}
    want = torch.load(tmp / "subcenters.pt", weights_only=True)
    return {
        "names": sorted(got)
        == sorted(want["tensors"])
        == ["index.codes", "index.scales", "subcenter_counts", "weight"],
        "identical": all(torch.equal(got[k], want["tensors"][k]) for k in want["tensors"]),
        "index step": scalars == want["scalars"] == {"index.built_at": 0},
        "shape": tuple(got["weight"].shape) == (C, 3, D),
    }


def _checkpoint_checks(rank, W, tmpdir):
    from dmltrain.distributed import gather_state, load_by_class, load_state, save_by_class

    tmp = Path(tmpdir)
    report = {"subcenters": _subcenter_checkpoint(rank, W, tmp)}
    for opt_name in ("sgd", "adamw"):
        if W == 3:
            clf, opt = _train_for_checkpoint(rank, W, opt_name)
            state = gather_state(clf, opt)  # whole state on rank 0
            if rank == 0:
                torch.save(state, tmp / f"{opt_name}.pt")
            save_by_class(clf, tmp / f"{opt_name}-pieces", opt)
            continue
        for source in ("gathered", "pieces"):
            clf, opt = _fresh(W, opt_name)
            if source == "gathered":
                load_state(clf, torch.load(tmp / f"{opt_name}.pt", weights_only=True), opt)
            else:
                load_by_class(clf, tmp / f"{opt_name}-pieces", opt)
            again = gather_state(clf, opt, dst=None)
            if rank == 0:
                saved = _flatten_state(torch.load(tmp / f"{opt_name}.pt", weights_only=True))
                mine = _flatten_state(again)
                report[f"{opt_name}/{source}"] = {
                    "identical": all(torch.equal(saved[k], mine[k]) for k in saved) and saved.keys() == mine.keys(),
                    "full_weight_identical": torch.equal(clf.full_weight(), saved["weight"]),
                }
            else:
                clf.full_weight()
    return report


def _world_checks(rank: int, W: int, tmpdir: str) -> dict:
    torch.manual_seed(0)
    report: dict = {"classifier": {}, "losses": {}}
    for kind, params in CLASSIFIER_CASES:
        for budget in (64.0, 1e-4):  # logits kept / class blocks recomputed in backward
            out, _ = _classifier_case(rank, W, kind, params, budget)
            key = f"{kind}{params}/budget={budget:g}"
            report["losses"][key] = out["loss"]
            entry = {"kept": out["kept"], "active_classes": out["active_classes"]}
            if rank == 0:
                entry["err"] = out["err"]
            report["classifier"][key] = entry
    from dmltrain.distributed import ShardedClassifier

    init = ShardedClassifier(70_001, 2, seed=3).full_weight()  # spans two initialisation blocks
    report["init"] = init.numpy() if rank == 0 else None
    report["few_classes"] = _few_classes_case(rank, W)
    report["instance"] = _instance_checks(rank, W)
    report["sampling"] = _sampling_checks(rank, W)
    report["hard"] = _hard_checks(rank, W)
    report["subcenters"] = _subcenter_checks(rank, W)
    report["empty shards"] = _empty_shard_checks(rank, W)
    report["checkpoint"] = _checkpoint_checks(rank, W, tmpdir)
    if W == 2 and DEEPSPEED:  # last: DeepSpeed wraps the process group (and its import is slow)
        report["deepspeed"] = _deepspeed_check(rank, W)
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("classifier-ckpt"))
    out = {}
    for W in (3, 1, 2, 4):  # W = 3 saves the checkpoints the others load
        out[W] = run_workers(_world_checks, W, tmpdir, timeout=300)
    return out


WORLDS = [1, 2, 3, 4]


def _assert_errors(entry, where):
    for what, err in entry["err"].items():
        assert err <= TOL, f"{where}: {what} differs from one process by {err:.2e} (relative)"


@pytest.mark.parametrize("W", WORLDS)
def test_sharded_classifier_equals_one_process(reports, W):
    rep = reports[W]
    for key, entry in rep[0]["classifier"].items():
        _assert_errors(entry, f"W={W} {key}")
        assert entry["active_classes"] == C
    _assert_errors(rep[0]["few_classes"], f"W={W} 3 classes")
    kept = {e["kept"] for e in rep[0]["classifier"].values()}
    assert kept == {0.0, 1.0}, "both the kept-logits and the chunked path must run"
    # the loss value is the same on every worker
    for key in rep[0]["losses"]:
        values = {r["losses"][key] for r in rep}
        assert len(values) == 1, f"W={W} {key}: workers disagree on the loss: {values}"


def test_initial_weight_does_not_depend_on_world_size(reports):
    ref = reports[1][0]["init"]
    for W in WORLDS[1:]:
        assert (reports[W][0]["init"] == ref).all(), f"W={W}: the seeded initial weight differs from W=1"


@pytest.mark.parametrize("W", WORLDS)
def test_gathered_instance_losses_equal_one_process(reports, W):
    rep = reports[W]
    assert rep[0]["instance"], "no instance loss is registered"
    for key, entry in rep[0]["instance"].items():
        _assert_errors(entry, f"W={W} {key}")
        assert not entry["missing_stats"], f"W={W} {key}: stats missing {entry['missing_stats']}"
        values = {r["instance"][key]["loss"] for r in rep}
        assert len(values) == 1, f"W={W} {key}: workers disagree on the loss: {values}"


@pytest.mark.parametrize("W", WORLDS)
def test_class_subsampling(reports, W):
    for rank, rep in enumerate(reports[W]):
        assert all(rep["sampling"].pop("no host reads").values()), f"W={W} rank {rank}: the step without host reads"
        for key, entry in rep["sampling"].items():
            for check, ok in entry.items():
                if check in ("err", "loss"):
                    continue
                assert ok, f"W={W} rank {rank} {key}: {check} failed"
            if rank == 0 and "err" in entry:
                _assert_errors(entry, f"W={W} {key} (sample_ratio=0.5)")


@pytest.mark.parametrize("W", WORLDS)
def test_hard_and_mixed_draws_equal_the_reference_at_every_world_size(reports, W):
    for rank, rep in enumerate(reports[W]):
        for name, entry in rep["hard"].items():
            for check, ok in entry.items():
                if check != "err":
                    assert ok, f"W={W} rank {rank} {name}: {check} failed"
            if rank == 0:
                _assert_errors(entry, f"W={W} {name}")


@pytest.mark.parametrize("W", WORLDS)
def test_subcenters_equal_one_float64_process(reports, W):
    rep = reports[W][0]["subcenters"]
    for name, entry in rep.items():
        _assert_errors(entry, f"W={W} {name}")
    dropped, reported = rep["cosface k=2 sub, dropping"]["dropped"]
    assert 0 < dropped < 16 and abs(reported - dropped) < 1e-9, f"W={W}: {dropped} dropped, reported {reported}"


@pytest.mark.parametrize("W", WORLDS)
def test_shards_without_classes_keep_the_collectives_in_step(reports, W):
    for name, entry in reports[W][0]["empty shards"].items():
        _assert_errors(entry, f"W={W} 2 classes, {name}")
        if "dropped" in entry:
            dropped, reported = entry["dropped"]
            assert 0 < dropped < 16 and abs(reported - dropped) < 1e-9, f"W={W}: {dropped} dropped, reported {reported}"


@pytest.mark.parametrize("W", [1, 2, 4])
def test_sub_centers_and_their_index_reshard_by_class(reports, W):
    entry = reports[W][0]["checkpoint"]["subcenters"]
    for check, ok in entry.items():
        assert ok, f"W=3 -> W={W}: {check} failed"


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("source", ["gathered", "pieces"])
def test_checkpoint_saved_at_3_loads_at_other_world_sizes(reports, W, opt_name, source):
    entry = reports[W][0]["checkpoint"][f"{opt_name}/{source}"]
    assert entry["identical"], f"W=3 -> W={W} ({source}): weight or optimizer state differs"
    assert entry["full_weight_identical"]


# -- the backbone gradient under DeepSpeed ZeRO-1 ---------------------------------------------------
DS_SPLIT = [5, 7]


def _deepspeed_check(rank: int, W: int) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    from dmltrain.distributed import GatheredInstanceLoss, ShardedClassifier, grad_scale
    from dmltrain.losses import build_loss

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, D))
    init = {k: v.clone() for k, v in net.state_dict().items()}
    cfg = {
        "train_micro_batch_size_per_gpu": 6,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 by default
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0), config=cfg)

    g = torch.Generator().manual_seed(4)
    x_full = torch.randn(sum(DS_SPLIT), 6, generator=g)
    y_full = torch.tensor([3, 3, 8, 8, 8, 1, 1, 14, 14, 20, 20, 3])
    w_full, _ = _full_weight("cosface")
    s = sum(DS_SPLIT[:rank])
    x, y = x_full[s : s + DS_SPLIT[rank]], y_full[s : s + DS_SPLIT[rank]]

    clf = ShardedClassifier(C, D, "cosface", scale=16.0, margin=0.35)
    clf.load_full_weight(w_full)
    ice = GatheredInstanceLoss(build_loss("ice", scale=16.0))
    emb = grad_scale(engine(x), W)  # DeepSpeed averages; the gathered losses already sum
    loss = clf(emb, y) + 0.5 * ice(emb, y)
    engine.backward(loss)
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.step()  # SGD, lr = 1: the step is minus the reduced gradient
    reduced = [b - p.detach() for b, p in zip(before, engine.module.parameters())]

    ref_net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, D))
    ref_net.load_state_dict(init)
    e = ref_net(x_full)
    ref = dense_classifier_loss(e.double(), y_full, w_full.double(), None, "cosface", {"scale": 16.0, "margin": 0.35})
    ref = ref + 0.5 * build_loss("ice", scale=16.0)(e, y_full)
    ref.backward()
    return {
        "errors": [rel_err(r, p.grad) for r, p in zip(reduced, ref_net.parameters())],
        "loss": (float(loss.detach()), float(ref.detach())),
    }


@pytest.mark.skipif(not DEEPSPEED, reason="deepspeed is not installed")
def test_backbone_gradient_after_deepspeed_zero1_equals_one_process(reports):
    """A tiny backbone under a real DeepSpeed engine (ZeRO stage 1, gloo, W = 2, uneven local batches)."""
    for rank, rep in enumerate(reports[2]):
        res = rep["deepspeed"]
        got, want = res["loss"]
        assert rel_err(got, want) <= TOL, f"rank {rank}: loss {got} vs one process {want}"
        for i, err in enumerate(res["errors"]):
            assert err <= TOL, f"rank {rank}: backbone parameter {i} gradient differs by {err:.2e}"
