"""``remat.Checkpointable``: the optimal recompute schedule for a model, under a byte budget.

The automatic mode's steps meet here: :mod:`remat.discover` finds the chain of stages, :mod:`remat.measure`
profiles one training step, :mod:`remat.plan` solves within the budget, :mod:`remat.execute` runs it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
import warnings
from collections.abc import Hashable, Iterator
from types import EllipsisType
from typing import Any

import torch
from torch import nn

from remat.budget import MINIMUM, Budget, budget_too_small, parse_budget, warn_default_cpu_budget
from remat.discover.chain import Chain, discover_chain
from remat.execute import ChainExecutor, SelectiveRuns, expand_operations
from remat.manual._planned_scope import planned, planning
from remat.measure import ChainMeasurement, isolated_inputs, measure_chain, preserved_model_state
from remat.measure.estimate import step_estimator
from remat.measure.fake import FakeRunFailed, on_fake_tensors, refuse_meta_training
from remat.measure.options import named_policies, with_store_options
from remat.measure.parameters import holds_collectives, refuse_sharded_training
from remat.measure.real import measured_for_real
from remat.measure.scale import ShapeTimings, as_scaled_from
from remat.measure.step import measure_mode, measure_on_device, step_device
from remat.plan.check import StepCheck, checked_step
from remat.plan.elementwise import elementwise_stages, marked, planned_elementwise, refuse_other_plan
from remat.plan.key import PlanOptions, Setups, forget, signature, what_changed
from remat.plan.share import LOSS_ALLOWANCE_OUTPUTS, Planning, fastest, offload_option, prepared, taken_again
from remat.plan.solvers import OffloadingSolver, Solver, default_slots, get_solver
from remat.plan.step import Plan
from remat.ranks import RankAgreement, agreement_group_active
from remat.traced import TracedCalls
from remat.units import format_bytes
from remat.wrapper import (
    CACHE_TURNED_OFF,
    CallsInFlight,
    ModelStandIn,
    eager_under_compile,
    is_partial,
    model_own_call,
    partial_coverage,
    refuse_unmeasurable,
    stand_for_model,
    without_cache,
)

__all__ = ["DEFAULT_PLANNING_MARGIN", "LOSS_ALLOWANCE_OUTPUTS", "Checkpointable"]

logger = logging.getLogger("remat")

#: Fraction of the budget kept free when the prediction is not exact by construction.
DEFAULT_PLANNING_MARGIN = 0.02


class Checkpointable(ModelStandIn):
    """Wraps a model and trains it with the fastest recompute schedule that fits a budget.

    The model is an ``nn.Sequential`` (nested Sequentials are flattened into one chain)
    or any module whose forward runs a chain of blocks (see :func:`remat.discover.discover_chain`).
    In training mode with gradients enabled, the forward runs the planned schedule; in
    eval mode or under ``torch.no_grad()`` it is the model's plain forward.

    The first training call measures the model on its inputs (unless :meth:`measure` was
    called), solves, and caches the plan for everything that sets its costs (the inputs'
    shapes, dtypes and devices, which parameters require grad, their dtypes and devices,
    training modes, autocast; NOTE [what a plan depends on]); a change measures and plans
    again. The measuring itself stays within the budget (see ``measure``), so the first
    step fits as every later one does. A new input shape is sized exactly on fake tensors
    but timed only when needed (see ``timed_shapes``).

    The wrapper stands for the model: an attribute it does not have itself is the model's
    (``.config``, ``.generate``, ``.device``), and its ``state_dict`` has the model's keys,
    with no ``model.`` prefix, so checkpoints load into the model with or without the
    wrapper (``load_state_dict`` takes either form). To keep the model itself, use
    :func:`remat.enable` instead.

    Args:
        model: the model to wrap (registered as ``self.model``).
        mem_limit: the activation memory budget of a training step: bytes (int), a string
            with a unit ("512MiB", "1.5GB"), a fraction in (0, 1] of the activation memory
            without recompute (1.0 always fits: it plans no recompute), None for the memory
            the device has free (minus a margin),
            or ``"min"`` for the smallest feasible budget (see :mod:`remat.budget`).
        solver: a solver name from :func:`remat.plan.available_solvers` (default "optimal").
        slots: memory slots of the dynamic program; None picks as many as keep the solve well under a second
            (500 for 200 stages, up to 20000 for short chains): rounding sizes up to slots wastes little budget.
        preserve_rng_state: replay RNG states in recomputed stages (exact dropout).
        loss_fn: ``loss_fn(output) -> loss`` used during measurement, e.g.
            ``lambda out: F.cross_entropy(out, target)``. Without it, remat measures with a
            sum and leaves room for a loss holding ``LOSS_ALLOWANCE_OUTPUTS`` (3) tensors of
            the output's size (see NOTE [loss allowance] in
            :mod:`remat.plan.share`); with it, the plan is exact.
        margin: fraction of the budget kept free when planning (see NOTE [planning margin]);
            None: 0 for a model measured with your ``loss_fn`` outside autocast (predicted
            to the byte, or above), otherwise ``DEFAULT_PLANNING_MARGIN`` (2%).
        output_kept: whether the training loop keeps the model's output alive through the
            backward (``outputs = model(x); outputs.loss.backward()``, the Hugging Face
            style). True is safe either way; set False when the loss is computed in one
            expression (``loss_fn(model(x), y).backward()``) for a tighter plan.
        measure: how stages are measured (NOTE [measuring within the budget]):

            * ``"sized"`` (default): the bytes come from a step run on fake tensors (no
              device memory, exact sizes), the times from a pass that runs one planned
              stage at a time, forward and backward, whose memory is bounded before it
              runs: a budget it would not fit in raises :class:`~remat.BudgetTooSmall`
              with the figure. A model that cannot run on fake tensors (data-dependent
              shapes, ``.item()`` in its forward) is measured with a frugal step instead,
              with a warning (NOTE [measured for real when fake tensors fail]);
            * ``"plain"``: one plain training step (all activations stored) tracked byte
              for byte, and one more for the times;
            * ``"frugal"``: the same steps with every stage recomputed, in spans chosen from
              what each stage saves (see NOTE [frugal measurement]), sized as a plain step
              is.
            * ``"estimated"``: sized, with times estimated from each stage's work by a cost
              model calibrated on the device (:mod:`remat.measure.estimate`): nothing runs
              on the device before the first step, which trains on that plan; the next
              training step times the stages and plans again. A model built on the meta
              device (too large to hold) can be measured and planned this way.
        frugal_measure: deprecated; True selects the default (``measure="sized"``) and warns.
        nested: plan inside blocks too: a block whose submodules run one after another (a
            transformer block's norms, attention and MLP) is split into them, recursively, so
            that a plan keeps part of a block and recomputes the rest, down to what the largest
            indivisible call needs. More stages: measuring and solving take longer.
        plan: a plan to train with at every training call, without measuring or planning:
            a :class:`~remat.plan.Plan` or the path of one saved with ``plan.to_json()``
            (for production runs that must not change their schedule). It must plan this
            model's chain of stage calls; ``mem_limit`` is then not used.
        timed_shapes: with ``measure="sized"``, the most input shapes timed per setup (the
            same model and inputs but for their sizes: a sequence length, a last short
            batch). Every new shape is sized exactly on fake tensors, so its plan fits
            its budget; its times are scaled from the timed shape nearest in work (its
            flops: attention scales with the square of the sequence) unless that is more
            than twice or less than half of its own and timings are left. The first step
            at a scaled shape checks its forward's time and has the shape timed at the
            next step when it is off by more than that. ``measure_counts`` says how many
            shapes were timed and scaled.
        policy: without ``mem_limit`` or ``plan``, selective recompute instead of a plan: each stage
            call recomputed alone under it (:mod:`remat.policies`), or a mapping of stage names or
            indices to policies (others stored). With one, a policy or a list of them the planner
            may store any stage under, beside storing it whole or recomputing it (NOTE [stored under a policy]).
        agree_ranks: under ``torch.distributed`` (data parallel, FSDP2, tensor parallel),
            all ranks run one plan, from the figures of all ranks (NOTE [one plan for all ranks]); False: each its own.
        offload: plan offload to host memory beside store and recompute (NOTE [planning offload]):
            True measures the CUDA device's link to pinned host memory; a number of bytes per
            second plans as if the link were that fast (a stand-in). Pays only on an accelerator.
        comm: a recomputed stage's collectives (tensor parallelism): ``"recompute"`` runs them again;
            ``"auto"`` also lets the planner keep a stage's collective outputs and recompute the rest
            of it (the store option ``save_collectives``, and each ``policy=`` option with it),
            from their measured bytes and times (NOTE [planned collectives]).
        elementwise: each stored stage leaves what it saves and cheap elementwise operations
            can make again to backward (:func:`remat.recompute_elementwise`), and the plan is
            made with it (NOTE [elementwise saves in planned stages]).

    .. warning::
       The forward must run the chain's stages once each, in the same order, at every
       training call, and must not keep references to the outputs of stages other than
       the last (e.g. a list of all hidden states): remat frees them, and a model that
       keeps them uses more memory than planned.
    """

    def __init__(
        self,
        model: nn.Module,
        mem_limit: Budget = None,
        *,
        solver: str = "optimal",
        slots: int | None = None,
        preserve_rng_state: bool = True,
        loss_fn: Any = None,
        margin: float | None = None,
        output_kept: bool = True,
        measure: str = "sized",
        frugal_measure: bool = False,
        plan: Plan | str | os.PathLike[str] | None = None,
        timed_shapes: int = 3,
        policy: Any = None,
        nested: bool = False,
        agree_ranks: bool = True,
        offload: bool | float = False,
        comm: str = "recompute",
        elementwise: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"Checkpointable wraps an nn.Module, got {type(model).__name__}")
        self.model = model
        stand_for_model(self)
        if mem_limit != MINIMUM:
            parse_budget(mem_limit, reference_bytes=1)  # fail now on a budget in no accepted form
        self.mem_limit = mem_limit
        self.solver_name = solver
        self.offload = offload_option(offload, nested=bool(nested))
        self.slots = slots
        self.preserve_rng_state = preserve_rng_state
        self._loss_fn = loss_fn
        self._chains: dict[Hashable, Chain] = {}
        self._measurements: dict[Hashable, ChainMeasurement] = {}
        self._plans: dict[tuple[Hashable, PlanOptions], Plan] = {}
        self._executors: dict[tuple[Hashable, Plan], ChainExecutor] = {}
        self._forced_plan: Plan | None = Plan.pinned(plan)
        self._minimums: dict[tuple[Hashable, PlanOptions], list[int]] = {}
        self._last_key: Hashable | None = None
        self._setups = Setups()  # NOTE [setups kept]
        if margin is not None and not 0.0 <= margin < 0.5:
            raise ValueError(f"margin is a fraction of the budget in [0, 0.5), got {margin}")
        self._margin_option = margin
        self.output_kept = output_kept
        self.measure_mode = measure_mode(measure, frugal_measure)
        self._shapes = ShapeTimings(timed_shapes)
        self._cache_warned = self._default_budget_warned = self._coverage_warned = False
        self._traced = TracedCalls()  # NOTE [a plan in the compiled graph]
        self._in_flight = CallsInFlight()  # NOTE [one call per step]
        self._solver()  # fail now on an unknown solver name
        self.policy, self.nested, self.comm = policy, bool(nested), comm
        self._ranks = RankAgreement() if agree_ranks else None
        planned = mem_limit is not None or plan is not None or policy is None  # (else: SelectiveRuns)
        self._policies = named_policies(policy, comm, planned=planned)
        self._selective = None if policy is None or self._policies else SelectiveRuns(policy, preserve_rng_state)
        self.elementwise = planned_elementwise(
            elementwise, policy=policy, offload=self.offload, measure=self.measure_mode
        )

    # ------------------------------------------------------------------ public
    def measure(self, *sample_inputs: Any, **sample_kwargs: Any) -> ChainMeasurement:
        """Measures every stage on these inputs (see ``measure`` in the class docstring).

        The model is left as it was: parameters, ``.grad``, buffers and RNG states. With ``measure="sized"``, the
        timing pass stays within the budget: a planned stage whose backward would not fit is timed forward only, its
        backward estimated. (A training call with a budget no schedule fits raises :class:`~remat.BudgetTooSmall`
        before anything runs on the device.)
        """
        with model_own_call(self.model):
            return self._measure(sample_inputs, self._training_kwargs(sample_kwargs), training=False)

    def _training_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A training call's kwargs: a Hugging Face key/value cache turned off, once said."""
        kwargs, turned_off = without_cache(self.model, kwargs)
        if turned_off and not self._cache_warned:
            self._cache_warned = True
            warnings.warn(CACHE_TURNED_OFF, UserWarning, stacklevel=5)
        return kwargs

    def _measure(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, training: bool) -> ChainMeasurement:
        refuse_unmeasurable(self.model)
        with planned(self.elementwise):  # NOTE [elementwise saves in planned stages]
            try:
                return self._measure_now(inputs, kwargs, training=training)
            finally:  # NOTE [autocast's cache after measuring] in remat.measure.step
                torch.clear_autocast_cache()

    def _measure_now(
        self, sample_inputs: tuple[Any, ...], sample_kwargs: dict[str, Any], *, training: bool
    ) -> ChainMeasurement:
        if training:
            refuse_meta_training(self.model)  # (before its timing pass fails on the meta device)
        key = signature(self.model, sample_inputs, sample_kwargs)
        for old in self._setups.entered(key, sample_inputs, sample_kwargs):  # NOTE [setups kept]
            self._forget(old, times=False)
        logger.info("remat is measuring the model (%s); its first step takes longer", what_changed(self._last_key, key))
        started = time.perf_counter()
        chain = self._chain_for(key, sample_inputs, sample_kwargs)
        how = self.measure_mode
        scaled: list[float] = []
        references: list[ChainMeasurement] = []

        def known_times(sized: ChainMeasurement) -> list[tuple[float, float]] | None:
            together = self._ranks is not None and self._ranks.measuring_together  # NOTE [measuring together]
            found = self._shapes.known_times(key, sized) if training and not together else None
            if found is None:
                return None
            scaled.append(found[1])
            references.append(found[2])
            return found[0]

        model, loss_fn = self.model, self._loss_fn
        estimator = None
        if how == "estimated" and not self._shapes.was_estimated(key):
            # a training call's cost model holds no more than its step (NOTE [calibrating within the budget])
            estimator = step_estimator(model, step_device(model, sample_inputs, sample_kwargs), bounded=training)
        failed = None  # why the model cannot run on fake tensors
        if how in ("sized", "estimated"):
            try:
                measurement = measure_chain(
                    self.model,
                    chain,
                    sample_inputs,
                    sample_kwargs,
                    loss_fn=self._loss_fn,
                    sized=True,
                    before_timing=lambda sized, needs: self._timed_backwards(key, sized, needs, training),
                    known_times=known_times,
                    estimated_times=estimator,
                    policies=self._policies,
                )
            except FakeRunFailed as error:
                failed = str(error)  # (the error is let go first: its traceback holds the failed run's frames)
            if failed is not None:
                measurement, how = measured_for_real(model, chain, sample_inputs, sample_kwargs, loss_fn, failed)
        else:
            frugal = how == "frugal"
            measurement = measure_on_device(model, chain, sample_inputs, sample_kwargs, loss_fn, frugal=frugal)
        if self._policies:  # NOTE [sizing store options]
            measurement = with_store_options(model, chain, measurement, sample_inputs, sample_kwargs, self._policies)
        if references:
            measurement = as_scaled_from(references[0], measurement, scaled[0])
        estimated = estimator is not None and how in ("sized", "estimated") and not scaled
        self._shapes.record(key, measurement, scaled=bool(scaled), estimated=estimated)
        if scaled:
            how = f"sized; times scaled from a timed shape, x{scaled[0]:.2f} its work"
        elif estimated:
            how = "sized; times estimated, timed at the next training step"
        logger.info("remat measured %s (%s): %d stages (%d planned) in %.2f s, plain peak %s",
                    what_changed(self._last_key, key), how, len(chain), measurement.profile.n_stages,
                    time.perf_counter() - started, format_bytes(measurement.measured_peak_bytes))  # fmt: skip
        measurement = self._measurements[key] = marked(measurement, planning())
        if is_partial(measurement) and not self._coverage_warned:
            self._coverage_warned = True
            warnings.warn(partial_coverage(chain, measurement), UserWarning, stacklevel=4)
        # plans from an earlier measurement of this key (a shape timed again) are replaced;
        # the check before timing solved on the sizes alone, the measurement may add to them
        forget(key, self._plans, self._executors, self._minimums)
        self._last_key = key
        gc.collect(1)  # measuring leaves reference cycles holding tensors: gone before the next step
        return measurement

    def _timed_backwards(
        self, key: Hashable, sized: ChainMeasurement, needs: tuple[int, ...], training: bool
    ) -> frozenset[int] | None:
        """The groups whose backward the timing pass can run within the budget (None: all).
        For a training call, raises BudgetTooSmall, before anything runs, for a budget no schedule fits in."""
        if self.mem_limit is None:
            return None  # the free device memory: no plan fits where the timing pass does not
        plannings = self._plannings(key, sized)
        total = self._total_bytes(key, plannings, self.mem_limit)
        if training and self._ranks is not None and self._ranks.measuring_together:  # NOTE [measuring together]
            total = self._ranks.before_timing(functools.partial(self._check_feasible, key, plannings, total), total)
        elif training:
            self._check_feasible(key, plannings, total)
        if not needs:
            return None  # the first call, on the sizes alone
        if self.mem_limit == MINIMUM:  # NOTE [the least budget's timing pass] in remat.measure.step
            total = min(total, sized.timing_pass_bytes)
        timed = frozenset(g for g, need in enumerate(needs) if need <= total)
        if len(timed) < len(sized.groups):
            logger.info("remat: %d of %d planned stages do not fit in the budget with their backward; their "
                        "backward times are estimated from their forwards", len(sized.groups) - len(timed),
                        len(sized.groups))  # fmt: skip
        return timed

    def plan_for(self, mem_limit: Budget | EllipsisType = ..., *, all_ranks: bool = False) -> Plan:
        """The plan of the last measured input signature under a budget (cached).

        Args:
            mem_limit: a budget in any accepted form, ``"min"`` included; default: the one given at construction.
            all_ranks: a collective call: every rank of the process group calls it and gets one schedule, from the
                largest figures of any rank and the smallest budget in bytes (NOTE [one plan for all ranks]).

        Raises:
            BudgetTooSmall: no schedule fits; ``.minimum_bytes`` is the smallest budget that does.
        """
        ranks = RankAgreement() if all_ranks and agreement_group_active() else None
        budget = self.mem_limit if isinstance(mem_limit, EllipsisType) else mem_limit
        return self._plan(self._measured_key(), budget, ranks)

    def compute_sequence(self, mem_limit: Budget | EllipsisType = ...) -> Plan:
        """rotor's name of :meth:`plan_for`."""
        return self.plan_for(mem_limit)

    def minimum_budget_bytes(self) -> int:
        """The smallest feasible whole-step budget, in bytes, for the last measured input."""
        key = self._measured_key()
        return min(self._minima(key, self._plannings(key, self._measurements[key])))

    @contextlib.contextmanager
    def executing(self, plan: Plan) -> Iterator[Plan]:
        """Within this block, training forwards run ``plan`` instead of the plan for ``mem_limit``.

        ``plan`` may come from :meth:`plan_for` (any budget) or from :meth:`Plan.from_json`; it must plan this model's
        chain of stage calls for the inputs it is run on.
        """
        previous = self._forced_plan
        self._forced_plan = plan
        try:
            yield plan
        finally:
            self._forced_plan = previous

    @contextlib.contextmanager
    def check_step(self) -> Iterator[StepCheck]:
        """Checks the training step inside the block: its exact peak against the plan's.

        ``with model.check_step() as check: loss_fn(model(x), y).backward()``; then ``check.measured_peak_bytes``,
        ``check.predicted_peak_bytes``, ``check.within_budget`` (see :class:`remat.plan.check.StepCheck`). It logs
        one INFO line and warns if the step went over its budget; the exact tracker slows the step two to three times.
        """
        with checked_step(lambda: self.plan, self.model.parameters()) as check:
            yield check

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent training call, if any (the pinned one, if given)."""
        if self._forced_plan is not None:
            return self._forced_plan
        if self._last_key is None:
            return None
        return self._plans.get((self._last_key, self._options(self.mem_limit)))

    @eager_under_compile
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with model_own_call(self.model):
            return self._forward(args, kwargs)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # the model's own mode: it may be switched on the model itself (remat.enable)
        if not (self.model.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        kwargs = self._training_kwargs(kwargs)
        key = signature(self.model, args, kwargs)
        for old in self._setups.entered(key, args, kwargs):  # NOTE [setups kept]
            self._forget(old, times=False)
        if (chain := self._chains.get(key)) is not None and not chain.still_in(self.model):  # a stage replaced
            self._forget(key, times=True)
        if self._selective is not None:
            return self._selective.run(key, lambda: self._chain_for(key, args, kwargs), self.model, args, kwargs)
        must_measure = key not in self._measurements or self._shapes.must_retime(key)
        if self._forced_plan is not None:
            plan = self._forced_plan
        elif self._ranks is not None and agreement_group_active():  # NOTE [one plan for all ranks]
            measure = functools.partial(self._measure, args, kwargs, training=True)
            held = self._plans.get((key, self._options(self.mem_limit)))
            replan = functools.partial(self._plan, key, self.mem_limit, self._ranks)
            together = holds_collectives(self.model)  # NOTE [measuring together]
            self._last_key, plan = key, self._ranks.agreed(key, held, must_measure, measure, replan, together=together)
        else:
            if must_measure:
                self._measure(args, kwargs, training=True)
            self._last_key, plan = key, self._plan(key, self.mem_limit)
        call = functools.partial(self._executor(key, plan, args, kwargs), self.model, args, kwargs)
        if self._forced_plan is None and self._shapes.unverified(key):
            call = functools.partial(self._shapes.verified_call, key, call, self.model)
        return self._in_flight.called(call())

    measure_counts = property(lambda self: dict(self._shapes.counts), doc="Input shapes timed and scaled.")
    frugal_measure = property(lambda self: self.measure_mode != "plain", doc="Deprecated: measure != 'plain'.")

    # ------------------------------------------------------------------ internals
    @property
    def margin(self) -> float:
        """The planning margin in use for the last measured input (see ``margin`` above)."""
        if self._last_key is None or self._last_key not in self._measurements:
            return self._margin_option if self._margin_option is not None else DEFAULT_PLANNING_MARGIN
        return self._margin(self._last_key, self._measurements[self._last_key])

    def _margin(self, key: Hashable, measurement: ChainMeasurement) -> float:
        if self._margin_option is not None:
            return self._margin_option
        # A model measured with the real loss is predicted to the byte or above it (NOTE
        # [suffix on real tensors]). One measured with the default loss (a sum), or under
        # autocast (whose cache lives on its own terms, NOTE [autocast casts]), keeps a margin.
        autocast = isinstance(key, tuple) and len(key) > 3 and any(key[3])
        exact = (self._loss_fn is not None or measurement.loss_from_output) and not autocast
        return 0.0 if exact else DEFAULT_PLANNING_MARGIN

    def _options(self, mem_limit: Budget) -> PlanOptions:
        form = type(mem_limit).__name__
        return PlanOptions(mem_limit, form, self.solver_name, self.slots, self._margin_option, self.output_kept)

    def _forget(self, key: Hashable, *, times: bool) -> None:
        runners, rounds = self._selective.runners if self._selective else {}, self._ranks.rounds if self._ranks else {}
        forget(key, self._chains, self._measurements, self._plans, self._executors, self._minimums, runners, rounds)
        self._shapes.forget(key, times=times)

    def _measured_key(self) -> Hashable:
        if self._last_key is None:
            raise RuntimeError("call measure(*sample_inputs) (or run a training step) before planning")
        return self._last_key

    def _solver(self, n_stages: int = 1) -> Solver:
        if self.solver_name in ("optimal", "auto"):
            solver = get_solver(self.solver_name, slots=self.slots or default_slots(n_stages))
        else:
            solver = get_solver(self.solver_name)
        return solver if self.offload is False else OffloadingSolver(solver)

    def _chain_for(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Chain:
        chain = self._chains.get(key)
        if chain is None:
            agreeing = self._ranks is not None or not agreement_group_active()
            refuse_sharded_training(self.model, agreeing=agreeing)  # NOTE [sharded models in the automatic mode]
            if isinstance(self.model, nn.Sequential) and not self.nested:
                chain = discover_chain(self.model, args, kwargs)
            else:
                devices = [p.device for p in self.model.parameters()]
                with preserved_model_state(self.model, devices):
                    chain = self._discover(args, kwargs)
            self._chains[key] = chain
        return chain

    def _discover(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Chain:
        """The model's chain, found on fake tensors where it can (no device memory)."""
        discover = functools.partial(discover_chain, self.model, loss_fn=self._loss_fn, nested=self.nested)
        if self.measure_mode in ("sized", "estimated"):
            try:
                with on_fake_tensors(self.model, step_device(self.model, args, kwargs)) as fake:
                    fake_args, fake_kwargs = fake.inputs(args, kwargs)
                    with fake.mode:
                        return discover(fake_args, fake_kwargs)
            except FakeRunFailed:
                pass  # found on the real inputs; measuring says why fake tensors do not do
        return discover(*isolated_inputs(args, kwargs))

    def _executor(self, key: Hashable, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ChainExecutor:
        executor = self._executors.get((key, plan))
        if executor is None:
            refuse_meta_training(self.model)
            refuse_other_plan(plan, self.elementwise)
            ops, chain = expand_operations(plan.schedule.operations, plan.groups), self._chain_for(key, args, kwargs)
            chain.refuse_plan_of(plan.stage_calls)
            taken = taken_again(plan, self._measurements.get(key))
            executor = self._executors[(key, plan)] = ChainExecutor(
                chain, ops, preserve_rng_state=self.preserve_rng_state, policies=self._policies, taken_again=taken,
                elementwise=elementwise_stages(plan.schedule.profile, len(chain)),
            )  # fmt: skip
        return executor

    def _plannings(self, key: Hashable, measurement: ChainMeasurement) -> list[Planning]:
        """Glue constants kept, or taken from replays (NOTE [constants an earlier stage takes])."""
        ways = (False, True) if measurement.taken_again else (False,)
        return [self._prepare(key, measurement, take_again=way) for way in ways]

    def _prepare(self, key: Hashable, measurement: ChainMeasurement, take_again: bool = False) -> Planning:
        return prepared(
            measurement,
            loss_measured=self._loss_fn is not None or measurement.loss_from_output,
            output_kept=self.output_kept,
            margin=self._margin(key, measurement),
            solver=self._solver(measurement.profile.n_stages),
            offload=self.offload,
            take_again=take_again,
        )

    def _minima(self, key: Hashable, plannings: list[Planning]) -> list[int]:
        """The smallest feasible budget of each way to plan."""
        cache_key = (key, self._options(None))
        if cache_key not in self._minimums:
            self._minimums[cache_key] = [planning.minimum_total_bytes() for planning in plannings]
        return self._minimums[cache_key]

    def _total_bytes(self, key: Hashable, plannings: list[Planning], mem_limit: Budget) -> int:
        """The whole-step budget in bytes that `mem_limit` stands for."""
        planning = plannings[0]
        if mem_limit == MINIMUM:
            return min(self._minima(key, plannings))
        # A fraction is of the budget that stores everything, margin included, with what lives part of the step
        # counted where it lives, or of what measuring needs where that is more (a model that trains its head
        # only saves less than a stage's forward holds): 1.0 always plans no recompute.
        device = planning.profile.metadata.get("device", "cpu")
        reference = max(planning.total_holding(planning.store_all()), planning.floor_bytes)
        total = parse_budget(mem_limit, reference_bytes=reference, device=device)
        if mem_limit is None and str(device) == "cpu" and not self._default_budget_warned:
            self._default_budget_warned = True
            warn_default_cpu_budget(total, reference)
        return total

    def _check_feasible(self, key: Hashable, plannings: list[Planning], total: int) -> None:
        minimum = min(self._minima(key, plannings))
        if total < minimum:
            raise budget_too_small(total, minimum)

    def _plan(self, key: Hashable, mem_limit: Budget, ranks: RankAgreement | None = None) -> Plan:
        options = self._options(mem_limit)
        cached = self._plans.get((key, options))
        if cached is not None and ranks is None:
            return cached
        if ranks is not None:  # planned again, minimum included, from the figures of all ranks
            self._minimums.pop((key, self._options(None)), None)
        measurement = self._measurements[key]
        plannings = [p if ranks is None else ranks.combined(p) for p in self._plannings(key, measurement)]
        total = self._total_bytes(key, plannings, mem_limit)
        total = total if ranks is None else ranks.smallest(total)
        self._check_feasible(key, plannings, total)
        schedule, split = fastest(plannings, self._minima(key, plannings), total)
        plan = Plan(schedule, split, tuple(measurement.groups), measurement.measured_peak_bytes, measurement)
        self._plans[(key, options)] = plan
        counts, peak = plan.forward_counts, format_bytes(plan.predicted_peak_bytes)
        recomputed = f"{sum(count > 1 for count in counts)} of {len(counts)} stages recomputed"
        logger.info("remat planned for a budget of %s: predicted peak %s, overhead +%.0f%%, %s",
                    format_bytes(total), peak, 100 * plan.overhead_fraction, recomputed)  # fmt: skip
        return plan
