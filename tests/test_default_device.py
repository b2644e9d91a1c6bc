"""The default device of the forward holds in its recompute (NOTE [the default device in a recompute]).

A backward never sees the forward's `torch.set_default_device` or `with torch.device(...)`
(on a GPU it runs on the autograd engine's own thread; on a CPU torch runs it without the
Python modes). On a CPU the case is made with the meta device: the forward runs inside
`torch.device("meta")`, the backward outside. Without the fix, a block's device-less
tensors come out on the CPU in its recompute and the backward fails.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import remat
from remat import policies

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class MaskedMix(nn.Module):
    """Makes device-less tensors in its forward: a causal mask, a ramp, a scalar."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        scores = (x @ x.transpose(-1, -2)).masked_fill(~mask, float("-inf")).softmax(-1)
        ramp = torch.arange(x.shape[-1], dtype=x.dtype) / x.shape[-1]
        return self.drop(self.proj(scores @ x) * (ramp + torch.tensor(0.5)))


RUNS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "hooks": lambda m, x: remat.recompute(m, x),
    "reentrant": lambda m, x: remat.recompute(m, x, use_reentrant=True),
    "policy": lambda m, x: remat.recompute(m, x, policy=policies.save_matmuls),
    "marked": lambda m, x: remat.mark(m)(x),
}


@pytest.mark.parametrize("how", sorted(RUNS))
def test_a_forward_under_a_device_context_is_recomputed_under_it(how: str) -> None:
    with torch.device("meta"):
        model = MaskedMix()
        x = torch.randn(2, 5, 6, requires_grad=True)
        out = RUNS[how](model, x)
    assert out.device.type == "meta"
    out.sum().backward()  # outside the context: the recompute still makes meta tensors
    assert x.grad is not None and x.grad.device.type == "meta"
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
