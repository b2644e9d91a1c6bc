"""The results of a benchmark: one row per strategy, step timelines, and their JSON and Markdown."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.units import format_bytes

__all__ = [
    "BASELINE",
    "CHECKPOINT_SEQUENTIAL",
    "CKPT_SEQ_BUDGET",
    "MIN_BUDGET",
    "BenchmarkResult",
    "BenchmarkRow",
    "StepTimeline",
    "format_row",
]

BASELINE = "no recompute"
"""Label of the strategy without recompute."""

CHECKPOINT_SEQUENTIAL = "checkpoint_sequential sqrt(n)"
"""Label of torch's ``checkpoint_sequential`` baseline."""

CKPT_SEQ_BUDGET = "ckpt-seq memory"
"""Budget label meaning: the peak that ``checkpoint_sequential`` measured."""

MIN_BUDGET = "min"
"""Budget label meaning: the smallest budget any schedule fits."""


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
            f"{describe_threads(meta)}, median of {meta.get('steps', '?')} steps after "
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


def describe_threads(metadata: dict[str, Any]) -> str:
    """The threads, and the ranks of a run under torchrun (whose peaks and step times are
    each the largest of any rank's)."""
    threads = metadata.get("threads", "?")
    text = f"{threads} thread" + ("" if threads == 1 else "s")
    distributed = metadata.get("distributed")
    return text if distributed is None else f"{text} per rank, {distributed}, the slowest and largest rank's figures"


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
