"""How a whole step's budget is shared between the chain and what the step adds."""

from __future__ import annotations

import math
from typing import NamedTuple

from remat.plan.profile import ChainProfile
from remat.plan.solvers import Solver

__all__ = ["Planning"]


class Planning(NamedTuple):
    """A measurement made ready for the solver: the chain's profile and what the step adds.

    Attributes:
        profile: the chain's profile (the loss allowance included).
        held_outside_bytes: held through the step outside the chain's schedule.
        loss_allowance_bytes: room kept for a loss that was not measured.
        margin: the fraction of the budget kept free (NOTE [planning margin]).
        solver: the solver to plan with.
        after_chain_peak_bytes: the step's peak after the chain's backward (any schedule).
    """

    profile: ChainProfile
    held_outside_bytes: int
    loss_allowance_bytes: int
    margin: float
    solver: Solver
    after_chain_peak_bytes: int

    def chain_bytes(self, total_bytes: int) -> int:
        """The chain's share of a whole-step budget of `total_bytes`."""
        # NOTE [planning margin]
        # The plan must fit with a margin for what per-stage measurement cannot attribute
        # (the model's own code around the chain, a real loss heavier than the default
        # one measured): the chain is planned for (1 - margin) of the budget, less the
        # memory held outside it. A Sequential measured with the real loss has nothing
        # unattributed.
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
