"""The four classifier kinds, each described once: hyperparameters, defaults, bounds, logit scale, target logit.

One :class:`ClassifierKind` record per kind (:data:`KINDS`) is read by every place that needs
to know a kind: the registry losses (:mod:`~dmltrain.losses.normsoftmax` and its siblings
build their hyperparameters from it), the class-sharded classifier
(:mod:`dmltrain.distributed.sharded_softmax`), config validation (``loss.classifier`` in
:mod:`dmltrain.config`) and through it ``dmltrain tune``'s check of a search space.

* ``normsoftmax``: cosine logits ``cos θ / T`` (``temperature`` T > 0, default 0.05);
* ``cosface``: ``s·cos θ``, target ``s·(cos θ − m)`` (``scale`` s > 0, 64; ``margin`` m ≥ 0, 0.35);
* ``arcface``: ``s·cos θ``, target ``s·cos(θ + m)`` (s > 0, 64; 0 ≤ m < π, 0.5);
* ``softmax_ce``: a linear layer with bias on unnormalised features and label smoothing
  (``smoothing`` ε in [0, 1), 0.1).

The normalised kinds also take ``subcenters`` k (a whole number, default 1): sub-center ArcFace
(Deng et al., ECCV 2020), k rows per class, the class's cosine the best of its k. It shapes the
weight, not the target logit: :meth:`ClassifierKind.logit_params` leaves it out of what
``target_logit`` receives. Only the class-sharded classifier takes k > 1.

Errors are one line naming the parameter: :meth:`ClassifierKind.resolve` raises
``TypeError`` (unknown name) or ``ValueError`` (out of bounds); :func:`check_classifier`
returns the same reason keyed by ``kind`` or ``params.<name>`` for config messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

from dmltrain.losses.margins import arcface_target, cosface_target, normsoftmax_target


@dataclass(frozen=True)
class KindParam:
    """One hyperparameter: its default and the interval it must lie in."""

    name: str
    default: float
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    high_label: str | None = None  # how the upper bound reads in messages ("pi")
    integer: bool = False  # a whole number (a count)

    def bound_text(self) -> str:
        if self.high == math.inf:
            if self.low == 0 and self.low_open:
                return "positive"
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        high = self.high_label or f"{self.high:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"

    def problem(self, value: float) -> str | None:
        """None when ``value`` is allowed, else ``"<name> must be <bound>, got <value>"`` (NaN is refused)."""
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        if self.integer and above and below and value != int(value):
            return f"{self.name} must be a whole number, got {value:g}"
        return None if above and below else f"{self.name} must be {self.bound_text()}, got {value:g}"


@dataclass(frozen=True)
class ClassifierKind:
    """A softmax classifier kind.

    ``normalized``: logits are scaled cosines of unit embeddings and unit class rows (no
    bias); otherwise a linear layer with bias on the raw embeddings. ``logit_scale`` maps the
    hyperparameters to the factor turning cosines into the non-target logits.
    ``target_logit(x_hat, w_hat, **params)`` is the target logit of paired unit rows with the
    kind's margin (normalised kinds only; it carries the margin's true gradient).
    """

    name: str
    params: tuple[KindParam, ...]
    normalized: bool
    logit_scale: Callable[[Mapping[str, float]], float]
    target_logit: Callable[..., Tensor] | None = None

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def has_bias(self) -> bool:
        return not self.normalized

    def defaults(self) -> dict[str, float]:
        return {p.name: p.default for p in self.params}

    def logit_params(self, params: Mapping[str, float]) -> dict[str, float]:
        """The hyperparameters of ``target_logit`` and ``logit_scale`` (those that shape the weight left out)."""
        return {k: v for k, v in params.items() if k not in STRUCTURAL}

    @staticmethod
    def subcenters(params: Mapping[str, float]) -> int:
        """Rows per class (1 when the kind has no sub-centers)."""
        return int(params.get("subcenters", 1))

    def problem(self, params: Mapping[str, float]) -> str | None:
        """The first problem of ``params`` as ``"params.<name>: <reason>"``, or None."""
        for key in params:
            if key not in self.param_names:
                return f"params.{key}: not a parameter of {self.name} (it takes: {', '.join(self.param_names)})"
        for p in self.params:
            if p.name in params:
                reason = p.problem(float(params[p.name]))
                if reason:
                    return f"params.{p.name}: {reason} ({self.name})"
        return None

    def resolve(self, params: Mapping[str, float]) -> dict[str, float]:
        """Defaults overridden by ``params`` as floats; ``TypeError`` for an unknown name,
        ``ValueError`` for a value out of bounds (one line naming both)."""
        unknown = sorted(set(params) - set(self.param_names))
        if unknown:
            raise TypeError(
                f"{self.name}: unknown parameter(s) {', '.join(unknown)} (it takes: {', '.join(self.param_names)})"
            )
        out = {**self.defaults(), **{k: float(v) for k, v in params.items()}}
        for p in self.params:
            reason = p.problem(out[p.name])
            if reason:
                raise ValueError(f"{self.name}: {reason}")
        return out


_SCALE = KindParam("scale", 64.0, low=0.0, low_open=True)
_SUBCENTERS = KindParam("subcenters", 1.0, low=1.0, high=1024.0, high_open=False, integer=True)
#: hyperparameters that shape the weight rather than the logits
STRUCTURAL = ("subcenters",)

#: every classifier kind by name
KINDS: dict[str, ClassifierKind] = {
    k.name: k
    for k in (
        ClassifierKind(
            "normsoftmax",
            (KindParam("temperature", 0.05, low=0.0, low_open=True), _SUBCENTERS),
            normalized=True,
            logit_scale=lambda p: 1.0 / p["temperature"],
            target_logit=normsoftmax_target,
        ),
        ClassifierKind(
            "cosface",
            (_SCALE, KindParam("margin", 0.35, low=0.0), _SUBCENTERS),
            normalized=True,
            logit_scale=lambda p: p["scale"],
            target_logit=cosface_target,
        ),
        ClassifierKind(
            "arcface",
            (_SCALE, KindParam("margin", 0.5, low=0.0, high=math.pi, high_label="pi"), _SUBCENTERS),
            normalized=True,
            logit_scale=lambda p: p["scale"],
            target_logit=arcface_target,
        ),
        ClassifierKind(
            "softmax_ce",
            (KindParam("smoothing", 0.1, low=0.0, high=1.0),),
            normalized=False,
            logit_scale=lambda p: 1.0,
        ),
    )
}

CLASSIFIER_KINDS: tuple[str, ...] = tuple(KINDS)


def classifier_kind(name: str) -> ClassifierKind:
    """The record of ``name``; ``ValueError`` naming the choices when there is none."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown classifier kind {name!r} (choose from {', '.join(CLASSIFIER_KINDS)})") from None


def check_classifier(name: str, params: Mapping[str, float]) -> str | None:
    """None when kind ``name`` takes ``params``; else one line starting with the key at fault
    (``kind`` or ``params.<name>``), for config messages."""
    if name not in KINDS:
        return f"kind: {name!r} is not one of {', '.join(CLASSIFIER_KINDS)}"
    return KINDS[name].problem(params)
