"""Models in their usual hand-written layout, each with an explicit ``forward``.

They are the yardstick for ``remat.models``: the chains there must compute the
same function with the same parameters, in the same order, so that
``remat.models.copy_weights(reference, chain)`` (or a ``zip`` over
``parameters()``) moves the weights across. Tests that need a model written
the ordinary way (loops over a ``ModuleList``, side inputs built in
``forward``) can use them too.

Nothing here depends on ``remat``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "GPT",
    "VGG",
    "BasicBlock",
    "Bottleneck",
    "ResNet",
    "TanhResidual",
    "ViT",
    "resnet",
    "vgg",
]


# ----------------------------------------------------------------------------- a small block


class TanhResidual(nn.Module):
    """``x + tanh(linear(x))``: a residual block of one layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.linear(x))


# ----------------------------------------------------------------------------- ResNet


def _projection(in_planes: int, out_planes: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False),
        nn.BatchNorm2d(out_planes),
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut; the shortcut projection is passed in."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class Bottleneck(nn.Module):
    """1x1, 3x3 (carrying the stride), 1x1 with 4x expansion, and a shortcut."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


RESNET_LAYERS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
    152: (Bottleneck, [3, 8, 36, 3]),
}


class ResNet(nn.Module):
    """The ImageNet ResNet: stem, four stages of blocks, pooling, linear classifier.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        layers: number of blocks in each of the four stages.
        num_classes: outputs of ``fc``.
        width: channels of the stem (64 in the original).
        in_channels: channels of the input images.
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: list[int],
        num_classes: int = 1000,
        width: int = 64,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def _make_layer(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        planes: int,
        blocks: int,
        stride: int = 1,
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = _projection(self.inplanes, planes * block.expansion, stride)
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        for _ in range(1, blocks):
            layers.append(block(self.inplanes, planes))
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x


def resnet(depth: int, num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> ResNet:
    """The reference ResNet of the given depth (18, 34, 50, 101 or 152)."""
    block, layers = RESNET_LAYERS[depth]
    return ResNet(block, layers, num_classes=num_classes, width=width, in_channels=in_channels)


# ----------------------------------------------------------------------------- VGG

VGG_LAYERS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [
        64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
        512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
    ],
}  # fmt: skip


class VGG(nn.Module):
    """VGG: a ``features`` Sequential, adaptive pooling, flatten, ``classifier``.

    Args:
        layers: channels of each convolution at width 64, ``"M"`` for max pooling.
        num_classes: outputs of the classifier.
        batch_norm: batch norm after every convolution.
        width: channels of the first convolution; all are scaled by ``width / 64``.
        hidden_features: width of the two hidden classifier layers.
        image_size: input side; features are pooled to ``max(1, image_size // 32)``.
        dropout: dropout in the classifier.
        in_channels: channels of the input images.
    """

    def __init__(
        self,
        layers: list[int | str],
        num_classes: int = 1000,
        batch_norm: bool = False,
        width: int = 64,
        hidden_features: int = 4096,
        image_size: int = 224,
        dropout: float = 0.5,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        modules: list[nn.Module] = []
        channels = in_channels
        for item in layers:
            if item == "M":
                modules.append(nn.MaxPool2d(kernel_size=2, stride=2))
                continue
            out_channels = int(item) * width // 64
            modules.append(nn.Conv2d(channels, out_channels, kernel_size=3, padding=1))
            if batch_norm:
                modules.append(nn.BatchNorm2d(out_channels))
            modules.append(nn.ReLU(inplace=True))
            channels = out_channels
        self.features = nn.Sequential(*modules)
        pooled = max(1, image_size // 32)
        self.avgpool = nn.AdaptiveAvgPool2d((pooled, pooled))
        self.classifier = nn.Sequential(
            nn.Linear(channels * pooled * pooled, hidden_features),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden_features, hidden_features),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden_features, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def vgg(depth: int, num_classes: int = 1000, **kwargs: int | float | bool) -> VGG:
    """The reference VGG of the given depth (11, 13, 16 or 19); ``kwargs`` go to :class:`VGG`."""
    return VGG(VGG_LAYERS[depth], num_classes, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- GPT-2


class CausalSelfAttention(nn.Module):
    """Multi-head attention; the causal mask arrives as an argument."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, t, c = x.shape
        hd = c // self.n_heads
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.n_heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if mask is not None:
            att = att.masked_fill(mask.logical_not(), float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class GPTBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x), mask)``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, layer_norm_eps: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln_2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        x = x + self.dropout(self.c_proj(self.gelu(self.c_fc(self.ln_2(x)))))
        return x


class GPT(nn.Module):
    """A GPT-2-style language model with a loop over its blocks.

    The keyword arguments are the fields of ``remat.models.GPTConfig``, so
    ``GPT(**dataclasses.asdict(config))`` builds the matching reference.
    """

    def __init__(
        self,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        d_model: int = 768,
        n_heads: int = 12,
        n_layers: int = 12,
        dropout: float = 0.1,
        tie_weights: bool = True,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(n_positions, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPTBlock(d_model, n_heads, dropout, layer_norm_eps) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=idx.device))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x, mask)
        x = self.ln_f(x)
        return self.lm_head(x)


# ----------------------------------------------------------------------------- ViT


class ViTBlock(nn.Module):
    """Pre-LN encoder block without a mask; MLP ``Linear, GELU, Dropout, Linear, Dropout``."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float,
        layer_norm_eps: float,
    ) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.attn = CausalSelfAttention(d_model, n_heads, attention_dropout)
        # The output dropout of the attention uses ``dropout``, not the attention rate.
        self.attn.resid_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), None)
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """A ViT-style classifier: patches, class token, positions, blocks, norm, head.

    The keyword arguments are the fields of ``remat.models.ViTConfig``.
    """

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        in_channels: int = 3,
        num_classes: int = 1000,
        d_model: int = 768,
        n_heads: int = 12,
        n_layers: int = 12,
        mlp_dim: int = 3072,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        layer_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        n_patches = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embedding = nn.Parameter(torch.randn(1, n_patches + 1, d_model) * 0.02)
        self.conv_proj = nn.Conv2d(in_channels, d_model, patch_size, stride=patch_size)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            ViTBlock(d_model, n_heads, mlp_dim, dropout, attention_dropout, layer_norm_eps) for _ in range(n_layers)
        )
        self.ln = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_proj(x)
        x = x.flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embedding
        x = self.dropout(x)
        for layer in self.layers:
            x = layer(x)
        x = self.ln(x)
        return self.head(x[:, 0])


def small_levit() -> tuple[nn.Module, dict[str, Tensor]]:
    """A small Hugging Face LeViT classifier in training mode (seeded) and one batch of its
    training inputs; its subsampling attention takes the keys and values from the stage
    that ends with the queries' subsample. Needs transformers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LevitConfig(
        image_size=64, patch_size=16, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
        key_dim=[8, 8, 8], num_labels=10,
    )  # fmt: skip
    model = transformers.LevitForImageClassification(config).train()
    return model, {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 10, (2,))}
