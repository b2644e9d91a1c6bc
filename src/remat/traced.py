"""The automatic mode's plan inside a compiled graph (NOTE [a plan in the compiled graph]).

NOTE [a plan in the compiled graph]
remat's executor runs Python in the backward (it replays regions when their saved tensors
are first used), which a graph cannot hold: a training call of the automatic mode traced
by torch.compile is a graph break, and the plan runs eagerly there. Once that eager call
has measured the input, remat plans it again for compiled calls, with a region break at
every boundary of the chain: each stage is then stored, or recomputed alone from its
input, the form torch's checkpoint operation has. That plan is the fastest of that form
within the same budget, and its prediction is exact for eager execution like any other.
Each stage it recomputes gets a stand-in ``forward``. From the next call on, with the same
input shapes, budget, training modes and parameters requiring grad, Dynamo traces the
model's own forward with that plan marked as the one being traced: each stand-in of a
stage it recomputes runs the stage through :func:`remat.recompute`, which hands it to the
compiler as torch's checkpoint operation (remat.manual._compiled), and any other stand-in,
like every stand-in run eagerly, is the stage itself. No graph break (``fullgraph=True``
works), the partitioner recomputes the planned stages, and the other stages and the
model's code between them are compiled as they are. The first compiled call recompiles
once because of it, and remat says so. Plans for several input shapes (or budgets) live
side by side: a batch of another size does not undo the first size's plan. Traced calls
guard on a version of the plans (TracedCalls.version), so each new plan makes the next
call of every shape trace once more. The plan is made on eager figures, which the exact
tracker cannot check inside compiled code: inductor may keep less (it fuses), and the
planner benchmark measures compiled steps with the CPU allocator.

It is not used, and compiled calls keep running the eager plan at a graph break, said
once, when: the budget is below the least a plan of that form needs (its minimum is
named), a stage the plan recomputes groups several calls, the controller stores stages
under policies, offloads, runs a pinned plan or recomputes selectively without a budget,
or ranks agree on one plan (NOTE [one plan for all ranks]: a plan made here would be this
rank's alone, and a rank with a new input would plan alone, out of step with the others).
The stand-ins stay on the model until ``remat.disable``; they change nothing in eager
calls, nor in compiled calls that run no plan of this controller.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.errors import BudgetTooSmall
from remat.manual.marking import traced_stage, untraced_stage
from remat.plan.elementwise import elementwise_stages
from remat.plan.step import Plan
from remat.ranks import agreement_group_active
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.automatic import Checkpointable

__all__ = ["TracedCalls", "TracedPlan", "input_setup", "remove_traced_plans", "traced_plan_for"]


@dataclasses.dataclass(frozen=True)
class TracedPlan:
    """A plan for compiled calls: the input setup and budget it was made for, and the stages it recomputes."""

    setup: tuple[Any, ...]  # (input_setup)
    mem_limit: Any
    plan: Plan
    names: frozenset[str]


@dataclasses.dataclass
class TracedCalls:
    """A controller's plans for compiled calls, by input setup and budget; the one being
    traced (whose stages the stand-ins recompute); the stand-ins; what was tried and said."""

    plans: dict[tuple[Any, Any], TracedPlan] = dataclasses.field(default_factory=dict)
    version: int = 0  # one more at each change of `plans`: what the traced calls guard on
    tracing: TracedPlan | None = None
    stand_ins: dict[str, nn.Module] = dataclasses.field(default_factory=dict)
    tried: set[Any] = dataclasses.field(default_factory=set)
    told: bool = False

    def plan_of(
        self, model: nn.Module, mem_limit: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> TracedPlan | None:
        """The plan a compiled training call with these inputs runs in the graph, if any.

        Traced, the answer holds until ``version`` changes: Dynamo guards on that integer
        (a lookup in ``plans`` alone was not always guarded), so a new plan, or the plans
        taken off, make the next call trace again."""
        if self.version == 0:
            return None
        return self.plans.get((input_setup(model, args, kwargs), mem_limit))

    def run(self, plan: TracedPlan, call: Any) -> Any:
        """`call()` traced with `plan`'s stages recomputed by their stand-ins."""
        self.tracing = plan
        out = call()
        self.tracing = None
        return out


def input_setup(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a traced call compares with the plans' setups: each input tensor's shape and dtype,
    which parameters require grad and the modules' training modes (the parts of the eager plan's
    key, NOTE [what a plan depends on], that change while a compiled model trains: unfreezing
    layers after a warm-up, a submodule put in eval mode)."""
    leaves = tree_flatten((args, kwargs))[0]
    return (
        tuple((tuple(leaf.shape), leaf.dtype) for leaf in leaves if isinstance(leaf, torch.Tensor)),
        tuple(parameter.requires_grad for parameter in model.parameters()),
        tuple(module.training for module in model.modules()),
    )


def remove_traced_plans(controller: Checkpointable) -> None:
    """Takes the stand-ins of `controller`'s plans for compiled calls off the model; forgets the plans."""
    calls = controller._traced
    for module in calls.stand_ins.values():
        untraced_stage(module)
    calls.stand_ins.clear()
    calls.plans.clear()
    calls.tried.clear()
    calls.version += 1


def traced_plan_for(controller: Checkpointable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """After an eager training call under torch.compile: makes the plan for the next compiled
    calls of that input and budget and installs its stand-ins, or says once why there is
    none (see the NOTE)."""
    calls, key, setup = controller._traced, controller._last_key, input_setup(controller.model, args, kwargs)
    attempt = (key, setup, controller.mem_limit)
    if attempt in calls.tried:
        return  # planned for these calls already, or said why not
    calls.tried.add(attempt)
    why = _not_traceable(controller)
    plan = None
    if why is None:
        plan, why = _one_stage_plan(controller, key)
    if plan is not None:
        chain = controller._chains[key]
        recomputed = [stage for stage, count in enumerate(plan.forward_counts) if count > 1]
        several = [chain.names[plan.groups[s][0]] for s in recomputed if plan.groups[s][1] - plan.groups[s][0] > 1]
        if several:
            why = f"the stages that begin with {', '.join(several[:3])} group several calls"
        else:
            names = [chain.names[plan.groups[s][0]] for s in recomputed]
            for name in names:
                if name not in calls.stand_ins:
                    module = chain.modules[chain.names.index(name)]
                    module.__dict__["forward"] = traced_stage(module, calls, name)
                    calls.stand_ins[name] = module
            budget = controller.mem_limit
            calls.plans[(setup, budget)] = TracedPlan(setup, budget, plan, frozenset(names))
            calls.version += 1
            warnings.warn(
                f"remat: compiled training calls of this input run a plan in the graph from the next call on "
                f"(one recompile): {len(names)} of {len(plan.forward_counts)} stages recomputed alone, "
                f"predicted peak {format_bytes(plan.predicted_peak_bytes)}, overhead "
                f"+{100 * plan.overhead_fraction:.0f}%",
                UserWarning,
                stacklevel=4,
            )
            return
    if not calls.told:
        calls.told = True
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
    measurement = controller._measurements[controller._last_key]
    if elementwise_stages(measurement.profile, len(measurement.stages)):
        return "its stages leave elementwise saves to backward (elementwise=True)"
    if controller._forced_plan is not None:
        return "a pinned plan runs as it is"
    if controller._ranks is not None and agreement_group_active():  # (planning here would be one rank's)
        return "under torch.distributed, every training call runs the plan all ranks agreed on"
    return None


def _one_stage_plan(controller: Checkpointable, key: Hashable) -> tuple[Plan | None, str | None]:
    """The fastest plan whose regions are single stages, within the controller's budget."""
    measurement = controller._measurements[key]
    planning = controller._prepare(key, measurement)
    n = planning.profile.n_stages
    planning = planning._replace(profile=dataclasses.replace(planning.profile, region_breaks=tuple(range(1, n))))
    total = controller._total_bytes(key, controller._plannings(key, measurement), controller.mem_limit)
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
