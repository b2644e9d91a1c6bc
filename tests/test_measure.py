"""remat.measure: the measured profile, its device, and the tracker API measurement reads."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from remat.discover.chain import discover_chain
from remat.measure import ChainMeasurement, measure_chain
from remat.measure.groups import group_stages
from remat.measure.instrument import StageMeasurement
from remat.measure.timing import FORWARD_REPEATS
from remat.memory import MemoryTracker, Window
from remat.models import mlp_chain

pytestmark = pytest.mark.usefixtures("clean_remat_state")

FLOAT = 4  # bytes of a float32


def _measure(model: nn.Module, sample: torch.Tensor, *, frugal: bool = False) -> ChainMeasurement:
    chain = discover_chain(model, (sample,), {})
    return measure_chain(model, chain, (sample,), {}, frugal=frugal)


@pytest.mark.parametrize("frugal", [False, True])
def test_the_profile_names_the_device_the_step_ran_on(frugal: bool) -> None:
    measurement = _measure(mlp_chain(4, 16), torch.randn(8, 16), frugal=frugal)
    assert measurement.profile.metadata["device"] == "cpu"
    assert measurement.profile.metadata["fixed_bytes"] == measurement.fixed_bytes
    assert measurement.profile.metadata["measured_peak_bytes"] == measurement.measured_peak_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_profile_names_the_cuda_device() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    measurement = _measure(mlp_chain(4, 16).to(device), torch.randn(8, 16, device=device))
    assert measurement.profile.metadata["device"] == str(device)


def test_the_device_survives_a_json_round_trip() -> None:
    profile = _measure(mlp_chain(3, 16), torch.randn(8, 16)).profile
    assert type(profile).from_json(profile.to_json()).metadata["device"] == "cpu"


def test_frugal_and_plain_measurements_agree_on_what_is_kept() -> None:
    torch.manual_seed(0)
    model = mlp_chain(6, 32)
    sample = torch.randn(8, 32)
    plain = _measure(model, sample)
    frugal = _measure(model, sample, frugal=True)
    assert plain.groups == frugal.groups
    assert plain.profile.activation_bytes == frugal.profile.activation_bytes
    assert plain.profile.saved_bytes == frugal.profile.saved_bytes
    assert plain.profile.saves_input == frugal.profile.saves_input
    assert plain.profile.saves_output == frugal.profile.saves_output


def test_a_measurement_built_by_hand_needs_no_end_peak() -> None:
    profile = _measure(mlp_chain(2, 8), torch.randn(4, 8)).profile
    measurement = ChainMeasurement(stages=[], groups=[(0, 1)], profile=profile, fixed_bytes=0, measured_peak_bytes=0)
    assert measurement.end_peak_bytes == 0
    assert measurement.output_bytes == 0


def test_stages_that_keep_nothing_or_work_in_place_ride_with_the_stage_before() -> None:
    def stage(*, saved: bool = True, in_place: bool = False, linked: bool = True) -> StageMeasurement:
        return StageMeasurement(
            "s",
            input_storages={1: 4} if linked else {},
            saved_storages={2: (4, 0)} if saved else {},
            modifies_input=in_place,
        )

    stages = [stage(), stage(saved=False), stage(), stage(in_place=True), stage(linked=False), stage()]
    assert group_stages(stages) == [(0, 2), (2, 5), (5, 6)]


# ----------------------------------------------------------------------------- tracker API
def test_a_window_of_the_event_stream() -> None:
    with MemoryTracker() as tracker:
        a = torch.empty(10)
        start = tracker.n_events
        b = torch.empty(20)
        del b
        c = torch.empty(5)
        stop = tracker.n_events
        del a
    assert tracker.window(start, stop) == Window(10 * FLOAT, 30 * FLOAT, 15 * FLOAT)
    assert tracker.window(start, start) == Window(10 * FLOAT, 10 * FLOAT, 10 * FLOAT)
    assert tracker.window().peak_bytes == tracker.peak_bytes == 30 * FLOAT
    assert tracker.window(stop).after_bytes == tracker.live_bytes == 5 * FLOAT
    del c


def test_the_tracker_notes_what_autograd_saves() -> None:
    weight = torch.randn(8, 8, requires_grad=True)
    with MemoryTracker() as tracker, tracker.saved_tensors_hooks():
        x = torch.randn(4, 8)
        hidden = x @ weight  # saves x (and the weight, which is not tracked)
        mark = tracker.n_saved
        out = hidden.sin()  # saves hidden
        saved = tracker.saved_allocations(mark)
        assert saved == [tracker.allocation_id(hidden)]
        assert tracker.allocation_id(x) in tracker.saved_allocations()
        records = tracker.allocation_records(saved)
        assert records[saved[0]].nbytes == 4 * 8 * FLOAT
        assert tracker.allocations_of([hidden, weight]) == {saved[0]: 4 * 8 * FLOAT}
        out.sum().backward()
    assert weight.grad is not None


class _SlowOnce(nn.Module):
    """Sleeps 60 ms at its first call on real tensors, 1 ms at the others (a cold start)."""

    def __init__(self) -> None:
        super().__init__()
        self.real_calls: list[None] = []  # not a number: measuring puts those back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, FakeTensor):
            self.real_calls.append(None)
            time.sleep(0.06 if len(self.real_calls) == 1 else 0.001)
        return torch.tanh(x)


def test_a_short_stage_is_timed_as_the_median_of_several_runs() -> None:
    """One sample of a short stage is at the mercy of a cold start; the median is not."""
    slow = _SlowOnce()
    model = nn.Sequential(nn.Linear(16, 16), slow, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    chain = discover_chain(model, (torch.randn(8, 16),), {})
    measurement = measure_chain(model, chain, (torch.randn(8, 16),), {}, sized=True)
    stage = next(index for index, module in enumerate(chain.modules) if module is slow)
    assert len(slow.real_calls) == 1 + FORWARD_REPEATS
    assert measurement.stages[stage].forward_time_s < 0.03


class _Clock:
    """A stand-in for ``time.perf_counter`` that the model's own code can move forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now


def test_the_code_between_two_stages_is_timed_with_the_stage_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [glue time]: a replay runs that code again after the stage, so it costs with it."""
    clock = _Clock()
    monkeypatch.setattr("remat.measure.timing.time", clock)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(16, 16)
            self.second = nn.Linear(16, 16)
            self.third = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x)
            clock.now += 1.0  # the model's own code between the first two stages: a second
            h = self.second(torch.tanh(h))
            out = self.third(h)
            clock.now += 5.0  # after the last stage: not the chain's (never replayed)
            return out

    model = Model()
    sample = torch.randn(8, 16)
    chain = discover_chain(model, (sample,), {})
    assert chain.modules == [model.first, model.second, model.third]
    measurement = measure_chain(model, chain, (sample,), {}, sized=True)
    forward_s = [stage.forward_time_s for stage in measurement.stages]
    assert 1.0 < forward_s[0] < 1.1
    assert forward_s[1] < 0.1 and forward_s[2] < 0.1


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(hidden)) * mask


class _MaskedBlocks(nn.Module):
    """Blocks given a mask that the model makes once, after its first stage (as a decoder's
    attention mask is made after its embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        mask = (x.abs() < 10).to(x.dtype)
        for block in self.blocks:
            hidden = block(hidden, mask)
        return hidden


@pytest.mark.parametrize("measure", ["sized", "plain"])
def test_a_side_input_given_to_every_stage_does_not_hold_their_inputs(measure: str) -> None:
    import remat

    torch.manual_seed(0)
    wrapper = remat.Checkpointable(_MaskedBlocks(), None, measure=measure, loss_fn=lambda out: out.sum())
    measurement = wrapper.measure(torch.randn(64, 32))
    # each block's input (the block before's output) dies with the block that takes it; the
    # mask, which every block takes, is held with the first block only (and made in glue:
    # a glue constant), not again with each block
    assert measurement.input_held_until == (0, 4, 2, 3, 4)
    mask_bytes = 64 * 32 * 4
    assert [nbytes for nbytes, *_ in measurement.glue_constants] == [mask_bytes]
    # and the smallest budget holds, the mask alive through every block
    model = _MaskedBlocks()
    wrapper = remat.Checkpointable(model, "min", measure=measure, loss_fn=lambda out: out.sum())
    x = torch.randn(64, 32)
    wrapper.measure(x)  # (a plain measuring step is not bounded by the budget)
    with MemoryTracker(exclude_grads_of=model.parameters()) as tracker:
        wrapper(x).sum().backward()
    assert wrapper.plan is not None and max(wrapper.plan.forward_counts) > 1
    assert tracker.peak_bytes <= wrapper.plan.budget_bytes


class _ResidualLayer(nn.Module):
    """A RegNet-shaped layer: its main path opens on a stage that keeps nothing (fused into
    the stage before's group), and its shortcut runs on its input after the main path."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Identity(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.shortcut = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x) + self.shortcut(x))


def _trains_within_the_least_budget(
    model: nn.Module,
    x: torch.Tensor,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    nested: bool = False,
    refused: type[Warning] = RuntimeWarning,
) -> None:
    """Two steps at "min", each within the budget, warnings of `refused` raised (the sized
    measuring step, not a plain one), a plan that recomputes, gradients as plain autograd's."""
    import warnings

    import remat

    reference = copy.deepcopy(model)
    loss_fn(reference(x)).backward()
    wrapper = remat.Checkpointable(model, "min", nested=nested, loss_fn=loss_fn)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", refused)
            with MemoryTracker(exclude_grads_of=model.parameters()) as tracker:
                loss_fn(wrapper(x)).backward()
        assert wrapper.plan is not None
        assert tracker.peak_bytes <= wrapper.plan.budget_bytes, step
    assert max(wrapper.plan.forward_counts) > 1
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)


def _squares(out: torch.Tensor) -> torch.Tensor:
    return out.square().sum()


class _RoutedBlock(nn.Module):
    """A mixture-of-experts-shaped block: the model keeps its router's logits (not its
    output) for an auxiliary loss, as transformers' output recorders do."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 4)
        self.mlp = nn.Linear(32, 32)
        self.logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.logits is None:  # the first call's (the timing pass runs a short stage again)
            self.logits = logits
        return torch.tanh(self.mlp(x)) * logits.softmax(-1)[:, :1]


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_RoutedBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = []
        for block in self.blocks:
            x = block(x)
            logits.append(block.logits)
            block.logits = None
        return x, logits


def _routed_loss(output: tuple[torch.Tensor, list[torch.Tensor]]) -> torch.Tensor:
    out, logits = output
    return out.square().sum() + 0.01 * sum(t.square().sum() for t in logits)


@pytest.mark.parametrize("nested", [False, True])
def test_the_loss_backward_of_the_timing_pass_stops_at_the_graphs_of_the_groups(nested: bool) -> None:
    """NOTE [a group's own graph]: the loss takes tensors each group made besides its output
    (router logits), whose graphs the groups' own backwards have run already."""
    torch.manual_seed(0)
    _trains_within_the_least_budget(_Routed(), torch.randn(16, 32), _routed_loss, nested=nested)


def test_a_group_backward_stops_at_the_graph_of_the_group_before() -> None:
    """NOTE [a group's own graph]: a layer's input is made in the group before (the model's
    code after that group's last stage), and its shortcut takes it in a later group."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *(_ResidualLayer() for _ in range(3)), nn.Linear(32, 4))
    # (every warning an error: the sized measuring step does not give up on it)
    _trains_within_the_least_budget(model, torch.randn(16, 32), _squares, nested=True, refused=Warning)


class _Experts(nn.Module):
    """Expert products as transformers' mixtures of experts run them: one grouped product
    over the tokens of each expert (here a fixed share of the tokens each)."""

    def __init__(self, experts: int = 4, width: int = 32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.weight.shape[0]
        share = x.shape[0] // experts
        offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=x.device) * share
        return torch.tanh(torch._grouped_mm(x, self.weight, offs=offsets))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm is newer than this torch")
def test_a_float32_grouped_product_is_sized_on_fake_tensors() -> None:
    """NOTE [grouped products on fake tensors]: torch's fake kernel takes bfloat16 only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), *(_Experts() for _ in range(4)), nn.Linear(32, 4))
    _trains_within_the_least_budget(model, torch.randn(64, 32), _squares)
