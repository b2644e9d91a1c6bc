"""Each planned stage's times and bytes, from the measured step's figures.

Part of the assembly (:mod:`remat.measure.assemble`): a group of stage calls planned as
one stage gets its forward and backward times, its output and saved bytes, and the
transient bytes of its forward and backward above them, as the simulator counts them
(NOTE [memory model of the simulator] in ``remat.plan.simulate``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, NamedTuple

from remat.discover.chain import Chain
from remat.manual._state import snapshot_bytes
from remat.measure.instrument import StageMeasurement, StageWatch
from remat.memory import MemoryTracker, Window

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
    forward = as_kept(step, forward_start, forward_stop, input_storages)
    peak_bytes = forward.peak_bytes
    # A recomputed stage also holds the guard's copy of one normalisation layer's running
    # statistics (NOTE [running statistics during recompute]).
    guard_bytes = max(map(snapshot_bytes, chain.modules[first:stop]))
    forward_temp_bytes = peak_bytes - forward.before_bytes - output_bytes - saved_bytes - cast_bytes
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


# NOTE [a frugal step's forward as a plain one]
# The frugal mode (NOTE [frugal measurement]) runs the forward with every stage in a
# recompute region. Two things live differently from a plain step, and every figure taken
# from the forward and the suffix (up to the first backward of a stage) is read as a plain
# step would show it:
# * what a stage saves for its backward is not kept: it dies as soon as the model's code
#   lets go of it, where a plain step holds it until the stage's backward. Each such
#   tensor is counted as alive from its death to that point;
# * each span's region keeps its input until the span's backward, where a plain step
#   frees it when the model's code lets go of it (unless a stage saved it). The watch
#   notes that moment (the tensor the model held dies; the region holds another on the
#   same memory), and the input is counted as dead from then on.
# The event stream is otherwise the same but for the regions' copies of the buffers of the
# modules they record (NOTE [running statistics during recompute]), counted on the safe
# side, so the transient bytes of a stage's forward and the suffix's peak are those of a
# plain step (byte for byte in tests/test_frugal.py). (Before this, the forward's transient
# was bounded by its whole peak without the saved tensors, on top of them: on a GPT-2
# block 18 MiB where the plain step shows 2 MiB, and a smallest budget 23% too high.)
# In nested plans, the constants the executor keeps for the glue's replays are alive when
# the forward returns, and are counted as held by the model through the step, on the safe
# side (tests/test_frugal.py's small GPT-2, nested: its least budget 48% above a plain
# measurement's).
def as_kept(step: TrackedStep, start: int, stop: int, held: dict[int, int] | None = None) -> Window:
    """The tracker's window ``[start, stop)`` with the allocations `held` (id -> bytes) alive
    to `stop` (NOTE [a group's input through its forward]), and in the frugal mode as a
    plain step would show it (see the NOTE above)."""
    tracker = step.tracker
    held = dict(held or {})
    changes: list[tuple[int, int]] = []  # (event, bytes added to the live bytes from that event on)
    if step.watch.spans is not None:
        for key, entries in _as_plain(step).items():
            if key not in held:
                changes += entries
    for key, (_, freed) in tracker.allocation_freed_events(held).items():
        if freed is not None and start <= freed < stop:
            changes.append((freed + 1, held[key]))
    return _adjusted_window(tracker, start, stop, changes)


_AS_PLAIN: weakref.WeakKeyDictionary[StageWatch, dict[int, list[tuple[int, int]]]] = weakref.WeakKeyDictionary()


def _as_plain(step: TrackedStep) -> dict[int, list[tuple[int, int]]]:
    """A frugal step's changes to the live bytes, per allocation, that make its forward and
    suffix those of a plain step (NOTE [a frugal step's forward as a plain one]); worked out
    once per step."""
    watch, tracker = step.watch, step.tracker
    found = _AS_PLAIN.get(watch)
    if found is not None:
        return found
    found = {}
    saved = {key: nbytes for stage in watch.stages for key, (nbytes, _) in stage.saved_storages.items()}
    ends = watch.stages[-1].backward_window
    until = ends[0] if ends is not None else tracker.n_events
    for key, (_, freed) in tracker.allocation_freed_events(saved).items():
        if freed is not None and freed < until:
            found[key] = [(freed + 1, saved[key])]
    let_go = {key: at for key, at in watch.let_go_event.items() if key not in saved}
    records = tracker.allocation_records(let_go)
    for key, (_, freed) in tracker.allocation_freed_events(let_go).items():
        if freed is None or let_go[key] <= freed:
            found[key] = [(let_go[key], -records[key].nbytes)]
            if freed is not None:
                found[key].append((freed + 1, records[key].nbytes))
    _AS_PLAIN[watch] = found
    return found


# NOTE [replays inside a frugal backward]
# A window of a frugal step's backward (a stage's backward, the wait for a gradient) may
# see the replay of a span: the backward reached what the span saved (its own stage's, or
# an earlier span's). A plain step held those tensors from its forward on and runs no
# replay. So each saved tensor a replay makes, that the regions then give back to backward,
# is counted as alive from the window's start to the event that made it; what else the
# replay made and left alive (an output recomputed on the way) is counted as gone when the
# replay ends; and the replay's own events are left out of the window's peak (its
# temporaries, which a plain step never makes). What the backward made before the replay (the gradients it came with)
# counts as in a plain step.
#
# NOTE [a frugal stage's backward]
# A group that ends its span is replayed when its backward starts: its transient is read
# from the end of the replay, when its saved tensors are back as a plain step holds them,
# with what its backward made before the replay and still holds then (the gradients it
# came with) counted as its own, as a plain step's window counts them. Without that, CLIP's
# second layer was 8 KiB under its plain figure, and its plans at the smallest budget 2.5%
# over it. (Read from the window's start instead, the replay gives back at once tensors
# that a plain step's glue backward let go of before the stage's own window: the ResNet's
# least budget came out a third above its plain figure.)
def backward_as_plain(step: TrackedStep, start: int, stop: int, since: int | None = None) -> Window:
    """The tracker's window ``[start, stop)`` of the backward, as a plain step would show it
    (see the NOTE; `since` as for :meth:`~remat.memory.MemoryTracker.window`)."""
    tracker = step.tracker
    inside = sorted((first, min(last, stop)) for first, last in step.watch.recompute_windows if start <= first < stop)
    if not inside:
        return tracker.window(start, stop, since=since)
    changes: list[tuple[int, int]] = []
    records = tracker.allocation_records(tracker.allocations_since(inside[0][0]))
    freed = tracker.allocation_freed_events(records)
    for key, record in records.items():
        made, gone, nbytes = record.allocated_event, freed[key][1], record.nbytes
        replay = next(((first, last) for first, last in inside if first <= made < last), None)
        if replay is None:
            continue
        if key in step.watch.given_back:  # a saved tensor: alive from the start in a plain step
            changes += [(start, nbytes), (made, -nbytes)]
        elif gone is None or gone >= replay[1]:  # made by the replay alone, and outliving it
            changes += [(replay[1], -nbytes)] + ([(gone + 1, nbytes)] if gone is not None else [])
    pieces, at = [], start
    for first, last in inside:
        if at < first:
            pieces.append((at, first))
        at = max(at, last)
    if at < stop:
        pieces.append((at, stop))
    whole = _adjusted_window(tracker, start, stop, changes, since)
    peaks = [_adjusted_window(tracker, first, last, changes, since).peak_bytes for first, last in pieces]
    return Window(whole.before_bytes, max([whole.before_bytes, *peaks]), whole.after_bytes)


def _adjusted_window(
    tracker: MemoryTracker, start: int, stop: int, changes: list[tuple[int, int]], since: int | None = None
) -> Window:
    """The window ``[start, stop)`` with each ``(event, nbytes)`` of `changes` adding `nbytes`
    to the live bytes from that event on (the live bytes before it included)."""
    window = tracker.window(start, stop, since=since)
    before = sum(nbytes for event, nbytes in changes if event <= start)
    after = sum(nbytes for event, nbytes in changes if event <= stop)
    points = sorted({event for event, _ in changes if start < event < stop})
    if not points:
        return Window(window.before_bytes + before, window.peak_bytes + before, window.after_bytes + after)
    deltas: dict[int, int] = {}
    for event, nbytes in changes:
        if start < event < stop:
            deltas[event] = deltas.get(event, 0) + nbytes
    peak, added, segment = 0, before, start
    for point in [*points, stop]:
        peak = max(peak, tracker.window(segment, point, since=since).peak_bytes + added)
        added += deltas.get(point, 0)
        segment = point
    return Window(window.before_bytes + before, peak, window.after_bytes + after)


def _backward_temp_bytes(step: TrackedStep, members: list[StageMeasurement], stop: int) -> int:
    """Transient bytes of a group's backward, on top of what is live and its input's gradient."""
    windows = [m.backward_window for m in members]
    last_window, first_window = windows[-1], windows[0]
    if last_window is None or first_window is None:
        return 0
    start_event, stop_event = last_window[0], first_window[1]
    tracker, watch = step.tracker, step.watch
    # Frugal mode, a group that ends its span: from the end of the span's replay, when its
    # saved tensors are back, with what the backward made before the replay and still holds
    # then counted as the window's own (NOTE [a frugal stage's backward])
    span_start = watch.span_start_of_last_stage.get(stop - 1)
    replayed = watch.recompute_end_event.get(span_start) if span_start is not None else None
    early = 0
    if replayed is not None and start_event < replayed < stop_event:
        began = min((first for first, last in watch.recompute_windows if last == replayed), default=replayed)
        made = tracker.surviving_allocations(start_event, began)
        for key, (_, gone) in tracker.allocation_freed_events(made).items():
            if gone is None or gone >= replayed:
                early += made[key]
        start_event = replayed
    backward = backward_as_plain(step, start_event, stop_event)
    return max(0, backward.peak_bytes - backward.before_bytes + early - members[0].gradient_bytes_in)
