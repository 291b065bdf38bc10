"""Feature extractors by name: torchvision ResNets and GoogLeNet, a small CNN for CPU runs, and any timm model.

A :class:`Backbone` is the network up to its features, without the ImageNet classifier. Its
*stages* are the named points whose feature maps can be tapped for multi-level embeddings.
The torchvision ones are :class:`LayerChain` s, which register the torchvision submodules under
their torchvision names, so their ``state_dict`` keys are exactly torchvision's minus the
classifier (``fc.*``, ``aux1.*``, ``aux2.*``): a torchvision state dict loads into them directly.

* ResNets: ``layer1`` .. ``layer4``;
* GoogLeNet: ``conv3``, ``inception3a`` .. ``inception5b`` (the RLL paper's L, M, H levels
  are ``inception3b``, ``inception4e``, ``inception5b`` here; torchvision's GoogLeNet has
  BatchNorm in every convolution, the closest torchvision network to BN-Inception);
* ``small_cnn``: ``stage1`` .. ``stage4``;
* any other name timm knows (``vit_small_patch16_224``, ``vit_base_patch14_dinov2``, ``convnext_base``, ...;
  ``timm:NAME`` for a name that is also one of the above): a
  :class:`~dmltrain.models.timm_backbones.TimmBackbone`, whose stages are timm's feature points
  (``blocks.0`` .., ``stages.0`` ..) plus ``output``, the features the single-level head takes.

Gradient checkpointing (:meth:`Backbone.set_grad_checkpointing`) recomputes each stage in the backward
pass instead of keeping its activations; :meth:`Backbone.layer_ids` numbers the parameters from the
input side for layer-wise learning-rate decay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torchvision.models as tvm
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from torchvision.models.resnet import BasicBlock, Bottleneck

from dmltrain.backbone_facts import timm_name
from dmltrain.errors import UserError
from dmltrain.models.backbone_base import Backbone
from dmltrain.models.timm_backbones import build_timm_backbone

# Keys of the ImageNet classifier in torchvision checkpoints; a backbone never has them.
CLASSIFIER_PREFIXES = ("fc.", "aux1.", "aux2.", "classifier.")


@contextlib.contextmanager
def _recomputing(module: nn.Module) -> Iterator[None]:
    """A checkpointed stage's recomputation: training BatchNorm layers normalise by the batch as in the forward
    pass, and their running statistics are put back afterwards (the forward pass already moved them once)."""
    layers = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in layers]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(layers, saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


class LayerChain(Backbone):
    """A feed-forward chain of named layers whose chosen stage outputs are returned.

    ``forward`` stops after the deepest stage asked for. With gradient checkpointing each stage
    layer runs under ``torch.utils.checkpoint`` (non-reentrant) while autograd records: its
    activations are recomputed in the backward pass, its BatchNorm statistics updated once.
    """

    def __init__(
        self,
        name: str,
        layers: Sequence[tuple[str, nn.Module]],
        stage_channels: dict[str, int],
        input_transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        for layer_name, module in layers:
            self.add_module(layer_name, module)
        self._order = [layer_name for layer_name, _ in layers]
        unknown = [s for s in stage_channels if s not in self._order]
        if unknown:
            raise ValueError(f"{name}: stages {unknown} are not layers of the network")
        # network order, whatever order the dict was written in
        self.stage_channels = {s: stage_channels[s] for s in self._order if s in stage_channels}
        self.input_transform = input_transform
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = bool(enable)

    def layer_ids(self) -> dict[str, int]:
        """The layers before the first stage are layer 0, the i-th stage (and what follows it) layer i."""
        ids, level = {}, 0
        for layer_name in self._order:
            if layer_name in self.stage_channels:
                level += 1
            for p_name, _ in getattr(self, layer_name).named_parameters():
                ids[f"{layer_name}.{p_name}"] = level
        return ids

    def _run(self, layer_name: str, x: Tensor) -> Tensor:
        layer = getattr(self, layer_name)
        if self.grad_checkpointing and layer_name in self.stage_channels and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                # compiled (model.compile): the recomputation is part of the compiled backward, which replays no
                # buffer update (the forward's running statistics are written once), and dynamo takes no context_fn
                return checkpoint(layer, x, use_reentrant=False)
            recompute = lambda: (contextlib.nullcontext(), _recomputing(layer))  # noqa: E731
            return checkpoint(layer, x, use_reentrant=False, context_fn=recompute)
        return layer(x)

    def forward(self, x: Tensor, stages: Sequence[str] | None = None) -> list[Tensor]:
        wanted = list(stages) if stages else [self.stage_names[-1]]
        last = max(self._order.index(s) for s in wanted)
        if self.input_transform is not None:
            x = self.input_transform(x)
        taps: dict[str, Tensor] = {}
        for layer_name in self._order[: last + 1]:
            x = self._run(layer_name, x)
            if layer_name in self.stage_channels:
                taps[layer_name] = x
        return [taps[s] for s in wanted]


# -- torchvision ResNets ---------------------------------------------------------------------------
def _resnet(name: str) -> LayerChain:
    net = getattr(tvm, name)(weights=None)
    layers = [(n, getattr(net, n)) for n in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")]
    channels = {}
    for n in ("layer1", "layer2", "layer3", "layer4"):
        block = getattr(net, n)[-1]
        if isinstance(block, Bottleneck):
            channels[n] = block.bn3.num_features
        elif isinstance(block, BasicBlock):
            channels[n] = block.bn2.num_features
        else:  # pragma: no cover - torchvision ResNets only have these two blocks
            raise TypeError(f"{name}: unexpected block {type(block).__name__}")
    return LayerChain(name, layers, channels)


# -- torchvision GoogLeNet ----------------------------------------------------------------------
def _googlenet_transform(x: Tensor) -> Tensor:
    """torchvision's ``transform_input``: ImageNet-normalised input -> the (x - 0.5) / 0.5 scale
    the ported GoogLeNet weights expect (applied only with pretrained weights, as torchvision does)."""
    x0 = x[:, 0:1] * (0.229 / 0.5) + (0.485 - 0.5) / 0.5
    x1 = x[:, 1:2] * (0.224 / 0.5) + (0.456 - 0.5) / 0.5
    x2 = x[:, 2:3] * (0.225 / 0.5) + (0.406 - 0.5) / 0.5
    return torch.cat((x0, x1, x2), 1)


def _googlenet(name: str, *, transform_input: bool) -> LayerChain:
    # as torchvision does: its (slow) truncated-normal init is skipped when weights will be loaded
    net = tvm.googlenet(weights=None, aux_logits=False, init_weights=not transform_input)
    order = (
        "conv1 maxpool1 conv2 conv3 maxpool2 inception3a inception3b maxpool3 "
        "inception4a inception4b inception4c inception4d inception4e maxpool4 inception5a inception5b"
    ).split()
    layers = [(n, getattr(net, n)) for n in order]
    channels = {"conv3": net.conv3.conv.out_channels}
    for n in order:
        if n.startswith("inception"):
            block = getattr(net, n)
            # the four branches are concatenated: sum of each branch's last convolution
            channels[n] = block.branch1.conv.out_channels + sum(
                getattr(block, b)[-1].conv.out_channels for b in ("branch2", "branch3", "branch4")
            )
    return LayerChain(name, layers, channels, input_transform=_googlenet_transform if transform_input else None)


# -- small CNN ---------------------------------------------------------------------------------------
def _conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


SMALL_CNN_CHANNELS = (32, 64, 128, 192)


def small_cnn(name: str = "small_cnn") -> LayerChain:
    """Four stages of two 3×3 conv-BN-ReLU blocks (stride 1), each stage halving the resolution by 2×2 max-pooling.

    Max-pooling, not strided convolutions, as the Conv-4 networks of the few-shot and metric-learning
    literature: a stride-2 convolution fits the training classes as well but transfers worse to
    unseen ones (thin structures alias away). Stages 2-4 pool *before* their convolutions, so
    those run at the reduced size and the network costs what a strided one does; stage 1 pools
    after its first convolution, so raw pixels are never max-pooled (a 2×2 max over a thin dark
    stroke on a light ground would erase it). 32×32 inputs end at 2×2, 224×224 at 14×14; about
    0.84M parameters and 13M multiply-adds at 32×32. Kaiming-normal init as torchvision's ResNets.
    """
    c1 = SMALL_CNN_CHANNELS[0]
    layers = [("stage1", nn.Sequential(*_conv_bn_relu(3, c1), nn.MaxPool2d(2), *_conv_bn_relu(c1, c1)))]
    for i, (cin, cout) in enumerate(zip(SMALL_CNN_CHANNELS, SMALL_CNN_CHANNELS[1:]), 2):
        layers.append(
            (f"stage{i}", nn.Sequential(nn.MaxPool2d(2), *_conv_bn_relu(cin, cout), *_conv_bn_relu(cout, cout)))
        )
    backbone = LayerChain(name, layers, {f"stage{i}": c for i, c in enumerate(SMALL_CNN_CHANNELS, 1)})
    for m in backbone.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return backbone


# -- registry -------------------------------------------------------------------------------------------
# name -> (builder(pretrained: bool) -> LayerChain, torchvision ImageNet weights "Enum.MEMBER" or None)
BACKBONES: dict[str, tuple[Callable[[bool], LayerChain], str | None]] = {
    "resnet18": (lambda _: _resnet("resnet18"), "ResNet18_Weights.IMAGENET1K_V1"),
    "resnet34": (lambda _: _resnet("resnet34"), "ResNet34_Weights.IMAGENET1K_V1"),
    "resnet50": (lambda _: _resnet("resnet50"), "ResNet50_Weights.IMAGENET1K_V2"),
    "resnet101": (lambda _: _resnet("resnet101"), "ResNet101_Weights.IMAGENET1K_V2"),
    "resnet152": (lambda _: _resnet("resnet152"), "ResNet152_Weights.IMAGENET1K_V2"),
    "resnext50_32x4d": (lambda _: _resnet("resnext50_32x4d"), "ResNeXt50_32X4D_Weights.IMAGENET1K_V2"),
    "wide_resnet50_2": (lambda _: _resnet("wide_resnet50_2"), "Wide_ResNet50_2_Weights.IMAGENET1K_V2"),
    "googlenet": (
        lambda pretrained: _googlenet("googlenet", transform_input=pretrained),
        "GoogLeNet_Weights.IMAGENET1K_V1",
    ),
    "small_cnn": (lambda _: small_cnn(), None),
}


def build_backbone(
    name: str,
    pretrained: bool = False,
    *,
    image_size: int | None = None,
    drop_path: float = 0.0,
    features: str = "auto",
) -> Backbone:
    """A randomly initialised backbone by name (weights are loaded by :mod:`.pretrained`).

    ``pretrained`` only changes the architecture where torchvision does: GoogLeNet's ported
    weights expect ``transform_input``, so it is on whenever weights will be loaded. ``image_size``,
    ``drop_path`` and ``features`` concern timm models (see :func:`~.timm_backbones.build_timm_backbone`);
    a torchvision backbone refuses a drop-path rate (it has no stochastic depth).
    """
    if name in BACKBONES:
        if drop_path:
            raise UserError(
                f"model.drop_path: {name} (torchvision) has no stochastic depth; use 0, or a timm backbone "
                f"(e.g. timm:{name})"
            )
        if features not in ("auto", "patches"):
            raise UserError(
                f"model.features: {features} is for timm models; {name} gives its last feature map (auto or patches)"
            )
        return BACKBONES[name][0](pretrained)
    if timm_name(name) is None:
        raise UserError(
            f"model.backbone: unknown backbone '{name}' (choose from {', '.join(BACKBONES)}, or a timm model name)"
        )
    return build_timm_backbone(name, image_size=image_size, drop_path=drop_path, features=features)


def imagenet_weights(name: str):
    """The torchvision weights enum member for ``name``, or None when there is none."""
    spec = BACKBONES[name][1] if name in BACKBONES else None
    if spec is None:
        return None

    enum_name, member = spec.split(".")
    return getattr(getattr(tvm, enum_name), member)
