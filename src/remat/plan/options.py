"""Ways to store a stage other than keeping everything: a stage stored under a policy.

NOTE [stored under a policy]
A stage is stored (:class:`~remat.plan.operations.Store`) keeping everything its backward
needs, or, with a :class:`StoreOption` of the profile, as one selective recompute block
under that option's policy (:mod:`remat.policies`): its first forward keeps its input and
the outputs of the operations the policy keeps, and when the backward reaches the stage it
runs the stage's forward again (the kept operations are not run), which makes everything
the stage's backward needs, then runs that backward. In the terms of the simulator's
memory model (:mod:`remat.plan.simulate`), for a stage ``i`` stored under option ``o``:

* its forward peaks as the stage stored whole does (``x_{i+1} + S_i + ft_i`` on top of
  what is live: the first forward makes every tensor once);
* from then until its backward it holds ``x_i`` (the block keeps its input),
  ``saved_bytes[i]`` of the option (the kept outputs, ``x_i`` and ``x_{i+1}`` not
  counted), and ``x_{i+1}`` when ``saves_output[i]`` (a kept operation returned it);
* its backward first runs the forward again, peaking at
  ``live - K + [x_{i+1} unless kept] + S_i + ft_i``, then the backward proper, at
  ``live - K + S_i + G_i + bt_i``, where ``K`` (``shared_bytes``) is what of the kept
  outputs the backward saves too: the recompute takes those over as part of ``S_i``
  instead of making them again; the other kept outputs are counted until the backward
  ends (the safe side);
* its backward takes ``backward_time_s[i] + extra_time_s[i]``: the operations the policy
  does not keep, run again, and the policy's cost of deciding on each operation.

The dynamic program (``NOTE [memory accounting of the dynamic program]``) takes, for
"store a", the best of storing whole and each option, with these terms.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.errors import RematError

__all__ = ["StoreOption"]


class _InvalidOption(RematError, ValueError):
    """Raised as the profile's InvalidProfile by :func:`checked_options`."""


@dataclass(frozen=True)
class StoreOption:
    """Another way to store each stage: as a selective recompute block under a named policy.

    See NOTE [stored under a policy]. Sequences have one entry per stage.

    Attributes:
        name: the option's name (the policy's), as plans and reports name it.
        saved_bytes: bytes the stage keeps until its backward under the option, its input
            and output not counted; None where the option does not apply to the stage.
        saves_output: whether the stage keeps its output under the option.
        extra_time_s: seconds the option adds to the stage's backward.
        shared_bytes: of ``saved_bytes``, the bytes the stage's backward saves too (they
            are in the profile's ``saved_bytes`` of the stage); empty for none.
    """

    name: str
    saved_bytes: tuple[int | None, ...]
    saves_output: tuple[bool, ...]
    extra_time_s: tuple[float, ...]
    shared_bytes: tuple[int, ...] = ()

    def shared(self, stage: int) -> int:
        """``shared_bytes[stage]``, 0 when none are given."""
        return self.shared_bytes[stage] if self.shared_bytes else 0

    def applies(self, stage: int) -> bool:
        """Whether a stage may be stored under this option."""
        return self.saved_bytes[stage] is not None

    def to_dict(self) -> dict[str, Any]:
        """The option as JSON-able data (see :func:`checked_options`, which reads it back)."""
        return {
            "name": self.name,
            "saved_bytes": list(self.saved_bytes),
            "saves_output": list(self.saves_output),
            "extra_time_s": list(self.extra_time_s),
            "shared_bytes": list(self.shared_bytes),
        }


def checked_options(values: Any, saved_bytes: tuple[int, ...]) -> tuple[StoreOption, ...]:
    """The options of a profile whose stages save ``saved_bytes``, from options or their dicts, checked.

    Raises:
        RematError (a ValueError): an option is malformed: a name repeated or empty, a
            sequence of the wrong length, a negative or non-finite value.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise _InvalidOption(f"store_options must be a sequence of StoreOption, got {type(values).__name__}")
    options: list[StoreOption] = []
    for index, value in enumerate(values):
        if isinstance(value, Mapping):
            unknown = set(value) - {"name", "saved_bytes", "saves_output", "extra_time_s", "shared_bytes"}
            if unknown:
                raise _InvalidOption(f"store_options[{index}] has unknown keys {sorted(unknown)}")
            try:
                value = StoreOption(**value)
            except TypeError as error:
                raise _InvalidOption(f"store_options[{index}]: {error}") from None
        if not isinstance(value, StoreOption):
            raise _InvalidOption(f"store_options[{index}] must be a StoreOption, got {type(value).__name__}")
        options.append(_checked(value, saved_bytes, f"store_options[{index}]"))
    names = [option.name for option in options]
    if len(set(names)) != len(names):
        raise _InvalidOption(f"store_options repeat a name: {names}")
    return tuple(options)


def _checked(option: StoreOption, stage_saved: tuple[int, ...], where: str) -> StoreOption:
    n_stages = len(stage_saved)
    if not isinstance(option.name, str) or not option.name:
        raise _InvalidOption(f"{where}.name must be a non-empty str, got {option.name!r}")
    where = f"{where} ({option.name!r})"
    lists = {}
    for field_name in ("saved_bytes", "saves_output", "extra_time_s"):
        values = getattr(option, field_name)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != n_stages:
            raise _InvalidOption(f"{where}.{field_name} must have one value per stage ({n_stages})")
        lists[field_name] = tuple(values)
    saved: list[int | None] = []
    for stage, nbytes in enumerate(lists["saved_bytes"]):
        if nbytes is None:
            saved.append(None)
            continue
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise _InvalidOption(f"{where}.saved_bytes[{stage}] must be a whole number of bytes >= 0 or None")
        saved.append(int(nbytes))
    flags = []
    for stage, flag in enumerate(lists["saves_output"]):
        if flag not in (0, 1) or not isinstance(flag, numbers.Integral):
            raise _InvalidOption(f"{where}.saves_output[{stage}] must be a bool, got {flag!r}")
        flags.append(bool(flag))
    times = []
    for stage, seconds in enumerate(lists["extra_time_s"]):
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= float(seconds) < math.inf:
            raise _InvalidOption(f"{where}.extra_time_s[{stage}] must be finite seconds >= 0, got {seconds!r}")
        times.append(float(seconds))
    shared = tuple(option.shared_bytes)
    if shared:
        if len(shared) != n_stages:
            raise _InvalidOption(f"{where}.shared_bytes must have one value per stage ({n_stages}) or none")
        for stage, nbytes in enumerate(shared):
            within = min(saved[stage] or 0, stage_saved[stage])
            if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or not 0 <= nbytes <= within:
                raise _InvalidOption(
                    f"{where}.shared_bytes[{stage}] must be whole bytes from 0 to the option's and the stage's "
                    f"saved bytes ({within}), got {nbytes!r}"
                )
        shared = tuple(int(nbytes) for nbytes in shared)
    return StoreOption(option.name, tuple(saved), tuple(flags), tuple(times), shared)
