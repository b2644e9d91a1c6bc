"""ResNet-18/34/50/101/152 and a small CIFAR-style ResNet, as chains.

The chains keep the parameter order *and* the parameter names of the usual
ImageNet ResNet (``conv1``, ``bn1``, ``layer1.0.conv1``, ..., ``fc``), so a
state dict saved from that layout loads with ``load_state_dict``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from torch import Tensor, nn

from remat.models._weights import depth_factory

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "resnet",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnet_small",
]


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """The 1x1 projection a block needs when its shape changes, or ``None``."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection, ReLU at the end.

    One stage of a chain: it takes one tensor and returns one tensor, and never
    writes to its input (the in-place ReLUs act on tensors the block made).

    Args:
        in_channels: channels of the input.
        channels: channels of the output (``expansion`` is 1).
        stride: stride of the first convolution (2 halves the resolution).
    """

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample = _shortcut(in_channels, channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, with a residual connection.

    The stride sits on the 3x3 convolution (the "v1.5" variant). Like
    :class:`BasicBlock`, it is one stage of a chain with its ReLU inside.

    Args:
        in_channels: channels of the input.
        channels: channels of the inner convolutions; the output has
            ``channels * expansion`` (4x) channels.
        stride: stride of the 3x3 convolution.
    """

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        """Applies the block."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


_LAYOUTS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


def _stage(
    block: type[BasicBlock] | type[Bottleneck],
    in_channels: int,
    channels: int,
    count: int,
    stride: int,
) -> tuple[nn.Sequential, int]:
    """``count`` blocks, the first strided; returns them and the output channels."""
    blocks = []
    for index in range(count):
        blocks.append(block(in_channels, channels, stride if index == 0 else 1))
        in_channels = channels * block.expansion
    return nn.Sequential(*blocks), in_channels


def _initialize(model: nn.Module, *, zero_init_residual: bool) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if zero_init_residual:
        for module in model.modules():
            if isinstance(module, Bottleneck):
                nn.init.zeros_(module.bn3.weight)
            elif isinstance(module, BasicBlock):
                nn.init.zeros_(module.bn2.weight)


def resnet(
    depth: int,
    num_classes: int = 1000,
    *,
    width: int = 64,
    in_channels: int = 3,
    zero_init_residual: bool = False,
) -> nn.Sequential:
    """An ImageNet ResNet as a chain.

    The chain is ``conv1, bn1, relu, maxpool, layer1 .. layer4, avgpool,
    flatten, fc``, where each ``layerN`` is a nested :class:`~torch.nn.Sequential`
    of residual blocks (one stage each once flattened). Any input size from
    about 32x32 up works thanks to the adaptive average pooling. The parameter
    and buffer names are those of the usual hand-written ResNet, so its state
    dict loads with :meth:`~torch.nn.Module.load_state_dict`.

    .. note::
        The stem ReLU is a stage of its own, so it is not in place (a stage
        must not overwrite its input); the ReLUs inside the blocks are.

    Args:
        depth: 18, 34, 50, 101 or 152.
        num_classes: outputs of the final linear layer.
        width: channels after the stem; the stages use ``width``, ``2*width``,
            ``4*width`` and ``8*width`` (64 is the original; small values make
            fast test models with the same structure).
        in_channels: channels of the input images.
        zero_init_residual: start the last batch norm of every block at zero,
            so that each block starts as the identity.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        ValueError: ``depth`` is not one of the five known depths.
    """
    if depth not in _LAYOUTS:
        known = ", ".join(str(d) for d in _LAYOUTS)
        raise ValueError(f"unknown ResNet depth {depth}; choose one of: {known}")
    block, counts = _LAYOUTS[depth]
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False),
        bn1=nn.BatchNorm2d(width),
        relu=nn.ReLU(),
        maxpool=nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )
    channels = width
    for index, count in enumerate(counts):
        stride = 1 if index == 0 else 2
        layers[f"layer{index + 1}"], channels = _stage(block, channels, width * 2**index, count, stride)
    layers["avgpool"] = nn.AdaptiveAvgPool2d((1, 1))
    layers["flatten"] = nn.Flatten(1)
    layers["fc"] = nn.Linear(channels, num_classes)
    model = nn.Sequential(layers)
    _initialize(model, zero_init_residual=zero_init_residual)
    return model


def _of_depth(depth: int, layout: str) -> Callable[..., nn.Sequential]:
    return depth_factory(
        resnet,
        f"resnet{depth}",
        depth,
        f"ResNet-{depth} ({layout}) as a chain; keyword options (``width``, ``in_channels``, "
        "``zero_init_residual``) as for :func:`resnet`.",
    )


resnet18 = _of_depth(18, "basic blocks 2-2-2-2")
resnet34 = _of_depth(34, "basic blocks 3-4-6-3")
resnet50 = _of_depth(50, "bottlenecks 3-4-6-3")
resnet101 = _of_depth(101, "bottlenecks 3-4-23-3")
resnet152 = _of_depth(152, "bottlenecks 3-8-36-3")


def resnet_small(
    num_classes: int = 10,
    *,
    width: int = 16,
    blocks_per_stage: Sequence[int] = (2, 2, 2),
    in_channels: int = 3,
) -> nn.Sequential:
    """A small CIFAR-style ResNet chain for 32x32 images.

    A 3x3 stem without max pooling, then one stage of :class:`BasicBlock` per
    entry of ``blocks_per_stage`` (channels ``width``, ``2*width``, ``4*width``,
    ...; every stage after the first halves the resolution), average pooling
    and a linear classifier. The defaults (about 0.17 M parameters) train a few
    steps in seconds on two CPU cores at batch 16.

    Args:
        num_classes: outputs of the final linear layer.
        width: channels of the first stage.
        blocks_per_stage: number of blocks in each stage.
        in_channels: channels of the input images.

    Returns:
        The model, an :class:`~torch.nn.Sequential`.

    Raises:
        ValueError: ``blocks_per_stage`` is empty or holds a count below 1.
    """
    if not blocks_per_stage or min(blocks_per_stage) < 1:
        raise ValueError(f"blocks_per_stage must be a non-empty list of positive counts, got {blocks_per_stage!r}")
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(in_channels, width, kernel_size=3, padding=1, bias=False),
        bn1=nn.BatchNorm2d(width),
        relu=nn.ReLU(),
    )
    channels = width
    for index, count in enumerate(blocks_per_stage):
        stride = 1 if index == 0 else 2
        layers[f"layer{index + 1}"], channels = _stage(BasicBlock, channels, width * 2**index, count, stride)
    layers["avgpool"] = nn.AdaptiveAvgPool2d((1, 1))
    layers["flatten"] = nn.Flatten(1)
    layers["fc"] = nn.Linear(channels, num_classes)
    model = nn.Sequential(layers)
    _initialize(model, zero_init_residual=False)
    return model
