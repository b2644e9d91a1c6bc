"""What is installed on a chain while it is measured: per-stage watches and gradient hooks.

* :class:`StageWatch` is called instead of each stage module (see
  :func:`remat.discover.intercept.intercept_stages`): it notes the stage's input and output
  storages, its forward's event window and time, and whether it modifies its input;
* the tracker's saved-tensor hooks record which allocations each stage keeps for its
  backward (in the frugal mode, the recompute regions tell what they discard);
* a gradient hook on each stage's outputs marks where the stage's backward starts
  (the moment the whole gradient of its output is there);
* in the frugal mode, a :class:`_SpanObserver` per recompute region says what the region
  discards (what its stages save) and when it is recomputed.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat.discover.chain import Chain, StageLinks
from remat.discover.glue import GlueRecorder, StageInputs
from remat.discover.intercept import call_original, out_of_order
from remat.manual._planned_scope import stage_call
from remat.manual._tensors import storage_key
from remat.memory import MemoryTracker

__all__ = ["InPlaceProbe", "StageMeasurement", "StageWatch", "Work", "tensors_in", "work_between", "work_mark"]


class Work(NamedTuple):
    """What a stretch of a step computes, as the tracker counts it.

    Attributes:
        flops: floating-point operations of the operators ``torch.utils.flop_counter``
            knows (matrix products, convolutions, attention).
        operations: operators run (each costs a call, whatever its size).
        allocated_bytes: bytes of the storages it allocates (written at least once).
    """

    flops: int = 0
    operations: int = 0
    allocated_bytes: int = 0


def work_between(tracker: MemoryTracker, start: tuple[int, int, int], stop: tuple[int, int, int]) -> Work:
    """The work between two marks of :func:`work_mark`."""
    return Work(stop[0] - start[0], stop[1] - start[1], tracker.allocated_bytes(start[2], stop[2]))


def work_mark(tracker: MemoryTracker | None) -> tuple[int, int, int]:
    """(flops, operations, events) counted so far: where a stretch of work starts or stops."""
    return (tracker.flops, tracker.operations, tracker.n_events) if tracker is not None else (0, 0, 0)


@dataclass
class StageMeasurement:
    """Raw figures of one stage call (before grouping).

    Attributes:
        name: the stage's name in the chain.
        forward_time_s: seconds of its forward.
        backward_time_s: seconds of its backward.
        forward_window: the tracker events of its forward, ``(start, stop)``.
        backward_window: the tracker events of its backward, ``(start, stop)`` (None when
            its output got no gradient).
        input_storages: allocation id -> bytes of what it takes from the stage before.
        output_storages: allocation id -> bytes of what the stage after takes from it.
        saved_storages: allocation id -> (bytes, allocation event) of what it keeps for
            its backward.
        escaped_storages: allocation id -> bytes of its outputs that the next stage does
            not take (they go to the model's own code).
        gradient_bytes_in: bytes of the gradient of its input.
        modifies_input: whether its input is changed in place during the step, by the
            stage itself or by a later one (through an alias: a stage returning its
            input); a region cannot start there, since it would keep a changing input.
        input_changed: whether the model's own code changed in place what it takes from
            the stage before, after that stage returned it.
        input_requires_grad: for each tensor among its inputs (in flattening order),
            whether it required grad.
        forward_work: the work of its forward (its glue included), where the tracker counts
            it (sized and tracked steps; zero in a timing step).
        backward_work: the work of its backward, the same way.
        kept_constants: allocation id -> bytes of the tensors made since the chain began
            that the model's code after it (or the next stage) takes as they are: the
            executor keeps them for the replay when it recomputes the stage.
        glue_replayable: whether the model's code after it can be replayed (NOTE [glue
            that changes an earlier activation]); if not, the stage is pinned.
        glue_constants: allocation ids of every tensor the model's code after it (or the
            next stage) takes as it is, made before the chain too: the executor keeps
            them while the stage may be replayed.
        earlier_inputs: allocation id -> stage, for those of ``kept_constants`` that an
            earlier stage took as its input or its glue made (NOTE [constants an earlier
            stage takes] in remat.discover.glue).
        earlier_made: those of ``earlier_inputs`` that the glue made.
        taken_storages: allocation id -> bytes of every tensor the call takes (its
            ``input_storages``, and side inputs such as a mask made once for every block).
    """

    name: str
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    forward_window: tuple[int, int] = (0, 0)
    backward_window: tuple[int, int] | None = None
    input_storages: dict[int, int] = field(default_factory=dict)
    output_storages: dict[int, int] = field(default_factory=dict)
    saved_storages: dict[int, tuple[int, int]] = field(default_factory=dict)
    escaped_storages: dict[int, int] = field(default_factory=dict)
    gradient_bytes_in: int = 0
    modifies_input: bool = False
    input_changed: bool = False
    input_requires_grad: tuple[bool, ...] = ()
    forward_work: Work = Work()
    backward_work: Work = Work()
    kept_constants: dict[int, int] = field(default_factory=dict)
    glue_replayable: bool = True
    glue_constants: frozenset[int] = frozenset()
    earlier_inputs: dict[int, int] = field(default_factory=dict)
    earlier_made: set[int] = field(default_factory=set)
    taken_storages: dict[int, int] = field(default_factory=dict)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of a nest of tuples, lists and dicts."""
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


class _InPlaceWatch:
    """Sees, around each stage call, what was changed in place in a forward.

    :meth:`before` tells whether the model's code changed what the stage takes from the
    stage before (see :class:`~remat.discover.chain.StageLinks`); :meth:`after` which
    stages' inputs were changed in place since they were called, by the stage itself or
    any later code (only weak references are kept: watching changes no tensor's lifetime).
    """

    def __init__(self, n_stages: int) -> None:
        self._links = StageLinks(n_stages)
        self._watched: list[tuple[int, list[tuple[weakref.ref[torch.Tensor], int]]]] = []

    def before(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Starts watching stage `index`'s inputs; whether the model's code changed its linked input."""
        changed = bool(self._links.changed_in_place(args, kwargs))
        self._watched.append((index, [(weakref.ref(t), t._version) for t in tensors_in((args, kwargs))]))
        return changed

    def after(self, index: int, output: Any) -> list[int]:
        """Notes stage `index`'s output; the stages whose inputs changed since (then no longer watched)."""
        self._links.returned(index, output)
        changed, kept = [], []
        for index, refs in self._watched:
            tensors = [(ref(), version) for ref, version in refs]
            if any(t is not None and t._version != version for t, version in tensors):
                changed.append(index)
            elif any(t is not None for t, _ in tensors):
                kept.append((index, refs))
        self._watched = kept
        return changed


class StageWatch:
    """Installed on the stage modules while measuring (one per measured step).

    Args:
        chain: the stages.
        tracker: the tracker of the tracked step; None for the timing step (no bytes).
        synchronize: waits for the device (None on the CPU).
        spans: the recompute regions of the frugal mode (None for a plain step).
    """

    def __init__(
        self,
        chain: Chain,
        tracker: MemoryTracker | None,
        synchronize: Callable[[], None] | None,
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        self.chain = chain
        self.tracker = tracker
        self.synchronize = synchronize
        # Frugal measurement (see NOTE [frugal measurement]): each span of stages runs as
        # a recompute region, so the step keeps only the spans' inputs.
        self.spans = spans
        self.recompute_end_event: dict[int, int] = {}  # span start -> event after its recompute
        self.recompute_time_s: dict[int, float] = {}  # span start -> seconds of its recompute
        self.recompute_windows: list[tuple[int, int]] = []  # events of every recompute
        # stage -> the event when backward first took what it saved, after the replay that
        # brought it back (NOTE [first uses in a frugal step] in remat.measure.outside)
        self.first_use_event: dict[int, int] = {}
        # the allocations of the saved tensors the replays gave back to backward
        # (NOTE [replays inside a frugal backward] in remat.measure.costs)
        self.given_back: set[int] = set()
        # allocation -> the event when the model let go of it, for the inputs of spans, which
        # their regions keep (NOTE [a frugal step's forward as a plain one] in remat.measure.costs)
        self.let_go_event: dict[int, int] = {}
        self._span_starts = {start for start, _ in spans or []}
        self._let_go_refs: list[weakref.ref[torch.Tensor]] = []
        self.span_start_of_last_stage = {stop - 1: start for start, stop in spans or []}
        self._run: Any = None
        if spans is not None:
            from remat.execute import ChainExecutor, _Run
            from remat.plan.operations import Region, Store

            items = tuple(Region(a, b, tuple(Store(k) for k in range(a, b))) for a, b in spans)
            self._run = _Run(ChainExecutor(chain, items, observer=lambda region: _SpanObserver(self, region.start)))
        self.stages = [StageMeasurement(name) for name in chain.names]
        self.in_place = _InPlaceWatch(len(chain))
        self.current: int | None = None
        self.next_stage = 0
        self._glue: GlueRecorder | None = None  # the running stage's glue, while it runs
        self._stage_inputs = StageInputs()
        self._started: tuple[float, int, int, tuple[int, int, int]] = (0.0, 0, 0, (0, 0, 0))
        self._block_outputs: dict[int, int] = {}
        self._saved_at_return = (0, 0)
        self.saved_ids: list[list[int]] = [[] for _ in chain.names]  # frugal: per stage, in save order
        self.grad_ready_time: dict[int, float] = {}  # stage -> when its output's gradient was complete
        self.grad_ready_event: dict[int, int] = {}
        self.own_ready_event: dict[int, int] = {}  # stage -> when the gradient of what it made was complete
        self.grad_ready_work: dict[int, tuple[int, int, int]] = {}  # stage -> work mark then
        self.output_grad_bytes = 0
        self.gradient_allocations: set[int] = set()
        self.input_gradient_allocations: dict[int, set[int]] = {}  # stage -> its input's gradient

    def event(self) -> int:
        """The tracker's event count now (0 when untracked)."""
        return self.tracker.n_events if self.tracker is not None else 0

    def record_saved(self, tensor: torch.Tensor) -> None:
        """Notes that the running stage keeps `tensor` for its backward (frugal mode).

        In a plain tracked step the tracker's saved-tensor hooks note what each stage
        saves (NOTE [saved-tensor records] in remat.memory); a recompute region saves
        through hooks of its own, and tells its observer what it discards.
        """
        if self.current is not None and self.tracker is not None:
            allocation_id = self.tracker.allocation_id(tensor)
            if allocation_id is not None:
                self.saved_ids[self.current].append(allocation_id)

    def _watch_let_go(self, tracker: MemoryTracker, inputs: Sequence[torch.Tensor]) -> None:
        """Notes when the model lets go of a span's inputs that require grad: its region keeps
        them as other tensors on the same memory, which outlive them."""
        for tensor in inputs:
            key = tracker.allocation_id(tensor) if tensor.requires_grad else None
            if key is not None:
                noted = functools.partial(self._let_go, key)
                self._let_go_refs.append(weakref.ref(tensor, noted))

    def _let_go(self, key: int, _: object) -> None:
        self.let_go_event.setdefault(key, self.event())

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs stage `index` in place of the module's call, and takes its figures.

        A stage's forward lasts until the next stage is called: the model's own code in
        between (its glue: ``x + block(x)``, a scaling) is part of it, as the executor runs
        it (NOTE [glue between stages] in remat.execute). The last stage ends when it returns.
        """
        if index != self.next_stage:
            raise out_of_order(self.chain, index, self.next_stage)
        self.next_stage += 1
        inputs = tensors_in((args, kwargs))
        if index > 0:
            self._end_forward(index - 1, args, kwargs)
        self._stage_inputs.note(index, inputs)
        stage = self.stages[index]
        stage.input_changed = self.in_place.before(index, args, kwargs)
        stage.input_requires_grad = tuple(t.requires_grad for t in inputs)
        tracker = self.tracker
        if tracker is not None:
            stage.taken_storages = tracker.allocations_of(inputs)
            self._link(index, stage.taken_storages)
            if index in self._span_starts:
                self._watch_let_go(tracker, inputs)
        self.current = index
        if self.synchronize is not None:
            self.synchronize()
        self._started = (
            time.perf_counter(),
            self.event(),
            tracker.n_saved if tracker is not None else 0,
            work_mark(tracker),
        )
        try:
            if self._run is not None and torch.is_grad_enabled():
                out = self._run.call(index, module, args, kwargs)
            else:
                with stage_call(index):  # NOTE [elementwise saves in planned stages]
                    out = call_original(module, args, kwargs)
        except BaseException:
            self.current = None
            raise
        for changed in self.in_place.after(index, out):
            self.stages[changed].modifies_input = True
        outputs = tensors_in(out)
        self._block_outputs = tracker.allocations_of(outputs) if tracker is not None else {}
        self._saved_at_return = (tracker.n_saved if tracker is not None else 0, len(self.saved_ids[index]))
        if torch.is_grad_enabled():
            if index == 0:
                self._hook_gradients(-1, inputs)
            if index == len(self.chain) - 1:
                self._hook_gradients(index, outputs)
        if index == len(self.chain) - 1:
            self._end_forward(index, None, None)
        else:
            self._glue = GlueRecorder(inputs, outputs)
            self._glue.start()
        return out

    def _end_forward(self, index: int, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> None:
        """Ends stage `index`'s forward: the next stage is called with (args, kwargs) (None: it was the last)."""
        glue, self._glue = self._glue, None
        made: list[torch.Tensor] = []
        passed: list[torch.Tensor] = []
        stage = self.stages[index]
        tracker = self.tracker
        start_time, start_event, start_saved, start_work = self._started
        if glue is not None and args is not None and kwargs is not None:
            recorded = glue.finish(args, kwargs)
            stage.glue_replayable = recorded.replayable
            made = recorded.made(args, kwargs)
            passed = recorded.passed_through(args, kwargs)
            if tracker is not None:
                # what the executor keeps for the replay of this stage's glue: the tensors
                # made since the chain began that the glue or the next stage take as they are
                chain_start = self.stages[0].forward_window[0] if index > 0 else start_event
                records = tracker.allocation_records(tracker.allocations_of(recorded.constants))
                stage.glue_constants = frozenset(records)
                stage.kept_constants = {key: r.nbytes for key, r in records.items() if r.allocated_event >= chain_start}
                # NOTE [constants an earlier stage takes] in remat.discover.glue
                earlier = self._stage_inputs.earlier(recorded.constants, index)
                for tensor in recorded.constants:
                    keys = tracker.allocations_of([tensor])
                    if id(tensor) in earlier and len(keys) == 1 and next(iter(keys)) in stage.kept_constants:
                        key, at = next(iter(keys)), earlier[id(tensor)]
                        stage.earlier_inputs[key] = at.stage
                        if at.made:
                            stage.earlier_made.add(key)
            self._stage_inputs.note_made(index, glue)
        self.current = None
        if self.synchronize is not None:
            self.synchronize()
        stage.forward_time_s = time.perf_counter() - start_time
        stage.forward_window = (start_event, self.event())
        if tracker is not None:
            stage.forward_work = work_between(tracker, start_work, work_mark(tracker))
            # an output that the glue saves for its backward (x + gamma * block(x)) is the
            # stage's own saved tensor, not one that escapes to the model's code
            tracked_at, own_at = self._saved_at_return
            glue_saved = {*tracker.saved_allocations(tracked_at), *self.saved_ids[index][own_at:]}
            outputs = {k: v for k, v in self._block_outputs.items() if k not in glue_saved}
            stage.output_storages = {**outputs, **tracker.allocations_of(made)}
            saved_ids = tracker.saved_allocations(start_saved) + self.saved_ids[index]
            records = tracker.allocation_records(saved_ids)
            stage.saved_storages = {k: (r.nbytes, r.allocated_event) for k, r in records.items()}
        if torch.is_grad_enabled() and args is not None:
            # its backward starts once the whole gradient of what the next stage took from it is there
            self._hook_gradients(index, made, passed)

    def finish(self) -> None:
        """Stops a glue recording left running (the forward failed, or ended early)."""
        glue, self._glue = self._glue, None
        if glue is not None:
            glue.stop()

    def _link(self, index: int, input_storages: dict[int, int]) -> None:
        # The boundary is what this stage takes from the previous one; any other output
        # of the previous stage escapes to the model's own code.
        stage = self.stages[index]
        if index == 0:
            stage.input_storages = input_storages
            return
        previous = self.stages[index - 1]
        linked: dict[int, int] = {}
        escaped: dict[int, int] = {}
        for key, nbytes in previous.output_storages.items():
            (linked if key in input_storages else escaped)[key] = nbytes
        previous.escaped_storages = escaped
        previous.output_storages = linked
        stage.input_storages = linked

    def _hook_gradients(self, index: int, tensors: list[torch.Tensor], passed: Sequence[torch.Tensor] = ()) -> None:
        # Plain tensor hooks (they also fire for the tensor backward starts from). The
        # last one to fire marks the moment the whole gradient is there, and the stage's
        # backward starts, but for the outputs the stage's own backward completes (NOTE
        # [outputs a stage's own backward completes]); the last of those of what the
        # stage made, not `passed` on from its inputs, when its own backward can start
        # (NOTE [gradients waiting for a replay] in remat.measure.outside).
        received: dict[int, int] = {}  # position -> bytes, shared by the outputs of one stage
        own: set[int] = set()  # the positions of what it made
        hooked = [tensor for tensor in tensors if tensor.requires_grad]
        # Reading grad_fn first brings a view changed in place up to date: PyTorch
        # regenerates its node there, and registering a hook before that fails.
        inside = completed_inside([tensor.grad_fn for tensor in hooked])
        for position, tensor in enumerate(hooked):
            if not any(tensor is other for other in passed) and position not in inside:
                own.add(position)
            hook = functools.partial(self._on_gradient, index, position, received, own, inside)
            tensor.register_hook(hook)

    def _on_gradient(
        self,
        index: int,
        position: int,
        received: dict[int, int],
        own: set[int],
        inside: set[int],
        grad: torch.Tensor | None,
    ) -> None:
        # The gradient of one output of stage `index` (-1: of the chain input) is there.
        # Once all have come, stage `index`'s backward starts, and the backward of stage
        # index + 1 has just ended; one its own backward completes comes within it.
        if self.synchronize is not None:
            self.synchronize()
        tracker = self.tracker
        if position not in inside or index not in self.grad_ready_event:
            self.grad_ready_time[index] = time.perf_counter()
            self.grad_ready_event[index] = tracker.n_events if tracker is not None else 0
            self.grad_ready_work[index] = work_mark(tracker)
        if position in own and own <= {*received, position}:
            self.own_ready_event.setdefault(index, self.grad_ready_event[index])
        if grad is None:
            received[position] = 0
        else:
            received[position] = int(grad.numel() * grad.element_size())
            if tracker is not None:
                allocation_id = tracker.allocation_id(grad)
                # one the stage's own backward completes is not part of the gradient it
                # starts with when that backward made it: what a later stage gave of it
                # is that one's leftover (not when it was summed into in place)
                if position in inside and allocation_id is not None:
                    made_at = tracker.allocation_records([allocation_id])[allocation_id].allocated_event
                    if made_at >= self.grad_ready_event[index]:
                        received[position] = 0
                if allocation_id is not None:
                    self.gradient_allocations.add(allocation_id)
                    self.input_gradient_allocations.setdefault(index + 1, set()).add(allocation_id)
        nbytes = sum(received.values())
        if index == -1:
            self.stages[0].gradient_bytes_in = nbytes
        elif index + 1 < len(self.stages):
            self.stages[index + 1].gradient_bytes_in = nbytes
        else:
            self.output_grad_bytes = nbytes


# NOTE [outputs a stage's own backward completes]
# T5's first block makes the position bias, adds it to its own attention scores and
# returns it with its output for the next block, which adds it to its scores too. The
# bias's gradient is whole only when the first block's own attention backward has added
# its part: in the middle of that block's backward, which started when the gradient of
# its other output was whole. Taken as the start of its backward, that hook charged the
# first events of the block's backward to the next block's (as what that one left
# behind, and as gradients waiting for the block's replay): 39% over the measured peak
# of a two-block MT5 plan. An output is such an output when its autograd node is reached
# from another output's by the stage's own graph (the stage or its glue took it); its
# hook does not move the start of the stage's backward once another output's has set
# it, and its gradient is not part of the one the stage's backward starts with (what a
# later stage gave of it is that stage's leftover, freed here). An output only a later
# stage takes (LeViT's keys and values, made beside the queries' subsample) is not
# reached so: its gradient, late, is delivered by that stage, and what waits for it is
# counted (NOTE [gradients a region's own backward takes] in remat.measure.outside).
def completed_inside(nodes: Sequence[Any]) -> set[int]:
    """The positions of `nodes` (autograd nodes of a stage's outputs; None for a leaf)
    reached from another's by the graph between them (see the NOTE)."""
    known = [node for node in nodes if node is not None]
    if len(known) < 2:
        return set()
    # a node made before the earliest output's cannot lead to any of them
    floor = min(node._sequence_nr() for node in known)
    targets = set(known)
    reached: set[Any] = set()
    seen: set[Any] = set()
    stack = [child for node in known for child, _ in node.next_functions if child is not None]
    while stack:
        node = stack.pop()
        if node in seen or node._sequence_nr() < floor:
            continue
        seen.add(node)
        if node in targets:
            reached.add(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return {position for position, node in enumerate(nodes) if node is not None and node in reached}


# NOTE [frugal measurement]
# A plain measuring step stores every activation: it needs as much memory as training
# without recompute, which a model that only fits with recompute does not have. The
# frugal mode runs the measured steps with every stage recomputed, in spans of stages that
# each run as a recompute region (NOTE [frugal spans] in remat.measure.spans), so a step keeps
# little more than the spans' inputs and one span's saved tensors. What each stage saves is
# seen as the region discards it; the figures of the forward and of the suffix are read as
# a plain step would show them (NOTE [a frugal step's forward as a plain one] in
# remat.measure.costs); a stage's backward is measured from the end of its span's replay,
# when its saved tensors are back (NOTE [replays inside a frugal backward]), and backward's
# first use of what each stage saved is told by the regions (NOTE [first uses in a frugal
# step] in remat.measure.outside). Times: the replay's time is taken off the backward it
# precedes.
class _SpanObserver:
    """Told by a span's recompute region what it discards, when it is recomputed, and when
    backward takes what it saved."""

    def __init__(self, watch: StageWatch, start: int) -> None:
        self.watch = watch
        self.start = start
        self.started = 0.0
        self.started_event = 0
        self.savers: list[int | None] = []  # per saved tensor of the region, the stage that saved it

    def on_discarded(self, tensor: torch.Tensor) -> None:
        self.watch.record_saved(tensor)
        self.savers.append(self.watch.current)

    def on_unpacked(self, index: int, tensor: torch.Tensor) -> None:
        watch = self.watch
        stage = self.savers[index] if index < len(self.savers) else None
        if stage is not None:
            watch.first_use_event.setdefault(stage, watch.event())
        key = watch.tracker.allocation_id(tensor) if watch.tracker is not None else None
        if key is not None:
            watch.given_back.add(key)

    def on_recompute(self, started: bool) -> None:
        watch = self.watch
        if watch.synchronize is not None:
            watch.synchronize()
        if started:
            self.started = time.perf_counter()
            self.started_event = watch.event()
            return
        watch.recompute_end_event[self.start] = watch.event()
        watch.recompute_windows.append((self.started_event, watch.event()))
        watch.recompute_time_s[self.start] = watch.recompute_time_s.get(self.start, 0.0) + (
            time.perf_counter() - self.started
        )


class InPlaceProbe:
    """Finds, in a forward, the stages that modify their input in place and those whose
    input the model's own code changed in place (see :class:`StageMeasurement`); and, as
    its :meth:`pack` is told of what autograd saves, about how many bytes each stage (with
    the model's code after it) saves and takes as input (NOTE [frugal spans] in
    :mod:`remat.measure.spans`). Nothing saved is kept."""

    def __init__(self, chain: Chain, constants: set[int] | None = None) -> None:
        self.modifies_input = [False] * len(chain)
        self.input_changed = [False] * len(chain)
        self.in_place = _InPlaceWatch(len(chain))
        self.input_bytes = [0] * len(chain)
        self.saved_bytes = [0] * len(chain)
        self._constants = constants or set()  # storages of parameters and buffers: not counted
        # what the running stage saved, by storage: held while it runs, so that a storage
        # freed and another made at its address are not taken for one
        self._seen: dict[int, Any] = {}
        self._current: int | None = None
        # the stages' inputs by storage, weakly (see written)
        self._inputs: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = {}

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.input_changed[index] = self.in_place.before(index, args, kwargs)
        inputs = tensors_in((args, kwargs))
        for tensor in inputs:
            self._inputs.setdefault(storage_key(tensor), []).append((weakref.ref(tensor), index))
        storages = {storage_key(t): _storage_bytes(t) for t in inputs if t.requires_grad}
        self.input_bytes[index] = sum(storages.values())
        self._current, self._seen = index, {}
        out = call_original(module, args, kwargs)
        for changed in self.in_place.after(index, out):
            self.modifies_input[changed] = True
        return out

    def written(self, tensors: list[torch.Tensor]) -> None:
        """An operation changes `tensors` in place: a stage whose input they share memory with
        modifies its input (an ``nn.Identity`` returns its input, which the model's code then
        adds to in place and lets go of, before any stage could see its version)."""
        for tensor in tensors:
            for ref, index in self._inputs.get(storage_key(tensor), ()):
                if ref() is not None:
                    self.modifies_input[index] = True

    def pack(self, tensor: torch.Tensor) -> None:
        """A saved-tensor hook: counts what the running stage saves, and keeps nothing."""
        key = storage_key(tensor)
        if self._current is not None and key not in self._seen and key not in self._constants:
            self._seen[key] = tensor.untyped_storage() if tensor.layout == torch.strided else tensor
            self.saved_bytes[self._current] += _storage_bytes(tensor)


def _storage_bytes(tensor: torch.Tensor) -> int:
    if tensor.layout != torch.strided:
        return tensor.element_size() * tensor.numel()
    return int(tensor.untyped_storage().nbytes())
