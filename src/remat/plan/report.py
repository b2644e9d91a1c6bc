"""A printable report of a planned schedule, in the spirit of ``opt_einsum``'s ``PathInfo``.

``str(PlanReport(schedule))`` (or ``str(schedule)``) shows the budget, the predicted peak
and step time next to storing everything, and a table of what happens to every stage;
:meth:`PlanReport.to_dict` gives the same facts as JSON-able data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from remat.plan.operations import Store, plan_to_data
from remat.plan.simulate import simulate
from remat.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from remat.plan.schedule import Schedule
    from remat.plan.step import BudgetSplit

__all__ = ["PlanReport", "StageRow", "format_bytes", "format_seconds"]


@dataclass(frozen=True)
class StageRow:
    """What a schedule does with one stage.

    Attributes:
        index: the stage index.
        name: the stage name from the profile.
        forward_time_s: seconds of one forward.
        backward_time_s: seconds of one backward.
        output_bytes: bytes of the stage output.
        saved_bytes: bytes the stage keeps for its backward when stored (inputs excluded).
        kept: whether the first forward keeps what the backward needs (never recomputed).
        forward_runs: how many times the forward runs (1 + recomputations; a stage stored
            under a policy runs once more, in part: what the policy does not keep).
        offloaded: whether what it keeps waits in host memory for its backward.
        option: the store option the first forward runs it under (NOTE [stored under a
            policy]); ``saved_bytes`` is then what it keeps under the option.
    """

    index: int
    name: str
    forward_time_s: float
    backward_time_s: float
    output_bytes: int
    saved_bytes: int
    kept: bool
    forward_runs: int
    offloaded: bool = False
    option: str | None = None

    @property
    def decision(self) -> str:
        """``"keep"``, ``"offload"``, ``"recompute"``, or ``"policy: <option>"`` (stored under a policy)."""
        if self.option is not None:
            return f"policy: {self.option}"
        return "offload" if self.offloaded else "keep" if self.kept else "recompute"

    def formatted_figures(self) -> tuple[str, ...]:
        """Index, name, forward and backward times, output and saved bytes, formatted for people."""
        return (
            str(self.index),
            self.name,
            format_seconds(self.forward_time_s),
            format_seconds(self.backward_time_s),
            format_bytes(self.output_bytes),
            format_bytes(self.saved_bytes),
        )


class PlanReport:
    """The facts of a schedule side by side with storing everything.

    Args:
        schedule: the schedule to report on.
        budget: for the plan of a whole training step, how its budget is shared out;
            the report then gives whole-step figures, with the chain's share beside them.
    """

    def __init__(self, schedule: Schedule, *, budget: BudgetSplit | None = None) -> None:
        self.schedule = schedule
        self.budget = budget
        profile = schedule.profile
        self.baseline = simulate(profile, tuple(Store(stage) for stage in range(profile.n_stages)))
        kept = set(schedule.stored_stages)
        offloaded = set(schedule.offloaded_stages)
        options = {item.stage: item.option for item in schedule.items if isinstance(item, Store) and item.option}
        self.rows = tuple(
            StageRow(
                index=index,
                name=profile.names[index],
                forward_time_s=profile.forward_time_s[index],
                backward_time_s=profile.backward_time_s[index],
                output_bytes=profile.activation_bytes[index + 1],
                saved_bytes=profile.saved_bytes[index]
                if index not in options
                else int(profile.store_option(options[index]).saved_bytes[index] or 0),
                kept=index in kept,
                # (stored under a policy, it runs again in its backward: what the policy does not keep)
                forward_runs=schedule.forward_counts[index] + (index in options),
                offloaded=index in offloaded,
                option=options.get(index),
            )
            for index in range(profile.n_stages)
        )

    @property
    def overhead_fraction(self) -> float:
        """Recompute time as a fraction of the step time without recompute (0.25 = +25%)."""
        baseline_s = self.baseline.time_s
        if baseline_s == 0.0:
            return 0.0
        return self.schedule.overhead_s / baseline_s

    @property
    def memory_fraction(self) -> float:
        """The predicted peak as a fraction of the store-everything peak."""
        if self.baseline.peak_bytes == 0:
            return 1.0
        return self.schedule.predicted_peak_bytes / self.baseline.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """Returns the report as JSON-able data (for ``--json`` output)."""
        schedule = self.schedule
        return {
            "solver": schedule.solver_name,
            "n_stages": schedule.profile.n_stages,
            "budget_bytes": schedule.budget_bytes,
            "predicted_peak_bytes": schedule.predicted_peak_bytes,
            "predicted_time_s": schedule.predicted_time_s,
            "overhead_s": schedule.overhead_s,
            "overhead_fraction": self.overhead_fraction,
            "baseline_peak_bytes": self.baseline.peak_bytes,
            "baseline_time_s": self.baseline.time_s,
            "times": schedule.profile.metadata.get("times", "measured"),
            "elementwise_stages": schedule.profile.metadata.get("elementwise_stages"),
            "workspace_bytes": schedule.profile.metadata.get("workspace_bytes", 0),
            "plan": plan_to_data(schedule.items),
            "region_breaks": list(schedule.profile.region_breaks),
            "pinned_stages": list(schedule.profile.pinned_stages),
            "stages": [
                {
                    "index": row.index,
                    "name": row.name,
                    "forward_time_s": row.forward_time_s,
                    "backward_time_s": row.backward_time_s,
                    "output_bytes": row.output_bytes,
                    "saved_bytes": row.saved_bytes,
                    "kept": row.kept,
                    "decision": row.decision,
                    "forward_runs": row.forward_runs,
                }
                for row in self.rows
            ],
        }

    def _under_policies(self) -> str:
        stored = sum(1 for row in self.rows if row.option is not None)
        return f" (and {stored} stored under a policy, run again in part)" if stored else ""

    def __str__(self) -> str:
        schedule = self.schedule
        n_stages = schedule.profile.n_stages
        recomputed = sum(1 for row in self.rows if not row.kept)
        extra_forwards = sum(row.forward_runs - 1 for row in self.rows)
        lines = [f"remat plan: {n_stages} stages, solver {schedule.solver_name!r}"]
        lines += self._memory_lines()
        lines += [
            f"  step time:       {format_seconds(schedule.predicted_time_s)}"
            f"  (storing everything: {format_seconds(self.baseline.time_s)},"
            f" overhead +{_percent(self.overhead_fraction)})",
            f"  recomputed:      {recomputed} of {n_stages} stages{self._under_policies()},"
            f" {extra_forwards} extra forward{'s' if extra_forwards != 1 else ''}",
        ]
        if "times" in schedule.profile.metadata:
            lines.append(f"  stage times:     {schedule.profile.metadata['times']}")
        if "elementwise_stages" in schedule.profile.metadata:  # NOTE [stages that make no recipe]
            calls = _spans(schedule.profile.metadata["elementwise_stages"])
            which = f"stage calls {calls} leave" if calls else "no stage call leaves"
            lines.append(f"  elementwise:     {which} saves to backward")
        if schedule.profile.metadata.get("workspace_bytes"):  # NOTE [device workspaces]
            workspace = format_bytes(schedule.profile.metadata["workspace_bytes"])
            lines.append(f"  workspaces:      up to {workspace} above a stage's tensors (the device's kernels)")
        if schedule.offloaded_stages:
            simulation = schedule.simulation
            lines.append(
                f"  offloaded:       {len(schedule.offloaded_stages)} stages, host memory"
                f" {format_bytes(simulation.host_peak_bytes)}, waiting for copies {format_seconds(simulation.stall_s)}"
            )
        lines.append("")
        header = ("stage", "name", "forward", "backward", "output", "saved", "decision", "runs")
        table = [header] + [(*row.formatted_figures(), row.decision, str(row.forward_runs)) for row in self.rows]
        widths = [max(len(cells[column]) for cells in table) for column in range(len(header))]
        left_aligned = {1, 6}
        for cells in table:
            formatted = [
                cell.ljust(width) if column in left_aligned else cell.rjust(width)
                for column, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ]
            lines.append("  " + "  ".join(formatted).rstrip())
        lines += self._limit_lines()
        return "\n".join(lines)

    def _limit_lines(self) -> list[str]:
        """Where no region may go, and why (see ChainProfile.region_breaks)."""
        profile = self.schedule.profile
        lines = []
        if profile.region_breaks:
            names = ", ".join(f"{k} {profile.names[k]!r}" for k in profile.region_breaks)
            lines.append(
                f"  no region crosses into stages {names}: the model changes their input in place"
                " after the stage before returns it"
            )
        if profile.pinned_stages:
            names = ", ".join(f"{g} {profile.names[g]!r}" for g in profile.pinned_stages)
            lines.append(
                f"  never recomputed: stages {names} (they, or the model's code after them, change in place"
                " a tensor a replay would need as it was)"
            )
        return [""] + lines if lines else []

    def _memory_lines(self) -> list[str]:
        schedule = self.schedule
        if self.budget is None:
            budget = "unlimited" if schedule.budget_bytes is None else format_bytes(schedule.budget_bytes)
            return [
                f"  budget:          {budget}",
                f"  predicted peak:  {format_bytes(schedule.predicted_peak_bytes)}"
                f"  ({_percent(self.memory_fraction)} of storing everything:"
                f" {format_bytes(self.baseline.peak_bytes)})",
            ]
        # A whole step: one budget figure, and how it splits.
        split = self.budget
        outside = split.held_outside_bytes
        total = "unlimited" if split.total_bytes is None else format_bytes(split.total_bytes)
        chain = "unlimited" if split.chain_bytes is None else format_bytes(split.chain_bytes)
        loss = f" ({format_bytes(split.loss_allowance_bytes)} of it for the loss)" if split.loss_allowance_bytes else ""
        # a chain share that counts what is held outside only part of the step where it lives
        overlap = 0
        if split.total_bytes is not None and split.chain_bytes is not None:
            overlap = max(0, split.chain_bytes + outside + split.margin_bytes - split.total_bytes)
        margin = format_bytes(split.margin_bytes)
        if overlap:
            budget_line = (
                f"  budget:          {total}: held outside the chain {format_bytes(outside)} + margin {margin}, "
                f"the rest for the chain; it was planned in {chain}{loss}, what lives only part of the step "
                "counted where it lives"
            )
        else:
            budget_line = (
                f"  budget:          {total} = chain {chain}{loss} + held outside the chain"
                f" {format_bytes(outside)} + margin {margin}"
            )
        after = split.after_chain_peak_bytes
        during = split.chain_phase_peak_bytes(schedule.simulation)
        peak = max(during, after)
        everything = max(split.chain_phase_peak_bytes(self.baseline), after)
        fraction = peak / everything if everything else 1.0
        parts = schedule.predicted_peak_bytes + outside
        sum_of_parts = (
            f"chain {format_bytes(schedule.predicted_peak_bytes)} + held outside the chain {format_bytes(outside)}"
        )
        if parts != during:
            # what lives only part of the step is not all alive at the chain's peak (or the
            # model holds a stage input a while longer than the schedule does)
            change = "less" if parts > during else "more"
            sum_of_parts += f", {change} {format_bytes(abs(parts - during))} by when each lives"
        if after > during:
            # the backward of the code before the chain peaks higher, whatever the schedule
            peak_line = (
                f"  predicted peak:  {format_bytes(peak)} after the chain's backward, at the code before it"
                f" (during the chain: {sum_of_parts})"
            )
        else:
            peak_line = f"  predicted peak:  {format_bytes(peak)} = {sum_of_parts}"
        return [
            f"  whole step: budget {total}, predicted peak {format_bytes(peak)}",
            budget_line,
            f"{peak_line}  ({_percent(fraction)} of storing everything: {format_bytes(everything)})",
        ]

    def __repr__(self) -> str:
        schedule = self.schedule
        return (
            f"PlanReport(solver={schedule.solver_name!r}, n_stages={schedule.profile.n_stages}, "
            f"budget_bytes={schedule.budget_bytes}, "
            f"predicted_peak_bytes={schedule.predicted_peak_bytes}, "
            f"predicted_time_s={schedule.predicted_time_s:.6g})"
        )


def _percent(fraction: float) -> str:
    if math.isinf(fraction) or math.isnan(fraction):
        return "n/a"
    return f"{fraction * 100:.1f}%"


def _spans(indices: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``"1-3, 7"``."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
