"""The hook-based implementation of recompute: nested recompute frames.

Every tensor autograd saves inside a recomputed block is replaced by a handle
(``torch.autograd.graph.saved_tensors_hooks``); when backward first needs one, the block
runs again from its kept inputs and fills the handles (see NOTE [nested recompute
frames]). :class:`RegionRecording` opens such a frame over several stage calls, for the
executor of a schedule.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from remat._inherited import InheritedStack
from remat.errors import NondeterministicRecompute, RematError
from remat.manual import _debug, _selective, _state
from remat.manual._inputs import dual_level_for, ended_first_forward, has_tangents, kept_tensor, materialised
from remat.manual._outputs import lazy_output, register_outputs
from remat.manual._outside import ModuleSlots, ParametersRead, held_inside
from remat.manual._rng import ForwardState, capture_forward_state, replay_forward_state
from remat.manual._spans import Span, recorded_span
from remat.manual._tensors import RecomputeOptions, TensorMeta, graph_retained
from remat.manual.elementwise import filling, read_held
from remat.memory import note_kept_for_backward

__all__ = ["active_mode", "recompute_with_hooks"]


# =========================================================================== hooks
# NOTE [nested recompute frames]
# A *frame* is one execution of a recomputed block. Every tensor saved for backward while
# a block runs for the first time becomes a handle numbered in the order it was saved,
# and the numbering belongs to the outermost frame (the root): blocks nested inside a
# block that is running for the first time simply run inside it. When backward needs a
# handle that holds nothing, the frame that owns it is recomputed ("fill" mode): its
# saved tensors are stored into the root's handles, in the same order. A nested block
# met during that recompute does not materialise anything: it becomes a child frame that
# keeps its own inputs and takes ownership of the handles its operations would fill
# ("skip" mode), and it is recomputed in turn only when backward reaches one of them.
# This is what makes the optimal schedules of the planner executable: a region's body
# is a sequence of stored stages and nested regions, and only the stored stages'
# activations are materialised when the region is recomputed.
#
# The first forward records where each nested block's handles start and stop (a tree of
# spans). When a recompute meets a nested block, the child takes its whole span at once;
# if the recompute needs nothing beyond that span, it stops right there instead of
# running the child only to throw its work away, and the child first runs when backward
# reaches it. So a block nested last in its parent runs once per recompute of its own,
# not once more for its parent's.
#
# Each recomputed tensor lives in its handle, which lives as long as the autograd node that
# saved it: the memory goes as soon as that node has run.

# NOTE [backward inside a block]
# A block may run a backward inside its own forward (torch.autograd.grad for a gradient
# penalty, a physics-informed loss, an inner meta-learning step). That backward needs
# tensors the block saved a moment ago, which are already handles: the root is filled
# from its kept inputs while its first forward is still running (its inputs are kept
# until that forward ends); such a fill stops where the first forward has got to. From
# then on the root is marked: its recomputes give what they save to their own graph as
# well, because the replayed block runs that inner backward again on the recompute's own
# graph (the tensors live until the recompute ends). They are given as detached aliases,
# which autograd joins to its graph again when it unpacks them: a tensor given as itself to
# the node that made it (tanh keeps its output) is a reference cycle through C++ nodes the
# garbage collector cannot see (a leak every step). Other blocks keep nothing there.


class _StopRecompute(BaseException):
    """Raised inside a recompute once every needed handle is filled."""


class _Handle:
    __slots__ = ("root", "index", "value", "filler", "__weakref__")

    def __init__(self, root: _Root, index: int) -> None:
        self.root, self.index = root, index
        self.value: torch.Tensor | None = None
        self.filler: _Frame | None = None  # the frame whose recompute gave `value`


class _Frame:
    @_selective.as_internal
    def __init__(
        self,
        root: _Root | None,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: RecomputeOptions,
        start: int,
    ) -> None:
        # A child refers to its root weakly: the root owns its children (`owners`) and lives while a handle does.
        self._root_ref = None if root is None else weakref.ref(root)
        self.function = function
        self.name = getattr(function, "__qualname__", None) or type(function).__name__
        flat, self.spec = tree_flatten((args, kwargs))
        self.inputs: list[Any] = []
        self.versions: list[Any] = []  # (or what another input holds: NOTE [tensors inside other inputs])
        for value in flat:
            lazy = lazy_output(value)
            if lazy is not None:
                self.inputs.append(lazy)
                self.versions.append(None)
            elif isinstance(value, torch.Tensor):
                self.inputs.append(kept_tensor(value))
                self.versions.append(value._version)
                if root is None:  # measured: kept until the block's backward, as if saved
                    note_kept_for_backward(value)
                    explaining = _selective.explain_observer()
                    if explaining is not None:
                        explaining.on_saved(value, discarded=False)
            else:
                self.inputs.append(value)
                self.versions.append(held_inside(value))
        self.tangents = has_tangents(self.inputs, self.versions)  # NOTE [forward-mode tangents of inputs]
        self.options = options
        self.state: ForwardState = capture_forward_state(flat, preserve_rng_state=options.preserve_rng_state)
        self.start = start
        self.stop: int | None = None
        self.cursor = start
        # the number of the block's first module call in its root's sequence (see
        # NOTE [module state during recompute])
        self.first_call = 0
        self.output_recompute = False
        self.cached_outputs: list[tuple[Any, bool]] | None = None
        self.observer: Any = None  # see RegionRecording
        # the spans recorded by the first forward, when known (see NOTE [nested recompute frames])
        self.span: Span | None = None
        # its policy block's ordinal (None: it keeps nothing), the ordinal its nested policy
        # blocks start from, and the next one while it runs (see NOTE [selective recompute])
        self.policy_key: int | None = None
        self.policy_start = 0
        self.policy_cursor = 0

    @property
    def root(self) -> _Root:
        if self._root_ref is None:
            return self  # type: ignore[return-value]
        root = self._root_ref()
        if root is None:  # pragma: no cover - a child only runs while its root lives
            raise RematError("internal error: a recompute frame outlived its root")
        return root

    # -- inputs
    def _materialise_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = tree_unflatten(materialised(self.inputs, self.versions, self.name), self.spec)
        return args, kwargs

    def note_held(self) -> None:
        """Its first forward ended: the versions its recomputes check (and what its other inputs hold)."""
        self.versions = ended_first_forward(self.inputs, self.versions, self.name)

    def release_inputs(self) -> None:
        self.inputs = []

    # -- running
    def run(self, mode: str) -> Any:
        """Re-runs the block in `mode` ("fill" or "outputs")."""
        if not self.tangents:
            return self._run(mode)
        with dual_level_for():  # NOTE [forward-mode tangents of inputs]
            return self._run(mode)

    def _run(self, mode: str) -> Any:
        if not self.inputs and self.spec.num_leaves:
            raise RematError(
                f"the recomputed block {self.name!r} was asked to run again after its inputs were "
                "released; this happens when backward runs twice through a recomputed block "
                "without retain_graph=True"
            )
        root = self.root
        root.parameters.started()
        args, kwargs = self._materialise_inputs()
        self.cursor = self.start
        last_needed = root.last_needed(self) if mode == "fill" else None
        if mode == "fill" and last_needed is None:
            return None
        observer = self.observer if self._root_ref is None else None
        if observer is not None:
            observer.on_recompute(True)
        _STACK.push(_Context("fill", self, last_needed))
        self.policy_cursor = self.policy_start
        trace = None
        try:
            try:
                with (
                    torch.enable_grad(),
                    root.slots.put_back(),
                    replay_forward_state(self.state),
                    _state.recomputing(root.state_log, self.first_call),
                    self.options.recompute_context(self.name),
                    _debug.traced(self.options.debug) as trace,
                    _selective.replaying_block(root, self.policy_key, self.options, consume=self._last_run(mode)),
                ):
                    try:
                        with _state.module_call(self.function):
                            out = self.function(*args, **kwargs)
                    except _StopRecompute:
                        out = None
            finally:
                _STACK.pop()
                root.parameters.ran()
            if mode == "fill":
                self._finish_fill()
        except NondeterministicRecompute as error:
            original, op_start = _debug.original_ops(root, self.span)
            raise _debug.explained(error, original, trace, op_start) from None
        if observer is not None:
            observer.on_recompute(False)
        return out

    def _last_run(self, mode: str) -> bool:
        """Whether this fill is the frame's last run (see NOTE [selective recompute])."""
        root = self.root
        return mode == "fill" and not self.output_recompute and root.stop is not None and not graph_retained()

    def _finish_fill(self) -> None:
        root = self.root
        if root.last_needed(self) is not None:
            raise NondeterministicRecompute(
                f"the recompute of block {self.name!r} saved {self.cursor - self.start} tensors "
                f"for backward, the original forward saved {(self.stop or 0) - self.start}; the block "
                "must run the same operations when it is recomputed (check control flow that "
                "depends on global state, and use remat.is_recomputing() for side effects)"
            )
        # Every live handle this frame owned is filled or owned by a child: the kept inputs are no longer
        # needed (the first operations hold them if they saved them), unless the first forward is still
        # running (a backward inside the block's own forward filled it) and more handles will come.
        if not self.output_recompute and root.stop is not None and not graph_retained():
            self.release_inputs()
            if root.cache is not None:
                root.cache.release(self.policy_key)

    def outputs_for_recompute(self) -> list[tuple[torch.Tensor, bool]]:
        """The block's recomputed outputs, cut from the recompute's graph (with their flags)."""
        if self.cached_outputs is None:
            out = self.run("outputs")
            self.cached_outputs = [
                (leaf.detach(), leaf.requires_grad) if isinstance(leaf, torch.Tensor) else (leaf, False)
                for leaf in tree_leaves(out)
            ]
        return self.cached_outputs


class _Root(_Frame):
    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: RecomputeOptions,
    ) -> None:
        super().__init__(None, function, args, kwargs, options, start=0)
        self.handles: list[weakref.ref[_Handle]] = []
        self.metas: list[TensorMeta] = []
        self.owners: list[_Frame | None] = []
        self.open_spans: list[Span] = []  # while the first forward runs: innermost last
        self.state_log = _state.StateLog()
        # debug=True: the first forward's trace while it runs, then its operations (NOTE [op traces])
        self.trace: _debug.OpTrace | None = None
        self.original_ops: list[Any] | None = None
        # whether a backward ran inside the first forward (see NOTE [backward inside a block])
        self.inner_backward = False
        # the outputs its policy blocks kept, and how many policy blocks its first forward
        # entered so far (see NOTE [selective recompute])
        self.cache: _selective.OpCache | None = None
        self.policy_blocks = 0
        self.parameters = ParametersRead()  # NOTE [parameters changed before the recompute]
        self.slots = ModuleSlots(function)  # NOTE [parameters swapped in for a call]

    def end_first_forward(self) -> int:
        """Its first forward ended: what it saved is numbered. Returns how many it saved."""
        self.stop = len(self.handles)
        self.parameters.ended()
        self.note_held()
        return self.stop

    def last_needed(self, frame: _Frame) -> int | None:
        """Index of the last live, empty handle `frame` is responsible for."""
        stop = len(self.handles) if frame.stop is None else min(frame.stop, len(self.handles))
        for index in range(stop - 1, frame.start - 1, -1):
            handle = self.handles[index]()
            if handle is not None and handle.value is None and _owner(self, index) is frame:
                return index
        return None


_ROOT_OWNER: Any = object()  # owner entry meaning "the root itself" (no reference cycle)


def _owner(root: _Root, index: int) -> _Frame | None:
    owner = root.owners[index]
    return root if owner is _ROOT_OWNER else owner


class _Context:
    __slots__ = ("mode", "frame", "last_needed", "children_met", "hooks", "stop_at_next", "previous_fillable")
    previous_fillable: tuple[torch.Size, torch.dtype] | None

    def __init__(self, mode: str, frame: _Frame, last_needed: int | None = None) -> None:
        self.mode, self.frame, self.last_needed = mode, frame, last_needed  # mode: "discard", "fill" or "skip"
        self.children_met = 0  # nested blocks met so far by this fill
        self.stop_at_next, self.previous_fillable = False, None  # NOTE [an early stop waits for the next save]


class _Stack:
    """The stack of active frames, kept in step with the saved-tensor hooks; a backward's
    threads start from the stack of the thread that started it (NOTE [state a backward's
    threads inherit])."""

    def __init__(self) -> None:
        self._stack: InheritedStack[_Context] = InheritedStack("remat.frames")

    @property
    def items(self) -> list[_Context]:
        return self._stack.items

    def top(self) -> _Context | None:
        return self._stack.top()

    def push(self, context: _Context) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()  # first: if it raises, nothing is left pushed
        context.hooks = hooks  # type: ignore[attr-defined]
        self._stack.push(context)

    def pop(self) -> None:
        context = self._stack.pop()
        context.hooks.__exit__(None, None, None)  # type: ignore[attr-defined]


_STACK = _Stack()


def _discarded(root: _Root, tensor: torch.Tensor) -> _Handle:
    """A tensor saved by a first forward: a handle that the recompute fills."""
    if root.observer is not None:
        root.observer.on_discarded(tensor)
    if root.cache is not None:  # NOTE [keeping only what the recompute reads]
        root.cache.saved(tensor)
    if (explaining := _selective.explain_observer()) is not None:
        explaining.on_saved(tensor, discarded=True)
    root.parameters.saw(tensor)
    handle = _Handle(root, len(root.handles))
    root.handles.append(weakref.ref(handle))
    root.metas.append(TensorMeta.of(tensor))
    root.owners.append(_ROOT_OWNER)
    return handle


@_selective.as_internal
def _pack(tensor: torch.Tensor) -> Any:
    context = _STACK.top()
    if context is None:  # pragma: no cover - hooks are pushed with a context
        return tensor
    frame, root = context.frame, context.frame.root
    if context.mode == "discard":
        return _discarded(root, tensor)
    if context.stop_at_next:  # (a fill's: NOTE [an early stop waits for the next save])
        raise _StopRecompute
    index = frame.cursor
    frame.cursor += 1
    if context.mode == "skip":
        if index < len(root.owners):
            root.owners[index] = frame
        return tensor.detach() if root.inner_backward else None
    if root.parameters.changed:  # NOTE [parameters changed before the recompute]
        root.parameters.read(tensor, frame.name)
    if root.stop is None and index >= len(root.handles):  # a fill past where the first forward has
        raise _StopRecompute  # got to (NOTE [backward inside a block]): nothing more is needed
    if frame.stop is not None and index >= frame.stop or index >= len(root.handles):
        raise NondeterministicRecompute(
            f"the recompute of block {frame.name!r} saved more tensors for backward than the "
            f"original forward ({index - frame.start + 1} > {(frame.stop or len(root.handles)) - frame.start}); "
            "the block must run the same operations when it is recomputed"
        )
    filled = root.handles[index]()
    if filled is not None and filled.value is None and _owner(root, index) is frame:
        expected = root.metas[index]
        if frame.options.checks and TensorMeta.of(tensor) != expected:
            raise NondeterministicRecompute(
                f"the recompute of block {frame.name!r} saved a tensor of shape {tuple(tensor.shape)}, "
                f"{tensor.dtype} on {tensor.device} where the original forward saved "
                f"{tuple(expected.shape)}, {expected.dtype} on {expected.device} (saved tensor "
                f"#{index - frame.start}); the block must compute the same thing when recomputed"
            )
        # A tensor that does not require grad is kept as itself (often the very object the
        # original forward saved: a constant, a buffer, an input without grad); a planned
        # replay may hold a recipe instead (NOTE [elementwise saves in planned stages]).
        value = tensor.detach() if tensor.requires_grad else tensor
        filled.value = value if (planned := filling()) is None else planned.hold(tensor, value)
        filled.filler = frame
        root.owners[index] = None
    fresh = not (tensor.requires_grad or tensor._version or isinstance(tensor, torch.nn.Parameter))
    fillable = (tensor.shape, tensor.dtype) if fresh and tensor.is_floating_point() else None
    if context.last_needed is not None and index >= context.last_needed and frame.options.early_stop:
        # NOTE [an early stop waits for the next save]
        # All this frame must provide is there (children met own the rest). But an operation saves its
        # inputs before it runs, and may then fill one (F.rrelu's noise, with no version bump): stopping
        # now would hand backward it unfilled (torch's checkpoint does: wrong rrelu gradients). rrelu saves
        # its noise, float, without grad, never changed, then its input, of that shape and type, requiring
        # grad: after such a pair the stop waits for the next tensor saved (a later operation's) or the end.
        if not (tensor.requires_grad and context.previous_fillable == (tensor.shape, tensor.dtype)):
            raise _StopRecompute
        context.stop_at_next = True
    context.previous_fillable = fillable
    return tensor.detach() if root.inner_backward else None


def _unpack(handle: Any) -> torch.Tensor:
    if not isinstance(handle, _Handle):
        if handle is None:
            raise RematError(
                "a tensor saved during a recompute was used by backward; this is a bug in remat "
                "or a graph built from a recomputed output, which is not supported"
            )
        return handle
    root = handle.root
    if root.stop is None and handle.value is None:
        root.inner_backward = True
    while handle.value is None:
        owner = _owner(root, handle.index)
        if owner is None:
            raise NondeterministicRecompute(
                f"the recompute of block {root.name!r} did not produce saved tensor #{handle.index}; "
                "the block must run the same operations when it is recomputed"
            )
        owner.run("fill")
        if handle.value is None and _owner(root, handle.index) is owner:
            raise NondeterministicRecompute(
                f"the recompute of block {owner.name!r} stopped before producing saved tensor "
                f"#{handle.index - owner.start}; the block must run the same operations when recomputed"
            )
    value = read_held(handle.value)
    if root.observer is not None:
        root.observer.on_unpacked(handle.index, value)
    if handle.filler is not None and graph_retained():
        # NOTE [retained graphs]
        # A backward that keeps its graph (retain_graph=True) would otherwise keep every recomputed tensor until
        # the graph is freed: the memory recompute was meant to save. Each one is dropped once backward took it,
        # its frame becomes its owner again and keeps its inputs, and the next backward recomputes it.
        filler = handle.filler
        handle.value = handle.filler = None
        root.owners[handle.index] = _ROOT_OWNER if filler is root else filler
    return value


def recompute_with_hooks(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RecomputeOptions,
    output_recompute: bool,
) -> Any:
    if not torch.is_grad_enabled():
        # still one module call, so that the state log's numbering matches the replay's
        with _state.module_call(function):
            return function(*args, **kwargs)
    context = _STACK.top()
    if context is None:
        if options.policy.saves_everything:
            with _state.module_call(function):
                return function(*args, **kwargs)
        return _first_forward(function, args, kwargs, options, output_recompute)
    if context.mode == "discard":
        return _nested_first_forward(context.frame.root, function, args, kwargs, options)
    if context.mode == "skip":
        # Inside a child being skipped over: the child owns all of it.
        frame = context.frame
        with _selective.replaying_block(frame.root, _selective.next_block(frame, options), options):
            return _inline(function, args, kwargs, options.recompute_context)
    # fill: this nested block becomes a child frame that owns its handles.
    parent = context.frame
    root = parent.root
    child = _Frame(root, function, args, kwargs, options, start=parent.cursor)
    child.first_call = _state.current_replay_call() or 0
    child.policy_key = _selective.next_block(parent, options)
    child.policy_start = child.policy_cursor = parent.policy_cursor
    recorded = recorded_span(parent, context)
    if recorded is not None:
        child.span = recorded
        child.stop = recorded.stop
        for index in range(recorded.start, recorded.stop):  # type: ignore[arg-type]
            if _owner(root, index) is parent:
                root.owners[index] = child
        if context.last_needed is not None:
            last_needed = root.last_needed(parent)
            if last_needed is None and parent.options.early_stop:
                # The parent needs nothing from here on: the child keeps its inputs and
                # runs when backward reaches it.
                raise _StopRecompute
            context.last_needed = last_needed
    original, op_start = _debug.original_ops(root, recorded)
    _STACK.push(_Context("skip", child))
    trace = None
    try:
        with (
            _debug.traced(options.debug and original is not None) as trace,
            _selective.replaying_block(root, child.policy_key, options),
        ):
            out = _inline(function, args, kwargs, options.recompute_context)
        if recorded is not None and recorded.stop is not None and child.cursor != recorded.stop:
            raise NondeterministicRecompute(
                f"the recompute of the nested block {child.name!r} saved {child.cursor - child.start} "
                f"tensors for backward, its first forward saved {recorded.stop - recorded.start}; "
                "the block must run the same operations when it is recomputed"
            )
    except NondeterministicRecompute as error:
        raise _debug.explained(error, original, trace, op_start) from None
    finally:
        _STACK.pop()
    parent.cursor = child.cursor
    parent.policy_cursor = child.policy_cursor
    child.stop = child.cursor
    return out


def _first_forward(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RecomputeOptions,
    output_recompute: bool,
) -> Any:
    """The first forward of an outermost recomputed block: a new root frame."""
    root = _Root(function, args, kwargs, options)
    root.output_recompute = output_recompute
    root.span = Span(0)
    root.open_spans.append(root.span)
    _STACK.push(_Context("discard", root))
    try:
        with (
            options.forward_context(root.name),
            root.state_log.recording(),
            _state.module_call(function),
            _debug.traced(options.debug) as root.trace,
            _selective.recording_block(root, root.span, options.policy),
        ):
            # known before the block runs: a backward inside it may recompute it already
            root.policy_key = root.span.policy_key
            root.policy_start = root.policy_cursor = 0 if root.policy_key is None else root.policy_key + 1
            out = function(*args, **kwargs)
    finally:
        _STACK.pop()
        root.open_spans.clear()
        root.original_ops, root.trace = (root.trace.entries if root.trace else None), None
    root.span.stop = root.end_first_forward()
    if root.cache is not None:
        with _selective.internal():
            root.cache.seal()
    if output_recompute:
        register_outputs(root, out)
    return out


def _nested_first_forward(
    root: _Root, function: Callable[..., Any], args: Any, kwargs: Any, options: RecomputeOptions
) -> Any:
    """A block nested in one running for the first time.

    Everything here is discarded anyway, so the nested block is just a call; only where
    it starts and stops is recorded.
    """
    span = Span(len(root.handles), len(root.trace.entries) if root.trace is not None else 0)
    if root.open_spans:
        root.open_spans[-1].children.append(span)
    root.open_spans.append(span)
    trace = None
    try:
        # a nested block with debug=True in a root without it keeps a trace of its own
        with (
            _debug.traced(options.debug and root.trace is None) as trace,
            _selective.recording_block(root, span, options.policy),
        ):
            return _inline(function, args, kwargs, options.forward_context)
    finally:
        root.open_spans.pop()
        span.stop = len(root.handles)
        span.original_ops = trace.entries if trace is not None else None


def _inline(
    function: Callable[..., Any], args: Any, kwargs: Any, context: Callable[[str], AbstractContextManager[Any]]
) -> Any:
    """``function(*args, **kwargs)`` as one module call, inside ``context(name)``."""
    name = getattr(function, "__qualname__", None) or type(function).__name__
    with context(name), _state.module_call(function):
        return function(*args, **kwargs)


def active_mode() -> str | None:
    """The recompute mode of the current thread: None, "discard", "fill" or "skip"."""
    context = _STACK.top()
    return None if context is None else context.mode
