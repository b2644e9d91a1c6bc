"""Selective recompute: which operations of a recomputed block keep their outputs.

A *policy* answers, for each ATen operation a recomputed block runs in its first forward,
"keep this output, or recompute it in backward?". An output kept by the policy is held
until the block's backward and handed to the recompute instead of running the operation
again; every other operation runs again. Policies are small immutable callables,
combined with :func:`either` and :func:`both`, and accepted wherever ``policy=`` is::

    from remat import policies

    remat.recompute(block, x, policy=policies.save_matmuls)
    remat.apply(model, Block, policy=policies.recompute_ops(torch.ops.aten.gelu, "softmax"))
    remat.recompute(block, x, policy=policies.save_names("attention_scores"))   # with remat.tag

Decisions follow torch's ``CheckpointPolicy``: ``MUST_*`` and ``PREFER_*``. In eager
execution both strengths are obeyed; the strength decides between policies combined
with :func:`either` or :func:`both`, where a ``MUST`` beats a ``PREFER``.

Operations are named by ATen overload (``torch.ops.aten.mm.default``), by packet
(``torch.ops.aten.mm``, every overload), by a torch function (``torch.nn.functional.gelu``,
``torch.softmax``), or by a name as a string (``"gelu"``, ``"aten.mm"``). A function or a
bare name matches the ATen operation of that name and every operation run inside a call
of the torch function of that name (``F.dropout`` runs ``empty_like``, ``bernoulli_``,
``div_`` and ``mul`` on the CPU; ``Tensor.softmax`` and ``F.softmax`` are both "softmax").

Views and in-place operations are never kept: a view costs no memory and no time to
recompute, and an in-place operation's output is its input.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.errors import RematError

__all__ = [
    "Decision",
    "OpCall",
    "Policy",
    "PolicyLike",
    "as_policy",
    "both",
    "either",
    "offload_names",
    "offload_ops",
    "recompute_ops",
    "save_all",
    "save_collectives",
    "save_matmuls",
    "save_names",
    "save_nothing",
    "save_ops",
]


class Decision(enum.Enum):
    """What a policy decides for one operation (torch's ``CheckpointPolicy`` names)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_OFFLOAD = "must_offload"
    """Keep the output in host memory until the recompute needs it (no torch equivalent)."""

    @property
    def saves(self) -> bool:
        """Whether the operation's output is kept (on the device, or in host memory)."""
        return self in (Decision.MUST_SAVE, Decision.PREFER_SAVE, Decision.MUST_OFFLOAD)

    @property
    def offloads(self) -> bool:
        """Whether the kept output waits in host memory."""
        return self is Decision.MUST_OFFLOAD

    @property
    def must(self) -> bool:
        """Whether the decision is a ``MUST_*`` one."""
        return self in (Decision.MUST_SAVE, Decision.MUST_RECOMPUTE, Decision.MUST_OFFLOAD)

    @staticmethod
    def of(value: Any, source: object = None) -> Decision:
        """A policy's answer as a Decision: ``True`` is ``MUST_SAVE``, ``False`` ``PREFER_RECOMPUTE``."""
        if isinstance(value, Decision):
            return value
        if isinstance(value, bool):
            return Decision.MUST_SAVE if value else Decision.PREFER_RECOMPUTE
        raise RematError(
            f"the policy {source!r} returned {value!r}; a policy returns a remat.policies.Decision or a bool "
            "(True: keep the output)"
        )


@dataclass(frozen=True)
class OpCall:
    """One operation a policy decides on.

    Attributes:
        op: the ATen overload (``torch.ops.aten.mm.default``).
        args: its positional arguments.
        kwargs: its keyword arguments.
        function: the torch function being run when it ran (``"gelu"`` inside
            ``F.gelu``, ``"softmax"`` inside ``Tensor.softmax``), when the policy asked for
            it (:attr:`Policy.functions` is not empty); None otherwise.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    function: str | None = None


class Policy:
    """Base class of policies: ``policy(op, *args, **kwargs) -> Decision``."""

    #: names of torch functions the policy matches (see the module docstring)
    functions: frozenset[str] = frozenset()

    def decide(self, call: OpCall) -> Decision:
        """The decision for one operation."""
        raise NotImplementedError

    def decide_name(self, name: str) -> Decision | None:
        """The decision for a tensor named with :func:`remat.tag` (None: no opinion)."""
        return None

    @property
    def saves_everything(self) -> bool:
        """True for :data:`save_all`: the block runs as it would without recompute."""
        return False

    @property
    def recomputes_everything(self) -> bool:
        """True for :data:`save_nothing`: nothing of the block is kept (whole-block recompute)."""
        return False

    @property
    def names(self) -> frozenset[str]:
        """The tag names whose tensors the policy may keep."""
        return frozenset()

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.decide(OpCall(op, args, kwargs))


@dataclass(frozen=True)
class _Constant(Policy):
    decision: Decision
    label: str

    def decide(self, call: OpCall) -> Decision:
        return self.decision

    @property
    def saves_everything(self) -> bool:
        return self.decision.saves

    @property
    def recomputes_everything(self) -> bool:
        return not self.decision.saves

    def __repr__(self) -> str:
        return f"remat.policies.{self.label}"


@dataclass(frozen=True)
class _OpSet:
    """Operations named by overload, by packet, or by name (ATen packet or torch function)."""

    overloads: frozenset[Any] = frozenset()
    packets: frozenset[Any] = frozenset()
    names: frozenset[str] = frozenset()

    def matches(self, call: OpCall) -> bool:
        op = call.op
        if op in self.overloads:
            return True
        packet = getattr(op, "overloadpacket", None)
        if packet in self.packets:
            return True
        if not self.names:
            return False
        if call.function is not None and call.function in self.names:
            return True
        return packet is not None and _normalised(packet.__name__) in self.names

    def describe(self) -> str:
        parts = sorted(str(o) for o in self.overloads) + sorted(f"aten.{p.__name__}" for p in self.packets)
        return ", ".join(parts + sorted(repr(n) for n in self.names))

    def __reduce__(self) -> tuple[Any, ...]:
        # ATen operations do not pickle: they go by name (a marked module saved with torch.save)
        overloads = tuple(sorted((o.name(), o._overloadname) for o in self.overloads))
        packets = tuple(sorted(p._qualified_op_name for p in self.packets))
        return (_op_set_from_names, (overloads, packets, tuple(sorted(self.names))))


def _op_set_from_names(
    overloads: tuple[tuple[str, str], ...], packets: tuple[str, ...], names: tuple[str, ...]
) -> _OpSet:
    """An :class:`_OpSet` unpickled: each operation found again by its qualified name."""

    def packet(qualified: str) -> Any:
        namespace, name = qualified.split("::")
        return getattr(getattr(torch.ops, namespace), name)

    return _OpSet(
        frozenset(getattr(packet(name), overload) for name, overload in overloads),
        frozenset(packet(name) for name in packets),
        frozenset(names),
    )


@dataclass(frozen=True)
class _Ops(Policy):
    """``listed`` gets ``inside``, every other operation ``outside``."""

    listed: _OpSet
    inside: Decision
    outside: Decision
    label: str
    functions: frozenset[str] = field(default=frozenset())

    def decide(self, call: OpCall) -> Decision:
        return self.inside if self.listed.matches(call) else self.outside

    def __repr__(self) -> str:
        if self.label == "save_matmuls":
            return "remat.policies.save_matmuls"
        return f"remat.policies.{self.label}({self.listed.describe()})"


@dataclass(frozen=True)
class _Names(Policy):
    saved: frozenset[str]
    chosen: Decision = Decision.MUST_SAVE
    label: str = "save_names"

    def decide(self, call: OpCall) -> Decision:
        return Decision.PREFER_RECOMPUTE

    def decide_name(self, name: str) -> Decision | None:
        return self.chosen if name in self.saved else None

    @property
    def names(self) -> frozenset[str]:
        return self.saved

    def __repr__(self) -> str:
        return f"remat.policies.{self.label}({', '.join(map(repr, sorted(self.saved)))})"


# Which decision wins when policies are combined (first wins).
_EITHER_ORDER = (
    Decision.MUST_SAVE,
    Decision.MUST_OFFLOAD,
    Decision.MUST_RECOMPUTE,
    Decision.PREFER_SAVE,
    Decision.PREFER_RECOMPUTE,
)
_BOTH_ORDER = (
    Decision.MUST_RECOMPUTE,
    Decision.MUST_OFFLOAD,
    Decision.MUST_SAVE,
    Decision.PREFER_RECOMPUTE,
    Decision.PREFER_SAVE,
)


@dataclass(frozen=True)
class _Combined(Policy):
    parts: tuple[Policy, ...]
    order: tuple[Decision, ...]
    label: str

    @property
    def functions(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset().union(*(p.functions for p in self.parts))

    def _pick(self, decisions: Iterable[Decision | None]) -> Decision | None:
        present = {d for d in decisions if d is not None}
        return next((d for d in self.order if d in present), None)

    def decide(self, call: OpCall) -> Decision:
        decision = self._pick(part.decide(call) for part in self.parts)
        assert decision is not None
        return decision

    def decide_name(self, name: str) -> Decision | None:
        return self._pick(part.decide_name(name) for part in self.parts)

    @property
    def names(self) -> frozenset[str]:
        return frozenset().union(*(p.names for p in self.parts))

    # save_all and save_nothing decide with MUST: in either() save_all wins, in both() save_nothing
    @property
    def saves_everything(self) -> bool:
        if self.label == "either":
            return any(p.saves_everything for p in self.parts)
        return all(p.saves_everything for p in self.parts)

    @property
    def recomputes_everything(self) -> bool:
        if self.label == "both":
            return any(p.recomputes_everything for p in self.parts)
        return all(p.recomputes_everything for p in self.parts)

    def __repr__(self) -> str:
        return f"remat.policies.{self.label}({', '.join(map(repr, self.parts))})"


@dataclass(frozen=True)
class _Callable(Policy):
    function: Callable[..., Any]

    def decide(self, call: OpCall) -> Decision:
        return Decision.of(self.function(call.op, *call.args, **call.kwargs), self.function)

    def __repr__(self) -> str:
        return f"remat.policies.as_policy({getattr(self.function, '__qualname__', self.function)!r})"


save_all: Policy = _Constant(Decision.MUST_SAVE, "save_all")
"""Keep every output: the block runs as without recompute."""

save_nothing: Policy = _Constant(Decision.MUST_RECOMPUTE, "save_nothing")
"""Keep nothing but the block's inputs: whole-block recompute (the default)."""


_MATMUL_NAMES = (
    "mm",
    "addmm",
    "_addmm_activation",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "dot",
    "vdot",
    "mv",
    "addmv",
    "linear",
    "_int_mm",
    "_scaled_mm",
    "convolution",
    "_convolution",
    "convolution_overrideable",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "miopen_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def _aten_packets(names: Iterable[str]) -> frozenset[Any]:
    return frozenset(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


save_matmuls: Policy = _Ops(
    _OpSet(packets=_aten_packets(_MATMUL_NAMES)), Decision.MUST_SAVE, Decision.PREFER_RECOMPUTE, "save_matmuls"
)
"""Keep the outputs of matrix products, convolutions and fused attention; recompute the rest.

Megatron's selective recompute and JAX's ``dots_saveable``: the expensive operations are
not run again, the cheap pointwise ones (activations, softmax, dropout, norms) are.
"""


#: The namespaces of the functional collectives (``torch.distributed._functional_collectives``).
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd"})


def is_collective(op: Any) -> bool:
    """Whether `op` is a functional collective (or its wait) of ``torch.distributed``."""
    return getattr(op, "namespace", None) in COLLECTIVE_NAMESPACES


@dataclass(frozen=True)
class _SaveCollectives(Policy):
    """Keeps the outputs of ``torch.distributed``'s functional collectives; recomputes the rest."""

    def decide(self, call: OpCall) -> Decision:
        if is_collective(call.op) and "wait_tensor" not in str(call.op):
            return Decision.MUST_SAVE
        return Decision.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return "remat.policies.save_collectives"


save_collectives: Policy = _SaveCollectives()
"""Keep the outputs of the collectives a block runs; recompute the rest: its recompute does
not communicate. MindSpore's ``mp_comm_recompute=False``. The collectives are those of
``torch.distributed``'s functional API, which DTensor redistributions and tensor-parallel
layers issue (all-reduce, all-gather, reduce-scatter, all-to-all); in-place ``dist.*``
calls (``dist.all_reduce(t)``) are replayed. ``recompute(..., comm="save")`` adds it to the
block's policy.
"""


def _normalised(name: str) -> str:
    return name.strip("_")


def _op_set(ops: tuple[Any, ...], factory: str) -> _OpSet:
    if not ops:
        raise RematError(f"{factory}() needs at least one operation, e.g. {factory}(torch.ops.aten.gelu)")
    overloads: set[Any] = set()
    packets: set[Any] = set()
    names: set[str] = set()
    for op in ops:
        if isinstance(op, torch._ops.OpOverload):
            overloads.add(op)
        elif isinstance(op, torch._ops.OpOverloadPacket):
            packets.add(op)
        elif isinstance(op, str):
            resolved = _resolve_string(op, factory)
            if isinstance(resolved, str):
                names.add(resolved)
            elif isinstance(resolved, torch._ops.OpOverload):
                overloads.add(resolved)
            else:
                packets.add(resolved)
        elif callable(op) and isinstance(getattr(op, "__name__", None), str):
            names.add(_normalised(op.__name__))
        else:
            raise RematError(
                f"{factory}() takes ATen operations (torch.ops.aten.gelu, torch.ops.aten.mm.default), torch "
                f'functions (torch.nn.functional.gelu) or their names ("gelu"); got {op!r}'
            )
    return _OpSet(frozenset(overloads), frozenset(packets), frozenset(names))


def _resolve_string(text: str, factory: str) -> Any:
    """``"aten.mm"`` / ``"aten::mm"`` / ``"aten.mm.default"`` -> the op; a bare name stays a name."""
    dotted = text.replace("::", ".")
    if dotted.startswith("aten."):
        parts = dotted.split(".")[1:]
        packet = getattr(torch.ops.aten, parts[0], None) if parts and parts[0] else None
        if packet is None:
            raise RematError(f"{factory}(): there is no ATen operation {text!r}")
        if len(parts) == 1:
            return packet
        overload = getattr(packet, parts[1], None) if len(parts) == 2 else None
        if overload is None:
            raise RematError(f"{factory}(): {text!r} is not an overload of aten.{parts[0]} ({packet.overloads()})")
        return overload
    name = _normalised(text)
    import torch.nn.functional as functional

    if not name or not any(hasattr(space, name) for space in (torch, functional, torch.Tensor, torch.ops.aten)):
        raise RematError(
            f'{factory}(): {text!r} names no torch function and no ATen operation; pass e.g. "gelu", '
            '"softmax", "aten.mm" or the function itself'
        )
    return name


def save_ops(*ops: Any) -> Policy:
    """Keep the outputs of the given operations (``MUST_SAVE``); recompute the rest (``PREFER_RECOMPUTE``)."""
    listed = _op_set(ops, "save_ops")
    return _Ops(listed, Decision.MUST_SAVE, Decision.PREFER_RECOMPUTE, "save_ops", listed.names)


def recompute_ops(*ops: Any) -> Policy:
    """Recompute only the given operations (``MUST_RECOMPUTE``); keep every other output (``PREFER_SAVE``).

    The form of MindSpore's ``Primitive.recompute()``: mark single operations, such as
    an activation or a dropout, in a forward you do not change.
    """
    listed = _op_set(ops, "recompute_ops")
    return _Ops(listed, Decision.MUST_RECOMPUTE, Decision.PREFER_SAVE, "recompute_ops", listed.names)


def save_names(*names: str) -> Policy:
    """Keep the tensors named with :func:`remat.tag` by one of `names`; recompute the rest.

    JAX's ``save_only_these_names``. The tensor's whole operation output is kept (the
    base, when the tagged tensor is a view).
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise RematError(f"save_names() takes one or more non-empty strings, got {names!r}")
    return _Names(frozenset(names))


def offload_ops(*ops: Any) -> Policy:
    """Keep the outputs of the given operations in host memory (``MUST_OFFLOAD``); recompute the rest.

    Each listed output is copied to host memory when the operation returns (on the
    device's stream, after the operation) and copied back when the recompute reaches it,
    in place of running the operation again: a matrix product's output, say, costs the
    device nothing between the forward and the backward. Nothing is prefetched: the copy
    back runs when the recompute needs it (the planner's offload overlaps its copies,
    ``remat.enable(model, budget, offload=True)``). It pays only on an accelerator.
    """
    listed = _op_set(ops, "offload_ops")
    return _Ops(listed, Decision.MUST_OFFLOAD, Decision.PREFER_RECOMPUTE, "offload_ops", listed.names)


def offload_names(*names: str) -> Policy:
    """Keep the tensors named with :func:`remat.tag` by one of `names` in host memory; recompute the rest.

    JAX's ``save_and_offload_only_these_names`` for the offloaded names (see :func:`offload_ops`).
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise RematError(f"offload_names() takes one or more non-empty strings, got {names!r}")
    return _Names(frozenset(names), Decision.MUST_OFFLOAD, "offload_names")


def either(*policies: PolicyLike) -> Policy:
    """Keep an output when any of `policies` keeps it; a ``MUST`` beats a ``PREFER``.

    When two ``MUST`` decisions disagree, the output is kept.
    """
    return _combined(policies, _EITHER_ORDER, "either")


def both(*policies: PolicyLike) -> Policy:
    """Keep an output only when all of `policies` keep it; a ``MUST`` beats a ``PREFER``.

    When two ``MUST`` decisions disagree, the output is recomputed.
    """
    return _combined(policies, _BOTH_ORDER, "both")


def _combined(policies: tuple[PolicyLike, ...], order: tuple[Decision, ...], label: str) -> Policy:
    if not policies:
        raise RematError(f"{label}() needs at least one policy")
    return _Combined(tuple(as_policy(p) for p in policies), order, label)


PolicyLike = Policy | bool | Callable[..., Any] | None
"""What ``policy=`` accepts: a Policy, a bool (``True``: keep everything), a callable
``(op, *args, **kwargs) -> Decision | bool``, or None (:data:`save_nothing`)."""


def as_policy(value: PolicyLike) -> Policy:
    """Normalises what ``policy=`` accepts into a :class:`Policy`.

    ``None`` and ``False`` are :data:`save_nothing` (recompute everything), ``True`` is
    :data:`save_all`, a callable ``(op, *args, **kwargs)`` returns a :class:`Decision` or a
    bool (``True``: keep the output).
    """
    if value is None or value is False:
        return save_nothing
    if value is True:
        return save_all
    if isinstance(value, Policy):
        return value
    if callable(value):
        return _Callable(value)
    raise RematError(
        f"policy must be a remat.policies policy, a bool or a function (op, *args, **kwargs) -> Decision; "
        f"got {type(value).__name__}"
    )
