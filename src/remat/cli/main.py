"""The ``remat`` command: see a model's recompute plan, and benchmark it, from the shell.

Subcommands::

    remat models                      the ready-made models, with parameter counts
    remat plan MODEL [--budget B]     measure MODEL, solve, print the plan (or --json)
    remat bench MODEL [--budgets ..]  no recompute vs checkpoint_sequential vs remat:
                                      exact peak memory and step time, table/JSON/PNG
    remat demo [--out DIR]            a bench of resnet_small on the CPU, with a PNG

MODEL is a name from ``remat models``, or ``package.module:function``: a function with no
arguments that returns an ``nn.Sequential``, or a tuple ``(model, sample_input)``. A
model without a sample input needs ``--input-shape C,H,W``: the input is then a random
float tensor of shape ``(batch, C, H, W)``. Catalogue models train on synthetic data with
their own loss; a user's model trains on its input with the sum of its output as the loss.

Exit codes:

===  =====================================================================
0    success
1    an optional dependency is missing: ``pip install 'remat[cli]'``
2    the budget is below the smallest feasible budget (the message gives it)
3    unknown model name (the message lists the catalogue)
4    the budget cannot be read (the message lists the accepted forms)
5    the model factory cannot be imported or called, does not return an
     ``nn.Sequential``, or the model fails on its input
6    out of memory on the device while building or running the model
7    invalid command-line arguments
8    remat cannot plan this model (e.g. its stages are not a chain)
9    an output file cannot be written
130  interrupted
===  =====================================================================

Every error is one line on stderr, ``remat: error: ...``; ``--debug`` shows the traceback.
This module is the output layer of remat: the only place that prints.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

import remat
from remat.errors import BudgetTooSmall, InvalidBudget, RematError

if TYPE_CHECKING:
    from rich.console import Console

    from remat.bench.runner import BenchmarkResult
    from remat.automatic import PlannedChain
    from remat.models import ModelSpec

__all__ = ["main"]

EXIT_OK = 0
EXIT_MISSING_DEPENDENCY = 1
EXIT_BUDGET_TOO_SMALL = 2
EXIT_UNKNOWN_MODEL = 3
EXIT_BAD_BUDGET = 4
EXIT_BAD_MODEL = 5
EXIT_OUT_OF_MEMORY = 6
EXIT_USAGE = 7
EXIT_UNSUPPORTED_MODEL = 8
EXIT_CANNOT_WRITE = 9
EXIT_INTERRUPTED = 130

INSTALL_HINT = "pip install 'remat[cli]'"

_EPILOG = """\
exit codes:
  0    success
  1    an optional dependency is missing (pip install 'remat[cli]')
  2    the budget is below the smallest feasible budget
  3    unknown model name
  4    the budget cannot be read
  5    the model factory cannot be imported or called, does not return an
       nn.Sequential, or the model fails on its input
  6    out of memory on the device
  7    invalid command-line arguments
  8    remat cannot plan this model
  9    an output file cannot be written
  130  interrupted

MODEL is a name from `remat models` or package.module:function (a function with no
arguments returning an nn.Sequential, or a tuple (model, sample_input)).
"""

_DEFAULT_BATCH = 16
_DEMO_MODEL = "resnet_small"
_DEMO_BUDGETS = "1.0,0.5,0.25,min"
_MIB = 1024 * 1024


class CliError(Exception):
    """An error to report as one line on stderr, with its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = " ".join(message.split())


def _fail(code: int, message: str) -> NoReturn:
    raise CliError(code, message)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors become :class:`CliError` (exit code 7)."""

    def error(self, message: str) -> NoReturn:
        _fail(EXIT_USAGE, f"{message} (see `{self.prog} --help`)")


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
        raise argparse.ArgumentTypeError(
            f"expected positive sizes separated by commas, like 3,32,32; got {text!r}"
        )
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


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a name from `remat models`, or package.module:function")
    parser.add_argument(
        "--batch",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"batch size of the synthetic input (default {_DEFAULT_BATCH}; not with a factory's sample input)",
    )
    parser.add_argument(
        "--input-shape",
        type=_shape,
        default=None,
        metavar="D1,D2,...",
        help="for a factory: the input is a random float tensor of shape (batch, D1, D2, ...)",
    )
    parser.add_argument(
        "--device", type=_device, default="cpu", help="cpu or cuda (default cpu)"
    )
    parser.add_argument(
        "--solver",
        choices=_solver_names(),
        default="optimal",
        help="the planner (default optimal)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``remat`` command."""
    from remat.memory import BUDGET_FORMS

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

    commands.add_parser(
        "models",
        help="list the ready-made models",
        description="List the ready-made models with their parameter counts.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    plan = commands.add_parser(
        "plan",
        help="measure a model and print its recompute plan",
        description="Measure MODEL on one synthetic batch, solve for the budget and print the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_arguments(plan)
    plan.add_argument(
        "--budget",
        default=None,
        metavar="B",
        help=f"activation memory budget of a training step: {BUDGET_FORMS} (default: free device memory)",
    )
    plan.add_argument("--json", action="store_true", help="print a JSON document instead of tables")

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
    _add_model_arguments(bench)
    _add_bench_arguments(bench, budgets=_DEMO_BUDGETS, steps=5)
    bench.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="write the two-panel figure")
    bench.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the result as JSON")
    bench.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="write the table as Markdown")

    demo = commands.add_parser(
        "demo",
        help=f"benchmark {_DEMO_MODEL} on the CPU and draw the figure",
        description=(
            f"Benchmark {_DEMO_MODEL} (CPU, batch {_DEFAULT_BATCH}, one thread, budgets "
            f"{_DEMO_BUDGETS}); print the table, write remat-demo.png and remat-demo.json."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help="where to write the files (default .)")
    demo.add_argument("--steps", type=_positive_int, default=5, metavar="N", help="timed steps per strategy (default 5)")
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
    parser.add_argument("--steps", type=_positive_int, default=steps, metavar="N", help=f"timed steps per strategy (default {steps})")
    parser.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N", help="untimed steps per strategy (default 1)")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N", help="pin torch's thread count")


# ---------------------------------------------------------------------- output layer
class _Output:
    """Where everything the command shows goes: rich consoles on stdout and stderr."""

    def __init__(self) -> None:
        try:
            from rich.console import Console
        except ImportError:
            _fail(EXIT_MISSING_DEPENDENCY, f"the remat command needs rich: {INSTALL_HINT}")
        self.out: Console = Console(file=sys.stdout, width=_width(sys.stdout), highlight=False)
        self.err: Console = Console(file=sys.stderr, width=_width(sys.stderr), highlight=False)

    def text(self, value: str = "") -> None:
        self.out.print(value)

    def raw(self, value: str) -> None:
        """Writes text as it is (JSON), without rich's wrapping or markup."""
        sys.stdout.write(value if value.endswith("\n") else value + "\n")
        sys.stdout.flush()

    def note(self, value: str) -> None:
        self.err.print(value)


def _width(stream: Any) -> int | None:
    """Rich's own width on a terminal or when COLUMNS says; wide enough for the tables otherwise."""
    if os.environ.get("COLUMNS", "").strip().isdigit():
        return None
    try:
        return None if stream.isatty() else 160
    except (AttributeError, ValueError):
        return 160


def _require_matplotlib() -> None:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        _fail(EXIT_MISSING_DEPENDENCY, f"drawing the figure needs matplotlib: {INSTALL_HINT}")


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / _MIB:.2f} MiB"


def _bytes_and_mib(n_bytes: int) -> str:
    return f"{n_bytes} bytes ({_mib(n_bytes)})"


# ---------------------------------------------------------------------- models
@dataclass
class Workload:
    """A model ready to measure, with its batch and loss.

    Attributes:
        name: the model's name (a catalogue name or the factory's ``module:function``).
        model: the chain, on its device, in training mode.
        make_batch: ``() -> (inputs, target)``; the same batch at every call.
        loss_fn: ``(output, target) -> loss``.
        loss_description: the loss in words, for reports.
        device: where the model and the batch live.
    """

    name: str
    model: nn.Sequential
    make_batch: Callable[[], tuple[tuple[Any, ...], Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    loss_description: str
    device: torch.device

    def measurement_loss(self, target: Any) -> Callable[[Any], Tensor]:
        """The ``loss_fn(output) -> loss`` that :class:`~remat.checkpointable.Checkpointable` measures with."""
        return lambda output: self.loss_fn(output, target)


def _sum_loss(output: Any, target: Any) -> Tensor:
    """The default loss of a user's model: the sum of every floating-point output."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        _fail(EXIT_BAD_MODEL, "the model's output has no floating-point tensor to train on")
    return sum((t.sum() for t in tensors[1:]), tensors[0].sum())


@contextlib.contextmanager
def _model_failures(what: str) -> Iterator[None]:
    """Reports an error of the user's model as one line (exit 5); remat's own errors and
    running out of memory pass through to their own exit codes."""
    try:
        yield
    except (RematError, CliError):
        raise
    except Exception as error:
        if _is_out_of_memory(error):
            raise
        _fail(EXIT_BAD_MODEL, f"{what}: {type(error).__name__}: {_first_line(error)}")


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    out_of_memory = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if out_of_memory is not None and isinstance(error, out_of_memory):
        return True
    if isinstance(error, RuntimeError) and not isinstance(error, RematError):
        text = str(error).lower()
        return any(
            phrase in text for phrase in ("out of memory", "can't allocate memory", "not enough memory")
        )
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _resolve_device(text: str) -> torch.device:
    device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        _fail(EXIT_USAGE, f"--device {text}: CUDA is not available on this machine")
    return device


def load_workload(
    model: str,
    *,
    batch: int | None,
    input_shape: tuple[int, ...] | None,
    device: torch.device,
) -> Workload:
    """Builds the model named on the command line, with its synthetic batch and loss.

    Args:
        model: a catalogue name or ``package.module:function``.
        batch: the batch size (None: the default, or the factory's sample input).
        input_shape: the shape of one sample for a factory's model.
        device: where to build the model and the batch.

    Raises:
        CliError: unknown name (3), a bad factory (5), out of memory (6), bad arguments (7).
    """
    if ":" in model:
        return _load_factory(model, batch=batch, input_shape=input_shape, device=device)
    from remat.models import CATALOGUE

    spec = CATALOGUE.get(model)
    if spec is None:
        known = ", ".join(sorted(CATALOGUE))
        _fail(
            EXIT_UNKNOWN_MODEL,
            f"unknown model {model!r}; choose one of: {known} (or give package.module:function)",
        )
    if input_shape is not None:
        _fail(EXIT_USAGE, f"--input-shape is for a factory's model; {model} has its own input")
    return _catalogue_workload(spec, batch or _DEFAULT_BATCH, device)


def _catalogue_workload(spec: ModelSpec, batch: int, device: torch.device) -> Workload:
    torch.manual_seed(0)
    built = _build(spec.factory, spec.name, device)
    batch_size = batch

    def make_batch() -> tuple[tuple[Any, ...], Any]:
        torch.manual_seed(1)
        return spec.make_batch(batch_size, device)

    return Workload(
        spec.name, built, make_batch, spec.loss_fn, f"{spec.name}'s own loss on synthetic data", device
    )


def _build(factory: Callable[[], Any], name: str, device: torch.device) -> nn.Sequential:
    try:
        built = factory()
        if isinstance(built, nn.Module):
            built = built.to(device).train()
    except Exception as error:
        if _is_out_of_memory(error):
            _fail(EXIT_OUT_OF_MEMORY, f"out of memory building {name} on {device}: {_first_line(error)}")
        raise
    return built


def _load_factory(
    text: str, *, batch: int | None, input_shape: tuple[int, ...] | None, device: torch.device
) -> Workload:
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        _fail(EXIT_BAD_MODEL, f"{text!r} is not package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        _fail(EXIT_BAD_MODEL, f"cannot import {module_name!r}: {type(error).__name__}: {_first_line(error)}")
    factory: Any = module
    try:
        for part in attribute.split("."):
            factory = getattr(factory, part)
    except AttributeError:
        _fail(EXIT_BAD_MODEL, f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        _fail(EXIT_BAD_MODEL, f"{text} is a {type(factory).__name__}, not a function returning an nn.Sequential")
    try:
        torch.manual_seed(0)
        result = factory()
    except CliError:
        raise
    except Exception as error:
        if _is_out_of_memory(error):
            _fail(EXIT_OUT_OF_MEMORY, f"out of memory building {text}: {_first_line(error)}")
        _fail(EXIT_BAD_MODEL, f"{text}() raised {type(error).__name__}: {_first_line(error)}")
    sample: Any = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, sample = result
    if not isinstance(result, nn.Sequential):
        _fail(
            EXIT_BAD_MODEL,
            f"{text}() returned {type(result).__name__}; it must return an nn.Sequential or a "
            "tuple (nn.Sequential, sample_input)",
        )
    model = _build(lambda: result, text, device)
    if input_shape is not None:
        shape = (batch or _DEFAULT_BATCH, *input_shape)
        torch.manual_seed(1)
        inputs: tuple[Any, ...] = (torch.randn(shape, device=device),)
    elif sample is not None:
        if batch is not None:
            _fail(EXIT_USAGE, f"{text}() gives a sample input, which fixes the batch; drop --batch or give --input-shape")
        leaves = sample if isinstance(sample, tuple) else (sample,)
        if not leaves or not all(isinstance(t, Tensor) for t in leaves):
            _fail(EXIT_BAD_MODEL, f"{text}() returned a sample input that is not a tensor or a tuple of tensors")
        inputs = tuple(t.to(device) for t in leaves)
    else:
        _fail(
            EXIT_USAGE,
            f"{text}() returns no sample input: give --input-shape, e.g. --input-shape 3,32,32 "
            "for inputs of shape (batch, 3, 32, 32)",
        )
    fixed_inputs = inputs
    return Workload(
        text, model, lambda: (fixed_inputs, None), _sum_loss, "sum of the output", device
    )


# ---------------------------------------------------------------------- remat models
def _parameter_count(spec: ModelSpec) -> int | None:
    from remat.models import count_parameters

    try:
        with torch.device("meta"):
            return count_parameters(spec.factory())
    except Exception:
        try:
            return count_parameters(spec.factory())
        except Exception:
            return None


def _human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _command_models(args: argparse.Namespace, output: _Output) -> int:
    from rich.table import Table

    from remat.models import CATALOGUE

    table = Table(title="remat models", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for name, spec in CATALOGUE.items():
        table.add_row(name, _human_count(_parameter_count(spec)), spec.description)
    output.out.print(table)
    output.text("Use a name with `remat plan NAME` or `remat bench NAME`, or give package.module:function.")
    return EXIT_OK


# ---------------------------------------------------------------------- plan
def _check_budget(text: str, *, allow_min: bool) -> None:
    from remat.memory import BUDGET_FORMS, parse_budget

    if allow_min and text.strip().lower() == "min":
        return
    try:
        parse_budget(text, reference_bytes=1)
    except InvalidBudget:
        also = "; or min for the smallest feasible budget" if allow_min else ""
        _fail(EXIT_BAD_BUDGET, f"cannot read the budget {text!r}; use {BUDGET_FORMS}{also}")


def _budget_value(text: str | None) -> Any:
    """The budget as Checkpointable takes it: a fraction as a float, other forms as text."""
    if text is None:
        return None
    stripped = text.strip()
    try:
        number = float(stripped)
    except ValueError:
        return stripped
    if "." in stripped and 0.0 < number <= 1.0:
        return number
    return stripped


def _measure(workload: Workload, solver: str, output: _Output) -> tuple[Any, tuple[Any, ...]]:
    from remat.automatic import Checkpointable

    inputs, target = workload.make_batch()
    wrapper = Checkpointable(workload.model, None, solver=solver, loss_fn=workload.measurement_loss(target))
    with output.err.status(f"measuring {workload.name} (a warm-up step, a tracked step, a timed step)..."):
        with _model_failures(f"{workload.name} failed on its input {_shapes(inputs)}"):
            _warm_up(workload, inputs, target)
            wrapper.measure(*inputs)
    return wrapper, inputs


def _warm_up(workload: Workload, inputs: tuple[Any, ...], target: Any) -> None:
    """Runs one training step and puts the model back: first-call costs stay out of the timings."""
    model = workload.model
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    workload.loss_fn(model(*inputs), target).backward()
    for parameter in model.parameters():
        parameter.grad = None
    model.load_state_dict(state)


def _shapes(inputs: Sequence[Any]) -> str:
    shapes = [tuple(t.shape) for t in inputs if isinstance(t, Tensor)]
    return ", ".join(str(s) for s in shapes) or "()"


def _minimum_message(error: BudgetTooSmall, name: str) -> str:
    return (
        f"no recompute schedule of {name} fits the budget {_bytes_and_mib(error.budget_bytes)}; "
        f"the minimum feasible budget is {_bytes_and_mib(error.minimum_bytes)}"
    )


def _plan_document(
    workload: Workload, planned: PlannedChain, inputs: tuple[Any, ...], budget_text: str | None, solver: str
) -> dict[str, Any]:
    """The plan as JSON-able data: whole-step figures, the schedule's report, what was measured.

    The top-level byte figures are for the whole training step (they add the memory held
    outside the chain, ``measured.fixed_bytes``); ``schedule`` is the report of the chain's
    schedule, :meth:`remat.plan.report.PlanReport.to_dict`.
    """
    measurement = planned.measurement
    fixed = planned.fixed_bytes
    report = planned.schedule.report()
    return {
        "format": "remat.plan",
        "version": 1,
        "model": workload.name,
        "device": str(workload.device),
        "solver": solver,
        "input_shapes": [list(t.shape) for t in inputs if isinstance(t, Tensor)],
        "loss": workload.loss_description,
        "budget": budget_text,
        "budget_bytes": planned.budget_bytes,
        "predicted_peak_bytes": planned.predicted_peak_bytes,
        "predicted_time_s": planned.predicted_time_s,
        "predicted_overhead": planned.overhead,
        "no_recompute_peak_bytes": report.baseline.peak_bytes + fixed,
        "forward_counts": list(planned.forward_counts),
        "kept_stages": [row.index for row in report.rows if row.kept],
        "schedule": report.to_dict(),
        "measured": {
            "peak_bytes": measurement.measured_peak_bytes,
            "fixed_bytes": fixed,
            "stage_calls": len(measurement.stages),
            "groups": [list(group) for group in measurement.groups],
        },
        "profile": measurement.profile.to_dict(),
    }


def _print_plan(document: dict[str, Any], output: _Output) -> None:
    from rich.table import Table

    from remat.memory import format_bytes
    from remat.plan.report import format_seconds

    stages = document["schedule"]["stages"]
    table = Table(
        title=f"recompute plan of {document['model']} ({len(stages)} planned stages)",
        title_justify="left",
    )
    for header, justify in (
        ("#", "right"),
        ("stage", "left"),
        ("forward", "right"),
        ("backward", "right"),
        ("output", "right"),
        ("saved", "right"),
        ("plan", "left"),
        ("forward runs", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for stage in stages:
        table.add_row(
            str(stage["index"]),
            stage["name"],
            format_seconds(stage["forward_time_s"]),
            format_seconds(stage["backward_time_s"]),
            format_bytes(stage["output_bytes"]),
            format_bytes(stage["saved_bytes"]),
            "kept" if stage["kept"] else "[yellow]recomputed[/yellow]",
            str(stage["forward_runs"]),
        )
    output.out.print(table)
    budget = document["budget_bytes"]
    requested = document["budget"] or "the free device memory"
    peak = document["predicted_peak_bytes"]
    fixed = document["measured"]["fixed_bytes"]
    lines = [
        f"input {', '.join(str(tuple(s)) for s in document['input_shapes'])} on {document['device']}; "
        f"loss: {document['loss']}; solver {document['solver']}",
        f"budget:              {_bytes_and_mib(budget)}, from {requested}" if budget is not None else "budget: none",
        f"predicted peak:      {_bytes_and_mib(peak)}"
        + (f", of which {format_bytes(fixed)} held outside the chain" if fixed else ""),
        f"without recompute:   {_bytes_and_mib(document['no_recompute_peak_bytes'])}",
        f"predicted overhead:  {document['predicted_overhead'] * 100:.1f}% "
        f"(predicted step {format_seconds(document['predicted_time_s'])})",
        f"recomputed stages:   {sum(1 for s in stages if not s['kept'])} of {len(stages)}, "
        f"{sum(s['forward_runs'] - 1 for s in stages)} extra stage forwards per step",
    ]
    for line in lines:
        output.text(line)


def _command_plan(args: argparse.Namespace, output: _Output) -> int:
    if args.budget is not None:
        _check_budget(args.budget, allow_min=False)
    device = _resolve_device(args.device)
    workload = load_workload(args.model, batch=args.batch, input_shape=args.input_shape, device=device)
    wrapper, inputs = _measure(workload, args.solver, output)
    try:
        planned = wrapper.compute_sequence(_budget_value(args.budget))
    except BudgetTooSmall as error:
        _fail(EXIT_BUDGET_TOO_SMALL, _minimum_message(error, workload.name))
    except InvalidBudget as error:
        _fail(EXIT_BAD_BUDGET, str(error))
    document = _plan_document(workload, planned, inputs, args.budget, args.solver)
    if args.json:
        output.raw(json.dumps(document, indent=2))
    else:
        _print_plan(document, output)
    return EXIT_OK


# ---------------------------------------------------------------------- bench
def _parse_budgets(text: str) -> list[Any]:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        _fail(EXIT_BAD_BUDGET, f"--budgets {text!r} lists no budget")
    budgets: list[Any] = []
    for item in items:
        _check_budget(item, allow_min=True)
        budgets.append("min" if item.lower() == "min" else _budget_value(item))
    return budgets


def _run_bench(
    workload: Workload,
    output: _Output,
    *,
    budgets: list[Any],
    steps: int,
    warmup: int,
    threads: int | None,
    solver: str,
) -> BenchmarkResult:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from remat.bench.runner import run_benchmark

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=output.err,
        transient=True,
    ) as progress:
        task = progress.add_task(f"bench {workload.name}", total=None)

        def report(done: int, total: int, label: str) -> None:
            progress.update(task, completed=done, total=total, description=f"bench {workload.name}: {label}")

        with _model_failures(f"{workload.name} failed while training"):
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
            )


def _print_bench(result: BenchmarkResult, output: _Output) -> None:
    from rich.table import Table

    from remat.bench.runner import format_row

    meta = result.metadata
    table = Table(
        title=(
            f"{meta['model']}: {meta['n_stages']} stages ({meta['n_planned_stages']} planned), "
            f"{meta['device']}, {meta['threads']} thread{'' if meta['threads'] == 1 else 's'}, "
            f"median of {meta['steps']} steps"
        ),
        title_justify="left",
    )
    for header, justify in (
        ("strategy", "left"),
        ("budget", "right"),
        ("measured peak", "right"),
        ("predicted peak", "right"),
        ("fits", "center"),
        ("median step", "right"),
        ("overhead", "right"),
        ("predicted overhead", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for row in result.rows:
        cells = format_row(row)
        fits = cells["fits"]
        if row.fits_budget is False or row.error is not None:
            fits = f"[red]{fits}[/red]"
        table.add_row(
            cells["strategy"],
            cells["budget"],
            cells["measured_peak"],
            cells["predicted_peak"],
            fits,
            cells["median_step"],
            cells["overhead"],
            cells["predicted_overhead"],
        )
    output.out.print(table)
    for row in result.rows:
        if row.error is not None:
            output.text(f"{row.strategy}: {row.error}")
    output.text(
        "peaks: exact live activation bytes of one step (parameter gradients excluded); "
        "overhead: median step time / no recompute's; steps timed in interleaved rounds"
    )


def _write(path: Path, write: Callable[[Path], Any], output: _Output, what: str) -> None:
    try:
        if path.parent and not path.parent.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as error:
        _fail(EXIT_CANNOT_WRITE, f"cannot write {what} {str(path)!r}: {error.strerror or error}")
    output.text(f"wrote {what} {path}")


def _save_outputs(
    result: BenchmarkResult,
    output: _Output,
    *,
    json_path: Path | None,
    markdown_path: Path | None,
    plot_path: Path | None,
) -> None:
    from remat.bench.runner import save_plot

    if json_path is not None:
        _write(json_path, lambda p: p.write_text(result.to_json() + "\n", encoding="utf-8"), output, "JSON")
    if markdown_path is not None:
        _write(markdown_path, lambda p: p.write_text(result.to_markdown(), encoding="utf-8"), output, "Markdown")
    if plot_path is not None:
        _write(plot_path, lambda p: save_plot(result, p), output, "figure")


def _command_bench(args: argparse.Namespace, output: _Output) -> int:
    budgets = _parse_budgets(args.budgets)
    if args.plot is not None:
        _require_matplotlib()
    device = _resolve_device(args.device)
    workload = load_workload(args.model, batch=args.batch, input_shape=args.input_shape, device=device)
    result = _run_bench(
        workload,
        output,
        budgets=budgets,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        solver=args.solver,
    )
    _print_bench(result, output)
    _save_outputs(result, output, json_path=args.json, markdown_path=args.markdown, plot_path=args.plot)
    return EXIT_OK


def _command_demo(args: argparse.Namespace, output: _Output) -> int:
    _require_matplotlib()
    start = time.perf_counter()
    device = torch.device("cpu")
    workload = load_workload(_DEMO_MODEL, batch=_DEFAULT_BATCH, input_shape=None, device=device)
    result = _run_bench(
        workload,
        output,
        budgets=_parse_budgets(_DEMO_BUDGETS),
        steps=args.steps,
        warmup=1,
        threads=args.threads,
        solver="optimal",
    )
    result.metadata["batch"] = _DEFAULT_BATCH
    _print_bench(result, output)
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


_COMMANDS: dict[str, Callable[[argparse.Namespace, _Output], int]] = {
    "models": _command_models,
    "plan": _command_plan,
    "bench": _command_bench,
    "demo": _command_demo,
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
        output = _Output()
        return _COMMANDS[args.command](args, output)
    except CliError as error:
        if debug:
            raise
        _error_line(error.message)
        return error.code
    except KeyboardInterrupt:
        _error_line("interrupted")
        return EXIT_INTERRUPTED
    except BudgetTooSmall as error:
        if debug:
            raise
        _error_line(
            f"the budget {_bytes_and_mib(error.budget_bytes)} is below the minimum feasible budget "
            f"{_bytes_and_mib(error.minimum_bytes)}"
        )
        return EXIT_BUDGET_TOO_SMALL
    except InvalidBudget as error:
        if debug:
            raise
        _error_line(str(error))
        return EXIT_BAD_BUDGET
    except RematError as error:
        if debug:
            raise
        _error_line(f"{type(error).__name__}: {error}")
        return EXIT_UNSUPPORTED_MODEL
    except (MemoryError, RuntimeError) as error:
        if debug or not _is_out_of_memory(error):
            raise
        _error_line(f"out of memory: {_first_line(error)}; try a smaller --batch or another --device")
        return EXIT_OUT_OF_MEMORY


def _error_line(message: str) -> None:
    sys.stderr.write(f"remat: error: {' '.join(message.split())}\n")
    sys.stderr.flush()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
