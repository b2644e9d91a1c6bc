"""Measuring a chain: what each stage costs in time and in exact bytes.

One training step of the model is run with every stage call watched
(:mod:`remat.measure.instrument`):

* a :class:`~remat.memory.MemoryTracker` follows every allocation, and each stage's
  forward and backward is a window of its event stream, so peaks are exact;
* a transparent saved-tensor hook records which storages each stage keeps for its
  backward (the storages of parameters and of anything that existed before the step are
  not counted; the stage's input and output storages are reported as flags);
* tensor hooks on each stage's outputs mark where its backward starts.

A second, untracked step gives the times (the tracker slows small operations down).
The model is left as it was: parameter ``.grad``, every buffer (BatchNorm statistics)
and the RNG states are restored.

Stages are then *grouped* (:mod:`remat.measure.assemble`): a stage that modifies its
input in place (it cannot start a recompute region), one that takes no activation from
the stage before, and one that keeps nothing for its backward (nothing to recompute) are
fused with the stage before it. Which activations each stage keeps (``saves_input`` /
``saves_output``) goes into the profile, where the planner's memory model uses it (see
``remat.plan.schedule.simulate``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from remat.discover.chain import Chain
from remat.discover.intercept import intercept_stages, missing_stages
from remat.manual._planned_scope import planning, settle_scopes
from remat.manual._state import learning_state
from remat.measure.assemble import ChainMeasurement, TrackedStep, assemble, with_times
from remat.measure.estimate import Estimator
from remat.measure.fake import on_fake_tensors
from remat.measure.instrument import StageWatch, tensors_in
from remat.measure.isolation import isolated_inputs, preserved_model_state, preserved_state_bytes
from remat.measure.losses import (
    _check_no_cache,
    _DefaultLoss,
    _loss_and_backward,
    _loss_probe,
    _loss_widening,
    _shape_of,
    output_tensors,
)
from remat.measure.spans import frugal_spans
from remat.measure.timing import TimingPass, time_groups
from remat.measure.workspace import WorkspaceProbe, probe_for, timed_passes, with_workspaces
from remat.memory import MemoryTracker

__all__ = [
    "MEASURE_MODES",
    "MEASURING_PHASES",
    "isolated_inputs",
    "measure_chain",
    "measure_mode",
    "measure_on_device",
    "preserved_model_state",
    "step_device",
    "step_devices",
]

logger = logging.getLogger("remat")

#: How many phases a measurement has; each is logged at DEBUG level, with the record's
#: ``remat_phase`` attribute set to ``(phase, MEASURING_PHASES, what)`` (a progress bar's feed).
MEASURING_PHASES = 3


MEASURE_MODES = ("sized", "plain", "frugal", "estimated")


def measure_mode(measure: str, frugal_measure: bool) -> str:
    """`measure` checked, with the deprecated ``frugal_measure=True`` read as the default."""
    if measure not in MEASURE_MODES:
        raise ValueError(f"measure is one of {', '.join(map(repr, MEASURE_MODES))}, got {measure!r}")
    if frugal_measure:
        if measure != "sized":
            raise ValueError(f"frugal_measure=True and measure={measure!r} disagree; pass measure alone")
        warnings.warn(
            "remat: frugal_measure is deprecated: measuring stays within the budget by default "
            "(measure='sized'); pass measure='frugal' for the measuring step with recomputed segments",
            DeprecationWarning,
            stacklevel=3,
        )
    return measure


def _phase(phase: int, what: str) -> None:
    logger.debug(
        "remat measuring (%d/%d): %s",
        phase,
        MEASURING_PHASES,
        what,
        extra={"remat_phase": (phase, MEASURING_PHASES, what)},
    )


# NOTE [autocast's cache after measuring]
# Under autocast, the casts of the parameters a forward makes are kept in autocast's cache
# until the autocast region ends. The measuring step runs the model more than once (on
# fake tensors, then its timing pass, on real ones) inside the caller's region, and the
# casts the measuring left there were held through the step that followed it, beside the
# casts that step made: a CLIP under bf16 autocast measured its first step 141,056 bytes
# (22%) over its budget, the later ones within it. The automatic mode empties the cache
# once it has measured (as the timing pass does after each group): what the caller's
# code cast before is cast again when it is used, to the same values. A frugal step under
# autocast is refused (`frugal_refused`): its replays cast the weights apart from the steps
# it plans, and its plans went 21% over their budget on every step.
def measure_chain(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    frugal: bool = False,
    sized: bool = False,
    before_timing: Callable[[ChainMeasurement, tuple[int, ...]], frozenset[int] | None] | None = None,
    known_times: Callable[[ChainMeasurement], Sequence[tuple[float, float]] | None] | None = None,
    estimated_times: Estimator | None = None,
    policies: Mapping[str, Any] | None = None,
) -> ChainMeasurement:
    """Measures one training step of `model`, stage by stage, and groups the stages.

    The profile's ``metadata["device"]`` names the device the step ran on (``"cuda:0"``,
    ``"cpu"``): the first device other than the CPU among the inputs and parameters.

    Args:
        model: the model (its forward must call the chain's stages once each, in order).
        chain: the stages.
        args: sample positional inputs.
        kwargs: sample keyword inputs.
        loss_fn: ``loss_fn(output) -> loss``. The output is dropped once the loss is
            computed, as in a training loop; a loss function that runs the backward
            itself may return None. Default: the loss the output carries (a Hugging Face
            ``ModelOutput`` computed with ``labels``: ``loss_from_output`` is then set in
            the measurement), else the sum of the outputs.
        frugal: measure with every stage recomputed, in about the memory of keeping only
            the stages' inputs, instead of a plain step (see NOTE [frugal measurement]).
        sized: take the bytes from a step on fake tensors (no device memory; see
            :mod:`remat.measure.fake`) and the times from a pass that runs one planned
            stage at a time (:mod:`remat.measure.timing`). Raises
            :class:`~remat.measure.fake.FakeRunFailed` when the model cannot run on fake
            tensors (nothing real ran then).
        before_timing: with `sized`, called with the measurement of bytes (all times 0)
            and the bytes the timing pass needs while each group runs with its backward
            (rehearsed on fake tensors); it returns the groups whose backward the pass may
            run (None: all; see :func:`remat.measure.timing.time_groups`), or raises to stop
            there (a budget below the feasible minimum). It is called first with no needs,
            before anything runs on the device, then again before the timing pass.
        known_times: with `sized`, times for the measurement of bytes, if known (scaled
            from another shape: no timing pass; it is still rehearsed on fake tensors, for
            what the model holds across stages), else None.
        estimated_times: with `sized`, gives times for the measurement of bytes in place
            of the timing pass (the profile's ``metadata["times"]`` says so). The pass is
            still rehearsed on fake tensors, for what the model holds across stages, but
            not run: nothing runs on the device.
        policies: with `sized`, policies the timing pass also times each stage under
            (NOTE [timing store options]), by name.
    """
    default = _DefaultLoss()
    chosen: Callable[[Any], Any] = loss_fn if loss_fn is not None else default
    devices = step_devices(model, args, kwargs)
    device = _first_accelerator(devices)
    if sized:
        # the sizing step ran the loss: what the timing pass may do is decided with the
        # loss it found (a loss the output carries needs no allowance), as the plan is
        checked = before_timing

        def with_loss(sized: ChainMeasurement, needs: tuple[int, ...]) -> frozenset[int] | None:
            assert checked is not None
            return checked(_with_loss_found(sized, default), needs)

        measurement = _sized_measurement(
            model, chain, args, kwargs, chosen, devices, device, with_loss if checked else None, known_times,
            estimated_times, policies,
        )  # fmt: skip
    else:
        measurement = _plain_measurement(model, chain, args, kwargs, chosen, devices, device, frugal)
    return _with_loss_found(measurement, default)


def _with_loss_found(measurement: ChainMeasurement, default: _DefaultLoss) -> ChainMeasurement:
    """The measurement, marked as measured with the loss its output carries where it was."""
    return dataclasses.replace(measurement, loss_from_output=True) if default.from_output else measurement


def measure_on_device(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], Any] | None,
    *,
    frugal: bool,
) -> ChainMeasurement:
    """A plain (or frugal) measured step; a plain one that runs out of memory is made frugal.

    Raises:
        NotImplementedError: a frugal step cannot size this one (:func:`frugal_refused`).
    """
    refused = frugal_refused(step_device(model, args, kwargs).type)
    if frugal and refused:
        raise NotImplementedError(f"remat: measure='frugal' is not built here: {refused}. Use measure='sized'")
    try:
        return measure_chain(model, chain, args, kwargs, loss_fn=loss_fn, frugal=frugal)
    except torch.OutOfMemoryError:
        if frugal:
            raise
        if refused:
            raise NotImplementedError(
                f"remat: a plain measuring step does not fit in memory, and a frugal one is not built here: {refused}"
            ) from None
    # A plain step does not fit the device: measure frugally instead (the model, its
    # gradients and buffers were put back as they were).
    warnings.warn(
        "remat: a plain training step does not fit in memory; measuring with recompute instead (measure='frugal')",
        RuntimeWarning,
        stacklevel=4,
    )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return measure_chain(model, chain, args, kwargs, loss_fn=loss_fn, frugal=True)


def frugal_refused(device_type: str) -> str | None:
    """Why a frugal measuring step cannot size the step about to run (None: it can)."""
    if planning() is not None:  # NOTE [elementwise saves in planned stages]
        return "a model planned with elementwise=True is sized by a step that stores every stage"
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        # NOTE [autocast's cache after measuring]
        return "under autocast, a frugal step does not see the weights' casts as the planned steps make them"
    return None


def step_devices(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.device]:
    """The devices of the inputs and parameters (the meta device left out: a model built
    there is sized on its inputs' device, see :func:`~remat.measure.fake.on_fake_tensors`)."""
    everything = {t.device for t in tensors_in((args, kwargs))} | {p.device for p in model.parameters()}
    return sorted((d for d in everything if d.type != "meta"), key=str)


def step_device(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device a step is measured on: the first among :func:`step_devices` other than the CPU."""
    return _first_accelerator(step_devices(model, args, kwargs))


def _first_accelerator(devices: list[torch.device]) -> torch.device:
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def _plain_measurement(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], Any],
    devices: list[torch.device],
    device: torch.device,
    frugal: bool,
) -> ChainMeasurement:
    """Bytes from a real step (plain, or with recomputed segments), times from another."""
    # Each run gets copies of the inputs: the caller's are never touched, and a model that
    # changes its input in place gets the original values in every run.
    with preserved_model_state(model, devices) as kept:
        _phase(1, "a step tracked byte for byte")
        spans = frugal_spans(model, chain, *isolated_inputs(args, kwargs)) if frugal else None
        probe = probe_for(device)  # NOTE [device workspaces]: the step's largest, for every stage
        with probe if probe is not None else contextlib.nullcontext():
            tracked = _tracked_step(
                model, chain, *isolated_inputs(args, kwargs), loss_fn=loss_fn, device=device, spans=spans
            )
        for p in model.parameters():
            p.grad = None
        _phase(2, "a step timed")
        with learning_state():  # untracked: the copies it makes do not count
            timing, end_time = _timing_step(
                model, chain, *isolated_inputs(args, kwargs), loss_fn=loss_fn, device=device, spans=spans
            )
        measurement = assemble(chain, tracked, watched_times(tracked, timing, end_time))
        if probe is not None:
            largest = [probe.largest_seen] * len(chain)
            measurement = with_workspaces(measurement, largest, largest, probe.largest_seen)
        _phase(3, "what the model holds across stages (a forward without grad)")
        # What the model's own code holds across stages (NOTE [inputs the model holds]):
        # a forward without grad, tracked, shows it, as the timing pass does for the sized mode.
        held = time_groups(
            model, chain, measurement.stages, measurement.groups, *isolated_inputs(args, kwargs), device,
            frozenset(), track_all=True,
        )  # fmt: skip
    measurement = _with_fixed_bytes(measurement, kept.bytes)  # NOTE [tensors kept in attributes]
    return dataclasses.replace(measurement, input_held_until=held.input_held_until, held_outputs=held.held_outputs)


def _sized_measurement(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], Any],
    devices: list[torch.device],
    device: torch.device,
    before_timing: Callable[[ChainMeasurement, tuple[int, ...]], frozenset[int] | None] | None,
    known_times: Callable[[ChainMeasurement], Sequence[tuple[float, float]] | None] | None,
    estimated_times: Estimator | None = None,
    policies: Mapping[str, Any] | None = None,
) -> ChainMeasurement:
    """Bytes from a step on fake tensors, then times from a pass of one group at a time."""
    run_loss = functools.partial(_loss_and_backward, loss_fn)
    outputs: list[Any] = []

    def shaped_loss(output: Any) -> Any:
        outputs.append(tree_map(_shape_of, output))
        return loss_fn(output)

    _phase(1, "a step sized on fake tensors (no device memory)")
    with preserved_model_state(model, devices) as kept, on_fake_tensors(model, device) as fake:
        fake_args, fake_kwargs = fake.inputs(args, kwargs)
        versions = [
            t._version if isinstance(t, torch.Tensor) else None for t in tree_flatten((fake_args, fake_kwargs))[0]
        ]
        with fake.mode:
            tracked = _tracked_step(
                model, chain, fake_args, fake_kwargs, loss_fn=shaped_loss, device=device, spans=None
            )
        kept.note()  # (before the fake tensors are taken back)
        # the inputs the model changes in place: the timing pass copies those alone
        changed = {
            position
            for position, (leaf, version) in enumerate(
                zip(tree_flatten((fake_args, fake_kwargs))[0], versions, strict=True)
            )
            if isinstance(leaf, torch.Tensor) and leaf._version != version
        }
    # the fake model keeps real copies of the counters it made fake constants of: dropped now, not while timing
    del fake, fake_args, fake_kwargs
    sized = _with_fixed_bytes(assemble(chain, tracked), kept.bytes)  # NOTE [tensors kept in attributes]
    settle_scopes()  # NOTE [stages that make no recipe]
    # The timing pass rehearsed on fake tensors: what each group will need, the suffix, and what the model's own
    # code holds between stages (an input it keeps until its block returns). The budget must hold that, and the
    # pass itself (its peak with no backward timed, and the copies it runs on): both are known before a budget is
    # refused, so that the minimum named is the one planned within.
    rehearsal = _rehearsal(model, chain, sized, args, kwargs, device, devices, run_loss=run_loss, policies=policies)
    sized = dataclasses.replace(sized, input_held_until=rehearsal.input_held_until, held_outputs=rehearsal.held_outputs)
    times = known_times(sized) if known_times is not None else None
    floor = 0
    if times is None:
        # the real pass runs on copies of the inputs the model changes in place (on aliases
        # of the others), and holds a copy of the model's buffers to restore them after it:
        # the rehearsal counted neither
        leaves = tree_flatten((args, kwargs))[0]
        copies = sum(leaves[p].numel() * leaves[p].element_size() for p in changed) + preserved_state_bytes(model)
        # the pass runs every group's forward, timed or not, and times the backward of those
        # that fit in the budget: its peak with no backward timed is the least budget planned
        # (the first step must fit it too)
        untimed = _rehearsal(model, chain, sized, args, kwargs, device, devices, frozenset())
        floor = max(untimed.group_peak_bytes, default=0) + copies
        # NOTE [the least budget's timing pass]
        # The least budget ("min") depends on the stages' times (the least-memory plans it
        # weighs are the fastest ones), and it is resolved again once they are timed: it
        # may come out lower than before. The pass of a step planned at "min" keeps to
        # this floor, which every least budget is at least (remat.plan.share), so that the
        # measuring step fits the budget the plan ends up with.
    if before_timing is not None:
        # a budget no schedule fits is refused before anything real runs
        before_timing(dataclasses.replace(sized, timing_pass_bytes=floor), ())
    # NOTE [suffix on real tensors]
    # A kernel can hold more memory than its fake counterpart says (CPU mse_loss keeps its
    # whole elementwise buffer behind the scalar loss: the sizing now knows that one, NOTE
    # [losses that keep their buffer] in remat.storages). The loss is probed on real tensors
    # shaped like the model's output before anything else runs; what it needs beyond its
    # fake run is held through the whole step (the safe side: it may be transient).
    _phase(2, "the loss on real tensors")
    loss_extra = _loss_probe(run_loss, outputs[0], device) if outputs else 0
    # A FakeTensorMode left in a reference cycle by the probe can hold real memory: freed now, not while timing.
    gc.collect()
    sized = _with_fixed_bytes(sized, loss_extra)
    if times is not None:
        return with_times(sized, times)
    floor += loss_extra
    _phase(
        3,
        f"timing the stages, one of {len(sized.groups)} groups at a time"
        if estimated_times is None
        else "rehearsing the timing pass on fake tensors; times estimated from the sizes",
    )
    if estimated_times is not None:
        estimated = with_times(sized, estimated_times(sized))
        metadata = {**estimated.profile.metadata, "times": estimated_times.describe()}
        return dataclasses.replace(
            estimated,
            profile=dataclasses.replace(estimated.profile, metadata=metadata),
            input_held_until=rehearsal.input_held_until,
            held_outputs=rehearsal.held_outputs,
            timing_pass_bytes=floor,
        )
    needs = tuple(peak + copies + loss_extra for peak in rehearsal.group_peak_bytes)
    sized = dataclasses.replace(sized, timing_pass_bytes=floor)

    def decided(sized: ChainMeasurement, needs: tuple[int, ...]) -> frozenset[int] | None:
        assert before_timing is not None
        groups = before_timing(sized, needs)
        if groups is None or not 0 < len(groups) < len(needs):
            return groups
        # NOTE [a mix of timed groups]
        # A group whose backward is not timed runs its forward after groups whose backward
        # was: what those leave alive (an output the model keeps, that their graph held) is
        # neither in the pass with every backward timed nor in the one with none. The mix
        # is rehearsed too; a mix whose peak does not fit times no backward (the floor fits).
        mixed = _rehearsal(
            model, chain, sized, args, kwargs, device, devices, groups, run_loss=run_loss, policies=policies
        )
        peak = max(mixed.group_peak_bytes, default=0) + copies + loss_extra
        return before_timing(sized, tuple(max(need, peak) for need in needs))

    def timing_pass(groups: frozenset[int] | None, workspace: WorkspaceProbe | None) -> TimingPass:
        with preserved_model_state(model, devices), learning_state():  # (the decisions outside it)
            pass_args, pass_kwargs = isolated_inputs(args, kwargs, copied=changed)
            return time_groups(
                model, chain, sized.stages, sized.groups, pass_args, pass_kwargs, device, groups,
                run_loss=run_loss, policies=policies, workspace=workspace,
            )  # fmt: skip

    # NOTE [a cold device]: a GPU's first call of each kernel and shape takes up to a hundred
    # times its later calls: the pass runs twice (NOTE [device workspaces]), the last one timed.
    timing, sized = timed_passes(device, timing_pass, decided if before_timing else None, sized, needs)
    measurement = dataclasses.replace(
        with_times(sized, timing.times),
        input_held_until=rehearsal.input_held_until,
        held_outputs=rehearsal.held_outputs,
        option_extra_s=timing.option_extra_s,
        timing_pass_bytes=floor,
    )
    if timing.suffix_peak_bytes is not None and rehearsal.suffix_peak_bytes is not None:
        # what runs after the chain, on real tensors, beyond its rehearsal and the loss probe
        # (a kernel of the model's own head); found after the pass, it counts from now on
        extra = timing.suffix_peak_bytes - rehearsal.suffix_peak_bytes - loss_extra
        measurement = _with_fixed_bytes(measurement, extra)
    return measurement


def _rehearsal(
    model: nn.Module,
    chain: Chain,
    sized: ChainMeasurement,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    devices: Any,
    backward_groups: frozenset[int] | None = None,
    **options: Any,
) -> TimingPass:
    """The timing pass on fake tensors, every group tracked (`options`: of :func:`time_groups`)."""
    with preserved_model_state(model, devices), on_fake_tensors(model, device) as fake:
        fake_args, fake_kwargs = fake.inputs(args, kwargs)
        with fake.mode:
            return time_groups(
                model, chain, sized.stages, sized.groups, fake_args, fake_kwargs, device, backward_groups,
                track_all=True, rehearsal=True, **options,
            )  # fmt: skip


def _with_fixed_bytes(measurement: ChainMeasurement, extra: int) -> ChainMeasurement:
    """The measurement with `extra` more bytes held through the whole step (a kernel that
    holds more on real tensors than on fake ones: the safe side, as where it lives is not
    known)."""
    if extra <= 0:
        return measurement
    fixed_bytes = measurement.fixed_bytes + extra
    profile = dataclasses.replace(
        measurement.profile, metadata={**measurement.profile.metadata, "fixed_bytes": fixed_bytes}
    )
    return dataclasses.replace(measurement, profile=profile, fixed_bytes=fixed_bytes)


def _tracked_step(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any],
    device: torch.device,
    spans: list[tuple[int, int]] | None,
) -> TrackedStep:
    """Runs the step under the tracker: bytes and event windows of every stage."""
    # sized steps run on fake tensors; the flops scale times to new shapes
    tracker = MemoryTracker(device=device.type, count_fake=True, count_flops=True)
    watch = StageWatch(chain, tracker, None, spans)
    # the frugal mode's own regions keep their inputs: not what the stages save
    with intercept_stages(chain, watch), tracker, tracker.saved_tensors_hooks(note_kept=spans is None):
        try:
            output = model(*args, **kwargs)
        finally:
            watch.finish()
        _check_no_cache(output)
        # Sizes now: some of these storages die with the output, before the assembly.
        alive_after_forward = tracker.live_allocations()
        output_storages = tracker.allocations_of(output_tensors(output))
        widening = _loss_widening(output_tensors(output))
        state = [
            value
            for module in model.modules()
            for value in [*module._buffers.values(), *vars(module).values()]
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
        ]
        state_allocations = set(tracker.allocations_of(state))
        holder = [output]
        del output
        loss_events: list[int] = []
        loss_storages: set[int] = set()

        def on_loss(loss: Any) -> None:
            loss_events.append(tracker.n_events)
            loss_storages.update(tracker.allocations_of(tensors_in(loss)))

        _loss_and_backward(loss_fn, holder, on_loss)
    if watch.next_stage != len(chain):
        raise missing_stages(chain, watch.next_stage)
    return TrackedStep(
        watch=watch,
        tracker=tracker,
        alive_after_forward=alive_after_forward,
        output_bytes=sum(output_storages.values()),
        loss_output_bytes=int(sum(output_storages.values()) * widening),
        # the loss a training loop keeps for its backward is no longer the output (a Hugging
        # Face output's loss): held from the loss on, like the rest of what the suffix keeps
        output_allocations=set(output_storages) - loss_storages,
        device=str(device),
        state_allocations=state_allocations,
        cast_allocations=tracker.cast_allocations(),
        loss_event=loss_events[0] if loss_events else None,
        loss_allocations=loss_storages,
    )


def _timing_step(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any],
    device: torch.device,
    spans: list[tuple[int, int]] | None,
) -> tuple[StageWatch, float]:
    """Runs the step untracked: the times of every stage, and when its backward ended."""
    synchronize = functools.partial(torch.cuda.synchronize, device) if device.type == "cuda" else None
    timing = StageWatch(chain, None, synchronize, spans)
    with intercept_stages(chain, timing):
        if synchronize is not None:
            synchronize()
        holder: list[Any] = []
        try:
            holder.append(model(*args, **kwargs))
        finally:
            timing.finish()
        _loss_and_backward(loss_fn, holder)
        if synchronize is not None:
            synchronize()
        end_time = time.perf_counter()
    return timing, end_time


def watched_times(step: TrackedStep, timing: StageWatch, end_time: float) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each stage call, from a timing step watched like the tracked one.

    Args:
        step: what the tracked step saw (its forwards are a second sample of each forward).
        timing: the stage watch of the untracked step.
        end_time: when the untracked step's backward ended (``time.perf_counter()``).
    """
    span_of_last = timing.span_start_of_last_stage
    times = []
    for index, stage in enumerate(step.watch.stages):
        backward_s = 0.0
        start_time_s = timing.grad_ready_time.get(index)
        if start_time_s is not None:
            stop_time_s = timing.grad_ready_time.get(index - 1, end_time)
            # in the frugal mode, the span's recompute ran inside its last stage's backward
            recompute_time_s = timing.recompute_time_s.get(span_of_last.get(index, -1), 0.0)
            backward_s = max(0.0, stop_time_s - start_time_s - recompute_time_s)
        # Two samples of each forward (the tracked one is slowed by the tracker, never
        # sped up): the smaller is the better estimate, and a spike in one is ignored.
        times.append((min(timing.stages[index].forward_time_s, stage.forward_time_s), backward_s))
    return times
