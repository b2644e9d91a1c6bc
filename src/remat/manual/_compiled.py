"""Recompute inside code that ``torch.compile`` traces.

NOTE [recompute under torch.compile]
remat's own implementations run Python during the backward (saved-tensor hooks, RNG
replay, a guard on running statistics) that Dynamo cannot put in a graph: traced, they
break the graph and run eagerly. Inside a traced region a recomputed block is therefore
handed to the compiler in the form it understands: ``torch.utils.checkpoint.checkpoint``
(non-reentrant), which Dynamo turns into one higher-order operation whose nodes carry a
recompute tag that AOTAutograd's partitioner honours; a policy becomes torch's selective
checkpointing policy, decided on the same ATen operations. What the compiler guarantees
then, in place of remat's own machinery:

* gradients: the partitioner recomputes the tagged nodes in the backward graph from the
  block's inputs; random operations are never recomputed there (their outputs are kept),
  so dropout masks are the original ones;
* running statistics: a normalisation layer's buffer update is a mutation of the forward
  graph, applied once; the backward graph only recomputes values;
* ``output_recompute`` and ``use_reentrant`` do not change the compiled graph: the
  partitioner decides for the block's output as for every tagged node (it may keep it or
  recompute it), and there is one compiled form;
* :func:`remat.is_recomputing` is False while the block is traced: the compiled backward
  does not run Python.

What cannot be said to the partitioner is refused when the code is traced, never run
with other semantics: policies that match tensors named with :func:`remat.tag` or torch
functions rather than ATen operations, a ``context_fn`` together with a policy, and
``debug=True``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat.manual._rng import ForwardState, capture_forward_state, replay_forward_state
from remat.manual._tensors import RecomputeOptions
from remat.manual.policies import Decision, Policy

__all__ = ["compiling", "recompute_compiled"]

_POLICIES = {
    Decision.MUST_SAVE: CheckpointPolicy.MUST_SAVE,
    Decision.PREFER_SAVE: CheckpointPolicy.PREFER_SAVE,
    Decision.MUST_RECOMPUTE: CheckpointPolicy.MUST_RECOMPUTE,
    Decision.PREFER_RECOMPUTE: CheckpointPolicy.PREFER_RECOMPUTE,
}


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing the code that runs now."""
    return bool(torch.compiler.is_compiling())


def recompute_compiled(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], options: RecomputeOptions
) -> Any:
    """Runs a recomputed block, traced by Dynamo, as torch's checkpoint operation (see the NOTE)."""
    policy = options.policy
    if policy.saves_everything:
        return function(*args, **kwargs)
    if options.debug:
        raise NotImplementedError(
            "remat.recompute(..., debug=True) cannot run under torch.compile: the compiled backward "
            "runs no Python to trace; debug the block without torch.compile"
        )
    context_fn = options.context_fn
    if not policy.recomputes_everything:
        _check_compilable(policy)
        if context_fn is not None:
            raise NotImplementedError(
                "under torch.compile a policy is passed to the compiler as a context_fn; pass either "
                "policy= or context_fn=, not both"
            )
    if context_fn is None:
        decide = _always_recompute if policy.recomputes_everything else functools.partial(_decide, policy)
        context_fn = functools.partial(create_selective_checkpoint_contexts, decide)
    return checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=options.preserve_rng_state,
        determinism_check=options.determinism_check,
        context_fn=functools.partial(_replaying_contexts, context_fn, options.preserve_rng_state),
        **kwargs,
    )


# NOTE [the checkpoint operation run eagerly]
# The compiled graph holds torch's checkpoint operation; AOTAutograd (aot_eager, inductor)
# traces through it and partitions the joint graph, keeping random outputs. The "eager"
# backend instead runs the operation as it is: torch's checkpoint, with the RNG state
# not preserved (its implementation leaves that to the compiler), so a recomputed dropout
# would draw other numbers. The contexts remat hands to it capture the RNG (and autocast)
# state as the forward enters and replay it around the recompute, when they run on real
# tensors; traced (fake tensors), they do nothing but torch's own.
def _replaying_contexts(inner: Callable[[], tuple[Any, Any]], preserve_rng_state: bool) -> tuple[Any, Any]:
    """The contexts of `inner`, with RNG capture and replay added (a ``context_fn``)."""
    forward, recompute = inner()
    if torch._guards.detect_fake_mode() is not None:
        return forward, recompute  # traced by AOTAutograd, which keeps random outputs itself
    captured: list[ForwardState] = []
    return _WithState(forward, captured, preserve_rng_state, False), _WithState(
        recompute, captured, preserve_rng_state, True
    )


class _WithState:
    """One of torch's checkpoint contexts, entered after capturing (or replaying) the RNG state.

    Attributes torch sets on it (the graph id of selective checkpointing) go to the inner one.
    """

    def __init__(self, inner: Any, captured: list[ForwardState], preserve_rng_state: bool, replay: bool) -> None:
        object.__setattr__(self, "_parts", (inner, captured, preserve_rng_state, replay, contextlib.ExitStack()))

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._parts[0], name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_parts")[0], name)

    def __enter__(self) -> Any:
        inner, captured, preserve_rng_state, replay, stack = self._parts
        if replay and captured:
            stack.enter_context(replay_forward_state(captured[-1]))
        elif not replay:
            captured.append(capture_forward_state((), preserve_rng_state=preserve_rng_state))
        try:
            return stack.enter_context(inner)
        except BaseException:
            stack.close()
            raise

    def __exit__(self, *exc: Any) -> Any:
        return self._parts[4].__exit__(*exc)


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _check_compilable(policy: Policy) -> None:
    if policy.names:
        raise NotImplementedError(
            f"the policy {policy!r} keeps tensors named with remat.tag, which torch.compile's partitioner "
            "cannot see; under torch.compile use a policy on operations (remat.policies.save_ops, "
            "recompute_ops, save_matmuls)"
        )
    if policy.functions:
        raise NotImplementedError(
            f"the policy {policy!r} matches torch functions ({', '.join(sorted(policy.functions))}), which "
            "torch.compile's partitioner cannot see (it decides on ATen operations); under torch.compile "
            "name the ATen operations instead (remat.policies.save_ops('aten.mm', ...))"
        )


def _decide(policy: Policy, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A remat policy's decision as torch's selective checkpointing asks for one."""
    decision = Decision.of(policy(op, *args, **kwargs), policy)
    if decision.offloads:
        raise NotImplementedError(
            f"the policy {policy!r} offloads the output of {op} to host memory, which remat does not build under "
            "torch.compile; there keep it (remat.policies.save_ops) or recompute it, or run the block outside the "
            "compiled code (torch.compiler.disable)"
        )
    return _POLICIES[decision]
