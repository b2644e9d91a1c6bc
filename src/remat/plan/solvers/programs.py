"""The optimal solver's two programs as it runs them: in numpy, or as the compiled loops.

The least-peak program (a min-max recurrence) gives the smallest peak of every subproblem;
the time program gives the least time of every subproblem under every memory, as a
:class:`CostTable` that plan reconstruction reads. Each program has a numpy form here,
which works on whole arrays of stops, and a loop form in ``kernels.py``, which numba
compiles; both are written with the peak formulas of ``kernels.py``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from remat.plan.solvers.arrays import _ChainArrays
from remat.plan.solvers.kernels import INT_INFINITY, compiled_programs, region_peak, store_own_peak

__all__ = ["CostTable", "cost_table", "least_peaks"]


# ------------------------------------------------------------ the least-peak program


def _least_peaks_numpy(arrays: _ChainArrays) -> tuple[np.ndarray, np.ndarray]:
    """The numpy form: all the subproblems of one length at once, their regions as one array.

    Tables by length and start (``[d, a]`` holds the subproblem ``(a, a + d - 1)``) and by
    length and end (``[d, b]``) make every term a slice: for the subproblems of length
    ``d`` and the regions ``[a, a + k)``, the rests ``(a + k, b, 0)`` are rows ``d - 1 .. 1``
    of the table by end, and the bodies ``(a, a + k - 1, 1)`` rows ``1 .. d - 1`` of the
    table by start. The work is about ``n**3 / 6`` elements, with ``n`` steps of Python.
    """
    n = arrays.n_stages
    shape = (n + 1, n)
    by_start = [np.full(shape, INT_INFINITY, dtype=np.int64) for _ in range(2)]
    by_end = [np.full(shape, INT_INFINITY, dtype=np.int64) for _ in range(2)]
    saturation_by_start = [np.full(shape, INT_INFINITY, dtype=np.int64) for _ in range(2)]
    inner_by_length = np.zeros(shape, dtype=np.int64)  # [k, a] = inner(a, a + k)
    for length in range(1, n + 1):
        starts = np.arange(n - length + 1)
        inner_by_length[length, : n - length + 1] = arrays.region_inner_forward[starts, starts + length]
    activation = arrays.activation[:n]
    saves_output = arrays.saves_output.astype(bool)
    single_least = arrays.single_least
    for held in (0, 1):
        by_start[held][1] = single_least[:, held]
        by_end[held][1] = single_least[:, held]
        saturation_by_start[held][1] = arrays.single_peak[:, held]
    for length in range(2, n + 1):
        count = n - length + 1
        start_activation = activation[:count]
        ends = slice(length - 1, n)
        # the regions' forward peaks (region_forward_peak, by length), then region_peak
        forward = (start_activation + arrays.outer_gradient[ends])[None, :] + inner_by_length[1:length, :count]
        rests = by_end[0][length - 1 : 0 : -1, ends]
        bodies = by_start[1][1:length, :count]
        region = region_peak(forward, start_activation[None, :], rests, bodies).min(axis=0)
        after = slice(1, count + 1)  # the subproblems (a + 1, b) of "store a"
        for option in range(len(arrays.option_names)):  # "store a" under each store option
            own = np.maximum(
                start_activation + arrays.outer_gradient[ends] + arrays.first_forward[:count],
                arrays.option_backward[option, :count],
            )
            following = np.where(
                arrays.option_saves_output[option, :count].astype(bool),
                by_start[1][length - 1, after],
                by_start[0][length - 1, after],
            )
            region = np.minimum(region, np.maximum(own, arrays.option_background[option, :count] + following))
        next_least = np.where(saves_output[:count], by_start[1][length - 1, after], by_start[0][length - 1, after])
        next_saturation = np.where(
            saves_output[:count],
            saturation_by_start[1][length - 1, after],
            saturation_by_start[0][length - 1, after],
        )
        for held in (0, 1):
            own = store_own_peak(
                arrays.activation, arrays.outer_gradient, arrays.first_forward, arrays.store_backward,
                slice(0, count), ends, held,
            )  # fmt: skip
            background = arrays.store_background[:count, held]
            least_here = np.minimum(np.maximum(own, background + next_least), region)
            by_start[held][length, :count] = least_here
            by_end[held][length, ends] = least_here
            saturation_by_start[held][length, :count] = np.maximum(own, background + next_saturation)
    least = np.full((n, n, 2), INT_INFINITY, dtype=np.int64)
    saturation = np.full((n, n, 2), INT_INFINITY, dtype=np.int64)
    firsts, lasts = np.triu_indices(n)
    for held in (0, 1):
        least[firsts, lasts, held] = by_start[held][lasts - firsts + 1, firsts]
        saturation[firsts, lasts, held] = saturation_by_start[held][lasts - firsts + 1, firsts]
    return least, saturation


def least_peaks(arrays: _ChainArrays, implementation: str) -> tuple[np.ndarray, np.ndarray]:
    """The least peak and the store-everything peak of every subproblem ``[a, b, h]``, shape (n, n, 2).

    Entries with ``a > b`` are :data:`~.kernels.INT_INFINITY`.

    Args:
        arrays: the chain in whole units.
        implementation: "numba" for the compiled loops, anything else for numpy.
    """
    if implementation != "numba":
        return _least_peaks_numpy(arrays)
    compiled_least_peaks, _ = compiled_programs()
    return compiled_least_peaks(
        arrays.activation,
        arrays.first_forward,
        arrays.region_inner_forward,
        arrays.outer_gradient,
        arrays.store_background,
        arrays.store_backward,
        arrays.single_peak,
        arrays.saves_output,
        arrays.option_background,
        arrays.option_backward,
        arrays.option_single_peak,
        arrays.option_saves_output,
        INT_INFINITY,
    )


# ------------------------------------------------------------ the time program


class CostTable(Protocol):
    """The least time of every subproblem under every memory (in the units of its arrays)."""

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """cost(a, b, h, m) in seconds for arrays of subproblems and memories (inf when infeasible)."""
        ...


class _DenseCosts:
    """cost(a, b, h, m) read from the numpy form's tables: ``[b, a, m]`` for h = 0, ``[a, b, m]`` for h = 1."""

    def __init__(self, by_end: np.ndarray, by_start: np.ndarray) -> None:
        self.by_end = by_end
        self.by_start = by_start

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """See :meth:`CostTable.lookup`."""
        inside = memories >= 0
        result = np.full(np.broadcast(starts, memories).shape, np.inf)
        clipped = np.maximum(memories, 0)
        values = np.where(helds == 0, self.by_end[ends, starts, clipped], self.by_start[starts, ends, clipped])
        result[inside] = np.broadcast_to(values, result.shape)[inside]
        return result


class _JaggedCosts:
    """cost(a, b, h, m) read from the rows of the loop form (see ``kernels.py``)."""

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
        """See :meth:`CostTable.lookup`."""
        least = self.least[starts, ends, helds]
        saturated = memories >= self.saturation[starts, ends, helds]
        stored = (memories >= least) & ~saturated
        result = np.where(saturated, self.arrays.base_s[starts, ends], np.inf)
        indices = self.offsets[starts, ends, helds] + memories - least
        result[stored] = self.values[indices[stored]]
        return result


def _dense_costs_numpy(
    arrays: _ChainArrays, budget_units: int, least: np.ndarray, saturation: np.ndarray
) -> _DenseCosts:
    """The numpy form: cost(a, b, h, m) for every memory up to the budget, the regions as arrays of stops.

    A subproblem's regions are computed only for the memories between its least and
    store-everything peaks (above, "store a" gives the store-everything time). The forward
    peaks of its regions grow with their stop, so every region fits the memories from the
    last one's on, and only the memories below it need a mask of the regions that fit.

    The subproblems are taken by end, then by start from the last: the rests of a region,
    ``(j, b, 0)``, are then the rows of one block of the table kept by end (``[b, j, m]``),
    which stays in cache while every start reads it, and the bodies ``(a, c, 1)`` one
    block of the table kept by start. The program is bound by memory traffic.
    """
    n = arrays.n_stages
    width = budget_units + 1
    memory = np.arange(width, dtype=np.int64)
    tables = (np.full((n, n, width), np.inf), np.full((n, n, width), np.inf))  # h = 0 by end, h = 1 by start
    workspace = np.empty((max(n - 1, 1), width), dtype=np.float64)
    region = np.empty(width, dtype=np.float64)
    n_options = len(arrays.option_names)
    for start in range(n):
        for held in (0, 1):
            fits = memory >= arrays.single_peak[start, held]
            tables[held][start, start, fits] = arrays.forward_backward_s[start]
            for option in range(n_options):
                fits = memory >= arrays.option_single_peak[option, start]
                row = tables[held][start, start]
                row[fits] = np.minimum(row[fits], arrays.option_forward_backward_s[option, start])
    for end in range(1, n):
        rests = tables[0][end]
        for start in range(end - 1, -1, -1):
            length = end - start + 1
            activation = int(arrays.activation[start])
            region.fill(np.inf)
            thresholds = arrays.region_forward_peaks(start, end)
            low = max(int(least[start, end].min()), activation, int(thresholds[0]))
            high = min(width, int(saturation[start, end].max()))
            if low < high:
                recompute_s = arrays.forward_prefix_s[start + 1 : end + 1] - arrays.forward_prefix_s[start]
                options = np.add(
                    rests[start + 1 : end + 1, low - activation : high - activation],
                    recompute_s[:, None],
                    out=workspace[: length - 1, : high - low],
                )
                options += tables[1][start, start:end, low:high]
                split = min(max(int(thresholds[-1]), low), high)
                if split < high:
                    options[:, split - low :].min(axis=0, out=region[split:high])
                if low < split:
                    below = options[:, : split - low]
                    below[memory[None, low:split] < thresholds[:, None]] = np.inf
                    below.min(axis=0, out=region[low:split])
            following = tables[1][start + 1, end] if arrays.saves_output[start] else rests[start + 1]
            for held in (0, 1):
                # "store start" into the row (infinite where it does not fit), then the regions.
                row = rests[start] if held == 0 else tables[1][start, end]
                background = int(arrays.store_background[start, held])
                if background < width:
                    np.add(following[: width - background], arrays.forward_backward_s[start], out=row[background:])
                row[: min(arrays.store_own_peak(start, end, held), width)] = np.inf
                np.minimum(row, region, out=row)
            for option in range(n_options):  # "store start" under each option, the same for both h
                background = int(arrays.option_background[option, start])
                if background >= width:
                    continue
                following = tables[1][start + 1, end] if arrays.option_saves_output[option, start] else rests[start + 1]
                stored = following[: width - background] + arrays.option_forward_backward_s[option, start]
                stored[: max(0, arrays.option_own_peak(option, start, end) - background)] = np.inf
                for held in (0, 1):
                    row = rests[start] if held == 0 else tables[1][start, end]
                    np.minimum(row[background:], stored, out=row[background:])
    return _DenseCosts(*tables)


def _row_offsets(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Where each row of the jagged table starts: rows (j, b, 0) by (b, j), then (a, c, 1)."""
    lengths_rest = np.ascontiguousarray(lengths[:, :, 0].T).reshape(-1)
    lengths_body = lengths[:, :, 1].reshape(-1)
    offsets = np.empty(lengths.shape, dtype=np.int64)
    offsets[:, :, 0] = (np.cumsum(lengths_rest) - lengths_rest).reshape(lengths.shape[:2]).T
    offsets[:, :, 1] = (np.cumsum(lengths_body) - lengths_body).reshape(lengths.shape[:2]) + lengths_rest.sum()
    return offsets, int(lengths_rest.sum() + lengths_body.sum())


def _jagged_costs_compiled(
    arrays: _ChainArrays, budget_units: int, least: np.ndarray, saturation: np.ndarray
) -> _JaggedCosts:
    """The loop form: only the memories between each subproblem's least and store-everything peaks."""
    lengths = np.clip(np.minimum(saturation, budget_units + 1) - least, 0, None)
    lengths[np.tril_indices(arrays.n_stages, -1)] = 0
    offsets, total = _row_offsets(lengths)
    _, compiled_costs = compiled_programs()
    values = compiled_costs(
        budget_units,
        arrays.activation,
        arrays.first_forward,
        arrays.region_inner_forward,
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
        arrays.option_background,
        arrays.option_backward,
        arrays.option_single_peak,
        arrays.option_saves_output,
        arrays.option_forward_backward_s,
    )
    return _JaggedCosts(arrays, least, saturation, offsets, values)


def cost_table(
    arrays: _ChainArrays, budget_units: int, least: np.ndarray, saturation: np.ndarray, implementation: str
) -> CostTable:
    """Runs the time program for the memories up to ``budget_units``.

    Args:
        arrays: the chain in whole units.
        budget_units: the largest memory of the table.
        least: the least peaks of every subproblem (from :func:`least_peaks`).
        saturation: the store-everything peaks of every subproblem (likewise).
        implementation: "numba" for the compiled loops, anything else for numpy.
    """
    if implementation != "numba":
        return _dense_costs_numpy(arrays, budget_units, least, saturation)
    return _jagged_costs_compiled(arrays, budget_units, least, saturation)
