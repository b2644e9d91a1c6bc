"""Models whose forward is written the way people write it, not as an ``nn.Sequential``.

A residual loop over a ``ModuleList`` (:class:`ResidualLoop`, in four spellings), a loop
whose blocks take side inputs by keyword (:class:`SideInputs`), an encoder-decoder whose
decoder blocks take the encoder's output (:class:`EncoderDecoder`), and a U-Net that keeps
each down block's output for its up block (:class:`UNet`). remat finds each as one chain
of its blocks; the catalogue trains them on synthetic data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RESIDUAL_KINDS", "ConvBNReLU", "EncoderDecoder", "ResidualLoop", "SideInputBlock", "SideInputs", "UNet"]

#: The ways :class:`ResidualLoop` writes its loop.
RESIDUAL_KINDS = ("add after", "add before", "pre-norm, scaled", "post-norm")


class SideInputBlock(nn.Module):
    """An MLP block with dropout, taking optional side inputs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if positions is not None:
            x = x + positions
        if rotary is not None:
            cos, sin = rotary
            x = x * cos + x.roll(1, -1) * sin
        if memory is not None:
            x = x + memory.mean(1, keepdim=True)
        h = self.down(F.gelu(self.up(x)))
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return self.drop(h)


class ResidualLoop(nn.Module):
    """``n`` blocks in a residual loop, written in one of several ways."""

    def __init__(self, kind: str = "pre-norm, scaled", n: int = 6, width: int = 32, features: int = 16) -> None:
        super().__init__()
        if kind not in RESIDUAL_KINDS:
            raise ValueError(f"kind must be one of {', '.join(RESIDUAL_KINDS)}, got {kind!r}")
        self.kind = kind
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(SideInputBlock(width) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(n))
        self.gamma = nn.Parameter(torch.full((n, width), 0.5))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i, block in enumerate(self.blocks):
            if self.kind == "add after":
                x = x + block(x)
            elif self.kind == "add before":
                x = block(x) + x
            elif self.kind == "pre-norm, scaled":
                x = x + self.gamma[i] * block(self.norms[i](x))
            else:  # "post-norm"
                x = self.norms[i](x + block(x))
        return self.head(x)


class SideInputs(nn.Module):
    """A loop over blocks that take a mask, positions and rotary tables as keywords."""

    def __init__(self, style: str = "zip", n: int = 6, width: int = 32, features: int = 16, length: int = 24) -> None:
        super().__init__()
        if style not in ("zip", "indexing"):
            raise ValueError(f"style must be 'zip' or 'indexing', got {style!r}")
        self.style = style
        self.width = width
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(SideInputBlock(width) for _ in range(n))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(n))
        self.positions = nn.Parameter(torch.randn(1, length, width) * 0.02)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        seq = x.shape[1]
        mask = (torch.arange(self.width, device=x.device) % 5 == 0).expand(seq, self.width)
        angles = torch.arange(seq, dtype=x.dtype, device=x.device)[:, None] / 10.0
        rotary = (torch.cos(angles), torch.sin(angles))
        extra = {"mask": mask, "positions": self.positions[:, :seq], "rotary": rotary}
        if self.style == "zip":
            for block, norm in zip(self.blocks, self.norms, strict=True):
                x = x + block(norm(x), **extra)
        else:  # "indexing"
            for i in range(len(self.blocks)):
                x = x + self.blocks[i](self.norms[i](x), **extra)
        return self.head(x)


class EncoderDecoder(nn.Module):
    """Two residual loops: the decoder's blocks take the encoder's output as memory."""

    def __init__(
        self,
        n_encoder: int = 4,
        n_decoder: int = 4,
        width: int = 32,
        source_features: int = 16,
        target_features: int = 8,
    ) -> None:
        super().__init__()
        self.source = nn.Linear(source_features, width)
        self.target = nn.Linear(target_features, width)
        self.encoder = nn.ModuleList(SideInputBlock(width) for _ in range(n_encoder))
        self.decoder = nn.ModuleList(SideInputBlock(width) for _ in range(n_decoder))
        self.encoder_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 4)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        memory = self.source(source)
        for block in self.encoder:
            memory = memory + block(memory)
        memory = self.encoder_norm(memory)
        y = self.target(target)
        for block in self.decoder:
            y = y + block(y, memory=memory)
        return self.head(y)


class ConvBNReLU(nn.Sequential):
    """Convolution, BatchNorm, ReLU."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__(
            nn.Conv2d(channels_in, channels_out, 3, padding=1),
            nn.BatchNorm2d(channels_out),
            nn.ReLU(),
        )


class UNet(nn.Module):
    """Down blocks whose outputs are kept as skips, up blocks that concatenate them."""

    def __init__(self, depth: int = 3, channels: int = 8, classes: int = 2) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.downs = nn.ModuleList(ConvBNReLU(widths[i], widths[i + 1]) for i in range(depth))
        self.middle = ConvBNReLU(widths[-1], widths[-1])
        self.ups = nn.ModuleList(ConvBNReLU(widths[i + 1] * 2, widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(channels, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.middle(x)
        for up in self.ups:
            x = F.interpolate(x, scale_factor=2.0)
            x = up(torch.cat([x, skips.pop()], dim=1))
        return self.out(x)
