"""FSDP2 units in remat's own runs and in replays (NOTE [FSDP2 units])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

__all__ = ["UnitGathering", "fsdp_units", "gathered_units"]


# NOTE [FSDP2 units]
# A model sharded with FSDP2 (fully_shard) keeps each unit's parameters sharded between its
# calls. Hooks on the unit's call gather them (all-gather) into storages of their own and
# register them on the unit's modules (plain tensors; DTensors of the tensor-parallel mesh
# under FSDP2 + TP), reshard them after its forward (reshard_after_forward) and again after
# its backward, which reduces their gradients. remat meets this in two places.
#
# Its own runs (discovery, sizing on fake tensors, the timing pass) run the model's forward
# and backward by pieces, outside FSDP2's order. Before them every unit is gathered, on
# every rank together (the ranks of a model with DTensor parameters measure together: NOTE
# [measuring together]), and each unit's state is put, for the run, in the one FSDP2 gives
# a unit recomputed by activation checkpointing inside its own backward: its call then only
# casts its inputs and output as its mixed-precision policy says, registers no gradient
# hook, and so reduces nothing. The runs compute with the parameters a training step
# computes with; afterwards each state is put back and every unit that was sharded is
# sharded again. Measuring thus holds the whole model's parameters gathered for its step.
#
# Replays: a region may begin in a unit whose parameters were resharded after its forward
# and be replayed when backward reaches a later unit. Before a replayed stage runs, every
# unit enclosing it is gathered if it is sharded (its parameters, and those the model's
# code after the stage reads), and it stays gathered until FSDP2 reshards it after its own
# backward: what FSDP2 does for a unit torch's checkpoint recomputes (a unit recomputed in
# backward is not resharded after its forward), so the unit's backward finds it gathered
# and gathers nothing more. A stage that is a unit itself gathers its own parameters in its
# hooks, the same way. A replay that reaches back over several units thus holds their
# parameters from the replay to their backward. Gathered parameters are parameters, not
# activations: the tracker leaves FSDP2's buffers out of its figures (NOTE [parameter
# traffic] in remat.memory).
def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` sharded with FSDP2's ``fully_shard``, outermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _state(unit: nn.Module) -> Any:
    try:
        return unit._get_fsdp_state()  # type: ignore[operator]
    except AttributeError as error:  # pragma: no cover - a torch whose FSDP2 keeps its state elsewhere
        raise NotImplementedError(
            "remat's automatic mode reads FSDP2's unit state as torch 2.6 to 2.13 keep it; this torch "
            "keeps it elsewhere. Recompute by hand instead: remat.mark(block) before fully_shard"
        ) from error


def _gathered(unit: nn.Module) -> bool:
    return all(group.is_unsharded for group in _state(unit)._fsdp_param_groups)


@contextlib.contextmanager
def gathered_units(model: nn.Module) -> Iterator[None]:
    """Inside: every FSDP2 unit of `model` gathered, its hooks as in a recompute (see the NOTE)."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    root = _state(units[0])
    if units[0] is model and root._is_root is None:
        root._lazy_init()  # what its first call does: measuring may come before it (measure())
    states = list({id(state): state for state in map(_state, units)}.values())
    sharded = [unit for unit in units if not _gathered(unit)]
    before = [(state, state._training_state) for state in states]
    try:
        for unit in sharded:
            unit.unshard()  # type: ignore[operator]
        for state in states:
            state._training_state = TrainingState.PRE_BACKWARD
        yield
    finally:
        for state, training_state in before:
            state._training_state = training_state
        for unit in sharded:
            unit.reshard()  # type: ignore[operator]


class UnitGathering:
    """Gathers, for a replay, the FSDP2 units whose stages it runs (see the NOTE).

    A stage needs every unit enclosing it gathered: its own parameters, and those the model's
    code after it (the glue, replayed with it) reads. Each is gathered before the stage if it
    is sharded, and stays gathered until FSDP2 reshards it after its own backward, as FSDP2
    keeps a unit that torch's checkpoint recomputes. A stage that is a unit itself gathers
    its parameters in its own hooks.

    Args:
        model: the model whose chain is replayed.
        stages: the chain's stage modules.
    """

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module]) -> None:
        self._enclosing: dict[int, tuple[nn.Module, ...]] = {}  # stage -> its units, outermost first
        units = fsdp_units(model)
        if units:
            chains: dict[int, tuple[nn.Module, ...]] = {}
            for unit in units:  # outermost first
                for module in unit.modules():
                    chains[id(module)] = (*chains.get(id(module), ()), unit)
            for index, stage in enumerate(stages):
                enclosing = tuple(unit for unit in chains.get(id(stage), ()) if unit is not stage)
                if enclosing:
                    self._enclosing[index] = enclosing

    def before(self, stage: int) -> None:
        """Gathers the units enclosing stage `stage` that are sharded, before its replay."""
        for unit in self._enclosing.get(stage, ()):
            if not _gathered(unit):
                unit.unshard()  # type: ignore[operator]
