"""The automatic mode's plan inside a compiled graph (NOTE [a plan in the compiled graph]).

NOTE [a plan in the compiled graph]
remat's executor runs Python in the backward (it replays regions when their saved tensors
are first used), which a graph cannot hold: a training call of the automatic mode traced
by torch.compile is a graph break, and the plan runs eagerly there. Once that eager call
has measured the input, remat plans it again for compiled calls, with a region break at
every boundary of the chain: each stage is then stored, or recomputed alone from its
input, the form torch's checkpoint operation has. That plan is the fastest of that form
within the same budget, and its prediction is exact for eager execution like any other.
Each stage it recomputes gets a stand-in ``forward`` that, traced, runs the stage
through :func:`remat.recompute`, which hands it to the compiler as torch's checkpoint
operation (remat.manual._compiled); run eagerly, the stand-in is the stage itself. From
the next call on, with the same input shapes, budget and training mode, Dynamo traces
the model's own forward through the stand-ins: no graph break (``fullgraph=True``
works), the partitioner recomputes the planned stages, and the other stages and the
model's code between them are compiled as they are. The first compiled call recompiles
once because of it, and remat says so. The plan is made on eager figures, which the
exact tracker cannot check inside compiled code: inductor may keep less (it fuses), and
the planner benchmark measures compiled steps with the CPU allocator.

It is not used, and compiled calls keep running the eager plan at a graph break, said
once, when: the budget is below the least a plan of that form needs (its minimum is
named), a stage the plan recomputes groups several calls, the controller stores stages
under policies, offloads, runs a pinned plan or recomputes selectively without a budget.
The stand-ins stay on the model until ``remat.disable`` (or a plan for another input or
budget replaces them); they change nothing in eager calls.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.manual.marking import traced_stage, untraced_stage
from remat.plan.step import Plan
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.automatic import Checkpointable

__all__ = ["TracedCalls", "TracedPlan", "input_shapes", "remove_traced_plan", "traced_plan_for"]


@dataclasses.dataclass(frozen=True)
class TracedPlan:
    """A plan for compiled calls: the input it was made for, and the stages it recomputes."""

    key: Hashable
    shapes: tuple[Any, ...]
    mem_limit: Any
    plan: Plan
    modules: tuple[nn.Module, ...]

    def install(self) -> None:
        for module in self.modules:
            module.__dict__["forward"] = traced_stage(module)

    def remove(self) -> None:
        for module in self.modules:
            untraced_stage(module)


@dataclasses.dataclass
class TracedCalls:
    """A controller's plan for compiled calls (None: none), and whether it said why it has none."""

    current: TracedPlan | None = None
    told: bool = False
    tried: Any = None  # the input and budget of the last try

    def runs(self, mem_limit: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a compiled training call with these inputs runs the plan in the graph."""
        current = self.current
        return current is not None and current.mem_limit == mem_limit and current.shapes == input_shapes(args, kwargs)


def input_shapes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a traced call compares with the plan's input: each tensor's shape and dtype."""
    leaves = [*args, *kwargs.values()]
    return tuple((tuple(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor))


def remove_traced_plan(controller: Checkpointable) -> None:
    """Takes the stand-ins of `controller`'s plan for compiled calls off the model."""
    traced = controller._traced.current
    if traced is not None:
        traced.remove()
        controller._traced.current = None


def traced_plan_for(controller: Checkpointable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """After an eager training call under torch.compile: makes and installs the plan for the
    next compiled calls of that input, or says once why there is none (see the NOTE)."""
    key = controller._last_key
    attempt = (key, input_shapes(args, kwargs), controller.mem_limit)
    if controller._traced.tried == attempt:
        return  # planned for these calls already, or said why not
    controller._traced.tried = attempt
    remove_traced_plan(controller)
    why = _not_traceable(controller)
    plan = None
    if why is None:
        plan, why = _one_stage_plan(controller, controller._last_key)
    if plan is not None:
        chain = controller._chains[key]
        recomputed = [stage for stage, count in enumerate(plan.forward_counts) if count > 1]
        several = [chain.names[plan.groups[s][0]] for s in recomputed if plan.groups[s][1] - plan.groups[s][0] > 1]
        if several:
            why = f"the stages that begin with {', '.join(several[:3])} group several calls"
        else:
            modules = tuple(chain.modules[plan.groups[s][0]] for s in recomputed)
            traced = TracedPlan(key, input_shapes(args, kwargs), controller.mem_limit, plan, modules)
            traced.install()
            controller._traced.current = traced
            warnings.warn(
                f"remat: compiled training calls of this input run a plan in the graph from the next call on "
                f"(one recompile): {len(modules)} of {len(plan.forward_counts)} stages recomputed alone, "
                f"predicted peak {format_bytes(plan.predicted_peak_bytes)}, overhead "
                f"+{100 * plan.overhead_fraction:.0f}%",
                UserWarning,
                stacklevel=4,
            )
            return
    if not controller._traced.told:
        controller._traced.told = True
        warnings.warn(
            f"remat: compiled training calls keep running the plan eagerly (a graph break): {why}",
            UserWarning,
            stacklevel=4,
        )


def _not_traceable(controller: Checkpointable) -> str | None:
    if controller._selective is not None or controller._last_key not in controller._measurements:
        return "selective recompute (a policy without a budget) runs as it is"
    if controller.offload is not False:
        return "the plan offloads"
    if controller._policies:
        return "the plan may store stages under policies"
    if controller._forced_plan is not None:
        return "a pinned plan runs as it is"
    return None


def _one_stage_plan(controller: Checkpointable, key: Hashable) -> tuple[Plan | None, str | None]:
    """The fastest plan whose regions are single stages, within the controller's budget."""
    from remat.errors import BudgetTooSmall

    measurement = controller._measurements[key]
    planning = controller._prepared(key)
    n = planning.profile.n_stages
    planning = planning._replace(profile=dataclasses.replace(planning.profile, region_breaks=tuple(range(1, n))))
    total = controller._total_bytes(key, planning, controller.mem_limit)
    minimum = planning.minimum_total_bytes()
    if total < minimum:
        return None, (
            f"the budget {format_bytes(total)} is below the {format_bytes(minimum)} ({minimum} bytes) that a plan "
            "recomputing stages one by one needs"
        )
    try:
        schedule, split = planning.solve(planning.split(total))
    except (ValueError, BudgetTooSmall) as error:
        return None, str(error)
    return Plan(schedule, split, tuple(measurement.groups), measurement.measured_peak_bytes, measurement), None
