"""`remat.enable` on real Hugging Face architectures and on plain PyTorch forwards.

For each architecture of :func:`remat.models.hugging_face_architectures` (configs at
``--scale`` 4: widths of 256, 8 sequences of 128 tokens or 8 images; random weights,
every other setting at its default; the loss the model computes from ``labels``), and for
the catalogue's models written with a forward of their own (a residual loop, an
encoder-decoder, a U-Net; batch 8, their catalogue loss), it measures the exact peak of a
plain training step, remat's smallest feasible budget, and, at a budget of half the plain
step's (or at the smallest one where half is infeasible), the exact peak and the median
step time against the plain step, timed in interleaved rounds on one thread.

With ``--elementwise``, each model is run instead at half its plain peak in bytes, planned
without and with ``elementwise=True`` (stored stages leave what cheap elementwise operations
can make again to backward), in the same interleaved rounds, and each plan's first step
after measuring is checked against plain autograd: loss and every parameter gradient
``torch.equal`` from the same seed. It writes ``results/dropin_elementwise.json`` and ``.md``.

Run ``python benchmarks/dropin.py [--elementwise]``; it writes ``results/dropin.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from remat.models import CATALOGUE, hugging_face_architectures

#: The catalogue's models written with a forward of their own.
PLAIN_PYTORCH = ("residual", "encoder_decoder", "unet")
#: A case: the model's factory, its inputs (a tuple, or a dict of keyword inputs) and the
#: step's loss from the model's output.
Case = tuple[Callable[[], nn.Module], Any, Callable[[Any], torch.Tensor]]

RESULTS = Path(__file__).parent / "results"
ROUNDS = 7


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)


def _step(model: nn.Module, inputs: Any, loss_of: Callable[[Any], torch.Tensor]) -> float:
    started = time.perf_counter()
    loss_of(_call(model, inputs)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def _peak(model: nn.Module, inputs: Any, loss_of: Callable[[Any], torch.Tensor]) -> int:
    with remat.MemoryTracker() as tracker:
        loss_of(_call(model, inputs)).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def hugging_face_case(name: str, scale: int) -> Case:
    factory, kwargs = hugging_face_architectures(scale)[name]()
    return factory, kwargs, lambda output: output.loss


def plain_pytorch_case(name: str, batch: int = 8) -> Case:
    spec = CATALOGUE[name]
    torch.manual_seed(1)
    inputs, target = spec.make_batch(batch)
    return spec.factory, inputs, lambda output: spec.loss_fn(output, target)


def _plain_model(factory: Callable[[], nn.Module]) -> nn.Module:
    """The model in training, from seed 0, with a Hugging Face cache off as remat's training calls run."""
    torch.manual_seed(0)
    plain = factory().train()
    config = getattr(plain, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    return plain


def run(case: Case) -> dict[str, Any]:
    factory, inputs, loss_of = case
    plain = _plain_model(factory)
    model = copy.deepcopy(plain)
    control = remat.enable(model, 0.5, loss_fn=loss_of)
    _call(control.measure, inputs)
    minimum = control.minimum_budget_bytes()
    try:
        control.plan_for()
        budget = "50%"
    except remat.BudgetTooSmall:
        control.mem_limit = "min"
        budget = "smallest"
    _step(model, inputs, loss_of)  # the measuring step is not timed
    plain_peak, remat_peak = _peak(plain, inputs, loss_of), _peak(model, inputs, loss_of)
    plain_times, remat_times = [], []
    for _ in range(ROUNDS):  # interleaved rounds
        plain_times.append(_step(plain, inputs, loss_of))
        remat_times.append(_step(model, inputs, loss_of))
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


def _exact(plain: nn.Module, model: nn.Module, inputs: Any, loss_of: Callable[[Any], torch.Tensor]) -> bool:
    """Whether a step of `model` gives the loss and gradients of a step of `plain`, from one seed."""
    results = []
    for module in (plain, model):
        torch.manual_seed(0)
        loss = loss_of(_call(module, inputs))
        loss.backward()
        results.append((loss.detach(), [p.grad for p in module.parameters()]))
        module.zero_grad(set_to_none=True)
    (loss_a, grads_a), (loss_b, grads_b) = results
    same = [
        a is None and b is None or a is not None and b is not None and torch.equal(a, b)
        for a, b in zip(grads_a, grads_b, strict=True)
    ]
    return torch.equal(loss_a, loss_b) and all(same)


def run_elementwise(case: Case) -> dict[str, Any]:
    """Half the plain peak in bytes, planned without and with elementwise=True, timed together."""
    factory, inputs, loss_of = case
    plain = _plain_model(factory)
    _step(plain, inputs, loss_of)
    plain_peak = _peak(plain, inputs, loss_of)
    row: dict[str, Any] = {"plain_peak_bytes": plain_peak}
    models = {"plain": plain}
    for name, elementwise in (("remat", False), ("elementwise", True)):
        model = copy.deepcopy(plain)
        control = remat.enable(model, plain_peak // 2, loss_fn=loss_of, elementwise=elementwise)
        try:
            _step(model, inputs, loss_of)  # measures and plans
        except remat.BudgetTooSmall as error:
            control.mem_limit = "min"
            row[f"{name}_budget"] = f"smallest ({error.minimum_bytes / plain_peak:.0%})"
            _step(model, inputs, loss_of)
        plan = control.plan
        assert plan is not None and plan.budget_bytes is not None
        row[f"{name}_exact"] = _exact(plain, model, inputs, loss_of)
        row[f"{name}_budget_bytes"] = plan.budget_bytes
        row[f"{name}_predicted_bytes"] = plan.predicted_peak_bytes
        row[f"{name}_peak_bytes"] = _peak(model, inputs, loss_of)
        row[f"{name}_recomputed"] = f"{sum(count > 1 for count in plan.forward_counts)} of {len(plan.forward_counts)}"
        models[name] = model
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(ROUNDS):  # interleaved rounds, each starting with another model
        names = list(models)[round_ % len(models) :] + list(models)[: round_ % len(models)]
        for name in names:
            times[name].append(_step(models[name], inputs, loss_of))
    for name, samples in times.items():
        row[f"{name}_step_s"] = statistics.median(samples)
    return row


def _elementwise_table(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [
        "| model | plain peak | plan: peak | step | exact | with elementwise: peak | step | exact | "
        "stages recomputed (plan / elementwise) |",
        "|---|---:|---:|---:|---|---:|---:|---|---|",
    ]
    for name, row in results.items():
        plain, cells = row["plain_peak_bytes"], []
        for kind in ("remat", "elementwise"):
            peak, budget = row[f"{kind}_peak_bytes"], row[f"{kind}_budget_bytes"]
            over = "" if peak <= budget else " (OVER its budget)"
            at = f" at {row[kind + '_budget']}" if f"{kind}_budget" in row else ""
            cells += [
                f"{peak / plain:.1%}{at}{over}",
                f"x{row[kind + '_step_s'] / row['plain_step_s']:.3f}",
                "yes" if row[f"{kind}_exact"] else "NO",
            ]
        recomputed = f"{row['remat_recomputed']} / {row['elementwise_recomputed']}"
        lines.append(f"| {name} | {remat.format_bytes(plain)} | {' | '.join(cells)} | {recomputed} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=int, default=4, help="width, batch and length multiplier of the configs")
    parser.add_argument("--only", choices=("hf", "plain"), default=None, help="run only one of the two families")
    parser.add_argument("--models", default=None, help="comma-separated names: run only these (their rows updated)")
    parser.add_argument(
        "--elementwise", action="store_true", help="half the plain peak, without and with elementwise=True"
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the use_cache and coverage notes, said in the table
    cases: dict[str, Callable[[], Case]] = {}
    if options.only != "plain":
        cases |= {name: lambda n=name: hugging_face_case(n, options.scale) for name in hugging_face_architectures()}
    if options.only != "hf":
        cases |= {name: lambda n=name: plain_pytorch_case(n) for name in PLAIN_PYTORCH}
    if options.models is not None:
        chosen = options.models.split(",")
        unknown = sorted(set(chosen) - set(cases))
        if unknown:
            parser.error(f"unknown models {unknown}; choose among {sorted(cases)}")
        cases = {name: cases[name] for name in chosen}
    stem = "dropin_elementwise" if options.elementwise else "dropin"
    path = RESULTS / f"{stem}.json"
    # one family, or some models, alone update their rows of the last full run
    partial = options.only is not None or options.models is not None
    results = json.loads(path.read_text()) if partial and path.exists() else {}
    for name, case in cases.items():
        results[name] = row = (run_elementwise if options.elementwise else run)(case())
        print(name, json.dumps(row), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    if options.elementwise:
        text = "\n".join(_elementwise_table(results))
        (RESULTS / f"{stem}.md").write_text(text + "\n")
        print(text)
        return
    lines = [
        "| model | plain peak | smallest budget | budget run | peak there | within | "
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
    (RESULTS / "dropin.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
