"""Loading the model named on the command line: a catalogue name or ``package.module:function``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from remat.cli.codes import (
    EXIT_BAD_MODEL,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_UNKNOWN_MODEL,
    EXIT_USAGE,
    CliError,
    fail,
)
from remat.errors import RematError

if TYPE_CHECKING:
    from remat.cli.render import Output
    from remat.models import ModelSpec

__all__ = [
    "DEFAULT_BATCH",
    "Workload",
    "command_models",
    "first_line",
    "is_out_of_memory",
    "load_workload",
    "measure_workload",
    "model_failures",
]

DEFAULT_BATCH = 16


@dataclass
class Workload:
    """A model ready to measure, with its batch and loss.

    Attributes:
        name: the model's name (a catalogue name, the factory's ``module:function``, or
            ``hf:ARCHITECTURE``).
        model: the model, on its device, in training mode.
        make_batch: ``() -> (inputs, target)``; the same batch at every call. The inputs
            are a tuple (``model(*inputs)``) or a dict of keyword inputs (``model(**inputs)``).
        loss_fn: ``(output, target) -> loss``.
        loss_description: the loss in words, for reports.
        device: where the model and the batch live.
    """

    name: str
    model: nn.Module
    make_batch: Callable[[], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], Tensor]
    loss_description: str
    device: torch.device

    def measurement_loss(self, target: Any) -> Callable[[Any], Tensor]:
        """The ``loss_fn(output) -> loss`` that :class:`~remat.Checkpointable` measures with."""
        return lambda output: self.loss_fn(output, target)


def _sum_loss(output: Any, target: Any) -> Tensor:
    """The default loss of a user's model: the loss its output carries (``output.loss``, a
    Hugging Face model's), else the sum of every floating-point output."""
    from remat.measure.losses import output_loss

    carried = output_loss(output)
    if carried is not None:
        return carried
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        fail(EXIT_BAD_MODEL, "the model's output has no floating-point tensor to train on")
    return sum((t.sum() for t in tensors[1:]), tensors[0].sum())


@contextlib.contextmanager
def model_failures(what: str) -> Iterator[None]:
    """Reports an error of the user's model as one line (exit 5); remat's own errors and
    running out of memory pass through to their own exit codes."""
    try:
        yield
    except (RematError, CliError):
        raise
    except Exception as error:
        if is_out_of_memory(error):
            raise
        fail(EXIT_BAD_MODEL, f"{what}: {type(error).__name__}: {first_line(error)}")


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, MemoryError):
        return True
    out_of_memory = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if out_of_memory is not None and isinstance(error, out_of_memory):
        return True
    if isinstance(error, RuntimeError) and not isinstance(error, RematError):
        text = str(error).lower()
        return any(phrase in text for phrase in ("out of memory", "can't allocate memory", "not enough memory"))
    return False


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def resolve_device(text: str) -> torch.device:
    device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(EXIT_USAGE, f"--device {text}: CUDA is not available on this machine")
    return device


def load_workload(
    model: str | None,
    *,
    batch: int | None,
    input_shape: tuple[int, ...] | None,
    device: torch.device,
    hf: str | None = None,
    hf_config: Sequence[str] = (),
    meta: bool = False,
) -> Workload:
    """Builds the model named on the command line, with its synthetic batch and loss.

    Args:
        model: a catalogue name or ``package.module:function`` (None with `hf`).
        batch: the batch size (None: the default, or the factory's sample input).
        input_shape: the shape of one sample for a factory's model.
        device: where to build the model and the batch.
        hf: a Hugging Face architecture, built from its config with random weights.
        hf_config: ``KEY=VALUE`` settings of that config.
        meta: build the model on the meta device (no memory: for planning from sizes
            alone); the batch is still on `device`.

    Raises:
        CliError: unknown name (3), a bad factory (5), out of memory (6), bad arguments (7).
    """
    if hf is not None or hf_config:
        if hf is None:
            fail(EXIT_USAGE, "--hf-config sets the config of --hf ARCHITECTURE; a MODEL has no config to set")
        if model is not None:
            fail(EXIT_USAGE, "give a MODEL or --hf ARCHITECTURE (with --hf-config for its settings), not both")
        if batch is not None or input_shape is not None:
            fail(EXIT_USAGE, "--batch and --input-shape are not for --hf: the architecture's sample input fixes them")
        return _hugging_face_workload(hf, hf_config, device, meta)
    if model is None:
        fail(EXIT_USAGE, "give a MODEL (a name from `remat models`, or package.module:function) or --hf ARCHITECTURE")
    if ":" in model:
        return _load_factory(model, batch=batch, input_shape=input_shape, device=device, meta=meta)
    from remat.models import CATALOGUE

    spec = CATALOGUE.get(model)
    if spec is None:
        known = ", ".join(sorted(CATALOGUE))
        fail(
            EXIT_UNKNOWN_MODEL,
            f"unknown model {model!r}; choose one of: {known} (or give package.module:function)",
        )
    if input_shape is not None:
        fail(EXIT_USAGE, f"--input-shape is for a factory's model; {model} has its own input")
    return _catalogue_workload(spec, batch or DEFAULT_BATCH, device, meta)


def _catalogue_workload(spec: ModelSpec, batch: int, device: torch.device, meta: bool) -> Workload:
    torch.manual_seed(0)
    built = _build(spec.factory, spec.name, device, meta)
    batch_size = batch

    def make_batch() -> tuple[tuple[Any, ...], Any]:
        torch.manual_seed(1)
        return spec.make_batch(batch_size, device)

    return Workload(spec.name, built, make_batch, spec.loss_fn, f"{spec.name}'s own loss on synthetic data", device)


def _hugging_face_workload(name: str, settings: Sequence[str], device: torch.device, meta: bool) -> Workload:
    try:
        import transformers  # noqa: F401

        from remat.models import hugging_face_model
    except ImportError:
        fail(EXIT_USAGE, "--hf needs transformers: pip install 'remat[hf]'")
    config: dict[str, Any] = {}
    for setting in settings:
        for item in _settings(setting):
            key, equals, text = item.partition("=")
            if not equals or not key.strip():
                fail(EXIT_USAGE, f"--hf-config {item!r}: give KEY=VALUE, e.g. num_hidden_layers=4")
            try:
                value: Any = ast.literal_eval(text.strip())
            except (ValueError, SyntaxError):
                value = text.strip()
            config[key.strip()] = value
    try:
        factory, kwargs = hugging_face_model(name, **config)
    except KeyError as error:
        fail(EXIT_UNKNOWN_MODEL, str(error.args[0]))
    except Exception as error:  # the config's own checks (a value of the wrong type)
        said = " ".join(str(error).split())
        fail(EXIT_USAGE, f"--hf-config: {name}'s config refused the settings: {said[:400] or type(error).__name__}")
    torch.manual_seed(0)
    with model_failures(f"building {name} from its config"):
        built = _build(factory, f"hf:{name}", device, meta)
    inputs = {key: value.to(device) for key, value in kwargs.items()}
    return Workload(
        f"hf:{name}", built, lambda: (inputs, None), _sum_loss, "the model's own loss (from labels)", device
    )


def _settings(text: str) -> list[str]:
    """``KEY=VALUE`` items separated by commas, but for those inside brackets or quotes
    (``depths=[1,1,1,1],hidden_act='gelu'``)."""
    items: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for character in text:
        if quote:
            quote = "" if character == quote else quote
        elif character in "'\"":
            quote = character
        elif character in "([{":
            depth += 1
        elif character in ")]}":
            depth -= 1
        elif character == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(character)
    items.append("".join(current))
    return [item for item in items if item.strip()]


def _build(factory: Callable[[], Any], name: str, device: torch.device, meta: bool) -> nn.Module:
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            built = factory()
        if isinstance(built, nn.Module):
            built = (built if meta else built.to(device)).train()
    except Exception as error:
        if is_out_of_memory(error):
            fail(EXIT_OUT_OF_MEMORY, f"out of memory building {name} on {device}: {first_line(error)}")
        raise
    return built


def _load_factory(
    text: str, *, batch: int | None, input_shape: tuple[int, ...] | None, device: torch.device, meta: bool
) -> Workload:
    module_name, _, attribute = text.partition(":")
    if not module_name or not attribute:
        fail(EXIT_BAD_MODEL, f"{text!r} is not package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        fail(EXIT_BAD_MODEL, f"cannot import {module_name!r}: {type(error).__name__}: {first_line(error)}")
    factory: Any = module
    try:
        for part in attribute.split("."):
            factory = getattr(factory, part)
    except AttributeError:
        fail(EXIT_BAD_MODEL, f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        fail(EXIT_BAD_MODEL, f"{text} is a {type(factory).__name__}, not a function returning an nn.Module")
    try:
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            result = factory()
    except CliError:
        raise
    except Exception as error:
        if is_out_of_memory(error):
            fail(EXIT_OUT_OF_MEMORY, f"out of memory building {text}: {first_line(error)}")
        fail(EXIT_BAD_MODEL, f"{text}() raised {type(error).__name__}: {first_line(error)}")
    sample: Any = None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, sample = result
    if not isinstance(result, nn.Module):
        fail(
            EXIT_BAD_MODEL,
            f"{text}() returned {type(result).__name__}; it must return an nn.Module or a "
            "tuple (nn.Module, sample_input)",
        )
    model = _build(lambda: result, text, device, meta)
    inputs = _factory_inputs(text, sample, batch=batch, input_shape=input_shape, device=device)
    fixed_inputs = inputs
    return Workload(text, model, lambda: (fixed_inputs, None), _sum_loss, "the output's own loss, else its sum", device)


def _factory_inputs(
    text: str, sample: Any, *, batch: int | None, input_shape: tuple[int, ...] | None, device: torch.device
) -> tuple[Any, ...]:
    """The inputs of a factory's model: random of ``input_shape``, or its own sample input."""
    if input_shape is not None:
        shape = (batch or DEFAULT_BATCH, *input_shape)
        torch.manual_seed(1)
        return (torch.randn(shape, device=device),)
    elif sample is not None:
        if batch is not None:
            fail(
                EXIT_USAGE, f"{text}() gives a sample input, which fixes the batch; drop --batch or give --input-shape"
            )
        leaves = sample if isinstance(sample, tuple) else (sample,)
        if not leaves or not all(isinstance(t, Tensor) for t in leaves):
            fail(EXIT_BAD_MODEL, f"{text}() returned a sample input that is not a tensor or a tuple of tensors")
        # (a sample made on the meta device, with the model: zeros of its shapes)
        return tuple(torch.zeros_like(t, device=device) if t.is_meta else t.to(device) for t in leaves)
    else:
        fail(
            EXIT_USAGE,
            f"{text}() returns no sample input: give --input-shape, e.g. --input-shape 3,32,32 "
            "for inputs of shape (batch, 3, 32, 32)",
        )


def parameter_count(spec: ModelSpec) -> int | None:
    from remat.models import count_parameters

    try:
        with torch.device("meta"):
            return count_parameters(spec.factory())
    except Exception:
        try:
            return count_parameters(spec.factory())
        except Exception:
            return None


def human_count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def measure_workload(
    workload: Workload,
    solver: str,
    output: Output,
    *,
    nested: bool,
    estimate: bool = False,
    policies: list[Any] | None = None,
    elementwise: bool = False,
) -> tuple[Any, Any]:
    """A ``Checkpointable`` of the workload's model measured on its batch, and that batch.

    With `estimate`, nothing runs the model for real (see ``measure="estimated"``). With
    `policies`, its plans may store stages under them (their options are sized too).
    """
    from remat.automatic import Checkpointable
    from remat.bench.runner import call_with
    from remat.cli.progress import measuring_progress

    inputs, target = workload.make_batch()
    loss_fn = workload.measurement_loss(target)
    how = "estimated" if estimate else "sized"
    # (a budget makes the policies store options; plans for other budgets come from plan_for)
    budget, policy = (1.0, policies) if policies else (None, None)
    # The command's steps drop the output once the loss is computed, as remat bench's do (output_kept=False)
    wrapper = Checkpointable(
        workload.model, budget, solver=solver, loss_fn=loss_fn, nested=nested, measure=how, policy=policy,
        elementwise=elementwise, output_kept=False,
    )  # fmt: skip
    with measuring_progress(workload.name, output) as progress:
        with model_failures(f"{workload.name} failed on its input {_shapes(inputs)}"):
            if not estimate:
                warm_up(workload, inputs, target)
            progress("finding the chain of stages")
            call_with(wrapper.measure, inputs)
    return wrapper, inputs


THREADS_HELP = "pin torch's thread count (steadier stage timings, and so plans, on a busy machine)"


def pin_threads(threads: int | None) -> None:
    """``--threads``: torch's thread count for the command, when given."""
    if threads is not None:
        if threads < 1:
            fail(EXIT_USAGE, f"--threads must be a positive integer, got {threads}")
        torch.set_num_threads(threads)


def warm_up(workload: Workload, inputs: tuple[Any, ...], target: Any) -> None:
    """Runs one training step and puts the model back: first-call costs (an enabled model's
    measuring) stay out of the timings and of what ``remat explain`` sees."""
    from remat.bench.runner import call_with

    model = workload.model
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    workload.loss_fn(call_with(model, inputs), target).backward()
    for parameter in model.parameters():
        parameter.grad = None
    model.load_state_dict(state)


def _shapes(inputs: Any) -> str:
    from remat.bench.runner import input_tensors

    shapes = [tuple(t.shape) for t in input_tensors(inputs)]
    return ", ".join(str(s) for s in shapes) or "()"


def command_models(args: argparse.Namespace, output: Output) -> int:
    """``remat models``: the catalogue, with parameter counts."""
    from rich.table import Table

    from remat.models import CATALOGUE

    table = Table(title="remat models", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for name, spec in CATALOGUE.items():
        table.add_row(name, human_count(parameter_count(spec)), spec.description)
    output.out.print(table)
    output.text("Use a name with `remat plan NAME` or `remat bench NAME`, or give package.module:function.")
    return EXIT_OK
