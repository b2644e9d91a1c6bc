"""How long the "optimal" solver takes on long chains, with numba and with numpy.

Usage::

    python benchmarks/solver_speed.py [--stages 200] [--slots 500] [--repeat 3]
        [--implementations numba numpy] [--output results.jsonl]

Prints one JSON line (appended to ``--output`` too, when given): for each chain,
implementation and budget, the best wall-clock and CPU seconds of a whole solve (least
peak, time program, plan reconstruction and simulation), after one warm-up call that
compiles the numba kernels (or loads them from numba's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from remat.plan import ChainProfile, OptimalSolver, Store, numba_available, simulate
from remat.testing import random_chain

FRACTIONS = (0.1, 0.5, 0.9)
"""Budgets, as fractions of the way from the least peak to the store-everything peak."""


def uniform_chain(n_stages: int) -> ChainProfile:
    """A transformer-like chain: every stage alike (32 MiB out, 96 MiB saved)."""
    mib = 2**20
    return ChainProfile(
        names=tuple(f"block{index}" for index in range(n_stages)),
        forward_time_s=(0.01,) * n_stages,
        backward_time_s=(0.02,) * n_stages,
        activation_bytes=(32 * mib,) * (n_stages + 1),
        gradient_bytes=(32 * mib,) * (n_stages + 1),
        saved_bytes=(96 * mib,) * n_stages,
        saves_input=(True,) * n_stages,
        saves_output=(False,) * n_stages,
        forward_temp_bytes=(16 * mib,) * n_stages,
        backward_temp_bytes=(64 * mib,) * n_stages,
    )


def measure(profile: ChainProfile, implementation: str, slots: int, repeat: int) -> list[dict[str, Any]]:
    solver = OptimalSolver(slots=slots, implementation=implementation)
    everything = simulate(profile, tuple(Store(i) for i in range(profile.n_stages))).peak_bytes
    minimum = solver.minimum_bytes(profile)
    rows = []
    for fraction in FRACTIONS:
        budget = int(minimum + fraction * (everything - minimum))
        solver(profile, budget)  # warm-up: compiles or loads the kernels
        wall_s, cpu_s = [], []
        for _ in range(repeat):
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            schedule = solver(profile, budget)
            wall_s.append(time.perf_counter() - wall_start)
            cpu_s.append(time.process_time() - cpu_start)
        rows.append(
            {
                "implementation": implementation,
                "budget_fraction": fraction,
                "budget_bytes": budget,
                "wall_s": round(min(wall_s), 4),
                "cpu_s": round(min(cpu_s), 4),
                "overhead_fraction": round(schedule.overhead_s / profile.total_time_s, 4),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=200)
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--implementations",
        nargs="+",
        default=["numba", "numpy"] if numba_available() else ["numpy"],
        choices=["numba", "numpy"],
    )
    parser.add_argument("--output", help="append the JSON line to this file as well")
    args = parser.parse_args(argv)
    chains = {
        "random": random_chain(0, args.stages, max_units=100, unit_bytes=2**20),
        "uniform": uniform_chain(args.stages),
    }
    results = []
    for chain_name, profile in chains.items():
        for implementation in args.implementations:
            repeat = args.repeat if implementation == "numba" else 1
            for row in measure(profile, implementation, args.slots, repeat):
                results.append({"chain": chain_name, **row})
    line = json.dumps(
        {
            "benchmark": "solver_speed",
            "n_stages": args.stages,
            "slots": args.slots,
            "cpu_count": os.cpu_count(),
            "load_average": [round(value, 2) for value in os.getloadavg()],
            "python": platform.python_version(),
            "machine": platform.machine(),
            "results": results,
        }
    )
    sys.stdout.write(line + "\n")
    if args.output:
        with open(args.output, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
