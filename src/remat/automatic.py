"""``remat.Checkpointable``: the optimal recompute schedule for a model, under a byte budget."""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Hashable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.discover.chain import Chain, discover_chain
from remat.errors import BudgetTooSmall
from remat.execute import ChainExecutor, expand_groups
from remat.measure import ChainMeasurement, measure_chain
from remat.memory import parse_budget
from remat.plan.schedule import Schedule
from remat.plan.simulate import simulate
from remat.plan.solvers import get_solver, numba_available

__all__ = ["Checkpointable", "PlannedChain"]

logger = logging.getLogger("remat")

#: Fraction of the budget kept free when the prediction is not exact by construction.
DEFAULT_MARGIN = 0.02

#: Without a loss_fn, the loss is assumed to hold this many tensors of the output's size.
LOSS_ALLOWANCE = 3


@dataclass
class PlannedChain:
    """A measured chain with its plan: what :meth:`Checkpointable.compute_sequence` returns.

    Printing it shows the plan: budget, predicted peak, predicted step time and overhead,
    and a per-stage table. The whole-step figures add the memory held outside the chain
    (``fixed_bytes``: the prefix's activations for a model that is not a plain Sequential).

    Attributes:
        schedule: the solver's schedule over the grouped stages (the chain's own figures).
        measurement: the measured figures it was planned from.
        budget_bytes: the whole-step activation budget.
        predicted_peak_bytes: predicted peak activation memory of a training step.
        fixed_bytes: memory held outside the chain's schedule through the step (the
            prefix's activations, outputs that escape the chain, the kept model output).
    """

    schedule: Schedule
    measurement: ChainMeasurement
    budget_bytes: int | None
    predicted_peak_bytes: int
    fixed_bytes: int = 0

    @property
    def predicted_time_s(self) -> float:
        """Predicted time of the chain's forward and backward, recomputations included."""
        return self.schedule.predicted_time_s

    @property
    def overhead(self) -> float:
        """Predicted extra time over no recompute, as a fraction (0.25 = 25% slower)."""
        base = self.measurement.profile.total_time_s
        return self.schedule.overhead_s / base if base > 0 else 0.0

    @property
    def forward_counts(self) -> tuple[int, ...]:
        """How many times each planned stage's forward runs per step."""
        return self.schedule.forward_counts

    def __str__(self) -> str:
        # The report above is the chain's schedule, planned within what the whole-step
        # budget leaves after the planning margin and the memory held outside the chain.
        from remat.memory import format_bytes

        budget = "unlimited" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"{self.schedule}\nwhole step: budget {budget}, predicted peak "
            f"{format_bytes(self.predicted_peak_bytes)} (memory held outside the chain's "
            f"schedule: {format_bytes(self.fixed_bytes)})"
        )


class Checkpointable(nn.Module):
    """Wraps a model and trains it with the fastest recompute schedule that fits a budget.

    The model is an ``nn.Sequential`` (nested Sequentials are flattened into one chain)
    or any module whose forward runs a chain of blocks (see :func:`remat.chain.discover_chain`).
    In training mode with gradients enabled, the forward runs the planned schedule; in
    eval mode or under ``torch.no_grad()`` it is the model's plain forward.

    The first training call measures the model on its inputs (unless :meth:`measure` was
    called), solves, and caches the plan for that input signature (shapes, dtypes,
    devices); a new signature measures and plans again.

    Args:
        model: the model to wrap (registered as ``self.model``).
        mem_limit: the activation memory budget of a training step: bytes (int), a string
            with a unit ("512MiB", "1.5GB"), a fraction in (0, 1] of the activation memory
            without recompute, or None for the memory the device has free (minus a margin).
        solver: a solver name from :func:`remat.plan.available_solvers` (default "optimal").
        slots: memory slots of the dynamic program; None picks as many as keep the solve
            well under a second (500 for 200 stages, up to 20000 for short chains), so
            that rounding sizes up to slots wastes little of the budget.
        preserve_rng_state: replay RNG states in recomputed stages (exact dropout).
        loss_fn: ``loss_fn(output) -> loss`` used during measurement, e.g.
            ``lambda out: F.cross_entropy(out, target)``. Without it, remat measures with a
            sum and leaves room for a loss holding ``LOSS_ALLOWANCE`` (3) tensors of the
            output's size (see NOTE [loss allowance]); with it, the plan is exact.
        margin: fraction of the budget kept free when planning (see NOTE [planning margin]);
            None: 0 for an ``nn.Sequential`` measured with your ``loss_fn`` (predicted to
            the byte), otherwise ``DEFAULT_MARGIN`` (2%).
        output_kept: whether the training loop keeps the model's output alive through the
            backward (``outputs = model(x); outputs.loss.backward()``, the Hugging Face
            style). True is safe either way; set False when the loss is computed in one
            expression (``loss_fn(model(x), y).backward()``) for a tighter plan.
        frugal_measure: measure with the stages recomputed in segments of about sqrt(n),
            in a fraction of the memory of a plain step, for a model that does not fit
            without recompute (see NOTE [frugal measurement]); its predictions err a little
            more on the safe side.

    .. warning::
       The forward must run the chain's stages once each, in the same order, at every
       training call, and must not keep references to the outputs of stages other than
       the last (e.g. a list of all hidden states): remat frees them, and a model that
       keeps them uses more memory than planned.
    """

    def __init__(
        self,
        model: nn.Module,
        mem_limit: int | float | str | None = None,
        *,
        solver: str = "optimal",
        slots: int | None = None,
        preserve_rng_state: bool = True,
        loss_fn: Any = None,
        margin: float | None = None,
        output_kept: bool = True,
        frugal_measure: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"Checkpointable wraps an nn.Module, got {type(model).__name__}")
        self.model = model
        parse_budget(mem_limit, reference_bytes=1)  # fail now on a budget in no accepted form
        self.mem_limit = mem_limit
        self.solver_name = solver
        self.slots = slots
        self.preserve_rng_state = preserve_rng_state
        self._loss_fn = loss_fn
        self._chains: dict[Hashable, Chain] = {}
        self._measurements: dict[Hashable, ChainMeasurement] = {}
        self._plans: dict[tuple[Hashable, Any], tuple[PlannedChain, ChainExecutor]] = {}
        self._last_key: Hashable | None = None
        if margin is not None and not 0.0 <= margin < 0.5:
            raise ValueError(f"margin is a fraction of the budget in [0, 0.5), got {margin}")
        self._margin_option = margin
        self.output_kept = output_kept
        self.frugal_measure = frugal_measure
        self._solver()  # fail now on an unknown solver name

    # ------------------------------------------------------------------ public
    def measure(self, *sample_inputs: Any, **sample_kwargs: Any) -> ChainMeasurement:
        """Measures every stage on these inputs (one step, plus one untracked for times).

        The model is left as it was: parameters, ``.grad``, buffers and RNG states.
        """
        key = _signature(sample_inputs, sample_kwargs)
        chain = self._chain_for(key, sample_inputs, sample_kwargs)
        try:
            measurement = measure_chain(
                self.model, chain, sample_inputs, sample_kwargs, loss_fn=self._loss_fn, frugal=self.frugal_measure
            )
        except torch.OutOfMemoryError:
            if self.frugal_measure:
                raise
            # A plain step does not fit the device: measure frugally instead (the model,
            # its gradients and buffers were put back as they were).
            warnings.warn(
                "remat: a plain training step does not fit in memory; measuring with recompute "
                "instead (frugal_measure=True)",
                RuntimeWarning,
                stacklevel=2,
            )
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            measurement = measure_chain(
                self.model, chain, sample_inputs, sample_kwargs, loss_fn=self._loss_fn, frugal=True
            )
        self._measurements[key] = measurement
        self._last_key = key
        logger.info("remat measured %d stages (%d planned stages)", len(chain), measurement.profile.n_stages)
        return measurement

    def compute_sequence(self, mem_limit: int | float | str | None | object = ...) -> PlannedChain:
        """Solves for the last measured input signature and returns the printable plan.

        Args:
            mem_limit: a budget in any accepted form; default: the one given at construction.

        Raises:
            BudgetTooSmall: no schedule fits; ``.minimum_bytes`` is the smallest budget that does.
        """
        if self._last_key is None:
            raise RuntimeError("call measure(*sample_inputs) (or run a training step) before compute_sequence()")
        return self._plan(self._last_key, self.mem_limit if mem_limit is ... else mem_limit)[0]

    @property
    def plan(self) -> PlannedChain | None:
        """The plan of the most recent training call, if any."""
        if self._last_key is None:
            return None
        cached = self._plans.get((self._last_key, self._plan_key(self.mem_limit)))
        return None if cached is None else cached[0]

    def _plan_key(self, mem_limit: Any) -> str:
        # Everything a plan depends on besides the measurement: changing an option after a
        # first plan gives a new plan, not the cached one.
        return repr((mem_limit, self.solver_name, self.slots, self._margin_option, self.output_kept))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        key = _signature(args, kwargs)
        if key not in self._measurements:
            self.measure(*args, **kwargs)
        self._last_key = key
        _planned, executor = self._plan(key, self.mem_limit)
        return executor(self.model, args, kwargs)

    # ------------------------------------------------------------------ internals
    @property
    def margin(self) -> float:
        """The planning margin in use for the last measured input (see ``margin`` above)."""
        if self._last_key is None or self._last_key not in self._chains:
            return self._margin_option if self._margin_option is not None else DEFAULT_MARGIN
        return self._margin(self._last_key)

    def _margin(self, key: Hashable) -> float:
        if self._margin_option is not None:
            return self._margin_option
        # An nn.Sequential measured with the real loss is predicted to the byte; anything
        # with parts outside the chain, or measured with the default loss, keeps a margin.
        exact = self._chains[key].whole_model and self._loss_fn is not None
        return 0.0 if exact else DEFAULT_MARGIN

    def _solver(self, n_stages: int = 1) -> Any:
        if self.solver_name in ("optimal", "auto"):
            return get_solver(self.solver_name, slots=self._slots_for(n_stages))
        return get_solver(self.solver_name)

    def _slots_for(self, n_stages: int) -> int:
        if self.slots is not None:
            return self.slots
        if not numba_available():
            return 500
        # The dynamic program costs about n^3 * slots; 200 stages x 500 slots solve in a
        # fraction of a second, so shorter chains can afford finer memory.
        return int(min(20000, max(500, 200**3 * 500 // max(1, n_stages) ** 3)))

    def _chain_for(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Chain:
        chain = self._chains.get(key)
        if chain is None:
            if isinstance(self.model, nn.Sequential):
                chain = discover_chain(self.model, args, kwargs)
            else:
                from remat.measure import preserved_model_state

                devices = [p.device for p in self.model.parameters()]
                with preserved_model_state(self.model, devices):
                    chain = discover_chain(self.model, args, kwargs)
            self._chains[key] = chain
        return chain

    def _plan(self, key: Hashable, mem_limit: Any) -> tuple[PlannedChain, ChainExecutor]:
        budget_key = self._plan_key(mem_limit)
        cached = self._plans.get((key, budget_key))
        if cached is not None:
            return cached
        measurement = self._measurements[key]
        profile = measurement.profile
        fixed = measurement.fixed_bytes
        if self._loss_fn is None:
            # NOTE [loss allowance]
            # Measured with the cheapest loss (a sum), the plan would not leave room for a
            # real one: a cross entropy or a mean squared error holds about three tensors
            # of the output's size at its peak. Without the user's loss_fn, the chain's
            # output gradient is charged that much more (it is live from the loss to the
            # end of the last stage's backward).
            gradients = list(profile.gradient_bytes)
            gradients[-1] += LOSS_ALLOWANCE * measurement.output_bytes
            profile = dataclasses.replace(profile, gradient_bytes=tuple(gradients))
        if self.output_kept:
            # The loss was measured with the output dropped once the loss is computed; a
            # loop that keeps it holds it through the whole step on top (counted twice at
            # the loss itself, which errs on the safe side).
            fixed += measurement.output_bytes
        store_all = simulate(profile, get_solver("none")(profile, None).items)
        reference = store_all.peak_bytes + fixed
        device = profile.metadata.get("device", "cpu")
        budget = parse_budget(mem_limit, reference_bytes=reference, device=device)
        # NOTE [planning margin]
        # The plan must fit with a margin for what per-stage measurement cannot attribute
        # (the model's own code around the chain, a real loss heavier than the default
        # one measured): the chain is planned for (1 - margin) of the budget, less the
        # fixed memory. A Sequential measured with the real loss has nothing unattributed.
        margin = self._margin(key)

        def chain_budget_of(total: int) -> int:
            return int(total * (1.0 - margin)) - fixed

        chain_budget = chain_budget_of(budget)
        solver = self._solver(profile.n_stages)
        try:
            if chain_budget <= 0:
                raise BudgetTooSmall("", budget_bytes=chain_budget, minimum_bytes=0)
            else:
                schedule = solver(profile, chain_budget)
        except BudgetTooSmall:
            needed = _minimum_budget(solver, profile)
            minimum = math.ceil((needed + fixed) / (1.0 - margin))
            # The smallest budget whose chain budget is `needed`, whatever the float rounding.
            while chain_budget_of(minimum) < needed:
                minimum += 1
            while minimum > 1 and chain_budget_of(minimum - 1) >= needed:
                minimum -= 1
            from remat.memory import format_bytes

            raise BudgetTooSmall(
                f"no recompute schedule fits a budget of {budget} bytes ({format_bytes(budget)}); the "
                f"smallest feasible budget for this model and input is {minimum} bytes "
                f"({format_bytes(minimum)}). Raise mem_limit to at least that, or use a smaller batch",
                budget_bytes=budget,
                minimum_bytes=minimum,
            ) from None
        planned = PlannedChain(schedule, measurement, budget, schedule.predicted_peak_bytes + fixed, fixed)
        chain = self._chains[key]
        executor = ChainExecutor(
            chain, expand_groups(schedule.items, measurement.groups), preserve_rng_state=self.preserve_rng_state
        )
        self._plans[(key, budget_key)] = (planned, executor)
        return planned, executor


def _minimum_budget(solver: Any, profile: Any) -> int:
    try:
        solver(profile, 1)
    except BudgetTooSmall as error:
        return error.minimum_bytes
    return 1


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    leaves, spec = tree_flatten((args, kwargs))
    parts: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, str(leaf.device), leaf.requires_grad))
        else:
            parts.append(repr(leaf))
    return tuple(parts)
