"""What the step holds besides the chain's activations, each while it lives.

Planning counts everything held outside the chain's schedule as held through the whole
step: a bound at every moment, and the schedule fits the budget under it. Some of it
lives only part of the step, and :func:`peak_with_lifetimes` follows it along the
schedule for the prediction:

* what a stage's backward leaves behind (the partial gradient of a weight used twice),
  from that backward on;
* from the loss on: what the code after the chain (a head, the loss) still holds when
  the chain's backward starts, and the model output a training loop keeps (measured
  dropped once the loss was computed, it is alive through the loss's own backward);
* the profile charges the chain output's gradient with the peak of the code after the
  chain (``gradient_bytes[-1]``: a head's logits and their gradient, the loss's own),
  from the loss to the last stage's backward; beyond the gradient itself, that lives
  during the loss only, and is taken off afterwards.

* a stage's input that the model's own code holds beyond the stage (the input of a
  container of blocks, until its last block returns: NOTE [inputs the model holds] in
  ``remat.measure.timing``), through the first forward, where the schedule would have
  freed it; one held into the code after the chain that a stage saves, until the loss
  is computed (NOTE [inputs held after the chain] in ``remat.measure.assemble``);
* what the glue after a stage that is not stored keeps for its replay (NOTE [glue
  constants] in ``remat.measure.outside``), from that stage's first forward (before it,
  the model's code holds it: a held input) to the end of the chain's backward;
* the gradients that wait for the replay of a region (NOTE [gradients waiting for a
  replay] in ``remat.measure.outside``), on top of the replay that follows the backward
  of the stage after the region;
* autocast's casts of a stage's weights (NOTE [autocast casts] in
  ``remat.measure.outside``): its cache keeps every cast made in the forward until the
  autocast region ends, once the loss is computed (before its backward, as in a training
  loop; the executor warns about a backward inside the region); from then on the casts of a stage that
  stored its activations live until its backward. A stage run again in the backward
  makes its casts again: kept until its backward when it stores; when it does not, until
  the replay it is part of ends, at the next backward (each replay leaves autocast, which
  empties the cache).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from remat.plan.operations import OperationKind
from remat.plan.simulate import SimulationResult

__all__ = ["GlueConstant", "HeldInput", "Lifetimes", "ReplayHold", "peak_with_lifetimes"]


class HeldInput(NamedTuple):
    """An input the model's own code holds beyond its stage, in the first forward.

    Attributes:
        stage: the planned stage it goes into (or inside, when not its input).
        until: the last planned stage whose forward runs while it is held.
        nbytes: its size.
        is_stage_input: whether it is the planned stage's input ``x_stage`` (the schedule
            may keep it anyway); otherwise it passes between two stage calls inside it,
            or the stage made it (a U-Net's skip).
        kept_by_stage: whether the stage saves it (its input, what passes between its
            calls, or what it made) for its backward.
        kept_by_previous: whether the stage before saves its output for its backward.
        later_takers: the later planned stages, up to ``until``, that take part of it as
            it is (NOTE [side inputs kept by later stages]).
        later_bytes: the bytes of what they take of it.
        later_savers: those of ``later_takers`` that save some of it for their backward.
        after_chain: the model holds it into the code after the chain too, whose peak
            (the loss's) does not count it since a stage saves it: held until the loss is
            computed (``until`` is then the last stage; NOTE [inputs held after the chain]
            in ``remat.measure.assemble``).
    """

    stage: int
    until: int
    nbytes: int
    is_stage_input: bool
    kept_by_stage: bool = False
    kept_by_previous: bool = False
    later_takers: tuple[int, ...] = ()
    later_bytes: int = 0
    later_savers: tuple[int, ...] = ()
    after_chain: bool = False


class GlueConstant(NamedTuple):
    """What the glue after some stages keeps as it is for their replays (NOTE [glue
    constants] in ``remat.measure.outside``).

    Attributes:
        nbytes: its size.
        keepers: the planned stages whose glue takes it.
        stage_input: the planned stage whose input it is, or -1 (made inside a stage).
        kept_by_stage: whether that stage saves its input for its backward.
        kept_by_previous: whether the stage before it saves its output.
        saved: held by the keepers that are stored (they save it for their backward: NOTE
            [earlier activations saved] in ``remat.measure.outside``), not by those that
            are not.
    """

    nbytes: int
    keepers: tuple[int, ...]
    stage_input: int = -1
    kept_by_stage: bool = False
    kept_by_previous: bool = False
    saved: bool = False


class ReplayHold(NamedTuple):
    """An earlier stage's input, or what its glue made, that a replay holds for the glue
    after a later stage (NOTE [constants an earlier stage takes] in ``remat.discover.glue``).

    Attributes:
        stage: the planned stage whose input it is (or whose glue made it).
        glue_stage: the planned stage whose glue takes it.
        nbytes: its size.
        kept_by_stage: whether ``stage`` saves its input for its backward.
        saved_by_glue: whether the glue saves it for its backward too (a shortcut
            convolution run as glue): stored in a replay, ``glue_stage`` holds it until its
            backward.
        made: it is what the glue after ``stage`` made, not its input: a replay that
            checkpoints ``stage`` does not keep it.
    """

    stage: int
    glue_stage: int
    nbytes: int
    kept_by_stage: bool
    saved_by_glue: bool = False
    made: bool = False


@dataclass(frozen=True)
class Lifetimes:
    """Bytes planned as living longer than they do.

    Attributes:
        leftover_bytes: per planned stage, what its backward leaves alive.
        from_loss_bytes: alive from the loss on.
        loss_only_bytes: counted by the simulator from the loss to the last stage's
            backward, but alive during the loss only.
        cast_bytes: per planned stage, autocast's casts of its weights that it keeps
            for its backward.
        held_inputs: inputs the model holds beyond their stage (not counted by planning
            at all: the prediction adds them where they live).
        suffix_backward_excess_bytes: how much the loss's peak in the simulation exceeds
            the peak of the code after the chain until the loss is computed.
        cached_cast_bytes: per planned stage, autocast's casts that no stage keeps for
            its backward: its cache holds them until the loss is computed, and a replay
            makes them again until it ends.
        leftover_freed: ``(planned stage, bytes)``: leftovers (and what the suffix keeps,
            ``from_loss_bytes``) that stage's backward frees.
        glue_constants: what the glue keeps for replays, alive from the first forward of
            the first of its keepers that is not stored to the end of the chain's backward;
            what stored stages save of an earlier stage's output (``saved``), from the first
            of them to the backward of the last, unless the schedule keeps it anyway.
        waiting_gradient_bytes: per boundary ``k`` (``n + 1``, or empty), what waits for
            the replay of a region ending at ``k``: alive during the forwards that follow
            the backward of stage ``k`` (not held outside the chain: not in
            :attr:`total_bytes`).
        replay_held: in a replay (a forward after the first backward), the value of
            each :class:`ReplayHold` is held from the end of its forward to the
            end of the glue's stage's, or to the next backward (to the glue's stage's
            backward where that stage is stored and its glue saves it), unless the replay
            keeps it anyway (a checkpoint, or a stored stage that saves its input) (NOTE
            [constants an earlier stage takes] in ``remat.discover.glue``; not held
            outside the chain: not in :attr:`total_bytes`).
    """

    leftover_bytes: Sequence[int] = ()
    from_loss_bytes: int = 0
    loss_only_bytes: int = 0
    cast_bytes: Sequence[int] = ()
    held_inputs: Sequence[HeldInput] = ()
    suffix_backward_excess_bytes: int = 0
    cached_cast_bytes: Sequence[int] = ()
    leftover_freed: Sequence[tuple[int, int]] = ()
    glue_constants: Sequence[GlueConstant] = ()
    waiting_gradient_bytes: Sequence[int] = ()
    replay_held: Sequence[ReplayHold] = ()

    @property
    def total_bytes(self) -> int:
        """All of it held outside the chain (what planning counts as held through the step)."""
        constants = sum(constant.nbytes for constant in self.glue_constants)
        return (
            sum(self.leftover_bytes) + self.from_loss_bytes + sum(self.cast_bytes) + sum(self.cached_cast_bytes)
        ) + constants


def peak_with_lifetimes(simulation: SimulationResult, lifetimes: Lifetimes) -> int:
    """The chain's simulated peak with what `lifetimes` describes added while it lives."""
    alive = _Alive(lifetimes, len(simulation.forward_counts))
    waiting = lifetimes.waiting_gradient_bytes
    peak = 0
    replay_after: int | None = None  # the stage whose backward the forwards running now follow
    replays = _ReplayHeld(lifetimes.replay_held)
    for entry in simulation.timeline:
        kind, stage = entry.operation.kind, entry.operation.stage
        if stage is not None and kind.is_forward:
            extra = waiting[replay_after] if waiting and replay_after is not None else 0
        else:
            extra = 0
            replay_after = stage if kind is not OperationKind.LOSS else None
        if kind is OperationKind.FORWARD_OFFLOAD:  # what lives outside the chain: as if stored
            kind = OperationKind.FORWARD_STORE
        if kind is OperationKind.LOSS:
            # until the loss is computed every cast is alive; then the autocast region
            # ends and takes those of the stages that did not store with it
            alive.bytes += lifetimes.from_loss_bytes
            peak = max(peak, entry.peak_during_bytes - lifetimes.suffix_backward_excess_bytes + alive.bytes)
            alive.end_of_forward()
        elif stage is not None and kind.is_forward:
            alive.forward_starts(kind, stage)
        peak = max(peak, entry.peak_during_bytes + alive.bytes + alive.replayed + extra + replays.bytes)
        if stage is not None and kind.is_forward and alive.in_backward:
            replays.forward_ends(kind, stage, alive.first_kinds)
        elif not kind.is_forward:
            replays.sweep_ends(stage)
        if kind is OperationKind.LOSS:
            alive.bytes -= lifetimes.loss_only_bytes  # until the last stage's backward releases it
        elif stage is not None and kind.is_forward:
            alive.forward_ends(kind, stage)
        elif stage is not None:
            alive.backward_ends(stage)
    return peak


class _ReplayHeld:
    """What a replay holds of an earlier stage's input for a glue constant (see
    ``Lifetimes.replay_held``), along a schedule."""

    def __init__(self, held: Sequence[ReplayHold]) -> None:
        self.held = held
        self.until: dict[int, int] = {}  # holding entry -> the stage whose forward ends it
        self.saved: list[tuple[int, int]] = []  # (stored glue's stage, bytes) until its backward
        self.bytes = 0

    def forward_ends(self, kind: OperationKind, stage: int, first_kinds: dict[int, OperationKind]) -> None:
        stored = kind is OperationKind.FORWARD_STORE
        for index, hold in enumerate(self.held):
            if first_kinds.get(hold.glue_stage) is OperationKind.FORWARD_STORE:
                continue  # a glue stored in the first forward is never replayed: it takes nothing
            if self.until.get(index) == stage:
                del self.until[index]
                if hold.saved_by_glue and stored:
                    self.saved.append((stage, hold.nbytes))
                else:
                    self.bytes -= hold.nbytes
            kept = not hold.made and _replay_keeps_input(kind, hold.kept_by_stage)
            if hold.stage == stage and index not in self.until and not kept:
                self.until[index] = hold.glue_stage
                self.bytes += hold.nbytes

    def sweep_ends(self, stage: int | None) -> None:
        """A backward (of `stage`) or the loss runs: the replay before it is over."""
        self.until.clear()
        self.saved = [(saver, nbytes) for saver, nbytes in self.saved if saver != stage]
        self.bytes = sum(nbytes for _, nbytes in self.saved)


class _Alive:
    """What `Lifetimes` describes that is alive, along a schedule."""

    def __init__(self, lifetimes: Lifetimes, n_stages: int) -> None:
        self.lifetimes = lifetimes
        self.casts = lifetimes.cast_bytes or (0,) * n_stages
        self.cached = lifetimes.cached_cast_bytes or (0,) * n_stages
        self.last = n_stages - 1
        self.bytes = 0
        self.replayed = 0  # casts of stages replayed without storing, until their replay ends
        self.in_backward = False
        self.cast_alive: set[int] = set()  # stages whose casts are alive
        self.stored: set[int] = set()  # stages whose activations are kept until their backward
        self.first_kinds: dict[int, OperationKind] = {}  # each stage's kind in the first forward
        # what the model holds, by the stage whose forward ends it: (tensor, holder, bytes)
        self.model_held: dict[int, list[tuple[Hashable, Hashable, int]]] = {}
        # the holders of each tensor counted (a stage's input the model holds may be what a
        # glue keeps or saves too: counted once, while any of them holds it)
        self.holders: dict[Hashable, set[Hashable]] = {}
        self.side = _SideInputs(self)

    def forward_starts(self, kind: OperationKind, stage: int) -> None:
        if self.in_backward:
            self.replayed += self.cached[stage]
        elif stage not in self.first_kinds:
            self.bytes += self.cached[stage]
        if kind is OperationKind.FORWARD_STORE:
            self.stored.add(stage)
        if stage in self.cast_alive:
            return
        if kind is OperationKind.FORWARD_STORE or not self.in_backward:
            self.cast_alive.add(stage)  # kept by the cache (forward) or for the backward
            self.bytes += self.casts[stage]
        else:
            self.replayed += self.casts[stage]

    def forward_ends(self, kind: OperationKind, stage: int) -> None:
        if self.in_backward:
            self.side.forward_ends(kind, stage)
            return
        self.first_kinds[stage] = kind
        for tensor, holder, nbytes in self.model_held.pop(stage, ()):
            self._release(tensor, holder, nbytes)
        for index, constant in enumerate(self.lifetimes.glue_constants):
            holds = (kind is OperationKind.FORWARD_STORE) is constant.saved
            covered = constant.saved and _schedule_keeps_constant(constant, self.first_kinds)
            if holds and stage in constant.keepers and not covered:
                self._hold(_constant_tensor(index, constant), ("glue", index, stage), constant.nbytes)
        for index, held in enumerate(self.lifetimes.held_inputs):
            beyond = held.until > stage or held.after_chain
            if held.stage == stage and beyond and not _schedule_keeps(held, self.first_kinds):
                tensor = ("input", held.stage, held.nbytes) if held.is_stage_input else ("held", index)
                self._hold(tensor, ("model", index), held.nbytes)
                until = self.last + 1 if held.after_chain else held.until  # (last + 1: to the loss)
                self.model_held.setdefault(until, []).append((tensor, ("model", index), held.nbytes))
        self.side.forward_ends(kind, stage)

    def _hold(self, tensor: Hashable, holder: Hashable, nbytes: int) -> None:
        holders = self.holders.setdefault(tensor, set())
        if not holders:
            self.bytes += nbytes
        holders.add(holder)

    def _release(self, tensor: Hashable, holder: Hashable, nbytes: int) -> None:
        holders = self.holders.get(tensor, set())
        if holder in holders:
            holders.discard(holder)
            if not holders:
                self.bytes -= nbytes

    def end_of_forward(self) -> None:
        self.in_backward = True
        for tensor, holder, nbytes in self.model_held.pop(self.last + 1, ()):  # held after the chain
            self._release(tensor, holder, nbytes)
        self.bytes -= sum(self.cached[stage] for stage in self.first_kinds)
        for dropped in self.cast_alive - self.stored:
            self.bytes -= self.casts[dropped]
        self.cast_alive &= self.stored

    def backward_ends(self, stage: int) -> None:
        self.replayed = 0
        self.side.backward_ends(stage)
        if stage == self.last:
            self.bytes += self.lifetimes.loss_only_bytes
        if self.lifetimes.leftover_bytes:
            self.bytes += self.lifetimes.leftover_bytes[stage]
        self.bytes -= sum(nbytes for freed_by, nbytes in self.lifetimes.leftover_freed if freed_by == stage)
        for index, constant in enumerate(self.lifetimes.glue_constants):
            if constant.saved:  # the glue keeps the others to the end
                self._release(_constant_tensor(index, constant), ("glue", index, stage), constant.nbytes)
        if stage in self.cast_alive:
            self.cast_alive.discard(stage)
            self.stored.discard(stage)
            self.bytes -= self.casts[stage]


# NOTE [side inputs kept by later stages]
# What the model makes once and gives several stages (an attention mask, an ALiBi bias,
# rotary tables) is counted with its first taker (HeldInput), held by the model through the
# last of them. Unless the schedule keeps the first taker's input (which outlives the later
# takers' backwards), a later taker keeps its part too: a stored one that saves it, until
# its backward; a checkpoint, which keeps every tensor its region's replay takes, until its
# backward. In the first forward those holds count once the model's own hold ends. A replay
# of the first taker makes the tensor again (the glue before it runs again): that one is
# counted until the replay's backward, and with the later takers of the replay that keep
# it; a replay that starts at a later taker's checkpoint takes the tensor that checkpoint
# holds. The first taker may be a call inside a planned stage of several (a frozen
# embedding and first layer, planned as one, whose glue makes rotary tables for every
# layer): a replay of that stage makes the tensor again unless the stage is stored and
# saves it, and what passes on to the next stage as its input is not a side input.
class _SideInputs:
    """The side inputs of ``Lifetimes.held_inputs`` that later takers keep, along a schedule."""

    def __init__(self, alive: _Alive) -> None:
        self.alive = alive
        self.held = [(index, held) for index, held in enumerate(alive.lifetimes.held_inputs) if held.later_takers]
        self.source: dict[int, Hashable] = {}  # held index -> the tensor the takers now get
        self.holds: dict[tuple[int, int], Hashable] = {}  # (held index, taker) -> tensor it keeps
        self.pending: dict[int, list[int]] = {}  # first forward: takers holding once the model lets go
        self.made: dict[int, Hashable] = {}  # held index -> the tensor the current replay made
        self.replays = 0

    def _keeps(self, kind: OperationKind, taker: int, held: HeldInput) -> bool:
        saves = kind is OperationKind.FORWARD_STORE and taker in held.later_savers
        return saves or kind is OperationKind.FORWARD_CHECKPOINT

    def forward_ends(self, kind: OperationKind, stage: int) -> None:
        alive = self.alive
        for index, held in self.held:
            if alive.in_backward:
                self._replayed(index, held, kind, stage)
                continue
            if stage in held.later_takers and self._keeps(kind, stage, held):
                self.pending.setdefault(index, []).append(stage)
            if stage == held.until and not _schedule_keeps(held, alive.first_kinds):
                for taker in self.pending.pop(index, ()):
                    self._hold(index, held, taker, ("first", index))

    def _replayed(self, index: int, held: HeldInput, kind: OperationKind, stage: int) -> None:
        if stage == held.stage:
            # (what passes between two calls inside the stage is made again by every replay
            # of it, unless the stage is stored and saves it)
            stored = kind is OperationKind.FORWARD_STORE and held.kept_by_stage
            if stored if not held.is_stage_input else _replay_keeps_input(kind, held.kept_by_stage):
                self.source.pop(index, None)
                return
            self.replays += 1
            tensor = ("replayed", index, self.replays)
            self.source[index] = self.made[index] = tensor
            self.alive._hold(tensor, ("made", index), held.later_bytes)
        elif stage in held.later_takers and self._keeps(kind, stage, held):
            if (index, stage) in self.holds:  # the replay starts at this checkpoint
                self.source[index] = self.holds[index, stage]
            elif index in self.source:
                self._hold(index, held, stage, self.source[index])

    def _hold(self, index: int, held: HeldInput, taker: int, tensor: Hashable) -> None:
        self.holds[index, taker] = tensor
        self.alive._hold(tensor, ("taker", index, taker), held.later_bytes)

    def backward_ends(self, stage: int) -> None:
        for index, held in self.held:
            tensor = self.holds.pop((index, stage), None)
            if tensor is not None:
                self.alive._release(tensor, ("taker", index, stage), held.later_bytes)
            self.source.pop(index, None)
            made = self.made.pop(index, None)
            if made is not None:
                self.alive._release(made, ("made", index), held.later_bytes)


def _replay_keeps_input(kind: OperationKind, kept_by_stage: bool) -> bool:
    """Whether a replay's forward of a stage keeps its input: it checkpoints it, or stores
    the stage, which saves it."""
    return kind is OperationKind.FORWARD_CHECKPOINT or kind is OperationKind.FORWARD_STORE and kept_by_stage


def _constant_tensor(index: int, constant: GlueConstant) -> Hashable:
    """What identifies a glue constant's tensor among those counted: a stage's input is
    the same tensor whoever holds it."""
    return ("input", constant.stage_input, constant.nbytes) if constant.stage_input >= 0 else ("constant", index)


def _schedule_keeps_constant(constant: GlueConstant, first_kinds: dict[int, OperationKind]) -> bool:
    """Whether the schedule keeps a tensor a stored stage saves anyway: a stage input kept
    after its stage's first forward (see :func:`_keeps_stage_input`) is kept until that
    stage's backward or its region's end, after every later stage's."""
    stage = constant.stage_input
    if stage < 0 or stage not in first_kinds:
        return False
    return _keeps_stage_input(stage, constant.kept_by_stage, constant.kept_by_previous, first_kinds)


def _schedule_keeps(held: HeldInput, first_kinds: dict[int, OperationKind]) -> bool:
    """Whether the schedule itself keeps a held stage input (or a tensor made inside the
    stage that the stage saves) after its stage's first forward."""
    if not held.is_stage_input:
        return held.kept_by_stage and first_kinds[held.stage] is OperationKind.FORWARD_STORE
    return _keeps_stage_input(held.stage, held.kept_by_stage, held.kept_by_previous, first_kinds)


def _keeps_stage_input(
    stage: int, kept_by_stage: bool, kept_by_previous: bool, first_kinds: dict[int, OperationKind]
) -> bool:
    """Whether the first forward keeps a stage's input: it checkpoints it (a region starts
    there), or stores the stage that saves it, or the stage before that saves its output."""
    kind = first_kinds[stage]
    if kind is OperationKind.FORWARD_CHECKPOINT or kind is OperationKind.FORWARD_STORE and kept_by_stage:
        return True
    return kept_by_previous and first_kinds.get(stage - 1) is OperationKind.FORWARD_STORE
