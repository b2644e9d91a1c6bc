"""Running a model on fake tensors: every size of a step, without its memory or its time.

A fake tensor (``torch._subclasses.fake_tensor``) has a real tensor's shape, dtype,
device and strides but no data: operators compute only the metadata of their results.
A training step run on fake tensors therefore allocates nothing on the device, yet the
:class:`~remat.memory.MemoryTracker` sees every storage it would allocate, at its exact
size, in the same order: the step's memory profile, byte for byte, before the real step
has run once.

:func:`on_fake_tensors` swaps a model's parameters and buffers for fake ones (tied
parameters stay tied), converts the inputs, and puts everything back afterwards,
including module attributes the forward filled with fake tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from remat.discover.intercept import uncompiled
from remat.errors import RematError, UnsupportedModel

__all__ = ["FakeRunFailed", "on_fake_tensors", "refuse_meta_training"]


class FakeRunFailed(Exception):
    """The model could not run on fake tensors (the cause is chained)."""


# NOTE [grouped products on fake tensors]
# torch's fake kernel of ``aten._grouped_mm`` (a mixture of experts' expert products in
# transformers) carries the checks of the CUDA kernel: bfloat16 inputs and output only.
# The CPU kernel also takes other floating-point types (a float32 model), so a step the
# device runs would fail on fake tensors alone. The fake mode sizes such a product on
# bfloat16 copies of its inputs, then gives the output the inputs' type: the same shape,
# and the strides of a fresh tensor, as the fake kernel makes them.
_GROUPED_MM = torch.ops.aten._grouped_mm.default


class _FakeMode(FakeTensorMode):
    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _GROUPED_MM and kwargs.get("out_dtype") is None and len(args) >= 2:
            first, second = args[0], args[1]
            dtype = first.dtype
            if dtype != torch.bfloat16 and dtype.is_floating_point and second.dtype == dtype:
                run = super().dispatch
                to_copy = torch.ops.aten._to_copy.default
                inputs = [run(to_copy, types, (t,), {"dtype": torch.bfloat16}) for t in (first, second)]
                return run(to_copy, types, (run(func, types, (*inputs, *args[2:]), kwargs),), {"dtype": dtype})
        return super().dispatch(func, types, args, kwargs)


class _FakeModel:
    """The fake mode of one run, and what it converted."""

    def __init__(self, mode: FakeTensorMode, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        self._memo: dict[int, torch.Tensor] = {}

    def _from_meta(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake tensor on the device for a tensor of the meta device (a model built there)."""
        if tensor.numel() <= 1 and not tensor.is_floating_point():
            # a counter: its value is read as a number, and a meta tensor has none
            real = torch.zeros(tensor.shape, dtype=tensor.dtype, device=self.device)
            return self.mode.fake_tensor_converter.from_real_tensor(self.mode, real, make_constant=True)
        return self.mode.fake_tensor_converter.from_meta_and_device(self.mode, tensor.detach(), self.device)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The fake counterpart of `tensor` (the same one for the same tensor)."""
        fake = self._memo.get(id(tensor))
        if fake is None:
            if tensor.is_meta:
                converted = self._from_meta(tensor)
            elif tensor.numel() <= 1 and not isinstance(tensor, nn.Parameter):
                # A counter such as BatchNorm's num_batches_tracked is read as a number in
                # the forward: a fake constant keeps its value and follows its updates.
                converted = self.mode.fake_tensor_converter.from_real_tensor(
                    self.mode, tensor.detach().clone(), make_constant=True
                )
            else:
                converted = self.mode.from_tensor(tensor.detach())
            if isinstance(tensor, nn.Parameter):
                fake = nn.Parameter(converted, requires_grad=tensor.requires_grad)
            else:
                fake = converted
            self._memo[id(tensor)] = fake
        return fake

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Fake copies of the inputs (one that requires grad gets a graph of its own; a
        leaf stays a leaf, as autocast caches its casts of leaves only).

        Call it outside the fake mode: the inputs are real tensors.
        """
        leaves, spec = tree_flatten((args, kwargs))
        out = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                fake: torch.Tensor = self._from_meta(leaf) if leaf.is_meta else self.mode.from_tensor(leaf.detach())
                if leaf.requires_grad:
                    with self.mode:
                        fake = fake.requires_grad_(True) if leaf.is_leaf else fake.requires_grad_(True).clone()
                out.append(fake)
            else:
                out.append(leaf)
        return tree_unflatten(out, spec)


def refuse_meta_training(model: nn.Module) -> None:
    """Raises :class:`~remat.errors.UnsupportedModel` if `model` has parameters on the meta
    device: such a model is sized and planned, never trained."""
    if any(p.is_meta for p in model.parameters()):
        raise UnsupportedModel(
            "the model's parameters are on the meta device: it can be measured and planned "
            "(measure='estimated', then plan_for), not trained. Build it on a real device to train"
        )


def _holds_fake(value: Any) -> bool:
    try:
        return any(isinstance(leaf, FakeTensor) for leaf in tree_leaves(value))
    except Exception:  # an object pytree cannot flatten holds no fake tensor we put there
        return False


@contextlib.contextmanager
def on_fake_tensors(model: nn.Module, device: torch.device) -> Iterator[_FakeModel]:
    """Within this block, `model`'s parameters and buffers are fake tensors.

    Those of the meta device (a model built under ``torch.device("meta")``, too large to
    hold) become fake tensors on `device` (the step's: see
    :func:`remat.measure.step.step_device`), as if the model were there.

    Yields the converter; run the model inside ``with converter.mode:`` on inputs from
    :meth:`_FakeModel.inputs`. On exit the real parameters and buffers are back, and
    every module attribute the run set to something holding a fake tensor is put back
    as it was (or removed). A failure inside the block is raised as
    :class:`FakeRunFailed`, with the cause chained.
    """
    fake = _FakeModel(_FakeMode(allow_non_fake_inputs=True), device)
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    attributes = [(module, dict(module.__dict__)) for module in model.modules()]
    # Modules compiled with module.compile() run their own forward here: compiled code
    # would run its kernels on fake tensors' (absent) data.
    with uncompiled(model.modules()):
        try:
            for module in model.modules():
                tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
                for table in tables:
                    for name, value in list(table.items()):
                        if value is not None:
                            swapped.append((table, name, value))
                            table[name] = fake.tensor(value)
            try:
                yield fake
            except RematError:
                raise  # remat's own refusals hold on real tensors too
            except Exception as error:
                raise FakeRunFailed(f"{type(error).__name__}: {error}") from error
        finally:
            for table, name, value in swapped:
                table[name] = value
            for module, before in attributes:
                for name in [n for n, v in module.__dict__.items() if n not in before and _holds_fake(v)]:
                    del module.__dict__[name]
                for name, value in before.items():
                    if module.__dict__.get(name) is not value and _holds_fake(module.__dict__.get(name)):
                        module.__dict__[name] = value
