"""How a whole step's budget is shared between the chain and what the step adds."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from remat.manual.offload import offload_time_per_byte_s
from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.plan.simulate import SimulationResult, simulate
from remat.plan.solvers import Solver, store_everything_plan
from remat.plan.step import BudgetSplit, Plan

if TYPE_CHECKING:
    from remat.measure import ChainMeasurement

#: Without a loss_fn, the loss is assumed to hold this many tensors of the output's size.
LOSS_ALLOWANCE_OUTPUTS = 3

#: At most this many more solves look for a faster plan that counts what is held only
#: part of the step where it lives (see :meth:`Planning.solve`).
TIGHTENINGS = 4

#: At most this many shares just above the solver's least are compared for the smallest
#: whole-step budget (NOTE [shares near the minimum]).
NEAR_MINIMUM = 5

# NOTE [shares near the minimum]
# Several schedules may need the solver's least memory, or a few bytes more, and they may
# peak at different moments: one at a replay while a saved shortcut input or a residual's
# gradient lives outside the chain, another where nothing else does. The solver sees only
# the chain. The smallest whole-step budget is taken over the schedules planned within the
# least share and within a few shares above it (1/512 of it more, then 1/256, up to 1/32),
# stopping at the first whose need is the least possible. `Planning.solve` tries the same
# shares when nothing larger fits, so that every budget from that minimum on is planned.

#: Then at most this many solves bisect between the largest share whose plan fitted and
#: the smallest one above it whose plan did not.
BISECTIONS = 4

__all__ = ["LOSS_ALLOWANCE_OUTPUTS", "Planning", "fastest", "offload_option", "prepared", "taken_again"]


class Planning(NamedTuple):
    """A measurement made ready for the solver: the chain's profile and what the step adds.

    Attributes:
        profile: the chain's profile (the loss allowance included).
        margin: the fraction of the budget kept free (NOTE [planning margin]).
        solver: the solver to plan with.
        outside: what is held outside the chain and when, the loss allowance and the peak
            after the chain's backward (a :class:`BudgetSplit` with no budget yet:
            :meth:`split` gives the one of a budget).
        floor_bytes: the least whole-step budget the measuring step itself fits in (its
            timing pass); no smaller budget is planned.
    """

    profile: ChainProfile
    margin: float
    solver: Solver
    outside: BudgetSplit
    floor_bytes: int = 0

    @property
    def held_outside_bytes(self) -> int:
        """Held through the step outside the chain's schedule (as planning counts it)."""
        return self.outside.held_outside_bytes

    @property
    def after_chain_peak_bytes(self) -> int:
        """The step's peak after the chain's backward, whatever the schedule."""
        return self.outside.after_chain_peak_bytes

    def split(self, total_bytes: int) -> BudgetSplit:
        """How a whole-step budget of `total_bytes` is shared out, as planning starts."""
        return dataclasses.replace(
            self.outside,
            total_bytes=total_bytes,
            chain_bytes=self.chain_bytes(total_bytes),
            margin_bytes=total_bytes - int(total_bytes * (1.0 - self.margin)),
        )

    def minimum_total_bytes(self) -> int:
        """The smallest whole-step budget :meth:`solve` plans within.

        It is the one the solver's least-memory schedule fits, with everything counted
        where it lives (:meth:`BudgetSplit.chain_phase_peak_bytes`), and the peak after
        the chain's backward, and at least :attr:`floor_bytes`.
        """
        return max(self.floor_bytes, self._least_total_bytes())

    def _least_total_bytes(self) -> int:
        minimum = self.solver.minimum_bytes(self.profile)
        least = min(total for _, _, total in self.near_minimum())
        # the solver's least peak does not count the gradients waiting for a replay (NOTE
        # [gradients waiting for a replay]): storing everything, or the schedule that counts
        # them (NOTE [least memory with waiting gradients]), may need less
        if not any(self.outside.waiting_gradient_bytes):
            return least
        roomiest = self._roomiest_share(minimum)
        if roomiest is not None:
            least = min(least, self.total_holding(self.solver(self.profile, roomiest).simulation))
        return min(least, self.total_holding(self.waiting_aware().simulation))

    # NOTE [least memory with waiting gradients]
    # The solver does not count the gradients that wait for a replay (NOTE [gradients
    # waiting for a replay] in remat.measure.outside); the prediction adds them. Among the
    # schedules of least chain peak, it may pick one whose replay comes with many of them
    # (LeViT's subsampling attention: 24 KB more than the least whole-step need), and which
    # it picks depends on the stages' times: the least budget named before the stages were
    # timed came out 19% above the one planned after. The solver is also given the profile
    # with each boundary's gradient counting what waits there (alive through the
    # backwards too, so an upper bound), and its least-memory schedule, predicted on the
    # real profile, is one more candidate for the least budget.
    def waiting_aware(self) -> Schedule:
        """The least-memory schedule of a profile whose gradients at each boundary count
        what waits there for a replay (NOTE [least memory with waiting gradients]),
        simulated on the profile itself."""
        waiting = self.outside.waiting_gradient_bytes
        gradients = tuple(g + w for g, w in zip(self.profile.gradient_bytes, waiting, strict=True))
        aware = dataclasses.replace(self.profile, gradient_bytes=gradients)
        planned = self.solver(aware, self.solver.minimum_bytes(aware))
        return Schedule.from_plan(self.profile, planned.items, solver_name=planned.solver_name)

    def near_minimum(self) -> list[tuple[int, Schedule, int]]:
        """``(share, schedule, whole-step budget it needs)`` of the chain's shares that
        :meth:`minimum_total_bytes` compares: the solver's least, then larger ones until a
        schedule's whole-step need is within 1/64 of the least possible (its chain peak,
        the solver's least, at a moment when nothing held part of the step lives), at most
        ``NEAR_MINIMUM`` more (NOTE [shares near the minimum])."""
        minimum = self.solver.minimum_bytes(self.profile)
        through_step = self.held_outside_bytes - self.outside.part_time_bytes
        floor = self.total_holding_bytes(minimum + through_step)
        out: list[tuple[int, Schedule, int]] = []
        for step in range(NEAR_MINIMUM + 1):
            share = minimum + (max(1, minimum >> (NEAR_MINIMUM + 5 - step)) if step else 0)
            schedule = self.solver(self.profile, share)
            out.append((share, schedule, self.total_holding(schedule.simulation)))
            if min(total for _, _, total in out) <= floor + (floor >> 6):
                break  # within 1/64 of the least possible: not worth more solves
        return out

    def _last_tries(self) -> Iterator[tuple[int, Schedule]]:
        """``(share, schedule)``: those of :meth:`near_minimum`, then the least-memory
        schedule that counts the gradients waiting for a replay, if any wait."""
        for share, schedule, _ in self.near_minimum():
            yield share, schedule
        if any(self.outside.waiting_gradient_bytes):
            aware = self.waiting_aware()
            yield aware.predicted_peak_bytes, aware

    def store_all(self) -> SimulationResult:
        """The simulation of the schedule that stores every stage (no recompute)."""
        return simulate(self.profile, store_everything_plan(self.profile.n_stages))

    def _roomiest_share(self, minimum: int) -> int | None:
        """The share that stores everything, if the solver plans within it (`minimum`: the
        least it plans within)."""
        share = self.store_all().peak_bytes
        return share if share >= minimum else None

    def total_holding(self, simulation: SimulationResult) -> int:
        """The smallest whole-step budget that holds a schedule simulated so, everything
        counted where it lives, and the peak after the chain's backward."""
        return self.total_holding_bytes(self.outside.chain_phase_peak_bytes(simulation))

    def total_holding_bytes(self, chain_phase_peak_bytes: int) -> int:
        """The smallest whole-step budget that holds a chain phase peaking at
        `chain_phase_peak_bytes`, and the peak after the chain's backward."""
        needed = max(chain_phase_peak_bytes, self.after_chain_peak_bytes)
        total = math.ceil(needed / (1.0 - self.margin))
        while int(total * (1.0 - self.margin)) < needed:
            total += 1
        return total

    def chain_bytes(self, total_bytes: int) -> int:
        """The chain's share of a whole-step budget of `total_bytes`."""
        # NOTE [planning margin]
        # The plan must fit with a margin for what per-stage measurement cannot attribute
        # (a real loss heavier than the default one measured, autocast's casts): the
        # chain is planned for (1 - margin) of the budget, less the memory held outside
        # it. A model measured with the real loss outside autocast has nothing
        # unattributed (Checkpointable._margin).
        return int(total_bytes * (1.0 - self.margin)) - self.held_outside_bytes

    def solve(self, split: BudgetSplit) -> tuple[Schedule, BudgetSplit]:
        """The fastest schedule found whose predicted whole-step peak fits the budget.

        Planning counts everything held outside the chain as held through the step, and
        so the schedule planned within ``split.chain_bytes`` leaves room for it. Part of
        it lives only part of the step (a kept output from the loss on, a tied weight's
        partial gradient after its backward, autocast's casts), and the model may hold a
        stage's input longer than the schedule would: each candidate is checked against
        the budget with everything counted where it lives. The solver is first given
        the larger share that counts the part-time bytes where they live, and the
        share is lowered by the excess until the schedule fits (at most ``TIGHTENINGS``
        times, then the shares of :meth:`near_minimum` are tried), then bisected between the largest
        share that fitted and the smallest above it that did not (at most
        ``BISECTIONS`` times); the schedule planned within ``split.chain_bytes`` is a
        candidate too. The fastest one that fits is taken.
        The budget must be at least :meth:`minimum_total_bytes`.
        """
        assert split.total_bytes is not None and split.chain_bytes is not None
        minimum = self.solver.minimum_bytes(self.profile)
        limit = split.total_bytes - split.margin_bytes
        best: tuple[Schedule, BudgetSplit] | None = None
        tried: dict[int, int] = {}  # share -> excess

        def attempt(share: int, planned: Schedule | None = None) -> int:
            """The excess of the schedule planned within `share` (`planned`, where it is
            already) over the budget (<= 0: it fits)."""
            nonlocal best
            if planned is None and share in tried:  # (a schedule given is tried whatever its share)
                return tried[share]
            candidate_split = dataclasses.replace(split, chain_bytes=share)
            candidate = planned if planned is not None else self.solver(self.profile, share)
            excess = candidate_split.chain_phase_peak_bytes(candidate.simulation) - limit
            if excess <= 0 and (best is None or candidate.predicted_time_s < best[0].predicted_time_s):
                best = candidate, candidate_split
            tried[share] = excess
            return excess

        if split.chain_bytes >= minimum:
            attempt(split.chain_bytes)  # first: the plain split is kept unless a faster one fits
        share = split.chain_bytes + split.part_time_bytes
        for _ in range(TIGHTENINGS):
            if share < minimum or attempt(share) <= 0:
                break
            share -= tried[share]
        if all(excess > 0 for excess in tried.values()):
            # the last tries: the least memory the solver can plan in, and just above it
            for least, planned in self._last_tries():
                if attempt(least, planned) <= 0:
                    break
        for _ in range(BISECTIONS):
            fitting = max((s for s, excess in tried.items() if excess <= 0), default=None)
            above = [s for s, excess in tried.items() if excess > 0 and fitting is not None and s > fitting]
            if fitting is None or not above or min(above) - fitting <= max(1, fitting // 200):
                break
            attempt((fitting + min(above)) // 2)
        if best is None and any(split.waiting_gradient_bytes):  # the minimum may be storing everything
            roomiest = self._roomiest_share(minimum)
            if roomiest is not None:
                attempt(roomiest)
        if best is None:
            raise ValueError("the budget is below the smallest feasible one (see minimum_total_bytes)")
        return best


def offload_option(offload: Any, *, nested: bool = False) -> bool | float:
    """Checks the ``offload`` option: True, False, or a link speed in bytes per second.

    Raises:
        ValueError: none of those.
        NotImplementedError: offload with nested plans, whose offloaded submodules the
            simulator predicted below the measured peak (up to 14% over the budget).
    """
    if isinstance(offload, bool):
        value: bool | float = offload
    elif isinstance(offload, numbers.Real) and 0 < float(offload) < math.inf:
        value = float(offload)
    else:
        raise ValueError(f"offload is True, False or a link speed in bytes per second (> 0), got {offload!r}")
    if nested and value is not False:
        raise NotImplementedError(
            "offload= with nested=True is not built: a nested plan's offloaded submodules went over the budget "
            "(up to 14%, on every step) where the plan predicted they fit. Use nested=True or offload=, not both"
        )
    return value


def prepared(
    measurement: ChainMeasurement,
    *,
    loss_measured: bool,
    output_kept: bool,
    margin: float,
    solver: Solver,
    offload: bool | float = False,
    take_again: bool = False,
) -> Planning:
    """A measurement made ready for the solver.

    Args:
        measurement: the chain's measurement.
        loss_measured: whether the step was measured with the real loss (the user's
            ``loss_fn``, or the loss a Hugging Face output carries).
        output_kept: whether the training loop keeps the model output through the backward.
        margin: the fraction of the budget kept free.
        solver: the solver to plan with.
        offload: whether the profile gets the link speed to host memory, which lets an
            offloading solver plan offload: True measures it on the measured device, a
            number is that speed in bytes per second (see :func:`offload_option`).
        take_again: plan the glue constants an earlier stage took as its input, or its glue
            made, as taken from its replay, not kept: every region that replays such a glue replays that
            stage too (NOTE [constants an earlier stage takes] in remat.discover.glue).
    """
    profile = measurement.profile
    if take_again:
        profile = dataclasses.replace(profile, glue_spans=measurement.glue_spans())
    if offload is not False:
        device = profile.metadata.get("device", "cpu")
        per_byte = offload_time_per_byte_s(device) if offload is True else 1.0 / offload
        profile = dataclasses.replace(profile, offload_time_per_byte_s=per_byte)
    allowance = 0
    if not loss_measured:
        # NOTE [loss allowance]
        # Measured with the cheapest loss (a sum), the plan would not leave room for a
        # real one: a cross entropy or a mean squared error holds about three tensors
        # of the output's size at its peak, in float32 when the output is in half
        # precision (losses upcast it). Without the user's loss_fn, the chain's output
        # gradient is charged that much more (it is live from the loss to the end of the
        # last stage's backward).
        allowance = LOSS_ALLOWANCE_OUTPUTS * measurement.loss_output_bytes
        gradients = list(profile.gradient_bytes)
        gradients[-1] += allowance
        profile = dataclasses.replace(profile, gradient_bytes=tuple(gradients))
    # The loss was measured with the output dropped once the loss is computed; a loop
    # that keeps it holds it from the loss on (planned as held through the whole step,
    # predicted where it lives: remat.plan.lifetimes).
    kept_output = measurement.output_bytes if output_kept else 0
    outside = measurement.outside_split(kept_output, allowance, take_again)
    return Planning(profile, margin, solver, outside, measurement.timing_pass_bytes)


def taken_again(plan: Plan, measurement: ChainMeasurement | None) -> frozenset[tuple[int, int]]:
    """The ``(stage, glue's stage)`` stage calls of `measurement` (None: those `plan` was made
    with) whose glue takes an earlier stage's input, or what its glue made, from its replay under
    `plan` (NOTE [constants an earlier stage takes] in remat.discover.glue): those its profile's
    glue spans cover."""
    spans = set(plan.schedule.profile.glue_spans)
    if not spans:
        return frozenset()
    group_of = [g for g, (first, stop) in enumerate(plan.groups) for _ in range(first, stop)]
    if measurement is None:  # a pinned plan: the pairs it was made with
        pairs: Any = plan.taken_again_pairs
    else:
        pairs = (pair for taken in measurement.taken_again for pair in taken.pairs)
    return frozenset((s, k) for s, k in pairs if (group_of[s], group_of[k]) in spans)


def fastest(plannings: list[Planning], minima: list[int], total_bytes: int) -> tuple[Schedule, BudgetSplit]:
    """The fastest schedule of the ways to plan one measurement (`minima`: the smallest
    budget of each) within a whole-step budget (at least one of them fits it)."""
    solved = [p.solve(p.split(total_bytes)) for p, least in zip(plannings, minima, strict=True) if least <= total_bytes]
    return min(solved, key=lambda solution: solution[0].predicted_time_s)
