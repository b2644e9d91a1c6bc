"""remat's own runs on aliases of the model's parameters (NOTE [measuring on aliases of the
parameters]), and the models whose parameters it cannot plan (NOTE [sharded models in the
automatic mode])."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["alias_parameters", "holds_collectives", "refuse_sharded_training"]


# NOTE [measuring on aliases of the parameters]
# remat's own runs (discovery, measurement) run backward passes through the model. On the
# model's parameters, those would fire every hook on them: DistributedDataParallel's
# reducer (under static_graph=True, a backward inside its first forward made it stop
# averaging gradients from the second step on, silently), an optimizer stepping in
# backward, a user's gradient hook. They run instead on aliases: each parameter is
# replaced, for the run, by a new leaf sharing its storage (no memory, the same values,
# the same requires_grad), so the gradients go to the aliases and no hook sees them. A
# parameter shared by several modules gets one alias. The units of a model sharded with
# FSDP2 are gathered first: their gathered parameters are aliased (NOTE [FSDP2 units] in
# remat.sharded).
def alias_parameters(model: nn.Module) -> list[tuple[dict[str, Any], str, nn.Parameter]]:
    """Replaces the model's parameters by aliases (see the NOTE); returns what to put back."""
    aliases: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, nn.Parameter]] = []
    for module in model.modules():
        table = module._parameters
        for name, parameter in list(table.items()):
            if parameter is None:
                continue
            alias = aliases.get(id(parameter))
            if alias is None:
                alias = aliases[id(parameter)] = _parameter_alias(parameter)
            swapped.append((table, name, parameter))
            table[name] = alias  # type: ignore[assignment]  # a Parameter, or the subclass's own alias
    return swapped


def _parameter_alias(parameter: torch.Tensor) -> torch.Tensor:
    alias = parameter.detach()
    if isinstance(parameter, nn.Parameter):
        alias = nn.Parameter(alias, requires_grad=parameter.requires_grad)
    else:
        alias.requires_grad_(parameter.requires_grad)
    # attributes libraries set on parameters (flags read by the forward), not hooks
    for name, value in parameter.__dict__.items():
        if "hook" not in name:
            alias.__dict__.setdefault(name, value)
    return alias


# NOTE [sharded models in the automatic mode]
# A model sharded with FSDP2 (fully_shard) or split with tensor parallelism
# (parallelize_module) has DTensor parameters. Both are planned. A tensor-parallel layer
# keeps its parameters and runs its collectives inside the stages' calls, so a replayed
# stage runs them again as the plain forward does. An FSDP2 unit gathers its parameters in
# hooks on its call: remat gathers the units for its own runs and for replays (NOTE [FSDP2
# units] in remat.sharded). Either way the ranks must measure together, on one input,
# with no rank's times scaled from an earlier shape (NOTE [measuring together]), which
# needs the ranks to agree on one plan: with agree_ranks=False such a model is refused, at
# its first training call, on every rank alike (the check reads the model only, so no rank
# waits for another), before anything runs.
def holds_collectives(model: nn.Module) -> bool:
    """Whether `model` has DTensor parameters or buffers (FSDP2, tensor parallelism): its
    stages or its units run collectives, which every rank must run alike."""
    return any(_is_dtensor(tensor) for tensor in itertools.chain(model.parameters(), model.buffers()))


def refuse_sharded_training(model: nn.Module, *, agreeing: bool) -> None:
    """Raises NotImplementedError if `model` holds DTensors while its ranks plan alone
    (`agreeing` False): see the NOTE."""
    if agreeing or not holds_collectives(model):
        return
    raise NotImplementedError(
        f"remat's automatic mode cannot plan {type(model).__name__}: the model has DTensor parameters "
        "(FSDP2 or tensor parallelism), whose collectives ranks planning alone (agree_ranks=False) would "
        "pair wrongly. Leave agree_ranks=True (the default), or recompute by hand: remat.mark(block, comm=...)"
    )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)
