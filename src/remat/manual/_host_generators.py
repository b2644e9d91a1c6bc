"""Python's and NumPy's global random generators: capture, compare and set their states.

See NOTE [host random numbers] in ``_rng.py`` for why they are replayed, and NOTE
[reading host generators directly] below for how this is kept cheap.
"""

from __future__ import annotations

import ctypes
import functools
import random
import struct
import sys
from typing import Any, NamedTuple

__all__ = ["HostState", "capture", "restore", "stands_at"]

# NOTE [reading host generators directly]
# A recomputed block captures the host generators before its forward and checks them
# around its replay (NOTE [replaying host generators cheaply] in _rng.py). Through their
# public APIs this is slow: NumPy's get_state() and set_state() copy its 624 words one by
# one (about 25 us each), and Python's getstate() builds a tuple of 625 ints (7 us, and
# as long again to compare two). Done at every block, it cost a small block more than the
# rest of its recompute.
#
# Both generators are Mersenne Twisters whose whole state is a few contiguous bytes:
#
# * NumPy: the MT19937 bit generator's state struct (624 words and a position), at the
#   address its ctypes interface documents, and the legacy RandomState's cached Gaussian
#   (a flag and a double) inside the RandomState object;
# * Python: the index and 624 words inside the ``random.Random`` object, and its
#   ``gauss_next`` attribute.
#
# These bytes are read directly and compared as bytes; the public APIs set a state back
# (rare: only when something drew). Where the bytes lie inside the objects is not assumed:
# it is found once per process on probe generators of the same types in known states
# (their public get_state()), each offset required to be the only match and to hold on
# every probe, then checked once against the global generators themselves. Where any of
# this fails (another interpreter, another layout, another NumPy bit generator), the
# public APIs are used, as they were before.

_WORDS = 624
_MT_BYTES = _WORDS * 4 + 4  # uint32 words[624]; int position

# NOTE [comparing heads]
# A replay asks twice whether a generator still stands where the capture left it (before
# and after the recompute). Read in full, the 2.5 KB of each state cost more than the
# recompute of a small block: between two reads the block's tensors have pushed them out
# of the caches. The question is answered from a head of each state instead: the
# position and the first words (Python's index and 15 words, NumPy's 16 words and its
# position), with the cached Gaussian. A draw moves the position; draws that bring it
# back to where it was have regenerated all 624 words on the way, and the head compares
# 15 or 16 of them: a false "still stands" needs 480 or more bits to repeat. The capture
# itself still reads the whole state, which is what is set back.
_HEAD = 64


class HostState(NamedTuple):
    """Python's and NumPy's global generators at one moment.

    Each is either raw bytes read from the generator (NOTE [reading host generators
    directly]) or what its public API returns; ``numpy`` is None when NumPy was not
    imported.
    """

    python: Any
    numpy: Any


class _Raw(NamedTuple):
    memory: bytes  # the words and the position
    gauss_next: Any = None  # Python's: an attribute of the random.Random instance; NumPy's: flag and value


# ----------------------------------------------------------------------------- Python
@functools.cache
def _python_offset() -> int | None:
    """Where random.Random keeps its index (its words follow), found on probes once (None: not found)."""
    if sys.implementation.name != "cpython":
        return None
    found: set[int] = set()
    for seed, draws in ((1, 0), (2, 1), (3, 7), (4, 700)):
        probe = random.Random(seed)
        for _ in range(draws):
            probe.random()
        internal = probe.getstate()[1]
        memory = ctypes.string_at(id(probe), type(probe).__basicsize__)
        words = struct.pack(f"={_WORDS}I", *internal[:_WORDS])
        at = memory.find(words)
        if at < 4 or memory.find(words, at + 1) != -1:
            return None
        if struct.unpack_from("=i", memory, at - 4)[0] != internal[_WORDS]:
            return None
        found.add(at - 4)
    if len(found) != 1:
        return None
    offset = found.pop()
    instance = _python_instance()
    if type(instance) is not random.Random or _read_python(instance, offset) != _raw_of_python(instance.getstate()):
        return None
    return offset


def _python_instance() -> Any:
    """The random module's global generator (its functions are this instance's methods)."""
    return random.getstate.__self__  # type: ignore[attr-defined]


# Views of the bytes read, made once per object and size: reading through a view copies
# the bytes without a ctypes call, whose machinery a replay otherwise runs on cold caches
# between two large kernels. Each view keeps its object alive, so its address stays valid.
_VIEWS: dict[tuple[int, int], tuple[Any, memoryview]] = {}


def _read(owner: Any, address: int, size: int) -> bytes:
    """`size` bytes at `address`, inside the live object `owner`."""
    cached = _VIEWS.get((address, size))
    if cached is None or cached[0] is not owner:
        if len(_VIEWS) > 16:  # generators replaced again and again: start over
            _VIEWS.clear()
        cached = _VIEWS[address, size] = (owner, memoryview((ctypes.c_char * size).from_address(address)).cast("B"))
    return cached[1].tobytes()


def _read_python(instance: Any, offset: int, size: int = _MT_BYTES) -> _Raw:
    return _Raw(_read(instance, id(instance) + offset, size), instance.gauss_next)


def _raw_of_python(state: Any) -> _Raw:
    internal = state[1]
    return _Raw(struct.pack("=i", internal[_WORDS]) + struct.pack(f"={_WORDS}I", *internal[:_WORDS]), state[2])


def _python_state(head: bool = False) -> Any:
    offset = _python_offset()
    instance = _python_instance()
    if offset is None or type(instance) is not random.Random:
        return random.getstate()
    return _read_python(instance, offset, _HEAD if head else _MT_BYTES)


def _set_python(state: Any) -> None:
    if isinstance(state, _Raw):
        index = struct.unpack_from("=i", state.memory, 0)[0]
        words = struct.unpack_from(f"={_WORDS}I", state.memory, 4)
        state = (random.Random.VERSION, (*words, index), state.gauss_next)
    random.setstate(state)


# ----------------------------------------------------------------------------- NumPy
@functools.cache
def _numpy_offsets(numpy: Any) -> tuple[int, int] | None:
    """Where a legacy RandomState keeps its cached Gaussian (flag, value), found on probes
    once (None: not found)."""
    if sys.implementation.name != "cpython" or not hasattr(numpy.random, "get_bit_generator"):
        return None
    found: set[tuple[int, int]] = set()
    for seed in (1, 2, 3):
        probe = numpy.random.RandomState(seed)
        probe.standard_normal()  # draws two, returns one and caches the other
        state = probe.get_state(legacy=False)
        memory = ctypes.string_at(id(probe), type(probe).__basicsize__)
        value = struct.pack("=d", state["gauss"])
        at = memory.find(value)
        if not state["has_gauss"] or at < 8 or memory.find(value, at + 1) != -1:
            return None
        flag = at - 8  # {int has_gauss; double gauss}: the double aligned on 8 bytes
        if struct.unpack_from("=i", memory, flag)[0] != 1:
            return None
        probe.standard_normal()  # takes the cached one
        state = probe.get_state(legacy=False)
        memory = ctypes.string_at(id(probe), type(probe).__basicsize__)
        if state["has_gauss"] or struct.unpack_from("=i", memory, flag)[0] != 0:
            return None
        if struct.unpack_from("=d", memory, at)[0] != state["gauss"]:
            return None
        found.add((flag, at))
    if len(found) != 1:
        return None
    offsets = found.pop()
    instance = numpy.random.get_state.__self__
    if type(instance) is not numpy.random.RandomState:
        return None
    read = _read_numpy(numpy, instance, offsets)
    if read is not None and read != _raw_of_numpy(numpy, instance.get_state(legacy=False)):
        return None
    return offsets


def _read_numpy(numpy: Any, instance: Any, offsets: tuple[int, int], head: bool = False) -> _Raw | None:
    generator = numpy.random.get_bit_generator()
    if type(generator).__name__ != "MT19937":
        return None
    flag, value = offsets
    address = generator.ctypes.state_address
    if head:  # the first words and the position
        words = _read(generator, address, _HEAD) + _read(generator, address + _WORDS * 4, 4)
    else:
        words = _read(generator, address, _MT_BYTES)
    return _Raw(words, _read(instance, id(instance) + flag, 4) + _read(instance, id(instance) + value, 8))


def _raw_of_numpy(numpy: Any, state: dict[str, Any]) -> _Raw | None:
    if state.get("bit_generator") != "MT19937":
        return None
    key = numpy.asarray(state["state"]["key"], dtype=numpy.uint32)
    return _Raw(
        key.tobytes() + struct.pack("=i", int(state["state"]["pos"])),
        struct.pack("=i", int(state["has_gauss"])) + struct.pack("=d", float(state["gauss"])),
    )


def _numpy_state(numpy: Any, head: bool = False) -> Any:
    offsets = _numpy_offsets(numpy)
    instance = numpy.random.get_state.__self__
    if offsets is not None and type(instance) is numpy.random.RandomState:
        read = _read_numpy(numpy, instance, offsets, head)
        if read is not None:
            return read
    return numpy.random.get_state(legacy=False)  # a dict, for any bit generator


def _set_numpy(numpy: Any, state: Any) -> None:
    if isinstance(state, _Raw):
        memory, gauss = state
        state = {
            "bit_generator": "MT19937",
            "state": {
                "key": numpy.frombuffer(memory[: _WORDS * 4], dtype=numpy.uint32).copy(),
                "pos": struct.unpack_from("=i", memory, _WORDS * 4)[0],
            },
            "has_gauss": struct.unpack_from("=i", gauss, 0)[0],
            "gauss": struct.unpack_from("=d", gauss, 4)[0],
        }
    numpy.random.set_state(state)


def _equal(a: Any, b: Any) -> bool:
    """Equality of two captured states, of either form (NumPy arrays compared by value)."""
    if type(a) is _Raw:  # the usual case, first
        return type(b) is _Raw and a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and not isinstance(a, _Raw):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape"):  # a NumPy array
        return bool(a.shape == b.shape and (a == b).all())
    return bool(a == b)


# ----------------------------------------------------------------------------- both
def capture() -> HostState:
    """The generators' states now."""
    numpy = sys.modules.get("numpy")
    return HostState(_python_state(), None if numpy is None else _numpy_state(numpy))


def stands_at(state: HostState) -> bool:
    """Whether the generators are in the states `state` captured (NumPy's: if it was captured).

    States read as bytes are compared by their heads (NOTE [comparing heads]).
    """
    python = state.python
    if type(python) is _Raw:
        if _python_state(head=True) != _Raw(python.memory[:_HEAD], python.gauss_next):
            return False
    elif not _equal(_python_state(), python):
        return False
    numpy = sys.modules.get("numpy")
    if numpy is None or state.numpy is None:
        return True
    captured = state.numpy
    if type(captured) is _Raw:
        head = captured.memory[:_HEAD] + captured.memory[_WORDS * 4 :]
        return bool(_numpy_state(numpy, head=True) == _Raw(head, captured.gauss_next))
    return _equal(_numpy_state(numpy), captured)


def restore(state: HostState) -> None:
    """Sets the generators to `state` (NumPy's when it was captured)."""
    _set_python(state.python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and state.numpy is not None:
        _set_numpy(numpy, state.numpy)
