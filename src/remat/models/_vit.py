"""A ViT-style image classifier (transformer encoder over patches) as a chain."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from remat.models._transformer import TransformerBlock

__all__ = ["ClassTokenHead", "PatchEmbedding", "ViTConfig", "vit"]


@dataclass(frozen=True)
class ViTConfig:
    """The shape of a ViT-style model. The defaults are ViT-B/16 at 224x224.

    Attributes:
        image_size: side of the (square) input images.
        patch_size: side of the square patches; must divide ``image_size``.
        in_channels: channels of the input images.
        num_classes: outputs of the head.
        d_model: width of the tokens.
        n_heads: attention heads per block.
        n_layers: number of transformer blocks.
        mlp_dim: width of the feed-forward hidden layers.
        dropout: dropout after the embeddings, the attention projection and in
            the MLPs.
        attention_dropout: dropout on the attention probabilities.
        layer_norm_eps: epsilon of every layer norm.
    """

    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    mlp_dim: int = 3072
    dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-6


class PatchEmbedding(nn.Module):
    """Patches to tokens, a class token in front, plus position embeddings.

    The first stage of the chain: images ``(batch, channels, size, size)`` in,
    tokens ``(batch, 1 + patches, d_model)`` out.

    Args:
        image_size: side of the input images.
        patch_size: side of the patches; must divide ``image_size``.
        in_channels: channels of the input images.
        d_model: width of the tokens.
        dropout: dropout on the tokens.

    Raises:
        ValueError: ``patch_size`` does not divide ``image_size``.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_channels: int,
        d_model: int,
        *,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size != 0:
            raise ValueError(f"patch_size ({patch_size}) must divide image_size ({image_size})")
        patches = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.position = nn.Parameter(torch.empty(1, patches + 1, d_model).normal_(std=0.02))
        self.projection = nn.Conv2d(in_channels, d_model, patch_size, stride=patch_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, images: Tensor) -> Tensor:
        """Embeds ``images``."""
        patches = self.projection(images).flatten(2).transpose(1, 2)
        class_token = self.class_token.expand(patches.shape[0], -1, -1)
        return self.dropout(torch.cat([class_token, patches], dim=1) + self.position)


class ClassTokenHead(nn.Module):
    """A linear classifier on the class token (the first token).

    Args:
        d_model: width of the tokens.
        num_classes: number of outputs.
    """

    def __init__(self, d_model: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Returns logits ``(batch, num_classes)`` from tokens ``(batch, tokens, d_model)``."""
        return self.linear(x[:, 0])


def _initialize(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.normal_(module.bias, std=1e-6)
        elif isinstance(module, nn.Conv2d):
            nn.init.trunc_normal_(module.weight, std=(1.0 / module.weight[0].numel()) ** 0.5)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def vit(config: ViTConfig | None = None, **overrides: Any) -> nn.Sequential:
    """A ViT-style encoder classifier as a chain.

    The chain is ``embedding`` (:class:`PatchEmbedding`), ``blocks`` (a nested
    :class:`~torch.nn.Sequential` of pre-LN :class:`TransformerBlock`),
    ``norm`` and ``head`` (:class:`ClassTokenHead`).

    Args:
        config: the model shape; ViT-B/16 when ``None``.
        **overrides: fields of :class:`ViTConfig` to replace, for example
            ``vit(image_size=32, patch_size=4)``.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        TypeError: an override is not a field of :class:`ViTConfig`.
        ValueError: the patch size does not divide the image size, or the heads
            do not divide ``d_model``.
    """
    config = dataclasses.replace(config or ViTConfig(), **overrides)
    blocks = nn.Sequential(
        *(
            TransformerBlock(
                config.d_model,
                config.n_heads,
                config.mlp_dim,
                dropout=config.dropout,
                attention_dropout=config.attention_dropout,
                mlp_inner_dropout=True,
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.n_layers)
        )
    )
    model = nn.Sequential(
        OrderedDict(
            embedding=PatchEmbedding(
                config.image_size,
                config.patch_size,
                config.in_channels,
                config.d_model,
                dropout=config.dropout,
            ),
            blocks=blocks,
            norm=nn.LayerNorm(config.d_model, eps=config.layer_norm_eps),
            head=ClassTokenHead(config.d_model, config.num_classes),
        )
    )
    _initialize(model)
    return model
