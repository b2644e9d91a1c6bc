"""remat on a CUDA device: exactness, the allocator's peak against the plan, and step times.

On a Hugging Face GPT-2 (dropout on) and a Hugging Face ResNet (BatchNorm), this checks what
only a GPU shows:

* dropout replayed bit for bit on CUDA: the gradients of remat at a low budget against plain
  autograd, with ``torch.use_deterministic_algorithms`` (and a plain-against-plain control, so
  that a difference is remat's and not the kernels');
* BatchNorm running statistics updated once per step;
* ``torch.cuda.max_memory_allocated`` during a step against the plan's predicted peak and its
  budget (the allocator counts above what is allocated before the step: parameters and
  gradients), and the exact tracker's peak on the same step;
* ``mem_limit=None``: the budget taken from the device's free memory;
* median step times of plain training, torch's checkpoint per block (Hugging Face's own on
  GPT-2), torch's selective checkpointing saving matrix products and convolutions, and remat
  at several budgets, with and without offload (``--sections resnet``: a ResNet-50 layout
  along a curve of budgets).

Run ``python benchmarks/gpu.py [--small]`` on a machine with a CUDA device (``--small`` and
``--device cpu`` check the script itself elsewhere). It writes ``results/gpu.json`` and
``gpu.md``, ``gpu_decoder.*`` and ``gpu_resnet.*`` (or into ``--out``), named with the device.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import remat
from peers import checkpoint_selectively
from remat.units import format_bytes

RESULTS = Path(__file__).parent / "results"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gpt(small: bool, device: torch.device, config: dict[str, int], batch: int) -> tuple[nn.Module, dict[str, Any]]:
    """A Hugging Face GPT-2 of `config` (``--small``: a tiny one) and a batch of its tokens."""
    transformers: Any = importlib.import_module("transformers")

    torch.manual_seed(0)
    if small:
        config, batch, length = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}, 2, 32
    else:
        length = 1024
    gpt_config = transformers.GPT2Config(**config)
    model = transformers.GPT2LMHeadModel(gpt_config).to(device).train()
    tokens = torch.randint(0, gpt_config.vocab_size, (batch, length), device=device)
    return model, {"input_ids": tokens, "labels": tokens, "use_cache": False}


def gpt2(small: bool, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    return _gpt(small, device, {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024}, 8)


def decoder(small: bool, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """A wide GPT-style decoder with a small vocabulary: its blocks hold most of the step's
    memory, and each one computes long enough to hide a copy of what it saves."""
    config = {"n_layer": 8, "n_embd": 2048, "n_head": 16, "vocab_size": 8192, "n_positions": 1024}
    return _gpt(small, device, config, 4)


def resnet(small: bool, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    transformers: Any = importlib.import_module("transformers")

    torch.manual_seed(0)
    if small:
        config = transformers.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10
        )
        batch, size = 2, 32
    else:
        config = transformers.ResNetConfig(num_labels=100)  # ResNet-50's layout
        batch, size = 32, 224
    model = transformers.ResNetForImageClassification(config).to(device).train()
    pixels = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, 100 if not small else 10, (batch,), device=device)
    return model, {"pixel_values": pixels, "labels": labels}


def train_step(model: nn.Module, kwargs: dict[str, Any]) -> None:
    model(**kwargs).loss.backward()


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def run_seeded(model: nn.Module, kwargs: dict[str, Any], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    train_step(model, kwargs)
    buffers = [b.detach().clone() for b in model.buffers()]
    return gradients(model), buffers


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b, strict=True))


def exactness(
    name: str,
    factory: Callable[..., tuple[nn.Module, dict[str, Any]]],
    small: bool,
    device: torch.device,
    budget: float | str,
) -> dict[str, Any]:
    """remat at ``budget`` against plain autograd, same seed, deterministic kernels."""
    model, kwargs = factory(small, device)
    plain = copy.deepcopy(model)
    control = copy.deepcopy(model)
    wrapped = remat.Checkpointable(copy.deepcopy(model), budget, loss_fn=lambda out: out.loss, output_kept=False)
    train_step(wrapped, kwargs)  # measures and plans
    # a fresh copy of the start state for each compared step
    for target in (plain, control):
        target.load_state_dict(model.state_dict())
    wrapped.load_state_dict(model.state_dict())
    torch.use_deterministic_algorithms(True)
    try:
        expected, expected_buffers = run_seeded(plain, kwargs, 1234)
        again, _ = run_seeded(control, kwargs, 1234)
        actual, actual_buffers = run_seeded(wrapped, kwargs, 1234)
    finally:
        torch.use_deterministic_algorithms(False)
    plan = wrapped.plan
    assert plan is not None
    buffers_equal = all(torch.equal(x, y) for x, y in zip(expected_buffers, actual_buffers, strict=True))
    return {
        "model": name,
        "budget": budget,
        "recomputed_stages": sum(count > 1 for count in plan.forward_counts),
        "stages": len(plan.forward_counts),
        "control_equal": all(torch.equal(x, y) for x, y in zip(expected, again, strict=True)),
        "gradients_equal": all(torch.equal(x, y) for x, y in zip(expected, actual, strict=True)),
        "max_abs_difference": max_difference(expected, actual),
        "buffers_equal": buffers_equal,
    }


def allocator_peak(step: Callable[[], None], device: torch.device) -> int:
    """The allocator's peak during ``step`` above what was allocated before it (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def median_time(step: Callable[[], None], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def blocks_of(model: Any) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face GPT-2 (its layers) or ResNet (its stages)."""
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return list(model.resnet.encoder.stages)


def selective_matmuls(model: nn.Module) -> nn.Module:
    """A copy with every block under torch's checkpoint with a policy saving matrix products."""
    copied: Any = copy.deepcopy(model)
    checkpoint_selectively(blocks_of(copied))
    return copied


def checkpointed_blocks(model: nn.Module) -> nn.Module:
    """A copy with every block under torch's checkpoint: Hugging Face's own where the model has
    it (GPT-2), else each block's forward wrapped (ResNet's stages)."""
    copied: Any = copy.deepcopy(model)
    if copied.supports_gradient_checkpointing:
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return copied
    for block in blocks_of(copied):

        def checkpointed(*args: Any, _forward: Callable[..., Any] = block.forward, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return copied


class _Compiled(nn.Module):
    """A copy compiled with ``torch._functorch.config.activation_memory_budget``."""

    def __init__(self, model: nn.Module, budget: float) -> None:
        super().__init__()
        self.model = copy.deepcopy(model)
        self.budget = budget
        self.program = torch.compile(self.model)

    def forward(self, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.program(**kwargs)


def compiled_with_budget(model: nn.Module, budget: float) -> nn.Module:
    return _Compiled(model, budget)


def memory_and_time(
    factory: Callable[..., tuple[nn.Module, dict[str, Any]]],
    small: bool,
    device: torch.device,
    repeats: int,
    compile_budgets: bool,
    written: Callable[[list[dict[str, Any]]], None],
    fractions: tuple[float, ...] = (0.5, 0.25),
) -> dict[str, Any]:
    model, kwargs = factory(small, device)
    strategies: dict[str, nn.Module] = {
        "no recompute": model,
        "torch checkpoint per block": checkpointed_blocks(model),
        "torch selective (save matmuls)": selective_matmuls(model),
    }
    strategies["remat policy save_matmuls"] = remat.Checkpointable(
        copy.deepcopy(model), policy=remat.policies.save_matmuls
    )
    offload = device.type == "cuda" or 8e9  # on the CPU (checking the script): a stand-in link
    for fraction, offloading in [(1.0, False)] + [(f, o) for f in fractions for o in (False, offload)]:
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), fraction, loss_fn=lambda out: out.loss, output_kept=False, offload=offloading
        )
        label = f"remat {fraction}" + (" + offload" if offloading else "")
        try:
            wrapped.measure(**kwargs)
            wrapped.compute_sequence()
        except remat.BudgetTooSmall as error:
            print(f"{label}: {error}")
            continue
        strategies[label] = wrapped
    for offloading in (False, offload):
        wrapped = remat.Checkpointable(
            copy.deepcopy(model), "min", loss_fn=lambda out: out.loss, output_kept=False, offload=offloading
        )
        wrapped.measure(**kwargs)
        strategies["remat min" + (" + offload" if offloading else "")] = wrapped
    if compile_budgets:
        for budget in (0.5, 0.25):
            strategies[f"torch.compile budget {budget}"] = compiled_with_budget(model, budget)
    rows = []
    for name, module in strategies.items():
        step = functools.partial(train_step, module, kwargs)
        for _ in range(2):  # measures, plans and warms the allocator up
            step()
        module.zero_grad(set_to_none=False)  # gradients allocated before the measured step
        peak = allocator_peak(step, device)
        with remat.MemoryTracker(device=device.type) as tracker:
            step()
        seconds = median_time(step, device, repeats)
        row: dict[str, Any] = {
            "strategy": name,
            "allocator_peak_bytes": peak,
            "tracker_peak_bytes": tracker.peak_bytes,
            "median_step_s": seconds,
        }
        if isinstance(module, remat.Checkpointable):
            plan = module.plan
            if plan is None:  # a policy: nothing planned
                rows.append(row)
                row["vs_no_recompute"] = row["median_step_s"] / rows[0]["median_step_s"]
                written(rows)
                module.zero_grad(set_to_none=True)
                continue
            row["budget_bytes"] = plan.budget_bytes
            row["predicted_peak_bytes"] = plan.predicted_peak_bytes
            row["offloaded_stages"] = sum(type(item).__name__ == "Offload" for item in plan.schedule.items)
            row["predicted_host_bytes"] = plan.schedule.simulation.host_peak_bytes
            row["recomputed_stages"] = sum(count > 1 for count in plan.forward_counts)
            row["stages"] = len(plan.forward_counts)
            if peak:
                row["allocator_vs_predicted"] = peak / plan.predicted_peak_bytes
        rows.append(row)
        row["vs_no_recompute"] = row["median_step_s"] / rows[0]["median_step_s"]
        written(rows)  # as it goes: a run cut short keeps what it measured
        module.zero_grad(set_to_none=True)
    return {"rows": rows}


def free_memory_budget(small: bool, device: torch.device) -> dict[str, Any]:
    model, kwargs = gpt2(small, device)
    wrapped = remat.Checkpointable(model, None, loss_fn=lambda out: out.loss, output_kept=False)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else remat.budget.available_memory_bytes()
    train_step(wrapped, kwargs)
    plan = wrapped.plan
    assert plan is not None
    return {
        "free_bytes_before": int(free),
        "budget_bytes": plan.budget_bytes,
        "recomputed_stages": sum(count > 1 for count in plan.forward_counts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny models, to check the script")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile's memory budget")
    parser.add_argument(
        "--sections",
        default="exactness,free,gpt2,decoder,resnet",
        help="comma-separated: exactness,free,gpt2,decoder,resnet",
    )
    options = parser.parse_args()
    device = torch.device(options.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result: dict[str, Any] = {"device": name, "torch": torch.__version__}
    sections = options.sections.split(",")
    options.out.mkdir(parents=True, exist_ok=True)
    if "exactness" in sections:
        result["exactness"] = [
            exactness("gpt2", gpt2, options.small, device, "min"),
            exactness("resnet", resnet, options.small, device, "min"),
        ]
        print(json.dumps(result["exactness"], indent=1), flush=True)
    if "free" in sections:
        result["free_memory_budget"] = free_memory_budget(options.small, device)
        print(json.dumps(result["free_memory_budget"]), flush=True)
    titles = {
        "gpt2": "HF GPT-2 training step",
        "decoder": "wide GPT-style decoder (8 x 2048, 4 x 1024 tokens)",
        "resnet": "HF ResNet-50 layout (32 images of 224 pixels)",
    }
    curves = {"resnet": (0.75, 0.5, 0.35, 0.25)}
    for section, factory in (("gpt2", gpt2), ("decoder", decoder), ("resnet", resnet)):
        if section not in sections:
            continue

        def written(rows: list[dict[str, Any]], section: str = section) -> None:
            result[section] = {"rows": rows}
            stem = "gpu" if section == "gpt2" else f"gpu_{section}"
            (options.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
            (options.out / f"{stem}.md").write_text(
                table(f"remat on {name} (torch {torch.__version__}), {titles[section]}", rows)
            )

        compiling = not options.no_compile and section != "resnet"  # compile's budget: transformers only
        fractions = curves.get(section, (0.5, 0.25))
        memory_and_time(factory, options.small, device, options.repeats, compiling, written, fractions)
        print((options.out / ("gpu.md" if section == "gpt2" else f"gpu_{section}.md")).read_text(), flush=True)


def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        title,
        "",
        "| strategy | allocator peak | tracker peak | predicted | budget | offloaded | median step | vs no recompute |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        predicted = format_bytes(row["predicted_peak_bytes"]) if "predicted_peak_bytes" in row else ""
        budget = format_bytes(row["budget_bytes"]) if "budget_bytes" in row else ""
        lines.append(
            f"| {row['strategy']} | {format_bytes(row['allocator_peak_bytes'])} | "
            f"{format_bytes(row['tracker_peak_bytes'])} | {predicted} | {budget} | "
            f"{row.get('offloaded_stages', '')} | {row['median_step_s'] * 1e3:.1f} ms | x{row['vs_no_recompute']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
