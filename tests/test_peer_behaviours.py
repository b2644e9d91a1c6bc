"""remat against the behaviours that the checkpoint test suites of its peers check.

Each test runs a case plainly (no recompute) and with remat, in both implementations
where it applies, and compares outputs, gradients and buffers bit for bit (``torch.equal``).
Where a peer asserts an error, the test asserts what remat does instead, by type and
message. The behaviours, per peer suite, and the test that covers each:

PyTorch ``test/test_utils.py``, ``TestCheckpoint``:

- checkpoint_trigger (forward counts of ``checkpoint_sequential``):
  ``test_sequential_recomputes_every_segment``. Difference: remat recomputes the last
  segment too (README), so every module runs twice, not only the first half.
- checkpoint / checkpoint_module_list (a list of children, an ``nn.Sequential``, an
  ``nn.ModuleList``): ``test_sequential_matches_plain``.
- checkpoint_valid (``autograd.grad`` refused by the reentrant mode, accepted with
  ``create_graph=True`` by the other): ``test_sequential_autograd_grad``.
- checkpoint_sequential_deprecated_multiple_args / _no_args:
  ``test_sequential_takes_exactly_one_input``.
- checkpoint_rng_cpu: ``test_dropout_before_and_inside_the_block``.
- checkpoint_rng_gpu, get_device_states_recursive, infer_device_state_*,
  checkpoint_preserves_device_context: not applicable (accelerators, multiple devices,
  torch's private helpers; ``tests/test_cuda.py`` covers remat on a GPU).
- checkpoint_not_preserve_rng_state_and_without_reentrant:
  ``test_without_preserved_rng_state``.
- checkpoint_non_tensor (a ``None`` argument): ``test_none_argument``.
- checkpoint_non_tensor_inputs_outputs: ``test_non_tensor_inputs_and_outputs``.
  Difference: the input returned as is keeps its own history, so a second backward
  through it works as in plain autograd, where torch's reentrant Function raises. One
  loss over all the outputs: ``test_input_returned_and_used_inside_in_one_loss``
  (difference, reentrant mode: the input's gradient may differ in the last bits).
- checkpoint_no_tensors: ``test_no_tensor_arguments``.
- checkpoint_partial_grad: ``test_partial_grad`` (where no output requires grad, remat
  raises autograd's own error, as plain autograd does; torch raises its own).
- checkpointing_without_reentrant_early_free: ``test_saved_tensors_are_freed_during_backward``
  and ``test_saved_tensors_are_kept_during_a_retained_backward_as_plain_autograd_keeps_them``
  (difference: with a retained graph, recomputed tensors stay as plain autograd's do).

PyTorch ``test/test_autograd.py``, checkpoint tests:

- checkpointing (one module called on many inputs): ``test_one_module_on_many_inputs``.
- checkpointing_without_reentrant (kwargs, input requires grad True / False):
  ``test_keyword_input_with_and_without_grad``.
- checkpointing_non_reentrant_autocast_cpu: ``test_autocast_dtype_in_recompute``
  (an input used by two autocast ops shares one cast, as in plain autograd).
- checkpointing_without_reentrant_memory_savings (CUDA there; exact bytes here):
  ``test_recompute_lowers_the_peak``.
- checkpointing_without_reentrant_custom_function_works: ``test_custom_function_inside``.
  Difference: remat lets a custom Function read ``ctx.saved_tensors`` twice, as plain
  autograd does; torch raises on the second read.
- checkpointing_without_reentrant_with_context_fn: ``test_context_fn_sees_forward_and_recompute``.
  Difference: remat takes ``context_fn`` in the reentrant mode too; torch refuses it.
- checkpointing_without_reentrant_context_fn_exits_on_forward_exception:
  ``test_context_fn_exits_when_the_forward_raises``.
- checkpointing_without_reentrant_context_fn_cannot_suppress_forward_exception:
  ``test_context_fn_cannot_swallow_a_forward_error``.
- checkpoint_warns_if_use_reentrant_not_passed_explcitly (and the sequential one): not
  applicable, a torch deprecation; remat's default use warns nothing
  (``tests/test_recompute.py::test_no_warning_in_default_use``).
- checkpoint_graph_execution_group (gradients of parts of the outputs, one after the
  other): ``test_gradients_of_parts_of_the_outputs`` (``GraphExecGroup`` itself is torch's).
  Differences: the hook mode recomputes once for both calls, where torch recomputes for
  each; in the reentrant mode the outputs are siblings of one node, so autograd finds
  that the second output does not depend on the first (as in torch's reentrant mode).
- checkpoint_detects_non_determinism: ``test_nondeterminism_is_detected``
  (fewer, more with and without early stop, other metadata, ``debug=True``) and
  ``test_nondeterminism_in_the_reentrant_mode`` (it checks outputs only;
  ``determinism_check="none"`` leaves the mismatch to autograd).
- access_saved_tensor_twice_without_recomputation_works:
  ``test_saved_tensor_read_outside_backward``. Difference: remat keeps what it recomputed
  for the read until backward uses it, instead of recomputing at every read.
- checkpoint_valid_reset_on_error: ``test_reentrant_refusal_leaves_backward_working``.
- checkpointing_without_reentrant_detached_tensor: ``test_output_without_gradient_path``
  (torch's reentrant mode raises; difference: remat's reentrant output requires grad).
- checkpointing_without_reentrant_saved_object_identity: ``test_saved_object_identity``.
- checkpointing_without_reentrant_correct_grad: ``test_backward_and_autograd_grad_agree``.
- checkpointing_without_reentrant_dataparallel: ``test_data_parallel_wrapper`` (on the
  CPU, where ``nn.DataParallel`` calls its module).
- checkpointing_without_reentrant_parameter_used_in_an_out:
  ``test_parameter_used_inside_and_outside``.
- checkpointing_without_reentrant_arbitrary_input_output: ``test_dict_input_and_output``.
- checkpointing_without_reentrant_with_block_mask, checkpoint_compile_*,
  checkpoint_device_context_fn, checkpoint_automatic_dynamic_*: not applicable
  (CUDA, ``torch.compile``).
- nested checkpoints (``TestNestedCheckpoint``: two children, kwargs, non-tensor inputs
  and outputs): ``test_nested_blocks_with_kwargs_and_constants``.
- ``set_grad_enabled`` / ``no_grad`` inside the block: ``test_grad_mode_switched_inside``.
- parametrizations: ``test_parametrized_weight``.
- backward twice / ``retain_graph``: ``test_backward_twice_with_retain_graph``.

FairScale ``tests/nn/checkpoint/``:

- test_basic (an FFN with dropout: loss and gradients): ``test_marked_ffn_with_dropout``.
- offload_to_cpu, test_offload_memory: not applicable (remat does not offload).
- test_multiin_multiout: ``test_several_inputs_and_outputs``.
- test_deprecated_path: not applicable (FairScale's import paths).
- test_list_input: ``test_list_input_and_output``.
- test_checkpoint_disabling: ``test_unmark_disables_recompute``.
- test_checkpoint_requires_grad (frozen blocks are not recomputed; non-tensor inputs and
  outputs): ``test_frozen_blocks_are_not_recomputed`` and
  ``test_non_tensor_list_arguments_with_frozen_blocks``. Difference: a plain int counter
  on the module reads as after one forward, because remat replays module attributes
  (README); the call counts are kept in lists.
- test_norm (LayerNorm, BatchNorm2d; fp32 and half; state after an SGD step):
  ``test_norm_layers_after_an_sgd_step``. On this torch, half precision runs on the CPU.

DeepSpeed ``tests/unit/runtime/activation_checkpointing/test_activation_checkpointing.py``
(and its non-reentrant copy):

- ckpt_inputs1_outputs1, ckpt_inputs2_outputs1/2/3 (a boolean or a float mask),
  ckpt_arg_none: ``test_masked_linear_blocks``. An output not requiring grad in plain
  autograd requires it in the reentrant mode (see ``test_output_without_gradient_path``).
- ckpt_non_tensor_input / ckpt_non_tensor_output: ``test_non_tensor_input`` and
  ``test_non_tensor_output``; non_tensor_output_ordering: ``test_non_tensor_output``
  (the structure must match). A tensor constant among the outputs:
  ``test_tensor_from_outside_comes_back_as_itself`` (difference, reentrant mode: it comes
  back as an alias that requires grad).
- the same blocks with inputs that do not require grad: ``test_masked_linear_blocks``
  (parametrised over ``input_requires_grad``).
- tensor and non-tensor keyword arguments: ``test_keyword_arguments``.
- CPU offload, pipeline-module configuration: not applicable.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

import remat
from remat import NondeterministicRecompute, RematError

pytestmark = pytest.mark.usefixtures("clean_remat_state")

BOTH = pytest.mark.parametrize("use_reentrant", [False, True], ids=["hooks", "reentrant"])


# ----------------------------------------------------------------------------- helpers
@dataclasses.dataclass
class Outcome:
    """What one forward + backward leaves behind, to compare with another run."""

    structure: Any
    constants: list[Any]
    outputs: list[torch.Tensor]
    requires_grad: list[bool]
    grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    rng: torch.Tensor


def weighted_loss(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A loss whose gradient differs per element, over the given tensors."""
    total = torch.zeros(())
    for t in tensors:
        weights = torch.linspace(-1.0, 2.0, t.numel()).reshape(t.shape)
        total = total + (t.float() * weights).sum() + t.float().pow(2).sum()
    return total


def run(
    call: Callable[[], Any],
    leaves: Sequence[torch.Tensor],
    *,
    modules: Sequence[nn.Module] = (),
    differentiate: Sequence[bool] | None = None,
    seed: int = 0,
) -> Outcome:
    """Runs `call` from a fixed seed, then backward through its differentiable outputs.

    Args:
        call: the forward, returning any structure.
        leaves: the tensors whose gradients are compared (reset before the run).
        modules: modules whose buffers are compared.
        differentiate: which floating-point outputs enter the loss (default: those that
            require grad); pass the plain run's choice so both runs use the same loss.
        seed: the RNG seed of the run.
    """
    for leaf in leaves:
        leaf.grad = None
    torch.manual_seed(seed)
    out = call()
    flat, spec = tree_flatten(out)
    tensors = [v for v in flat if isinstance(v, torch.Tensor)]
    if differentiate is None:
        differentiate = [t.requires_grad and t.is_floating_point() for t in tensors]
    used = [t for t, chosen in zip(tensors, differentiate) if chosen]
    if used:
        weighted_loss(used).backward()
    return Outcome(
        structure=spec,
        constants=[v for v in flat if not isinstance(v, torch.Tensor)],
        outputs=[t.detach().clone() for t in tensors],
        requires_grad=[t.requires_grad for t in tensors],
        grads=[None if leaf.grad is None else leaf.grad.clone() for leaf in leaves],
        buffers={f"{i}.{n}": b.clone() for i, m in enumerate(modules) for n, b in m.named_buffers()},
        rng=torch.get_rng_state(),
    )


def assert_same(expected: Outcome, actual: Outcome, *, requires_grad: bool = True) -> None:
    """Asserts two outcomes are identical: structure, constants, values, gradients, state."""
    assert expected.structure == actual.structure, "output structures differ"
    assert expected.constants == actual.constants, "non-tensor outputs differ"
    assert len(expected.outputs) == len(actual.outputs)
    for i, (a, b) in enumerate(zip(expected.outputs, actual.outputs)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"
    if requires_grad:
        assert expected.requires_grad == actual.requires_grad, "requires_grad of the outputs differs"
    for i, (a, b) in enumerate(zip(expected.grads, actual.grads)):  # type: ignore[assignment]
        assert (a is None) == (b is None), f"gradient {i}: {a} vs {b}"
        if a is not None and b is not None:
            assert torch.equal(a, b), f"gradient {i} differs"
    assert expected.buffers.keys() == actual.buffers.keys()
    for name, value in expected.buffers.items():
        assert torch.equal(value, actual.buffers[name]), f"buffer {name} differs"
    assert torch.equal(expected.rng, actual.rng), "the global RNG state differs"


def grad_leaves(*trees: Any) -> list[torch.Tensor]:
    """The leaf tensors requiring grad in `trees` (module parameters included)."""
    found: list[torch.Tensor] = []
    for tree in trees:
        values = list(tree.parameters()) if isinstance(tree, nn.Module) else tree_leaves(tree)
        for value in values:
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
                if all(value is not seen for seen in found):
                    found.append(value)
    return found


def compare_block(
    block: Callable[..., Any],
    *args: Any,
    use_reentrant: bool,
    requires_grad: bool | None = None,
    **kwargs: Any,
) -> Outcome:
    """``block(*args, **kwargs)`` plainly and recomputed (a module on a copy): identical.

    The requires_grad flags of the outputs are compared in the hook mode, and in the
    reentrant mode only when `requires_grad` says so (see ``test_output_without_gradient_path``).
    """
    twin = copy.deepcopy(block) if isinstance(block, nn.Module) else block
    modules = [block] if isinstance(block, nn.Module) else []
    twins = [twin] if isinstance(twin, nn.Module) else []
    inputs = grad_leaves((args, kwargs))
    expected = run(lambda: block(*args, **kwargs), [*inputs, *grad_leaves(*modules)], modules=modules)
    chosen = [rg and out.is_floating_point() for rg, out in zip(expected.requires_grad, expected.outputs)]
    actual = run(
        lambda: remat.recompute(twin, *args, use_reentrant=use_reentrant, **kwargs),
        [*inputs, *grad_leaves(*twins)],
        modules=twins,
        differentiate=chosen,
    )
    assert_same(expected, actual, requires_grad=not use_reentrant if requires_grad is None else requires_grad)
    return actual


def call_counts(modules: Iterable[nn.Module]) -> list[int]:
    """How many times each module ran (its ``calls`` list)."""
    return [len(cast(list[bool], module.calls)) for module in modules]


class Counted(nn.Module):
    """Wraps a module and counts its calls in a list (remat replays plain attributes, not lists)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls: list[bool] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(remat.is_recomputing())
        return self.inner(*args, **kwargs)


# ============================================================ PyTorch test/test_utils.py
class Doubler(nn.Module):
    """Multiplies by a constant it creates, so that it saves a tensor for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(remat.is_recomputing())
        return x * torch.tensor(2.0)


@BOTH
def test_sequential_recomputes_every_segment(use_reentrant: bool) -> None:
    modules = [Doubler() for _ in range(10)]
    x = torch.randn(3, 4, requires_grad=True)
    out = remat.recompute_sequential(modules, 2, x, use_reentrant=use_reentrant)
    assert [len(m.calls) for m in modules] == [1] * 10
    out.sum().backward()
    # torch's checkpoint_sequential runs its last segment plainly: [2] * 5 + [1] * 5
    assert [m.calls for m in modules] == [[False, True]] * 10
    assert torch.equal(x.grad, torch.full((3, 4), 2.0**10))  # type: ignore[arg-type]


def layer_stack() -> list[nn.Module]:
    return [nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU()]


class ModuleListNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module_list = nn.ModuleList(layer_stack())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


@BOTH
@pytest.mark.parametrize("container", ["children", "sequential", "module_list"])
def test_sequential_matches_plain(use_reentrant: bool, container: str) -> None:
    model: nn.Module = ModuleListNet() if container == "module_list" else nn.Sequential(*layer_stack())
    twin = copy.deepcopy(model)
    chain: Any = {
        "children": list(twin.children()),
        "sequential": twin,
        "module_list": getattr(twin, "module_list", None),
    }[container]
    x = torch.randn(2, 20, requires_grad=True)
    expected = run(lambda: model(x), [x, *model.parameters()])
    actual = run(lambda: remat.recompute_sequential(chain, 2, x, use_reentrant=use_reentrant), [x, *twin.parameters()])
    assert_same(expected, actual)


@BOTH
def test_sequential_autograd_grad(use_reentrant: bool) -> None:
    model = nn.Sequential(nn.Linear(20, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh())
    x = torch.randn(1, 20, requires_grad=True)
    ones = torch.ones(1, 5)
    out = remat.recompute_sequential(list(model.children()), 2, x, use_reentrant=use_reentrant)
    if use_reentrant:
        with pytest.raises(RematError, match=r"does not support torch.autograd.grad\(\).*use_reentrant=False"):
            torch.autograd.grad([out], [x], [ones], create_graph=True)
        return
    (expected,) = torch.autograd.grad([model(x)], [x], [ones], create_graph=True)
    (actual,) = torch.autograd.grad([out], [x], [ones], create_graph=True)
    assert torch.equal(expected, actual) and actual.requires_grad
    # the gradient is itself differentiable, as in plain autograd
    (second_expected,) = torch.autograd.grad(expected.square().sum(), [x])
    (second_actual,) = torch.autograd.grad(actual.square().sum(), [x])
    assert torch.equal(second_expected, second_actual)


def test_sequential_takes_exactly_one_input() -> None:
    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a, b

    model = nn.Sequential(Two())
    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4, requires_grad=True)
    sequential: Any = remat.recompute_sequential
    with pytest.raises(TypeError, match="takes 3 positional arguments but 4 were given"):
        sequential(model, 1, a, b)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'input'"):
        sequential(model, 1)


@BOTH
def test_dropout_before_and_inside_the_block(use_reentrant: bool) -> None:
    before, inside = nn.Dropout(), nn.Dropout()

    def plain(x: torch.Tensor) -> torch.Tensor:
        return inside(before(x))

    def recomputed(x: torch.Tensor) -> torch.Tensor:
        return remat.recompute(inside, before(x), use_reentrant=use_reentrant)

    for seed in range(3):
        x = torch.randn(2000, requires_grad=True)
        expected = run(functools.partial(plain, x), [x], seed=seed)
        assert_same(expected, run(functools.partial(recomputed, x), [x], seed=seed))


@BOTH
def test_without_preserved_rng_state(use_reentrant: bool) -> None:
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4, requires_grad=True)
    expected = run(lambda: block(x), [x, *block.parameters()])
    actual = run(
        lambda: remat.recompute(block, x, use_reentrant=use_reentrant, preserve_rng_state=False),
        [x, *block.parameters()],
    )
    assert_same(expected, actual)
    # with a random operation it still runs (its recompute may draw another mask)
    x.grad = None
    out = remat.recompute(nn.Dropout(), x, use_reentrant=use_reentrant, preserve_rng_state=False)
    out.sum().backward()
    assert x.grad is not None and set(x.grad.unique().tolist()) <= {0.0, 2.0}


@BOTH
def test_host_random_numbers_where_torch_differs(use_reentrant: bool) -> None:
    # NOTE [host random numbers]: torch's checkpoint draws again from NumPy's generator
    import numpy as np
    from torch.utils.checkpoint import checkpoint

    linear = nn.Linear(4, 4)

    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(linear(x) * float(np.random.randn()))

    x = torch.randn(3, 4, requires_grad=True)
    np.random.seed(0)
    expected = run(lambda: block(x), [x, *linear.parameters()])
    np.random.seed(0)
    assert_same(
        expected, run(lambda: remat.recompute(block, x, use_reentrant=use_reentrant), [x, *linear.parameters()])
    )
    np.random.seed(0)
    theirs = run(lambda: checkpoint(block, x, use_reentrant=use_reentrant), [x, *linear.parameters()])
    assert not all(torch.equal(a, b) for a, b in zip(expected.grads, theirs.grads, strict=True))


@BOTH
def test_none_argument(use_reentrant: bool) -> None:
    def block(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return a.tanh() if b is None else a + b

    compare_block(block, torch.randn(1, 10, requires_grad=True), None, use_reentrant=use_reentrant)


def scaled_pair(t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor) -> tuple[Any, ...]:
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


@BOTH
def test_non_tensor_inputs_and_outputs(use_reentrant: bool) -> None:
    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    plain = scaled_pair(t1, t2, 7, t3)
    res = remat.recompute(scaled_pair, t1, t2, 7, t3, use_reentrant=use_reentrant)
    assert len(res) == 7 and [res[i] for i in (0, 2, 3, 5)] == [7, None, True, "bar"]
    assert torch.equal(res[1], plain[1]) and torch.equal(res[4], plain[4]) and res[6] is t1

    def backward_each(res: tuple[Any, ...]) -> list[torch.Tensor]:
        t1.grad = t2.grad = None
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
        res[6].sum().backward()  # the input returned as is: a graph of its own each time
        return [t1.grad, t2.grad]

    expected = backward_each(plain)
    actual = backward_each(res)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))


@BOTH
def test_input_returned_and_used_inside_in_one_loss(use_reentrant: bool) -> None:
    t1, t2, t3 = torch.rand(10, requires_grad=True), torch.rand(10, requires_grad=True), torch.rand(10)
    if not use_reentrant:
        compare_block(scaled_pair, t1, t2, 7, t3, use_reentrant=use_reentrant)
        return

    # Difference (README): the reentrant Function sums the gradients from inside the block
    # in a backward of its own, then adds the one from outside: the last bits may differ
    def loss(outputs: Any) -> torch.Tensor:
        return torch.stack([o.sum() for o in outputs if isinstance(o, torch.Tensor)]).sum()

    def grads(outputs: Any) -> list[torch.Tensor]:
        t1.grad = t2.grad = None
        loss(outputs).backward()
        return [cast(torch.Tensor, t1.grad), cast(torch.Tensor, t2.grad)]

    expected = grads(scaled_pair(t1, t2, 7, t3))
    actual = grads(remat.recompute(scaled_pair, t1, t2, 7, t3, use_reentrant=True))
    assert all(torch.allclose(e, a, rtol=1e-6, atol=0) for e, a in zip(expected, actual, strict=True))


@BOTH
def test_no_tensor_arguments(use_reentrant: bool) -> None:
    args = (0.5, 0.25, 3, 0.75)
    assert remat.recompute(scaled_pair, *args, use_reentrant=use_reentrant) == scaled_pair(*args)  # type: ignore[arg-type]


@BOTH
def test_partial_grad(use_reentrant: bool) -> None:
    def pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a * 3, b  # b is used by the caller for other things

    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    compare_block(pair, a, b, use_reentrant=use_reentrant)

    def first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a

    a, b = torch.randn(1, 4), torch.randn(1, 4, requires_grad=True)
    message = "element 0 of tensors does not require grad and does not have a grad_fn"
    with pytest.raises(RuntimeError, match=message):
        first(a, b).sum().backward()
    out = remat.recompute(first, a, b, use_reentrant=use_reentrant)
    assert out is a
    with pytest.raises(RuntimeError, match=message):
        out.sum().backward()


def backward_live_bytes(
    wrap: Callable[[Callable[..., torch.Tensor], torch.Tensor], torch.Tensor], retain: bool
) -> list[int]:
    """Live bytes when backward reaches each of three intermediate results of a chain."""
    stats: list[int] = []
    with remat.MemoryTracker() as tracker:

        def track(t: torch.Tensor) -> None:
            if t.requires_grad:  # the reentrant forward runs under no_grad
                t.register_hook(lambda grad: stats.append(tracker.live_bytes))

        def chain(x: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                x = x**2
                track(x)
            return (x**2).sum()

        x = torch.zeros(10, requires_grad=True)
        x.grad = torch.zeros_like(x)
        wrap(chain, x).backward(retain_graph=retain)
    return stats


def test_saved_tensors_are_freed_during_backward() -> None:
    plain = backward_live_bytes(lambda f, x: f(x), retain=False)
    assert plain == sorted(plain, reverse=True) and len(set(plain)) == 3
    assert backward_live_bytes(lambda f, x: remat.recompute(f, x), retain=False) == plain
    # the reentrant mode frees as it goes too, retained graph or not (it also holds its anchor)
    reentrant = backward_live_bytes(lambda f, x: remat.recompute(f, x, use_reentrant=True), retain=False)
    assert reentrant == backward_live_bytes(lambda f, x: remat.recompute(f, x, use_reentrant=True), retain=True)
    assert [a - b for a, b in zip(reentrant, reentrant[1:])] == [a - b for a, b in zip(plain, plain[1:])]


def test_a_retained_backward_frees_what_it_recomputed_as_it_goes() -> None:
    # NOTE [retained graphs]: with retain_graph=True each recomputed tensor is dropped once
    # backward took it (as torch does), so a retained backward needs no more memory than
    # an ordinary one; plain autograd keeps its saved tensors until the graph is freed
    plain = backward_live_bytes(lambda f, x: f(x), retain=True)
    kept = backward_live_bytes(lambda f, x: remat.recompute(f, x), retain=True)
    freed = backward_live_bytes(lambda f, x: remat.recompute(f, x), retain=False)
    assert kept == freed
    assert kept[-1] < plain[-1]


# ============================================================ PyTorch test/test_autograd.py
def bottleneck() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))


@BOTH
def test_one_module_on_many_inputs(use_reentrant: bool) -> None:
    module = bottleneck()
    twin = copy.deepcopy(module)
    inputs = [torch.rand(1, 10, requires_grad=True) for _ in range(50)]
    expected = run(lambda: torch.stack([module(x) for x in inputs]).mean(), [*inputs, *module.parameters()])
    actual = run(
        lambda: torch.stack([remat.recompute(twin, x, use_reentrant=use_reentrant) for x in inputs]).mean(),
        [*inputs, *twin.parameters()],
    )
    assert_same(expected, actual)


class Holder(nn.Module):
    """Takes its input as a keyword argument."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self.module(data)


@BOTH
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_keyword_input_with_and_without_grad(use_reentrant: bool, input_requires_grad: bool) -> None:
    module = Holder(bottleneck())
    twin = copy.deepcopy(module)
    inputs = [torch.rand(1, 10).requires_grad_(input_requires_grad) for _ in range(20)]
    leaves = [x for x in inputs if x.requires_grad]
    expected = run(lambda: torch.stack([module(data=x) for x in inputs]).mean(), [*leaves, *module.parameters()])
    actual = run(
        lambda: torch.stack([remat.recompute(twin, data=x, use_reentrant=use_reentrant) for x in inputs]).mean(),
        [*leaves, *twin.parameters()],
    )
    assert_same(expected, actual)


@pytest.mark.parametrize(
    ("use_reentrant", "enabled"),
    [
        (False, True),
        (False, False),
        (True, True),
        (True, False),
    ],
    ids=["hooks-enabled", "hooks-disabled", "reentrant-enabled", "reentrant-disabled"],
)
def test_autocast_dtype_in_recompute(use_reentrant: bool, enabled: bool) -> None:
    seen: list[torch.dtype] = []

    def matmuls(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, y)
        seen.append(x.dtype)  # x is saved for backward: the recompute always gets here
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        return z + y

    x, y, z = (torch.randn(3, 3, requires_grad=True) for _ in range(3))

    def under_autocast(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def wrapped() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                return call()

        return wrapped

    expected = run(under_autocast(lambda: matmuls(x, y, z)), [x, y, z])
    seen.clear()
    actual = run(under_autocast(lambda: remat.recompute(matmuls, x, y, z, use_reentrant=use_reentrant)), [x, y, z])
    assert_same(expected, actual)
    assert seen == [torch.bfloat16 if enabled else torch.float32] * 2  # forward, then recompute


@BOTH
def test_recompute_lowers_the_peak(use_reentrant: bool) -> None:
    layers = [nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(4)]
    x = torch.randn(32, 64, requires_grad=True)

    def peak(recompute: bool) -> int:
        with remat.MemoryTracker(exclude_grads_of=[p for layer in layers for p in layer.parameters()]) as tracker:
            h = x
            for layer in layers:
                h = remat.recompute(layer, h, use_reentrant=use_reentrant) if recompute else layer(h)
            h.sum().backward()
        return tracker.peak_bytes

    activation = 32 * 64 * 4
    assert peak(True) <= peak(False) - 4 * activation


class SavesTwice(torch.autograd.Function):
    """Saves inputs, an intermediate and its output, and reads ``ctx.saved_tensors`` twice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y, z, w, out = ctx.saved_tensors
        again = ctx.saved_tensors  # torch's non-reentrant checkpoint raises here
        assert all(torch.equal(a, b) for a, b in zip(again, (x, y, z, w, out)))
        return 2 * grad * y * z, 2 * grad * x * z, 2 * grad * x * y


@BOTH
def test_custom_function_inside(use_reentrant: bool) -> None:
    def block(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return SavesTwice.apply(x * y * z, y * y * z, z * z)

    values = [torch.tensor(v, requires_grad=True) for v in (1.0, 2.0, 3.0)]
    compare_block(block, *values, use_reentrant=use_reentrant)


class RecordOps(TorchDispatchMode):
    """Records the name of every operator that runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


@BOTH
def test_context_fn_sees_forward_and_recompute(use_reentrant: bool) -> None:
    x = torch.tensor(1.0, requires_grad=True)
    forward = RecordOps()
    remat.recompute(
        torch.exp, x, use_reentrant=use_reentrant, context_fn=lambda: (forward, contextlib.nullcontext())
    ).backward()
    assert forward.ops == ["exp.default"]
    recompute = RecordOps()
    out = remat.recompute(
        torch.exp, x, use_reentrant=use_reentrant, context_fn=lambda: (contextlib.nullcontext(), recompute)
    )
    assert recompute.ops == []
    out.backward()
    assert recompute.ops == ["exp.default", "detach.default"]
    assert torch.equal(x.grad, 2 * torch.exp(x.detach()))  # type: ignore[arg-type]


@BOTH
def test_context_fn_exits_when_the_forward_raises(use_reentrant: bool) -> None:
    events: list[Any] = []

    @contextlib.contextmanager
    def watched() -> Iterator[None]:
        events.append("enter")
        try:
            yield
        except ValueError as error:
            events.append(("exit", str(error)))
            raise

    def fails(x: torch.Tensor) -> torch.Tensor:
        assert events == ["enter"]
        raise ValueError("forward failed")

    with pytest.raises(ValueError, match="forward failed"):
        remat.recompute(
            fails,
            torch.tensor(1.0, requires_grad=True),
            use_reentrant=use_reentrant,
            context_fn=lambda: (watched(), contextlib.nullcontext()),
        )
    assert events == ["enter", ("exit", "forward failed")]


@BOTH
def test_context_fn_cannot_swallow_a_forward_error(use_reentrant: bool) -> None:
    class Swallows:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> bool:
            return True

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("forward failed")

    with pytest.raises(RematError, match=r"context_fn suppressed an exception raised by the block '.*fails'"):
        remat.recompute(
            fails,
            torch.tensor(1.0, requires_grad=True),
            use_reentrant=use_reentrant,
            context_fn=lambda: (Swallows(), contextlib.nullcontext()),
        )


@BOTH
def test_gradients_of_parts_of_the_outputs(use_reentrant: bool) -> None:
    calls: list[bool] = []

    def two_stages(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(remat.is_recomputing())
        y = x.sin().cos()
        return y, y.sin().cos()

    x = torch.randn(3, 3, requires_grad=True)
    ones = torch.ones(3, 3)

    def grads(y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (grad_y,) = torch.autograd.grad(z, [y], [ones])
        (grad_x,) = torch.autograd.grad(y, [x], [grad_y])
        return grad_y, grad_x

    expected = grads(*two_stages(x))
    y, z = remat.recompute(two_stages, x, use_reentrant=use_reentrant)
    if use_reentrant:
        # the block's outputs are siblings of one autograd node: z does not depend on y
        with pytest.raises(RuntimeError, match="differentiated Tensors? .*appears to not have been used"):
            grads(y, z)
        return
    actual = grads(y, z)
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    # torch recomputes once per backward (twice); remat's first recompute serves both
    assert calls == [False, False, True]


def sin_exp_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def sin_exp(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def sin_times_pair(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * torch.tensor([1.0, 2.0])


def changes_on_recompute(original: Callable[..., Any], recomputed: Callable[..., Any]) -> Callable[..., Any]:
    def block(x: torch.Tensor) -> Any:
        return recomputed(x) if remat.is_recomputing() else original(x)

    return block


def test_nondeterminism_is_detected() -> None:
    a = torch.randn(1, requires_grad=True)
    with pytest.raises(NondeterministicRecompute, match="saved 2 tensors for backward, the original forward saved 3"):
        remat.recompute(changes_on_recompute(sin_exp_sin, sin_exp), a).backward()
    with pytest.raises(
        NondeterministicRecompute, match=r"saved more tensors for backward than the original forward \(3 > 2\)"
    ):
        remat.recompute(changes_on_recompute(sin_exp, sin_exp_sin), a, early_stop=False).backward()
    with pytest.raises(
        NondeterministicRecompute, match=r"saved a tensor of shape \(2,\).*where the original forward saved \(1,\)"
    ):
        remat.recompute(changes_on_recompute(sin_exp, sin_times_pair), a).sum().backward()
    with pytest.raises(NondeterministicRecompute, match="debug=True: the original forward"):
        remat.recompute(changes_on_recompute(sin_exp, sin_times_pair), a, debug=True).sum().backward()
    # with early stop, a recompute that saves more stops once it has what backward needs
    a.grad = None
    remat.recompute(changes_on_recompute(sin_exp, sin_exp_sin), a).backward()
    early = a.grad
    a.grad = None
    sin_exp(a).backward()
    assert torch.equal(early, a.grad)  # type: ignore[arg-type]


def test_nondeterminism_in_the_reentrant_mode() -> None:
    a = torch.randn(1, requires_grad=True)
    with pytest.raises(
        NondeterministicRecompute, match=r"returned tensors \[\(\(2,\).*where the original forward returned \[\(\(1,\)"
    ):
        remat.recompute(changes_on_recompute(sin_exp, sin_times_pair), a, use_reentrant=True).sum().backward()
    # with the check off, autograd itself finds the mismatch
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        remat.recompute(
            changes_on_recompute(sin_exp, sin_times_pair), a, use_reentrant=True, determinism_check="none"
        ).sum().backward()


def test_saved_tensor_read_outside_backward() -> None:
    calls: list[bool] = []

    def block(a: torch.Tensor) -> torch.Tensor:
        calls.append(remat.is_recomputing())
        b = a * a
        a * b
        return torch.exp(a)

    a = torch.randn(5, requires_grad=True)
    plain = block(a)
    d = remat.recompute(block, a)
    assert torch.equal(d.grad_fn._saved_result, plain.grad_fn._saved_result)  # type: ignore[union-attr]
    assert torch.equal(d.grad_fn._saved_result, plain.grad_fn._saved_result)  # type: ignore[union-attr]
    # torch recomputes at each read; remat once, and backward uses what that recompute made
    assert calls == [False, False, True]
    d.sum().backward()
    assert calls == [False, False, True]
    plain.sum().backward()
    message = "directly access saved tensors after they have already been freed"
    with pytest.raises(RuntimeError, match=message):
        plain.grad_fn._saved_result  # type: ignore[union-attr]  # noqa: B018
    with pytest.raises(RuntimeError, match=message):
        d.grad_fn._saved_result  # noqa: B018


def test_reentrant_refusal_leaves_backward_working() -> None:
    a = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(RematError, match="use_reentrant=False"):
        torch.autograd.grad(remat.recompute(torch.exp, a, use_reentrant=True).sum(), (a,))
    remat.recompute(torch.exp, a, use_reentrant=True).sum().backward()
    assert torch.equal(a.grad, torch.exp(a.detach()))  # type: ignore[arg-type]


class NoGradInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)
        self.lin2 = nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lin2(self.linear(x))


@BOTH
def test_output_without_gradient_path(use_reentrant: bool) -> None:
    module = NoGradInside()
    a = torch.randn(2, 2, requires_grad=True)
    for _ in range(3):
        plain = module(a)
        out = remat.recompute(module, a, use_reentrant=use_reentrant)
        assert torch.equal(plain, out)
        # Difference (README): a reentrant block's outputs all require grad when an input
        # does (autograd's rule for a custom Function); the gradients stay exact
        assert out.requires_grad == use_reentrant and plain.requires_grad is False
        out += a
        out.sum().backward()
    assert torch.equal(a.grad, torch.full((2, 2), 3.0))  # type: ignore[arg-type]
    assert all(p.grad is None for p in module.parameters())


class SavesItsSecondInput(torch.autograd.Function):
    seen: torch.Tensor | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(y)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (SavesItsSecondInput.seen,) = ctx.saved_tensors
        return grad, None


@BOTH
def test_saved_object_identity(use_reentrant: bool) -> None:
    a, b = torch.tensor(1.0, requires_grad=True), torch.tensor(1.0)
    SavesItsSecondInput.apply(a, b).backward()
    assert SavesItsSecondInput.seen is b
    SavesItsSecondInput.seen = None
    remat.recompute(SavesItsSecondInput.apply, a, b, use_reentrant=use_reentrant).backward()
    assert SavesItsSecondInput.seen is b
    SavesItsSecondInput.seen = None


@BOTH
def test_backward_and_autograd_grad_agree(use_reentrant: bool) -> None:
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    expected = a.grad
    a.grad = None
    remat.recompute(torch.exp, a, use_reentrant=use_reentrant).sum().backward()
    assert torch.equal(expected, a.grad)  # type: ignore[arg-type]
    if not use_reentrant:
        (grad,) = torch.autograd.grad(remat.recompute(torch.exp, a).sum(), (a,))
        assert torch.equal(expected, grad)  # type: ignore[arg-type]


@BOTH
def test_data_parallel_wrapper(use_reentrant: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # on a machine without a GPU nn.DataParallel calls its module; where one is, it is made
    # to believe there is none (this test's tensors are on the CPU)
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
    monkeypatch.setattr(data_parallel, "_get_available_device_type", lambda: None)
    model = nn.DataParallel(nn.Linear(2, 2, bias=False))
    compare_block(model, torch.randn(2, 2, requires_grad=True), use_reentrant=use_reentrant)


@BOTH
def test_parameter_used_inside_and_outside(use_reentrant: bool) -> None:
    w = torch.randn(10, 10, requires_grad=True)
    x = torch.rand(10, 10, requires_grad=True)
    hook_calls: list[torch.Tensor] = []
    w.register_hook(hook_calls.append)
    (w * (w * x)).sum().backward()
    expected = [w.grad, x.grad]
    assert len(hook_calls) == 1
    w.grad = x.grad = None
    hook_calls.clear()
    remat.recompute(lambda h: w * h, w * x, use_reentrant=use_reentrant).sum().backward()
    assert all(torch.equal(e, a) for e, a in zip(expected, [w.grad, x.grad]))  # type: ignore[arg-type]
    # the reentrant mode gives w its inner gradient in a backward pass of its own
    assert len(hook_calls) == (2 if use_reentrant else 1)


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 5, bias=False)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"result": self.layer(inputs["tensor"])}


@BOTH
def test_dict_input_and_output(use_reentrant: bool) -> None:
    compare_block(DictModel(), {"tensor": torch.randn(5, 5)}, use_reentrant=use_reentrant)


@BOTH
def test_nested_blocks_with_kwargs_and_constants(use_reentrant: bool) -> None:
    inner = Counted(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Dropout(0.2)))

    def child(x: torch.Tensor, tag: str, *, scale: float) -> tuple[torch.Tensor, str, None]:
        return inner(x) * scale, tag + "!", None

    def outer(x: torch.Tensor, y: torch.Tensor, *, nested: bool, scale: float) -> dict[str, Any]:
        call: Callable[..., Any] = (
            (lambda *a, **k: remat.recompute(child, *a, use_reentrant=use_reentrant, **k)) if nested else child
        )
        first, tag, nothing = call(x.sin(), "a", scale=scale)
        second, _, _ = call(y, "b", scale=-scale)  # the same child on another input
        return {"out": first * second, "tag": tag, "none": nothing, "scale": scale}

    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    leaves = [x, y, *inner.parameters()]
    expected = run(lambda: outer(x, y, nested=False, scale=0.5), leaves)
    actual = run(lambda: remat.recompute(outer, x, y, nested=True, scale=0.5, use_reentrant=use_reentrant), leaves)
    assert_same(expected, actual, requires_grad=True)


@BOTH
@pytest.mark.parametrize("switch", ["set_grad_enabled", "no_grad"])
def test_grad_mode_switched_inside(use_reentrant: bool, switch: str) -> None:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)

    def block(x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(False) if switch == "set_grad_enabled" else torch.no_grad():
            scale = first(x).sigmoid()  # used as a constant
        with torch.set_grad_enabled(True):
            return torch.tanh(second(x) * scale)

    x = torch.randn(3, 4, requires_grad=True)
    expected = run(lambda: block(x), [x, *first.parameters(), *second.parameters()])
    actual = run(
        lambda: remat.recompute(block, x, use_reentrant=use_reentrant), [x, *first.parameters(), *second.parameters()]
    )
    assert_same(expected, actual)
    assert first.weight.grad is None


class Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.triu() + weight.triu(1).transpose(-1, -2)


@BOTH
@pytest.mark.parametrize("cached", [False, True])
def test_parametrized_weight(use_reentrant: bool, cached: bool) -> None:
    block = nn.Sequential(nn.Linear(5, 5), nn.GELU(), nn.Linear(5, 5))
    parametrize.register_parametrization(block[0], "weight", Symmetric())
    twin = copy.deepcopy(block)
    x = torch.randn(3, 5, requires_grad=True)
    context = parametrize.cached if cached else contextlib.nullcontext

    def within(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def wrapped() -> torch.Tensor:
            with context():
                return call()

        return wrapped

    expected = run(within(lambda: block(x)), [x, *block.parameters()])
    actual = run(within(lambda: remat.recompute(twin, x, use_reentrant=use_reentrant)), [x, *twin.parameters()])
    assert_same(expected, actual)


@BOTH
def test_backward_twice_with_retain_graph(use_reentrant: bool) -> None:
    block = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Dropout(0.3))
    x = torch.randn(2, 3, requires_grad=True)

    def twice(call: Callable[[], torch.Tensor]) -> tuple[list[torch.Tensor], str]:
        x.grad = None
        block.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = call().square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(RuntimeError) as third:
            loss.backward()
        return [x.grad, *(p.grad for p in block.parameters())], str(third.value)  # type: ignore[list-item]

    expected, plain_error = twice(lambda: block(x))
    actual, error = twice(lambda: remat.recompute(block, x, use_reentrant=use_reentrant))
    assert all(torch.equal(e, a) for e, a in zip(expected, actual))
    assert error == plain_error and "backward through the graph a second time" in error


# ============================================================ FairScale tests/nn/checkpoint
class BasicModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(32, 128), nn.Dropout(p=0.5), nn.Linear(128, 32))
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ffn(x))


@BOTH
def test_marked_ffn_with_dropout(use_reentrant: bool) -> None:
    model = BasicModel()
    twin = copy.deepcopy(model)
    remat.mark(twin.ffn, use_reentrant=use_reentrant)
    x = torch.rand(2, 16, 32, requires_grad=True)
    assert_same(run(lambda: model(x), [x, *model.parameters()]), run(lambda: twin(x), [x, *twin.parameters()]))


class TwoBranches(nn.Module):
    def __init__(self, multiout: bool) -> None:
        super().__init__()
        self.multiout = multiout
        self.conv1 = nn.Sequential(nn.Conv2d(1, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))
        self.conv2 = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 5, 3))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor | None = None) -> Any:
        out1, out2 = self.conv1(x1), self.conv2(x2)
        return (out1, out2) if self.multiout else out1 + out2


@BOTH
@pytest.mark.parametrize("multiout", [True, False])
@pytest.mark.parametrize("marked", [1, 2, 3])
def test_several_inputs_and_outputs(use_reentrant: bool, multiout: bool, marked: int) -> None:
    model = TwoBranches(multiout)
    twin = copy.deepcopy(model)
    if marked & 1:
        remat.mark(twin.conv1, use_reentrant=use_reentrant)
    if marked & 2:
        remat.mark(twin.conv2, use_reentrant=use_reentrant)
    in1, in2 = torch.rand(2, 1, 8, 8, requires_grad=True), torch.rand(2, 3, 8, 8, requires_grad=True)
    expected = run(lambda: model(in1, x2=in2), [in1, in2, *model.parameters()])
    actual = run(lambda: twin(in1, x2=in2), [in1, in2, *twin.parameters()])
    assert_same(expected, actual)


class ListModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls: list[bool] = []

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(remat.is_recomputing())
        return [self.linear(x) for x in xs]


@BOTH
def test_list_input_and_output(use_reentrant: bool) -> None:
    model = nn.Sequential(ListModel(), ListModel())
    twin = copy.deepcopy(model)
    remat.mark(twin[0], use_reentrant=use_reentrant)
    xs = [torch.rand(4, 2), torch.rand(4, 2)]
    expected = run(lambda: model(xs), list(model.parameters()))
    actual = run(lambda: twin(xs), list(twin.parameters()))
    assert_same(expected, actual, requires_grad=True)
    assert [m.calls for m in twin] == [[False, True], [False]]


@BOTH
def test_unmark_disables_recompute(use_reentrant: bool) -> None:
    first, second = ListModel(), ListModel()
    x = torch.rand(4, 2)
    remat.mark(first, use_reentrant=use_reentrant)
    sum(t.sum() for t in first(x)).backward()
    assert first.calls == [False, True]
    remat.mark(second, use_reentrant=use_reentrant)
    remat.unmark(second)
    sum(t.sum() for t in second(x)).backward()
    assert second.calls == [False]


class CountingLinear(nn.Module):
    """Counts its calls in a list, and in a plain int as FairScale's test does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls: list[bool] = []
        self.cnt = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(remat.is_recomputing())
        self.cnt += 1
        return self.linear(x)


@pytest.mark.parametrize(
    ("use_reentrant", "first_trainable"),
    [
        (False, False),
        (False, True),
        (True, False),
        (True, True),
    ],
    ids=["hooks-frozen", "hooks-first-trainable", "reentrant-frozen", "reentrant-first-trainable"],
)
def test_frozen_blocks_are_not_recomputed(use_reentrant: bool, first_trainable: bool) -> None:
    plain = nn.Sequential(*(CountingLinear() for _ in range(4)))
    model = copy.deepcopy(plain)
    for m in model:
        remat.mark(m, use_reentrant=use_reentrant)
    for m in (plain, model):
        m[0].requires_grad_(first_trainable)
        m[1].requires_grad_(False)
        m[2].requires_grad_(False)
    x = torch.rand(4, 2)
    expected = run(lambda: plain(x), list(plain.parameters()))
    actual = run(lambda: model(x), list(model.parameters()))
    assert_same(expected, actual, requires_grad=True)
    # a block recomputes only when backward goes through it
    assert call_counts(model) == ([2, 2, 2, 2] if first_trainable else [1, 1, 1, 2])
    # remat replays plain attributes: the int counter reads as after one forward
    assert [m.cnt for m in model] == [1, 1, 1, 1]


class ListArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls: list[bool] = []
        self.cnt = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor, z: list[Any]) -> tuple[torch.Tensor, list[Any], list[str]]:
        self.calls.append(remat.is_recomputing())
        self.cnt += 1
        return self.linear(x + y), z + [self.cnt], ["hi"]


@BOTH
@pytest.mark.parametrize("frozen", [(0, 1), (1,)])
def test_non_tensor_list_arguments_with_frozen_blocks(use_reentrant: bool, frozen: tuple[int, ...]) -> None:
    plain = nn.ModuleList([CountingLinear(), CountingLinear(), ListArguments(), CountingLinear()])
    model = copy.deepcopy(plain)
    for m in model:
        remat.mark(m, use_reentrant=use_reentrant)
    for index in frozen:
        plain[index].requires_grad_(False)
        model[index].requires_grad_(False)
    x = torch.rand(4, 2)

    def forward(m: nn.ModuleList) -> Any:
        hidden, listed, words = m[2](m[0](x), m[1](x), ["bye"])
        return m[3](hidden), listed, words

    expected = run(lambda: forward(plain), list(plain.parameters()))
    actual = run(lambda: forward(model), list(model.parameters()))
    assert_same(expected, actual, requires_grad=not use_reentrant)
    assert actual.constants == ["bye", 1, "hi"]
    assert call_counts(model)[2:] == [2, 2]
    if not use_reentrant:  # the reentrant mode recomputes frozen blocks: see test_frozen_blocks_are_not_recomputed
        assert call_counts(model)[:2] == [1 if i in frozen else 2 for i in range(2)]


@BOTH
@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.BatchNorm2d])
@pytest.mark.parametrize("precision", ["fp32", "half"])
def test_norm_layers_after_an_sgd_step(use_reentrant: bool, norm: type[nn.Module], precision: str) -> None:
    reference = nn.Sequential(nn.Linear(3, 2), norm(2))
    if precision == "half":
        reference.half()
    model = copy.deepcopy(reference)
    remat.mark(model, use_reentrant=use_reentrant)
    x = torch.rand(2, 2, 3, 3)
    x = (x.half() if precision == "half" else x).requires_grad_(True)
    for m in (reference, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x).sum().backward()
        optimizer.step()
    for (name, value), other in zip(reference.state_dict().items(), model.state_dict().values()):
        assert value.dtype == other.dtype and torch.equal(value, other), name


# ============================================================ DeepSpeed activation checkpointing
HIDDEN = 20


class MaskedLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out * (mask if mask.is_floating_point() else mask.type_as(out))


class MaskedLinearSeq(MaskedLinear):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x, mask), mask


class MaskedLinearSeqDup(MaskedLinearSeq):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        dup = x.clone().detach() * 1.38
        out, mask = super().forward(x, mask)
        return dup, out, mask


class DropMaskLinear(nn.Linear):
    def forward(self, x: torch.Tensor, mask: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


def mask_of(kind: str) -> torch.Tensor:
    mask = torch.randn(HIDDEN) > 0
    return mask if kind == "bool" else mask.float()


@BOTH
@pytest.mark.parametrize("input_requires_grad", [True, False])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("block_type", [nn.Linear, MaskedLinear, MaskedLinearSeq, MaskedLinearSeqDup, DropMaskLinear])
def test_masked_linear_blocks(
    use_reentrant: bool, input_requires_grad: bool, mask_kind: str, block_type: type[nn.Module]
) -> None:
    block = block_type(HIDDEN, HIDDEN)
    x = torch.rand(HIDDEN).requires_grad_(input_requires_grad)
    args: tuple[Any, ...] = (x,)
    if block_type is DropMaskLinear:
        args = (x, None)
    elif block_type is not nn.Linear:
        args = (x, mask_of(mask_kind))
    out = compare_block(block, *args, use_reentrant=use_reentrant)
    if block_type in (MaskedLinearSeq, MaskedLinearSeqDup):
        assert out.outputs[-1].dtype == args[1].dtype


class LinearWithExtra(nn.Linear):
    def forward(self, x: torch.Tensor, extra: Any) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


NON_TENSORS = [None, 2, True, (None, 2.5), (None, True, torch.randn(HIDDEN))]


@BOTH
@pytest.mark.parametrize("extra", NON_TENSORS, ids=["none", "int", "bool", "pair", "triple"])
def test_non_tensor_input(use_reentrant: bool, extra: Any) -> None:
    compare_block(
        LinearWithExtra(HIDDEN, HIDDEN), torch.rand(HIDDEN, requires_grad=True), extra, use_reentrant=use_reentrant
    )


class LinearReturningExtra(nn.Linear):
    def __init__(self, extra: Any) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        return super().forward(x), self.extra


@BOTH
@pytest.mark.parametrize(
    "extra",
    [*NON_TENSORS, (torch.randn(HIDDEN), 2.5), (None, torch.randn(HIDDEN), True)],
    ids=["none", "int", "bool", "pair", "triple", "tensor-first", "tensor-middle"],
)
def test_non_tensor_output(use_reentrant: bool, extra: Any) -> None:
    compare_block(LinearReturningExtra(extra), torch.rand(HIDDEN, requires_grad=True), use_reentrant=use_reentrant)


@BOTH
@pytest.mark.parametrize(
    "extra", [(torch.randn(HIDDEN), 2.5), (None, torch.randn(HIDDEN), True)], ids=["first", "middle"]
)
def test_tensor_from_outside_comes_back_as_itself(use_reentrant: bool, extra: Any) -> None:
    block = LinearReturningExtra(extra)
    out = compare_block(block, torch.rand(HIDDEN, requires_grad=True), use_reentrant=use_reentrant)
    _, returned = remat.recompute(block, torch.rand(HIDDEN, requires_grad=True), use_reentrant=use_reentrant)
    if not use_reentrant:
        assert out.requires_grad == [True, False]
        assert all(a is b for a, b in zip(tree_leaves(returned), tree_leaves(extra)))
        return
    # Difference (README): through the reentrant Function, a tensor from outside that
    # needs no gradient comes back as an alias of itself that requires grad
    tensors = [(a, b) for a, b in zip(tree_leaves(returned), tree_leaves(extra)) if isinstance(b, torch.Tensor)]
    assert all(torch.equal(a, b) and a is not b and a.requires_grad for a, b in tensors)


@BOTH
def test_keyword_arguments(use_reentrant: bool) -> None:
    def function(value: torch.Tensor, *, scale: torch.Tensor, offset: float) -> torch.Tensor:
        return value * scale + offset

    value, scale = torch.randn(HIDDEN, requires_grad=True), torch.randn(HIDDEN, requires_grad=True)
    compare_block(function, value, scale=scale, offset=1.5, use_reentrant=use_reentrant)
