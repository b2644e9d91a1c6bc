"""Selective recompute: keeping the outputs a policy chose, and handing them to the recompute.

NOTE [selective recompute]
A recomputed block with a policy other than "save nothing" runs its first forward with a
``TorchDispatchMode`` below autograd. Each ATen operation it runs is numbered, the policy
decides on it, and the outputs of the operations it keeps are held (as detached aliases)
in the block's root frame, an :class:`OpCache`. When the block is recomputed, the same
operations come in the same order: a kept one is not run, its held output is returned in
its place, and every other one runs. Autograd above the mode builds the recompute's graph
and saves the same tensors as the first time, so the saved-tensor handles of
NOTE [nested recompute frames] are filled exactly as without a policy; only the work and
the memory differ.

Numbering. Operations are numbered per *policy block*: each recomputed block whose policy
keeps something gets an ordinal, in the order such blocks are entered in the root's first
forward, and numbers its own operations from 0 (those of blocks nested in it belong to
the nested block: the innermost policy decides). A recompute may start in the middle of
the root (a nested frame), so each frame knows its own ordinal and the next one, as it
knows its handles. Views and in-place operations are not numbered: they are never kept,
so remat's own detaches between the two runs do not shift the numbers; remat's other
bookkeeping runs as "internal" and is not seen at all.

Exactness.
* A kept output that is changed in place afterwards (in the block, or by the code around
  it after it returned) no longer holds what the operation produced, and the operation is
  run again instead. A change inside the block is seen by the mode and the entry is
  dropped at once (it holds no memory either); a change after the block's first forward
  shows in the version counter of the alias the entry then holds (see :class:`_Kept`).
* A kept random operation is not run by the recompute, so the random-number generator is
  set to the state the first forward left after it: the random operations that follow,
  recomputed, draw the same numbers as in the first forward.
* A kept output is returned as a fresh alias each time, so each recompute's graph is its
  own.
* A kept output that nothing in the recompute reads is let go when the block's first
  forward ends, and its operation is skipped (NOTE [keeping only what the recompute reads]
  in :mod:`remat.manual._kept`).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat._inherited import InheritedStack
from remat.errors import NondeterministicRecompute
from remat.manual._kept import OpCache, _Kept, strided_storage_keys
from remat.manual._op_kinds import _fills_self, _kind, _written, unnumbered
from remat.manual._tensors import storage_key
from remat.manual.policies import Decision, OpCall, Policy, _normalised, is_collective

__all__ = ["OpCache", "internal", "recording", "replaying", "tag", "unnumbered"]


class _Scope:
    """One policy block running: recording (`policy` set) or replaying; `block` None numbers nothing."""

    __slots__ = ("cache", "block", "policy", "next_index", "made", "replay_rng", "consume", "placeholders", "fills")

    def __init__(
        self, cache: OpCache | None, block: int | None, policy: Policy | None, replay_rng: bool, consume: bool = False
    ) -> None:
        self.cache = cache
        self.block = block
        self.policy = policy
        self.next_index = 0
        self.replay_rng = replay_rng
        self.consume = consume  # the block's last run: an entry is let go once handed over
        # while replaying: the placeholders of skipped operations, which nothing may read, by storage
        self.placeholders: dict[int, weakref.ref[torch.Tensor]] = {}
        # while replaying: the in-place fills still to skip, by the storage of the output served
        # (NOTE [outputs filled in place] in remat.manual._kept)
        self.fills: dict[int, collections.deque[tuple[Any, dict[str, Any] | None]]] = {}
        # tensors made by operations not kept, for remat.tag: id -> (ref, index, op, outputs, rng)
        self.made: dict[int, tuple[Any, ...]] | None = {} if policy is not None and policy.names else None

    def check_reads(self, func: Any, args: Any, kwargs: Any) -> None:
        """Raises if `func` would read the placeholder of a skipped operation."""
        for key in strided_storage_keys((args, kwargs)):
            placeholder = self.placeholders.get(key)
            if placeholder is not None and placeholder() is not None:  # (a storage freed may come back at the same key)
                raise NondeterministicRecompute(
                    f"the recompute ran {func} on the output of an operation that its first forward "
                    "did not read again (NOTE [keeping only what the recompute reads]); the block must "
                    "run the same operations when it is recomputed"
                )


class _Local(threading.local):
    def __init__(self) -> None:
        self.internal = 0
        self.function: str | None = None
        self.pending: Any = None  # (key, decision) of the operation the observer sees next
        self.unnumbered_blocks = 0  # see blocks_unnumbered


_LOCAL = _Local()
# The policy blocks running, innermost on top, each pushed with whether the selective mode
# is on the mode stack; a backward's threads start from the starting thread's (NOTE [state
# a backward's threads inherit]), as they start from its dispatch modes.
_SCOPES: InheritedStack[_Scope] = InheritedStack("remat.selective")
#: remat.explain's observers, the innermost on top (inherited as the scopes are)
_EXPLAINING: InheritedStack[Any] = InheritedStack("remat.explain")
_RUNNING_EXPLAINS = [0]  # in every thread: while none runs, the stack is not read (per operation)


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Operations run inside are remat's own bookkeeping: not numbered, not kept, not explained."""
    _LOCAL.internal += 1
    try:
        yield
    finally:
        _LOCAL.internal -= 1


def as_internal(method: Any) -> Any:
    """Decorates a bookkeeping method of remat's so that it runs as :func:`internal`."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _LOCAL.internal += 1
        try:
            return method(*args, **kwargs)
        finally:
            _LOCAL.internal -= 1

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


def is_internal() -> bool:
    """Whether remat's own bookkeeping is running on this thread."""
    return _LOCAL.internal > 0


def explain_observer() -> Any:
    """The observer of :func:`remat.explain` on this thread (or the thread that started
    this backward), if one is running."""
    return _EXPLAINING.top() if _RUNNING_EXPLAINS[0] else None


@contextlib.contextmanager
def observed_by(observer: Any) -> Iterator[None]:
    """Numbers every recomputed block (even whole-block ones) and reports to `observer`."""
    _EXPLAINING.push(observer)
    _RUNNING_EXPLAINS[0] += 1
    try:
        yield
    finally:
        _RUNNING_EXPLAINS[0] -= 1
        _EXPLAINING.pop()
        _LOCAL.pending = None


def take_pending() -> Any:
    """What the selective mode knows of the operation the observer sees now: (key, decision) or None."""
    pending, _LOCAL.pending = _LOCAL.pending, None
    return pending


def numbers(policy: Policy) -> bool:
    """Whether a block with `policy` is a numbered policy block (see NOTE [selective recompute])."""
    if _LOCAL.unnumbered_blocks:
        return False
    return not policy.recomputes_everything or explain_observer() is not None


@contextlib.contextmanager
def blocks_unnumbered() -> Iterator[None]:
    """Recomputed blocks entered inside keep nothing: code that is replayed as torch calls.

    The executor replays the model's code between two stages (its glue) as the torch calls
    it made, not through the blocks it called: a block there with a policy would be
    numbered in the first forward and never met by the replay.
    """
    _LOCAL.unnumbered_blocks += 1
    try:
        yield
    finally:
        _LOCAL.unnumbered_blocks -= 1


_TO_COPY = torch.ops.aten._to_copy.default


def _rng_state(out: Any) -> dict[str, Any]:
    devices = {t.device for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    states: dict[str, Any] = {}
    for device in devices:
        if device.type == "cpu":
            states["cpu"] = torch.get_rng_state()
        elif device.type != "meta":
            states[str(device)] = torch.get_device_module(device.type).get_rng_state(device)
    return states


def _set_rng_state(states: dict[str, Any]) -> None:
    for name, state in states.items():
        if name == "cpu":
            torch.set_rng_state(state)
        else:
            device = torch.device(name)
            torch.get_device_module(device.type).set_rng_state(state, device)


# NOTE [collectives in policy blocks]
# The functional collectives (torch.distributed's c10d functional operations, which DTensor
# redistributions and tensor-parallel layers issue) run inside autograd functions, whose
# forward runs with grad disabled. They are numbered all the same, so that a policy can keep
# their outputs (remat.policies.save_collectives): the recompute then does not communicate.
# They run at the same place in the first forward and in the recompute.


class _Mode(TorchDispatchMode):
    """Numbers, keeps and serves operation outputs for the innermost policy block."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _LOCAL.internal:
            return func(*args, **kwargs)
        scope = _SCOPES.top()
        written = _written(func, args, kwargs)
        filled = self._filling(scope, func, args, kwargs, written) if written else None
        if filled:
            return filled[0]
        if written:
            for recording in _SCOPES:
                if recording.policy is not None and recording.cache is not None and recording.cache.storages:
                    for tensor in written:
                        recording.cache.changed(tensor)
        if (
            scope is None
            or scope.block is None
            or _kind(func) == "unnumbered"
            # saves nothing: code guarded by is_recomputing() runs here; but a collective runs
            # so inside the autograd function that wraps it (NOTE [collectives in policy blocks])
            or (not torch.is_grad_enabled() and not is_collective(func))
            or func is _TO_COPY  # a cast autocast may take from its cache in one run and not the other
        ):
            # a view reads nothing; anything else runs in the recompute too and reads its arguments
            # (NOTE [keeping only what the recompute reads])
            if not getattr(func, "is_view", False):
                if scope is not None and scope.placeholders:
                    scope.check_reads(func, args, kwargs)
                _read_by_recordings(args, kwargs)
            out = self._run(func, args, kwargs, None, None)
            if scope is not None and scope.policy is not None and scope.cache is not None:
                scope.cache.sharing(out)
            return out
        index = scope.next_index
        scope.next_index += 1
        assert scope.cache is not None
        if scope.policy is not None:
            return self._record(scope, scope.cache, index, func, args, kwargs)
        return self._replay(scope, scope.cache, index, func, args, kwargs)

    def _filling(
        self, scope: _Scope | None, func: Any, args: Any, kwargs: Any, written: list[torch.Tensor]
    ) -> tuple[Any] | None:
        """An in-place write taken into a kept output's entry, or skipped as one (NOTE
        [outputs filled in place]): its result in a tuple; None for any other write."""
        if scope is None or scope.block is None or not _fills_self(func, args, written):
            return None
        if scope.policy is not None:
            return self._fill(scope, func, args, kwargs)
        return self._skip_fill(scope, func, args)

    def _fill(self, scope: _Scope, func: Any, args: Any, kwargs: Any) -> tuple[Any] | None:
        """NOTE [outputs filled in place]: an in-place write of a kept output, taken into its entry."""
        cache, policy = scope.cache, scope.policy
        assert cache is not None and policy is not None and scope.block is not None
        if cache.storages is None or any(
            other.cache is not cache for other in _SCOPES if other.policy is not None and other.cache is not None
        ):
            return None
        entry = cache.fill_target(args[0], scope.block)
        if entry is None:
            return None
        decision = Decision.of(policy.decide(OpCall(func, args, kwargs, _LOCAL.function)), policy)
        if not decision.saves or decision.offloads:
            return None
        out = self._run(func, args, kwargs, None, None)
        random = torch.Tag.nondeterministic_seeded in func.tags
        with internal():
            cache.filled(entry, func, _rng_state(out) if random else None, (args[1:], kwargs))
        return (out,)

    def _skip_fill(self, scope: _Scope, func: Any, args: Any) -> tuple[Any] | None:
        """A fill the first forward took into a kept output: not run again (its output is served filled)."""
        if not scope.fills:
            return None
        key = storage_key(args[0])
        pending = scope.fills.get(key)
        if pending is None:
            return None
        op, rng_after = pending.popleft()
        if not pending:
            del scope.fills[key]
        if op is not func:
            raise NondeterministicRecompute(
                f"the recompute ran {func} on a kept output that its first forward filled with {op}; "
                "the block must run the same operations when it is recomputed"
            )
        if rng_after is not None and scope.replay_rng:
            _set_rng_state(rng_after)
        return (args[0],)

    def _replay(self, scope: _Scope, cache: OpCache, index: int, func: Any, args: Any, kwargs: Any) -> Any:
        assert scope.block is not None
        ran = cache.ops.get(scope.block)
        if ran is not None and index >= len(ran) and _recording(cache, scope.block):
            # NOTE [replaying a block still in its first forward]
            return self._run(func, args, kwargs, None, None)
        if ran is not None and (index >= len(ran) or ran[index] is not func):
            raise NondeterministicRecompute(
                f"operation #{index} of the recomputed block is {func}, the first forward ran "
                f"{ran[index] if index < len(ran) else 'no more operations'} there; the block must run the "
                "same operations when it is recomputed (with a policy, code guarded by "
                "remat.is_recomputing() must run under torch.no_grad())"
            )
        kept = cache.get(scope.block, index)
        if kept is not None and kept.intact():
            if kept.rng_after is not None and scope.replay_rng:
                _set_rng_state(kept.rng_after)
            with internal():
                out = kept.served()
            if scope.consume:
                cache.drop(scope.block, index)
            if kept.fills:
                scope.fills[storage_key(out)] = collections.deque(kept.fills)
            if kept.skipped:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        scope.placeholders[storage_key(t)] = weakref.ref(t)
            elif (observer := explain_observer()) is not None:
                observer.on_served(func, out, (id(cache), scope.block, index))
            return out
        if kept is not None:
            cache.drop(scope.block, index)  # changed in place after the block returned
        if scope.placeholders:
            scope.check_reads(func, args, kwargs)
        return self._run(func, args, kwargs, (id(cache), scope.block, index), None)

    def _record(self, scope: _Scope, cache: OpCache, index: int, func: Any, args: Any, kwargs: Any) -> Any:
        policy = scope.policy
        assert policy is not None and scope.block is not None
        decision = Decision.of(policy.decide(OpCall(func, args, kwargs, _LOCAL.function)), policy)
        if not decision.saves:
            cache.read(args, kwargs)  # it runs again in the recompute
        out = self._run(func, args, kwargs, (id(cache), scope.block, index), decision)
        cache.ops.setdefault(scope.block, []).append(func)
        cache.sharing(out)
        random = _kind(func) == "random"
        if decision.saves:
            if any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
                with internal():
                    inputs = cache.kept_in((args, kwargs))
                    cache.closed(inputs)
                    kept = _Kept(func, out, _rng_state(out) if random else None, decision.offloads, inputs)
                    cache.keep(scope.block, index, kept)
                if (observer := explain_observer()) is not None:
                    observer.on_kept(cache, (scope.block, index))
        elif scope.made is not None:
            leaves = tree_leaves(out)
            if leaves and all(isinstance(t, torch.Tensor) for t in leaves):
                rng = _rng_state(out) if random else None
                refs = tuple(weakref.ref(t) for t in leaves)
                bare = isinstance(out, torch.Tensor)
                versions = tuple(t._version for t in leaves)
                for t in leaves:
                    scope.made[id(t)] = (weakref.ref(t), index, func, refs, bare, rng, versions)
        return out

    @staticmethod
    def _run(func: Any, args: Any, kwargs: Any, key: tuple[int, int, int] | None, decision: Any) -> Any:
        if _RUNNING_EXPLAINS[0] and not _LOCAL.internal and _EXPLAINING.top() is not None:
            _LOCAL.pending = (key, decision)  # for the observer's mode, which sees the op next
        return func(*args, **kwargs)


# NOTE [replaying a block still in its first forward]
# A backward inside a policy block (a gradient penalty) may need tensors its enclosing
# recomputed block saved a moment ago, before either has returned: the enclosing block is
# then recomputed from its inputs while the policy block is still recording. That
# recompute runs the policy block again and goes on past the operations recorded so far,
# into the inner backward, before it stops. Those operations have nothing kept yet: they
# simply run (a recompute that keeps nothing is exact), instead of being refused as
# operations the first forward never ran.


def _read_by_recordings(args: Any, kwargs: Any) -> None:
    """Notes, in every policy block recording, that an operation run again in the recompute reads
    these arguments (NOTE [keeping only what the recompute reads])."""
    for recording in _SCOPES:
        cache = recording.cache
        if recording.policy is not None and cache is not None and cache.storages is not None:
            cache.read(args, kwargs)


def _recording(cache: OpCache, block: int) -> bool:
    """Whether the first forward of policy block `block` of `cache` is still running."""
    return any(s.policy is not None and s.cache is cache and s.block == block for s in _SCOPES)


# NOTE [reads outside the dispatcher]
# ``Tensor.tolist()``, ``.numpy()``, ``np.asarray(t)`` and ``.data_ptr()`` (a Triton kernel's
# launch) read a tensor's data with no ATen operation: the selective mode never sees them.
# A kept output read only so (MoE split sizes from ``bincount(...).tolist()``) would count
# as read by nothing, be let go, and the recompute would read an uninitialised placeholder
# (NOTE [keeping only what the recompute reads]). A first forward under a policy runs
# under a torch-function mode too, which counts these calls as reads.
_RAW_READS = frozenset(
    {
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__array__,
        torch.Tensor.data_ptr,
        torch.Tensor.untyped_storage,
        torch.Tensor.storage,
    }
)


class _Functions(TorchFunctionMode):
    """Tells the policies which torch function (``F.gelu``, ``Tensor.softmax``) is running
    (`named`: the policy names some), and counts reads outside the dispatcher as reads (NOTE
    [reads outside the dispatcher])."""

    def __init__(self, named: bool) -> None:
        super().__init__()
        self.named = named

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _RAW_READS and not _LOCAL.internal:
            with internal():
                _read_by_recordings(args, kwargs or {})
        if not self.named or _LOCAL.function is not None:
            return func(*args, **(kwargs or {}))
        _LOCAL.function = _normalised(getattr(func, "__name__", ""))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _LOCAL.function = None


@contextlib.contextmanager
def _scope(scope: _Scope, functions: bool | None) -> Iterator[_Scope]:
    """`functions`: None, no torch-function mode; else whether the policy names torch functions."""
    stack = contextlib.ExitStack()
    with stack:
        mode_active = _SCOPES.flag()
        if scope.block is not None and not mode_active:
            stack.enter_context(_Mode())
            mode_active = True
        if functions is not None:
            stack.enter_context(_Functions(named=functions))
        _SCOPES.push(scope, mode_active)
        try:
            yield scope
        finally:
            _SCOPES.pop()
            scope.made = None
            if scope.policy is not None and scope.cache is not None and scope.block is not None:
                with internal():
                    scope.cache.seal(scope.block)


def recording(cache: OpCache, block: int | None, policy: Policy) -> contextlib.AbstractContextManager[_Scope]:
    """The first forward of policy block `block` (None: a nested block that keeps nothing)."""
    active = block is not None and not policy.recomputes_everything
    functions = bool(policy.functions) if active else None
    return _scope(_Scope(cache, block, policy if block is not None else None, True), functions)


def replaying(
    cache: OpCache, block: int | None, *, replay_rng: bool, consume: bool = False
) -> contextlib.AbstractContextManager[_Scope]:
    """A recompute of policy block `block` (None: one that kept nothing).

    With `consume`, the block will not run again: each kept output is let go as soon as
    it is handed over, and lives on only where the recompute's graph holds it.
    """
    return _scope(_Scope(cache, block, None, replay_rng, consume), None)


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Names `tensor` for :func:`remat.policies.save_names`; returns `tensor` itself.

    Inside a recomputed block whose policy keeps tensors of that name, the output of the
    operation that made `tensor` (its base, for a view) is kept for backward; the
    recompute does not run that operation again. Anywhere else it does nothing.

    Example::

        scores = remat.tag(q @ k.transpose(-2, -1), "attention_scores")
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"remat.tag(tensor, name) takes a non-empty string name, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"remat.tag(tensor, name) takes a tensor, got {type(tensor).__name__}")
    target = tensor if tensor._base is None else tensor._base
    for scope in _SCOPES:
        if scope.made is None or scope.policy is None or scope.cache is None or scope.block is None:
            continue
        made = scope.made.get(id(target))
        if made is None or made[0]() is not target:
            continue
        decision = scope.policy.decide_name(name)
        if decision is not None and decision.saves:
            _, index, op, refs, bare, rng, versions = made
            outputs = [ref() for ref in refs]
            if any(o is None for o in outputs) or tuple(o._version for o in outputs) != versions:
                break  # another output is gone, or one was changed in place: the operation is recomputed
            with internal():
                value = outputs[0] if bare else tuple(outputs)
                scope.cache.keep(scope.block, index, _Kept(op, value, rng, decision.offloads))
            if (observer := explain_observer()) is not None:
                observer.on_kept(scope.cache, (scope.block, index))
        break
    return tensor


# -- the numbering of policy blocks, for remat.manual._frames (see NOTE [selective recompute])
def recording_block(root: Any, span: Any, policy: Policy) -> contextlib.AbstractContextManager[Any]:
    """The first forward of a block with `policy` in the frame `root`; `span` gets its ordinal."""
    if numbers(policy):
        if root.cache is None:
            root.cache = OpCache()
        span.policy_key = root.policy_blocks
        root.policy_blocks += 1
    if root.cache is None:
        return contextlib.nullcontext()
    return recording(root.cache, span.policy_key, policy)


def next_block(frame: Any, options: Any) -> int | None:
    """The ordinal of a nested block met while `frame` recomputes (None: it keeps nothing)."""
    if frame.root.cache is None or not numbers(options.policy):
        return None
    frame.policy_cursor += 1
    return int(frame.policy_cursor - 1)


def replaying_block(
    root: Any, block: int | None, options: Any, *, consume: bool = False
) -> contextlib.AbstractContextManager[Any]:
    """A recompute of policy block `block` of the frame `root` (`consume`: see :func:`replaying`)."""
    if root.cache is None:
        return contextlib.nullcontext()
    return replaying(root.cache, block, replay_rng=options.preserve_rng_state, consume=consume)
