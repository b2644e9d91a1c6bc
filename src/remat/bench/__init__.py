"""Side-by-side benchmarks: remat against no recompute and torch's checkpoint_sequential."""

from remat.bench.runner import (
    BASELINE,
    CHECKPOINT_SEQUENTIAL,
    CKPT_SEQ_BUDGET,
    MIN_BUDGET,
    BenchmarkResult,
    BenchmarkRow,
    StepTimeline,
    format_row,
    run_benchmark,
    save_plot,
)

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
