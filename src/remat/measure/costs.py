"""Each planned stage's times and bytes, from the measured step's figures.

Part of the assembly (:mod:`remat.measure.assemble`): a group of stage calls planned as
one stage gets its forward and backward times, its output and saved bytes, and the
transient bytes of its forward and backward above them, as the simulator counts them
(NOTE [memory model of the simulator] in ``remat.plan.simulate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from remat.discover.chain import Chain
from remat.manual._state import snapshot_bytes
from remat.measure.instrument import StageMeasurement
from remat.memory import MemoryTracker

if TYPE_CHECKING:
    from remat.measure.assemble import TrackedStep

__all__ = ["GroupCost", "group_cost"]


class GroupCost(NamedTuple):
    name: str
    forward_time_s: float
    backward_time_s: float
    output_bytes: int
    saved_bytes: int
    saves_input: bool
    saves_output: bool
    forward_temp_bytes: int
    backward_temp_bytes: int
    cast_bytes: int


def group_cost(chain: Chain, step: TrackedStep, first: int, stop: int) -> GroupCost:
    """Times and bytes of the planned stage made of the stage calls ``[first, stop)``."""
    members = step.watch.stages[first:stop]
    frugal = step.watch.spans is not None
    input_storages = members[0].input_storages
    output_storages = members[-1].output_storages
    saved_all: dict[int, tuple[int, int]] = {}
    for member in members:
        saved_all.update(member.saved_storages)
    forward_start, forward_stop = members[0].forward_window[0], members[-1].forward_window[1]
    # Saved storages allocated before the group (side inputs such as a mask) are held by
    # the model anyway: only what the group allocates counts as its own. Autocast's casts
    # of weights are held by its cache (NOTE [autocast casts]): outside the chain.
    saved_bytes = cast_bytes = 0
    for key, (nbytes, allocated_event) in saved_all.items():
        own = forward_start <= allocated_event < forward_stop
        if own and key in step.cast_allocations:
            cast_bytes += nbytes
        elif own and key not in input_storages and key not in output_storages:
            saved_bytes += nbytes
    output_bytes = sum(output_storages.values())
    forward = step.tracker.window(forward_start, forward_stop)
    peak_bytes = _peak_holding(step.tracker, forward_start, forward_stop, input_storages)
    # frugal: the forward ran without its saved tensors kept, so its peak above the live
    # memory already bounds what the model adds on top of them.
    # A recomputed stage also holds the guard's copy of one normalisation layer's running
    # statistics (NOTE [running statistics during recompute]).
    guard_bytes = max(map(snapshot_bytes, chain.modules[first:stop]))
    forward_temp_bytes = peak_bytes - forward.before_bytes - output_bytes - (0 if frugal else saved_bytes) - cast_bytes
    return GroupCost(
        name=chain.names[first] if stop - first == 1 else f"{chain.names[first]}..{chain.names[stop - 1]}",
        forward_time_s=sum([m.forward_time_s for m in members]),
        backward_time_s=sum([m.backward_time_s for m in members]),
        output_bytes=output_bytes,
        saved_bytes=saved_bytes,
        saves_input=not input_storages.keys().isdisjoint(saved_all),
        saves_output=not output_storages.keys().isdisjoint(saved_all),
        forward_temp_bytes=max(0, forward_temp_bytes) + guard_bytes,
        backward_temp_bytes=_backward_temp_bytes(step, members, stop),
        cast_bytes=cast_bytes,
    )


# NOTE [a group's input through its forward]
# The simulator holds a stage's input through the stage's whole forward (its frontier, a
# checkpoint, or the stored stage before). A group of several stage calls may see its
# input freed halfway in the measured step: the model's code drops it once the first call
# has returned (LeViT: `hidden_state = layer(hidden_state)` drops a residual layer's
# input, and the subsampling attention after it runs its key and value projection, the
# group's glue, before the queries' subsample, the group's last call). A replay of a
# region that starts there holds the input, its checkpoint, to the end of the group's
# forward: measured with the input gone at the projection's peak, the forward's transient
# bytes left it out (LeViT at 0.36: 4 KiB, and the step went 2304 B over its prediction).
# The peak is taken as if the input lived to the end of the group's forward, as the
# simulator counts it.
def _peak_holding(tracker: MemoryTracker, start: int, stop: int, held: dict[int, int]) -> int:
    """The peak of the events ``[start, stop)`` with the allocations `held` (id -> bytes)
    alive to `stop` (see the NOTE)."""
    frees = sorted(
        (freed, held[key])
        for key, (_, freed) in tracker.allocation_freed_events(held).items()
        if freed is not None and start <= freed < stop
    )
    if not frees:
        return tracker.window(start, stop).peak_bytes
    peak = tracker.window(start, frees[0][0]).peak_bytes
    kept = 0
    for index, (freed, nbytes) in enumerate(frees):
        kept += nbytes
        until = frees[index + 1][0] if index + 1 < len(frees) else stop
        # (from the event after the free: the window's own start is the live bytes after it)
        peak = max(peak, tracker.window(freed + 1, until).peak_bytes + kept)
    return peak


def _backward_temp_bytes(step: TrackedStep, members: list[StageMeasurement], stop: int) -> int:
    """Transient bytes of a group's backward, on top of what is live and its input's gradient."""
    windows = [m.backward_window for m in members]
    last_window, first_window = windows[-1], windows[0]
    if last_window is None or first_window is None:
        return 0
    start_event, stop_event = last_window[0], first_window[1]
    # Frugal mode: from the end of the recompute that precedes it, when the group ends a
    # span: the saved tensors are back then, as they are kept in a plain step.
    span_start = step.watch.span_start_of_last_stage.get(stop - 1)
    if span_start is not None and span_start in step.watch.recompute_end_event:
        start_event = max(start_event, step.watch.recompute_end_event[span_start])
    backward = step.tracker.window(start_event, stop_event)
    return max(0, backward.peak_bytes - backward.before_bytes - members[0].gradient_bytes_in)
