"""Long chains planned over groups of consecutive stages (solvers/grouping.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from remat.plan import ChainProfile, InvalidPlan, OptimalSolver, Region, Store, numba_available, simulate
from remat.plan.operations import PlanTree
from remat.plan.solvers.grouping import expanded_plan, group_starts, merged_profile
from remat.testing import all_plans, random_chain

IMPLEMENTATIONS = ["numpy"] + (["numba"] if numba_available() else [])


def random_starts(rng: np.random.Generator, n_stages: int, n_groups: int) -> tuple[int, ...]:
    inner = rng.choice(np.arange(1, n_stages), size=n_groups - 1, replace=False) if n_groups > 1 else []
    return tuple(sorted({0, *map(int, inner)}))


def region_bounds(plan: PlanTree) -> set[int]:
    """Every start and stop of a region of the plan, at any depth."""
    bounds: set[int] = set()
    pending = list(plan)
    while pending:
        item = pending.pop()
        if isinstance(item, Region):
            bounds |= {item.start, item.stop}
            pending.extend(item.body)
    return bounds


@pytest.mark.parametrize("seed", range(8))
def test_every_merged_plan_expands_to_a_plan_that_peaks_no_higher_and_takes_the_same_time(seed: int) -> None:
    # NOTE [merged stages]: the guarantee the grouped solver rests on, for every plan tree.
    rng = np.random.default_rng(seed)
    checked = 0
    loose = 0
    for _ in range(6):
        n_stages = int(rng.integers(4, 10))
        profile = random_chain(rng, n_stages, max_units=12)
        starts = random_starts(rng, n_stages, int(rng.integers(2, 5)))
        merged = merged_profile(profile, starts)
        assert merged.n_stages == len(starts)
        assert merged.total_time_s == pytest.approx(profile.total_time_s, rel=1e-12)
        for plan in all_plans(merged.n_stages):
            on_groups = simulate(merged, plan)
            on_stages = simulate(profile, expanded_plan(plan, starts, n_stages))
            assert on_stages.peak_bytes <= on_groups.peak_bytes, (starts, plan)
            assert math.isclose(on_stages.time_s, on_groups.time_s, rel_tol=1e-12)
            checked += 1
            loose += on_stages.peak_bytes < on_groups.peak_bytes
    assert checked >= 6 * 8
    assert loose < checked  # not every bound is loose: it is tight where the groups are single stages


def test_one_stage_groups_are_the_chain_itself() -> None:
    profile = random_chain(3, 7)
    starts = tuple(range(7))
    merged = merged_profile(profile, starts)
    assert dataclasses.replace(merged, names=profile.names) == profile
    for plan in all_plans(4):
        padded = plan + tuple(Store(stage) for stage in range(4, 7))
        assert expanded_plan(padded, starts, 7) == padded


def test_expanding_a_plan_over_groups() -> None:
    starts = (0, 2, 5)
    plan = (Region(0, 2, (Store(0),)), Store(2))
    assert expanded_plan(plan, starts, 7) == (Region(0, 5, (Store(0), Store(1))), Store(5), Store(6))


def test_group_boundaries_take_every_break_and_prefer_small_activations() -> None:
    base = random_chain(5, 40)
    activation = [1000] * 41
    activation[13] = 10  # a cheap checkpoint near the even boundary at 10
    profile = dataclasses.replace(base, activation_bytes=tuple(activation), region_breaks=(7, 33))
    starts = group_starts(profile, 4)
    assert starts[0] == 0 and {7, 13, 33} <= set(starts)
    assert list(starts) == sorted(set(starts))
    assert len(starts) <= 4 + 2
    assert group_starts(profile, 40) == tuple(range(40))
    merged = merged_profile(profile, starts)
    assert merged.region_breaks == (starts.index(7), starts.index(33))


def test_a_pinned_stage_pins_its_group() -> None:
    profile = dataclasses.replace(random_chain(2, 9), pinned_stages=(4,))
    merged = merged_profile(profile, (0, 3, 6))
    assert merged.pinned_stages == (1,)


def test_a_break_inside_a_group_pins_the_group() -> None:
    profile = dataclasses.replace(random_chain(2, 9), region_breaks=(3, 5))
    merged = merged_profile(profile, (0, 3, 6))
    assert merged.region_breaks == (1,) and merged.pinned_stages == (1,)
    # Many breaks: groups no longer follow them, and every plan of the merged chain that
    # simulate() accepts expands to a plan that crosses none.
    crowded = dataclasses.replace(random_chain(4, 9), region_breaks=(2, 3, 4, 5, 6, 7))
    starts = group_starts(crowded, 3)
    assert len(starts) == 3
    _check_merged_plans(crowded, starts)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(10))
def test_a_long_chain_is_planned_over_groups_within_the_budget(implementation: str, seed: int) -> None:
    n_stages = 7 + seed % 3
    profile = random_chain(seed, n_stages, integer_times=True, max_time_s=4.0)
    if seed % 2:
        profile = dataclasses.replace(profile, region_breaks=(3,), pinned_stages=(n_stages - 2,))
    solver = OptimalSolver(implementation=implementation, max_stages=3)
    starts = group_starts(profile, 3)
    merged = merged_profile(profile, starts)
    minimum = solver.minimum_bytes(profile)
    # The least peak is the chain's own, not the groups': every plan tree is considered.
    assert minimum == OptimalSolver(implementation=implementation).minimum_bytes(profile)
    everything = simulate(profile, tuple(Store(i) for i in range(n_stages))).peak_bytes
    for budget in range(minimum, everything + 1):
        schedule = solver(profile, budget)
        assert schedule.predicted_peak_bytes <= budget
        # No plan over the groups that fits (by the merged chain's peaks) is faster.
        for plan in all_plans(merged.n_stages):
            try:
                on_groups = simulate(merged, plan)
            except InvalidPlan:  # crosses a break or holds a pinned group
                continue
            if on_groups.peak_bytes <= budget:
                assert schedule.predicted_time_s <= on_groups.time_s * (1 + 1e-12)
        # The program's own plan starts and stops its regions at group boundaries.
        fastest = solver._fastest_plan(profile, budget, implementation)
        if fastest is not None:
            assert region_bounds(fastest) <= {*starts, n_stages}
            assert simulate(profile, fastest).peak_bytes <= budget


def test_max_stages_must_be_a_positive_integer() -> None:
    for bad in (0, -3, 2.5, True, "10"):
        with pytest.raises(ValueError, match="max_stages"):
            OptimalSolver(max_stages=bad)  # type: ignore[arg-type]


def test_the_default_length_is_solved_stage_by_stage() -> None:
    solver = OptimalSolver(implementation="numpy")
    assert solver._stage_limit("numpy") == 72
    assert OptimalSolver(implementation="numpy", slots=4000)._stage_limit("numpy") == 36
    assert OptimalSolver(implementation="numpy", max_stages=7)._stage_limit("numpy") == 7


@pytest.mark.slow
def test_a_thousand_stage_chain_is_planned_with_numpy() -> None:
    profile = random_chain(11, 1000, max_units=64, unit_bytes=2**20)
    solver = OptimalSolver(implementation="numpy")
    minimum = solver.minimum_bytes(profile)
    everything = simulate(profile, tuple(Store(i) for i in range(1000))).peak_bytes
    for fraction in (0.1, 0.6):
        budget = int(minimum + fraction * (everything - minimum))
        schedule = solver(profile, budget)
        assert schedule.predicted_peak_bytes <= budget
        assert schedule.overhead_s > 0


def test_glue_spans_hold_on_the_merged_chain() -> None:
    # a region of groups that replays a span's glue stage starts at or before its first stage
    profile = dataclasses.replace(random_chain(5, 9), glue_spans=((1, 2), (4, 7)))
    starts = (0, 3, 6)
    assert merged_profile(profile, starts).glue_spans == ((0, 0), (1, 2))
    _check_merged_plans(profile, starts)


def _check_merged_plans(profile: ChainProfile, starts: tuple[int, ...]) -> None:
    """Every plan of the merged chain that simulate() accepts expands to a plan of `profile`
    that it accepts too, within the merged plan's peak; simulate() refuses some."""
    merged = merged_profile(profile, starts)
    accepted = 0
    for plan in all_plans(merged.n_stages):
        try:
            on_groups = simulate(merged, plan)
        except InvalidPlan:
            continue
        accepted += 1
        assert simulate(profile, expanded_plan(plan, starts, profile.n_stages)).peak_bytes <= on_groups.peak_bytes
    assert 0 < accepted < len(all_plans(merged.n_stages))
