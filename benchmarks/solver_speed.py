"""How long the "optimal" solver takes on long chains, and what planning over groups costs.

Usage::

    python benchmarks/solver_speed.py [--stages 100 200 400 1000] [--slots 500] [--repeat 3]
        [--implementations numpy numba] [--exact-up-to 400] [--options K] [--output-dir benchmarks/results]

For each chain length, chain (a random heterogeneous one and a uniform transformer-like one),
implementation and budget, it times a whole solve by a fresh solver (least peaks, the time
program, plan reconstruction, the checks and the simulation), best of ``--repeat`` after one
warm-up call that compiles the numba kernels (or loads them from numba's cache). Chains
longer than the solver's ``max_stages`` are planned over groups of stages; up to
``--exact-up-to`` stages, the step time of the plan is compared with the plan of the
program solved stage by stage (``max_stages`` unbounded, numba when installed) at the same
budget. With ``--options K``, every stage also has K store options (a stage stored under a
policy, NOTE [stored under a policy]): the random chain's from ``random_chain``, the uniform
chain's keeping a half, a quarter, ... of its saved bytes for a growing extra time. Writes
``solver_speed.json`` and ``solver_speed.md`` (``solver_speed_options<K>``) to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from remat.plan import ChainProfile, OptimalSolver, Store, numba_available, simulate
from remat.plan.options import StoreOption
from remat.testing import random_chain

FRACTIONS = (0.1, 0.5, 0.9)
"""Budgets, as fractions of the way from the least peak to the store-everything peak."""


def uniform_chain(n_stages: int, n_options: int = 0) -> ChainProfile:
    """A transformer-like chain: every stage alike (32 MiB out, 96 MiB saved)."""
    mib = 2**20
    options = tuple(
        StoreOption(
            f"option{index}",
            (96 * mib // 2 ** (index + 1),) * n_stages,
            (False,) * n_stages,
            (0.002 * (index + 1),) * n_stages,
            (32 * mib // 2 ** (index + 1),) * n_stages,
        )
        for index in range(n_options)
    )
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
        store_options=options,
    )


def timed_solve(profile: ChainProfile, budget: int, implementation: str, slots: int, repeat: int) -> tuple[Any, float]:
    """The schedule and the best wall-clock seconds of a solve by a fresh solver."""
    times = []
    schedule = None
    for _ in range(repeat):
        solver = OptimalSolver(slots=slots, implementation=implementation)
        start = time.perf_counter()
        schedule = solver(profile, budget)
        times.append(time.perf_counter() - start)
    return schedule, min(times)


def measure(
    chain: str, profile: ChainProfile, implementations: list[str], slots: int, repeat: int, exact: bool
) -> list[dict[str, Any]]:
    n = profile.n_stages
    everything = simulate(profile, tuple(Store(i) for i in range(n))).peak_bytes
    minimum = OptimalSolver(slots=slots, implementation=implementations[0]).minimum_bytes(profile)
    exact_implementation = "numba" if numba_available() else "numpy"
    rows = []
    for fraction in FRACTIONS:
        budget = int(minimum + fraction * (everything - minimum))
        reference = None
        if exact:
            reference = OptimalSolver(slots=slots, implementation=exact_implementation, max_stages=n)(profile, budget)
        for implementation in implementations:
            OptimalSolver(slots=slots, implementation=implementation)(profile, budget)  # warm-up
            schedule, wall_s = timed_solve(profile, budget, implementation, slots, repeat)
            limit = OptimalSolver(slots=slots, implementation=implementation)._stage_limit(implementation)
            row = {
                "chain": chain,
                "n_stages": n,
                "options": len(profile.store_options),
                "implementation": implementation,
                "groups": min(n, limit),
                "budget_fraction": fraction,
                "budget_bytes": budget,
                "wall_s": round(wall_s, 4),
                "overhead": round(schedule.overhead_s / profile.total_time_s, 4),
                "peak_within_budget": schedule.predicted_peak_bytes <= budget,
            }
            if reference is not None:
                row["exact_overhead"] = round(reference.overhead_s / profile.total_time_s, 4)
                row["step_vs_exact"] = round(schedule.predicted_time_s / reference.predicted_time_s, 4)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def markdown(results: list[dict[str, Any]], header: dict[str, Any]) -> str:
    options = f", {header['options']} store options per stage" if header.get("options") else ""
    lines = [
        f"# Solver speed ({header['slots']} slots{options}; {header['cpu_count']} CPUs, load {header['load_average']})",
        "",
        "Wall seconds of a whole solve, best of the repeats; overhead as a share of a step without",
        "recompute; step time against the program solved stage by stage at the same budget.",
        "",
        "| stages | chain | implementation | groups | budget | seconds | overhead | exact overhead | step vs exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        lines.append(
            f"| {row['n_stages']} | {row['chain']} | {row['implementation']} | {row['groups']} | "
            f"{row['budget_fraction']} | {row['wall_s']:.3f} | {row['overhead']:.4f} | "
            f"{row.get('exact_overhead', '')} | {row.get('step_vs_exact', '')} |"
        )
    by_size: dict[tuple[int, str], list[float]] = {}
    for row in results:
        by_size.setdefault((row["n_stages"], row["implementation"]), []).append(row["wall_s"])
    lines += ["", "| stages | implementation | median seconds | largest |", "|---|---|---|---|"]
    for (n, implementation), times in sorted(by_size.items()):
        lines.append(f"| {n} | {implementation} | {statistics.median(times):.3f} | {max(times):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[100, 200, 400, 1000])
    parser.add_argument("--slots", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--exact-up-to", type=int, default=400)
    parser.add_argument(
        "--implementations",
        nargs="+",
        default=["numpy", "numba"] if numba_available() else ["numpy"],
        choices=["numba", "numpy"],
    )
    parser.add_argument("--options", type=int, default=0, help="store options per stage (default 0)")
    parser.add_argument("--output-dir", default=None, help="write solver_speed.json and .md there")
    args = parser.parse_args(argv)
    results = []
    for n_stages in args.stages:
        chains = {
            "random": random_chain(0, n_stages, max_units=100, unit_bytes=2**20, store_options=args.options),
            "uniform": uniform_chain(n_stages, args.options),
        }
        for chain_name, profile in chains.items():
            exact = n_stages <= args.exact_up_to
            results += measure(chain_name, profile, args.implementations, args.slots, args.repeat, exact)
    header = {
        "benchmark": "solver_speed",
        "slots": args.slots,
        "options": args.options,
        "cpu_count": os.cpu_count(),
        "load_average": [round(value, 2) for value in os.getloadavg()],
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    document = {**header, "results": results}
    sys.stdout.write(json.dumps(document) + "\n")
    if args.output_dir:
        directory = Path(args.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        stem = "solver_speed" + (f"_options{args.options}" if args.options else "")
        (directory / f"{stem}.json").write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        (directory / f"{stem}.md").write_text(markdown(results, header), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
