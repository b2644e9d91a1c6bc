"""Offload as a third choice beside store and recompute: which stages keep their saved
tensors in host memory.

NOTE [planning offload]
An offloaded stage (:class:`~remat.plan.operations.Offload`, NOTE [offloaded stages] in
``remat.plan.simulate``) is a stored stage whose saved bytes ``S_i`` leave the device while
the next stage runs forward and come back while the next stage runs backward. For a given
set of stages that may be offloaded, the chain is planned by the recompute solver on a
*stand-in profile* in which each such stage saves nothing and holds ``S_i`` as transient
bytes of its own forward and backward and of the next stage's forward and backward, and
whose times include the waits for the copies. Every peak of the stand-in is at least the
true one (it counts ``S_i`` next to stage ``i+1`` even where the plan recomputes stage
``i``), so a schedule that fits there fits for real; the stages the solver stores at the
top level are then offloaded, and the schedule is simulated on the true profile, which
gives the peak and the time reported. The set itself is searched greedily: offload is
added stage by stage (cheapest waits first) while the simulated step gets faster within
the budget, and removed stage by stage from "all of them" likewise; the faster result is
taken. Without offload in the profile (``offload_time_per_byte_s`` None) the solver is
the recompute solver itself.
"""

from __future__ import annotations

import dataclasses

from remat.errors import BudgetTooSmall
from remat.plan.operations import Offload, PlanTree, Store
from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.plan.solvers.contract import Solver, _budget_too_small, _validated_budget_bytes
from remat.plan.solvers.optimal import OptimalSolver

__all__ = ["OffloadingSolver"]

#: Above this many candidate stages, the greedy search tries sets of the cheapest stages
#: in a few sizes instead of one stage at a time (each try is a solve).
STEPWISE_CANDIDATES = 48


class OffloadingSolver:
    """Plans store, offload or recompute for every stage (NOTE [planning offload]).

    Args:
        inner: the recompute solver planning each candidate set; by default ``"optimal"``
            with ``slots`` memory slots.
        slots: the slots of the default inner solver.
    """

    def __init__(self, inner: Solver | None = None, *, slots: int = 500) -> None:
        self.inner = inner if inner is not None else OptimalSolver(slots=slots)

    # -- the stand-in profile
    @staticmethod
    def candidates(profile: ChainProfile) -> list[int]:
        """The stages worth offloading, cheapest waits for the copies first."""
        if profile.offload_time_per_byte_s is None:
            return []
        waits = {}
        for stage in range(profile.n_stages - 1):
            if profile.saved_bytes[stage] == 0:
                continue
            transfer_s = profile.transfer_time_s(stage)
            waits[stage] = max(0.0, transfer_s - profile.forward_time_s[stage + 1]) + max(
                0.0, transfer_s - profile.backward_time_s[stage + 1]
            )
        return sorted(waits, key=lambda stage: (waits[stage] / profile.saved_bytes[stage], stage))

    @staticmethod
    def stand_in(profile: ChainProfile, offloaded: frozenset[int]) -> ChainProfile:
        """The profile the recompute solver plans on when `offloaded` may be offloaded."""
        saved = list(profile.saved_bytes)
        forward_temp = list(profile.forward_temp_bytes)
        backward_temp = list(profile.backward_temp_bytes)
        forward_s = list(profile.forward_time_s)
        backward_s = list(profile.backward_time_s)
        for stage in offloaded:
            nbytes, transfer_s = profile.saved_bytes[stage], profile.transfer_time_s(stage)
            saved[stage] = 0
            for moment in (stage, stage + 1):
                forward_temp[moment] += nbytes
                backward_temp[moment] += nbytes
            forward_s[stage] += max(0.0, transfer_s - profile.forward_time_s[stage + 1])
            backward_s[stage] += max(0.0, transfer_s - profile.backward_time_s[stage + 1])
        # a stage that may be offloaded is stored whole in the stand-in (options are never offloaded)
        options = tuple(
            dataclasses.replace(
                option,
                saved_bytes=tuple(None if stage in offloaded else b for stage, b in enumerate(option.saved_bytes)),
                shared_bytes=tuple(0 if stage in offloaded else b for stage, b in enumerate(option.shared_bytes)),
            )
            for option in profile.store_options
        )
        return dataclasses.replace(
            profile,
            saved_bytes=tuple(saved),
            forward_temp_bytes=tuple(forward_temp),
            backward_temp_bytes=tuple(backward_temp),
            forward_time_s=tuple(forward_s),
            backward_time_s=tuple(backward_s),
            store_options=options,
        )

    @staticmethod
    def offloaded_plan(plan: PlanTree, offloaded: frozenset[int]) -> PlanTree:
        """`plan` with its top-level stored stages of `offloaded` offloaded (never the last item)."""
        last = len(plan) - 1
        return tuple(
            Offload(item.stage)
            if isinstance(item, Store) and item.option is None and item.stage in offloaded and index < last
            else item
            for index, item in enumerate(plan)
        )

    def _schedule(self, profile: ChainProfile, budget_bytes: int | None, offloaded: frozenset[int]) -> Schedule | None:
        stand_in = self.stand_in(profile, offloaded)
        try:
            planned = self.inner(stand_in, budget_bytes)
        except BudgetTooSmall:
            return None
        plan = self.offloaded_plan(planned.items, offloaded)
        schedule = Schedule.from_plan(profile, plan, budget_bytes=budget_bytes, solver_name="offload")
        if budget_bytes is not None and schedule.predicted_peak_bytes > budget_bytes:
            return None
        return schedule

    # -- the contract
    def minimum_bytes(self, profile: ChainProfile) -> int:
        """The smallest budget planned within: without offload, or offloading every candidate."""
        least = self.inner.minimum_bytes(profile)
        every = frozenset(self.candidates(profile))
        if every:
            least = min(least, self.inner.minimum_bytes(self.stand_in(profile, every)))
        return least

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """The fastest schedule found within the budget (NOTE [planning offload])."""
        budget_bytes = _validated_budget_bytes(budget_bytes)
        candidates = self.candidates(profile)
        best: Schedule | None = None
        for start, moves in ((frozenset(), candidates), (frozenset(candidates), candidates[::-1])):
            current = self._schedule(profile, budget_bytes, start)
            if current is None:
                continue
            chosen = start
            stepwise = len(moves) <= STEPWISE_CANDIDATES
            for toggled in self._toggles(moves):
                trial = (chosen if stepwise else start) ^ toggled
                schedule = self._schedule(profile, budget_bytes, trial)
                if schedule is not None and schedule.predicted_time_s < current.predicted_time_s:
                    current, chosen = schedule, trial
            if best is None or current.predicted_time_s < best.predicted_time_s:
                best = current
        if best is None:
            assert budget_bytes is not None
            raise _budget_too_small(
                "offload",
                profile,
                budget_bytes,
                self.minimum_bytes(profile),
                "Raise the budget, or use a smaller batch.",
            )
        return best

    @staticmethod
    def _toggles(moves: list[int]) -> list[frozenset[int]]:
        """What each try changes: one stage at a time along `moves`, each from the set kept
        so far (few candidates); else the first k of `moves` at once, for a few k."""
        if len(moves) <= STEPWISE_CANDIDATES:
            return [frozenset((stage,)) for stage in moves]
        sizes = sorted({max(1, len(moves) * k // 8) for k in range(1, 9)})
        return [frozenset(moves[:size]) for size in sizes]
