"""The loss registry: one name per loss, built from keyword hyperparameters.

``build_loss("ice", scale=64)``. Names are registered by the ``@register`` decorator on each
loss class; importing any module of :mod:`dmltrain.losses` (this one included) first runs the
package's ``__init__``, which imports, and so registers, every loss.
"""

from __future__ import annotations

import inspect
from typing import Any

_REGISTRY: dict[str, type] = {}

# Constructor arguments that the builder supplies, never the user's `params`.
STRUCTURAL_ARGS = ("num_classes", "dim")


def register(name: str):
    """Class decorator: make the loss buildable as ``build_loss(name, ...)``."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"loss name {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return deco


def loss_names() -> list[str]:
    return sorted(_REGISTRY)


def loss_class(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r} (choose from {', '.join(sorted(_REGISTRY))})") from None


def accepted_params(name: str) -> list[str]:
    """The hyperparameter keywords of a loss: its ``hyperparameters`` (the classifier kinds,
    :mod:`~dmltrain.losses.kinds`), else its constructor's minus num_classes/dim."""
    cls = loss_class(name)
    declared = getattr(cls, "hyperparameters", None)
    if declared:
        return list(declared)
    sig = inspect.signature(cls.__init__)
    return [
        p
        for p in sig.parameters
        if p not in ("self", *STRUCTURAL_ARGS) and sig.parameters[p].kind is not inspect.Parameter.VAR_KEYWORD
    ]


def check_params(name: str, params: dict[str, Any], allowed: tuple[str, ...] | None = None) -> str | None:
    """None when ``name`` takes keywords ``params``; else a short reason starting with the key at fault.

    Names only: :func:`check_values` also runs the constructor's value checks, and the
    classifier kinds are checked by :func:`~dmltrain.losses.kinds.check_classifier`."""
    if allowed is not None and name not in allowed:
        return f"kind: {name!r} is not one of {', '.join(allowed)}"
    if name not in _REGISTRY:
        return f"kind: unknown loss {name!r} (choose from {', '.join(sorted(_REGISTRY))})"
    accepted = accepted_params(name)
    for key in params:
        if key not in accepted:
            return f"params.{key}: not a parameter of {name} (it takes: {', '.join(accepted) or 'none'})"
    return None


def check_values(name: str, params: dict[str, Any]) -> str | None:
    """None when the instance loss ``name`` accepts ``params``'s values; else a short reason.

    Builds the loss once at toy size (a proxy loss with 2 classes of dimension 2), so its
    constructor's checks (``m <= alpha``, ``normalize``) run before a run starts rather than
    on the workers."""
    problem = check_params(name, params)
    if problem:
        return problem
    sig = inspect.signature(loss_class(name).__init__).parameters
    toy = {k: 2 for k in STRUCTURAL_ARGS if k in sig}
    try:
        build_loss(name, **toy, **params)
    except (ValueError, TypeError) as e:
        return f"params: {str(e).splitlines()[0]}"
    return None


def build_loss(name: str, **kwargs: Any):
    """Instantiate the loss registered as ``name``; unknown keywords raise ``TypeError`` naming them."""
    cls = loss_class(name)
    accepted = set(accepted_params(name)) | set(STRUCTURAL_ARGS)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(f"{name}: unknown parameter(s) {', '.join(unknown)}")
    return cls(**kwargs)
