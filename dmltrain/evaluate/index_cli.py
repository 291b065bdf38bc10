"""``dmltrain index build|eval|query``: a faiss index over an embedding set, its recall against the exact search,
and answers to a handful of queries.

    dmltrain index build emb/gallery --kind hnsw --holdout 1000          # -> emb/gallery/index-hnsw/
    dmltrain index eval emb/gallery/index-hnsw                            # Recall@K vs exact, times, memory -> MLflow
    dmltrain index eval emb/gallery/index-ivf-pq --queries emb/query      # another set's embeddings as the queries
    dmltrain index query emb/gallery/index-hnsw --images a.jpg b.jpg      # ids and scores of the nearest
    dmltrain index query emb/gallery/index-hnsw --vectors q.npy --k 5

``build`` takes an embedding set (``dmltrain embed``'s folder); the index folder is described in
:mod:`dmltrain.evaluate.index`. ``eval`` searches the held-out rows (``build --holdout``) or ``--queries`` (another
set than the index's own, whose rows would find themselves: refused) with the index and exactly
(:func:`dmltrain.evaluate.knn.knn`, the evaluation's exact search), and reports ``k``-recall@``k`` against the
exact neighbours, Recall@K by label for both when there are labels (queries without an item of their label in
the index left out, and counted), the build time, the query time per query and the index's size; it writes
``index_eval.json`` beside the index and logs the same to MLflow (``--run-id`` to add them to an existing run,
else a run named after the index in ``--experiment``). ``query`` embeds ``--images`` with ``--model`` (the user's
to name, never the index's) as its contract says.

A command module: what running the command needs is imported where it runs, so ``dmltrain index --help``
answers without loading torch or faiss (the CLI's lazy dispatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.text import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = sub.add_parser(
        "build",
        help="build a faiss index over an embedding set",
        description="Build a faiss index (flat, ivf-pq or hnsw) over an embedding set written by dmltrain embed.",
    )
    b.add_argument("embeddings", metavar="EMBEDDINGS", help="an embedding set's folder (dmltrain embed --out)")
    b.add_argument("--kind", default="flat", help="flat (exact), ivf-pq or hnsw (default flat)")
    b.add_argument("--out", metavar="DIR", help="the index folder (default: EMBEDDINGS/index-<kind>)")
    b.add_argument("--binary", action="store_true", help="flat only: an exact Hamming index over the set's sign bits")
    b.add_argument(
        "--holdout", type=int, default=0, metavar="N", help="keep N random rows out of the index as eval's queries"
    )
    b.add_argument("--nlist", type=int, help="ivf-pq: inverted-file cells (default about 4·sqrt(N))")
    b.add_argument("--m", type=int, help="ivf-pq: bytes per vector, the PQ sub-quantizers (default dim/4)")
    b.add_argument("--nbits", type=int, help="ivf-pq: bits per sub-quantizer code (default 8)")
    b.add_argument("--nprobe", type=int, help="ivf-pq: cells searched per query (default nlist/16, at least 8)")
    b.add_argument("--hnsw-m", type=int, default=32, help="hnsw: links per node (default 32)")
    b.add_argument("--ef-construction", type=int, default=80, help="hnsw: candidate list while building (default 80)")
    b.add_argument("--ef-search", type=int, default=64, help="hnsw: candidate list while searching (default 64)")
    b.add_argument(
        "--train-size", type=int, default=100_000, help="ivf-pq: vectors the quantizers train on (default 100000)"
    )
    b.add_argument("--seed", type=int, default=0, help="seed of the held-out rows and the training sample")
    b.add_argument("--overwrite", action="store_true", help="replace an index in --out")
    e = sub.add_parser(
        "eval",
        help="recall against the exact search, times and memory, logged to MLflow",
        description="Search held-out or given queries with the index and exactly; report k-recall@k, Recall@K by "
        "label, build and query times and the index size.",
    )
    e.add_argument("index", metavar="INDEX", help="an index folder (dmltrain index build)")
    e.add_argument(
        "--queries",
        metavar="EMBEDDINGS",
        help="an embedding set of queries, not the index's own (default: the rows held out at build)",
    )
    e.add_argument("--ks", default="1,10,100", help="the k of k-recall@k and Recall@K (default 1,10,100)")
    e.add_argument("--nprobe", type=int, help="ivf-pq: cells searched (default: the index's)")
    e.add_argument("--ef-search", type=int, help="hnsw: candidate list while searching (default: the index's)")
    e.add_argument("--out", metavar="JSON", help="the report (default: INDEX/index_eval.json)")
    e.add_argument(
        "--tracking-uri", metavar="URI", help="MLflow store (default $MLFLOW_TRACKING_URI, else ./mlflow.db)"
    )
    e.add_argument(
        "--experiment", default="dmltrain-index", help="MLflow experiment of the run (default dmltrain-index)"
    )
    e.add_argument("--run-id", help="log into this existing MLflow run (e.g. the training's) instead")
    e.add_argument("--no-tracking", action="store_true", help="no MLflow")
    q = sub.add_parser(
        "query",
        help="the nearest ids and scores for a few images or vectors",
        description="Print the ids and scores of the nearest gallery items of a few images or vectors.",
    )
    q.add_argument("index", metavar="INDEX", help="an index folder (dmltrain index build)")
    q.add_argument("--images", nargs="+", metavar="IMAGE", help="image files (or URLs) to embed and search for")
    q.add_argument("--vectors", metavar="NPY", help="a .npy file of query vectors (N × D)")
    q.add_argument("--rows", metavar="I,J,...", help="rows of the index's embedding set as queries")
    q.add_argument(
        "--model",
        help="the model that embeds --images (needed with them: an index folder never picks the code that runs)",
    )
    q.add_argument(
        "--trust-torchscript",
        action="store_true",
        help="load a TorchScript --model: TorchScript programs can run arbitrary code, pass it only for a file you trust",
    )
    q.add_argument("--k", type=int, default=5, help="neighbours per query (default 5)")
    q.add_argument("--nprobe", type=int, help="ivf-pq: cells searched (default: the index's)")
    q.add_argument("--ef-search", type=int, help="hnsw: candidate list while searching (default: the index's)")
    q.add_argument("--device", default="cpu", help="where --images are embedded (default cpu)")


def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise UserError(f"--ks: expected comma-separated positive integers, got '{text}'")
    return ks


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")


# -- build ---------------------------------------------------------------------------------------------------------
def _build(args: argparse.Namespace) -> int:
    import numpy as np

    from dmltrain.evaluate.embedding_set import IDS, load_embedding_set
    from dmltrain.evaluate.index import IndexParams, build, index_bytes, save_index

    _positive(args, "nlist", "m", "nbits", "nprobe", "hnsw_m", "ef_construction", "ef_search", "train_size")
    if args.holdout < 0:
        raise UserError(f"--holdout: must be >= 0, got {args.holdout}")
    out = Path(args.out or Path(args.embeddings, f"index-{args.kind}{'-binary' if args.binary else ''}"))
    check_output_dir(out, "--out")
    if (out / "index.json").exists() and not args.overwrite:
        raise UserError(f"{out}: holds an index; pass --overwrite to replace it, or choose another --out")
    es = load_embedding_set(args.embeddings)
    if args.binary and es.codes is None:
        raise UserError(f"--binary: {es.folder} has no sign bits (embed it with --binary)")
    n = len(es)
    if args.holdout >= n:
        raise UserError(f"--holdout: {args.holdout} of the set's {n} rows leaves nothing to index")
    rng = np.random.default_rng(args.seed)
    held = np.sort(rng.choice(n, args.holdout, replace=False)) if args.holdout else np.zeros(0, np.int64)
    rows = np.setdiff1d(np.arange(n), held)
    p = IndexParams(
        kind=args.kind,
        binary=args.binary,
        nlist=args.nlist,
        m=args.m,
        nbits=args.nbits,
        nprobe=args.nprobe,
        hnsw_m=args.hnsw_m,
        ef_construction=args.ef_construction,
        ef_search=args.ef_search,
        train_size=args.train_size,
        seed=args.seed,
    ).resolved(len(rows), es.dim)
    vectors = (es.codes if args.binary else es.embeddings)[rows]
    print(
        f"building {p.kind}{' (binary)' if p.binary else ''} over {len(rows):,} × {es.dim} embeddings of {es.folder}",
        file=sys.stderr,
    )
    index, seconds = build(vectors, p)
    size = index_bytes(index)
    info = {
        "kind": p.kind,
        "metric": "hamming" if p.binary else "cosine",
        "params": {k: v for k, v in vars(p).items()},
        "count": len(rows),
        "dim": es.dim,
        "embeddings": str(es.folder.resolve()),
        "model": es.info.get("model", {}).get("file"),
        "model_sha256": es.info.get("model", {}).get("sha256"),
        "holdout": held.tolist(),
        "build_seconds": round(seconds, 3),
        "index_bytes": size,
    }
    save_index(out, index, rows, es.folder / IDS, info)
    described = ", ".join(f"{k} {v}" for k, v in vars(p).items() if v is not None and k in _SHOWN[p.kind])
    print(
        f"wrote {out} ({p.kind}{': ' + described if described else ''}): {len(rows):,} vectors, "
        f"{size / 2**20:.1f} MiB ({size / len(rows):.0f} bytes per vector), built in {seconds:.2f} s"
        + (f"; {len(held)} rows held out for index eval" if len(held) else "")
    )
    return 0


_SHOWN = {"flat": (), "ivf-pq": ("nlist", "m", "nbits", "nprobe"), "hnsw": ("hnsw_m", "ef_construction", "ef_search")}


def _search_overrides(saved: Any, args: argparse.Namespace) -> None:
    from dmltrain.evaluate.index import set_search_params

    p = saved.params
    if args.nprobe is not None:
        if p.kind != "ivf-pq":
            raise UserError("--nprobe: only for an ivf-pq index")
        p.nprobe = args.nprobe
    if args.ef_search is not None:
        if p.kind != "hnsw":
            raise UserError("--ef-search: only for an hnsw index")
        p.ef_search = args.ef_search
    if not p.binary:
        set_search_params(saved.index, p)
    saved.info["params"] = vars(p)


# -- eval --------------------------------------------------------------------------------------------------------
def _eval(args: argparse.Namespace) -> int:
    import numpy as np

    from dmltrain.evaluate.embedding_set import load_embedding_set
    from dmltrain.evaluate.index import label_recall, load_index, recall_vs_exact, search
    from dmltrain.evaluate.knn import knn
    from dmltrain.fileio import write_json

    ks = _ks(args.ks)
    _positive(args, "nprobe", "ef_search")
    saved = load_index(args.index)
    _search_overrides(saved, args)
    out = Path(args.out) if args.out else saved.folder / "index_eval.json"
    check_output_dir(out.parent, "--out")
    gallery_set = load_embedding_set(saved.info["embeddings"])
    binary = saved.params.binary
    gallery_rows = saved.rows
    held = saved.info.get("holdout") or []
    if not isinstance(held, list) or not all(type(r) is int for r in held):
        raise UserError(f"{saved.folder / 'index.json'}: holdout is not a list of rows")
    named = np.concatenate([gallery_rows, np.asarray(held, np.int64)])  # rows of the set index.json names
    if len(named) and not (0 <= int(named.min()) and int(named.max()) < len(gallery_set)):
        raise UserError(f"{saved.folder}: rows beyond the {len(gallery_set)} of {gallery_set.folder}")
    if args.queries:
        query_set = load_embedding_set(args.queries)
        if query_set.folder.resolve() == gallery_set.folder.resolve():
            raise UserError(
                f"--queries: {query_set.folder} is the embedding set the index was built from: every query would find "
                "itself; hold rows out (index build --holdout N) or give another set's embeddings"
            )
        if query_set.dim != gallery_set.dim:
            raise UserError(
                f"--queries: {query_set.folder} holds {query_set.dim}-d embeddings, the index {gallery_set.dim}-d"
            )
        q_float, q_labels = np.asarray(query_set.embeddings), query_set.labels()
        q_codes = query_set.codes
        what = f"{len(q_float)} queries of {query_set.folder}"
    else:
        held = np.asarray(held, np.int64)
        if not len(held):
            raise UserError(
                f"{saved.folder}: no rows were held out at build (index build --holdout N), and no --queries given"
            )
        q_float = np.asarray(gallery_set.embeddings[held])
        labels = gallery_set.labels()
        q_labels = None if labels is None else labels[held]
        q_codes = None if gallery_set.codes is None else gallery_set.codes[held]
        what = f"{len(held)} held-out rows"
    if binary and q_codes is None:
        raise UserError(f"{args.queries or gallery_set.folder}: no sign bits for the queries of a binary index")
    k = min(ks[-1], len(gallery_rows))
    ks = [x for x in ks if x <= k]
    g_float = np.asarray(gallery_set.embeddings[gallery_rows])
    print(f"index eval: {saved.info['kind']} over {len(gallery_rows):,} vectors, {what}, k up to {k}", file=sys.stderr)
    t0 = time.perf_counter()
    _, approx = search(saved.index, q_codes if binary else q_float, k, binary, saved.folder / "index.faiss")
    query_s = time.perf_counter() - t0
    _, exact = knn(q_float if not binary else q_float, g_float, k, binary=binary, device="cpu")
    recall = recall_vs_exact(approx, exact, ks)
    metrics: dict[str, float] = {f"index/recall@{x}": v for x, v in recall.items()}
    g_labels = gallery_set.labels()
    n_q = len(q_float)
    if q_labels is not None and g_labels is not None:
        g_labels = g_labels[gallery_rows]
        for name, found in (("index/label_recall", approx), ("index/exact_label_recall", exact)):
            recalls, excluded = label_recall(found, q_labels, g_labels, ks)
            metrics.update({f"{name}@{x}": v for x, v in recalls.items()})
        metrics["index/excluded_queries"] = excluded
        if excluded:
            print(
                f"{excluded} of {n_q} queries have no item of their label in the index: left out of Recall@K by label"
            )
    metrics.update(
        {
            "index/build_s": float(saved.info["build_seconds"]),
            "index/query_ms": 1000 * query_s / n_q,
            "index/queries_per_s": n_q / query_s if query_s > 0 else float("inf"),
            "index/memory_mb": saved.info["index_bytes"] / 2**20,
            "index/bytes_per_vector": saved.info["index_bytes"] / len(gallery_rows),
        }
    )
    for x in ks:
        label = ""
        if f"index/label_recall@{x}" in metrics:
            got, want = metrics[f"index/label_recall@{x}"], metrics[f"index/exact_label_recall@{x}"]
            label = f"   Recall@{x} by label {100 * got:.2f}% (exact {100 * want:.2f}%)"
        print(f"{x}-recall@{x} vs exact {100 * recall[x]:6.2f}%{label}")
    print(
        f"build {metrics['index/build_s']:.2f} s; query {metrics['index/query_ms']:.3f} ms per query "
        f"({metrics['index/queries_per_s']:,.0f}/s, batch of {n_q}); index {metrics['index/memory_mb']:.2f} MiB "
        f"({metrics['index/bytes_per_vector']:.0f} bytes per vector)"
    )
    record = {
        "index": str(saved.folder),
        "queries": args.queries or "holdout",
        "params": saved.info["params"],
        "ks": ks,
        "metrics": metrics,
    }
    write_json(out, record)
    print(f"wrote {out}", file=sys.stderr)
    if not args.no_tracking:
        _log(args, saved, metrics, n_q)
    return 0


def _log(args: argparse.Namespace, saved: Any, metrics: dict[str, float], n_queries: int) -> None:
    from dmltrain.tracking.run import RunHandle

    uri = (
        args.tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or "sqlite:///" + str((Path.cwd() / "mlflow.db").resolve())
    )
    p = saved.info["params"]
    params = {f"index.{k}": v for k, v in p.items() if v is not None}
    params.update(
        {
            "index.count": saved.info["count"],
            "index.dim": saved.info["dim"],
            "index.queries": n_queries,
            "index.embeddings": saved.info["embeddings"],
            "index.faiss": saved.info.get("faiss"),
        }
    )
    if args.run_id:
        handle = RunHandle.attach(uri, args.run_id, owner="the index evaluation")
        handle.log_metrics(metrics)
        return
    name = f"{saved.folder.parent.name}-{saved.folder.name}"  # the set's folder and the index's: emb-index-hnsw
    handle = RunHandle.open(uri, args.experiment, name, params, owner="the index evaluation")
    handle.log_metrics(metrics)
    handle.log_artifact(saved.folder / "index.json", "index")
    handle.finish("FINISHED")
    if handle.enabled:
        print(
            f"MLflow: run {printable(name)} ({handle.run_id}) in experiment {printable(args.experiment)} at {uri}",
            file=sys.stderr,
        )


# -- query -------------------------------------------------------------------------------------------------------
def _query(args: argparse.Namespace) -> int:
    import numpy as np

    from dmltrain.evaluate.index import load_index, search

    _positive(args, "k", "nprobe", "ef_search")
    given = [n for n in ("images", "vectors", "rows") if getattr(args, n)]
    if len(given) != 1:
        raise UserError("index query: give one of --images, --vectors or --rows")
    saved = load_index(args.index)
    _search_overrides(saved, args)
    binary = saved.params.binary
    if args.vectors:
        try:
            vectors = np.load(args.vectors, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UserError(f"{args.vectors}: not a readable .npy file ({e})") from None
        vectors = np.atleast_2d(vectors)
        names = [f"{Path(args.vectors).name}[{i}]" for i in range(len(vectors))]
    elif args.rows:
        from dmltrain.evaluate.embedding_set import load_embedding_set

        es = load_embedding_set(saved.info["embeddings"])
        try:
            rows = [int(t) for t in args.rows.split(",")]
        except ValueError:
            raise UserError(f"--rows: expected comma-separated row numbers, got '{args.rows}'") from None
        if any(not 0 <= r < len(es) for r in rows):
            raise UserError(f"--rows: the embedding set has rows 0 to {len(es) - 1}")
        vectors = np.asarray((es.codes if binary else es.embeddings)[rows])
        names = [f"row {r} ({es.ids['id'][r]})" for r in rows]
    else:
        vectors, names = _embed_images(args, saved)
    if binary and vectors.dtype != np.uint8:  # float embeddings: their sign bits (packed codes pass as they are)
        from dmltrain.models.binary import pack_sign_bits

        vectors = pack_sign_bits(vectors)
    dim = saved.index.d // 8 if binary else saved.index.d
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        what = "bytes of codes" if binary else "dimensions"
        raise UserError(f"{args.vectors or 'the queries'}: {vectors.shape[-1]} {what}, the index holds {dim}")
    k = min(args.k, saved.index.ntotal)
    scores, found = search(saved.index, vectors, k, binary, saved.folder / "index.faiss")
    labels = saved.ids.get("label")
    for name, s, f in zip(names, scores, found):
        print(f"query {printable(name)}")
        for rank, (score, i) in enumerate(zip(s, f), 1):
            if i < 0:
                continue
            row = int(saved.rows[i])  # ids and labels are the set's: anyone's text, one visible line each
            label = f"  label {printable(labels[row])}" if labels is not None and labels[row] is not None else ""
            value = f"hamming {int(score)}" if binary else f"cosine {score:.4f}"
            print(f"  {rank:>3}. {printable(saved.ids['id'][row])}  {value}{label}")
    return 0


def _embed_images(args: argparse.Namespace, saved: Any) -> tuple[Any, list[str]]:
    """The ``--images``, embedded by ``--model``, prepared as its contract says. The model is always the user's
    to name: ``index.json`` is anyone's who can write the folder, and a model file decides what is loaded and run;
    a model other than the one ``index.json`` records (by SHA-256) gets a note."""
    import numpy as np
    import torch

    from dmltrain.models.serving import file_sha256, load_embedder
    from dmltrain.text import printable
    from shards.build.ingest import SkipImage, read_source
    from shards.decode.transforms import EvalTransform, normalize_batch

    recorded = saved.info.get("model")
    if not args.model:
        named = f" (the index was built from embeddings of {printable(recorded, 200)})" if recorded else ""
        raise UserError(f"--model: needed with --images; an index folder never picks the model that runs{named}")
    model, contract, files = load_embedder(args.model, args.device, trust_torchscript=args.trust_torchscript)
    want = saved.info.get("model_sha256")
    if isinstance(want, str) and file_sha256(files[0]) != want:
        print(
            f"dmltrain: note: --model {args.model} is not the file the set was embedded with "
            f"({printable(recorded, 200)}); its embeddings compare only if it is that model (an export of it)",
            file=sys.stderr,
        )
    transform = EvalTransform(
        contract.resize, contract.crop, grayscale=contract.grayscale, interpolation=contract.interpolation
    )
    arrays = []
    for image in args.images:
        try:
            arrays.append(transform(read_source(image)))
        except SkipImage as e:
            raise UserError(f"{image}: {e}") from None
        except Exception as e:  # noqa: BLE001 — PIL raises many types for a file that is not an image
            raise UserError(f"{image}: not an image PIL can read ({type(e).__name__})") from None
    images = normalize_batch(torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous(), norm=contract.norm())
    model.eval()
    with torch.no_grad():
        emb = model(images.to(args.device)).float().cpu().numpy()
    return emb, list(args.images)


def run(args: argparse.Namespace) -> int:
    return {"build": _build, "eval": _eval, "query": _query}[args.action](args)
