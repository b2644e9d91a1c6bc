"""What remat costs when it recomputes nothing, and when it runs the schedule torch's checkpoint runs.

Two questions, on the workloads of ``benchmarks/planner.py`` (``gpt2``, ``resnet``, ``mlp``) and
on ``small``, a chain of 100 small blocks whose step is mostly the cost of each call:

1. **A budget of 100%.** ``remat.Checkpointable(model, 1.0)`` plans no recompute, so it
   runs the model's own forward (NOTE [nothing to recompute] in ``remat/execute.py``);
   against the plain model, what is left is remat's own bookkeeping per call.
2. **The same schedule by hand.** Every block marked with ``remat.mark`` (non-reentrant,
   RNG preserved) against every block wrapped in ``torch.utils.checkpoint.checkpoint``
   (``use_reentrant=False``, RNG preserved), both against plain.

Each strategy runs on its own copy of the same weights; one thread; one warm-up round, then
``--steps`` interleaved rounds, each starting with a different strategy; medians and ratios
of the same run. Run ``python benchmarks/fixed_cost.py [--workloads mlp gpt2 resnet]
[--steps 21]``; it writes ``results/fixed_cost.json`` and ``results/fixed_cost.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat

sys.path.insert(0, str(Path(__file__).parent))
from planner import WORKLOADS, MlpBlock, Workload, mlp_blocks  # noqa: E402


def small_workload() -> Workload:
    """100 blocks of Linear(64, 64) + GELU on a batch of 8: what each recomputed call costs."""
    torch.manual_seed(0)
    return Workload(
        "small",
        "100 blocks of Linear(64, 64) + GELU, batch 8, loss = sum: the cost of each call",
        nn.Sequential(*(MlpBlock(64, 64, normalized=False) for _ in range(100))).train(),
        (torch.randn(8, 64, requires_grad=True),),
        {},
        lambda output: output.sum(),
        mlp_blocks,
    )


ALL_WORKLOADS = {**WORKLOADS, "small": small_workload}


class _TorchCheckpointed(nn.Module):
    """A block whose every call goes through torch's checkpoint (non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _wrap_blocks(model: nn.Module, blocks: list[nn.Module], wrap: Callable[[nn.Module], nn.Module]) -> None:
    """Replaces each of `blocks` in `model` by ``wrap(block)`` (torch's checkpoint), in place."""
    targets = {id(block) for block in blocks}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                setattr(parent, name, wrap(child))


def strategies(workload: Workload) -> dict[str, nn.Module]:
    plain = copy.deepcopy(workload.model)
    at_full = remat.Checkpointable(copy.deepcopy(workload.model), 1.0, loss_fn=workload.loss_fn, output_kept=False)
    marked = copy.deepcopy(workload.model)
    for block in workload.blocks(marked):
        remat.mark(block)
    torch_checkpointed = copy.deepcopy(workload.model)
    _wrap_blocks(torch_checkpointed, workload.blocks(torch_checkpointed), _TorchCheckpointed)
    return {
        "plain": plain,
        "remat 1.0": at_full,
        "remat.mark per block": marked,
        "torch checkpoint per block": torch_checkpointed,
    }


def run_workload(name: str, steps: int) -> dict[str, Any]:
    workload = ALL_WORKLOADS[name]()
    modules = strategies(workload)
    names = list(modules)
    samples: dict[str, list[float]] = {label: [] for label in names}
    for round_index in range(steps + 1):  # the first round warms up (and measures remat's plan)
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for label in order:
            module = modules[label]
            started = time.perf_counter()
            workload.loss_fn(workload.call(module)).backward()
            elapsed = time.perf_counter() - started
            for parameter in module.parameters():
                parameter.grad = None
            if round_index:
                samples[label].append(elapsed)
    medians = {label: statistics.median(values) for label, values in samples.items()}
    plan = modules["remat 1.0"].plan  # type: ignore[union-attr]
    result = {
        "workload": name,
        "description": workload.description,
        "blocks": len(workload.blocks(workload.model)),
        "median_step_s": medians,
        "remat_1_0_recomputes": bool(plan is not None and max(plan.forward_counts) > 1),
        "ratios": {
            "remat 1.0 / plain": medians["remat 1.0"] / medians["plain"],
            "remat.mark / torch checkpoint": medians["remat.mark per block"] / medians["torch checkpoint per block"],
            "remat.mark / plain": medians["remat.mark per block"] / medians["plain"],
            "torch checkpoint / plain": medians["torch checkpoint per block"] / medians["plain"],
        },
        "extra_per_block_us": {
            label: (medians[label] - medians["plain"]) / len(workload.blocks(workload.model)) * 1e6
            for label in ("remat.mark per block", "torch checkpoint per block")
        },
    }
    print(json.dumps(result["ratios"]), flush=True)
    return result


def markdown(results: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# remat's fixed cost: a budget of 100%, and remat.mark against torch's checkpoint",
        "",
        f"torch {torch.__version__}, {platform.machine()}, 1 thread, median of {steps} interleaved rounds.",
        "",
        "| workload | blocks | plain | remat 1.0 | remat.mark per block | torch checkpoint per block "
        "| remat 1.0 / plain | mark / torch checkpoint | extra per block: mark / torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m, q, e = r["median_step_s"], r["ratios"], r["extra_per_block_us"]
        lines.append(
            f"| {r['workload']} | {r['blocks']} | {m['plain'] * 1e3:.1f} ms | {m['remat 1.0'] * 1e3:.1f} ms "
            f"| {m['remat.mark per block'] * 1e3:.1f} ms | {m['torch checkpoint per block'] * 1e3:.1f} ms "
            f"| x{q['remat 1.0 / plain']:.3f} | x{q['remat.mark / torch checkpoint']:.3f} "
            f"| {e['remat.mark per block']:.0f} / {e['torch checkpoint per block']:.0f} us |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(ALL_WORKLOADS), choices=list(ALL_WORKLOADS))
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run_workload(name, args.steps) for name in args.workloads]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "fixed_cost.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.output_dir / "fixed_cost.md").write_text(markdown(results, args.steps))
    print(markdown(results, args.steps))


if __name__ == "__main__":
    main()
