"""One rank of the DistributedDataParallel check (launched twice by tests/test_distributed.py).

Run as ``python _ddp_worker.py OUTPUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set. For each scenario it wraps a freshly built model in DDP, runs
two training steps on this rank's half of a fixed batch, and saves the gradients of the
second step (DDP has averaged them over the ranks by then), or the error, to
``OUTPUT_DIR/rank{RANK}.pt``. The test compares them with one process on the whole batch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import remat
from launch_helpers import worker_main

WIDTH = 8
BATCH_PER_RANK = 4


def block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


class Net(nn.Module):
    """Three blocks and a head; `unused` never takes part (for find_unused_parameters).

    style: "plain", "marked" (blocks marked with remat.mark), "function" (forward
    calls remat.recompute on a function of two blocks) or "plain-function" (the same
    function called plainly). With `shared`, the first block runs twice.
    """

    def __init__(self, style: str, use_reentrant: bool, with_unused: bool, shared: bool) -> None:
        super().__init__()
        self.style = style
        self.use_reentrant = use_reentrant
        self.shared = shared
        self.blocks = nn.ModuleList([block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)
        self.unused = nn.Linear(WIDTH, WIDTH) if with_unused else None
        if style == "marked":
            for b in self.blocks:
                remat.mark(b, use_reentrant=use_reentrant)

    def _two_blocks(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x)) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared:
            x = self.blocks[0](x)
        if self.style == "function":
            x = remat.recompute(self._two_blocks, x, 0.5, use_reentrant=self.use_reentrant)
        elif self.style == "plain-function":
            x = self._two_blocks(x, 0.5)
        else:
            x = self.blocks[1](self.blocks[0](x))
        return self.head(self.blocks[2](x))


def make_net(style: str, use_reentrant: bool = False, with_unused: bool = False, shared: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(style, use_reentrant, with_unused, shared)


def full_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2 * BATCH_PER_RANK, WIDTH, generator=generator)
    y = torch.randn(2 * BATCH_PER_RANK, 1, generator=generator)
    return x, y


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _enabled(model: nn.Module, budget: float) -> nn.Module:
    remat.enable(model, budget)
    return model


# name -> (model factory, DDP options)
SCENARIOS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "plain": (lambda: make_net("plain"), {}),
    "plain-function": (lambda: make_net("plain-function"), {}),
    "hooks-marked": (lambda: make_net("marked"), {}),
    "hooks-marked-find-unused": (lambda: make_net("marked", with_unused=True), {"find_unused_parameters": True}),
    "hooks-function": (lambda: make_net("function"), {}),
    "hooks-function-find-unused": (
        lambda: make_net("function", with_unused=True),
        {"find_unused_parameters": True},
    ),
    "hooks-marked-static-graph": (lambda: make_net("marked", with_unused=True), {"static_graph": True}),
    "reentrant-marked": (lambda: make_net("marked", use_reentrant=True), {}),
    "reentrant-function": (lambda: make_net("function", use_reentrant=True), {}),
    "reentrant-marked-static-graph": (
        lambda: make_net("marked", use_reentrant=True, with_unused=True),
        {"static_graph": True},
    ),
    "reentrant-marked-find-unused": (
        lambda: make_net("marked", use_reentrant=True, with_unused=True),
        {"find_unused_parameters": True},
    ),
    "hooks-marked-shared": (lambda: make_net("marked", shared=True), {}),
    "plain-shared": (lambda: make_net("plain", shared=True), {}),
    "reentrant-marked-shared": (lambda: make_net("marked", use_reentrant=True, shared=True), {}),
    "reentrant-marked-shared-static-graph": (
        lambda: make_net("marked", use_reentrant=True, shared=True),
        {"static_graph": True},
    ),
    # remat.Checkpointable inside DDP: its first call measures (forward and backward
    # inside DDP's forward), then runs the optimal plan for 60% of the memory.
    "checkpointable": (lambda: remat.Checkpointable(make_net("plain"), 0.6), {}),
    # under static_graph=True, a measuring backward inside DDP's first forward used to
    # stop DDP from averaging gradients from the second step on (no error)
    "checkpointable-static-graph": (lambda: remat.Checkpointable(make_net("plain"), 0.6), {"static_graph": True}),
    "enabled-static-graph": (lambda: _enabled(make_net("plain"), 0.6), {"static_graph": True}),
    "checkpointable-find-unused": (
        lambda: remat.Checkpointable(make_net("plain", with_unused=True), 0.6),
        {"find_unused_parameters": True},
    ),
    # gradient accumulation: each step's first micro-batch under no_sync (the first of all
    # measures there), the second synchronised
    "plain-no-sync": (lambda: make_net("plain"), {"accumulate": True}),
    "plain-no-sync-static-graph": (lambda: make_net("plain"), {"accumulate": True, "static_graph": True}),
    "enabled-no-sync": (lambda: _enabled(make_net("plain"), 0.6), {"accumulate": True}),
    "checkpointable-no-sync-static-graph": (
        lambda: remat.Checkpointable(make_net("plain"), 0.6),
        {"accumulate": True, "static_graph": True},
    ),
}


def run_scenario(rank: int, factory: Callable[[], nn.Module], options: dict[str, Any]) -> dict[str, Any]:
    x, y = full_batch()
    shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    options = dict(options)
    accumulate = options.pop("accumulate", False)
    model = DistributedDataParallel(factory(), **options)
    try:
        for _ in range(2):  # DDP reports some misuse only at the next iteration
            model.zero_grad(set_to_none=True)
            if accumulate:
                half = BATCH_PER_RANK // 2
                with model.no_sync():
                    loss_of(model, x[shard][:half], y[shard][:half]).backward()
                loss_of(model, x[shard][half:], y[shard][half:]).backward()
            else:
                loss_of(model, x[shard], y[shard]).backward()
        grads = {name: p.grad.clone() for name, p in model.module.named_parameters() if p.grad is not None}
        return {"grads": grads, "error": None}
    except Exception as error:  # noqa: BLE001 - reported to the test, which decides
        return {"grads": None, "error": f"{type(error).__name__}: {error}"}
    finally:
        # a failed step can leave the ranks out of step: resynchronise before the next
        dist.barrier()


def scenarios(rank: int) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, (factory, options) in SCENARIOS.items():
        yield name, run_scenario(rank, factory, options)


if __name__ == "__main__":
    sys.exit(worker_main(scenarios))
