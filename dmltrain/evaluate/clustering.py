"""NMI of a k-means clustering of the embeddings against the class labels.

k-means on L2-normalized embeddings, with k = number of distinct labels, seeded, every point
used for training (no subsampling, so the result does not depend on a sample). The score is
scikit-learn's ``normalized_mutual_info_score`` (arithmetic normalization), as in
pytorch-metric-learning. Engines (:func:`kmeans_engine`): faiss's k-means on the CPU, and on a
GPU when the faiss GPU build (the ``gpu`` extra) sees one; otherwise, on a CUDA device, the
torch k-means of :mod:`.kmeans` (same algorithm and seeding rule; the NMI agrees within the
noise of k-means itself, checked against faiss's in the tests).

Seeding: k-means++ where it is affordable (``n·k·d <= KMEANS_PP_BUDGET``: CUB, Cars, most
validation sets), faiss's uniform random seeding otherwise. faiss's k-means++ is sequential
in k; on SOP (k = 11,316) it would cost ~10× the 20 Lloyd iterations, and with thousands of
small classes random seeding is what pytorch-metric-learning uses too.
"""

from __future__ import annotations

import numpy as np
import torch

from dmltrain.evaluate.kmeans import torch_kmeans

KMEANS_PP_BUDGET = 2e9


def faiss_gpu_available() -> bool:
    import faiss

    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def kmeans_engine(device: str | torch.device = "cpu") -> str:
    """``faiss`` (CPU, or faiss's GPU build on a CUDA device) or ``torch`` (a CUDA device without it)."""
    if torch.device(device).type == "cuda" and not faiss_gpu_available():
        return "torch"
    return "faiss"


def kmeans_assignments(
    x: np.ndarray,
    k: int,
    *,
    seed: int = 0,
    niter: int = 20,
    init: str = "auto",
    threads: int | None = None,
    device: str | torch.device = "cpu",
    engine: str | None = None,
) -> np.ndarray:
    """Cluster index (int64) of every row of ``x`` after ``niter`` k-means iterations.

    ``k`` must be between 1 and ``len(x)``. ``init``: ``kmeans++``, ``random`` or ``auto``
    (see the module doc). ``threads`` (faiss on the CPU) defaults to ``torch.get_num_threads()``.
    ``engine``: ``faiss`` or ``torch`` (default :func:`kmeans_engine` of ``device``).
    """
    import faiss

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: k={k} must be between 1 and the {n} points")
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    if threads is None:
        threads = torch.get_num_threads()
    if init == "auto":
        init = "kmeans++" if float(n) * k * d <= KMEANS_PP_BUDGET else "random"
    methods = {"kmeans++": faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS, "random": faiss.ClusteringInitMethod_RANDOM}
    if init not in methods:
        raise ValueError(f"kmeans: init must be auto, kmeans++ or random, got '{init}'")
    engine = engine or kmeans_engine(device)
    if engine == "torch":
        dev = torch.device(device)
        return torch_kmeans(torch.from_numpy(x).to(dev), k, seed=seed, niter=niter, init=init).cpu().numpy()
    if engine != "faiss":
        raise ValueError(f"kmeans: engine must be faiss or torch, got '{engine}'")
    use_gpu = faiss_gpu_available()
    previous = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(max(1, int(threads)))
    try:
        km = faiss.Kmeans(
            d,
            k,
            niter=niter,
            seed=seed,
            verbose=False,
            gpu=use_gpu,
            min_points_per_centroid=1,  # few points per class is the norm here (SOP: ~5); no warning
            max_points_per_centroid=n,  # train on every point
            init_method=methods[init],
        )
        km.train(x)
        _, assign = km.index.search(x, 1)
    finally:
        faiss.omp_set_num_threads(previous)
    return assign[:, 0].astype(np.int64)


def nmi_score(labels: np.ndarray, assignments: np.ndarray) -> float:
    """scikit-learn's normalized mutual information of two labelings (arithmetic mean normalization)."""
    # imported here: scikit-learn is about a second of every training worker's start-up, needed only with eval.nmi
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(np.asarray(labels), np.asarray(assignments)))


def clustering_nmi(
    emb: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int = 0,
    niter: int = 20,
    device: str | torch.device = "cpu",
    engine: str | None = None,
) -> float:
    """NMI of k-means (k = distinct labels) on the L2-normalized ``emb`` against ``labels``;
    ``device`` and ``engine`` as in :func:`kmeans_assignments`."""
    x = np.asarray(emb, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.maximum(norms, 1e-12)
    k = len(np.unique(labels))
    return nmi_score(labels, kmeans_assignments(x, k, seed=seed, niter=niter, device=device, engine=engine))
