"""The two programs of the optimal solver, in numpy and, compiled, in numba.

The least-peak program (a min-max recurrence) gives the smallest peak of every
subproblem; the time program gives the least time of every subproblem under every
memory. Each has a numpy implementation and a numba one that computes the same
recurrence (see NOTE [memory accounting of the dynamic program] in ``arrays.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from remat.plan.solvers.arrays import INT_INFINITY, _ChainArrays

__all__: list[str] = []


def _least_peaks_numpy(arrays: _ChainArrays) -> tuple[np.ndarray, np.ndarray]:
    """Returns (least peak, store-everything peak) of every subproblem, shape (n, n, 2)."""
    n = arrays.n_stages
    least = np.full((n, n, 2), INT_INFINITY, dtype=np.int64)
    saturation = np.full((n, n, 2), INT_INFINITY, dtype=np.int64)
    for start in range(n):
        least[start, start] = arrays.single_peak[start]
        saturation[start, start] = arrays.single_peak[start]
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            activation = arrays.activation[start]
            outer = activation + arrays.outer_gradient[end]
            region = np.maximum(
                np.maximum(arrays.region_forward_peaks(start, end), activation + least[start + 1 : end + 1, end, 0]),
                least[start, start:end, 1],
            ).min()
            held_next = arrays.saves_output[start]
            for held in (0, 1):
                own = max(outer + arrays.first_forward[start], arrays.store_backward[start, held])
                background = arrays.store_background[start, held]
                store = max(own, background + least[start + 1, end, held_next])
                least[start, end, held] = min(store, region)
                saturation[start, end, held] = max(own, background + saturation[start + 1, end, held_next])
    return least, saturation


def _least_peaks_kernel(  # pragma: no cover - compiled by numba
    n: int,
    activation: np.ndarray,
    first_forward: np.ndarray,
    discard_forward: np.ndarray,
    outer_gradient: np.ndarray,
    store_background: np.ndarray,
    store_backward: np.ndarray,
    single_peak: np.ndarray,
    saves_output: np.ndarray,
    infinity: np.int64,
) -> tuple[np.ndarray, np.ndarray]:
    least = np.full((n, n, 2), infinity, dtype=np.int64)
    saturation = np.full((n, n, 2), infinity, dtype=np.int64)
    for start in range(n):
        for held in range(2):
            least[start, start, held] = single_peak[start, held]
            saturation[start, start, held] = single_peak[start, held]
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            outer = activation[start] + outer_gradient[end]
            inner = first_forward[start]
            region = infinity
            for stop in range(start + 1, end + 1):
                if stop > start + 1 and discard_forward[stop - 1] > inner:
                    inner = discard_forward[stop - 1]
                value = max(
                    outer + inner,
                    activation[start] + least[stop, end, 0],
                    least[start, stop - 1, 1],
                )
                if value < region:
                    region = value
            held_next = saves_output[start]
            for held in range(2):
                own = max(outer + first_forward[start], store_backward[start, held])
                background = store_background[start, held]
                store = max(own, background + least[start + 1, end, held_next])
                least[start, end, held] = min(store, region)
                saturation[start, end, held] = max(own, background + saturation[start + 1, end, held_next])
    return least, saturation


# The time program is one compiled loop nest: splitting it into calls would cost the
# compiled kernel its speed, hence its complexity.
def _costs_kernel(  # noqa: C901  # pragma: no cover - compiled by numba
    n: int,
    budget_units: int,
    activation: np.ndarray,
    first_forward: np.ndarray,
    discard_forward: np.ndarray,
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
) -> np.ndarray:
    # Row (a, b, h) holds cost(a, b, h, m) for m in [least, min(saturation, budget + 1))
    # at values[offsets[a, b, h] + m - least]; below it is infinite, above base_s[a, b].
    # Order: b increasing, a decreasing, so that the rows (j, b, 0) of the rests, used
    # by every a, stay in cache; the layout keeps them, and the rows (a, c, 1) of the
    # bodies, next to each other.
    values = np.empty(total, dtype=np.float64)
    for end in range(1, n):
        for start in range(end - 1, -1, -1):
            low = min(least[start, end, 0], least[start, end, 1])
            high = min(budget_units + 1, max(saturation[start, end, 0], saturation[start, end, 1]))
            if low >= high:
                continue
            activation_start = activation[start]
            outer = activation_start + outer_gradient[end]
            own_s = forward_backward_s[start]
            held_next = saves_output[start]
            next_least = least[start + 1, end, held_next]
            next_full = saturation[start + 1, end, held_next]
            next_offset = offsets[start + 1, end, held_next] - next_least
            next_base = base_s[start + 1, end]
            # best[m - low] starts as the larger of the two "store start" costs (that of
            # the larger background) and takes the minimum with every region. Both are
            # non-increasing in m, which the pruning below relies on.
            best = np.empty(high - low, dtype=np.float64)
            background = max(store_background[start, 0], store_background[start, 1])
            store_first = max(
                outer + first_forward[start],
                store_backward[start, 0],
                store_backward[start, 1],
                background + next_least,
            )
            for m in range(low, high):
                if m < store_first:
                    best[m - low] = np.inf
                elif m - background >= next_full:
                    best[m - low] = own_s + next_base
                else:
                    best[m - low] = own_s + values[next_offset + m - background]
            inner = first_forward[start]
            for stop in range(start + 1, end + 1):
                if stop > start + 1 and discard_forward[stop - 1] > inner:
                    inner = discard_forward[stop - 1]
                first = max(
                    low,
                    outer + inner,
                    activation_start + least[stop, end, 0],
                    least[start, stop - 1, 1],
                )
                if first >= high:
                    continue
                recompute_s = forward_prefix_s[stop] - forward_prefix_s[start]
                rest_base = base_s[stop, end]
                body_base = base_s[start, stop - 1]
                # The rest (stop, end, 0) at m - x_a and the body (start, stop - 1, 1)
                # at m, each read from its row or, past its saturation, constant.
                rest_offset = offsets[stop, end, 0] - least[stop, end, 0] - activation_start
                rest_full = activation_start + saturation[stop, end, 0]
                body_offset = offsets[start, stop - 1, 1] - least[start, stop - 1, 1]
                body_full = saturation[start, stop - 1, 1]
                # This region costs at least what it costs at high - 1: skip the m where
                # best is already there (a suffix of [first, high), found by bisection).
                last = high - 1
                if last >= rest_full:
                    floor = recompute_s + rest_base
                else:
                    floor = recompute_s + values[rest_offset + last]
                if last >= body_full:
                    floor = floor + body_base
                else:
                    floor = floor + values[body_offset + last]
                if best[first - low] <= floor:
                    continue
                cut_low, cut_high = first + 1, high
                while cut_low < cut_high:
                    middle = (cut_low + cut_high) // 2
                    if best[middle - low] <= floor:
                        cut_high = middle
                    else:
                        cut_low = middle + 1
                cut = cut_low
                both_rows = min(cut, rest_full, body_full)
                one_row = min(cut, max(rest_full, body_full))
                # The loops run over slices, indexed from 0, so that they vectorise.
                if both_rows > first:
                    target = best[first - low : both_rows - low]
                    rest_row = values[rest_offset + first : rest_offset + both_rows]
                    body_row = values[body_offset + first : body_offset + both_rows]
                    for index in range(target.shape[0]):
                        target[index] = min(target[index], recompute_s + rest_row[index] + body_row[index])
                segment = max(first, both_rows)
                if one_row > segment:
                    target = best[segment - low : one_row - low]
                    if rest_full <= body_full:
                        with_rest = recompute_s + rest_base
                        body_row = values[body_offset + segment : body_offset + one_row]
                        for index in range(target.shape[0]):
                            target[index] = min(target[index], with_rest + body_row[index])
                    else:
                        rest_row = values[rest_offset + segment : rest_offset + one_row]
                        for index in range(target.shape[0]):
                            target[index] = min(target[index], recompute_s + rest_row[index] + body_base)
                segment = max(first, one_row)
                if cut > segment:
                    constant = recompute_s + rest_base + body_base
                    target = best[segment - low : cut - low]
                    for index in range(target.shape[0]):
                        target[index] = min(target[index], constant)
            for held in range(2):
                row_start = least[start, end, held]
                row_stop = min(budget_units + 1, saturation[start, end, held])
                if row_start >= row_stop:
                    continue
                row_offset = offsets[start, end, held] - row_start
                background = store_background[start, held]
                store_first = max(
                    outer + first_forward[start],
                    store_backward[start, held],
                    background + next_least,
                )
                for m in range(row_start, row_stop):
                    value = best[m - low]
                    if m >= store_first:
                        if m - background >= next_full:
                            stored = own_s + next_base
                        else:
                            stored = own_s + values[next_offset + m - background]
                        if stored < value:
                            value = stored
                    values[row_offset + m] = value
    return values


@functools.lru_cache(maxsize=1)
def _numba_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Compiles (once; cached on disk) the numba kernels of the two programs."""
    import numba

    return numba.njit(cache=True)(_least_peaks_kernel), numba.njit(cache=True)(_costs_kernel)


def _least_peaks(arrays: _ChainArrays, implementation: str) -> tuple[np.ndarray, np.ndarray]:
    if implementation == "numba":
        least_peaks, _ = _numba_kernels()
        return least_peaks(  # type: ignore[no-any-return]
            arrays.n_stages,
            arrays.activation,
            arrays.first_forward,
            arrays.discard_forward,
            arrays.outer_gradient,
            arrays.store_background,
            arrays.store_backward,
            arrays.single_peak,
            arrays.saves_output,
            INT_INFINITY,
        )
    return _least_peaks_numpy(arrays)


# ------------------------------------------------------------ the time program


class _CostTable(Protocol):
    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """cost(a, b, h, m) for arrays of subproblems and memories (inf when infeasible)."""
        ...


class _JaggedCosts:
    """cost(a, b, h, m) read from the numba kernel's rows."""

    def __init__(
        self,
        arrays: _ChainArrays,
        least: np.ndarray,
        saturation: np.ndarray,
        offsets: np.ndarray,
        values: np.ndarray,
    ) -> None:
        self.arrays = arrays
        self.least = least
        self.saturation = saturation
        self.offsets = offsets
        self.values = values

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        least = self.least[starts, ends, helds]
        saturated = memories >= self.saturation[starts, ends, helds]
        stored = (memories >= least) & ~saturated
        result = np.where(saturated, self.arrays.base_s[starts, ends], np.inf)
        indices = self.offsets[starts, ends, helds] + memories - least
        result[stored] = self.values[indices[stored]]
        return result


class _DenseCosts:
    """cost(a, b, h, m) read from the numpy implementation's table (h, a, b, m)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        inside = memories >= 0
        result = np.full(np.broadcast(starts, memories).shape, np.inf)
        values = self.table[helds, starts, ends, np.maximum(memories, 0)]
        result[inside] = np.broadcast_to(values, result.shape)[inside]
        return result


def _row_offsets(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Where each row of the jagged table starts: rows (j, b, 0) by (b, j), then (a, c, 1)."""
    lengths_rest = np.ascontiguousarray(lengths[:, :, 0].T).reshape(-1)
    lengths_body = lengths[:, :, 1].reshape(-1)
    offsets = np.empty(lengths.shape, dtype=np.int64)
    offsets[:, :, 0] = (np.cumsum(lengths_rest) - lengths_rest).reshape(lengths.shape[:2]).T
    offsets[:, :, 1] = (np.cumsum(lengths_body) - lengths_body).reshape(lengths.shape[:2]) + lengths_rest.sum()
    return offsets, int(lengths_rest.sum() + lengths_body.sum())


def _costs_numba(arrays: _ChainArrays, budget_units: int, least: np.ndarray, saturation: np.ndarray) -> _JaggedCosts:
    _, kernel = _numba_kernels()
    lengths = np.clip(np.minimum(saturation, budget_units + 1) - least, 0, None)
    lengths[np.tril_indices(arrays.n_stages, -1)] = 0
    offsets, total = _row_offsets(lengths)
    values = kernel(
        arrays.n_stages,
        budget_units,
        arrays.activation,
        arrays.first_forward,
        arrays.discard_forward,
        arrays.outer_gradient,
        arrays.store_background,
        arrays.store_backward,
        arrays.saves_output,
        arrays.forward_backward_s,
        arrays.forward_prefix_s,
        arrays.base_s,
        least,
        saturation,
        offsets,
        total,
    )
    return _JaggedCosts(arrays, least, saturation, offsets, values)


def _costs_numpy(arrays: _ChainArrays, budget_units: int) -> _DenseCosts:
    n = arrays.n_stages
    width = budget_units + 1
    memory = np.arange(width, dtype=np.int64)
    table = np.full((2, n, n, width), np.inf, dtype=np.float64)
    for start in range(n):
        for held in (0, 1):
            fits = memory >= arrays.single_peak[start, held]
            table[held, start, start, fits] = arrays.forward_backward_s[start]
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            activation = int(arrays.activation[start])
            outer = activation + int(arrays.outer_gradient[end])
            region = np.full(width, np.inf)
            if activation < width:
                recompute_s = arrays.forward_prefix_s[start + 1 : end + 1] - arrays.forward_prefix_s[start]
                rest = table[0, start + 1 : end + 1, end, : width - activation]
                body = table[1, start, start:end, activation:]
                options = recompute_s[:, None] + rest + body
                options[memory[None, activation:] < arrays.region_forward_peaks(start, end)[:, None]] = np.inf
                region[activation:] = options.min(axis=0)
            held_next = int(arrays.saves_output[start])
            following = table[held_next, start + 1, end]
            for held in (0, 1):
                background = int(arrays.store_background[start, held])
                own = max(
                    outer + int(arrays.first_forward[start]),
                    int(arrays.store_backward[start, held]),
                )
                store = np.full(width, np.inf)
                if background < width:
                    store[background:] = arrays.forward_backward_s[start] + following[: width - background]
                store[: min(own, width)] = np.inf
                table[held, start, end] = np.minimum(store, region)
    return _DenseCosts(table)
