"""One plan for all ranks: the automatic mode under ``torch.distributed``.

Each rank measures its own step, and timings are noisy: planned alone, two ranks can pick
different schedules. When the stages hold collectives (tensor parallelism, FSDP), a
recompute on one rank and not on the other pairs a collective with the wrong one: a hang
or wrong gradients. And a rank that sees a new input shape measures alone while the
others train.

NOTE [one plan for all ranks]
While a default process group of more than one rank is initialised, every training call
of the automatic mode starts with one small all-reduce, on every rank: whether a rank
must measure (a new input signature), and the round of the plan it holds for its input.
When no rank must measure and all hold plans of the same round, each runs its plan: the
plans of one round were made from the same figures, so they are the same schedule.
Otherwise the ranks plan a new round together: those that must measure do (the others
keep their measurement), a failure on any rank is raised on every rank, and the figures
the solver reads are combined (the largest bytes and the longest times of any rank; the
structure of the chain must be the same everywhere, or every rank raises the same
error). The budget in bytes is the smallest of the ranks'. The solver is deterministic:
every rank gets the same schedule.

The cost is one all-reduce of three integers per training call. Every rank must make the
same number of training calls of the model (as data parallelism does); a model trained
on some ranks only, or with different plans on purpose, is built with
``agree_ranks=False``.

NOTE [measuring together]
A model whose stages run collectives (tensor parallelism) cannot be measured on one rank
while the others train: its timing pass runs those collectives, which every rank must
run, in the same order, with tensors of the same shapes. For such a model, when any rank
must measure, every rank measures, and only if all hold the same input signature (else
every rank raises the same error, which names the fix). Every rank then makes the same
decisions while measuring: no rank's times are scaled from an earlier shape (which one
rank could do while another times), a budget no schedule fits on any rank stops every
rank before the timing pass runs (:meth:`RankAgreement.before_timing`), and the timing
pass runs the stages within the smallest of the ranks' budgets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from remat.errors import RematError

__all__ = ["RankAgreement", "agreement_group_active", "largest_on_any_rank", "same_on_every_rank"]

# A field of a planning figure whose name holds one of these is combined across ranks
# (the largest value); every other value is the chain's structure, which must agree.
_COMBINED_INTEGERS = "bytes"
_COMBINED_FLOATS = ("_s", "time_s")
# (field, position): bytes inside pairs of indices and bytes
_COMBINED_PAIRS = {"leftover_freed": 1}
# bytes a figure takes off a peak (a store option's shared bytes): the smallest of any rank
_COMBINED_MINIMA = frozenset({"shared_bytes"})


def agreement_group_active() -> bool:
    """Whether a default process group of more than one rank is initialised."""
    if not torch.distributed.is_available():  # pragma: no cover - torch built without it
        return False
    import torch.distributed as dist

    return bool(dist.is_initialized() and dist.get_world_size() > 1)


def _device() -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "gloo" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _all_reduce_max(values: list[int]) -> list[int]:
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def largest_on_any_rank(values: list[float]) -> list[float]:
    """The largest of each value on any rank of the process group (a collective call)."""
    import torch.distributed as dist

    if not values:
        return []
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.tolist()]


# ------------------------------------------------------------ combining figures


def _rebuild(
    value: Any,
    name: str,
    take: Callable[[str, Any], Any],
    seen: Callable[[str, Any], None] | None = None,
    position: int = -1,
) -> Any:
    """`value` with each figure to combine replaced by ``take(kind, figure)`` (kind "int" or "float").

    ``seen(kind, leaf)`` is told of every leaf in order, the structure's ("same") too, a
    tuple's length among them.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            field.name: _rebuild(getattr(value, field.name), field.name, take, seen)
            for field in dataclasses.fields(value)
            if field.name != "metadata"  # the rank's own facts (device, shapes)
        }
        return dataclasses.replace(value, **changes)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_rebuild(getattr(value, f), f, take, seen) for f in value._fields))
    if isinstance(value, tuple | list):
        if seen is not None:
            seen("same", ("length", len(value)))
        pair = name in _COMBINED_PAIRS
        return type(value)([_rebuild(item, name, take, seen, i if pair else -1) for i, item in enumerate(value)])
    if isinstance(value, bool) or value is None or isinstance(value, str):
        kind = "same"
    elif isinstance(value, int) and name in _COMBINED_MINIMA:
        kind = "min"
    elif isinstance(value, int):
        kind = "int" if _COMBINED_INTEGERS in name or _COMBINED_PAIRS.get(name) == position else "same"
    elif isinstance(value, float):
        kind = "float" if name.endswith(_COMBINED_FLOATS) else "same"
    else:
        raise TypeError(f"cannot combine a {type(value).__name__} ({name}) across ranks")
    if seen is not None:
        seen(kind, value)
    return value if kind == "same" else take(kind, value)


def _walk(value: Any, name: str) -> list[tuple[str, Any]]:
    """The leaves of a planning figure, in order: ("int"/"float", figure) to combine, else ("same", leaf)."""
    leaves: list[tuple[str, Any]] = []
    _rebuild(value, name, lambda _kind, figure: figure, lambda kind, leaf: leaves.append((kind, leaf)))
    return leaves


def _structure_text(leaves: list[tuple[str, Any]]) -> str:
    """What must agree across ranks."""
    return "\x00".join(repr((kind, type(value).__name__)) if kind != "same" else repr(value) for kind, value in leaves)


def _without_device_indices(key: Any) -> str:
    """An input signature as text, without device indices (each rank has its own GPU)."""
    return re.sub(r"(cuda|xpu|hpu|npu|mps):\d+|index=\d+", r"\1", repr(key))


def same_on_every_rank(text: str) -> bool:
    """Whether every rank of the process group holds the same `text` (a collective call),
    compared by a hash that is the same in every process (unlike ``hash(str)``)."""
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")
    highest, negated_lowest = _all_reduce_max([digest, -digest])
    return highest == -negated_lowest


# ------------------------------------------------------------ the agreement


class RankAgreement:
    """The rounds of plans of one automatic-mode model (NOTE [one plan for all ranks])."""

    def __init__(self) -> None:
        self.rounds: dict[Any, int] = {}  # the round of the plan held, by input signature
        #: whether the ranks are measuring together right now (NOTE [measuring together])
        self.measuring_together = False

    def agreed(
        self,
        key: Any,
        held: Any,
        must_measure: bool,
        measure: Callable[[], Any],
        replan: Callable[[], Any],
        *,
        together: bool = False,
    ) -> Any:
        """The plan of this rank's input `key`, the same schedule as every other rank's.

        Args:
            key: this rank's input signature.
            held: the plan this rank holds for `key` (None: none).
            must_measure: whether this rank must measure `key` (a new input).
            measure: measures `key`.
            replan: plans `key` again, from the figures of all ranks (:meth:`combined`).
            together: the stages run collectives: when any rank measures, all do, on one input
                signature (NOTE [measuring together]).
        """
        round_held = self.rounds.get(key, -1) if held is not None else -1
        needs, highest, negated_lowest = _all_reduce_max([int(must_measure or held is None), round_held, -round_held])
        if not needs and highest == -negated_lowest:
            return held  # every rank holds a plan of the same round
        if together and needs:
            if not same_on_every_rank(_without_device_indices(key)):
                raise RematError(
                    "the ranks hold inputs of different signatures (shapes, dtypes or modes) while the "
                    "model's stages run collectives (tensor parallelism): its ranks measure together, "
                    "on one input, and no plan was made. Give every rank inputs of the same shapes (pad "
                    "a last short batch, or drop it)"
                )
            self.measuring_together = True
            try:
                self.measured_everywhere(measure)
            finally:
                self.measuring_together = False
        else:
            self.measured_everywhere(measure if must_measure else None)
        plan = replan()
        self.rounds[key] = highest + 1
        return plan

    @staticmethod
    def measured_everywhere(measure: Callable[[], Any] | None) -> None:
        """Runs `measure` (None: nothing to measure here); a failure on any rank raises on all."""
        error: BaseException | None = None
        if measure is not None:
            try:
                measure()
            except Exception as caught:  # noqa: BLE001 - raised below, on every rank
                error = caught
        (failed,) = _all_reduce_max([int(error is not None)])
        if error is not None:
            raise error
        if failed:
            raise RematError(
                "another rank failed while remat measured the model for a plan of all ranks (its error "
                "is raised there); this rank stops too, so that no rank waits for the others"
            )

    @staticmethod
    def before_timing(check: Callable[[], None], total_bytes: int) -> int:
        """While measuring together: runs `check` (the budget's feasibility) on every rank; a
        failure on any rank raises on all, before the timing pass. Returns the smallest of
        the ranks' budgets in bytes, which the timing pass keeps within."""
        error: BaseException | None = None
        try:
            check()
        except Exception as caught:  # noqa: BLE001 - raised below, on every rank
            error = caught
        failed, negated = _all_reduce_max([int(error is not None), -int(total_bytes)])
        if error is not None:
            raise error
        if failed:
            raise RematError(
                "no plan fits the budget on another rank (its error is raised there); the ranks "
                "measure this model together, so this rank stops too"
            )
        return -negated

    @staticmethod
    def combined(planning: Any) -> Any:
        """The figures of `planning` combined across ranks: the largest bytes and times of any rank."""
        leaves = _walk(planning.profile, "profile") + _walk(planning.outside, "outside")
        if not same_on_every_rank(_structure_text(leaves)):
            raise RematError(
                "the ranks measured chains of different structure (other stages, groups or "
                "breaks), so no plan can serve them all; give every rank the same model, or pass "
                "agree_ranks=False to plan on each rank alone (safe only when no stage holds a "
                "collective)"
            )
        integers = iter(_all_reduce_max([v for kind, v in leaves if kind == "int"]))
        negated = [-v for kind, v in leaves if kind == "min"]  # (the same count on every rank)
        minima = iter(_all_reduce_max(negated) if negated else [])
        floats = iter(largest_on_any_rank([v for kind, v in leaves if kind == "float"]))

        def take(kind: str, _value: Any) -> Any:
            if kind == "min":
                return -next(minima)
            return next(integers) if kind == "int" else next(floats)

        profile = _rebuild(planning.profile, "profile", take)
        outside = _rebuild(planning.outside, "outside", take)
        # the same float on every rank: the largest margin, rounded up to a millionth
        (margin_millionths,) = _all_reduce_max([math.ceil(planning.margin * 1e6)])
        return planning._replace(profile=profile, outside=outside, margin=margin_millionths / 1e6)

    @staticmethod
    def smallest(total_bytes: int) -> int:
        """The smallest of the ranks' budgets in bytes."""
        (negated,) = _all_reduce_max([-int(total_bytes)])
        return -negated
