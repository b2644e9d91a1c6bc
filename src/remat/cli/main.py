"""The ``remat`` command's entry point: argument parsing -> library calls -> rendering.

See :mod:`remat.cli` for the subcommands and the exit codes. Loading models lives in
:mod:`remat.cli.loading`, rendering in :mod:`remat.cli.render`, the exit codes in
:mod:`remat.cli.codes`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

import remat
from remat.budget import BUDGET_FORMS, budget_from_text
from remat.cli.codes import (
    EXIT_BAD_BUDGET,
    EXIT_BUDGET_TOO_SMALL,
    EXIT_CANNOT_WRITE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_UNSUPPORTED_MODEL,
    EXIT_USAGE,
    CliError,
    exit_code_table,
    fail,
)
from remat.cli.explaining import POLICY_FORMS, add_explain_command, command_explain, policy_from_text
from remat.cli.launch import torchrun_group
from remat.cli.loading import (
    DEFAULT_BATCH,
    THREADS_HELP,
    Workload,
    command_models,
    first_line,
    is_out_of_memory,
    load_workload,
    measure_workload,
    model_failures,
    pin_threads,
    resolve_device,
)
from remat.cli.render import Output, bytes_and_mib, print_bench, print_plan, require_matplotlib
from remat.errors import BudgetTooSmall, InvalidBudget, RematError
from remat.models._hf import HUGGING_FACE_NAMES

if TYPE_CHECKING:
    from remat.bench import BenchmarkResult

__all__ = ["build_parser", "main"]

_EPILOG = (
    "exit codes:\n"
    + exit_code_table(markup=False)
    + "\n\nMODEL is a name from `remat models` or package.module:function (a function with no\n"
    "arguments returning an nn.Module, or a tuple (model, sample_input)).\n"
)

_DEMO_MODEL = "resnet_small"
_DEMO_BUDGETS = "1.0,0.5,0.25,min"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors become :class:`CliError` (exit code 7)."""

    def error(self, message: str) -> NoReturn:
        fail(EXIT_USAGE, f"{message} (see `{self.prog} --help`)")


# ---------------------------------------------------------------------- arguments
def _int_at_least(minimum: int, expected: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive sizes separated by commas, like 3,32,32; got {text!r}")
    return dims


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda (or cuda:N), got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda (or cuda:N), got {text!r}")
    return text


def _solver_names() -> tuple[str, ...]:
    from remat.plan.solvers import available_solvers

    return available_solvers()


def _add_global_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that may come anywhere on the line, before or after the subcommand."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of errors")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL", nargs="?", default=None, help="a name from `remat models`, or package.module:function"
    )
    parser.add_argument(
        "--hf",
        default=None,
        metavar="ARCH",
        help="a Hugging Face architecture instead of MODEL, from a config with random weights (no download): "
        + ", ".join(HUGGING_FACE_NAMES),
    )
    parser.add_argument(
        "--hf-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the --hf config, e.g. num_hidden_layers=8 (repeat, or separate with commas)",
    )
    parser.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"batch size of the synthetic input (default {DEFAULT_BATCH}; not with a factory's sample input)",
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        metavar="D1,D2,...",
        help="for a factory: the input is a random float tensor of shape (batch, D1, D2, ...)",
    )
    parser.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--solver", choices=_solver_names(), default="optimal", help="the planner (default optimal)")
    parser.add_argument("--nested", action="store_true", help="split blocks into their submodules (nested plans)")


def _add_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        action="append",
        default=None,
        metavar="POLICY",
        help=f"a policy remat's plans may store stages under ({POLICY_FORMS}); repeat for several",
    )
    parser.add_argument(
        "--elementwise", action="store_true", help="stored stages leave cheap elementwise saves to backward"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``remat`` command."""
    parser = _Parser(
        prog="remat",
        description="Train PyTorch models in less memory: see and benchmark the optimal recompute schedule.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"remat {remat.__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    models = commands.add_parser(
        "models",
        help="list the ready-made models",
        description="List the ready-made models with their parameter counts.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    _add_global_arguments(models)

    plan = commands.add_parser(
        "plan",
        help="measure a model and print its recompute plan",
        description="Measure MODEL on one synthetic batch, solve for the budget and print the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_global_arguments(plan)
    _add_model_arguments(plan)
    plan.add_argument(
        "--budget",
        default=None,
        metavar="B",
        help=f"activation memory budget of a training step: {BUDGET_FORMS.replace('%', '%%')}; or min for the smallest "
        "feasible one (default: free device memory)",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    plan.add_argument("--threads", type=_positive_int, default=None, metavar="N", help=THREADS_HELP)
    _add_policy_argument(plan)
    plan.add_argument(
        "--estimate",
        action="store_true",
        help="plan without running the model: it is built on the meta device (no memory, so it may be larger "
        "than the machine), sized on fake tensors, and its times estimated by a cost model calibrated on --device",
    )

    bench = commands.add_parser(
        "bench",
        help="benchmark no recompute, checkpoint_sequential and remat",
        description=(
            "Train MODEL for a few steps with each strategy; measure the exact peak activation "
            "memory and the median step time."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_global_arguments(bench)
    _add_model_arguments(bench)
    _add_bench_arguments(bench, budgets=_DEMO_BUDGETS, steps=5)
    _add_policy_argument(bench)
    bench.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="write the two-panel figure")
    bench.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the result as JSON")
    bench.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="write the table as Markdown")

    demo = commands.add_parser(
        "demo",
        help=f"benchmark {_DEMO_MODEL} on the CPU and draw the figure",
        description=(
            f"Benchmark {_DEMO_MODEL} (CPU, batch {DEFAULT_BATCH}, one thread, budgets "
            f"{_DEMO_BUDGETS}); print the table, write remat-demo.png and remat-demo.json."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_explain_command(commands, (_add_global_arguments, _add_model_arguments), _EPILOG)
    _add_global_arguments(demo)
    demo.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help="where to write the files (default .)")
    demo.add_argument(
        "--steps", type=_positive_int, default=5, metavar="N", help="timed steps per strategy (default 5)"
    )
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        metavar="N",
        help="torch threads (default 1: the most repeatable timings, even on a busy machine)",
    )
    return parser


def _add_bench_arguments(parser: argparse.ArgumentParser, *, budgets: str, steps: int) -> None:
    parser.add_argument(
        "--budgets",
        default=budgets,
        metavar="B1,B2,...",
        help=f"remat budgets, comma-separated, each a budget or min (default {budgets})",
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=steps, metavar="N", help=f"timed steps per strategy (default {steps})"
    )
    parser.add_argument(
        "--warmup", type=_non_negative_int, default=1, metavar="N", help="untimed steps per strategy (default 1)"
    )
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N", help="pin torch's thread count")


# ---------------------------------------------------------------------- plan
def _budget(text: str, *, allow_minimum: bool) -> int | float | str:
    """A budget from the command line, read by the library's one parser."""
    try:
        return budget_from_text(text, allow_minimum=allow_minimum)
    except InvalidBudget:
        also = "; or min for the smallest feasible budget" if allow_minimum else ""
        fail(EXIT_BAD_BUDGET, f"cannot read the budget {text!r}; use {BUDGET_FORMS}{also}")


def _minimum_message(error: BudgetTooSmall, name: str) -> str:
    return (
        f"no recompute schedule of {name} fits the budget {bytes_and_mib(error.budget_bytes)}; "
        f"the minimum feasible budget is {bytes_and_mib(error.minimum_bytes)}"
    )


def _workload(args: argparse.Namespace) -> Workload:
    """The model the command line names (MODEL or --hf), with its batch and loss."""
    return load_workload(
        args.model,
        batch=args.batch,
        input_shape=args.input_shape,
        device=resolve_device(args.device),
        hf=args.hf,
        hf_config=args.hf_config,
        meta=getattr(args, "estimate", False),
    )


def _remat_options(args: argparse.Namespace) -> list[Any]:
    """The policies of ``--policy``; with ``--elementwise``, a usage error (not built together)."""
    if args.policy and args.elementwise:
        fail(EXIT_USAGE, "--elementwise with --policy is not built: use one or the other")
    return [policy_from_text(text) for text in args.policy or []]


def _command_plan(args: argparse.Namespace, output: Output) -> int:
    budget = None if args.budget is None else _budget(args.budget, allow_minimum=True)
    pin_threads(args.threads)
    workload = _workload(args)
    policies = _remat_options(args)
    wrapper, inputs = measure_workload(
        workload, args.solver, output, nested=args.nested, estimate=args.estimate, policies=policies,
        elementwise=args.elementwise,
    )  # fmt: skip
    try:
        plan = wrapper.plan_for(budget)
    except BudgetTooSmall as error:
        fail(EXIT_BUDGET_TOO_SMALL, _minimum_message(error, workload.name))
    except InvalidBudget as error:
        fail(EXIT_BAD_BUDGET, str(error))
    described = {
        "model": workload.name,
        "device": str(workload.device),
        "input_shapes": [list(t.shape) for t in tree_flatten(inputs)[0] if isinstance(t, Tensor)],
        "loss": workload.loss_description,
        "requested_budget": args.budget,
    }
    if args.json:
        output.raw(json.dumps({**plan.to_dict(), **described}, indent=2))
    else:
        print_plan(plan, described, output)
    return EXIT_OK


# ---------------------------------------------------------------------- bench
def _parse_budgets(text: str) -> list[Any]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        fail(EXIT_BAD_BUDGET, f"--budgets {text!r} lists no budget")
    return [_budget(item, allow_minimum=True) for item in items]


def _run_bench(
    workload: Workload,
    output: Output,
    *,
    budgets: list[Any],
    steps: int,
    warmup: int,
    threads: int | None,
    solver: str,
    nested: bool = False,
    policies: Sequence[Any] = (),
    elementwise: bool = False,
    shown: bool = True,
    distributed: bool = False,
) -> BenchmarkResult:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from remat.bench import run_benchmark

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=output.err,
        transient=True,
        disable=not shown,
    ) as progress:
        task = progress.add_task(f"bench {workload.name}", total=None)

        def report(done: int, total: int, label: str) -> None:
            progress.update(task, completed=done, total=total, description=f"bench {workload.name}: {label}")

        with model_failures(f"{workload.name} failed while training"):
            return run_benchmark(
                workload.model,
                workload.make_batch,
                workload.loss_fn,
                budgets=budgets,
                steps=steps,
                warmup=warmup,
                threads=threads,
                progress=report,
                solver=solver,
                device=workload.device,
                model_name=workload.name,
                nested=nested,
                policies=policies,
                elementwise=elementwise,
                distributed=distributed,
            )


#: The figure formats ``--plot`` writes (matplotlib's, by the file's suffix).
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_output(path: Path, what: str, suffixes: tuple[str, ...] | None) -> None:
    """Fails before any work on an output path that cannot be written as `what`."""
    if suffixes is not None and path.suffix.lower() not in suffixes:
        fail(
            EXIT_CANNOT_WRITE,
            f"cannot write {what} {str(path)!r}: its suffix must be one of {', '.join(suffixes)}",
        )
    if path.is_dir():
        fail(EXIT_CANNOT_WRITE, f"cannot write {what} {str(path)!r}: it is a directory")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        fail(EXIT_CANNOT_WRITE, f"cannot write {what} {str(path)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK):
        fail(EXIT_CANNOT_WRITE, f"cannot write {what} {str(path)!r}: {str(parent)!r} is not writable")


def _write(path: Path, write: Callable[[Path], Any], output: Output, what: str) -> None:
    try:
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as error:
        fail(EXIT_CANNOT_WRITE, f"cannot write {what} {str(path)!r}: {error.strerror or error}")
    output.text(f"wrote {what} {path}")


def _save_outputs(
    result: BenchmarkResult,
    output: Output,
    *,
    json_path: Path | None,
    markdown_path: Path | None,
    plot_path: Path | None,
) -> None:
    from remat.bench import save_plot

    if json_path is not None:
        _write(json_path, lambda p: p.write_text(result.to_json() + "\n", encoding="utf-8"), output, "JSON")
    if markdown_path is not None:
        _write(markdown_path, lambda p: p.write_text(result.to_markdown(), encoding="utf-8"), output, "Markdown")
    if plot_path is not None:
        _write(plot_path, lambda p: save_plot(result, p), output, "figure")


def _command_bench(args: argparse.Namespace, output: Output) -> int:
    budgets = _parse_budgets(args.budgets)
    if args.plot is not None:
        require_matplotlib()
        _check_output(args.plot, "the figure", PLOT_SUFFIXES)
    for path, what in ((args.json, "the JSON result"), (args.markdown, "the Markdown table")):
        if path is not None:
            _check_output(path, what, None)
    with torchrun_group(args.device) as rank:  # one process per rank under torchrun: rank 0 reports
        result = _run_bench(
            _workload(args),
            output,
            budgets=budgets,
            steps=args.steps,
            warmup=args.warmup,
            threads=args.threads,
            solver=args.solver,
            nested=args.nested,
            policies=_remat_options(args),
            elementwise=args.elementwise,
            shown=not rank,
            distributed=rank is not None,
        )
        if not rank:
            print_bench(result, output)
            _save_outputs(result, output, json_path=args.json, markdown_path=args.markdown, plot_path=args.plot)
    return EXIT_OK


def _command_demo(args: argparse.Namespace, output: Output) -> int:
    require_matplotlib()
    start = time.perf_counter()
    device = torch.device("cpu")
    workload = load_workload(_DEMO_MODEL, batch=DEFAULT_BATCH, input_shape=None, device=device)
    result = _run_bench(
        workload,
        output,
        budgets=_parse_budgets(_DEMO_BUDGETS),
        steps=args.steps,
        warmup=1,
        threads=args.threads,
        solver="optimal",
    )
    result.metadata["batch"] = DEFAULT_BATCH
    print_bench(result, output)
    out_dir: Path = args.out
    _save_outputs(
        result,
        output,
        json_path=out_dir / "remat-demo.json",
        markdown_path=None,
        plot_path=out_dir / "remat-demo.png",
    )
    output.text(f"demo finished in {time.perf_counter() - start:.1f} s")
    return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace, Output], int]] = {
    "models": command_models,
    "plan": _command_plan,
    "bench": _command_bench,
    "demo": _command_demo,
    "explain": lambda args, output: command_explain(args, output, _workload(args), _budget),
}


# ---------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``remat`` command.

    Args:
        argv: the arguments, without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring).
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in arguments
    try:
        try:
            args = build_parser().parse_args(arguments)
        except SystemExit as exit_request:  # --help, --version
            code = exit_request.code
            return code if isinstance(code, int) else (0 if code is None else EXIT_USAGE)
        output = Output()
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = _show_warning
            return _COMMANDS[args.command](args, output)
    except CliError as error:
        _error_line(debug, error.message)
        return error.code
    except KeyboardInterrupt:
        _error_line(False, "interrupted")
        return EXIT_INTERRUPTED
    except BudgetTooSmall as error:
        _error_line(
            debug,
            f"the budget {bytes_and_mib(error.budget_bytes)} is below the minimum feasible budget "
            f"{bytes_and_mib(error.minimum_bytes)}",
        )
        return EXIT_BUDGET_TOO_SMALL
    except InvalidBudget as error:
        _error_line(debug, str(error))
        return EXIT_BAD_BUDGET
    except RematError as error:
        _error_line(debug, f"{type(error).__name__}: {error}")
        return EXIT_UNSUPPORTED_MODEL
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        _error_line(debug, f"out of memory: {first_line(error)}; try a smaller --batch or another --device")
        return EXIT_OUT_OF_MEMORY


def _show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
    """remat's warnings as one line each, without the source line (--debug shows it)."""
    text = str(message)
    print(text if text.startswith("remat: ") else f"warning: {text}", file=sys.stderr)


def _error_line(debug: bool, message: str) -> None:
    """The error's one line (with --debug, after the traceback of the error being handled)."""
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"remat: error: {' '.join(message.split())}\n")
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
