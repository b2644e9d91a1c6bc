"""remat's own runs on aliases of the model's parameters (NOTE [measuring on aliases of the
parameters]), and the models whose parameters it cannot plan (NOTE [sharded models in the
automatic mode])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["alias_parameters", "refuse_sharded_training"]


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
# unit's call, and a tensor-parallel model (parallelize_module) runs collectives inside
# its layers. The automatic mode measures and replays stages that may lie inside such a
# unit (past its gather), and its measuring runs are collectives every rank would have to
# run together, in the same order, whatever input each rank holds. Neither is built: a
# sharded model is refused at its first training call, on every rank alike (the check
# reads the model only, so no rank waits for another), before anything runs. Manual
# recompute is exact there (remat.mark on the blocks before fully_shard; comm= for
# tensor parallelism), and the automatic mode plans data-parallel models (DDP).
def refuse_sharded_training(model: nn.Module) -> None:
    """Raises NotImplementedError if `model` is sharded with FSDP2 or holds DTensor
    parameters (tensor parallelism): see the NOTE."""
    if _fsdp_managed(model):
        how = "is sharded with FSDP2 (fully_shard)"
        instead = "mark its blocks with remat.mark(block) before fully_shard (exact under FSDP2)"
    elif any(_is_dtensor(parameter) for parameter in model.parameters()):
        how = "has DTensor parameters (tensor parallelism)"
        instead = "mark its blocks with remat.mark(block, comm='recompute' or 'save')"
    else:
        return
    raise NotImplementedError(
        f"remat's automatic mode cannot plan {type(model).__name__}: the model {how}, and measuring "
        "or replaying its stages would run collectives on ranks apart. Recompute it by hand instead: "
        f"{instead}; the automatic mode plans data-parallel models (DistributedDataParallel)"
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
