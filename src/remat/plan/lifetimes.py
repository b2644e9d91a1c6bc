"""What the step holds besides the chain's activations, each while it lives.

Planning counts everything held outside the chain's schedule as held through the whole
step: a bound at every moment, and the schedule fits the budget under it. Some of it
lives only part of the step, and :func:`peak_with_lifetimes` follows it along the
schedule for the prediction:

* what a stage's backward leaves behind (the partial gradient of a weight used twice),
  from that backward on;
* from the loss on: what the code after the chain (a head, the loss) still holds when
  the chain's backward starts, and the model output a training loop keeps (measured
  dropped once the loss was computed, it is alive through the loss's own backward);
* the profile charges the chain output's gradient with the peak of the code after the
  chain (``gradient_bytes[-1]``: a head's logits and their gradient, the loss's own),
  from the loss to the last stage's backward; beyond the gradient itself, that lives
  during the loss only, and is taken off afterwards.

(Autocast's weight casts are not followed: see :meth:`remat.plan.step.BudgetSplit.chain_phase_peak_bytes`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.plan.operations import OperationKind
from remat.plan.simulate import SimulationResult

__all__ = ["Lifetimes", "peak_with_lifetimes"]


@dataclass(frozen=True)
class Lifetimes:
    """Bytes planned as living longer than they do.

    Attributes:
        leftover_bytes: per planned stage, what its backward leaves alive.
        from_loss_bytes: alive from the loss on.
        loss_only_bytes: counted by the simulator from the loss to the last stage's
            backward, but alive during the loss only.
    """

    leftover_bytes: Sequence[int] = ()
    from_loss_bytes: int = 0
    loss_only_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """All of it (what planning counts as held through the step)."""
        return sum(self.leftover_bytes) + self.from_loss_bytes


def peak_with_lifetimes(simulation: SimulationResult, lifetimes: Lifetimes) -> int:
    """The chain's simulated peak with what `lifetimes` describes added while it lives."""
    leftovers = lifetimes.leftover_bytes
    last = len(simulation.forward_counts) - 1
    alive = 0
    peak = 0
    for entry in simulation.timeline:
        kind, stage = entry.operation.kind, entry.operation.stage
        if kind is OperationKind.LOSS:
            alive += lifetimes.from_loss_bytes
        peak = max(peak, entry.peak_during_bytes + alive)
        if kind is OperationKind.LOSS:
            alive -= lifetimes.loss_only_bytes  # until the last stage's backward releases it
        elif kind is OperationKind.BACKWARD and stage is not None:
            if stage == last:
                alive += lifetimes.loss_only_bytes
            if leftovers:
                alive += leftovers[stage]
    return peak
