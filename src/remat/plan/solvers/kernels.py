"""The recurrences of the optimal solver's two programs, once: peak formulas and compiled loops.

The peak formulas below are the one definition of the peaks of the program's options (see
NOTE [memory accounting of the dynamic program] in ``arrays.py``). They are plain functions:
the numpy forms of the programs (``programs.py``), plan reconstruction and
:func:`~.arrays._plan_peak_units` call them (through :class:`~.arrays._ChainArrays`) for
all the stops of a subproblem at once, and the loop forms here, which numba compiles, for
one stop at a time. The two forms of the least-peak program also share the step that
closes a subproblem.

The loops take the chain's arrays one by one, not as a :class:`_ChainArrays`: numba
compiles loops over arrays held in a tuple into slower code.

NOTE [numba's cache and this file]: numba compiles the loops on first use and caches them on
disk; a cached function is compiled again when its own file changes, not when a function it
calls does. Every function the compiled loops call is therefore in this file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "INT_INFINITY",
    "close_subproblem",
    "compiled_programs",
    "one_stage_peaks",
    "option_own_peak",
    "region_forward_peak",
    "region_peak",
    "store_own_peak",
]

INT_INFINITY = np.int64(2**62)
"""Stands for an infeasible peak in the integer tables."""

Stops = int | slice
"""One stop of a region, or a slice of consecutive stops (then the formula gives an array)."""


# ------------------------------------------------------------ the peak formulas


def region_forward_peak(
    activation: np.ndarray,
    outer_gradient: np.ndarray,
    region_inner_forward: np.ndarray,
    start: int,
    stop: Stops,
    end: int,
) -> Any:
    """The peak of the forwards of the region ``[start, stop)`` in the subproblem ``(start, end, .)``.

    ``x_start`` and the subproblem's outer gradient, plus the largest of the checkpointing
    forward of ``start`` and the discarding forwards after it (``inner`` in the NOTE).
    """
    return activation[start] + outer_gradient[end] + region_inner_forward[start, stop]


def region_peak(forward_peak: Any, start_activation: Any, rest_least_peak: Any, body_least_peak: Any) -> Any:
    """The least peak of the option "region ``[a, j)``" of a subproblem ``(a, b, .)``.

    The largest of the region's forwards (``forward_peak``, from :func:`region_forward_peak`),
    the rest ``(j, b, 0)`` on top of the checkpointed ``x_a`` (``start_activation``), and the
    body ``(a, j - 1, 1)``. Scalars, or arrays over consecutive stops ``j``.
    """
    return np.maximum(np.maximum(forward_peak, start_activation + rest_least_peak), body_least_peak)


def store_own_peak(
    activation: np.ndarray,
    outer_gradient: np.ndarray,
    first_forward: np.ndarray,
    store_backward: np.ndarray,
    start: Stops,
    end: Stops,
    held: int,
) -> Any:
    """The peak of the forward and the backward of "store ``start``" in ``(start, end, held)``, start < end.

    Scalars, or arrays over subproblems when ``start`` and ``end`` are slices of equal length.
    """
    forward = activation[start] + outer_gradient[end] + first_forward[start]
    return np.maximum(forward, store_backward[start, held])


def option_own_peak(
    activation: np.ndarray,
    outer_gradient: np.ndarray,
    first_forward: np.ndarray,
    option_backward: np.ndarray,
    option: int,
    start: int,
    end: int,
) -> Any:
    """The peak of the forward and the backward of "store ``start``" under a store option, start < end.

    The forward is the stage's stored whole (NOTE [stored under a policy] in
    ``remat/plan/options.py``); ``option_backward`` holds the backward's, its recompute first.
    """
    forward = activation[start] + outer_gradient[end] + first_forward[start]
    return max(forward, option_backward[option, start])


# ------------------------------------------------------------ the least-peak program


def one_stage_peaks(
    single_peak: np.ndarray, option_single_peak: np.ndarray, infinity: np.int64
) -> tuple[np.ndarray, np.ndarray]:
    """The (least, store-everything) peak tables, (n, n, 2), with the one-stage subproblems filled.

    A one-stage subproblem's least peak is the least of storing it whole and under each
    store option; its store-everything peak is that of storing it whole.
    """
    n = single_peak.shape[0]
    least = np.full((n, n, 2), infinity, dtype=np.int64)
    saturation = np.full((n, n, 2), infinity, dtype=np.int64)
    for start in range(n):
        for held in range(2):
            lowest = single_peak[start, held]
            for option in range(option_single_peak.shape[0]):
                lowest = min(lowest, option_single_peak[option, start])
            least[start, start, held] = lowest
            saturation[start, start, held] = single_peak[start, held]
    return least, saturation


def close_subproblem(
    least: np.ndarray,
    saturation: np.ndarray,
    region: Any,
    start: int,
    end: int,
    activation: np.ndarray,
    outer_gradient: np.ndarray,
    first_forward: np.ndarray,
    store_background: np.ndarray,
    store_backward: np.ndarray,
    saves_output: np.ndarray,
    option_background: np.ndarray,
    option_backward: np.ndarray,
    option_saves_output: np.ndarray,
) -> None:
    """Fills the peaks of ``(start, end, h)`` from ``region`` (the least of its regions'),
    "store start", and "store start" under each store option (the same for both h)."""
    held_next = saves_output[start]
    for option in range(option_background.shape[0]):
        own = option_own_peak(activation, outer_gradient, first_forward, option_backward, option, start, end)
        following = least[start + 1, end, option_saves_output[option, start]]
        region = min(region, max(own, option_background[option, start] + following))
    for held in range(2):
        own = store_own_peak(activation, outer_gradient, first_forward, store_backward, start, end, held)
        background = store_background[start, held]
        store = max(own, background + least[start + 1, end, held_next])
        least[start, end, held] = min(store, region)
        saturation[start, end, held] = max(own, background + saturation[start + 1, end, held_next])


def _least_peaks_loops(  # pragma: no cover - compiled by numba
    activation: np.ndarray,
    first_forward: np.ndarray,
    region_inner_forward: np.ndarray,
    outer_gradient: np.ndarray,
    store_background: np.ndarray,
    store_backward: np.ndarray,
    single_peak: np.ndarray,
    saves_output: np.ndarray,
    option_background: np.ndarray,
    option_backward: np.ndarray,
    option_single_peak: np.ndarray,
    option_saves_output: np.ndarray,
    infinity: np.int64,
) -> tuple[np.ndarray, np.ndarray]:
    """The loop form of the least-peak program: the regions of a subproblem one stop at a time."""
    least, saturation = one_stage_peaks(single_peak, option_single_peak, infinity)
    n = single_peak.shape[0]
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            region = infinity
            for stop in range(start + 1, end + 1):
                forward = region_forward_peak(activation, outer_gradient, region_inner_forward, start, stop, end)
                region = min(
                    region, region_peak(forward, activation[start], least[stop, end, 0], least[start, stop - 1, 1])
                )
            close_subproblem(
                least,
                saturation,
                region,
                start,
                end,
                activation,
                outer_gradient,
                first_forward,
                store_background,
                store_backward,
                saves_output,
                option_background,
                option_backward,
                option_saves_output,
            )
    return least, saturation


# ------------------------------------------------------------ the time program

# The loop form keeps, for each subproblem (a, b, h), only the memories m in
# [least, min(saturation, budget + 1)): its row, at values[offsets[a, b, h] + m - least].
# Below the row the cost is infinite, above it the store-everything time base_s[a, b]. A
# caller reads a row through an offset that already subtracts its least peak (and, for
# the rest of a region, x_a) and through its saturation in the caller's memory.


def _row_cost_s(  # pragma: no cover - compiled by numba
    values: np.ndarray, offset: int, saturation: int, base_s: float, memory: int
) -> float:
    """A subproblem's cost at ``memory`` (not below its least peak): from its row, or ``base_s`` past it."""
    if memory >= saturation:
        return base_s
    return values[offset + memory]


def _first_at_most(  # pragma: no cover - compiled by numba
    best: np.ndarray, low: int, begin: int, end: int, floor: float
) -> int:
    """The first m in ``[begin, end)`` with ``best[m - low] <= floor``, or ``end``; best is non-increasing."""
    while begin < end:
        middle = (begin + end) // 2
        if best[middle - low] <= floor:
            end = middle
        else:
            begin = middle + 1
    return begin


def _lower_by_region(  # pragma: no cover - compiled by numba
    best: np.ndarray,
    low: int,
    first: int,
    high: int,
    values: np.ndarray,
    recompute_s: float,
    rest_offset: int,
    rest_saturation: int,
    rest_base_s: float,
    body_offset: int,
    body_saturation: int,
    body_base_s: float,
) -> None:
    """Lowers ``best`` (memories from ``low``) to a region's cost on ``[first, high)``.

    The cost is ``recompute_s`` plus the rest's and the body's, read from their rows (at
    ``offset``, constant from ``saturation`` on, as :func:`_row_cost_s`).
    """
    # The region costs at least what it costs at high - 1: skip the m where best is already
    # there (a suffix of [first, high), found by bisection).
    floor = recompute_s + _row_cost_s(values, rest_offset, rest_saturation, rest_base_s, high - 1)
    floor = floor + _row_cost_s(values, body_offset, body_saturation, body_base_s, high - 1)
    if best[first - low] <= floor:
        return
    cut = _first_at_most(best, low, first + 1, high, floor)
    # Up to three segments: both rows read, one row read and the other constant, both
    # constant. The loops run over slices, indexed from 0, so that they vectorise.
    both_rows = min(cut, rest_saturation, body_saturation)
    one_row = min(cut, max(rest_saturation, body_saturation))
    if both_rows > first:
        target = best[first - low : both_rows - low]
        rest_row = values[rest_offset + first : rest_offset + both_rows]
        body_row = values[body_offset + first : body_offset + both_rows]
        for index in range(target.shape[0]):
            target[index] = min(target[index], recompute_s + rest_row[index] + body_row[index])
    segment = max(first, both_rows)
    if one_row > segment:
        target = best[segment - low : one_row - low]
        if rest_saturation <= body_saturation:
            with_rest = recompute_s + rest_base_s
            body_row = values[body_offset + segment : body_offset + one_row]
            for index in range(target.shape[0]):
                target[index] = min(target[index], with_rest + body_row[index])
        else:
            rest_row = values[rest_offset + segment : rest_offset + one_row]
            for index in range(target.shape[0]):
                target[index] = min(target[index], recompute_s + rest_row[index] + body_base_s)
    segment = max(first, one_row)
    if cut > segment:
        constant = recompute_s + rest_base_s + body_base_s
        target = best[segment - low : cut - low]
        for index in range(target.shape[0]):
            target[index] = min(target[index], constant)


def _one_stage_rows(  # pragma: no cover - compiled by numba
    values: np.ndarray,
    budget_units: int,
    least: np.ndarray,
    saturation: np.ndarray,
    offsets: np.ndarray,
    option_single_peak: np.ndarray,
    option_forward_backward_s: np.ndarray,
) -> None:
    """The rows of the one-stage subproblems: below storing whole, the fastest store option that fits."""
    for start in range(least.shape[0]):
        for held in range(2):
            row_offset = offsets[start, start, held] - least[start, start, held]
            for m in range(least[start, start, held], min(budget_units + 1, saturation[start, start, held])):
                value = np.inf
                for option in range(option_single_peak.shape[0]):
                    if m >= option_single_peak[option, start]:
                        value = min(value, option_forward_backward_s[option, start])
                values[row_offset + m] = value


def _option_store_terms(  # pragma: no cover - compiled by numba
    start: int,
    end: int,
    activation: np.ndarray,
    outer_gradient: np.ndarray,
    first_forward: np.ndarray,
    least: np.ndarray,
    saturation: np.ndarray,
    offsets: np.ndarray,
    option_background: np.ndarray,
    option_backward: np.ndarray,
    option_saves_output: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For "store start" of ``(start, end, .)`` under each option: the least memory it needs,
    and the offset and saturation (in this subproblem's memory) of the row of its rest."""
    n_options = option_background.shape[0]
    first = np.empty(n_options, dtype=np.int64)
    offset = np.empty(n_options, dtype=np.int64)
    next_saturation = np.empty(n_options, dtype=np.int64)
    for option in range(n_options):
        saves = option_saves_output[option, start]
        background = option_background[option, start]
        next_least = least[start + 1, end, saves]
        own = option_own_peak(activation, outer_gradient, first_forward, option_backward, option, start, end)
        first[option] = max(own, background + next_least)
        offset[option] = offsets[start + 1, end, saves] - next_least - background
        next_saturation[option] = saturation[start + 1, end, saves] + background
    return first, offset, next_saturation


def _costs_loops(  # pragma: no cover - compiled by numba
    budget_units: int,
    activation: np.ndarray,
    first_forward: np.ndarray,
    region_inner_forward: np.ndarray,
    outer_gradient: np.ndarray,
    store_background: np.ndarray,
    store_backward: np.ndarray,
    saves_output: np.ndarray,
    forward_backward_s: np.ndarray,
    forward_prefix_s: np.ndarray,
    base_s: np.ndarray,
    least: np.ndarray,
    saturation: np.ndarray,
    offsets: np.ndarray,
    total: int,
    option_background: np.ndarray,
    option_backward: np.ndarray,
    option_single_peak: np.ndarray,
    option_saves_output: np.ndarray,
    option_forward_backward_s: np.ndarray,
) -> np.ndarray:
    """The loop form of the time program: the rows of every subproblem, in one flat array."""
    # Order: b increasing, a decreasing, so that the rows (j, b, 0) of the rests, used by
    # every a, stay in cache; the layout keeps them, and the rows (a, c, 1) of the bodies,
    # next to each other.
    values = np.empty(total, dtype=np.float64)
    n_options = option_background.shape[0]
    _one_stage_rows(values, budget_units, least, saturation, offsets, option_single_peak, option_forward_backward_s)
    for end in range(1, least.shape[0]):
        for start in range(end - 1, -1, -1):
            low = min(least[start, end, 0], least[start, end, 1])
            high = min(budget_units + 1, max(saturation[start, end, 0], saturation[start, end, 1]))
            if low >= high:
                continue
            own_s = forward_backward_s[start]
            held_next = saves_output[start]
            next_least = least[start + 1, end, held_next]
            next_saturation = saturation[start + 1, end, held_next]
            next_base_s = base_s[start + 1, end]
            # best[m - low] starts as the larger of the two "store start" costs (that of the
            # larger background) and takes the minimum with every region. Both are
            # non-increasing in m, which the pruning in _lower_by_region relies on.
            background = max(store_background[start, 0], store_background[start, 1])
            store_first = max(
                store_own_peak(activation, outer_gradient, first_forward, store_backward, start, end, 0),
                store_own_peak(activation, outer_gradient, first_forward, store_backward, start, end, 1),
                background + next_least,
            )
            next_offset = offsets[start + 1, end, held_next] - next_least - background
            best = np.full(high - low, np.inf)
            for m in range(max(low, store_first), high):
                best[m - low] = own_s + _row_cost_s(values, next_offset, next_saturation + background, next_base_s, m)
            for stop in range(start + 1, end + 1):
                forward = region_forward_peak(activation, outer_gradient, region_inner_forward, start, stop, end)
                first = max(
                    low, region_peak(forward, activation[start], least[stop, end, 0], least[start, stop - 1, 1])
                )
                if first >= high:
                    continue
                _lower_by_region(
                    best,
                    low,
                    first,
                    high,
                    values,
                    forward_prefix_s[stop] - forward_prefix_s[start],
                    offsets[stop, end, 0] - least[stop, end, 0] - activation[start],
                    activation[start] + saturation[stop, end, 0],
                    base_s[stop, end],
                    offsets[start, stop - 1, 1] - least[start, stop - 1, 1],
                    saturation[start, stop - 1, 1],
                    base_s[start, stop - 1],
                )
            # "store start" under each option: the same for both h (NOTE [stored under a policy]).
            option_first, option_offset, option_next_saturation = _option_store_terms(
                start, end, activation, outer_gradient, first_forward, least, saturation, offsets,
                option_background, option_backward, option_saves_output,
            )  # fmt: skip
            option_next_base_s = base_s[start + 1, end]
            # Each row (start, end, h): best, lowered by "store start" with h's own background.
            for held in range(2):
                row_start = least[start, end, held]
                row_offset = offsets[start, end, held] - row_start
                background = store_background[start, held]
                store_first = max(
                    store_own_peak(activation, outer_gradient, first_forward, store_backward, start, end, held),
                    background + next_least,
                )
                next_offset = offsets[start + 1, end, held_next] - next_least - background
                for m in range(row_start, min(budget_units + 1, saturation[start, end, held])):
                    value = best[m - low]
                    if m >= store_first:
                        stored = own_s + _row_cost_s(values, next_offset, next_saturation + background, next_base_s, m)
                        value = min(value, stored)
                    for option in range(n_options):
                        if m >= option_first[option]:
                            optional = option_forward_backward_s[option, start] + _row_cost_s(
                                values, option_offset[option], option_next_saturation[option], option_next_base_s, m
                            )
                            value = min(value, optional)
                    values[row_offset + m] = value
    return values


# ------------------------------------------------------------ compilation

_COMPILED_HELPERS = (
    region_forward_peak,
    region_peak,
    store_own_peak,
    option_own_peak,
    one_stage_peaks,
    close_subproblem,
    _row_cost_s,
    _first_at_most,
    _lower_by_region,
    _one_stage_rows,
    _option_store_terms,
)


@functools.lru_cache(maxsize=1)
def compiled_programs() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Compiles (once; cached on disk) the loop forms of the two programs with numba.

    Returns:
        The least-peak loops and the time-program loops, with the signatures of
        ``_least_peaks_loops`` and ``_costs_loops``.
    """
    import numba
    from numba.extending import register_jitable

    # The helpers stay plain Python functions, for the numpy forms; registered, the
    # compiled loops can call them, and numba inlines them there.
    for helper in _COMPILED_HELPERS:
        register_jitable(inline="always")(helper)
    compile_with_cache = numba.njit(cache=True)
    return compile_with_cache(_least_peaks_loops), compile_with_cache(_costs_loops)
