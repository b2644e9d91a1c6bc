"""Synthetic chains: a uniform MLP and a heterogeneous convolutional network."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from remat.models._vgg import ConvBlock

__all__ = ["MLPBlock", "convnet", "mlp_chain"]


class MLPBlock(nn.Module):
    """``Linear(width, expansion * width)``, GELU, ``Linear(expansion * width, width)``.

    Args:
        width: size of the input and output features.
        expansion: ratio of the hidden width to ``width``.
    """

    def __init__(self, width: int, *, expansion: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, expansion * width)
        self.activation = nn.GELU()
        self.fc2 = nn.Linear(expansion * width, width)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block to ``x``, shaped ``(..., width)``."""
        return self.fc2(self.activation(self.fc1(x)))


def mlp_chain(depth: int = 8, width: int = 256, *, expansion: int = 4) -> nn.Sequential:
    """A uniform chain of ``depth`` identical :class:`MLPBlock` stages.

    Every stage has the same costs, which makes this the simplest chain to
    check a planner on. Input and output are ``(batch, width)``.

    Args:
        depth: number of blocks.
        width: size of the features between blocks.
        expansion: ratio of each block's hidden width to ``width``.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        ValueError: ``depth`` or ``width`` is below 1.
    """
    if depth < 1 or width < 1:
        raise ValueError(f"depth and width must be positive, got depth={depth}, width={width}")
    return nn.Sequential(*(MLPBlock(width, expansion=expansion) for _ in range(depth)))


def convnet(num_classes: int = 10, *, width: int = 32, in_channels: int = 3) -> nn.Sequential:
    """A heterogeneous convolutional chain for 32x32 images.

    Stages differ in channels, resolution and cost: :class:`ConvBlock` stages
    (convolution, batch norm, in-place ReLU) at ``width`` to ``8*width``
    channels, downsampling by strided convolutions and by one max pooling, then
    average pooling, flatten and a linear classifier.

    Args:
        num_classes: outputs of the classifier.
        width: channels of the first convolution.
        in_channels: channels of the input images.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.
    """
    return nn.Sequential(
        OrderedDict(
            conv1=ConvBlock(in_channels, width, batch_norm=True, bias=False),
            conv2=ConvBlock(width, width, batch_norm=True, bias=False),
            pool1=nn.MaxPool2d(2),
            conv3=ConvBlock(width, 2 * width, batch_norm=True, bias=False),
            conv4=ConvBlock(2 * width, 2 * width, batch_norm=True, bias=False),
            conv5=ConvBlock(2 * width, 4 * width, batch_norm=True, stride=2, bias=False),
            conv6=ConvBlock(4 * width, 4 * width, batch_norm=True, bias=False),
            conv7=ConvBlock(4 * width, 8 * width, batch_norm=True, stride=2, bias=False),
            avgpool=nn.AdaptiveAvgPool2d((1, 1)),
            flatten=nn.Flatten(1),
            fc=nn.Linear(8 * width, num_classes),
        )
    )
