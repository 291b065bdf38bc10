"""What the embedding model needs of a network: :class:`Backbone`, the interface every backbone implements.

A module of its own so that the backbone families (:mod:`.backbones`: torchvision and ``small_cnn``;
:mod:`.timm_backbones`: any timm model) each import it, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from dmltrain.errors import UserError


class Backbone(nn.Module):
    """What the embedding model needs of a network: named stages and their channels, ``forward(x, stages)``.

    ``stage_channels`` maps each tappable stage name (in network order) to its output
    channels. ``forward(x, stages)`` returns the feature maps (``B × C × H × W``) of ``stages`` in the
    order asked; with ``stages=None`` it returns ``[last stage]``.
    """

    name: str
    stage_channels: dict[str, int]
    #: convolutional (channels_last helps) rather than a transformer over patch tokens
    convolutional: bool = True

    @property
    def stage_names(self) -> tuple[str, ...]:
        return tuple(self.stage_channels)

    @property
    def out_channels(self) -> int:
        """Channels of the last stage: the features a single-level head pools."""
        return self.stage_channels[self.stage_names[-1]]

    def check_stages(self, stages: Sequence[str]) -> None:
        """Raise a one-line :class:`UserError` for a stage name this network does not have."""
        for s in stages:
            if s not in self.stage_channels:
                raise UserError(
                    f"model.multilevel: unknown stage '{s}' for {self.name} (stages: {', '.join(self.stage_names)})"
                )
        if len(set(stages)) != len(stages):
            raise UserError(f"model.multilevel: a stage is listed twice in {list(stages)}")

    def set_grad_checkpointing(self, enable: bool = True) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def layer_ids(self) -> dict[str, int]:  # pragma: no cover - abstract
        """Each parameter's layer, 0 at the input, rising towards the output (layer-wise learning-rate decay)."""
        raise NotImplementedError

    def no_weight_decay(self) -> set[str]:
        """Names of parameters of more than one dimension that are not decayed with ``decay_norm_and_bias=False``
        (a ViT's class token and position embeddings); none here."""
        return set()

    def forward(self, x: Tensor, stages: Sequence[str] | None = None) -> list[Tensor]:  # pragma: no cover
        raise NotImplementedError
