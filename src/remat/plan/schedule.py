"""A schedule: a plan tree of a chain, with what the simulator predicts for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from remat.plan.operations import Offload, Operation, PlanTree, Store
from remat.plan.profile import ChainProfile
from remat.plan.report import PlanReport
from remat.plan.simulate import SimulationResult, simulate

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """A plan of a chain with what it is predicted to cost.

    Solvers return schedules. ``str(schedule)`` prints a report of the plan (see
    :class:`remat.plan.report.PlanReport`).

    Attributes:
        items: the plan tree.
        profile: the chain profile it was planned for.
        simulation: what :func:`simulate` predicts for it.
        budget_bytes: the memory budget it was planned for; None for unlimited.
        solver_name: the name of the solver that made it (``"manual"`` for hand-made plans).
    """

    items: PlanTree
    profile: ChainProfile = field(repr=False)
    simulation: SimulationResult = field(repr=False)
    budget_bytes: int | None = None
    solver_name: str = "manual"

    @classmethod
    def from_plan(
        cls,
        profile: ChainProfile,
        plan: PlanTree,
        *,
        budget_bytes: int | None = None,
        solver_name: str = "manual",
    ) -> Schedule:
        """Validates and simulates a plan.

        Args:
            profile: the chain profile.
            plan: the plan tree.
            budget_bytes: the budget it was planned for, if any (not enforced here).
            solver_name: who made the plan.

        Raises:
            InvalidPlan: the plan is not a valid schedule of the chain.
        """
        return cls(
            items=plan,
            profile=profile,
            simulation=simulate(profile, plan),
            budget_bytes=budget_bytes,
            solver_name=solver_name,
        )

    @property
    def operations(self) -> list[Operation]:
        """The operations the executor runs, in order (see :func:`operations`)."""
        return self.simulation.operations

    @property
    def predicted_peak_bytes(self) -> int:
        """The simulated peak of live bytes (the chain input excluded)."""
        return self.simulation.peak_bytes

    @property
    def predicted_time_s(self) -> float:
        """The simulated seconds of all forwards and backwards of a training step."""
        return self.simulation.time_s

    @property
    def overhead_s(self) -> float:
        """The simulated seconds spent recomputing."""
        return self.simulation.overhead_s

    @property
    def forward_counts(self) -> tuple[int, ...]:
        """How many times each stage's forward runs."""
        return self.simulation.forward_counts

    @property
    def stored_stages(self) -> tuple[int, ...]:
        """The stages stored (or offloaded) in the first forward pass (run once, never recomputed)."""
        return tuple(item.stage for item in self.items if isinstance(item, Store | Offload))

    @property
    def offloaded_stages(self) -> tuple[int, ...]:
        """The stages whose saved tensors wait in host memory for their backward."""
        return tuple(item.stage for item in self.items if isinstance(item, Offload))

    def report(self) -> PlanReport:
        """Returns the printable report of this schedule."""
        return PlanReport(self)

    def __str__(self) -> str:
        return str(self.report())
