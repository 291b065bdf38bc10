"""Build a loss from a config part (``loss.classifier`` / ``loss.instance``).

:func:`build_loss` needs ``num_classes`` and ``dim`` exactly for proxy losses; this helper
supplies them when the loss owns class weights and leaves them out otherwise, so callers
need not know which kind a name is.
"""

from __future__ import annotations

from typing import Any

from dmltrain.losses.base import BaseLoss, ProxyLoss
from dmltrain.losses.registry import build_loss, loss_class


def is_proxy_loss(kind: str) -> bool:
    """Whether the loss registered as ``kind`` owns a ``num_classes × dim`` weight."""
    return issubclass(loss_class(kind), ProxyLoss)


def make_loss(
    kind: str, params: dict[str, Any] | None = None, *, num_classes: int | None = None, dim: int | None = None
) -> BaseLoss:
    """``build_loss(kind, **params)``, adding ``num_classes`` and ``dim`` for proxy losses.

    Raises ``ValueError`` when a proxy loss is asked for without them.
    """
    kwargs = dict(params or {})
    if is_proxy_loss(kind):
        if num_classes is None or dim is None:
            raise ValueError(f"{kind}: a proxy loss needs num_classes and dim")
        kwargs.update(num_classes=num_classes, dim=dim)
    return build_loss(kind, **kwargs)
