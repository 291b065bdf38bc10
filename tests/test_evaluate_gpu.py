"""The GPU paths of the evaluation, run on the CPU against the brute-force references of test_evaluate.

* ``mma`` binary engine (±1 int8 GEMM, ``torch._int_mm`` runs on the CPU too): the same
  metrics and neighbour lists as the Hamming reference, ties included.
* Triton kernels (rank counting, popcount Hamming) under ``TRITON_INTERPRET=1``: the variable
  only takes effect for kernels defined after it is set, so they run in a spawned process.
* Duplicate folding on a device (torch) against the NumPy folding.
* torch k-means: Lloyd's iterations against a NumPy transcription from the same start, and
  NMI against faiss's k-means on the same data (within the spread of faiss's own seeds).
* Embedding with ``channels_last``: the model sees channels_last input, the embeddings are equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from multiproc import run_workers
from test_evaluate import DATASETS, KS, assert_same, dataset_scores, ref_metrics, split_query_gallery

from dmltrain.evaluate import gallery as gallery_mod
from dmltrain.evaluate.clustering import clustering_nmi, kmeans_assignments, nmi_score
from dmltrain.evaluate.embedding import embed_batches
from dmltrain.evaluate.kmeans import torch_kmeans
from dmltrain.evaluate.knn import knn
from dmltrain.evaluate.retrieval import retrieval_metrics


# -- binary: the int8 tensor-core engine ------------------------------------------------------
@pytest.mark.parametrize("name", ["signs", "duplicates"])
def test_mma_binary_engine_matches_reference(name, monkeypatch):
    monkeypatch.setenv("DMLTRAIN_HAMMING", "mma")
    x, y = DATASETS[name]
    assert gallery_mod.binary_gallery(x, torch.device("cpu")).engine == "mma"
    want, _, _ = ref_metrics(x, y, None, None, KS, True, dataset_scores(name, True))
    for block_bytes in (1 << 28, 3000):  # one block; blocks of 16 rows or fewer (the padded int8 GEMM)
        assert_same(retrieval_metrics(x, y, ks=KS, nmi=False, binary=True, block_bytes=block_bytes, device="cpu"), want)
    qi, gi = split_query_gallery(y, np.random.default_rng(3))
    S = dataset_scores(name, True)[np.ix_(qi, gi)]
    want, _, _ = ref_metrics(x[qi], y[qi], x[gi], y[gi], KS, True, S)
    assert_same(retrieval_metrics(x[qi], y[qi], x[gi], y[gi], ks=KS, nmi=False, binary=True, device="cpu"), want)
    # neighbour lists: distances ascending, then index, and the distances themselves
    d, ids = knn(x, k=20, binary=True, device="cpu", block_bytes=5000)
    H = -dataset_scores(name, True)
    np.fill_diagonal(H, np.inf)
    for i in range(len(x)):
        order = np.lexsort((np.arange(len(x)), H[i]))[:20]
        assert np.array_equal(ids[i], order) and np.array_equal(d[i], H[i, order])


def test_unknown_hamming_engine_is_refused(monkeypatch):
    monkeypatch.setenv("DMLTRAIN_HAMMING", "bogus")
    with pytest.raises(ValueError, match="DMLTRAIN_HAMMING"):
        gallery_mod.hamming_engine(torch.device("cpu"))


@pytest.mark.parametrize("name", ["continuous", "signs"])
def test_recall_only_ranks_the_best_pair_per_query(name):
    """Without MAP@R only each query's best relevant item is ranked: the same Recall@K."""
    x, y = DATASETS[name]
    for binary in (False, True):
        want, _, _ = ref_metrics(x, y, None, None, KS, binary, dataset_scores(name, binary))
        got = retrieval_metrics(x, y, ks=KS, nmi=False, map_at_r=False, binary=binary, device="cpu", block_bytes=5000)
        assert_same(got, {k: v for k, v in want.items() if "recall@" in k})
        assert not any("map@r" in k for k in got)


# -- duplicate folding on a device -------------------------------------------------------------
def test_torch_folding_equals_numpy_folding():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 70)).astype(np.float32)
    x[10] = x[20] = x[3]
    x[40, :] = x[41, :]
    x[41, 1] += 1.0  # differs from row 40 in one column only
    x[50] = -0.0
    x[51] = 0.0  # bit-different from -0.0: not folded
    x[60] = x[61] = x[62] = 0.0  # the same as row 51
    for arr in (x[:0], x):
        f_np, i_np = gallery_mod.unique_rows(arr)
        f_t, i_t = gallery_mod.unique_rows(torch.from_numpy(arr))
        assert np.array_equal(f_np, f_t.numpy()) and np.array_equal(i_np, i_t.numpy())
    assert len(f_np) == 295 and np.array_equal(x[f_np][i_np], x)
    a = gallery_mod.float_gallery(x, torch.device("cpu"))
    b_first, _ = gallery_mod.fold_rows(torch.from_numpy(x), with_numpy=False)
    assert a.data.shape[0] == len(b_first) == 295


# -- the Triton kernels, interpreted ------------------------------------------------------------
def _ref_ranks(S, rows, cols, larger):
    out = []
    for r, c in zip(rows, cols):
        order = np.lexsort((np.arange(S.shape[1]), -S[r] if larger else S[r]))
        out.append(int(np.flatnonzero(order == c)[0]) + 1)
    return np.array(out)


def _interpreted_kernels(rank, world):
    """Runs with TRITON_INTERPRET=1: kernel-level checks, then whole metrics with both kernels forced."""
    import os

    from dmltrain.evaluate import gpu_kernels
    from dmltrain.evaluate import ranks as ranks_mod
    from dmltrain.models.binary import hamming_distances

    assert gpu_kernels.INTERPRET
    rng = np.random.default_rng(0)
    report = {"ranks": [], "hamming": []}
    S = rng.integers(-3, 4, (7, 150)).astype(np.float32) / 4
    S[np.arange(7), np.arange(7)] = -np.inf
    # row 6 holds 40 pairs: two passes of 32 over its row
    pairs = [(r, c) for r in range(7) for c in sorted(rng.choice(150, 40 if r == 6 else 1 + 3 * r, replace=False))]
    rows, cols = map(np.array, zip(*pairs))
    for dtype, larger in ((torch.float32, True), (torch.int32, True), (torch.int32, False), (torch.int16, False)):
        block = (
            torch.from_numpy(S)
            if dtype == torch.float32
            else torch.from_numpy(np.nan_to_num(S * 4, neginf=-9)).to(dtype)
        )
        got = ranks_mod.pair_ranks(block, rows, cols, larger, engine="triton")
        report["ranks"].append(bool(np.array_equal(got, _ref_ranks(block.double().numpy(), rows, cols, larger))))
    for nbytes in (4, 36, 260):
        q = rng.integers(0, 256, (19, nbytes), dtype=np.uint8)
        g = rng.integers(0, 256, (35, nbytes), dtype=np.uint8)
        words = [torch.from_numpy(a.view(np.int32).T.copy()) for a in (q, g)]
        report["hamming"].append(
            bool(np.array_equal(gpu_kernels.hamming_block(*words).numpy(), hamming_distances(q, g)))
        )
    # whole metrics: every block's ranks from the kernel, binary scores from the popcount kernel
    ranks_mod.engine_for = lambda block, engine=None: engine or "triton"
    os.environ["DMLTRAIN_HAMMING"] = "popcount"
    report["metrics"] = {}
    for name in ("duplicates", "signs"):
        x, y = DATASETS[name]
        x, y = x[:60], y[:60]
        report["metrics"][name] = retrieval_metrics(x, y, ks=KS, nmi=False, binary=True, device="cpu", block_bytes=8000)
    return report


@pytest.fixture(scope="module")
def interpreted():
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    try:
        return run_workers(_interpreted_kernels, 1, timeout=600)[0]
    finally:
        mp.undo()


def test_triton_rank_kernel_matches_reference(interpreted):
    assert interpreted["ranks"] == [True] * 4


def test_triton_popcount_kernel_matches_reference(interpreted):
    assert interpreted["hamming"] == [True] * 3


@pytest.mark.parametrize("name", ["duplicates", "signs"])
def test_metrics_through_the_kernels_match_reference(interpreted, name):
    x, y = DATASETS[name]
    x, y = x[:60], y[:60]
    want = {}
    for binary in (False, True):
        want.update(ref_metrics(x, y, None, None, KS, binary, dataset_scores(name, binary)[:60, :60])[0])
    assert_same(interpreted["metrics"][name], want)


# -- k-means -----------------------------------------------------------------------------------
def _lloyd_reference(x: np.ndarray, centroids: np.ndarray, niter: int) -> np.ndarray:
    """Lloyd's algorithm point by point in float64 (no empty clusters on this data)."""
    c = centroids.astype(np.float64)
    for _ in range(niter + 1):
        assign = np.array([int(np.argmin([((p - cc) ** 2).sum() for cc in c])) for p in x.astype(np.float64)])
        if _ == niter:
            return assign
        c = np.stack([x[assign == j].mean(0) if (assign == j).any() else c[j] for j in range(len(c))])


def _blobs(seed, k=12, per=25, d=16, spread=0.35):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((k, d)) * 2
    y = np.repeat(np.arange(k), per)
    x = (centers[y] + rng.standard_normal((len(y), d)) * spread).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), y


def test_torch_kmeans_follows_lloyd():
    x, _ = _blobs(0)
    start = x[np.random.default_rng(1).choice(len(x), 12, replace=False)]
    got = torch_kmeans(torch.from_numpy(x), 12, niter=5, centroids=torch.from_numpy(start), block_bytes=4096)
    assert np.array_equal(got.numpy(), _lloyd_reference(x, start, 5))


@pytest.mark.cuda
def test_torch_kmeans_on_cuda_follows_lloyd():
    x, _ = _blobs(0)
    start = x[np.random.default_rng(1).choice(len(x), 12, replace=False)]
    xc, sc = torch.from_numpy(x).cuda(), torch.from_numpy(start).cuda()
    got = torch_kmeans(xc, 12, niter=5, centroids=sc, block_bytes=4096)
    assert got.device.type == "cuda" and np.array_equal(got.cpu().numpy(), _lloyd_reference(x, start, 5))


def test_torch_kmeans_moves_empty_centroids_to_the_worst_served_point():
    x, y = _blobs(2, k=4, per=30)
    start = np.stack([x[0], x[1], x[2], np.full(x.shape[1], 50.0, np.float32)])  # three in one blob, one far away
    got = torch_kmeans(torch.from_numpy(x), 4, niter=15, centroids=torch.from_numpy(start)).numpy()
    assert len(np.unique(got)) == 4  # nothing stays empty
    assert nmi_score(y, got) > 0.9


@pytest.mark.parametrize("init", ["random", "kmeans++"])
def test_torch_kmeans_nmi_agrees_with_faiss(init):
    x, y = _blobs(3, k=20, per=15, d=24, spread=0.6)  # overlapping classes: the NMI is not trivially 1
    faiss_nmi = [nmi_score(y, kmeans_assignments(x, 20, seed=s, init=init, engine="faiss")) for s in range(4)]
    torch_nmi = [nmi_score(y, kmeans_assignments(x, 20, seed=s, init=init, engine="torch")) for s in range(4)]
    assert max(faiss_nmi) < 0.999
    noise = max(faiss_nmi) - min(faiss_nmi) + 0.02
    assert abs(np.mean(torch_nmi) - np.mean(faiss_nmi)) <= noise
    # seeded: reproducible on the CPU
    assert clustering_nmi(x, y, seed=5, engine="torch") == clustering_nmi(x, y, seed=5, engine="torch")


# -- embedding ---------------------------------------------------------------------------------
class _LayoutProbe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.seen_channels_last: list[bool] = []

    def forward(self, x):
        self.seen_channels_last.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return self.conv(x).mean((2, 3))


def test_embedding_in_channels_last():
    torch.manual_seed(0)
    model = _LayoutProbe()
    batches = [(torch.randn(4, 3, 9, 9), torch.arange(4), torch.arange(4) + 4 * i) for i in range(3)]
    plain, labels, index = embed_batches(model, batches, progress=False)
    assert model.seen_channels_last == [False] * 3
    model.seen_channels_last.clear()
    cl, labels2, index2 = embed_batches(
        model.to(memory_format=torch.channels_last), batches, channels_last=True, progress=False
    )
    assert model.seen_channels_last == [True] * 3
    assert np.allclose(plain, cl, atol=1e-6) and np.array_equal(labels, labels2) and np.array_equal(index, index2)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["duplicates", "signs"])
@pytest.mark.parametrize("hamming", ["mma", "popcount"])
def test_metrics_on_cuda_match_reference(name, hamming, monkeypatch):
    """The whole evaluation on a GPU, compiled: score blocks, the Triton rank kernel, both binary engines."""
    monkeypatch.setenv("DMLTRAIN_HAMMING", hamming)
    x, y = DATASETS[name]
    want = {}
    for binary in (False, True):
        want.update(ref_metrics(x, y, None, None, KS, binary, dataset_scores(name, binary))[0])
    for block_bytes in (1 << 28, 5000):
        got = retrieval_metrics(x, y, ks=KS, nmi=False, binary=True, device="cuda", block_bytes=block_bytes)
        assert_same(got, want)
