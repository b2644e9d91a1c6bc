"""remat.Checkpointable on nn.Sequential chains: exact training under every solver and budget.

Every training step is compared bit for bit with plain autograd on the CPU (see
tests/chain_helpers.py), and its peak activation memory, measured with MemoryTracker,
with the budget and with the plan's prediction.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from chain_helpers import (
    GroupCounter,
    assert_peak_matches_prediction,
    assert_same_tensors,
    clone_inputs,
    compare_training,
    grads_of,
    minimum_budget,
    state_of,
)
from remat.budget import BUDGET_FORMS, available_memory_bytes
from remat.budget import FREE_MEMORY_MARGIN as SAFETY_MARGIN
from remat.discover.chain import sequential_chain
from remat.measure import ChainMeasurement
from remat.models import gpt2
from remat.plan import available_solvers
from remat.testing import random_chain

pytestmark = pytest.mark.usefixtures("clean_remat_state")

UNLIMITED = 2**40
BUDGETS = {"unlimited": UNLIMITED, "1.0": 1.0, "0.5": 0.5, "0.25": 0.25, "minimum": None}
EXACT_SOLVERS = ("optimal", "auto")  # they fit every budget above the minimum

Case = tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]


# ----------------------------------------------------------------------------- the chains
def mlp_with_dropout(depth: int = 8, width: int = 16) -> Case:
    """Linear, GELU, Dropout, Linear blocks (nested Sequentials, flattened into 32 stages)."""
    model = nn.Sequential(
        *(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
    )
    return model, (torch.randn(8, width),), lambda output: output.square().mean()


def conv_bn_relu(depth: int = 8, channels: int = 4) -> Case:
    """Conv, BatchNorm, in-place ReLU, as separate stages, then pooling and a classifier."""
    layers: list[nn.Module] = []
    in_channels = 3
    for _ in range(depth):
        layers += [
            nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
        ]
        in_channels = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 5)]
    labels = torch.tensor([1, 3])
    return (
        nn.Sequential(*layers),
        (torch.randn(2, 3, 8, 8),),
        lambda output: nn.functional.cross_entropy(output, labels),
    )


def tiny_gpt2(n_layers: int = 8) -> Case:
    """remat.models.gpt2: embedding, causal blocks with dropout, final norm, LM head."""
    model = gpt2(n_layers=n_layers, d_model=16, n_heads=2, vocab_size=32, n_positions=8, dropout=0.1)
    tokens = torch.randint(0, 32, (2, 8))
    targets = torch.roll(tokens, -1, dims=1)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, (tokens,), loss_fn


CASES: dict[str, Callable[[], Case]] = {
    "mlp_dropout": mlp_with_dropout,
    "conv_bn_relu": conv_bn_relu,
    "gpt2": tiny_gpt2,
}


def build(case: str) -> Case:
    torch.manual_seed(0)
    model, inputs, loss_fn = CASES[case]()
    return model.train(), inputs, loss_fn


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("budget_name", list(BUDGETS))
@pytest.mark.parametrize("solver", available_solvers())
@pytest.mark.parametrize("case", list(CASES))
def test_training_is_exact_and_fits_the_budget(case: str, solver: str, budget_name: str) -> None:
    model, inputs, loss_fn = build(case)
    reference = copy.deepcopy(model)
    budget = BUDGETS[budget_name]
    options = {"solver": solver, "loss_fn": loss_fn}
    if budget is None:
        budget = minimum_budget(remat.Checkpointable(copy.deepcopy(model), **options), *clone_inputs(inputs))
    wrapped = remat.Checkpointable(model, budget, **options)
    wrapped.measure(*clone_inputs(inputs))
    try:
        planned = wrapped.compute_sequence()
    except remat.BudgetTooSmall as error:
        # Only a baseline may fail, and only where its own schedule does not fit.
        assert solver not in EXACT_SOLVERS, f"{solver} found no schedule: {error}"
        own_peak = wrapped.compute_sequence(UNLIMITED).predicted_peak_bytes
        assert error.minimum_bytes >= own_peak > error.budget_bytes * (1 - wrapped.margin)
        assert error.budget_bytes < error.minimum_bytes
        return

    peaks = compare_training(reference, wrapped, inputs, loss_fn)

    assert wrapped.plan is planned  # planned once, for that input signature
    for peak in peaks:
        assert_peak_matches_prediction(peak, planned)
    if budget_name == "minimum":
        assert planned.budget_bytes == budget


def test_a_wrong_gradient_would_be_caught() -> None:
    """The comparison of compare_training sees one flipped bit of one gradient."""
    model, inputs, loss_fn = build("mlp_dropout")
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, 0.5)

    def corrupt(module: nn.Module, grad_input: Any, grad_output: Any) -> tuple[torch.Tensor, ...]:
        gradient = grad_input[0].clone()
        gradient.view(-1)[0] = torch.nextafter(gradient.view(-1)[0], torch.tensor(float("inf")))
        return (gradient,)

    model[5][0].register_full_backward_hook(corrupt)
    with pytest.raises(AssertionError, match=r"parameter gradients differ.*4\.3\.weight"):
        compare_training(reference, wrapped, inputs, loss_fn, steps=1)


def test_a_second_step_on_a_different_seed_would_be_caught() -> None:
    """Dropout masks enter the comparison: a different RNG stream changes the output."""
    model, inputs, loss_fn = build("mlp_dropout")
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, 0.5)
    torch.manual_seed(1)
    expected = reference(*inputs)
    torch.manual_seed(2)
    assert not torch.equal(expected, wrapped(*inputs))


# ----------------------------------------------------------------------------- recompute counts
@pytest.mark.parametrize("solver", ["optimal", "periodic", "inputs"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_group_runs_as_often_as_planned(case: str, solver: str) -> None:
    model, inputs, loss_fn = build(case)
    # The baselines' schedules do not depend on the budget.
    wrapped = remat.Checkpointable(model, 0.5 if solver == "optimal" else UNLIMITED, solver=solver)
    measurement = wrapped.measure(*clone_inputs(inputs))
    planned = wrapped.compute_sequence()
    assert max(planned.forward_counts) > 1, "the plan recomputes nothing: the test would prove little"
    counter = GroupCounter(wrapped, measurement)
    try:
        loss_fn(wrapped(*clone_inputs(inputs))).backward()
        assert tuple(counter.counts) == planned.forward_counts
        counter.reset()
        loss_fn(wrapped(*clone_inputs(inputs))).backward()  # the cached plan, again
        assert tuple(counter.counts) == planned.forward_counts
    finally:
        counter.remove()


def test_hooks_on_stage_modules_run_once_per_call() -> None:
    """A forward hook that replaces a stage's output is applied once, as in plain autograd."""
    model, inputs, loss_fn = build("mlp_dropout")
    for block in model:
        block[3].register_forward_hook(lambda module, args, output: output * 0.5)
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, 0.5)
    compare_training(reference, wrapped, inputs, loss_fn)


# ----------------------------------------------------------------------------- plan cache
def test_plans_are_cached_per_input_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.automatic as checkpointable_module

    calls: list[int] = []
    measure_chain = checkpointable_module.measure_chain

    def counting_measure_chain(*args: Any, **kwargs: Any) -> ChainMeasurement:
        calls.append(1)
        return measure_chain(*args, **kwargs)

    monkeypatch.setattr(checkpointable_module, "measure_chain", counting_measure_chain)
    model, (x,), loss_fn = build("mlp_dropout")
    wrapped = remat.Checkpointable(model, 0.5)

    wrapped.measure(x.clone())
    other = wrapped.compute_sequence(1.0)  # a plan for another budget than the one in use
    loss_fn(wrapped(x)).backward()
    first = wrapped.plan
    assert len(calls) == 1 and first is not None
    assert other is not first and other.budget_bytes == 2 * first.budget_bytes
    loss_fn(wrapped(torch.randn_like(x))).backward()
    assert len(calls) == 1 and wrapped.plan is first

    bigger = torch.randn(2 * x.shape[0], x.shape[1])
    loss_fn(wrapped(bigger)).backward()
    second = wrapped.plan
    assert len(calls) == 2 and second is not None and second is not first
    assert second.measurement.profile.activation_bytes[1] == 2 * first.measurement.profile.activation_bytes[1]
    assert second.budget_bytes == pytest.approx(2 * first.budget_bytes, rel=0.01)

    loss_fn(wrapped(x)).backward()  # the first signature again: its plan, not a new one
    assert len(calls) == 2 and wrapped.plan is first


@pytest.mark.parametrize(
    "change",
    ["unfreeze", "freeze", "eval a submodule", "autocast", "autocast dtype", "double", "kwargs", "attention kernels"],
)
def test_a_plan_is_made_again_when_the_costs_can_change(monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    # NOTE [what a plan depends on]: each change gives a new measurement, never a stale plan
    import contextlib

    import remat.automatic as checkpointable_module

    calls: list[int] = []
    measure_chain = checkpointable_module.measure_chain
    monkeypatch.setattr(
        checkpointable_module, "measure_chain", lambda *a, **k: calls.append(1) or measure_chain(*a, **k)
    )
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)
    )
    if change == "unfreeze":
        model[0].requires_grad_(False)
    wrapped = remat.Checkpointable(model, "min")
    x = torch.randn(16, 8)
    wrapped(x).float().sum().backward()
    first = wrapped.plan
    assert len(calls) == 1 and first is not None
    context: Any = contextlib.nullcontext
    if change == "unfreeze":
        model[0].requires_grad_(True)
    elif change == "freeze":
        model[3].requires_grad_(False)
    elif change == "eval a submodule":
        model[1].eval()
    elif change == "autocast":
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif change == "autocast dtype":
        context = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    elif change == "double":
        model.double()
        x = x.double()
    elif change == "attention kernels":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        context = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
    with context():
        out = wrapped(x) if change != "kwargs" else wrapped(input=x)
    out.float().sum().backward()
    assert len(calls) == 2 and wrapped.plan is not first
    with context():
        out = wrapped(x) if change != "kwargs" else wrapped(input=x)
    out.float().sum().backward()
    assert len(calls) == 2  # and then it is cached


# ----------------------------------------------------------------------------- measure() is clean
def test_the_measuring_call_leaves_the_callers_graph_alone() -> None:
    """The first call measures on the caller's input, computed here by an upstream layer.

    The measured steps must neither free that upstream graph nor add their gradients to it.
    """
    model, (x,), loss_fn = build("mlp_dropout")
    torch.manual_seed(1)
    upstream = nn.Linear(16, 16)
    plain, plain_upstream = copy.deepcopy(model), copy.deepcopy(upstream)
    wrapped = remat.Checkpointable(model, 0.5)
    for step in range(2):
        torch.manual_seed(step)
        loss_fn(plain(plain_upstream(x))).backward()
        torch.manual_seed(step)
        loss_fn(wrapped(upstream(x))).backward()  # step 0 measures first
        assert_same_tensors(grads_of(plain_upstream), grads_of(upstream), f"step {step}: upstream gradients")
        assert_same_tensors(grads_of(plain), grads_of(model), f"step {step}: gradients")


def test_measure_leaves_the_model_untouched() -> None:
    model, (x,), _ = build("conv_bn_relu")
    model.add_module("dropout", nn.Dropout(0.5))  # draws random numbers in the measured steps
    model(x)  # BatchNorm statistics that are not the initial ones
    grads = {}
    for name, parameter in model.named_parameters():
        parameter.grad = torch.full_like(parameter, 0.25)
        grads[name] = parameter.grad
    before = state_of(model)
    rng = torch.get_rng_state()

    wrapped = remat.Checkpointable(model, 0.5)
    wrapped.measure(x.clone().requires_grad_(True))

    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_tensors(before, state_of(model), "parameters and buffers")
    for name, parameter in model.named_parameters():
        assert parameter.grad is grads[name], f"{name}.grad was replaced"
        assert torch.equal(parameter.grad, torch.full_like(parameter, 0.25)), f"{name}.grad changed"


def test_eval_mode_and_no_grad_run_the_plain_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.automatic as checkpointable_module

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("measured or discovered outside a training call")

    monkeypatch.setattr(checkpointable_module, "measure_chain", fail)
    monkeypatch.setattr(checkpointable_module, "discover_chain", fail)
    model, (x,), _ = build("conv_bn_relu")
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, 0.5)

    with torch.no_grad():  # training mode: BatchNorm statistics move, as in the plain model
        assert torch.equal(wrapped(x), reference(x))
    assert_same_tensors(state_of(reference), state_of(model), "after a no_grad training forward")
    wrapped.eval()
    reference.eval()
    assert not model.training
    assert torch.equal(wrapped(x), reference(x))
    assert_same_tensors(state_of(reference), state_of(model), "after an eval forward")
    assert wrapped.plan is None


# ----------------------------------------------------------------------------- budgets
def small_mlp() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)) for _ in range(6)))
    return model, torch.randn(16, 16, requires_grad=True)


def planned_budget(mem_limit: Any) -> int | None:
    """The whole-step budget in bytes that `mem_limit` means for small_mlp."""
    model, x = small_mlp()
    wrapped = remat.Checkpointable(model, mem_limit)
    wrapped.measure(x)
    try:
        return wrapped.compute_sequence().budget_bytes
    except remat.BudgetTooSmall as error:
        return error.budget_bytes


def test_budget_forms() -> None:
    assert planned_budget(300_000) == 300_000
    assert planned_budget("512KiB") == 512 * 1024
    assert planned_budget("0.5MB") == 500_000
    assert planned_budget("1.5kB") == 1500
    everything = planned_budget(1.0)
    assert everything is not None
    assert planned_budget(0.5) == everything // 2
    assert planned_budget("0.25") == everything // 4
    assert planned_budget("50%") == planned_budget(0.5)
    assert planned_budget(" 12.5%") == int(everything * 0.125)
    free = available_memory_bytes("cpu") * (1 - SAFETY_MARGIN)
    assert planned_budget(None) == pytest.approx(free, rel=0.25)


@pytest.mark.parametrize(
    "bad", ["lots", "-5MiB", "12 parsecs", -1, 0, 1.5, 0.0, float("nan"), True, [1024], "0%", "150%", "5MiB%"]
)
def test_a_bad_budget_is_refused_when_wrapping(bad: Any) -> None:
    model, _ = small_mlp()
    with pytest.raises(remat.InvalidBudget) as error:
        remat.Checkpointable(model, bad)
    assert BUDGET_FORMS in str(error.value)


def test_budget_too_small_gives_the_minimum_which_then_fits() -> None:
    model, x = small_mlp()
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, 1000)
    with pytest.raises(remat.BudgetTooSmall, match="smallest feasible budget") as error:
        wrapped(x)
    minimum = error.value.minimum_bytes
    assert error.value.budget_bytes == 1000 < minimum
    assert str(minimum) in str(error.value)

    with pytest.raises(remat.BudgetTooSmall):  # the minimum is the smallest that fits
        remat.Checkpointable(copy.deepcopy(reference), minimum - 1)(x.detach().clone().requires_grad_(True))
    fitted = remat.Checkpointable(copy.deepcopy(reference), minimum)
    peaks = compare_training(reference, fitted, (x.detach(),), lambda output: output.sum())
    assert max(peaks) <= minimum
    assert fitted.plan is not None and fitted.plan.budget_bytes == minimum


@pytest.mark.parametrize("margin", [0.0, 0.02, 0.1, 0.3, 0.45])
def test_the_minimum_budget_fits_for_any_margin_and_fixed_memory(
    margin: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BudgetTooSmall.minimum_bytes is exactly the smallest budget, despite float rounding."""
    import remat.automatic as checkpointable_module

    profile = random_chain(3, 2, max_units=40, unit_bytes=8)
    fixed = {"bytes": 0}

    def fake_measure_chain(*args: Any, **kwargs: Any) -> ChainMeasurement:
        return ChainMeasurement(
            stages=[],
            groups=[(0, 1), (1, 2)],
            profile=profile,
            fixed_bytes=fixed["bytes"],
            measured_peak_bytes=0,
            end_peak_bytes=0,
        )

    monkeypatch.setattr(checkpointable_module, "measure_chain", fake_measure_chain)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for fixed_bytes in range(0, 400, 7):
        fixed["bytes"] = fixed_bytes
        for solver in ("none", "optimal"):
            wrapped = remat.Checkpointable(model, 1, solver=solver, margin=margin)
            wrapped.measure(torch.zeros(1, 2))
            with pytest.raises(remat.BudgetTooSmall) as error:
                wrapped.compute_sequence()
            minimum = error.value.minimum_bytes
            assert wrapped.compute_sequence(minimum).budget_bytes == minimum
            with pytest.raises(remat.BudgetTooSmall):
                wrapped.compute_sequence(minimum - 1)


# ----------------------------------------------------------------------------- side effects
class CachingBlocks(nn.Module):
    """Blocks that also store a copy of their output in a cache the model keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: list[torch.Tensor] = []
        self.blocks = nn.ModuleList(CachingBlock(self.cache) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.clear()
        for block in self.blocks:
            x = block(x)
        return x


class CachingBlock(nn.Module):
    def __init__(self, cache: list[torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.cache = cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x).tanh()
        self.cache.append(x.detach() * 1.0)  # allocated by the stage, kept by the model
        return x


def test_state_a_stage_keeps_outside_autograd_is_fixed_memory_and_warned_about() -> None:
    torch.manual_seed(0)
    model = CachingBlocks()
    x = torch.randn(8, 16, requires_grad=True)
    wrapped = remat.Checkpointable(model, 1.0)
    with pytest.warns(RuntimeWarning, match=r"'blocks\.0'.*outlives the forward.*use_cache=False"):
        measurement = wrapped.measure(x)
    cache_bytes = 4 * 8 * 16 * 4
    assert measurement.fixed_bytes >= cache_bytes


# ----------------------------------------------------------------------------- in-place stages
def test_a_stage_that_modifies_its_input_in_place_is_fused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, 16),
    )
    x = torch.randn(8, 16)
    wrapped = remat.Checkpointable(copy.deepcopy(model), 1.0)
    measurement = wrapped.measure(x.clone().requires_grad_(True))
    assert measurement.groups == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [stage.modifies_input for stage in measurement.stages] == [False, True] * 3 + [False]
    minimum = minimum_budget(remat.Checkpointable(copy.deepcopy(model)), x.clone().requires_grad_(True))
    everything = wrapped.compute_sequence(1.0).budget_bytes
    assert everything is not None
    for budget in (minimum, (minimum + everything) // 2):
        reference, wrapped = copy.deepcopy(model), remat.Checkpointable(copy.deepcopy(model), budget)
        peaks = compare_training(reference, wrapped, (x,), lambda output: output.sum())
        assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
        for peak in peaks:
            assert_peak_matches_prediction(peak, wrapped.plan)


# ----------------------------------------------------------------------------- the printed plan
def test_the_plan_prints_budget_peak_overhead_and_stages() -> None:
    model, inputs, _ = build("gpt2")
    wrapped = remat.Checkpointable(model, 0.5)
    wrapped(*inputs).sum().backward()
    planned = wrapped.plan
    assert planned is not None
    text = str(planned)
    assert "budget:" in text and "predicted peak:" in text  # the chain's schedule
    assert planned.budget_bytes is not None
    whole_step = (
        f"whole step: budget {remat.format_bytes(planned.budget_bytes)}, "
        f"predicted peak {remat.format_bytes(planned.predicted_peak_bytes)}"
    )
    assert whole_step in text
    assert "overhead +" in text and f"{100 * planned.overhead:.1f}%" in text
    header = next(line for line in text.splitlines() if line.split()[:2] == ["stage", "name"])
    assert header.split() == ["stage", "name", "forward", "backward", "output", "saved", "decision", "runs"]
    names = sequential_chain(model).names
    assert names[:3] == ["embedding", "blocks.0", "blocks.1"]
    for index, name in enumerate(planned.measurement.profile.names):
        row = next(line for line in text.splitlines() if line.split()[:2] == [str(index), name])
        assert row.split()[-1] == str(planned.forward_counts[index])
    assert "recompute" in text and "keep" in text


def test_changing_an_option_after_planning_plans_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(6)))
    x = torch.randn(8, 16)
    wrapped = remat.Checkpointable(model, 0.5)
    wrapped(x).sum().backward()
    first = wrapped.plan
    assert first is not None and first.schedule.solver_name == "optimal"
    wrapped.solver_name = "none"
    wrapped.mem_limit = 2**40
    wrapped(x).sum().backward()
    second = wrapped.plan
    assert second is not None and second is not first and second.schedule.solver_name == "none"


@pytest.mark.parametrize("name", ["mlp_dropout", "conv_bn_relu", "gpt2"])
def test_frugal_measurement_uses_less_memory_and_plans_within_the_budget(name: str) -> None:
    model, inputs, loss_fn = build(name)
    plain_wrapper = remat.Checkpointable(copy.deepcopy(model), 0.5, measure="plain")
    with remat.MemoryTracker() as plain_tracker:
        plain = plain_wrapper.measure(*inputs)
    frugal_wrapper = remat.Checkpointable(copy.deepcopy(model), 0.5, measure="frugal")
    with remat.MemoryTracker() as frugal_tracker:
        frugal = frugal_wrapper.measure(*inputs)
    # the measuring step itself: well below a plain step's memory
    assert frugal_tracker.peak_bytes < 0.8 * plain_tracker.peak_bytes
    # the same chain, the same stored bytes; transients bounded from above
    assert frugal.groups == plain.groups
    assert frugal.profile.saved_bytes == plain.profile.saved_bytes
    assert frugal.profile.activation_bytes == plain.profile.activation_bytes
    assert all(f >= p for f, p in zip(frugal.profile.forward_temp_bytes, plain.profile.forward_temp_bytes))
    # and training with its plan is exact and fits
    peaks = compare_training(copy.deepcopy(model), frugal_wrapper, inputs, loss_fn)
    assert frugal_wrapper.plan is not None
    assert max(peaks[1:]) <= frugal_wrapper.plan.budget_bytes


def test_a_plain_measuring_step_that_runs_out_of_memory_is_measured_frugally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import remat.measure.step as module

    original = module.measure_chain
    modes = []

    def measure(*args: object, frugal: bool = False, **kwargs: object) -> object:
        modes.append(frugal)
        if not frugal:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return original(*args, frugal=frugal, **kwargs)

    monkeypatch.setattr(module, "measure_chain", measure)
    model, inputs, loss_fn = build("mlp_dropout")
    wrapped = remat.Checkpointable(copy.deepcopy(model), 0.5, measure="plain")
    with pytest.warns(RuntimeWarning, match="measure='frugal'"):
        peaks = compare_training(copy.deepcopy(model), wrapped, inputs, loss_fn)
    assert modes == [False, True]
    assert wrapped.plan is not None and max(peaks[1:]) <= wrapped.plan.budget_bytes


def test_without_a_loss_fn_a_heavy_loss_still_fits_the_budget() -> None:
    # Measured with a sum, planned with room for a loss holding a few output-sized tensors
    # (NOTE [loss allowance]): a log-sum-exp over the vocabulary stays within the budget.
    torch.manual_seed(0)
    model = remat.models.gpt2(vocab_size=128, n_positions=32, d_model=32, n_heads=4, n_layers=6, dropout=0.1)
    ids = torch.randint(0, 128, (4, 32))
    for fraction in (0.5, 0.25):
        wrapped = remat.Checkpointable(copy.deepcopy(model), fraction, output_kept=False)
        wrapped(ids).logsumexp(-1).mean().backward()  # measures and plans
        with remat.MemoryTracker() as tracker:
            wrapped(ids).logsumexp(-1).mean().backward()
        assert wrapped.plan is not None
        assert tracker.peak_bytes <= wrapped.plan.budget_bytes


def test_without_a_loss_fn_a_float32_loss_on_a_bf16_output_fits_the_budget() -> None:
    # A loss upcasts a half-precision output: the room left for it is sized in float32
    # (NOTE [loss allowance]); sized in bf16 the smallest budget was exceeded
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(4)))
    model = model.to(torch.bfloat16)
    x, y = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(64, 32)
    for budget in (0.7, "min"):
        wrapped = remat.Checkpointable(copy.deepcopy(model), budget, output_kept=False)
        (wrapped(x).float() - y).pow(2).mean().backward()  # measures and plans
        with remat.MemoryTracker() as tracker:
            (wrapped(x).float() - y).pow(2).mean().backward()
        assert wrapped.plan is not None
        assert tracker.peak_bytes <= wrapped.plan.budget_bytes, budget


def test_a_model_running_under_autocast_is_exact_and_fits() -> None:
    # Autocast caches the casts of weights until its region ends, discarded stages' too
    # (plain autograd shares them: exact gradients); the plan counts them (NOTE [autocast casts]).
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(
                *(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.2), nn.Linear(128, 32)) for _ in range(6))
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.blocks(x).float()

    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(128, 32)
    wrapped = remat.Checkpointable(copy.deepcopy(model), 0.5, loss_fn=lambda out: out.pow(2).mean())
    peaks = compare_training(copy.deepcopy(model), wrapped, (x,), lambda out: out.pow(2).mean())
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
    assert max(peaks[1:]) <= wrapped.plan.budget_bytes


def test_autocast_casts_are_counted_under_every_plan() -> None:
    # The plan at a budget depends on the measured times: plans from seeded random times
    # stand for what a noisy machine may pick. Autocast caches the casts of a leaf input
    # that requires grad and of biases (no stage saves those) until its region ends,
    # inside the model's forward here: each plan's prediction must count them.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 16)) for _ in range(4)]

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*blocks)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.blocks(x).float()

    x = torch.randn(64, 16, requires_grad=True)
    wrapped = remat.Checkpointable(Mixed(), 0.5, loss_fn=lambda out: out.pow(2).mean(), margin=0.0)
    measurement = wrapped.measure(x)
    lower = torch.bfloat16.itemsize
    biases = sum(m.bias.numel() * lower for m in wrapped.model.modules() if isinstance(m, nn.Linear))
    assert sum(measurement.cached_cast_bytes) == biases
    # the first stage saves the casts of its weight and of the input (a leaf)
    assert measurement.cast_bytes[0] == (16 * 64 + x.numel()) * lower
    generator = torch.Generator().manual_seed(0)
    n_stages = measurement.profile.n_stages
    schedules = set()
    for _ in range(12):
        forward, backward = (tuple((torch.rand(n_stages, generator=generator) + 0.1).tolist()) for _ in range(2))
        profile = dataclasses.replace(measurement.profile, forward_time_s=forward, backward_time_s=backward)
        wrapped._measurements[wrapped._last_key] = dataclasses.replace(measurement, profile=profile)
        wrapped._plans.clear()
        plan = wrapped.plan_for(0.5)
        schedules.add(plan.schedule.items)
        with wrapped.executing(plan):
            wrapped(x).pow(2).mean().backward()  # a step first: the peaks of steps that follow
            with remat.MemoryTracker() as tracker:
                wrapped(x).pow(2).mean().backward()
        assert tracker.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes, plan
    assert len(schedules) > 3


def test_stages_that_do_not_keep_their_input_are_still_planned_separately() -> None:
    # nn.TransformerEncoderLayer (batch_first) keeps a transposed copy of its input, not the
    # input itself: each layer must stay a stage of its own, so recompute can help.
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True) for _ in range(4)))
    x = torch.randn(8, 32, 32)
    wrapped = remat.Checkpointable(copy.deepcopy(model), 0.6, loss_fn=lambda out: out.sum())
    measurement = wrapped.measure(x)
    assert measurement.groups == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert not any(measurement.profile.saves_input[1:])
    peaks = compare_training(copy.deepcopy(model), wrapped, (x,), lambda out: out.sum())
    assert wrapped.plan is not None and max(wrapped.plan.forward_counts) > 1
    assert max(peaks[1:]) <= wrapped.plan.budget_bytes


def test_at_the_minimum_the_running_statistics_guard_is_counted() -> None:
    # A recomputed BatchNorm briefly holds a copy of its running statistics (the guard that
    # keeps them exact): at the exact minimum, with no margin, that copy must be planned for.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 3
    for width, stride in [(16, 1), (16, 1), (32, 2), (32, 1), (64, 2)]:
        layers += [nn.Conv2d(channels, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    model = nn.Sequential(*layers)
    x = torch.randn(8, 3, 16, 16)
    target = torch.randint(0, 10, (8,))
    loss_fn = lambda out: nn.functional.cross_entropy(out, target)  # noqa: E731
    probe = remat.Checkpointable(copy.deepcopy(model), 1, loss_fn=loss_fn)
    probe.measure(x)
    with pytest.raises(remat.BudgetTooSmall) as info:
        probe.compute_sequence()
    wrapped = remat.Checkpointable(copy.deepcopy(model), info.value.minimum_bytes, loss_fn=loss_fn)
    peaks = compare_training(copy.deepcopy(model), wrapped, (x,), loss_fn)
    assert wrapped.margin == 0.0
    assert max(peaks[1:]) <= info.value.minimum_bytes


def test_one_log_line_per_measurement_and_per_plan(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    wrapped = remat.Checkpointable(model, "min")
    with caplog.at_level(logging.INFO, logger="remat"):
        for batch in (16, 16, 32):
            wrapped(torch.randn(batch, 8)).sum().backward()
        model[0].requires_grad_(False)
        wrapped(torch.randn(32, 8)).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "remat" and r.levelno == logging.INFO]
    measured = [line for line in lines if line.startswith("remat measured")]
    planned = [line for line in lines if line.startswith("remat planned")]
    assert len(measured) == len(planned) == 3  # the second batch of 16 reuses the first plan
    assert "the first input" in measured[0]
    assert "a change in the input shapes" in measured[1]
    assert "a change in the parameters" in measured[2]
    assert all("predicted peak" in line and "overhead" in line for line in planned)


def test_a_pinned_plan_trains_without_measuring(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import remat.automatic as checkpointable_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    x = torch.randn(16, 8)
    planner = remat.Checkpointable(copy.deepcopy(model), "min")
    planner(x).sum().backward()
    assert planner.plan is not None
    path = tmp_path / "plan.json"
    path.write_text(planner.plan.to_json())
    calls: list[int] = []
    measure_chain = checkpointable_module.measure_chain
    monkeypatch.setattr(
        checkpointable_module, "measure_chain", lambda *a, **k: calls.append(1) or measure_chain(*a, **k)
    )
    for pinned in (str(path), path, planner.plan):
        wrapped = remat.Checkpointable(copy.deepcopy(model), plan=pinned)
        compare_training(copy.deepcopy(model), wrapped, [x], lambda out: out.sum(), steps=2)
        assert wrapped.plan is not None and wrapped.plan.schedule.items == planner.plan.schedule.items
    assert calls == []  # never measured
    other = remat.Checkpointable(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), plan=path)
    with pytest.raises(remat.RematError, match=r"a chain of \d+ stage calls, and this model's forward makes 2"):
        other(torch.randn(4, 8)).sum().backward()
    with pytest.raises(TypeError, match="plan must be a remat.plan.Plan or the path"):
        remat.Checkpointable(model, plan=42)  # type: ignore[arg-type]
