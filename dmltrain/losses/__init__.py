"""The loss library of the four papers: proxy losses and instance (pair) losses.

``build_loss(name, **params)``; see :mod:`dmltrain.losses.registry` for the names.
"""

from dmltrain.losses.base import AnchorTerms, BaseLoss, InstanceLoss, ProxyLoss
from dmltrain.losses.registry import build_loss, check_params, loss_names, register

__all__ = ["AnchorTerms", "BaseLoss", "InstanceLoss", "ProxyLoss", "build_loss", "check_params", "loss_names", "register"]
