"""The fused Triton path of the sharded classifier against independent torch references.

On the CPU the kernels run under Triton's interpreter. ``TRITON_INTERPRET=1`` only takes effect
for kernels defined after it is set, and this pytest process has already imported them
compiled for a GPU, so every check runs in spawned processes (tests/multiproc.py, gloo on
loopback) that inherit the variable: W = 1 (kernel-level checks and the classifier), W = 2
and W = 3 (the classifier, uneven local batches, one worker without samples). With a GPU the
same checks run on it, compiled.

References: kernel-level checks against a float64 torch transcription of the kernels'
formulas; classifier checks against one process holding the whole weight in float64
(tests/distributed_reference.py), for the default backward (one kernel, atomics) and the
deterministic one (two kernels), and two runs of the same steps compared bit for bit.
Error = max |ours − ref| / max |ref|. Tolerances:

* fp32 (IEEE products), and tf32 under the interpreter (which multiplies in fp32): 1e-5;
* tf32 on a GPU (10-bit mantissas): 5e-3;
* bf16 (8-bit mantissas, fp32 accumulation): loss 2e-3, gradients 3e-2 at scales up to 16
  (a unit-vector cosine off by 2⁻⁹ moves a logit by 0.03). Kernel-level bf16 checks compare
  with operands rounded to bf16 in the reference, leaving only the rounding of the
  probabilities for the gradient products: 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from distributed_reference import dense_classifier_loss, rel_err
from multiproc import run_workers

pytestmark = pytest.mark.multiprocess

C, D = 45, 24
BATCH = 21
SPLITS = {1: [21], 2: [12, 9], 3: [8, 0, 13]}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

#: (name, kind, params, precision, sample_ratio) per world size: every kind at every W, dense and subsampled;
#: "det" runs the deterministic two-kernel backward
CASES = {
    1: [
        ("normsoftmax fp32", "normsoftmax", {"temperature": 0.1}, "fp32", 1.0),
        ("cosface fp32 sub", "cosface", {"scale": 16.0, "margin": 0.35}, "fp32", 0.5),
        ("arcface fp32", "arcface", {"scale": 16.0, "margin": 0.5}, "fp32", 1.0),
        ("arcface fp32 margin past pi", "arcface", {"scale": 16.0, "margin": 3.0}, "fp32", 1.0),
        ("softmax_ce fp32 sub", "softmax_ce", {"smoothing": 0.1}, "fp32", 0.5),
        ("arcface bf16", "arcface", {"scale": 16.0, "margin": 0.5}, "bf16", 1.0),
        ("softmax_ce bf16", "softmax_ce", {"smoothing": 0.1}, "bf16", 1.0),
        ("normsoftmax tf32 sub", "normsoftmax", {"temperature": 0.1}, "tf32", 0.5),
        ("cosface fp32 sub det", "cosface", {"scale": 16.0, "margin": 0.35}, "fp32", 0.5),
        ("softmax_ce fp32 det", "softmax_ce", {"smoothing": 0.1}, "fp32", 1.0),
        ("arcface bf16 det", "arcface", {"scale": 16.0, "margin": 0.5}, "bf16", 1.0),
    ],
    2: [
        ("normsoftmax fp32 sub", "normsoftmax", {"temperature": 0.1}, "fp32", 0.5),
        ("cosface fp32", "cosface", {"scale": 16.0, "margin": 0.35}, "fp32", 1.0),
        ("arcface fp32 sub", "arcface", {"scale": 16.0, "margin": 0.5}, "fp32", 0.5),
        ("softmax_ce fp32", "softmax_ce", {"smoothing": 0.1}, "fp32", 1.0),
        ("cosface bf16 sub", "cosface", {"scale": 16.0, "margin": 0.35}, "bf16", 0.5),
        ("softmax_ce fp32 sub det", "softmax_ce", {"smoothing": 0.1}, "fp32", 0.5),
        ("arcface fp32 det", "arcface", {"scale": 16.0, "margin": 0.5}, "fp32", 1.0),
        ("normsoftmax fp32 sub hard", "normsoftmax", {"temperature": 0.1}, "fp32", 0.6),  # nearest classes drawn
    ],
    3: [
        ("normsoftmax fp32", "normsoftmax", {"temperature": 0.1}, "fp32", 1.0),
        ("cosface fp32 sub", "cosface", {"scale": 16.0, "margin": 0.35}, "fp32", 0.5),
        ("arcface fp32", "arcface", {"scale": 16.0, "margin": 0.5}, "fp32", 1.0),
        ("softmax_ce fp32 sub", "softmax_ce", {"smoothing": 0.1}, "fp32", 0.5),
        ("normsoftmax bf16", "normsoftmax", {"temperature": 0.1}, "bf16", 1.0),
        ("normsoftmax fp32 sub det", "normsoftmax", {"temperature": 0.1}, "fp32", 0.5),
        ("cosface fp32 det", "cosface", {"scale": 16.0, "margin": 0.35}, "fp32", 1.0),
    ],
}


def tolerance(precision: str, device: str, what: str) -> float:
    if precision == "bf16":
        return 2e-3 if what == "loss" else 3e-2
    if precision == "tf32" and device == "cuda":
        return 5e-3
    return 1e-5


# -- workers (run in spawned processes) -----------------------------------------------------------------
def _global_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, D, generator=g), torch.randint(0, C, (BATCH,), generator=g)


def _full_params(kind: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(C, D, generator=g) * (0.3 if kind == "softmax_ce" else 1.0)
    return w, (torch.randn(C, generator=g) * 0.1 if kind == "softmax_ce" else None)


def _local(t: torch.Tensor, rank: int, W: int) -> torch.Tensor:
    s = sum(SPLITS[W][:rank])
    return t[s : s + SPLITS[W][rank]].clone()


def _classifier_case(
    rank, W, device, kind, params, precision, ratio, weight_storage="fp32", steps=1, det=False, sampling="uniform"
):
    """Loss and gradients of ``steps`` calls (gradients accumulated) against one float64 process."""
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    w_full, b_full = _full_params(kind)
    backend = "auto" if device == "cuda" else "triton"
    clf = ShardedClassifier(C, D, kind, sample_ratio=ratio, seed=3, precision=precision, weight_storage=weight_storage,
                            backend=backend, deterministic=det, sampling=sampling, **params).to(device)  # fmt: skip
    clf.load_full_weight(w_full.to(device), None if b_full is None else b_full.to(device))
    losses, xs, actives = [], [], []
    for step in range(steps):
        x_full, y_full = _global_batch(seed=step)
        x = _local(x_full, rank, W).to(device).requires_grad_(True)
        loss = clf(x, _local(y_full, rank, W).to(device), step=step)
        loss.backward()
        assert clf.stats["logits_kept"] == 0.0  # the fused path keeps nothing
        losses.append(float(loss.detach()))
        xs.append(all_gather_uneven(x.grad)[0].cpu())
        actives.append(None if ratio >= 1 else torch.sort(all_gather_uneven(clf.active_class_ids)[0].cpu()).values)
    w_grad = clf.gather_rows_all(clf.weight.grad).float().cpu()
    b_grad = None if b_full is None else clf.gather_rows_all(clf.bias.grad).float().cpu()
    if rank != 0:
        return None
    w_stored = w_full.bfloat16() if weight_storage == "bf16" else w_full  # the reference sees the stored weight
    wr = w_stored.double().requires_grad_(True)
    br = None if b_full is None else b_full.double().requires_grad_(True)
    err = {}
    for step in range(steps):
        x_full, y_full = _global_batch(seed=step)
        xr = x_full.double().requires_grad_(True)
        ref = dense_classifier_loss(xr, y_full, wr, br, kind, clf.params, actives[step])
        ref.backward()
        err[f"loss {step}"] = ("loss", rel_err(losses[step], float(ref.detach())))
        err[f"embedding grad {step}"] = ("grad", rel_err(xs[step], xr.grad))
    err["weight grad"] = ("grad", rel_err(w_grad, wr.grad))
    if br is not None:
        err["bias grad"] = ("grad", rel_err(b_grad, br.grad))
    return err


def _kernel_reference(x, w, rows, count, bias, tcol, scale, lse, off, alpha, precision):
    """float64 transcription of the kernels' formulas: non-target logits, their statistics and gradients."""
    active = w if rows is None else w[rows]
    k = active.shape[0] if count is None else count
    wa = active[:k].double()
    rnd = (lambda t: t.bfloat16().double()) if precision == "bf16" else (lambda t: t.double())
    if bias is None:  # the unit rows as the kernels store them, in the operands' precision
        inv = 1 / wa.norm(dim=1)
        stored = rnd(wa * inv[:, None])
        z = (rnd(x) @ stored.t()) * scale
        col = torch.full_like(inv, scale)
    else:
        stored = rnd(wa)
        col = torch.ones(wa.shape[0], dtype=torch.float64)
        z = rnd(x) @ stored.t() + (bias if rows is None else bias[rows])[:k].double()
    keep = torch.ones_like(z, dtype=torch.bool)
    owned = ((tcol >= 0) & (tcol < k)).nonzero().squeeze(1)
    keep[owned, tcol[owned].long()] = False
    zk = z.masked_fill(~keep, float("-inf"))
    G = torch.where(keep, (torch.exp(z - lse.double()[:, None]) - off) * alpha, torch.zeros_like(z))
    gx = (G * col) @ stored
    gw = (G * col).t() @ rnd(x)
    if bias is None:  # through the normalisation: (h − S ŵ)/‖w‖
        gw = inv[:, None] * gw - (inv * inv * (G * z).sum(0))[:, None] * wa
    return {"lse": torch.logsumexp(zk, 1), "max": zk.amax(1), "sum": torch.where(keep, z, 0).sum(1),
            "grad x": gx, "grad w": gw, "grad b": None if bias is None else G.sum(0), "k": k}  # fmt: skip


def _kernel_checks(device):
    """The backend's two functions alone on shapes that cut tiles and chunks unevenly (16-wide tiles
    and 16-column chunks under the interpreter), the fused backward (tuned and deterministic) and, for bf16, the
    staged one in several stages a chunk, padding past a drawn count. Every ``torch.empty`` is filled with NaN
    meanwhile: a buffer read before it is written (the row copy's padding under a GEMM) shows in the results."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        return _kernel_cases(device)
    finally:
        torch.empty = empty


def _kernel_cases(device):
    from dmltrain.distributed import softmax_kernels as sk
    from dmltrain.distributed.row_sparse import RowGradTarget, RowSet
    from dmltrain.distributed.shard_operands import ShardOperands

    cases = [  # N, D, local rows, subsampled (drawn count or None), normalised, precision, accumulate, need x
        (16, 16, 16, False, None, True, "fp32", False, True),
        (17, 40, 33, False, None, True, "fp32", True, True),  # three D chunks, the last one partial
        (31, 24, 50, True, None, False, "fp32", False, True),
        (20, 24, 40, True, 13, True, "bf16", False, True),  # padding after the 13 drawn rows
        (9, 24, 40, True, 18, False, "tf32", True, False),  # the count ends inside the second chunk
        # widths whose rows' epilogue goes in quarters (D_PAD >= 256), one of them ragged (D_PAD 512 for 260)
        (12, 260, 20, True, None, True, "fp32", True, True),
        (10, 256, 24, False, None, False, "bf16", False, True),
        # the staged backward's paths: the bias kind with a count, added to .grad; drawn rows without embeddings
        (19, 40, 37, True, 20, False, "bf16", True, True),
        (18, 48, 45, True, None, True, "bf16", True, False),
        (21, 32, 40, True, 25, True, "bf16", False, True),  # a power-of-two width: the batch-resident forward too
    ]
    g = torch.Generator().manual_seed(5)
    out = {}
    chunk_bytes, stage_bytes, stage_bf16, stage_min = sk.CHUNK_BYTES, sk.STAGE_BYTES, sk.STAGE_BF16, sk.STAGE_MIN_DIM
    for i, (N, Dk, n_local, sub, count, normalized, precision, accumulate, need_x) in enumerate(cases):
        x = torch.randn(N, Dk, generator=g)
        if normalized:
            x = torch.nn.functional.normalize(x, dim=1)
        w = torch.randn(n_local, Dk, generator=g)
        bias = None if normalized else 0.1 * torch.randn(n_local, generator=g)
        rows = torch.randperm(n_local, generator=g)[: n_local // 2] if sub else None
        if rows is not None and count is None:
            rows = torch.sort(rows).values
        K = n_local if rows is None else rows.numel()
        tcol = torch.randint(-1, K, (N,), generator=g)
        if count is not None:
            tcol = torch.where(tcol < count, tcol, -1)
        scale = 8.0 if normalized else 1.0
        lse = torch.randn(N, generator=g) + 3.0  # any per-sample normaliser exercises the gradient formulas
        off, alpha = 0.01, 0.5
        ref = _kernel_reference(x, w, rows, count, bias, tcol, scale, lse, off, alpha, precision)
        dev = lambda t: None if t is None else t.to(device)  # noqa: E731
        cnt = None if count is None else torch.tensor(count, device=device)
        op = ShardOperands(dev(x), dev(w), dev(bias), dev(rows), cnt, dev(tcol), scale, normalized)
        sk.CHUNK_BYTES = Dk * 8 * 16  # 16-column chunks: several per case
        lse_p, max_p, sum_p, _ = sk.partials(op, True, precision)
        out[f"case {i} lse"] = (precision, rel_err(lse_p.cpu(), ref["lse"]))
        out[f"case {i} max"] = (precision, rel_err(max_p.cpu(), ref["max"]))
        out[f"case {i} sum"] = (precision, rel_err(sum_p.cpu(), ref["sum"]))
        if Dk & (Dk - 1) == 0:  # the log-sum-exp kernel with the batch block resident
            sk.INTERPRET_RESIDENT = True
            try:
                resident = sk.partials(op, True, precision)
            finally:
                sk.INTERPRET_RESIDENT = False
            for what, got in zip(("lse", "max", "sum"), resident):
                out[f"case {i} x-resident {what}"] = (precision, rel_err(got.cpu(), ref[what]))
        results = {}
        # the staged backward (bf16): 48-column chunks in 16-column stages, so that a chunk holds several stages
        for det, staged in (
            ((False, False), (True, False), (False, True)) if precision == "bf16" else ((False, False), (True, False))
        ):
            sk.STAGE_BF16, sk.STAGE_MIN_DIM = staged, 0
            if staged:
                sk.CHUNK_BYTES, sk.STAGE_BYTES = Dk * 6 * 48, 2 * N * 16
            base = torch.randn(n_local, Dk, generator=g) if accumulate else torch.full_like(w, float("nan"))
            gw = base.clone().to(device)
            gb = None if bias is None else (0.5 if accumulate else float("nan")) + torch.zeros(n_local, device=device)
            target = RowGradTarget(None, RowSet(op.rows, cnt), gw, gb, accumulate)
            coef = (torch.tensor(alpha, device=device), torch.tensor(off, device=device))
            gx = sk.gradients(op, None, dev(lse), *coef, need_x, target, precision, deterministic=det)
            sk.CHUNK_BYTES, sk.STAGE_BYTES, sk.STAGE_BF16, sk.STAGE_MIN_DIM = (
                Dk * 8 * 16,
                stage_bytes,
                stage_bf16,
                stage_min,
            )
            tag = f"case {i} {'staged' if staged else 'deterministic' if det else 'tuned'}"
            if need_x:
                out[f"{tag} grad x"] = (precision, rel_err(gx.cpu(), ref["grad x"]))
            else:
                out[f"{tag} no grad x"] = ("exact", float(gx is not None))
            active = slice(None) if rows is None else rows[: ref["k"]]
            gw = gw.cpu() - (base if accumulate else 0)
            out[f"{tag} grad w"] = (precision, rel_err(gw[active], ref["grad w"]))
            if rows is not None and not accumulate:  # rows not drawn, padding included, are never written
                untouched = torch.ones(n_local, dtype=torch.bool)
                untouched[active] = False
                out[f"{tag} inactive rows untouched"] = ("exact", float(not bool(gw[untouched].isnan().all())))
            if bias is not None:
                gbc = gb.cpu() - (0.5 if accumulate else 0)
                out[f"{tag} grad b"] = (precision, rel_err(gbc[active], ref["grad b"]))
            results[det, staged] = (gx, gw)
        if need_x:
            for other in results.keys() - {(False, False)}:
                agree = rel_err(results[other][0].cpu(), results[False, False][0].cpu())
                out[f"case {i} {'staged' if other[1] else 'deterministic'} agrees with tuned"] = (precision, agree)
        out.update(_kept_copies_check(sk, op, i, precision, dev(lse), cnt, device))
    sk.CHUNK_BYTES = chunk_bytes
    return out


def _kept_copies_check(sk, op, i, precision, lse, cnt, device):
    """The forward's row copies kept for the backward give the bits the backward's own copies do, in every chunk;
    after the weight changed in place they are not used (the backward copies the new weight)."""
    from dmltrain.distributed.row_sparse import RowGradTarget, RowSet

    def backward(saved):
        gw = torch.zeros_like(op.weight)
        gb = None if op.bias is None else torch.zeros_like(op.bias)
        coef = (torch.tensor(0.5, device=device), torch.tensor(0.01, device=device))
        gx = sk.gradients(op, saved, lse, *coef, True, RowGradTarget(None, RowSet(op.rows, cnt), gw, gb, False),
                          precision)  # fmt: skip
        return [t for t in (gx, gw, gb) if t is not None]

    _, _, _, kept = sk.partials(op, True, precision, keep_copies=True)
    out = {f"case {i} kept copies": ("exact", float(kept is None))}
    same = all(torch.equal(a, b) for a, b in zip(backward(kept), backward(None)))
    out[f"case {i} kept copies give the same bits"] = ("exact", float(not same))
    with torch.no_grad():
        op.weight.mul_(1.5)
    same = all(torch.equal(a, b) for a, b in zip(backward(kept), backward(None)))
    out[f"case {i} a weight changed since the forward is copied again"] = ("exact", float(not same))
    return out


def _bf16_storage_case(rank, W, device):
    """A bf16 weight: gradient in bf16, the optimizer's fp32 state and stochastic rounding, then a resume: the
    state after step 0 loaded by class id into a fresh head, step 1 ends with the uninterrupted run's rows and
    state bit for bit (the deterministic backward; the rounding noise is keyed by the step, none of it saved)."""
    from dmltrain.distributed import ClassifierHead, ShardedClassifier
    from dmltrain.distributed.class_checkpoint import load_state, local_state

    backend = "auto" if device == "cuda" else "triton"

    def head(seed: int = 3) -> ClassifierHead:
        clf = ShardedClassifier(C, D, "cosface", sample_ratio=0.5, weight_storage="bf16", precision="bf16",
                                backend=backend, deterministic=True, seed=seed).to(device)  # fmt: skip
        return ClassifierHead(clf, "sgd", lr=0.5, momentum=0.9)

    def forward(h: ClassifierHead, step: int) -> None:
        x, y = _global_batch(seed=step)
        h(_local(x, rank, W).to(device), _local(y, rank, W).to(device), step=step).backward()

    straight = head()
    clf, opt = straight.classifier, straight.optimizer
    before = clf.weight.detach().clone()
    forward(straight, 0)
    rows = clf.row_grads.row_ids().to(device)
    ok = clf.weight.grad.dtype == torch.bfloat16 and opt.state[clf.weight]["momentum_buffer"].dtype == torch.float32
    straight.step()
    moved = (clf.weight.detach() != before).any(1)
    inactive = torch.ones(clf.num_local, dtype=torch.bool, device=device)
    inactive[rows] = False
    piece = local_state(clf, opt)
    resumed = head(seed=3)
    with torch.no_grad():
        resumed.classifier.weight.zero_()  # loading must overwrite it
    load_state(resumed.classifier, piece, resumed.optimizer)
    for h in (straight, resumed):
        forward(h, 1)
        h.step()
    mom = [h.optimizer.state[h.classifier.weight]["momentum_buffer"] for h in (straight, resumed)]
    return {
        "dtypes": ok,
        "active rows moved": bool(moved[rows].any()),
        "inactive rows kept": not bool(moved[inactive].any()),
        "resumed bit for bit": torch.equal(clf.weight, resumed.classifier.weight) and torch.equal(*mom),
    }


def _subcenter_fallback_case(rank, W, device):
    """Sub-centers (and the log-Q correction) with ``backend="triton"``: the documented fallback to the torch
    backend's sub-center rows feeding a max, exact against one float64 process."""
    from dmltrain.distributed import ShardedClassifier
    from dmltrain.distributed.collectives import all_gather_uneven

    k, params = 2, {"scale": 16.0, "margin": 0.5}
    w_full = torch.randn(C, k, D, generator=torch.Generator().manual_seed(4))
    clf = ShardedClassifier(C, D, "arcface", sample_ratio=0.5, seed=3, backend="auto" if device == "cuda" else "triton",
                            sampling="mixed", sampling_correction=True, subcenters=k, **params).to(device)  # fmt: skip
    clf.load_full_weight(w_full.to(device))
    x_full, y_full = _global_batch(seed=5)
    x = _local(x_full, rank, W).to(device).requires_grad_(True)
    loss = clf(x, _local(y_full, rank, W).to(device), step=1)
    loss.backward()
    assert not clf.fused, "sub-centers run the torch backend"
    ids = all_gather_uneven(clf.active_class_ids)[0].cpu()
    offsets = all_gather_uneven(clf._active.offsets[: clf.active_rows.numel()])[0].cpu()
    x_grad, w_grad = all_gather_uneven(x.grad)[0].cpu(), clf.gather_rows_all(clf.weight.grad).cpu()
    if rank != 0:
        return None
    order = torch.argsort(ids)
    xr, wr = x_full.double().requires_grad_(True), w_full.double().requires_grad_(True)
    ref = dense_classifier_loss(xr, y_full, wr, None, "arcface", params, ids[order], offsets[order])
    ref.backward()
    return {
        "loss": ("loss", rel_err(float(loss.detach()), float(ref.detach()))),
        "embedding grad": ("grad", rel_err(x_grad, xr.grad)),
        "weight grad": ("grad", rel_err(w_grad, wr.grad)),
    }


def _fused_world(rank, W, device):
    from dmltrain.distributed import softmax_kernels

    assert softmax_kernels.INTERPRET == (device == "cpu"), "the kernels must run under the interpreter on the CPU"
    # every bf16 case but the deterministic ones through the staged backward, at this file's narrow D
    softmax_kernels.STAGE_MIN_DIM = 0
    report = {"classifier": {}}
    if W == 1:
        report["kernels"] = _kernel_checks(device)
        report["classifier"]["normsoftmax fp32 sub, accumulated over 2 calls"] = _classifier_case(
            rank, W, device, "normsoftmax", {"temperature": 0.1}, "fp32", 0.5, steps=2
        )
        report["classifier"]["softmax_ce fp32, accumulated over 2 calls"] = _classifier_case(
            rank, W, device, "softmax_ce", {"smoothing": 0.1}, "fp32", 1.0, steps=2
        )
        report["classifier"]["cosface bf16, bf16 weight storage"] = _classifier_case(
            rank, W, device, "cosface", {"scale": 16.0, "margin": 0.35}, "bf16", 0.5, weight_storage="bf16"
        )
    for name, kind, params, precision, ratio in CASES[W]:
        det, sampling = name.endswith(" det"), "hard" if name.endswith(" hard") else "uniform"
        report["classifier"][name] = _classifier_case(
            rank, W, device, kind, params, precision, ratio, det=det, sampling=sampling
        )
    report["classifier"]["arcface fp32 2 sub-centers, corrected (torch fallback)"] = _subcenter_fallback_case(
        rank, W, device
    )
    report["bf16 storage"] = _bf16_storage_case(rank, W, device)
    report["reruns identical"] = _rerun_identical(rank, W, device)
    return report


def _rerun_identical(rank, W, device):
    """Two runs of the same step (subsampled, label smoothing) on the deterministic path give bit-identical
    losses and gradients (the default's atomics would too on the CPU interpreter, one program at a time:
    nothing to learn there), and every kernel's tiles were asked for as deterministic (fixed, untuned)."""
    from dmltrain.distributed import ShardedClassifier, softmax_kernels
    from dmltrain.distributed.collectives import all_gather_uneven

    asked = []
    choose = softmax_kernels._choose

    def recorded(kind, key, precision, device, launch, deterministic=False, *more):
        asked.append((kind, deterministic))
        return choose(kind, key, precision, device, launch, deterministic, *more)

    softmax_kernels._choose = recorded
    runs = []
    for _ in range(2):
        clf = ShardedClassifier(C, D, "softmax_ce", sample_ratio=0.5, seed=3, smoothing=0.1, deterministic=True,
                                backend="auto" if device == "cuda" else "triton").to(device)  # fmt: skip
        clf.load_full_weight(*[t.to(device) for t in _full_params("softmax_ce")])
        got = []
        for step in (4,):
            x_full, y_full = _global_batch(seed=step)
            x = _local(x_full, rank, W).to(device).requires_grad_(True)
            loss = clf(x, _local(y_full, rank, W).to(device), step=step)
            loss.backward()
            got += [loss.detach().cpu(), all_gather_uneven(x.grad)[0].cpu()]
        runs.append(got + [clf.weight.grad.cpu().clone(), clf.bias.grad.cpu().clone()])
    softmax_kernels._choose = choose
    fixed = bool(asked) and all(det for _, det in asked) and {k for k, _ in asked} == {"lse", "grad_x", "grad_w"}
    return all(torch.equal(a, b) for a, b in zip(*runs)) and fixed


# -- tests ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=DEVICES)
def fused_reports(request, monkeypatch_module):
    device = request.param
    if device == "cpu":
        monkeypatch_module.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch_module.delenv("TRITON_INTERPRET", raising=False)
    out = {W: run_workers(_fused_world, W, device, timeout=600) for W in (1, 2, 3)}
    monkeypatch_module.undo()
    return device, out


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _precision_of(name: str) -> str:
    return next(p for p in ("fp32", "tf32", "bf16") if p in name)


def test_kernels_match_their_float64_formulas(fused_reports):
    device, reports = fused_reports
    for key, (precision, err) in reports[1][0]["kernels"].items():
        tol = 0.0 if precision == "exact" else (1e-2 if precision == "bf16" else tolerance(precision, device, "grad"))
        if precision == "exact" and "norms" in key:
            tol = 1e-6
        assert err <= tol, f"{device} {key}: {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("W", [1, 2, 3])
def test_fused_classifier_equals_one_process(fused_reports, W):
    device, reports = fused_reports
    rep = reports[W][0]["classifier"]
    assert len(rep) >= 5
    for name, errors in rep.items():
        precision = _precision_of(name)
        for what, (kind, err) in errors.items():
            tol = tolerance(precision, device, kind)
            assert err <= tol, f"{device} W={W} {name}: {what} differs from one process by {err:.2e} (> {tol:.0e})"


@pytest.mark.parametrize("W", [1, 2, 3])
def test_two_runs_of_the_same_step_are_bit_identical(fused_reports, W):
    device, reports = fused_reports
    for rank, rep in enumerate(reports[W]):
        assert rep["reruns identical"], f"{device} W={W} rank {rank}: deterministic reruns differ (or tuned tiles)"


@pytest.mark.parametrize("W", [1, 2, 3])
def test_bf16_weight_storage_steps_only_active_rows(fused_reports, W):
    device, reports = fused_reports
    for rank, rep in enumerate(reports[W]):
        assert rep["bf16 storage"]["dtypes"], f"{device} W={W} rank {rank}: bf16 gradient, fp32 optimizer state"
        assert rep["bf16 storage"]["inactive rows kept"], f"{device} W={W} rank {rank}"
        assert rep["bf16 storage"]["resumed bit for bit"], f"{device} W={W} rank {rank}: the resumed bf16 rows differ"
    assert any(rep["bf16 storage"]["active rows moved"] for rep in reports[W])
