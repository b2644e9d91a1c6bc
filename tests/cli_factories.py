"""Model factories for the command-line tests, imported as ``cli_factories:NAME``."""

from __future__ import annotations

import torch
from torch import nn

from remat.models import mlp_chain

WIDTH = 16
"""Features of the tiny MLP chains (the input shape for ``--input-shape``)."""

NOT_CALLABLE = 3


def tiny_mlp() -> nn.Sequential:
    """Four MLP blocks of width 16: needs ``--input-shape 16``."""
    return mlp_chain(depth=4, width=WIDTH)


def tiny_mlp_with_input() -> tuple[nn.Sequential, torch.Tensor]:
    """Four MLP blocks with a sample input of batch 8."""
    return mlp_chain(depth=4, width=WIDTH), torch.randn(8, WIDTH)


def not_a_module() -> object:
    """A factory that returns no module."""
    return "a model"


class Blocks(nn.Module):
    """A model with its own forward looping over blocks (not an ``nn.Sequential``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def blocks_with_input() -> tuple[nn.Module, torch.Tensor]:
    """A looping model with a sample input of batch 64."""
    return Blocks(), torch.randn(64, WIDTH)


def raises() -> nn.Sequential:
    """A factory with a bug."""
    raise ValueError("boom")


def cuda_out_of_memory() -> nn.Sequential:
    """A model too big for the GPU."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def cpu_out_of_memory() -> nn.Sequential:
    """A model too big for the RAM (the message of torch's CPU allocator)."""
    raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4398046511104 bytes. Error code 12"
    )


def python_out_of_memory() -> nn.Sequential:
    """A model whose construction exhausts Python's memory."""
    raise MemoryError()
