"""Retrieval metrics against a brute-force transcription of their definitions.

The reference ranks every gallery item of every query with ``np.lexsort`` on (score, index),
scores computed one pair at a time with ``math.fsum`` in float64 (so identical vectors tie
exactly), and evaluates Recall@K, MAP@R and R-precision by their textbook formulas. The data
has exact ties and duplicates on purpose: ±1 vectors (every cosine a multiple of 1/8), raw
and rescaled duplicates with other labels, a zero vector, singleton classes, query labels
absent from the gallery.
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
import torch

from dmltrain.evaluate import hamming as hamming_mod
from dmltrain.evaluate import native
from dmltrain.evaluate.clustering import clustering_nmi, kmeans_assignments, nmi_score
from dmltrain.evaluate.gallery import unique_rows
from dmltrain.evaluate.knn import knn, lexicographic_topk
from dmltrain.evaluate.retrieval import retrieval_metrics
from dmltrain.models.binary import hamming_distances, pack_sign_bits

KS = [1, 2, 3, 5, 10, 40]


# -- the reference ---------------------------------------------------------------------------
def ref_scores(q: np.ndarray, g: np.ndarray, binary: bool) -> np.ndarray:
    """Score matrix where larger is better: cosine (fsum, float64) or minus Hamming distance."""
    if binary:
        return -hamming_distances(pack_sign_bits(q), pack_sign_bits(g)).astype(np.float64)

    def unit(rows: np.ndarray) -> list[list[float]]:
        out = []
        for r in rows.astype(np.float64):
            n = math.sqrt(math.fsum(v * v for v in r))
            out.append([v / n if n > 0 else 0.0 for v in r])
        return out

    qu, gu = unit(q), unit(g)
    return np.array([[math.fsum(a * b for a, b in zip(x, y)) for y in gu] for x in qu])


def ref_metrics(q, ql, g, gl, ks, binary, S=None):
    """Loop-by-loop transcription: per query, rank all candidates, then each metric's formula."""
    self_search = g is None
    if self_search:
        g, gl = q, ql
    if S is None:
        S = ref_scores(q, g, binary)
    hits = dict.fromkeys(ks, 0)
    ap_sum = rp_sum = 0.0
    n = excluded = 0
    for i in range(len(q)):
        cand = np.array([j for j in range(len(g)) if not (self_search and j == i)])
        ranked = cand[np.lexsort((cand, -S[i, cand]))]  # score descending, then index ascending
        rel = [gl[j] == ql[i] for j in ranked]
        R = sum(rel)
        if R == 0:
            excluded += 1
            continue
        n += 1
        for k in ks:
            hits[k] += any(rel[:k])
        ap = 0.0
        correct = 0
        for pos in range(1, R + 1):
            if rel[pos - 1]:
                correct += 1
                ap += correct / pos
        ap_sum += ap / R
        rp_sum += sum(rel[:R]) / R
    p = "binary/" if binary else ""
    out = {f"{p}recall@{k}": hits[k] / n for k in ks}
    out[f"{p}map@r"] = ap_sum / n
    out[f"{p}r_precision"] = rp_sum / n
    return out, n, excluded


def near_tie_free(q, ql, g, gl, tol=1e-5, S=None) -> bool:
    """No relevant and irrelevant item closer than ``tol`` in cosine unless exactly tied.

    Float32 arithmetic may order such near-ties differently from the float64 reference;
    exact ties are the point of the test and stay.
    """
    self_search = g is None
    if self_search:
        g, gl = q, ql
    if S is None:
        S = ref_scores(q, g, False)
    for i in range(len(q)):
        mask = np.ones(len(g), bool)
        if self_search:
            mask[i] = False
        rel = (gl == ql[i]) & mask
        irr = (gl != ql[i]) & mask
        d = np.abs(S[i, rel][:, None] - S[i, irr][None, :])
        if ((d > 0) & (d < tol)).any():
            return False
    return True


# -- data with ties and duplicates -----------------------------------------------------------
def _labels(rng, n, classes):
    y = rng.integers(0, classes, n)
    y[[5, 50]] = [1000, 1001]  # singleton classes: nothing to retrieve, excluded
    return y


def continuous_data(seed):
    """Gaussian embeddings with raw duplicates, rescaled duplicates (same direction), a zero row."""
    for s in range(seed, seed + 50):
        rng = np.random.default_rng(s)
        n, d = 130, 12
        x = rng.standard_normal((n, d)).astype(np.float32)
        y = _labels(rng, n, 30)
        src = rng.choice(n, 24, replace=False)
        x[src[12:]] = x[src[:12]]  # bit-identical rows, labels kept (often different)
        x[src[:4]] *= 2.0
        x[src[4:8]] = 0.5 * x[rng.choice(n, 4)]  # same direction, different bits
        x[7] = 0.0
        if near_tie_free(x, y, None, None):
            return x, y
    raise RuntimeError("no near-tie-free seed found")


def sign_data(seed):
    """±1 vectors in 16 dims: cosines are exact multiples of 1/8, so ties are everywhere."""
    rng = np.random.default_rng(seed)
    n = 160
    x = rng.choice(np.array([-1.0, 1.0], np.float32), size=(n, 16))
    x[::5] *= 2.0
    x[1::7] = x[2::7][: len(x[1::7])]
    y = _labels(rng, n, 25)
    return x, y


def duplicate_data(seed):
    """40 directions, each present 3-5 times (raw or rescaled by 2 or 1/2) under mixed labels:
    every query's nearest neighbours are exact ties, ordered by index alone."""
    for s in range(seed, seed + 50):
        rng = np.random.default_rng(s)
        base = rng.standard_normal((40, 32)).astype(np.float32)
        which = np.concatenate([np.arange(40), np.arange(40), np.arange(40), rng.integers(0, 40, 40)])
        rng.shuffle(which)
        x = base[which] * rng.choice(np.array([1.0, 1.0, 2.0, 0.5], np.float32), size=(len(which), 1))
        y = _labels(rng, len(x), 12)
        if near_tie_free(x, y, None, None):
            return x, y
    raise RuntimeError("no near-tie-free seed found")


DATASETS = {"continuous": continuous_data(0), "signs": sign_data(1), "duplicates": duplicate_data(0)}


@functools.cache
def dataset_scores(name: str, binary: bool) -> np.ndarray:
    x, _ = DATASETS[name]
    return ref_scores(x, x, binary)


def split_query_gallery(y, rng):
    """Query and gallery indices where some query labels are absent from the gallery."""
    perm = rng.permutation(len(y))
    q, g = perm[: len(y) // 3], perm[len(y) // 3 :]
    absent = np.unique(y[q])[:3]
    return q, g[~np.isin(y[g], absent)]


def assert_same(got, want):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("binary", [False, True])
def test_self_retrieval_matches_reference(name, binary):
    x, y = DATASETS[name]
    want, n, excluded = ref_metrics(x, y, None, None, KS, binary, dataset_scores(name, binary))
    for block_bytes in (1 << 28, 64 * 4 * len(x) // 10):  # one block; many small blocks
        got = retrieval_metrics(x, y, ks=KS, nmi=False, binary=binary, block_bytes=block_bytes, device="cpu")
        assert_same(got, want)
        assert (got["num_queries"], got["excluded_queries"], got["gallery_size"]) == (n, excluded, len(x))
    assert excluded > 0  # singleton classes exist and are excluded


@pytest.mark.parametrize("name", list(DATASETS))
@pytest.mark.parametrize("binary", [False, True])
def test_query_gallery_matches_reference(name, binary):
    x, y = DATASETS[name]
    qi, gi = split_query_gallery(y, np.random.default_rng(3))
    q, ql, g, gl = x[qi], y[qi], x[gi], y[gi]
    S = dataset_scores(name, binary)[np.ix_(qi, gi)]
    if not binary:
        assert near_tie_free(q, ql, g, gl, S=S)
    want, n, excluded = ref_metrics(q, ql, g, gl, KS, binary, S)
    got = retrieval_metrics(
        torch.from_numpy(q), torch.from_numpy(ql), g, gl, ks=KS, nmi=False, binary=binary, block_bytes=4096
    )
    assert_same(got, want)
    assert got["excluded_queries"] == excluded > 0 and got["num_queries"] == n
    # binary=True also reports the float metrics, identical to a float-only call
    if binary:
        float_only = retrieval_metrics(q, ql, g, gl, ks=KS, nmi=False)
        assert {k: v for k, v in got.items() if k in float_only} == float_only


@pytest.mark.parametrize("binary", [False, True])
def test_fallback_engines_match_reference(binary, monkeypatch):
    """Without the native kernels (no compiler): NumPy ranks and faiss Hamming, same numbers."""
    monkeypatch.setenv("DMLTRAIN_NATIVE", "0")
    x, y = DATASETS["duplicates"]
    want, _, _ = ref_metrics(x, y, None, None, KS, binary, dataset_scores("duplicates", binary))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "native kernel unavailable"
        assert_same(retrieval_metrics(x, y, ks=KS, nmi=False, binary=binary, block_bytes=20000), want)


def test_hand_computed_map_at_r():
    # One query at angle 0; gallery at 10°, 20°, ... 60° with labels A B A B A B: relevant at
    # ranks 1, 3, 5 and R = 3, so MAP@R = (1/1 + 2/3) / 3 = 5/9 and R-precision = 2/3.
    ang = np.deg2rad(np.arange(10, 70, 10))
    g = np.stack([np.cos(ang), np.sin(ang)], 1)
    m = retrieval_metrics([[1.0, 0.0]], ["A"], g, list("ABABAB"), ks=[1, 2, 3, 5, 6], nmi=False)
    assert m["map@r"] == pytest.approx(5 / 9)
    assert m["r_precision"] == pytest.approx(2 / 3)
    assert [m[f"recall@{k}"] for k in (1, 2, 3, 5, 6)] == [1.0] * 5
    # A tie broken by index: gallery 0 (B) and 1 (A) are the same vector, then A at 30°.
    # Ranking B, A, A: recall@1 = 0, recall@2 = 1, MAP@R = (0 + 1/2) / 2, R-precision = 1/2.
    g = np.array([[np.cos(0.2), np.sin(0.2)], [np.cos(0.2), np.sin(0.2)], [np.cos(0.5), np.sin(0.5)]])
    m = retrieval_metrics([[1.0, 0.0]], ["A"], g, ["B", "A", "A"], ks=[1, 2], nmi=False)
    assert (m["recall@1"], m["recall@2"], m["map@r"], m["r_precision"]) == (0.0, 1.0, 0.25, 0.5)
    # Swap the labels of the tied pair: ranking A, B, A; only rank 1 is within R = 2: MAP@R = 1/2.
    m = retrieval_metrics([[1.0, 0.0]], ["A"], g, ["A", "B", "A"], ks=[1, 2], nmi=False)
    assert (m["recall@1"], m["map@r"], m["r_precision"]) == (1.0, 0.5, 0.5)


def test_map_at_r_counts_only_top_r():
    # R = 2; relevant items at ranks 2 and 3: only rank 2 counts: MAP@R = (1/2)/2.
    g = np.array([[1.0, 0.1], [1.0, 0.2], [1.0, 0.3], [1.0, 0.4]])
    m = retrieval_metrics([[1.0, 0.0]], [1], g, [0, 1, 1, 0], ks=[1], nmi=False)
    assert m["map@r"] == pytest.approx(0.25) and m["r_precision"] == pytest.approx(0.5)


# -- search internals ------------------------------------------------------------------------
def test_knn_and_topk_follow_the_tie_rule():
    x, _ = DATASETS["signs"]
    S = dataset_scores("signs", False).copy()
    np.fill_diagonal(S, -np.inf)
    scores, ids = knn(x, k=25, block_bytes=3000)
    for i in range(len(x)):
        want = np.lexsort((np.arange(len(x)), -S[i]))[:25]
        assert np.array_equal(ids[i], want)
    # binary: distances ascending, then index
    d, ids = knn(x, k=30, binary=True)
    H = -dataset_scores("signs", True)
    np.fill_diagonal(H, np.inf)
    for i in range(len(x)):
        want = np.lexsort((np.arange(len(x)), H[i]))[:30]
        assert np.array_equal(ids[i], want) and np.array_equal(d[i], H[i, want])
    # the straddling-tie repair on a block with massive ties
    block = torch.tensor([[1, 0, 1, 1, 2, 1], [3, 3, 3, 3, 3, 3]], dtype=torch.int32)
    v, i = lexicographic_topk(block, 3, larger_is_better=True)
    assert i.tolist() == [[4, 0, 2], [0, 1, 2]] and v.tolist() == [[2, 1, 1], [3, 3, 3]]
    # query -> gallery on the duplicates set (exact ties between distinct gallery rows)
    xd, yd = DATASETS["duplicates"]
    qi, gi = split_query_gallery(yd, np.random.default_rng(5))
    S = dataset_scores("duplicates", False)[np.ix_(qi, gi)]
    _, ids = knn(torch.from_numpy(xd[qi]), xd[gi], k=12)
    for i in range(len(qi)):
        assert np.array_equal(ids[i], np.lexsort((np.arange(len(gi)), -S[i]))[:12])
    with pytest.raises(ValueError, match="k=40"):
        knn(x[:20], x[:30], k=40)


def test_unique_rows_folds_bit_identical_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 200)).astype(np.float32)
    x[10] = x[3]
    x[20] = x[3]
    x[30, :] = x[31, :]
    x[31, 1] += 1.0  # agrees with row 30 on all but a column the fingerprint does not sample
    first, inv = unique_rows(x)
    assert np.array_equal(x[first][inv], x)
    assert len(first) == 48 and inv[10] == inv[20] == inv[3] and inv[30] != inv[31]


def _ref_pair_ranks(S, rows, cols, larger):
    out = []
    for r, c in zip(rows, cols):
        keys = -S[r] if larger else S[r]
        order = np.lexsort((np.arange(len(keys)), keys))
        out.append(int(np.flatnonzero(order == c)[0]) + 1)
    return np.array(out)


@pytest.mark.parametrize("engine", ["native", "numpy", "torch", "sort"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.int32])
def test_pair_ranks_engines(engine, dtype):
    from dmltrain.evaluate import ranks as ranks_mod

    if engine == "native" and native.library() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(0)
    n_rows, n_cols = 9, 300
    if dtype == torch.float32:  # few distinct values: ties everywhere; plus -0.0/0.0 and -inf
        S = rng.integers(-3, 4, (n_rows, n_cols)).astype(np.float32) / 4
        S[S == 0] = np.where(rng.random((S == 0).sum()) < 0.5, -0.0, 0.0)
        S[np.arange(n_rows), np.arange(n_rows)] = -np.inf
    else:
        S = rng.integers(0, 6, (n_rows, n_cols)).astype(np.int32)
    pairs = [(r, c) for r in range(n_rows) for c in sorted(rng.choice(n_cols, 1 + r * 7, replace=False))]
    if engine == "sort":  # force the sort path with many pairs per row
        pairs = [(r, c) for r in range(n_rows) for c in range(0, n_cols, 2)]
    rows, cols = map(np.array, zip(*pairs))
    block = torch.from_numpy(S).to(dtype) if dtype != torch.float32 else torch.from_numpy(S)
    for larger in (True, False):
        if dtype == torch.float32 and not larger:
            continue  # -inf masks are for similarities
        want = _ref_pair_ranks(S.astype(np.float64), rows, cols, larger)
        if engine == "sort":
            got = ranks_mod._ranks_by_sort(block, rows, cols, larger)
        else:
            got = ranks_mod.pair_ranks(block, rows, cols, larger, engine=engine)
        assert np.array_equal(got, want), (engine, dtype, larger)
    with pytest.raises(ValueError, match="grouped"):
        ranks_mod.pair_ranks(block, rows[::-1], cols[::-1], True)


@pytest.mark.parametrize("engine", ["native", "faiss"])
def test_hamming_engines_exact(engine):
    if engine == "native" and native.library() is None:
        pytest.skip("no C compiler: the faiss engine is used")
    rng = np.random.default_rng(0)
    for nbytes in (1, 3, 32, 40, 1000):  # unaligned, one chunk, several, over the 31-chunk fold
        q = rng.integers(0, 256, (5, nbytes), dtype=np.uint8)
        g = rng.integers(0, 256, (11, nbytes), dtype=np.uint8)
        got = hamming_mod.hamming_block(hamming_mod.pad_codes(q), hamming_mod.pad_codes(g), threads=2, engine=engine)
        assert np.array_equal(got, hamming_distances(q, g))


# -- NMI -------------------------------------------------------------------------------------
def test_nmi_score_matches_formula():
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    clusters = np.array([0, 0, 1, 1, 2, 2, 2, 0])

    def entropy(a):
        p = np.bincount(a) / len(a)
        return -sum(x * math.log(x) for x in p if x > 0)

    mi = 0.0
    n = len(labels)
    for a in np.unique(labels):
        for b in np.unique(clusters):
            nab = np.sum((labels == a) & (clusters == b))
            if nab:
                mi += nab / n * math.log(n * nab / (np.sum(labels == a) * np.sum(clusters == b)))
    want = mi / ((entropy(labels) + entropy(clusters)) / 2)
    assert nmi_score(labels, clusters) == pytest.approx(want)


def test_clustering_nmi_on_a_fixed_clustering():
    from sklearn.cluster import KMeans
    from sklearn.metrics import normalized_mutual_info_score

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((6, 16)) * 10
    y = np.repeat(np.arange(6), 20)
    x = (centers[y] + rng.standard_normal((120, 16)) * 0.05).astype(np.float32)
    assert clustering_nmi(x, y) == pytest.approx(1.0)
    # Overlapping classes: the clustering is still fixed (well-separated blobs), and equals sklearn's k-means one.
    y2 = np.where(np.arange(120) % 7 == 0, (y + 1) % 6, y)
    ours = nmi_score(y2, kmeans_assignments(x / np.linalg.norm(x, axis=1, keepdims=True), 6, seed=3))
    xs = x / np.linalg.norm(x, axis=1, keepdims=True)
    theirs = normalized_mutual_info_score(y2, KMeans(6, n_init=5, random_state=0).fit_predict(xs))
    assert ours == pytest.approx(theirs) and ours < 1.0
    m = retrieval_metrics(x, y2, ks=[1], seed=3)
    assert m["nmi"] == pytest.approx(ours)
    assert retrieval_metrics(x, y2, ks=[1], seed=3)["nmi"] == m["nmi"]  # seeded: reproducible


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, y: retrieval_metrics(x, y[:-1]), "9 labels for 10 embeddings"),
        (lambda x, y: retrieval_metrics(np.where(np.arange(10)[:, None] == 4, np.nan, x), y), "NaN or inf.*row 4"),
        (lambda x, y: retrieval_metrics(np.where(np.arange(10)[:, None] == 2, np.inf, x), y), "NaN or inf"),
        (lambda x, y: retrieval_metrics(x, y, x[:, :3], y), "dim 3 differs"),
        (lambda x, y: retrieval_metrics(x, y, x), "together"),
        (lambda x, y: retrieval_metrics(x[:0], y[:0]), "empty"),
        (lambda x, y: retrieval_metrics(x[:, 0], y), "2-D"),
        (lambda x, y: retrieval_metrics(x, np.arange(10)), "nothing to evaluate"),
        (lambda x, y: retrieval_metrics(x, y, x, y + 100), "nothing to evaluate"),
        (lambda x, y: retrieval_metrics(x, y, ks=[0, 1]), "positive integers"),
        (lambda x, y: retrieval_metrics(x, y, ks=[]), "positive integers"),
    ],
)
def test_bad_input_is_one_line_value_error(call, match):
    x = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    y = np.arange(10) % 3
    with pytest.raises(ValueError, match=match) as info:
        call(x, y)
    assert "\n" not in str(info.value)


def test_k_beyond_the_gallery_warns_and_is_one():
    x = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    y = np.arange(10) % 3
    with pytest.warns(RuntimeWarning, match="K > 9"):
        m = retrieval_metrics(x, y, ks=[1, 9, 50], nmi=False, binary=True)
    assert m["recall@9"] == m["recall@50"] == m["binary/recall@50"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        retrieval_metrics(x, y, ks=[9], nmi=False)


def test_accepts_tensors_and_low_precision():
    x, y = DATASETS["continuous"]
    want = retrieval_metrics(x, y, ks=[1, 5], nmi=False)
    got = retrieval_metrics(torch.from_numpy(x).double(), torch.from_numpy(y), ks=[5, 1, 1], nmi=False)
    assert got == want
    assert set(want) == {
        "recall@1",
        "recall@5",
        "map@r",
        "r_precision",
        "num_queries",
        "excluded_queries",
        "gallery_size",
    }


def test_knn_and_retrieval_import_at_module_top_without_a_circle():
    """knn.py and gallery.py must not reach back into retrieval.py (what they need lives in inputs.py and
    gallery.py), and none of these files hides an import inside a function (where a circle would only show
    at run time)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "dmltrain" / "evaluate"
    imported = {}
    for name in ("knn", "gallery", "retrieval", "inputs"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        top = {id(n) for n in tree.body}
        nested = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top]
        assert not nested, f"{name}.py imports inside functions at lines {nested}"
        imported[name] = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert "dmltrain.evaluate.retrieval" not in imported["knn"] | imported["inputs"] | imported["gallery"]
    assert "dmltrain.evaluate.knn" not in imported["gallery"]
    assert "dmltrain.evaluate.gallery" in imported["retrieval"] & imported["knn"]
