"""Retrieval evaluation: Recall@K, MAP@R, R-precision and NMI on float and binary embeddings.

    from dmltrain.evaluate import retrieval_metrics, embed_batches, gather_to_rank0, evaluate_model
    metrics = retrieval_metrics(emb, labels, ks=(1, 2, 4, 8), binary=True)

Modules: :mod:`.retrieval` (the metrics and their definitions), :mod:`.gallery` (float and
binary galleries on a device: duplicate folding, score blocks, the binary engines),
:mod:`.knn` (the tie rule, neighbour lists), :mod:`.ranks` (exact ranks of relevant items,
the primitive behind every metric), :mod:`.hamming` (binary score blocks on the CPU),
:mod:`.native` (the C kernels of the CPU, built on first use), :mod:`.gpu_kernels` (the
Triton kernels of the GPU: rank counting, popcount), :mod:`.inputs` (checks of embeddings
and labels), :mod:`.clustering` (k-means NMI) and :mod:`.kmeans` (k-means in torch),
:mod:`.embedding` (embedding a model's batches, gathering to rank 0, evaluating a model on
shards), :mod:`.rerank` (query expansion and k-reciprocal re-ranking of each query's top
candidates), :mod:`.store` (saved embeddings), :mod:`.plots` (Recall@K curves, 2-D maps),
:mod:`.cli` (``dmltrain eval``), :mod:`.bench` (``dmltrain bench eval``); for serving,
:mod:`.sources` (shards, tables and folders of images), :mod:`.embedding_set` (``dmltrain embed``'s
output, written chunk by chunk), :mod:`.embed_cli` (``dmltrain embed``), :mod:`.index` (faiss
indexes and their recall against the exact search) and :mod:`.index_cli` (``dmltrain index``).

Names are imported on first use, so ``dmltrain eval --help`` stays fast.
"""

from __future__ import annotations

from dmltrain.lazy_exports import lazy_exports

_EXPORTS = {
    "retrieval_metrics": "retrieval",
    "pair_ranks": "ranks",
    "knn": "knn",
    "lexicographic_topk": "knn",
    "hamming_block": "hamming",
    "clustering_nmi": "clustering",
    "kmeans_assignments": "clustering",
    "nmi_score": "clustering",
    "embed_batches": "embedding",
    "gather_to_rank0": "embedding",
    "evaluate_model": "embedding",
    "save_embeddings": "store",
    "load_embeddings": "store",
    "plot_recall_at_k": "plots",
    "plot_embedding_map": "plots",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
