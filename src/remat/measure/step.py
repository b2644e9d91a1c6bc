"""Measuring a chain: what each stage costs in time and in exact bytes.

One training step of the model is run with every stage call watched:

* a :class:`~remat.memory.MemoryTracker` follows every allocation, and each stage's
  forward and backward is a window of its event stream, so peaks are exact;
* a transparent saved-tensor hook records which storages each stage keeps for its
  backward (the storages of parameters and of anything that existed before the step are
  not counted; the stage's input and output storages are reported as flags);
* tensor hooks on each stage's outputs mark where its backward starts.

A second, untracked step gives the times (the tracker slows small operations down).
The model is left as it was: parameter ``.grad``, every buffer (BatchNorm statistics)
and the RNG states are restored.

Stages are then *grouped*: a stage that modifies its input in place (it cannot start a
recompute region), one that takes no activation from the stage before, and one that keeps
nothing for its backward (nothing to recompute) are fused with the stage before it. Which
activations each stage keeps (``saves_input`` / ``saves_output``) goes into the profile,
where the planner's memory model uses it (see ``remat.plan.schedule.simulate``).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from remat.manual._state import snapshot_bytes
from remat.discover.chain import Chain
from remat.discover.intercept import call_original, intercept_stages
from remat.errors import RematError, UnsupportedModel
from remat.memory import MemoryTracker
from remat.plan.profile import ChainProfile

__all__ = ["ChainMeasurement", "StageMeasurement", "measure_chain"]


@dataclass
class StageMeasurement:
    """Raw figures of one stage call (before grouping)."""

    name: str
    forward_time_s: float = 0.0
    backward_time_s: float = 0.0
    forward_window: tuple[int, int] = (0, 0)
    backward_window: tuple[int, int] | None = None
    input_storages: dict[int, int] = field(default_factory=dict)  # storage key -> bytes
    output_storages: dict[int, int] = field(default_factory=dict)
    saved_storages: dict[int, tuple[int, int]] = field(default_factory=dict)  # key -> (bytes, allocated at)
    escaped_storages: dict[int, int] = field(default_factory=dict)  # outputs the next stage does not take
    gradient_bytes_in: int = 0  # bytes of the gradient of this stage's input
    modifies_input: bool = False
    input_requires_grad: bool = False


@dataclass
class ChainMeasurement:
    """Everything measured on a chain, and the grouped profile the planner uses.

    Attributes:
        stages: per stage call figures.
        groups: (first, stop) stage indices of each planned stage.
        profile: the grouped :class:`~remat.plan.profile.ChainProfile`.
        fixed_bytes: bytes held through the whole step outside the chain (the prefix's
            activations and the chain input when the model computes it).
        measured_peak_bytes: peak of the measured step (every activation stored).
        end_peak_bytes: peak after the chain's backward (the prefix's backward).
        output_bytes: bytes of the model's output (what a training loop that keeps the
            output through the backward holds on top).
    """

    stages: list[StageMeasurement]
    groups: list[tuple[int, int]]
    profile: ChainProfile
    fixed_bytes: int
    measured_peak_bytes: int
    end_peak_bytes: int
    output_bytes: int = 0


class _Watch:
    """Installed on the stage modules while measuring."""

    def __init__(
        self,
        chain: Chain,
        tracker: MemoryTracker | None,
        synchronize: Callable[[], None],
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        self.chain = chain
        self.tracker = tracker
        self.synchronize = synchronize
        # Frugal measurement (see NOTE [frugal measurement]): each span of stages runs as
        # a recompute region, so the step keeps only the spans' inputs.
        self.spans = spans
        self.recompute_end_event: dict[int, int] = {}  # span start -> event after its recompute
        self.recompute_time_s: dict[int, float] = {}  # span start -> seconds of its recompute
        self.recompute_windows: list[tuple[int, int]] = []  # events of every recompute
        self._run: Any = None
        if spans is not None:
            from remat.execute import ChainExecutor, _Run
            from remat.plan.operations import Region, Store

            items = tuple(Region(a, b, tuple(Store(k) for k in range(a, b))) for a, b in spans)
            self._run = _Run(ChainExecutor(chain, items, observer=lambda region: _SpanObserver(self, region.start)))
        self.stages = [StageMeasurement(name) for name in chain.names]
        self.current: int | None = None
        self.next_stage = 0
        self.grad_ready_time: dict[int, float] = {}
        self.grad_ready_event: dict[int, int] = {}
        self.output_grad_bytes = 0
        self.gradient_allocations: set[int] = set()
        self.chain_output_ids: set[int] = set()

    def event(self) -> int:
        return self.tracker.n_events if self.tracker is not None else 0

    def pack(self, tensor: torch.Tensor) -> Any:
        self.record_saved(tensor)
        return tensor.detach() if tensor.layout == torch.strided else tensor

    def record_saved(self, tensor: torch.Tensor) -> None:
        # Storages are known by allocation id, not address: in the frugal mode a saved
        # tensor can die before the next is saved, and its address be reused.
        if self.current is not None and self.tracker is not None:
            allocation_id = self.tracker.allocation_id(tensor)
            if allocation_id is not None:
                self.stages[self.current].saved_storages[allocation_id] = (
                    self.tracker.allocation_bytes(allocation_id),
                    self.tracker.allocation_event(allocation_id),
                )

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index != self.next_stage:
            raise UnsupportedModel(
                f"stage {index} ({self.chain.names[index]!r}) was called when stage {self.next_stage} "
                "was expected; remat needs the chain's stages to run once each, in order, in every "
                "forward. Use remat.mark for models whose forward varies"
            )
        self.next_stage += 1
        stage = self.stages[index]
        inputs = _tensors((args, kwargs))
        stage.input_storages = _storages(inputs, self.tracker)
        if index > 0:
            # The boundary is what this stage takes from the previous one; any other
            # output of the previous stage escapes to the model's own code.
            previous = self.stages[index - 1]
            linked = {k: v for k, v in previous.output_storages.items() if k in stage.input_storages}
            previous.escaped_storages = {
                k: v for k, v in previous.output_storages.items() if k not in linked
            }
            previous.output_storages = linked
            stage.input_storages = linked
        stage.input_requires_grad = any(t.requires_grad for t in inputs)
        versions = [t._version for t in inputs]
        self.current = index
        self.synchronize()
        start_time = time.perf_counter()
        start_event = self.event()
        try:
            if self._run is not None and torch.is_grad_enabled():
                out = self._run.call(index, module, args, kwargs)
            else:
                out = call_original(module, args, kwargs)
        finally:
            self.current = None
        self.synchronize()
        stage.forward_time_s = time.perf_counter() - start_time
        stage.forward_window = (start_event, self.event())
        stage.modifies_input = any(t._version != v for t, v in zip(inputs, versions))
        outputs = _tensors(out)
        stage.output_storages = _storages(outputs, self.tracker)
        if torch.is_grad_enabled():
            self._watch_gradients(index, [t for t in outputs if t.requires_grad])
            if index == 0:
                self._watch_gradients(-1, [t for t in inputs if t.requires_grad])
        return out

    def _watch_gradients(self, index: int, tensors: list[torch.Tensor]) -> None:
        # Plain tensor hooks (they also fire for the tensor backward starts from). The
        # last one to fire marks the moment the whole gradient is there.
        received: dict[int, int] = {}
        for position, tensor in enumerate(tensors):
            tensor.register_hook(lambda g, i=index, p=position, r=received: self._grad_ready(i, p, g, r))

    def _grad_ready(self, index: int, position: int, grad: torch.Tensor, received: dict[int, int]) -> None:
        # The gradient of stage `index`'s output is there: its backward starts now, and
        # the backward of stage index + 1 has just ended.
        self.synchronize()
        self.grad_ready_time[index] = time.perf_counter()
        self.grad_ready_event[index] = self.event()
        received[position] = int(grad.numel() * grad.element_size()) if grad is not None else 0
        if self.tracker is not None and grad is not None:
            allocation_id = self.tracker.allocation_id(grad)
            if allocation_id is not None:
                self.gradient_allocations.add(allocation_id)
        nbytes = sum(received.values())
        if index == -1:
            self.stages[0].gradient_bytes_in = nbytes
        elif index + 1 < len(self.stages):
            self.stages[index + 1].gradient_bytes_in = nbytes
        else:
            self.output_grad_bytes = nbytes


class _SpanObserver:
    """Told by a span's recompute region what it discards and when it is recomputed."""

    def __init__(self, watch: _Watch, start: int) -> None:
        self.watch = watch
        self.start = start
        self.started = 0.0
        self.started_event = 0

    def on_discarded(self, tensor: torch.Tensor) -> None:
        self.watch.record_saved(tensor)

    def on_recompute(self, started: bool) -> None:
        watch = self.watch
        watch.synchronize()
        if started:
            self.started = time.perf_counter()
            self.started_event = watch.event()
            return
        watch.recompute_end_event[self.start] = watch.event()
        watch.recompute_windows.append((self.started_event, watch.event()))
        watch.recompute_time_s[self.start] = watch.recompute_time_s.get(self.start, 0.0) + (
            time.perf_counter() - self.started
        )


class _InPlaceProbe:
    """Finds the stages that modify their input in place, in a forward without grad."""

    def __init__(self, chain: Chain) -> None:
        self.modifies_input = [False] * len(chain)

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = _tensors((args, kwargs))
        versions = [t._version for t in inputs]
        out = call_original(module, args, kwargs)
        self.modifies_input[index] = any(t._version != v for t, v in zip(inputs, versions))
        return out


# NOTE [frugal measurement]
# A plain measuring step stores every activation: it needs as much memory as training
# without recompute, which a model that only fits with recompute does not have. The
# frugal mode runs the measured steps with every stage in a recompute region of its own
# (a stage that modifies its input in place shares its predecessor's region), so a step
# keeps little more than the stages' inputs. What each stage saves is seen as the region
# discards it; its forward's extra memory is bounded by the peak seen without the saved
# tensors kept (keeping them adds at most their size, which the model counts apart); its
# backward is measured from the end of its recompute, when its saved tensors are back.
# Times: the recompute's time is taken off the backward it precedes.


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def _storages(tensors: list[torch.Tensor], tracker: MemoryTracker | None) -> dict[int, int]:
    """Allocation id -> bytes of the tracked storages behind `tensors` (empty untracked)."""
    out: dict[int, int] = {}
    if tracker is None:
        return out
    for t in tensors:
        allocation_id = tracker.allocation_id(t)
        if allocation_id is not None:
            out[allocation_id] = tracker.allocation_bytes(allocation_id)
    return out


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _default_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in _tensors(output) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    if not tensors:
        raise RematError(
            "the model's output does not require grad, so there is no backward to plan; "
            "check that the model is in training mode and its parameters require grad"
        )
    return torch.stack([t.sum() for t in tensors]).sum()


def _loss_and_backward(loss_fn: Callable[[Any], Any], output: list[Any]) -> None:
    """Computes the loss, drops the output (as a training loop does), then runs backward.

    `output` is a one-element list so that this function holds the only reference.
    """
    loss = loss_fn(output.pop())
    if loss is None:  # the loss function ran the backward itself
        return
    if not isinstance(loss, torch.Tensor):
        raise RematError(f"loss_fn must return the loss tensor (or None), got {type(loss).__name__}")
    if loss.numel() != 1:
        loss = loss.sum()
    loss.backward()


@contextlib.contextmanager
def preserved_model_state(model: nn.Module, devices: list[torch.device]) -> Iterator[None]:
    """Restores parameter gradients, every buffer and the RNG states on exit."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cuda = [d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=cuda):
            for p, _ in grads:
                p.grad = None
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def measure_chain(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    frugal: bool = False,
) -> ChainMeasurement:
    """Measures one training step of `model`, stage by stage, and groups the stages.

    Args:
        model: the model (its forward must call the chain's stages once each, in order).
        chain: the stages.
        args: sample positional inputs.
        kwargs: sample keyword inputs.
        loss_fn: ``loss_fn(output) -> loss`` (default: the sum of the outputs). The output
            is dropped once the loss is computed, as in a training loop; a loss function
            that runs the backward itself may return None.
        frugal: measure with every stage recomputed, in about the memory of keeping only
            the stages' inputs, instead of a plain step (see NOTE [frugal measurement]).
    """
    loss_fn = loss_fn or _default_loss
    devices = sorted({t.device for t in _tensors((args, kwargs))} | {p.device for p in model.parameters()}, key=str)
    device = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
    synchronize = _synchronizer(device)
    args, kwargs = _isolated_inputs(args, kwargs)
    with preserved_model_state(model, devices):
        spans = _in_place_spans(model, chain, args, kwargs) if frugal else None
        tracker = MemoryTracker(device=device.type)
        watch = _Watch(chain, tracker, lambda: None, spans)
        with intercept_stages(chain, watch), tracker, torch.autograd.graph.saved_tensors_hooks(
            watch.pack, lambda t: t
        ):
            output = model(*args, **kwargs)
            _check_no_cache(output)
            alive_after_forward = tracker.live_allocations()
            # Sizes now: some of these storages die with the output, before _assemble.
            alive_bytes = {key: tracker.allocation_bytes(key) for key in alive_after_forward}
            output_bytes = _bytes(_storages(_tensors(output), tracker))
            output_allocations = {i for t in _tensors(output) if (i := tracker.allocation_id(t)) is not None}
            holder = [output]
            del output
            _loss_and_backward(loss_fn, holder)
        if watch.next_stage != len(chain):
            raise UnsupportedModel(
                f"the forward ran {watch.next_stage} of the chain's {len(chain)} stages; remat needs "
                "every stage to run once per forward"
            )
        # Checked before the timing step: that step would run the in-place operation again,
        # on an input whose history the first backward has freed.
        if watch.stages[0].modifies_input:
            raise UnsupportedModel(
                f"the first stage {chain.names[0]!r} modifies its input in place; remat cannot keep "
                "the chain input for a recompute. Make that operation out of place (e.g. "
                "nn.ReLU(inplace=False))"
            )
        for p in model.parameters():
            p.grad = None
        timing = _Watch(chain, None, synchronize, spans)
        with intercept_stages(chain, timing):
            synchronize()
            _loss_and_backward(loss_fn, [model(*args, **kwargs)])
            synchronize()
            end_time = time.perf_counter()
    return _assemble(
        chain, watch, timing, tracker, alive_after_forward, alive_bytes, output_bytes, output_allocations, end_time
    )


def _in_place_spans(
    model: nn.Module, chain: Chain, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[int, int]]:
    """Spans of stages for the frugal mode: an in-place stage joins its predecessor's span."""
    probe = _InPlaceProbe(chain)
    # on copies: a first stage that works in place must not change the caller's input
    copies = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    with torch.no_grad(), intercept_stages(chain, probe):
        model(*copies[0], **copies[1])
    if probe.modifies_input[0]:
        raise UnsupportedModel(
            f"the first stage {chain.names[0]!r} modifies its input in place; remat cannot keep "
            "the chain input for a recompute. Make that operation out of place (e.g. "
            "nn.ReLU(inplace=False))"
        )
    # Segments of about sqrt(n) stages (as checkpoint_sequential cuts them): the step
    # then keeps about sqrt(n) segment inputs plus one segment's activations. A segment
    # never starts at an in-place stage: it would modify the input the segment keeps.
    size = math.isqrt(max(0, len(chain) - 1)) + 1
    spans: list[tuple[int, int]] = []
    for index, in_place in enumerate(probe.modifies_input):
        if spans and (in_place or spans[-1][1] - spans[-1][0] < size):
            spans[-1] = (spans[-1][0], index + 1)
        else:
            spans.append((index, index + 1))
    return spans


def _assemble(
    chain: Chain,
    watch: _Watch,
    timing: _Watch,
    tracker: MemoryTracker,
    alive_after_forward: dict[int, int],
    alive_bytes: dict[int, int],
    output_bytes: int,
    output_allocations: set[int],
    end_time: float,
) -> ChainMeasurement:
    n = len(chain)
    stages = watch.stages
    frugal = watch.spans is not None
    spans = watch.spans or []
    span_of_last = {stop - 1: start for start, stop in spans}
    # Backward windows and times: stage i's backward runs from the moment its output's
    # gradient is complete to the moment its input's gradient is.
    end_event = tracker.n_events
    for i in range(n):
        start = watch.grad_ready_event.get(i)
        stop = watch.grad_ready_event.get(i - 1, end_event) if i > 0 else watch.grad_ready_event.get(-1, end_event)
        if start is not None:
            stages[i].backward_window = (start, stop)
        t_start = timing.grad_ready_time.get(i)
        t_stop = timing.grad_ready_time.get(i - 1, end_time) if i > 0 else timing.grad_ready_time.get(-1, end_time)
        if t_start is not None:
            # in the frugal mode, the span's recompute ran inside its last stage's backward
            recompute_s = timing.recompute_time_s.get(span_of_last.get(i, -1), 0.0)
            stages[i].backward_time_s = max(0.0, t_stop - t_start - recompute_s)
        # Two samples of each forward (the tracked one is slowed by the tracker, never
        # sped up): the smaller is the better estimate, and a spike in one is ignored.
        stages[i].forward_time_s = min(timing.stages[i].forward_time_s, stages[i].forward_time_s)

    groups: list[tuple[int, int]] = []
    for i in range(n):
        # A stage that modifies its input in place cannot start a region (the region would
        # keep an input that changes); nor can one that takes no activation from the stage
        # before it. A stage that keeps nothing for its backward (a view, a pooling to one
        # value) has nothing to recompute: it rides with the stage before. A stage that
        # only does not keep its input is a stage of its own: the planner's model knows
        # what holds each activation (saves_input / saves_output).
        fuse = i > 0 and (
            stages[i].modifies_input or not stages[i].input_storages or not stages[i].saved_storages
        )
        if fuse and groups:
            groups[-1] = (groups[-1][0], i + 1)
        else:
            groups.append((i, i + 1))

    fixed_before, _, _ = tracker._curve(stages[0].forward_window[0], stages[0].forward_window[0])
    # Outputs that escape to the model's code (a key/value cache, attention weights) and
    # are still alive when the forward returns are held through the backward too.
    escaped = {k: v for st in stages for k, v in st.escaped_storages.items() if k in alive_after_forward}
    # Likewise for what a stage allocates and something else than autograd keeps (a
    # cache object filled in place): alive after the forward, neither saved for
    # backward nor passed on to the next stage.
    saved_keys = {k for st in stages for k in st.saved_storages}
    boundary_keys = {k for st in stages for k in st.output_storages}
    windows = [st.forward_window for st in stages]
    side_effects: dict[str, int] = {}
    for key, allocated_at in alive_after_forward.items():
        if key in saved_keys or key in boundary_keys or key in escaped:
            continue
        for index, (start, stop) in enumerate(windows):
            if start <= allocated_at < stop:
                escaped[key] = alive_bytes[key]
                side_effects[chain.names[index]] = side_effects.get(chain.names[index], 0) + alive_bytes[key]
                break
    if side_effects:
        _warn_side_effects(side_effects)
    fixed_before += _bytes(escaped)
    # What a stage's backward leaves behind besides its input's gradient (the partial
    # gradient of a weight used twice, waiting for the other use) lives on after it.
    def recomputed(allocation_id: int) -> bool:
        # frugal mode: a span's recompute brings back the saved tensors of all its
        # stages at once; they outlive the first stage's backward, but are not left over
        at = tracker.allocation_event(allocation_id)
        return any(start <= at < stop for start, stop in watch.recompute_windows)

    for st in stages:
        if st.backward_window is not None:
            leftover = tracker.surviving_allocations(*st.backward_window)
            fixed_before += sum(
                v for k, v in leftover.items() if k not in watch.gradient_allocations and not recomputed(k)
            )
    _, measured_peak, _ = tracker._curve()
    last_b0 = stages[0].backward_window
    end_peak = tracker._curve(last_b0[1], None)[1] if last_b0 is not None else 0

    names, ft, bt, act, grad, saved, s_in, s_out, f_tmp, b_tmp = ([] for _ in range(10))
    act.append(_bytes(stages[0].input_storages) if not chain.whole_model else 0)
    grad.append(stages[0].gradient_bytes_in)
    for first, stop in groups:
        members = stages[first:stop]
        input_storages = members[0].input_storages
        output_storages = members[-1].output_storages
        saved_all: dict[int, tuple[int, int]] = {}
        for m in members:
            saved_all.update(m.saved_storages)
        fw_start, fw_stop = members[0].forward_window[0], members[-1].forward_window[1]
        # Saved storages allocated before the group (side inputs such as a mask) are
        # held by the model anyway: only what the group allocates counts as its own.
        internal = {
            k: nbytes
            for k, (nbytes, allocated_at) in saved_all.items()
            if k not in input_storages and k not in output_storages and fw_start <= allocated_at < fw_stop
        }
        out_bytes = _bytes(output_storages)
        s_bytes = _bytes(internal)
        names.append(chain.names[first] if stop - first == 1 else f"{chain.names[first]}..{chain.names[stop - 1]}")
        ft.append(sum(m.forward_time_s for m in members))
        bt.append(sum(m.backward_time_s for m in members))
        act.append(out_bytes)
        saved.append(s_bytes)
        s_in.append(any(k in saved_all for k in input_storages))
        s_out.append(any(k in saved_all for k in output_storages))
        before, peak, _ = tracker._curve(fw_start, fw_stop)
        # frugal: the forward ran without its saved tensors kept, so its peak above the
        # live memory already bounds what the model adds on top of them
        # A recomputed stage also holds the guard's copy of one normalisation layer's
        # running statistics (NOTE [running statistics during recompute]).
        guard = max(snapshot_bytes(chain.modules[k]) for k in range(first, stop))
        f_tmp.append(max(0, peak - before - out_bytes - (0 if frugal else s_bytes)) + guard)
        backward_windows = [m.backward_window for m in members]
        if frugal and all(w is not None for w in backward_windows):
            # From the end of the recompute that precedes it, when the group ends a span:
            # the saved tensors are back then, as they are kept in a plain step.
            b_start, b_stop = backward_windows[-1][0], backward_windows[0][1]  # type: ignore[index]
            span_start = span_of_last.get(stop - 1)
            if span_start is not None and span_start in watch.recompute_end_event:
                b_start = max(b_start, watch.recompute_end_event[span_start])
            before_b, peak_b, _ = tracker._curve(b_start, b_stop)
            b_tmp.append(max(0, peak_b - before_b - members[0].gradient_bytes_in))
        elif all(w is not None for w in backward_windows):
            b_start, b_stop = backward_windows[-1][0], backward_windows[0][1]  # type: ignore[index]
            before_b, peak_b, _ = tracker._curve(b_start, b_stop)
            g_in = members[0].gradient_bytes_in
            b_tmp.append(max(0, peak_b - before_b - g_in))
        else:
            b_tmp.append(0)
        grad.append(0)  # filled below
    # gradient of each group's output = gradient of the next group's input
    for g in range(len(groups) - 1):
        grad[g + 1] = stages[groups[g + 1][0]].gradient_bytes_in
    # The chain output's gradient appears with the loss; whatever runs after the chain
    # (a head, the loss) is charged at that moment, as extra bytes of that gradient.
    last_forward_end = stages[-1].forward_window[1]
    b_last = stages[-1].backward_window
    suffix_stop = b_last[0] if b_last is not None else tracker.n_events
    suffix_before, suffix_peak, _ = tracker._curve(last_forward_end, suffix_stop)
    # What the suffix allocates and still holds when the last stage's backward ends, other
    # than the model's output, is held through the chain's backward: e.g. the partial
    # gradient of an LM head's weight tied to the prefix's embedding, which waits for the
    # embedding's backward. It is fixed memory, not part of the transient.
    suffix_kept = 0
    if b_last is not None:
        in_last_backward = tracker.surviving_allocations(*b_last)
        suffix_kept = sum(
            v
            for k, v in tracker.surviving_allocations(last_forward_end, b_last[1]).items()
            if k not in in_last_backward
            and k not in watch.gradient_allocations
            and k not in output_allocations
            and not recomputed(k)
        )
    fixed_before += suffix_kept
    grad[-1] = max(watch.output_grad_bytes, suffix_peak - suffix_before - suffix_kept)
    profile = ChainProfile(
        names=tuple(names),
        forward_time_s=tuple(ft),
        backward_time_s=tuple(bt),
        activation_bytes=tuple(act),
        gradient_bytes=tuple(grad),
        saved_bytes=tuple(saved),
        saves_input=tuple(s_in),
        saves_output=tuple(s_out),
        forward_temp_bytes=tuple(f_tmp),
        backward_temp_bytes=tuple(b_tmp),
        metadata={"fixed_bytes": int(fixed_before), "measured_peak_bytes": int(measured_peak)},
    )
    return ChainMeasurement(
        stages, groups, profile, int(fixed_before), int(measured_peak), int(end_peak), int(output_bytes)
    )


def _isolated_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The inputs with every tensor that requires grad cut from the caller's graph.

    The measured steps run backward: on the caller's tensors that would accumulate
    gradients into them (and into whatever they were computed from) and free the
    caller's graph before its own backward. Each such tensor is replaced by a clone of a
    detached alias: same values and flags, a graph of its own, and an in-place operation
    of the first stage lands on the clone.
    """
    leaves, spec = tree_flatten((args, kwargs))
    leaves = [
        leaf.detach().requires_grad_(True).clone()
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        else leaf
        for leaf in leaves
    ]
    return tree_unflatten(leaves, spec)


def _check_no_cache(output: Any) -> None:
    # NOTE [key/value caches]
    # A model that fills a key/value cache in its training forward (Hugging Face models
    # built with use_cache=True) appends to it again when remat recomputes a block: the
    # recompute then attends over twice the keys (NondeterministicRecompute, or a silently
    # corrupted cache), and the cache keeps the blocks' tensors alive against the plan.
    cache = output.get("past_key_values") if isinstance(output, Mapping) else getattr(output, "past_key_values", None)
    if cache is not None:
        raise UnsupportedModel(
            "the model returned a key/value cache (past_key_values) from its training forward; "
            "recomputing a block would append to that cache again. Build the model with "
            "use_cache=False (Hugging Face: from_pretrained(..., use_cache=False) or "
            "config.use_cache = False) or call it with use_cache=False"
        )


def _warn_side_effects(side_effects: dict[str, int]) -> None:
    from remat.memory import format_bytes

    stages = ", ".join(f"{name!r} ({format_bytes(nbytes)})" for name, nbytes in side_effects.items())
    warnings.warn(
        f"stages {stages} allocate memory that outlives the forward without being their output "
        "or saved for backward: state filled in place, such as a key/value cache. remat counts "
        "it as fixed memory, but recomputing these stages repeats the side effect (a cache grows, "
        "or the recompute computes something else). For Hugging Face models, build them with "
        "use_cache=False (or pass use_cache=False) for training",
        RuntimeWarning,
        stacklevel=5,
    )


def _bytes(storages: dict[int, int]) -> int:
    return int(sum(storages.values()))
