"""Recompute schedules as data: the plan tree, its operations, and the memory simulator.

A plan is a tuple of items covering the stages ``0 .. n-1`` in order. An item is either
:class:`Store` (run the stage keeping what its backward needs) or :class:`Region` (run a
range of stages once keeping only its input; when the backward reaches the range, run its
``body``, a plan of the same range, forward then backward). The executor runs regions as
nested recompute frames, in exactly the order :func:`operations` lists.

:func:`simulate` is the ground truth of what a schedule costs: the planner's dynamic program
is built to agree with it exactly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from remat.errors import RematError
from remat.plan.profile import ChainProfile

if TYPE_CHECKING:
    from remat.plan.report import PlanReport

__all__ = [
    "InvalidPlan",
    "Operation",
    "OperationKind",
    "Plan",
    "Region",
    "Schedule",
    "SimulationResult",
    "Store",
    "TimelineEntry",
    "operations",
    "plan_from_data",
    "plan_to_data",
    "simulate",
    "validate_plan",
]


class InvalidPlan(RematError, ValueError):
    """A plan or an operation sequence does not describe a valid schedule of the chain."""


@dataclass(frozen=True)
class Store:
    """Run stage ``stage`` once, keeping what its backward needs until that backward.

    Attributes:
        stage: the stage index.
    """

    stage: int


@dataclass(frozen=True)
class Region:
    """Run stages ``[start, stop)`` keeping only ``x_start``; re-run them as ``body`` later.

    In the forward pass the stages of the region run once and discard everything but their
    input ``x_start`` (the checkpoint). When the backward pass reaches the region, ``body``
    (a plan covering ``[start, stop)`` exactly) runs: its forward part, then its backward.

    Attributes:
        start: the first stage of the region.
        stop: one past the last stage of the region.
        body: the plan of ``[start, stop)`` run when the backward reaches the region. Its
            first item, if a region, is strictly shorter than this one.
    """

    start: int
    stop: int
    body: tuple[Store | Region, ...]


Item = Store | Region
Plan = tuple[Item, ...]
"""A plan: items covering the stages of a chain in order."""


class OperationKind(str, enum.Enum):
    """What one step of a schedule does."""

    FORWARD_CHECKPOINT = "forward_checkpoint"
    """Forward of the first stage of a region: its input is kept, nothing else."""
    FORWARD_DISCARD = "forward_discard"
    """Forward of a later stage of a region: nothing is kept."""
    FORWARD_STORE = "forward_store"
    """Forward keeping what the stage's backward needs."""
    LOSS = "loss"
    """The end of the forward pass: the gradient of the chain output appears."""
    BACKWARD = "backward"
    """Backward of a stage."""

    @property
    def is_forward(self) -> bool:
        """Whether the operation runs the forward of a stage."""
        return self in _FORWARD_KINDS


_FORWARD_KINDS = frozenset(
    {OperationKind.FORWARD_CHECKPOINT, OperationKind.FORWARD_DISCARD, OperationKind.FORWARD_STORE}
)


@dataclass(frozen=True)
class Operation:
    """One step of a schedule.

    Attributes:
        kind: what the step does.
        stage: the stage it runs; None for :attr:`OperationKind.LOSS`.
    """

    kind: OperationKind
    stage: int | None = None

    def __str__(self) -> str:
        if self.stage is None:
            return self.kind.value
        return f"{self.kind.value}({self.stage})"


_LOSS = Operation(OperationKind.LOSS)


def operations(plan: Plan) -> list[Operation]:
    """Flattens a plan into the operations the executor runs, in order.

    ``ops(items) = fwd(items[0]) + ops(items[1:]) + bwd(items[0])`` with ``ops(())`` the
    loss marker at the top level and nothing inside a region's body; ``fwd(Store(i))`` is
    ``forward_store(i)``, ``bwd(Store(i))`` is ``backward(i)``; ``fwd(Region)`` is
    ``forward_checkpoint(start)`` and ``forward_discard`` of the other stages, and
    ``bwd(Region)`` is the operations of its body.

    Args:
        plan: the plan (not validated here: see :func:`validate_plan`).

    Returns:
        The operations, forward pass first, with one ``loss`` marker.
    """
    result: list[Operation] = []
    _append_operations(plan, result, top_level=True)
    return result


def _append_operations(items: Sequence[Item], result: list[Operation], *, top_level: bool) -> None:
    # Iterative over the items of one level: forwards in order, then backwards reversed.
    for item in items:
        if isinstance(item, Store):
            result.append(Operation(OperationKind.FORWARD_STORE, item.stage))
        else:
            result.append(Operation(OperationKind.FORWARD_CHECKPOINT, item.start))
            result.extend(
                Operation(OperationKind.FORWARD_DISCARD, stage)
                for stage in range(item.start + 1, item.stop)
            )
    if top_level:
        result.append(_LOSS)
    for item in reversed(items):
        if isinstance(item, Store):
            result.append(Operation(OperationKind.BACKWARD, item.stage))
        else:
            _append_operations(item.body, result, top_level=False)


def validate_plan(plan: Plan, n_stages: int) -> None:
    """Checks that a plan is a valid schedule of a chain of ``n_stages`` stages.

    Args:
        plan: the plan.
        n_stages: the number of stages of the chain.

    Raises:
        InvalidPlan: the plan does not cover the stages in order, a region is empty or its
            body does not cover it, or a body starts with a region as long as its own.
    """
    if n_stages < 1:
        raise InvalidPlan(f"a chain has at least one stage, got n_stages={n_stages}")
    if not isinstance(plan, tuple):
        raise InvalidPlan(f"a plan is a tuple of Store and Region items, got {type(plan).__name__}")
    _validate_items(plan, 0, n_stages, "plan")


def _validate_items(items: tuple[Item, ...], start: int, stop: int, where: str) -> None:
    if not isinstance(items, tuple) or not items:
        raise InvalidPlan(f"{where} must be a non-empty tuple covering stages [{start}, {stop})")
    position = start
    for index, item in enumerate(items):
        label = f"{where}[{index}]"
        if isinstance(item, Store):
            if item.stage != position:
                raise InvalidPlan(
                    f"{label} is Store({item.stage}) but stage {position} comes next "
                    f"(items must cover [{start}, {stop}) in order)"
                )
            position += 1
        elif isinstance(item, Region):
            if item.start != position:
                raise InvalidPlan(
                    f"{label} is a region starting at stage {item.start} but stage {position} "
                    f"comes next (items must cover [{start}, {stop}) in order)"
                )
            if item.stop <= item.start:
                raise InvalidPlan(f"{label} is the empty region [{item.start}, {item.stop})")
            first = item.body[0] if isinstance(item.body, tuple) and item.body else None
            if isinstance(first, Region) and first.start == item.start and first.stop >= item.stop:
                raise InvalidPlan(
                    f"{label}: the body of region [{item.start}, {item.stop}) starts with the "
                    f"region [{first.start}, {first.stop}); a body's first region must be "
                    "strictly shorter than the region itself"
                )
            _validate_items(item.body, item.start, item.stop, f"{label}.body")
            position = item.stop
        else:
            raise InvalidPlan(f"{label} is {item!r}, not a Store or a Region")
        if position > stop:
            raise InvalidPlan(f"{label} reaches stage {position - 1}, past the end {stop - 1}")
    if position != stop:
        raise InvalidPlan(
            f"{where} covers stages [{start}, {position}) but must cover [{start}, {stop})"
        )


def plan_to_data(plan: Plan) -> list[dict[str, Any]]:
    """Returns a plan as JSON-able data: ``{"store": i}`` or ``{"region": [s, t], "body": [...]}``.

    See :func:`plan_from_data` for the way back.
    """
    data: list[dict[str, Any]] = []
    for item in plan:
        if isinstance(item, Store):
            data.append({"store": item.stage})
        else:
            data.append({"region": [item.start, item.stop], "body": plan_to_data(item.body)})
    return data


def plan_from_data(data: Sequence[Mapping[str, Any]]) -> Plan:
    """Builds a plan from the data :func:`plan_to_data` returns (not validated here).

    Raises:
        InvalidPlan: an entry is neither a store nor a region.
    """
    items: list[Item] = []
    for index, entry in enumerate(data):
        if isinstance(entry, Mapping) and set(entry) == {"store"}:
            items.append(Store(int(entry["store"])))
        elif isinstance(entry, Mapping) and set(entry) == {"region", "body"}:
            start, stop = entry["region"]
            items.append(Region(int(start), int(stop), plan_from_data(entry["body"])))
        else:
            raise InvalidPlan(
                f"plan entry {index} is {entry!r}; expected {{'store': i}} or "
                "{'region': [start, stop], 'body': [...]}"
            )
    return tuple(items)


class TimelineEntry(NamedTuple):
    """The memory around one operation of a simulated schedule.

    Attributes:
        operation: the operation.
        live_after_bytes: bytes live once it has finished.
        peak_during_bytes: the most bytes live while it runs.
    """

    operation: Operation
    live_after_bytes: int
    peak_during_bytes: int


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` predicts for a schedule.

    Attributes:
        peak_bytes: the most bytes live at any moment (the chain input excluded).
        time_s: seconds of all forwards and backwards run.
        overhead_s: ``time_s`` minus one forward and one backward of every stage.
        forward_counts: how many times each stage's forward runs (1 + recomputations).
        timeline: live and peak bytes around each operation, in order.
    """

    peak_bytes: int
    time_s: float
    overhead_s: float
    forward_counts: tuple[int, ...]
    timeline: tuple[TimelineEntry, ...] = field(repr=False)

    @property
    def operations(self) -> list[Operation]:
        """The operations simulated, in order."""
        return [entry.operation for entry in self.timeline]


# NOTE [memory model of the simulator]
# Live bytes are the sum of the values that have at least one holder:
#   x_k (k >= 1), held by
#     "frontier"      from its creation by a forward of stage k-1 until the next operation
#                     finishes (the forward of stage k that consumes it, the loss marker, or
#                     the backward of stage k-1 at the end of a recomputed body);
#     "stored"        forward_store(k) of a stage that saves its input, until backward(k);
#     "output"        forward_store(k-1) of a stage that saves its output, until backward(k-1);
#     "checkpoint"    forward_checkpoint(k), until backward(k), which ends that region's body
#                     (each stage's backward runs once, so it ends every region starting there);
#   x_0 is the caller's and costs nothing;
#   S_i, the saved bytes of stage i, from forward_store(i) until backward(i);
#   G_k, the gradient of x_k, from its creation (G_n at the loss marker, G_i by backward(i))
#     until backward(k-1) finishes; G_0 stays to the end.
# An operation first creates, then peaks, then releases:
#   forward of stage i:  peak = live + x_{i+1} + S_i + forward_temp_i (for every forward kind:
#                        a discarding forward still materialises S_i for a moment);
#   loss marker:         peak = live + G_n;
#   backward(i):         peak = live + G_i + backward_temp_i.
# The live bytes after an operation never exceed its peak, so the peak of a schedule is the
# largest of these. The planner's dynamic program (solvers.py) reproduces exactly this model.


def simulate(
    profile: ChainProfile, plan: Plan | Schedule | Sequence[Operation]
) -> SimulationResult:
    """Predicts the peak memory and the time of a schedule of a chain.

    Args:
        profile: the costs of the chain.
        plan: a plan tree, a :class:`Schedule`, or a sequence of operations.

    Returns:
        The peak bytes, time, overhead, forward counts and per-operation timeline.

    Raises:
        InvalidPlan: the plan is not valid for the chain, or the operations cannot run in
            that order (a forward without its input, a backward without its saved values or
            its output gradient, a stage without a backward, ...).
    """
    if isinstance(plan, Schedule):
        ops = list(plan.operations)
    elif isinstance(plan, tuple) and all(isinstance(item, (Store, Region)) for item in plan):
        validate_plan(plan, profile.n_stages)
        ops = operations(plan)
    else:
        ops = list(cast(Sequence[Operation], plan))
        for position, operation in enumerate(ops):
            if not isinstance(operation, Operation):
                raise InvalidPlan(
                    f"operation {position} is {operation!r}; expected a plan tree of Store and "
                    "Region items or a sequence of Operation"
                )
    return _simulate_operations(profile, ops)


def _simulate_operations(profile: ChainProfile, ops: Sequence[Operation]) -> SimulationResult:
    n_stages = profile.n_stages
    activation = profile.activation_bytes
    gradient = profile.gradient_bytes
    # Each computation of x_k is a value of its own: a recomputed x_k can coexist with an
    # older copy whose frontier has not ended yet. values[v] = [boundary, holder count].
    values: list[list[int]] = []
    current: list[int | None] = [None] * (n_stages + 1)
    stored_holder: list[int | None] = [None] * (n_stages + 1)
    output_holder: list[int | None] = [None] * (n_stages + 1)
    checkpoint_holders: list[list[int]] = [[] for _ in range(n_stages + 1)]
    saved_live = [False] * n_stages
    gradient_live = [False] * (n_stages + 1)
    backward_done = [False] * n_stages
    forward_counts = [0] * n_stages
    live = 0
    peak = 0
    times_s: list[float] = []
    frontier: int | None = None
    loss_seen = False
    timeline: list[TimelineEntry] = []

    def is_live(boundary: int) -> bool:
        return boundary == 0 or current[boundary] is not None

    def create(boundary: int) -> int:
        nonlocal live
        values.append([boundary, 1])
        current[boundary] = len(values) - 1
        live += activation[boundary]
        return len(values) - 1

    def hold(boundary: int) -> int | None:
        value = current[boundary]
        if value is not None:
            values[value][1] += 1
        return value

    def release(value: int | None) -> None:
        nonlocal live
        if value is None:
            return
        values[value][1] -= 1
        if values[value][1] == 0:
            boundary = values[value][0]
            live -= activation[boundary]
            if current[boundary] == value:
                current[boundary] = None

    for position, operation in enumerate(ops):
        stage = operation.stage
        kind = operation.kind
        where = f"operation {position} ({operation})"
        if kind is OperationKind.LOSS:
            if loss_seen:
                raise InvalidPlan(f"{where}: a schedule has one loss marker")
            if not is_live(n_stages):
                raise InvalidPlan(f"{where}: the chain output has not been computed")
            loss_seen = True
            peak_during = live + gradient[n_stages]
            live += gradient[n_stages]
            gradient_live[n_stages] = True
            released_frontier = frontier
            frontier = None
        else:
            if stage is None or not 0 <= stage < n_stages:
                raise InvalidPlan(f"{where}: stage must be in [0, {n_stages})")
            if kind.is_forward:
                if not is_live(stage):
                    raise InvalidPlan(f"{where}: its input x_{stage} is not live")
                if backward_done[stage]:
                    raise InvalidPlan(f"{where}: runs after the backward of stage {stage}")
                forward_counts[stage] += 1
                times_s.append(profile.forward_time_s[stage])
                peak_during = (
                    live
                    + activation[stage + 1]
                    + profile.saved_bytes[stage]
                    + profile.forward_temp_bytes[stage]
                )
                created = create(stage + 1)
                if kind is OperationKind.FORWARD_STORE:
                    if saved_live[stage]:
                        raise InvalidPlan(f"{where}: stage {stage} is already stored")
                    saved_live[stage] = True
                    live += profile.saved_bytes[stage]
                    if profile.saves_input[stage] and stage > 0:
                        stored_holder[stage] = hold(stage)
                    if profile.saves_output[stage]:
                        output_holder[stage + 1] = hold(stage + 1)
                elif kind is OperationKind.FORWARD_CHECKPOINT and stage > 0:
                    checkpoint = hold(stage)
                    if checkpoint is not None:
                        checkpoint_holders[stage].append(checkpoint)
                released_frontier = frontier
                frontier = created
            else:
                if backward_done[stage]:
                    raise InvalidPlan(f"{where}: the backward of stage {stage} runs twice")
                if not saved_live[stage]:
                    raise InvalidPlan(f"{where}: stage {stage} was not stored before its backward")
                if not gradient_live[stage + 1]:
                    raise InvalidPlan(f"{where}: the gradient of x_{stage + 1} does not exist yet")
                backward_done[stage] = True
                times_s.append(profile.backward_time_s[stage])
                # A frontier still open here is the output a region body recomputed last:
                # nothing consumes it, so only a holder other than the frontier keeps it.
                release(frontier)
                frontier = None
                peak_during = live + gradient[stage] + profile.backward_temp_bytes[stage]
                live += gradient[stage]
                gradient_live[stage] = True
                live -= gradient[stage + 1]
                gradient_live[stage + 1] = False
                live -= profile.saved_bytes[stage]
                saved_live[stage] = False
                release(stored_holder[stage])
                stored_holder[stage] = None
                for checkpoint in checkpoint_holders[stage]:
                    release(checkpoint)
                checkpoint_holders[stage].clear()
                release(output_holder[stage + 1])
                output_holder[stage + 1] = None
                released_frontier = frontier
                frontier = None
        release(released_frontier)
        peak = max(peak, peak_during, live)
        timeline.append(TimelineEntry(operation, live, peak_during))
    if not loss_seen:
        raise InvalidPlan("the schedule has no loss marker")
    missing = [stage for stage in range(n_stages) if not backward_done[stage]]
    if missing:
        raise InvalidPlan(f"the schedule never runs the backward of stages {missing}")
    return SimulationResult(
        peak_bytes=peak,
        time_s=math.fsum(times_s),
        overhead_s=math.fsum(
            (count - 1) * forward_s
            for count, forward_s in zip(forward_counts, profile.forward_time_s, strict=True)
        ),
        forward_counts=tuple(forward_counts),
        timeline=tuple(timeline),
    )


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

    items: Plan
    profile: ChainProfile = field(repr=False)
    simulation: SimulationResult = field(repr=False)
    budget_bytes: int | None = None
    solver_name: str = "manual"

    @classmethod
    def from_plan(
        cls,
        profile: ChainProfile,
        plan: Plan,
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
        """The stages stored in the first forward pass (run once, never recomputed)."""
        return tuple(item.stage for item in self.items if isinstance(item, Store))

    def report(self) -> PlanReport:
        """Returns the printable report of this schedule."""
        from remat.plan.report import PlanReport

        return PlanReport(self)

    def __str__(self) -> str:
        return str(self.report())
