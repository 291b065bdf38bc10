"""The distributed core: a class-sharded softmax classifier with class subsampling (torch
block GEMMs on the CPU, fused Triton kernels on CUDA, the class draw on the device), its row-sparse
gradients and optimizers,
W-independent checkpoints by class id, and instance losses over the all-gathered global batch.

Names are imported lazily so that ``dmltrain bench --help`` does not load torch.
"""

from __future__ import annotations

from dmltrain.lazy_exports import lazy_exports

_EXPORTS = {
    "ShardedClassifier": "sharded_softmax",
    "GatheredInstanceLoss": "gathered_loss",
    "gather_with_grad": "collectives",
    "all_gather_uneven": "collectives",
    "grad_scale": "collectives",
    "group_rank_size": "collectives",
    "ClassPartition": "class_partition",
    "draw_active": "class_sampling",
    "RowGrads": "row_sparse",
    "RowSparseSGD": "row_sparse",
    "RowSparseAdamW": "row_sparse",
    "make_row_optimizer": "row_sparse",
    "ClassifierHead": "classifier_head",
    "make_classifier_optimizer": "classifier_head",
    "save_by_class": "class_checkpoint",
    "load_by_class": "class_checkpoint",
    "gather_state": "class_checkpoint",
    "local_state": "class_checkpoint",
    "load_state": "class_checkpoint",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
