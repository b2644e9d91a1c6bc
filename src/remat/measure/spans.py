"""The spans of stages a frugal measuring step recomputes together (NOTE [frugal spans])."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat.discover.chain import Chain
from remat.discover.intercept import intercept_stages
from remat.errors import UnsupportedModel
from remat.manual._op_kinds import _written
from remat.manual._tensors import storage_key
from remat.measure.instrument import InPlaceProbe

__all__ = ["frugal_spans"]


# NOTE [frugal spans]
# The frugal step (NOTE [frugal measurement]) keeps the input of each span to the end of
# the forward, and while a span is replayed, everything its stages save: it needs about
# the inputs of the spans, plus the most any one span saves. A probe forward, with grad
# and with what autograd saves counted and let go once the stage is done (it holds what
# the running stage saves, no more), tells each stage's input bytes and saved bytes (the
# model's code after a stage counted with it; parameters and buffers left out), and, as it
# watches every operation that writes in place, which stages' inputs are changed in place
# after the stage was called (weakly: it holds no stage's input; a RegNet layer adds in
# place to what its last ``nn.Identity`` stage returned, that stage's input, and lets go of
# it before the next stage runs, so that versions read then would show nothing, and a span
# starting there failed its replay). The spans are chosen to
# make that sum small: for each of a few dozen caps on a span's saved bytes, from the
# largest stage's to the whole chain's, spans are filled greedily up to the cap, and the
# spans that cost least are taken. Stages that save much more than they take (a GPT-2 block saves
# about 40 times its input) get a span each; stages that save about what they take (an
# MLP of single layers) share spans of about sqrt(n), as checkpoint_sequential cuts them.
# On the planner benchmark's GPT-2, one span per block measures in 61 MB, against 186 MB
# with spans of sqrt(n) and 362 MB for a plain step. A span never starts at an in-place
# stage (it would modify the input the span keeps), and a stage whose input the model's
# code changed in place starts one.
def frugal_spans(
    model: nn.Module, chain: Chain, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[int, int]]:
    """Spans of stages for the frugal mode (see the NOTE)."""
    constants = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    probe = InPlaceProbe(chain, constants)
    hooks = torch.autograd.graph.saved_tensors_hooks(probe.pack, _never_unpacked)
    with hooks, intercept_stages(chain, probe), _Writes(probe):
        model(*args, **kwargs)
    if probe.modifies_input[0]:
        raise UnsupportedModel(
            f"the chain's input (the input of its first stage {chain.names[0]!r}) is changed in place "
            "during the forward; the frugal measurement recomputes every stage and cannot keep it. "
            "Measure with measure='plain' (the first stage is then never recomputed), or make "
            "that operation out of place (e.g. nn.ReLU(inplace=False))"
        )
    for index, (in_place, changed) in enumerate(zip(probe.modifies_input, probe.input_changed, strict=True)):
        if in_place and changed:
            raise UnsupportedModel(
                f"stage {chain.names[index]!r} modifies in place an input that the model's code also "
                "changed in place after the stage before returned it; the frugal measurement cannot "
                "recompute around it. Measure with measure='plain', or make one of the two "
                "changes out of place"
            )
    saved, largest = probe.saved_bytes, max(probe.saved_bytes)
    caps, cap = [largest], max(largest, 1)
    while cap < sum(saved):
        cap = math.ceil(cap * 1.25)
        caps.append(cap)

    def filled(limit: int) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        held = 0
        for index, (in_place, changed) in enumerate(zip(probe.modifies_input, probe.input_changed, strict=True)):
            if spans and not changed and (in_place or held + saved[index] <= limit):
                spans[-1] = (spans[-1][0], index + 1)
                held += saved[index]
            else:
                spans.append((index, index + 1))
                held = saved[index]
        return spans

    def cost(spans: list[tuple[int, int]]) -> int:
        kept = sum(probe.input_bytes[start] for start, _ in spans[1:])
        return kept + max(sum(saved[start:stop]) for start, stop in spans)

    return min((filled(limit) for limit in caps), key=cost)


class _Writes(TorchDispatchMode):
    """Tells the probe of every operation that changes tensors in place."""

    def __init__(self, probe: InPlaceProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        if written:
            self.probe.written(written)
        return func(*args, **kwargs)


def _never_unpacked(_: Any) -> torch.Tensor:  # pragma: no cover - the probe runs no backward
    raise RuntimeError("remat's frugal probe keeps nothing for backward")
