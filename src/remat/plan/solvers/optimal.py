"""The optimal solver: the fastest schedule that fits the budget, by dynamic programming."""

from __future__ import annotations

import logging
import math
import numbers
from typing import ClassVar

import numpy as np

from remat.errors import RematError
from remat.plan.operations import Offload, PlanItem, PlanTree, Store
from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.plan.solvers.arrays import _ChainArrays
from remat.plan.solvers.baselines import PeriodicSolver, StoreInputsSolver, store_everything_plan
from remat.plan.solvers.contract import _ADVICE_OPTIMAL, _budget_too_small, _validated_budget_bytes, numba_available
from remat.plan.solvers.grouping import expanded_plan, group_starts, merged_profile
from remat.plan.solvers.programs import cost_table, least_peaks
from remat.plan.solvers.reconstruct import _build_plan, _fastest_choice, _least_peak_choice

__all__ = ["AutoSolver", "OptimalSolver"]

# The solvers log under the name of their package.
logger = logging.getLogger("remat.plan.solvers")


#: Chains up to this length get a second, relaxed pass of the dynamic program.
_RELAXED_PASS_MAX_STAGES = 120

#: The work (``stages**3 * slots``) the time program does in about a quarter of a second,
#: by implementation (measured with ``benchmarks/solver_speed.py``); it sets the default
#: ``max_stages`` of :class:`OptimalSolver`.
_QUICK_WORK = {"numpy": 72**3 * 500, "numba": 120**3 * 500}


def _baseline_plans(profile: ChainProfile) -> list[PlanTree]:
    """Store-inputs and the periodic plans with 2 .. 2*sqrt(n) segments, cut at the profile's breaks."""
    n_stages = profile.n_stages
    plans: list[PlanTree] = [StoreInputsSolver().plan_for(profile)] if n_stages > 1 else []
    for segments in range(2, min(n_stages, 2 * (math.isqrt(n_stages) + 1)) + 1):
        plans.append(PeriodicSolver(segments=segments).plan_for(profile))
    return plans


def _plan_time_s(profile: ChainProfile, plan: PlanTree) -> float:
    """The time of a plan from its forward counts, without simulating it."""
    counts = [0] * profile.n_stages
    extras_s: list[float] = []
    pending: list[PlanItem] = list(plan)
    while pending:
        item = pending.pop()
        if isinstance(item, Store) and item.option is not None:
            extras_s.append(profile.store_option(item.option).extra_time_s[item.stage])
        if isinstance(item, Store | Offload):
            counts[item.stage] += 1
        else:
            for stage in range(item.start, item.stop):
                counts[stage] += 1
            pending.extend(item.body)
    return math.fsum(
        [count * forward_s for count, forward_s in zip(counts, profile.forward_time_s, strict=True)]
        + list(profile.backward_time_s)
        + extras_s
    )


# ------------------------------------------------------------ the solvers


def _resolve_implementation(implementation: str | None) -> str:
    """The implementation an :class:`OptimalSolver` runs: "numba" or "numpy" (None: numba if installed)."""
    if implementation is None:
        return "numba" if numba_available() else "numpy"
    if implementation not in ("numba", "numpy"):
        raise ValueError(f"implementation must be 'numba', 'numpy' or None, got {implementation!r}")
    if implementation == "numba" and not numba_available():
        raise RematError(
            "the numba implementation needs numba: pip install 'remat[fast]' (or pass implementation='numpy')"
        )
    return implementation


class OptimalSolver:
    """``"optimal"``: the fastest schedule that fits the budget, by dynamic programming.

    The program (see ``NOTE [memory accounting of the dynamic program]`` in ``arrays.py``)
    considers every plan tree of :mod:`remat.plan.operations` and agrees exactly with
    :func:`~remat.plan.simulate.simulate` when the sizes are whole slots. Sizes are rounded
    up to slots of ``ceil(budget / slots)`` bytes, so the plan's real peak never exceeds the
    budget; more slots waste less of the budget and take longer.

    A chain longer than ``max_stages`` is planned over ``max_stages`` groups of consecutive
    stages (``NOTE [merged stages]`` in ``grouping.py``): the plan is then the fastest among
    those whose recompute regions start and stop at group boundaries, and still fits the
    budget to the byte. The least peak (:meth:`minimum_bytes`) and the least-peak plans are
    computed stage by stage whatever the length.

    Args:
        slots: the number of memory slots the budget is divided into (default 500).
        implementation: ``"numba"`` (compiled, fast), ``"numpy"`` (no compiler, slower and
            memory-hungry on long chains), or None for numba when it is installed.
        max_stages: the longest chain solved stage by stage; None for the length the
            implementation solves in about a quarter of a second at this many slots (72
            stages with numpy and 120 with numba at 500 slots). The time grows with the
            cube of the length.

    Raises:
        ValueError: ``slots`` or ``max_stages`` is not a positive integer, or
            ``implementation`` is unknown.
        RematError: ``implementation="numba"`` without numba installed.
    """

    name: ClassVar[str] = "optimal"
    slots: int
    implementation: str
    max_stages: int | None

    def __init__(self, *, slots: int = 500, implementation: str | None = None, max_stages: int | None = None) -> None:
        if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if max_stages is not None and (
            isinstance(max_stages, bool) or not isinstance(max_stages, numbers.Integral) or max_stages < 1
        ):
            raise ValueError(f"max_stages must be a positive integer or None, got {max_stages!r}")
        self.slots = int(slots)
        self.implementation = _resolve_implementation(implementation)
        self.max_stages = None if max_stages is None else int(max_stages)
        self._last_least_peaks: tuple[ChainProfile, tuple[_ChainArrays, np.ndarray, int]] | None = None

    def _stage_limit(self, implementation: str) -> int:
        """The longest chain this solver plans stage by stage with ``implementation``."""
        if self.max_stages is not None:
            return self.max_stages
        return max(2, round((_QUICK_WORK[implementation] / self.slots) ** (1 / 3)))

    def minimum_bytes(self, profile: ChainProfile) -> int:
        """The smallest budget in bytes for which this solver returns a schedule.

        It is the least peak of any plan tree (computed exactly, in bytes).
        """
        _, _, minimum_bytes = self._exact_least_peaks(profile)
        return minimum_bytes

    def _implementation_for(self, profile: ChainProfile) -> str:
        """The implementation of the programs for this chain."""
        return self.implementation

    def _exact_least_peaks(self, profile: ChainProfile) -> tuple[_ChainArrays, np.ndarray, int]:
        """The chain in bytes, the least peaks of its subproblems, and the least peak of the whole chain.

        The last chain's are kept: callers ask :meth:`minimum_bytes` before they solve.
        """
        cached = self._last_least_peaks
        if cached is not None and (cached[0] is profile or cached[0] == profile):
            return cached[1]
        exact = _ChainArrays.from_profile(profile, unit_bytes=1)
        least, _ = least_peaks(exact, self._implementation_for(profile))
        result = (exact, least, int(least[0, profile.n_stages - 1, 0]))
        self._last_least_peaks = (profile, result)
        return result

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the fastest schedule whose simulated peak fits the budget.

        Raises:
            BudgetTooSmall: the budget is below the least peak of any schedule
                (``.minimum_bytes`` is :meth:`minimum_bytes`).
            InvalidBudget: the budget is not a whole number of bytes >= 0, nor None.
        """
        budget_bytes = _validated_budget_bytes(budget_bytes)
        n = profile.n_stages
        everything = Schedule.from_plan(
            profile, store_everything_plan(n), budget_bytes=budget_bytes, solver_name=self.name
        )
        if budget_bytes is None or everything.predicted_peak_bytes <= budget_bytes:
            return everything
        # The minimum of minimum_bytes(), from the tables the least-peak plans are built from.
        exact, least_exact, minimum_bytes = self._exact_least_peaks(profile)
        if budget_bytes < minimum_bytes:
            raise _budget_too_small(self.name, profile, budget_bytes, minimum_bytes, _ADVICE_OPTIMAL)
        least_choice = _least_peak_choice(exact, least_exact)
        implementation = self._implementation_for(profile)
        fastest = self._fastest_plan(profile, budget_bytes, implementation)
        best: Schedule | None = None
        if fastest is not None:
            best = self._checked_schedule(profile, fastest, budget_bytes)
        # A least-peak plan always fits; it is only faster when rounding to slots hid it.
        # (The one built for the minimum itself too: whatever fits the minimum fits here.)
        least_plans = {_build_plan(exact, budget_bytes, least_choice), _build_plan(exact, minimum_bytes, least_choice)}
        for least_plan in least_plans:
            if best is None or _plan_time_s(profile, least_plan) < best.predicted_time_s * (1.0 - 1e-12):
                best = self._checked_schedule(profile, least_plan, budget_bytes)
        assert best is not None
        return self._faster_candidate(profile, budget_bytes, implementation, best)

    def _faster_candidate(
        self, profile: ChainProfile, budget_bytes: int, implementation: str, best: Schedule
    ) -> Schedule:
        """``best``, or a plan that rounding to slots hid and that is faster and fits to the byte."""
        n = profile.n_stages
        candidates: list[PlanTree] = []
        # Rounding up to slots rejects plans whose exact peak is within a few slots of the
        # budget. Where it is cheap, solve once more with the budget raised by that much.
        # (Not over groups: their fewer, larger sizes lose less to rounding.)
        if n <= min(_RELAXED_PASS_MAX_STAGES, self._stage_limit(implementation)):
            slot_bytes = max(1, -(-budget_bytes // self.slots))
            relaxed = self._fastest_plan(profile, budget_bytes + (2 * n + 2) * slot_bytes, implementation)
            if relaxed is not None:
                candidates.append(relaxed)
        # The baselines are checked exactly too, so the result is never slower than one that fits.
        candidates.extend(_baseline_plans(profile))
        for plan in candidates:
            if _plan_time_s(profile, plan) < best.predicted_time_s * (1.0 - 1e-12):
                candidate = Schedule.from_plan(profile, plan, budget_bytes=budget_bytes, solver_name=self.name)
                if candidate.predicted_peak_bytes <= budget_bytes:
                    best = candidate
        return best

    def _checked_schedule(self, profile: ChainProfile, plan: PlanTree, budget_bytes: int) -> Schedule:
        """The schedule of ``plan``, which the program found within the budget.

        Raises:
            RematError: its simulated peak is above the budget (an internal error).
        """
        schedule = Schedule.from_plan(profile, plan, budget_bytes=budget_bytes, solver_name=self.name)
        if schedule.predicted_peak_bytes > budget_bytes:
            raise RematError(
                f"internal error in solver {self.name!r}: the plan's simulated peak "
                f"{schedule.predicted_peak_bytes} bytes exceeds the budget {budget_bytes} bytes; "
                "please report this with the saved profile"
            )
        return schedule

    def _fastest_plan(self, profile: ChainProfile, budget_bytes: int, implementation: str) -> PlanTree | None:
        """The fastest plan with sizes in slots (over groups on a long chain), or None when rounding leaves none."""
        limit = self._stage_limit(implementation)
        if profile.n_stages <= limit:
            return self._fastest_plan_by_stage(profile, budget_bytes, implementation)
        starts = group_starts(profile, limit)
        logger.info(
            "solver %r: %d stages planned over %d groups of consecutive stages (max_stages=%d)",
            self.name,
            profile.n_stages,
            len(starts),
            limit,
        )
        plan = self._fastest_plan_by_stage(merged_profile(profile, starts), budget_bytes, implementation)
        return None if plan is None else expanded_plan(plan, starts, profile.n_stages)

    def _fastest_plan_by_stage(self, profile: ChainProfile, budget_bytes: int, implementation: str) -> PlanTree | None:
        """The fastest plan of every stage of ``profile``, sizes in slots, or None when rounding leaves none."""
        slot_bytes = max(1, -(-budget_bytes // self.slots))
        arrays = _ChainArrays.from_profile(profile, unit_bytes=slot_bytes)
        budget_slots = budget_bytes // slot_bytes
        least, saturation = least_peaks(arrays, implementation)
        n = profile.n_stages
        if least[0, n - 1, 0] > budget_slots:
            logger.info(
                "solver %r: with %d slots of %d bytes the rounding leaves no plan within %d "
                "bytes; using the least-peak plan",
                self.name,
                self.slots,
                slot_bytes,
                budget_bytes,
            )
            return None
        costs = cost_table(arrays, budget_slots, least, saturation, implementation)
        return _build_plan(arrays, budget_slots, _fastest_choice(arrays, costs))


class AutoSolver(OptimalSolver):
    """``"auto"``: the dynamic program, with the implementation chosen by problem size.

    Small problems use numpy (no compilation); larger ones numba when it is installed.

    Args:
        slots: the number of memory slots (see :class:`OptimalSolver`).
        numpy_work_limit: the largest ``n_stages ** 3 * slots`` solved with numpy when
            numba is available.
        max_stages: the longest chain solved stage by stage (see :class:`OptimalSolver`).
    """

    name: ClassVar[str] = "auto"

    def __init__(self, *, slots: int = 500, numpy_work_limit: int = 10**8, max_stages: int | None = None) -> None:
        super().__init__(slots=slots, implementation="numpy", max_stages=max_stages)
        self.numpy_work_limit = int(numpy_work_limit)
        self._numba = numba_available()

    def _implementation_for(self, profile: ChainProfile) -> str:
        """numpy for a problem of at most ``numpy_work_limit``, or without numba; numba otherwise."""
        small = profile.n_stages**3 * self.slots <= self.numpy_work_limit
        return "numpy" if small or not self._numba else "numba"
