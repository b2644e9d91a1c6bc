"""The model's own code between two stage calls (the *glue*): recorded, then replayed.

A forward rarely hands a stage's output straight to the next stage: ``x = x + block(x)``
adds the block's input back, a scaling or a norm may follow, a U-Net concatenates a skip.
When a stage runs inside a recomputed region, what runs after it up to the next stage's
call belongs to the region too: it is recomputed with it, and it builds the next stage's
input. :class:`GlueRecorder` watches those torch calls (a ``TorchFunctionMode``, so the
very functions the model called are replayed, with the same autograd graph and the same
saved tensors) and :class:`Glue` runs them again on the replayed stage's values.

Each recorded value is a *slot*: the stage's inputs, its outputs, then what each call
makes. A tensor that is none of these (a parameter, a mask, anything made before the
stage) is a *constant*: the replay uses it as it is, and refuses it if it was changed in
place since.

NOTE [constants the glue changes]
A call of the glue may change a constant in place: a BatchNorm called between two stages
updates its running statistics, a counter is incremented. The replay must not change
them again (statistics are updated once), so such a call is replayed on a copy of the
constant, and what the glue then reads of that constant is the constant itself, as the
forward left it. This is exact for calls whose result does not depend on the old value
of what they change (a normalisation in training uses the batch's statistics).

NOTE [constants an earlier stage takes]
A constant may be what an earlier stage of the chain took: the residual stream that a
block's inner stages leave and its code adds back (``r = x; x = attn(ln(x)); x = x + r``,
with ``ln`` and ``attn`` two stages). A replay of a region that runs that earlier stage
makes the same value again, so the executor need not keep the first forward's tensor from
then to the end of the backward: :meth:`Glue.take_from_earlier` turns such a constant into
a reference to the earlier stage's input, which the replay looks up in what it ran
(``earlier(stage, position)``). A plan does so only where every region that replays the
glue also replays that stage (``ChainProfile.glue_spans``).

The same holds for what an earlier stage's glue made: an attention whose query and key
projections run as glue after its norm (the chain goes on through the value projection)
computes them with the scores after that projection, in the glue of the later stage. A
replay of the norm's stage runs its glue again and makes them again; the later glue takes
them from there (``EarlierValue.made``) instead of keeping the first forward's. A replay
holds each value until the last glue that takes it, as the plan counts it (``ReplayHold``
in remat.plan.lifetimes): a mask made beside the first block's query and key, and taken
by every block's glue, must not keep them alive until the last block's attention.

NOTE [glue that changes an earlier activation]
The glue may change in place a tensor that needs a gradient and is not one of the stage's
own values: an earlier stage's output (``h = layer(x); r = shortcut(x); h += r``, with
``layer`` and ``shortcut`` two stages). A replay has only the stage's own values: on the
forward's tensor it would add twice, on a copy it would lose the gradient. Such a glue is
not replayable; measurement pins its stage (it is always stored, never recomputed), and
a replay of it raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from remat.errors import NondeterministicRecompute, RecomputeInputModified, RematError, UnsupportedModel
from remat.manual._rng import ForwardState, capture_forward_state, replay_forward_state
from remat.manual._tensors import detached_alias

__all__ = ["EarlierInputs", "EarlierValue", "Glue", "GlueRecorder", "StageInputs"]


class EarlierValue(NamedTuple):
    """Where a glue constant comes from at replay (NOTE [constants an earlier stage takes]):
    input ``position`` of ``stage``, or, when ``made``, the value of slot ``position`` of
    the glue after ``stage``."""

    stage: int
    position: int
    made: bool = False


# Normalisations that update running statistics in place without telling autograd (their
# version counters do not move): the tensors they take that need no gradient are copied.
_UPDATES_STATISTICS = frozenset(
    {
        torch.nn.functional.batch_norm,
        torch.nn.functional.instance_norm,
        torch.batch_norm,
        torch.instance_norm,
        torch.native_batch_norm,
    }
)

# How a value of a recorded call (or of the next stage's inputs) is found at replay.
_SLOT, _CONSTANT, _VALUE, _COPY, _EARLIER = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class _Call:
    function: Any
    sources: tuple[tuple[int, Any], ...]
    spec: Any
    new_slots: tuple[int, ...]  # positions, among the output's tensors, of the new slots
    grad_enabled: bool
    autocast: ForwardState  # the autocast state it ran in (no RNG: the stage's replay draws on)


class Glue:
    """The calls recorded between stage ``j``'s return and stage ``j + 1``'s call."""

    def __init__(
        self,
        n_inputs: int,
        returned: frozenset[int],
        n_stage_values: int,
        calls: tuple[_Call, ...],
        next_sources: tuple[tuple[int, Any], ...],
        next_spec: Any,
        constants: list[tuple[torch.Tensor, int | None]],
        replayable: bool = True,
    ) -> None:
        self.replayable = replayable  # NOTE [glue that changes an earlier activation]
        self._n_inputs = n_inputs
        self._returned = returned
        self._n_stage_values = n_stage_values
        self._calls = calls
        self._next_sources = next_sources
        self._next_spec = next_spec
        self._constants = constants
        # the stage's inputs its calls (or the next stage) take: the others are not kept
        sources = [source for call in calls for source in call.sources] + list(next_sources)
        self._used_inputs = frozenset(item for kind, item in sources if kind == _SLOT and item < n_inputs)
        self._freed_after = _last_uses(n_stage_values, calls, next_sources)

    @property
    def constants(self) -> list[torch.Tensor]:
        """The tensors from before the stage that the glue or the next stage take as they are."""
        return [tensor for tensor, _ in self._constants]

    def take_from_earlier(self, earlier: dict[int, EarlierValue]) -> None:
        """Takes the constants whose ids are in `earlier` from the replay of an earlier stage
        (its input, or what its glue made) instead of keeping them (NOTE [constants an
        earlier stage takes])."""
        if not earlier:
            return

        def source(item: tuple[int, Any]) -> tuple[int, Any]:
            kind, value = item
            return (_EARLIER, earlier[id(value)]) if kind == _CONSTANT and id(value) in earlier else item

        self._calls = tuple(dataclasses.replace(c, sources=tuple(map(source, c.sources))) for c in self._calls)
        self._next_sources = tuple(map(source, self._next_sources))
        self._constants = [(t, v) for t, v in self._constants if id(t) not in earlier]

    def made(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Among the next stage's inputs (`args`, `kwargs`, as recorded), the tensors the
        stage or its glue made: the stage's outputs in the chain's sense."""
        flat = tree_flatten((args, kwargs))[0]
        return [
            leaf
            for leaf, (kind, item) in zip(flat, self._next_sources, strict=True)
            if kind == _SLOT and (item >= self._n_inputs or item in self._returned) and isinstance(leaf, torch.Tensor)
        ]

    def passed_through(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Among :meth:`made`, the stage's own inputs that it returned as they are (a position
        bias each block takes and hands on)."""
        flat = tree_flatten((args, kwargs))[0]
        return [
            leaf
            for leaf, (kind, item) in zip(flat, self._next_sources, strict=True)
            if kind == _SLOT and item < self._n_inputs and item in self._returned and isinstance(leaf, torch.Tensor)
        ]

    def _check_replayable(self, stage_values: list[torch.Tensor]) -> None:
        """Refuses a replay that cannot be exact (see :meth:`replay`)."""
        if not self.replayable:
            raise UnsupportedModel(
                "the model's code after a recomputed stage changes in place a tensor that needs a "
                "gradient and was made before that stage; it cannot be replayed. Plan this model "
                "again (its stage is then always stored), or make that change out of place"
            )
        if len(stage_values) != self._n_stage_values:
            raise NondeterministicRecompute(
                f"a replayed stage took and gave {len(stage_values)} tensors where its first forward took "
                f"and gave {self._n_stage_values}; the stage must compute the same thing when recomputed"
            )
        for tensor, version in self._constants:
            if version is not None and tensor._version != version:
                raise RecomputeInputModified(
                    f"a tensor of shape {tuple(tensor.shape)} that the model's code between two recomputed "
                    "stages uses was changed in place after the forward; its recompute would see other "
                    "values. Make that change out of place"
                )

    def replay(
        self,
        stage_values: list[torch.Tensor],
        earlier: Callable[[EarlierValue], torch.Tensor] | None = None,
        made: Callable[[int, torch.Tensor], None] | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Runs the calls again on `stage_values` (the replayed stage's input tensors, then
        its output tensors); returns the next stage's (args, kwargs). The inputs the calls do
        not take are dropped from `stage_values` (the list is the glue's own from then on):
        the first forward had freed them by then, unless the model's code held them.
        `earlier` gives the replayed value of an earlier stage, and `made(slot, tensor)` is
        told each value the calls make (NOTE [constants an earlier stage takes]).

        Raises:
            RecomputeInputModified: a constant was changed in place since it was recorded.
            NondeterministicRecompute: the replayed stage gave another number of tensors.
        """
        self._check_replayable(stage_values)
        slots: list[Any] = stage_values
        for position in range(self._n_inputs):
            if position not in self._used_inputs:
                slots[position] = None
        aliases: dict[int, torch.Tensor] = {}

        def value(source: tuple[int, Any]) -> Any:
            kind, item = source
            if kind == _SLOT:
                return slots[item]
            if kind == _CONSTANT:
                alias = aliases.get(id(item))
                if alias is None:
                    alias = aliases[id(item)] = detached_alias(item, item.requires_grad)
                return alias
            if kind == _EARLIER:  # NOTE [constants an earlier stage takes]
                assert earlier is not None, "a glue that takes an earlier stage's value needs `earlier`"
                return earlier(item)
            if kind == _COPY:  # NOTE [constants the glue changes]
                copy = item.detach().clone()
                return copy.requires_grad_(True) if item.requires_grad else copy
            return item

        for call, freed in zip(self._calls, self._freed_after, strict=True):
            args, kwargs = tree_unflatten([value(s) for s in call.sources], call.spec)
            with torch.set_grad_enabled(call.grad_enabled), replay_forward_state(call.autocast):
                out = call.function(*args, **kwargs)
            tensors = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
            if made is not None:
                for offset, position in enumerate(call.new_slots):
                    made(len(slots) + offset, tensors[position])
            slots.extend(tensors[position] for position in call.new_slots)
            del args, kwargs, out, tensors
            for slot in freed:  # NOTE [glue values freed after their last use]
                slots[slot] = None
        args, kwargs = tree_unflatten([value(s) for s in self._next_sources], self._next_spec)
        return args, kwargs


# NOTE [glue values freed after their last use]
# The model's code frees a temporary once nothing refers to it (``(q * cos) + (rotate_half(q)
# * sin)`` holds its products only until the sum), and the measured step sees that peak. A
# replay keeps its values in slots: each is dropped after the last call that reads it (or
# at once, when none does), so the replay holds no more than the first forward did. The
# stage's values and what the next stage takes stay until the replay returns.
def _last_uses(
    n_stage_values: int, calls: tuple[_Call, ...], next_sources: tuple[tuple[int, Any], ...]
) -> tuple[tuple[int, ...], ...]:
    """Per call, the slots made by the calls that no later call, nor the next stage, reads."""
    last: dict[int, int] = {}
    made: dict[int, int] = {}
    position = n_stage_values
    for index, call in enumerate(calls):
        for kind, item in call.sources:
            if kind == _SLOT:
                last[item] = index
        for _ in call.new_slots:
            made[position] = index
            position += 1
    kept = {item for kind, item in next_sources if kind == _SLOT}
    freed: list[list[int]] = [[] for _ in calls]
    for slot, index in made.items():
        if slot not in kept:
            freed[max(index, last.get(slot, index))].append(slot)
    return tuple(tuple(slots) for slots in freed)


# NOTE [FSDP2 hooks in the glue]
# Between two stages in different FSDP2 units run FSDP2's hooks: the first unit's after its
# forward (it reshards, casts the output), the next unit's before it (it gathers the
# parameters: buffers, an all-gather, copies into the parameters' storages; it casts the
# inputs and passes them through a function that reduces the gradients after the unit's
# backward). A cast of a stage's value is recorded as any call. The pass-through gives an
# alias made without gradient (the function's own view of its input): it is not recorded,
# the alias takes its input's slot, so a replay hands the next stage the replayed value
# itself. What they do to the parameters touches none of the stage's values and is not
# recorded: a replay gathers what it needs itself (NOTE [FSDP2 units] in remat.sharded),
# and replaying a copy into a storage FSDP2 has since freed would write out of bounds.
def _in_fsdp2_hook() -> bool:
    """Whether the torch call being recorded comes from FSDP2's code (a few frames up: its
    hooks call torch directly, or through an autograd function)."""
    if "torch.distributed.fsdp._fully_shard" not in sys.modules:
        return False
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FSDP2_FRAMES):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith("torch.distributed.fsdp._fully_shard."):
            return True
        frame = frame.f_back
    return False


_FSDP2_FRAMES = 8


def _alias(tensor: torch.Tensor, of: torch.Tensor) -> bool:
    """Whether `tensor` is a view of `of` that reads the same elements as it."""
    base = tensor._base
    return (
        base is not None
        and (base is of or base is of._base)
        and tensor.is_conj() == of.is_conj()
        and tensor.is_neg() == of.is_neg()
        and tensor.dtype == of.dtype
        and tensor.shape == of.shape
        and tensor.stride() == of.stride()
        and tensor.storage_offset() == of.storage_offset()
    )


class StageInputs:
    """Which stage last took each tensor as an input, and where among its input tensors,
    and which glue made each of its values (NOTE [constants an earlier stage takes]); it
    holds no tensor alive."""

    def __init__(self) -> None:
        self._of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def note(self, stage: int, inputs: list[torch.Tensor]) -> None:
        for position, tensor in enumerate(inputs):
            self._of[tensor] = EarlierValue(stage, position)
            # a view that reads the same elements as its base (FSDP2's pass-through of a
            # unit's input) stands for it: the model's code may hold the base
            if tensor._base is not None and _alias(tensor, tensor._base):
                self._of[tensor._base] = EarlierValue(stage, position)

    def note_made(self, stage: int, recorder: GlueRecorder) -> None:
        """The glue after `stage` was recorded by `recorder`: the values it made."""
        for slot, tensor in recorder.made_values():
            self._made[tensor] = EarlierValue(stage, slot, made=True)

    def earlier(self, tensors: list[torch.Tensor], before: int) -> dict[int, EarlierValue]:
        """Where each of `tensors` comes from before stage `before`: what a stage took (the
        latest), else what a glue made; by id."""
        out = {}
        for tensor in tensors:
            where = self._of.get(tensor)
            if where is None or where.stage >= before:
                where = self._made.get(tensor)
            if where is not None and where.stage < before:
                out[id(tensor)] = where
        return out


class EarlierInputs:
    """The executor's side of NOTE [constants an earlier stage takes], for one forward.

    Args:
        pairs: ``(stage, glue's stage)``: the glue after the second takes what the first
            took as its input, or what its glue made, from the replay, not as the first
            forward's tensor.
    """

    def __init__(self, pairs: frozenset[tuple[int, int]]) -> None:
        self.pairs = pairs
        # the last glue recorded to take each value (a glue whose stage was stored in the
        # first forward is never replayed: it takes nothing)
        self.last_glue: dict[EarlierValue, int] = {}
        self._seen = StageInputs()
        self._inputs_wanted: dict[int, set[int]] = {}  # stage -> the positions of its inputs taken later
        self._wanted: dict[int, set[int]] = {}  # stage -> the slots of its glue taken later
        self._replayed: dict[int, dict[int, torch.Tensor]] = {}  # stage -> its replayed inputs taken later
        self._made: dict[int, dict[int, torch.Tensor]] = {}  # stage -> its glue's replayed values
        self._depth = 0

    def called(self, stage: int, inputs: list[torch.Tensor]) -> None:
        """First forward: stage `stage` is called on `inputs`."""
        self._seen.note(stage, inputs)

    def recorded(self, stage: int, glue: Glue, recorder: GlueRecorder) -> None:
        """First forward: the glue after `stage` was recorded (by `recorder`)."""
        earlier = self._seen.earlier(glue.constants, stage)
        self._seen.note_made(stage, recorder)
        taken = {key: at for key, at in earlier.items() if (at.stage, stage) in self.pairs}
        glue.take_from_earlier(taken)
        for at in taken.values():
            self.last_glue[at] = max(stage, self.last_glue.get(at, stage))
            wanted = self._wanted if at.made else self._inputs_wanted
            wanted.setdefault(at.stage, set()).add(at.position)
        expected = {first for first, glue_stage in self.pairs if glue_stage == stage}
        missed = expected - {at.stage for at in taken.values()}
        if missed:
            warnings.warn(
                f"remat: the model's code after stage {stage} no longer takes a value of stage(s) "
                f"{sorted(missed)} as it did when measured; it keeps it for the replay, which the plan "
                "did not count (the step may go over its budget). Please report this model",
                RuntimeWarning,
                stacklevel=2,
            )

    def replaying(self, stage: int, inputs: list[torch.Tensor]) -> None:
        """A replay runs `stage` on `inputs`: held until the last glue that takes them."""
        wanted = self._inputs_wanted.get(stage)
        if wanted:
            self._replayed[stage] = {p: inputs[p] for p in wanted if p < len(inputs)}

    def keeper(self, stage: int) -> Callable[[int, torch.Tensor], None] | None:
        """What a replay of the glue after `stage` tells the values it makes, or None when no
        later glue takes any of them."""
        wanted = self._wanted.get(stage)
        if not wanted:
            return None
        made = self._made[stage] = {}

        def keep(slot: int, tensor: torch.Tensor) -> None:
            if slot in wanted:
                made[slot] = tensor

        return keep

    def input(self, at: EarlierValue) -> torch.Tensor:
        """The replayed value `at` of an earlier stage, for a glue replayed after it."""
        values = self._values_of(at)
        if values is None or at.position not in values:
            raise RematError(
                f"a replay needs a value of stage {at.stage}, which it did not run: the plan's regions "
                "do not follow its glue spans (ChainProfile.glue_spans); plan the model again"
            )
        return values[at.position]

    def _values_of(self, at: EarlierValue) -> dict[int, torch.Tensor] | None:
        """The replayed values of `at`'s stage held for later glues: its glue's, or its inputs."""
        return self._made.get(at.stage) if at.made else self._replayed.get(at.stage)

    def glue_replayed(self, stage: int) -> None:
        """A replay ran the glue after `stage`: what no later glue takes is let go."""
        for at, last in self.last_glue.items():
            if last == stage:
                values = self._values_of(at)
                if values is not None:
                    values.pop(at.position, None)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Around each replay of a level: what the outermost one held is let go at its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._replayed.clear()
                self._made.clear()


class GlueRecorder(TorchFunctionMode):
    """Records the torch calls made after a stage returns, until the next stage is called.

    Args:
        inputs: the stage's input tensors (the first slots).
        outputs: the stage's output tensors (the slots after them).
    """

    def __init__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        stage_values = [*inputs, *outputs]
        self._n_inputs = len(inputs)
        self._slots: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for position, tensor in enumerate(stage_values):
            self._slots.setdefault(tensor, position)
        # the slots of the outputs (an output that is also an input keeps the input's slot)
        self._returned = frozenset(self._slots[t] for t in outputs)
        self._n_stage_values = len(stage_values)
        self._n_slots = len(stage_values)
        self._calls: list[_Call] = []
        self._constants: dict[int, torch.Tensor] = {}
        self._read: set[int] = set()  # the constants read as they are (not only changed on a copy)
        self._replayable = True  # NOTE [glue that changes an earlier activation]
        self._entered = False

    def made_values(self) -> list[tuple[int, torch.Tensor]]:
        """``(slot, tensor)`` of the values the recorded calls made that are still alive."""
        return [(slot, tensor) for tensor, slot in self._slots.items() if slot >= self._n_stage_values]

    # -- recording
    def _source(self, value: Any) -> tuple[int, Any]:
        if isinstance(value, torch.Tensor):
            slot = self._slots.get(value)
            if slot is not None:
                return (_SLOT, slot)
            self._constants.setdefault(id(value), value)
            self._read.add(id(value))
            return (_CONSTANT, value)
        return (_VALUE, value)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors_in = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        versions = [t._version for t in tensors_in]
        grad_enabled = torch.is_grad_enabled()
        autocast = capture_forward_state((), preserve_rng_state=False)
        out = func(*args, **kwargs)
        out_tensors = [leaf for leaf in tree_flatten(out)[0] if isinstance(leaf, torch.Tensor)]
        changed = [t for t, v in zip(tensors_in, versions, strict=True) if t._version != v]
        if not out_tensors and not changed:
            return out  # a question about a tensor (its shape, a flag): nothing to replay
        if _in_fsdp2_hook() and self._passed_through(tensors_in, out_tensors, changed):
            return out  # NOTE [FSDP2 hooks in the glue]
        # NOTE [constants the glue changes]: replayed on a copy
        outside = [t for t in changed if self._slots.get(t) is None]  # none of the stage's values
        copied = {id(t) for t in outside}
        if any(t.requires_grad for t in outside):
            self._replayable = False
        if func in _UPDATES_STATISTICS:
            copied |= {id(t) for t in tensors_in if self._slots.get(t) is None and not t.requires_grad}
        sources = tuple(
            (_COPY, leaf) if isinstance(leaf, torch.Tensor) and id(leaf) in copied else self._source(leaf)
            for leaf in flat
        )
        for leaf in flat:
            if isinstance(leaf, torch.Tensor) and id(leaf) in copied:
                self._constants.setdefault(id(leaf), leaf)
        new_slots = []
        for position, tensor in enumerate(out_tensors):
            if self._slots.get(tensor) is None and id(tensor) not in copied:
                self._slots[tensor] = self._n_slots
                self._n_slots += 1
                new_slots.append(position)
        self._calls.append(_Call(func, sources, spec, tuple(new_slots), grad_enabled, autocast))
        return out

    def _passed_through(self, tensors_in: list[torch.Tensor], out: list[torch.Tensor], changed: list[Any]) -> bool:
        """For a call of FSDP2's hooks: whether it touches none of the stage's values, or only
        passes them through (its outputs alias its inputs, and take their slots)."""
        inputs = [t for t in tensors_in if self._slots.get(t) is not None]
        if not inputs:
            return True
        aliased = [next((t for t in inputs if _alias(o, t)), None) for o in out]
        if changed or any(t is None for t in aliased):
            return False
        for o, t in zip(out, aliased, strict=True):
            self._slots[o] = self._slots[t]
        return True

    # -- the recording's window
    def start(self) -> None:
        """Starts recording (the stage has returned)."""
        self.__enter__()
        self._entered = True

    def stop(self) -> None:
        """Stops recording (the next stage is being called, or the forward failed)."""
        if not self._entered:
            return
        self._entered = False
        stack = _get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            # the model's code entered a mode of its own around the next stage call
            raise UnsupportedModel(
                "the model's code between two recomputed stages left a torch function mode active "
                "around the next stage's call; remat cannot tell its calls apart from the stage's. "
                "Enter it inside the stage or around the whole forward"
            )
        self.__exit__(None, None, None)

    def finish(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Glue:
        """Stops recording; the glue, with the next stage's (args, kwargs) as its result."""
        self.stop()
        flat, spec = tree_flatten((args, kwargs))
        sources = tuple(self._source(leaf) for leaf in flat)
        # only what the replay reads as it is must not change (a statistic the glue updates
        # is replayed on a copy, and may change again later)
        constants = [(t, t._version if key in self._read else None) for key, t in self._constants.items()]
        return Glue(
            self._n_inputs,
            self._returned,
            self._n_stage_values,
            tuple(self._calls),
            sources,
            spec,
            constants,
            self._replayable,
        )
