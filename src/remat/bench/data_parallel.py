"""The benchmark under ``torchrun``: every strategy's step through one DistributedDataParallel.

NOTE [the benchmark on several ranks]
Launched with ``torchrun`` (a process group of more than one rank), the benchmark trains as
data parallelism does: each strategy's forward runs through one
:class:`~torch.nn.parallel.DistributedDataParallel` over the model, so every backward
all-reduces the gradients, and the figures are those of a real distributed step. One DDP
serves all strategies (a module whose forward is the current strategy's), so its gradient
buckets are made, and rebuilt after its first step, once: two untimed steps before any
strategy is measured keep that out of every row. Each rank measures the model; every remat
budget is planned on all ranks at once, from the largest figures of any rank and the
smallest budget in bytes (``plan_for(..., all_ranks=True)``), and the run checks that every
rank holds the same schedule. A row's peak is the largest of the ranks' (the budget holds
only if it holds on every rank), and each timed step counts as the slowest rank's.
Timelines are rank 0's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat.plan import plan_to_data
from remat.plan.step import Plan
from remat.ranks import largest_on_any_rank, same_on_every_rank

__all__ = ["DataParallelSteps"]


class _Current(nn.Module):
    """The model, called through the strategy set last (its forward is that strategy's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.set(model)

    def set(self, forward: Callable[..., Any]) -> None:
        self.__dict__["forward_of"] = forward  # a plain attribute, never a second child module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["forward_of"](*args, **kwargs)


class DataParallelSteps:
    """The distributed side of one benchmark run (see the NOTE)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.current = _Current(model)
        device_ids = None
        if device.type == "cuda":
            device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
        self.ddp = DistributedDataParallel(self.current, device_ids=device_ids)
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.same_plans = True

    def forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """`forward` run through the DDP."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self.current.set(forward)
            return self.ddp(*args, **kwargs)

        return run

    @staticmethod
    def largest(value: float) -> float:
        """The largest of `value` on any rank."""
        return largest_on_any_rank([value])[0]

    def check_same_plan(self, plan: Plan) -> bool:
        """Whether every rank holds `plan`'s schedule (noted in ``same_plans``)."""
        same = same_on_every_rank(json.dumps(plan_to_data(plan.schedule.items), sort_keys=True))
        self.same_plans = self.same_plans and same
        return same

    def metadata(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "distributed": f"DistributedDataParallel on {self.world_size} ranks ({self.backend})",
            "same_plan_on_every_rank": self.same_plans,
        }
