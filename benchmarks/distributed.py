"""Collectives and memory of recompute under FSDP2, per option, on a GPT-style decoder.

Run with torchrun (two processes on the CPU, gloo)::

    .venv/bin/torchrun --nproc-per-node 2 benchmarks/distributed.py [--rounds 5]

Each transformer block of a GPT-style decoder (``remat.models.gpt2``: 6 layers x 128,
vocabulary 512, 4 x 128 tokens per rank) is sharded with ``fully_shard``, and the root
too. FSDP2's ``reshard_after_forward`` True (the parameters are gathered again for the
backward) or False (kept gathered from the forward), each without recompute, with every
block marked (``remat.mark``), and in the automatic mode (``remat.enable`` after
``fully_shard``) at 0.5 and at the smallest budget. For each it measures, on rank 0: the
collectives of one step's forward and backward (all-gathers, reduce-scatters, all-reduces,
counted with a dispatch mode), the exact activation peak of the step with
:class:`remat.MemoryTracker` (FSDP2's gathered parameters and its all-gather and
reduce-scatter buffers are not activations: NOTE [parameter traffic] in remat.memory), the
automatic mode's budget and predicted peak, the median step time over interleaved rounds
after a warm-up (which measures and plans), and whether the gradients (full tensors) equal
those of the same sharding without recompute.
It writes ``results/distributed.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.models import GPTConfig, gpt2

RESULTS = Path(__file__).with_name("results")
CONFIG = GPTConfig(vocab_size=512, n_positions=128, d_model=128, n_heads=4, n_layers=6, dropout=0.0)


class Collectives(TorchDispatchMode):
    """Counts the collectives dispatched while active, by kind."""

    KINDS = ("allgather", "reduce_scatter", "allreduce", "all_reduce", "all_gather")

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if "c10d" in name:
            kind = next((k for k in self.KINDS if k in name), name)
            kind = {"all_reduce": "allreduce", "all_gather": "allgather"}.get(kind, kind)
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


#: how each configuration recomputes: not at all, every block marked, or a budget of the automatic mode
RECOMPUTES: tuple[str | float, ...] = ("none", "mark", 0.5, "min")


def build(reshard: bool, recompute: str | float) -> nn.Module:
    torch.manual_seed(0)
    model = gpt2(CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        if recompute == "mark":
            remat.mark(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if recompute not in ("none", "mark"):
        remat.enable(model, recompute, loss_fn=lambda logits: loss_of(logits, LABELS[0]), output_kept=False)
    return model


LABELS: list[torch.Tensor] = []  # the step's labels, which the automatic mode's loss_fn reads


def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), labels.reshape(-1))


def describe(recompute: str | float) -> str:
    return {"none": "none", "mark": "every block (remat.mark)"}.get(str(recompute), f"remat.enable({recompute!r})")


def step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return loss_of(model(tokens[:, :-1]), tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 129), generator=generator)
    LABELS.append(tokens[:, 1:])
    configurations = [(reshard, recompute) for reshard in (True, False) for recompute in RECOMPUTES]
    models = {c: build(*c) for c in configurations}
    rows: dict[tuple[bool, str | float], dict[str, Any]] = {}
    grads: dict[tuple[bool, str | float], list[torch.Tensor]] = {}
    for configuration, model in models.items():
        step(model, tokens).backward()  # warm-up (FSDP's lazy initialisation; remat measures and plans)
        model.zero_grad(set_to_none=True)
        forward, backward = Collectives(), Collectives()
        with remat.MemoryTracker(exclude_grads_of=list(model.parameters())) as tracker:
            with forward:
                loss = step(model, tokens)
            with backward:
                loss.backward()
        grads[configuration] = [p.grad.full_tensor() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        control = remat.controller(model) if configuration[1] not in ("none", "mark") else None
        rows[configuration] = {
            "reshard_after_forward": configuration[0],
            "recompute": describe(configuration[1]),
            "forward_collectives": forward.counts,
            "backward_collectives": backward.counts,
            "peak_bytes": tracker.peak_bytes,
            "budget_bytes": None if control is None else control.plan.budget_bytes,
            "predicted_peak_bytes": None if control is None else control.plan.predicted_peak_bytes,
            "times_ms": [],
        }
    for _ in range(args.rounds):  # interleaved
        for configuration, model in models.items():
            dist.barrier()
            started = time.perf_counter()
            step(model, tokens).backward()
            rows[configuration]["times_ms"].append((time.perf_counter() - started) * 1e3)
            model.zero_grad(set_to_none=True)
    for (reshard, recompute), row in rows.items():
        reference = grads[(reshard, "none")]
        row["gradients_equal_without_recompute"] = all(
            torch.equal(a, b) for a, b in zip(grads[(reshard, recompute)], reference, strict=True)
        )
        row["median_step_ms"] = statistics.median(row.pop("times_ms"))
    if rank == 0:
        write(list(rows.values()), dist.get_world_size())
    dist.destroy_process_group()


def write(rows: list[dict[str, Any]], world_size: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "model": "remat.models.gpt2: 6 layers x 128, 4 heads, vocabulary 512, no dropout; 4 x 128 tokens per rank",
        "ranks": world_size,
        "backend": "gloo (CPU), 1 thread per rank",
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    (RESULTS / "distributed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")

    def counts(values: dict[str, int]) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(values.items())) or "none"

    plain = {row["reshard_after_forward"]: row for row in rows if row["recompute"] == "none"}

    def planned(row: dict[str, Any]) -> str:
        if row["budget_bytes"] is None:
            return "-"
        return f"{remat.format_bytes(row['budget_bytes'])} / {remat.format_bytes(row['predicted_peak_bytes'])}"

    lines = [
        "# Recompute under FSDP2: collectives and memory per option",
        "",
        f"{meta['model']}; {world_size} ranks, {meta['backend']}; torch {meta['torch']}. Rank 0's figures. "
        "Peak: remat.MemoryTracker over one step: activations (FSDP2's gathered parameters and its "
        "all-gather and reduce-scatter buffers are not counted; parameter gradients left out). Median of "
        "interleaved steps after a warm-up.",
        "",
        "| reshard_after_forward | recompute | forward collectives | backward collectives | peak | "
        "vs same sharding without recompute | budget / predicted | median step | gradients equal |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        base = plain[row["reshard_after_forward"]]
        lines.append(
            f"| {row['reshard_after_forward']} | {row['recompute']} | {counts(row['forward_collectives'])} | "
            f"{counts(row['backward_collectives'])} | {remat.format_bytes(row['peak_bytes'])} | "
            f"{100 * row['peak_bytes'] / base['peak_bytes']:.1f}% | {planned(row)} | {row['median_step_ms']:.1f} ms "
            f"(x{row['median_step_ms'] / base['median_step_ms']:.2f}) | {row['gradients_equal_without_recompute']} |"
        )
    (RESULTS / "distributed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
