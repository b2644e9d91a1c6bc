"""From the figures of the measured steps to the grouped chain profile the planner uses.

The assembly runs in named steps:

1. :func:`_take_backward_windows_and_times`: each stage's backward is the window from the
   moment its output's gradient is complete to the moment its input's gradient is;
2. :func:`group_stages`: stages that cannot start a recompute region, or that keep
   nothing to recompute, ride with the stage before;
3. :func:`~remat.measure.outside.held_outside_chain`: the prefix's activations, outputs that escape to
   the model's code, side effects, and what backwards leave behind;
4. :func:`_suffix`: what runs after the chain (a head, the loss), charged to the chain
   output's gradient, and what it keeps through the chain's backward;
5. :func:`~remat.measure.costs.group_cost`: each group's times and bytes;
6. the :class:`~remat.plan.profile.ChainProfile`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from remat.discover.chain import Chain
from remat.measure.costs import as_kept, group_cost
from remat.measure.groups import group_stages, region_limits
from remat.measure.instrument import StageMeasurement, StageWatch, work_between, work_mark
from remat.measure.outside import (
    TakenAgain,
    backward_freeing,
    cached_casts,
    constants_taken_again,
    glue_constants,
    held_outside_chain,
    recomputed,
    sum_except,
    waiting_gradients,
)
from remat.memory import AllocationRecord, MemoryTracker
from remat.plan.lifetimes import GlueConstant, HeldInput, ReplayHold
from remat.plan.profile import ChainProfile
from remat.plan.step import BudgetSplit

__all__ = ["ChainMeasurement", "TrackedStep", "assemble", "with_times"]


@dataclass
class ChainMeasurement:
    """Everything measured on a chain, and the grouped profile the planner uses.

    Attributes:
        stages: per stage call figures.
        groups: (first, stop) stage indices of each planned stage.
        profile: the grouped :class:`~remat.plan.profile.ChainProfile`.
        fixed_bytes: bytes held through the whole step outside the chain (the prefix's
            activations and the chain input when the model computes it).
        measured_peak_bytes: peak of the measured step (every activation stored).
        end_peak_bytes: peak after the chain's backward (the prefix's backward). remat's
            planning does not use it; it is kept, with a default, for callers that read
            it or build a measurement by hand.
        output_bytes: bytes of the model's output (what a training loop that keeps the
            output through the backward holds on top).
        suffix_peak_bytes: the peak of what runs after the chain (a head, the loss, their
            backward up to the chain output's gradient) above what was live when it began.
        suffix_kept_bytes: what the suffix still holds then (counted in ``fixed_bytes``).
        cast_bytes: per planned stage, autocast's casts of weights that it made and keeps
            for its backward (counted in ``fixed_bytes``; NOTE [autocast casts]).
        leftover_bytes: per planned stage, what its backward leaves alive besides its
            input's gradient, from then on (counted in ``fixed_bytes``): the partial
            gradient of a weight also used before it, waiting for the other use, or a
            gradient it received that outlives it (a U-Net's skip gradient).
        leftover_freed: ``(planned stage, bytes)``: of those leftovers and of what the
            suffix keeps, what that later stage's backward frees.
        suffix_transient_bytes: what the chain output's gradient in the profile charges
            for the suffix's own peak (a head's logits and their gradient) beyond the
            gradient itself: it lives during the loss only.
        cached_cast_bytes: per planned stage, autocast's casts that it made and that no
            stage keeps for its backward, held by autocast's cache until its region ends
            (counted in ``fixed_bytes``).
        glue_constants: what the executor keeps for the replay of a stage's glue that
            the model does not hold on its own (NOTE [glue constants] in ``remat.measure.outside``): ``(bytes, planned
            stages whose glue takes it, the planned stage whose input it is or -1, False)``,
            and what a stored stage saves that was made earlier in the chain (the same,
            True; NOTE [earlier activations saved]), counted in ``fixed_bytes``.
        suffix_backward_excess_bytes: how much the chain output's gradient in the
            profile exceeds the peak of the suffix's forward part (until the loss is
            computed; autocast's region ends there in a training loop).
        loss_from_output: measured without a ``loss_fn``, the loss was the one the
            model's output carries (a Hugging Face ``ModelOutput`` with ``labels``).
        input_held_until: per stage call, the last stage call whose forward runs while
            the model's own code still holds the stage's input (NOTE [inputs the model
            holds] in ``remat.measure.timing``), the number of stage calls when it holds it
            into the code after the chain; empty when not measured.
        held_outputs: what a stage call (with the model's code after it) makes that the
            model holds beyond the next stage call without passing it on (a U-Net's
            skip): ``(stage call, last stage call it is held through, bytes, whether
            the stage saves it too)``; empty when not measured or when there is none.
        option_extra_s: per stage call, the seconds each policy of ``policy=`` (by name)
            adds to its forward and backward, timed (NOTE [timing store options]); empty
            where not timed.
        waiting_gradient_bytes: per planned boundary ``k`` (``n + 1``), the gradients that
            wait, alive, for the replay of a region ending at ``k`` (NOTE [gradients
            waiting for a replay] in ``remat.measure.outside``); empty when not measured.
        taken_again: per glue constant a plan may take from the replay of an earlier stage
            instead of keeping it (NOTE [constants an earlier stage takes] in
            ``remat.discover.glue``): its bytes and its ``(stage, glue's stage)`` pairs.
        glue_constants_kept: ``glue_constants`` without those.
        timing_pass_bytes: the largest peak of a group in the timing pass's rehearsal:
            the measuring step's own need, which no plan goes below (0: not timed).
    """

    stages: list[StageMeasurement]
    groups: list[tuple[int, int]]
    profile: ChainProfile
    fixed_bytes: int
    measured_peak_bytes: int
    end_peak_bytes: int = 0
    output_bytes: int = 0
    loss_output_bytes: int = 0
    suffix_peak_bytes: int = 0
    suffix_kept_bytes: int = 0
    cast_bytes: tuple[int, ...] = ()
    leftover_bytes: tuple[int, ...] = ()
    suffix_transient_bytes: int = 0
    cached_cast_bytes: tuple[int, ...] = ()
    input_held_until: tuple[int, ...] = ()
    held_outputs: tuple[tuple[int, int, int, bool], ...] = ()
    leftover_freed: tuple[tuple[int, int], ...] = ()
    suffix_backward_excess_bytes: int = 0
    loss_from_output: bool = False
    option_extra_s: tuple[dict[str, float], ...] = ()
    glue_constants: tuple[tuple[int, tuple[int, ...], int, bool], ...] = ()
    waiting_gradient_bytes: tuple[int, ...] = ()
    taken_again: tuple[TakenAgain, ...] = ()
    glue_constants_kept: tuple[tuple[int, tuple[int, ...], int, bool], ...] = ()
    timing_pass_bytes: int = 0

    @property
    def chain_activation_bytes(self) -> int:
        """What the chain's stages keep for backward and pass on, storing everything."""
        profile = self.profile
        return sum(profile.saved_bytes) + sum(profile.activation_bytes[1:])

    @property
    def outside_activation_bytes(self) -> int:
        """Activation memory outside the chain: what the code before or around it holds
        (not the partial gradients a backward leaves), and the peak of the code after it."""
        return self.fixed_bytes - sum(self.leftover_bytes) + self.profile.gradient_bytes[-1]

    @property
    def coverage(self) -> float:
        """The share of the step's activation memory in the chain's stages: what a plan can
        recompute."""
        chain = self.chain_activation_bytes
        total = chain + self.outside_activation_bytes
        return chain / total if total else 1.0

    def glue_spans(self) -> tuple[tuple[int, int], ...]:
        """``(planned stage, glue's planned stage)`` of every constant in ``taken_again``:
        the spans of ``ChainProfile.glue_spans``."""
        group_of = self.group_of()
        return tuple(sorted({(group_of[s], group_of[k]) for taken in self.taken_again for s, k in taken.pairs}))

    def group_of(self) -> list[int]:
        """The planned stage of each stage call."""
        return [g for g, (first, stop) in enumerate(self.groups) for _ in range(first, stop)]

    def outside_split(self, kept_output_bytes: int, loss_allowance_bytes: int, take_again: bool = False) -> BudgetSplit:
        """What the step holds outside the chain, as planning shares a budget out (no
        budget yet): with the model output a training loop keeps (from the loss on), and
        the room kept for a loss that was not measured. `take_again`: for a plan that
        takes the constants of ``taken_again`` from replays (NOTE [constants an earlier
        stage takes] in remat.discover.glue)."""
        fixed, constants = self.fixed_bytes, self._glue_constants(self.glue_constants)
        replay_held: tuple[ReplayHold, ...] = ()
        if take_again:
            fixed -= sum(taken.nbytes for taken in self.taken_again)
            constants = self._glue_constants(self.glue_constants_kept)
            group_of, saves_input = self.group_of(), self.profile.saves_input
            # (a stage's input kept by its stage: the stage starts its group and saves it)
            # one per tensor and planned pair (two tensors of one size are two holds)
            held = [
                ReplayHold(
                    group_of[s],
                    group_of[k],
                    taken.nbytes,
                    not taken.made and self.groups[group_of[s]][0] == s and saves_input[group_of[s]],
                    taken.saved,
                    taken.made,
                )
                for taken in self.taken_again
                for s, k in sorted({(s, k) for s, k in taken.pairs if group_of[s] < group_of[k]})
            ]
            replay_held = tuple(sorted(held))
        return BudgetSplit(
            total_bytes=None,
            chain_bytes=None,
            held_outside_bytes=fixed + kept_output_bytes,
            loss_allowance_bytes=loss_allowance_bytes,
            after_chain_peak_bytes=self.end_peak_bytes + kept_output_bytes,
            cast_bytes=self.cast_bytes,
            cached_cast_bytes=self.cached_cast_bytes,
            leftover_bytes=self.leftover_bytes,
            leftover_freed=self.leftover_freed,
            from_loss_bytes=self.suffix_kept_bytes,
            kept_output_bytes=kept_output_bytes,
            loss_only_bytes=self.suffix_transient_bytes,
            held_inputs=self.held_inputs(),
            suffix_backward_excess_bytes=self.suffix_backward_excess_bytes,
            glue_constants=constants,
            waiting_gradient_bytes=self.waiting_gradient_bytes,
            replay_held=replay_held,
        )

    def _glue_constants(self, entries: tuple[tuple[int, tuple[int, ...], int, bool], ...]) -> tuple[GlueConstant, ...]:
        profile = self.profile
        out = []
        for nbytes, keepers, stage, saved in entries:
            if stage < 0:
                out.append(GlueConstant(nbytes, keepers, saved=saved))
                continue
            kept_before = stage > 0 and profile.saves_output[stage - 1]
            out.append(GlueConstant(nbytes, keepers, stage, profile.saves_input[stage], kept_before, saved))
        return tuple(out)

    def _later_takers(
        self, index: int, until: int, flowing: Collection[int] = ()
    ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """The later planned stages, up to stage call `until`, that take part of what stage
        call `index` takes (NOTE [side inputs kept by later stages] in
        ``remat.plan.lifetimes``), but for the allocations `flowing`; those of them that save
        some; the bytes taken."""
        group_of = self.group_of()
        held = {key: nbytes for key, nbytes in self.stages[index].input_storages.items() if key not in flowing}
        takers: dict[int, bool] = {}
        taken: dict[int, int] = {}
        for later in range(index + 1, until + 1):
            stage = self.stages[later]
            part = {key: nbytes for key, nbytes in stage.taken_storages.items() if key in held}
            if part and group_of[later] != group_of[index]:
                group = group_of[later]
                takers[group] = takers.get(group, False) or not part.keys().isdisjoint(stage.saved_storages)
                taken.update(part)
        savers = tuple(group for group, saves in takers.items() if saves)
        return tuple(takers), savers, sum(taken.values())

    # NOTE [inputs held after the chain]
    # The model may hold a stage's input into the code after the chain (a Segformer stage's
    # input, held by its caller until the stage returns, after the reshape copy that follows
    # its last norm). The suffix's peak, charged at the loss as the chain output's gradient,
    # counts what the chain made and the model frees there only if no stage saves it
    # (`_suffix`), since a stored stage keeps what it saves. A schedule that recomputes that
    # stage does not keep it, and the model still holds it there: such an input is
    # `after_chain`, and the prediction holds it until the loss is computed
    # (remat.plan.lifetimes).
    def held_inputs(self) -> tuple[HeldInput, ...]:
        """What the model holds beyond a planned stage: its input (see ``input_held_until``),
        and what it made and keeps for later (``held_outputs``)."""
        group_of = self.group_of()
        calls = len(self.stages)
        saved_keys = {key for stage in self.stages for key in stage.saved_storages}
        out = []
        for index, until in enumerate(self.input_held_until):
            storages = self.stages[index].input_storages
            after_chain = until >= calls and not storages.keys().isdisjoint(saved_keys)
            until = min(until, calls - 1)
            start, end = group_of[index], group_of[until]
            if index == 0 or (end == start and not after_chain):
                continue
            nbytes = sum(storages.values())
            if index == self.groups[start][0]:
                profile = self.profile
                kept_before = start > 0 and profile.saves_output[start - 1]
                takers, savers, later_bytes = self._later_takers(index, until)
                held = HeldInput(start, end, nbytes, True, profile.saves_input[start], kept_before)
                out.append(
                    held._replace(
                        later_takers=takers, later_bytes=later_bytes, later_savers=savers, after_chain=after_chain
                    )
                )
            else:  # it passes between two calls inside the planned stage
                stop = self.groups[start][1]
                # (changed in place, it may be the stage's output too: the next stage's input)
                flowing = self.stages[stop].input_storages.keys() if stop < calls else set()
                takers, savers, later_bytes = self._later_takers(index, until, flowing)
                saved = any(not storages.keys().isdisjoint(self.stages[c].saved_storages) for c in range(index, stop))
                held = HeldInput(start, end, nbytes, False, saved, later_takers=takers, later_bytes=later_bytes)
                out.append(held._replace(later_savers=savers, after_chain=after_chain))
        for index, until, nbytes, saved in self.held_outputs:
            if group_of[until] != group_of[index]:
                out.append(HeldInput(group_of[index], group_of[until], nbytes, False, kept_by_stage=saved))
        return tuple(out)


@dataclass
class TrackedStep:
    """What the tracked step saw, as the assembly needs it.

    Attributes:
        watch: the stage watch of the tracked step (bytes and event windows).
        tracker: the tracker of the tracked step.
        alive_after_forward: the tracked allocations alive when the forward returned.
        output_bytes: bytes of the model's output.
        loss_output_bytes: its bytes as a loss computes on it: half-precision floats
            count as float32 (NOTE [loss allowance] in remat.plan.share).
        output_allocations: the allocations of the model's output.
        device: the device the step ran on.
        state_allocations: the allocations of the modules' buffers and tensor attributes
            when the forward returned (state that remat replays, not a side effect).
        cast_allocations: the allocations of autocast's casts of weights (see
            :meth:`remat.memory.MemoryTracker.cast_allocations`).
        loss_event: the event at which the loss was computed, before its backward (None:
            the loss function ran the backward itself).
        loss_allocations: the allocations of the loss (a training loop holds it through
            its backward).
    """

    watch: StageWatch
    tracker: MemoryTracker
    alive_after_forward: dict[int, AllocationRecord]
    output_bytes: int
    loss_output_bytes: int
    output_allocations: set[int]
    device: str
    state_allocations: set[int] = field(default_factory=set)
    cast_allocations: set[int] = field(default_factory=set)
    loss_event: int | None = None
    loss_allocations: set[int] = field(default_factory=set)


def assemble(chain: Chain, step: TrackedStep, times: Sequence[tuple[float, float]] | None = None) -> ChainMeasurement:
    """Groups the measured stages and builds the profile (see the module's steps).

    Args:
        chain: the stages.
        step: what the tracked step saw.
        times: (forward, backward) seconds of each stage call; None: all 0 (a profile of
            bytes only, whose times come later).
    """
    stages = step.watch.stages
    _take_backward_windows(step)
    for stage, (stage_forward_s, stage_backward_s) in zip(stages, times or [(0.0, 0.0)] * len(stages), strict=True):
        stage.forward_time_s, stage.backward_time_s = stage_forward_s, stage_backward_s
    groups = group_stages(stages)
    breaks, pinned = region_limits(stages, groups)
    fixed_bytes, leftovers, freed_by = held_outside_chain(chain, step, groups)
    group_of = [g for g, (first, stop) in enumerate(groups) for _ in range(first, stop)]
    suffix = _suffix(step)
    suffix_kept_bytes, output_gradient_bytes, suffix_peak_bytes, suffix_transient_bytes = suffix[:4]
    fixed_bytes += suffix_kept_bytes
    cached = cached_casts(step, groups)
    fixed_bytes += sum(cached)
    constants = glue_constants(step, groups, group_of)
    taken_again = constants_taken_again(step, groups, group_of)
    constants_kept = glue_constants(step, groups, group_of, frozenset(taken_again))
    fixed_bytes += sum(nbytes for nbytes, _, _, saved in constants if saved)  # the others are escaped bytes
    costs = [group_cost(chain, step, first, stop) for first, stop in groups]
    tracker = step.tracker
    measured_peak_bytes = tracker.window().peak_bytes
    first_backward = stages[0].backward_window
    end_peak_bytes = tracker.window(first_backward[1]).peak_bytes if first_backward is not None else 0
    # gradient of each group's output = gradient of the next group's input
    gradient_bytes = [stages[first].gradient_bytes_in for first, _ in groups] + [output_gradient_bytes]
    input_bytes = 0 if chain.whole_model else sum(stages[0].input_storages.values())
    # the groups' costs, one tuple per field
    (
        names,
        forward_s,
        backward_s,
        output_bytes,
        saved_bytes,
        saves_input,
        saves_output,
        forward_temp,
        backward_temp,
        casts,
    ) = zip(*costs, strict=True)
    profile = ChainProfile(
        names=names,
        forward_time_s=forward_s,
        backward_time_s=backward_s,
        activation_bytes=(input_bytes, *output_bytes),
        gradient_bytes=tuple(gradient_bytes),
        saved_bytes=saved_bytes,
        saves_input=saves_input,
        saves_output=saves_output,
        forward_temp_bytes=forward_temp,
        backward_temp_bytes=backward_temp,
        metadata={
            "fixed_bytes": int(fixed_bytes),
            "measured_peak_bytes": int(measured_peak_bytes),
            "device": step.device,
        },
        region_breaks=tuple(breaks),
        pinned_stages=tuple(pinned),
    )
    return ChainMeasurement(
        stages,
        groups,
        profile,
        int(fixed_bytes),
        int(measured_peak_bytes),
        end_peak_bytes=int(end_peak_bytes),
        output_bytes=int(step.output_bytes),
        loss_output_bytes=int(step.loss_output_bytes),
        suffix_peak_bytes=int(suffix_peak_bytes),
        suffix_kept_bytes=int(suffix_kept_bytes),
        cast_bytes=tuple(int(c) for c in casts),
        cached_cast_bytes=tuple(cached),
        leftover_bytes=tuple(sum(leftovers[first:stop]) for first, stop in groups),
        leftover_freed=tuple((group_of[stage], nbytes) for stage, nbytes in [*freed_by, *suffix.kept_freed]),
        suffix_transient_bytes=int(suffix_transient_bytes),
        suffix_backward_excess_bytes=int(suffix.backward_excess_bytes),
        glue_constants=constants,
        waiting_gradient_bytes=waiting_gradients(step, groups),
        taken_again=tuple(taken_again.values()),
        glue_constants_kept=constants_kept,
    )


def with_times(measurement: ChainMeasurement, times: Sequence[tuple[float, float]]) -> ChainMeasurement:
    """The measurement with these (forward, backward) seconds of each stage call."""
    stages = measurement.stages
    for stage, (forward_s, backward_s) in zip(stages, times, strict=True):
        stage.forward_time_s, stage.backward_time_s = forward_s, backward_s
    groups = measurement.groups
    profile = dataclasses.replace(
        measurement.profile,
        forward_time_s=tuple(sum(s.forward_time_s for s in stages[a:b]) for a, b in groups),
        backward_time_s=tuple(sum(s.backward_time_s for s in stages[a:b]) for a, b in groups),
    )
    return dataclasses.replace(measurement, profile=profile)


def _take_backward_windows(step: TrackedStep) -> None:
    """Sets each stage's backward window in the tracked step's events."""
    watch = step.watch
    end_event = step.tracker.n_events
    end_work = work_mark(step.tracker)
    for index, stage in enumerate(watch.stages):
        # stage i's backward runs from the moment its output's gradient is complete to the
        # moment its input's gradient is (index i - 1; -1 stands for the chain input)
        start_event = watch.grad_ready_event.get(index)
        if start_event is not None:
            stage.backward_window = (start_event, watch.grad_ready_event.get(index - 1, end_event))
            stop = watch.grad_ready_work.get(index - 1, end_work)
            stage.backward_work = work_between(step.tracker, watch.grad_ready_work[index], stop)


# NOTE [returned and kept for a replay]
# What a stage makes and the model returns is counted as escaped, held through the step
# (remat.measure.outside.escaped_bytes). A loop that drops the output at the loss frees it
# in the suffix of a plain step, which the suffix's peak then counts as gone. When the glue
# after a later stage takes it as it is (ViT-MAE's order of the patches, which the code
# before the decoder takes to undo its shuffle), the executor keeps it for that stage's
# replays, through the loss's backward: it is counted there, as it is at the forward's end.
# (A plan that stores that stage frees it at the loss: predicted that much high.)
def _suffix(step: TrackedStep) -> _Suffix:
    """Bytes the suffix keeps through the chain's backward, gradient bytes of the chain
    output, its peak, how much of that gradient is the suffix's transient, and how much
    it exceeds the peak of the suffix's forward (until the loss is computed).

    The chain output's gradient appears with the loss; whatever runs after the chain (a
    head, the loss) is charged at that moment, as extra bytes of that gradient.
    """
    watch, tracker = step.watch, step.tracker
    last_forward_end = watch.stages[-1].forward_window[1]
    last_backward = watch.stages[-1].backward_window
    suffix_stop = last_backward[0] if last_backward is not None else tracker.n_events
    suffix = as_kept(step, last_forward_end, suffix_stop)
    # What the suffix allocates and still holds when the last stage's backward ends, other
    # than the model's output, is held through the chain's backward: e.g. the partial
    # gradient of an LM head's weight tied to the prefix's embedding, which waits for the
    # embedding's backward. It is fixed memory, not part of the transient.
    # A stage's backward may free it (the decoder's embedding, run as glue, sums that
    # partial gradient with its own: the sum is that stage's leftover): released there,
    # not counted twice. (Not the first stage's: its window runs to the step's end, where
    # the training loop drops the loss.)
    kept_bytes = 0
    kept_freed: list[tuple[int, int]] = []
    if last_backward is not None:
        in_last_backward = tracker.surviving_allocations(*last_backward)
        held = tracker.surviving_allocations(last_forward_end, last_backward[1])
        excluded = in_last_backward.keys() | watch.gradient_allocations | step.output_allocations
        excluded |= recomputed(step, held)
        kept_bytes = sum_except(held, excluded)
        windows = [stage.backward_window for stage in watch.stages]
        for key, (_, freed) in tracker.allocation_freed_events(held.keys() - excluded).items():
            taker = backward_freeing(windows, freed, first=1)
            if taker is not None:
                kept_freed.append((taker, held[key]))
        # a loss the chain's last stage computes (a loss module planned as a stage) is held
        # by the training loop through the whole backward
        returned = watch.stages[-1].output_storages
        kept_bytes += sum(returned[key] for key in step.loss_allocations if key in returned)
    # What the chain made that no stage saved (an autocast stage saves its cast) but the
    # model's code still held when the last stage returned (NOTE [inputs the model holds]:
    # a stage's input, an output kept in a variable to the end of the forward) is gone for
    # the schedule, but counted in the window's start; it dies in the suffix, which adds
    # that much more to what the schedule holds. (What the code before the chain made is
    # counted as held through the step: its death there is the suffix's own.)
    saved = {key for stage in watch.stages for key in stage.saved_storages}
    chain_start = watch.stages[0].forward_window[0]
    # (what outlives the forward is counted as escaped, and autocast's casts apart)
    counted = saved | step.output_allocations | step.cast_allocations | step.alive_after_forward.keys()
    # What the code before the chain made and the model's code between stages takes as it
    # is (an embedding added to the first stage's output) dies in the suffix of a plain
    # step, but the executor keeps it while a stage whose glue takes it may be replayed:
    # through the loss, for a region that starts the chain. It is counted like the rest.
    replayed_constants = {key for stage in watch.stages for key in stage.glue_constants}
    # So does what the model returns and a glue takes as it is (NOTE [returned and kept
    # for a replay]): counted as escaped, through the step, it must not die in the suffix.
    returned_and_kept = replayed_constants & (step.output_allocations - saved - step.cast_allocations)
    made = tracker.allocation_freed_events(
        (set(tracker.allocations_since(chain_start)) | replayed_constants) - (counted - returned_and_kept)
    )
    records = tracker.allocation_records(made)
    uncounted = sum(
        records[key].nbytes
        for key, (allocated, freed) in made.items()
        if allocated < last_forward_end and freed is not None and last_forward_end <= freed < suffix_stop
    )
    # a span's input its region keeps (frugal mode) dies there in a plain step if the model
    # lets go of it there (NOTE [a frugal step's forward as a plain one])
    elsewhere = saved | step.output_allocations | step.cast_allocations  # (its region keeps it after the forward)
    let_go = {key: at for key, at in watch.let_go_event.items() if key not in elsewhere}
    uncounted += sum(
        record.nbytes
        for key, record in tracker.allocation_records(let_go).items()
        if record.allocated_event < last_forward_end and last_forward_end <= let_go[key] < suffix_stop
    )
    before_bytes = suffix.before_bytes - uncounted
    gradient_bytes = max(watch.output_grad_bytes, suffix.peak_bytes - before_bytes - kept_bytes)
    # the suffix's forward (a head, the loss itself) ends where the loss is computed
    forward_end = step.loss_event if step.loss_event is not None else suffix_stop
    forward = as_kept(step, last_forward_end, max(last_forward_end, forward_end))
    forward_bytes = max(0, forward.peak_bytes - before_bytes - kept_bytes)
    return _Suffix(
        kept_bytes,
        gradient_bytes,
        suffix.peak_bytes - before_bytes,
        gradient_bytes - watch.output_grad_bytes,
        gradient_bytes - forward_bytes,
        tuple(kept_freed),
    )


class _Suffix(NamedTuple):
    kept_bytes: int
    gradient_bytes: int
    peak_bytes: int
    transient_bytes: int
    backward_excess_bytes: int
    kept_freed: tuple[tuple[int, int], ...] = ()  # (stage whose backward frees it, bytes)
