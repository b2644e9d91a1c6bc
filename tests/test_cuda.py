"""CUDA variants: device RNG replay, and the planner's prediction against the CUDA allocator.

These run only where a CUDA device is present (they skip on the CPU-only CI).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
from typing import Any

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


def test_the_link_to_host_memory_is_measured() -> None:
    from remat.manual.offload import offload_time_per_byte_s

    per_byte = offload_time_per_byte_s("cuda")
    print(f"{1 / per_byte / 1e9:.1f} GB/s")
    assert 0 < per_byte < 1e-8  # faster than 100 MB/s


def _gpt(layers: int = 4, width: int = 1024) -> tuple[nn.Module, dict[str, torch.Tensor | bool]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=8, vocab_size=4096, n_positions=1024)
    model = transformers.GPT2LMHeadModel(config).cuda().train()
    tokens = torch.randint(0, config.vocab_size, (4, 1024), device="cuda")
    return model, {"input_ids": tokens, "labels": tokens, "use_cache": False}


def _offloading_step(
    model: nn.Module, batch: dict[str, torch.Tensor | bool], mem_limit: float | str, offload_all: bool
) -> None:
    """Offload on a GPT-2 with dropout, as planned (or with the plan `items`, every stage
    but the last offloaded): gradients bit for bit against plain autograd (deterministic
    kernels), the exact tracker's peak within the budget and within 5% of the prediction,
    and the allocator's peak beside them."""
    plain = copy.deepcopy(model)
    wrapped = remat.Checkpointable(
        copy.deepcopy(model), mem_limit, loss_fn=lambda out: out.loss, output_kept=False, offload=True
    )
    wrapped(**batch).loss.backward()  # measures and plans
    plan = wrapped.plan
    if offload_all:
        n_stages = plan.schedule.profile.n_stages
        items = tuple(remat.plan.Offload(k) for k in range(n_stages - 1)) + (remat.plan.Store(n_stages - 1),)
        schedule = remat.plan.Schedule.from_plan(plan.schedule.profile, items)
        plan = dataclasses.replace(plan, schedule=schedule)
    wrapped.load_state_dict(model.state_dict())
    plain.load_state_dict(model.state_dict())
    torch.use_deterministic_algorithms(True)
    try:
        plain.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        plain(**batch).loss.backward()
        with wrapped.executing(plan):
            for tracked in (False, True):  # the allocator's peak, then the tracker's
                wrapped.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                torch.manual_seed(7)
                with remat.MemoryTracker(device="cuda") if tracked else contextlib.nullcontext() as tracker:
                    wrapped(**batch).loss.backward()
                torch.cuda.synchronize()
                if not tracked:
                    allocator = torch.cuda.max_memory_allocated() - base
    finally:
        torch.use_deterministic_algorithms(False)
    offloaded = plan.schedule.offloaded_stages
    print(
        f"{mem_limit}: {len(offloaded)} stages offloaded, predicted {plan.predicted_peak_bytes}, tracker "
        f"{tracker.peak_bytes}, allocator {allocator}, budget {plan.budget_bytes}, host {remat.host_memory().peak_bytes}"
    )
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert tracker.peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - tracker.peak_bytes) <= 0.05 * tracker.peak_bytes


@pytest.mark.parametrize("mem_limit", [0.5, "min"])
def test_planned_offload_on_cuda_is_exact_and_fits_the_plan(mem_limit: float | str) -> None:
    model, batch = _gpt()
    _offloading_step(model, batch, mem_limit, False)


def test_every_stage_offloaded_on_cuda_runs_as_simulated() -> None:
    model, batch = _gpt(layers=3)
    _offloading_step(model, batch, 1.0, True)


def test_offloaded_blocks_on_cuda_are_exact() -> None:
    torch.manual_seed(0)
    model = _mlp().cuda()
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    offloaded = copy.deepcopy(model)
    for layer in offloaded:
        if isinstance(layer, nn.Linear):
            remat.mark(layer, offload=True)
    grads = []
    for module in (model, offloaded):
        module.zero_grad(set_to_none=True)
        torch.cuda.manual_seed(5)
        module(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_the_timing_pass_runs_twice_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [a cold device]: the first pass loads kernels and builds cuDNN's plans; its
    # times are discarded (the rehearsal on fake tensors is not a timing pass)
    step = importlib.import_module("remat.measure.step")
    passes: list[bool] = []
    timed = step.time_groups

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(kwargs.get("rehearsal", False))
        return timed(*args, **kwargs)

    monkeypatch.setattr(step, "time_groups", counted)
    torch.manual_seed(0)
    wrapped = remat.Checkpointable(_mlp(p=0.0).cuda(), 0.5)
    wrapped(torch.randn(64, 512, device="cuda")).sum().backward()
    assert passes.count(False) == 2 and passes.count(True) == 1


@pytest.mark.parametrize("fraction", [0.6, 0.35])
def test_stages_stored_under_a_policy_on_cuda_are_exact_and_fit_the_plan(fraction: float) -> None:
    # NOTE [stored under a policy]: on the device, dropout included; each stage timed under
    # the policy (NOTE [timing store options]) with the device synchronised
    torch.manual_seed(0)
    model = _mlp(p=0.2).cuda()
    twin = copy.deepcopy(model)
    x = torch.randn(256, 512, device="cuda")

    def step(module: nn.Module) -> list[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        torch.cuda.manual_seed(7)
        module(x).square().mean().backward()
        return [p.grad.clone() for p in module.parameters()]

    expected = step(model)
    control = remat.enable(twin, fraction, policy=remat.policies.save_matmuls, loss_fn=lambda out: out.square().mean())
    step(twin)
    got = step(twin)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    plan = control.plan
    assert plan is not None
    timed = [extra for extra in plan.measurement.option_extra_s if extra]
    assert timed, "the timing pass times the stages under the policy on the device too"
    twin.zero_grad(set_to_none=True)
    with control.check_step() as check:
        twin(x).square().mean().backward()
    print(f"options taken: {sum(op.option is not None for op in plan.schedule.operations)}; ratio {check.ratio:.4f}")
    assert check.within_budget
