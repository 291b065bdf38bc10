"""The class-sharded classifier as one component: its rows, their optimizer, their checkpoint.

:class:`ClassifierHead` composes a :class:`~dmltrain.distributed.sharded_softmax.ShardedClassifier`
and the row-sparse optimizer built over the classifier's
:class:`~dmltrain.distributed.row_sparse.RowGrads` (the optimizer reads which rows hold a gradient
from that object, never from the classifier), and saves and loads both by global class id
(:mod:`~dmltrain.distributed.class_checkpoint`), so a run resumes at any world size. Its
optimizer's stochastic rounding of a bf16 weight draws from
:func:`~dmltrain.distributed.class_sampling.rounding_seed` and the step of the classifier's last call,
apart from the class draws, so a resumed run rounds as an uninterrupted one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from dmltrain.distributed.class_checkpoint import load_by_class, save_by_class
from dmltrain.distributed.class_sampling import rounding_seed
from dmltrain.distributed.row_sparse import RowSparseOptimizer, make_row_optimizer
from dmltrain.distributed.sharded_softmax import ShardedClassifier


def make_classifier_optimizer(clf: ShardedClassifier, name: str = "sgd", **kwargs: Any) -> RowSparseOptimizer:
    """The row-sparse optimizer of ``clf``'s weight (and bias), stepping the rows its ``row_grads`` hold
    (keyword arguments: :func:`~dmltrain.distributed.row_sparse.make_row_optimizer`'s)."""
    return make_row_optimizer(clf.weight, clf.bias, clf.row_grads, name, **kwargs)


class ClassifierHead:
    """A classifier shard and its optimizer: call it, ``set_lr``, ``step``, ``save``/``load`` by class id.

    ``optimizer`` (``sgd`` or ``adamw``) and its hyperparameters are
    :func:`~dmltrain.distributed.row_sparse.make_row_optimizer`'s; ``bias_weight_decay`` applies to
    ``softmax_ce``'s bias.
    """

    def __init__(
        self,
        classifier: ShardedClassifier,
        optimizer: str = "sgd",
        lr: float = 0.01,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        bias_weight_decay: float | None = None,
    ) -> None:
        self.classifier = classifier
        self.optimizer = make_classifier_optimizer(
            classifier,
            optimizer,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            betas=betas,
            bias_weight_decay=bias_weight_decay,
            seed=rounding_seed(classifier.seed, classifier.rank),  # one stream per shard
        )

    def __call__(self, embeddings: Tensor, labels: Tensor, step: int, sizes: Sequence[int] | None = None) -> Tensor:
        return self.classifier(embeddings, labels, step=step, sizes=sizes)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self) -> None:
        """Step the rows holding a gradient (the rounding of a bf16 weight keyed by the classifier's last step),
        then clear the gradients."""
        self.optimizer.step(rounding_step=self.classifier.last_step)
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Every worker's rows and their optimizer state, by class id (collective)."""
        save_by_class(self.classifier, directory, self.optimizer)

    def load(self, directory: str | os.PathLike[str]) -> None:
        """This worker's rows and their optimizer state from a :meth:`save` at any world size."""
        load_by_class(self.classifier, directory, self.optimizer)

    def memory_bytes(self) -> int:
        """The shard held by this rank: its rows plus their optimizer state and per-class state (the nearness
        index of hard-class sampling, the sub-center counts)."""
        tensors = list(self.classifier.parameters())
        tensors += [v for st in self.optimizer.state.values() for v in st.values() if hasattr(v, "element_size")]
        tensors += list(self.classifier.class_state()[0].values())
        return sum(t.numel() * t.element_size() for t in tensors)
