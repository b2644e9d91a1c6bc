"""``recompute(function, *args, ...)``: run a block without keeping its activations.

Two implementations stand behind one function:

* the default, **hook-based** one (``use_reentrant=False``): the block runs once with
  autograd recording the graph as usual, but every tensor the graph saves for backward
  is replaced by a small handle (``torch.autograd.graph.saved_tensors_hooks``). When the
  backward pass first needs one of them, the block is run again from its kept inputs and
  the handles are filled. It supports everything autograd supports: nested structures,
  ``torch.autograd.grad``, ``backward(inputs=...)``, nesting, DDP.
* the **reentrant** one (``use_reentrant=True``): a custom ``torch.autograd.Function``
  runs the block under ``no_grad`` and, in its backward, runs it again with grad enabled
  and calls ``torch.autograd.backward`` on the result.

With ``policy=`` (:mod:`remat.policies`), the hook-based implementation keeps the outputs
of the operations the policy chooses and hands them to the recompute instead of running
those operations again (see NOTE [selective recompute] in ``_selective.py``).

.. warning::
   The recomputed forward must do the same thing as the original: same operations on
   same-shaped tensors. remat replays the RNG state (``preserve_rng_state=True``) and the
   autocast state, and keeps the running statistics of normalisation layers from being
   updated twice, but other global state the block reads (a Python counter, a flag that
   changed between forward and backward) is the block's responsibility; use
   :func:`remat.is_recomputing` to skip side effects. remat raises
   :class:`~remat.NondeterministicRecompute` when the recomputed forward saves tensors of
   another shape, dtype or device than the original, and
   :class:`~remat.RecomputeInputModified` when a kept input was modified in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from remat.errors import (
    NotCallableBlock,
    RematError,
)
from remat.manual import _state
from remat.manual._compiled import compiling, recompute_compiled
from remat.manual._frames import recompute_with_hooks
from remat.manual._reentrant import recompute_reentrant
from remat.manual._tensors import DETERMINISM_CHECKS, RecomputeOptions
from remat.manual.policies import PolicyLike, as_policy, either, save_collectives

__all__ = ["COMM_OPTIONS", "recompute", "recompute_sequential"]

#: The values of ``comm=``: what a recompute does with the block's collectives.
COMM_OPTIONS = ("recompute", "save")

ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


def recompute(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    preserve_rng_state: bool = True,
    output_recompute: bool = False,
    determinism_check: str = "default",
    early_stop: bool = True,
    context_fn: ContextFn | None = None,
    debug: bool = False,
    policy: PolicyLike = None,
    comm: str = "recompute",
    **kwargs: Any,
) -> Any:
    """Runs ``function(*args, **kwargs)`` and recomputes its activations in backward.

    Nothing the block computes internally is kept for the backward pass; only its inputs
    are. When backward reaches the block, it is run again and its gradients are computed
    exactly as without recompute.

    Args:
        function: any callable: an ``nn.Module``, a bound method or a plain function.
        *args: positional arguments; tensors may be nested in tuples, lists and dicts,
            and non-tensor values are passed through unchanged.
        use_reentrant: ``False`` (default) uses saved-tensor hooks; ``True`` uses a custom
            autograd Function (no ``torch.autograd.grad``, no ``backward(inputs=...)``).
        preserve_rng_state: replay the CPU and device RNG states so that dropout and
            every other random operation draw the same numbers in the recompute.
        output_recompute: do not keep the block's outputs either: a later recomputed
            block that takes them as inputs gets them by recomputing this one (adjacent
            recomputed blocks are merged). Needs ``use_reentrant=False``.
        determinism_check: ``"default"`` compares the shape, dtype and device of every
            tensor the recompute saves (or, reentrant, returns) with the original's and
            raises :class:`~remat.NondeterministicRecompute` naming the block and the
            tensor; ``"none"`` skips the comparison.
        early_stop: stop a recompute as soon as every tensor backward needs from it is
            regenerated (default); ``False`` runs the block to its end each time. The
            reentrant implementation always runs the whole block.
        context_fn: a function returning two context managers: the first is entered
            around the original forward, the second around each recompute (the function
            is called again for every recompute), like ``torch.utils.checkpoint``'s.
        debug: record the operations of the original forward and of each recompute;
            when they do not match, the error shows both traces from a few operations
            before the first difference, each operation with the line of code that ran
            it. Slow: for finding the cause of a
            :class:`~remat.NondeterministicRecompute`.
        policy: which operations keep their outputs (:mod:`remat.policies`): a policy,
            a bool (``True`` keeps everything) or a function ``(op, *args, **kwargs) ->
            Decision | bool``. ``None`` (default) keeps nothing but the inputs. A kept
            output is held until the block's backward and is not computed again. Needs
            ``use_reentrant=False``. Inside a block with a policy, a nested recomputed
            block decides for its own operations.
        comm: the collectives the block runs (``torch.distributed``'s functional
            collectives, which DTensor and tensor-parallel layers issue): ``"recompute"``
            (default) runs them again when the recompute needs their outputs;
            ``"save"`` keeps their outputs from the first forward (the memory of those
            outputs), so the recompute does not communicate: ``policy`` combined with
            :data:`remat.policies.save_collectives`. Needs ``use_reentrant=False``.
        **kwargs: keyword arguments for ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        NotCallableBlock: ``function`` is not callable.
        RematError: an option combination that is not supported.

    .. note::
       Under ``DistributedDataParallel`` the default implementation works with every DDP
       option (``find_unused_parameters=True``, ``static_graph=True``, a block called
       several times). The reentrant one runs the block under ``no_grad`` in the forward
       and gives its parameters their gradients from a backward pass of its own, inside
       the outer one. DDP accepts that only when every parameter takes part in exactly
       one such pass per step and none is unused: use DDP's default options then, and
       ``static_graph=True`` otherwise. With ``find_unused_parameters=True`` DDP sees
       the block's parameters as unused at the end of the forward and raises ("marked as
       ready twice") when their gradients come; with a block called twice and neither
       option, DDP reduces a parameter's gradient after the first of its passes and the
       ranks end up with different gradients, with no error.
    """
    if not callable(function):
        raise NotCallableBlock(
            f"recompute() needs a callable block (an nn.Module or a function), got "
            f"{type(function).__name__}; pass the module or function itself, not its output"
        )
    if determinism_check not in DETERMINISM_CHECKS:
        raise RematError(f"determinism_check must be one of {list(DETERMINISM_CHECKS)}, got {determinism_check!r}")
    if context_fn is not None and not callable(context_fn):
        raise RematError(f"context_fn must be a function returning two context managers, got {context_fn!r}")
    if not isinstance(debug, bool):
        raise RematError(f"debug must be True or False, got {debug!r}")
    chosen = as_policy(policy)
    if comm not in COMM_OPTIONS:
        raise RematError(f"comm must be one of {list(COMM_OPTIONS)}, got {comm!r}")
    if comm == "save" and not chosen.saves_everything:
        if use_reentrant:
            raise RematError(
                "comm='save' needs the hook-based implementation (the reentrant one keeps nothing of "
                "the block); call recompute(..., use_reentrant=False, comm='save')"
            )
        chosen = either(chosen, save_collectives)
    options = RecomputeOptions(chosen, preserve_rng_state, determinism_check, early_stop, context_fn, debug)
    if use_reentrant and not (chosen.recomputes_everything or chosen.saves_everything):
        raise RematError(
            f"policy={chosen!r} needs the hook-based implementation: the reentrant one runs the block "
            "under no_grad and again in backward, with no place to keep chosen outputs; call "
            "recompute(..., use_reentrant=False, policy=...)"
        )
    if use_reentrant and chosen.saves_everything:
        return function(*args, **kwargs)
    if use_reentrant and output_recompute:
        raise RematError(
            "output_recompute=True needs the hook-based implementation; "
            "call recompute(..., use_reentrant=False, output_recompute=True)"
        )
    if (kwargs or len(args) > 1) and torch.is_grad_enabled():
        args, kwargs = _without_layer_cache(function, args, kwargs)
    if compiling():
        # torch.compile traces this call: the compiler's own recompute (NOTE [recompute
        # under torch.compile] in _compiled.py)
        return recompute_compiled(function, args, kwargs, options)
    with _state.inside_manual_block():
        if use_reentrant:
            return recompute_reentrant(function, args, kwargs, options)
        return recompute_with_hooks(function, args, kwargs, options, output_recompute)


# NOTE [a layer's key/value cache]
# A Hugging Face layer called with a key/value cache (``cache``, ``past_key_values``,
# ``past_key_value``, ``layer_past``: a model built with use_cache=True, the default of its
# causal LMs) appends its keys and values to it; recomputed, it appends them again, and attends
# over them twice (the reentrant implementation gave silently wrong gradients, the default one
# a cache of twice the length). Hugging Face's own gradient checkpointing calls such a layer
# without its cache while training, and so does remat, wherever it recomputes (grad on, in
# training mode or not): the block gets None for the cache, by name or where it is passed by
# position (GPT-2's blocks take it second), and use_cache=False, said once. A layer that only
# reads its cache says so (``_can_checkpoint_with_cache``) and keeps it; a ``cache`` argument is
# taken for one only when it is a Hugging Face cache object.
_LAYER_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")
_LAYER_CACHE_WARNED = [False]


def _without_layer_cache(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    names = [name for name in _LAYER_CACHES if kwargs.get(name) is not None]
    if names[:1] == ["cache"] and not _is_cache(kwargs["cache"]):
        names = names[1:]
    positions = [i for i, value in enumerate(args) if _is_cache(value)]  # (GPT-2's blocks take it second)
    if not names and not positions and kwargs.get("use_cache") is not True:
        return args, kwargs
    module = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    if getattr(module, "_can_checkpoint_with_cache", False) is True:
        names, positions = [], []
    if not _LAYER_CACHE_WARNED[0]:
        _LAYER_CACHE_WARNED[0] = True
        warnings.warn(
            "remat: a recomputed block was called with a key/value cache (use_cache=True or "
            f"{', '.join(names) or 'a Cache'}); its recompute would fill the cache again, so recomputed "
            "blocks run without it when grad is on, as Hugging Face's gradient checkpointing does in "
            "training. Build or call the model with use_cache=False to silence this",
            UserWarning,
            stacklevel=4,
        )
    args = tuple(None if i in positions else value for i, value in enumerate(args))
    kwargs = {**kwargs, **dict.fromkeys(names)}
    return args, ({**kwargs, "use_cache": False} if "use_cache" in kwargs else kwargs)


def _is_cache(value: Any) -> bool:
    """Whether `value` is a Hugging Face key/value cache object."""
    kind = type(value)
    return kind.__module__.startswith("transformers.") and kind.__name__.endswith("Cache")


def recompute_sequential(
    modules: nn.Sequential | Sequence[Callable[..., Any]],
    segments: int,
    input: Any,
    *,
    use_reentrant: bool = False,
    **options: Any,
) -> Any:
    """Runs `modules` one after another in `segments` recomputed segments.

    The equivalent of ``torch.utils.checkpoint.checkpoint_sequential``, with remat's
    exactness (RNG, module state, nested structures). Each segment keeps only its input;
    the last segment is recomputed too (torch runs it plainly), so the whole chain costs
    about ``segments`` inputs plus one segment's activations in backward.

    Args:
        modules: an ``nn.Sequential`` or a sequence of callables, each taking the previous
            one's output.
        segments: how many segments to cut the chain into, ``1 <= segments``; more
            segments than modules gives one module per segment. A module that changes
            its input in place (``inplace=True``: ``nn.ReLU(inplace=True)``) never starts a
            segment: it joins the segment before it.
        input: the first module's input (any structure the first module takes).
        use_reentrant: as for :func:`recompute`.
        **options: other options of :func:`recompute`.

    Returns:
        The last module's output.

    Raises:
        RematError: ``segments`` is not a positive int, or `modules` is empty.
    """
    functions: list[Callable[..., Any]] = list(modules)
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise RematError(f"segments must be a positive int, got {segments!r}")
    if not functions:
        raise RematError("recompute_sequential() needs at least one module")
    size = -(-len(functions) // min(segments, len(functions)))
    starts: list[int] = []
    for start in range(0, len(functions), size):
        # a segment starting at a module that changes its input in place (nn.ReLU(inplace=True))
        # could not be recomputed (NOTE [inputs a block changes itself]): the module joins the one before
        while start < len(functions) and getattr(functions[start], "inplace", False) is True and start > 0:
            start += 1
        if start < len(functions) and (not starts or start > starts[-1]):
            starts.append(start)
    output = input
    for start, stop in zip(starts, [*starts[1:], len(functions)], strict=True):
        output = recompute(_InOrder(functions[start:stop]), output, use_reentrant=use_reentrant, **options)
    return output


class _InOrder:
    """A segment of :func:`recompute_sequential`: its functions one after another."""

    def __init__(self, functions: list[Callable[..., Any]]) -> None:
        self.functions = functions
        # its modules' places are put back for its recomputes (NOTE [parameters swapped in for a call])
        self.block_modules = [f for f in functions if isinstance(f, nn.Module)]
        self.__qualname__ = "recompute_sequential segment"

    def __call__(self, value: Any) -> Any:
        for function in self.functions:
            value = function(value)
        return value
