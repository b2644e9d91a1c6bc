"""The plan tree, and the flat list of operations it stands for.

A plan tree is a tuple of items covering the stages ``0 .. n-1`` in order. An item is
:class:`Store` (run the stage keeping what its backward needs), :class:`Offload` (the same,
with what it keeps moved to host memory until its backward nears), or :class:`Region`
(run a range of stages once keeping only its input; when the backward reaches the range,
run its ``body``, a plan tree of the same range, forward then backward).

:func:`operations` flattens a tree into the schedule itself: the list of operations that
the simulator (:mod:`remat.plan.simulate`) checks and the executor (:mod:`remat.execute`)
runs. :func:`tree_of` reads the tree back from the operations.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.errors import RematError

__all__ = [
    "InvalidPlan",
    "Offload",
    "Operation",
    "OperationKind",
    "PlanItem",
    "PlanTree",
    "Region",
    "Store",
    "operations",
    "plan_from_data",
    "plan_to_data",
    "validate_plan",
]


class InvalidPlan(RematError, ValueError):
    """A plan or an operation sequence does not describe a valid schedule of the chain."""


@dataclass(frozen=True)
class Store:
    """Run stage ``stage`` once, keeping what its backward needs until that backward.

    Attributes:
        stage: the stage index.
        option: None to keep everything; else the name of one of the profile's store
            options: the stage runs as a selective recompute block under its policy
            (NOTE [stored under a policy] in :mod:`remat.plan.options`).
    """

    stage: int
    option: str | None = None


@dataclass(frozen=True)
class Offload:
    """Run stage ``stage`` once keeping what its backward needs, in host memory meanwhile.

    What the stage saves for its backward (its input and output apart, which stay where
    they are) is copied to host memory while the next stage runs forward, and brought back
    while the next stage runs backward (NOTE [offloaded stages] in :mod:`remat.plan.simulate`).
    An offloaded stage is never the last item of its level: the next stage's forward and
    backward are what the copies overlap.

    Attributes:
        stage: the stage index.
    """

    stage: int


@dataclass(frozen=True, eq=False)
class Region:
    """Run stages ``[start, stop)`` keeping only ``x_start``; re-run them as ``body`` later.

    In the forward pass the stages of the region run once and discard everything but their
    input ``x_start`` (the checkpoint). When the backward pass reaches the region, ``body``
    (a plan covering ``[start, stop)`` exactly) runs: its forward part, then its backward.

    Attributes:
        start: the first stage of the region.
        stop: one past the last stage of the region.
        body: the plan of ``[start, stop)`` run when the backward reaches the region. Its
            first item, if a region, is strictly shorter than this one.
    """

    start: int
    stop: int
    body: tuple[Store | Offload | Region, ...]

    # A plan for the smallest budget nests a region in every body: a chain of 1,000 stages
    # gives a tree 1,000 deep, beyond what recursive hashing and comparison allow.
    def _key(self) -> tuple[Any, ...]:
        """The tree as a flat tuple: a stage s is s (-4, s, option under an option), a region
        (-1, start, stop), its end -2, an offloaded stage (-3, s)."""
        key = self.__dict__.get("_cached_key")
        if key is not None:
            return key
        out: list[Any] = []
        for kind, item in _walk((self,)):
            if isinstance(item, Store):
                out += (item.stage,) if item.option is None else (-4, item.stage, item.option)
            elif isinstance(item, Offload):
                out += (-3, item.stage)
            else:
                out += (-1, item.start, item.stop) if kind == "region" else (-2,)
        key = tuple(out)
        object.__setattr__(self, "_cached_key", key)
        return key

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Region):
            return NotImplemented
        return self is other or self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


PlanItem = Store | Offload | Region
"""One item of a plan tree."""


def _walk(items: Sequence[PlanItem]) -> Iterator[tuple[str, PlanItem]]:
    """The items of a tree in order, flat, without recursion: ``("store", Store)``,
    ``("offload", Offload)``, and ``("region", Region)`` before the region's body, ``("end",
    Region)`` after it."""
    pending: list[tuple[bool, PlanItem]] = [(False, item) for item in reversed(items)]
    while pending:
        body_done, item = pending.pop()
        if isinstance(item, Store):
            yield "store", item
        elif isinstance(item, Offload):
            yield "offload", item
        elif body_done:
            yield "end", item
        else:
            yield "region", item
            pending.append((True, item))
            pending.extend((False, child) for child in reversed(item.body))


PlanTree = tuple[PlanItem, ...]
"""A plan tree: items covering the stages of a chain in order."""


class OperationKind(str, enum.Enum):
    """What one step of a schedule does."""

    FORWARD_CHECKPOINT = "forward_checkpoint"
    """Forward of the first stage of a region: its input is kept, nothing else."""
    FORWARD_DISCARD = "forward_discard"
    """Forward of a later stage of a region: nothing is kept."""
    FORWARD_STORE = "forward_store"
    """Forward keeping what the stage's backward needs."""
    FORWARD_OFFLOAD = "forward_offload"
    """Forward keeping what the stage's backward needs in host memory until near its backward."""
    LOSS = "loss"
    """The end of the forward pass: the gradient of the chain output appears."""
    BACKWARD = "backward"
    """Backward of a stage."""

    @property
    def is_forward(self) -> bool:
        """Whether the operation runs the forward of a stage."""
        return self in _FORWARD_KINDS


_FORWARD_KINDS = frozenset(
    {
        OperationKind.FORWARD_CHECKPOINT,
        OperationKind.FORWARD_DISCARD,
        OperationKind.FORWARD_STORE,
        OperationKind.FORWARD_OFFLOAD,
    }
)


@dataclass(frozen=True)
class Operation:
    """One step of a schedule.

    Attributes:
        kind: what the step does.
        stage: the stage it runs; None for :attr:`OperationKind.LOSS`.
        option: for :attr:`OperationKind.FORWARD_STORE`, the store option the stage runs
            under (see :class:`Store`); None otherwise.
    """

    kind: OperationKind
    stage: int | None = None
    option: str | None = None

    def __str__(self) -> str:
        if self.stage is None:
            return self.kind.value
        if self.option is not None:
            return f"{self.kind.value}({self.stage}, {self.option})"
        return f"{self.kind.value}({self.stage})"


_LOSS = Operation(OperationKind.LOSS)


def operations(plan: PlanTree) -> list[Operation]:
    """Flattens a plan into the operations the executor runs, in order.

    ``ops(items) = fwd(items[0]) + ops(items[1:]) + bwd(items[0])`` with ``ops(())`` the
    loss marker at the top level and nothing inside a region's body; ``fwd(Store(i))`` is
    ``forward_store(i)`` (``forward_offload(i)`` for :class:`Offload`), ``bwd(Store(i))`` is
    ``backward(i)``; ``fwd(Region)`` is
    ``forward_checkpoint(start)`` and ``forward_discard`` of the other stages, and
    ``bwd(Region)`` is the operations of its body.

    Args:
        plan: the plan (not validated here: see :func:`validate_plan`).

    Returns:
        The operations, forward pass first, with one ``loss`` marker.
    """
    result: list[Operation] = []
    # Iterative (a plan for the smallest budget nests as deep as the chain is long): each
    # level's forwards in order, the loss marker at the top level, then its backwards in
    # reverse, a region's backward being its body's level.
    pending: list[tuple[Sequence[PlanItem], bool] | int] = [(plan, True)]
    while pending:
        work = pending.pop()
        if isinstance(work, int):
            result.append(Operation(OperationKind.BACKWARD, work))
            continue
        items, top_level = work
        for item in items:
            if isinstance(item, Store):
                result.append(Operation(OperationKind.FORWARD_STORE, item.stage, item.option))
            elif isinstance(item, Offload):
                result.append(Operation(OperationKind.FORWARD_OFFLOAD, item.stage))
            else:
                result.append(Operation(OperationKind.FORWARD_CHECKPOINT, item.start))
                result.extend(
                    Operation(OperationKind.FORWARD_DISCARD, stage) for stage in range(item.start + 1, item.stop)
                )
        if top_level:
            result.append(_LOSS)
        # the last item's backward comes first: pushed last
        pending.extend((item.body, False) if isinstance(item, Region) else item.stage for item in items)
    return result


def validate_plan(plan: PlanTree, n_stages: int) -> None:
    """Checks that a plan is a valid schedule of a chain of ``n_stages`` stages.

    Args:
        plan: the plan.
        n_stages: the number of stages of the chain.

    Raises:
        InvalidPlan: the plan does not cover the stages in order, a region is empty or its
            body does not cover it, or a body starts with a region as long as its own.
    """
    if n_stages < 1:
        raise InvalidPlan(f"a chain has at least one stage, got n_stages={n_stages}")
    if not isinstance(plan, tuple):
        raise InvalidPlan(f"a plan is a tuple of Store and Region items, got {type(plan).__name__}")
    pending: list[tuple[tuple[PlanItem, ...], int, int, str]] = [(plan, 0, n_stages, "plan")]
    while pending:  # iterative: plans nest as deep as the chain is long
        pending.extend(_validate_items(*pending.pop()))


def _validate_items(
    items: tuple[PlanItem, ...], start: int, stop: int, where: str
) -> list[tuple[tuple[PlanItem, ...], int, int, str]]:
    """Checks one level; returns the bodies of its regions, to check in turn."""
    if not isinstance(items, tuple) or not items:
        raise InvalidPlan(f"{where} must be a non-empty tuple covering stages [{start}, {stop})")
    position = start
    bodies = []
    for index, item in enumerate(items):
        label = f"{where}[{index}]"
        if isinstance(item, Store | Offload):
            if item.stage != position:
                raise InvalidPlan(
                    f"{label} is {type(item).__name__}({item.stage}) but stage {position} comes next "
                    f"(items must cover [{start}, {stop}) in order)"
                )
            if isinstance(item, Offload) and where != "plan":
                raise InvalidPlan(
                    f"{label} offloads stage {item.stage} inside a region's body: offload is planned at the "
                    "top level only (a replayed stage keeps its saved tensors for the region's graph)"
                )
            if isinstance(item, Offload) and index == len(items) - 1:
                raise InvalidPlan(
                    f"{label} offloads stage {item.stage}, the last of its level: an offloaded stage needs "
                    "a next stage whose forward and backward its copies overlap (store it instead)"
                )
            position += 1
        elif isinstance(item, Region):
            _check_region(item, position, start, stop, label)

            bodies.append((item.body, item.start, item.stop, f"{label}.body"))
            position = item.stop
        else:
            raise InvalidPlan(f"{label} is {item!r}, not a Store, an Offload or a Region")
        if position > stop:
            raise InvalidPlan(f"{label} reaches stage {position - 1}, past the end {stop - 1}")
    if position != stop:
        raise InvalidPlan(f"{where} covers stages [{start}, {position}) but must cover [{start}, {stop})")
    return bodies


def _check_region(item: Region, position: int, start: int, stop: int, label: str) -> None:
    if item.start != position:
        raise InvalidPlan(
            f"{label} is a region starting at stage {item.start} but stage {position} "
            f"comes next (items must cover [{start}, {stop}) in order)"
        )
    if item.stop <= item.start:
        raise InvalidPlan(f"{label} is the empty region [{item.start}, {item.stop})")
    first = item.body[0] if isinstance(item.body, tuple) and item.body else None
    if isinstance(first, Region) and first.start == item.start and first.stop >= item.stop:
        raise InvalidPlan(
            f"{label}: the body of region [{item.start}, {item.stop}) starts with the "
            f"region [{first.start}, {first.stop}); a body's first region must be "
            "strictly shorter than the region itself"
        )


def plan_to_data(plan: PlanTree) -> list[dict[str, Any]]:
    """Returns a plan as flat JSON-able data: ``{"store": i}`` (``{"store": i, "option":
    name}`` under a store option), ``{"offload": i}``, or ``{"region": [s, t]}`` followed
    by the entries of its body and ``{"end": [s, t]}``.

    Flat, so that a plan nested as deep as a long chain (the smallest budget's) is written
    and read without recursion. See :func:`plan_from_data` for the way back.
    """
    data: list[dict[str, Any]] = []
    for kind, item in _walk(plan):
        if isinstance(item, Store) and item.option is not None:
            data.append({kind: item.stage, "option": item.option})
        elif isinstance(item, Store | Offload):
            data.append({kind: item.stage})
        else:
            data.append({kind: [item.start, item.stop]})
    return data


def plan_from_data(data: Sequence[Mapping[str, Any]]) -> PlanTree:
    """Builds a plan from the data :func:`plan_to_data` returns (not validated here).

    The nested form of earlier versions (``{"region": [s, t], "body": [...]}``) is read too.

    Raises:
        InvalidPlan: an entry is neither a store, a region nor a region's end, or the
            regions and their ends do not match.
    """
    levels: list[tuple[list[PlanItem], tuple[int, int] | None]] = [([], None)]
    pending: list[Mapping[str, Any] | None] = list(reversed(data))
    nested: list[tuple[int, int]] = []  # the regions of the nested form, closed by a None
    index = 0
    while pending:
        entry = pending.pop()
        if entry is None:  # the end of a nested region's body
            entry = {"end": list(nested.pop())}
        else:
            index += 1
        keys = set(entry) if isinstance(entry, Mapping) else set()
        if keys == {"store"}:
            levels[-1][0].append(Store(int(entry["store"])))
        elif keys == {"store", "option"} and isinstance(entry["option"], str):
            levels[-1][0].append(Store(int(entry["store"]), entry["option"]))
        elif keys == {"offload"}:
            levels[-1][0].append(Offload(int(entry["offload"])))
        elif keys in ({"region"}, {"region", "body"}):
            start, stop = (int(value) for value in entry["region"])
            levels.append(([], (start, stop)))
            if "body" in keys:
                nested.append((start, stop))
                pending.append(None)
                pending.extend(reversed(list(entry["body"])))
        elif keys == {"end"} and len(levels) > 1 and levels[-1][1] == tuple(int(v) for v in entry["end"]):
            body, (start, stop) = levels.pop()  # type: ignore[misc]
            levels[-1][0].append(Region(start, stop, tuple(body)))
        else:
            raise InvalidPlan(
                f"plan entry {index - 1} is {entry!r}; expected {{'store': i}}, {{'offload': i}}, "
                "{'region': [start, stop]} "
                "opening a region's body, or {'end': [start, stop]} closing it"
            )
    if len(levels) != 1:
        raise InvalidPlan(f"the plan's region {levels[-1][1]} has no end entry")
    return tuple(levels[0][0])
