"""Plan reconstruction: a plan tree from the programs' tables, one choice per subproblem."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from remat.errors import RematError
from remat.plan.operations import PlanItem, PlanTree, Region, Store
from remat.plan.solvers.arrays import _ChainArrays
from remat.plan.solvers.programs import CostTable

__all__: list[str] = []


@dataclass
class _OpenLevel:
    """A level of the plan being built: its items so far and the subproblem left."""

    items: list[PlanItem]
    origin: int
    start: int
    end: int
    held: int
    memory: int
    parent: _OpenLevel | None


def _build_plan(arrays: _ChainArrays, memory: int, choose: Callable[[int, int, int, int], int]) -> PlanTree:
    """Builds the plan from the top-level problem, asking ``choose`` at every subproblem.

    ``choose(start, end, held, memory)`` returns 0 for "store start", ``-1 - o`` for "store
    start" under store option ``o``, or the stop of the region to open. Iterative, so that
    deep nestings do not hit Python's recursion limit.
    """
    root = _OpenLevel([], 0, 0, arrays.n_stages - 1, 0, memory, None)
    stack = [root]
    while stack:
        level = stack[-1]
        if level.start > level.end:
            stack.pop()
            if level.parent is not None:
                region = Region(level.origin, level.end + 1, tuple(level.items))
                level.parent.items.append(region)
            continue
        start = level.start
        stop = choose(start, level.end, level.held, level.memory)
        if stop < 0:
            option = -1 - stop
            level.items.append(Store(start, arrays.option_names[option]))
            level.memory -= int(arrays.option_background[option, start])
            level.held = int(arrays.option_saves_output[option, start])
            level.start = start + 1
        elif stop == 0:
            level.items.append(Store(start))
            level.memory -= int(arrays.store_background[start, level.held])
            level.held = int(arrays.saves_output[start])
            level.start = start + 1
        else:
            stack.append(_OpenLevel([], start, start, stop - 1, 1, level.memory, level))
            level.memory -= int(arrays.activation[start])
            level.held = 0
            level.start = stop
    return tuple(root.items)


def _fastest_choice(arrays: _ChainArrays, costs: CostTable) -> Callable[[int, int, int, int], int]:
    """Picks, at each subproblem, the option of least cost (storing on near-ties)."""
    relative_tolerance = 1e-12

    def choose(start: int, end: int, held: int, memory: int) -> int:
        if start == end:
            return _fastest_single(arrays, start, held, memory)
        store = math.inf
        if memory >= arrays.store_own_peak(start, end, held):
            background = int(arrays.store_background[start, held])
            following = costs.lookup(
                np.array(start + 1),
                np.array(end),
                np.array(arrays.saves_output[start]),
                np.array(memory - background),
            )
            store = float(arrays.forward_backward_s[start] + following)
        option_choice, option_cost = 0, math.inf
        for option in range(len(arrays.option_names)):
            if memory < arrays.option_own_peak(option, start, end):
                continue
            following = costs.lookup(
                np.array(start + 1),
                np.array(end),
                np.array(arrays.option_saves_output[option, start]),
                np.array(memory - int(arrays.option_background[option, start])),
            )
            cost = float(arrays.option_forward_backward_s[option, start] + following)
            if cost < option_cost:
                option_choice, option_cost = -1 - option, cost
        stops = np.arange(start + 1, end + 1)
        activation = int(arrays.activation[start])
        feasible = memory >= arrays.region_forward_peaks(start, end)
        recompute_s = arrays.forward_prefix_s[stops] - arrays.forward_prefix_s[start]
        rest = costs.lookup(stops, np.full_like(stops, end), np.zeros_like(stops), np.array(memory - activation))
        body = costs.lookup(np.full_like(stops, start), stops - 1, np.ones_like(stops), np.array(memory))
        regions = np.where(feasible, recompute_s + rest + body, np.inf)
        best_index = int(np.argmin(regions))
        best = float(regions[best_index])
        if math.isinf(store) and math.isinf(best) and math.isinf(option_cost):
            raise RematError(f"internal error: subproblem ({start}, {end}, {held}) has no plan within {memory} slots")
        least = min(best, option_cost)
        if store <= least + relative_tolerance * abs(least):
            return 0
        if option_cost <= best + relative_tolerance * abs(best):
            return option_choice
        return int(stops[best_index])

    return choose


def _fastest_single(arrays: _ChainArrays, start: int, held: int, memory: int) -> int:
    """A one-stage subproblem's choice: store whole if it fits, else the fastest store option that does."""
    if memory >= arrays.single_peak[start, held]:
        return 0
    choice, fastest = 0, math.inf
    for option in range(len(arrays.option_names)):
        if (
            memory >= arrays.option_single_peak[option, start]
            and arrays.option_forward_backward_s[option, start] < fastest
        ):
            choice, fastest = -1 - option, float(arrays.option_forward_backward_s[option, start])
    if math.isinf(fastest):
        raise RematError(f"internal error: stage {start} has no way to be stored within {memory} units")
    return choice


def _least_peak_choice(arrays: _ChainArrays, least: np.ndarray) -> Callable[[int, int, int, int], int]:
    """Picks "store" at each subproblem if it fits in memory, else the shortest region that does."""

    def choose(start: int, end: int, held: int, memory: int) -> int:
        if start == end:
            return _fastest_single(arrays, start, held, memory)
        background = int(arrays.store_background[start, held])
        store = max(
            arrays.store_own_peak(start, end, held),
            background + int(least[start + 1, end, arrays.saves_output[start]]),
        )
        if store <= memory:
            return 0
        fitting_options = [
            option
            for option in range(len(arrays.option_names))
            if max(
                arrays.option_own_peak(option, start, end),
                int(arrays.option_background[option, start])
                + int(least[start + 1, end, arrays.option_saves_output[option, start]]),
            )
            <= memory
        ]
        if fitting_options:
            fastest = min(fitting_options, key=lambda option: float(arrays.option_forward_backward_s[option, start]))
            return -1 - fastest
        peaks = arrays.region_peaks(least, start, end)
        fitting = np.flatnonzero(peaks <= memory)
        if fitting.size == 0:
            raise RematError(f"internal error: no plan of ({start}, {end}, {held}) within {memory} bytes")
        return start + 1 + int(fitting[0])

    return choose
