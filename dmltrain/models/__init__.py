"""Embedding models: torchvision and timm backbones by name, embedding heads, saving and loading.

    from dmltrain.models import build_model, param_groups, save_model, load_model, autocast
    model = build_model(cfg.model)        # EmbeddingModel: images -> B × D embeddings

Modules: :mod:`.backbones` (networks by name, named stages), :mod:`.timm_backbones` (any timm model:
ViT, DINOv2, CLIP, ConvNeXt, ...), :mod:`.pretrained` (local file, ImageNet, timm / Hugging Face cache
weights), :mod:`.heads` (layernorm, batchnorm, none; multi-level; avg, max, GeM pooling),
:mod:`.embedding_model` (the model, parameter groups, BN freezing), :mod:`.export` (files),
:mod:`.precision` (autocast, channels_last), :mod:`.binary` (sign bits, Hamming distance),
:mod:`.serving` (ONNX, pt2 and TorchScript exports, checked and loaded back), :mod:`.contract`
(the preprocessing contract beside an export), :mod:`.cli` (``dmltrain export``).

Names are imported on first use, so ``import dmltrain.models.binary`` stays light.
"""

from __future__ import annotations

from dmltrain.lazy_exports import lazy_exports

_EXPORTS = {
    "Backbone": "backbone_base",
    "LayerChain": "backbones",
    "TimmBackbone": "timm_backbones",
    "BACKBONES": "backbones",
    "build_backbone": "backbones",
    "Head": "heads",
    "LayerNormHead": "heads",
    "BatchNormHead": "heads",
    "PlainHead": "heads",
    "GlobalPool": "heads",
    "build_head": "heads",
    "EmbeddingModel": "embedding_model",
    "build_model": "embedding_model",
    "param_groups": "embedding_model",
    "save_model": "export",
    "load_model": "export",
    "autocast": "precision",
    "supports_bf16": "precision",
    "to_channels_last": "precision",
    "pack_sign_bits": "binary",
    "hamming_distances": "binary",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
