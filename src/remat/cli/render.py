"""Rendering for the ``remat`` command: rich tables of plans and benchmarks, on stdout."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from remat.bench.result import describe_threads
from remat.cli.codes import EXIT_MISSING_DEPENDENCY, INSTALL_HINT, fail
from remat.units import MIB, format_bytes, format_seconds

if TYPE_CHECKING:
    from rich.console import Console

    from remat.bench import BenchmarkResult
    from remat.plan import Plan

__all__ = ["Output", "bytes_and_mib", "print_bench", "print_plan", "require_matplotlib"]


class Output:
    """Where everything the command shows goes: rich consoles on stdout and stderr."""

    def __init__(self) -> None:
        try:
            from rich.console import Console
        except ImportError:
            fail(EXIT_MISSING_DEPENDENCY, f"the remat command needs rich: {INSTALL_HINT}")
        self.out: Console = Console(file=sys.stdout, width=_width(sys.stdout), highlight=False)
        self.err: Console = Console(file=sys.stderr, width=_width(sys.stderr), highlight=False)

    def text(self, value: str = "") -> None:
        self.out.print(value)

    def raw(self, value: str) -> None:
        """Writes text as it is (JSON), without rich's wrapping or markup."""
        sys.stdout.write(value if value.endswith("\n") else value + "\n")
        sys.stdout.flush()


def _width(stream: Any) -> int | None:
    """Rich's own width on a terminal or when COLUMNS says; wide enough for the tables otherwise."""
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return None
    try:
        return None if stream.isatty() else 160
    except (AttributeError, ValueError):
        return 160


def require_matplotlib() -> None:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        fail(EXIT_MISSING_DEPENDENCY, f"drawing the figure needs matplotlib: {INSTALL_HINT}")


def bytes_and_mib(n_bytes: int) -> str:
    return f"{n_bytes} bytes ({n_bytes / MIB:.2f} MiB)"


#: The columns of names, which may fold in a narrow terminal (every other column keeps its line).
_NAME_COLUMNS = frozenset({"stage", "strategy", "name", "description"})


def _table(
    title: str,
    headers: tuple[str, ...],
    *,
    left_aligned: set[str],
    centred: tuple[str, ...] = (),
) -> Any:
    """A rich table with a left-justified title; columns right-aligned unless named."""
    from rich.table import Table

    # figures never wrap: in a narrow terminal the text columns (names) give way first
    table = Table(title=title, title_justify="left", pad_edge=False)
    for header in headers:
        justify = "left" if header in left_aligned else "center" if header in centred else "right"
        name = header in _NAME_COLUMNS
        table.add_column(
            header,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=not name,
            overflow="fold" if name else "ellipsis",
            min_width=min(len(header), 8) if name else None,
        )
    return table


def print_plan(plan: Plan, workload: dict[str, Any], output: Output) -> None:
    """Prints the plan's report as a rich table, then its whole-step figures and budget split."""
    report = plan.report()
    times = plan.schedule.profile.metadata.get("times")  # how the stage times were had, if not measured
    table = _table(
        f"recompute plan of {workload['model']} ({len(report.rows)} planned stages"
        f"{', estimated times' if times else ''})",
        ("#", "stage", "forward", "backward", "output", "saved", "plan", "runs"),
        left_aligned={"stage", "plan"},
    )
    for row in report.rows:
        decision = "kept" if row.kept else "[yellow]recomputed[/yellow]"
        if row.option is not None:
            decision = f"[cyan]{row.option}[/cyan]"  # stored under the policy: its own recompute
        table.add_row(*row.formatted_figures(), decision, str(row.forward_runs))
    output.out.print(table)
    split = plan.budget
    shapes = ", ".join(str(tuple(shape)) for shape in workload["input_shapes"])
    requested = workload["requested_budget"] or "the free device memory"
    loss_room = (
        f" ({format_bytes(split.loss_allowance_bytes)} of it for the loss)" if split.loss_allowance_bytes else ""
    )
    chain = "unlimited" if split.chain_bytes is None else format_bytes(split.chain_bytes)
    if split.total_bytes is not None and split.chain_bytes is not None:
        if split.chain_bytes + split.held_outside_bytes + split.margin_bytes > split.total_bytes:
            # the parts overlap: what is held outside only part of the step was counted where it lives
            chain += " (what lives only part of the step counted where it lives)"
    recomputed = sum(1 for row in report.rows if not row.kept)
    extra_forwards = sum(row.forward_runs - 1 for row in report.rows)
    lines = [
        f"input {shapes} on {workload['device']}; loss: {workload['loss']}; solver {plan.schedule.solver_name}",
        f"budget:              {bytes_and_mib(plan.budget_bytes)}, from {requested}: the chain {chain}{loss_room}, "
        f"held outside the chain {format_bytes(split.held_outside_bytes)}, margin {format_bytes(split.margin_bytes)}"
        if plan.budget_bytes is not None
        else "budget: none",
        f"predicted peak:      {bytes_and_mib(plan.predicted_peak_bytes)}",
        f"without recompute:   {bytes_and_mib(report.baseline.peak_bytes + split.held_outside_bytes)}",
        f"predicted overhead:  {plan.overhead_fraction * 100:.1f}% "
        f"(predicted step {format_seconds(plan.predicted_time_s)})",
        f"recomputed stages:   {recomputed} of {len(report.rows)}, {extra_forwards} extra stage forwards per step",
    ]
    if times:
        lines.append(f"stage times:         {times}")
    for line in lines:
        output.text(line)


def _bench_table(title: str, columns: tuple[tuple[str, str], ...], result: BenchmarkResult) -> Any:
    """The benchmark's table with these (header, cell) columns."""
    from remat.bench import format_row

    table = _table(title, tuple(header for header, _ in columns), left_aligned={"strategy"}, centred=("fits",))
    for row in result.rows:
        cells = format_row(row)
        if row.fits_budget is False or row.error is not None:
            cells["fits"] = f"[red]{cells['fits']}[/red]"
        table.add_row(*(cells[key] for _, key in columns))
    return table


def print_bench(result: BenchmarkResult, output: Output) -> None:
    """Prints the benchmark's rows as a rich table, with each row's error below it."""
    meta = result.metadata
    title = (
        f"{meta['model']}: {meta['n_stages']} stages ({meta['n_planned_stages']} planned), "
        f"{meta['device']}, {describe_threads(meta)}, "
        f"median of {meta['steps']} steps"
    )
    columns = (
        ("strategy", "strategy"),
        ("budget", "budget"),
        ("measured peak", "measured_peak"),
        ("predicted peak", "predicted_peak"),
        ("fits", "fits"),
        ("median step", "median_step"),
        ("overhead", "overhead"),
        ("predicted overhead", "predicted_overhead"),
    )
    table = _bench_table(title, columns, result)
    console = output.out
    if console.measure(table, options=console.options.update(max_width=1 << 16)).maximum > console.width:
        # a narrow terminal: the measured figures only, under short headers
        narrow: tuple[tuple[str, str], ...] = (
            ("strategy", "strategy"),
            ("budget", "budget"),
            ("peak", "measured_peak"),
            ("fits", "fits"),
            ("step", "median_step"),
            ("overhead", "overhead"),
        )
        table = _bench_table(title, narrow, result)
    output.out.print(table)
    for row in result.rows:
        if row.error is not None:
            output.text(f"{row.strategy}: {row.error}")
    output.text(
        "peaks: exact live activation bytes of one step (parameter gradients excluded); "
        "overhead: median step time / no recompute's; steps timed in interleaved rounds"
    )
