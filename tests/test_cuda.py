"""CUDA variants: device RNG replay, and the planner's prediction against the CUDA allocator.

These run only where a CUDA device is present (they skip on the CPU-only CI).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mlp(width: int = 512, depth: int = 8, p: float = 0.2) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(p), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_dropout_on_cuda_is_bit_identical(use_reentrant: bool) -> None:
    torch.manual_seed(0)
    model = _mlp().cuda()
    x = torch.randn(64, 512, device="cuda", requires_grad=True)

    def run(recomputed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.cuda.manual_seed(123)
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = remat.recompute(model, x, use_reentrant=use_reentrant) if recomputed else model(x)
        out.pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    expected, expected_grads = run(False)
    actual, actual_grads = run(True)
    assert torch.equal(expected, actual)
    for a, b in zip(expected_grads, actual_grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_cuda_allocator_peak_is_within_the_plan(fraction: float) -> None:
    torch.manual_seed(0)
    model = _mlp(p=0.0).cuda()
    x = torch.randn(256, 512, device="cuda")
    target = torch.randn(256, 512, device="cuda")
    loss_fn = nn.functional.mse_loss
    wrapped = remat.Checkpointable(
        copy.deepcopy(model), fraction, loss_fn=lambda out: loss_fn(out, target), output_kept=False
    )
    wrapped.measure(x)
    planned = wrapped.compute_sequence()
    for _ in range(2):  # warm the allocator up
        loss_fn(wrapped(x), target).backward()
    wrapped.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_fn(wrapped(x), target).backward()
    torch.cuda.synchronize()
    allocator_peak = torch.cuda.max_memory_allocated() - base
    # The allocator rounds every block up to 512 bytes and keeps the gradients (already
    # allocated at `base`): its peak of activations is the plan's, up to that rounding.
    assert allocator_peak <= planned.budget_bytes * 1.02 + 512 * 1024
    with remat.MemoryTracker(device="cuda") as tracker:
        loss_fn(wrapped(x), target).backward()
    assert tracker.peak_bytes <= planned.budget_bytes
