"""Side-by-side benchmark of recompute strategies: exact peak memory and step time.

:func:`run_benchmark` trains a chain model for a few steps on one synthetic batch with
each strategy in turn:

* ``"no recompute"``: the plain model, every activation stored;
* ``"checkpoint_sequential sqrt(n)"``: torch's
  :func:`torch.utils.checkpoint.checkpoint_sequential` with ``ceil(sqrt(n))`` segments
  over the flattened chain (``use_reentrant=False``), the usual baseline;
* ``"remat @ <budget>"``: :class:`remat.Checkpointable` with the optimal
  schedule under each budget (``"min"`` is the smallest feasible budget), and
  ``"remat @ ckpt-seq memory"``, a budget equal to the peak that checkpoint_sequential
  measured: what remat does with the same memory.

Every strategy starts from the same weights and buffers and sees the same batch. A *step*
is a forward, the loss and the backward; the weights are not updated, so every step of
every strategy computes the same thing. For each strategy the benchmark records the peak
activation memory of one step, measured exactly by :class:`remat.memory.MemoryTracker`
(parameter gradients excluded), and the median wall time of ``steps`` timed steps. Remat
rows also carry the planner's predicted peak and predicted overhead, and whether the
measured peak fits the budget.

The run has two phases. First each strategy in turn runs ``warmup`` untimed steps and one
tracked step (the tracker slows a step down, so it is never timed). Then come ``steps``
timed rounds, each running one step of every strategy: a change in the machine's load
during the run (another process starting) shifts every strategy alike, instead of
penalising the ones that happened to run at that moment.

Usage::

    from functools import partial
    from remat.bench import run_benchmark
    from remat.models import CATALOGUE

    spec = CATALOGUE["resnet_small"]
    result = run_benchmark(spec.factory, partial(spec.make_batch, 16), spec.loss_fn)
    print(result.to_markdown())
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint_sequential

from remat.automatic import Checkpointable
from remat.bench.data_parallel import DataParallelSteps
from remat.bench.result import (
    BASELINE,
    CHECKPOINT_SEQUENTIAL,
    CKPT_SEQ_BUDGET,
    MIN_BUDGET,
    BenchmarkResult,
    BenchmarkRow,
    StepTimeline,
)
from remat.budget import MINIMUM
from remat.discover.chain import sequential_chain
from remat.errors import BudgetTooSmall, RematError
from remat.memory import MemoryTracker
from remat.plan.step import Plan
from remat.ranks import agreement_group_active
from remat.units import format_bytes

__all__ = ["call_with", "input_tensors", "run_benchmark"]

logger = logging.getLogger("remat")

Budget = int | float | str
Batch = tuple[tuple[Any, ...], Any]
LossFn = Callable[[Any, Any], Tensor]
Progress = Callable[[int, int, str], None]


# ---------------------------------------------------------------------- running
@dataclass
class _Strategy:
    """A strategy to time: its row, how to run its forward, and the remat plan it runs, if any."""

    row: BenchmarkRow
    forward: Callable[..., Any]
    plan: tuple[Checkpointable, Plan] | None = None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Where the strategy's steps run: within its plan, for remat."""
        if self.plan is None:
            return contextlib.nullcontext()
        wrapper, plan = self.plan
        return wrapper.executing(plan)


def call_with(function: Callable[..., Any], inputs: Any) -> Any:
    """``function(**inputs)`` for a dict of keyword inputs, else ``function(*inputs)``."""
    return function(**inputs) if isinstance(inputs, Mapping) else function(*inputs)


def input_tensors(inputs: Any) -> list[Tensor]:
    """The tensors among positional or keyword inputs, in order."""
    return [leaf for leaf in tree_flatten(inputs)[0] if isinstance(leaf, Tensor)]


class _Runner:
    """Runs training steps on the shared batch; the model is reset to the saved state."""

    def __init__(
        self,
        model: nn.Module,
        state: dict[str, Tensor],
        batch: Batch,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        self.model = model
        self.state = state
        self.inputs, self.target = batch
        self.loss_fn = loss_fn
        self.device = device

    def reset(self) -> None:
        self.model.load_state_dict(self.state)
        self.model.train()
        for parameter in self.model.parameters():
            parameter.grad = None

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, forward: Callable[..., Any]) -> None:
        """One step: forward, the loss (the output dropped once it is computed), backward."""
        loss = self.loss_fn(call_with(forward, self.inputs), self.target)
        loss.backward()
        del loss
        for parameter in self.model.parameters():
            parameter.grad = None

    def tracked_step(self, forward: Callable[..., Any]) -> tuple[int, list[int]]:
        """One step under a MemoryTracker: (peak bytes, live bytes after each event)."""
        tracker = MemoryTracker(exclude_grads_of=list(self.model.parameters()), device=self.device.type)
        with tracker:
            self.step(forward)
        return tracker.peak_bytes, tracker.timeline()

    def timed_step(self, forward: Callable[..., Any]) -> float:
        """Seconds of one step."""
        self._synchronize()
        start = time.perf_counter()
        self.step(forward)
        self._synchronize()
        return time.perf_counter() - start


def run_benchmark(
    model_factory_or_model: Callable[[], nn.Module] | nn.Module,
    make_batch: Callable[[], Batch],
    loss_fn: LossFn,
    *,
    budgets: Sequence[Budget] = (1.0, 0.5, 0.25, MIN_BUDGET),
    steps: int = 5,
    warmup: int = 1,
    include_checkpoint_sequential: bool = True,
    threads: int | None = None,
    progress: Progress | None = None,
    solver: str = "optimal",
    device: str | torch.device | None = None,
    model_name: str | None = None,
    nested: bool = False,
    policies: Sequence[Any] = (),
    distributed: bool = False,
    elementwise: bool = False,
) -> BenchmarkResult:
    """Measures peak memory and step time of no recompute, checkpoint_sequential and remat.

    Args:
        model_factory_or_model: a model (an ``nn.Sequential``, or any model remat finds a
            chain in), or a zero-argument function that returns one. It is built (or taken)
            once; its weights and buffers are saved and restored before every strategy, so
            all strategies start from the same state.
        make_batch: a zero-argument function returning ``(inputs, target)``: a tuple of
            inputs for ``model(*inputs)`` (or a dict of keyword inputs, ``model(**inputs)``)
            and whatever ``loss_fn`` takes as a target. It is called once; every strategy
            trains on that batch.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        budgets: remat budgets, in any form ``mem_limit`` accepts (bytes, ``"512MiB"``, a
            fraction of the memory without recompute), or ``"min"`` for the smallest
            feasible budget. A budget below the minimum gives a row with an ``error``.
        steps: timed steps per strategy (the median is reported), run in interleaved rounds.
        warmup: untimed steps per strategy before its tracked step.
        include_checkpoint_sequential: also run torch's ``checkpoint_sequential`` with
            ``ceil(sqrt(n))`` segments, and remat with the memory it measured (only for an
            ``nn.Sequential`` with one input; skipped with a warning otherwise).
        threads: pin ``torch.set_num_threads`` to this for the run (restored afterwards).
        progress: called as ``progress(done, total, label)`` before each strategy is
            prepared and before each timed round, and once at the end (``done == total``).
        solver: the remat solver (see :func:`remat.plan.solvers.available_solvers`).
        device: where to run; default: the device of the model's parameters.
        model_name: a name for the metadata and tables.
        nested: remat with ``nested=True`` (blocks split into their submodules).
        policies: policies remat may store stages under (``policy=`` with the budget).
        elementwise: remat with ``elementwise=True`` (stored stages leave cheap elementwise
            saves to backward).
        distributed: train every strategy through DistributedDataParallel, each remat budget
            planned on all ranks at once (NOTE [the benchmark on several ranks] in
            :mod:`remat.bench.data_parallel`): every rank of the initialised process group
            must call this (``remat bench`` under ``torchrun`` does).

    Returns:
        The rows, the timelines of "no recompute" and of the chosen remat strategy, and
        metadata.

    Raises:
        TypeError: the model is not an ``nn.Module``.
        ValueError: ``steps`` is below 1 or ``warmup`` below 0.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    model = model_factory_or_model if isinstance(model_factory_or_model, nn.Module) else model_factory_or_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"run_benchmark needs an nn.Module, got {type(model).__name__}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        benchmark = _Benchmark(model, make_batch, loss_fn, steps=steps, warmup=warmup, progress=progress, device=device)
        if distributed:
            if not agreement_group_active():
                raise ValueError("distributed=True needs an initialised process group of more than one rank")
            benchmark.ranks = DataParallelSteps(model, benchmark.device)
        benchmark.nested, benchmark.elementwise = nested, elementwise
        benchmark.policies = list(policies)
        return benchmark.run(
            list(budgets),
            include_checkpoint_sequential=include_checkpoint_sequential,
            solver=solver,
            model_name=model_name,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _budget_label(budget: Budget) -> str:
    return budget.strip() if isinstance(budget, str) else repr(budget)


class _Benchmark:
    """One benchmark run: phase 1 prepares every strategy (warm-up, tracked step), phase 2 times them."""

    def __init__(
        self,
        model: nn.Module,
        make_batch: Callable[[], Batch],
        loss_fn: LossFn,
        *,
        steps: int,
        warmup: int,
        progress: Progress | None,
        device: str | torch.device | None,
    ) -> None:
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        model.to(self.device)
        self.model = model
        self.loss_fn = loss_fn
        self.runner = _Runner(model, copy.deepcopy(model.state_dict()), make_batch(), loss_fn, self.device)
        self.steps = steps
        self.warmup = warmup
        self.nested = False  # remat's nested=True
        self.elementwise = False  # remat's elementwise=True
        self.policies: list[Any] = []  # remat's policy= with the budget
        self.progress = progress
        self.rows: list[BenchmarkRow] = []
        self.strategies: list[_Strategy] = []
        self.timelines: dict[str, StepTimeline] = {}
        self.done = 0
        self.total = 0
        self.ranks: DataParallelSteps | None = None  # under torchrun

    def forward_of(self, strategy: _Strategy) -> Callable[..., Any]:
        return strategy.forward if self.ranks is None else self.ranks.forward(strategy.forward)

    def advance(self, label: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, label)
        self.done += 1

    def prepare(self, strategy: _Strategy, budget_bytes: int | None = None) -> None:
        """Warm-up steps, then one tracked step for the peak and the timeline."""
        self.runner.reset()
        forward = self.forward_of(strategy)
        with strategy.context():
            for _ in range(self.warmup):
                self.runner.step(forward)
            peak, timeline = self.runner.tracked_step(forward)
        strategy.row.measured_peak_bytes = peak if self.ranks is None else int(self.ranks.largest(peak))
        self.timelines[strategy.row.strategy] = StepTimeline(strategy.row.strategy, timeline, budget_bytes)
        self.strategies.append(strategy)

    def new_row(self, row: BenchmarkRow) -> BenchmarkRow:
        self.advance(row.strategy)
        self.rows.append(row)
        return row

    # -- the strategies
    def run(
        self, budgets: list[Budget], *, include_checkpoint_sequential: bool, solver: str, model_name: str | None
    ) -> BenchmarkResult:
        stages = sequential_chain(self.model).modules if isinstance(self.model, nn.Sequential) else []
        # checkpoint_sequential runs the stages itself: only an nn.Sequential with one input.
        inputs = self.runner.inputs
        one_input = isinstance(inputs, tuple) and len(inputs) == 1
        can_checkpoint = include_checkpoint_sequential and one_input and bool(stages)
        if include_checkpoint_sequential and not can_checkpoint:
            logger.warning("checkpoint_sequential needs an nn.Sequential with a single input; skipping that baseline")
        self.total = 1 + (2 if can_checkpoint else 0) + len(budgets) + self.steps
        baseline = _Strategy(self.new_row(BenchmarkRow(BASELINE, "baseline")), self.model)
        if self.ranks is not None:  # DDP makes its buckets, and rebuilds them after its first step
            self.runner.reset()
            for _ in range(2):
                self.runner.step(self.forward_of(baseline))
        self.prepare(baseline)
        checkpoint_peak = self.run_checkpoint_sequential(stages) if can_checkpoint else None
        remat_budgets: list[tuple[str, Budget]] = [(_budget_label(budget), budget) for budget in budgets]
        if checkpoint_peak is not None:
            remat_budgets.append((CKPT_SEQ_BUDGET, checkpoint_peak))
        wrapper = self.measured_wrapper(solver)
        for label, budget in remat_budgets:
            self.run_remat(wrapper, label, budget)
        self.timed_rounds(baseline)
        return self.result(wrapper, stages, solver, model_name)

    def run_checkpoint_sequential(self, stages: list[nn.Module]) -> int | None:
        segments = max(1, math.ceil(math.sqrt(len(stages))))

        def checkpointed(x: Tensor) -> Tensor:
            return checkpoint_sequential(stages, segments, x, use_reentrant=False)

        row = self.new_row(BenchmarkRow(CHECKPOINT_SEQUENTIAL, "checkpoint_sequential", segments=segments))
        strategy = _Strategy(row, checkpointed)
        try:
            self.prepare(strategy)
        except RuntimeError as error:
            # e.g. an in-place operation at a segment boundary, which torch rejects
            row.error = f"failed: {str(error).splitlines()[0]}"
            if strategy in self.strategies:
                self.strategies.remove(strategy)
            self.timelines.pop(row.strategy, None)
            return None
        return row.measured_peak_bytes

    def measured_wrapper(self, solver: str) -> Checkpointable:
        """remat, measured once and then planned for every budget."""
        self.runner.reset()
        target = self.runner.target
        # The benchmark's steps drop the output once the loss is computed (output_kept=False).
        # (a budget makes the policies store options; each budget is planned with plan_for)
        wrapper = Checkpointable(
            self.model,
            1.0 if self.policies else None,
            solver=solver,
            loss_fn=lambda output: self.loss_fn(output, target),
            output_kept=False,
            nested=self.nested,
            policy=self.policies or None,
            elementwise=self.elementwise,
        )
        self.measurement = call_with(wrapper.measure, self.runner.inputs)
        return wrapper

    def run_remat(self, wrapper: Checkpointable, label: str, budget: Budget) -> None:
        row = self.new_row(BenchmarkRow(f"remat @ {label}", "remat", budget=label))
        try:
            agreed = {"all_ranks": True} if self.ranks is not None else {}  # a collective call on ranks
            plan = wrapper.plan_for(MINIMUM if _is_minimum(budget) else budget, **agreed)
        except BudgetTooSmall as error:
            row.budget_bytes = error.budget_bytes
            row.error = f"infeasible: the minimum is {format_bytes(error.minimum_bytes)} ({error.minimum_bytes} bytes)"
            return
        except RematError as error:
            # One budget that cannot be planned must not cost the whole benchmark.
            logger.warning("remat could not plan %s: %s", row.strategy, error)
            row.error = f"planning failed: {error}"
            return
        row.budget_bytes = plan.budget_bytes
        row.predicted_peak_bytes = plan.predicted_peak_bytes
        row.predicted_overhead_ratio = 1.0 + plan.overhead_fraction
        row.recomputed_forwards = sum(count - 1 for count in plan.forward_counts)
        if self.ranks is not None and not self.ranks.check_same_plan(plan):
            row.error = "the ranks planned different schedules"
            return
        self.prepare(_Strategy(row, wrapper, plan=(wrapper, plan)), plan.budget_bytes)
        row.fits_budget = (
            plan.budget_bytes is not None
            and row.measured_peak_bytes is not None
            and row.measured_peak_bytes <= plan.budget_bytes
        )

    def timed_rounds(self, baseline: _Strategy) -> None:
        """Phase 2: each round runs one step of every strategy, so a change in the machine's
        load during the run affects every strategy alike."""
        for round_index in range(self.steps):
            self.advance(f"timed round {round_index + 1}/{self.steps}")
            for strategy in self.strategies:
                with strategy.context():
                    seconds = self.runner.timed_step(self.forward_of(strategy))
                strategy.row.step_times_s.append(seconds if self.ranks is None else self.ranks.largest(seconds))
        if self.progress is not None:
            self.progress(self.total, self.total, "done")
        baseline_median = statistics.median(baseline.row.step_times_s)
        for strategy in self.strategies:
            row = strategy.row
            row.median_step_s = statistics.median(row.step_times_s)
            row.overhead_ratio = row.median_step_s / baseline_median if baseline_median > 0 else None

    def result(
        self, wrapper: Checkpointable, stages: list[nn.Module], solver: str, model_name: str | None
    ) -> BenchmarkResult:
        ran = [r for r in self.rows if r.kind == "remat" and r.ran and r.budget_bytes is not None]
        chosen = min(ran, key=lambda r: (r.budget_bytes, r.strategy)).strategy if ran else None
        timelines = {name: t for name, t in self.timelines.items() if name in (BASELINE, chosen)}
        metadata: dict[str, Any] = {
            "model": model_name or type(self.model).__name__,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "n_stages": len(stages) or len(self.measurement.stages),
            "n_planned_stages": self.measurement.profile.n_stages,
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "steps": self.steps,
            "warmup": self.warmup,
            "solver": solver,
            "nested": self.nested,
            "elementwise": self.elementwise,
            "policies": [repr(policy).removeprefix("remat.policies.") for policy in self.policies],
            "input_shapes": [list(x.shape) for x in input_tensors(self.runner.inputs)],
            "torch": torch.__version__,
            "python": platform.python_version(),
            **(self.ranks.metadata() if self.ranks is not None else {}),
        }
        self.runner.reset()
        return BenchmarkResult(self.rows, timelines, chosen, metadata)


def _is_minimum(budget: Budget | None) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == MIN_BUDGET
