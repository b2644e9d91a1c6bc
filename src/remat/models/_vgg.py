"""VGG-11/13/16/19 as chains, with or without batch normalisation."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch import Tensor, nn

from remat.models._weights import depth_factory

__all__ = ["ConvBlock", "LinearBlock", "vgg", "vgg11", "vgg13", "vgg16", "vgg19"]

# Channels of each 3x3 convolution at width 64; "M" is a 2x2 max pooling.
_LAYOUTS: dict[int, tuple[int | str, ...]] = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (
        64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
        512, 512, 512, "M", 512, 512, 512, "M",
    ),
    19: (
        64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
        512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
    ),
}  # fmt: skip


class ConvBlock(nn.Module):
    """A 3x3 convolution, an optional batch norm and an in-place ReLU.

    The ReLU is fused into the block so that it acts on a tensor the block made,
    never on the block's input.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        batch_norm: put a :class:`~torch.nn.BatchNorm2d` between the
            convolution and the ReLU.
        stride: stride of the convolution.
        bias: give the convolution a bias.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        batch_norm: bool = False,
        stride: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(out_channels) if batch_norm else None
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block."""
        out = self.conv(x)
        if self.bn is not None:
            out = self.bn(out)
        return self.relu(out)


class LinearBlock(nn.Module):
    """A linear layer, an in-place ReLU and dropout (a VGG classifier layer).

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        dropout: dropout probability after the ReLU.
    """

    def __init__(self, in_features: int, out_features: int, *, dropout: float = 0.5) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block."""
        return self.dropout(self.relu(self.linear(x)))


def _initialize(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
            nn.init.zeros_(module.bias)


def vgg(
    depth: int,
    num_classes: int = 1000,
    *,
    batch_norm: bool = False,
    width: int = 64,
    hidden_features: int = 4096,
    image_size: int = 224,
    dropout: float = 0.5,
    in_channels: int = 3,
) -> nn.Sequential:
    """A VGG network as a chain.

    The chain is ``features`` (a nested :class:`~torch.nn.Sequential` of
    :class:`ConvBlock` and max-pooling stages), ``avgpool``, ``flatten`` and
    ``classifier`` (two :class:`LinearBlock` and a final linear layer).

    Args:
        depth: 11, 13, 16 or 19.
        num_classes: outputs of the final linear layer.
        batch_norm: use batch normalisation after every convolution.
        width: channels of the first convolution (64 in the original); all
            convolutions are scaled by ``width / 64``.
        hidden_features: size of the two hidden classifier layers.
        image_size: side of the input images; the feature map is pooled to
            ``max(1, image_size // 32)`` on each side (7 for 224, 1 for 32), so
            small images give a small classifier.
        dropout: dropout probability in the classifier.
        in_channels: channels of the input images.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        ValueError: ``depth`` is not one of the four known depths.
    """
    if depth not in _LAYOUTS:
        known = ", ".join(str(d) for d in _LAYOUTS)
        raise ValueError(f"unknown VGG depth {depth}; choose one of: {known}")
    features: list[nn.Module] = []
    channels = in_channels
    for item in _LAYOUTS[depth]:
        if item == "M":
            features.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            out_channels = int(item) * width // 64
            features.append(ConvBlock(channels, out_channels, batch_norm=batch_norm))
            channels = out_channels
    pooled = max(1, image_size // 32)
    model = nn.Sequential(
        OrderedDict(
            features=nn.Sequential(*features),
            avgpool=nn.AdaptiveAvgPool2d((pooled, pooled)),
            flatten=nn.Flatten(1),
            classifier=nn.Sequential(
                LinearBlock(channels * pooled * pooled, hidden_features, dropout=dropout),
                LinearBlock(hidden_features, hidden_features, dropout=dropout),
                nn.Linear(hidden_features, num_classes),
            ),
        )
    )
    _initialize(model)
    return model


def _of_depth(depth: int, configuration: str) -> Callable[..., nn.Sequential]:
    return depth_factory(
        vgg,
        f"vgg{depth}",
        depth,
        f'VGG-{depth} (configuration "{configuration}") as a chain; keyword options '
        "(``batch_norm``, ``width``, ``hidden_features``, ``image_size``, ``dropout``) as for :func:`vgg`.",
    )


vgg11 = _of_depth(11, "A")
vgg13 = _of_depth(13, "B")
vgg16 = _of_depth(16, "D")
vgg19 = _of_depth(19, "E")
