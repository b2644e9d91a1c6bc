"""Store options: a stage stored under a policy, planned beside storing whole and recomputing.

NOTE [stored under a policy] (remat/plan/options.py) is the memory model; these tests check
the simulator against hand-computed peaks, the dynamic program against every plan tree with
options (both implementations; ``test_numba_and_numpy_agree`` in ``test_plan_solvers.py``
compares them on longer chains with options too).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from remat.errors import BudgetTooSmall
from remat.plan import (
    ChainProfile,
    InvalidPlan,
    InvalidProfile,
    OptimalSolver,
    Store,
    numba_available,
    plan_from_data,
    plan_to_data,
    simulate,
)
from remat.plan.options import StoreOption
from remat.plan.solvers.arrays import _ChainArrays, _plan_peak_units
from remat.plan.solvers.grouping import expanded_plan, merged_profile
from remat.testing import all_plans, random_chain

IMPLEMENTATIONS = ["numpy"] + (["numba"] if numba_available() else [])


def ends_with_region(plan: tuple) -> bool:
    return not isinstance(plan[-1], Store) or any(
        ends_with_region(item.body) for item in plan if not isinstance(item, Store)
    )


def two_stages(option: StoreOption | None = None) -> ChainProfile:
    return ChainProfile(
        names=("a", "b"),
        forward_time_s=(1.0, 1.0),
        backward_time_s=(2.0, 2.0),
        activation_bytes=(0, 10, 10),
        gradient_bytes=(0, 10, 10),
        saved_bytes=(100, 1),
        saves_input=(False, True),
        saves_output=(False, False),
        forward_temp_bytes=(0, 0),
        backward_temp_bytes=(0, 0),
        store_options=() if option is None else (option,),
    )


KEEP_MATMULS = StoreOption(
    "keep", saved_bytes=(30, None), saves_output=(False, False), extra_time_s=(0.5, 0.0), shared_bytes=(30, 0)
)


def test_a_stage_stored_under_an_option_holds_what_the_option_keeps() -> None:
    profile = two_stages(KEEP_MATMULS)
    whole = simulate(profile, (Store(0), Store(1)))
    kept = simulate(profile, (Store(0, "keep"), Store(1)))
    # Stored whole, stage 0 holds its 100 saved bytes through stage 1: the peak is at the
    # loss (S0 100, x1 10 kept by stage 1, x2 10, S1 1, G2 10).
    assert whole.peak_bytes == 131
    # Under the option it holds 30; its forward still makes all 100 (x1 + S0 = 110), and
    # its backward runs the forward again on top of the 30 it kept (all of them saved by
    # the backward too, so taken over) and G1: 30 - 30 + 10 + x1 10 + S0 100.
    assert [entry.peak_during_bytes for entry in kept.timeline] == [110, 51, 61, 61, 120]
    assert kept.peak_bytes == 120
    assert kept.time_s == whole.time_s + 0.5
    assert kept.overhead_s == 0.5
    # without the shared bytes, what it kept is counted beside the recompute
    unshared = two_stages(StoreOption("keep", (30, None), (False, False), (0.5, 0.0)))
    assert simulate(unshared, (Store(0, "keep"), Store(1))).peak_bytes == 150


def test_an_option_is_checked_against_the_profile() -> None:
    profile = two_stages(KEEP_MATMULS)
    with pytest.raises(InvalidPlan, match="does not apply to stage 1"):
        simulate(profile, (Store(0), Store(1, "keep")))
    with pytest.raises(InvalidPlan, match="no store option 'other'"):
        simulate(profile, (Store(0, "other"), Store(1)))
    with pytest.raises(InvalidProfile, match="one value per stage"):
        two_stages(StoreOption("bad", (1,), (False, False), (0.0, 0.0)))
    with pytest.raises(InvalidProfile, match="repeat a name"):
        ChainProfile.from_dict({**two_stages(KEEP_MATMULS).to_dict(), "store_options": [KEEP_MATMULS.to_dict()] * 2})
    with pytest.raises(InvalidProfile, match="extra_time_s"):
        two_stages(StoreOption("bad", (1, 1), (False, False), (0.0, -1.0)))
    with pytest.raises(InvalidProfile, match="shared_bytes"):
        two_stages(StoreOption("bad", (1, 1), (False, False), (0.0, 0.0), (2, 0)))


def test_options_survive_json_and_plans_name_them() -> None:
    profile = two_stages(KEEP_MATMULS)
    assert ChainProfile.from_json(profile.to_json()) == profile
    plan = (Store(0, "keep"), Store(1))
    data = plan_to_data(plan)
    assert data[0] == {"store": 0, "option": "keep"}
    assert plan_from_data(data) == plan


def test_the_solver_takes_the_option_where_it_is_the_cheapest_way_to_fit() -> None:
    profile = two_stages(KEEP_MATMULS)
    whole = simulate(profile, (Store(0), Store(1))).peak_bytes
    kept = simulate(profile, (Store(0, "keep"), Store(1))).peak_bytes
    solver = OptimalSolver(implementation="numpy", slots=10_000)
    assert solver(profile, whole).items == (Store(0), Store(1))
    schedule = solver(profile, kept)
    assert schedule.items == (Store(0, "keep"), Store(1))  # 0.5 s, against 1 s to recompute stage 0
    assert schedule.predicted_time_s == pytest.approx(6.5)
    # without the option, the same budget takes a recompute of stage 0
    without = solver(two_stages(), kept)
    assert without.predicted_time_s == pytest.approx(7.0)


@pytest.mark.parametrize("seed", range(14))
def test_optimal_with_options_matches_brute_force(seed: int) -> None:
    n_stages = 1 + seed % 4
    profile = random_chain(seed, n_stages, integer_times=True, max_time_s=4.0, store_options=1 + seed % 2)
    names = tuple(option.name for option in profile.store_options)
    results = []
    for plan in all_plans(n_stages, names):
        try:
            results.append(simulate(profile, plan))
        except InvalidPlan as error:  # an option that does not apply to a stage
            assert "does not apply" in str(error)
    least = min(result.peak_bytes for result in results)
    most = max(result.peak_bytes for result in results)
    for implementation in IMPLEMENTATIONS:  # (every plan tree simulated once for both)
        solver = OptimalSolver(implementation=implementation)
        assert solver.minimum_bytes(profile) == least
        uses_options = False
        for budget in range(max(0, least - 1), most + 2):
            fitting = [result.time_s for result in results if result.peak_bytes <= budget]
            if not fitting:
                with pytest.raises(BudgetTooSmall):
                    solver(profile, budget)
                continue
            schedule = solver(profile, budget)
            assert schedule.predicted_peak_bytes <= budget
            assert math.isclose(schedule.predicted_time_s, min(fitting), rel_tol=1e-12), (implementation, budget)
            uses_options |= any(op.option is not None for op in schedule.operations)
        # the options change the optimum on every one of these chains but four
        assert uses_options == (seed not in (0, 2, 4, 8))


@pytest.mark.parametrize("seed", range(30))
def test_program_accounting_with_options_equals_simulation(seed: int) -> None:
    n_stages = 1 + seed % 4
    profile = random_chain(seed, n_stages, flag_probability=(seed % 3) / 2, store_options=1)
    arrays = _ChainArrays.from_profile(profile, unit_bytes=1)
    checked = 0
    for plan in all_plans(n_stages, ("option0",)):
        if ends_with_region(plan):
            continue
        try:
            simulated = simulate(profile, plan).peak_bytes
        except InvalidPlan:
            continue
        assert _plan_peak_units(arrays, plan) == simulated, plan
        checked += 1
    assert checked > 0


def test_options_lower_the_least_peak_and_never_slow_a_plan() -> None:
    for seed in range(10):
        profile = random_chain(seed, 12, max_units=30, unit_bytes=100, store_options=1)
        plain = ChainProfile.from_dict({k: v for k, v in profile.to_dict().items() if k != "store_options"})
        solver = OptimalSolver(implementation="numpy", slots=300)
        assert solver.minimum_bytes(profile) <= solver.minimum_bytes(plain)
        budget = solver.minimum_bytes(plain) * 11 // 10
        with_options, without = solver(profile, budget), solver(plain, budget)
        assert with_options.predicted_peak_bytes <= budget
        assert with_options.predicted_time_s <= without.predicted_time_s * (1 + 1e-9)


def test_groups_of_one_stage_keep_their_options() -> None:
    profile = random_chain(3, 9, store_options=1)
    starts = (0, 1, 4, 5, 8)
    merged = merged_profile(profile, starts)
    option = merged.store_options[0]
    assert option.saved_bytes[0] == profile.store_options[0].saved_bytes[0]
    assert option.saved_bytes[2] == profile.store_options[0].saved_bytes[4]
    assert option.saved_bytes[1] is None and option.saved_bytes[3] is None
    plan = tuple(Store(g, "option0" if option.applies(g) else None) for g in range(len(starts)))
    expanded = expanded_plan(plan, starts, profile.n_stages)
    assert [item.option for item in expanded] == [
        plan[0].option,
        None,
        None,
        None,
        plan[2].option,
        None,
        None,
        None,
        plan[4].option,
    ]
    # the merged plan's peak bounds the expanded one's
    assert simulate(profile, expanded).peak_bytes <= simulate(merged, plan).peak_bytes


def test_offload_and_options_plan_together_within_the_budget() -> None:
    from remat.plan import Offload, OffloadingSolver

    for seed in range(6):
        profile = dataclasses.replace(
            random_chain(seed, 10, max_units=30, unit_bytes=100, store_options=1), offload_time_per_byte_s=1e-6
        )
        solver = OffloadingSolver(OptimalSolver(implementation="numpy", slots=300))
        budget = solver.minimum_bytes(profile) * 12 // 10
        schedule = solver(profile, budget)
        assert schedule.predicted_peak_bytes <= budget
        assert simulate(profile, schedule.items).peak_bytes == schedule.predicted_peak_bytes
        for item in schedule.items:
            assert not (isinstance(item, Offload) and getattr(item, "option", None))
