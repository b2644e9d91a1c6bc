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
    with remat.MemoryTracker(device="cuda") as tracker:
        loss_fn(wrapped(x), target).backward()
    peaks = {}
    for set_to_none in (False, True):
        wrapped.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss_fn(wrapped(x), target).backward()
        torch.cuda.synchronize()
        peaks[set_to_none] = torch.cuda.max_memory_allocated() - base
    gradient_bytes = [p.numel() * p.element_size() for p in wrapped.parameters()]
    figures = (
        f"budget {planned.budget_bytes}, predicted {planned.predicted_peak_bytes}, tracker {tracker.peak_bytes}, "
        f"allocator with gradients allocated {peaks[False]}, from none {peaks[True]} "
        f"(gradients {sum(gradient_bytes)})"
    )
    print(figures)
    assert tracker.peak_bytes <= planned.budget_bytes, figures
    # The allocator rounds every block up to 512 bytes. From no gradients, they are counted
    # as they come (the budget leaves them out). With gradients allocated before the step
    # (accumulation), autograd adds each new one into the old: one parameter's gradient is
    # alive twice for a moment, which the budget also leaves out (README: what the budget counts).
    rounding = 512 * 1024
    assert peaks[True] <= planned.budget_bytes + sum(gradient_bytes) + rounding, figures
    assert peaks[False] <= planned.budget_bytes + max(gradient_bytes) + rounding, figures


@pytest.mark.parametrize("fraction", [1.0, 0.75, "min"])
@pytest.mark.parametrize("measure", ["sized", "plain"])
def test_cuda_prediction_matches_the_step(measure: str, fraction: float | str) -> None:
    """The plan's predicted peak against the exact tracker on CUDA, for both ways of measuring
    (the sized one rehearses on fake CUDA tensors: their bytes must be counted as CUDA's)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=256, n_head=4, vocab_size=8192, n_positions=512)
    model = transformers.GPT2LMHeadModel(config).cuda().train()
    tokens = torch.randint(0, config.vocab_size, (4, 512), device="cuda")
    batch = {"input_ids": tokens, "labels": tokens, "use_cache": False}
    wrapped = remat.Checkpointable(
        copy.deepcopy(model), fraction, loss_fn=lambda out: out.loss, output_kept=False, measure=measure
    )
    wrapped(**batch).loss.backward()
    wrapped.zero_grad(set_to_none=True)
    with remat.MemoryTracker(device="cuda") as tracker:
        wrapped(**batch).loss.backward()
    plan = wrapped.plan
    print(measure, fraction, plan.predicted_peak_bytes, tracker.peak_bytes, plan.budget_bytes)
    assert tracker.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - tracker.peak_bytes) <= 0.05 * tracker.peak_bytes
