"""Side-by-side benchmarks: remat against no recompute and torch's checkpoint_sequential."""

from remat.bench.plot import plot_figure, save_plot
from remat.bench.result import (
    BASELINE,
    CHECKPOINT_SEQUENTIAL,
    CKPT_SEQ_BUDGET,
    MIN_BUDGET,
    BenchmarkResult,
    BenchmarkRow,
    StepTimeline,
    format_row,
)
from remat.bench.runner import run_benchmark

__all__ = [
    "BASELINE",
    "CHECKPOINT_SEQUENTIAL",
    "CKPT_SEQ_BUDGET",
    "MIN_BUDGET",
    "BenchmarkResult",
    "BenchmarkRow",
    "StepTimeline",
    "format_row",
    "plot_figure",
    "run_benchmark",
    "save_plot",
]
