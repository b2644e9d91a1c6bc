"""``remat.explain``: every operation of a step, and what recompute does with its output.

The equivalent of MindSpore's graph dump of recomputed operators: one forward and one
backward run under observation, and each ATen operation is listed with its output's
shape and bytes and whether that output is kept for backward (by autograd, or by the
policy), recomputed in backward, or freed after the forward; then every operation the
backward runs: the recomputes (and the kept outputs handed to them) and the gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.manual import _selective, _state
from remat.manual._rng import preserved_host_rng
from remat.manual._tensors import storage_key
from remat.manual.policies import PolicyLike
from remat.units import format_bytes

__all__ = ["ExplainedOp", "Explanation", "explain"]

FORWARD_STATUSES = ("kept", "saved", "recomputed", "freed", "view", "in-place")


@dataclass
class ExplainedOp:
    """One operation run by the step.

    Attributes:
        phase: "forward", "recompute" (run again in backward to rebuild saved tensors)
            or "backward" (a gradient).
        op: the ATen overload, e.g. "aten.mm.default".
        shapes: the shapes of its tensor outputs.
        nbytes: bytes of the new storage its outputs hold (0 for views and in-place ops).
        status: for a forward operation, what becomes of its output: "kept" (kept by the
            policy until backward, and handed to the recompute), "saved" (kept by
            autograd, or as the input of a recomputed block), "recomputed" (autograd
            needs it and the recompute makes it again), "freed" (backward does not need
            it), "view" or "in-place" (no new memory of its own). In backward:
            "recomputed", "served" (a kept output handed over; the op does not run) or
            "gradient".
        decision: the policy's decision, when a policy decided ("must_save", ...).
        reruns: for a forward operation, how many times it ran again in backward.
        view: whether the operation is a view (its output aliases its input: no memory,
            no work); the summary leaves views out.
    """

    phase: str
    op: str
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    status: str
    decision: str | None = None
    reruns: int = 0
    view: bool = False


@dataclass
class Explanation:
    """What :func:`explain` saw: the operations, and totals over them. ``print`` it."""

    ops: list[ExplainedOp] = field(default_factory=list)

    def forward(self) -> list[ExplainedOp]:
        """The forward's operations."""
        return [o for o in self.ops if o.phase == "forward"]

    def backward(self) -> list[ExplainedOp]:
        """The backward's operations: recomputes, outputs handed over, gradients."""
        return [o for o in self.ops if o.phase != "forward"]

    def counts(self, phase: str, *, status: str | None = None) -> Counter[str]:
        """How many times each ATen operation (by name, e.g. "mm") ran in `phase`.

        Outputs handed to a recompute (status "served") did not run and are not counted
        unless asked for with ``status="served"``.
        """
        return Counter(
            _short(o.op)
            for o in self.ops
            if o.phase == phase and (o.status == status if status is not None else o.status != "served")
        )

    @property
    def totals(self) -> dict[str, int]:
        """Totals: operations per phase and bytes per forward status."""
        forward = self.forward()
        totals = {
            "forward_ops": len(forward),
            "recomputed_ops": sum(1 for o in self.ops if o.phase == "recompute" and o.status == "recomputed"),
            "served_ops": sum(1 for o in self.ops if o.status == "served"),
            "gradient_ops": sum(1 for o in self.ops if o.phase == "backward"),
        }
        for status in FORWARD_STATUSES[:-2]:
            totals[f"{status}_bytes"] = sum(o.nbytes for o in forward if o.status == status)
        return totals

    def to_dict(self) -> dict[str, Any]:
        """The explanation as plain data (JSON-ready)."""
        return {
            "totals": self.totals,
            "ops": [
                {
                    "phase": o.phase,
                    "op": o.op,
                    "shapes": [list(s) for s in o.shapes],
                    "nbytes": o.nbytes,
                    "status": o.status,
                    "decision": o.decision,
                    "reruns": o.reruns,
                    "view": o.view,
                }
                for o in self.ops
            ],
        }

    def summary(self) -> list[dict[str, Any]]:
        """One row per ATen operation but views: runs in each phase, and bytes per forward status."""
        rows: dict[str, dict[str, Any]] = {}
        for o in self.ops:
            if o.view:
                continue
            row = rows.setdefault(
                _short(o.op),
                {"op": _short(o.op), "forward": 0, "recompute": 0, "served": 0, "backward": 0}
                | {f"{s}_bytes": 0 for s in FORWARD_STATUSES[:-2]},
            )
            if o.status == "served":
                row["served"] += 1
            else:
                row[o.phase] += 1
            if o.phase == "forward" and o.status != "in-place":
                row[f"{o.status}_bytes"] += o.nbytes
        return sorted(rows.values(), key=lambda r: (-(r["recomputed_bytes"] + r["kept_bytes"]), r["op"]))

    def format(self, *, ops: bool = False) -> str:
        """The totals and the per-operation summary; with ``ops=True``, every operation too."""
        t = self.totals
        lines = [
            f"forward: {t['forward_ops']} ops | kept by the policy {format_bytes(t['kept_bytes'])}, "
            f"saved {format_bytes(t['saved_bytes'])}, recomputed {format_bytes(t['recomputed_bytes'])}, "
            f"freed {format_bytes(t['freed_bytes'])}",
            f"backward: {t['recomputed_ops']} ops recomputed, {t['served_ops']} kept outputs handed over, "
            f"{t['gradient_ops']} gradient ops",
            "",
            f"{'op':<34}{'fwd':>5}{'again':>6}{'served':>7}{'bwd':>5}{'kept':>11}{'saved':>11}{'recomputed':>12}",
        ]
        for r in self.summary():
            lines.append(
                f"{r['op'][:33]:<34}{r['forward']:>5}{r['recompute']:>6}{r['served']:>7}{r['backward']:>5}"
                f"{_bytes(r['kept_bytes']):>11}{_bytes(r['saved_bytes']):>11}{_bytes(r['recomputed_bytes']):>12}"
            )
        if ops:
            lines += ["", f"{'phase':<10}{'op':<40}{'status':<11}{'bytes':>11}  shapes"]
            for o in self.ops:
                shapes = ", ".join(str(list(s)) for s in o.shapes)
                lines.append(f"{o.phase:<10}{o.op[:39]:<40}{o.status:<11}{_bytes(o.nbytes):>11}  {shapes}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _bytes(n: int) -> str:
    return format_bytes(n) if n else "-"


def _short(op: str) -> str:
    name = op.removeprefix("aten.")
    for suffix in (".default", ".Tensor", ".Scalar"):
        name = name.removesuffix(suffix)
    return name


class _Observer(TorchDispatchMode):
    """Sees every operation that runs; numbered ones come with their key from the selective mode."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: list[ExplainedOp] = []
        self.by_key: dict[Any, int] = {}  # (cache, block, index) -> forward row
        # storage pointer -> the forward row that made it, and its output
        self.by_storage: dict[int, tuple[int, Any]] = {}
        self.caches: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        pending = _selective.take_pending()
        out = func(*args, **(kwargs or {}))
        if _selective.is_internal():
            return out
        key, decision = pending if pending is not None else (None, None)
        self._row(func, out, key, decision, None)
        return out

    def _new_storages(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose storage no live output of an earlier forward operation holds."""
        fresh = []
        for t in tensors:
            if t.layout != torch.strided:
                continue
            known = self.by_storage.get(storage_key(t))
            alive = known is not None and known[1]() is not None
            if not alive:
                fresh.append(t)
        return fresh

    def _row(self, func: Any, out: Any, key: Any, decision: Any, status: str | None) -> None:
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        aliases = _selective.unnumbered(func)
        view = bool(getattr(func, "is_view", False))
        fresh = [] if aliases else self._new_storages(tensors) if self.phase == "forward" else tensors
        nbytes = sum(t.numel() * t.element_size() for t in fresh)
        if self.phase == "forward":
            status = ("view" if view else "in-place") if aliases else "freed"
            row = ExplainedOp("forward", str(func), tuple(tuple(t.shape) for t in tensors), nbytes, status, view=view)
            row.decision = decision.value if decision is not None else None
            index = len(self.ops)
            self.ops.append(row)
            if key is not None:
                self.by_key[key] = index
            for t in fresh:
                self.by_storage[storage_key(t)] = (index, weakref.ref(t))
            return
        phase = "recompute" if _state.is_recomputing() else "backward"
        status = status or ("recomputed" if phase == "recompute" else "gradient")
        shapes = tuple(tuple(t.shape) for t in tensors)
        self.ops.append(
            ExplainedOp(phase, str(func), shapes, nbytes, status, view=bool(getattr(func, "is_view", False)))
        )
        if key is not None and key in self.by_key and status == "recomputed":
            self.ops[self.by_key[key]].reruns += 1

    # -- told by remat's hooks
    def on_served(self, func: Any, out: Any, key: Any) -> None:
        self._row(func, out, key, None, "served")

    def on_kept(self, cache: Any, key: Any = None) -> None:
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)

    def on_saved(self, tensor: torch.Tensor, discarded: bool) -> None:
        if self.phase != "forward" or tensor.layout != torch.strided:
            return
        known = self.by_storage.get(storage_key(tensor))
        if known is None:
            return
        index = known[0]
        row = self.ops[index]
        if discarded and row.status == "freed":
            row.status = "recomputed"
        elif not discarded:
            row.status = "saved"

    def end_forward(self) -> None:
        for cache in self.caches:
            for block, entries in cache.entries.items():
                for index, kept in entries.items():
                    if kept.skipped:  # let go: nothing read it (NOTE [keeping only what the recompute reads])
                        continue
                    row = self.by_key.get((id(cache), block, index))
                    if row is not None:
                        self.ops[row].status = "kept"
        self.caches = []
        self.phase = "backward"


def explain(
    function: Callable[..., Any], *args: Any, policy: PolicyLike | EllipsisType = ..., **kwargs: Any
) -> Explanation:
    """Runs one forward and backward of `function` and explains what recompute does.

    With `policy` (None meaning whole-block recompute), `function` runs as
    :func:`remat.recompute` with that policy; without, it runs as it is, with its marked
    modules and the plans of an enabled model. The backward starts from the tensor
    outputs (``ones`` as their gradients; the ``loss`` of an output that has one) and
    gives no tensor a ``.grad``. The buffers of `function` (a module, or a module's
    method) and of the modules among the arguments, and the random-number generators, are
    left as they were; a module reached only through a closure keeps what its forward
    changed (BatchNorm statistics).

    Example::

        print(remat.explain(block, x, policy=remat.policies.save_matmuls))
    """
    from remat.manual.recompute import recompute

    def run() -> Any:
        if isinstance(policy, EllipsisType):
            return function(*args, **kwargs)
        return recompute(function, *args, policy=policy, **kwargs)

    observer = _Observer()
    with _restored_state(function, args, kwargs), _selective.observed_by(observer), observer:
        with torch.autograd.graph.saved_tensors_hooks(_outer_pack(observer), lambda t: t):
            out = run()
        observer.end_forward()
        roots = _backward_roots(out)
        with _selective.internal():
            grads = [torch.ones_like(t) for t in roots]
        leaves = _graph_leaves(roots)
        if roots and leaves:
            torch.autograd.grad(roots, leaves, grads, allow_unused=True)
        elif roots:
            torch.autograd.backward(roots, grads)  # no leaf: nothing gets a gradient
        del out, roots, grads, leaves
    return Explanation(observer.ops)


def _outer_pack(observer: _Observer) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        observer.on_saved(tensor, discarded=False)
        return tensor

    return pack


def _backward_roots(out: Any) -> list[torch.Tensor]:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return [loss]
    values = out.values() if isinstance(out, dict) else out
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def _graph_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors the backward from `roots` reaches (so that none of them gets a ``.grad``)."""
    leaves = [r for r in roots if r.grad_fn is None]
    seen: set[Any] = set()
    pending = [r.grad_fn for r in roots if r.grad_fn is not None]
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        pending += [following for following, _ in node.next_functions if following is not None]
    return leaves


@contextlib.contextmanager
def _restored_state(function: Any, args: Any, kwargs: Any) -> Iterator[None]:
    module = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    modules = [module] if isinstance(module, nn.Module) else []
    modules += [m for m in tree_leaves((args, kwargs)) if isinstance(m, nn.Module)]
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    devices = sorted(
        {t.device.index for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
        | {p.device.index for m in modules for p in m.parameters() if p.device.type == "cuda"}
    )
    try:
        with torch.random.fork_rng(devices=devices), preserved_host_rng():
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
