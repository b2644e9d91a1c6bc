"""Exact accounting of live tensor memory.

:class:`MemoryTracker` is the ruler for every memory figure remat reports. It is a
``TorchDispatchMode`` that sees every tensor an operator returns and follows the
lifetime of each *storage* (not each tensor):

* a view or the result of an in-place operation shares its input's storage and is
  not counted again;
* every allocation gets its own id, because storage addresses are reused as soon as a
  block is freed;
* the bytes of a storage are released the moment its last reference dies (a weak
  finalizer on the storage object), so freed-then-reused memory is never double
  counted, and nothing is estimated from process RSS;
* storages that end up as the ``.grad`` of a leaf tensor (parameter gradients) are
  excluded from every figure, whatever the moment they were allocated.

Only storages allocated while the tracker is active are counted: the parameters, the
optimizer state and the inputs created before the step are not activation memory.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from remat.storages import buffered_loss_bytes, storage_key, unwrapped

__all__ = [
    "AllocationRecord",
    "MemoryTracker",
    "Section",
    "Window",
    "track_memory",
]


_TO_COPY = torch.ops.aten._to_copy.default
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
# Fake tensors ask their device through this operator, from above autograd: its argument
# can look like a leaf there, and a hook registered on it would replace the tensor's own.
_DEVICE = torch.ops.prim.device.default


class _Recorders(threading.local):
    def __init__(self) -> None:
        self.stack: list[MemoryTracker | None] = []  # None: hooks that do not note kept inputs


_RECORDERS = _Recorders()  # the trackers whose saved-tensor hooks are in use, innermost last


def note_kept_for_backward(tensor: torch.Tensor) -> None:
    """Tells the tracker recording saved tensors that `tensor` is kept for backward.

    For what autograd does not see saved: the inputs a recompute region keeps to run again.
    """
    if _RECORDERS.stack and _RECORDERS.stack[-1] is not None:
        _RECORDERS.stack[-1]._pack(tensor)


def _is_fake_conversion(func: Any, args: Any, out: Any) -> bool:
    """Whether an alias of a real tensor came back fake: fake tensor mode converting data
    that existed before the run (see :mod:`remat.measure.fake`), not an allocation."""
    if func not in _ALIASES or not args or not isinstance(args[0], torch.Tensor):
        return False
    return isinstance(out, FakeTensor) and not isinstance(args[0], FakeTensor)


def _is_autocast_cast(func: Any, args: Any) -> bool:
    """Whether an operator call casts a leaf that requires grad, as autocast does (and caches).

    (Inside autocast's own cast, ``torch.is_autocast_enabled`` reads False: any such cast
    counts, and one made by the model's code is then only held a little longer in the plan.)
    """
    if func is not _TO_COPY or not args or not isinstance(args[0], torch.Tensor):
        return False
    source = args[0]
    return source.is_leaf and source.requires_grad


@dataclass
class _Allocation:
    allocation_id: int
    nbytes: int
    allocated_at: int
    freed_at: int | None = None


class AllocationRecord(NamedTuple):
    """What the tracker knows of one allocation (see :meth:`MemoryTracker.allocation_records`).

    Attributes:
        nbytes: its size when it was last seen.
        allocated_event: index of the event that allocated it.
    """

    nbytes: int
    allocated_event: int


class Window(NamedTuple):
    """Live bytes around a window of the event stream (see :meth:`MemoryTracker.window`).

    Attributes:
        before_bytes: live bytes just before the window's first event.
        peak_bytes: the highest live byte count inside the window (at least ``before_bytes``).
        after_bytes: live bytes after the window's last event.
    """

    before_bytes: int
    peak_bytes: int
    after_bytes: int


@dataclass
class Section:
    """A named window of a tracked run (see :meth:`MemoryTracker.section`).

    Attributes:
        name: the name given to :meth:`MemoryTracker.section`.
        start_event: index of the first event inside the window.
        stop_event: index one past the last event inside the window (``None`` while open).
    """

    name: str
    start_event: int
    stop_event: int | None = None


class MemoryTracker(TorchDispatchMode):
    """Follows every storage allocated while active; reports exact live and peak bytes.

    Use it as a context manager around a training step::

        with remat.MemoryTracker() as tracker:
            loss = model(x).sum()
            loss.backward()
        print(tracker.peak_bytes)

    Figures exclude parameter gradients: a storage that is the ``.grad`` of a leaf seen by
    an operator (or given in ``exclude_grads_of``) when the run ends, or that a leaf's
    accumulation takes or makes, from its allocation on. (A weight used twice in one graph:
    its first partial gradient, kept until the second arrives, is counted.)

    Args:
        exclude_grads_of: extra tensors (e.g. ``model.parameters()``) whose ``.grad``
            storages must be excluded even if no operator saw them.
        device: count only storages on this device type (``"cpu"``, ``"cuda"``); ``None``
            counts all devices together.
        count_fake: count the storages of fake tensors (``torch._subclasses.fake_tensor``)
            too, as if they were real: how remat sizes a step before running it.
        count_flops: also add up the floating-point operations of the operators that
            ``torch.utils.flop_counter`` knows (matrix products, convolutions, attention)
            in :attr:`flops`, and count the operators run in :attr:`operations`: how remat
            scales measured times to new input shapes and estimates times from shapes.
    """

    def __init__(
        self,
        *,
        exclude_grads_of: Any = None,
        device: str | torch.device | None = None,
        count_fake: bool = False,
        count_flops: bool = False,
    ) -> None:
        super().__init__()
        self._count_fake = count_fake
        self._count_flops = count_flops
        self.flops = 0  # see count_flops
        self.operations = 0
        self._lock = threading.Lock()
        self._device_type = None if device is None else torch.device(device).type
        self._allocations: dict[int, _Allocation] = {}
        self._live_by_key: dict[int, int] = {}  # storage _cdata -> allocation id
        self._events: list[tuple[int, int]] = []  # (allocation id, +nbytes / -nbytes)
        self._since_cache: tuple[int, int, np.ndarray] | None = None
        self._leaves: dict[int, weakref.ref[torch.Tensor]] = {}
        self._extra_leaves: list[weakref.ref[torch.Tensor]] = []
        if exclude_grads_of is not None:
            for tensor in exclude_grads_of:
                self._extra_leaves.append(weakref.ref(tensor))
        self._sections: list[Section] = []
        self._active = False
        self._frozen_excluded: set[int] | None = None
        self._curve_cache: tuple[int, set[int], np.ndarray] | None = None
        self._gradient_ids: set[int] = set()
        self._traffic_ids: set[int] = set()  # NOTE [parameter traffic]
        self._hooks: list[Any] = []
        self._saved_ids: list[int] = []  # allocations of the tensors saved for backward, in order
        self._unpacks: dict[int, int] = {}  # event a tensor was saved at -> event of its first unpack
        self._cast_ids: set[int] = set()  # allocations made by casting a leaf (see _is_autocast_cast)
        self._next_id = 0

    # ------------------------------------------------------------------ dispatch
    def __enter__(self) -> MemoryTracker:
        self._active = True
        self._frozen_excluded = None
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            self._active = False
            # Which storages are parameter gradients is decided now, at the end of the
            # run: zeroing or restoring .grad afterwards does not change the figures.
            self._frozen_excluded = self._excluded_ids()

    # NOTE [lean dispatch]
    # __torch_dispatch__ runs for every operator of the step: no Python call of its own per
    # tensor. The bookkeeping of each output is inline, the inputs are read by one helper
    # per operator, and the only other call is the finalizer of each storage when it dies.
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _DEVICE:
            return func(*args, **kwargs)
        input_keys = self._input_storage_keys(tree_leaves((args, kwargs)), hook_leaves=True)
        if func.namespace == "fsdp":  # NOTE [parameter traffic]
            self._note_traffic(input_keys)
        out = func(*args, **kwargs)
        if self._count_flops:
            self.operations += 1
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                self.flops += int(count(*args, **kwargs, out_val=out))
        if _is_fake_conversion(func, args, out):
            return out
        cast = _is_autocast_cast(func, args)
        device_type = self._device_type
        count_fake = self._count_fake
        buffered = buffered_loss_bytes(func, args, out) if count_fake else 0  # (a fake loss)
        for tensor in unwrapped(tree_leaves(out)):
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.layout != torch.strided:
                continue
            if not count_fake and isinstance(tensor, FakeTensor):
                continue
            if device_type is not None and tensor.device.type != device_type:
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = storage._cdata
            nbytes = max(int(storage.nbytes()), buffered)
            with self._lock:
                allocation_id = self._live_by_key.get(key)
                if allocation_id is None:
                    if key in input_keys:
                        # A view of (or an in-place result on) a storage that existed
                        # before the run, such as a parameter: not an allocation of this run.
                        continue
                    allocation_id = self._next_id
                    self._next_id += 1
                    self._allocations[allocation_id] = _Allocation(allocation_id, nbytes, len(self._events))
                    self._live_by_key[key] = allocation_id
                    self._events.append((allocation_id, nbytes))
                    if cast:
                        self._cast_ids.add(allocation_id)
                else:
                    allocation = self._allocations[allocation_id]
                    if allocation.freed_at is None and nbytes != allocation.nbytes:
                        # resize_ of a storage we already follow
                        self._events.append((allocation_id, nbytes - allocation.nbytes))
                        allocation.nbytes = nbytes
                    continue
            weakref.finalize(storage, self._on_free, key, allocation_id)
        return out

    # NOTE [parameter traffic]
    # FSDP2 gathers a unit's parameters into a buffer its own operator fills
    # (fsdp.all_gather_copy_in) and reduces gradients through one (fsdp.chunk_cat): not
    # activations. An allocation an fsdp operator takes is left out of every figure, from
    # its allocation on, as parameter gradients are. (The gathered parameters live in
    # storages FSDP2 resizes in place, allocated before the step.)
    def _note_traffic(self, keys: set[int]) -> None:
        with self._lock:
            self._traffic_ids.update(self._live_by_key[key] for key in keys if key in self._live_by_key)

    def _input_storage_keys(self, leaves: Iterable[Any], *, hook_leaves: bool) -> set[int]:
        """The storages of the tensors among `leaves`; hooks the leaf tensors that require grad."""
        keys: set[int] = set()
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                continue
            # (a leaf freed during the run leaves its id to the next tensor: that one is new)
            known = self._leaves.get(id(leaf))
            if hook_leaves and leaf.requires_grad and leaf.is_leaf and (known is None or known() is not leaf):
                self._leaves[id(leaf)] = weakref.ref(leaf)
                self._hooks.append(leaf.register_hook(self._on_leaf_gradient))
                # and what ends up its .grad (a gradient of another layout is copied there)
                self._hooks.append(leaf.register_post_accumulate_grad_hook(self._on_accumulated))
            key = storage_key(leaf)  # a wrapper's inner storage (NOTE [wrapper tensors] in remat.storages)
            if key is not None:
                keys.add(key)
        return keys

    def _on_free(self, key: int, allocation_id: int) -> None:
        with self._lock:
            if self._live_by_key.get(key) == allocation_id:
                del self._live_by_key[key]
            allocation = self._allocations.get(allocation_id)
            if allocation is None or allocation.freed_at is not None:
                return
            allocation.freed_at = len(self._events)
            if self._active:
                # Freed after the run: the run's figures end at __exit__.
                self._events.append((allocation_id, -allocation.nbytes))

    # ------------------------------------------------------------------ saved tensors
    # NOTE [saved-tensor records]
    # The pack hook runs for every tensor autograd saves: it only notes the allocation id,
    # inline. Storages are known by allocation id, not address: a saved tensor can die
    # before the next is saved, and its address be reused.
    @contextlib.contextmanager
    def saved_tensors_hooks(self, *, note_kept: bool = True) -> Iterator[None]:
        """Saved-tensor hooks that note the allocation behind every tensor saved for backward.

        Use them inside the tracked run (``with tracker, tracker.saved_tensors_hooks(): ...``)
        and read what was saved with :meth:`saved_allocations`, and when backward first
        used what was saved with :meth:`first_unpacks`. They keep each tensor as is.
        A region marked for recompute inside saves through hooks of its own; the inputs it
        keeps for its recompute are noted as saved too (:func:`note_kept_for_backward`),
        unless `note_kept` is False.
        """
        recorder = self if note_kept else None
        _RECORDERS.stack.append(recorder)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _RECORDERS.stack.pop()

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        event = len(self._events)
        if tensor.layout != torch.strided:
            return (tensor, event)
        key = storage_key(tensor)
        if key is not None:
            with self._lock:
                allocation_id = self._live_by_key.get(key)
                if allocation_id is not None:
                    self._saved_ids.append(allocation_id)
        return (tensor.detach(), event)

    def _unpack(self, packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        tensor, event = packed
        self._unpacks.setdefault(event, len(self._events))
        return tensor

    def first_unpacks(self) -> dict[int, int]:
        """For the tensors saved through :meth:`saved_tensors_hooks`: the event count when
        some were saved -> the event count when backward first used one of them."""
        return dict(self._unpacks)

    def cast_allocations(self) -> set[int]:
        """Allocation ids of autocast's casts of leaves that require grad (weights).

        Autocast caches such a cast until its region ends, whatever the cast's users keep:
        it lives on its own terms (NOTE [autocast casts] in ``remat.measure.outside``).
        """
        with self._lock:
            return set(self._cast_ids)

    @property
    def n_saved(self) -> int:
        """Number of tracked tensors saved for backward so far (see :meth:`saved_allocations`)."""
        return len(self._saved_ids)

    def saved_allocations(self, start: int = 0) -> list[int]:
        """Allocation ids of the tracked tensors saved for backward, from the `start`-th on."""
        with self._lock:
            return self._saved_ids[start:]

    # ------------------------------------------------------------------ allocations
    def allocation_id(self, tensor: torch.Tensor) -> int | None:
        """The id of the live tracked allocation behind `tensor`, or None."""
        key = storage_key(tensor)
        if key is None:
            return None
        with self._lock:
            return self._live_by_key.get(key)

    def allocations_of(self, tensors: Iterable[torch.Tensor]) -> dict[int, int]:
        """Allocation id -> bytes, for the live tracked storages behind `tensors`."""
        out: dict[int, int] = {}
        keys = self._input_storage_keys(tensors, hook_leaves=False)
        with self._lock:
            for key in keys:
                allocation_id = self._live_by_key.get(key)
                if allocation_id is not None:
                    out[allocation_id] = self._allocations[allocation_id].nbytes
        return out

    def allocation_freed_events(self, allocation_ids: Iterable[int]) -> dict[int, tuple[int, int | None]]:
        """Allocation id -> (the event that allocated it, the event that freed it or None)."""
        with self._lock:
            return {
                a: (self._allocations[a].allocated_at, self._allocations[a].freed_at)
                for a in allocation_ids
                if a in self._allocations
            }

    def allocations_since(self, event: int) -> list[int]:
        """Ids of the allocations made at or after `event`, live or freed."""
        with self._lock:
            return [a.allocation_id for a in self._allocations.values() if a.allocated_at >= event]

    def allocated_bytes(self, start_event: int, stop_event: int) -> int:
        """Bytes allocated by the events ``[start_event, stop_event)`` (growths included,
        frees not subtracted; parameter gradients included: they are written too)."""
        with self._lock:
            return sum(delta for _, delta in self._events[start_event:stop_event] if delta > 0)

    def allocation_records(self, allocation_ids: Iterable[int]) -> dict[int, AllocationRecord]:
        """Allocation id -> (bytes when last seen, allocation event), for these ids."""
        with self._lock:
            allocations = [self._allocations[i] for i in allocation_ids]
        return {a.allocation_id: AllocationRecord(a.nbytes, a.allocated_at) for a in allocations}

    def live_allocations(self) -> dict[int, AllocationRecord]:
        """Allocation id -> (bytes, allocation event), for the tracked storages alive now."""
        with self._lock:
            allocations = [self._allocations[i] for i in self._live_by_key.values()]
        return {a.allocation_id: AllocationRecord(a.nbytes, a.allocated_at) for a in allocations}

    def surviving_allocations(self, start: int, stop: int) -> dict[int, int]:
        """Allocation id -> bytes, for what was allocated in [start, stop) and still lived at `stop`.

        Parameter gradients are left out.
        """
        excluded = self._excluded_ids()
        with self._lock:
            return {
                a.allocation_id: a.nbytes
                for a in self._allocations.values()
                if start <= a.allocated_at < stop
                and (a.freed_at is None or a.freed_at > stop)
                and a.allocation_id not in excluded
            }

    def section(self, name: str) -> _SectionContext:
        """Marks a window of the run, to read its peak later with :meth:`section_peak_bytes`."""
        return _SectionContext(self, name)

    def sections(self, name: str) -> list[Section]:
        """All closed sections with this name, in order."""
        return [s for s in self._sections if s.name == name and s.stop_event is not None]

    # ------------------------------------------------------------------ figures
    def _on_accumulated(self, leaf: torch.Tensor) -> None:
        self._on_leaf_gradient(leaf.grad)

    def _on_leaf_gradient(self, grad: torch.Tensor | None) -> None:
        # A gradient on its way into a leaf's .grad (for a tied weight, one of several
        # partial gradients summed there) is parameter-gradient memory.
        key = None if grad is None else storage_key(grad)
        if key is None:
            return
        with self._lock:
            allocation_id = self._live_by_key.get(key)
            if allocation_id is not None:
                self._gradient_ids.add(allocation_id)

    def _excluded_ids(self) -> set[int]:
        if self._frozen_excluded is not None:
            return self._frozen_excluded
        keys: set[int] = set()
        refs = list(self._leaves.values()) + self._extra_leaves
        for ref in refs:
            leaf = ref()
            if leaf is None or not leaf.is_leaf:  # (a fake tensor's view can pass for a leaf in dispatch)
                continue
            grad = leaf.grad
            key = None if grad is None else storage_key(grad)
            if key is not None:
                keys.add(key)
        with self._lock:
            live = {self._live_by_key[k] for k in keys if k in self._live_by_key}
            return live | self._gradient_ids | self._traffic_ids

    def _counted_events(self) -> np.ndarray:
        """The events as an (n, 2) array of (allocation id, delta), parameter gradients zeroed."""
        excluded = self._excluded_ids()
        with self._lock:
            events = np.array(self._events, dtype=np.int64).reshape(-1, 2)
        if excluded:
            events[np.isin(events[:, 0], np.fromiter(excluded, dtype=np.int64, count=len(excluded))), 1] = 0
        return events

    def _live_after_each_event(self) -> np.ndarray:
        """Live bytes after each event, parameter gradients excluded (cached once frozen)."""
        cached = self._curve_cache
        if cached is not None and cached[0] == len(self._events) and cached[1] is self._frozen_excluded:
            return cached[2]
        live = np.cumsum(self._counted_events()[:, 1])
        if self._frozen_excluded is not None:
            self._curve_cache = (len(live), self._frozen_excluded, live)
        return live

    def _live_since(self, event: int) -> np.ndarray:
        """Live bytes after each event, of the allocations made at or after `event` alone."""
        cached = self._since_cache
        if cached is not None and cached[:2] == (event, len(self._events)):
            return cached[2]
        events = self._counted_events()
        with self._lock:
            earlier = [a for a, record in self._allocations.items() if record.allocated_at < event]
        events[np.isin(events[:, 0], np.asarray(earlier, dtype=np.int64)), 1] = 0
        live = np.cumsum(events[:, 1])
        self._since_cache = (event, len(self._events), live)
        return live

    def window(self, start_event: int = 0, stop_event: int | None = None, *, since: int | None = None) -> Window:
        """Live bytes before, at the peak of and after the events ``[start_event, stop_event)``.

        Event indices are those of :attr:`n_events` read during the run: the window opened
        by reading ``n_events`` at one moment and closed by reading it at a later one covers
        what was allocated and freed in between. Parameter gradients are left out.

        Args:
            start_event: index of the window's first event.
            stop_event: index one past its last event (``None``: the end of the run).
            since: count only what was allocated at or after this event (None: everything).

        Returns:
            A :class:`Window`; an empty window reports the live bytes at its start three times.
        """
        live = self._live_after_each_event() if since is None else self._live_since(since)
        stop = len(live) if stop_event is None else min(stop_event, len(live))
        before = int(live[start_event - 1]) if start_event > 0 else 0
        if stop <= start_event:
            return Window(before, before, before)
        return Window(before, max(before, int(live[start_event:stop].max())), int(live[stop - 1]))

    @property
    def peak_bytes(self) -> int:
        """The highest live byte count reached during the run (parameter gradients excluded)."""
        return self.window().peak_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes allocated during the run and still alive now (parameter gradients excluded)."""
        return self.window().after_bytes

    @property
    def n_events(self) -> int:
        """Number of allocation and free events so far."""
        return len(self._events)

    def section_peak_bytes(self, name: str, index: int = -1) -> Window:
        """(live at start, peak inside, live at end) of a closed section."""
        sections = self.sections(name)
        if not sections:
            raise KeyError(f"no closed section named {name!r}")
        section = sections[index]
        return self.window(section.start_event, section.stop_event)

    def timeline(self) -> list[int]:
        """Live bytes after each allocation or free event (parameter gradients excluded)."""
        excluded = self._excluded_ids()
        with self._lock:
            events = list(self._events)
        deltas = [delta for allocation_id, delta in events if allocation_id not in excluded]
        return [int(live) for live in np.cumsum(np.array(deltas, dtype=np.int64))]


class _SectionContext:
    def __init__(self, tracker: MemoryTracker, name: str) -> None:
        self._tracker = tracker
        self._section = Section(name, 0)

    def __enter__(self) -> Section:
        self._section.start_event = self._tracker.n_events
        self._tracker._sections.append(self._section)
        return self._section

    def __exit__(self, *exc: Any) -> None:
        self._section.stop_event = self._tracker.n_events


def track_memory(**options: Any) -> MemoryTracker:
    """Shorthand for :class:`MemoryTracker` (``with remat.track_memory() as t: ...``)."""
    return MemoryTracker(**options)
