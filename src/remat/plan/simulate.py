"""The memory and time simulator: what a schedule costs, operation by operation.

:func:`simulate` is the ground truth of what a schedule costs: the planner's dynamic program
is built to agree with it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from remat.plan.operations import (
    InvalidPlan,
    Operation,
    OperationKind,
    PlanTree,
    Region,
    Store,
    operations,
    validate_plan,
)
from remat.plan.profile import ChainProfile

__all__ = ["SimulationResult", "TimelineEntry", "simulate"]


class _HasOperations(Protocol):
    @property
    def operations(self) -> list[Operation]: ...


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


def simulate(profile: ChainProfile, plan: PlanTree | _HasOperations | Sequence[Operation]) -> SimulationResult:
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
    if not isinstance(plan, Sequence) and hasattr(plan, "operations"):
        ops = list(plan.operations)  # a Schedule
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
                    live + activation[stage + 1] + profile.saved_bytes[stage] + profile.forward_temp_bytes[stage]
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
            (count - 1) * forward_s for count, forward_s in zip(forward_counts, profile.forward_time_s, strict=True)
        ),
        forward_counts=tuple(forward_counts),
        timeline=tuple(timeline),
    )
