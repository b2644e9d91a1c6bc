"""What each planned stage keeps, and costs, stored under a policy: the profile's store options.

NOTE [sizing store options]
For every policy the planner may store stages under (``policy=`` with a budget), each
stage call is run once, on fake tensors, as :func:`remat.recompute` under the policy,
forward and backward, from its input in a forward of the model without grad; the
operations are observed as :func:`remat.explain` observes them. Of the call's outputs:

* *kept* are those the policy keeps (held until the call's backward, then handed to its
  recompute); those that autograd saves too are *shared* (the recompute takes them over);
* *saved* are those autograd saves and the policy does not keep, made again by the
  recompute.

The planned stage's ``saved_bytes`` under the option is its ``saved_bytes`` stored whole,
less what its calls' autograd saves, plus what they keep: what the model's code between
calls saves (a residual addition's inputs) stays as it is. A group of calls keeps the
inputs of its calls after the first (each call is its own block, which keeps its input).
The output is kept when a kept operation returned it, or when the stage stored whole
keeps it (the model's code after the call, which runs as it is, may save it). The option's extra time is timed
by the timing pass where it can be (NOTE [timing store options] in
:mod:`remat.measure.timing`: a group of one stage call whose backward is timed); elsewhere
(groups of several calls, the last stage, times estimated or scaled from another shape) it
is estimated: the operations the recompute runs again, priced by the device's cost model
(:mod:`remat.measure.estimate`) as a share of the call's timed forward, plus the policy's
cost of deciding on each operation of the forward and the recompute, timed once per
process (:func:`policy_call_s`), the whole scaled by how the timed calls' own estimates
compared with their timings (the estimate alone was about half the timing on GPT-2).
Bytes are exact.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from remat._no_grad import forward_without_grad
from remat.discover.chain import Chain
from remat.discover.intercept import call_original, intercept_stages, missing_stages
from remat.errors import RematError
from remat.manual import _selective
from remat.manual._tensors import storage_key
from remat.manual.explain import _Observer, _outer_pack
from remat.manual.policies import Policy, as_policy, either, save_collectives, save_matmuls
from remat.manual.recompute import recompute
from remat.measure.assemble import ChainMeasurement
from remat.measure.estimate import CostModel, _median_s, calibrated_cost_model, dominant_dtype
from remat.measure.fake import FakeRunFailed, on_fake_tensors
from remat.measure.instrument import StageMeasurement, Work, tensors_in
from remat.measure.isolation import preserved_model_state
from remat.measure.step import step_device
from remat.measure.timing import _cut_inputs, _detached
from remat.plan.options import StoreOption

__all__ = [
    "PLANNED_COMM_OPTIONS",
    "CallUnderPolicy",
    "named_policies",
    "option_name",
    "policy_call_s",
    "store_options",
    "with_store_options",
]


def option_name(policy: Policy) -> str:
    """The name a plan gives a policy's store option: its repr without the module."""
    return repr(policy).replace("remat.policies.", "")


#: The automatic mode's values of ``comm=`` (NOTE [planned collectives]).
PLANNED_COMM_OPTIONS = ("recompute", "auto")


# NOTE [planned collectives]
# A stage recomputed whole runs its collectives again (an all-reduce of a row-parallel
# layer, a DTensor redistribution). With comm="auto", the planner may instead store a
# stage under save_collectives: the stage keeps its collectives' outputs from the first
# forward and recomputes the rest of itself in its backward, so it does not communicate
# again, for the memory of those outputs. It is one more store option, sized on fake
# tensors and timed like every other (NOTE [timing store options]): the planner weighs
# its bytes and time against storing the stage and recomputing it whole, stage by stage.
# Each policy= option is offered with save_collectives too (either of them saves). The
# manual entry points' comm="save" keeps the collectives of every recompute; the
# automatic mode does not force it, since a stage recomputed within a larger region has
# no place to keep them.
def named_policies(policy: Any, comm: str = "recompute", *, planned: bool = True) -> dict[str, Policy]:
    """The store options of ``policy=`` with a budget: one policy, or a sequence of them, by
    name (None: none), and with ``comm="auto"`` the same with collectives kept (NOTE
    [planned collectives]). `planned` False (``policy=`` without a budget): none.

    Raises:
        NotImplementedError: a mapping of stages to policies (with a budget).
        RematError: a value is not a policy, two policies have one name, or `comm` is not one
            of ``PLANNED_COMM_OPTIONS`` (``"auto"`` needs a budget).
    """
    if comm not in PLANNED_COMM_OPTIONS:
        hint = " (the manual entry points' 'save' is not planned: 'auto' lets the planner keep them)"
        raise RematError(
            f"comm must be one of {list(PLANNED_COMM_OPTIONS)} in the automatic mode, got {comm!r}"
            + (hint if comm == "save" else "")
        )
    if not planned:
        if comm == "auto":
            raise RematError(
                "comm='auto' lets the planner keep collectives' outputs under a budget; with policy= "
                "and no budget, pass policy=remat.policies.either(policy, remat.policies.save_collectives)"
            )
        return {}
    if policy is None:
        values: list[Any] = []
    elif isinstance(policy, Mapping):
        raise NotImplementedError(
            "a budget with a mapping of stages to policies is not implemented: with a budget, pass a "
            "policy (or a list of policies) the planner may store any stage under, or the mapping alone"
        )
    else:
        values = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    checked = [as_policy(value) for value in values]
    if comm == "auto":
        checked += [either(p, save_collectives) for p in checked] + [save_collectives]
    named: dict[str, Policy] = {}
    for option in checked:
        name = option_name(option)
        if name in named:
            raise RematError(f"policy= names {name!r} twice; give each store option once")
        named[name] = option
    return named


@dataclass(frozen=True)
class CallUnderPolicy:
    """One stage call run under a policy (see NOTE [sizing store options]).

    Attributes:
        kept_bytes: bytes of the outputs the policy keeps, the call's output not counted.
        shared_bytes: of those, the bytes autograd saves too.
        autograd_bytes: bytes autograd saves of what the call makes, its output not counted
            (what the block stored whole keeps of its own).
        keeps_output: whether a kept operation returned the call's output.
        forward_work: the work of the call's forward.
        recompute_work: the work its recompute runs again.
        dispatched: the operations the policy's mode sees, in the forward and the recompute.
    """

    kept_bytes: int
    shared_bytes: int
    autograd_bytes: int
    keeps_output: bool
    forward_work: Work
    recompute_work: Work
    dispatched: int


class _Probe(_Observer):
    """:func:`remat.explain`'s observer that also counts each operation's flops."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        rows = len(self.ops)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.ops) > rows:
            count = flop_registry.get(func._overloadpacket)
            self.flops.append(0 if count is None else int(count(*args, **(kwargs or {}), out_val=out)))
        return out

    def work(self, rows: Sequence[int]) -> Work:
        return Work(
            sum(self.flops[row] for row in rows),
            len(rows),
            sum(self.ops[row].nbytes for row in rows),
        )


def _run_under_policy(module: nn.Module, args: Any, kwargs: Any, policy: Policy) -> CallUnderPolicy:
    """Runs one stage call under `policy`, forward and backward, observed (grad on, inputs cut)."""
    probe = _Probe()
    with _selective.observed_by(probe), probe:
        with torch.autograd.graph.saved_tensors_hooks(_outer_pack(probe), lambda t: t):
            out = recompute(call_original, module, args, kwargs, policy=policy)
        before_end = [row.status for row in probe.ops]
        probe.end_forward()
        outputs = {storage_key(t) for t in tensors_in(out) if t.layout == torch.strided}
        # (the storages of outputs freed early are reused: only live ones are looked up)
        made = {row for row, op in enumerate(probe.ops) if op.nbytes and op.status not in ("view", "in-place")}
        output_rows = {row for key, (row, _) in probe.by_storage.items() if key in outputs}
        kept = shared = autograd = 0
        for row in made - output_rows:
            nbytes, status, was = probe.ops[row].nbytes, probe.ops[row].status, before_end[row]
            if status == "kept":
                kept += nbytes
                shared += nbytes if was == "recomputed" else 0
            if was in ("recomputed", "saved"):
                autograd += nbytes
        keeps_output = any(probe.ops[row].status == "kept" for row in output_rows)
        # (fake tensors answer device queries as operations of their own: not the model's)
        operations = [i for i, row in enumerate(probe.ops) if not row.op.startswith("prim.")]
        forward_rows = [i for i in operations if not probe.ops[i].view]
        roots = [t for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
        if roots:
            with _selective.internal():
                grads = [torch.ones_like(t) for t in roots]
            torch.autograd.backward(roots, grads)
        # what the recompute ran again (the kept operations are served, not run); it
        # dispatches every operation of the block again, served ones and views included
        recompute_rows = [i for i in forward_rows if probe.ops[i].reruns]
        dispatched = 2 * len(operations)
        del out, roots
    return CallUnderPolicy(
        kept, shared, autograd, keeps_output, probe.work(forward_rows), probe.work(recompute_rows), dispatched
    )


class _OptionPass:
    """Called instead of each stage module: runs it under every policy, then on without grad."""

    def __init__(self, chain: Chain, stages: list[StageMeasurement], policies: Mapping[str, Policy]) -> None:
        self.chain = chain
        self.stages = stages
        self.policies = policies
        self.calls: list[dict[str, CallUnderPolicy]] = []

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        figures = {}
        with torch.enable_grad():
            cut_args, cut_kwargs = _cut_inputs(args, kwargs, self.stages[index])
            for name, policy in self.policies.items():
                figures[name] = _run_under_policy(module, cut_args, cut_kwargs, policy)
        self.calls.append(figures)
        return _detached(call_original(module, args, kwargs))


@functools.lru_cache(maxsize=8)
def policy_call_s(device: str) -> float:
    """Seconds a policy's dispatch mode adds to one operation on `device` (measured once, tiny tensors)."""
    target = torch.device(device)
    synchronize = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)
    calls = 200
    start = torch.ones(4, device=target, requires_grad=True)

    def block(value: torch.Tensor) -> torch.Tensor:
        for _ in range(calls):
            value = value * 1.0001
        return value

    plain_s = _median_s(lambda: block(start), synchronize, 5)
    selective_s = _median_s(lambda: recompute(block, start, policy=save_matmuls), synchronize, 5)
    return max(0.0, selective_s - plain_s) / calls


def store_options(
    model: nn.Module,
    chain: Chain,
    measurement: ChainMeasurement,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    policies: Mapping[str, Policy],
) -> tuple[StoreOption, ...]:
    """The store options of `measurement`'s planned stages under `policies` (NOTE [sizing store options]).

    Runs the model once on fake tensors; the model is left as it was.
    """
    devices = [p.device for p in model.parameters()]
    with preserved_model_state(model, devices), on_fake_tensors(model, device) as fake:
        fake_args, fake_kwargs = fake.inputs(args, kwargs)
        probe = _OptionPass(chain, measurement.stages, policies)
        with fake.mode, forward_without_grad(), intercept_stages(chain, probe):
            model(*fake_args, **fake_kwargs)
    if len(probe.calls) != len(chain):
        raise missing_stages(chain, len(probe.calls), " while sizing options")
    # the cost model's tensors hold no more than a stage saves (the timing pass held as much): a
    # first step planned at the least budget keeps it (NOTE [calibrating within the budget])
    held = max((sum(nbytes for nbytes, _ in s.saved_storages.values()) for s in measurement.stages), default=0)
    cost = (
        calibrated_cost_model(device, dominant_dtype(list(model.parameters())), max_bytes=held)
        if device.type != "meta"
        else None
    )
    per_op_s = policy_call_s(str(device)) if device.type != "meta" else 0.0
    return tuple(_option(name, measurement, probe.calls, cost, per_op_s) for name in policies)


def _seconds(cost: CostModel | None, work: Work) -> float:
    if cost is None:
        return float(work.flops + work.allocated_bytes + work.operations)
    return cost.seconds(work)


def _option(
    name: str,
    measurement: ChainMeasurement,
    calls: list[dict[str, CallUnderPolicy]],
    cost: CostModel | None,
    per_op_s: float,
) -> StoreOption:
    profile = measurement.profile
    saved: list[int | None] = []
    shared: list[int] = []
    outputs: list[bool] = []
    extras: list[float] = []

    def estimated_s(index: int) -> float:
        f = calls[index][name]
        share = _seconds(cost, f.recompute_work) / max(_seconds(cost, f.forward_work), 1e-12)
        return measurement.stages[index].forward_time_s * min(1.0, share) + per_op_s * f.dispatched

    # the estimate, scaled by what the timed calls took against their own estimates
    timed = [(index, extra[name]) for index, extra in enumerate(measurement.option_extra_s) if name in extra]
    estimated_of_timed = sum(estimated_s(index) for index, _ in timed)
    scale = sum(seconds for _, seconds in timed) / estimated_of_timed if timed and estimated_of_timed > 0 else 1.0
    for group, (first, stop) in enumerate(measurement.groups):
        figures = [calls[index][name] for index in range(first, stop)]
        whole = profile.saved_bytes[group]
        autograd = sum(f.autograd_bytes for f in figures)
        inner_inputs = sum(_input_bytes(measurement, index) for index in range(first + 1, stop))
        kept = max(0, whole - autograd) + sum(f.kept_bytes for f in figures) + inner_inputs
        saved.append(kept)
        shared.append(min(sum(f.shared_bytes for f in figures), whole, kept))
        # the model's code after the call (its glue) runs as it is and may save the stage's
        # output (a ReLU after a residual addition): kept then as when stored whole
        outputs.append(figures[-1].keeps_output or profile.saves_output[group])
        extra = 0.0
        for index in range(first, stop):
            own = measurement.option_extra_s[index] if measurement.option_extra_s else {}
            # NOTE [timing store options]: timed where it could be, else estimated
            extra += own[name] if name in own else scale * estimated_s(index)
        extras.append(extra)
    return StoreOption(name, tuple(saved), tuple(outputs), tuple(extras), tuple(shared))


def _input_bytes(measurement: ChainMeasurement, index: int) -> int:
    """Bytes of stage call `index`'s input (what the call before it returned to it)."""
    return sum(measurement.stages[index].input_storages.values())


def with_store_options(
    model: nn.Module,
    chain: Chain,
    measurement: ChainMeasurement,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policies: Mapping[str, Policy],
) -> ChainMeasurement:
    """`measurement` with its profile's store options under `policies` (NOTE [sizing store options]).

    Raises:
        RematError: the model cannot run on fake tensors, where the options are sized.
    """
    try:
        options = store_options(model, chain, measurement, args, kwargs, step_device(model, args, kwargs), policies)
    except FakeRunFailed as error:
        raise RematError(
            f"storing stages under a policy needs a model that runs on fake tensors, where the options are "
            f"sized, and this one does not ({error}); pass a budget without policy="
        ) from None
    profile = dataclasses.replace(measurement.profile, store_options=options)
    return dataclasses.replace(measurement, profile=profile)
