"""Selective recompute: policies decide per operation, gradients stay bit for bit.

Each decision is asserted by counting, per ATen operation, how many times it ran in the
forward, again in backward (a recompute) and as a gradient: a kept output's operation must
never run twice, a recomputed one must run again. Gradients, outputs and buffers are
compared with plain autograd with ``torch.equal``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pickle
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import RematError, policies
from remat.policies import Decision

pytestmark = pytest.mark.usefixtures("clean_remat_state")


# ----------------------------------------------------------------------------- helpers
class OpCounter(TorchDispatchMode):
    """Counts ATen operations by name, in the forward, in recomputes and in the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts: dict[str, Counter[str]] = {"forward": Counter(), "recompute": Counter(), "backward": Counter()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        phase = "recompute" if remat.is_recomputing() else self.phase
        if not func.is_view and func is not torch.ops.aten.detach.default:
            self.counts[phase][func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def run_step(forward: Callable[[], Any], leaves: list[torch.Tensor], seed: int = 7) -> tuple[Any, list, OpCounter]:
    """One forward and backward: the output, the gradients of `leaves`, the op counts."""
    for leaf in leaves:
        leaf.grad = None
    torch.manual_seed(seed)
    with OpCounter() as counter:
        out = forward()
        counter.phase = "backward"
        weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        (out * weights).sum().backward()
    grads = [None if leaf.grad is None else leaf.grad.clone() for leaf in leaves]
    return out.detach(), grads, counter


def assert_same(expected: tuple[Any, list, OpCounter], got: tuple[Any, list, OpCounter]) -> None:
    assert torch.equal(expected[0], got[0])
    assert len(expected[1]) == len(got[1])
    for a, b in zip(expected[1], got[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


class MLP(nn.Module):
    def __init__(self, width: int = 16, p: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.drop(self.fc2(self.drop(self.act(self.fc1(x))))))


class Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = remat.tag(q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5, "scores")
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        probs = F.dropout(scores.masked_fill(~mask, float("-inf")).softmax(-1), 0.2, training=self.training)
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, c))


class ConvBN(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.drop = nn.Dropout2d(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.act(self.bn(self.conv(x))))


def mlp_case() -> tuple[nn.Module, torch.Tensor]:
    return MLP(), torch.randn(4, 16, requires_grad=True)


def attention_case() -> tuple[nn.Module, torch.Tensor]:
    return Attention(), torch.randn(2, 5, 16, requires_grad=True)


def conv_case() -> tuple[nn.Module, torch.Tensor]:
    return ConvBN(), torch.randn(2, 4, 6, 6, requires_grad=True)


CASES = {"mlp": mlp_case, "attention": attention_case, "conv_bn": conv_case}

POLICIES: dict[str, Any] = {
    "save_nothing": policies.save_nothing,
    "save_all": policies.save_all,
    "save_matmuls": policies.save_matmuls,
    "recompute_gelu": policies.recompute_ops(torch.ops.aten.gelu),
    "recompute_functional_dropout": policies.recompute_ops(F.dropout, "softmax"),
    "save_addmm_overload": policies.save_ops(torch.ops.aten.addmm.default, "aten.convolution"),
    "save_names": policies.save_names("scores"),
    "either": policies.either(policies.save_matmuls, policies.save_names("scores")),
    "both": policies.both(policies.save_matmuls, policies.save_ops(torch.ops.aten.bmm)),
    "true": True,
    "false": False,
    "callable": lambda op, *args, **kwargs: op.overloadpacket.__name__ in ("addmm", "_softmax", "bmm"),
}


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_gives_plain_autograd_gradients_and_buffers(case: str, name: str) -> None:
    model, x = CASES[case]()
    twin = copy.deepcopy(model)
    leaves = [x, *model.parameters()]
    plain = run_step(lambda: model(x), leaves)
    got = run_step(lambda: remat.recompute(twin, x, policy=POLICIES[name]), [x, *twin.parameters()])
    assert_same(plain, got)
    for a, b in zip(model.buffers(), twin.buffers(), strict=True):
        assert torch.equal(a, b)  # running statistics updated once, as in plain autograd


@pytest.mark.parametrize("name", ["save_matmuls", "recompute_gelu", "callable"])
def test_marked_applied_and_sequential_forms_take_a_policy(name: str) -> None:
    model, x = mlp_case()
    marked, applied = copy.deepcopy(model), copy.deepcopy(model)
    plain = run_step(lambda: model(x), [x, *model.parameters()])
    remat.mark(marked, policy=POLICIES[name])
    remat.apply(applied, MLP, policy=POLICIES[name])
    assert_same(plain, run_step(lambda: marked(x), [x, *marked.parameters()]))
    assert_same(plain, run_step(lambda: applied(x), [x, *applied.parameters()]))
    chain = nn.Sequential(copy.deepcopy(model), copy.deepcopy(model))
    twin = copy.deepcopy(chain)
    expected = run_step(lambda: chain(x), [x, *chain.parameters()])
    got = run_step(lambda: remat.recompute_sequential(twin, 2, x, policy=POLICIES[name]), [x, *twin.parameters()])
    assert_same(expected, got)


# ----------------------------------------------------------------------------- decisions
def test_save_matmuls_never_runs_a_matmul_twice_and_recomputes_the_rest_once() -> None:
    model, x = attention_case()
    _, _, counter = run_step(lambda: remat.recompute(model, x, policy=policies.save_matmuls), [x])
    forward, again = counter.counts["forward"], counter.counts["recompute"]
    assert forward["addmm"] == 2 and forward["bmm"] == 2
    for matmul in ("mm", "addmm", "bmm", "matmul"):
        assert again[matmul] == 0
    assert again["_softmax"] == 1 and again["masked_fill"] == 1


def test_whole_block_recompute_runs_every_operation_again() -> None:
    model, x = mlp_case()
    _, _, counter = run_step(lambda: remat.recompute(model, x), [x])
    forward, again = counter.counts["forward"], counter.counts["recompute"]
    # the last LayerNorm's own output is not needed by its backward: early stop ends there
    assert again["addmm"] == forward["addmm"] == 2
    assert again["gelu"] == 1 and again["bernoulli_"] == 2


def test_recompute_ops_recomputes_only_the_marked_operation() -> None:
    model, x = mlp_case()
    _, _, counter = run_step(lambda: remat.recompute(model, x, policy=policies.recompute_ops("gelu")), [x])
    again = counter.counts["recompute"]
    assert again["gelu"] == 1
    assert again["addmm"] == 0 and again["native_layer_norm"] == 0 and again["mul"] == 0
    # the dropout masks, made in place (bernoulli_ on an empty tensor), are kept as filled
    # (NOTE [outputs filled in place]): not drawn again
    assert again["bernoulli_"] == 0 and again["empty_like"] == 0


def test_a_torch_function_name_matches_every_operation_it_runs() -> None:
    model, x = mlp_case()
    _, _, counter = run_step(lambda: remat.recompute(model, x, policy=policies.recompute_ops(F.dropout)), [x])
    again = counter.counts["recompute"]
    assert again["bernoulli_"] == 2 and again["empty_like"] == 2
    assert again["gelu"] == 0 and again["addmm"] == 0


def test_save_names_keeps_the_tagged_tensor_and_recomputes_the_rest() -> None:
    model, x = attention_case()
    _, _, counter = run_step(lambda: remat.recompute(model, x, policy=policies.save_names("scores")), [x])
    forward, again = counter.counts["forward"], counter.counts["recompute"]
    assert forward["div"] == 1
    assert again["div"] == 0  # the tagged division's output is handed to the recompute
    assert again["bmm"] == 2  # both products (scores, and probabilities @ values) run again
    assert again["addmm"] == 1


def test_tag_outside_a_recompute_returns_the_tensor_itself() -> None:
    x = torch.randn(3)
    assert remat.tag(x, "name") is x
    with pytest.raises(TypeError, match="non-empty string"):
        remat.tag(x, "")


def test_combinators_follow_must_before_prefer() -> None:
    mm = torch.ops.aten.mm.default
    gelu = torch.ops.aten.gelu.default
    either = policies.either(policies.recompute_ops(gelu), policies.save_matmuls)
    assert either(mm) is Decision.MUST_SAVE
    assert either(gelu) is Decision.MUST_RECOMPUTE
    assert either(torch.ops.aten.sin.default) is Decision.PREFER_SAVE
    both = policies.both(policies.recompute_ops(gelu), policies.save_matmuls)
    assert both(mm) is Decision.MUST_SAVE
    assert both(torch.ops.aten.sin.default) is Decision.PREFER_RECOMPUTE
    assert policies.either(policies.save_all, policies.save_nothing).saves_everything
    assert policies.both(policies.save_all, policies.save_nothing).recomputes_everything


def test_bool_and_callable_policies_are_normalised() -> None:
    assert policies.as_policy(True) is policies.save_all
    assert policies.as_policy(False) is policies.save_nothing
    assert policies.as_policy(None) is policies.save_nothing
    custom = policies.as_policy(lambda op, *args, **kwargs: op is torch.ops.aten.mm.default)
    assert custom(torch.ops.aten.mm.default) is Decision.MUST_SAVE
    assert custom(torch.ops.aten.add.Tensor) is Decision.PREFER_RECOMPUTE
    with pytest.raises(RematError, match="policy must be"):
        policies.as_policy(3)  # type: ignore[arg-type]
    wrong = policies.as_policy(lambda op, *args, **kwargs: "yes")
    with pytest.raises(RematError, match="returned 'yes'"):
        remat.recompute(lambda t: t.sin() @ t, torch.randn(2, 2, requires_grad=True), policy=wrong)


@pytest.mark.parametrize(
    ("factory", "argument", "message"),
    [
        (policies.save_ops, None, "at least one operation"),
        (policies.save_ops, "aten.no_such_op", "no ATen operation"),
        (policies.recompute_ops, "aten.mm.nope", "not an overload"),
        (policies.recompute_ops, "definitely_not_an_op", "names no torch function"),
        (policies.save_ops, 3, "takes ATen operations"),
    ],
)
def test_bad_operation_names_are_refused(factory: Any, argument: Any, message: str) -> None:
    with pytest.raises(RematError, match=message):
        factory() if argument is None else factory(argument)


def test_policies_print_as_they_are_written() -> None:
    assert repr(policies.save_matmuls) == "remat.policies.save_matmuls"
    assert "aten.gelu" in repr(policies.recompute_ops(torch.ops.aten.gelu))
    assert repr(policies.save_names("a")) == "remat.policies.save_names('a')"


def test_the_reentrant_implementation_refuses_a_selective_policy() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(RematError, match="needs the hook-based implementation"):
        remat.recompute(torch.sin, x, use_reentrant=True, policy=policies.save_matmuls)
    # keeping everything needs no recompute at all: the block just runs
    assert torch.equal(remat.recompute(torch.sin, x, use_reentrant=True, policy=True), torch.sin(x))


# ----------------------------------------------------------------------------- exactness traps
def test_a_kept_random_operation_leaves_the_generator_where_the_forward_did() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        noisy = x * torch.rand_like(x)  # kept: the recompute does not draw these numbers
        return F.dropout(noisy.sin(), 0.5, training=True)  # recomputed: must draw the same mask

    x = torch.randn(6, 6, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    policy = policies.save_ops(torch.ops.aten.rand_like)
    got = run_step(lambda: remat.recompute(block, x, policy=policy), [x])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["rand_like"] == 0 and got[2].counts["recompute"]["bernoulli_"] == 1


def test_is_recomputing_is_true_in_a_selective_recompute() -> None:
    seen: list[bool] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(remat.is_recomputing())
        return (x @ x).sin()

    x = torch.randn(3, 3, requires_grad=True)
    remat.recompute(block, x, policy=policies.save_matmuls).sum().backward()
    assert seen == [False, True]


def test_a_kept_output_changed_in_place_in_the_forward_is_computed_again() -> None:
    def block(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = a @ w
        y.add_(1)
        return (y * 2).sin()

    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    plain = run_step(lambda: block(a, w), [a, w])
    got = run_step(lambda: remat.recompute(block, a, w, policy=policies.save_matmuls), [a, w])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["mm"] == 1  # its kept output no longer held the product


def test_a_kept_output_changed_after_the_block_returned_is_computed_again() -> None:
    def block(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = a @ w
        return y, (y * 3).sin()

    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)

    def forward(recomputed: bool) -> torch.Tensor:
        y, z = remat.recompute(block, a, w, policy=policies.save_matmuls) if recomputed else block(a, w)
        y.mul_(5)  # the block's output, changed by the caller
        return y + z

    plain = run_step(lambda: forward(False), [a, w])
    got = run_step(lambda: forward(True), [a, w])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["mm"] == 1


@pytest.mark.parametrize(("outer", "inner"), [(None, "save_matmuls"), ("save_matmuls", None)])
def test_a_nested_block_decides_for_its_own_operations(outer: str | None, inner: str | None) -> None:
    first, second = MLP(), MLP()
    x = torch.randn(4, 16, requires_grad=True)

    def body(t: torch.Tensor) -> torch.Tensor:
        t = first(t)
        t = remat.recompute(second, t, policy=POLICIES[inner] if inner else None)
        return t.cos()

    leaves = [x, *first.parameters(), *second.parameters()]
    plain = run_step(lambda: second(first(x)).cos(), leaves)
    got = run_step(lambda: remat.recompute(body, x, policy=POLICIES[outer] if outer else None), leaves)
    assert_same(plain, got)
    again = got[2].counts["recompute"]
    # the outer block's two matmuls run again only when it keeps nothing; the inner's never do
    # when it saves them, and once more each (for the outer's own recompute) otherwise
    assert again["addmm"] == (2 if outer is None else 0) + (0 if inner else 4)


def test_retained_graphs_recompute_again_with_the_kept_outputs() -> None:
    model, x = mlp_case()
    twin = copy.deepcopy(model)
    torch.manual_seed(1)
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    torch.manual_seed(1)
    out = remat.recompute(twin, x, policy=policies.save_matmuls).sum()
    first = torch.autograd.grad(out, [x, *twin.parameters()], retain_graph=True)
    second = torch.autograd.grad(out, [x, *twin.parameters()])
    for a, b, c in zip(expected, first, second, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


# ----------------------------------------------------------------------------- memory
def _kept_after_forward(policy: Any) -> int:
    """Bytes alive after the forward of a 4-layer MLP, beyond its input and output."""
    layers = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)
    with remat.MemoryTracker() as tracker:
        out = remat.recompute(layers, x, policy=policy) if policy != "plain" else layers(x)
        live = tracker.live_bytes
    del out
    return live - 32 * 64 * 4  # the output itself


def test_the_memory_kept_is_what_the_policy_keeps() -> None:
    activation = 32 * 64 * 4
    # tanh keeps its output (the next layer's input too); a product's output is not needed
    assert _kept_after_forward("plain") == 3 * activation
    assert _kept_after_forward(policies.save_nothing) == 0
    # the four products' outputs: more than plain autograd keeps for this network
    assert _kept_after_forward(policies.save_matmuls) == 4 * activation
    assert _kept_after_forward(policies.recompute_ops(torch.ops.aten.tanh)) == 4 * activation


@pytest.mark.parametrize("case", ["mlp", "attention"])
def test_the_peak_matches_torch_selective_checkpointing_at_equal_policy(case: str) -> None:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from remat.manual._selective import unnumbered

    model, x = CASES[case]()
    policy = policies.save_matmuls

    def same_decisions(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if unnumbered(op):  # remat never keeps views and in-place outputs
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy[policy(op, *args, **kwargs).name]

    runs = {
        "remat": lambda: remat.recompute(model, x, policy=policy),
        "torch": lambda: checkpoint(
            model,
            x,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(same_decisions),
        ),
    }
    peaks = {}
    for name, run in runs.items():
        torch.manual_seed(0)
        with remat.MemoryTracker() as tracker:
            out = run()
            out.sum().backward()
            del out
        peaks[name] = tracker.peak_bytes
    assert peaks["remat"] == peaks["torch"]


# NOTE [keeping only what the recompute reads]
class WrittenOutGelu(nn.Module):
    """A GELU written out (as GPT-2's), then a softmax: most outputs are read only by kept ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))
        return y.softmax(-1)


def _peak_and_step(run: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> tuple[int, Any]:
    torch.manual_seed(0)
    with remat.MemoryTracker() as tracker:
        result = run_step(run, leaves)
    return tracker.peak_bytes, result


def test_outputs_the_recompute_never_reads_are_let_go_and_not_run_again() -> None:
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    block, x = WrittenOutGelu(), torch.randn(64, 256, requires_grad=True)
    policy = policies.recompute_ops("softmax")

    def same_decisions(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE if op.is_view else CheckpointPolicy[policy(op, *args, **kwargs).name]

    def torch_selective() -> torch.Tensor:
        contexts = lambda: create_selective_checkpoint_contexts(same_decisions)  # noqa: E731
        return checkpoint(block, x, use_reentrant=False, context_fn=contexts)

    plain_peak, plain = _peak_and_step(lambda: block(x), [x])
    remat_peak, got = _peak_and_step(lambda: remat.recompute(block, x, policy=policy), [x])
    torch_peak, theirs = _peak_and_step(torch_selective, [x])
    assert_same(plain, got)
    assert_same(plain, theirs)
    # torch keeps every output the policy names, more than plain autograd saves; remat keeps
    # those autograd saves and the softmax's input, which its recompute reads
    activation = x.numel() * x.element_size()
    assert torch_peak > plain_peak + activation
    assert remat_peak == plain_peak + activation
    again = got[2].counts["recompute"]
    assert again["_softmax"] == 1 and again["pow"] == 0 and again["tanh"] == 0 and again["mul"] == 0


def test_a_storage_freed_in_the_forward_does_not_count_as_read_when_its_address_comes_back() -> None:
    from remat.manual._selective import internal
    from remat.manual._tensors import storage_key

    addresses: dict[str, int] = {}

    def block(x: torch.Tensor) -> torch.Tensor:
        t = x + 1  # recomputed, and read by the recomputed product below...
        u = t * 2
        with internal():  # (the test's own look at the storage is no read of its data)
            addresses.setdefault("read", storage_key(t))  # in the first forward
        del t  # ...then freed: the allocator hands the same address to the next output
        v = torch.neg(u)  # kept, read only by kept operations: let go
        with internal():
            addresses.setdefault("kept", storage_key(v))
        return (v - 1).exp().sum()  # autograd saves the exponential alone

    def forward(recomputed: bool) -> tuple[torch.Tensor, int]:
        with remat.MemoryTracker() as tracker:
            out = remat.recompute(block, x, policy=policies.recompute_ops("add", "mul")) if recomputed else block(x)
            return out, tracker.live_bytes

    x = torch.randn(1 << 14, requires_grad=True)
    plain = run_step(lambda: forward(False)[0], [x])
    plain_live = forward(False)[1]
    reused = 0
    for _ in range(200):  # whether the allocator hands the address back depends on its state
        addresses.clear()
        remat_live = forward(True)[1]
        reused += addresses["read"] == addresses["kept"]
        assert remat_live == plain_live  # the exponential alone, as plain autograd
        if reused == 3:
            break
    assert reused  # the case under test did happen
    assert_same(plain, run_step(lambda: forward(True)[0], [x]))


def test_letting_go_looks_at_each_kept_output_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.manual import _kept

    looked = Counter[str]()
    tensors = _kept._Kept.tensors

    def counted(self: Any) -> list[torch.Tensor]:
        looked["tensors"] += 1
        return tensors(self)

    monkeypatch.setattr(_kept._Kept, "tensors", counted)

    def inner(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 1.5 + 0.1).softmax(-1)

    def outer(x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):  # policy blocks under one root: each seals while the others are kept
            x = remat.recompute(inner, x, policy=policies.recompute_ops("softmax"))
        return x

    def looks(n: int) -> int:
        looked.clear()
        x = torch.randn(4, 8, requires_grad=True)
        remat.recompute(outer, x, n).sum().backward()
        return looked["tensors"]

    assert looks(40) < 2.5 * looks(20)  # linear in the blocks (each block's seal looked at all: x4)


class Dropped(nn.Module):
    """A mask made in place (F.dropout on the CPU: empty_like, bernoulli_, div_), then a softmax."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x), 0.3, True).softmax(-1)


@pytest.mark.parametrize(
    ("policy", "drawn_again"),
    [(policies.recompute_ops("softmax"), 0), (policies.recompute_ops("softmax", "bernoulli_"), 1)],
)
def test_a_mask_filled_in_place_is_kept_unless_the_policy_names_the_fill(policy: Any, drawn_again: int) -> None:
    # NOTE [outputs filled in place]
    block, x = Dropped(), torch.randn(16, 32, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    generator_after = torch.get_rng_state()
    got = run_step(lambda: remat.recompute(block, x, policy=policy), [x])
    assert_same(plain, got)
    assert torch.equal(torch.get_rng_state(), generator_after)
    again = got[2].counts["recompute"]
    assert again["bernoulli_"] == drawn_again and again["div_"] == drawn_again and again["_softmax"] == 1


def test_a_random_operation_run_again_after_a_kept_fill_draws_what_the_forward_drew() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        mask = torch.empty_like(x).bernoulli_(0.5)  # kept, filled: not drawn again
        noise = torch.randn_like(x)  # drawn again, after the skipped fill
        return (x * mask + x * noise).softmax(-1)

    x = torch.randn(8, 8, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    got = run_step(lambda: remat.recompute(block, x, policy=policies.recompute_ops("randn_like", "softmax")), [x])
    assert_same(plain, got)
    again = got[2].counts["recompute"]
    assert again["bernoulli_"] == 0 and again["randn_like"] == 1


def test_what_a_fill_reads_is_kept_when_the_filled_output_runs_again() -> None:
    def block(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        k = c * 3  # kept, and read only by the fill below
        e = torch.empty_like(c).uniform_()
        e.mul_(k)  # taken into the entry of e...
        r = e + x  # ...which is read (a recomputed addition)...
        e.mul_(2)  # ...then written: its entry goes, and its operations, the fills included, run again
        return (r * e).softmax(-1)

    x, c = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6)
    plain = run_step(lambda: block(x, c), [x])
    got = run_step(lambda: remat.recompute(block, x, c, policy=policies.recompute_ops("add", "softmax")), [x])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["uniform_"] == 1


def test_a_fill_that_changes_the_layout_is_not_taken_in() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        e = torch.empty_like(x).uniform_()  # taken in...
        e.t_()  # ...but this one changes e's strides, which a served value would not have
        return (e * x).softmax(-1)

    x = torch.randn(6, 6, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    assert_same(plain, run_step(lambda: remat.recompute(block, x, policy=policies.recompute_ops("softmax")), [x]))


class Stashing(nn.Module):
    """Keeps an intermediate on itself; the caller changes it in place after the forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 2  # read only by the kept product below
        self.stash = a * 3  # held outside remat: its operation may run again, and read `a`
        return self.stash + x.sin()


def test_an_output_held_outside_remat_is_kept_and_what_it_reads_too() -> None:
    block, x = Stashing(), torch.randn(8, 8, requires_grad=True)
    policy = policies.recompute_ops("sin")

    def forward(recomputed: bool) -> torch.Tensor:
        out = remat.recompute(block, x, policy=policy) if recomputed else block(x)
        block.stash.add_(1)  # changed in place: the recompute makes it again from `a`
        return out

    plain = run_step(lambda: forward(False), [x])
    got = run_step(lambda: forward(True), [x])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["mul"] == 1  # the product alone, from the kept `a`


def test_what_an_output_changed_in_the_forward_is_made_from_is_kept() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        a = x * 0.5  # read only by the kept product below...
        b = a * 1.5
        c = b * 2  # (a read: a change of b from now on is not a fill, NOTE [outputs filled in place])
        b.add_(x)  # ...which is changed in place, so the recompute makes it again from `a`
        return (b + c).softmax(-1)

    x = torch.randn(6, 6, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    got = run_step(lambda: remat.recompute(block, x, policy=policies.recompute_ops("softmax")), [x])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["mul"] == 1 and got[2].counts["recompute"]["add_"] == 1


def test_a_skipped_random_operation_leaves_the_generator_where_the_forward_did() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        coins = torch.bernoulli(torch.full_like(x, 0.5))  # kept, read only by the kept sum: skipped
        s = (x + coins).softmax(-1)  # recomputed: reads the sum
        return s * torch.normal(s, 1.0)  # recomputed: must draw the numbers of the first forward

    x = torch.randn(6, 6, requires_grad=True)
    plain = run_step(lambda: block(x), [x])
    got = run_step(lambda: remat.recompute(block, x, policy=policies.recompute_ops("softmax", "normal")), [x])
    assert_same(plain, got)
    again = got[2].counts["recompute"]
    assert again["bernoulli"] == 0 and again["normal"] == 1


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_storage_references_count_the_tensors_that_share_it(fake: bool) -> None:
    # what lets remat tell that nothing outside it holds a kept output
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.manual._kept import _storage_uses
    from remat.manual._tensors import storage_key

    with FakeTensorMode() if fake else contextlib.nullcontext():
        base = torch.randn(4, 4)
        key = storage_key(base)
        assert _storage_uses(key) == 1
        views = [base.detach(), base[1:], base.t()]
        assert _storage_uses(key) == 4
        del views
        assert _storage_uses(key) == 1


def test_a_recompute_that_reads_a_skipped_output_is_refused() -> None:
    def block(x: torch.Tensor) -> torch.Tensor:
        cube = x.pow(3)  # read only by the kept sum in the first forward: skipped
        total = cube + x
        if remat.is_recomputing():
            with torch.no_grad():
                cube.max()  # code that reads it in the recompute only
        return total.softmax(-1)

    x = torch.randn(4, 4, requires_grad=True)
    out = remat.recompute(block, x, policy=policies.recompute_ops("softmax"))
    with pytest.raises(remat.NondeterministicRecompute, match="keeping only what the recompute reads"):
        out.sum().backward()


# ----------------------------------------------------------------------------- explain and residuals
def test_explain_lists_each_operation_with_what_becomes_of_its_output() -> None:
    model, x = mlp_case()
    before = [p.detach().clone() for p in model.parameters()]
    state = torch.get_rng_state()
    explanation = remat.explain(model, x, policy=policies.save_matmuls)
    forward = {(o.op, o.status) for o in explanation.forward()}
    assert ("aten.addmm.default", "kept") in forward
    assert ("aten.mul.Tensor", "recomputed") in forward  # dropout's output, the next layer's input
    gelu = next(o for o in explanation.forward() if o.op == "aten.gelu.default")
    assert gelu.status == "freed" and gelu.reruns == 1  # no backward needs it, the recompute does
    assert explanation.counts("recompute")["addmm"] == 0
    assert explanation.counts("recompute", status="served")["addmm"] == 2
    assert explanation.counts("recompute")["gelu"] == 1
    totals = explanation.totals
    assert totals["kept_bytes"] == 4 * 32 * 4 + 4 * 16 * 4
    assert totals["recomputed_ops"] > 0 and totals["gradient_ops"] > 0
    json.dumps(explanation.to_dict())
    text = str(explanation)
    assert "addmm" in text and "kept by the policy" in text
    # nothing is left behind: gradients, parameters, the generator
    assert all(p.grad is None for p in model.parameters()) and x.grad is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert torch.equal(state, torch.get_rng_state())


def test_explain_of_a_plain_model_shows_what_autograd_saves() -> None:
    model, x = mlp_case()
    explanation = remat.explain(model, x)
    statuses = Counter(o.status for o in explanation.forward())
    assert statuses["saved"] > 0 and statuses["recomputed"] == 0 and statuses["kept"] == 0
    assert explanation.totals["recomputed_ops"] == 0


def test_explain_of_a_marked_model_shows_the_recomputed_block() -> None:
    model = nn.Sequential(MLP(), MLP())
    remat.mark(model[1], policy=policies.recompute_ops("gelu"))
    explanation = remat.explain(model, torch.randn(4, 16, requires_grad=True))
    again = explanation.counts("recompute")
    assert again["gelu"] == 1 and again["addmm"] == 0


def test_saved_residuals_reports_per_policy() -> None:
    model, x = mlp_case()
    plain = remat.saved_residuals(model, x)
    whole = remat.saved_residuals(model, x, policy=None)
    matmuls = remat.saved_residuals(model, x, policy=policies.save_matmuls)

    def activation_bytes(saved: list[remat.SavedTensor]) -> int:
        return sum(s.nbytes for s in saved if s.kind == "activation" and not s.shared)

    assert activation_bytes(whole) == 0 and [s.kind for s in whole] == ["input"]
    assert activation_bytes(matmuls) == 4 * 32 * 4 + 4 * 16 * 4
    assert {s.module for s in matmuls if s.kind == "activation"} == {"fc1", "fc2"}
    assert activation_bytes(plain) > activation_bytes(matmuls)


# ----------------------------------------------------------------------------- automatic mode
def test_enable_with_a_policy_recomputes_every_stage_under_it() -> None:
    model = remat.models.gpt2(vocab_size=50, n_positions=16, d_model=32, n_heads=2, n_layers=3, dropout=0.1)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (2, 16))
    plain = run_step(lambda: model(tokens), list(model.parameters()))
    remat.enable(twin, policy=policies.recompute_ops("gelu"))
    got = run_step(lambda: twin(tokens), list(twin.parameters()))
    assert_same(plain, got)
    assert got[2].counts["recompute"]["gelu"] == 3
    assert got[2].counts["recompute"]["addmm"] == 0 and got[2].counts["recompute"]["bmm"] == 0


def test_enable_with_a_policy_per_stage() -> None:
    model = nn.Sequential(MLP(), MLP(), MLP())
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16, requires_grad=True)
    plain = run_step(lambda: model(x), [x, *model.parameters()])
    remat.enable(twin, policy={"1": policies.save_matmuls, 2: None})
    got = run_step(lambda: twin(x), [x, *twin.parameters()])
    assert_same(plain, got)
    assert got[2].counts["recompute"]["gelu"] == 1 and got[2].counts["recompute"]["addmm"] == 0


def test_enable_refuses_what_it_cannot_do_with_a_policy() -> None:
    with pytest.raises(NotImplementedError, match="budget with a mapping"):
        remat.enable(nn.Sequential(MLP(), MLP()), 0.5, policy={"0": policies.save_matmuls})
    model = nn.Sequential(MLP(), MLP())
    remat.enable(model, policy={"nope": policies.save_matmuls})
    with pytest.raises(RematError, match="not in the model's chain"):
        model(torch.randn(4, 16, requires_grad=True))
    assert not any("_call_impl" in m.__dict__ for m in model.modules() if m is not model)


def test_a_kept_output_changed_by_the_code_around_a_nested_block_is_computed_again() -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def outer(x: torch.Tensor) -> torch.Tensor:
        y = remat.recompute(torch.mm, x, w, policy=policies.save_matmuls)
        y.add_(1)  # the outer block changes the inner one's kept output, then lets it go
        return y.sin()

    x = torch.randn(4, 4, requires_grad=True)
    plain = run_step(lambda: torch.mm(x, w).add_(1).sin(), [x, w])
    got = run_step(lambda: remat.recompute(outer, x), [x, w])
    assert_same(plain, got)


# ----------------------------------------------------------------------------- found in review
def test_a_tag_on_a_tensor_changed_in_place_keeps_nothing() -> None:
    def block(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = a @ w
        y.add_(1)
        return remat.tag(y, "y").sin()

    a, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    plain = run_step(lambda: block(a, w), [a, w])
    assert_same(plain, run_step(lambda: remat.recompute(block, a, w, policy=policies.save_names("y")), [a, w]))


def test_a_kept_output_changed_through_a_tensor_sharing_its_storage_is_computed_again() -> None:
    linear = nn.Linear(4, 4, bias=False)  # on a 3-d input: mm, then _unsafe_view of its storage
    x = torch.randn(2, 3, 4, requires_grad=True)

    def block(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = linear(t)
        return h, torch.tanh(h)

    def step(recomputed: bool) -> torch.Tensor:
        h, s = remat.recompute(block, x, policy=policies.save_matmuls) if recomputed else block(x)
        h += 1.0
        return h.exp() + s

    assert_same(run_step(lambda: step(False), [x, linear.weight]), run_step(lambda: step(True), [x, linear.weight]))


def test_autocast_casts_taken_from_its_cache_do_not_shift_the_numbering() -> None:
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    x = torch.randn(4, 16, requires_grad=True)

    def step(recomputed: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for _ in range(2):  # the second call finds the weights' casts in autocast's cache
                h = h + (remat.recompute(block, h, policy=policies.save_matmuls) if recomputed else block(h))
            return h.float()

    leaves = [x, *block.parameters()]
    assert_same(run_step(lambda: step(False), leaves), run_step(lambda: step(True), leaves))


def test_code_guarded_by_is_recomputing_under_no_grad_is_left_out_of_the_numbering() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(6, 8, requires_grad=True)
    norms: list[float] = []

    def block(t: torch.Tensor) -> torch.Tensor:
        h = t @ w
        if not remat.is_recomputing():
            with torch.no_grad():
                norms.append((h * h).mean().item())
        return (h * 2).tanh()

    plain = run_step(lambda: block(x), [x, w])
    assert_same(plain, run_step(lambda: remat.recompute(block, x, policy=policies.save_ops("mul")), [x, w]))


def test_a_recompute_that_runs_other_operations_raises() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(6, 8, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        h = t @ w
        if not remat.is_recomputing():
            h = h * 1.0  # with grad: a side effect that changes the operations the recompute sees
        return (h * 2).tanh().exp()

    out = remat.recompute(block, x, policy=policies.save_ops("mul"))
    with pytest.raises(remat.NondeterministicRecompute, match="must run the same operations"):
        out.sum().backward()


def test_policies_run_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        linear = nn.Linear(16, 16)
        x = torch.randn(8, 16, requires_grad=True)
        remat.recompute(lambda t: torch.tanh(linear(t)), x, policy=policies.save_matmuls).sum().backward()
        assert linear.weight.grad is not None


def test_marked_blocks_with_a_policy_in_the_code_between_planned_stages() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.linear(x))

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(8))
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    model = Loop()
    twin = copy.deepcopy(model)
    for index, block in enumerate(twin.blocks):  # even blocks run between stages, odd ones hold stages
        remat.mark(block if index % 2 == 0 else block.linear, policy=policies.save_matmuls)
    remat.enable(twin, 0.75, measure="plain")
    x = torch.randn(256, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kept outputs are measured as kept for backward, not as state
        got = run_step(lambda: twin(x), list(twin.parameters()))
    assert_same(run_step(lambda: model(x), list(model.parameters())), got)


def test_explain_gives_no_tensor_a_gradient() -> None:
    embedding = nn.Linear(8, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU())
    remat.explain(model, embedding(torch.randn(4, 8)), policy=policies.save_matmuls)
    remat.explain(lambda t: model(t), torch.randn(4, 16, requires_grad=True), policy=policies.save_matmuls)
    assert embedding.weight.grad is None and all(p.grad is None for p in model.parameters())


def test_comm_takes_recompute_or_save_and_save_needs_the_hook_based_implementation() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(remat.RematError, match=r"comm must be one of \['recompute', 'save'\], got 'keep'"):
        remat.recompute(torch.tanh, x, comm="keep")
    with pytest.raises(remat.RematError, match="comm='save' needs the hook-based implementation"):
        remat.recompute(torch.tanh, x, comm="save", use_reentrant=True)
    # without collectives in the block, comm="save" changes nothing
    expected = torch.autograd.grad(torch.tanh(x * 2).sum(), x)
    found = torch.autograd.grad(remat.recompute(lambda t: torch.tanh(t * 2), x, comm="save").sum(), x)
    assert torch.equal(found[0], expected[0])


def test_save_collectives_keeps_the_functional_collectives_only() -> None:
    policy = remat.policies.save_collectives
    assert repr(policy) == "remat.policies.save_collectives"
    if not torch.distributed.is_available():
        pytest.skip("torch built without torch.distributed")
    from torch.distributed import _functional_collectives  # noqa: F401 - registers the operations

    functional = torch.ops._c10d_functional
    assert policy(functional.all_reduce.default) is remat.policies.Decision.MUST_SAVE
    assert policy(functional.all_gather_into_tensor.default) is remat.policies.Decision.MUST_SAVE
    assert policy(functional.wait_tensor.default) is remat.policies.Decision.PREFER_RECOMPUTE
    assert policy(torch.ops.aten.mm.default) is remat.policies.Decision.PREFER_RECOMPUTE


# ----------------------------------------------------------------------------- random blocks, random decisions
_STEPS = (
    "mul",
    "add",
    "sin",
    "tanh",
    "pow",
    "softmax",
    "matmul",
    "scale",
    "sigmoid",
    "transpose",
    "add_",
    "stash",
    "dropout",
    "fill",
    "fill_after_read",
    "fill_through_view",
)


_FILLS = ("dropout", "fill", "fill_after_read", "fill_through_view")


def _filled(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Steps that fill a fresh tensor in place (NOTE [outputs filled in place])."""
    if name == "dropout":
        return F.dropout(a, 0.5, True)  # on the CPU: empty_like, bernoulli_, div_
    if name == "fill":
        out = torch.empty_like(a).uniform_()
        out.mul_(b)  # a fill that reads another value
        return out * a
    if name == "fill_after_read":
        out = torch.empty_like(a).normal_()
        read = out * a
        out.add_(b)  # written after a read: not taken in
        return out + read
    out = torch.empty_like(a).bernoulli_(0.5)
    out.t().mul_(b)  # through views, of all of it and of a part
    out[1:].add_(1)
    return out * a


def _random_block(steps: list[tuple[str, int, int]], holder: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A block of `steps`, each an operation on one or two earlier values (by position)."""

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        values = [x]
        for name, i, j in steps:
            a, b = values[i % len(values)], values[j % len(values)]
            if name == "mul":
                out = a * b
            elif name == "add":
                out = a + b
            elif name == "pow":
                out = a.pow(3)
            elif name == "softmax":
                out = a.softmax(-1)
            elif name == "matmul":
                out = a @ w
            elif name == "scale":
                out = a * 0.5
            elif name == "transpose":
                out = a.t()
            elif name == "add_":
                out = a * 1.5
                out.add_(b)  # changed in place after it was made
            elif name == "stash":
                out = a * 2
                holder["stash"] = out  # held outside the block
            elif name in _FILLS:
                out = _filled(name, a, b)
            else:
                out = getattr(torch, name)(a)
            values.append(out)
        return sum(v.sum(0) for v in values[-3:])

    return block


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    steps=st.lists(st.tuples(st.sampled_from(_STEPS), st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=12),
    keep=st.lists(st.booleans(), min_size=40, max_size=40),
    change_stash=st.booleans(),
)
def test_random_blocks_under_random_decisions_give_plain_gradients(
    steps: list[tuple[str, int, int]], keep: list[bool], change_stash: bool
) -> None:
    # NOTE [keeping only what the recompute reads]: whatever is kept, let go or skipped,
    # the gradients are those of plain autograd, and no recompute reads a placeholder
    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)

    def decisions() -> Callable[..., bool]:
        count = iter(range(10**6))
        return lambda op, *args, **kwargs: keep[next(count) % len(keep)]

    def forward(recomputed: bool) -> torch.Tensor:
        holder: dict[str, torch.Tensor] = {}
        block = _random_block(steps, holder)
        out = remat.recompute(block, x, w, policy=decisions()) if recomputed else block(x, w)
        if change_stash and "stash" in holder:
            holder["stash"].mul_(3)
        return out

    try:
        plain = run_step(lambda: forward(False), [x, w])
    except RuntimeError:  # the in-place change broke plain autograd itself
        reject()
    generator_after = torch.get_rng_state()
    assert_same(plain, run_step(lambda: forward(True), [x, w]))
    assert torch.equal(torch.get_rng_state(), generator_after)  # the draws go on as without recompute


@pytest.mark.parametrize(
    "policy",
    [
        policies.save_matmuls,
        policies.save_ops(torch.ops.aten.mm, torch.ops.aten.addmm.default, "gelu"),
        policies.offload_ops("aten.mm"),
        policies.recompute_ops(torch.nn.functional.gelu, "aten::softmax"),
        policies.either(policies.save_names("a"), policies.save_ops("aten.bmm.default")),
    ],
    ids=["save_matmuls", "save_ops", "offload_ops", "recompute_ops", "either"],
)
def test_policies_naming_aten_operations_pickle_and_mark_modules_that_save(policy: Any) -> None:
    # ATen operations do not pickle; policies give them by qualified name
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and repr(again) == repr(policy)
    torch.manual_seed(0)
    block = remat.mark(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), policy=policy)
    buffer = io.BytesIO()
    torch.save(block, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 8, requires_grad=True)
    grads = []
    for module in (block, loaded):
        module.zero_grad()
        module(x).square().sum().backward()
        grads.append([p.grad.clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
