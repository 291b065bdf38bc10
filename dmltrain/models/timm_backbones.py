"""Backbones from timm: any timm model name as ``model.backbone`` (ViT, DINOv2, CLIP ViTs, ConvNeXt, ...).

:class:`TimmBackbone` holds the timm model as ``net``, built with ``num_classes=0`` (no classifier), so
``backbone.net`` has timm's own parameter names and a state dict that timm saved loads into it
(:mod:`.pretrained`, with timm's checkpoint filter: position embeddings resampled to another image
size, original DINOv2 / OpenAI CLIP layouts converted). Its stages are timm's feature points
(``feature_info``: ``blocks.0`` .. for a ViT, ``stages.0`` .. for a ConvNeXt), tapped through timm's
``forward_intermediates`` as ``B × C × h × w`` maps (a ViT's patch tokens on their grid), plus
``output``: what a single-level head takes, by ``model.features``:

* ``pooled`` (``auto``): the model's own pooled features as pretrained (``forward_head(pre_logits=True)``:
  the class token after the final norm for ViT, DINOv2 and CLIP; average pooling + LayerNorm for ConvNeXt);
* ``cls``: the class token after the final norm (models with one);
* ``patches``: the patch tokens after the final norm on their grid (a convolutional model: its last feature
  map), pooled by the head's ``model.pooling`` (avg, max, avgmax, gem).

``pooled`` and ``cls`` give ``B × C × 1 × 1``. Built for ``image_size`` (a ViT's position embeddings
and patch grid: the size must be a multiple of the patch size), with timm's drop-path rate and
gradient checkpointing; attention runs through ``F.scaled_dot_product_attention`` (timm's
``fused_attn``, forced on: flash or memory-efficient kernels on GPUs in bf16).

What the run config must know of a timm model before anything is built (its input contract, patch size,
stages) is :func:`dmltrain.backbone_facts.timm_facts`'s.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from dmltrain.backbone_facts import create_timm_model, timm_facts
from dmltrain.errors import UserError
from dmltrain.models.backbone_base import Backbone

OUTPUT = "output"  # the stage that holds model.features
FEATURES = ("auto", "pooled", "cls", "patches")


def _force_fused_attention(net: nn.Module) -> int:
    """Every timm attention layer on ``F.scaled_dot_product_attention`` (whatever ``TIMM_FUSED_ATTN`` says); the count."""
    n = 0
    for m in net.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
            n += 1
    return n


class TimmBackbone(Backbone):
    """A timm model without its classifier as a :class:`~.backbones.Backbone` (see the module doc)."""

    def __init__(self, name: str, net: nn.Module, features: str = "auto") -> None:
        super().__init__()
        if features not in FEATURES:
            raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
        self.name, self.net = name, net
        self.features = "pooled" if features == "auto" else features
        self.convolutional = getattr(net, "patch_embed", None) is None
        self._taps = (
            [f["module"] for f in net.feature_info] if hasattr(net, "forward_intermediates") else []
        )  # positions are forward_intermediates' indices
        width = net.num_features if self.features != "pooled" else getattr(net, "head_hidden_size", net.num_features)
        self.stage_channels = {**{f["module"]: int(f["num_chs"]) for f in net.feature_info}, OUTPUT: int(width)}
        if not self._taps:  # no forward_intermediates: the output alone
            self.stage_channels = {OUTPUT: int(width)}
        self.num_prefix_tokens = int(getattr(net, "num_prefix_tokens", 0))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.net.set_grad_checkpointing(enable)

    def layer_ids(self) -> dict[str, int]:
        """timm's own grouping (``group_matcher``, as its layer-decay optimizer factory): the stem 0, block i
        i + 1, the final norm last; parameters it leaves out (the pooling head) share the last id."""
        from timm.models import group_parameters

        if not hasattr(self.net, "group_matcher"):
            return {f"net.{n}": 0 for n, _ in self.net.named_parameters()}
        ids = group_parameters(self.net, self.net.group_matcher(coarse=False), reverse=True)
        last = max(ids.values(), default=0)
        return {f"net.{n}": ids.get(n, last) for n, _ in self.net.named_parameters()}

    def no_weight_decay(self) -> set[str]:
        """The parameters matching the model's ``no_weight_decay()`` names (shell patterns, as timm's optimizer
        factory reads them: a ViT's ``cls_token``, ``pos_embed``, ``reg_token``, ``dist_token``)."""
        patterns = self.net.no_weight_decay() if hasattr(self.net, "no_weight_decay") else ()
        return {
            f"net.{n}" for n, _ in self.net.named_parameters() if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)
        }

    def _output(self, final: Tensor, x: Tensor) -> Tensor:
        """``model.features`` of the final features (tokens ``B × N × C``, or a ``B × C × h × w`` map)."""
        net = self.net
        if self.features == "pooled":
            out = net.forward_head(final, pre_logits=True)
            return out.reshape(out.shape[0], -1, 1, 1)
        if final.dim() == 3:  # tokens: prefix (class, registers) then patches
            if self.features == "cls":
                return final[:, 0, :, None, None]
            patches = final[:, self.num_prefix_tokens :]
            h, w = net.patch_embed.dynamic_feat_size(x.shape[-2:])
            return patches.transpose(1, 2).reshape(final.shape[0], -1, h, w)
        if getattr(net, "output_fmt", "NCHW") == "NHWC":
            final = final.permute(0, 3, 1, 2)
        return final

    def forward(self, x: Tensor, stages: Sequence[str] | None = None) -> list[Tensor]:
        wanted = list(stages) if stages else [OUTPUT]
        inner = sorted((self._taps.index(s), s) for s in wanted if s != OUTPUT)
        taps: dict[str, Tensor] = {}
        if not inner:
            taps[OUTPUT] = self._output(self.net.forward_features(x), x)
        else:
            indices = [i for i, _ in inner]
            if OUTPUT in wanted:
                final, maps = self.net.forward_intermediates(x, indices=indices, output_fmt="NCHW")
                taps[OUTPUT] = self._output(final, x)
            else:
                maps = self.net.forward_intermediates(
                    x, indices=indices, output_fmt="NCHW", intermediates_only=True, stop_early=True
                )
            taps.update(zip((s for _, s in inner), maps))
        return [taps[s] for s in wanted]


def build_timm_backbone(
    name: str, *, image_size: int | None = None, drop_path: float = 0.0, features: str = "auto"
) -> TimmBackbone:
    """timm model ``name`` (randomly initialised, classifier removed) as a backbone; a model built for an input
    size is built for ``image_size`` (its default when None). Offline: nothing is downloaded here."""
    facts = timm_facts(name)
    kwargs: dict[str, Any] = {"drop_path_rate": float(drop_path)} if drop_path else {}
    if facts.takes_image_size and image_size is not None:
        kwargs["img_size"] = int(image_size)
    try:
        net = create_timm_model(facts.name, **kwargs)
    except TypeError as e:  # a model without stochastic depth
        raise UserError(f"model.drop_path: timm model {name} does not take it ({e})") from None
    except (AssertionError, ValueError, RuntimeError) as e:  # e.g. a window size that does not divide the grid
        raise UserError(f"model.backbone: timm cannot build {name} for data.image_size {image_size} ({e})") from None
    _force_fused_attention(net)
    return TimmBackbone(name, net, features)


def checkpoint_filter(net: nn.Module):
    """timm's state-dict filter for ``net``'s architecture (``checkpoint_filter_fn`` of its module: converts
    original layouts, resamples position embeddings and patch kernels to ``net``'s), or None."""
    return getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
