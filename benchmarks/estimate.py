"""Plans from sizes alone against plans from timed stages (``measure="estimated"``).

For each workload of ``benchmarks/planner.py`` (``gpt2``, ``resnet``, ``mlp``), in one process:

1. the model is sized on fake tensors and its stage times estimated by the cost model
   calibrated on this machine (:mod:`remat.measure.estimate`), as ``remat plan --estimate``
   and the first step of ``measure="estimated"`` do; the same model is also measured the
   default way (its stages timed);
2. per stage, estimated against timed forward and backward times;
3. at each budget, the plan from the estimate and the plan from the timed stages: their
   recompute time under the *timed* stage times (the simulator, so without noise), and the
   measured median step time of both plans, run in alternation on the same weights.

Bytes are the same either way (both come from the sized step), so both plans fit the same
budget; the estimate can only cost time. One thread. Run
``python benchmarks/estimate.py [--workloads gpt2 resnet mlp] [--steps 5]``; it writes
``results/estimate.json`` and ``results/estimate.md`` (``--render RESULT.json`` rewrites the
table from a result).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import remat
from remat.plan import simulate

sys.path.insert(0, str(Path(__file__).parent))
from planner import WORKLOADS, Workload  # noqa: E402

BUDGETS: tuple[float | str, ...] = (0.3, 0.5, 0.7, "min")


def _ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values)).astype(float)


def stage_agreement(estimated: Any, timed: Any) -> dict[str, Any]:
    """How the estimated stage times compare with the timed ones."""
    rows: dict[str, Any] = {}
    for direction in ("forward", "backward"):
        guess = np.array([getattr(s, f"{direction}_time_s") for s in estimated.stages])
        truth = np.array([getattr(s, f"{direction}_time_s") for s in timed.stages])
        ratios = guess / np.maximum(truth, 1e-9)
        rows[direction] = {
            "estimated_total_s": float(guess.sum()),
            "timed_total_s": float(truth.sum()),
            "total_ratio": float(guess.sum() / truth.sum()),
            "median_stage_ratio": float(np.median(ratios)),
            "stages_within_2x": float(np.mean((ratios >= 0.5) & (ratios <= 2.0))),
            "rank_correlation": float(np.corrcoef(_ranks(guess), _ranks(truth))[0, 1]) if len(guess) > 1 else 1.0,
        }
    return rows


def step_times(workload: Workload, wrapper: Any, plans: dict[str, Any], steps: int) -> dict[str, float]:
    """Median step seconds of each plan, run in alternation by the same (timed) wrapper."""
    samples: dict[str, list[float]] = {name: [] for name in plans}
    for round_index in range(steps + 1):  # the first round warms up
        for name, plan in plans.items():
            with wrapper.executing(plan):
                started = time.perf_counter()
                workload.loss_fn(workload.call(wrapper)).backward()
                elapsed = time.perf_counter() - started
            for parameter in wrapper.model.parameters():
                parameter.grad = None
            if round_index:
                samples[name].append(elapsed)
    return {name: statistics.median(values) for name, values in samples.items()}


def run_workload(name: str, steps: int) -> dict[str, Any]:
    workload = WORKLOADS[name]()
    started = time.perf_counter()
    estimated = remat.Checkpointable(
        workload.model, None, loss_fn=workload.loss_fn, output_kept=False, measure="estimated"
    )
    estimated_measurement = _measure(estimated, workload)
    estimate_s = time.perf_counter() - started
    started = time.perf_counter()
    timed = remat.Checkpointable(workload.model, None, loss_fn=workload.loss_fn, output_kept=False)
    timed_measurement = _measure(timed, workload)
    timed_s = time.perf_counter() - started
    result: dict[str, Any] = {
        "workload": name,
        "description": workload.description,
        "stages": len(timed_measurement.stages),
        "cost_model": estimated_measurement.profile.metadata["times"],
        "measure_s": {"estimated": estimate_s, "timed": timed_s},
        "stage_times": stage_agreement(estimated_measurement, timed_measurement),
        "budgets": [],
    }
    for budget in BUDGETS:
        try:
            from_estimate, from_timed = estimated.plan_for(budget), timed.plan_for(budget)
        except remat.BudgetTooSmall as error:
            result["budgets"].append({"budget": budget, "infeasible": True, "minimum_bytes": error.minimum_bytes})
            continue
        truth = from_timed.schedule.profile  # the planning profile with the timed stage times
        estimate_extra_s = simulate(truth, from_estimate.schedule.items).overhead_s
        timed_extra_s = simulate(truth, from_timed.schedule.items).overhead_s
        plans = {"estimate": from_estimate, "timed": from_timed, "no_recompute": timed.plan_for(1.0)}
        measured = step_times(workload, timed, plans, steps)
        no_recompute = measured["no_recompute"]
        result["budgets"].append(
            {
                "budget": budget,
                "budget_bytes": from_timed.budget_bytes,
                "same_budget_bytes": from_estimate.budget_bytes == from_timed.budget_bytes,
                "predicted_peak_bytes": {
                    "estimate": from_estimate.predicted_peak_bytes,
                    "timed": from_timed.predicted_peak_bytes,
                },
                "same_plan": from_estimate.schedule.items == from_timed.schedule.items,
                "recompute_s_under_timed_times": {"estimate": estimate_extra_s, "timed": timed_extra_s},
                "step_s": measured,
            }
        )
        print(
            f"{name} {budget}: same plan {result['budgets'][-1]['same_plan']}, recompute under timed times "
            f"{estimate_extra_s * 1e3:.1f} vs {timed_extra_s * 1e3:.1f} ms, step {measured['estimate'] * 1e3:.0f} vs "
            f"{measured['timed'] * 1e3:.0f} ms (no recompute {no_recompute * 1e3:.0f} ms)",
            flush=True,
        )
    return result


def _measure(wrapper: Any, workload: Workload) -> Any:
    return wrapper.measure(*workload.args, **workload.kwargs)


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        '# Plans from sizes alone (`measure="estimated"`) against plans from timed stages',
        "",
        f"torch {torch.__version__}, {platform.machine()}, 1 thread. The cost model of each workload, "
        "calibrated within its largest stage's bytes (NOTE [calibrating within the budget]):",
        "",
        *(f"- {r['workload']}: {r['cost_model']}" for r in results),
        "",
        "## Stage times, estimated against timed",
        "",
        "| workload | stages | forward total | backward total | median stage ratio (fwd / bwd) "
        "| stages within 2x (fwd / bwd) | rank correlation (fwd / bwd) | measuring: estimated / timed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, b = r["stage_times"]["forward"], r["stage_times"]["backward"]
        lines.append(
            f"| {r['workload']} | {r['stages']} | x{f['total_ratio']:.2f} | x{b['total_ratio']:.2f} "
            f"| {f['median_stage_ratio']:.2f} / {b['median_stage_ratio']:.2f} "
            f"| {f['stages_within_2x']:.0%} / {b['stages_within_2x']:.0%} "
            f"| {f['rank_correlation']:.2f} / {b['rank_correlation']:.2f} "
            f"| {r['measure_s']['estimated']:.1f} s / {r['measure_s']['timed']:.1f} s |"
        )
    lines += [
        "",
        "## Plans at each budget",
        "",
        "Recompute time of each plan under the timed stage times (simulated), and measured median step "
        "times of both plans run in alternation, as a ratio to the step without recompute.",
        "",
        "| workload | budget | same plan | recompute (estimate / timed) | step (estimate / timed) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["budgets"]:
            if row.get("infeasible"):
                lines.append(f"| {r['workload']} | {row['budget']} | below the smallest feasible budget | | |")
                continue
            extra, step = row["recompute_s_under_timed_times"], row["step_s"]
            base = step["no_recompute"]
            lines.append(
                f"| {r['workload']} | {row['budget']} | {'yes' if row['same_plan'] else 'no'} "
                f"| {extra['estimate'] * 1e3:.1f} ms / {extra['timed'] * 1e3:.1f} ms "
                f"| x{step['estimate'] / base:.2f} / x{step['timed'] / base:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--render", type=Path, default=None, metavar="RESULT.json", help="only rewrite its table")
    args = parser.parse_args()
    if args.render is not None:
        results = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(markdown(results))
        return
    torch.set_num_threads(1)
    results = [run_workload(name, args.steps) for name in args.workloads]
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "estimate.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.output_dir / "estimate.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
