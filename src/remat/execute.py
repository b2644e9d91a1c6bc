"""Running a schedule inside autograd, within the model's own forward.

The executor runs the very list of operations that the simulator checks
(:func:`remat.plan.operations.operations`). It reads it once into a :class:`_Level` per
region (which stage calls the first forward stores, which start a region, which run inside
one, the body each region replays), then intercepts the stage calls of the model's forward:

* ``forward_store``: the stage runs as usual;
* ``forward_offload`` (top level only): the stage runs as usual, and what it and its glue
  save is moved to host memory while the next stage runs forward, then brought back while
  the next stage runs backward (:class:`~remat.manual.offload.StageOffloads`, NOTE [offloaded stages] in
  :mod:`remat.plan.simulate`);
* ``forward_checkpoint``: the stage opens a recording (a recompute frame) that keeps its inputs; it and the
  ``forward_discard`` stages after it save handles only; the region's last stage closes the recording;
* when backward first needs one of those handles, the region's *body* is replayed from
  the kept inputs: its stored stages are run again with their saved tensors kept, and
  each nested region becomes a child frame that keeps only its own inputs, to be
  replayed in turn when backward reaches it (see NOTE [nested recompute frames]);
* the model's own code after a recomputed stage, up to the next stage call (its *glue*:
  a residual addition, a scaling), runs inside the region and is recorded; a replay runs
  it again after the stage to build the next stage's input (NOTE [glue between stages]).

Each stage of a region is replayed with the RNG state (and grad mode) it saw in the forward; normalisation
statistics are updated once (the recompute guard).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat.discover.chain import Chain
from remat.discover.glue import EarlierInputs, Glue, GlueRecorder
from remat.discover.intercept import (
    call_original,
    call_stage,
    compiled_stages,
    intercept_stages,
    missing_stages,
    out_of_order,
    refuse_compiled_state,
)
from remat.errors import RematError
from remat.manual._frames import active_mode
from remat.manual._output_hooks import hook_chain_output
from remat.manual._recording import RegionRecording
from remat.manual._rng import ForwardState, capture_forward_state, replay_forward_state
from remat.manual._state import hold_hooks
from remat.manual._tensors import graph_retained
from remat.manual.elementwise import ElementwiseRecompute
from remat.manual.offload import StageOffloads
from remat.manual.policies import Policy, as_policy
from remat.manual.recompute import recompute
from remat.plan.operations import Operation, OperationKind, PlanTree, operations
from remat.sharded import UnitGathering

__all__ = ["ChainExecutor", "PolicyRunner", "RegionSpan", "SelectiveRuns", "expand_operations", "stage_policies"]

_STORE = OperationKind.FORWARD_STORE
_OFFLOAD = OperationKind.FORWARD_OFFLOAD
_STORES = (_STORE, _OFFLOAD)
_CHECKPOINT = OperationKind.FORWARD_CHECKPOINT
_DISCARD = OperationKind.FORWARD_DISCARD


class RegionSpan(NamedTuple):
    """The stage calls ``[start, stop)`` of a top-level region (what an observer is told)."""

    start: int
    stop: int


def expand_operations(ops: Sequence[Operation], groups: Sequence[tuple[int, int]]) -> list[Operation]:
    """Maps the operations of a schedule over planned stages onto the chain's stage calls.

    A planned stage groups the stage calls ``groups[stage] = (first, stop)``: its forward
    becomes a forward of each call (a checkpoint keeps the first call's input only, the
    others discard), its backward a backward of each call, last first.
    """
    expanded: list[Operation] = []
    for operation in ops:
        if operation.stage is None:
            expanded.append(operation)
            continue
        first, stop = groups[operation.stage]
        if operation.kind is OperationKind.BACKWARD:
            expanded.extend(Operation(operation.kind, call) for call in reversed(range(first, stop)))
        elif operation.kind is _CHECKPOINT:
            expanded.append(Operation(_CHECKPOINT, first))
            expanded.extend(Operation(_DISCARD, call) for call in range(first + 1, stop))
        else:
            expanded.extend(Operation(operation.kind, call, operation.option) for call in range(first, stop))
    return expanded


@dataclass(frozen=True)
class _Step:
    """One step of a level's first forward: a stored stage, or a region of stages."""

    kind: OperationKind  # FORWARD_STORE, FORWARD_OFFLOAD or FORWARD_CHECKPOINT
    start: int
    stop: int
    body: _Level | None = None  # what a region replays
    option: str | None = None  # a stored stage's store option (NOTE [stored under a policy])


@dataclass(frozen=True)
class _Level:
    """The operations of one level (the whole chain, or a region's body), read once."""

    steps: tuple[_Step, ...]


def _read_level(
    ops: Sequence[Operation], start: int, stop: int, where: str, *, top_level: bool = False
) -> tuple[_Level, int]:
    """Reads the level of stages ``[start, stop)`` from ``ops``; returns it and where it ends.

    A level's operations are its first forward (one forward of every stage, in order), the
    loss marker at the top level, then its backward part in reverse order of the steps: a
    stored stage's ``backward``, or a region's body (its own level, ending with the
    backward of the region's first stage).
    """
    steps = _read_first_forward(ops, start, stop, where)
    position = stop - start
    if top_level:
        if position >= len(ops) or ops[position].kind is not OperationKind.LOSS:
            raise RematError(f"{where}: expected the loss marker after the first forward")
        position += 1
    bodies: dict[int, _Level] = {}
    for kind, step_start, step_stop, _ in reversed(steps):
        if kind in _STORES:
            if kind is _OFFLOAD and not top_level:
                raise RematError(f"{where}: stage {step_start} is offloaded inside a region (top level only)")
            expected = Operation(OperationKind.BACKWARD, step_start)
            if position >= len(ops) or ops[position] != expected:
                found = ops[position] if position < len(ops) else "the end"
                raise RematError(f"{where}: expected {expected}, found {found}")
            position += 1
        else:
            body, used = _read_level(ops[position:], step_start, step_stop, f"{where}, region {step_start}")
            bodies[step_start] = body
            position += used
    level = _Level(tuple(_Step(kind, a, b, bodies.get(a), option) for kind, a, b, option in steps))
    return level, position


def _read_first_forward(ops: Sequence[Operation], start: int, stop: int, where: str) -> list[list[Any]]:
    """The steps of a level's first forward, as ``[kind, start, stop, option]``: stores and regions."""
    steps: list[list[Any]] = []
    for position, stage in enumerate(range(start, stop)):
        operation = ops[position] if position < len(ops) else None
        if operation is None or not operation.kind.is_forward or operation.stage != stage:
            raise RematError(f"{where}: expected a forward of stage {stage}, found {operation}")
        if operation.kind is _DISCARD:
            if not steps or steps[-1][0] is not _CHECKPOINT:
                raise RematError(f"{where}: {operation} is not inside a region")
            steps[-1][2] = stage + 1
        else:
            steps.append([operation.kind, stage, stage + 1, operation.option])
    return steps


def _read_schedule(ops: Sequence[Operation], n_calls: int) -> _Level:
    level, used = _read_level(ops, 0, n_calls, "schedule", top_level=True)
    if used != len(ops):
        raise RematError(f"the schedule has {len(ops) - used} operations after its last backward")
    return level


class _Run:
    """The state of one forward of the chain: what the replays will need."""

    def __init__(self, executor: ChainExecutor) -> None:
        self.executor = executor
        self.next_stage = 0
        self.recording: RegionRecording | None = None
        self.states: dict[int, ForwardState] = {}
        #: the glue recorded after each recomputed stage (NOTE [glue between stages]), until
        #: its last replay (NOTE [glue released after its last replay])
        self.glues: dict[int, Glue] = {}
        self.replays_left = dict(executor.replays)
        # a recomputed stage whose glue is running: its discarding context, the recorder
        self._open: tuple[Any, GlueRecorder, _Step] | None = None
        self.offloads = StageOffloads()
        self.earlier = EarlierInputs(executor.taken_again) if executor.taken_again else None
        self.elementwise = ElementwiseRecompute(scoped_stages=executor.elementwise)  # (none: nothing scoped)
        self.without_grad: set[int] = set()  # stage calls the model made under no_grad, replayed so

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        executor = self.executor
        if index != self.next_stage:
            raise out_of_order(executor.chain, index, self.next_stage)
        self.next_stage += 1
        if not torch.is_grad_enabled():
            self.without_grad.add(index)
        self.offloads.before(index, (args, kwargs))
        self._end_glue(args, kwargs)
        if self.earlier is not None:  # NOTE [constants an earlier stage takes] in remat.discover.glue
            self.earlier.called(index, _tensors((args, kwargs)))
        kind, step = executor.first_forward[index]
        if kind is _OFFLOAD and index < len(executor.chain) - 1:
            self.offloads.open(index, module, (args, kwargs))
        if step.option is not None:  # NOTE [stored under a policy]
            out = recompute(call_stage, module, args, kwargs, **self.executor.option_arguments(step.option))
        elif kind in _STORES:
            with self.elementwise.scoped(index):
                out = call_original(module, args, kwargs)
        else:
            out = self._call_in_region(index, kind, step, module, args, kwargs)
        self.offloads.after(index, out)
        if index == len(executor.chain) - 1 and torch.is_grad_enabled():
            hook_chain_output(out, recomputes=executor.recomputes())
        return out

    # NOTE [glue between stages]
    # The model's own code between a recomputed stage and the next stage call (a residual ``x = x + block(x)``, a
    # scaling, a concatenation) runs inside the stage's region: what it saves is discarded with the stage's
    # tensors, and it is recorded (remat.discover.glue) so that the replay runs it again after the stage.
    def _call_in_region(
        self,
        index: int,
        kind: OperationKind,
        step: _Step,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        executor = self.executor
        if not executor.chain.whole_model:
            self.states[index] = capture_forward_state((args, kwargs), preserve_rng_state=executor.preserve_rng_state)
        if kind is _CHECKPOINT:
            assert step.body is not None
            observer = executor.observer(RegionSpan(step.start, step.stop)) if executor.observer else None
            # A model's forward replays each stage, with its glue, from the state captured
            # above (NOTE [random state of replayed stages]): the region's own capture, at
            # the same moment as its first stage's, would only be set and put back around them.
            self.recording = RegionRecording(
                _Replay(self, step.body),
                (args, kwargs),
                {},
                preserve_rng_state=executor.preserve_rng_state and executor.chain.whole_model,
                observer=observer,
            )
        recording = self.recording
        assert recording is not None
        discarding = recording.stage()
        discarding.__enter__()
        try:
            out = call_original(module, args, kwargs)
        except BaseException:
            discarding.__exit__(None, None, None)
            raise
        if index == len(executor.chain) - 1:
            discarding.__exit__(None, None, None)
            self._close_region(index, step)
        else:
            discarding.stage_returned()
            recorder = GlueRecorder(_tensors((args, kwargs)), _tensors(out))
            recorder.start()
            self._open = (discarding, recorder, step)
        return out

    def _end_glue(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Ends the glue of the stage before (if it is recomputed): the next stage is called."""
        if self._open is None:
            return
        discarding, recorder, step = self._open
        self._open = None
        index = self.next_stage - 2
        try:
            self.glues[index] = recorder.finish(args, kwargs)
            if self.earlier is not None:
                self.earlier.recorded(index, self.glues[index], recorder)
        finally:
            discarding.__exit__(None, None, None)
        self._close_region(index, step)

    def _close_region(self, index: int, step: _Step) -> None:
        if index == step.stop - 1 and self.recording is not None:
            self.recording.close()
            self.recording = None

    def abort(self) -> None:
        """Leaves an open glue recording (the forward failed, or ended early)."""
        self.offloads.abort()
        if self._open is not None:
            discarding, recorder, _ = self._open
            self._open = None
            try:
                recorder.stop()
            finally:
                discarding.__exit__(None, None, None)

    def run_level(self, level: _Level, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Replays a level from its first stage's inputs; returns the inputs of the stage after it."""
        with self.earlier.replay() if self.earlier is not None else contextlib.nullcontext():
            return self._run_steps(level, args, kwargs)

    def _run_steps(self, level: _Level, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for step in level.steps:
            if step.kind in _STORES:
                # the stage takes its inputs from the holder: what its glue does not use is
                # freed before the glue runs, as in the first forward (NOTE [glue between stages])
                holder = [(args, kwargs)]
                del args, kwargs
                args, kwargs = self._replay_stage(step.start, holder, step.option)
            else:
                assert step.body is not None
                args, kwargs = recompute(_Replay(self, step.body), args, kwargs)
        return args, kwargs

    def _replay_stage(
        self, stage: int, holder: list[Any], option: str | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # NOTE [random state of replayed stages]
        # The model's own code between stages may draw random numbers, so each stage of a model's forward is
        # replayed from the state it started with, its glue after it (and without grad if it ran so). In an
        # nn.Sequential nothing runs between stages: the region's frame replays from the region's start and the
        # stages draw in order (a state restored around each stage would rewind it for the next one).
        state = self.states.get(stage)
        module = self.executor.chain.modules[stage]
        args, kwargs = holder.pop()
        if self.earlier is not None:
            self.earlier.replaying(stage, _tensors((args, kwargs)))
        if self.executor.gathering is not None:  # NOTE [FSDP2 units] in remat.sharded
            self.executor.gathering.before(stage)
        with (
            replay_forward_state(state) if state is not None else contextlib.nullcontext(),
            torch.no_grad() if stage in self.without_grad else contextlib.nullcontext(),
        ):
            if option is not None:
                out = recompute(call_stage, module, args, kwargs, **self.executor.option_arguments(option))
            else:
                with self.elementwise.scoped(stage, replay=True):
                    out = call_stage(module, args, kwargs)
            if stage == len(self.executor.chain) - 1:  # the chain's last stage: nothing follows it
                return (out,), {}
            glue = self._glue_for_replay(stage)
            values = _tensors((args, kwargs)) + _tensors(out)
            del args, kwargs, out
            if self.earlier is None:
                return glue.replay(values)
            replayed = glue.replay(values, self.earlier.input, self.earlier.keeper(stage))
            self.earlier.glue_replayed(stage)
            return replayed

    # NOTE [glue released after its last replay]
    # What a stage's glue keeps for its replays (the tensors it takes as they are: a block's input that its query
    # and value projections, run as glue, take beside its key's stage) is needed until the schedule's last replay
    # of that stage, before the stage's backward. The plan counts it until then (remat.plan.lifetimes); kept to the
    # end of the step, it outlived its count through the backward of every stage before (a CvT's nested plans
    # went 5% over). A retained graph may be replayed again: then everything is kept.
    def _glue_for_replay(self, stage: int) -> Glue:
        glue = self.glues.get(stage)
        if glue is None:
            raise RematError(
                f"stage {stage} ({self.executor.chain.names[stage]!r}) was replayed more often than its schedule "
                "plans: its glue was released after its last planned replay"
            )
        left = self.replays_left.get(stage, 0) - 1
        self.replays_left[stage] = left
        if left <= 0 and not graph_retained():
            del self.glues[stage]
        return glue


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


#: Python frames one level of nested regions may take, replayed or read (with room to spare).
_FRAMES_PER_LEVEL = 64


@contextlib.contextmanager
def _room_for(levels: int) -> Iterator[None]:
    """Raises Python's recursion limit, while inside, for ``levels`` more nested levels.

    A plan for the smallest budget of a long chain nests a region in every body: replaying
    one body replays every body inside it, level by level, one call within another. The
    limit is put back on the way out, unless someone else changed it meanwhile.
    """
    before = sys.getrecursionlimit()
    wanted = before + _FRAMES_PER_LEVEL * levels
    sys.setrecursionlimit(wanted)
    try:
        yield
    finally:
        if sys.getrecursionlimit() == wanted:
            sys.setrecursionlimit(before)


class _Replay:
    """Replays a region body: the function behind a recompute frame."""

    def __init__(self, run: _Run, body: _Level) -> None:
        self.run, self.body = run, body
        self.__qualname__ = f"stages {body.steps[0].start}.."
        # its stages' parameters are put back for its replays (NOTE [parameters swapped in for a call])
        self.block_modules = run.executor.chain.modules[body.steps[0].start : body.steps[-1].stop]

    @torch._dynamo.disable  # (a backward in a compiled step: compiled, it saved other tensors than the forward)
    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _room_for(1):
            return self.run.run_level(self.body, args, kwargs)


class ChainExecutor:
    """Runs a schedule over a chain's stage calls inside the model's forward.

    Args:
        chain: the stages.
        schedule: the schedule's operations over the chain's stage calls (see
            :func:`expand_operations`), or a plan tree, which stands for its operations.
        preserve_rng_state: replay RNG states in recomputed stages.
        observer: ``observer(span)`` gives the observer of each top-level region's
            recording (see :class:`remat.manual._recording.RegionRecording`); ``span`` is
            the region's :class:`RegionSpan`. Used by measurement.
        policies: the policy of each store option the schedule names, by name; a stage
            stored under one runs as :func:`remat.recompute` under it.
        taken_again: ``(stage, glue's stage)`` stage calls whose glue takes what the first
            took as its input, or what its glue made, from the replay (NOTE [constants an earlier stage takes] in
            remat.discover.glue); the schedule's regions must allow it.
        elementwise: the stage calls that, stored, leave what they save and cheap elementwise
            operations can make again to backward (NOTE [elementwise saves in planned stages]).

    Raises:
        RematError: the operations are not a schedule of the chain's stage calls.
    """

    def __init__(
        self,
        chain: Chain,
        schedule: Sequence[Operation] | PlanTree,
        *,
        preserve_rng_state: bool = True,
        observer: Callable[[RegionSpan], Any] | None = None,
        policies: Mapping[str, Policy] | None = None,
        taken_again: frozenset[tuple[int, int]] = frozenset(),
        elementwise: Collection[int] = (),
    ) -> None:
        self.chain, self.elementwise = chain, frozenset(elementwise)
        self.taken_again = taken_again
        self.policies = dict(policies or {})
        ops = [item for item in schedule if isinstance(item, Operation)]
        self.operations = tuple(ops) if len(ops) == len(schedule) else tuple(operations(tuple(schedule)))  # type: ignore[arg-type]
        self.preserve_rng_state = preserve_rng_state
        self.observer = observer
        # how often the backward replays each stage call (NOTE [glue released after its last replay])
        loss = next((i for i, op in enumerate(self.operations) if op.kind is OperationKind.LOSS), len(self.operations))
        self.replays = Counter(op.stage for op in self.operations[loss:] if op.kind.is_forward and op.stage is not None)
        with _room_for(len(chain)):  # the levels nest at most as deep as the chain is long
            level = _read_schedule(self.operations, len(chain))
        missing = sorted({op.option for op in self.operations if op.option is not None} - set(self.policies))
        if missing:
            raise RematError(
                f"the schedule stores stages under the store options {missing}, whose policies were not given: "
                f"pass them as policy= (the options given: {sorted(self.policies)})"
            )
        # How the first forward runs each stage call, and the region it belongs to.
        self.first_forward: list[tuple[OperationKind, _Step]] = [
            (_DISCARD if step.kind is _CHECKPOINT and call > step.start else step.kind, step)
            for step in level.steps
            for call in range(step.start, step.stop)
        ]
        compiled = compiled_stages(chain)
        if compiled:
            offloaded = [chain.names[call] for call in compiled if self.first_forward[call][0] is _OFFLOAD]
            if offloaded:
                raise NotImplementedError(
                    f"the plan offloads stages compiled with torch.compile ({', '.join(offloaded)}): offload of "
                    "compiled code is not built. Plan without offload, or compile the whole model instead"
                )
            kinds = self.first_forward
            refuse_compiled_state(chain, [c for c in compiled if kinds[c][0] not in _STORES or kinds[c][1].option])
            hold_hooks(self)  # the compiled stages' code guards on them (see hold_hooks)

        # NOTE [nothing to recompute]
        # A schedule that stores every stage call (a budget of 1.0, or any budget the plain
        # step fits in) is the plain step: the model runs its own forward, with no stage
        # intercepted, so such a plan costs no time at all. What the executor would check
        # (every stage called once, in order) matters only to a replay, and there is none.
        stored = all(kind is _STORE and not step.option for kind, step in self.first_forward)
        self.plain = stored and not self.elementwise
        self.gathering: UnitGathering | None = None  # the FSDP2 units of the model it first runs

    def recomputes(self) -> bool:
        """Whether any stage call is recomputed (not stored by its first forward, or stored under a policy)."""
        return any(kind not in _STORES or step.option is not None for kind, step in self.first_forward)

    def option_arguments(self, option: str) -> dict[str, Any]:
        """The keyword arguments of :func:`remat.recompute` for a stage stored under `option`."""
        return {"policy": self.policies[option], "preserve_rng_state": self.preserve_rng_state}

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs ``model(*args, **kwargs)`` with the schedule applied to its chain."""
        if active_mode() is not None:
            # Inside a block that remat.recompute is already recomputing: that block's
            # frame decides what is kept, the chain runs as plain code inside it.
            return model(*args, **kwargs)
        if self.plain:  # NOTE [nothing to recompute]
            out = model(*args, **kwargs)
            if torch.is_grad_enabled():
                hook_chain_output(out, recomputes=False)
            return out
        if self.gathering is None:
            self.gathering = UnitGathering(model, self.chain.modules)
        run = _Run(self)
        try:
            with intercept_stages(self.chain, run):
                out = model(*args, **kwargs)
        finally:
            run.abort()
        if run.next_stage != len(self.chain):
            raise missing_stages(self.chain, run.next_stage)
        return out


class PolicyRunner:
    """Runs each stage call of a chain as its own recomputed block under a policy.

    The automatic mode with ``policy=`` and no budget: selective recompute of every stage
    (or of the stages a mapping names), with no plan. A stage whose policy is None runs
    as it is (stored).

    Args:
        chain: the stages.
        policies: a policy per stage (None: the stage is stored).
        preserve_rng_state: replay RNG states in recomputed stages.
    """

    def __init__(self, chain: Chain, policies: Sequence[Any], *, preserve_rng_state: bool = True) -> None:
        self.chain = chain
        self.policies = tuple(policies)
        self.preserve_rng_state = preserve_rng_state

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        policy = self.policies[index]
        if policy is None:
            return call_original(module, args, kwargs)
        return recompute(call_stage, module, args, kwargs, policy=policy, preserve_rng_state=self.preserve_rng_state)

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs ``model(*args, **kwargs)`` with each stage call recomputed under its policy."""
        if active_mode() is not None:
            return model(*args, **kwargs)
        with intercept_stages(self.chain, self):
            return model(*args, **kwargs)


def stage_policies(policy: Any, chain: Chain) -> list[Policy | None]:
    """The policy of each stage: one for all, or a mapping by stage name or index (others stored)."""
    if not isinstance(policy, Mapping):
        return [as_policy(policy)] * len(chain)
    chosen: list[Policy | None] = [None] * len(chain)
    for key, value in policy.items():
        if isinstance(key, int) and not isinstance(key, bool) and -len(chain) <= key < len(chain):
            index = key % len(chain)
        elif isinstance(key, str) and key in chain.names:
            index = chain.names.index(key)
        else:
            raise RematError(
                f"policy names the stage {key!r}, which is not in the model's chain; its stages are "
                f"{list(chain.names)} (or their indices 0..{len(chain) - 1})"
            )
        chosen[index] = None if value is None else as_policy(value)
    return chosen


class SelectiveRuns:
    """The automatic mode's ``policy=`` without a budget: a :class:`PolicyRunner` per input signature.

    Raises:
        RematError: `policy` is not a policy (nor a mapping of stages to policies).
    """

    def __init__(self, policy: Any, preserve_rng_state: bool) -> None:
        if not isinstance(policy, Mapping):
            as_policy(policy)  # fail now on a value that is not a policy
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.runners: dict[Any, PolicyRunner] = {}  # by input signature

    def run(self, key: Any, chain: Callable[[], Chain], model: nn.Module, args: Any, kwargs: Any) -> Any:
        """Runs a training call; `chain` gives the model's chain for `key` (discovered once)."""
        runner = self.runners.get(key)
        if runner is None:
            found = chain()
            policies = stage_policies(self.policy, found)
            runner = self.runners[key] = PolicyRunner(found, policies, preserve_rng_state=self.preserve_rng_state)
        return runner(model, args, kwargs)
