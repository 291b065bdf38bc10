"""What a ``model.backbone`` name stands for, read without building the model: the backbone catalogue.

The run config's schema (:mod:`dmltrain.config`) asks it what a backbone expects (its input contract:
:func:`backbone_input`) and what it can take (:func:`check_timm_model`); the models (:mod:`dmltrain.models`)
build the backbones it names. Neither the schema nor this module imports the models: the names of the
torchvision backbones are listed here (:data:`TORCHVISION_BACKBONES`; a test keeps them equal to
:data:`dmltrain.models.backbones.BACKBONES`), any other name is looked up in timm.

:func:`timm_facts` answers what the run config must know before anything is built (the normalization and
interpolation of the model's pretrained config, its patch size, stages, whether it is convolutional), from the
model built on the meta device (no memory, no weights). timm and torch are imported only when a timm name is
looked up, so checking a config of a torchvision backbone loads neither.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from dmltrain.errors import UserError
from shards.config import IMAGENET_MEAN, IMAGENET_STD

#: the torchvision backbones' names (:data:`dmltrain.models.backbones.BACKBONES`' keys, listed here so that checking
#: a config imports no torchvision); any other name is looked up in timm
TORCHVISION_BACKBONES = tuple(
    ("resnet18 resnet34 resnet50 resnet101 resnet152 resnext50_32x4d wide_resnet50_2 googlenet small_cnn").split()
)

TIMM_PREFIX = "timm:"


def timm_name(name: str) -> str | None:
    """The timm model name (with its pretrained tag, if any) that ``model.backbone`` = ``name`` stands for, or
    None: one of dmltrain's torchvision names (``timm:NAME`` forces timm's), or a name timm does not know."""
    if name in TORCHVISION_BACKBONES:
        return None
    name = name.removeprefix(TIMM_PREFIX)
    import timm

    return name if timm.is_model(name) else None


@dataclass(frozen=True)
class TimmFacts:
    """What a timm model's run needs to know before building it (see :func:`timm_facts`)."""

    name: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str  # bilinear or bicubic
    patch_size: tuple[int, int] | None  # a ViT's patches; None for a convolutional model
    takes_image_size: bool  # built for an input size (position embeddings)
    has_cls: bool
    stages: tuple[str, ...]  # feature points forward_intermediates can tap (empty: none)
    convolutional: bool
    classifier: tuple[str, ...]  # the pretrained config's classifier module names (their keys are dropped)
    hf_hub_id: str | None
    url: str | None


def create_timm_model(name: str, **kwargs: Any):
    """timm's model ``name`` without its classifier, randomly initialised."""
    import timm

    return timm.create_model(name, pretrained=False, num_classes=0, **kwargs)


@functools.lru_cache(maxsize=32)
def timm_facts(name: str) -> TimmFacts:
    """The facts of timm model ``name`` (a ``model.backbone`` value), from the model built on the meta device."""
    import torch

    arch = timm_name(name)
    if arch is None:
        raise UserError(f"model.backbone: timm knows no model '{name}'")
    with torch.device("meta"):
        net = create_timm_model(arch)
    # built for an input size (position embeddings): its constructor takes one; convolutional models do not
    takes_image_size = "img_size" in inspect.signature(type(net).__init__).parameters
    cfg = dict(net.pretrained_cfg)
    interpolation = cfg.get("interpolation", "bicubic")
    patch = getattr(getattr(net, "patch_embed", None), "patch_size", None)
    classifier = cfg.get("classifier") or ()
    return TimmFacts(
        name=arch,
        mean=tuple(float(v) for v in cfg.get("mean", IMAGENET_MEAN)),
        std=tuple(float(v) for v in cfg.get("std", IMAGENET_STD)),
        interpolation=interpolation if interpolation in ("bilinear", "bicubic") else "bicubic",
        patch_size=tuple(patch) if patch is not None else None,
        takes_image_size=takes_image_size,
        has_cls=getattr(net, "cls_token", None) is not None,
        stages=tuple(f["module"] for f in net.feature_info) if hasattr(net, "forward_intermediates") else (),
        convolutional=getattr(net, "patch_embed", None) is None,
        classifier=(classifier,) if isinstance(classifier, str) else tuple(classifier),
        hf_hub_id=cfg.get("hf_hub_id"),
        url=cfg.get("url") or None,
    )


def check_timm_model(name: str, features: str, pooling: str, image_size: int, eval_crop: int) -> None:
    """A one-line :class:`UserError` for settings timm model ``name`` cannot take: ``model.features=cls`` without
    a class token, GeM pooling of a single pooled vector, or (models built for an input size) an image size
    that is not a multiple of the patch size or an evaluation crop of another size."""
    facts = timm_facts(name)
    if features == "cls" and not facts.has_cls:
        raise UserError(f"model.features: {name} has no class token; use pooled or patches")
    if pooling == "gem" and features in ("auto", "pooled", "cls") and not facts.convolutional:
        raise UserError(
            f"model.pooling: gem pools patch tokens; with model.features={features} {name} gives one vector "
            f"(set model.features=patches)"
        )
    if facts.takes_image_size:
        ph, pw = facts.patch_size or (1, 1)
        if image_size % ph or image_size % pw:
            raise UserError(
                f"data.image_size: {image_size} is not a multiple of {name}'s patch size {ph}; "
                f"use {max(ph, image_size // ph * ph)} or {(image_size // ph + 1) * ph}"
            )
        if eval_crop != image_size:
            raise UserError(
                f"data.eval_crop: {eval_crop} differs from data.image_size {image_size}; {name} is built for one input "
                f"size (its position embeddings): set data.eval_crop={image_size}"
            )


def backbone_input(backbone: str) -> tuple[tuple[float, ...], tuple[float, ...], str]:
    """``(mean, std, interpolation)`` that backbone ``backbone`` expects: ImageNet's and bilinear for the torchvision
    backbones, the pretrained config's for a timm model; a one-line :class:`UserError` for an unknown name."""
    if backbone in TORCHVISION_BACKBONES:
        return IMAGENET_MEAN, IMAGENET_STD, "bilinear"
    if timm_name(backbone) is None:
        raise UserError(
            f"model.backbone: unknown backbone '{backbone}' (choose from {', '.join(TORCHVISION_BACKBONES)}, "
            f"or a timm model name)"
        )
    facts = timm_facts(backbone)
    return facts.mean, facts.std, facts.interpolation
