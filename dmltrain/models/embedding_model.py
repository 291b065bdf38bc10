"""The embedding model: a backbone, an embedding head, and the training options around them.

:func:`build_model` turns a ``ModelConfig`` into an :class:`EmbeddingModel`;
:func:`param_groups` splits its parameters into optimizer groups (pretrained vs new,
decayed vs not, and with ``optim.layer_decay`` by backbone layer).

Decisions worth knowing:

* ``freeze_bn`` keeps every BatchNorm layer of the *backbone* in eval mode, so its running
  statistics stay fixed and batches are normalised with them; their affine parameters still
  train (as the CE paper's and the MS loss's released code do). Freeze those too by giving
  them ``requires_grad=False``; :func:`param_groups` skips frozen parameters. The head's
  BatchNorm (new, affine-free) is not affected.
* ``set_backbone_trainable(False)`` runs the backbone without autograd (the head-only warm-up
  of the NormSoftmax recipe): no backward through it, its parameters get no gradient. Give the
  ``backbone*`` groups a zero learning rate at the same time, so weight decay in fused or
  flattened optimizers (DeepSpeed) cannot move them either.
* ``channels_last``: the model's weights are converted at build time and ``forward`` converts
  its input, so callers need not (converting before the transfer to the GPU saves a copy).
* ``forward`` casts a floating input to the backbone's parameter dtype unless autocast is on
  (so a bf16 model accepts float32 images); embeddings are float32 in every case.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dmltrain.config import ModelConfig
from dmltrain.models.backbone_base import Backbone
from dmltrain.models.backbones import build_backbone
from dmltrain.models.binary import pack_sign_bits
from dmltrain.models.heads import Head, build_head
from dmltrain.models.precision import to_channels_last
from dmltrain.models.pretrained import load_pretrained as load_weights


class EmbeddingModel(nn.Module):
    """``images (B × 3 × H × W) -> embeddings (B × D)``; see the module doc for the options.

    ``stages`` are the backbone stages the head pools (one for a single-level embedding).
    ``classifier_dropout`` is not applied here: the trainer applies ``F.dropout(emb, p)`` on
    the classifier branch only, so instance losses and evaluation see the plain embedding.
    """

    def __init__(
        self,
        backbone: Backbone,
        head: Head,
        stages: Sequence[str] | None = None,
        *,
        freeze_bn: bool = False,
        classifier_dropout: float = 0.0,
        channels_last: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.stages = tuple(stages) if stages else (backbone.stage_names[-1],)
        backbone.check_stages(self.stages)
        if list(head.in_channels) != [backbone.stage_channels[s] for s in self.stages]:
            raise ValueError(f"head expects channels {head.in_channels}, stages {self.stages} give others")
        self.freeze_bn = freeze_bn
        self.classifier_dropout = float(classifier_dropout)
        self.channels_last = channels_last
        self.config = config  # the ModelConfig as a dict, stored by save_model to rebuild the model
        self.input_spec: dict[str, Any] | None = None  # mean, std, interpolation of a loaded model file (load_model)
        self._backbone_trainable = True
        self.train()  # applies freeze_bn from the start

    # -- properties the trainer reads ----------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.head.embedding_dim

    @property
    def normalized(self) -> bool:
        """Whether ``forward`` returns L2-normalised rows (the layernorm head)."""
        return self.head.normalized

    @property
    def backbone_trainable(self) -> bool:
        return self._backbone_trainable

    def set_backbone_trainable(self, trainable: bool) -> None:
        """False: the backbone runs without autograd (head-only warm-up); see the module doc."""
        self._backbone_trainable = bool(trainable)

    # -- forward ---------------------------------------------------------------------------------
    def _prepare(self, images: Tensor) -> Tensor:
        if self.channels_last:
            images = to_channels_last(images)
        if images.is_floating_point() and not torch.is_autocast_enabled(images.device.type):
            dtype = next(self.backbone.parameters()).dtype
            if images.dtype != dtype:
                images = images.to(dtype)
        return images

    def features(self, images: Tensor) -> list[Tensor]:
        """The feature maps of ``self.stages`` (respecting ``backbone_trainable``)."""
        images = self._prepare(images)
        if self._backbone_trainable:
            return self.backbone(images, self.stages)
        with torch.no_grad():
            return self.backbone(images, self.stages)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))

    def forward_levels(self, images: Tensor) -> list[Tensor]:
        """Each level's embedding separately (for a loss per level, as in the RLL paper)."""
        return self.head.levels(self.features(images))

    @torch.no_grad()
    def binarize(self, images: Tensor) -> np.ndarray:
        """Packed sign bits of the embeddings (``B × ceil(D/8)`` uint8, for Hamming search).

        Meaningful for centred embeddings: the layernorm head (LayerNorm centres each vector)
        and the batchnorm head (centred per feature). The unprojected ``none`` head pools ReLU
        outputs, all >= 0, so it refuses.
        """
        if not self.head.centred:
            raise ValueError(
                "binarize: this head's embeddings are non-negative pooled features; sign bits carry no information"
            )
        return pack_sign_bits(self(images))

    # -- modes and parameters --------------------------------------------------------------------
    def train(self, mode: bool = True) -> EmbeddingModel:
        super().train(mode)
        if mode and self.freeze_bn:
            for m in self.backbone.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self

    def new_parameters(self) -> Iterator[nn.Parameter]:
        """The randomly initialised parameters: the head (with the multi-level projections)."""
        return self.head.parameters()

    def pretrained_parameters(self) -> Iterator[nn.Parameter]:
        """The backbone's parameters (pretrained or not, they are the ones an ImageNet file fills)."""
        return self.backbone.parameters()

    def summary(self) -> dict[str, Any]:
        """Flat facts for logging (MLflow params)."""
        count = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
        return {
            "backbone": self.backbone.name,
            "stages": ",".join(self.stages),
            "head": self.head.kind,
            "embedding_dim": self.embedding_dim,
            "params_backbone": count(self.backbone.parameters()),
            "params_head": count(self.head.parameters()),
        }


def build_model(cfg: Any, *, load_pretrained: bool = True) -> EmbeddingModel:
    """An :class:`EmbeddingModel` from a ``ModelConfig`` (or its dict).

    ``load_pretrained=False`` builds the same architecture without reading or downloading the
    weights ``cfg.pretrained`` names (used to rebuild a saved model). Bad names raise one-line
    :class:`~dmltrain.errors.UserError`.
    """

    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.model_validate(cfg)
    backbone = build_backbone(
        cfg.backbone,
        pretrained=cfg.pretrained not in ("", "none"),
        image_size=cfg.image_size,
        drop_path=cfg.drop_path,
        features=cfg.features,
    )
    stages = tuple(cfg.multilevel) if cfg.multilevel else (backbone.stage_names[-1],)
    backbone.check_stages(stages)
    if load_pretrained:
        load_weights(backbone, cfg.pretrained, allow_download=cfg.pretrained_download)
    if cfg.grad_checkpointing:
        backbone.set_grad_checkpointing(True)
    head = build_head(cfg.head, [backbone.stage_channels[s] for s in stages], cfg.embedding_dim, cfg.pooling, cfg.gem_p)
    model = EmbeddingModel(
        backbone,
        head,
        stages,
        freeze_bn=cfg.freeze_bn,
        classifier_dropout=cfg.dropout,
        channels_last=cfg.channels_last,
        config=cfg.model_dump(mode="json"),
    )
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    return model


GROUP_NAMES = ("backbone", "backbone_no_decay", "head", "head_no_decay")


def param_groups(model: nn.Module, optim_cfg: Any, extra_new: Iterable[nn.Module] = ()) -> list[dict[str, Any]]:
    """Optimizer parameter groups: pretrained (backbone) vs new (head, and ``extra_new`` modules
    such as a classifier), each split into decayed and not decayed.

    Every trainable parameter lands in exactly one group; frozen ones in none. Each group has
    ``params``, ``weight_decay`` (``optim_cfg.weight_decay``, or 0 in the ``*_no_decay``
    groups), ``lr_mult`` (``optim_cfg.new_param_lr_mult`` for new parameters, else 1) and
    ``name``. With ``decay_norm_and_bias=False`` every parameter of at most one dimension
    (biases, BatchNorm and LayerNorm scales) goes to a ``*_no_decay`` group, and so do the backbone's
    :meth:`~.backbones.Backbone.no_weight_decay` ones (a timm ViT's class token and position embeddings,
    as timm's optimizer factory does): only conv and linear weights are decayed. Empty groups are left out.

    With ``optim_cfg.layer_decay = d`` the backbone groups are split by layer as well (named
    ``backbone.layer<i>`` and ``backbone_no_decay.layer<i>``): a parameter of layer ``i``
    (:meth:`~.backbones.Backbone.layer_ids`, the last layer ``L``) gets ``lr_mult = d^(L - i)``, so the
    schedule, which scales every group's rate, keeps the ratios. The head's groups keep theirs.
    """
    model = getattr(model, "module", model)  # DeepSpeed engine / DDP wrapper
    if not isinstance(model, EmbeddingModel):
        raise TypeError(f"param_groups: expected an EmbeddingModel, got {type(model).__name__}")
    split = not optim_cfg.decay_norm_and_bias
    decay = getattr(optim_cfg, "layer_decay", None)
    layer_of: dict[int, int] = {}
    last = 0
    if decay is not None:
        ids = model.backbone.layer_ids()
        last = max(ids.values(), default=0)
        layer_of = {id(p): ids[n] for n, p in model.backbone.named_parameters()}
    exempt_names = model.backbone.no_weight_decay()
    exempt = {id(p) for n, p in model.backbone.named_parameters() if n in exempt_names}
    groups: dict[str, list[nn.Parameter]] = {}
    mults: dict[str, float] = {}
    seen: set[int] = set()
    sources = [("backbone", model.backbone.parameters()), ("head", model.head.parameters())]
    sources += [("head", m.parameters()) for m in extra_new]
    for section, params in sources:
        for p in params:
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{section}_no_decay" if split and (p.ndim <= 1 or id(p) in exempt) else section
            mult = float(optim_cfg.new_param_lr_mult) if section == "head" else 1.0
            if section == "backbone" and decay is not None:
                layer = layer_of[id(p)]
                name, mult = f"{name}.layer{layer}", float(decay) ** (last - layer)
            groups.setdefault(name, []).append(p)
            mults[name] = mult
    order = {n: i for i, n in enumerate(GROUP_NAMES)}

    def key(name: str) -> tuple[int, int]:
        base, _, layer = name.partition(".layer")
        return order[base], int(layer or 0)

    return [
        {
            "params": groups[name],
            "weight_decay": 0.0 if name.split(".")[0].endswith("no_decay") else float(optim_cfg.weight_decay),
            "lr_mult": mults[name],
            "name": name,
        }
        for name in sorted(groups, key=key)
    ]
