"""Shared checks for remat.Checkpointable: exact training steps side by side, peaks, counts.

A *case* is a model and its inputs. :func:`compare_training` runs the same seeded training
steps (forward, the model's loss, backward, an SGD update) on a plain copy of the model and
on a :class:`remat.Checkpointable` around another copy, and asserts that outputs, every
parameter gradient, the input gradients and every buffer are bit-for-bit equal. It returns
the peak activation memory of each remat step, measured with :class:`remat.MemoryTracker`.

Bit-for-bit equality holds on the CPU: the same kernels run on the same values in the same
order, and recomputed dropout replays its RNG state. (On a GPU some kernels, e.g. atomic
reductions in convolution backward, are not deterministic.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import remat

__all__ = [
    "GroupCounter",
    "assert_peak_matches_prediction",
    "assert_same_tensors",
    "clone_inputs",
    "compare_training",
    "grads_of",
    "minimum_budget",
    "state_of",
]

LossFn = Callable[[Any], torch.Tensor]


def clone_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Fresh leaf copies of the inputs; floating-point tensors require grad."""
    out = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
            if value.is_floating_point():
                value.requires_grad_(True)
        out.append(value)
    return tuple(out)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, by name."""
    return {name: p.grad for name, p in model.named_parameters()}


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer (BatchNorm statistics included), by name."""
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    state.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
    return state


def assert_same_tensors(
    expected: dict[str, torch.Tensor | None], actual: dict[str, torch.Tensor | None], what: str
) -> None:
    """Asserts two name -> tensor maps are bit-for-bit equal (None only where None)."""
    assert expected.keys() == actual.keys(), f"{what}: different names"
    wrong = []
    for name, value in expected.items():
        other = actual[name]
        if value is None or other is None:
            if value is not other:
                wrong.append(f"{name} (None in one only)")
        elif value.shape != other.shape or not torch.equal(value, other):
            wrong.append(name)
    assert not wrong, f"{what} differ from plain autograd: {', '.join(wrong)}"


def _step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: LossFn,
    seed: int,
    optimizer: torch.optim.Optimizer,
    output_of: Callable[[Any], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = model(*inputs)  # held through the backward, as a training loop does
    loss_fn(output).backward()
    return output_of(output).detach(), grads_of(_inner(model))


def _inner(model: nn.Module) -> nn.Module:
    return model.model if isinstance(model, remat.Checkpointable) else model


def compare_training(
    reference: nn.Module,
    wrapped: remat.Checkpointable,
    inputs: Sequence[Any],
    loss_fn: LossFn,
    *,
    steps: int = 2,
    output_of: Callable[[Any], torch.Tensor] = lambda output: output,
) -> list[int]:
    """Runs seeded training steps on both models and asserts they agree exactly.

    `reference` and `wrapped.model` must start with equal parameters and buffers. Each
    step reseeds the RNG, runs forward, ``loss_fn(output).backward()`` and an SGD update,
    so the second step runs on updated weights and BatchNorm statistics. The remat step
    runs inside a :class:`remat.MemoryTracker`; the model is measured before, unless
    `wrapped` already has a plan.

    Args:
        reference: the plain model.
        wrapped: the Checkpointable around a copy of it.
        inputs: the model's positional inputs (floating-point tensors get a gradient).
        loss_fn: the model's loss, from its output.
        steps: how many training steps.
        output_of: the tensor to compare in the model's output (e.g. ``.logits``).

    Returns:
        The measured peak activation bytes of each remat step.
    """
    if wrapped.plan is None:
        # The first training call would measure: one step storing everything, which is
        # not what the budget is about. Measure before the tracked steps.
        wrapped.measure(*clone_inputs(inputs))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, wrapped.model)]
    peaks = []
    for step in range(steps):
        plain_inputs, remat_inputs = clone_inputs(inputs), clone_inputs(inputs)
        seed = 1000 + step
        expected, expected_grads = _step(reference, plain_inputs, loss_fn, seed, optimizers[0], output_of)
        with remat.MemoryTracker() as tracker:
            actual, actual_grads = _step(wrapped, remat_inputs, loss_fn, seed, optimizers[1], output_of)
        peaks.append(tracker.peak_bytes)
        assert torch.equal(expected, actual), f"step {step}: outputs differ"
        assert_same_tensors(expected_grads, actual_grads, f"step {step}: parameter gradients")
        assert_same_tensors(
            {f"input {i}": getattr(t, "grad", None) for i, t in enumerate(plain_inputs)},
            {f"input {i}": getattr(t, "grad", None) for i, t in enumerate(remat_inputs)},
            f"step {step}: input gradients",
        )
        assert_same_tensors(
            dict(reference.named_buffers()), dict(wrapped.model.named_buffers()), f"step {step}: buffers"
        )
        for optimizer in optimizers:
            optimizer.step()
    return peaks


def minimum_budget(wrapped: remat.Checkpointable, *inputs: Any) -> int:
    """The smallest budget `wrapped` accepts for these inputs (from BudgetTooSmall)."""
    wrapped.measure(*inputs)
    try:
        wrapped.compute_sequence(1)
    except remat.BudgetTooSmall as error:
        return error.minimum_bytes
    raise AssertionError("a budget of 1 byte fits; the model has no activations?")


class GroupCounter:
    """Counts forward calls of the first stage module of each planned group.

    A recompute stops as soon as it has produced what the backward needs, so only the
    first module of a group is sure to run each time the group's forward runs.
    """

    def __init__(self, wrapped: remat.Checkpointable, measurement: Any) -> None:
        from remat.discover.chain import sequential_chain

        model = wrapped.model
        chain = sequential_chain(model) if isinstance(model, nn.Sequential) else None
        assert chain is not None, "GroupCounter works on nn.Sequential models"
        self.counts = [0] * len(measurement.groups)
        self._handles = []
        for group, (first, _stop) in enumerate(measurement.groups):
            self._handles.append(chain.modules[first].register_forward_pre_hook(self._hook(group)))

    def _hook(self, group: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.counts[group] += 1

        return hook

    def reset(self) -> None:
        self.counts = [0] * len(self.counts)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def assert_peak_matches_prediction(peak: int, planned: remat.PlannedChain, *, tolerance: float = 0.10) -> None:
    """Asserts a measured peak fits the plan's budget and agrees with its prediction.

    The measured peak may exceed the prediction by 1% at most (what per-stage measurement
    cannot attribute, covered by the planning margin), and may fall short of it by
    `tolerance` of the prediction plus one activation: the simulator keeps the recomputed
    output of the last stage of a recomputed body alive through that stage's backward,
    where the executor drops it at once (the recompute stops early), so a plan whose peak
    is such a backward is over-predicted by that activation.
    """
    predicted = planned.predicted_peak_bytes
    assert planned.budget_bytes is not None and peak <= planned.budget_bytes, (
        f"measured peak {peak} B over the budget {planned.budget_bytes} B"
    )
    assert peak <= predicted * 1.01, f"measured {peak} B, predicted only {predicted} B"
    slack = tolerance * predicted + max(planned.measurement.profile.activation_bytes)
    assert predicted - peak <= slack, f"measured {peak} B, predicted {predicted} B: more than {slack:.0f} B apart"
