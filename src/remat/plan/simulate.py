"""The memory and time simulator: what a schedule costs, operation by operation.

:func:`simulate` is the ground truth of what a schedule costs: the planner's dynamic program
is built to agree with it exactly.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from remat.plan.operations import (
    InvalidPlan,
    Offload,
    Operation,
    OperationKind,
    PlanTree,
    Region,
    Store,
    operations,
    validate_plan,
)
from remat.plan.options import StoreOption
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
        host_peak_bytes: the most bytes held in host memory at once by offloaded stages.
        stall_s: seconds the computation waits for copies to or from host memory (in
            ``time_s`` and ``overhead_s``).
    """

    peak_bytes: int
    time_s: float
    overhead_s: float
    forward_counts: tuple[int, ...]
    timeline: tuple[TimelineEntry, ...] = field(repr=False)
    host_peak_bytes: int = 0
    stall_s: float = 0.0

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
# largest of these. The planner's dynamic program (plan/solvers/arrays.py) reproduces exactly this model.

# NOTE [offloaded stages]
# forward_offload(i) holds what forward_store(i) holds, but S_i moves to host memory: its
# copy starts when the forward ends and overlaps the next operation (the forward of stage
# i+1), whose peak still counts S_i; S_i leaves device memory when that operation ends, and
# the computation waits max(0, T_i - forward_i+1) for the copy, T_i being the transfer time
# of S_i (profile.transfer_time_s). The copy back starts with backward(i+1), the operation
# before backward(i), whose peak counts S_i again, and the computation waits
# max(0, T_i - backward_i+1) for it. (If nothing started it earlier, backward(i) itself
# brings S_i back and waits T_i.) The executor (remat.execute, remat.offload) frees and
# brings back at exactly these points, so that the device never holds more than this.


class _Where:
    """Names an operation in an error message, formatted only if one is raised."""

    __slots__ = ("operation", "position")

    def __init__(self, position: int, operation: Operation) -> None:
        self.position = position
        self.operation = operation

    def __str__(self) -> str:
        return f"operation {self.position} ({self.operation})"


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
    # A plan that nests deep has operations in the square of the chain's length (500,000
    # for 1,000 stages), each with an entry in the timeline: the cyclic garbage collector,
    # scanning them again and again as they pile up, took about 40% of the time. Nothing
    # here makes a reference cycle, so it is paused, and put back as it was.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if not isinstance(plan, Sequence) and hasattr(plan, "operations"):
            ops = list(plan.operations)  # a Schedule
        elif isinstance(plan, tuple) and all(isinstance(item, Store | Offload | Region) for item in plan):
            validate_plan(plan, profile.n_stages)
            ops = operations(plan)
        else:
            ops = list(cast(Sequence[Operation], plan))
            for position, operation in enumerate(ops):
                if not isinstance(operation, Operation):
                    raise InvalidPlan(
                        f"operation {position} is {operation!r}; expected a plan tree of Store, Offload "
                        "and Region items or a sequence of Operation"
                    )
        return _simulate_operations(profile, ops)
    finally:
        if was_enabled:
            gc.enable()


def _simulate_operations(profile: ChainProfile, ops: Sequence[Operation]) -> SimulationResult:
    return _Simulation(profile).run(ops)


class _Simulation:
    """The state of a simulated schedule (see NOTE [memory model of the simulator])."""

    def __init__(self, profile: ChainProfile) -> None:
        n_stages = profile.n_stages
        self.profile = profile
        self.n_stages = n_stages
        # Each computation of x_k is a value of its own: a recomputed x_k can coexist with
        # an older copy whose frontier has not ended yet. values[v] = [boundary, holders].
        self.values: list[list[int]] = []
        self.current: list[int | None] = [None] * (n_stages + 1)
        self.stored_holder: list[int | None] = [None] * (n_stages + 1)
        self.output_holder: list[int | None] = [None] * (n_stages + 1)
        self.checkpoint_holders: list[list[int]] = [[] for _ in range(n_stages + 1)]
        self.saved_live = [False] * n_stages
        self.gradient_live = [False] * (n_stages + 1)
        self.backward_done = [False] * n_stages
        self.forward_counts = [0] * n_stages
        self.live_bytes = 0
        self.times_s: list[float] = []
        self.frontier: int | None = None
        self.loss_seen = False
        self.breaks = frozenset(profile.region_breaks)
        self.pinned = frozenset(profile.pinned_stages)
        # glue spans: a replay that runs stage k starts at or before the span's first stage
        self.span_start = profile.span_starts()
        self.sweep_start: int | None = 0  # where the forwards running now started
        # offloaded stages (NOTE [offloaded stages]): the one whose copy overlaps the next
        # operation, and those whose saved bytes are in host memory
        self.leaving: int | None = None
        self.on_host: set[int] = set()
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.stalls_s: list[float] = []
        # stages stored under a store option (NOTE [stored under a policy]), until their backward
        self.options: dict[int, StoreOption] = {}
        self.extras_s: list[float] = []

    # -- values of the boundaries x_k and their holders
    def is_live(self, boundary: int) -> bool:
        return boundary == 0 or self.current[boundary] is not None

    def create(self, boundary: int) -> int:
        self.values.append([boundary, 1])
        self.current[boundary] = len(self.values) - 1
        self.live_bytes += self.profile.activation_bytes[boundary]
        return len(self.values) - 1

    def hold(self, boundary: int) -> int | None:
        value = self.current[boundary]
        if value is not None:
            self.values[value][1] += 1
        return value

    def release(self, value: int | None) -> None:
        if value is None:
            return
        self.values[value][1] -= 1
        if self.values[value][1] == 0:
            boundary = self.values[value][0]
            self.live_bytes -= self.profile.activation_bytes[boundary]
            if self.current[boundary] == value:
                self.current[boundary] = None

    def end_frontier(self) -> int | None:
        ended, self.frontier = self.frontier, None
        return ended

    # -- the operations; each returns its peak and the value its end releases
    def loss(self, where: _Where) -> tuple[int, int | None]:
        if self.loss_seen:
            raise InvalidPlan(f"{where}: a schedule has one loss marker")
        if not self.is_live(self.n_stages):
            raise InvalidPlan(f"{where}: the chain output has not been computed")
        self.loss_seen = True
        self.sweep_start = None
        gradient_bytes = self.profile.gradient_bytes[self.n_stages]
        peak_during = self.live_bytes + gradient_bytes
        self.live_bytes += gradient_bytes
        self.gradient_live[self.n_stages] = True
        return peak_during, self.end_frontier()

    def forward(
        self, kind: OperationKind, stage: int, where: _Where, option_name: str | None = None
    ) -> tuple[int, int | None]:
        profile = self.profile
        if not self.is_live(stage):
            raise InvalidPlan(f"{where}: its input x_{stage} is not live")
        stores = kind in (OperationKind.FORWARD_STORE, OperationKind.FORWARD_OFFLOAD)
        if not stores and stage in self.pinned:
            raise InvalidPlan(
                f"{where}: stage {stage} is pinned (see ChainProfile.pinned_stages): it is never recomputed"
            )
        if kind is OperationKind.FORWARD_DISCARD and stage in self.breaks:
            raise InvalidPlan(
                f"{where}: its region crosses boundary {stage}, a break (the model changes x_{stage} in place "
                f"after stage {stage - 1} returns it; see ChainProfile.region_breaks)"
            )
        if self.backward_done[stage]:
            raise InvalidPlan(f"{where}: runs after the backward of stage {stage}")
        self.sweep_start = stage if self.sweep_start is None else self.sweep_start
        if self.sweep_start > self.span_start.get(stage, self.sweep_start):
            raise InvalidPlan(
                f"{where}: a replay from stage {self.sweep_start} runs it, but its glue takes the input of stage "
                f"{self.span_start[stage]} from the replay (see ChainProfile.glue_spans)"
            )
        self.forward_counts[stage] += 1
        self.times_s.append(profile.forward_time_s[stage])
        peak_during = (
            self.live_bytes
            + profile.activation_bytes[stage + 1]
            + profile.saved_bytes[stage]
            + profile.forward_temp_bytes[stage]
        )
        created = self.create(stage + 1)
        if kind is OperationKind.FORWARD_OFFLOAD:
            if profile.offload_time_per_byte_s is None:
                raise InvalidPlan(f"{where}: the profile has no offload_time_per_byte_s (offload was not measured)")
            self.leaving = stage
        if stores:
            if self.saved_live[stage]:
                raise InvalidPlan(f"{where}: stage {stage} is already stored")
            self.saved_live[stage] = True
            option = self.option_of(option_name, kind, stage, where)
            if option is not None:  # NOTE [stored under a policy]
                self.options[stage] = option
                self.live_bytes += cast(int, option.saved_bytes[stage])
                saves_input, saves_output = True, option.saves_output[stage]
            else:
                self.live_bytes += profile.saved_bytes[stage]
                saves_input, saves_output = profile.saves_input[stage], profile.saves_output[stage]
            if saves_input and stage > 0:
                self.stored_holder[stage] = self.hold(stage)
            if saves_output:
                self.output_holder[stage + 1] = self.hold(stage + 1)
        elif kind is OperationKind.FORWARD_CHECKPOINT and stage > 0:
            checkpoint = self.hold(stage)
            if checkpoint is not None:
                self.checkpoint_holders[stage].append(checkpoint)
        ended = self.end_frontier()
        self.frontier = created
        return peak_during, ended

    def option_of(self, name: str | None, kind: OperationKind, stage: int, where: _Where) -> StoreOption | None:
        """The store option a forward names (None: none), checked against the profile."""
        if name is None:
            return None
        if kind is not OperationKind.FORWARD_STORE:
            raise InvalidPlan(f"{where}: only a stored stage runs under a store option")
        matches = [option for option in self.profile.store_options if option.name == name]
        if not matches:
            known = [option.name for option in self.profile.store_options]
            raise InvalidPlan(f"{where}: the profile has no store option {name!r} (its options: {known})")
        if not matches[0].applies(stage):
            raise InvalidPlan(f"{where}: the store option {name!r} does not apply to stage {stage}")
        return matches[0]

    def backward(self, stage: int, where: _Where) -> tuple[int, int | None]:
        profile = self.profile
        if self.backward_done[stage]:
            raise InvalidPlan(f"{where}: the backward of stage {stage} runs twice")
        if not self.saved_live[stage]:
            raise InvalidPlan(f"{where}: stage {stage} was not stored before its backward")
        if not self.gradient_live[stage + 1]:
            raise InvalidPlan(f"{where}: the gradient of x_{stage + 1} does not exist yet")
        self.backward_done[stage] = True
        self.sweep_start = None
        self.times_s.append(profile.backward_time_s[stage])
        option = self.options.pop(stage, None)
        if stage in self.on_host:  # nothing brought it back: this backward waits for it
            self.bring_back(stage, 0.0)
        if stage > 0 and stage - 1 in self.on_host:  # the copy back overlaps this backward
            self.bring_back(stage - 1, profile.backward_time_s[stage])
        # A frontier still open here is the output a region body recomputed last: nothing
        # consumes it, so only a holder other than the frontier keeps it.
        self.release(self.end_frontier())
        peak_during = self.live_bytes + profile.gradient_bytes[stage] + profile.backward_temp_bytes[stage]
        saved_bytes = profile.saved_bytes[stage]
        if option is not None:  # runs its forward again first (NOTE [stored under a policy])
            self.extras_s.append(option.extra_time_s[stage])
            output_bytes = 0 if option.saves_output[stage] else profile.activation_bytes[stage + 1]
            live_bytes = self.live_bytes - option.shared(stage)
            recompute_peak = live_bytes + output_bytes + saved_bytes + profile.forward_temp_bytes[stage]
            peak_during = max(recompute_peak, peak_during - option.shared(stage) + saved_bytes)
            saved_bytes = cast(int, option.saved_bytes[stage])
        self.live_bytes += profile.gradient_bytes[stage] - profile.gradient_bytes[stage + 1] - saved_bytes
        self.gradient_live[stage] = True
        self.gradient_live[stage + 1] = False
        self.saved_live[stage] = False
        self.release(self.stored_holder[stage])
        self.stored_holder[stage] = None
        for checkpoint in self.checkpoint_holders[stage]:
            self.release(checkpoint)
        self.checkpoint_holders[stage].clear()
        self.release(self.output_holder[stage + 1])
        self.output_holder[stage + 1] = None
        return peak_during, None

    def send_to_host(self, stage: int, overlapped_s: float) -> None:
        saved = self.profile.saved_bytes[stage]
        self.live_bytes -= saved
        self.host_bytes += saved
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self.on_host.add(stage)
        self.stalls_s.append(max(0.0, self.profile.transfer_time_s(stage) - overlapped_s))

    def bring_back(self, stage: int, overlapped_s: float) -> None:
        saved = self.profile.saved_bytes[stage]
        self.live_bytes += saved
        self.host_bytes -= saved
        self.on_host.discard(stage)
        self.stalls_s.append(max(0.0, self.profile.transfer_time_s(stage) - overlapped_s))

    def step(self, position: int, operation: Operation) -> int:
        """Runs one operation; returns its peak."""
        leaving, self.leaving = self.leaving, None
        peak = self._step(position, operation)
        if leaving is not None:  # its copy overlapped this operation (NOTE [offloaded stages])
            time_s = self.times_s[-1] if operation.kind is not OperationKind.LOSS else 0.0
            if self.saved_live[leaving]:
                self.send_to_host(leaving, time_s)
        return peak

    def _step(self, position: int, operation: Operation) -> int:
        where = _Where(position, operation)
        stage = operation.stage
        if operation.kind is OperationKind.LOSS:
            return self._finish(self.loss(where))
        if stage is None or not 0 <= stage < self.n_stages:
            raise InvalidPlan(f"{where}: stage must be in [0, {self.n_stages})")
        if operation.kind.is_forward:
            return self._finish(self.forward(operation.kind, stage, where, operation.option))
        return self._finish(self.backward(stage, where))

    def _finish(self, outcome: tuple[int, int | None]) -> int:
        peak_during, released = outcome
        self.release(released)
        return peak_during

    def run(self, ops: Sequence[Operation]) -> SimulationResult:
        peak = 0
        timeline: list[TimelineEntry] = []
        for position, operation in enumerate(ops):
            peak_during = self.step(position, operation)
            peak = max(peak, peak_during, self.live_bytes)
            timeline.append(TimelineEntry(operation, self.live_bytes, peak_during))
        if not self.loss_seen:
            raise InvalidPlan("the schedule has no loss marker")
        missing = [stage for stage in range(self.n_stages) if not self.backward_done[stage]]
        if missing:
            raise InvalidPlan(f"the schedule never runs the backward of stages {missing}")
        forward_times_s = self.profile.forward_time_s
        stall_s = math.fsum(self.stalls_s)
        extra_s = math.fsum(self.extras_s)
        return SimulationResult(
            peak_bytes=peak,
            time_s=math.fsum(self.times_s) + stall_s + extra_s,
            overhead_s=stall_s
            + extra_s
            + math.fsum(
                (count - 1) * forward_s for count, forward_s in zip(self.forward_counts, forward_times_s, strict=True)
            ),
            forward_counts=tuple(self.forward_counts),
            timeline=tuple(timeline),
            host_peak_bytes=self.host_peak_bytes,
            stall_s=stall_s,
        )
