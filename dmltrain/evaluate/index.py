"""A faiss index over an embedding set: built, saved, loaded, searched, and measured against the exact search.

Kinds (cosine similarity: the vectors are L2-normalized and compared by inner product):

* ``flat``: ``IndexFlatIP``, exact (the reference every other kind is measured against); with ``binary``,
  ``IndexBinaryFlat`` over the sign bits (Hamming distance), exact too;
* ``ivf-pq``: ``IVF{nlist},PQ{m}x{nbits}`` (an inverted file of ``nlist`` k-means cells, each vector stored as
  ``m`` bytes of product-quantization codes at ``nbits = 8``), searched in the ``nprobe`` nearest cells;
  defaults ``nlist ≈ 4√N`` (a power of two, at least 39 training vectors per cell), ``m = D/4`` (rounded down to a
  divisor of D: 128 bytes for 512 dims, 1/16 of the float32 vector), ``nbits = 8`` (fewer below 39 · 256
  vectors), ``nprobe = nlist/16`` (at least 8, at most nlist);
* ``hnsw``: ``IndexHNSWFlat`` (a navigable small-world graph, ``hnsw_m`` links per node), built with
  ``ef_construction`` and searched with ``ef_search``.

A saved index is a folder: ``index.faiss`` (``faiss.write_index``: faiss's own format, no pickle), ``rows.npy``
(the embedding-set row of each faiss id), ``ids.parquet`` (copied from the set: ids and labels, so the folder
answers queries alone) and ``index.json`` (kind, parameters, counts, build time, size, held-out queries, the
set it came from), written last. ``holdout`` rows (a seeded random choice) are kept out of the index and
recorded, to serve as the queries of :func:`evaluate_index`.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.errors import UserError
from dmltrain.evaluate.faiss_file import check_index_file
from dmltrain.fileio import atomic_path, read_json, write_json

KINDS = ("flat", "ivf-pq", "hnsw")
FORMAT = "dmltrain.index"
VERSION = 1
INDEX_FILE, ROWS_FILE, IDS_FILE, INFO_FILE = "index.faiss", "rows.npy", "ids.parquet", "index.json"


@dataclass
class IndexParams:
    """Parameters of an index; ``None`` means the default for the data (module doc)."""

    kind: str = "flat"
    binary: bool = False
    nlist: int | None = None
    m: int | None = None
    nbits: int | None = None
    nprobe: int | None = None
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 64
    train_size: int = 100_000
    seed: int = 0

    def resolved(self, n: int, dim: int) -> IndexParams:
        """These parameters with every default filled in for ``n`` vectors of ``dim`` dimensions; a value that
        cannot work is a one-line :class:`UserError` naming its option."""
        if self.kind not in KINDS:
            raise UserError(f"--kind: unknown index kind {self.kind!r} (choose from {', '.join(KINDS)})")
        if self.binary and self.kind != "flat":
            raise UserError("--binary: only with --kind flat (an exact Hamming search over the sign bits)")
        p = IndexParams(**asdict(self))
        if self.kind != "ivf-pq":
            return p
        if self.nlist is None:  # about 4√N cells, a power of two, each with 39 training vectors at least
            p.nlist = max(1, min(2 ** round(math.log2(max(1.0, 4 * math.sqrt(n)))), n // 39))
        if p.nlist > n:
            raise UserError(f"--nlist: {p.nlist} cells for {n} vectors (at most one cell per vector)")
        p.m = self.m or max((d for d in range(1, max(1, dim // 4) + 1) if dim % d == 0), default=1)
        if dim % p.m:
            raise UserError(f"--m: {p.m} does not divide the embedding dim {dim}")
        p.nbits = self.nbits or max(4, min(8, int(math.log2(max(16, n // 39)))))
        if not 1 <= p.nbits <= 16 or 2**p.nbits > n:
            raise UserError(f"--nbits: {p.nbits} bits need at least {2**p.nbits} vectors to train on, there are {n}")
        p.nprobe = self.nprobe or min(p.nlist, max(8, p.nlist // 16))
        return p


def normalized(x: np.ndarray) -> np.ndarray:
    """float32 rows scaled to unit length (an all-zero row stays zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def new_index(p: IndexParams, dim: int) -> Any:
    import faiss

    if p.binary:
        return faiss.IndexBinaryFlat(dim)
    if p.kind == "flat":
        return faiss.IndexFlatIP(dim)
    if p.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, p.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = p.ef_construction
        return index
    # np: no polysemous training (a reordering of the codes for Hamming-filtered search, which IVF-PQ search does
    # not use here; it costs 15-60x the quantizers' own k-means)
    return faiss.index_factory(dim, f"IVF{p.nlist},PQ{p.m}x{p.nbits}np", faiss.METRIC_INNER_PRODUCT)


def set_search_params(index: Any, p: IndexParams) -> None:
    """The search-time parameters: ``nprobe`` (IVF), ``ef_search`` (HNSW)."""
    import faiss

    if p.kind == "ivf-pq":
        faiss.extract_index_ivf(index).nprobe = int(p.nprobe)
    elif p.kind == "hnsw":
        index.hnsw.efSearch = int(p.ef_search)


def build(vectors: np.ndarray, p: IndexParams) -> tuple[Any, float]:
    """An index of ``vectors`` (float rows, or packed codes with ``binary``), and its build time in seconds
    (training included). ``p`` must be :meth:`IndexParams.resolved`."""
    t0 = time.perf_counter()
    if p.binary:
        index = new_index(p, vectors.shape[1] * 8)
        index.add(np.ascontiguousarray(vectors, dtype=np.uint8))
        return index, time.perf_counter() - t0
    x = normalized(vectors)
    index = new_index(p, x.shape[1])
    if not index.is_trained:
        rng = np.random.default_rng(p.seed)
        sample = x if len(x) <= p.train_size else x[np.sort(rng.choice(len(x), p.train_size, replace=False))]
        index.train(sample)
    index.add(x)
    set_search_params(index, p)
    return index, time.perf_counter() - t0


def index_bytes(index: Any) -> int:
    """The index's size as faiss serializes it (its memory, near enough: codes, centroids, graph links)."""
    import faiss

    serialize = faiss.serialize_index_binary if isinstance(index, faiss.IndexBinary) else faiss.serialize_index
    return int(len(serialize(index)))


def search(
    index: Any, queries: np.ndarray, k: int, binary: bool, where: str | os.PathLike[str] = INDEX_FILE
) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, faiss ids)`` of the ``k`` best per query: cosines of the normalized queries, or Hamming distances
        with ``binary`` (packed codes in). Missing neighbours (k beyond what a probe found) are id -1; an id outside
        the index's vectors (an inverted list's stored ids are the file's to say) is a one-line :class:`UserError`
    naming ``where``."""
    if binary:
        scores, found = index.search(np.ascontiguousarray(queries, dtype=np.uint8), k)
    else:
        scores, found = index.search(normalized(queries), k)
    if found.size and (int(found.min()) < -1 or int(found.max()) >= index.ntotal):
        bad = int(found.max()) if int(found.max()) >= index.ntotal else int(found.min())
        raise UserError(f"{where}: the index returned id {bad}, outside its {index.ntotal} vectors ({ROWS_FILE})")
    return scores, found


# -- the saved folder --------------------------------------------------------------------------------------------
@dataclass
class SavedIndex:
    folder: Path
    info: dict[str, Any]
    index: Any
    rows: np.ndarray  # embedding-set row of each faiss id
    ids: dict[str, list[Any]]  # the set's ids.parquet columns, by set row

    @property
    def params(self) -> IndexParams:
        return IndexParams(**self.info["params"])


def save_index(
    folder: str | os.PathLike[str], index: Any, rows: np.ndarray, ids_file: Path, info: dict[str, Any]
) -> Path:
    """Write the folder (module doc); ``index.json`` last, so its presence means a complete index."""
    import faiss

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INFO_FILE).unlink(missing_ok=True)
    writer = faiss.write_index_binary if isinstance(index, faiss.IndexBinary) else faiss.write_index
    with atomic_path(folder / INDEX_FILE) as tmp:
        writer(index, str(tmp))
    with atomic_path(folder / ROWS_FILE) as tmp, open(tmp, "wb") as f:
        np.save(f, rows.astype(np.int64), allow_pickle=False)
    with atomic_path(folder / IDS_FILE) as tmp:
        shutil.copyfile(ids_file, tmp)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "faiss": faiss.__version__,
        **info,
    }
    write_json(folder / INFO_FILE, record)
    return folder / INFO_FILE


def load_index(folder: str | os.PathLike[str]) -> SavedIndex:
    """A folder :func:`save_index` wrote (or its ``index.json``); one-line :class:`UserError` naming the file."""
    import faiss
    import pyarrow.parquet as pq

    folder = Path(folder)
    if folder.name == INFO_FILE:
        folder = folder.parent
    info_path = folder / INFO_FILE
    if not info_path.is_file():
        raise UserError(f"{info_path}: not found; not a folder written by dmltrain index build")
    info = read_json(info_path)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise UserError(f"{info_path}: not a {FORMAT} file")
    params = info.get("params")
    count, dim = info.get("count"), info.get("dim")
    if not isinstance(params, dict) or not all(type(v) is int and v > 0 for v in (count, dim)):
        raise UserError(f"{info_path}: no params, count or dim")
    binary = bool(params.get("binary"))
    # what faiss would allocate and which classes it would build, bounded by the file, before it reads it
    check_index_file(folder / INDEX_FILE, binary=binary, dim=-(-dim // 8) * 8 if binary else dim, count=count)
    reader = faiss.read_index_binary if binary else faiss.read_index
    try:
        index = reader(str(folder / INDEX_FILE))
        rows = np.load(folder / ROWS_FILE, allow_pickle=False)
        ids = pq.read_table(folder / IDS_FILE).to_pydict()
    except Exception as e:  # noqa: BLE001 — faiss raises RuntimeError, numpy and pyarrow their own: one line
        raise UserError(
            f"{folder}: unreadable index files ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
        ) from None
    if rows.ndim != 1 or rows.dtype != np.int64 or index.ntotal != len(rows):
        raise UserError(f"{folder / ROWS_FILE}: {rows.dtype} {rows.shape} rows for the index's {index.ntotal} vectors")
    n_ids = len(ids.get("id") or [])
    if len(rows) and not (0 <= int(rows.min()) and int(rows.max()) < n_ids):
        raise UserError(f"{folder / ROWS_FILE}: rows outside the {n_ids} of {folder / IDS_FILE}")
    saved = SavedIndex(folder, info, index, rows, ids)
    if not saved.params.binary:
        set_search_params(index, saved.params)
    return saved


# -- measuring against the exact search ------------------------------------------------------------------------
def recall_vs_exact(approx: np.ndarray, exact: np.ndarray, ks: list[int]) -> dict[int, float]:
    """``k``-recall@``k`` for each ``k``: the mean share of the exact ``k`` nearest that the index also returns
    among its ``k`` (for k = 1: how often its first answer is the exact nearest)."""
    out = {}
    for k in ks:
        hits = [len(set(a[:k].tolist()) & set(e[:k].tolist())) for a, e in zip(approx, exact)]
        out[k] = float(np.mean(hits)) / k
    return out


def label_recall(
    neighbours: np.ndarray, query_labels: np.ndarray, gallery_labels: np.ndarray, ks: list[int]
) -> tuple[dict[int, float], int]:
    """Recall@K by label (the evaluation's definition, :mod:`.retrieval`): the share of queries with an item of their
    label among the first ``k`` returned (ids -1, nothing found, count as misses), and the number of queries left
    out: those with no item of their label in the gallery (``R = 0``: they cannot be retrieved). With none left,
    the recalls are ``{}``."""
    kept = np.isin(query_labels, gallery_labels)
    found = np.where(neighbours >= 0, gallery_labels[np.maximum(neighbours, 0)], None)
    same = (found == query_labels[:, None])[kept]
    recalls = {k: float(same[:, :k].any(axis=1).mean()) for k in ks} if len(same) else {}
    return recalls, int(len(kept) - kept.sum())
