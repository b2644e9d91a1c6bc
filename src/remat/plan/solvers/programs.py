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
from remat.plan.solvers.kernels import INT_INFINITY, close_subproblem, compiled_programs, one_stage_peaks

__all__ = ["CostTable", "cost_table", "least_peaks"]


# ------------------------------------------------------------ the least-peak program


def _least_peaks_numpy(arrays: _ChainArrays) -> tuple[np.ndarray, np.ndarray]:
    """The numpy form: the regions of a subproblem as one array of stops."""
    least, saturation = one_stage_peaks(arrays.single_peak, INT_INFINITY)
    n = arrays.n_stages
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            region = arrays.region_peaks(least, start, end).min()
            close_subproblem(
                least,
                saturation,
                region,
                start,
                end,
                arrays.activation,
                arrays.outer_gradient,
                arrays.first_forward,
                arrays.store_background,
                arrays.store_backward,
                arrays.saves_output,
            )
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
        INT_INFINITY,
    )


# ------------------------------------------------------------ the time program


class CostTable(Protocol):
    """The least time of every subproblem under every memory (in the units of its arrays)."""

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """cost(a, b, h, m) in seconds for arrays of subproblems and memories (inf when infeasible)."""
        ...


class _DenseCosts:
    """cost(a, b, h, m) read from the numpy form's table ``[h, a, b, m]``."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    def lookup(self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray) -> np.ndarray:
        """See :meth:`CostTable.lookup`."""
        inside = memories >= 0
        result = np.full(np.broadcast(starts, memories).shape, np.inf)
        values = self.table[helds, starts, ends, np.maximum(memories, 0)]
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


def _dense_costs_numpy(arrays: _ChainArrays, budget_units: int) -> _DenseCosts:
    """The numpy form: cost(a, b, h, m) for every memory up to the budget, the regions as arrays of stops."""
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
            region = np.full(width, np.inf)
            if activation < width:
                recompute_s = arrays.forward_prefix_s[start + 1 : end + 1] - arrays.forward_prefix_s[start]
                rest = table[0, start + 1 : end + 1, end, : width - activation]
                body = table[1, start, start:end, activation:]
                options = recompute_s[:, None] + rest + body
                options[memory[None, activation:] < arrays.region_forward_peaks(start, end)[:, None]] = np.inf
                region[activation:] = options.min(axis=0)
            following = table[int(arrays.saves_output[start]), start + 1, end]
            for held in (0, 1):
                background = int(arrays.store_background[start, held])
                store = np.full(width, np.inf)
                if background < width:
                    store[background:] = arrays.forward_backward_s[start] + following[: width - background]
                store[: min(arrays.store_own_peak(start, end, held), width)] = np.inf
                table[held, start, end] = np.minimum(store, region)
    return _DenseCosts(table)


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
        return _dense_costs_numpy(arrays, budget_units)
    return _jagged_costs_compiled(arrays, budget_units, least, saturation)
