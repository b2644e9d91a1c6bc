"""Solvers: the registry, the same edge cases for every solver, and brute-force optimality."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from remat.errors import BudgetTooSmall, InvalidBudget, RematError
from remat.plan import (
    ChainProfile,
    InvalidPlan,
    InvalidProfile,
    OptimalSolver,
    PeriodicSolver,
    Region,
    Schedule,
    SimulationResult,
    Store,
    available_solvers,
    get_solver,
    numba_available,
    register_solver,
    simulate,
    solve,
    validate_plan,
)
from remat.plan.solvers.contract import _REGISTRY
from remat.testing import all_plans, random_chain

SOLVERS = available_solvers()
IMPLEMENTATIONS = ["numpy"] + (["numba"] if numba_available() else [])


def minimum_of(solver_name: str, profile: ChainProfile) -> int:
    """The smallest budget the solver fits, from the error at a budget of 0 bytes."""
    try:
        get_solver(solver_name)(profile, 0)
    except BudgetTooSmall as error:
        return error.minimum_bytes
    return 0


# ---------------------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert SOLVERS == ("auto", "inputs", "none", "offload", "optimal", "periodic")
    assert all(name == name.lower() for name in SOLVERS)


def test_unknown_solver_lists_the_valid_ones() -> None:
    with pytest.raises(RematError) as raised:
        get_solver("rotor")
    message = str(raised.value)
    assert "'rotor'" in message
    for name in SOLVERS:
        assert repr(name) in message


def test_get_solver_is_case_insensitive_and_passes_options() -> None:
    solver = get_solver("Optimal", slots=64, implementation="numpy")
    assert isinstance(solver, OptimalSolver)
    assert solver.slots == 64 and solver.implementation == "numpy"
    with pytest.raises(TypeError):
        get_solver("none", slots=3)
    with pytest.raises(ValueError, match="slots"):
        get_solver("optimal", slots=0)
    with pytest.raises(ValueError, match="implementation"):
        get_solver("optimal", implementation="fortran")
    with pytest.raises(ValueError, match="segments"):
        get_solver("periodic", segments=0)


def test_register_a_custom_solver() -> None:
    class Everything:
        def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
            plan = tuple(Store(stage) for stage in range(profile.n_stages))
            return Schedule.from_plan(profile, plan, budget_bytes=budget_bytes, solver_name="mine")

        def minimum_bytes(self, profile: ChainProfile) -> int:
            return simulate(profile, tuple(Store(stage) for stage in range(profile.n_stages))).peak_bytes

    register_solver("mine", Everything)
    try:
        assert "mine" in available_solvers()
        schedule = solve(random_chain(0, 3), None, solver="mine")
        assert schedule.solver_name == "mine"
        with pytest.raises(ValueError, match="already registered"):
            register_solver("mine", Everything)
        register_solver("mine", Everything, replace=True)
        with pytest.raises(ValueError, match="lowercase"):
            register_solver("Mine", Everything)
    finally:
        _REGISTRY.pop("mine", None)


def test_solve_with_an_instance() -> None:
    profile = random_chain(1, 4)
    schedule = solve(profile, None, solver=PeriodicSolver(segments=2))
    assert schedule.solver_name == "periodic"
    with pytest.raises(TypeError):
        solve(profile, None, solver=PeriodicSolver(), segments=3)


@pytest.mark.parametrize("budget", [-1, 1.5, True, "1GiB", 10.0])
def test_budgets_must_be_whole_bytes(budget: object) -> None:
    with pytest.raises(InvalidBudget):
        solve(random_chain(0, 3), budget, solver="optimal")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- every solver


EDGE_CHAINS = {
    "one stage": random_chain(11, 1),
    "two stages": random_chain(12, 2),
    "three stages": random_chain(13, 3),
    "zero sizes": random_chain(14, 4, max_units=0),
    "long": random_chain(15, 12, unit_bytes=1024),
}


@pytest.mark.parametrize("chain", EDGE_CHAINS, ids=list(EDGE_CHAINS))
@pytest.mark.parametrize("name", SOLVERS)
def test_unlimited_budget(name: str, chain: str) -> None:
    profile = EDGE_CHAINS[chain]
    schedule = get_solver(name)(profile, None)
    validate_plan(schedule.items, profile.n_stages)
    assert schedule.budget_bytes is None
    assert schedule.solver_name == name
    if name in ("optimal", "auto", "none"):
        assert schedule.items == tuple(Store(i) for i in range(profile.n_stages))
        assert schedule.overhead_s == 0.0


@pytest.mark.parametrize("chain", EDGE_CHAINS, ids=list(EDGE_CHAINS))
@pytest.mark.parametrize("name", SOLVERS)
def test_budget_at_and_below_the_minimum(name: str, chain: str) -> None:
    profile = EDGE_CHAINS[chain]
    solver = get_solver(name)
    minimum = minimum_of(name, profile)
    schedule = solver(profile, minimum)
    assert schedule.predicted_peak_bytes <= minimum
    assert schedule.budget_bytes == minimum
    assert simulate(profile, schedule.items) == schedule.simulation
    if minimum > 0:
        with pytest.raises(BudgetTooSmall) as raised:
            solver(profile, minimum - 1)
        error = raised.value
        assert error.minimum_bytes == minimum
        assert error.budget_bytes == minimum - 1
        assert f"{minimum} bytes" in str(error) and "MiB" in str(error)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("name", SOLVERS)
def test_random_chains(name: str, seed: int) -> None:
    profile = random_chain(seed, 2 + seed)
    solver = get_solver(name)
    everything = simulate(profile, tuple(Store(i) for i in range(profile.n_stages)))
    minimum = minimum_of(name, profile)
    for budget in sorted({minimum, (minimum + everything.peak_bytes) // 2, everything.peak_bytes}):
        if budget < minimum:
            continue
        schedule = solver(profile, budget)
        validate_plan(schedule.items, profile.n_stages)
        assert schedule.predicted_peak_bytes <= budget
        assert schedule.predicted_time_s >= everything.time_s - 1e-9
        assert all(count >= 1 for count in schedule.forward_counts)


def test_baseline_plans() -> None:
    assert get_solver("inputs")(random_chain(0, 4), None).items == (
        Region(0, 1, (Store(0),)),
        Region(1, 2, (Store(1),)),
        Region(2, 3, (Store(2),)),
        Store(3),
    )
    # Like checkpoint_sequential: n // segments stages per segment, the last takes the rest.
    assert PeriodicSolver(segments=3).plan(8) == (
        Region(0, 2, (Store(0), Store(1))),
        Region(2, 4, (Store(2), Store(3))),
        Store(4), Store(5), Store(6), Store(7),
    )  # fmt: skip
    assert PeriodicSolver().plan(9) == PeriodicSolver(segments=3).plan(9)  # ceil(sqrt(9))
    assert PeriodicSolver().plan(1) == (Store(0),)
    assert PeriodicSolver(segments=50).plan(3) == (
        Region(0, 1, (Store(0),)), Region(1, 2, (Store(1),)), Store(2)
    )  # fmt: skip


# ---------------------------------------------------------------------------- the dynamic program


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(16))
def test_optimal_matches_brute_force(implementation: str, seed: int) -> None:
    # Sizes are whole bytes and budgets are below the slot count: slots are exact bytes.
    n_stages = 1 + seed % 5
    profile = random_chain(seed, n_stages, integer_times=seed % 2 == 0, max_time_s=4.0)
    results = [simulate(profile, plan) for plan in all_plans(n_stages)]
    least = min(result.peak_bytes for result in results)
    most = max(result.peak_bytes for result in results)
    solver = OptimalSolver(implementation=implementation)
    assert solver.minimum_bytes(profile) == least
    for budget in range(max(0, least - 1), most + 2):
        fitting = [result.time_s for result in results if result.peak_bytes <= budget]
        if not fitting:
            with pytest.raises(BudgetTooSmall) as raised:
                solver(profile, budget)
            assert raised.value.minimum_bytes == least
            continue
        schedule = solver(profile, budget)
        assert schedule.predicted_peak_bytes <= budget
        assert math.isclose(schedule.predicted_time_s, min(fitting), rel_tol=1e-12)


@pytest.mark.skipif(len(IMPLEMENTATIONS) < 2, reason="needs numba")
@pytest.mark.parametrize("store_options", [0, 2])
@pytest.mark.parametrize("seed", range(6))
def test_numba_and_numpy_agree(seed: int, store_options: int) -> None:
    # with store options too (a stage stored under a policy: NOTE [stored under a policy])
    profile = random_chain(seed, 10 + 3 * seed, max_units=40, unit_bytes=1000, store_options=store_options)
    numba_solver = OptimalSolver(implementation="numba", slots=97)
    numpy_solver = OptimalSolver(implementation="numpy", slots=97)
    minimum = numba_solver.minimum_bytes(profile)
    assert numpy_solver.minimum_bytes(profile) == minimum
    everything = simulate(profile, tuple(Store(i) for i in range(profile.n_stages))).peak_bytes
    for fraction in (0.0, 0.1, 0.3, 0.6, 0.9):
        budget = int(minimum + fraction * (everything - minimum))
        fast = numba_solver(profile, budget)
        slow = numpy_solver(profile, budget)
        assert math.isclose(fast.predicted_time_s, slow.predicted_time_s, rel_tol=1e-12)
        assert fast.predicted_peak_bytes <= budget and slow.predicted_peak_bytes <= budget


def test_auto_picks_numpy_for_small_problems_and_gives_optimal_plans() -> None:
    profile = random_chain(3, 6)
    auto = get_solver("auto")
    assert auto._implementation_for(profile) == "numpy"  # type: ignore[attr-defined]
    big = random_chain(3, 80)
    expected = "numba" if numba_available() else "numpy"
    assert auto._implementation_for(big) == expected  # type: ignore[attr-defined]
    minimum = get_solver("optimal").minimum_bytes(profile)
    assert auto(profile, minimum + 5).predicted_time_s == get_solver("optimal")(profile, minimum + 5).predicted_time_s


def test_coarse_slots_still_fit_the_budget() -> None:
    # With few slots, rounding up every size wastes budget; the plan must still fit, and a
    # budget at the exact minimum still gets a plan (the least-peak plan).
    profile = random_chain(21, 30, max_units=1000, unit_bytes=1, zero_probability=0.0)
    for implementation in IMPLEMENTATIONS:
        solver = OptimalSolver(slots=7, implementation=implementation)
        minimum = solver.minimum_bytes(profile)
        # At the minimum, rounding to slots leaves the program no plan: the least-peak one.
        assert solver._fastest_plan(profile, minimum, implementation) is None
        assert solver(profile, minimum).predicted_peak_bytes == minimum
        for budget in (minimum, minimum + 1, int(minimum * 1.3), int(minimum * 2)):
            schedule = solver(profile, budget)
            assert schedule.predicted_peak_bytes <= budget


def test_planning_from_a_saved_profile(tmp_path: Path) -> None:
    profile = random_chain(5, 9, unit_bytes=4096)
    path = tmp_path / "chain.json"
    profile.save(path)
    loaded = ChainProfile.load(path)
    minimum = get_solver("optimal").minimum_bytes(loaded)
    budget = minimum + 4096 * 10
    original = solve(profile, budget, solver="optimal")
    again = solve(loaded, budget, solver="optimal")
    assert again.items == original.items
    assert again.predicted_peak_bytes == original.predicted_peak_bytes


@pytest.mark.parametrize("name", available_solvers())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_minimum_bytes_is_the_smallest_budget_each_solver_fits(name: str, seed: int) -> None:
    """The minimum is a method of every solver, and agrees with the error a smaller budget raises."""
    profile = random_chain(seed, 6, max_units=30, unit_bytes=512)
    solver = get_solver(name)
    minimum = solver.minimum_bytes(profile)
    with pytest.raises(BudgetTooSmall) as raised:
        solver(profile, 1)
    assert raised.value.minimum_bytes == minimum
    assert solver(profile, minimum).predicted_peak_bytes <= minimum
    with pytest.raises(BudgetTooSmall):
        solver(profile, minimum - 1)


@pytest.mark.parametrize("chain", EDGE_CHAINS, ids=list(EDGE_CHAINS))
@pytest.mark.parametrize("name", SOLVERS)
def test_minimum_bytes_of_the_edge_chains(name: str, chain: str) -> None:
    """On every edge chain, the method gives the minimum that a budget of 0 bytes reports (0 if it fits)."""
    profile = EDGE_CHAINS[chain]
    assert get_solver(name).minimum_bytes(profile) == minimum_of(name, profile)


# ---------------------------------------------------------------------------- breaks and pinned stages


def _with_breaks(profile: ChainProfile, seed: int) -> ChainProfile:
    """`profile` with random region breaks and, sometimes, a pinned stage."""
    n = profile.n_stages
    breaks = tuple(k for k in range(1, n) if (seed * 7 + k * 3) % 4 == 0)
    pinned = (seed % n,) if seed % 3 == 0 else ()
    return dataclasses.replace(profile, region_breaks=breaks, pinned_stages=pinned)


def _allowed_results(profile: ChainProfile) -> list[SimulationResult]:
    results = []
    for plan in all_plans(profile.n_stages):
        try:
            results.append(simulate(profile, plan))
        except InvalidPlan:
            continue
    return results


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(12))
def test_optimal_plans_around_breaks_and_pinned_stages(implementation: str, seed: int) -> None:
    profile = _with_breaks(random_chain(seed, 2 + seed % 4, integer_times=True, max_time_s=4.0), seed)
    results = _allowed_results(profile)
    # the brute force itself must have excluded plans, or the test proves nothing
    assert len(results) < len(all_plans(profile.n_stages)) or not (profile.region_breaks or profile.pinned_stages)
    least = min(result.peak_bytes for result in results)
    solver = OptimalSolver(implementation=implementation)
    assert solver.minimum_bytes(profile) == least
    for budget in range(least, max(result.peak_bytes for result in results) + 1):
        schedule = solver(profile, budget)  # simulate() refuses a plan that crosses a break
        fitting = [result.time_s for result in results if result.peak_bytes <= budget]
        assert math.isclose(schedule.predicted_time_s, min(fitting), rel_tol=1e-12)


@pytest.mark.parametrize("name", ["inputs", "periodic"])
def test_baselines_cut_their_regions_at_breaks(name: str) -> None:
    profile = dataclasses.replace(random_chain(1, 9), region_breaks=(2, 5), pinned_stages=(7,))
    schedule = get_solver(name)(profile, None)
    for item in schedule.items:
        if isinstance(item, Region):
            assert profile.region_allowed(item.start, item.stop)
    assert Store(7) in schedule.items


def test_simulate_refuses_plans_across_a_break_or_over_a_pinned_stage() -> None:
    profile = dataclasses.replace(random_chain(2, 4), region_breaks=(2,), pinned_stages=(3,))
    with pytest.raises(InvalidPlan, match="crosses boundary 2"):
        simulate(profile, (Region(0, 3, (Store(0), Store(1), Store(2))), Store(3)))
    with pytest.raises(InvalidPlan, match="stage 3 is pinned"):
        simulate(profile, (Store(0), Store(1), Region(2, 4, (Store(2), Store(3)))))
    simulate(profile, (Region(0, 2, (Store(0), Store(1))), Region(2, 3, (Store(2),)), Store(3)))


def test_breaks_survive_a_saved_profile_and_are_checked(tmp_path: Path) -> None:
    profile = dataclasses.replace(random_chain(3, 5), region_breaks=(3, 1), pinned_stages=(4,))
    assert profile.region_breaks == (1, 3)
    assert ChainProfile.from_json(profile.to_json()) == profile
    assert "region_breaks" not in random_chain(3, 5).to_dict()
    with pytest.raises(InvalidProfile, match="region_breaks holds 5"):
        dataclasses.replace(profile, region_breaks=(5,))
    with pytest.raises(InvalidProfile, match="pinned_stages holds -1"):
        dataclasses.replace(profile, pinned_stages=(-1,))


# ---------------------------------------------------------------------------- glue spans


def _with_spans(profile: ChainProfile, seed: int) -> ChainProfile:
    """`profile` with random glue spans (NOTE [constants an earlier stage takes])."""
    n = profile.n_stages
    spans = tuple((s, min(n - 1, s + 1 + (seed + s) % 2)) for s in range(0, n - 1, 2) if (seed + s) % 3 != 1)
    return dataclasses.replace(profile, glue_spans=spans)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("seed", range(10))
def test_optimal_plans_follow_glue_spans(implementation: str, seed: int) -> None:
    # a region that replays a span's glue stage replays its first stage too
    profile = _with_spans(random_chain(seed, 3 + seed % 3, integer_times=True, max_time_s=4.0), seed)
    assert profile.glue_spans
    results = _allowed_results(profile)
    assert len(results) < len(all_plans(profile.n_stages))  # simulate() refused some plans
    least = min(result.peak_bytes for result in results)
    solver = OptimalSolver(implementation=implementation)
    assert solver.minimum_bytes(profile) == least
    for budget in range(least, max(result.peak_bytes for result in results) + 1):
        schedule = solver(profile, budget)
        fitting = [result.time_s for result in results if result.peak_bytes <= budget]
        assert math.isclose(schedule.predicted_time_s, min(fitting), rel_tol=1e-12)


def test_simulate_refuses_a_replay_that_starts_inside_a_glue_span() -> None:
    profile = dataclasses.replace(random_chain(2, 5), glue_spans=((1, 3),))
    assert not profile.region_allowed(2, 4) and not profile.region_allowed(3, 4)
    assert profile.region_allowed(1, 4) and profile.region_allowed(2, 3) and profile.region_allowed(0, 5)
    assert not profile.allowed_regions()[2, 4] and profile.allowed_regions()[1, 4]
    with pytest.raises(InvalidPlan, match="glue takes the input of stage 1"):
        simulate(profile, (Store(0), Store(1), Region(2, 4, (Store(2), Store(3))), Store(4)))
    simulate(profile, (Store(0), Region(1, 4, (Store(1), Store(2), Store(3))), Store(4)))


@pytest.mark.parametrize("name", ["inputs", "periodic"])
def test_baselines_store_the_glue_stage_of_a_span_they_would_cut(name: str) -> None:
    profile = dataclasses.replace(random_chain(1, 9), glue_spans=((1, 3), (4, 6), (6, 6)))
    schedule = get_solver(name)(profile, None)  # simulate() checks every region
    for item in schedule.items:
        if isinstance(item, Region):
            assert profile.region_allowed(item.start, item.stop)


def test_glue_spans_survive_a_saved_profile_and_are_checked() -> None:
    profile = dataclasses.replace(random_chain(3, 5), glue_spans=((2, 4), (0, 1), (2, 4)))
    assert profile.glue_spans == ((0, 1), (2, 4))
    assert ChainProfile.from_json(profile.to_json()) == profile
    assert "glue_spans" not in random_chain(3, 5).to_dict()
    for bad in ((3, 1), (0, 5), (-1, 2)):
        with pytest.raises(InvalidProfile, match="glue_spans holds"):
            dataclasses.replace(profile, glue_spans=(bad,))


def test_a_pinned_stage_right_after_a_cut_region_is_stored_once() -> None:
    profile = dataclasses.replace(random_chain(4, 5), region_breaks=(1,), pinned_stages=(2,))
    plan = PeriodicSolver(segments=2).plan_for(profile)
    assert plan == (Region(0, 1, (Store(0),)), Region(1, 2, (Store(1),)), Store(2), Store(3), Store(4))
    for budget in (OptimalSolver().minimum_bytes(profile), None):
        validate_plan(get_solver("optimal")(profile, budget).items, profile.n_stages)
