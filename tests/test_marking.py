"""remat.mark / unmark / is_marked / apply: what marking changes (how forward runs) and what it keeps."""

from __future__ import annotations

import copy
import io
import pickle
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import NotCallableBlock, RematError

pytestmark = pytest.mark.usefixtures("clean_remat_state")


class Counted(nn.Module):
    """Counts its forward calls (defined at module level so that it pickles).

    The count lives in a list: remat replays a module's plain attributes as state (a
    recompute sees and leaves the value of the original forward), not its containers.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.runs: list[None] = []

    @property
    def calls(self) -> int:
        return len(self.runs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs.append(None)
        return self.inner(x)


class OpCounter(TorchDispatchMode):
    """Counts the aten operators that run (to see what a single-op module recomputes)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def blocks_model() -> nn.Sequential:
    return nn.Sequential(
        Counted(nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))),
        nn.ReLU(),
        Counted(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Dropout(0.2), nn.Linear(12, 6))),
        nn.Linear(6, 2),
    )


def grads_after_step(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_same_step(reference: nn.Module, marked: nn.Module, x: torch.Tensor) -> None:
    out_a, grads_a = grads_after_step(reference, x)
    out_b, grads_b = grads_after_step(marked, x)
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


# ----------------------------------------------------------------------------- mark / unmark
def test_mark_block_recomputes_it_exactly(use_reentrant: bool) -> None:
    reference = blocks_model()
    model = copy.deepcopy(reference)
    assert remat.mark(model[0], use_reentrant=use_reentrant) is model[0]
    remat.mark(model[2], use_reentrant=use_reentrant)
    assert remat.is_marked(model[0]) and remat.is_marked(model[2]) and not remat.is_marked(model[1])
    assert_same_step(reference, model, torch.randn(4, 6))
    assert (model[0].calls, model[2].calls) == (2, 2)  # forward + recompute
    assert (reference[0].calls, reference[2].calls) == (1, 1)


def test_unmark_restores_plain_forward() -> None:
    model = blocks_model()
    remat.mark(model[0])
    assert remat.unmark(model[0]) is model[0]
    assert not remat.is_marked(model[0]) and "forward" not in model[0].__dict__
    model(torch.randn(3, 6)).sum().backward()
    assert model[0].calls == 1
    remat.unmark(model[0])  # unmarking an unmarked module does nothing
    assert not remat.is_marked(model[0])


def test_marking_again_replaces_the_options() -> None:
    block = Counted(nn.Linear(3, 3))
    remat.mark(block, use_reentrant=True)
    remat.mark(block, use_reentrant=False)
    x = torch.randn(2, 3, requires_grad=True)
    # only the hook-based mode supports torch.autograd.grad: the new options are in force
    torch.autograd.grad(block(x).sum(), x)
    assert block.calls == 2
    remat.unmark(block)
    assert not remat.is_marked(block) and "forward" not in block.__dict__


def test_instance_forward_is_kept_and_restored() -> None:
    block = nn.Linear(3, 3)
    block.forward = lambda x: nn.Linear.forward(block, x) * 2  # a user's own instance forward
    own = block.forward
    x = torch.randn(2, 3)
    expected = block(x)
    remat.mark(block)
    assert torch.equal(block(x), expected)
    remat.mark(block, preserve_rng_state=False)
    remat.unmark(block)
    assert block.forward is own


@pytest.mark.parametrize(
    ("module", "op", "saves_its_output"),
    [
        (nn.ReLU(), "relu", True),
        (nn.Tanh(), "tanh", True),
        (nn.GELU(), "gelu", False),
        (nn.Linear(5, 5), "addmm", False),
    ],
    ids=["relu", "tanh", "gelu", "linear"],
)
def test_single_op_modules(use_reentrant: bool, module: nn.Module, op: str, saves_its_output: bool) -> None:
    x = torch.randn(4, 5, requires_grad=True)
    counters = {}
    results = {}
    for marked in (False, True):
        m = copy.deepcopy(module)
        if marked:
            remat.mark(m, use_reentrant=use_reentrant)
        x.grad = None
        with OpCounter() as counter:
            out = m(x)
            (out * out).sum().backward()
        counters[marked] = counter.counts[op]
        results[marked] = (out.detach(), x.grad.clone(), [p.grad.clone() for p in m.parameters()])
    # The reentrant mode runs the op again. The hook-based one stops a recompute as soon as
    # the last tensor backward needs is saved: an op that saves its output runs again,
    # one that saves only its inputs (GELU, Linear) saves them before it computes
    # anything, so it does not run again at all.
    recomputed = use_reentrant or saves_its_output
    assert counters == {False: 1, True: 2 if recomputed else 1}
    assert torch.equal(results[False][0], results[True][0])
    assert torch.equal(results[False][1], results[True][1])
    assert all(torch.equal(a, b) for a, b in zip(results[False][2], results[True][2]))


def test_mark_rejects_non_modules_and_unknown_options() -> None:
    with pytest.raises(NotCallableBlock, match="recompute"):
        remat.mark(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(RematError, match="use_reentrant"):
        remat.mark(nn.ReLU(), use_reentrant_=True)


def test_marked_module_without_grad_just_runs() -> None:
    block = remat.mark(Counted(nn.Linear(3, 3)))
    with torch.no_grad():
        out = block(torch.randn(2, 3))
    assert not out.requires_grad and block.calls == 1


def test_output_recompute_marking_matches_plain() -> None:
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)])
    model = copy.deepcopy(reference)
    remat.apply(model, lambda name, m: name.count(".") == 0 and name != "", output_recompute=True)
    assert [remat.is_marked(m) for m in model] == [True] * 4
    assert_same_step(reference, model, torch.randn(3, 6, requires_grad=True))


# ----------------------------------------------------------------------------- apply
def test_apply_with_a_class() -> None:
    model = blocks_model()
    assert remat.apply(model, Counted) is model
    assert [remat.is_marked(m) for m in model] == [True, False, True, False]
    assert not any(remat.is_marked(m) for m in model[0].inner.modules())


def test_apply_with_a_tuple_of_classes() -> None:
    model = blocks_model()
    remat.apply(model, (nn.ReLU, nn.GELU, nn.Tanh))
    marked = sorted(name for name, m in model.named_modules() if remat.is_marked(m))
    assert marked == ["0.inner.1", "1", "2.inner.1"]


def test_apply_with_a_predicate_including_the_root() -> None:
    model = blocks_model()
    seen = []

    def where(name: str, module: nn.Module) -> bool:
        seen.append(name)
        return name in ("", "3")

    remat.apply(model, where, use_reentrant=True)
    assert seen == [name for name, _ in model.named_modules()]
    assert remat.is_marked(model) and remat.is_marked(model[3]) and not remat.is_marked(model[0])
    model(torch.randn(2, 6)).sum().backward()
    # the whole model is recomputed, and the marked Linear inside it is just a call there
    assert model[0].calls == 2


def test_apply_rejects_other_where() -> None:
    with pytest.raises(RematError, match="where"):
        remat.apply(blocks_model(), "Linear")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- what marking keeps
def test_parameter_names_and_state_dict_keys_unchanged() -> None:
    model = blocks_model()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict().keys())
    remat.apply(model, (Counted, nn.Linear, nn.ReLU))
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict().keys()) == keys
    plain = blocks_model()
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(plain.state_dict())
    assert_same_step(plain, model, torch.randn(2, 6))


def test_marked_module_deepcopies_still_marked_and_working() -> None:
    model = blocks_model()
    remat.mark(model[0], use_reentrant=True)
    twin = copy.deepcopy(model)
    assert remat.is_marked(twin[0]) and not remat.is_marked(twin[1])
    assert twin[0].forward.module is twin[0]  # bound to the copy, not the original
    assert_same_step(model, twin, torch.randn(3, 6))
    assert twin[0].calls == 2 and model[0].calls == 2


@pytest.mark.parametrize("via", ["pickle", "torch.save"])
def test_marked_module_pickles(via: str) -> None:
    model = blocks_model()
    remat.apply(model, Counted, output_recompute=False, preserve_rng_state=True)
    if via == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert [remat.is_marked(m) for m in loaded] == [True, False, True, False]
    assert loaded[0].forward.module is loaded[0]
    assert loaded[0].forward.options == {"preserve_rng_state": True, "output_recompute": False}
    calls_before = loaded[0].calls
    assert_same_step(model, loaded, torch.randn(3, 6))
    assert loaded[0].calls == calls_before + 2


def test_user_hooks_run_once_per_call_not_in_recompute(use_reentrant: bool) -> None:
    block = Counted(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    calls = Counter()

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        calls["pre"] += 1
        return (args[0] * 3,)

    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        calls["post"] += 1
        return output + 1

    block.register_forward_pre_hook(pre_hook)
    block.register_forward_hook(hook)
    reference = copy.deepcopy(block)
    remat.mark(block, use_reentrant=use_reentrant)
    x = torch.randn(2, 4, requires_grad=True)
    expected = reference(x)
    calls.clear()
    out = block(x)
    assert torch.equal(out, expected)  # both hooks changed the result
    out.sum().backward()
    assert calls == {"pre": 1, "post": 1} and block.calls == 2
    expected.sum().backward()  # x.grad now holds both: they must be two equal halves
    (grad,) = torch.autograd.grad(reference(x).sum(), x)
    assert torch.equal(x.grad, 2 * grad)
