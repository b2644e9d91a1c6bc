"""Saved elementwise results made again in backward: remat.recompute_elementwise against its peers.

Workloads (random weights, synthetic tokens, seeded):

* ``gpt2``: the Hugging Face GPT-2 of ``benchmarks/planner.py`` (8 layers x 256, vocabulary
  512, dropout at its default, 4 x 256 tokens), whose MLP is a GELU written out;
* ``llama``: a Hugging Face Llama (6 layers x 256, gated SiLU MLP of width 688, 4 heads of
  which 2 for keys and values, 4 x 256 tokens), whose MLP multiplies two products;

Strategies, each on its own copy of the same weights:

1. plain autograd;
2. ``remat.recompute_elementwise()`` around the forward;
3. torch's selective checkpointing on every block, recomputing the operations tagged
   elementwise (``torch.Tag.pointwise``: arithmetic and transcendental ones, not random
   ones), views and in-place fills (which it may not keep), and keeping every other
   output: the nearest thing torch has in eager code;
4. ``remat.Checkpointable`` at 50% of the plain peak, alone and with
   ``recompute_elementwise()`` around its forward (the plan is the same: it is made
   without it).

For each: the exact peak of one training step (forward, loss, backward) from
:class:`remat.MemoryTracker`, parameter gradients excluded; the median step time of
``--steps`` interleaved rounds on one thread after a warm-up round; and whether the loss
and every parameter gradient are ``torch.equal`` to plain autograd's (same seed, so the
dropout masks are the same).

Then, for every architecture of :func:`remat.models.hugging_face_architectures` (at
``--scale``, random weights, the loss the model computes from ``labels``): plain autograd
against ``recompute_elementwise()``, and against it with the transcendental operations
named too (``tanh``, ``exp``, ``erf``, ``sigmoid``, ``silu``, ``gelu``): the exact peaks,
the median step time of ``--rounds`` interleaved rounds, how much was left to backward,
and whether the loss, every parameter gradient and every buffer are ``torch.equal`` to
plain autograd's.

Run ``python benchmarks/elementwise.py [--workloads gpt2 llama] [--steps 7] [--scale 2]
[--rounds 5]``; it writes ``results/elementwise.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import remat
from remat.manual.elementwise import CHEAP_OPERATIONS
from remat.models import hugging_face_architectures
from remat.units import MIB

sys.path.insert(0, str(Path(__file__).parent))
from planner import WORKLOADS, Workload, causal_lm_workload  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _llama_blocks(model: Any) -> list[nn.Module]:
    return list(model.model.layers)


def llama_workload() -> Workload:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    described = (
        "Hugging Face LlamaForCausalLM, 6 layers, width 256, gated MLP 688, 4 heads (2 for keys and values), "
        "vocabulary 512"
    )
    return causal_lm_workload("llama", described, transformers.LlamaForCausalLM(config), 512, _llama_blocks)


ALL_WORKLOADS = {"gpt2": WORKLOADS["gpt2"], "llama": llama_workload}


#: Operations that make a tensor to be filled in place (a dropout's mask, a causal mask): torch's
#: selective checkpointing refuses to keep an output that is changed afterwards, so they run again.
_FRESH = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "zeros_like", "new_zeros", "ones", "ones_like",
     "new_ones", "full", "full_like", "new_full", "scalar_tensor", "arange"}
)  # fmt: skip


def _is_view(op: Any) -> bool:
    return any(r.alias_info is not None for r in op._schema.returns)


def _recompute_pointwise(context: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if torch.Tag.pointwise in op.tags and torch.Tag.nondeterministic_seeded not in op.tags:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op.overloadpacket.__name__ in _FRESH or op._schema.is_mutable or _is_view(op):
        return CheckpointPolicy.PREFER_RECOMPUTE  # in-place fills and views: kept ones would be changed
    return CheckpointPolicy.MUST_SAVE


def _torch_pointwise_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    context_fn = functools.partial(create_selective_checkpoint_contexts, _recompute_pointwise)
    for block in blocks:

        def checkpointed(*args: Any, _forward: Callable[..., Any] = block.forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = checkpointed


def strategies(workload: Workload) -> dict[str, tuple[nn.Module, bool]]:
    """Label -> (module, whether its forward runs inside recompute_elementwise)."""
    torch_pointwise = copy.deepcopy(workload.model)
    _torch_pointwise_blocks(torch_pointwise, workload.blocks(torch_pointwise))
    planned = remat.Checkpointable(copy.deepcopy(workload.model), 0.5, loss_fn=workload.loss_fn, output_kept=False)
    planned_elementwise = remat.Checkpointable(
        copy.deepcopy(workload.model), 0.5, loss_fn=workload.loss_fn, output_kept=False
    )
    return {
        "plain": (copy.deepcopy(workload.model), False),
        "remat.recompute_elementwise": (copy.deepcopy(workload.model), True),
        "torch selective, recompute pointwise": (torch_pointwise, False),
        "remat 0.5": (planned, False),
        "remat 0.5 + recompute_elementwise": (planned_elementwise, True),
    }


def _step(workload: Workload, module: nn.Module, elementwise: bool) -> tuple[torch.Tensor, Any]:
    for parameter in module.parameters():
        parameter.grad = None
    torch.manual_seed(1)
    with remat.recompute_elementwise() if elementwise else contextlib.nullcontext() as state:
        loss = workload.loss_fn(workload.call(module))
    loss.backward()
    return loss.detach(), state


def run_workload(name: str, steps: int) -> dict[str, Any]:
    workload = ALL_WORKLOADS[name]()
    modules = strategies(workload)
    labels = list(modules)
    reference = None
    rows: dict[str, dict[str, Any]] = {}
    for label in labels:  # the warm-up round (remat plans here), then exactness and peaks
        module, elementwise = modules[label]
        loss, _ = _step(workload, module, elementwise)
        loss, state = _step(workload, module, elementwise)
        grads = [p.grad.clone() if p.grad is not None else None for p in module.parameters()]
        if reference is None:
            reference = (loss, grads)
        exact = torch.equal(loss, reference[0]) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(grads, reference[1], strict=True)
        )
        with remat.MemoryTracker() as tracker:
            _step(workload, module, elementwise)
        plan = getattr(module, "plan", None)
        rows[label] = {
            "peak_bytes": tracker.peak_bytes,
            "exact": exact,
            "tensors_recomputed": state.tensors_recomputed if state is not None else None,
            "saved_bytes_recomputed": state.saved_bytes_recomputed if state is not None else None,
            "predicted_peak_bytes": plan.predicted_peak_bytes if plan is not None else None,
            "budget_bytes": plan.budget_bytes if plan is not None else None,
        }
        print(label, json.dumps(rows[label]), flush=True)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(steps):
        order = labels[round_index % len(labels) :] + labels[: round_index % len(labels)]
        for label in order:
            module, elementwise = modules[label]
            started = time.perf_counter()
            _step(workload, module, elementwise)
            samples[label].append(time.perf_counter() - started)
    plain_peak = rows["plain"]["peak_bytes"]
    plain_time = statistics.median(samples["plain"])
    for label in labels:
        median = statistics.median(samples[label])
        rows[label].update(
            median_step_s=median,
            time_vs_plain=median / plain_time,
            peak_vs_plain=rows[label]["peak_bytes"] / plain_peak,
        )
    return {"workload": name, "description": workload.description, "rows": rows}


#: The transcendental operations the architectures' third column lets backward run again too.
TRANSCENDENTAL = frozenset({"tanh", "exp", "erf", "sigmoid", "silu", "gelu"})


def _architecture_step(model: nn.Module, kwargs: dict[str, Any], operations: frozenset[str] | None) -> Any:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with remat.recompute_elementwise(operations=operations) if operations else contextlib.nullcontext() as state:
        loss = model(**kwargs).loss
    loss.backward()
    return loss.detach(), state


def run_architecture(name: str, scale: int, rounds: int) -> dict[str, Any]:
    factory, kwargs = hugging_face_architectures(scale)[name]()
    torch.manual_seed(0)
    reference = factory().train()
    variants: dict[str, frozenset[str] | None] = {
        "plain": None,
        "elementwise": CHEAP_OPERATIONS,
        "with transcendental": CHEAP_OPERATIONS | TRANSCENDENTAL,
    }
    models = {label: copy.deepcopy(reference) for label in variants}
    row: dict[str, Any] = {"architecture": name}
    expected = None
    for label, operations in variants.items():
        model = models[label]
        loss, state = _architecture_step(model, kwargs, operations)
        outcome = (loss, [p.grad for p in model.parameters()], list(model.buffers()))
        if expected is None:
            expected = outcome
        with remat.MemoryTracker() as tracker:
            _architecture_step(model, kwargs, operations)
        row[label] = {
            "peak_bytes": tracker.peak_bytes,
            "exact": torch.equal(loss, expected[0])
            and all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(outcome[1], expected[1], strict=True)
            )
            and all(torch.equal(a, b) for a, b in zip(outcome[2], expected[2], strict=True)),
            "tensors_recomputed": state.tensors_recomputed if state is not None else None,
            "saved_bytes_recomputed": state.saved_bytes_recomputed if state is not None else None,
        }
    samples: dict[str, list[float]] = {label: [] for label in variants}
    labels = list(variants)
    for round_index in range(rounds):
        for label in labels[round_index % 3 :] + labels[: round_index % 3]:
            started = time.perf_counter()
            _architecture_step(models[label], kwargs, variants[label])
            samples[label].append(time.perf_counter() - started)
    for label in labels:
        row[label]["median_step_s"] = statistics.median(samples[label])
    print(json.dumps(row), flush=True)
    return row


def markdown(results: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# Saved elementwise results made again in backward",
        "",
        f"torch {torch.__version__}, {platform.machine()}, CPU, 1 thread, median of {steps} interleaved rounds; "
        "peaks from remat.MemoryTracker (parameter gradients excluded).",
        "",
    ]
    for result in results:
        lines += [
            f"## {result['workload']}",
            "",
            result["description"],
            "",
            "| strategy | peak | % of plain | predicted (budget) | step | vs plain | saved tensors made again "
            "| gradients equal to plain |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for label, row in result["rows"].items():
            predicted = (
                f"{row['predicted_peak_bytes'] / MIB:.1f} ({row['budget_bytes'] / MIB:.1f}) MiB"
                if row["predicted_peak_bytes"] is not None
                else ""
            )
            made = (
                f"{row['tensors_recomputed']} ({row['saved_bytes_recomputed'] / MIB:.1f} MiB)"
                if row["tensors_recomputed"] is not None
                else ""
            )
            lines.append(
                f"| {label} | {row['peak_bytes'] / MIB:.1f} MiB | {row['peak_vs_plain']:.1%} | {predicted} "
                f"| {row['median_step_s'] * 1e3:.1f} ms | x{row['time_vs_plain']:.3f} | {made} "
                f"| {'yes' if row['exact'] else 'NO'} |"
            )
        lines.append("")
    return "\n".join(lines)


def architectures_markdown(rows: list[dict[str, Any]], scale: int, rounds: int) -> str:
    lines = [
        f"## Hugging Face architectures (scale {scale}, median of {rounds} interleaved rounds)",
        "",
        "Peak and step time against plain autograd's; made again: saved tensors left to backward "
        "(their storage); equal: loss, parameter gradients and buffers torch.equal to plain autograd's.",
        "",
        "| architecture | plain peak | elementwise: peak | step | made again | equal "
        "| with transcendental: peak | step | made again | equal |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        plain = row["plain"]
        cells = [row["architecture"], f"{plain['peak_bytes'] / MIB:.2f} MiB"]
        for label in ("elementwise", "with transcendental"):
            r = row[label]
            cells += [
                f"{r['peak_bytes'] / plain['peak_bytes']:.1%}",
                f"x{r['median_step_s'] / plain['median_step_s']:.3f}",
                f"{r['tensors_recomputed']} ({r['saved_bytes_recomputed'] / MIB:.2f} MiB)",
                "yes" if r["exact"] else "NO",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(ALL_WORKLOADS), default=["gpt2", "llama"])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--scale", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--architectures", nargs="*", default=None, help="default: all of them")
    options = parser.parse_args()
    torch.set_num_threads(1)
    results = [run_workload(name, options.steps) for name in options.workloads]
    names = options.architectures if options.architectures is not None else list(hugging_face_architectures())
    rows = [run_architecture(name, options.scale, options.rounds) for name in names]
    RESULTS.mkdir(exist_ok=True)
    summary = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "steps": options.steps,
        "results": results,
        "architectures": {"scale": options.scale, "rounds": options.rounds, "rows": rows},
    }
    (RESULTS / "elementwise.json").write_text(json.dumps(summary, indent=2))
    text = markdown(results, options.steps) + "\n" + architectures_markdown(rows, options.scale, options.rounds)
    (RESULTS / "elementwise.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
