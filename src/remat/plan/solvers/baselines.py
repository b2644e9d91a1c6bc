"""The baseline solvers: fixed plans that need no search, checked exactly against the budget."""

from __future__ import annotations

import functools
import math
import numbers
from typing import ClassVar

from remat.plan.operations import Offload, PlanItem, PlanTree, Region, Store
from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.plan.solvers.contract import _ADVICE_BASELINE, _budget_too_small, _validated_budget_bytes

__all__ = ["PeriodicSolver", "StoreEverythingSolver", "StoreInputsSolver", "store_everything_plan", "within_breaks"]


@functools.lru_cache(maxsize=4)
def _stores(n_stages: int) -> tuple[Store, ...]:
    """``Store(0) .. Store(n_stages - 1)``, made once per length (the baselines slice them)."""
    return tuple(Store(stage) for stage in range(n_stages))


def store_everything_plan(n_stages: int) -> PlanTree:
    """Returns the plan that stores every stage (no recomputation)."""
    return _stores(n_stages)


def within_breaks(plan: PlanTree, profile: ChainProfile) -> PlanTree:
    """``plan`` with its regions cut where the profile forbids them to reach.

    A region that crosses a break (see :attr:`ChainProfile.region_breaks`) becomes one
    region per piece between the breaks, and a pinned stage in it is stored instead, as is
    the glue's stage of a glue span whose first stage is before its piece (see
    :attr:`ChainProfile.glue_spans`). Only regions whose bodies store every stage are cut
    (the baselines' plans).

    Raises:
        ValueError: a region that must be cut has a nested region in its body.
    """
    if not profile.region_breaks and not profile.pinned_stages and not profile.glue_spans:
        return plan
    breaks, pinned = set(profile.region_breaks), set(profile.pinned_stages)
    span_start = profile.span_starts()
    items: list[PlanItem] = []
    for item in plan:
        if isinstance(item, Store | Offload) or profile.region_allowed(item.start, item.stop):
            items.append(item)
            continue
        if not all(isinstance(inner, Store) for inner in item.body):
            raise ValueError(f"cannot cut the region [{item.start}, {item.stop}): its body holds regions")
        start = item.start
        for stage in range(item.start, item.stop + 1):
            stored = stage < item.stop and (stage in pinned or span_start.get(stage, start) < start)
            if stage == item.stop or stage in breaks or stored:
                if start < stage:
                    items.append(Region(start, stage, tuple(Store(k) for k in range(start, stage))))
                start = stage
            if stored:
                items.append(Store(stage))
                start = stage + 1
    return tuple(items)


class _FixedPlanSolver:
    """A solver whose plan depends on the number of stages only."""

    name: ClassVar[str]

    def fixed_plan(self, n_stages: int) -> PlanTree:
        """The plan of a chain of ``n_stages`` stages."""
        raise NotImplementedError

    def plan_for(self, profile: ChainProfile) -> PlanTree:
        """The plan of the chain of ``profile``, its regions cut at the profile's breaks."""
        return within_breaks(self.fixed_plan(profile.n_stages), profile)

    def minimum_bytes(self, profile: ChainProfile) -> int:
        """The simulated peak of this solver's plan: the smallest budget it fits."""
        return Schedule.from_plan(profile, self.plan_for(profile)).predicted_peak_bytes

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the schedule of this solver's plan if it fits the budget.

        Raises:
            BudgetTooSmall: its peak is above the budget (``minimum_bytes`` is that peak).
        """
        budget = _validated_budget_bytes(budget_bytes)
        plan = self.plan_for(profile)
        schedule = Schedule.from_plan(profile, plan, budget_bytes=budget, solver_name=self.name)
        if budget is not None and schedule.predicted_peak_bytes > budget:
            minimum = self.minimum_bytes(profile)
            raise _budget_too_small(self.name, profile, budget, minimum, _ADVICE_BASELINE) from None
        return schedule


class StoreEverythingSolver(_FixedPlanSolver):
    """``"none"``: store every stage, recompute nothing (the fastest schedule)."""

    name: ClassVar[str] = "none"

    def fixed_plan(self, n_stages: int) -> PlanTree:
        """Every stage stored."""
        return store_everything_plan(n_stages)


class StoreInputsSolver(_FixedPlanSolver):
    """``"inputs"``: keep only the input of every stage and recompute each stage once.

    Every stage but the last is a one-stage region; the last stage is stored, since a
    region there would be recomputed right after it ran.
    """

    name: ClassVar[str] = "inputs"

    def fixed_plan(self, n_stages: int) -> PlanTree:
        """A one-stage region per stage, the last stored."""
        return self.plan_of(n_stages)

    @staticmethod
    def plan_of(n_stages: int) -> PlanTree:
        """The keep-inputs plan of a chain of ``n_stages`` stages."""
        return tuple(Region(stage, stage + 1, (Store(stage),)) for stage in range(n_stages - 1)) + (
            Store(n_stages - 1),
        )


class PeriodicSolver(_FixedPlanSolver):
    """``"periodic"``: equal segments, as ``torch.utils.checkpoint.checkpoint_sequential``.

    The chain is cut into ``segments`` segments of ``n // segments`` stages, the last one
    taking the remainder. Every segment but the last is a region whose body stores all its
    stages; the last segment is stored.

    Args:
        segments: the number of segments; default ``ceil(sqrt(n))``. Clipped to ``n``.

    Raises:
        ValueError: ``segments`` is not a positive integer.
    """

    name: ClassVar[str] = "periodic"

    def __init__(self, *, segments: int | None = None) -> None:
        if segments is not None and (
            isinstance(segments, bool) or not isinstance(segments, numbers.Integral) or segments < 1
        ):
            raise ValueError(f"segments must be a positive integer or None, got {segments!r}")
        self.segments = None if segments is None else int(segments)

    def plan(self, n_stages: int) -> PlanTree:
        """Returns the periodic plan of a chain of ``n_stages`` stages."""
        segments = self.segments if self.segments is not None else math.isqrt(n_stages - 1) + 1
        segments = min(segments, n_stages)
        size = n_stages // segments
        stores = _stores(n_stages)
        items: list[PlanItem] = []
        for start in range(0, size * (segments - 1), size):
            items.append(Region(start, start + size, stores[start : start + size]))
        items.extend(stores[size * (segments - 1) :])
        return tuple(items)

    def fixed_plan(self, n_stages: int) -> PlanTree:
        """The periodic plan (see :meth:`plan`)."""
        return self.plan(n_stages)
