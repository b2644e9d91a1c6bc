"""Offload beside store and recompute, on the CPU with a stand-in link to host memory.

On the CPU the device's memory and host memory are one, so offload saves nothing there; but
the host copies are made where the exact tracker does not count them (as on a GPU, where it
counts the device only), so the executor's device-memory behaviour is the GPU's: these tests
check it against the simulator byte for byte, and the gradients bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat.errors import RematError
from remat.manual.offload import OffloadGroup, host_memory
from remat.plan import ChainProfile, InvalidPlan, Offload, Region, Schedule, Store, plan_from_data, plan_to_data
from remat.plan.simulate import simulate
from remat.plan.solvers import OffloadingSolver, get_solver
from remat.testing import random_chain

LINK_BYTES_PER_S = 1e12  # the stand-in link: copies hide behind any stage


class Block(nn.Module):
    """A residual MLP block with dropout (a flat chain of such blocks)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def run(model: nn.Module, x: torch.Tensor, *, seed: int = 3, tracked: bool = False) -> tuple[Any, ...]:
    """One training step; the output is let go once the loss is computed, as planned
    (``output_kept=False``); returns the loss, the gradients and the tracker."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with remat.MemoryTracker() if tracked else contextlib.nullcontext() as tracker:
        loss = loss_of(model(x))
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], tracker


def profile_with_link(n_stages: int, seed: int, per_byte_s: float | None) -> ChainProfile:
    profile = random_chain(seed, n_stages, unit_bytes=1000)
    return dataclasses.replace(profile, offload_time_per_byte_s=per_byte_s)


# ----------------------------------------------------------------------------- the group


def test_an_offload_group_moves_what_is_saved_and_brings_it_back_bit_for_bit() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(32, 64, requires_grad=True)
    torch.manual_seed(1)
    expected = block(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad(set_to_none=True)
    x.grad = None
    host_memory().reset()
    with remat.MemoryTracker() as tracker:
        torch.manual_seed(1)
        group = OffloadGroup()
        with group.hooks():
            out = block(x)
        before = tracker.live_bytes
        group.send([x, out, *block.parameters()])
        group.release()
        after = tracker.live_bytes
        held = host_memory().live_bytes
        group.prefetch()
        out.sum().backward()
    assert torch.equal(out, expected)
    for a, b in zip([p.grad for p in block.parameters()] + [x.grad], expected_grads, strict=True):
        assert torch.equal(a, b)
    assert held > 0 and before - after == held  # what left the device is what host memory holds
    del out, group
    assert host_memory().live_bytes == 0  # the host copies go with the graph


# ----------------------------------------------------------------------------- the plan


def test_offload_items_round_trip_and_are_validated() -> None:
    plan = (Offload(0), Region(1, 3, (Store(1), Store(2))), Store(3))
    assert plan_from_data(plan_to_data(plan)) == plan
    profile = profile_with_link(4, 0, 1e-9)
    Schedule.from_plan(profile, plan)
    with pytest.raises(InvalidPlan, match="last of its level"):
        Schedule.from_plan(profile, (Store(0), Store(1), Store(2), Offload(3)))
    with pytest.raises(InvalidPlan, match="top level only"):
        Schedule.from_plan(profile, (Region(0, 3, (Offload(0), Store(1), Store(2))), Store(3)))
    with pytest.raises(InvalidPlan, match="offload was not measured"):
        simulate(dataclasses.replace(profile, offload_time_per_byte_s=None), plan)


def test_the_simulator_frees_an_offloaded_stage_after_the_next_forward_and_brings_it_back_for_the_next_backward() -> (
    None
):
    profile = profile_with_link(4, 1, 1e-9)
    stored = simulate(profile, tuple(Store(k) for k in range(4))).timeline
    offloaded = simulate(profile, (Offload(0), Store(1), Store(2), Store(3))).timeline
    saved = profile.saved_bytes[0]
    # forward_offload(0) and forward_store(1) hold S_0 as storing does; it leaves after
    # the forward of stage 1, and comes back with backward(1), before backward(0)
    assert offloaded[0] == stored[0]._replace(operation=offloaded[0].operation)
    assert offloaded[1].peak_during_bytes == stored[1].peak_during_bytes
    assert offloaded[1].live_after_bytes == stored[1].live_after_bytes - saved
    for position in range(2, 7):  # forwards of 2 and 3, the loss, backward(3), backward(2)
        assert offloaded[position].peak_during_bytes == stored[position].peak_during_bytes - saved
    assert offloaded[7].peak_during_bytes == stored[7].peak_during_bytes  # backward(1): back
    assert offloaded[8:] == stored[8:]


def test_waits_for_copies_count_what_the_next_stage_does_not_cover() -> None:
    profile = dataclasses.replace(
        profile_with_link(3, 2, 1.0),
        forward_time_s=(1.0, 2.0, 1.0),
        backward_time_s=(2.0, 5.0, 2.0),
        saved_bytes=(4, 0, 0),
    )
    result = simulate(profile, (Offload(0), Store(1), Store(2)))
    # 4 s each way: 2 s over the forward of stage 1, none over its backward (5 s)
    assert result.stall_s == pytest.approx(2.0)
    assert result.time_s == pytest.approx(sum(profile.forward_time_s) + sum(profile.backward_time_s) + 2.0)
    assert result.host_peak_bytes == 4


@pytest.mark.parametrize("seed", range(12))
def test_the_offloading_solver_fits_the_budget_and_is_never_slower_than_recompute_alone(seed: int) -> None:
    profile = profile_with_link(10, seed, 0.5 * sum(random_chain(seed, 10).forward_time_s) / 10_000)
    recompute = get_solver("optimal", slots=300)
    solver = OffloadingSolver(get_solver("optimal", slots=300))
    full = simulate(profile, tuple(Store(k) for k in range(profile.n_stages))).peak_bytes
    minimum = solver.minimum_bytes(profile)
    assert minimum <= recompute.minimum_bytes(profile)
    for fraction in (0.3, 0.5, 0.8):
        budget = max(minimum, int(full * fraction))
        schedule = solver(profile, budget)
        assert schedule.predicted_peak_bytes <= budget
        assert schedule.simulation == simulate(profile, schedule.items)
        if budget >= recompute.minimum_bytes(profile):
            assert schedule.predicted_time_s <= recompute(profile, budget).predicted_time_s + 1e-12
    with pytest.raises(remat.BudgetTooSmall) as raised:
        solver(profile, minimum - 1)
    assert raised.value.minimum_bytes == minimum


def test_a_fast_link_lets_the_planner_keep_what_recompute_would_run_again() -> None:
    profile = profile_with_link(10, 4, 1e-12)  # copies cost nothing
    full = simulate(profile, tuple(Store(k) for k in range(profile.n_stages))).peak_bytes
    budget = int(full * 0.6)
    plain = get_solver("optimal", slots=300)(profile, budget)
    offloading = OffloadingSolver(get_solver("optimal", slots=300))(profile, budget)
    assert offloading.offloaded_stages
    assert offloading.predicted_time_s < plain.predicted_time_s
    assert "offload" in str(offloading)


def test_without_a_measured_link_the_solver_is_the_recompute_solver() -> None:
    profile = profile_with_link(8, 5, None)
    inner = get_solver("optimal", slots=300)
    budget = max(
        inner.minimum_bytes(profile), int(simulate(profile, tuple(Store(k) for k in range(8))).peak_bytes * 0.5)
    )
    assert OffloadingSolver(inner)(profile, budget).items == inner(profile, budget).items


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("fraction", [0.35, 0.5, 0.7])
def test_offloading_plans_train_bit_for_bit_and_the_tracker_meets_the_prediction(fraction: float) -> None:
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(64, 64)
    wrapped = remat.Checkpointable(
        copy.deepcopy(model), fraction, loss_fn=loss_of, output_kept=False, offload=LINK_BYTES_PER_S
    )
    run(wrapped, x)  # measures and plans
    plan = wrapped.plan
    assert plan is not None and plan.schedule.offloaded_stages
    out, grads, tracker = run(wrapped, x, tracked=True)
    expected_out, expected_grads, _ = run(model, x)
    assert torch.equal(out, expected_out)
    for a, b in zip(grads, expected_grads, strict=True):
        assert torch.equal(a, b)
    assert tracker.peak_bytes <= plan.budget_bytes
    assert tracker.peak_bytes == plan.predicted_peak_bytes


def test_a_hand_made_offloading_plan_runs_as_simulated() -> None:
    torch.manual_seed(0)
    model = Stack(6)
    x = torch.randn(64, 64)
    wrapped = remat.Checkpointable(copy.deepcopy(model), 1.0, loss_fn=loss_of, output_kept=False, offload=1e9)
    run(wrapped, x)
    base = wrapped.plan
    items = (Offload(0), Region(1, 3, (Store(1), Store(2))), Offload(3), Offload(4), Store(5))
    plan = dataclasses.replace(base, schedule=Schedule.from_plan(base.schedule.profile, items))
    with wrapped.executing(plan):
        out, grads, tracker = run(wrapped, x, tracked=True)
    expected_out, expected_grads, _ = run(model, x)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    assert tracker.peak_bytes == plan.predicted_peak_bytes
    assert plan.predicted_peak_bytes < base.predicted_peak_bytes


def test_offload_true_on_the_cpu_says_it_frees_nothing_there() -> None:
    wrapped = remat.Checkpointable(Stack(2), 0.5, loss_fn=loss_of, offload=True)
    with pytest.raises(RematError, match="frees nothing"):
        run(wrapped, torch.randn(8, 64))
    with pytest.raises(ValueError, match="bytes per second"):
        remat.Checkpointable(Stack(2), 0.5, offload="fast")


# ----------------------------------------------------------------------------- by hand


def peak_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    with remat.MemoryTracker() as tracker:
        loss_of(model(x)).backward()
    return tracker.peak_bytes, [p.grad.clone() for p in model.parameters()]


def test_offloaded_blocks_train_bit_for_bit_in_less_device_memory() -> None:
    torch.manual_seed(0)
    model = Stack(6)
    x = torch.randn(64, 64)
    plain_peak, expected = peak_and_grads(model, x)
    offloaded = copy.deepcopy(model)
    for block in offloaded.blocks:
        remat.mark(block, offload=True)
    host_memory().reset()
    peak, grads = peak_and_grads(offloaded, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    # each block's saved tensors leave the device as it returns: what remains is the
    # activations between blocks, one block's own and the one coming back
    saved_per_block = host_memory().sent_bytes // 6
    assert saved_per_block > 0
    assert peak <= plain_peak - 3 * saved_per_block
    assert host_memory().fetched_bytes == host_memory().sent_bytes
    assert host_memory().peak_bytes == 6 * saved_per_block
    assert host_memory().live_bytes == 0


def test_the_function_form_brings_a_block_back_while_the_next_one_runs_backward() -> None:
    torch.manual_seed(0)
    first, second = Block(), Block()
    x = torch.randn(16, 64, requires_grad=True)
    host_memory().reset()
    y = remat.offload(second, remat.offload(first, x))
    sent = host_memory().sent_bytes
    assert host_memory().fetched_bytes == 0
    fetched_at_second: list[int] = []
    # the second block's output gradient is the first thing backward computes: by the
    # time the first block's input gradient exists, the first block's tensors are back
    y.register_hook(lambda grad: fetched_at_second.append(host_memory().fetched_bytes))
    y.sum().backward()
    assert fetched_at_second == [sent // 2]  # the first block's, prefetched; the second's came back on demand
    assert host_memory().fetched_bytes == sent


def test_host_copies_are_made_in_host_memory_whatever_the_default_device() -> None:
    # under torch.set_default_device("cuda") a device-less host buffer would land on the
    # GPU (and pinning it fails); here the meta device stands in for it: a copy made there
    # would keep no bytes, and the gradients would come out wrong or fail
    torch.manual_seed(0)
    first, second = Block(), Block()
    x = torch.randn(16, 64, requires_grad=True)
    torch.manual_seed(1)
    expected = second(first(x))
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in [*first.parameters(), *second.parameters()]]
    first.zero_grad(set_to_none=True)
    second.zero_grad(set_to_none=True)
    host_memory().reset()
    torch.manual_seed(1)
    with torch.device("meta"):
        y = remat.offload(second, remat.offload(first, x))
    assert host_memory().sent_bytes > 0
    y.sum().backward()
    assert torch.equal(y, expected)
    grads = [p.grad for p in [*first.parameters(), *second.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


def test_marking_for_offload_takes_no_recompute_option() -> None:
    with pytest.raises(RematError, match="recomputes nothing"):
        remat.mark(Block(), offload=True, policy=remat.policies.save_matmuls)


@pytest.mark.parametrize("use_tag", [False, True])
def test_a_policy_offloads_the_outputs_it_names_and_stays_bit_for_bit(use_tag: bool) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(4))
    x = torch.randn(64, 64, requires_grad=True)

    def up_tagged(block: Block, h: torch.Tensor) -> torch.Tensor:
        hidden = remat.tag(block.up(block.norm(h)), "up")
        return h + block.drop(block.down(torch.nn.functional.gelu(hidden)))

    def forward(policy: Any) -> tuple[int, list[torch.Tensor]]:
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(2)
        with remat.MemoryTracker() as tracker:
            h = x
            for block in blocks:
                h = remat.recompute(up_tagged, block, h, policy=policy) if policy is not None else up_tagged(block, h)
            loss_of(h).backward()
        return tracker.peak_bytes, [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]

    plain_peak, expected = forward(None)
    keep = remat.policies.save_names("up") if use_tag else remat.policies.save_ops("aten.addmm")
    offload = remat.policies.offload_names("up") if use_tag else remat.policies.offload_ops("aten.addmm")
    kept_peak, kept = forward(keep)
    host_memory().reset()
    offloaded_peak, offloaded = forward(offload)
    for grads in (kept, offloaded):
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
    moved = host_memory().sent_bytes
    assert moved > 0 and host_memory().fetched_bytes == moved
    assert offloaded_peak < kept_peak < plain_peak
    assert "offload" in repr(offload)


def test_offload_inside_a_recomputed_block_leaves_it_to_the_recompute() -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(16, 64, requires_grad=True)
    torch.manual_seed(1)
    block(x).sum().backward()
    expected = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    host_memory().reset()
    torch.manual_seed(1)
    remat.recompute(lambda t: remat.offload(block, t), x).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(block.parameters(), expected, strict=True))
    assert host_memory().sent_bytes == 0


def test_a_plan_that_offloads_a_compiled_stage_is_refused() -> None:
    torch.manual_seed(0)
    model = Stack()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    wrapped = remat.Checkpointable(model, 0.5, loss_fn=loss_of, output_kept=False, offload=LINK_BYTES_PER_S)
    with pytest.raises(NotImplementedError, match="offload of compiled code is not built"):
        run(wrapped, torch.randn(64, 64))
    # nothing is left behind: the same model trains without offload
    plain = remat.Checkpointable(model, 0.5, loss_fn=loss_of, output_kept=False)
    run(plain, torch.randn(64, 64))


def _changed_after_it_was_saved(where: str) -> Any:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)

    def block(t: torch.Tensor) -> torch.Tensor:
        a = linear(t)
        c = (a * t).tanh()  # keeps a, t and its own output
        if where == "inside":
            a.add_(1.0)
        return c

    return linear, block


@pytest.mark.parametrize("where", ["input", "output", "inside"])
def test_a_saved_tensor_changed_in_place_raises_as_autograd_does(where: str) -> None:
    # NOTE [saved tensors changed in place]: the input and output stay on the device, the
    # product's operand goes to host memory once the block returns
    for offloaded in (False, True):
        linear, block = _changed_after_it_was_saved(where)
        x = torch.randn(3, 4, requires_grad=True)
        t = x * 1.0
        y = remat.offload(block, t) if offloaded else block(t)
        with torch.no_grad():
            if where == "input":
                t.mul_(2.0)
            elif where == "output":
                y.mul_(2.0)
        error = remat.RecomputeInputModified if offloaded else RuntimeError
        with pytest.raises(error, match="modified by an in-place operation|modified by an inplace operation"):
            y.sum().backward()


def test_in_place_operations_inside_an_offloaded_block_that_autograd_allows_stay_exact() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    blocks = [
        lambda t: torch.relu_(linear(t)) * 2.0,  # saves its own output, after the write
        lambda t: linear(t).mul_(2.0).tanh_().exp(),
        lambda t: (t[:, :2] * 3.0).exp(),  # a view of the input
        lambda t: t @ linear.weight.t(),  # a view of a parameter
    ]
    for block in blocks:
        grads = []
        for offloaded in (False, True):
            x = torch.randn(3, 4, requires_grad=True, generator=torch.Generator().manual_seed(1))
            t = x * 1.0
            (remat.offload(block, t) if offloaded else block(t)).sum().backward()
            grads.append(x.grad)
        assert torch.equal(*grads)


@pytest.mark.parametrize("fraction", [0.35, 0.5])
def test_offloading_plans_with_store_options_train_bit_for_bit_within_the_budget(fraction: float) -> None:
    # a stage that may be offloaded is stored whole in the solver's stand-in (options are never offloaded)
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(64, 64)
    wrapped = remat.Checkpointable(
        copy.deepcopy(model),
        fraction,
        loss_fn=loss_of,
        output_kept=False,
        offload=LINK_BYTES_PER_S,
        policy=[remat.policies.save_matmuls],
    )
    run(wrapped, x)  # measures and plans
    plan = wrapped.plan
    assert plan is not None
    out, grads, tracker = run(wrapped, x, tracked=True)
    expected_out, expected_grads, _ = run(model, x)
    assert torch.equal(out, expected_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    assert tracker.peak_bytes <= plan.budget_bytes


def test_offload_with_nested_plans_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="offload= with nested=True is not built"):
        remat.Checkpointable(Stack(), 0.5, offload=LINK_BYTES_PER_S, nested=True)
    with pytest.raises(ValueError, match="offload is True, False or a link speed"):
        remat.Checkpointable(Stack(), 0.5, offload=-1.0, nested=True)
