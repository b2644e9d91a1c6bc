"""How a whole step's budget is shared between the chain and what the step adds."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.plan.solvers import Solver
from remat.plan.step import BudgetSplit

#: At most this many more solves look for a faster plan that counts what is held only
#: part of the step where it lives (see :meth:`Planning.solve`).
TIGHTENINGS = 4

__all__ = ["Planning"]


class Planning(NamedTuple):
    """A measurement made ready for the solver: the chain's profile and what the step adds.

    Attributes:
        profile: the chain's profile (the loss allowance included).
        margin: the fraction of the budget kept free (NOTE [planning margin]).
        solver: the solver to plan with.
        outside: what is held outside the chain and when, the loss allowance and the peak
            after the chain's backward (a :class:`BudgetSplit` with no budget yet:
            :meth:`split` gives the one of a budget).
    """

    profile: ChainProfile
    margin: float
    solver: Solver
    outside: BudgetSplit

    @property
    def held_outside_bytes(self) -> int:
        """Held through the step outside the chain's schedule (as planning counts it)."""
        return self.outside.held_outside_bytes

    @property
    def after_chain_peak_bytes(self) -> int:
        """The step's peak after the chain's backward, whatever the schedule."""
        return self.outside.after_chain_peak_bytes

    def split(self, total_bytes: int) -> BudgetSplit:
        """How a whole-step budget of `total_bytes` is shared out, as planning starts."""
        return dataclasses.replace(
            self.outside,
            total_bytes=total_bytes,
            chain_bytes=self.chain_bytes(total_bytes),
            margin_bytes=total_bytes - int(total_bytes * (1.0 - self.margin)),
        )

    def minimum_total_bytes(self) -> int:
        """The smallest whole-step budget :meth:`solve` plans within.

        With everything held outside counted through the step, it is the one whose chain
        share is the solver's minimum; with what lives only part of the step counted where
        it lives, the least-memory schedule may fit a smaller one.
        """
        minimum_chain = self.solver.minimum_bytes(self.profile)
        conservative = self.total_for(minimum_chain)
        if not self.outside.part_time_bytes:
            return conservative
        least = self.solver(self.profile, minimum_chain)
        needed = max(self.outside.chain_phase_peak_bytes(least.simulation), self.after_chain_peak_bytes)
        total = math.ceil(needed / (1.0 - self.margin))
        while int(total * (1.0 - self.margin)) < needed:
            total += 1
        return min(conservative, total)

    def chain_bytes(self, total_bytes: int) -> int:
        """The chain's share of a whole-step budget of `total_bytes`."""
        # NOTE [planning margin]
        # The plan must fit with a margin for what per-stage measurement cannot attribute
        # (a real loss heavier than the default one measured, autocast's casts): the
        # chain is planned for (1 - margin) of the budget, less the memory held outside
        # it. A model measured with the real loss outside autocast has nothing
        # unattributed (Checkpointable._margin).
        return int(total_bytes * (1.0 - self.margin)) - self.held_outside_bytes

    def total_for(self, needed: int) -> int:
        """The smallest whole-step budget whose chain share is at least `needed` bytes and
        that keeps the margin above the peak after the chain's backward."""
        after_chain = math.ceil(self.after_chain_peak_bytes / (1.0 - self.margin))
        minimum = max(after_chain, math.ceil((needed + self.held_outside_bytes) / (1.0 - self.margin)))
        # The smallest such budget, whatever the float rounding.
        while self.chain_bytes(minimum) < needed:
            minimum += 1
        while minimum > max(1, after_chain) and self.chain_bytes(minimum - 1) >= needed:
            minimum -= 1
        return minimum

    def solve(self, split: BudgetSplit) -> tuple[Schedule, BudgetSplit]:
        """The fastest schedule found whose predicted whole-step peak fits the budget.

        The schedule planned within ``split.chain_bytes`` fits: it counts everything held
        outside the chain as held through the step. Part of it lives only part of the
        step (a kept output from the loss on, the partial gradient of a tied weight after
        its backward), so a larger chain share can fit too: the solver is given the
        share with that part added, the result is checked against the budget with
        everything counted where it lives, and the share is lowered by the excess until
        it fits (at most ``TIGHTENINGS`` times, then the solver's minimum is tried). The
        faster of the two plans is taken. The budget must be at least
        :meth:`minimum_total_bytes`.
        """
        assert split.total_bytes is not None and split.chain_bytes is not None
        minimum = self.solver.minimum_bytes(self.profile)
        schedule = self.solver(self.profile, split.chain_bytes) if split.chain_bytes >= minimum else None
        if not split.part_time_bytes:
            if schedule is None:
                raise ValueError("the budget is below the smallest feasible one (see minimum_total_bytes)")
            return schedule, split
        limit = split.total_bytes - split.margin_bytes
        share = split.chain_bytes + split.part_time_bytes
        for attempt in range(TIGHTENINGS + 1):
            if attempt == TIGHTENINGS or share < minimum:
                share = minimum  # the last try: the least memory the solver can plan in
            candidate_split = dataclasses.replace(split, chain_bytes=share)
            candidate = self.solver(self.profile, share)
            peak = candidate_split.chain_phase_peak_bytes(candidate.simulation)
            if peak <= limit:
                if schedule is None or candidate.predicted_time_s < schedule.predicted_time_s:
                    return candidate, candidate_split
                break
            if share == minimum or schedule is not None and share <= split.chain_bytes:
                break
            share -= peak - limit
        if schedule is None:
            raise ValueError("the budget is below the smallest feasible one (see minimum_total_bytes)")
        return schedule, split
