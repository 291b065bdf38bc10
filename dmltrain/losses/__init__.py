"""The loss library of the four papers: proxy losses and instance (pair) losses.

``build_loss(name, **params)`` (or :func:`make_loss` from a config part); the names:

* proxy losses (own ``weight``: ``num_classes × dim``): ``normsoftmax``, ``cosface``,
  ``arcface``, ``softmax_ce`` (the four classifier kinds, :class:`ClassifierLoss`; each
  described once in :data:`KINDS`, :mod:`~dmltrain.losses.kinds`, with its margin and
  label-smoothing maths in :mod:`~dmltrain.losses.margins`, shared with the class-sharded
  classifier), ``proxy_nca``, ``center``;
* instance losses (:class:`InstanceLoss`, decomposed over anchors for the distributed
  layer): ``ice``, ``ranked_list``, ``spce``, ``contrastive``, ``triplet``,
  ``multi_similarity``, ``snca``, ``lifted_structure``, ``npair``.

Every loss is called as ``loss(embeddings, labels) -> scalar`` and leaves that call's
statistics in ``loss.stats`` (plain floats): ``pos_sim`` / ``neg_sim`` (mean cosine of
positive / negative pairs, or to the own / other class weights), ``active_pairs`` (pairs
that still carry gradient: mined or non-zero-loss pairs), ``nontrivial_fraction`` (their
share, by the loss's own unit: pairs, triplets or anchors), ``skipped_anchors`` (anchors
without a positive), and loss-specific ones (``tightness`` / ``contrastive`` parts after
the CE paper's Table 2, ICE's plain ``nll``, RLL's ``pos_loss`` / ``neg_loss``, ...).

Embeddings may come in any float dtype; losses that need unit vectors normalise inside,
and all arithmetic after the similarity GEMM is float32 (also under bf16 autocast).
"""

from dmltrain.losses import (  # noqa: F401  (each import registers its loss)
    arcface,
    center,
    contrastive,
    cosface,
    ice,
    lifted_structure,
    multi_similarity,
    normsoftmax,
    npair,
    proxy_nca,
    ranked_list,
    snca,
    softmax_ce,
    spce,
    triplet,
)
from dmltrain.losses.base import AnchorTerms, BaseLoss, InstanceLoss, ProxyLoss
from dmltrain.losses.classifier import ClassifierLoss
from dmltrain.losses.factory import is_proxy_loss, make_loss
from dmltrain.losses.kinds import CLASSIFIER_KINDS, KINDS, ClassifierKind
from dmltrain.losses.margins import smoothed_nll
from dmltrain.losses.registry import build_loss, check_params, loss_names, register

__all__ = [
    "CLASSIFIER_KINDS",
    "KINDS",
    "AnchorTerms",
    "BaseLoss",
    "ClassifierKind",
    "ClassifierLoss",
    "InstanceLoss",
    "ProxyLoss",
    "build_loss",
    "check_params",
    "is_proxy_loss",
    "loss_names",
    "make_loss",
    "register",
    "smoothed_nll",
]
