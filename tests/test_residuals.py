"""saved_residuals lists what autograd keeps for backward, with exact sizes and origins."""

import torch
from torch import nn

import remat


def test_lists_each_saved_tensor_with_its_module_and_size() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(5, 8, requires_grad=True)
    saved = remat.saved_residuals(model, x)
    by_module = {}
    for s in saved:
        by_module.setdefault(s.module, []).append(s)
    # Linear 0 keeps its input (x, 5*8*4 bytes) and its weight; ReLU keeps its output
    # (5*32*4 bytes); Linear 2 keeps its input (the ReLU output, shared) and its weight.
    assert [(s.kind, s.nbytes) for s in by_module["0"] if s.kind == "input"] == [("input", 160)]
    assert [(s.kind, s.nbytes, s.shared) for s in by_module["1"]] == [("activation", 640, False)]
    assert any(s.kind == "activation" and s.shared for s in by_module["2"])
    assert all(s.kind == "parameter" for s in saved if s.shape in {(32, 8), (4, 32), (8, 32), (32, 4)})
    text = remat.format_saved_residuals(saved)
    assert "activations kept for backward: 640 B" in text


def test_plain_function_and_no_state_left() -> None:
    x = torch.randn(3, 3, requires_grad=True)
    saved = remat.saved_residuals(lambda a: (a * a).sin(), x)
    assert {s.kind for s in saved} == {"input", "activation"}
    y = (x * x).sum()
    y.backward()  # no hook left behind
    assert torch.equal(x.grad, 2 * x.detach())


def test_no_hook_is_left_behind_even_a_pass_through_one() -> None:
    """After the call, no saved-tensor hook and no global module hook of remat remains."""
    from torch.nn.modules import module as module_hooks

    def global_hooks() -> tuple[int, int]:
        return len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    before = global_hooks()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    saved = remat.saved_residuals(model, x)
    count = len(saved)
    assert count > 0
    assert global_hooks() == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model(x).sum().backward()  # a later step is not recorded into the list returned before
    assert len(saved) == count
    try:  # and an error inside the function leaves nothing behind either
        remat.saved_residuals(lambda a: model(a).undefined_method(), x)
    except AttributeError:
        pass
    assert global_hooks() == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
