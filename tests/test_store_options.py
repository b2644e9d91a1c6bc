"""The automatic mode storing stages under a policy (``remat.enable(model, budget, policy=...)``).

NOTE [stored under a policy] and NOTE [sizing store options]: the planner may store a stage
as a selective recompute block under the given policies. Gradients, outputs and buffers
are compared with plain autograd (``torch.equal``), and the peak with the exact tracker.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import remat
import remat.automatic
from remat import policies
from remat.discover.chain import discover_chain
from remat.errors import RematError
from remat.execute import ChainExecutor
from remat.plan import Region, Schedule, Store


class Block(nn.Module):
    """A pre-norm MLP block: its matrix products are most of its work, not of its memory."""

    def __init__(self, width: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.drop(torch.nn.functional.gelu(self.fc1(self.norm(x))))))


class Tower(nn.Module):
    def __init__(self, depth: int = 5, width: int = 32, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def plain_step(model: nn.Module, x: torch.Tensor, seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    loss_fn(out).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def free_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store options cost no time: the planner takes them wherever they fit (their figures
    of bytes stay measured), whatever this machine's timings."""
    measured = remat.automatic.with_store_options

    def free(*args: Any, **kwargs: Any) -> Any:
        measurement = measured(*args, **kwargs)
        profile = measurement.profile
        options = tuple(
            dataclasses.replace(option, extra_time_s=(0.0,) * profile.n_stages) for option in profile.store_options
        )
        return dataclasses.replace(measurement, profile=dataclasses.replace(profile, store_options=options))

    monkeypatch.setattr(remat.automatic, "with_store_options", free)


def options_taken(control: remat.Checkpointable) -> list[str | None]:
    plan = control.plan
    assert plan is not None
    return [op.option for op in plan.schedule.operations if op.option is not None]


def trained_against_plain(budget: float, **options: Any) -> tuple[remat.Checkpointable, Any]:
    """A dropout tower enabled at `budget` with `options`: its second step's output and
    gradients are asserted equal to the plain model's; returns the controller and the
    check of a third step."""
    torch.manual_seed(0)
    model = Tower(p=0.2)
    twin = copy.deepcopy(model)
    x = torch.randn(16, 24, 32)
    expected = plain_step(model, x)
    control = remat.enable(twin, budget, loss_fn=loss_fn, **options)
    plain_step(twin, x)  # measures, plans and runs the plan
    got = plain_step(twin, x)
    assert torch.equal(expected[0], got[0])
    for a, b in zip(expected[1], got[1], strict=True):
        assert torch.equal(a, b)
    with control.check_step() as check:
        plain_step(twin, x)
    return control, check


@pytest.mark.usefixtures("free_options")
@pytest.mark.parametrize("budget", [0.7, 0.45])
def test_stages_stored_under_a_policy_give_plain_gradients_within_the_budget(budget: float) -> None:
    control, check = trained_against_plain(budget, policy=policies.save_matmuls)
    assert "save_matmuls" in options_taken(control)
    assert check.within_budget
    assert 0.99 <= check.ratio <= 1.0  # the prediction, to within 1% of the measured peak
    assert "policy: save_matmuls" in str(control.plan)


def test_the_first_step_draws_what_plain_draws_while_the_cost_model_is_calibrated() -> None:
    # The first step measures the model and, for store options, calibrates the device's
    # cost model (once per process): its tensors come from a generator of its own, so the
    # step's dropout masks, and the draws after it, are those of plain training.
    from remat.measure import estimate

    estimate._calibrate.cache_clear()
    torch.manual_seed(0)
    model = Tower(p=0.2)
    twin = copy.deepcopy(model)
    x = torch.randn(16, 24, 32)
    expected = plain_step(model, x)
    after_plain = torch.rand(4)
    remat.enable(twin, 0.45, loss_fn=loss_fn, policy=policies.save_matmuls)
    got = plain_step(twin, x)
    assert estimate._calibrate.cache_info().currsize > 0  # (the calibration ran in this step)
    assert torch.equal(expected[0], got[0])
    for a, b in zip(expected[1], got[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(torch.rand(4), after_plain)


def test_options_are_planned_only_where_they_pay() -> None:
    model = Tower()
    x = torch.randn(16, 24, 32)
    control = remat.enable(model, 1.0, policy=[policies.save_matmuls, policies.save_nothing], loss_fn=loss_fn)
    plain_step(model, x)
    profile = control.plan.measurement.profile
    assert [option.name for option in profile.store_options] == ["save_matmuls", "save_nothing"]
    # storing whole fits: nothing is recomputed, under a policy or otherwise
    assert options_taken(control) == [] and control.plan.overhead_fraction == 0.0
    matmuls, nothing = profile.store_options
    for stage in range(len(model.blocks)):
        # a block keeps less under save_matmuls than stored whole, and its input alone under save_nothing
        assert nothing.saved_bytes[stage] < matmuls.saved_bytes[stage] < profile.saved_bytes[stage]
        assert matmuls.extra_time_s[stage] > 0
    assert remat.plan.ChainProfile.from_json(profile.to_json()) == profile


@pytest.mark.usefixtures("free_options")
def test_batch_norm_statistics_are_updated_once_under_an_option() -> None:
    class ConvBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(8, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn(self.conv(x))) + x

    torch.manual_seed(1)
    model = nn.Sequential(*(ConvBlock() for _ in range(4)), nn.Flatten(), nn.Linear(8 * 12 * 12, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8, 12, 12)
    expected = plain_step(model, x)
    control = remat.enable(twin, 0.6, policy=policies.save_ops(torch.ops.aten.convolution), loss_fn=loss_fn)
    got = plain_step(twin, x)
    assert options_taken(control)
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))
    for a, b in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.equal(a, b)  # running statistics once, as without recompute
    assert control.plan.predicted_peak_bytes <= control.plan.budget.total_bytes


def test_a_stage_stored_under_a_policy_inside_a_region_body() -> None:
    torch.manual_seed(2)
    model = Tower(depth=4, p=0.3)
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16, 32)
    expected = plain_step(model, x)
    chain = discover_chain(twin, (x,), {})
    stages = len(chain)
    body = (Store(0, "save_matmuls"), Region(1, 3, (Store(1), Store(2, "save_matmuls"))))
    plan = (Region(0, 3, body),) + tuple(Store(stage, "save_matmuls") for stage in range(3, stages - 1))
    plan += (Store(stages - 1),)
    executor = ChainExecutor(chain, plan, policies={"save_matmuls": policies.save_matmuls})
    torch.manual_seed(3)
    out = executor(twin, (x,), {})
    loss_fn(out).backward()
    assert torch.equal(expected[0], out.detach())
    for a, b in zip(expected[1], [p.grad for p in twin.parameters()], strict=True):
        assert torch.equal(a, b)


def test_what_cannot_be_stored_under_a_policy_is_refused_clearly() -> None:
    model = Tower(depth=2)
    x = torch.randn(4, 8, 32)
    chain = discover_chain(model, (x,), {})
    with pytest.raises(RematError, match="whose policies were not given"):
        ChainExecutor(chain, (Store(0, "save_matmuls"), Store(1), Store(2)))
    with pytest.raises(NotImplementedError, match="mapping"):
        remat.enable(Tower(), 0.5, policy={"blocks.0": policies.save_matmuls})
    with pytest.raises(RematError, match="twice"):
        remat.enable(Tower(), 0.5, policy=[policies.save_matmuls, policies.save_matmuls])


@pytest.mark.usefixtures("free_options")
def test_a_saved_plan_with_options_is_pinned_with_its_policies(tmp_path: Any) -> None:
    torch.manual_seed(4)
    model = Tower(depth=4)
    x = torch.randn(8, 16, 32)
    expected = plain_step(copy.deepcopy(model), x)
    enabled = copy.deepcopy(model)
    control = remat.enable(enabled, 0.7, policy=policies.save_matmuls, loss_fn=loss_fn)
    plain_step(enabled, x)
    assert options_taken(control)
    path = tmp_path / "plan.json"
    path.write_text(control.plan.to_json())
    pinned = copy.deepcopy(model)
    remat.enable(pinned, plan=str(path), policy=policies.save_matmuls)
    got = plain_step(pinned, x)
    assert torch.equal(expected[0], got[0])
    assert all(torch.equal(a, b) for a, b in zip(expected[1], got[1], strict=True))
    without = copy.deepcopy(model)
    remat.enable(without, plan=str(path))
    with pytest.raises(RematError, match="whose policies were not given"):
        plain_step(without, x)


def test_the_timing_pass_times_each_stage_under_each_policy() -> None:
    # NOTE [timing store options]: the extra seconds of a policy are timed, not estimated,
    # for every group of one stage call whose backward the timing pass runs
    model = Tower(depth=3)
    x = torch.randn(8, 16, 32)
    control = remat.enable(model, 0.8, policy=[policies.save_matmuls, policies.save_nothing], loss_fn=loss_fn)
    plain_step(model, x)
    measurement = control.plan.measurement
    timed = [extra for extra in measurement.option_extra_s if extra]
    assert len(timed) >= len(model.blocks)
    assert all(set(extra) == {"save_matmuls", "save_nothing"} for extra in timed)
    option = measurement.profile.store_option("save_matmuls")
    for stage, (first, stop) in enumerate(measurement.groups):
        if stop - first == 1 and measurement.option_extra_s[first]:
            assert option.extra_time_s[stage] == measurement.option_extra_s[first]["save_matmuls"]


def test_an_output_the_model_code_after_a_stage_saves_is_kept_under_a_policy_too() -> None:
    # The glue after a stage (here a ReLU after a residual addition) runs as it is when the
    # stage is stored under a policy, and saves the stage's output x_{i+1} for its
    # backward: the option must hold it, as storing whole does.
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = torch.relu(block(x) + x)
            return x

    model = Residual()
    # (save_nothing keeps no operation, so not the block's last product either)
    control = remat.enable(model, 1.0, policy=policies.save_nothing, loss_fn=loss_fn)
    plain_step(model, torch.randn(16, 32))
    profile = control.plan.measurement.profile
    option = profile.store_option("save_nothing")
    assert any(profile.saves_output)
    for stage in range(profile.n_stages):
        assert option.saves_output[stage] or not profile.saves_output[stage]


def test_an_untimed_stage_s_estimate_is_scaled_by_the_timed_ones() -> None:
    # NOTE [sizing store options]: where a stage cannot be timed under the policy (here the
    # last, whose backward starts from the loss), its estimate is scaled by how the timed
    # stages' estimates compared with their timings: twice the timings, twice its estimate
    from remat.measure.options import store_options

    model = Tower(depth=3)
    x = torch.randn(8, 16, 32)
    named = {"save_matmuls": policies.save_matmuls}
    control = remat.enable(model, 0.8, policy=policies.save_matmuls, loss_fn=loss_fn)
    plain_step(model, x)
    measurement = control.plan.measurement
    chain = next(iter(control._chains.values()))
    remat.disable(model)  # sized again below, as the model itself
    last = measurement.profile.n_stages - 1
    assert "save_matmuls" not in measurement.option_extra_s[measurement.groups[last][0]]

    def untimed_extra(factor: float) -> float:
        doubled = tuple({k: factor * v for k, v in extra.items()} for extra in measurement.option_extra_s)
        varied = dataclasses.replace(measurement, option_extra_s=doubled)
        (option,) = store_options(model, chain, varied, (x,), {}, torch.device("cpu"), named)
        return option.extra_time_s[last]

    once, twice = untimed_extra(1.0), untimed_extra(2.0)
    assert once > 0 and twice == pytest.approx(2 * once, rel=1e-9)


def test_comm_options_of_the_automatic_mode_are_checked() -> None:
    # NOTE [planned collectives]: "auto" is planned under a budget; "save" is manual only
    with pytest.raises(RematError, match="'auto' lets the planner keep them"):
        remat.enable(Tower(), 0.5, comm="save")
    with pytest.raises(RematError, match="comm must be one of"):
        remat.enable(Tower(), 0.5, comm="keep")
    with pytest.raises(RematError, match="policy=remat.policies.either"):
        remat.enable(Tower(), policy=policies.save_matmuls, comm="auto")
    control = remat.enable(Tower(), 0.5, policy=policies.save_matmuls, comm="auto")
    assert sorted(control._policies) == [
        "either(save_matmuls, save_collectives)",
        "save_collectives",
        "save_matmuls",
    ]
    assert remat.enable(Tower(), 0.5)._policies == {}


@pytest.mark.usefixtures("free_options")
def test_comm_auto_offers_keeping_collectives_and_stays_exact() -> None:
    # without collectives, a stage stored under save_collectives recomputes all of itself
    control, check = trained_against_plain(0.45, comm="auto")
    assert set(options_taken(control)) == {"save_collectives"}
    assert check.within_budget


class _TinyResidual(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("options", [{"policy": [policies.save_matmuls]}, {"comm": "auto"}])
def test_the_first_step_of_a_small_model_keeps_the_least_budget_with_store_options(options: dict[str, Any]) -> None:
    # the options' cost model once held 64 KiB whatever the model: 3 times this step's budget
    from remat.measure.estimate import _calibrate

    _calibrate.cache_clear()  # (measured once per process: measured in this step)
    torch.manual_seed(0)
    model = nn.Sequential(*(_TinyResidual() for _ in range(3)), nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    enabled = remat.enable(model, "min", **options)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for _ in range(2):
        with enabled.check_step() as check:
            (model(x) - y).pow(2).mean().backward()
        assert check.within_budget, check
        (reference(x) - y).pow(2).mean().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_the_report_counts_the_second_run_of_a_stage_stored_under_a_policy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(_TinyResidual(64) for _ in range(4)), nn.Linear(64, 8))
    control = remat.enable(model, 1.0, policy=[policies.save_matmuls])
    x = torch.randn(128, 64)
    model(x).square().mean().backward()
    base = control.plan
    assert base is not None
    profile = base.schedule.profile
    items = tuple(Store(i, option="save_matmuls") if i in (1, 2) else Store(i) for i in range(profile.n_stages))
    schedule = Schedule.from_plan(profile, items, budget_bytes=base.schedule.budget_bytes)
    plan = dataclasses.replace(base, schedule=schedule)
    calls = dict.fromkeys(range(5), 0)
    for index, module in enumerate(model):
        module.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    with control.executing(plan):
        model(x).square().mean().backward()
    assert [row.forward_runs for row in plan.report().rows] == [calls[i] for i in range(5)] == [1, 2, 2, 1, 1]
    assert "0 of 5 stages (and 2 stored under a policy, run again in part), 2 extra forwards" in str(plan)
