"""`remat.enable` on real Hugging Face architectures with their default settings.

For each architecture of :func:`remat.models.hugging_face_architectures` (configs at
``--scale`` 4: widths of 256, 8 sequences of 128 tokens or 8 images; random weights,
every other setting at its default), it measures the exact peak of a plain
training step, remat's smallest feasible budget, and, at a budget of half the plain
step's (or at the smallest one where half is infeasible), the exact peak and the median
step time against the plain step, timed in interleaved rounds on one thread.

Run ``python benchmarks/hf_dropin.py``; it writes ``results/hf_dropin.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.models import hugging_face_architectures

RESULTS = Path(__file__).parent / "results"
ROUNDS = 7


def _step(model: nn.Module, kwargs: dict[str, Any]) -> float:
    started = time.perf_counter()
    output = model(**kwargs)
    output.loss.backward()
    del output
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _peak(model: nn.Module, kwargs: dict[str, Any]) -> int:
    with remat.MemoryTracker() as tracker:
        output = model(**kwargs)
        output.loss.backward()
        del output
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def run(name: str, scale: int) -> dict[str, Any]:
    factory, kwargs = hugging_face_architectures(scale)[name]()
    torch.manual_seed(0)
    plain = factory().train()
    if getattr(plain.config, "use_cache", False):
        plain.config.use_cache = False  # as remat's training calls run
    model = copy.deepcopy(plain)
    control = remat.enable(model, 0.5)
    control.measure(**kwargs)
    minimum = control.minimum_budget_bytes()
    try:
        control.plan_for()
        budget = "50%"
    except remat.BudgetTooSmall:
        control.mem_limit = "min"
        budget = "smallest"
    _step(model, kwargs)  # the measuring step is not timed
    plain_peak, remat_peak = _peak(plain, kwargs), _peak(model, kwargs)
    plain_times, remat_times = [], []
    for _ in range(ROUNDS):  # interleaved rounds
        plain_times.append(_step(plain, kwargs))
        remat_times.append(_step(model, kwargs))
    plan = control.plan
    assert plan is not None and plan.budget_bytes is not None
    return {
        "plain_peak_bytes": plain_peak,
        "minimum_budget_bytes": minimum,
        "budget": budget,
        "budget_bytes": plan.budget_bytes,
        "remat_peak_bytes": remat_peak,
        "recomputed_stages": sum(count > 1 for count in plan.forward_counts),
        "stages": len(plan.forward_counts),
        "plain_step_s": statistics.median(plain_times),
        "remat_step_s": statistics.median(remat_times),
        "coverage": plan.measurement.coverage if plan.measurement is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=4, help="width, batch and length multiplier of the configs")
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the use_cache and coverage notes, said in the table
    results = {}
    for name in hugging_face_architectures():
        results[name] = row = run(name, options.scale)
        print(name, json.dumps(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hf_dropin.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| architecture | plain peak | smallest budget | budget run | peak there | within | "
        "stages recomputed | chain's share | step time vs plain |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for name, row in results.items():
        lines.append(
            f"| {name} | {remat.format_bytes(row['plain_peak_bytes'])} "
            f"| {remat.format_bytes(row['minimum_budget_bytes'])} "
            f"({row['minimum_budget_bytes'] / row['plain_peak_bytes']:.0%}) | {row['budget']} "
            f"| {remat.format_bytes(row['remat_peak_bytes'])} "
            f"| {'yes' if row['remat_peak_bytes'] <= row['budget_bytes'] else 'NO'} "
            f"| {row['recomputed_stages']} of {row['stages']} | {row['coverage']:.0%} "
            f"| x{row['remat_step_s'] / row['plain_step_s']:.2f} |"
        )
    (RESULTS / "hf_dropin.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
