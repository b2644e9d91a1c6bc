"""Times from shapes alone: a cost model calibrated on the device, applied to a sized step.

A step sized on fake tensors (:mod:`remat.measure.fake`) knows every stage's bytes exactly,
and the tracker also counts what each stage computes (:class:`~remat.measure.instrument.Work`):
its floating-point operations, its operators and the bytes it allocates, forward and
backward. A :class:`CostModel` turns that work into seconds with three rates measured once
on the device:

    seconds = operations * call_s + flops / flops_per_s + allocated_bytes / bytes_per_s

one term for what every operator costs whatever its size (dispatch, autograd's records),
one for matrix products, convolutions and attention, one for the memory that elementwise
work writes and reads. It needs no run of the model, so it plans a model that does not
fit the machine (built on the meta device), or gives a first step before anything is
timed (``measure="estimated"``); the first real step then times the stages and replans.

NOTE [an estimate is only for time]
Only times are estimated: bytes come from the sized step, exact, so a plan made from an
estimate fits its budget like any other. A wrong estimate costs time (another schedule
would have been faster), never memory. The benchmark ``benchmarks/estimate.py`` measures
how much time, against plans from timed stages.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from remat.measure.assemble import ChainMeasurement
from remat.measure.instrument import Work

__all__ = ["CostModel", "Estimator", "calibrated_cost_model", "dominant_dtype", "estimated_times", "step_estimator"]

logger = logging.getLogger("remat")


@dataclass(frozen=True)
class CostModel:
    """Rates that turn a stage's work into seconds (see the module docstring).

    Attributes:
        device: where the rates were measured (``"cpu"``, ``"cuda:0"``), or a description
            of a stand-in.
        dtype: the floating dtype they were measured with.
        call_s: seconds of one operator call on a tiny tensor, with autograd recording it.
        flops_per_s: floating-point operations per second of a large matrix product.
        bytes_per_s: bytes per second that a large elementwise operator allocates and
            writes (reading its inputs included).
        product_side: the side of the square matrices the product rate was measured on
            (0 for a stand-in).
        addition_elements: the elements of the tensors the byte rate was measured on.
    """

    device: str
    dtype: str
    call_s: float
    flops_per_s: float
    bytes_per_s: float
    product_side: int = 0
    addition_elements: int = 0

    def __post_init__(self) -> None:
        for name in ("call_s", "flops_per_s", "bytes_per_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"a cost model's {name} is a positive finite number, got {value!r}")

    def seconds(self, work: Work) -> float:
        """The estimated seconds of `work`."""
        return work.operations * self.call_s + work.flops / self.flops_per_s + work.allocated_bytes / self.bytes_per_s

    def describe(self) -> str:
        """One line: the rates and where they come from."""
        sizes = (
            f" (products {self.product_side}x{self.product_side}, additions of {self.addition_elements} elements)"
            if self.product_side
            else ""
        )
        return (
            f"a cost model calibrated on {self.device} ({self.dtype}): {self.flops_per_s / 1e9:.1f} GFLOP/s, "
            f"{self.bytes_per_s / 1e9:.2f} GB/s, {self.call_s * 1e6:.1f} us per operator{sizes}"
        )


def estimated_times(measurement: ChainMeasurement, cost: CostModel) -> list[tuple[float, float]]:
    """Per stage of a sized `measurement`, (forward, backward) seconds from its work."""
    if not any(stage.forward_work.operations for stage in measurement.stages):
        raise ValueError("this measurement counted no work (a timing step); estimates need a tracked or sized step")
    return [(cost.seconds(stage.forward_work), cost.seconds(stage.backward_work)) for stage in measurement.stages]


def _median_s(run: Callable[[], object], synchronize: Callable[[], None], repeats: int) -> float:
    run()  # warm up: first-call costs stay out
    samples = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _power_of_two_at_most(value: float, low: int, high: int) -> int:
    """The largest power of two in [low, high] that is at most `value` (`low` if none)."""
    size = high
    while size > low and size > value:
        size //= 2
    return size


def _operator_on(
    shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, operator: Callable[..., torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """`operator` applied to two random tensors of `shape`, as a call without arguments.

    They are drawn from a generator of their own: a calibration runs inside the user's first
    step, whose random operations (dropout) must draw what they draw without remat."""
    generator = torch.Generator(device=device).manual_seed(0)
    first = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    second = torch.randn(shape, device=device, dtype=dtype, generator=generator)
    return lambda: operator(first, second)


@functools.lru_cache(maxsize=16)
def _calibrate(device: str, dtype: torch.dtype, threads: int, side: int, elements: int) -> CostModel:
    target = torch.device(device)
    cuda = target.type == "cuda"
    synchronize: Callable[[], None] = (lambda: torch.cuda.synchronize(target)) if cuda else (lambda: None)
    calls = 200
    one = torch.ones(1, device=target, dtype=dtype, requires_grad=True)
    other = torch.ones(1, device=target, dtype=dtype)

    def tiny_calls() -> None:
        for _ in range(calls):
            one * other

    call_s = _median_s(tiny_calls, synchronize, 5) / calls
    # one after the other: the product's tensors are gone before the addition's are made
    product_s = _median_s(_operator_on((side, side), target, dtype, torch.matmul), synchronize, 5)
    flops_per_s = 2 * side**3 / max(product_s - call_s, product_s / 2)
    add_s = _median_s(_operator_on((elements,), target, dtype, torch.add), synchronize, 5)
    bytes_per_s = elements * torch.empty((), dtype=dtype).element_size() / max(add_s - call_s, add_s / 2)
    return CostModel(str(target), str(dtype).removeprefix("torch."), call_s, flops_per_s, bytes_per_s, side, elements)


def calibrated_cost_model(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, max_bytes: int | None = None
) -> CostModel:
    """The cost model of `device` at `dtype`, measured once per process (and thread count).

    Takes a fraction of a second: tiny operator calls, a matrix product, a large addition.
    The product (up to 512 x 512 on the CPU, 4096 x 4096 on a GPU) and the addition (up to
    8 Mi elements, 64 Mi on a GPU: out of the caches, as large activations are) hold three
    tensors each at once; with `max_bytes` they are made smaller, to hold at most that.
    """
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type == "meta":
        raise ValueError("a cost model is measured on a real device (cpu, cuda), not on meta")
    cuda = target.type == "cuda"
    room = float("inf") if max_bytes is None else max_bytes / (3 * torch.empty((), dtype=dtype).element_size())
    side = _power_of_two_at_most(room**0.5, 8, 4096 if cuda else 512)
    elements = _power_of_two_at_most(room, 64, (64 if cuda else 8) * 2**20)
    return _calibrate(str(target), dtype, torch.get_num_threads(), side, elements)


def dominant_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The floating dtype holding the most elements among `tensors` (float32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=lambda dtype: counts[dtype]) if counts else torch.float32


class Estimator:
    """Estimated times for sized measurements: ``estimator(measurement)`` (see :func:`estimated_times`).

    NOTE [calibrating within the budget]
    The cost model is measured when the first measurement comes, with tensors no larger
    than what that step must hold anyway: every schedule holds, at some moment, a stage's
    whole saved tensors (at its backward) and a stage's whole output (when the next stage
    runs), so the largest of these is below every feasible budget, and calibrating within
    it keeps the first step within its budget, the calibration included. For a model of
    small stages, that is the bandwidth of the caches, and the estimate is too fast. An
    estimator that is not `bounded` (planning only: ``measure()``, ``remat plan --estimate``)
    uses the full sizes of :func:`calibrated_cost_model`.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, *, bounded: bool = True) -> None:
        self.device = device
        self.dtype = dtype
        self.bounded = bounded
        self.cost: CostModel | None = None

    def __call__(self, measurement: ChainMeasurement) -> list[tuple[float, float]]:
        held = None
        if self.bounded:
            held = max(
                (
                    max(sum(nbytes for nbytes, _ in s.saved_storages.values()), sum(s.output_storages.values()))
                    for s in measurement.stages
                ),
                default=0,
            )
        self.cost = calibrated_cost_model(self.device, self.dtype, max_bytes=held)
        logger.info("remat: the stages' times are %s", self.describe())
        return estimated_times(measurement, self.cost)

    def describe(self) -> str:
        """What the profile's ``metadata["times"]`` says of times from this estimator."""
        if self.cost is None:
            return "estimated from the sizes (no cost model measured yet)"
        return f"estimated from the sizes by {self.cost.describe()}"


def step_estimator(model: torch.nn.Module, device: torch.device, *, bounded: bool = True) -> Estimator:
    """The estimator of `model`'s step on `device`: its cost model at the autocast dtype if
    autocast is on there, else at the dtype of most of the model's floating parameters
    (`bounded`: see :class:`Estimator`)."""
    if torch.is_autocast_enabled(device.type):
        return Estimator(device, torch.get_autocast_dtype(device.type), bounded=bounded)
    return Estimator(device, dominant_dtype(list(model.parameters())), bounded=bounded)
