"""Timing a chain's stages one group at a time, in little more memory than one group needs.

The timing pass runs the model's forward without grad. At the first stage call of each
group (see :func:`remat.measure.groups.group_stages`), grad is switched on, on inputs
cut from the pass (those that required grad in the sized step require grad again); at
the group's last stage call, its backward runs at once from gradients of ones, and the
group's outputs go on, detached, to the rest of the forward. Only one group's
activations, gradients and autocast casts are alive at a time, on top of what the model
holds between stages: the pass fits in any budget that a schedule of the chain fits in
(:func:`timing_need_bytes` gives the bound before the pass runs).

Each stage's forward is timed alone (on a GPU, with the device synchronised around it),
with the model's code from its return to the next stage's call added to it (the glue a
replay runs again after the stage), and each group's backward as a whole (charged to its
last stage). A short stage's forward
(one of few floating-point operations in the sized step: a norm, an activation, a small
product) is a few microseconds that one sample times badly: it runs ``FORWARD_REPEATS``
more times without grad, and its time is the median of all its samples. A group whose backward
would not fit in the budget runs its forward without grad and its backward is estimated at
``BACKWARD_PER_FORWARD`` times its forward.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat._no_grad import forward_without_grad
from remat.discover.chain import Chain
from remat.discover.intercept import call_original, intercept_stages, missing_stages, out_of_order
from remat.manual._planned_scope import stage_call
from remat.manual.recompute import recompute
from remat.measure.instrument import StageMeasurement, tensors_in
from remat.measure.workspace import WorkspaceProbe
from remat.memory import MemoryTracker

__all__ = ["BACKWARD_PER_FORWARD", "FORWARD_REPEATS", "REPEATED_BELOW_FLOPS", "TimingPass", "time_groups"]

#: Extra runs, without grad, of the forward of a stage below ``REPEATED_BELOW_FLOPS``.
FORWARD_REPEATS = 4

#: A stage whose forward made fewer floating-point operations than this in the sized step
#: (about a millisecond of a CPU core) is timed as the median of ``1 + FORWARD_REPEATS`` runs.
#: Chosen from the sized step's figures, the same in the pass and its rehearsal on fake
#: tensors, which counts the repeats' outputs into what the pass needs.
REPEATED_BELOW_FLOPS = 50_000_000

#: A backward's time per forward's, for a group whose backward cannot be timed within the
#: budget (a matrix product's backward makes two products).
BACKWARD_PER_FORWARD = 2.0

#: Runs of a stage as it is and under each policy, taking turns (NOTE [timing store options]);
#: a short stage (below ``REPEATED_BELOW_FLOPS``) is run ``SHORT_OPTION_ROUNDS`` times.
OPTION_ROUNDS = 2
SHORT_OPTION_ROUNDS = 5


class TimingPass(NamedTuple):
    """What the timing pass gives.

    Attributes:
        times: (forward, backward) seconds of each stage call.
        suffix_peak_bytes: the peak of what runs after the chain (a head, the loss, their
            backward down to the chain output's gradient) above what was live when it
            began; None when not measured.
        group_peak_bytes: with ``track_all``, the pass's peak while each group ran (the
            last one with the suffix), counting everything allocated since it began.
        input_held_until: with ``track_all``, for each stage call, the last stage call
            whose forward runs while the model itself still holds the stage's input (NOTE
            [inputs the model holds]); the stage's own index when nothing does, and the
            number of stage calls when the model holds it into the code after the chain.
        held_outputs: with ``track_all``, what a stage call (with the code after it) makes
            that the model holds beyond the next stage call, other than that call's input
            (a U-Net's skip): ``(stage call, last stage call it is held through, bytes,
            whether the stage also saves it for its backward)``.
        option_extra_s: for each stage call, the seconds each policy (by name) adds to its
            forward and backward (NOTE [timing store options]); empty where not timed.
        forward_workspace_bytes: with a probe, what workspaces add to each stage call's
            forward and the code after it (the first's, the code before it too; NOTE
            [device workspaces]); empty without one.
        backward_workspace_bytes: likewise of each stage call's backward: of the group's,
            charged to its last stage call (the last group's with the code after the
            chain); a group whose backward is not run gets the largest of the pass.
        largest_workspace_bytes: with a probe, the largest workspace of one operator.
    """

    times: list[tuple[float, float]]
    suffix_peak_bytes: int | None
    group_peak_bytes: tuple[int, ...] = ()
    input_held_until: tuple[int, ...] = ()
    held_outputs: tuple[tuple[int, int, int, bool], ...] = ()
    option_extra_s: tuple[dict[str, float], ...] = ()
    forward_workspace_bytes: tuple[int, ...] = ()
    backward_workspace_bytes: tuple[int, ...] = ()
    largest_workspace_bytes: int = 0

    @property
    def workspaces(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """The arguments of :func:`remat.measure.workspace.with_workspaces` after the measurement."""
        return self.forward_workspace_bytes, self.backward_workspace_bytes, self.largest_workspace_bytes


class _GroupTimer:
    """Called instead of each stage module during the timing pass."""

    def __init__(
        self,
        chain: Chain,
        stages: list[StageMeasurement],
        groups: list[tuple[int, int]],
        synchronize: Callable[[], None] | None,
        backward_groups: frozenset[int],
        device_type: str,
        track_all: bool,
        track_suffix: bool,
        policies: Mapping[str, Any] | None = None,
        rehearsal: bool = False,
        workspace: WorkspaceProbe | None = None,
    ) -> None:
        self.chain = chain
        self.workspace = workspace
        self.forward_workspace = [0] * len(chain)
        self.backward_workspace = [0] * len(chain)
        self.policies = dict(policies or {})
        self.rehearsal = rehearsal
        self.option_extra_s: list[dict[str, float]] = [{} for _ in range(len(chain))]
        self.stages = stages
        self.first = {first for g, (first, _) in enumerate(groups) if g in backward_groups}
        self.last = {stop - 1 for g, (_, stop) in enumerate(groups) if g in backward_groups}
        self.groups = groups
        self.first_stages = {first for first, _ in groups}
        self.last_stages = {stop - 1 for _, stop in groups}
        self.synchronize = synchronize
        self.times = [(0.0, 0.0)] * len(chain)
        self.next_stage = 0
        self._returned: float | None = None  # when the stage call before returned
        self._grad_mode = False
        # NOTE [suffix on real tensors]
        # With a tracker, the last group is not cut from what follows: its backward runs
        # from the real loss, and the suffix (what runs after the chain: a head, the loss)
        # is tracked on real tensors, as the sized step tracked it on fake ones. A kernel
        # can hold more than its fake counterpart says (as CPU mse_loss keeps its whole
        # elementwise buffer behind the scalar loss), and the suffix is short.
        # the suffix tracker is entered as the last group starts, in the real pass and in its
        # rehearsal alike; the rehearsal also tracks every group (`everything`)
        self.tracker = MemoryTracker(device=device_type, count_fake=True) if track_suffix else None
        self.everything = MemoryTracker(device=device_type, count_fake=True) if track_all else None
        self.track_all = track_all
        self.group_windows: list[tuple[int, int]] = []
        self.stage_starts: list[int] = []  # with track_all: the event each stage call began at
        self.chain_end_event: int | None = None  # and the one the last stage call returned at
        self.last_group_saves = 0  # and the tensors saved before the last group began
        self.input_allocations: list[dict[int, int]] = []  # and what it took from before it
        self.output_allocations: list[dict[int, int]] = []  # and what it returned
        self._group_start = 0
        self.suffix_start_event = 0
        self.gradient_event: int | None = None
        self.gradient_time = 0.0
        self.tracking = False
        self._graph_seen = -1  # NOTE [a group's own graph]

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        entered = self._now()
        if index != self.next_stage:
            raise out_of_order(self.chain, index, self.next_stage, " while timing the stages")
        self.next_stage += 1
        if self._returned is not None:
            # NOTE [glue time]: the model's code since the stage before returned is part of
            # that stage's forward: a replay runs it again after the stage (an attention's
            # product between two nested projections is most of a block's work).
            before_s, before_backward_s = self.times[index - 1]
            self.times[index - 1] = (before_s + entered - self._returned, before_backward_s)
        # the code since the stage before (before the chain: charged to the first stage)
        self._note_workspace(self.forward_workspace, max(index - 1, 0), stored=torch.is_grad_enabled())
        suffix_follows = self.tracker is not None and index == len(self.chain) - 1 and index in self.last
        if self.track_all and index in self.first_stages:
            self._group_start = self._event()
        self._note_input(index, args, kwargs)
        cut: list[torch.Tensor] = []
        if index in self.first:
            self._grad_mode = torch.is_grad_enabled()
            torch.set_grad_enabled(True)
            args, kwargs = _cut_inputs(args, kwargs, self.stages[index])
            cut = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            if self.tracker is not None and self.groups[-1][0] == index:
                self.tracker.__enter__()
                self.tracking = True
        started = self._now()
        with stage_call(index):  # NOTE [elementwise saves in planned stages]: timed as it runs
            out = call_original(module, args, kwargs)
        forward_s = self._now() - started
        if cut:
            out = _not_aliasing(out, cut)
        stage = self.stages[index]
        if stage.forward_work.flops < REPEATED_BELOW_FLOPS and not stage.modifies_input:
            samples = [forward_s]
            # nothing kept: only the repeat's outputs, freed at once (in the elementwise
            # mode where the stage runs in it: its cost per operation is the stage's too)
            with forward_without_grad(), stage_call(index):
                for _ in range(FORWARD_REPEATS):
                    started = self._now()
                    call_original(module, args, kwargs)
                    samples.append(self._now() - started)
            forward_s = statistics.median(samples)
        self._note_workspace(self.forward_workspace, index, stored=torch.is_grad_enabled())
        backward_s = 0.0
        if suffix_follows:
            self._watch_output_gradient(out)  # grad stays on: the pass's no_grad block puts it back
        elif index in self.last:
            out, backward_s = self._group_backward(index, module, args, kwargs, out)
        if index in self.last_stages and not suffix_follows:
            # Autocast's cache would keep every group's casts of weights to the end of the
            # pass; emptied, only one group's are alive at a time (a weight used again later
            # is cast again, to the same values).
            torch.clear_autocast_cache()
            if self.track_all:
                self.group_windows.append((self._group_start, self._event()))
        self._note_output(index, out)
        self.times[index] = (forward_s, backward_s)
        self._returned = self._now()
        return out

    def _note_workspace(self, into: list[int], index: int, *, stored: bool) -> None:
        if self.workspace is not None:
            into[index] = max(into[index], self.workspace.take(stored=stored))

    def _group_backward(
        self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> tuple[Any, float]:
        """Runs the backward of the group ending at `index`; returns its output, detached, and its seconds."""
        backward_s = 0.0
        outputs = [t for t in tensors_in(out) if t.requires_grad]
        leaves, self._graph_seen = _window_leaves(outputs, self._graph_seen)
        if outputs and (leaves is None or leaves):
            started = self._now()
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs], inputs=leaves)
            backward_s = self._now() - started
        del outputs, leaves
        self._note_workspace(self.backward_workspace, index, stored=True)
        if self.policies and index in self.first and not self.stages[index].modifies_input:
            self._time_options(index, module, args, kwargs)
            if self.workspace is not None:  # runs of the same operators, beside what the group holds
                self.workspace.take()
        torch.set_grad_enabled(self._grad_mode)
        return _detached(out), backward_s

    # NOTE [timing store options]
    # With policies to store stages under (NOTE [stored under a policy]), each group of one
    # stage call whose backward is timed is run again, forward and backward, as it is and
    # under each policy, twice (five times for a short stage), taking turns; the extra
    # seconds of a policy are the difference of the quickest runs (its dispatch, and the
    # recompute of what it does not keep). They run after the group's own backward, within the group's window: the
    # rehearsal counts what they need in the group's peak, so the pass keeps its budget.
    def _time_options(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        def run(policy: Any) -> float:
            started = self._now()
            if policy is None:
                out = call_original(module, args, kwargs)
            else:
                out = recompute(call_original, module, args, kwargs, policy=policy)
            outputs = [t for t in tensors_in(out) if t.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            return self._now() - started

        plain_s = math.inf
        best = dict.fromkeys(self.policies, math.inf)
        short = self.stages[index].forward_work.flops < REPEATED_BELOW_FLOPS
        # (on fake tensors one run of each is what the pass needs: their times mean nothing)
        rounds = 1 if self.rehearsal else SHORT_OPTION_ROUNDS if short else OPTION_ROUNDS
        for _ in range(rounds):
            plain_s = min(plain_s, run(None))
            for name, policy in self.policies.items():
                best[name] = min(best[name], run(policy))
        self.option_extra_s[index] = {name: max(0.0, seconds - plain_s) for name, seconds in best.items()}

    def _note_input(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Notes when a stage call began and what it took (when the pass tracks everything)."""
        if self.everything is not None:
            self.stage_starts.append(self._event())
            if index == self.groups[-1][0]:
                self.last_group_saves = self.everything.n_saved
            self.input_allocations.append(self.everything.allocations_of(tensors_in((args, kwargs))))

    def _note_output(self, index: int, out: Any) -> None:
        """Notes what a stage returned, and when the last one did (when the pass tracks everything)."""
        if self.everything is not None:
            self.output_allocations.append(self.everything.allocations_of(tensors_in(out)))
            if index == len(self.chain) - 1:
                self.chain_end_event = self._event()

    def _event(self) -> int:
        return self.everything.n_events if self.everything is not None else 0

    def _watch_output_gradient(self, out: Any) -> None:
        assert self.tracker is not None
        self.suffix_start_event = self.tracker.n_events
        for tensor in tensors_in(out):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_gradient)

    def _on_output_gradient(self, grad: torch.Tensor | None) -> None:
        # the last one to fire marks the moment the whole gradient of the chain output is there
        self.gradient_time = self._now()
        assert self.tracker is not None
        self.gradient_event = self.tracker.n_events

    def estimated(self) -> list[tuple[float, float]]:
        """The times, with the backward of each group not timed estimated from its forwards."""
        times = list(self.times)
        for first, stop in self.groups:
            if first not in self.first:
                forward_s = sum(f for f, _ in times[first:stop])
                times[stop - 1] = (times[stop - 1][0], BACKWARD_PER_FORWARD * forward_s)
        return times


# NOTE [a group's own graph]
# The model's code between two stages of a group runs with grad, and it may make a value
# that later code takes again, not as a stage's input (a RegNet block's residual, made
# after one block's last stage, is taken by the shortcut after the next block's stages;
# a mixture of experts' router logits, kept by the model for its auxiliary loss, are taken
# by the loss). That value carries the earlier group's graph, whose backward has already
# run: a later group's backward, or the loss's, would run into it (an error once its saved tensors are freed; time
# and gradients charged twice before). Autograd numbers its nodes in the order they are
# made, so a group's backward walks its graph from its outputs and stops at the nodes
# an earlier group's graph holds (numbered at most the highest seen there); when it
# stopped at one, the backward runs for the leaves found within the group only.
def _window_leaves(outputs: list[torch.Tensor], seen: int) -> tuple[list[torch.Tensor] | None, int]:
    """The leaves the group's own graph reaches, or None when it reaches no earlier graph;
    and the highest node number of the graphs walked so far."""
    leaves: dict[int, torch.Tensor] = {}
    crossed = False
    highest = seen
    pending: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    visited: dict[int, Any] = {}  # (holding each node: an id is not reused meanwhile)
    while pending:
        node = pending.pop()
        if node is None or id(node) in visited:
            continue
        visited[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):  # AccumulateGrad: a leaf
            leaves[id(variable)] = variable
            continue
        number = node._sequence_nr()
        if number <= seen:
            crossed = True
            continue
        highest = max(highest, number)
        pending.extend(edge for edge, _ in node.next_functions)
    leaves.update((id(t), t) for t in outputs if t.grad_fn is None)  # an output that is a leaf
    return (list(leaves.values()) if crossed else None), highest


def _cut_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], stage: StageMeasurement
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The stage's inputs cut from the pass; those that required grad when sized require it again."""
    leaves, spec = tree_flatten((args, kwargs))
    flags = iter(stage.input_requires_grad)
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            wanted = next(flags, False)
            if wanted and not leaf.requires_grad and (leaf.is_floating_point() or leaf.is_complex()):
                # Not a leaf itself: autocast caches its casts of leaves until its region ends,
                # and the pass must not leave casts of activations behind. An in-place stage
                # works on a copy (its input is the stage before's output, kept by the model).
                cut = leaf.detach().requires_grad_(True)
                leaf = cut.clone() if stage.modifies_input else cut.view_as(cut)
        out.append(leaf)
    return tree_unflatten(out, spec)


def _not_aliasing(out: Any, cut: list[torch.Tensor]) -> Any:
    """`out` with a copy of each tensor that aliases a cut input (a stage that returns its
    input, an ``nn.Identity``): the model's code may change it in place, which a view of a
    leaf that requires grad refuses."""
    storages = {t.untyped_storage()._cdata for t in cut if t.layout == torch.strided}
    leaves, spec = tree_flatten(out)
    copied = [
        leaf.clone()
        if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and leaf.untyped_storage()._cdata in storages
        else leaf
        for leaf in leaves
    ]
    return tree_unflatten(copied, spec)


def _detached(value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    return tree_unflatten([leaf.detach() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def time_groups(
    model: nn.Module,
    chain: Chain,
    stages: list[StageMeasurement],
    groups: list[tuple[int, int]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    backward_groups: frozenset[int] | None = None,
    run_loss: Callable[..., None] | None = None,
    *,
    track_all: bool = False,
    rehearsal: bool = False,
    policies: Mapping[str, Any] | None = None,
    workspace: WorkspaceProbe | None = None,
) -> TimingPass:
    """The seconds of each stage call from one timing pass (see the module), and its suffix's bytes.

    Args:
        model: the model (its state is the caller's to restore).
        chain: the stages.
        stages: the sized step's stage figures (input flags).
        groups: (first, stop) stage indices of each planned stage.
        args: inputs for the pass.
        kwargs: keyword inputs for the pass.
        device: the device the step runs on (synchronised around each timing on a GPU).
        backward_groups: the groups whose backward is timed (None: all); the others run
            their forward without grad, and their backward is estimated.
        run_loss: takes the model's output from the one-element list it is given,
            computes the loss and runs its backward, for the leaves its keyword ``leaves``
            gives (None: the suffix is not measured).
        track_all: track the whole pass, not only the suffix: the peak of each group (a
            rehearsal on fake tensors gives what the real pass will need).
        rehearsal: a pass on fake tensors of ``device``: nothing to synchronise (its
            trackers count that device's storages all the same).
        policies: policies to time the stages under, by name (NOTE [timing store options]).
        workspace: a probe of the device's allocator, run over the whole pass (NOTE
            [device workspaces]): the pass then gives each stage call's workspaces.
    """
    on_device = device.type == "cuda" and not rehearsal
    synchronize = (lambda: torch.cuda.synchronize(device)) if on_device else None
    every = frozenset(range(len(groups)))
    chosen = every if backward_groups is None else backward_groups
    timer = _GroupTimer(
        chain, stages, groups, synchronize, chosen, device.type, track_all, run_loss is not None, policies, rehearsal,
        workspace,
    )  # fmt: skip
    everything = timer.everything if timer.everything is not None else contextlib.nullcontext()
    # what each group saves, to tell a tensor the model holds from one its stage keeps anyway
    saving = timer.everything.saved_tensors_hooks() if timer.everything is not None else contextlib.nullcontext()
    probing = workspace if workspace is not None else contextlib.nullcontext()
    with probing, everything, saving, forward_without_grad():  # NOTE [tensor hooks in runs without grad]
        try:
            with intercept_stages(chain, timer):
                holder = [model(*args, **kwargs)]
            if timer.next_stage != len(chain):
                raise missing_stages(chain, timer.next_stage, " while timing them")
            if timer.tracking and run_loss is not None:
                # drops the output once the loss is computed, as a training loop does; its
                # backward stops at the graphs of the groups before (NOTE [a group's own graph])
                run_loss(holder, leaves=lambda loss: _window_leaves([loss], timer._graph_seen)[0])
            holder.clear()
            ended = timer._now()
            # the code after the chain, with the last group's backward where the loss runs it
            timer._note_workspace(timer.backward_workspace, len(chain) - 1, stored=False)
        finally:
            if timer.tracking and timer.tracker is not None:
                timer.tracker.__exit__(None, None, None)
    times = timer.estimated()
    peaks: tuple[int, ...] = ()
    held: tuple[int, ...] = ()
    held_outputs: tuple[tuple[int, int, int, bool], ...] = ()
    if timer.everything is not None:
        timer.group_windows.append((timer._group_start, timer.everything.n_events))
        peaks = tuple(timer.everything.window(start, stop).peak_bytes for start, stop in timer.group_windows)
        held = _input_held_until(
            timer.everything, timer.stage_starts, timer.input_allocations, timer.output_allocations,
            timer.chain_end_event, set(timer.everything.saved_allocations(timer.last_group_saves)),
        )  # fmt: skip
        held_outputs = _held_outputs(timer.everything, timer.stage_starts, timer.input_allocations)
    options = tuple(timer.option_extra_s)
    workspaces = _workspaces(timer, groups, chosen)
    if timer.tracker is None or timer.gradient_event is None:
        return TimingPass(times, None, peaks, held, held_outputs, options, *workspaces)
    # the last group's backward: from its output's gradient to the end of the step
    last = len(chain) - 1
    times[last] = (times[last][0], ended - timer.gradient_time)
    suffix = timer.tracker.window(timer.suffix_start_event, timer.gradient_event)
    return TimingPass(times, suffix.peak_bytes - suffix.before_bytes, peaks, held, held_outputs, options, *workspaces)


def _workspaces(
    timer: _GroupTimer, groups: list[tuple[int, int]], timed: frozenset[int]
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """What workspaces add to each stage call, forward and backward, and the largest of one
    operator (NOTE [device workspaces])."""
    if timer.workspace is None:
        return (), (), 0
    backward = list(timer.backward_workspace)
    for group, (first, stop) in enumerate(groups):
        if group not in timed:  # not run: the largest the pass saw stands for it
            backward[first:stop] = [timer.workspace.largest_seen] * (stop - first)
    return tuple(timer.forward_workspace), tuple(backward), timer.workspace.largest_seen


# NOTE [inputs the model holds]
# A stage's input can outlive the stage in the model's own code: the input of a container
# (an nn.Sequential of blocks, a ResNet layer) stays referenced by its call until the last
# of its blocks returns, and a forward may keep an early output in a variable. A schedule
# that discards that input after the stage does not free it then. The timing pass runs
# without grad, each group's graph gone at its end, so what keeps a stage's input alive
# there is the model alone: the stage call during which its storage is freed is the last
# one it is held through (to the end of the forward when it outlives the pass). Held past
# the return of the last stage call, while the code after the chain allocates (a Segformer
# stage's reshape copy after its last norm, the caller still holding the stage's input),
# it is held into that code, whose peak the chain output's gradient stands for: `until`
# is then the number of stage calls (NOTE [inputs held after the chain] in
# remat.measure.assemble). (The last group's graph, whose backward runs from the loss,
# holds what it saved into that code too, and the model need not: not counted so.)
def _input_held_until(
    tracker: MemoryTracker,
    starts: list[int],
    inputs: list[dict[int, int]],
    outputs: list[dict[int, int]],
    chain_end: int | None = None,
    saved_by_last_group: set[int] | None = None,
) -> tuple[int, ...]:
    if not starts:
        return ()
    records = tracker.allocation_freed_events([a for taken in inputs for a in taken])
    first_taker: dict[int, int] = {}
    for index, taken in enumerate(inputs):
        for allocation in taken:
            first_taker.setdefault(allocation, index)
    held = []
    for index, taken in enumerate(inputs):
        until = index
        for allocation in taken:
            allocated, freed = records[allocation]
            if allocated < starts[0]:
                continue  # held before the chain began (its input, the prefix): not the chain's
            if first_taker[allocation] < index and allocation not in outputs[index - 1]:
                # an earlier stage took it too, and the stage before did not return it: a
                # side input the model gives several stages (an attention mask made once),
                # held for all of them and counted with the first that takes it, not again
                # with each. (A stage that returns its input, a dropout of probability 0,
                # passes it on: then the next stage takes it from that stage.)
                continue
            # the last stage call that began before the storage was freed
            last = len(starts) - 1 if freed is None else bisect.bisect_left(starts, freed) - 1
            if (
                freed is not None
                and chain_end is not None
                and allocation not in (saved_by_last_group or ())
                and tracker.allocated_bytes(chain_end, freed) > 0
            ):
                last = len(starts)  # held into the code after the chain
            until = max(until, last)
        held.append(until)
    return tuple(held)


# The same pass shows what a stage call, or the model's code after it, makes and the model
# keeps beyond the next stage call without passing it on: a U-Net keeps each down block's
# output for its up block. A schedule that recomputes that stage does not free it then. What
# outlives the pass (the model's output, a gradient) is counted elsewhere, as is what the
# next stage call takes (its input, above).
def _held_outputs(
    tracker: MemoryTracker, starts: list[int], inputs: list[dict[int, int]]
) -> tuple[tuple[int, int, int, bool], ...]:
    if len(starts) < 3:
        return ()
    taken = {a for allocations in inputs for a in allocations}
    made = {
        key: record
        for key, record in tracker.allocation_records(tracker.allocations_since(starts[0])).items()
        if key not in taken
    }
    freed = tracker.allocation_freed_events(made)
    saved = set(tracker.saved_allocations())
    out = []
    for key, record in made.items():
        stage = bisect.bisect_right(starts, record.allocated_event) - 1
        end = freed[key][1]
        if stage >= len(starts) - 2 or end is None:
            continue
        last = bisect.bisect_left(starts, end) - 1
        if last > stage + 1:
            out.append((stage, last, record.nbytes, key in saved))
    return tuple(sorted(out))
