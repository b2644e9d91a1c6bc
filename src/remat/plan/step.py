"""The plan of a whole training step: a chain's schedule, and how the budget is shared out.

A :class:`Schedule` plans the chain of stages alone. A training step also holds memory
outside the chain (what runs before it, outputs that escape it, the model output a loop
keeps), leaves room for a loss that was not measured, and keeps a margin for what
measurement cannot attribute. :class:`Plan` puts the two together: it is what
``Checkpointable.plan`` and ``Checkpointable.plan_for`` return, what ``print(plan)``
shows, and what ``plan.to_json()`` writes, the one plan format of remat
(``Plan.from_json`` reads it back, with no model and no device).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.plan.lifetimes import GlueConstant, HeldInput, Lifetimes, ReplayHold, peak_with_lifetimes
from remat.plan.operations import InvalidPlan, plan_from_data
from remat.plan.profile import ChainProfile
from remat.plan.report import PlanReport
from remat.plan.schedule import Schedule
from remat.plan.simulate import SimulationResult

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "BudgetSplit", "Plan"]

PLAN_FORMAT = "remat.plan"
"""The value of the ``"format"`` key of a saved plan."""

PLAN_VERSION = 2
"""The version of the plan layout that this module writes and reads."""


@dataclass(frozen=True)
class BudgetSplit:
    """How the budget of a training step is shared out.

    ``total_bytes = chain_bytes + held_outside_bytes + margin_bytes`` (up to rounding):
    the chain's schedule is planned within ``chain_bytes``.

    Attributes:
        total_bytes: the whole-step activation budget; None for unlimited.
        chain_bytes: what the chain's schedule is planned within; None for unlimited.
        held_outside_bytes: memory held through the step outside the chain's schedule
            (activations of the code before the chain, outputs that escape it, the model
            output a training loop keeps).
        loss_allowance_bytes: room kept, within the chain's share, for a loss that was
            not measured (see NOTE [loss allowance] in ``remat.plan.share``); 0 when the
            real loss was measured.
        margin_bytes: kept free for what per-stage measurement cannot attribute.
        after_chain_peak_bytes: the step's peak once the chain's backward is done (the
            backward of the code before the chain: an embedding whose weight is tied to
            the output layer forms a second whole gradient there), whatever the schedule.
        cast_bytes: per planned stage, autocast's casts of weights it keeps for its
            backward;
        cached_cast_bytes: per planned stage, autocast's casts that no stage keeps for
            its backward, which its cache holds until its region ends;
        leftover_bytes: per planned stage, what its backward leaves alive;
        leftover_freed: ``(planned stage, bytes)``: of those leftovers and of
            ``from_loss_bytes``, what a later backward (that stage's) frees: a U-Net's skip
            gradient, taken by its down block; a tied head's partial weight gradient;
        from_loss_bytes: what the code after the chain keeps from the loss on;
        kept_output_bytes: the model output the training loop keeps, from the loss on.
        loss_only_bytes: of the chain output's gradient in the profile, what is the peak
            of the code after the chain: planned from the loss to the last stage's
            backward, alive during the loss only.
            The first five of these are counted in ``held_outside_bytes``, and the last
            in the profile: the plan is made as if they lived that long. The prediction
            follows them where they live (:mod:`remat.plan.lifetimes`).
        suffix_backward_excess_bytes: how much the peak charged at the loss (the chain
            output's gradient in the profile) exceeds the peak of the code after the
            chain until the loss is computed, where a training loop leaves autocast.
        held_inputs: stage inputs the model's own code holds beyond their stage in the
            first forward, where the schedule would free them: not in the figures
            above; the prediction counts them where they live.
        glue_constants: what the glue after a stage keeps for its replays when the stage
            is not stored (NOTE [glue constants] in ``remat.measure.outside``): in
            ``held_outside_bytes``; the prediction counts each where it lives.
        waiting_gradient_bytes: per boundary ``k`` of the chain (``n + 1``, or empty),
            the gradients that wait, alive, for the replay of a region ending at ``k``
            (NOTE [gradients waiting for a replay] in ``remat.measure.outside``): not in
            the figures above; the prediction adds them to that replay.
        replay_held: a :class:`~remat.plan.lifetimes.ReplayHold` per glue constant a
            replay takes from an earlier planned stage instead of keeping it (NOTE
            [constants an earlier stage takes] in ``remat.discover.glue``): in a replay
            the executor holds that stage's input from its forward to the glue's (to the
            glue's stage's backward where it is stored and its glue saves it), unless
            the schedule keeps it; not in the figures above, the prediction adds it there.
    """

    total_bytes: int | None
    chain_bytes: int | None
    held_outside_bytes: int = 0
    loss_allowance_bytes: int = 0
    margin_bytes: int = 0
    after_chain_peak_bytes: int = 0
    cast_bytes: tuple[int, ...] = ()
    leftover_bytes: tuple[int, ...] = ()
    from_loss_bytes: int = 0
    kept_output_bytes: int = 0
    loss_only_bytes: int = 0
    held_inputs: tuple[HeldInput, ...] = ()
    suffix_backward_excess_bytes: int = 0
    cached_cast_bytes: tuple[int, ...] = ()
    leftover_freed: tuple[tuple[int, int], ...] = ()
    glue_constants: tuple[GlueConstant, ...] = ()
    waiting_gradient_bytes: tuple[int, ...] = ()
    replay_held: tuple[ReplayHold, ...] = ()

    def __post_init__(self) -> None:  # tuples again when read back from JSON
        held = tuple(ReplayHold(int(a), int(b), int(n), *map(bool, flags)) for a, b, n, *flags in self.replay_held)
        object.__setattr__(self, "replay_held", held)
        object.__setattr__(self, "waiting_gradient_bytes", tuple(int(c) for c in self.waiting_gradient_bytes))
        object.__setattr__(self, "cast_bytes", tuple(int(c) for c in self.cast_bytes))
        object.__setattr__(self, "cached_cast_bytes", tuple(int(c) for c in self.cached_cast_bytes))
        object.__setattr__(self, "leftover_bytes", tuple(int(c) for c in self.leftover_bytes))
        held_inputs = tuple(HeldInput(*h) for h in self.held_inputs)
        held_inputs = tuple(
            h._replace(later_takers=tuple(h.later_takers), later_savers=tuple(h.later_savers)) for h in held_inputs
        )
        object.__setattr__(self, "held_inputs", held_inputs)
        object.__setattr__(self, "leftover_freed", tuple((int(g), int(n)) for g, n in self.leftover_freed))
        constants = tuple(GlueConstant(*c) for c in self.glue_constants)  # lists when read back from JSON
        object.__setattr__(self, "glue_constants", tuple(c._replace(keepers=tuple(c.keepers)) for c in constants))

    @property
    def part_time_bytes(self) -> int:
        """What is held outside the chain only part of the step, where the prediction
        follows it."""
        return (
            sum(self.leftover_bytes)
            + self.from_loss_bytes
            + self.kept_output_bytes
            + self.loss_only_bytes
            + sum(self.cast_bytes)
            + sum(self.cached_cast_bytes)
            + sum(constant.nbytes for constant in self.glue_constants)
        )

    def chain_phase_peak_bytes(self, simulation: SimulationResult) -> int:
        """The step's peak until the chain's backward is done, for a schedule simulated so."""
        lifetimes = Lifetimes(
            self.leftover_bytes,
            self.from_loss_bytes + self.kept_output_bytes,
            self.loss_only_bytes,
            self.cast_bytes,
            self.held_inputs,
            self.suffix_backward_excess_bytes,
            self.cached_cast_bytes,
            self.leftover_freed,
            self.glue_constants,
            self.waiting_gradient_bytes,
            self.replay_held,
        )
        return peak_with_lifetimes(simulation, lifetimes) + self.held_outside_bytes - lifetimes.total_bytes

    @classmethod
    def unlimited(cls, held_outside_bytes: int = 0, loss_allowance_bytes: int = 0) -> BudgetSplit:
        """The split of no budget at all."""
        return cls(None, None, held_outside_bytes, loss_allowance_bytes, 0)


@dataclass(frozen=True, eq=False)
class Plan:
    """A recompute plan of a whole training step.

    Attributes:
        schedule: the schedule of the chain's planned stages (the chain's own figures).
        budget: how the step's budget is shared out.
        groups: for each planned stage, the ``(first, stop)`` stage calls it groups.
        measured_peak_bytes: the peak of the measured step (every activation stored).
        measurement: what the plan was made from (a ``remat.measure.ChainMeasurement``);
            None for a plan read back from JSON.
        read_taken_again: :attr:`taken_again_pairs` as read back from JSON.
    """

    schedule: Schedule
    budget: BudgetSplit
    groups: tuple[tuple[int, int], ...]
    measured_peak_bytes: int = 0
    measurement: Any = field(default=None, repr=False)
    read_taken_again: tuple[tuple[int, int], ...] = field(default=(), repr=False)

    @property
    def taken_again_pairs(self) -> tuple[tuple[int, int], ...]:
        """The ``(stage, glue's stage)`` stage calls whose glue can take an earlier value from a
        replay (NOTE [constants an earlier stage takes] in remat.discover.glue): a pinned plan
        (read from JSON, or made for another controller) runs its glue spans with them."""
        if self.measurement is None:
            return self.read_taken_again
        return tuple(sorted({pair for taken in self.measurement.taken_again for pair in taken.pairs}))

    # ------------------------------------------------------------------ figures
    @property
    def budget_bytes(self) -> int | None:
        """The whole-step budget in bytes (None: unlimited)."""
        return self.budget.total_bytes

    @property
    def held_outside_bytes(self) -> int:
        """Memory held through the step outside the chain's schedule."""
        return self.budget.held_outside_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak activation memory of the whole training step."""
        chain_phase = self.budget.chain_phase_peak_bytes(self.schedule.simulation)
        return max(chain_phase, self.budget.after_chain_peak_bytes)

    @property
    def predicted_time_s(self) -> float:
        """Predicted seconds of the chain's forwards and backwards, recomputations included."""
        return self.schedule.predicted_time_s

    @property
    def overhead_fraction(self) -> float:
        """Predicted extra time over no recompute, as a fraction (0.25: 25% slower)."""
        return self.report().overhead_fraction

    @property
    def overhead(self) -> float:
        """The same as :attr:`overhead_fraction`."""
        return self.overhead_fraction

    @property
    def forward_counts(self) -> tuple[int, ...]:
        """How many times each planned stage's forward runs per step."""
        return self.schedule.forward_counts

    @property
    def stage_calls(self) -> int:
        """How many stage calls the chain makes (planned stages group them)."""
        return self.groups[-1][1] if self.groups else 0

    # ------------------------------------------------------------------ report
    def report(self) -> PlanReport:
        """The printable report of this plan (what ``print(plan)`` shows)."""
        return PlanReport(self.schedule, budget=self.budget)

    def __str__(self) -> str:
        return str(self.report())

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able data: the one plan format of remat.

        Byte figures at the top level are for the whole step; ``schedule`` is the report
        of the chain's schedule and ``profile`` the costs it was planned from (with the
        loss allowance, if any, in the chain output's gradient).
        """
        report = self.report()
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "solver": self.schedule.solver_name,
            "budget_bytes": self.budget_bytes,
            "budget": {k: _as_json(v) for k, v in asdict(self.budget).items()},
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time_s": self.predicted_time_s,
            "predicted_overhead": report.overhead_fraction,
            "no_recompute_peak_bytes": report.baseline.peak_bytes + self.held_outside_bytes,
            "forward_counts": list(self.forward_counts),
            "kept_stages": [row.index for row in report.rows if row.kept],
            "schedule": report.to_dict(),
            "measured": {
                "peak_bytes": self.measured_peak_bytes,
                "fixed_bytes": self.held_outside_bytes,
                "stage_calls": self.stage_calls,
                "groups": [list(group) for group in self.groups],
                "taken_again": [list(pair) for pair in self.taken_again_pairs],
            },
            "profile": self.schedule.profile.to_dict(),
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as a JSON document (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Reads a plan written by :meth:`to_dict`, and checks it against its own profile.

        Raises:
            InvalidPlan: the data is not a plan of this format, or its schedule does not
                give the peak it records.
        """
        if not isinstance(data, Mapping) or data.get("format") != PLAN_FORMAT:
            raise InvalidPlan(f"not a remat plan: expected 'format': {PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise InvalidPlan(f"plan version {data.get('version')!r} is not {PLAN_VERSION}, the one this remat reads")
        try:
            profile = ChainProfile.from_dict(data["profile"])
            report = data["schedule"]
            budget = BudgetSplit(**data["budget"])
            schedule = Schedule.from_plan(
                profile,
                plan_from_data(report["plan"]),
                budget_bytes=budget.chain_bytes,
                solver_name=str(data["solver"]),
            )
            measured = data["measured"]
            groups = tuple((int(first), int(stop)) for first, stop in measured["groups"])
            taken = tuple((int(stage), int(glue)) for stage, glue in measured.get("taken_again", ()))
            plan = cls(schedule, budget, groups, int(measured["peak_bytes"]), read_taken_again=taken)
        except (KeyError, TypeError, ValueError) as error:
            raise InvalidPlan(f"the plan document is incomplete or malformed: {error!r}") from None
        if plan.predicted_peak_bytes != data.get("predicted_peak_bytes"):
            raise InvalidPlan(
                f"the plan records a predicted peak of {data.get('predicted_peak_bytes')} bytes, but its "
                f"schedule simulates to {plan.predicted_peak_bytes} bytes on its profile"
            )
        return plan

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Reads a plan from the JSON that :meth:`to_json` writes (see :meth:`from_dict`)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InvalidPlan(f"the plan is not valid JSON: {error}") from None
        return cls.from_dict(data)

    @classmethod
    def pinned(cls, plan: Plan | str | os.PathLike[str] | None) -> Plan | None:
        """A plan given as itself or as the path of a file :meth:`to_json` wrote (None stays None)."""
        if plan is None or isinstance(plan, Plan):
            return plan
        if not isinstance(plan, (str, os.PathLike)):
            raise TypeError(f"plan must be a remat.plan.Plan or the path of a saved plan, got {type(plan).__name__}")
        with open(plan, encoding="utf-8") as handle:
            return cls.from_json(handle.read())


def _as_json(value: Any) -> Any:
    """Tuples (named ones too) as lists, at any depth: what JSON reads back."""
    if isinstance(value, tuple):
        return [_as_json(v) for v in value]
    return value
