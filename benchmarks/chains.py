"""Benchmark: remat's optimal schedule against checkpoint_sequential on three chains.

For a uniform MLP, a heterogeneous conv net and a transformer stack, it measures (exact
peak activation bytes of one step, median step time) for: no recompute; torch's
``checkpoint_sequential`` with sqrt(n) segments; remat at the memory checkpoint_sequential
used; remat at 50%, 25% and the minimum. It also measures what planning costs: the wall
time of ``Checkpointable.measure`` in training steps, and the solver time for 200 stages
x 500 memory slots.

Writes ``benchmarks/results/chains.json`` and ``benchmarks/results/chains.md``.

    python benchmarks/chains.py [--steps 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat.automatic import Checkpointable
from remat.bench import run_benchmark
from remat.models import gpt2, mlp_chain
from remat.plan.solvers import get_solver
from remat.testing import random_chain
from remat.units import format_bytes

RESULTS = Path(__file__).parent / "results"


def _mlp() -> tuple[Callable[[], nn.Module], Callable[[], Any], Callable[..., torch.Tensor]]:
    def batch() -> tuple[tuple[torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return (torch.randn(256, 256, generator=generator),), torch.randn(256, 256, generator=generator)

    return partial(mlp_chain, depth=16, width=256), batch, F.mse_loss


def _convnet() -> tuple[Callable[[], nn.Module], Callable[[], Any], Callable[..., torch.Tensor]]:
    def batch() -> tuple[tuple[torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(32, 3, 32, 32, generator=generator)
        return (images,), torch.randint(0, 10, (32,), generator=generator)

    def factory() -> nn.Sequential:
        # conv, BatchNorm and in-place ReLU as separate stages, channels and resolution
        # changing along the chain: stages of very different costs.
        layers: list[nn.Module] = []
        channels = 3
        for width, stride in [(32, 1), (32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1)]:
            layers += [
                nn.Conv2d(channels, width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
            ]
            channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
        return nn.Sequential(*layers)

    return factory, batch, F.cross_entropy


def _transformer() -> tuple[Callable[[], nn.Module], Callable[[], Any], Callable[..., torch.Tensor]]:
    vocab, length = 512, 128

    def batch() -> tuple[tuple[torch.Tensor], torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (8, length), generator=generator)
        return (ids,), ids

    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))

    factory = partial(gpt2, vocab_size=vocab, n_positions=length, d_model=128, n_heads=4, n_layers=8, dropout=0.1)
    return factory, batch, loss


CHAINS = {
    "uniform MLP (16 blocks, width 256, batch 256)": _mlp,
    "heterogeneous conv net (8 conv-BN-ReLU, 32 to 256 channels, batch 32, 32x32)": _convnet,
    "transformer stack (GPT-2 style, 8 layers, d=128, 8x128 tokens)": _transformer,
}


def measurement_cost(factory: Callable[[], nn.Module], make_batch: Callable[[], Any], loss_fn: Any) -> dict[str, float]:
    """Wall time of Checkpointable.measure, in plain training steps of the same model."""
    model = factory()
    (inputs, target) = make_batch()

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        loss_fn(model(*inputs), target).backward()

    for _ in range(2):
        step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    wrapper = Checkpointable(model, 0.5, loss_fn=lambda out: loss_fn(out, target))
    measures = []
    for _ in range(3):
        start = time.perf_counter()
        wrapper.measure(*inputs)
        measures.append(time.perf_counter() - start)
    measure_s = statistics.median(measures)
    return {"step_s": step_s, "measure_s": measure_s, "measure_in_steps": measure_s / step_s}


def solver_speed(n_stages: int = 200, slots: int = 500) -> dict[str, float]:
    """Seconds for the optimal solver on a random chain of `n_stages`, after JIT warm-up."""
    profile = random_chain(0, n_stages)
    solver = get_solver("optimal", slots=slots)
    store_all = get_solver("none")(profile, None).predicted_peak_bytes
    budget = store_all // 3
    solver(profile, budget)  # warm-up (JIT compilation)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        solver(profile, budget)
        times.append(time.perf_counter() - start)
    return {"n_stages": n_stages, "slots": slots, "seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    RESULTS.mkdir(exist_ok=True)
    report: dict[str, Any] = {"chains": {}, "measurement": {}, "solver": None}
    markdown: list[str] = []
    torch.set_num_threads(args.threads)
    for title, make in CHAINS.items():
        factory, make_batch, loss_fn = make()
        result = run_benchmark(
            factory,
            make_batch,
            loss_fn,
            budgets=(0.5, 0.25, "min"),
            steps=args.steps,
            threads=args.threads,
            model_name=title,
        )
        report["chains"][title] = result.to_dict()
        cost = measurement_cost(factory, make_batch, loss_fn)
        report["measurement"][title] = cost
        markdown.append(f"### {title}\n")
        markdown.append(result.to_markdown())
        markdown.append(
            f"Measuring cost {cost['measure_s'] * 1000:.0f} ms = {cost['measure_in_steps']:.2f} training steps "
            f"(a plain step: {cost['step_s'] * 1000:.1f} ms).\n"
        )
        print(f"{title}: done", flush=True)
    speed = solver_speed()
    report["solver"] = speed
    markdown.append(
        f"Solver: {speed['n_stages']} stages x {speed['slots']} memory slots in {speed['seconds']:.3f} s "
        "(median of 3, after JIT warm-up).\n"
    )
    (RESULTS / "chains.json").write_text(json.dumps(report, indent=2))
    (RESULTS / "chains.md").write_text("\n".join(markdown))
    print("\n".join(markdown))
    print(f"peaks in bytes are exact; e.g. {format_bytes(1 << 20)} = 1 MiB")


if __name__ == "__main__":
    main()
