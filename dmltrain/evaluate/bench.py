"""``dmltrain bench eval``: retrieval metrics time against the bare similarity GEMM.

On synthetic clustered embeddings of the SOP test size (60,502 images, 11,316 classes) it
times, in one run on the same machine:

1. the bare similarity GEMM (N² × D), blocked exactly as the metrics block it: the bound;
2. Recall@K (every K at once), then Recall@K + MAP@R + R-precision, as ratios to (1);
3. NMI (faiss k-means, k = classes);
4. at 2048 dims: the float path (cosine) against the binary path (2048 sign bits, Hamming),
   both computing Recall@K + MAP@R + R-precision;

The GEMM is timed before and after the metrics (the faster kept) and the binary path before
and after the float one (the slower kept), so load from other processes can only make the
reported ratios worse.
5. optionally (``--faiss-peer``) faiss ``IndexFlatIP.search`` with k = max K, the peer the
   GEMM + rank-counting design replaced.

Targets: Recall within 1.5× of the GEMM; the binary path at least 4× faster than the float
path at 2048 dims. Nothing is asserted; the figures are printed.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=60502, help="images (default: 60502, the SOP test set)")
    parser.add_argument("--dim", type=int, default=512, help="float embedding dim of the Recall/NMI timings (default: 512)")
    parser.add_argument("--classes", type=int, help="classes (default: n × 11316 / 60502, SOP's ratio)")
    parser.add_argument("--ks", default="1,10,100,1000", help="Recall@K cut-offs (default: 1,10,100,1000)")
    parser.add_argument("--binary-dim", type=int, default=2048, help="dim of the float-vs-binary comparison (default: 2048)")
    parser.add_argument("--nmi-iters", type=int, default=20, help="k-means iterations for NMI (default: 20)")
    parser.add_argument("--skip-nmi", action="store_true", help="skip the NMI timing")
    parser.add_argument("--skip-binary", action="store_true", help="skip the float-vs-binary comparison at --binary-dim")
    parser.add_argument("--faiss-peer", action="store_true", help="also time faiss IndexFlatIP.search with k = max K")
    parser.add_argument("--device", default="cpu", help="where the float GEMMs run: cpu, cuda, auto (default: cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)


def _data(n: int, dim: int, classes: int, seed: int):
    """Class centres plus noise: every class has >= 2 images, sizes like SOP's (2-12); the
    noise grows with the dim so Recall@1 stays in the range trained models reach."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.arange(classes), np.arange(classes), rng.integers(0, classes, max(n - 2 * classes, 0))])[:n]
    rng.shuffle(labels)
    centers = rng.standard_normal((classes, dim), dtype=np.float32)
    emb = centers[labels]
    emb += 2.5 * (dim / 512) ** 0.25 * rng.standard_normal((n, dim), dtype=np.float32)
    return emb, labels


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _gemm_seconds(emb, device, block_bytes) -> float:
    """The bound: normalized N × D embeddings times their transpose, in the metrics' query blocks."""
    import torch

    from dmltrain.evaluate.knn import float_gallery

    gal = float_gallery(emb, device)
    x = gal.data
    rows = gal.rows_per_block(block_bytes)
    out = torch.empty((rows, len(x)), dtype=torch.float32, device=device)
    t = time.perf_counter()
    for lo in range(0, len(x), rows):
        hi = min(lo + rows, len(x))
        torch.mm(x[lo:hi], x.t(), out=out[: hi - lo])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from dmltrain.errors import UserError
    from dmltrain.evaluate.clustering import clustering_nmi
    from dmltrain.evaluate.hamming import engine_name
    from dmltrain.evaluate.knn import DEFAULT_BLOCK_BYTES, resolve_device
    from dmltrain.evaluate.retrieval import _Labels, check_ks, path_metrics

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.n
    classes = args.classes or max(2, round(n * 11316 / 60502))
    if n < 4 or not 2 <= classes <= n // 2:
        raise UserError(f"--classes: need 2 <= classes <= n/2 (every class twice), got {classes} for n={n}")
    try:
        ks = check_ks([int(k) for k in args.ks.split(",")])
    except ValueError:
        raise UserError(f"--ks: expected comma-separated positive integers, got '{args.ks}'") from None
    device = resolve_device(args.device)
    flops = 2.0 * n * n

    def say(text: str) -> None:
        print(text, flush=True)

    say(
        f"eval bench: n={n} classes={classes} dim={args.dim} ks={','.join(map(str, ks))} device={device} "
        f"threads={torch.get_num_threads()} hamming={engine_name()} block={DEFAULT_BLOCK_BYTES >> 20} MiB"
    )
    emb, labels = _data(n, args.dim, classes, args.seed)
    lab = _Labels.build(labels, None)
    valid = np.arange(n)

    # The bound is timed before and after the metrics and the faster run kept, so a busy
    # machine slowing one of them down makes the ratio pessimistic, never flattering.
    gemm_first = _gemm_seconds(emb, device, DEFAULT_BLOCK_BYTES)
    say(f"  similarity GEMM (N²×D, blocked)    {gemm_first:8.2f} s   {flops * args.dim / gemm_first / 1e9:6.1f} GFLOP/s")
    t_recall, m = _timed(lambda: path_metrics(emb, None, lab, valid, ks, False, "float", device))
    recall_text = ", ".join(f"R@{k} {100 * m[f'recall@{k}']:.1f}" for k in ks)
    say(f"  Recall@{{{','.join(map(str, ks))}}}          {t_recall:8.2f} s   ({recall_text})")
    t_map, m = _timed(lambda: path_metrics(emb, None, lab, valid, ks, True, "float", device))
    say(f"  Recall@K + MAP@R + R-precision    {t_map:8.2f} s   (MAP@R {100 * m['map@r']:.1f}, R-precision {100 * m['r_precision']:.1f})")
    gemm_again = _gemm_seconds(emb, device, DEFAULT_BLOCK_BYTES)
    gemm = min(gemm_first, gemm_again)
    say(f"  similarity GEMM again             {gemm_again:8.2f} s   -> bound {gemm:.2f} s; Recall {t_recall / gemm:.2f}×, with MAP@R {t_map / gemm:.2f}×")
    if args.faiss_peer:
        import faiss

        from dmltrain.evaluate.knn import float_gallery

        x = float_gallery(emb, torch.device("cpu")).data.numpy()
        index = faiss.IndexFlatIP(args.dim)
        index.add(x)
        faiss.omp_set_num_threads(torch.get_num_threads())
        t_faiss, _ = _timed(lambda: index.search(x, min(ks[-1] + 1, n)))
        say(f"  faiss IndexFlatIP.search k={min(ks[-1] + 1, n):<5}    {t_faiss:8.2f} s   {t_faiss / gemm:5.2f}× GEMM   (peer)")
        del x, index
    if not args.skip_nmi:
        t_nmi, nmi = _timed(lambda: clustering_nmi(emb, labels, seed=args.seed, niter=args.nmi_iters))
        say(f"  NMI (faiss k-means, k={classes}, {args.nmi_iters} it) {t_nmi:8.2f} s   (NMI {100 * nmi:.1f})")
    del emb
    if not args.skip_binary:
        emb2, labels2 = _data(n, args.binary_dim, classes, args.seed + 1)
        lab2 = _Labels.build(labels2, None)
        # Binary is timed before and after the float path and the slower run kept: pessimistic on a busy machine.
        t_bin1, mb = _timed(lambda: path_metrics(emb2, None, lab2, valid, ks, True, "binary", device))
        say(f"  binary path, {args.binary_dim} bits               {t_bin1:8.2f} s   (R@1 {100 * mb['binary/recall@1']:.1f}, MAP@R {100 * mb['binary/map@r']:.1f})")
        t_float, mf = _timed(lambda: path_metrics(emb2, None, lab2, valid, ks, True, "float", device))
        say(f"  float path, {args.binary_dim} dims                {t_float:8.2f} s   (R@1 {100 * mf['recall@1']:.1f}, MAP@R {100 * mf['map@r']:.1f})")
        t_bin2, _ = _timed(lambda: path_metrics(emb2, None, lab2, valid, ks, True, "binary", device))
        t_bin = max(t_bin1, t_bin2)
        say(f"  binary path again                 {t_bin2:8.2f} s   -> {t_bin:.2f} s kept")
        say(f"recall: {t_recall / gemm:.2f}× the GEMM bound (target <= 1.5×); binary {t_float / t_bin:.1f}× faster than float at {args.binary_dim} dims (target >= 4×)")
    else:
        say(f"recall: {t_recall / gemm:.2f}× the GEMM bound (target <= 1.5×)")
    return 0
