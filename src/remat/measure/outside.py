"""What a measured step holds outside the chain's stages, and when.

Part of the assembly (:mod:`remat.measure.assemble`): the prefix's activations, outputs
that escape to the model's code and side effects, what backwards leave behind, autocast's
casts, what the glue keeps for its replays, and what a stage saves that an earlier stage
made.
"""

from __future__ import annotations

import bisect
import warnings
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, NamedTuple

from remat.discover.chain import Chain
from remat.measure.costs import backward_as_plain
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.measure.assemble import TrackedStep

__all__ = [
    "TakenAgain",
    "backward_freeing",
    "cached_casts",
    "constants_taken_again",
    "glue_constants",
    "held_outside_chain",
    "recomputed",
    "sum_except",
    "waiting_gradients",
]


def recomputed(step: TrackedStep, allocations: dict[int, int]) -> set[int]:
    """Frugal mode: which of `allocations` a span's recompute made.

    A span's recompute brings back the saved tensors of all its stages at once; they
    outlive the first stage's backward, but are not left over.
    """
    windows = step.watch.recompute_windows
    if not windows:
        return set()
    records = step.tracker.allocation_records(allocations)
    return {
        key for key, record in records.items() if any(start <= record.allocated_event < stop for start, stop in windows)
    }


# NOTE [gradients waiting for a replay]
# The glue after a stage may make tensors that later code takes (an attention's query and
# key projections, made after its layer norm and taken by the attention after the value
# projection). Their gradients come in the later backward and wait for the glue's own
# backward, which runs when the whole gradient of the stage's output is not there yet.
# Stored, that glue backward runs at once. Recomputed in a region that ends with that
# stage, the glue's backward needs what the region saved: the region's replay runs first,
# with those gradients still alive, where the simulator counts the gradient of the
# region's output only. The plain step shows how much waits: from the first use by
# backward of what the stages up to that one (or their glue) saved, to the moment the
# gradient of its output is whole: what is live at the first above what is live then, or
# the most that is live in between above it, less the gradient the stage's own backward
# is planned to make (the glue's backward runs after the replay, within that room). Only
# what the backward made counts: a stage that makes a tensor it also takes (T5's first
# block and its position bias) has that tensor's gradient whole only within its own
# backward, whose freed activations are the simulator's, not waiting gradients. The
# prediction adds it to the replay after that boundary's backward
# (remat.plan.lifetimes). In frugal mode the first uses are told by the spans' regions
# (NOTE [first uses in a frugal step]). What waits
# for the region's own backward is counted too (NOTE [gradients a region's own backward
# takes]); each boundary gets the larger of the two.
def waiting_gradients(step: TrackedStep, groups: list[tuple[int, int]]) -> tuple[int, ...]:
    """Per planned boundary (``n + 1``), what waits for the replay of a region ending there."""
    watch, tracker = step.watch, step.tracker
    stages = watch.stages
    starts = [stage.forward_window[0] for stage in stages]
    chain_start, chain_stop = starts[0], stages[-1].forward_window[1]
    first_use: list[int | None] = [None] * len(stages)
    for index, used_at in watch.first_use_event.items():  # NOTE [first uses in a frugal step]
        first_use[index] = used_at
    for saved_at, used_at in tracker.first_unpacks().items():
        if chain_start <= saved_at < chain_stop:
            index = bisect.bisect_right(starts, saved_at) - 1
            known = first_use[index]
            first_use[index] = used_at if known is None else min(known, used_at)
    out = [0] * (len(groups) + 1)
    earliest: int | None = None
    left_over: set[int] | None = None
    group_starts = {first: group for group, (first, _) in enumerate(groups)}
    for index in range(len(stages) - 1):
        used = first_use[index]
        if used is not None:
            earliest = used if earliest is None else min(earliest, used)
        group = group_starts.get(index + 1)
        # (what a stage hands on from its inputs as it is, a position bias every block takes,
        # is whole only later: its own backward, and the replay before it, start earlier)
        whole = watch.own_ready_event.get(index, watch.grad_ready_event.get(index))
        if group is None or whole is None:
            continue
        start = earliest
        if start is not None and start < whole:
            # gradients, made by the backward: the activations its stages saved, freed by
            # the backward in that window (a maker of a position bias whose gradient is
            # whole only within its own backward), are the simulator's
            window = backward_as_plain(step, start, whole, since=step.loss_event)
            # the glue's own backward runs after the replay; the backward of the region's
            # last stage, planned next, leaves room for its input's gradient
            room = stages[groups[group - 1][0]].gradient_bytes_in
            waiting = window.before_bytes - window.after_bytes
            out[group] = max(0, waiting, window.peak_bytes - window.after_bytes - room)
        if group is not None:
            if left_over is None:
                left_over = _left_over(step)
            waiting = _waiting_for_own_backward(step, groups[group - 1], first_use, left_over)
            out[group] = max(out[group], waiting)
    return tuple(out)


# NOTE [first uses in a frugal step]
# A frugal step (NOTE [frugal measurement]) keeps nothing a stage saves: the first time its
# backward takes a tensor of a span, the span is replayed, and the backward takes that
# tensor from the replay. Each span's observer is told of every such use and notes, per
# stage, the event of its first use, after the replay: the moment a plain step's backward
# first takes what the stage saved, with the same tensors alive. The waiting gradients are
# then read as in a plain step, with the replays inside the window read as NOTE [replays
# inside a frugal backward] (in remat.measure.costs) says.
def _left_over(step: TrackedStep) -> set[int]:
    """What a stage's backward made that outlives it, and the gradients of the stages'
    inputs other than their own backward's: held outside the chain (held_outside_chain)."""
    watch, tracker = step.watch, step.tracker
    windows = [stage.backward_window for stage in watch.stages if stage.backward_window is not None]
    return set(watch.gradient_allocations).union(*(tracker.surviving_allocations(*window) for window in windows))


# NOTE [gradients a region's own backward takes]
# A stage may hand what it makes to later code besides its output (LeViT's subsampling
# attention: the stage that ends with the queries' subsample also computes the keys and
# values, which the attention after the query projection takes). The gradients of those
# come in the later backward and wait for the stage's own backward, as do the gradients
# its own backward makes before it needs anything the stage saved (the subsample's
# slicing saves nothing). Recomputed, that stage's backward starts with the replay of its
# region, and they are alive through it, where the simulator counts the gradient of the
# region's output only. The plain step shows them: what the backward made that is alive
# when the first of the region's saved tensors is used, and freed by the region's
# backward, beyond that gradient.
def _waiting_for_own_backward(
    step: TrackedStep, group: tuple[int, int], first_use: list[int | None], left_over: set[int]
) -> int:
    """What waits for the replay of a region ending with `group`, besides its output's
    gradient (see the NOTE)."""
    watch, tracker = step.watch, step.tracker
    first, stop = group
    uses = [used for used in first_use[first:stop] if used is not None]
    ended = watch.stages[first].backward_window
    if not uses or ended is None or step.loss_event is None:
        return 0
    used = min(uses)
    made = tracker.surviving_allocations(step.loss_event, used)  # (parameter gradients left out)
    freed = tracker.allocation_freed_events(made)
    # the gradient of the region's output (all its parts: a bias handed on) is the
    # simulator's: taken off below, as it plans it
    left_over = left_over - watch.input_gradient_allocations.get(stop, set())
    alive = {
        key: made[key] for key, (_, at) in freed.items() if at is not None and at <= ended[1] and key not in left_over
    }
    return max(0, sum_except(alive, recomputed(step, alive)) - watch.stages[stop].gradient_bytes_in)


def held_outside_chain(
    chain: Chain, step: TrackedStep, groups: list[tuple[int, int]]
) -> tuple[int, list[int], list[tuple[int, int]]]:
    """The prefix's live bytes, escaped outputs and side effects, and backward leftovers
    (all of it, the leftovers of each stage's backward, and which of them a later stage's
    backward frees: ``(stage, bytes)``), for the stages planned as `groups`."""
    stages, tracker = step.watch.stages, step.tracker
    fixed_bytes = tracker.window(stages[0].forward_window[0]).before_bytes
    fixed_bytes += escaped_bytes(chain, step)
    # NOTE [autocast casts]
    # Under autocast, the cast of a weight (a leaf) is cached until the autocast region
    # ends, and every use in the region shares it: that is how plain autograd builds the
    # graph, so a recomputed block keeps the cache as it is (exact gradients). A stage's
    # casts therefore outlive its discarded forward, up to the end of the region; stored,
    # they live until its backward; recomputed, they are made again. The planner counts
    # every stage's casts as held through the whole step: an upper bound at every moment
    # (each stage has at most one copy of its casts alive at a time), exact at the end of
    # the forward. The prediction follows their lifetimes (remat.plan.lifetimes).
    casts = {
        key: nbytes
        for stage in stages
        for key, (nbytes, _) in stage.saved_storages.items()
        if key in step.cast_allocations
    }
    fixed_bytes += sum(casts.values())
    # What a stage's backward leaves behind besides its input's gradient (the partial
    # gradient of a weight used twice, waiting for the other use) lives on after it.
    # A later backward may free it (the gradient a shortcut convolution run as glue gives
    # the block's input, summed with the block's own at its first stage's backward).
    windows = [stage.backward_window for stage in stages]
    freed_by: list[tuple[int, int]] = []  # (stage whose backward frees it, bytes)

    def taken_by(freed: int | None, nbytes: int) -> None:
        taker = backward_freeing(windows, freed)
        if taker is not None:
            freed_by.append((taker, nbytes))

    leftovers = [0] * len(stages)
    for index, stage in enumerate(stages):
        if stage.backward_window is not None:
            surviving = tracker.surviving_allocations(*stage.backward_window)
            excluded = step.watch.gradient_allocations | recomputed(step, surviving)
            leftover = {key: nbytes for key, nbytes in surviving.items() if key not in excluded}
            leftovers[index] = sum(leftover.values())
            for key, (_, freed) in tracker.allocation_freed_events(leftover).items():
                taken_by(freed, leftover[key])
    # A gradient a stage's backward received that outlives it: a U-Net's up block passes
    # its skip's gradient back as a view of its input's gradient, which then lives until
    # the down block's backward takes it. It is left over from that stage's backward on.
    gradients = tracker.allocation_freed_events(step.watch.gradient_allocations)
    records = tracker.allocation_records(gradients)
    # NOTE [gradients passed through inside a group]
    # A stage's own input gradient is its planned input gradient, not a leftover, when the
    # stage starts its planned group or dies within the group's backward. A stage inside a
    # group that passes its output's gradient through as its input's (a dropout with p=0, an
    # identity, a view: no new tensor) hands on a gradient that an earlier stage made, which
    # may outlive the group: in `x = x + block(x)` the residual stream's gradient waits,
    # after the block's last stages, for the block's first stage to return the other part of
    # it. It is left over from that stage's backward on (without this, a residual loop with
    # dropouts at p=0 went over its budget by a block's output).
    first_of = [first for first, stop in groups for _ in range(first, stop)]
    for index, window in enumerate(windows):
        if window is None:
            continue
        after = windows[index + 1] if index + 1 < len(windows) else None
        received_from = after[0] if after is not None else 0
        own = step.watch.input_gradient_allocations.get(index, set())
        first_window = windows[first_of[index]]
        group_end = first_window[1] if first_window is not None else window[1]
        for key, (allocated, freed) in gradients.items():
            if not (received_from <= allocated < window[0] and (freed is None or freed > window[1])):
                continue
            passed_on = index > first_of[index] and (freed is None or freed > group_end)
            if key not in own or passed_on:
                leftovers[index] += records[key].nbytes
                taken_by(freed, records[key].nbytes)
    return fixed_bytes + sum(leftovers), leftovers, freed_by


# NOTE [glue constants]
# The glue after a recomputed stage keeps what it takes as it is (a residual stream that a
# nested chain adds back after its block's inner stages, a shortcut's input) for its
# replays, from the stage's first forward until the chain's backward is done. Planning
# counts it as held through the whole step (in fixed_bytes: the safe side); the
# prediction counts it from the first forward of the first stage that keeps it and is not
# stored (remat.plan.lifetimes), so a plan that stores those stages is not charged. What
# the model itself holds through the backward (an escaped output) stays fixed. (A replay
# frees the stage's inputs its glue does not take before running the glue, as the first
# forward did: remat.discover.glue.Glue.replay.)
def glue_constants(
    step: TrackedStep, groups: list[tuple[int, int]], group_of: list[int], taken_again: frozenset[int] = frozenset()
) -> tuple[tuple[int, tuple[int, ...], int, bool], ...]:
    """Per glue constant the model does not hold by itself: its bytes, the groups keeping
    it, the group whose input it is (-1: none), and False; then, per tensor made earlier in
    the chain that a group saves for its backward (NOTE [earlier activations saved]), the
    same with True. The constants in `taken_again` are left out (NOTE [constants an
    earlier stage takes] in remat.discover.glue)."""
    stages = step.watch.stages
    held = _held_by_model(step)
    inputs = {key: group for group, (first, _) in enumerate(groups) for key in stages[first].input_storages}
    keepers: dict[int, tuple[int, set[int]]] = {}
    for index, stage in enumerate(stages):
        for key, nbytes in stage.kept_constants.items():
            if key not in held and key not in taken_again:
                keepers.setdefault(key, (nbytes, set()))[1].add(group_of[index])
    out = [(nbytes, tuple(sorted(k)), inputs.get(key, -1), False) for key, (nbytes, k) in keepers.items()]
    savers = earlier_activations_saved(step, groups, held)
    out += [(nbytes, tuple(sorted(k)), inputs.get(key, -1), True) for key, (nbytes, k) in savers.items()]
    return tuple(out)


def _held_by_model(step: TrackedStep) -> set[int]:
    """What the stages made that escapes to the model's code and is alive when the forward returns."""
    return {key for stage in step.watch.stages for key in stage.escaped_storages if key in step.alive_after_forward}


class TakenAgain(NamedTuple):
    """A glue constant a plan may take from a replay instead of keeping it."""

    nbytes: int
    #: ``(stage, glue's stage)`` stage calls: the glue after the second takes the input of
    #: the first, or what the first's glue made
    pairs: frozenset[tuple[int, int]]
    #: the glue saves it for its backward too: a replay that stores the glue's stage holds
    #: it until that stage's backward
    saved: bool = False
    #: what the earlier stage's glue made, not its input
    made: bool = False


def constants_taken_again(
    step: TrackedStep, groups: list[tuple[int, int]], group_of: list[int]
) -> dict[int, TakenAgain]:
    """The glue constants that a plan may take from the replay of the earlier stage whose
    input they are, or whose glue made them, instead of keeping them (NOTE [constants an
    earlier stage takes] in remat.discover.glue), by allocation id. Only those counted as kept for the glue alone:
    not held by the model, taken from an earlier stage by every glue that keeps them, and
    saved for a backward by none but the groups of those glues (a residual block's shortcut
    convolution, run as glue, saves the block's input it keeps)."""
    stages = step.watch.stages
    held = _held_by_model(step)
    saved = earlier_activations_saved(step, groups, held)
    out: dict[int, tuple[int, set[tuple[int, int]]]] = {}
    refused: set[int] = set(held)
    made: set[int] = set()
    for index, stage in enumerate(stages):
        for key, nbytes in stage.kept_constants.items():
            earlier = stage.earlier_inputs.get(key)
            if earlier is None:
                refused.add(key)
            else:
                out.setdefault(key, (nbytes, set()))[1].add((earlier, index))
                made |= {key} & stage.earlier_made
    for key, (_, savers) in saved.items():
        keepers = {group_of[k] for _, k in out.get(key, (0, set()))[1]}
        if not savers <= keepers:
            refused.add(key)
    kept = ((key, nbytes, pairs) for key, (nbytes, pairs) in out.items() if key not in refused)
    return {key: TakenAgain(nbytes, frozenset(pairs), key in saved, key in made) for key, nbytes, pairs in kept}


# NOTE [earlier activations saved]
# A stage (or its glue) may save for its backward a tensor made earlier in the chain that
# is not its input: a residual block split into its submodules whose shortcut convolution
# runs as glue after the block's last stage and saves the block's input. The model does not
# hold it on its own: stored, the stage keeps it until its backward, whatever the schedule
# does with the stage that made it. Its bytes are held outside the chain, and the
# prediction counts them from that stage's first forward, stored, to its backward
# (remat.plan.lifetimes; recomputed, the glue keeps it for its replays: a glue constant).
def earlier_activations_saved(
    step: TrackedStep, groups: list[tuple[int, int]], held: set[int]
) -> dict[int, tuple[int, set[int]]]:
    """Per tensor made in the chain before a group and saved by it (not its input): its
    bytes and the groups saving it."""
    stages = step.watch.stages
    chain_start = stages[0].forward_window[0]
    savers: dict[int, tuple[int, set[int]]] = {}
    for group, (first, stop) in enumerate(groups):
        start = stages[first].forward_window[0]
        for member in stages[first:stop]:
            for key, (nbytes, allocated_event) in member.saved_storages.items():
                made_before = chain_start <= allocated_event < start
                if made_before and key not in stages[first].input_storages and key not in held:
                    if key not in step.cast_allocations:
                        savers.setdefault(key, (nbytes, set()))[1].add(group)
    return savers


def cached_casts(step: TrackedStep, groups: list[tuple[int, int]]) -> list[int]:
    """Per group, autocast's casts that it made and no stage saved (a bias's, a weight's
    whose input needs no gradient) and that outlived its forward: the cache holds them
    until the autocast region ends (NOTE [autocast casts]), which may come before the
    model's forward returns (a region inside it); they are counted to the forward's end."""
    stages = step.watch.stages
    saved = {key for stage in stages for key in stage.saved_storages}
    casts = step.cast_allocations - saved
    records = step.tracker.allocation_records(casts)
    freed = step.tracker.allocation_freed_events(casts)
    cached = [0] * len(groups)
    for key, record in records.items():
        for index, (first, stop) in enumerate(groups):
            start, end = stages[first].forward_window[0], stages[stop - 1].forward_window[1]
            if start <= record.allocated_event < end:
                freed_at = freed[key][1]
                cached[index] += record.nbytes if freed_at is None or freed_at >= end else 0
                break
    return cached


def escaped_bytes(chain: Chain, step: TrackedStep) -> int:
    """Bytes allocated by the stages that the model holds through the backward on its own."""
    stages, alive = step.watch.stages, step.alive_after_forward
    # Outputs that escape to the model's code (a key/value cache, attention weights) and
    # are still alive when the forward returns are held through the backward too, unless
    # only their own stage's saving keeps them (NOTE [outputs their own stage saves]).
    own = _saved_by_own_stage(step)
    escaped = {k: v for stage in stages for k, v in stage.escaped_storages.items() if k in alive and k not in own}
    # What the executor keeps for the replay of a stage's glue, as it is: made since the
    # chain began (a U-Net's skip, an encoder's output that every decoder block takes), it
    # is held until the backward ends when that stage is recomputed (NOTE [glue between
    # stages] in remat.execute); counted for every stage, the safe side.
    for stage in stages:
        escaped.update(stage.kept_constants)
    # Likewise for what a stage allocates and something else than autograd keeps (a
    # cache object filled in place): alive after the forward, neither saved for
    # backward nor passed on to the next stage.
    # Autocast's cache holds casts that no stage saved (a bias's, a weight's whose input
    # needs no gradient) until its region ends: planned apart (_cached_casts).
    accounted = set(escaped) | step.cast_allocations
    for stage in stages:
        accounted.update(stage.saved_storages)
        accounted.update(stage.output_storages)
    side_effects: dict[str, int] = {}
    for key, record in alive.items():
        if key in accounted:
            continue
        for stage in stages:
            start, stop = stage.forward_window
            if start <= record.allocated_event < stop:
                escaped[key] = record.nbytes
                # module state is replayed, and the model's output is what the forward is
                # for (a mixture of experts' router logits, returned for its loss): no side
                # effect
                if key not in step.state_allocations and key not in step.output_allocations:
                    side_effects[stage.name] = side_effects.get(stage.name, 0) + record.nbytes
                break
    if side_effects:
        warn_side_effects(side_effects)
    return sum(escaped.values())


# NOTE [outputs their own stage saves]
# In `x = x + block(x)` the block's last stage returns t, the model's code adds it to x,
# and the next stage takes the sum: t escapes to the model's code. It is still alive when
# the forward returns only because that stage saved it for its backward (a tanh keeps its
# output), which the stage's saved bytes count already: held through the step as an
# escaped output too, it was counted twice (8 KiB over every prediction of a 4-block
# residual model with a head, whatever the budget). Such an output is not held outside
# the chain when nothing else keeps it: one stage saves it, it is not the model's output,
# module state, an autocast cast or a tensor the glue keeps, and the step freed it by the
# end of that stage's backward.
def _saved_by_own_stage(step: TrackedStep) -> set[int]:
    """The escaped outputs that only their own stage's saving keeps alive (see the NOTE)."""
    stages, alive = step.watch.stages, step.alive_after_forward
    savers = Counter(key for stage in stages for key in stage.saved_storages)
    kept = set(step.output_allocations) | step.state_allocations | step.cast_allocations
    for stage in stages:
        kept |= set(stage.kept_constants) | stage.glue_constants
    own: set[int] = set()
    for stage in stages:
        window = stage.backward_window
        keys = [
            key
            for key in stage.escaped_storages
            if key in stage.saved_storages and savers[key] == 1 and key in alive and key not in kept
        ]
        if window is None or not keys:
            continue
        for key, (_, freed_at) in step.tracker.allocation_freed_events(keys).items():
            if freed_at is not None and freed_at <= window[1]:
                own.add(key)
    return own


def backward_freeing(windows: Sequence[tuple[int, int] | None], freed: int | None, first: int = 0) -> int | None:
    """The stage (from `first` on) whose backward window (`windows`, one per stage) holds
    the event `freed`, if any."""
    if freed is None:
        return None
    return next((k for k in range(first, len(windows)) if (w := windows[k]) and w[0] <= freed < w[1]), None)


def sum_except(allocations: dict[int, int], excluded: AbstractSet[int]) -> int:
    """The bytes of `allocations` other than the `excluded` ones."""
    return sum(nbytes for key, nbytes in allocations.items() if key not in excluded)


def warn_side_effects(side_effects: dict[str, int]) -> None:
    stages = ", ".join(f"{name!r} ({format_bytes(nbytes)})" for name, nbytes in side_effects.items())
    warnings.warn(
        f"stages {stages} allocate memory that outlives the forward without being their output "
        "or saved for backward: state filled in place, such as a key/value cache. remat counts "
        "it as fixed memory, but recomputing these stages repeats the side effect (a cache grows, "
        "or the recompute computes something else). For Hugging Face models, build them with "
        "use_cache=False (or pass use_cache=False) for training",
        RuntimeWarning,
        stacklevel=7,
    )
