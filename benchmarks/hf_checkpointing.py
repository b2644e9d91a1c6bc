"""remat against Hugging Face's own gradient checkpointing, at the memory it uses.

A Hugging Face model with its default configuration trains with
``gradient_checkpointing_enable()`` (every layer recomputed); its exact peak becomes
remat's budget, and both are timed, with plain training as the reference. Steps are timed
in interleaved rounds on one thread, after a warm-up; peaks come from the exact tracker.

Run ``python benchmarks/hf_checkpointing.py [--model gpt2|bert] [--steps 9]``; it writes
``results/hf_checkpointing.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.units import format_bytes

RESULTS = Path(__file__).parent / "results"


def build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config()
        tokens = torch.randint(0, config.vocab_size, (2, 128))
        return transformers.GPT2LMHeadModel(config).train(), {"input_ids": tokens, "labels": tokens, "use_cache": False}
    config = transformers.BertConfig()
    tokens = torch.randint(0, config.vocab_size, (4, 128))
    return transformers.BertForMaskedLM(config).train(), {"input_ids": tokens, "labels": tokens}


def step_of(model: nn.Module, kwargs: dict[str, Any]) -> Callable[[], None]:
    def step() -> None:
        model(**kwargs).loss.backward()
        for parameter in model.parameters():
            parameter.grad = None

    return step


def peak_of(step: Callable[[], None]) -> int:
    with remat.MemoryTracker() as tracker:
        step()
    return tracker.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["gpt2", "bert"], default="gpt2")
    parser.add_argument("--steps", type=int, default=9)
    options = parser.parse_args()
    torch.set_num_threads(1)
    model, kwargs = build(options.model)
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    steps: dict[str, Callable[[], None]] = {
        "no recompute": step_of(model, kwargs),
        "HF checkpointing": step_of(hf, kwargs),
    }
    peaks = {name: peak_of(step) for name, step in steps.items()}
    budget: int | str = peaks["HF checkpointing"]
    label = "remat at HF's peak"
    wrapped = remat.Checkpointable(copy.deepcopy(model), budget, loss_fn=lambda output: output.loss, output_kept=False)
    try:
        peak_of(step_of(wrapped, kwargs))  # measures and plans first
    except remat.BudgetTooSmall as error:
        # remat cannot plan within HF's peak: compare at remat's smallest budget instead
        print(f"remat refused HF's peak: {error}")
        budget, label = "min", "remat at its smallest budget"
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), budget, loss_fn=lambda output: output.loss, output_kept=False
        )
        peak_of(step_of(wrapped, kwargs))
    steps[label] = step_of(wrapped, kwargs)
    peaks[label] = peak_of(steps[label])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        step()
    for _ in range(options.steps):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    plan = wrapped.plan
    assert plan is not None
    rows = [
        {
            "strategy": name,
            "peak_bytes": peaks[name],
            "median_step_s": medians[name],
            "vs_no_recompute": medians[name] / medians["no recompute"],
            "vs_hf": medians[name] / medians["HF checkpointing"],
        }
        for name in steps
    ]
    result = {
        "model": options.model,
        "hf_peak_bytes": peaks["HF checkpointing"],
        "budget": budget,
        "budget_bytes": plan.budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "recomputed_stages": sum(count > 1 for count in plan.forward_counts),
        "stages": len(plan.forward_counts),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"hf_checkpointing_{options.model}.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"{options.model}: HF checkpointing's peak {peaks['HF checkpointing']} B; remat's budget {plan.budget_bytes} B "
        f"({label}), recomputing "
        f"{result['recomputed_stages']} of {result['stages']} stages, predicted peak {plan.predicted_peak_bytes} B",
        "",
        "| strategy | measured peak | median step | vs no recompute | vs HF checkpointing |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {format_bytes(row['peak_bytes'])} | {row['median_step_s'] * 1e3:.0f} ms "
            f"| x{row['vs_no_recompute']:.2f} | x{row['vs_hf']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    (RESULTS / f"hf_checkpointing_{options.model}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
