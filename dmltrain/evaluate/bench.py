"""``dmltrain bench eval``: retrieval metrics time against the bare similarity GEMM, on the CPU or a GPU.

On synthetic clustered embeddings of the SOP test size (60,502 images, 11,316 classes) it
times, in one run on the same machine and device (``--device``):

1. the bare similarity GEMM (N² × D), blocked exactly as the metrics block it: the bound;
2. Recall@K (all K from one ranking), then Recall@K + MAP@R + R-precision, as ratios to (1);
3. NMI's k-means (k = classes; faiss on the CPU or with its GPU build, else torch on CUDA);
4. at 2048 dims: the float path (cosine) against the binary path (2048 sign bits, Hamming),
   both computing Recall@K + MAP@R + R-precision; on CUDA both binary engines (``mma``: int8
   tensor-core GEMM of ±1 codes; ``popcount``: the Triton XOR + popcount kernel);
5. optionally (``--faiss-peer``) faiss ``IndexFlatIP.search`` with k = max K, the peer the
   GEMM + rank-counting design replaced;
6. the approximate indexes of ``dmltrain index`` (``--index``, default ``ivf-pq,hnsw``, their default
   parameters): build time, query time per query and Recall@1 against the exact search (and 10-recall@10)
   for ``--index-queries`` held-out vectors, and the index's size, next to the exact search of the same
   queries (:func:`~dmltrain.evaluate.knn.knn`); faiss's threads as torch's. The data
   (``--index-data``): ``structured`` (default), class centres and within-class spread in a random
   64-dimensional subspace plus a little isotropic noise, as trained embeddings concentrate near a
   low-dimensional set; or ``isotropic``, the metrics' data above, whose 512 independent noise dimensions
   leave every point nearly equidistant: the worst case of any approximate search.

Contenders alternate over the same query chunks (``--chunks``; default 8 on the CPU, 1 on a
GPU): chunk 1 for the GEMM, then for Recall, then for Recall + MAP@R, chunk 2 for each, and
so on, so the load of other processes on a shared machine falls on all of them alike. Every
metric run pays its own setup (duplicate folding, normalization, sign codes) once per chunk.
On CUDA every contender first runs once on a few queries (Triton compilation, cuBLAS
handles), untimed, and every timing ends with the device's work done.

Targets: Recall within 1.5× of the GEMM on the CPU, 2× on a GPU; the binary path at least
4× faster than the float path at 2048 dims; k-means at SOP size within 3 s on a GPU.
Nothing is asserted; the figures are printed.

A command module: what running the command needs is imported where it runs, so ``dmltrain bench eval --help``
answers without loading torch, Ray or the data stack (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=60502, help="images (default: 60502, the SOP test set)")
    parser.add_argument(
        "--dim", type=int, default=512, help="float embedding dim of the Recall/NMI timings (default: 512)"
    )
    parser.add_argument("--classes", type=int, help="classes (default: n × 11316 / 60502, SOP's ratio)")
    parser.add_argument("--ks", default="1,10,100,1000", help="Recall@K cut-offs (default: 1,10,100,1000)")
    parser.add_argument(
        "--binary-dim", type=int, default=2048, help="dim of the float-vs-binary comparison (default: 2048)"
    )
    parser.add_argument("--nmi-iters", type=int, default=20, help="k-means iterations for NMI (default: 20)")
    parser.add_argument("--skip-nmi", action="store_true", help="skip the NMI timing")
    parser.add_argument(
        "--skip-binary", action="store_true", help="skip the float-vs-binary comparison at --binary-dim"
    )
    parser.add_argument("--faiss-peer", action="store_true", help="also time faiss IndexFlatIP.search with k = max K")
    parser.add_argument("--device", default="cpu", help="where the float GEMMs run: cpu, cuda, auto (default: cpu)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    parser.add_argument(
        "--chunks", type=int, help="query chunks the contenders alternate over (default: 8 on the CPU, 1 on a GPU)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON (make gpu-check reads them)")
    parser.add_argument(
        "--index", default="ivf-pq,hnsw", help="approximate indexes to time against the exact search ('' for none)"
    )
    parser.add_argument("--index-queries", type=int, default=1000, help="held-out queries of the index timings")
    parser.add_argument("--index-only", action="store_true", help="only the index timings")
    parser.add_argument(
        "--index-data",
        default="structured",
        choices=["structured", "isotropic"],
        help="the index timings' embeddings: structured (intrinsic dim 64, default) or isotropic (the metrics' data)",
    )


def _data(n: int, dim: int, classes: int, seed: int):
    """Class centres plus noise: every class has >= 2 images, sizes like SOP's (2-12); the
    noise grows with the dim so Recall@1 stays in the range trained models reach."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.concatenate(
        [np.arange(classes), np.arange(classes), rng.integers(0, classes, max(n - 2 * classes, 0))]
    )[:n]
    rng.shuffle(labels)
    centers = rng.standard_normal((classes, dim), dtype=np.float32)
    emb = centers[labels]
    emb += 2.5 * (dim / 512) ** 0.25 * rng.standard_normal((n, dim), dtype=np.float32)
    return emb, labels


def _structured_data(n: int, dim: int, classes: int, seed: int, intrinsic: int = 64):
    """Labels as :func:`_data`; each embedding a class centre plus within-class spread (std 0.9 against the
    centres' 1) in a random ``intrinsic``-dimensional subspace, plus isotropic noise of std 0.1: nearest
    neighbours are mostly class-mates (Recall@1 about 0.9 on 3,000 of them), as with trained embeddings."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = np.concatenate(
        [np.arange(classes), np.arange(classes), rng.integers(0, classes, max(n - 2 * classes, 0))]
    )[:n]
    rng.shuffle(labels)
    r = min(intrinsic, dim)
    basis = np.linalg.qr(rng.standard_normal((dim, r)))[0].astype(np.float32)
    z = rng.standard_normal((classes, r), dtype=np.float32)[labels] + 0.9 * rng.standard_normal(
        (n, r), dtype=np.float32
    )
    return z @ basis.T + 0.1 * rng.standard_normal((n, dim), dtype=np.float32), labels


def _index_bench(emb, kinds: list[str], n_queries: int, seed: int, threads: int, say) -> str:
    """Each index kind against the exact search on ``n_queries`` held-out rows of ``emb``: build and query time,
    Recall@1 vs exact, 10-recall@10, size. Returns the summary's part."""
    import faiss
    import numpy as np

    from dmltrain.evaluate.index import IndexParams, build, index_bytes, recall_vs_exact, search
    from dmltrain.evaluate.knn import knn

    faiss.omp_set_num_threads(threads)
    rng = np.random.default_rng(seed + 7)
    held = np.sort(rng.choice(len(emb), n_queries, replace=False))
    q, g = emb[held], np.delete(emb, held, axis=0)
    t_exact, (_, exact) = _timed(lambda: knn(q, g, 10, device="cpu"))
    say(
        f"  exact search (knn), {len(q)} queries over {len(g):,}   {1000 * t_exact / len(q):8.3f} ms/query   "
        f"(the reference)"
    )
    parts = []
    for kind in kinds:
        p = IndexParams(kind=kind, seed=seed).resolved(len(g), g.shape[1])
        index, t_build = build(g, p)
        t_query, (_, approx) = _timed(lambda index=index: search(index, q, 10, False))
        rec = recall_vs_exact(approx, exact, [1, 10])
        size = index_bytes(index)
        shown = {
            "ivf-pq": f"IVF{p.nlist},PQ{p.m}x{p.nbits} nprobe {p.nprobe}",
            "hnsw": f"M {p.hnsw_m} efC {p.ef_construction} efS {p.ef_search}",
        }.get(kind, "")
        say(
            f"  index {kind:<6} ({shown})   build {t_build:7.2f} s   query {1000 * t_query / len(q):7.3f} ms/query   "
            f"Recall@1 vs exact {rec[1]:.3f}   10-recall@10 {rec[10]:.3f}   {size / 2**20:6.1f} MiB ({size / len(g):.0f} B/vector)"
        )
        parts.append(f"{kind} Recall@1 {rec[1]:.3f} at {1000 * t_query / len(q):.2f} ms/query (build {t_build:.1f} s)")
    return f"index vs exact ({1000 * t_exact / len(q):.2f} ms/query): " + "; ".join(parts)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _gemm_seconds(gal, rows_idx, device, block_bytes) -> float:
    """The bound for queries ``rows_idx``: their normalized rows times the whole gallery's
    transpose, in the metrics' query blocks, writing every score block."""
    import torch

    x = gal.data
    step = gal.rows_per_block(block_bytes)
    out = torch.empty((step, len(x)), dtype=torch.float32, device=device)
    q_all = gal.query_rows(rows_idx)
    _sync(device)
    t = time.perf_counter()
    for lo in range(0, len(rows_idx), step):
        q = q_all[lo : lo + step]
        torch.mm(q, x.t(), out=out[: len(q)])
    _sync(device)
    return time.perf_counter() - t


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Interleaved:
    """Times several contenders over the same query chunks, alternating chunk by chunk, so a
    change of load on a shared machine falls on all of them alike."""

    def __init__(self, n: int, chunks: int, device):
        import numpy as np

        self.parts = [p for p in np.array_split(np.random.default_rng(0).permutation(n), chunks) if len(p)]
        self.seconds: dict[str, float] = {}
        self.device = device

    def run(self, contenders: dict) -> dict[str, list]:
        results: dict[str, list] = {name: [] for name in contenders}
        if self.device.type == "cuda":  # compile and warm up on a few queries, untimed
            for fn in contenders.values():
                fn(self.parts[0][:64])
        for part in self.parts:
            for name, fn in contenders.items():
                _sync(self.device)
                t = time.perf_counter()
                results[name].append(fn(part))
                _sync(self.device)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return results


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from dmltrain.errors import UserError
    from dmltrain.evaluate.clustering import clustering_nmi, kmeans_engine
    from dmltrain.evaluate.gallery import default_block_bytes, float_gallery, hamming_engine, resolve_device
    from dmltrain.evaluate.ranks import gpu_kernels
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
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device: '{args.device}' asked for but CUDA is not available")
    on_gpu = device.type == "cuda"
    chunks = args.chunks or (1 if on_gpu else 8)
    block_bytes = default_block_bytes(device)
    flops = 2.0 * n * n

    def say(text: str) -> None:
        print(text, flush=True)

    where = torch.cuda.get_device_name(device) if on_gpu else f"cpu, {torch.get_num_threads()} threads"
    say(
        f"eval bench: n={n} classes={classes} dim={args.dim} ks={','.join(map(str, ks))} device={device} ({where}) "
        f"hamming={hamming_engine(device)} kmeans={kmeans_engine(device)} block={block_bytes >> 20} MiB chunks={chunks}"
    )
    emb, labels = _data(n, args.dim, classes, args.seed)
    kinds = [k.strip() for k in args.index.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in ("flat", "ivf-pq", "hnsw")]
    if unknown:
        raise UserError(f"--index: unknown index kind {unknown[0]!r} (flat, ivf-pq, hnsw)")
    if kinds and not 1 <= args.index_queries < n:
        raise UserError(f"--index-queries: must be between 1 and n - 1, got {args.index_queries}")

    def index_part() -> str:
        data = emb if args.index_data == "isotropic" else _structured_data(n, args.dim, classes, args.seed + 3)[0]
        say(f"  index data: {args.index_data}, {n:,} × {args.dim}")
        return _index_bench(data, kinds, args.index_queries, args.seed, torch.get_num_threads(), say)

    if args.index_only:
        if not kinds:
            raise UserError("--index-only: no --index kinds to time")
        say(index_part())
        return 0
    lab = _Labels.build(labels, None)
    gal = float_gallery(emb, device)

    def metrics_of(kind: str, x, labels_: _Labels, with_map: bool, engine: str | None = None):
        def fn(part):
            return path_metrics(
                x, None, labels_, np.sort(part), ks, with_map, kind, device, block_bytes, binary_engine=engine
            )

        return fn

    def mean_of(results: list[dict], key: str, parts) -> float:
        return sum(r[key] * len(p) for r, p in zip(results, parts)) / sum(len(p) for p in parts)

    timer = _Interleaved(n, chunks, device)
    res = timer.run(
        {
            "gemm": lambda part: _gemm_seconds(gal, np.sort(part), device, block_bytes),
            "recall": metrics_of("float", emb, lab, False),
            "recall+map": metrics_of("float", emb, lab, True),
        }
    )
    sec = timer.seconds
    gemm = sum(res["gemm"])  # the GEMM loops alone, without their setup
    say(
        f"  similarity GEMM (N²×D, blocked)    {gemm:8.3f} s   {flops * args.dim / gemm / 1e9:6.1f} GFLOP/s   (the bound)"
    )
    recall_text = ", ".join(f"R@{k} {100 * mean_of(res['recall'], f'recall@{k}', timer.parts):.1f}" for k in ks)
    say(
        f"  Recall@{{{','.join(map(str, ks))}}}          {sec['recall']:8.3f} s   {sec['recall'] / gemm:5.2f}× GEMM   ({recall_text})"
    )
    map_r = mean_of(res["recall+map"], "map@r", timer.parts)
    say(
        f"  Recall@K + MAP@R + R-precision    {sec['recall+map']:8.3f} s   {sec['recall+map'] / gemm:5.2f}× GEMM   (MAP@R {100 * map_r:.1f})"
    )
    if args.faiss_peer:
        import faiss

        x = gal.data.cpu().numpy()
        index = faiss.IndexFlatIP(args.dim)
        index.add(x)
        faiss.omp_set_num_threads(torch.get_num_threads())
        t_faiss, _ = _timed(lambda: index.search(x, min(ks[-1] + 1, n)))
        say(
            f"  faiss IndexFlatIP.search k={min(ks[-1] + 1, n):<5}    {t_faiss:8.2f} s   {t_faiss / gemm:5.2f}× GEMM   (peer, CPU, not interleaved)"
        )
        del x, index
    figures: dict = {"device": where, "n": n, "dim": args.dim, "classes": classes, "gemm_s": gemm}
    figures |= {"recall_s": sec["recall"], "recall_map_s": sec["recall+map"], "recall_target": 2.0 if on_gpu else 1.5}
    summary = f"recall: {sec['recall'] / gemm:.2f}× the GEMM bound (target <= {2.0 if on_gpu else 1.5}×)"
    if not args.skip_nmi:
        engine = kmeans_engine(device)
        t_nmi, nmi = _timed(lambda: clustering_nmi(emb, labels, seed=args.seed, niter=args.nmi_iters, device=device))
        say(f"  NMI ({engine} k-means, k={classes}, {args.nmi_iters} it) {t_nmi:8.3f} s   (NMI {100 * nmi:.1f})")
        figures |= {"kmeans_s": t_nmi, "kmeans_engine": engine}
        if on_gpu:
            summary += f"; k-means {t_nmi:.2f} s (target <= 3 s)"
    if kinds:
        summary += "; " + index_part()
    emb = gal = None  # the float data goes before the binary pass allocates its own
    if not args.skip_binary:
        emb2, labels2 = _data(n, args.binary_dim, classes, args.seed + 1)
        lab2 = _Labels.build(labels2, None)
        engines = [hamming_engine(device)]
        if on_gpu and gpu_kernels is not None and "popcount" not in engines:
            engines.append("popcount")
        contenders = {"float": metrics_of("float", emb2, lab2, True)}
        contenders.update({f"binary {e}": metrics_of("binary", emb2, lab2, True, e) for e in engines})
        timer2 = _Interleaved(n, chunks, device)
        res2 = timer2.run(contenders)
        t_float = timer2.seconds["float"]
        r1f = mean_of(res2["float"], "recall@1", timer2.parts)
        say(
            f"  float path, {args.binary_dim} dims                {t_float:8.3f} s   (Recall@K + MAP@R; R@1 {100 * r1f:.1f})"
        )
        for e in engines:
            t_bin = timer2.seconds[f"binary {e}"]
            r1b = mean_of(res2[f"binary {e}"], "binary/recall@1", timer2.parts)
            say(
                f"  binary path, {args.binary_dim} bits ({e:<8})   {t_bin:8.3f} s   {t_float / t_bin:5.1f}× faster than float   (R@1 {100 * r1b:.1f})"
            )
        t_bin = timer2.seconds[f"binary {engines[0]}"]
        figures |= {"binary_dim": args.binary_dim, "float_s": t_float}
        figures["binary_s"] = {e: timer2.seconds[f"binary {e}"] for e in engines}
        summary += (
            f"; binary ({engines[0]}) {t_float / t_bin:.1f}× faster than float at {args.binary_dim} dims (target >= 4×)"
        )
    say(summary)
    if args.json:
        from dmltrain.fileio import write_json

        write_json(args.json, figures)
    return 0
