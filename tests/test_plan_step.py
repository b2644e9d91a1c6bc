"""The plan of a whole step: one JSON format, one report with the budget's split, and running it."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.execute import ChainExecutor, expand_operations
from remat.measure import ChainMeasurement
from remat.plan import BudgetSplit, InvalidPlan, Operation, OperationKind, Plan, Region, Store, operations
from remat.testing import random_chain
from remat.units import format_bytes


def mlp(depth: int = 6) -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 16)) for _ in range(depth)))


def measured(mem_limit: Any = 0.5, **options: Any) -> tuple[remat.Checkpointable, torch.Tensor]:
    torch.manual_seed(0)
    wrapped = remat.Checkpointable(mlp(), mem_limit, **options)
    x = torch.randn(16, 16, requires_grad=True)
    wrapped.measure(x)
    return wrapped, x


def train_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


# ----------------------------------------------------------------------------- JSON
def test_a_plan_survives_json_to_the_byte() -> None:
    wrapped, _ = measured(0.5)
    plan = wrapped.plan_for()
    assert max(plan.forward_counts) > 1, "a budget of 0.5 must make something recompute"
    again = Plan.from_json(plan.to_json())
    assert again.schedule.items == plan.schedule.items
    assert again.budget == plan.budget
    assert again.groups == plan.groups
    assert again.predicted_peak_bytes == plan.predicted_peak_bytes
    assert again.predicted_time_s == plan.predicted_time_s
    assert again.measurement is None
    assert str(again) == str(plan)
    assert again.to_dict() == json.loads(plan.to_json())


def test_a_plan_document_that_contradicts_itself_is_refused() -> None:
    wrapped, _ = measured(0.5)
    document = wrapped.plan_for().to_dict()
    document["predicted_peak_bytes"] -= 1
    with pytest.raises(InvalidPlan, match="simulates to"):
        Plan.from_dict(document)
    with pytest.raises(InvalidPlan, match="format"):
        Plan.from_dict({"format": "something else"})
    with pytest.raises(InvalidPlan, match="not valid JSON"):
        Plan.from_json("{")
    document = wrapped.plan_for().to_dict()
    del document["measured"]
    with pytest.raises(InvalidPlan, match="incomplete"):
        Plan.from_dict(document)


# ----------------------------------------------------------------------------- the budget
def test_the_printed_plan_gives_one_budget_figure_and_its_split() -> None:
    wrapped, _ = measured(0.6)  # no loss_fn: a loss allowance, and a margin
    plan = wrapped.plan_for()
    split = plan.budget
    assert split.total_bytes == plan.budget_bytes
    assert split.loss_allowance_bytes > 0 and split.margin_bytes > 0 and split.held_outside_bytes > 0
    assert split.chain_bytes == split.total_bytes - split.margin_bytes - split.held_outside_bytes
    assert plan.schedule.budget_bytes == split.chain_bytes
    text = str(plan)
    budget_lines = [line for line in text.splitlines() if "budget" in line]
    figures = {format_bytes(split.total_bytes)}  # every line that names a budget names this one
    assert all(any(figure in line for figure in figures) for line in budget_lines), budget_lines
    line = next(line for line in text.splitlines() if line.strip().startswith("budget:"))
    for part in (split.total_bytes, split.chain_bytes, split.held_outside_bytes, split.margin_bytes):
        assert format_bytes(part) in line, (part, line)
    assert f"{format_bytes(split.loss_allowance_bytes)} of it for the loss" in line


def test_min_plans_at_the_smallest_feasible_budget() -> None:
    wrapped, _ = measured(0.5)
    minimum = wrapped.minimum_budget_bytes()
    with pytest.raises(remat.BudgetTooSmall) as error:
        wrapped.plan_for(minimum - 1)
    assert error.value.minimum_bytes == minimum
    plan = wrapped.plan_for("min")
    assert plan.budget_bytes == minimum and plan.predicted_peak_bytes <= minimum
    assert wrapped.plan_for(minimum).schedule.items == plan.schedule.items
    assert remat.Checkpointable(mlp(), "min").mem_limit == "min"


# ----------------------------------------------------------------------------- executing a plan
def test_executing_runs_the_given_plan_exactly() -> None:
    wrapped, x = measured(1.0)
    reference = copy.deepcopy(wrapped.model)
    tight = Plan.from_json(wrapped.plan_for("min").to_json())  # from JSON: no measurement
    assert max(tight.forward_counts) > 1
    calls = [0] * len(wrapped.model)

    def count(index: int) -> Any:
        def hook(*_: Any) -> None:
            calls[index] += 1

        return hook

    handles = [block[0].register_forward_pre_hook(count(i)) for i, block in enumerate(wrapped.model)]
    try:
        with wrapped.executing(tight) as running:
            assert running is tight
            out, grads = train_step(wrapped, x.detach().clone().requires_grad_(True))
    finally:
        for handle in handles:
            handle.remove()
    expected_out, expected_grads = train_step(reference, x.detach().clone().requires_grad_(True))
    assert torch.equal(out, expected_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    # the first layer of each block is a stage call; it runs as often as its planned stage
    per_block = [tight.forward_counts[g] for g, (first, _) in enumerate(tight.groups) if first % 3 == 0]
    assert calls == per_block
    assert wrapped._forced_plan is None  # the block ended: back to the plan for mem_limit


def test_expand_operations_maps_planned_stages_to_stage_calls() -> None:
    tree = (Region(0, 2, (Store(0), Store(1))), Store(2))
    groups = [(0, 2), (2, 3), (3, 5)]
    expanded = expand_operations(operations(tree), groups)
    forward = OperationKind.FORWARD_STORE
    assert expanded == [
        Operation(OperationKind.FORWARD_CHECKPOINT, 0),
        Operation(OperationKind.FORWARD_DISCARD, 1),
        Operation(OperationKind.FORWARD_DISCARD, 2),
        Operation(forward, 3),
        Operation(forward, 4),
        Operation(OperationKind.LOSS),
        Operation(OperationKind.BACKWARD, 4),
        Operation(OperationKind.BACKWARD, 3),
        Operation(forward, 0),
        Operation(forward, 1),
        Operation(forward, 2),
        Operation(OperationKind.BACKWARD, 2),
        Operation(OperationKind.BACKWARD, 1),
        Operation(OperationKind.BACKWARD, 0),
    ]


def test_the_executor_refuses_operations_that_are_no_schedule_of_the_chain() -> None:
    chain = remat.discover.sequential_chain(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))
    good = operations((Store(0), Region(1, 3, (Store(1), Store(2)))))
    ChainExecutor(chain, good)
    with pytest.raises(remat.RematError, match="expected a forward of stage 2"):
        ChainExecutor(chain, operations((Store(0), Store(1))))
    with pytest.raises(remat.RematError, match="expected backward"):
        ChainExecutor(chain, good[:-1] + [Operation(OperationKind.BACKWARD, 2)])
    with pytest.raises(remat.RematError, match="after its last backward"):
        ChainExecutor(chain, good + [Operation(OperationKind.BACKWARD, 0)])


# ----------------------------------------------------------------------------- device budgets
def test_mem_limit_none_budgets_from_the_measured_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model measured on CUDA is budgeted from that device's free memory, not host RAM."""
    import remat.automatic as automatic

    profile = random_chain(5, 4, max_units=40, unit_bytes=64)
    asked: list[torch.device] = []

    def fake_measure_chain(*args: Any, **kwargs: Any) -> ChainMeasurement:
        cuda_profile = dataclasses.replace(profile, metadata={"device": "cuda:0"})
        return ChainMeasurement(
            stages=[], groups=[(k, k + 1) for k in range(4)], profile=cuda_profile, fixed_bytes=0,
            measured_peak_bytes=0, end_peak_bytes=0,
        )  # fmt: skip

    def fake_mem_get_info(device: Any = None) -> tuple[int, int]:
        asked.append(torch.device(device))
        return 7_000_000, 80_000_000

    monkeypatch.setattr(automatic, "measure_chain", fake_measure_chain)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake_mem_get_info)
    wrapped = remat.Checkpointable(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), None, margin=0.0)
    wrapped.measure(torch.zeros(1, 2))
    plan = wrapped.plan_for()
    assert asked == [torch.device("cuda:0")]
    assert plan.budget_bytes == int(7_000_000 * (1 - remat.budget.FREE_MEMORY_MARGIN))


def test_budget_split_of_unlimited() -> None:
    split = BudgetSplit.unlimited(held_outside_bytes=5)
    assert split.total_bytes is None and split.chain_bytes is None and split.held_outside_bytes == 5


def test_budgets_of_equal_value_and_different_form_are_different_plans() -> None:
    """1 is one byte and 1.0 is all of the memory: the plan cache must not mix them up."""
    wrapped, _ = measured(1.0)
    everything = wrapped.plan_for(1.0)
    assert everything.budget_bytes is not None and everything.budget_bytes > 1
    with pytest.raises(remat.BudgetTooSmall):
        wrapped.plan_for(1)
