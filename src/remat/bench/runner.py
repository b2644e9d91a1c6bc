"""Side-by-side benchmark of recompute strategies: exact peak memory and step time.

:func:`run_benchmark` trains a chain model for a few steps on one synthetic batch with
each strategy in turn:

* ``"no recompute"``: the plain model, every activation stored;
* ``"checkpoint_sequential sqrt(n)"``: torch's
  :func:`torch.utils.checkpoint.checkpoint_sequential` with ``ceil(sqrt(n))`` segments
  over the flattened chain (``use_reentrant=False``), the usual baseline;
* ``"remat @ <budget>"``: :class:`remat.checkpointable.Checkpointable` with the optimal
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
    from remat.bench.runner import run_benchmark
    from remat.models import CATALOGUE

    spec = CATALOGUE["resnet_small"]
    result = run_benchmark(spec.factory, partial(spec.make_batch, 16), spec.loss_fn)
    print(result.to_markdown())
"""

from __future__ import annotations

import copy
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint_sequential

from remat.discover.chain import sequential_chain
from remat.automatic import Checkpointable
from remat.errors import BudgetTooSmall, RematError
from remat.memory import MemoryTracker, format_bytes

__all__ = [
    "BASELINE",
    "CHECKPOINT_SEQUENTIAL",
    "CKPT_SEQ_BUDGET",
    "MIN_BUDGET",
    "BenchmarkResult",
    "BenchmarkRow",
    "StepTimeline",
    "format_row",
    "run_benchmark",
    "save_plot",
]

logger = logging.getLogger("remat")

BASELINE = "no recompute"
"""Label of the strategy without recompute."""

CHECKPOINT_SEQUENTIAL = "checkpoint_sequential sqrt(n)"
"""Label of torch's ``checkpoint_sequential`` baseline."""

CKPT_SEQ_BUDGET = "ckpt-seq memory"
"""Budget label meaning: the peak that ``checkpoint_sequential`` measured."""

MIN_BUDGET = "min"
"""Budget label meaning: the smallest budget any schedule fits."""

_MIB = 1024 * 1024

Budget = int | float | str
Batch = tuple[tuple[Any, ...], Any]
LossFn = Callable[[Any, Any], Tensor]
Progress = Callable[[int, int, str], None]


@dataclass
class BenchmarkRow:
    """What one strategy measured.

    Attributes:
        strategy: the label (``"no recompute"``, ``"remat @ 0.5"``, ...).
        kind: ``"baseline"``, ``"checkpoint_sequential"`` or ``"remat"``.
        budget: the budget as it was asked for (``"0.5"``, ``"min"``, ``"ckpt-seq memory"``);
            None for the strategies without a budget.
        budget_bytes: the budget in bytes (remat rows).
        measured_peak_bytes: exact peak activation memory of one step.
        predicted_peak_bytes: the planner's predicted peak of a step (remat rows).
        fits_budget: whether ``measured_peak_bytes <= budget_bytes`` (remat rows).
        median_step_s: median wall time of the timed steps, in seconds.
        step_times_s: wall time of every timed step, in seconds.
        overhead_ratio: ``median_step_s`` over the median of "no recompute" in the same run
            (1.25 = 25% slower).
        predicted_overhead_ratio: the planner's predicted step time over no recompute's
            (remat rows).
        recomputed_forwards: stage forwards run more than once per step (remat rows: from the
            plan, in planned stages).
        segments: the number of checkpoint_sequential segments.
        error: why the strategy did not run (e.g. a budget below the minimum); the figures
            are None then.
    """

    strategy: str
    kind: str
    budget: str | None = None
    budget_bytes: int | None = None
    measured_peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    fits_budget: bool | None = None
    median_step_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    overhead_ratio: float | None = None
    predicted_overhead_ratio: float | None = None
    recomputed_forwards: int | None = None
    segments: int | None = None
    error: str | None = None

    @property
    def ran(self) -> bool:
        """Whether the strategy ran (it has figures)."""
        return self.error is None and self.measured_peak_bytes is not None


@dataclass
class StepTimeline:
    """Live activation bytes after each allocation or free event of one tracked step.

    Attributes:
        strategy: the strategy the step ran.
        live_bytes: live bytes after each event (parameter gradients excluded).
        budget_bytes: the strategy's budget, if it has one.
    """

    strategy: str
    live_bytes: list[int]
    budget_bytes: int | None = None


@dataclass
class BenchmarkResult:
    """Rows of a benchmark, the memory timelines of one step, and how it was run.

    Attributes:
        rows: one row per strategy, in the order they ran.
        timelines: the step timeline of "no recompute" and of the chosen remat strategy
            (see ``chosen_strategy``), by strategy label.
        chosen_strategy: the remat strategy with the tightest budget that ran, or None.
        metadata: model, device, threads, steps and versions.
    """

    rows: list[BenchmarkRow]
    timelines: dict[str, StepTimeline]
    chosen_strategy: str | None
    metadata: dict[str, Any]

    def row(self, strategy: str) -> BenchmarkRow:
        """The row of a strategy, by label.

        Raises:
            KeyError: no strategy has that label.
        """
        for row in self.rows:
            if row.strategy == strategy:
                return row
        raise KeyError(f"no strategy {strategy!r}; the strategies are {[r.strategy for r in self.rows]}")

    @property
    def timeline(self) -> StepTimeline | None:
        """The step timeline of the chosen remat strategy, if one ran."""
        if self.chosen_strategy is None:
            return None
        return self.timelines.get(self.chosen_strategy)

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-able dict."""
        return {
            "format": "remat.benchmark",
            "version": 1,
            "metadata": dict(self.metadata),
            "rows": [asdict(row) for row in self.rows],
            "chosen_strategy": self.chosen_strategy,
            "timelines": {name: asdict(timeline) for name, timeline in self.timelines.items()},
        }

    def to_json(self, *, indent: int | None = 2) -> str:
        """The result as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def to_markdown(self) -> str:
        """The rows as a Markdown table, with a line saying what was run."""
        header = (
            "| strategy | budget | measured peak | predicted peak | fits budget "
            "| median step | overhead | predicted overhead |"
        )
        lines = [header, "|" + "---|" * 2 + "---:|" * 2 + ":---:|" + "---:|" * 3]
        for row in self.rows:
            cells = format_row(row)
            lines.append("| " + " | ".join(cells[key] for key in _COLUMNS) + " |")
        meta = self.metadata
        lines.append("")
        for row in self.rows:
            if row.error is not None:
                lines.append(f"{row.strategy}: {row.error}.  ")
        lines.append(
            f"{meta.get('model', 'model')}: {meta.get('n_stages', '?')} stages "
            f"({meta.get('n_planned_stages', '?')} planned), device {meta.get('device', '?')}, "
            f"{_threads(meta)}, median of {meta.get('steps', '?')} steps after "
            f"{meta.get('warmup', '?')} warm-up, timed in interleaved rounds; peaks measured "
            "exactly (live activation bytes of one step, parameter gradients excluded)."
        )
        return "\n".join(lines) + "\n"


_COLUMNS = (
    "strategy",
    "budget",
    "measured_peak",
    "predicted_peak",
    "fits",
    "median_step",
    "overhead",
    "predicted_overhead",
)


def _threads(metadata: dict[str, Any]) -> str:
    threads = metadata.get("threads", "?")
    return f"{threads} thread" + ("" if threads == 1 else "s")


def format_row(row: BenchmarkRow) -> dict[str, str]:
    """The cells of a row as text, for tables (keys: the column names of the tables).

    Args:
        row: the row.

    Returns:
        Text for ``strategy``, ``budget``, ``measured_peak``, ``predicted_peak``, ``fits``,
        ``median_step``, ``overhead`` and ``predicted_overhead``.
    """
    dash = "-"

    def mib(value: int | None) -> str:
        return dash if value is None else format_bytes(value)

    def ratio(value: float | None) -> str:
        return dash if value is None else f"x{value:.2f}"

    budget = dash
    if row.budget_bytes is not None:
        budget = mib(row.budget_bytes)
        if row.budget is not None and row.budget not in (MIN_BUDGET, CKPT_SEQ_BUDGET):
            budget = f"{row.budget} ({budget})"
    elif row.budget is not None:
        budget = row.budget
    if row.error is not None:
        return {
            "strategy": row.strategy,
            "budget": budget,
            "measured_peak": dash,
            "predicted_peak": dash,
            "fits": "infeasible",
            "median_step": dash,
            "overhead": dash,
            "predicted_overhead": dash,
        }
    fits = dash if row.fits_budget is None else ("yes" if row.fits_budget else "NO")
    median = dash if row.median_step_s is None else f"{row.median_step_s * 1000:.1f} ms"
    return {
        "strategy": row.strategy,
        "budget": budget,
        "measured_peak": mib(row.measured_peak_bytes),
        "predicted_peak": mib(row.predicted_peak_bytes),
        "fits": fits,
        "median_step": median,
        "overhead": ratio(row.overhead_ratio),
        "predicted_overhead": ratio(row.predicted_overhead_ratio),
    }


# ---------------------------------------------------------------------- running
@dataclass
class _Strategy:
    """A strategy to time: its row, and how to run its forward."""

    row: BenchmarkRow
    forward: Callable[..., Any]
    prepare: Callable[[], None] = lambda: None


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
        loss = self.loss_fn(forward(*self.inputs), self.target)
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


def _budget_label(budget: Budget) -> str:
    return budget.strip() if isinstance(budget, str) else repr(budget)


def _is_min(budget: Budget | None) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == MIN_BUDGET


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
) -> BenchmarkResult:
    """Measures peak memory and step time of no recompute, checkpoint_sequential and remat.

    Args:
        model_factory_or_model: a model (an ``nn.Sequential``, or any model remat finds a
            chain in), or a zero-argument function that returns one. It is built (or taken) once; its weights and buffers are saved and
            restored before every strategy, so all strategies start from the same state.
        make_batch: a zero-argument function returning ``(inputs, target)``: a tuple of
            inputs for ``model(*inputs)`` and whatever ``loss_fn`` takes as a target. It is
            called once; every strategy trains on that batch.
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
        return _run(
            model,
            make_batch,
            loss_fn,
            budgets=list(budgets),
            steps=steps,
            warmup=warmup,
            include_checkpoint_sequential=include_checkpoint_sequential,
            progress=progress,
            solver=solver,
            device=device,
            model_name=model_name,
        )
    finally:
        torch.set_num_threads(previous_threads)


def _run(
    model: nn.Module,
    make_batch: Callable[[], Batch],
    loss_fn: LossFn,
    *,
    budgets: list[Budget],
    steps: int,
    warmup: int,
    include_checkpoint_sequential: bool,
    progress: Progress | None,
    solver: str,
    device: str | torch.device | None,
    model_name: str | None,
) -> BenchmarkResult:
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    model.to(device)
    state = copy.deepcopy(model.state_dict())
    batch = make_batch()
    runner = _Runner(model, state, batch, loss_fn, device)
    # checkpoint_sequential runs the stages itself: only an nn.Sequential with one input.
    stages = sequential_chain(model).modules if isinstance(model, nn.Sequential) else []
    inputs = batch[0]
    can_checkpoint = include_checkpoint_sequential and len(inputs) == 1 and bool(stages)
    if include_checkpoint_sequential and not can_checkpoint:
        logger.warning(
            "checkpoint_sequential needs an nn.Sequential with a single input; skipping that baseline"
        )

    n_strategies = 1 + (2 if can_checkpoint else 0) + len(budgets)
    total = n_strategies + steps
    done = 0

    def advance(label: str) -> None:
        nonlocal done
        if progress is not None:
            progress(done, total, label)
        done += 1

    rows: list[BenchmarkRow] = []
    strategies: list[_Strategy] = []
    timelines: dict[str, StepTimeline] = {}

    def prepare(strategy: _Strategy, budget_bytes: int | None = None) -> None:
        """Warm-up steps, then one tracked step for the peak and the timeline."""
        runner.reset()
        strategy.prepare()
        for _ in range(warmup):
            runner.step(strategy.forward)
        peak, timeline = runner.tracked_step(strategy.forward)
        strategy.row.measured_peak_bytes = peak
        timelines[strategy.row.strategy] = StepTimeline(strategy.row.strategy, timeline, budget_bytes)
        strategies.append(strategy)

    # Phase 1: every strategy is warmed up and its peak measured, one after the other.
    advance(BASELINE)
    baseline = _Strategy(BenchmarkRow(BASELINE, "baseline"), model)
    rows.append(baseline.row)
    prepare(baseline)

    checkpoint_peak: int | None = None
    if can_checkpoint:
        segments = max(1, math.ceil(math.sqrt(len(stages))))
        advance(CHECKPOINT_SEQUENTIAL)

        def checkpointed(x: Tensor) -> Tensor:
            return checkpoint_sequential(stages, segments, x, use_reentrant=False)

        strategy = _Strategy(
            BenchmarkRow(CHECKPOINT_SEQUENTIAL, "checkpoint_sequential", segments=segments), checkpointed
        )
        rows.append(strategy.row)
        try:
            prepare(strategy)
            checkpoint_peak = strategy.row.measured_peak_bytes
        except RuntimeError as error:
            # e.g. an in-place operation at a segment boundary, which torch rejects
            strategy.row.error = f"failed: {str(error).splitlines()[0]}"
            strategies.remove(strategy) if strategy in strategies else None
            timelines.pop(strategy.row.strategy, None)

    # remat is measured once and planned for every budget.
    runner.reset()
    target = runner.target
    # The benchmark's steps drop the output once the loss is computed (output_kept=False).
    wrapper = Checkpointable(
        model,
        None,
        solver=solver,
        loss_fn=lambda output: loss_fn(output, target),
        output_kept=False,
    )
    measurement = wrapper.measure(*inputs)
    remat_budgets: list[tuple[str, Budget | None]] = [(_budget_label(b), b) for b in budgets]
    if can_checkpoint and checkpoint_peak is not None:
        remat_budgets.append((CKPT_SEQ_BUDGET, checkpoint_peak))
    for label, budget in remat_budgets:
        name = f"remat @ {label}"
        advance(name)
        row = BenchmarkRow(name, "remat", budget=label)
        rows.append(row)
        try:
            if _is_min(budget):
                budget = _minimum_budget(wrapper)
            assert budget is not None
            planned = wrapper.compute_sequence(budget)
        except BudgetTooSmall as error:
            row.budget_bytes = error.budget_bytes
            row.error = (
                f"infeasible: the minimum is {format_bytes(error.minimum_bytes)} "
                f"({error.minimum_bytes} bytes)"
            )
            continue
        except RematError as error:
            # One budget that cannot be planned must not cost the whole benchmark.
            logger.warning("remat could not plan %s: %s", name, error)
            row.error = f"planning failed: {error}"
            continue
        row.budget_bytes = planned.budget_bytes
        row.predicted_peak_bytes = planned.predicted_peak_bytes
        row.predicted_overhead_ratio = 1.0 + planned.overhead
        row.recomputed_forwards = sum(count - 1 for count in planned.forward_counts)
        plan_budget = budget

        def use_plan(budget: Budget = plan_budget) -> None:
            wrapper.mem_limit = budget

        prepare(_Strategy(row, wrapper, use_plan), planned.budget_bytes)
        row.fits_budget = planned.budget_bytes is not None and row.measured_peak_bytes is not None and (
            row.measured_peak_bytes <= planned.budget_bytes
        )

    # Phase 2: timed rounds. Each round runs one step of every strategy, so a change in the
    # machine's load during the run affects every strategy alike.
    for round_index in range(steps):
        advance(f"timed round {round_index + 1}/{steps}")
        for strategy in strategies:
            strategy.prepare()
            strategy.row.step_times_s.append(runner.timed_step(strategy.forward))
    if progress is not None:
        progress(total, total, "done")
    baseline_median = statistics.median(baseline.row.step_times_s)
    for strategy in strategies:
        row = strategy.row
        row.median_step_s = statistics.median(row.step_times_s)
        row.overhead_ratio = row.median_step_s / baseline_median if baseline_median > 0 else None

    ran = [r for r in rows if r.kind == "remat" and r.ran and r.budget_bytes is not None]
    chosen = min(ran, key=lambda r: (r.budget_bytes, r.strategy)).strategy if ran else None
    timelines = {name: t for name, t in timelines.items() if name in (BASELINE, chosen)}
    metadata: dict[str, Any] = {
        "model": model_name or type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "n_stages": len(stages) or len(measurement.stages),
        "n_planned_stages": measurement.profile.n_stages,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "steps": steps,
        "warmup": warmup,
        "solver": solver,
        "input_shapes": [list(x.shape) for x in inputs if isinstance(x, Tensor)],
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    runner.reset()
    return BenchmarkResult(rows, timelines, chosen, metadata)


def _minimum_budget(wrapper: Checkpointable) -> int:
    """The smallest whole-step budget any schedule fits, from the library's own error."""
    try:
        wrapper.compute_sequence(1)
    except BudgetTooSmall as error:
        return error.minimum_bytes
    return 1


# ---------------------------------------------------------------------- plotting
def save_plot(result: BenchmarkResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draws the benchmark as a PNG with two panels.

    Left: measured peak memory against median step time for every strategy that ran,
    labelled. Right: live activation memory over one training step for the chosen remat
    strategy with its budget line, and for no recompute as a reference.

    Args:
        result: what :func:`run_benchmark` returned.
        path: the image file to write.
        title: the figure's title (default: the model and device).

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'remat[cli]'``).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    path = Path(path)
    meta = result.metadata
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.6), constrained_layout=True)
    figure.suptitle(
        title
        or (
            f"remat benchmark: {meta.get('model', 'model')}, input "
            f"{' + '.join('x'.join(map(str, shape)) for shape in meta.get('input_shapes', [])) or '?'}"
            f", on {meta.get('device', '?')} with {_threads(meta)}, "
            f"median of {meta.get('steps', '?')} steps"
        ),
        fontsize=13,
    )

    colours = {"baseline": "tab:gray", "checkpoint_sequential": "tab:orange", "remat": "tab:blue"}
    markers = {"baseline": "s", "checkpoint_sequential": "D", "remat": "o"}
    ran = [row for row in result.rows if row.ran and row.median_step_s is not None]
    for kind, name in (
        ("baseline", "no recompute"),
        ("checkpoint_sequential", "checkpoint_sequential"),
        ("remat", "remat (optimal schedule)"),
    ):
        points = [row for row in ran if row.kind == kind]
        if not points:
            continue
        left.scatter(
            [row.median_step_s * 1000 for row in points],  # type: ignore[operator]
            [row.measured_peak_bytes / _MIB for row in points],  # type: ignore[operator]
            s=70,
            color=colours[kind],
            marker=markers[kind],
            label=name,
            zorder=3,
            edgecolors="black",
            linewidths=0.6,
        )
    remat_points = sorted(
        (row for row in ran if row.kind == "remat"), key=lambda row: row.measured_peak_bytes or 0
    )
    if len(remat_points) > 1:
        left.plot(
            [row.median_step_s * 1000 for row in remat_points],  # type: ignore[operator]
            [row.measured_peak_bytes / _MIB for row in remat_points],  # type: ignore[operator]
            color=colours["remat"],
            alpha=0.35,
            zorder=2,
        )
    left.set_xlabel("median step time (ms), forward + backward")
    left.set_ylabel("measured peak activation memory (MiB)")
    left.set_title("memory / time trade-off (lower left is better)")
    left.grid(True, alpha=0.3)
    if ran:
        left.set_xlim(0, max(row.median_step_s or 0.0 for row in ran) * 1000 * 1.35)
        left.set_ylim(0, max(row.measured_peak_bytes or 0 for row in ran) / _MIB * 1.25)
    left.legend(loc="lower right", fontsize=9)
    baseline = result.timelines.get(BASELINE)
    if baseline is not None:
        right.plot(
            range(len(baseline.live_bytes)),
            [value / _MIB for value in baseline.live_bytes],
            color=colours["baseline"],
            linewidth=1.2,
            label=f"{BASELINE} (peak {max(baseline.live_bytes, default=0) / _MIB:.2f} MiB)",
        )
    chosen = result.timeline
    if chosen is not None:
        right.plot(
            range(len(chosen.live_bytes)),
            [value / _MIB for value in chosen.live_bytes],
            color=colours["remat"],
            linewidth=1.4,
            label=f"{chosen.strategy} (peak {max(chosen.live_bytes, default=0) / _MIB:.2f} MiB)",
        )
        if chosen.budget_bytes is not None:
            right.axhline(
                chosen.budget_bytes / _MIB,
                color="tab:red",
                linestyle="--",
                linewidth=1.2,
                label=f"budget {chosen.budget_bytes / _MIB:.2f} MiB",
            )
        right.set_title(f"live activation memory over one training step: {chosen.strategy}")
    else:
        right.set_title("live activation memory over one training step")
    right.set_xlabel("allocation / free event of the step")
    right.set_ylabel("live activation memory (MiB)")
    right.set_ylim(bottom=0)
    right.grid(True, alpha=0.3)
    right.legend(loc="upper right", fontsize=9)

    _place_labels(
        figure,
        left,
        [
            (
                row.median_step_s * 1000,  # type: ignore[operator]
                row.measured_peak_bytes / _MIB,  # type: ignore[operator]
                row.strategy.replace("remat @ ", "@ "),
            )
            for row in ran
        ],
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _place_labels(figure: Any, axes: Any, points: list[tuple[float, float, str]]) -> None:
    """Labels scatter points, trying a few positions around each so that labels do not overlap."""
    from matplotlib.text import Text

    figure.canvas.draw()  # settle the layout: display coordinates are final from here on
    renderer = figure.canvas.get_renderer()
    frame = axes.get_window_extent(renderer)
    taken = []
    for x, y in axes.transData.transform([(px, py) for px, py, _ in points]) if points else []:
        taken.append((x - 7, y - 7, x + 7, y + 7))
    legend = axes.get_legend()
    if legend is not None:
        box = legend.get_window_extent(renderer)
        taken.append((box.x0, box.y0, box.x1, box.y1))
    candidates = [
        (10, 6, "left", "bottom"),
        (10, -6, "left", "top"),
        (-10, 6, "right", "bottom"),
        (-10, -6, "right", "top"),
        (14, 18, "left", "bottom"),
        (14, -18, "left", "top"),
        (-14, 18, "right", "bottom"),
        (-14, -18, "right", "top"),
    ]

    def free(box: tuple[float, float, float, float]) -> bool:
        inside = box[0] >= frame.x0 and box[2] <= frame.x1 and box[1] >= frame.y0 and box[3] <= frame.y1
        return inside and not any(
            box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3]
            for other in taken
        )

    for x, y, text in sorted(points, key=lambda point: -point[1]):
        chosen = None
        for dx, dy, ha, va in candidates:
            annotation = axes.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                ha=ha,
                va=va,
                fontsize=8.5,
                arrowprops={"arrowstyle": "-", "color": "0.55", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 4},
            )
            annotation.set_in_layout(False)
            annotation.update_positions(renderer)
            extent = Text.get_window_extent(annotation, renderer)  # the text, without the leader line
            box = (extent.x0, extent.y0, extent.x1, extent.y1)
            if free(box):
                chosen = box
                break
            annotation.remove()
        if chosen is None:
            annotation = axes.annotate(
                text, (x, y), xytext=candidates[0][:2], textcoords="offset points", fontsize=8.5
            )
            annotation.set_in_layout(False)
            annotation.update_positions(renderer)
            extent = Text.get_window_extent(annotation, renderer)
            chosen = (extent.x0, extent.y0, extent.x1, extent.y1)
        taken.append(chosen)
