"""Per-stage costs of a chain of stages: what the planner needs to know about a model.

A chain has ``n`` stages ``F_0 .. F_{n-1}``. The activation ``x_0`` is the chain input,
``x_{i+1} = F_i(x_i)`` and ``x_n`` is the chain output. A :class:`ChainProfile` holds, for
every stage, its forward and backward times and the bytes it creates, keeps and needs for
a moment; it is all the planner looks at, so a plan can be made from a saved profile on a
machine that has neither the model nor its device.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy

from remat.errors import RematError
from remat.plan.options import StoreOption, checked_options

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "ChainProfile", "InvalidProfile"]

PROFILE_FORMAT = "remat.chain_profile"
"""The value of the ``"format"`` key of a saved profile."""

PROFILE_VERSION = 1
"""The version of the saved profile layout that this module writes and reads."""

_PER_STAGE_FIELDS = (
    "forward_time_s",
    "backward_time_s",
    "saved_bytes",
    "saves_input",
    "saves_output",
    "forward_temp_bytes",
    "backward_temp_bytes",
)
_PER_BOUNDARY_FIELDS = ("activation_bytes", "gradient_bytes")
_BYTE_FIELDS = (
    "activation_bytes",
    "gradient_bytes",
    "saved_bytes",
    "forward_temp_bytes",
    "backward_temp_bytes",
)
_TIME_FIELDS = ("forward_time_s", "backward_time_s")
_OPTIONAL_FIELDS = ("region_breaks", "pinned_stages", "glue_spans")
_FLAG_FIELDS = ("saves_input", "saves_output")


class InvalidProfile(RematError, ValueError):
    """A chain profile is inconsistent (wrong lengths, negative sizes) or cannot be read."""


@dataclass(frozen=True)
class ChainProfile:
    """The costs of every stage of a chain, measured once and planned from many times.

    Stage ``i`` (``0 <= i < n``) maps ``x_i`` to ``x_{i+1}``; boundary ``k`` (``0 <= k <= n``)
    is the activation ``x_k``. Sequences are stored as tuples; lists are accepted.

    Attributes:
        names: a name per stage, for reports (``n`` strings).
        forward_time_s: seconds one forward of each stage takes (``n`` floats).
        backward_time_s: seconds one backward of each stage takes (``n`` floats).
        activation_bytes: bytes of each activation ``x_k`` (``n + 1`` ints). ``x_0`` is owned
            by the caller and never counted by the planner.
        gradient_bytes: bytes of the gradient of each ``x_k`` (``n + 1`` ints). The first may
            be 0 when the chain input needs no gradient; the last is the gradient of the
            chain output, which appears when the loss is computed.
        saved_bytes: bytes that stage ``i`` keeps for its backward when it is stored, not
            counting its input ``x_i`` and its output ``x_{i+1}`` (``n`` ints).
        saves_input: whether the backward of stage ``i`` needs its input ``x_i`` (``n`` bools).
        saves_output: whether the backward of stage ``i`` needs its output ``x_{i+1}``
            (``n`` bools).
        forward_temp_bytes: transient bytes at the peak of the forward of stage ``i``, on top
            of what is live, its output and its saved bytes (``n`` ints).
        backward_temp_bytes: transient bytes at the peak of the backward of stage ``i``, on
            top of what is live and the gradient of its input (``n`` ints).
        region_breaks: boundaries ``k`` (``0 < k < n``) that no recompute region may cross:
            the model's own code changes ``x_k`` in place after stage ``k - 1`` returned it,
            so a replay of stage ``k - 1`` could not give stage ``k`` its input. A region may
            start at ``k``, which keeps the changed ``x_k`` itself (sorted, no repeats).
        pinned_stages: stages that no recompute region may contain: they always run once,
            stored (a stage whose input is changed in place both by the model's code and
            by the stage itself, which can neither be replayed nor start a region).
        glue_spans: ``(s, k)`` with ``s <= k``: a recompute region that holds stage ``k``
            starts at ``s`` or before it. The glue after ``k`` takes what ``s`` took as its
            input, or what its glue made, from the replay of ``s`` instead of keeping it
            (NOTE [constants an earlier stage takes] in ``remat.discover.glue``).
        metadata: free-form JSON-able facts about the measurement (device, dtype, shapes).
        offload_time_per_byte_s: seconds to move one byte between the device and host
            memory, one way (pinned host memory, measured on the device); None where offload
            was not measured, and plans then never offload (:class:`~remat.plan.Offload`).
        store_options: other ways to store each stage, as a selective recompute block under
            a policy (:class:`~remat.plan.options.StoreOption`, NOTE [stored under a
            policy]); a plan names the one it takes in :class:`~remat.plan.Store`.

    Raises:
        InvalidProfile: a sequence has the wrong length, a size or time is negative or not
            finite, a value has the wrong type, or a break or pinned stage is out of range.
    """

    names: tuple[str, ...]
    forward_time_s: tuple[float, ...]
    backward_time_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]
    gradient_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    saves_input: tuple[bool, ...]
    saves_output: tuple[bool, ...]
    forward_temp_bytes: tuple[int, ...]
    backward_temp_bytes: tuple[int, ...]
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)
    region_breaks: tuple[int, ...] = ()
    pinned_stages: tuple[int, ...] = ()
    glue_spans: tuple[tuple[int, int], ...] = ()
    offload_time_per_byte_s: float | None = None
    store_options: tuple[StoreOption, ...] = ()

    def __post_init__(self) -> None:
        names = _as_tuple(self.names, "names")
        n_stages = len(names)
        if n_stages == 0:
            raise InvalidProfile("a chain profile needs at least one stage; got 0 names")
        for index, name in enumerate(names):
            if not isinstance(name, str):
                raise InvalidProfile(f"names[{index}] must be a str, got {type(name).__name__} {name!r}")
        object.__setattr__(self, "names", names)
        for field_name in _PER_STAGE_FIELDS + _PER_BOUNDARY_FIELDS:
            values = _as_tuple(getattr(self, field_name), field_name)
            expected = n_stages + 1 if field_name in _PER_BOUNDARY_FIELDS else n_stages
            if len(values) != expected:
                what = "boundaries (n_stages + 1)" if expected == n_stages + 1 else "stages"
                raise InvalidProfile(
                    f"{field_name} has {len(values)} values but the chain has {n_stages} stages "
                    f"({names[0]!r} .. {names[-1]!r}); expected {expected}, one per {what}"
                )
            object.__setattr__(self, field_name, _FIELD_CHECKS[field_name](field_name, values, names))
        if not isinstance(self.metadata, Mapping):
            raise InvalidProfile(f"metadata must be a dict, got {type(self.metadata).__name__}")
        object.__setattr__(self, "metadata", dict(self.metadata))
        object.__setattr__(self, "region_breaks", _indices(self.region_breaks, "region_breaks", 1, n_stages - 1))
        object.__setattr__(self, "pinned_stages", _indices(self.pinned_stages, "pinned_stages", 0, n_stages - 1))
        spans = tuple(tuple(span) for span in self.glue_spans)
        for span in spans:
            if len(span) != 2 or not all(isinstance(k, int) for k in span) or not 0 <= span[0] <= span[1] < n_stages:
                raise InvalidProfile(f"glue_spans holds (s, k) pairs with 0 <= s <= k < {n_stages}, got {list(span)}")
        object.__setattr__(self, "glue_spans", tuple(sorted(set(spans))))
        per_byte = self.offload_time_per_byte_s
        if per_byte is not None:
            if isinstance(per_byte, bool) or not isinstance(per_byte, numbers.Real) or not 0 < per_byte < math.inf:
                raise InvalidProfile(
                    f"offload_time_per_byte_s must be a positive number of seconds or None, got {per_byte!r}"
                )
            object.__setattr__(self, "offload_time_per_byte_s", float(per_byte))
        try:
            object.__setattr__(self, "store_options", checked_options(self.store_options, self.saved_bytes))
        except ValueError as error:
            raise InvalidProfile(str(error)) from None

    def store_option(self, name: str) -> StoreOption:
        """The store option called ``name``.

        Raises:
            InvalidProfile: the profile has no such option.
        """
        for option in self.store_options:
            if option.name == name:
                return option
        known = [option.name for option in self.store_options]
        raise InvalidProfile(f"the profile has no store option {name!r}; its options are {known}")

    def transfer_time_s(self, stage: int) -> float:
        """Seconds to move what stage ``stage`` saves (``saved_bytes``) to host memory, or back.

        Raises:
            InvalidProfile: offload was not measured (``offload_time_per_byte_s`` is None).
        """
        if self.offload_time_per_byte_s is None:
            raise InvalidProfile(
                "this profile has no offload_time_per_byte_s: offload was not measured (measure with offload on)"
            )
        return self.saved_bytes[stage] * self.offload_time_per_byte_s

    # ------------------------------------------------------------------ properties

    @property
    def n_stages(self) -> int:
        """The number of stages ``n``."""
        return len(self.names)

    @property
    def total_forward_time_s(self) -> float:
        """Seconds of one forward of every stage."""
        return math.fsum(self.forward_time_s)

    @property
    def total_backward_time_s(self) -> float:
        """Seconds of one backward of every stage."""
        return math.fsum(self.backward_time_s)

    @property
    def total_time_s(self) -> float:
        """Seconds of a training step without recomputation (forward plus backward)."""
        return self.total_forward_time_s + self.total_backward_time_s

    @property
    def input_bytes(self) -> int:
        """Bytes of the chain input ``x_0`` (owned by the caller, never counted)."""
        return self.activation_bytes[0]

    @property
    def output_bytes(self) -> int:
        """Bytes of the chain output ``x_n``."""
        return self.activation_bytes[-1]

    def stored_bytes(self, stage: int) -> int:
        """Bytes that stage ``stage`` keeps until its backward when stored, inputs included.

        Args:
            stage: the stage index, ``0 <= stage < n_stages``.

        Returns:
            ``saved_bytes[stage]`` plus the input and output activations that its backward
            needs (the chain input ``x_0`` counts 0).
        """
        total = self.saved_bytes[stage]
        if self.saves_input[stage] and stage > 0:
            total += self.activation_bytes[stage]
        if self.saves_output[stage]:
            total += self.activation_bytes[stage + 1]
        return total

    def span_starts(self) -> dict[int, int]:
        """Per stage that is the glue's stage of a glue span, the latest stage a recompute
        region that holds it may start at (the earliest first stage of its spans)."""
        starts: dict[int, int] = {}
        for first, glue in self.glue_spans:
            starts[glue] = min(first, starts.get(glue, first))
        return starts

    def region_allowed(self, start: int, stop: int) -> bool:
        """Whether a recompute region may cover the stages ``[start, stop)``.

        It may not cross a break (``start < k < stop``) nor hold a pinned stage, nor hold
        the glue's stage of a glue span without its first stage.
        """
        return (
            not any(start < k < stop for k in self.region_breaks)
            and not any(start <= g < stop for g in self.pinned_stages)
            and not any(s < start <= k < stop for s, k in self.glue_spans)
        )

    def allowed_regions(self) -> numpy.ndarray:
        """``[a, j]`` is True where a region may cover ``[a, j)``, shape ``(n, n + 1)``, for ``a < j``."""
        n = self.n_stages
        allowed = numpy.ones((n, n + 1), dtype=bool)
        for k in self.region_breaks:
            allowed[:k, k + 1 :] = False
        for g in self.pinned_stages:
            allowed[: g + 1, g + 1 :] = False
        for s, k in self.glue_spans:
            allowed[s + 1 : k + 1, k + 1 :] = False
        return allowed

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """Returns the profile as a JSON-able dict (see :meth:`from_dict`)."""
        data: dict[str, Any] = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        data["names"] = list(self.names)
        for field_name in _PER_STAGE_FIELDS + _PER_BOUNDARY_FIELDS:
            data[field_name] = list(getattr(self, field_name))
        for field_name in _OPTIONAL_FIELDS:
            if getattr(self, field_name):
                data[field_name] = [list(v) if isinstance(v, tuple) else v for v in getattr(self, field_name)]
        if self.offload_time_per_byte_s is not None:
            data["offload_time_per_byte_s"] = self.offload_time_per_byte_s
        if self.store_options:
            data["store_options"] = [option.to_dict() for option in self.store_options]
        data["metadata"] = dict(self.metadata)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChainProfile:
        """Builds a profile from the dict that :meth:`to_dict` returns.

        Args:
            data: the dict; ``metadata`` may be missing.

        Returns:
            The profile.

        Raises:
            InvalidProfile: the dict is not a saved chain profile of a known version, a key is
                missing or unknown, or the values are inconsistent.
        """
        if not isinstance(data, Mapping):
            raise InvalidProfile(f"a saved profile is a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise InvalidProfile(
                f"not a remat chain profile: 'format' is {data.get('format')!r}, expected {PROFILE_FORMAT!r}"
            )
        if data.get("version") != PROFILE_VERSION:
            raise InvalidProfile(
                f"chain profile version {data.get('version')!r} is not supported; this remat "
                f"reads version {PROFILE_VERSION}: measure the model again"
            )
        required = ("names",) + _PER_STAGE_FIELDS + _PER_BOUNDARY_FIELDS
        missing = [key for key in required if key not in data]
        if missing:
            raise InvalidProfile(f"saved chain profile lacks the keys {missing}")
        scalars = {"offload_time_per_byte_s", "store_options"}
        unknown = sorted(
            set(data) - set(required) - set(_OPTIONAL_FIELDS) - scalars - {"format", "version", "metadata"}
        )
        if unknown:
            raise InvalidProfile(f"saved chain profile has unknown keys {unknown}")
        values = {key: data[key] for key in required + _OPTIONAL_FIELDS + tuple(scalars) if key in data}
        return cls(**values, metadata=dict(data.get("metadata") or {}))

    def to_json(self, *, indent: int | None = 2) -> str:
        """Returns the profile as JSON text (see :meth:`from_json`).

        Args:
            indent: passed to :func:`json.dumps`; None writes a single line.

        Raises:
            InvalidProfile: the metadata holds a value that JSON cannot represent.
        """
        try:
            return json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise InvalidProfile(f"the profile metadata is not JSON-able: {error}") from None

    @classmethod
    def from_json(cls, text: str) -> ChainProfile:
        """Reads a profile from the JSON text that :meth:`to_json` writes.

        Raises:
            InvalidProfile: the text is not JSON or not a valid saved chain profile.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InvalidProfile(f"a saved chain profile must be JSON: {error}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the profile as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_json())
            handle.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ChainProfile:
        """Reads a profile saved by :meth:`save`.

        Raises:
            InvalidProfile: the file does not hold a valid saved chain profile.
            OSError: the file cannot be read.
        """
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        try:
            return cls.from_json(text)
        except InvalidProfile as error:
            raise InvalidProfile(f"{os.fspath(path)}: {error}") from None


def _as_tuple(values: Any, field_name: str) -> tuple[Any, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        try:
            return tuple(values)
        except TypeError:
            raise InvalidProfile(f"{field_name} must be a sequence, got {type(values).__name__}") from None
    return tuple(values)


def _indices(values: Any, field_name: str, low: int, high: int) -> tuple[int, ...]:
    """Sorted, distinct whole numbers in ``[low, high]``."""
    indices = _as_tuple(values, field_name)
    for value in indices:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
            raise InvalidProfile(f"{field_name} holds {value!r}; expected whole numbers from {low} to {high}")
    return tuple(sorted({int(value) for value in indices}))


def _stage_label(field_name: str, index: int, names: tuple[str, ...]) -> str:
    if field_name in _PER_BOUNDARY_FIELDS:
        if index == 0:
            return f"{field_name}[0] (chain input)"
        return f"{field_name}[{index}] (output of stage {index - 1} {names[index - 1]!r})"
    return f"{field_name}[{index}] (stage {names[index]!r})"


# NOTE [per-field validation]
# A profile is built once per measurement and once per load, with a few values per stage.
# Each field is checked in one pass; a value of the usual exact type (int, float, bool)
# is accepted inline, and only the others go through the per-value conversion, which
# names the stage in its error.


def _check_bytes(field_name: str, values: tuple[Any, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    checked = list(values)
    for index, value in enumerate(values):
        if type(value) is not int or value < 0:
            checked[index] = _to_bytes(field_name, index, value, names)
    return tuple(checked)


def _check_times(field_name: str, values: tuple[Any, ...], names: tuple[str, ...]) -> tuple[float, ...]:
    checked = list(values)
    for index, value in enumerate(values):
        if type(value) is not float or not 0.0 <= value < math.inf:
            checked[index] = _to_seconds(field_name, index, value, names)
    return tuple(checked)


def _check_flags(field_name: str, values: tuple[Any, ...], names: tuple[str, ...]) -> tuple[bool, ...]:
    checked = list(values)
    for index, value in enumerate(values):
        if type(value) is not bool:
            checked[index] = _to_flag(field_name, index, value, names)
    return tuple(checked)


def _to_bytes(field_name: str, index: int, value: Any, names: tuple[str, ...]) -> int:
    label = _stage_label(field_name, index, names)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InvalidProfile(f"{label} must be a whole number of bytes, got {value!r}")
    if value < 0:
        raise InvalidProfile(f"{label} is negative: {value} bytes")
    return int(value)


def _to_seconds(field_name: str, index: int, value: Any, names: tuple[str, ...]) -> float:
    label = _stage_label(field_name, index, names)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidProfile(f"{label} must be a number of seconds, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0.0:
        raise InvalidProfile(f"{label} must be finite and >= 0, got {number!r} s")
    return number


def _to_flag(field_name: str, index: int, value: Any, names: tuple[str, ...]) -> bool:
    if not isinstance(value, (bool, numpy.bool_, numbers.Integral)) or value not in (0, 1):
        label = _stage_label(field_name, index, names)
        raise InvalidProfile(f"{label} must be a bool, got {value!r}")
    return bool(value)


_FIELD_CHECKS: dict[str, Callable[[str, tuple[Any, ...], tuple[str, ...]], tuple[Any, ...]]] = {
    **dict.fromkeys(_BYTE_FIELDS, _check_bytes),
    **dict.fromkeys(_TIME_FIELDS, _check_times),
    **dict.fromkeys(_FLAG_FIELDS, _check_flags),
}
