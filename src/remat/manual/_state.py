"""Thread-local recompute state, and the guard that keeps module state exact.

NOTE [module state during recompute]
A module may change its own state in its forward: BatchNorm updates its running
statistics, ``spectral_norm`` advances its power iteration (its ``u``/``v`` buffers), a
custom layer counts steps in a buffer or in a plain attribute. A recompute re-runs that
forward, so without care it would see the state as the original forward *left* it (a
different power iteration, a counter one step ahead: silently different gradients) and
change it a second time (torch.utils.checkpoint has both defects).

remat follows every module call while a recomputed block runs for the first time
(*recording*) and while it is re-run (*replaying*), with two global module hooks that
exist only while some thread records or replays, and act only in that thread:

* recording: before each call, the module's own buffers are copied and its plain
  attributes (numbers, strings, tensors held outside the buffers) are noted; after the
  call, whatever the forward changed is kept in a :class:`StateLog`, under the call's
  number in the block's sequence of module calls, and the rest is dropped at once (an
  attribute the call added is kept as absent before it). A module that changes nothing
  costs a copy of its buffers during its own call only; torch's own layers without
  buffers or hooks are not numbered at all (NOTE [layers that keep no state]).
* replaying: the recompute makes the same module calls in the same order, so the call
  numbers match. Before a logged call, the module's current state is set aside and the
  state its original call saw is put back; after the call, the set-aside state returns,
  bit for bit. The module therefore computes exactly what it computed the first time
  and its state is left as one plain forward leaves it.

Details that matter:
* A recompute of a nested frame starts in the middle of the block: each frame knows the
  call number it starts at (``StateLog`` numbers are the root block's).
* A recompute is cut short by a BaseException raised from a saved-tensor hook once it has
  produced what backward needs, often inside a module (after it changed its state), and
  nn.Module runs "always call" forward hooks only on Exception: the set-aside states live
  on a stack that the replay restores, whatever is left on it, when it ends.
* Ops may have saved a buffer for backward (the reentrant recompute checks its version),
  so buffers are written without bumping their version counters.
* A training-mode normalisation layer's output does not read its running statistics, so
  for those the state before the call is not kept (only restored after the replay):
  this keeps the log's memory to the few buffers whose values a forward actually reads.
* A tensor attribute that is not a buffer and is changed in place cannot be put back
  (remat did not copy it): that is refused with an error asking to register a buffer.
* A large buffer of booleans (:func:`is_read_only_mask`: a causal mask) is taken for a mask the
  model reads, and is not copied before the call: a forward that changes one in place is
  refused, naming it (NOTE [buffers measuring puts back]). One the forward replaces by
  another (registered again) needs no copy: the one the call saw is intact.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.hooks import RemovableHandle

from remat.errors import NondeterministicRecompute, RematError
from remat.manual._attributes import MISSING, Attributes, is_state_attribute, set_attribute
from remat.manual._selective import as_internal

__all__ = [
    "StateLog",
    "changes_state",
    "current_replay_call",
    "in_manual_block",
    "inside_manual_block",
    "is_state_attribute",
    "is_read_only_mask",
    "learning_copy_bytes",
    "is_recomputing",
    "learning_state",
    "module_call",
    "recomputing",
    "rehearsing",
    "snapshot_bytes",
]


class _Local(threading.local):
    def __init__(self) -> None:
        self.recompute_depth = 0
        self.manual_depth = 0  # blocks of remat.recompute / remat.mark being run
        self.scopes: list[_Scope] = []


_LOCAL = _Local()


def is_recomputing() -> bool:
    """True only while remat re-runs a forward: to recompute activations, or to measure.

    Use it in a forward to skip side effects that must happen once per step (logging,
    counters, statistics). It is thread-local: a recompute in one thread does not show
    in another.
    """
    return _LOCAL.recompute_depth > 0


@contextlib.contextmanager
def inside_manual_block() -> Iterator[None]:
    """Marks the current thread as running a block of :func:`remat.recompute` (any grad mode)."""
    _LOCAL.manual_depth += 1
    try:
        yield
    finally:
        _LOCAL.manual_depth -= 1


def in_manual_block() -> bool:
    """Whether the current thread runs a block of :func:`remat.recompute` (or of a marked module)."""
    return _LOCAL.manual_depth > 0


#: Boolean buffers of this many elements are masks a model reads: not copied to be put back.
MASK_ELEMENTS = 64 * 1024


def is_read_only_mask(buffer: torch.Tensor) -> bool:
    """Whether `buffer` is taken for a mask the model only reads (a large one of booleans),
    which remat does not copy to put back (NOTE [module state during recompute])."""
    return buffer.dtype == torch.bool and buffer.numel() >= MASK_ELEMENTS


# ----------------------------------------------------------------------------- the log
@dataclass
class _Change:
    """What one module call changed: the values before the call (None: not needed)."""

    module: nn.Module
    buffers_before: dict[str, torch.Tensor | None] = field(default_factory=dict)
    attributes_before: dict[str, Any] = field(default_factory=dict)
    # a marked module's block: the state it started from (see _Scope._record_enter)
    entry_buffers: dict[str, torch.Tensor | None] = field(default_factory=dict)
    entry_attributes: dict[str, Any] = field(default_factory=dict)


class StateLog:
    """The state changes of a recomputed block's module calls, by call number.

    A block's first forward may be recorded in pieces (the executor of a plan records one
    region over several stage calls): each piece continues the numbering of the one before.
    """

    __slots__ = ("changes", "calls", "skips_layers")

    def __init__(self) -> None:
        self.changes: dict[int, _Change] = {}
        self.calls = 0  # module calls recorded so far
        # whether torch's stateless layers are left out of the numbering, decided when the
        # recording starts and kept by every replay (NOTE [layers that keep no state])
        self.skips_layers: bool | None = None

    def recording(self) -> contextlib.AbstractContextManager[_Scope]:
        """While active, this thread's module calls are recorded into the log."""
        return _Open(_Scope(self, replaying=False, first_call=self.calls))


def _output_ignores_state(module: nn.Module) -> bool:
    """A training-mode normalisation layer: its output does not read its running statistics."""
    return isinstance(module, _NormBase) and module.training and module.track_running_stats


def learning_copy_bytes(model: nn.Module) -> int:
    """The most the guard copies while it learns which modules change their state: the buffers
    of every module it copies before the call (not a training-mode normalisation layer's, nor a
    boolean mask), which for the model's own call last the whole forward."""
    return sum(
        b.numel() * b.element_size()
        for module in model.modules()
        if not _output_ignores_state(module)
        for b in module._buffers.values()
        if b is not None and not is_read_only_mask(b)
    )


def _write(buffer: torch.Tensor, value: torch.Tensor) -> None:
    with torch.autograd._unsafe_preserve_version_counter(buffer), torch.no_grad():
        buffer.copy_(value)


def _module_name(module: nn.Module) -> str:
    return type(module).__name__


# Whether each module seen so far changed its buffers in a forward (see NOTE [module
# state during recompute]): a recording copies the buffers of a module before its call
# only when it may need them (it changed them before, or it was never seen).
_CHANGES_STATE: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def changes_state(module: nn.Module) -> bool:
    """Whether `module`'s forward was seen changing its buffers (False if never seen)."""
    return _CHANGES_STATE.get(module, False)


class _Scope:
    """One recording, watch or replay in this thread; sees every module call while open.

    A watch (``log`` None) only learns which modules change their buffers.
    """

    def __init__(self, log: StateLog | None, replaying: bool, first_call: int) -> None:
        self.log = log
        self.replaying = replaying
        self.next_call = first_call
        # (module, call, buffers: name -> (tensor, version, copy or None), attributes)
        self.open_calls: list[tuple[nn.Module, int, Any, Any]] = []
        self.block_calls: set[int] = set()  # calls that are a marked module's block
        self.skips_layers = True
        if log is not None:
            if log.skips_layers is None:
                log.skips_layers = _no_other_global_hooks()
            self.skips_layers = log.skips_layers

    # -- recording
    def _record_enter(self, module: nn.Module, call: int, block: bool) -> None:
        # A training-mode normalisation layer changes all its buffers and needs none of
        # them kept; any other module is copied unless it was seen to change nothing.
        # A marked module's block starts after the module's own pre-hooks ran, which a
        # replay does not run again: what they set is part of what the block saw.
        entry_hooks = block and bool(module._forward_pre_hooks)
        buffers: dict[str, Any] = {}
        if module._buffers:
            copy = entry_hooks or (_CHANGES_STATE.get(module, True) and not _output_ignores_state(module))
            buffers = {
                name: (buf, buf._version, buf.detach().clone() if copy and not is_read_only_mask(buf) else None)
                for name, buf in module._buffers.items()
                if buf is not None
            }
        if block:
            self.block_calls.add(call)
        self.open_calls.append((module, call, buffers, Attributes(module) if self.log is not None else None))

    def _record_exit(self, module: nn.Module, call: int, buffers: Any, attributes: Attributes | None) -> None:
        buffers_before: dict[str, torch.Tensor | None] = {}
        unknown: list[str] = []
        if buffers:
            ignores_state = _output_ignores_state(module)
            buf: torch.Tensor
            for name, (buf, version, before) in buffers.items():
                # Kernels may write a buffer without bumping its version (the running
                # statistics of batch_norm): a kept copy is compared by value too.
                changed = (
                    ignores_state
                    or module._buffers.get(name) is not buf
                    or buf._version != version
                    or (before is not None and not torch.equal(before, buf))
                )
                if changed:
                    if before is None and module._buffers.get(name) is not buf and buf._version == version:
                        before = buf  # replaced, not written: the one the call saw is itself intact
                    buffers_before[name] = before
                    if before is None and not ignores_state:
                        unknown.append(name)
            _CHANGES_STATE[module] = bool(buffers_before) or _CHANGES_STATE.get(module, False)
        if self.log is None or attributes is None:
            return
        if unknown:
            raise RematError(
                f"{_module_name(module)} changed its buffer(s) {unknown} in this forward but not in its "
                "earlier ones, so remat did not keep the values it started from and a recompute "
                "could not see them. Run the block once outside remat first, or make the change "
                "happen in every training forward"
            )
        attributes_before = attributes.changed(module)
        entry_attributes: dict[str, Any] = {}
        entry_buffers: dict[str, torch.Tensor | None] = {}
        if call in self.block_calls and module._forward_pre_hooks:
            # see _record_enter: the state the block started from, for a replay that
            # runs the block without the module's pre-hooks
            entry_attributes = attributes.plain()
            entry_buffers = {name: before for name, (_, _, before) in buffers.items()}
        if buffers_before or attributes_before or entry_attributes or entry_buffers:
            self.log.changes[call] = _Change(module, buffers_before, attributes_before, entry_buffers, entry_attributes)

    # -- replaying
    def _replay_enter(self, module: nn.Module, call: int, block: bool) -> None:
        assert self.log is not None
        change = self.log.changes.get(call)
        if change is None:
            self.open_calls.append((module, call, None, None))
            return
        if change.module is not module:
            raise NondeterministicRecompute(
                f"module call #{call} of the recompute is {_module_name(module)}, the original forward "
                f"called {_module_name(change.module)} there; the block must make the same calls when "
                "it is recomputed"
            )
        buffers_before, attributes_before = change.buffers_before, change.attributes_before
        # A block run without its module's own call (the root of a recompute) did not run
        # the module's pre-hooks: it gets the state they had set. Inside the module's call
        # they have just run again, on the replayed state.
        inside_own_call = bool(self.open_calls) and self.open_calls[-1][0] is module
        if block and not inside_own_call:
            buffers_before = {**change.entry_buffers, **buffers_before}
            attributes_before = {**change.entry_attributes, **attributes_before}
        current_buffers = {
            name: (module._buffers[name], module._buffers[name].detach().clone())  # type: ignore[union-attr]
            for name in buffers_before
        }
        current_attributes = {name: module.__dict__.get(name, MISSING) for name in attributes_before}
        self.open_calls.append((module, call, current_buffers, current_attributes))
        for name, before in buffers_before.items():
            if before is not None:
                _write(module._buffers[name], before)  # type: ignore[arg-type]
        for name, value in attributes_before.items():
            set_attribute(module, name, value)

    def _replay_exit(self, buffers: Any, attributes: Any, module: nn.Module) -> None:
        if buffers is None:
            return
        for name, (buf, current) in buffers.items():
            module._buffers[name] = buf
            _write(buf, current)
        for name, value in attributes.items():
            set_attribute(module, name, value)

    # -- hooks
    @as_internal
    def enter(self, module: nn.Module, block: bool = False) -> None:
        call = self.next_call
        self.next_call += 1
        if self.replaying:
            self._replay_enter(module, call, block)
        else:
            if self.log is not None:
                self.log.calls = self.next_call
            self._record_enter(module, call, block)

    @as_internal
    def exit(self, module: nn.Module) -> None:
        open_calls = self.open_calls
        position = len(open_calls) - 1  # the innermost call, almost always
        while position >= 0 and open_calls[position][0] is not module:
            position -= 1
        if position < 0:
            return
        _, call, buffers, attributes = open_calls.pop(position)
        if self.replaying:
            self._replay_exit(buffers, attributes, module)
        else:
            self._record_exit(module, call, buffers, attributes)

    @as_internal
    def close(self) -> None:
        """Restores whatever a replay cut short left set aside (innermost first)."""
        while self.open_calls:
            module, _, buffers, attributes = self.open_calls.pop()
            if self.replaying:
                self._replay_exit(buffers, attributes, module)


# ----------------------------------------------------------------------------- hooks
_HOOK_LOCK = threading.Lock()
_HOOK_USERS = 0
_HOOK_HANDLES: list[Any] = []


# NOTE [layers that keep no state]
# The guard numbers and notes every module call of a recorded or replayed block. Most of
# those calls are torch's own layers (Linear, GELU, LayerNorm, Dropout, Conv2d...), whose
# forwards change no attribute of the module (an AST scan of torch.nn.modules finds none
# outside private names) and which, without buffers, have nothing a forward could change.
# Such a call is left out of the numbering altogether, in the recording and in the
# replay alike (the rule reads only what the call cannot change): a module of a class
# whose forward, __call__ and _call_impl are torch.nn's own, with no buffers, no forward
# hooks of its own and no forward set on the instance (a marking). Global module hooks of
# the user's may change any module: a recording that starts while one is installed numbers
# every call, and its replays do as the recording did, whatever is installed by then, so
# that their numbers match. This halves the guard's cost on a block of small layers;
# everything else is noted as before.
_TORCH_LAYER: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _torch_layer(kind: type) -> bool:
    forward = getattr(kind, "forward", None)
    return (
        (getattr(forward, "__module__", None) or "").startswith("torch.nn.modules.")
        and kind.__call__ is nn.Module.__call__
        and getattr(kind, "_call_impl", None) is nn.Module._call_impl
    )


def _no_other_global_hooks() -> bool:
    """Whether no global module forward hook but the guard's own is installed."""
    own = 1 if _HOOK_HANDLES else 0
    return _DIRECT and len(_GLOBAL_PRE_HOOKS) == own and len(_GLOBAL_HOOKS) == own


def _keeps_no_state(module: nn.Module) -> bool:
    if module._buffers or module._forward_pre_hooks or module._forward_hooks or "forward" in module.__dict__:
        return False
    kind = type(module)
    known = _TORCH_LAYER.get(kind)
    if known is None:
        known = _TORCH_LAYER[kind] = _torch_layer(kind)
    return known


# Inside code torch.compile traces (a stage compiled with module.compile()), the hooks do
# nothing: traced, they would put remat's call counters into the graph's guards (a
# recompile at every call, then eager fallbacks that differ between a forward and its
# recompute). Compiled code is one call for the guard: remat.discover.intercept refuses to
# recompute a compiled stage whose state it could not replay.
def _pre_hook(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():
        return
    quiet = _keeps_no_state(module)
    for scope in _LOCAL.scopes:
        if not (quiet and scope.skips_layers):
            scope.enter(module)


def _post_hook(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    quiet = _keeps_no_state(module)
    for scope in reversed(_LOCAL.scopes):
        if not (quiet and scope.skips_layers):
            scope.exit(module)


# torch's global forward hook dictionaries, private to torch: where they are not as
# expected, the guard's hooks go through the public registration instead
_DIRECT = isinstance(getattr(nn.modules.module, "_global_forward_pre_hooks", None), OrderedDict) and all(
    isinstance(getattr(nn.modules.module, name, None), dict)
    for name in ("_global_forward_hooks", "_global_forward_hooks_always_called")
)
_GLOBAL_PRE_HOOKS: OrderedDict[int, Any] = (
    nn.modules.module._global_forward_pre_hooks if _DIRECT else OrderedDict()  # type: ignore[assignment]
)
_GLOBAL_HOOKS: dict[int, Any] = nn.modules.module._global_forward_hooks if _DIRECT else {}
_ALWAYS_CALLED: dict[int, bool] = nn.modules.module._global_forward_hooks_always_called if _DIRECT else {}


class _Installed:
    """remat's two global module hooks, put straight into torch's hook dictionaries.

    ``register_module_forward_(pre_)hook`` makes a new handle each time, and the guard is
    installed around every recorded or replayed block: the two hooks keep ids of their own,
    taken once from torch's handle counter, and are added and removed by those ids.
    """

    __slots__ = ()
    ids: tuple[int, int] | None = None  # the pre-hook's id and the hook's

    def __init__(self) -> None:
        if _Installed.ids is None:
            _Installed.ids = (RemovableHandle(_GLOBAL_PRE_HOOKS).id, RemovableHandle(_GLOBAL_HOOKS).id)
        pre, post = _Installed.ids
        _GLOBAL_PRE_HOOKS[pre] = _pre_hook
        # first, before any global pre-hook of the user's, which may change the module
        _GLOBAL_PRE_HOOKS.move_to_end(pre, last=False)
        _GLOBAL_HOOKS[post] = _post_hook
        _ALWAYS_CALLED[post] = True

    def remove(self) -> None:
        assert _Installed.ids is not None
        pre, post = _Installed.ids
        _GLOBAL_PRE_HOOKS.pop(pre, None)
        _GLOBAL_HOOKS.pop(post, None)
        _ALWAYS_CALLED.pop(post, None)


def _use_hooks() -> None:
    global _HOOK_USERS
    with _HOOK_LOCK:
        if _HOOK_USERS == 0:
            if _DIRECT:
                _HOOK_HANDLES.append(_Installed())
            else:  # pragma: no cover - a torch whose hook dictionaries differ
                _HOOK_HANDLES.append(nn.modules.module.register_module_forward_pre_hook(_pre_hook))
                _HOOK_HANDLES.append(nn.modules.module.register_module_forward_hook(_post_hook, always_call=True))
        _HOOK_USERS += 1


def _release_hooks() -> None:
    global _HOOK_USERS
    with _HOOK_LOCK:
        _HOOK_USERS -= 1
        if _HOOK_USERS == 0:
            for handle in _HOOK_HANDLES:
                handle.remove()
            _HOOK_HANDLES.clear()


def hold_hooks(owner: object) -> None:
    """Keeps the guard's hooks installed for as long as `owner` lives.

    Compiled code (``module.compile()``) guards on the global module hooks it was traced
    with: hooks installed anew for every recompute would make it compile again at every
    step. An executor that runs compiled stages holds them instead (they do nothing
    while no block records or replays).
    """
    _use_hooks()
    weakref.finalize(owner, _release_hooks)


class _Open:
    """While active, `scope` sees this thread's module calls (`rehearse`: and it recomputes).

    A class rather than a generator: it is entered around every recorded and replayed block.
    """

    __slots__ = ("scope", "rehearse")

    def __init__(self, scope: _Scope, rehearse: bool = False) -> None:
        self.scope = scope
        self.rehearse = rehearse

    def __enter__(self) -> _Scope:
        _use_hooks()
        _LOCAL.scopes.append(self.scope)
        if self.rehearse:
            _LOCAL.recompute_depth += 1
        return self.scope

    def __exit__(self, *exc: Any) -> None:
        try:
            _LOCAL.scopes.remove(self.scope)
            self.scope.close()
        finally:
            if self.rehearse:
                _LOCAL.recompute_depth -= 1
            _release_hooks()


@contextlib.contextmanager
def rehearsing() -> Iterator[None]:
    """Marks the current thread as recomputing, e.g. for a run remat makes on its own (measuring)."""
    _LOCAL.recompute_depth += 1
    try:
        yield
    finally:
        _LOCAL.recompute_depth -= 1


def recomputing(log: StateLog, first_call: int = 0) -> contextlib.AbstractContextManager[_Scope]:
    """Marks the current thread as recomputing and replays `log` from call `first_call`."""
    return _Open(_Scope(log, replaying=True, first_call=first_call), rehearse=True)


def learning_state() -> contextlib.AbstractContextManager[_Scope]:
    """While active, remat learns which modules change their buffers (:func:`changes_state`).

    It copies the buffers of each module not yet known around its call, to compare them.
    """
    return _Open(_Scope(None, replaying=False, first_call=0))


def snapshot_bytes(module: nn.Module) -> int:
    """Bytes a replay copies at most at once while `module` is recomputed.

    A replay sets aside the buffers of each module that changes them, one module call at a
    time (nested calls add up; the largest module is the usual bound).
    """
    sizes = [
        sum(buf.numel() * buf.element_size() for buf in m.buffers(recurse=False))
        for m in module.modules()
        if changes_state(m) or (_output_ignores_state(m) and getattr(m, "running_mean", None) is not None)
    ]
    return max(sizes, default=0)


def current_replay_call() -> int | None:
    """The number the next module call gets in this thread's innermost replay, if any."""
    for scope in reversed(_LOCAL.scopes):
        if scope.replaying:
            return scope.next_call
    return None


@contextlib.contextmanager
def module_call(function: Any) -> Iterator[None]:
    """Runs the body as a call of the module `function` is the forward of, if it is one.

    A recomputed block given as a module's bound ``forward`` (what :func:`remat.mark`
    runs) changes the module's state outside the module's own call; this makes the
    block's run count as that call, in recording and in replay alike.
    """
    module = getattr(function, "__self__", None)
    if not isinstance(module, nn.Module) or not _LOCAL.scopes:
        yield
        return
    for scope in _LOCAL.scopes:
        scope.enter(module, block=True)
    try:
        yield
    finally:
        _post_hook(module, (), None)
