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

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.budget import BUDGET_FORMS, SAFETY_MARGIN, available_memory_bytes, parse_budget
from remat.units import format_bytes

__all__ = [
    "MemoryTracker",
    "Section",
    "available_memory_bytes",
    "format_bytes",
    "parse_budget",
    "track_memory",
]


@dataclass
class _Allocation:
    allocation_id: int
    nbytes: int
    device: str
    allocated_at: int
    freed_at: int | None = None


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

    Figures exclude parameter gradients: any storage that is the ``.grad`` of a leaf
    tensor seen by an operator during the run (or of a tensor given in ``exclude_grads_of``)
    when the run ends, and any gradient handed to such a leaf's accumulation, is left out
    of every figure, from its allocation on. (For a weight used twice in one graph, autograd
    sums the partial gradients before handing them over: the first partial gradient, kept
    until the second arrives, is activation-time memory and is counted.)

    Args:
        exclude_grads_of: extra tensors (e.g. ``model.parameters()``) whose ``.grad``
            storages must be excluded even if no operator saw them.
        device: count only storages on this device type (``"cpu"``, ``"cuda"``); ``None``
            counts all devices together.
    """

    def __init__(
        self,
        *,
        exclude_grads_of: Any = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._device_type = None if device is None else torch.device(device).type
        self._allocations: dict[int, _Allocation] = {}
        self._live_by_key: dict[int, int] = {}  # storage _cdata -> allocation id
        self._events: list[tuple[int, int]] = []  # (allocation id, +nbytes / -nbytes)
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
        self._hooks: list[Any] = []
        self._next_id = 0

    # ------------------------------------------------------------------ dispatch
    def __enter__(self) -> "MemoryTracker":
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

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        input_keys: set[int] = set()
        for leaf in tree_leaves((args, kwargs)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if leaf.requires_grad and leaf.is_leaf and id(leaf) not in self._leaves:
                self._leaves[id(leaf)] = weakref.ref(leaf)
                self._hooks.append(leaf.register_hook(self._on_leaf_gradient))
            key = _storage_key(leaf)
            if key is not None:
                input_keys.add(key)
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._observe(leaf, input_keys)
        return out

    def _observe(self, tensor: torch.Tensor, input_keys: set[int]) -> None:
        if tensor.is_meta or tensor.layout != torch.strided:
            return
        if self._device_type is not None and tensor.device.type != self._device_type:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        nbytes = int(storage.nbytes())
        with self._lock:
            allocation_id = self._live_by_key.get(key)
            if allocation_id is None and key in input_keys:
                # A view of (or an in-place result on) a storage that existed before
                # the run, such as a parameter: not an allocation of this run.
                return
            if allocation_id is not None:
                allocation = self._allocations[allocation_id]
                if allocation.freed_at is None and nbytes != allocation.nbytes:
                    # resize_ of a storage we already follow
                    self._events.append((allocation_id, nbytes - allocation.nbytes))
                    allocation.nbytes = nbytes
                return
            allocation_id = self._next_id
            self._next_id += 1
            self._allocations[allocation_id] = _Allocation(
                allocation_id, nbytes, str(tensor.device), len(self._events)
            )
            self._live_by_key[key] = allocation_id
            self._events.append((allocation_id, nbytes))
        weakref.finalize(storage, self._on_free, key, allocation_id)

    def _on_free(self, key: int, allocation_id: int) -> None:
        with self._lock:
            if self._live_by_key.get(key) == allocation_id:
                del self._live_by_key[key]
            allocation = self._allocations.get(allocation_id)
            if allocation is None or allocation.freed_at is not None:
                return
            if not self._active:
                # Freed after the run: the run's figures end at __exit__.
                allocation.freed_at = len(self._events)
                return
            allocation.freed_at = len(self._events)
            self._events.append((allocation_id, -allocation.nbytes))

    def allocated_at(self, tensor: torch.Tensor) -> int | None:
        """Event index at which `tensor`'s storage was allocated, or None if not tracked."""
        key = _storage_key(tensor)
        with self._lock:
            allocation_id = self._live_by_key.get(key) if key is not None else None
            return None if allocation_id is None else self._allocations[allocation_id].allocated_at

    def allocation_id(self, tensor: torch.Tensor) -> int | None:
        """The id of the live tracked allocation behind `tensor`, or None."""
        key = _storage_key(tensor)
        with self._lock:
            return self._live_by_key.get(key) if key is not None else None

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

    def live_allocations(self) -> dict[int, int]:
        """Allocation id -> allocation event index, for the tracked storages alive now."""
        with self._lock:
            return {i: self._allocations[i].allocated_at for i in self._live_by_key.values()}

    def allocation_bytes(self, allocation_id: int) -> int:
        """Bytes of an allocation (its size when it was last seen)."""
        with self._lock:
            return self._allocations[allocation_id].nbytes

    def allocation_event(self, allocation_id: int) -> int:
        """Event index at which an allocation was made."""
        with self._lock:
            return self._allocations[allocation_id].allocated_at

    def section(self, name: str) -> "_SectionContext":
        """Marks a window of the run, to read its peak later with :meth:`section_peak_bytes`."""
        return _SectionContext(self, name)

    def sections(self, name: str) -> list[Section]:
        """All closed sections with this name, in order."""
        return [s for s in self._sections if s.name == name and s.stop_event is not None]

    # ------------------------------------------------------------------ figures
    def _on_leaf_gradient(self, grad: torch.Tensor) -> None:
        # A gradient on its way into a leaf's .grad (for a tied weight, one of several
        # partial gradients summed there) is parameter-gradient memory.
        key = _storage_key(grad)
        with self._lock:
            allocation_id = self._live_by_key.get(key) if key is not None else None
            if allocation_id is not None:
                self._gradient_ids.add(allocation_id)

    def _excluded_ids(self) -> set[int]:
        if self._frozen_excluded is not None:
            return self._frozen_excluded
        keys: set[int] = set()
        refs = list(self._leaves.values()) + self._extra_leaves
        for ref in refs:
            leaf = ref()
            if leaf is None:
                continue
            grad = leaf.grad
            if grad is None or grad.layout != torch.strided:
                continue
            keys.add(grad.untyped_storage()._cdata)
        with self._lock:
            return {self._live_by_key[k] for k in keys if k in self._live_by_key} | self._gradient_ids

    def _live_after_each_event(self) -> np.ndarray:
        """Live bytes after each event, parameter gradients excluded (cached once frozen)."""
        excluded = self._excluded_ids()
        with self._lock:
            events = list(self._events)
        cached = self._curve_cache
        if cached is not None and cached[0] == len(events) and cached[1] is excluded:
            return cached[2]
        deltas = np.fromiter(
            (0 if allocation_id in excluded else delta for allocation_id, delta in events),
            dtype=np.int64,
            count=len(events),
        )
        live = np.cumsum(deltas)
        if excluded is self._frozen_excluded:
            self._curve_cache = (len(events), excluded, live)
        return live

    def _curve(self, start: int = 0, stop: int | None = None) -> tuple[int, int, int]:
        """Returns (live before `start`, peak within [start, stop), live at `stop`)."""
        live = self._live_after_each_event()
        stop = len(live) if stop is None else min(stop, len(live))
        before = int(live[start - 1]) if start > 0 else 0
        if stop <= start:
            return before, before, before
        return before, max(before, int(live[start:stop].max())), int(live[stop - 1])

    @property
    def peak_bytes(self) -> int:
        """The highest live byte count reached during the run (parameter gradients excluded)."""
        return self._curve()[1]

    @property
    def live_bytes(self) -> int:
        """Bytes allocated during the run and still alive now (parameter gradients excluded)."""
        return self._curve()[2]

    @property
    def n_events(self) -> int:
        """Number of allocation and free events so far."""
        return len(self._events)

    def section_peak_bytes(self, name: str, index: int = -1) -> tuple[int, int, int]:
        """(live at start, peak inside, live at end) of a closed section."""
        sections = self.sections(name)
        if not sections:
            raise KeyError(f"no closed section named {name!r}")
        section = sections[index]
        return self._curve(section.start_event, section.stop_event)

    def timeline(self) -> list[int]:
        """Live bytes after each allocation or free event (parameter gradients excluded)."""
        excluded = self._excluded_ids()
        with self._lock:
            events = list(self._events)
        live = 0
        out: list[int] = []
        for allocation_id, delta in events:
            if allocation_id in excluded:
                continue
            live += delta
            out.append(live)
        return out

    def allocations(self) -> Iterator[tuple[int, str, int, int | None]]:
        """Yields (nbytes, device, allocated_at event, freed_at event) for each allocation."""
        with self._lock:
            items = list(self._allocations.values())
        for a in items:
            yield a.nbytes, a.device, a.allocated_at, a.freed_at


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


def _storage_key(tensor: torch.Tensor) -> int | None:
    if tensor.is_meta or tensor.layout != torch.strided:
        return None
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def track_memory(**options: Any) -> MemoryTracker:
    """Shorthand for :class:`MemoryTracker` (``with remat.track_memory() as t: ...``)."""
    return MemoryTracker(**options)
