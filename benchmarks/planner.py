"""remat's automatic mode against its peers on the memory/time curve.

One workload per process (``--workload``):

* ``gpt2``: Hugging Face ``GPT2LMHeadModel`` from a small configuration with random weights
  (8 layers, width 256, 4 heads, 512 tokens of vocabulary, dropout at its default), 4
  sequences of 256 tokens, the model's own loss (``labels=input_ids``);
* ``resnet``: remat's zoo ResNet-18 (a chain), 8 images of 96x96, cross entropy;
* ``mlp``: 24 blocks of Linear, GELU (and LayerNorm every fourth), widths cycling
  256, 1024, 512, 2048, batch 64, the mean square of the output as the loss.

Strategies, each on its own copy of the same weights:

1. no recompute;
2. torch's ``checkpoint_sequential`` over the flattened chain with round(sqrt(n)) segments
   (the Sequentials), or Hugging Face's ``gradient_checkpointing_enable`` (GPT-2), both
   with ``use_reentrant=False``;
3. torch's selective activation checkpointing on every block, keeping matrix products,
   convolutions and attention (``MUST_SAVE``) and recomputing the rest (``PREFER_RECOMPUTE``);
4. ``torch.compile`` (inductor, CPU) with ``torch._functorch.config.activation_memory_budget``
   at each fraction; its overhead is also taken against its own budget 1.0;
5. ``remat.Checkpointable`` at each fraction, at the smallest feasible budget (``"min"``),
   and at the peak strategy 2 measured, in bytes; with ``--nested``, the same points again
   with ``nested=True`` (blocks split into their submodules), in the same run; with
   ``--policy``, the same points again with ``policy=save_matmuls`` (the planner may store
   any stage under the policy); with ``--elementwise``, the same points again with
   ``elementwise=True`` (each stored stage leaves what cheap elementwise operations can make
   again to backward), its fractions given in bytes of the plain peak (a fraction would be of
   its own step storing everything, which keeps less).

Peaks are those of one training step (forward, loss, backward), parameter gradients
excluded, from the exact tracker :class:`remat.MemoryTracker`, except for compiled code:
torch.compile does not run its graph under a ``TorchDispatchMode`` (Dynamo skips the frame,
and the module then stays eager), so the tracker would measure the eager model. Compiled
peaks come from the CPU allocator's events instead (``torch.profiler`` with
``profile_memory=True``: every allocation and free with its address, which inductor's own
buffers go through too), with the storages left as parameter gradients excluded as the
tracker does; that figure is taken for every strategy, so the two can be compared on eager
code. Step times: one thread, a warm-up step per strategy, then the median of ``--steps``
interleaved rounds, each round starting one strategy later.

Each compiled point gets a backend of its own that sets the budget while inductor
partitions the graph: Dynamo keeps its compiled code per code object, and copies of one
model share theirs, so a ``torch._dynamo.reset()`` between points would leave every earlier
copy running the graph compiled last. Inductor's cache is a fresh directory per run: the
first point compiles from cold, later ones may reuse the kernels earlier ones compiled.

Run ``python benchmarks/planner.py --workload gpt2|resnet|mlp [--steps 7] [--nested]
[--no-compile] [--policy] [--elementwise] [--compiled-blocks] [--compiled-model]``; it writes
``results/planner_<workload>.json`` and ``.md``, and the curve as
``docs/planner_<workload>.png`` (``planner_<workload>_nested`` with ``--nested``, and so on).
``--compiled-model`` adds ``torch.compile`` of the remat model itself, whose plan runs in the
graph from its second call (NOTE [a plan in the compiled graph] in remat.traced): its peaks
are the CPU allocator's, like compile's own.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint_sequential

import remat
from peers import checkpoint_selectively
from remat.discover.chain import sequential_chain
from remat.models import BasicBlock, resnet18
from remat.units import format_bytes

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parent.parent / "docs"
FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
MLP_WIDTHS = (256, 1024, 512, 2048)
PLAIN = "no recompute"
REMAT_NESTED = "remat nested"
REMAT_COMPILED = "remat, compiled blocks"
REMAT_POLICY = "remat + save_matmuls"
REMAT_GRAPH = "remat, compiled model"
REMAT_ELEMENTWISE = "remat + elementwise"
REMAT_FAMILIES = ("remat", REMAT_NESTED, REMAT_COMPILED, REMAT_POLICY, REMAT_GRAPH, REMAT_ELEMENTWISE)
COMPILED_FAMILIES = ("torch.compile", REMAT_COMPILED, REMAT_GRAPH)
TRACKER = "MemoryTracker"
ALLOCATOR = "allocator (torch.profiler)"
GRADIENT_MARK = "planner: gradient handed over"

LossFn = Callable[[Any], torch.Tensor]


# ---------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    """A model, its batch and its loss; ``blocks`` names the blocks selective checkpointing wraps."""

    name: str
    description: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss_fn: LossFn
    blocks: Callable[[nn.Module], list[nn.Module]]
    hugging_face: bool = False

    def call(self, module: Callable[..., Any]) -> Any:
        return module(*self.args, **self.kwargs)


class MlpBlock(nn.Module):
    """Linear, GELU and, if asked, a LayerNorm: one stage of the heterogeneous chain."""

    def __init__(self, in_features: int, out_features: int, *, normalized: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.activation = nn.GELU()
        self.norm = nn.LayerNorm(out_features) if normalized else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.activation(self.linear(x)))


def gpt2_blocks(model: Any) -> list[nn.Module]:
    return list(model.transformer.h)


def mlp_blocks(model: Any) -> list[nn.Module]:
    return list(model)


def causal_lm_workload(
    name: str, described: str, model: nn.Module, vocab_size: int, blocks: Callable[[Any], list[nn.Module]]
) -> Workload:
    """A Hugging Face causal language model (seeded before it was built) on 4 x 256 random
    tokens, trained on the loss it computes from ``labels=input_ids``."""
    tokens = torch.randint(0, vocab_size, (4, 256))
    return Workload(
        name,
        f"{described}, random weights; 4 x 256 tokens, labels = input_ids",
        model.train(),
        (),
        {"input_ids": tokens, "labels": tokens, "use_cache": False},
        lambda output: output.loss,
        blocks,
        hugging_face=True,
    )


def gpt2_workload() -> Workload:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=512, n_positions=256)
    described = "Hugging Face GPT2LMHeadModel, 8 layers, width 256, 4 heads, vocabulary 512"
    return causal_lm_workload("gpt2", described, transformers.GPT2LMHeadModel(config), config.vocab_size, gpt2_blocks)


def resnet_workload() -> Workload:
    torch.manual_seed(0)
    model = resnet18(num_classes=10).train()
    images = torch.randn(8, 3, 96, 96)
    labels = torch.randint(0, 10, (8,))
    return Workload(
        "resnet",
        "remat zoo ResNet-18 (a chain), 8 x 3 x 96 x 96 images, cross entropy over 10 classes",
        model,
        (images,),
        {},
        lambda output: functional.cross_entropy(output, labels),
        lambda module: [m for m in module.modules() if isinstance(m, BasicBlock)],
    )


def mlp_workload() -> Workload:
    torch.manual_seed(0)
    blocks = [MlpBlock(MLP_WIDTHS[i % 4], MLP_WIDTHS[(i + 1) % 4], normalized=i % 4 == 3) for i in range(24)]
    model = nn.Sequential(*blocks).train()
    inputs = torch.randn(64, MLP_WIDTHS[0])
    return Workload(
        "mlp",
        "24 blocks of Linear + GELU (+ LayerNorm every 4th), widths cycling 256, 1024, 512, 2048; "
        "batch 64, loss = mean square",
        model,
        (inputs,),
        {},
        lambda output: output.pow(2).mean(),
        mlp_blocks,
    )


WORKLOADS = {"gpt2": gpt2_workload, "resnet": resnet_workload, "mlp": mlp_workload}


# ---------------------------------------------------------------------------- strategies
@dataclass
class Strategy:
    """A row of the table and how to run its forward; ``module`` owns the parameters."""

    row: dict[str, Any]
    forward: Callable[[], Any]
    module: nn.Module
    times: list[float] = field(default_factory=list)


def row_of(family: str, strategy: str, budget: Any = None) -> dict[str, Any]:
    return {"family": family, "strategy": strategy, "budget": budget, "feasible": True}


def recompute_sequentially(workload: Workload) -> Strategy:
    """Strategy 2: checkpoint_sequential over the flattened chain, or Hugging Face's checkpointing."""
    copied: Any = copy.deepcopy(workload.model)
    if workload.hugging_face:
        copied.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return Strategy(
            row_of("HF checkpointing", "HF gradient checkpointing"), functools.partial(workload.call, copied), copied
        )
    stages = sequential_chain(copied).modules
    segments = max(1, round(math.sqrt(len(stages))))
    (x,) = workload.args

    def forward() -> Any:
        return checkpoint_sequential(stages, segments, x, use_reentrant=False)

    strategy = f"checkpoint_sequential ({segments} segments of {len(stages)} stages)"
    return Strategy(row_of("checkpoint_sequential", strategy), forward, copied)


def recompute_selectively(workload: Workload) -> Strategy:
    """Strategy 3: every block under torch's checkpoint with a policy keeping matrix products."""
    copied = copy.deepcopy(workload.model)
    checkpoint_selectively(workload.blocks(copied))
    strategy = f"torch selective, {len(workload.blocks(copied))} blocks, keep matmuls"
    return Strategy(row_of("torch selective", strategy), functools.partial(workload.call, copied), copied)


def inductor_with_budget(graph: torch.fx.GraphModule, example_inputs: list[Any], *, budget: float) -> Any:
    """Inductor, partitioning the joint graph under ``activation_memory_budget=budget``."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(activation_memory_budget=budget):
        return compile_fx(graph, example_inputs)


def compiled(workload: Workload, budget: float) -> Strategy:
    """Strategy 4 at one budget: compiles a fresh copy (its first step, timed, is the compile)."""
    row = row_of("torch.compile", f"torch.compile budget {budget}", budget)
    torch._functorch.config.activation_memory_budget = budget
    module = copy.deepcopy(workload.model)
    program = torch.compile(module, backend=functools.partial(inductor_with_budget, budget=budget))
    strategy = Strategy(row, functools.partial(workload.call, program), module)
    started = time.perf_counter()
    try:
        train_step(workload, strategy)
    except Exception as error:  # a model inductor cannot compile: recorded, the run goes on
        row.update(feasible=False, error=f"{type(error).__name__}: {error}"[:2000])
        print(f"torch.compile at {budget} failed: {row['error']}", flush=True)
    row["compile_s"] = time.perf_counter() - started
    return strategy


def rematerialized(workload: Workload, budget: float | int | str, label: str, *, family: str = "remat") -> Strategy:
    """Strategy 5 at one budget; infeasible budgets come back with ``feasible`` False.

    With the family `REMAT_COMPILED`, each block of a fresh copy is compiled first
    (``block.compile()``, inductor): the first step measures, plans and compiles (its wall
    time is ``compile_s``). `REMAT_POLICY` lets the planner store any stage under
    ``save_matmuls`` too (``policy=`` with the budget).
    """
    compiled, nested, graph = family == REMAT_COMPILED, family == REMAT_NESTED, family == REMAT_GRAPH
    policy = remat.policies.save_matmuls if family == REMAT_POLICY else None
    model = copy.deepcopy(workload.model)
    if compiled:
        for block in workload.blocks(model):
            block.compile(dynamic=False)
    wrapped = remat.Checkpointable(
        model, budget, loss_fn=workload.loss_fn, output_kept=False, nested=nested, policy=policy,
        elementwise=family == REMAT_ELEMENTWISE,
    )  # fmt: skip
    row = row_of(family, label, budget)
    # REMAT_GRAPH: the whole model compiled (inductor); its first call measures at a graph
    # break and plans stage by stage, the next compiles that plan into the graph
    call = torch.compile(wrapped) if graph else wrapped
    strategy = Strategy(row, functools.partial(workload.call, call), wrapped)
    started = time.perf_counter()
    try:
        train_step(workload, strategy)  # measures and plans
        if compiled or graph:
            train_step(workload, strategy)  # the first step under the plan compiles
            row["compile_s"] = time.perf_counter() - started
    except remat.BudgetTooSmall as error:
        row.update(feasible=False, error=str(error), budget_bytes=error.budget_bytes, minimum_bytes=error.minimum_bytes)
        return strategy
    plan = wrapped.plan
    if graph:
        if not wrapped._traced.plans:
            row.update(feasible=False, error="no plan in the graph at this budget (remat said why)")
            return strategy
        (traced,) = wrapped._traced.plans.values()
        plan = traced.plan
    assert plan is not None
    row.update(
        budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_time_s=plan.predicted_time_s,
        predicted_overhead=plan.overhead,
        recomputed_stages=sum(count > 1 for count in plan.forward_counts),
        stages=len(plan.forward_counts),
        policy_stages=sum(op.option is not None for op in plan.schedule.operations),
    )
    return strategy


# ---------------------------------------------------------------------------- measurements
def train_step(workload: Workload, strategy: Strategy) -> None:
    """Forward, loss (the output dropped once it is computed) and backward."""
    workload.loss_fn(strategy.forward()).backward()
    for parameter in strategy.module.parameters():
        parameter.grad = None


def tracker_peak_bytes(workload: Workload, strategy: Strategy) -> int:
    tracker = remat.MemoryTracker(exclude_grads_of=list(strategy.module.parameters()), device="cpu")
    with tracker:
        train_step(workload, strategy)
    return tracker.peak_bytes


def profiled_events(profiler: profile) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
    """The CPU allocator's events ``(time, address, +bytes allocated / -bytes freed)`` in
    order, and the time of each mark ``GRADIENT_MARK <k>`` by ``k``."""
    results: Any = profiler.profiler.kineto_results  # type: ignore[union-attr]
    pending = list(results.experimental_event_tree())
    found = []
    marks = {}
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.id, fields.ptr, fields.alloc_size))
        elif event.name.startswith(GRADIENT_MARK):
            marks[int(event.name.rsplit(" ", 1)[1])] = event.start_time_ns
    return [(time_ns, address, size) for time_ns, _, address, size in sorted(found)], marks


def allocator_peak_bytes(workload: Workload, strategy: Strategy) -> int:
    """Peak bytes allocated during one step by the CPU allocator, parameter gradients excluded.

    Allocations made before the step are not counted (their frees are ignored). As
    :class:`remat.MemoryTracker` does, gradients are left out from their allocation on:
    each gradient handed to a parameter's accumulation (seen by a hook on the parameter,
    which marks the moment in the profile: the allocation then live at its address), and
    the ``.grad`` storages alive at the end (accumulation copies a gradient whose strides
    differ from its parameter's, as inductor's channels-last convolution gradients do).
    """
    handed: list[int] = []

    def note(gradient: torch.Tensor) -> None:
        with record_function(f"{GRADIENT_MARK} {len(handed)}"):
            handed.append(gradient.untyped_storage().data_ptr())

    hooks = [parameter.register_hook(note) for parameter in strategy.module.parameters() if parameter.requires_grad]
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            workload.loss_fn(strategy.forward()).backward()
    finally:
        for hook in hooks:
            hook.remove()
    gradients = {p.grad.untyped_storage().data_ptr() for p in strategy.module.parameters() if p.grad is not None}
    for parameter in strategy.module.parameters():
        parameter.grad = None
    events, marks = profiled_events(profiler)
    last_at: dict[int, int] = {}  # address -> index of its latest allocation so far
    excluded = set()
    pending_marks = sorted((time_ns, handed[k]) for k, time_ns in marks.items())
    for index, (time_ns, address, size) in enumerate(events):
        while pending_marks and pending_marks[0][0] < time_ns:
            marked = last_at.get(pending_marks.pop(0)[1])
            if marked is not None:
                excluded.add(marked)
        if size > 0:
            last_at[address] = index
        else:
            last_at.pop(address, None)
    excluded |= {last_at[address] for _, address in pending_marks if address in last_at}
    excluded |= {index for address, index in last_at.items() if address in gradients}
    live: dict[int, int] = {}
    current = peak = 0
    for index, (_, address, size) in enumerate(events):
        if size > 0 and index not in excluded:
            live[address] = size
            current += size
            peak = max(peak, current)
        elif size < 0 and address in live:
            current -= live.pop(address)
    return peak


def measure_peaks(workload: Workload, strategy: Strategy) -> None:
    row = strategy.row
    row["allocator_peak_bytes"] = allocator_peak_bytes(workload, strategy)
    if row["family"] == REMAT_COMPILED:
        # the tracker sees the plan run eagerly (remat does not call compiled blocks under a
        # dispatch mode, which would make Dynamo skip them for good); the allocator, compiled
        row["tracker_peak_bytes"] = tracker_peak_bytes(workload, strategy)
        row["measured_peak_bytes"], row["peak_source"] = row["allocator_peak_bytes"], ALLOCATOR
    elif row["family"] in ("torch.compile", REMAT_GRAPH):
        # under a TorchDispatchMode the compiled module runs (and stays) eager: no tracker here
        row["tracker_peak_bytes"] = None
        row["measured_peak_bytes"], row["peak_source"] = row["allocator_peak_bytes"], ALLOCATOR
    else:
        row["tracker_peak_bytes"] = tracker_peak_bytes(workload, strategy)
        row["measured_peak_bytes"], row["peak_source"] = row["tracker_peak_bytes"], TRACKER


def time_rounds(workload: Workload, strategies: list[Strategy], rounds: int) -> None:
    """A warm-up step each, then ``rounds`` interleaved rounds, each starting one strategy later."""
    for strategy in strategies:
        train_step(workload, strategy)
    for round_index in range(rounds):
        shift = round_index % len(strategies)
        for strategy in strategies[shift:] + strategies[:shift]:
            started = time.perf_counter()
            train_step(workload, strategy)
            strategy.times.append(time.perf_counter() - started)
        print(f"round {round_index + 1}/{rounds} done", flush=True)


def compile_tracker_check(workload: Workload, strategy: Strategy) -> dict[str, Any]:
    """What the tracker sees of a compiled module, once every timing is done (it makes it eager)."""
    before = allocator_peak_bytes(workload, strategy)
    tracked = tracker_peak_bytes(workload, strategy)
    after = allocator_peak_bytes(workload, strategy)
    return {
        "budget": strategy.row["budget"],
        "allocator_peak_bytes_compiled": before,
        "tracker_peak_bytes": tracked,
        "allocator_peak_bytes_after_tracker": after,
    }


def dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


# ---------------------------------------------------------------------------- the run
def build_strategies(
    workload: Workload,
    fractions: list[float],
    *,
    nested: bool = False,
    with_compile: bool = True,
    compiled_blocks: bool = False,
    with_policy: bool = False,
    compiled_model: bool = False,
    elementwise: bool = False,
) -> tuple[list[Strategy], dict[str, Any]]:
    plain = Strategy(row_of("plain", PLAIN), functools.partial(workload.call, workload.model), workload.model)
    second = recompute_sequentially(workload)
    strategies = [plain, second, recompute_selectively(workload)]
    for strategy in strategies:
        train_step(workload, strategy)  # warm-up
        measure_peaks(workload, strategy)
    print(f"plain peak {format_bytes(plain.row['measured_peak_bytes'])}", flush=True)
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 256
    frames_before = dynamo_frames()
    for fraction in fractions if with_compile else []:
        strategy = compiled(workload, fraction)
        print(f"compiled at {fraction} in {strategy.row['compile_s']:.1f} s", flush=True)
        strategies.append(strategy)
    points: list[tuple[float | int | str, str]] = [(f, str(f)) for f in fractions]
    points += [("min", "min"), (second.row["measured_peak_bytes"], f"at {second.row['family']} peak")]
    families = ["remat"] + ([REMAT_NESTED] if nested else []) + ([REMAT_COMPILED] if compiled_blocks else [])
    families += [REMAT_POLICY] if with_policy else []
    families += [REMAT_GRAPH] if compiled_model else []
    families += [REMAT_ELEMENTWISE] if elementwise else []
    plain_bytes = plain.row["measured_peak_bytes"]
    for family in families:
        for budget, label in [(budget, f"{family} {text}") for budget, text in points]:
            of_plain = budget if family == REMAT_ELEMENTWISE and isinstance(budget, float) else None
            if of_plain is not None:
                budget = int(of_plain * plain_bytes)  # of the plain peak, not of its own step storing everything
            strategy = rematerialized(workload, budget, label, family=family)
            if of_plain is not None:
                strategy.row["budget"] = of_plain
            print(f"{label}: {'planned' if strategy.row['feasible'] else 'infeasible'}", flush=True)
            strategies.append(strategy)
    compile_info = {"frames_compiled": dynamo_frames() - frames_before}
    for strategy in strategies[3:]:
        if strategy.row["feasible"]:
            measure_peaks(workload, strategy)
    return strategies, compile_info


def summarize(strategies: list[Strategy]) -> list[dict[str, Any]]:
    plain = strategies[0].row
    plain_s = statistics.median(strategies[0].times)
    plain_peak = plain["measured_peak_bytes"]
    second = strategies[1].row
    own = next((s.row for s in strategies if s.row["family"] == "torch.compile" and s.row["budget"] == 1.0), None)
    for strategy in strategies:
        row = strategy.row
        if row.get("budget_bytes") is not None:
            row["budget_vs_plain"] = row["budget_bytes"] / plain_peak
        if row.get("minimum_bytes") is not None:
            row["minimum_vs_plain"] = row["minimum_bytes"] / plain_peak
        if not row["feasible"] or not strategy.times:
            continue
        row["step_s"] = strategy.times
        row["median_step_s"] = statistics.median(strategy.times)
        row["vs_plain"] = row["median_step_s"] / plain_s
        ruler = "allocator_peak_bytes" if row["peak_source"] == ALLOCATOR else "tracker_peak_bytes"
        row["peak_vs_plain"] = row["measured_peak_bytes"] / plain[ruler]
        row["allocator_peak_vs_plain"] = row["allocator_peak_bytes"] / plain["allocator_peak_bytes"]
        if row.get("predicted_peak_bytes"):
            row["prediction_error"] = (row["predicted_peak_bytes"] - row["measured_peak_bytes"]) / row[
                "measured_peak_bytes"
            ]
            row["over_budget"] = row["measured_peak_bytes"] > row["budget_bytes"]
        if row["family"] in REMAT_FAMILIES and " at " in row["strategy"]:
            row["vs_strategy_2"] = row["median_step_s"] / second["median_step_s"]
    add_time_check([strategy.row for strategy in strategies])
    if own is not None and own.get("median_step_s"):
        for row in (s.row for s in strategies if s.row["family"] == "torch.compile" and s.row.get("median_step_s")):
            row["vs_own_baseline"] = row["median_step_s"] / own["median_step_s"]
    return [strategy.row for strategy in strategies]


def add_time_check(rows: list[dict[str, Any]]) -> None:
    """The planner's predicted extra seconds per step beside the measured ones (remat rows).

    The prediction is the plan's recompute time (``predicted_overhead`` is a share of the
    chain's step time, ``predicted_time_s`` that step with the recompute); the measured
    extra time is the row's median step less plain's.
    """
    plain_s = rows[0].get("median_step_s")
    for row in rows:
        overhead = row.get("predicted_overhead")
        if overhead is None or not row.get("median_step_s") or not plain_s:
            continue
        row["predicted_extra_s"] = row["predicted_time_s"] * overhead / (1.0 + overhead)
        row["measured_extra_s"] = row["median_step_s"] - plain_s


# ---------------------------------------------------------------------------- targets
def verdict(value: float | None, limit: float | None) -> str:
    if value is None:
        return "n/a"
    if limit is None:
        return "no target"
    return "PASS" if value <= limit else "FAIL"


def remat_at(rows: list[dict[str, Any]], budget: Any, family: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["family"] == family and r["budget"] == budget and r.get("median_step_s")), None)


def targets(workload: str, rows: list[dict[str, Any]], family: str = "remat") -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    def add(key: str, text: str, value: float | None, limit: float | None, shown: str, limit_text: str = "") -> None:
        if limit is not None and not limit_text:
            limit_text = f"<= {percent(limit, signed=key in 'bc')}"
        found.append({"target": key, "text": text, "value": value, "limit": limit, "limit_text": limit_text})
        found[-1].update(shown=shown, verdict=verdict(value, limit))

    second = next((r for r in rows if r["family"] == family and " at " in r["strategy"]), None)
    ratio = second.get("vs_strategy_2") if second else None
    add(
        "a",
        "remat time / strategy 2's time, at strategy 2's peak",
        ratio,
        0.90,
        f"x{ratio:.3f}" if ratio else "n/a",
        "<= x0.90",
    )
    half = remat_at(rows, 0.5, family)
    overhead = half["vs_plain"] - 1 if half else None
    add("b", "remat overhead at 50% of plain", overhead, 0.10 if workload == "gpt2" else None, percent(overhead))
    whole = remat_at(rows, 1.0, family)
    overhead = whole["vs_plain"] - 1 if whole else None
    add("c", "remat overhead at 100% of plain", overhead, 0.01, percent(overhead))
    remat_rows = [r for r in rows if r["family"] == family and r.get("median_step_s")]
    compiled_rows = [r for r in rows if r["family"] == "torch.compile" and r.get("vs_own_baseline")]
    # both sides on the allocator's ruler: the one that sees compiled code
    for level in sorted({r["allocator_peak_bytes"] for r in compiled_rows}):
        point = min((r for r in compiled_rows if r["allocator_peak_bytes"] == level), key=lambda r: r["budget"])
        below = [r for r in remat_rows if r["allocator_peak_bytes"] <= level]
        nearest = max(below, key=lambda r: r["allocator_peak_bytes"]) if below else None
        compile_overhead = point["vs_own_baseline"] - 1
        text = (
            f"compile budget {point['budget']} at {100 * point['allocator_peak_vs_plain']:.1f}% of plain "
            f"(own overhead {percent(compile_overhead)}); remat's "
        )
        if nearest is None:
            add("d", text + "has no feasible point at or below it", None, None, "none")
            continue
        remat_overhead = nearest["vs_plain"] - 1
        share = percent(nearest["allocator_peak_vs_plain"], signed=False)
        text += f"nearest point at or below it is {nearest['strategy']!r} at {share}"
        add("d", text, remat_overhead, compile_overhead, percent(remat_overhead), "<= compile's own overhead")
    minimum = next((r for r in rows if r["family"] == family and r["budget"] == "min"), None)
    smallest = minimum.get("budget_vs_plain") if minimum else None
    limit = {"resnet": 0.30, "gpt2": 0.10}.get(workload)
    add("e", "smallest feasible remat budget, of plain", smallest, limit, percent(smallest, signed=False))
    errors = [abs(r["prediction_error"]) for r in remat_rows if r.get("prediction_error") is not None]
    worst = max(errors) if errors else None
    add("f", "max |prediction error| over remat points", worst, 0.05, percent(worst, signed=False))
    over = [r["strategy"] for r in remat_rows if r.get("over_budget")]
    add(
        "f",
        "remat points whose measured peak exceeded the budget",
        float(len(over)),
        0.0,
        ", ".join(over) or "none",
        "none",
    )
    return found


# ---------------------------------------------------------------------------- report
def percent(value: float | None, *, signed: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:+.1f}%" if signed else f"{100 * value:.1f}%"


def budget_text(row: dict[str, Any]) -> str:
    if row["budget"] is None:
        return ""
    if isinstance(row["budget"], int) and not isinstance(row["budget"], bool):
        return format_bytes(row["budget"])
    return str(row["budget"])


def table_row(row: dict[str, Any]) -> str:
    if not row["feasible"]:
        if "minimum_bytes" in row:
            minimum = f"{format_bytes(row['minimum_bytes'])} = {percent(row['minimum_vs_plain'], signed=False)}"
            reason = f"infeasible (minimum {minimum} of plain)"
        else:
            reason = f"failed: {row.get('error', '')[:120]}"
        return f"| {row['strategy']} | {budget_text(row)} | {reason} | | | | | | | | | |"
    predicted = format_bytes(row["predicted_peak_bytes"]) if row.get("predicted_peak_bytes") else ""
    error = percent(row.get("prediction_error")) if row.get("prediction_error") is not None else ""
    own = f"x{row['vs_own_baseline']:.3f}" if row.get("vs_own_baseline") else ""
    allocator = f"{format_bytes(row['allocator_peak_bytes'])} ({percent(row['allocator_peak_vs_plain'], signed=False)})"
    compile_s = f"{row['compile_s']:.1f}" if "compile_s" in row else ""
    if row.get("budget_bytes") is not None:
        budget = f"{budget_text(row)} ({percent(row['budget_vs_plain'], signed=False)})"
    else:
        budget = budget_text(row)
    extra = ""
    if "predicted_extra_s" in row:
        extra = f"{row['predicted_extra_s'] * 1e3:+.0f} / {row['measured_extra_s'] * 1e3:+.0f}"
    return (
        f"| {row['strategy']} | {budget} | {format_bytes(row['measured_peak_bytes'])} | "
        f"{percent(row['peak_vs_plain'], signed=False)} | {allocator} | {predicted} | {error} | "
        f"{row['median_step_s'] * 1e3:.1f} | x{row['vs_plain']:.3f} | {extra} | {own} | {compile_s} |"
    )


def markdown(result: dict[str, Any]) -> str:
    check = result["compile_tracker_check"]
    lines = [
        f"# planner: {result['workload']}",
        "",
        f"{result['description']}. torch {result['torch']}, CPU, {result['threads']} thread; median of "
        f"{result['steps']} interleaved rounds after a warm-up step each. Peaks: one training step, parameter "
        f"gradients excluded; measured with {TRACKER} except torch.compile rows ({ALLOCATOR}: the tracker's "
        "dispatch mode makes Dynamo skip the compiled frame). The allocator column is the same step measured "
        "from the CPU allocator's events, for every row (it also sees kernels' own workspaces); % of plain is "
        "on the row's own ruler, and (d) compares allocator peaks. Prediction error = (predicted - measured) / "
        "measured. Compile's own-baseline overhead is against torch.compile at budget 1.0; compile s is the first "
        "step's wall time (compile included, fresh inductor cache). Extra ms: the plan's predicted recompute "
        "time per step / the measured median step less plain's.",
        "",
        "| strategy | budget | measured peak | % of plain | allocator peak | predicted peak | prediction error "
        "| median step ms | vs plain | extra ms predicted / measured | compile vs own 1.0 | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [table_row(row) for row in result["rows"]]
    for key, title in (
        ("targets", "targets"),
        ("targets_nested", f"targets of {REMAT_NESTED}"),
        ("targets_policy", f"targets of {REMAT_POLICY}"),
        ("targets_elementwise", f"targets of {REMAT_ELEMENTWISE}"),
    ):
        if key not in result:
            continue
        lines += ["", f"## {title}", ""]
        for target in result[key]:
            shown_limit = f" (target {target['limit_text']})" if target["limit_text"] else ""
            line = f"- ({target['target']}) {target['text']}: {target['shown']}{shown_limit} -> {target['verdict']}"
            lines.append(line)
    if check:
        lines += [
            "",
            f"MemoryTracker on compiled code (budget {check['budget']}): allocator peak while compiled "
            f"{format_bytes(check['allocator_peak_bytes_compiled'])}; tracker "
            f"{format_bytes(check['tracker_peak_bytes'])}; allocator after the tracked step "
            f"{format_bytes(check['allocator_peak_bytes_after_tracker'])} (plain eager: "
            f"{format_bytes(result['rows'][0]['measured_peak_bytes'])}).",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    styles = {
        "plain": ("tab:gray", "s"),
        "checkpoint_sequential": ("tab:orange", "D"),
        "HF checkpointing": ("tab:orange", "D"),
        "torch selective": ("tab:green", "^"),
        "torch.compile": ("tab:red", "v"),
        "remat": ("tab:blue", "o"),
        REMAT_NESTED: ("tab:purple", "P"),
        REMAT_COMPILED: ("tab:cyan", "X"),
        REMAT_POLICY: ("tab:olive", "D"),
        REMAT_GRAPH: ("tab:brown", "*"),
    }
    rows = [r for r in result["rows"] if r.get("median_step_s")]
    for family, (colour, marker) in styles.items():
        # remat as its curve (by memory); compile's points in budget order, each labelled
        chosen = [r for r in rows if r["family"] == family]
        if not chosen:
            continue
        if family == "torch.compile":
            chosen.sort(key=lambda r: r["budget"])
        else:
            chosen.sort(key=lambda r: r["peak_vs_plain"])
        xs = [100 * r["peak_vs_plain"] for r in chosen]
        ys = [100 * (r["vs_plain"] - 1) for r in chosen]
        axes.plot(xs, ys, marker=marker, color=colour, label=family, linestyle="-" if len(xs) > 1 else "")
        if family == "torch.compile" and all("vs_own_baseline" in r for r in chosen):
            own = [100 * (r["vs_own_baseline"] - 1) for r in chosen]
            axes.plot(xs, own, marker=marker, color=colour, markerfacecolor="none", linestyle=":")
            axes.plot(
                [],
                [],
                marker=marker,
                color=colour,
                markerfacecolor="none",
                linestyle=":",
                label=f"{family} vs its own 1.0",
            )
        if family == "torch.compile":
            for row, x, y in zip(chosen, xs, ys, strict=True):
                axes.annotate(f"{row['budget']:g}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    axes.axhline(0, color="black", linewidth=0.5)
    axes.set_xlabel("measured peak, % of no recompute (torch.compile: allocator's figures)")
    axes.set_ylabel("step time overhead, % (vs eager no recompute)")
    axes.set_title(f"planner: {result['workload']} (CPU, {result['threads']} thread, torch {result['torch']})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(path: Path) -> None:
    """Writes the Markdown table of a result again from its JSON (the time check added)."""
    result = json.loads(path.read_text())
    add_time_check(result["rows"])
    path.write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--render", type=Path, default=None, metavar="RESULT.json", help="rewrite its table only")
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--nested", action="store_true", help="remat with nested=True too, in the same run")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile's points out")
    parser.add_argument(
        "--policy", action="store_true", help="remat storing stages under save_matmuls too, in the same run"
    )
    parser.add_argument("--elementwise", action="store_true", help="remat with elementwise=True too, in the same run")
    parser.add_argument(
        "--compiled-blocks", action="store_true", help="remat over blocks compiled one by one too, in the same run"
    )
    parser.add_argument(
        "--compiled-model", action="store_true", help="torch.compile of the remat model too (its plan in the graph)"
    )
    parser.add_argument(
        "--fractions", default=",".join(map(str, FRACTIONS)), help="comma-separated budgets for compile and remat"
    )
    options = parser.parse_args()
    if options.render is not None:
        render(options.render)
        return
    if options.workload is None:
        parser.error("--workload is required (or --render)")
    fractions = [float(text) for text in options.fractions.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="planner_inductor_", ignore_cleanup_errors=True) as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        workload = WORKLOADS[options.workload]()
        strategies, compile_info = build_strategies(
            workload,
            fractions,
            nested=options.nested,
            with_compile=not options.no_compile,
            compiled_blocks=options.compiled_blocks,
            with_policy=options.policy,
            compiled_model=options.compiled_model,
            elementwise=options.elementwise,
        )
        timed = [s for s in strategies if s.row["feasible"]]
        frames_before = dynamo_frames()
        time_rounds(workload, timed, options.steps)
        compile_info["frames_compiled_while_timing"] = dynamo_frames() - frames_before
        rows = summarize(strategies)
        compiled_ok = [s for s in timed if s.row["family"] == "torch.compile"]
        check = compile_tracker_check(workload, min(compiled_ok, key=lambda s: s.row["budget"])) if compiled_ok else {}
    result = {
        "workload": workload.name,
        "description": workload.description,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "steps": options.steps,
        "fractions": fractions,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "plain_peak_bytes": rows[0]["measured_peak_bytes"],
        "compile": compile_info,
        "compile_tracker_check": check,
        "rows": rows,
    }
    result["targets"] = targets(workload.name, rows)
    if options.nested:
        result["targets_nested"] = targets(workload.name, rows, REMAT_NESTED)
    if options.policy:
        result["targets_policy"] = targets(workload.name, rows, REMAT_POLICY)
    if options.elementwise:
        result["targets_elementwise"] = targets(workload.name, rows, REMAT_ELEMENTWISE)
    RESULTS.mkdir(exist_ok=True)
    name = workload.name + ("_nested" if options.nested else "") + ("_compiled" if options.compiled_blocks else "")
    name += "_policy" if options.policy else ""
    name += "_elementwise" if options.elementwise else ""
    name += "_graph" if options.compiled_model else ""
    stem = RESULTS / f"planner_{name}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    plot(result, DOCS / f"planner_{name}.png")
    print(text)


if __name__ == "__main__":
    main()
