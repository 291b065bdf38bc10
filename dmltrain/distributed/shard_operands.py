"""One shard's operands of a classifier call, as both softmax backends take them.

A module of its own so that the backends (:mod:`~dmltrain.distributed.softmax_torch`,
:mod:`~dmltrain.distributed.softmax_kernels`) and the classifier that calls them
(:mod:`~dmltrain.distributed.sharded_softmax`) all import it, and none imports another for it.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class ShardOperands(NamedTuple):
    """One shard's part of a call, as both backends take it.

    ``x``: the gathered batch (``N × D``, compute dtype, unit rows for the normalised kinds);
    ``weight``/``bias``: the shard's rows; ``rows``/``count``: the active rows (None: all; see
    :class:`~dmltrain.distributed.class_sampling.ActiveRows`); ``tcol``: each sample's column among
    the active rows (int64, −1 when this shard does not hold its class); ``scale``: the logit scale
    of the normalised kinds. The torch backend alone takes the rest: ``subcenters`` (the weight is
    then ``rows × k × D``), ``offsets`` (each active column's log-Q correction) and ``sample_weight``
    (each sample's weight in the loss, for dropped samples).
    """

    x: Tensor
    weight: Tensor
    bias: Tensor | None
    rows: Tensor | None
    count: Tensor | None
    tcol: Tensor
    scale: float
    normalized: bool
    subcenters: int = 1
    offsets: Tensor | None = None
    sample_weight: Tensor | None = None
