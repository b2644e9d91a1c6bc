"""Does the budget hold on every step, the first one included? A matrix over models, precisions and budgets.

For each model, precision (fp32, or bf16 under ``torch.autocast``) and budget (a fraction of
the memory without recompute, 10% to 100%), a fresh ``remat.Checkpointable`` trains a few
steps; every step runs under the exact tracker, the first one with its measuring included.
It reports, per case, the worst step peak over the budget and the worst measured peak over
the plan's prediction (steps after the first), and the measuring's cost in plain training
steps.

Run ``python benchmarks/budget_matrix.py [--quick]``; it writes ``results/budget_matrix.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.models import CATALOGUE

RESULTS = Path(__file__).parent / "results"
FRACTIONS = tuple(round(0.1 * k, 1) for k in range(1, 11))


def hf_gpt2() -> tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
    import transformers

    config = transformers.GPT2Config()  # the default configuration: 12 layers, tied embeddings
    tokens = torch.randint(0, config.vocab_size, (2, 128))
    return (
        lambda: transformers.GPT2LMHeadModel(config),
        (tokens,),
        {"labels": tokens, "use_cache": False},
        lambda output: output.loss,
    )


def hf_bert() -> tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
    import transformers

    config = transformers.BertConfig()  # the default configuration: 12 layers, tied embeddings
    tokens = torch.randint(0, config.vocab_size, (4, 128))
    return (
        lambda: transformers.BertForMaskedLM(config),
        (tokens,),
        {"labels": tokens},
        lambda output: output.loss,
    )


def zoo(name: str, batch: int) -> Callable[[], Any]:
    def make() -> tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], Callable[[Any], torch.Tensor]]:
        spec = CATALOGUE[name]
        inputs, target = spec.make_batch(batch)
        return spec.factory, inputs, {}, lambda output: spec.loss_fn(output, target)

    return make


MODELS: dict[str, Callable[[], Any]] = {
    "mlp": zoo("mlp", 64),
    "convnet": zoo("convnet", 8),
    "resnet_small": zoo("resnet_small", 8),
    "vgg11": zoo("vgg11", 4),
    "gpt2 (zoo)": zoo("gpt2", 4),
    "vit": zoo("vit", 8),
    "Hugging Face GPT2LMHeadModel (default config, 2x128 tokens)": hf_gpt2,
    "Hugging Face BertForMaskedLM (default config, 4x128 tokens)": hf_bert,
}


def precision_context(precision: str) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def plain_step_seconds(factory: Callable[[], nn.Module], args: Any, kwargs: Any, loss_fn: Any, precision: str) -> float:
    torch.manual_seed(0)
    model = factory().train()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        with precision_context(precision):
            loss = loss_fn(model(*args, **kwargs))
        loss.backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def measuring_seconds(factory: Callable[[], nn.Module], args: Any, kwargs: Any, loss_fn: Any, precision: str) -> float:
    """Median seconds of measuring (sizing, rehearsal, timing pass) on fresh instances, untracked."""
    times = []
    for _ in range(3):
        torch.manual_seed(0)
        wrapped = remat.Checkpointable(factory().train(), 0.5, loss_fn=loss_fn, output_kept=False)
        started = time.perf_counter()
        with precision_context(precision):
            wrapped.measure(*args, **kwargs)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_case(
    factory: Callable[[], nn.Module], args: Any, kwargs: Any, loss_fn: Any, precision: str, fraction: float, steps: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = factory().train()
    # this loop drops the output once the loss is computed (output_kept=False is its exact setting)
    wrapped = remat.Checkpointable(model, fraction, loss_fn=loss_fn, output_kept=False)
    peaks, seconds = [], []
    for _ in range(steps):
        started = time.perf_counter()
        with remat.MemoryTracker() as tracker:
            try:
                with precision_context(precision):
                    loss = loss_fn(wrapped(*args, **kwargs))
            except remat.BudgetTooSmall as error:
                return {"fraction": fraction, "infeasible": True, "minimum_bytes": error.minimum_bytes}
            loss.backward()
            del loss
        seconds.append(time.perf_counter() - started)
        peaks.append(tracker.peak_bytes)
        model.zero_grad(set_to_none=True)
    plan = wrapped.plan
    assert plan is not None and plan.budget_bytes is not None
    return {
        "fraction": fraction,
        "infeasible": False,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "peaks": peaks,
        "first_step_s": seconds[0],
        "later_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="zoo models only, budgets 0.1, 0.5, 1.0")
    parser.add_argument("--models", nargs="*", help="a subset of the models, by name")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--cost-only",
        action="store_true",
        help="time the measuring again, per model, and update those figures of the last run",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    fractions = (0.1, 0.5, 1.0) if options.quick else FRACTIONS
    names = options.models or [n for n in MODELS if not (options.quick and n.startswith("Hugging"))]
    results: dict[str, Any] = {}
    if options.cost_only:
        results = json.loads((RESULTS / "budget_matrix.json").read_text())
        for name in names:
            factory, args, kwargs, loss_fn = MODELS[name]()
            for precision in ("fp32", "bf16"):
                row = results[f"{name} / {precision}"]
                row["plain_step_s"] = plain_step_seconds(factory, args, kwargs, loss_fn, precision)
                row["measuring_s"] = measuring_seconds(factory, args, kwargs, loss_fn, precision)
                row["measuring_cost_steps"] = row["measuring_s"] / row["plain_step_s"]
                print(f"{name} / {precision}: measuring {row['measuring_cost_steps']:.2f} steps", flush=True)
        write_results(results, "")
        return
    for name in names:
        factory, args, kwargs, loss_fn = MODELS[name]()
        for precision in ("fp32", "bf16"):
            plain_s = plain_step_seconds(factory, args, kwargs, loss_fn, precision)
            cases = [run_case(factory, args, kwargs, loss_fn, precision, f, options.steps) for f in fractions]
            ran = [c for c in cases if not c["infeasible"]]
            worst_budget = max(max(c["peaks"]) / c["budget_bytes"] for c in ran)
            worst_first = max(c["peaks"][0] / c["budget_bytes"] for c in ran)
            errors = [max(c["peaks"][1:]) / c["predicted_peak_bytes"] for c in ran if len(c["peaks"]) > 1]
            measuring_s = measuring_seconds(factory, args, kwargs, loss_fn, precision)
            results[f"{name} / {precision}"] = {
                "cases": cases,
                "plain_step_s": plain_s,
                "worst_peak_over_budget": worst_budget,
                "worst_first_step_over_budget": worst_first,
                "worst_measured_over_predicted": max(errors) if errors else None,
                "best_measured_over_predicted": min(errors) if errors else None,
                "measuring_s": measuring_s,
                "measuring_cost_steps": measuring_s / plain_s,
                "smallest_feasible_fraction": min(c["fraction"] for c in ran),
            }
            row = results[f"{name} / {precision}"]
            print(
                f"{name} / {precision}: peak/budget <= {worst_budget:.4f} (first step {worst_first:.4f}), "
                f"measured/predicted in [{row['best_measured_over_predicted']:.4f}, "
                f"{row['worst_measured_over_predicted']:.4f}], measuring {row['measuring_cost_steps']:.2f} steps, "
                f"feasible from {row['smallest_feasible_fraction']:.0%}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if options.quick else ""
    path = RESULTS / f"budget_matrix{suffix}.json"
    if options.models and path.exists():  # a subset run updates its rows of the last full run
        results = {**json.loads(path.read_text()), **results}
    write_results(results, suffix)


def write_results(results: dict[str, Any], suffix: str) -> None:
    """Writes the JSON and the Markdown table of a run."""
    (RESULTS / f"budget_matrix{suffix}.json").write_text(json.dumps(results, indent=2))
    lines = [
        "| model / precision | feasible from | worst peak / budget (any step) | first step / budget "
        "| measured / predicted | measuring cost (plain steps) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, row in results.items():
        lines.append(
            f"| {key} | {row['smallest_feasible_fraction']:.0%} | {row['worst_peak_over_budget']:.4f} "
            f"| {row['worst_first_step_over_budget']:.4f} | {row['best_measured_over_predicted']:.3f} to "
            f"{row['worst_measured_over_predicted']:.3f} | {row['measuring_cost_steps']:.2f} |"
        )
    (RESULTS / f"budget_matrix{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
