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
# parameter shared by several modules gets one alias. Modules managed by FSDP2 swap their
# own parameters in their hooks and are left as they are.
def alias_parameters(model: nn.Module) -> list[tuple[dict[str, Any], str, nn.Parameter]]:
    """Replaces the model's parameters by aliases (see the NOTE); returns what to put back."""
    if _fsdp_managed(model):
        return []
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
# A model sharded with FSDP2 (fully_shard) gathers each unit's parameters in hooks on the
# unit's call, and swaps them in and out of the modules as it goes. The automatic mode
# sizes a step on fake tensors and replays stages that may lie inside a unit, past its
# gather: run through FSDP2's hooks, the fake step leaves fake tensors in FSDP2's own
# state (the gradients it reduces), and a measuring backward leaves units gathered, so
# that the next step trains on stale parameters. Neither is built: an FSDP2 model is
# refused at its first training call, on every rank alike (the check reads the model
# only, so no rank waits for another), before anything runs. Manual recompute is exact
# there (remat.mark on the blocks before fully_shard).
#
# A tensor-parallel model (parallelize_module: DTensor parameters) is planned: its
# layers keep their parameters, and its collectives run inside the stages' calls, so a
# replayed stage runs them again like the plain forward does. Its ranks must then measure
# together, on one input, with no rank's times scaled from an earlier shape (NOTE
# [measuring together]), which needs the ranks to agree on one plan: with
# agree_ranks=False it is refused too.
def holds_collectives(model: nn.Module) -> bool:
    """Whether `model` has DTensor parameters or buffers (tensor parallelism): its stages
    run collectives, which every rank must run alike."""
    return any(_is_dtensor(tensor) for tensor in itertools.chain(model.parameters(), model.buffers()))


def refuse_sharded_training(model: nn.Module, *, agreeing: bool) -> None:
    """Raises NotImplementedError if `model` is sharded with FSDP2, or holds DTensors while
    its ranks plan alone (`agreeing` False): see the NOTE."""
    if _fsdp_managed(model):
        how = "is sharded with FSDP2 (fully_shard), whose state measuring it on fake tensors would corrupt"
        instead = "mark its blocks with remat.mark(block) before fully_shard (exact under FSDP2)"
    elif not agreeing and holds_collectives(model):
        how = (
            "has DTensor parameters (tensor parallelism), whose collectives ranks planning alone "
            "(agree_ranks=False) would pair wrongly"
        )
        instead = "leave agree_ranks=True (the default), or mark its blocks with remat.mark(block, comm=...)"
    else:
        return
    raise NotImplementedError(
        f"remat's automatic mode cannot plan {type(model).__name__}: the model {how}. Recompute it "
        f"by hand instead: {instead}"
    )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _fsdp_managed(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(module, FSDPModule) for module in model.modules())
