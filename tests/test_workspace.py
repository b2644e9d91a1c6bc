"""Workspaces a device's allocator hands out inside one operator (NOTE [device workspaces]).

A GPU's allocator is not there on the CPU: a stand-in plays it. A custom operator "takes"
a workspace from the stand-in's counters inside its call (forward and backward, of
different sizes) and gives it back, as cuDNN's convolutions do with the caching
allocator; the probe reads the stand-in where it would read CUDA's.
"""

from __future__ import annotations

import copy
import importlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
import remat.measure.workspace as workspace
from remat.measure.workspace import WorkspaceProbe, timing_passes, with_workspaces

FORWARD_WORKSPACE = 3 << 20
BACKWARD_WORKSPACE = 5 << 20


class StandInAllocator:
    """An allocator's counters: bytes allocated now, and the most at once since a restart."""

    def __init__(self) -> None:
        self.live = 0
        self.highest = 0
        self.reads = 0

    def allocated(self) -> int:
        self.reads += 1
        return self.live

    def restart_peak(self) -> None:
        self.highest = self.live

    def peak_and_allocated(self) -> tuple[int, int]:
        return self.highest, self.allocated()

    def scratch(self, nbytes: int) -> None:
        """A workspace taken and given back inside one call."""
        self.highest = max(self.highest, self.live + nbytes)

    def keep(self, nbytes: int) -> None:
        """An allocation still held when the call returns (a library's own, kept between calls)."""
        self.live += nbytes
        self.highest = max(self.highest, self.live)


ALLOCATOR = StandInAllocator()


@torch.library.custom_op("remat_test::scratch_scale", mutates_args=())
def scratch_scale(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    ALLOCATOR.scratch(FORWARD_WORKSPACE)
    return x * weight


@scratch_scale.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("remat_test::scratch_scale_backward", mutates_args=())
def scratch_scale_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ALLOCATOR.scratch(BACKWARD_WORKSPACE)
    return grad * weight, (grad * x).sum(0)


@scratch_scale_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(grad), torch.empty_like(weight)


def _setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight = ctx.saved_tensors
    return scratch_scale_backward(grad, x, weight)


scratch_scale.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    def __init__(self, width: int, scratch: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.scratch = scratch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        x = scratch_scale(x, self.weight) if self.scratch else x * self.weight
        return torch.tanh(x)


class Stack(nn.Module):
    def __init__(self, width: int = 64, depth: int = 5, scratch_at: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, i == scratch_at) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _model_and_input() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Stack(), torch.randn(256, 64, requires_grad=True)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> StandInAllocator:
    """The CPU's allocator read through the stand-in's counters."""
    monkeypatch.setattr(workspace, "allocator_counters", lambda device: ALLOCATOR)
    ALLOCATOR.__init__()  # type: ignore[misc]
    return ALLOCATOR


def _measured(measure: str = "sized", mem_limit: Any = None) -> tuple[remat.Checkpointable, Any]:
    model, x = _model_and_input()
    wrapped = remat.Checkpointable(model, mem_limit, loss_fn=_loss, measure=measure)
    return wrapped, wrapped.measure(x)


def _group_of(measurement: Any, stage_name: str) -> int:
    return next(g for g, name in enumerate(measurement.profile.names) if stage_name in name)


def test_the_probe_counts_what_an_operator_gives_back_not_what_it_keeps() -> None:
    allocator = StandInAllocator()
    probe = WorkspaceProbe(allocator)

    @torch.library.custom_op("remat_test::keeps_and_scratches", mutates_args=())
    def keeps_and_scratches(x: torch.Tensor) -> torch.Tensor:
        allocator.keep(7_000)
        allocator.scratch(1_000)
        allocator.scratch(500)  # after the 1,000 was given back
        return x + 1

    x = torch.ones(3)
    with probe:
        keeps_and_scratches(x)
        x * 2
        # the most held during the call, 7,000 kept and 1,000 scratch: 1,000 above what is
        # allocated around it (not the 1,500 of the two scratch allocations together)
        assert probe.take() == 1_000
        assert probe.take() == 0  # taken: the next stretch starts empty
        x * 2
        assert probe.take() == 0 and probe.largest_seen == 1_000


def test_the_timing_pass_runs_the_probe_on_a_pass_whose_times_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert timing_passes(cuda) == (2, 0)
    # cuDNN's benchmark tries its algorithms, with workspaces of their own, at each shape's first call
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert timing_passes(cuda) == (3, 1)
    assert timing_passes(cpu) == (1, None)  # no allocator to read


def test_workspaces_enter_the_transient_bytes_of_the_stage_that_takes_them(stand_in: StandInAllocator) -> None:
    _, without = _measured()  # the stand-in's counters read, not the plain CPU's
    assert stand_in.reads > 0
    assert without.profile.metadata["workspace_bytes"] == BACKWARD_WORKSPACE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workspace, "allocator_counters", lambda device: None)
        _, plain = _measured()
    assert "workspace_bytes" not in plain.profile.metadata
    g = _group_of(without, "blocks.2")
    forward_extra = [a - b for a, b in zip(without.profile.forward_temp_bytes, plain.profile.forward_temp_bytes)]
    backward_extra = [a - b for a, b in zip(without.profile.backward_temp_bytes, plain.profile.backward_temp_bytes)]
    assert forward_extra[g] == FORWARD_WORKSPACE and backward_extra[g] == BACKWARD_WORKSPACE
    assert not any(forward_extra[:g] + forward_extra[g + 1 :])
    assert not any(backward_extra[:g] + backward_extra[g + 1 :])
    # everything else is the same measurement
    for field in ("activation_bytes", "gradient_bytes", "saved_bytes", "names"):
        assert getattr(without.profile, field) == getattr(plain.profile, field)


def test_a_plain_measuring_step_charges_the_largest_workspace_to_every_stage(stand_in: StandInAllocator) -> None:
    _, probed = _measured("plain")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workspace, "allocator_counters", lambda device: None)
        _, plain = _measured("plain")
    for field in ("forward_temp_bytes", "backward_temp_bytes"):
        extra = [a - b for a, b in zip(getattr(probed.profile, field), getattr(plain.profile, field))]
        assert extra == [BACKWARD_WORKSPACE] * len(extra)


def test_the_least_budget_holds_the_workspace_and_the_plan_stays_exact(stand_in: StandInAllocator) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workspace, "allocator_counters", lambda device: None)
        wrapped, _ = _measured()
        least_without = wrapped.minimum_budget_bytes()
    model, x = _model_and_input()
    reference = copy.deepcopy(model)
    wrapped = remat.Checkpointable(model, "min", loss_fn=_loss)
    _loss(wrapped(x)).backward()
    plan = wrapped.plan
    assert plan is not None
    assert plan.budget_bytes > least_without
    assert plan.budget_bytes >= least_without + FORWARD_WORKSPACE  # the stage's workspace on top
    x_reference = x.detach().clone().requires_grad_()
    _loss(reference(x_reference)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(x.grad, x_reference.grad)


def test_a_measurement_without_workspaces_is_left_as_it_is(stand_in: StandInAllocator) -> None:
    _, measurement = _measured()
    n_calls = len(measurement.stages)
    assert with_workspaces(measurement, [0] * n_calls, [0] * n_calls) is measurement


def test_a_plan_says_how_much_workspace_it_counts(stand_in: StandInAllocator) -> None:
    model, x = _model_and_input()
    wrapped = remat.Checkpointable(model, None, loss_fn=_loss)
    _loss(wrapped(x)).backward()
    plan = wrapped.plan
    assert plan is not None
    assert "workspaces:      up to 5.00 MiB above a stage's tensors" in str(plan.schedule)
    assert plan.schedule.report().to_dict()["workspace_bytes"] == BACKWARD_WORKSPACE


def test_a_backward_the_pass_does_not_run_takes_the_largest_workspace_it_saw(stand_in: StandInAllocator) -> None:
    # at the least budget the pass times no group's backward here: each is charged the
    # largest workspace of the forwards (the backward's own, larger, is not known)
    model, x = _model_and_input()
    wrapped = remat.Checkpointable(model, "min", loss_fn=_loss)
    _loss(wrapped(x)).backward()
    plan = wrapped.plan
    assert plan is not None
    assert plan.schedule.profile.metadata["workspace_bytes"] == FORWARD_WORKSPACE


STRETCH = StandInAllocator()


@torch.library.custom_op("remat_test::allocates", mutates_args=())
def allocates(x: torch.Tensor, nbytes: int, scratch: int) -> torch.Tensor:
    STRETCH.keep(nbytes)
    STRETCH.scratch(scratch)
    return x + 1


@pytest.mark.parametrize("stored", [True, False])
def test_what_a_workspace_adds_to_a_stretch(stored: bool) -> None:
    # Stored (run as the planned step runs it): what the workspaces rose above the stretch's
    # highest allocated count; a workspace below it adds nothing. Without grad (saved
    # tensors do not pile up as in the planned step's): the largest workspace, whole.
    STRETCH.__init__()  # type: ignore[misc]
    probe = WorkspaceProbe(STRETCH)
    x = torch.ones(3)
    with probe:
        allocates(x, 1_000, 4_000)  # 1,000 allocated, 5,000 with the workspace
        allocates(x, 6_000, 0)  # 7,000 allocated: the workspace stood below it
        assert probe.take(stored=stored) == (0 if stored else 4_000)
        allocates(x, 0, 3_000)  # 10,000 with the workspace, on 7,000
        allocates(x, 1_000, 0)  # 8,000
        assert probe.take(stored=stored) == (2_000 if stored else 3_000)
        assert probe.take(stored=stored) == 0  # each take starts a new stretch
    assert probe.largest_seen == 4_000


def test_a_shape_whose_times_are_scaled_takes_the_workspace_of_the_shape_timed(stand_in: StandInAllocator) -> None:
    model, _ = _model_and_input()
    wrapped = remat.Checkpointable(model, None, loss_fn=_loss)
    for rows in (256, 384):  # the second is within the scaling range of the first: not timed
        _loss(wrapped(torch.randn(rows, 64))).backward()
        plan = wrapped.plan
        assert plan is not None
        metadata = plan.schedule.profile.metadata
        if rows == 256:
            assert metadata["workspace_largest_bytes"] == BACKWARD_WORKSPACE
    assert wrapped.measure_counts["scaled"] == 1
    # the largest, grown with the work (x1.5), for every stage
    assert metadata["workspace_bytes"] == metadata["workspace_largest_bytes"] == BACKWARD_WORKSPACE * 3 // 2


def test_a_measuring_pass_that_went_over_with_its_workspaces_is_warned(stand_in: StandInAllocator) -> None:
    # The pass that finds the workspaces keeps to the budget by the tensors alone: 4 MiB
    # fits the backward of blocks.2 without its 5 MiB workspace, not with it. Said at once;
    # then no plan fits with the workspaces, and the error names the least budget that does.
    model, x = _model_and_input()
    before = [p.detach().clone() for p in model.parameters()]
    wrapped = remat.Checkpointable(model, 4 << 20, loss_fn=_loss)
    with (
        pytest.warns(RuntimeWarning, match=r"went over the budget by up to 5\.00 MiB: workspaces"),
        pytest.raises(remat.BudgetTooSmall) as refused,
    ):
        _loss(wrapped(x)).backward()
    assert refused.value.minimum_bytes > BACKWARD_WORKSPACE > 4 << 20
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_a_pass_within_the_budget_with_its_workspaces_is_not_warned(stand_in: StandInAllocator) -> None:
    model, x = _model_and_input()
    wrapped = remat.Checkpointable(model, 64 << 20, loss_fn=_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loss(wrapped(x)).backward()
    assert wrapped.plan is not None and wrapped.plan.schedule.profile.metadata["workspace_bytes"] > 0
    assert not [w for w in caught if "went over the budget" in str(w.message)]


def test_a_pass_after_the_probes_times_only_the_backwards_that_fit_with_the_workspaces(
    stand_in: StandInAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = _group_of(_measured()[1], "blocks.2")
    # as on a GPU: two passes, the probe on the first, whose times are dropped
    step = importlib.import_module("remat.measure.step")
    monkeypatch.setattr(workspace, "timing_passes", lambda device: (2, 0))
    passes: list[tuple[frozenset[int] | None, bool]] = []
    timed = step.time_groups

    def noted(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("rehearsal", False) and not kwargs.get("track_all", False):
            passes.append((args[7], kwargs.get("workspace") is not None))
        return timed(*args, **kwargs)

    monkeypatch.setattr(step, "time_groups", noted)
    model, x = _model_and_input()
    wrapped = remat.Checkpointable(model, 4 << 20, loss_fn=_loss)
    with pytest.warns(RuntimeWarning, match="went over the budget"), pytest.raises(remat.BudgetTooSmall):
        _loss(wrapped(x)).backward()
    (first, probed), (second, unprobed) = passes
    assert probed and not unprobed
    assert first is not None and g in first  # fits by its tensors
    assert second is not None and g not in second  # not with its 5 MiB workspace
    assert first - {g} == second
