"""CUDA variants: device RNG replay, and the planner's prediction against the CUDA allocator.

These run only where a CUDA device is present (they skip on the CPU-only CI).
"""

from __future__ import annotations

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
    allocator = _allocator_peak(wrapped, lambda: wrapped(**batch).loss.backward())
    plan = wrapped.plan
    print(measure, fraction, plan.predicted_peak_bytes, tracker.peak_bytes, allocator, plan.budget_bytes)
    _within_the_plan(wrapped, plan, tracker.peak_bytes, allocator)


def _allocator_peak(model: nn.Module, step: Any) -> int:
    """``torch.cuda.max_memory_allocated`` during a step, above what is allocated before it,
    with the parameter gradients allocated before it (the budget leaves them out)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _within_the_plan(model: nn.Module, plan: Any, tracker_peak: int, allocator_peak: int) -> None:
    """The tracker within the budget; the allocator too, but for one parameter's gradient
    alive twice while autograd adds it into the one before (README: what the budget counts)
    and its rounding of each block to 512 bytes; the prediction within 5% of the allocator."""
    largest_gradient = max(p.numel() * p.element_size() for p in model.parameters())
    assert tracker_peak <= plan.budget_bytes
    assert allocator_peak <= plan.budget_bytes + largest_gradient + 512 * 1024
    assert abs(plan.predicted_peak_bytes - allocator_peak) <= 0.05 * allocator_peak


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
            wrapped.zero_grad(set_to_none=True)
            torch.manual_seed(7)
            with remat.MemoryTracker(device="cuda") as tracker:
                wrapped(**batch).loss.backward()
            gradients = [p.grad.clone() for p in wrapped.parameters()]
            allocator = _allocator_peak(wrapped, lambda: wrapped(**batch).loss.backward())
    finally:
        torch.use_deterministic_algorithms(False)
    offloaded = plan.schedule.offloaded_stages
    print(
        f"{mem_limit}: {len(offloaded)} stages offloaded, predicted {plan.predicted_peak_bytes}, tracker "
        f"{tracker.peak_bytes}, allocator {allocator}, budget {plan.budget_bytes}, host {remat.host_memory().peak_bytes}"
    )
    for a, b in zip(plain.parameters(), gradients, strict=True):
        assert torch.equal(a.grad, b)
    _within_the_plan(wrapped, plan, tracker.peak_bytes, allocator)


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
    probed: list[bool] = []
    timed = step.time_groups

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(kwargs.get("rehearsal", False))
        if not passes[-1]:
            probed.append(kwargs.get("workspace") is not None)
        return timed(*args, **kwargs)

    monkeypatch.setattr(step, "time_groups", counted)
    torch.manual_seed(0)
    wrapped = remat.Checkpointable(_mlp(p=0.0).cuda(), 0.5)
    wrapped(torch.randn(64, 512, device="cuda")).sum().backward()
    assert passes.count(False) == 2  # (and its rehearsals on fake tensors)
    assert probed == [True, False]  # NOTE [device workspaces]: on the pass whose times are dropped


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


class _ConvNet(nn.Module):
    """Convolutions with BatchNorm: cuDNN takes workspaces outside any tensor."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("cudnn_benchmark", [False, True])
@pytest.mark.parametrize("mem_limit", [0.5, "min"])
def test_convolution_workspaces_stay_within_the_budget(mem_limit: float | str, cudnn_benchmark: bool) -> None:
    # NOTE [device workspaces]: the allocator's peak, which counts cuDNN's workspaces, within
    # the budget on every step, the first (which measures) included; BatchNorm updated once
    torch.manual_seed(0)
    model = _ConvNet().cuda().train()
    plain = copy.deepcopy(model)
    x = torch.randn(32, 3, 96, 96, device="cuda")
    labels = torch.randint(0, 10, (32,), device="cuda")

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels)

    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        wrapped = remat.Checkpointable(model, mem_limit, loss_fn=loss_fn, output_kept=False)
        peaks = []
        for _ in range(3):
            wrapped.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss_fn(wrapped(x)).backward()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        for _ in range(3):
            plain.zero_grad(set_to_none=True)
            loss_fn(plain(x)).backward()
    finally:
        torch.backends.cudnn.benchmark = previous
    plan = wrapped.plan
    assert plan is not None
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{mem_limit} benchmark={cudnn_benchmark}: allocator {peaks}, budget {plan.budget_bytes}, predicted "
        f"{plan.predicted_peak_bytes}, workspace {plan.schedule.profile.metadata.get('workspace_bytes', 0)}"
    )
    # The budget leaves parameter gradients out: they come as the step's allocations do.
    # The first step measures: its pass that finds the workspaces is kept to the budget by
    # the tensors alone, and may go over by a workspace; with cuDNN's benchmark, the first
    # call of each shape tries algorithms in workspaces as large as the free memory allows,
    # outside any budget (README: Known limits, GPU).
    assert plan.schedule.profile.metadata.get("workspace_bytes", 0) > 0  # cuDNN's are counted
    allowed = plan.budget_bytes + gradient_bytes + 512 * 1024
    assert max(peaks[1:]) <= allowed
    if not cudnn_benchmark:
        assert peaks[0] <= allowed + plan.schedule.profile.metadata.get("workspace_bytes", 0)
    for a, b in zip(model.buffers(), plain.buffers(), strict=True):
        # running statistics updated once per step (the benchmark's algorithms may round apart)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6) if cudnn_benchmark else torch.equal(a, b)


def test_elementwise_plans_on_cuda_are_exact_and_fit_the_plan() -> None:
    model, batch = _gpt(layers=3, width=256)
    plain = copy.deepcopy(model)
    wrapped = remat.Checkpointable(
        copy.deepcopy(model), 0.5, loss_fn=lambda out: out.loss, output_kept=False, elementwise=True
    )
    torch.use_deterministic_algorithms(True)
    try:
        for module in (plain, wrapped):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(7)
            with remat.MemoryTracker(device="cuda") as tracker:
                module(**batch).loss.backward()
    finally:
        torch.use_deterministic_algorithms(False)
    plan = wrapped.plan
    assert plan is not None
    print(
        f"elementwise: tracker {tracker.peak_bytes}, predicted {plan.predicted_peak_bytes}, budget {plan.budget_bytes}"
    )
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert tracker.peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("mem_limit", [0.5, "min"])
def test_bf16_autocast_steps_on_cuda_fit_the_budget(mem_limit: float | str) -> None:
    # NOTE [autocast's cache after measuring]: the first step, which measures, too
    model, batch = _gpt(layers=3, width=256)
    wrapped = remat.Checkpointable(model, mem_limit, loss_fn=lambda out: out.loss, output_kept=False)
    peaks = []
    for _ in range(3):
        wrapped.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16), remat.MemoryTracker(device="cuda") as tracker:
            wrapped(**batch).loss.backward()
        peaks.append(tracker.peak_bytes)
    plan = wrapped.plan
    assert plan is not None
    print(f"bf16 {mem_limit}: tracker {peaks}, predicted {plan.predicted_peak_bytes}, budget {plan.budget_bytes}")
    assert max(peaks) <= plan.budget_bytes
