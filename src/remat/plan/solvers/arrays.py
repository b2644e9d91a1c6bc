"""The dynamic program's view of a chain: its sizes in whole memory units, and its peak terms.

The NOTE below is the program's accounting; the peak formulas that every form of the program
shares (numpy, numba, plan reconstruction, :func:`_plan_peak_units`) are in ``kernels.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.plan.operations import Offload, PlanItem, PlanTree, Store
from remat.plan.profile import ChainProfile
from remat.plan.solvers import kernels

__all__: list[str] = []

#: inner(a, j) of a region the profile forbids: above any budget, and small enough that the
#: program's sums of a few such terms stay below :data:`~.kernels.INT_INFINITY`.
FORBIDDEN_REGION = np.int64(2**58)


# NOTE [memory accounting of the dynamic program]
# The program is exact with respect to simulate() (simulate.py) for every plan tree in which
# no level ends with a region; plans that do are never better (see "trailing regions").
#
# Subproblem (a, b, h), 0 <= a <= b <= n-1: run the items of one level covering stages
# a..b, i.e. their forwards, then (when b = n-1, the top level) the loss marker, then their
# backwards, recomputing regions' bodies as the backward reaches them. Its peak is counted
# relative to the bytes that stay constant during it ("background"), and includes:
#   X = bytes of x_a (0 for a = 0), live during the first operation at least. h says whether
#       something outside keeps x_a for the whole subproblem: the checkpoint of the region
#       whose body this is, or the "output" holder of a stored stage a-1 that saves its
#       output. With h = 0, x_a's only outside holder is the frontier, gone after the first
#       operation.
#   G = bytes of G_{b+1} when b < n-1: a recomputed body runs with the gradient of its output
#       live until backward(b), the first backward of the subproblem. When b = n-1 there is
#       no G before the loss marker.
# The live bytes after an operation never exceed its peak (simulate's note), and the last
# operation of a subproblem is a backward, so only the peaks during operations matter;
# releases that happen when the subproblem ends (the checkpoint of x_a) do not.
#
# Option "store a" (a < b): forward_store(a), then subproblem (a+1, b, so_a), then backward(a).
#   keep  = X if h or si_a else 0          (x_a after forward_store(a))
#   bg    = keep + S_a                     (constant while (a+1, b) runs)
#   peak  = max(X + G + x_{a+1} + S_a + ft_a,                        forward_store(a)
#               bg + peak(a+1, b, so_a),                              the rest
#               bg + [x_{a+1} if so_a] + G_{a+1} + G_a + bt_a)        backward(a)
#   In the last line G_{b+1} is gone and G_{a+1} is live; x_{a+1} stays only if stage a
#   saves its output (h of the subproblem (a+1, b) is so_a for that reason).
# Option "store a" (a = b < n-1), inside a body:
#   peak  = max(X + G + x_{a+1} + S_a + ft_a,
#               keep + G + [x_{a+1} if so_a] + S_a + G_a + bt_a)
#   The recomputed x_{a+1} feeds nothing: its frontier ends before backward(a), and only
#   stage a's own saving keeps it (the executor stops the recompute once the saved tensors
#   are back, before computing an output nothing keeps).
# Option "store a" (a = b = n-1), the last stage at the top level:
#   peak  = max(X + x_n + S_a + ft_a,
#               keep + x_n + S_a + G_n,                               loss marker
#               keep + [x_n if so_a] + S_a + G_n + G_a + bt_a)        backward(a)
# Option "region [a, j)" (a < j <= b): forward_checkpoint(a), forward_discard(a+1 .. j-1),
#   then subproblem (j, b, 0), then the body, subproblem (a, j-1, 1):
#   peak  = max(X + G + x_{a+1} + S_a + ft_a,                        forward_checkpoint(a)
#               X + G + max_{a<k<j} (x_k + x_{k+1} + S_k + ft_k),     forward_discard(k)
#               X + peak(j, b, 0),                                    the rest; x_a checkpointed
#               peak(a, j-1, 1))                                      the body, with G_j
#   The first two lines are X + G + inner(a, j), with inner(a, j) = max(x_{a+1} + S_a + ft_a,
#   max_{a<k<j} (x_k + x_{k+1} + S_k + ft_k)): the region's forward peak, tabulated once.
#   x_j is held only by its frontier (hence h = 0); when the body starts, the rest has
#   released everything but G_j, which is the body's G. Stages inside the region never hold
#   S_k after their discarding forward, but it was materialised, as simulate() counts it.
#   The body's first item, if a region, is strictly shorter (j' <= j-1 by the same rule).
# The top-level problem is (0, n-1, h) with X = 0. A single stage has only "store".
#
# Trailing regions: a level whose last item is a region [j, b+1) is never better than the
# same level with that region replaced by the items of its body. The body's operations are
# the same in both; without the region, x_j is not pinned by a checkpoint, G_{b+1} (or, at the
# top level, G_n) is not live during the body's forwards, x_{b+1}'s frontier does not outlive
# the first operation of the body, and the discarding forwards are not run: every peak is
# lower or equal and the time is lower. The program therefore only considers j <= b, and it
# is optimal among all plan trees (the brute-force test checks this for small chains).
#
# Memory is discretised: with a slot of ceil(budget / slots) bytes, every size is rounded up
# to whole slots and the budget rounded down, so a plan that fits in slots fits in bytes.
# cost(a, b, h, m) is the least time of the subproblem with a peak of at most m slots; it is
# non-increasing in m, infinite below the least peak mp(a, b, h) of any plan (a min-max
# program computes it), and equal to the store-everything time from the store-everything
# peak sat(a, b, h) on. Only m in [mp, sat) is stored, which is where the work is:
#   cost(store a)      = f_a + b_a + cost(a+1, b, so_a, m - bg)       when m >= its own peaks
#   cost(region [a,j)) = (f_a + .. + f_{j-1}) + cost(j, b, 0, m - X) + cost(a, j-1, 1, m)
# A region's cost at m is at least its cost at the largest m of the row, so the m where the
# best cost so far is already below that are skipped (best is non-increasing in m).
# The least peak of the whole chain, computed in exact bytes, is OptimalSolver.minimum_bytes();
# at any budget from it on a plan is returned: the least-peak plan when rounding to slots
# leaves the time program nothing, or when that plan happens to be faster.


@dataclass(frozen=True)
class _ChainArrays:
    """The sizes of a chain in whole units (slots or bytes) and the derived peak terms.

    The comments give each array's shape and, in the notation of the NOTE above, its value.
    """

    n_stages: int
    unit_bytes: int
    activation: np.ndarray  # (n+1,) int64: x_a, with x_0 = 0
    gradient: np.ndarray  # (n+1,) int64: G_a
    saved: np.ndarray  # (n,) int64: S_a
    forward_temp: np.ndarray  # (n,) int64: ft_a
    backward_temp: np.ndarray  # (n,) int64: bt_a
    saves_input: np.ndarray  # (n,) int64 0/1: si_a
    saves_output: np.ndarray  # (n,) int64 0/1: so_a
    first_forward: np.ndarray  # (n,) int64: x_{a+1} + S_a + ft_a
    discard_forward: np.ndarray  # (n,) int64: x_k + x_{k+1} + S_k + ft_k
    region_inner_forward: np.ndarray  # (n, n+1) int64: inner(a, j) for a < j (0 elsewhere)
    outer_gradient: np.ndarray  # (n,) int64: G of a subproblem ending at b (0 for b = n-1)
    store_background: np.ndarray  # (n, 2) int64: bg of "store a" for h = 0, 1
    store_backward: np.ndarray  # (n, 2) int64: peak of backward(a) of "store a", a < b
    single_peak: np.ndarray  # (n, 2) int64: peak of the one-stage subproblem (a, a, h)
    forward_backward_s: np.ndarray  # (n,) float64: forward + backward seconds
    forward_prefix_s: np.ndarray  # (n+1,) float64: cumulative forward seconds
    base_s: np.ndarray  # (n, n) float64: store-everything seconds of stages a..b
    # The profile's store options o (NOTE [stored under a policy] in remat/plan/options.py),
    # (K, n) each; an option that does not apply to a stage has FORBIDDEN_REGION peaks.
    option_names: tuple[str, ...]
    option_background: np.ndarray  # int64: bg of "store a" under o: x_a + S^o_a (both h)
    option_backward: np.ndarray  # int64: peak of backward(a) of "store a" under o (its recompute first)
    option_single_peak: np.ndarray  # int64: peak of the one-stage subproblem (a, a, .) under o
    option_saves_output: np.ndarray  # int64 0/1: so^o_a
    option_forward_backward_s: np.ndarray  # float64: forward + backward + the option's extra seconds

    @classmethod
    def from_profile(cls, profile: ChainProfile, unit_bytes: int) -> _ChainArrays:
        """The arrays of ``profile`` with every size rounded up to whole units of ``unit_bytes``."""
        n = profile.n_stages

        def units(values: tuple[int, ...]) -> np.ndarray:
            raw = np.asarray(values, dtype=np.int64)
            return -(-raw // unit_bytes)  # ceil division: round up

        activation = units(profile.activation_bytes)
        activation[0] = 0
        gradient = units(profile.gradient_bytes)
        saved = units(profile.saved_bytes)
        forward_temp = units(profile.forward_temp_bytes)
        backward_temp = units(profile.backward_temp_bytes)
        saves_input = np.asarray(profile.saves_input, dtype=np.int64)
        saves_output = np.asarray(profile.saves_output, dtype=np.int64)
        first_forward = activation[1:] + saved + forward_temp
        discard_forward = activation[:-1] + activation[1:] + saved + forward_temp
        outer_gradient = gradient[1:].copy()
        outer_gradient[-1] = 0  # no gradient before the loss at the top level
        keep = np.stack([activation[:-1] * saves_input, activation[:-1]], axis=1)
        store_background = keep + saved[:, None]
        output_kept = (activation[1:] * saves_output)[:, None]
        store_backward = store_background + output_kept + (gradient[1:] + gradient[:-1] + backward_temp)[:, None]
        # One-stage subproblems: inside a body (a < n-1) and the last stage at the top level.
        own_forward = (activation[:-1] + outer_gradient + first_forward)[:, None]
        single_peak = np.maximum(
            own_forward,
            keep + output_kept + (outer_gradient + saved + gradient[:-1] + backward_temp)[:, None],
        )
        last = n - 1
        single_peak[last] = np.maximum.reduce(
            [
                np.full(2, own_forward[last, 0]),
                keep[last] + activation[n] + saved[last] + gradient[n],
                keep[last] + output_kept[last] + saved[last] + gradient[n] + gradient[last] + backward_temp[last],
            ]
        )
        forward_s = np.asarray(profile.forward_time_s, dtype=np.float64)
        forward_backward_s = forward_s + np.asarray(profile.backward_time_s, dtype=np.float64)
        forward_prefix_s = np.concatenate(([0.0], np.cumsum(forward_s)))
        # base_s[a, b] = sum of forward_backward_s[a .. b] (0 below the diagonal), summed
        # from b down to a as the programs add them.
        base_s = np.zeros((n, n), dtype=np.float64)
        base_s[n - 1, n - 1] = forward_backward_s[n - 1]
        for start in range(n - 2, -1, -1):
            base_s[start, start] = forward_backward_s[start]
            base_s[start, start + 1 :] = forward_backward_s[start] + base_s[start + 1, start + 1 :]
        # Store options: x_a is kept (the block keeps its input), S^o_a held; the backward
        # first runs the forward again, then the backward proper, on top of G_{a+1}.
        n_options = len(profile.store_options)
        option_background = np.full((n_options, n), FORBIDDEN_REGION, dtype=np.int64)
        option_backward = np.full((n_options, n), FORBIDDEN_REGION, dtype=np.int64)
        option_single_peak = np.full((n_options, n), FORBIDDEN_REGION, dtype=np.int64)
        option_saves_output = np.zeros((n_options, n), dtype=np.int64)
        option_forward_backward_s = np.zeros((n_options, n), dtype=np.float64)
        for index, option in enumerate(profile.store_options):
            applies = np.asarray([value is not None for value in option.saved_bytes])
            kept = units(tuple(0 if value is None else value for value in option.saved_bytes))
            saves = np.asarray(option.saves_output, dtype=np.int64)
            background = activation[:-1] + kept
            recompute = (1 - saves) * activation[1:] + saved + forward_temp
            backward = saved + gradient[:-1] + backward_temp
            # K is taken off, so rounded down: the peak in units stays at least the real one
            shared = np.asarray(option.shared_bytes or [0] * n, dtype=np.int64) // unit_bytes
            peak = background - shared + gradient[1:] + saves * activation[1:] + np.maximum(recompute, backward)
            single = np.maximum(own_forward[:, 0], peak)
            single[last] = max(single[last], background[last] + activation[n] + gradient[n])
            option_background[index] = np.where(applies, background, FORBIDDEN_REGION)
            option_backward[index] = np.where(applies, peak, FORBIDDEN_REGION)
            option_single_peak[index] = np.where(applies, single, FORBIDDEN_REGION)
            option_saves_output[index] = saves
            option_forward_backward_s[index] = forward_backward_s + np.asarray(option.extra_time_s)
        return cls(
            n_stages=n,
            unit_bytes=unit_bytes,
            activation=activation,
            gradient=gradient,
            saved=saved,
            forward_temp=forward_temp,
            backward_temp=backward_temp,
            saves_input=saves_input,
            saves_output=saves_output,
            first_forward=first_forward,
            discard_forward=discard_forward,
            region_inner_forward=_region_inner_forward(first_forward, discard_forward, profile.allowed_regions()),
            outer_gradient=outer_gradient,
            store_background=store_background,
            store_backward=store_backward,
            single_peak=single_peak,
            forward_backward_s=forward_backward_s,
            forward_prefix_s=forward_prefix_s,
            base_s=base_s,
            option_names=tuple(option.name for option in profile.store_options),
            option_background=option_background,
            option_backward=option_backward,
            option_single_peak=option_single_peak,
            option_saves_output=option_saves_output,
            option_forward_backward_s=option_forward_backward_s,
        )

    @property
    def single_least(self) -> np.ndarray:
        """(n, 2) int64: the least peak of each one-stage subproblem, stored whole or under an option."""
        if not self.option_names:
            return self.single_peak
        return np.minimum(self.single_peak, self.option_single_peak.min(axis=0)[:, None])

    def option_own_peak(self, option: int, start: int, end: int) -> int:
        """The peak of "store start" under store option ``option`` (0-based) without the rest of ``(start, end, .)``."""
        if start == end:
            return int(self.option_single_peak[option, start])
        return int(
            kernels.option_own_peak(
                self.activation, self.outer_gradient, self.first_forward, self.option_backward, option, start, end
            )
        )

    def store_own_peak(self, start: int, end: int, held: int) -> int:
        """The peak of "store start" without the rest of the subproblem (start, end, held)."""
        if start == end:
            return int(self.single_peak[start, held])
        return int(
            kernels.store_own_peak(
                self.activation, self.outer_gradient, self.first_forward, self.store_backward, start, end, held
            )
        )

    def region_forward_peak(self, start: int, stop: int, end: int) -> int:
        """The forward peak of the region ``[start, stop)`` in a subproblem ending at ``end``."""
        return int(
            kernels.region_forward_peak(
                self.activation, self.outer_gradient, self.region_inner_forward, start, stop, end
            )
        )

    def region_forward_peaks(self, start: int, end: int) -> np.ndarray:
        """The forward peaks of the regions ``[start, stop)``, stop in ``start+1 .. end``, ending at ``end``."""
        stops = slice(start + 1, end + 1)
        return kernels.region_forward_peak(
            self.activation, self.outer_gradient, self.region_inner_forward, start, stops, end
        )

    def region_peaks(self, least: np.ndarray, start: int, end: int) -> np.ndarray:
        """The least peaks of the regions ``[start, stop)``, stop in ``start+1 .. end``, ending at ``end``.

        Args:
            least: the least peaks of the shorter subproblems.
            start: the first stage of the regions.
            end: the last stage of the subproblem.
        """
        rests = least[start + 1 : end + 1, end, 0]
        bodies = least[start, start:end, 1]
        return kernels.region_peak(self.region_forward_peaks(start, end), self.activation[start], rests, bodies)


def _region_inner_forward(first_forward: np.ndarray, discard_forward: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """inner(a, j) of the NOTE above, at ``[a, j]`` for a < j <= n; 0 for j <= a.

    The largest of the checkpointing forward of ``a`` and the discarding forwards of
    ``a+1 .. j-1``: a running maximum along each row. A region the profile forbids
    (``allowed[a, j]`` False: it crosses a break or holds a pinned stage) gets
    :data:`FORBIDDEN_REGION`, a forward peak no budget reaches, so no form of the program
    picks it.
    """
    n = first_forward.shape[0]
    stage = np.arange(n)
    # [a, k] = discard_forward[k] for k > a, else first_forward[a] (neutral for the maximum).
    forwards = np.where(stage[None, :] > stage[:, None], discard_forward[None, :], first_forward[:, None])
    inner = np.zeros((n, n + 1), dtype=np.int64)
    inner[:, 1:] = np.maximum.accumulate(forwards, axis=1)
    inner[~allowed] = FORBIDDEN_REGION
    inner[np.tril_indices(n, 0, n + 1)] = 0
    return inner


def _plan_peak_units(arrays: _ChainArrays, plan: PlanTree) -> int:
    """The peak of a plan by the dynamic program's accounting (in the units of ``arrays``).

    Used to check that the accounting agrees with :func:`~remat.plan.simulate.simulate`.

    Raises:
        ValueError: a level of the plan ends with a region (outside the program's family).
    """

    def level_peak(items: tuple[PlanItem, ...], start: int, end: int, held: int) -> int:
        first = items[0]
        if isinstance(first, Offload):
            raise ValueError(f"stage {first.stage} is offloaded: outside the program's family")
        if isinstance(first, Store) and first.option is not None:
            option = arrays.option_names.index(first.option)
            own = arrays.option_own_peak(option, start, end)
            if start == end:
                return own
            background = int(arrays.option_background[option, start])
            rest = level_peak(items[1:], start + 1, end, int(arrays.option_saves_output[option, start]))
            return max(own, background + rest)
        if isinstance(first, Store):
            own = arrays.store_own_peak(start, end, held)
            if start == end:
                return own
            background = int(arrays.store_background[start, held])
            rest = level_peak(items[1:], start + 1, end, int(arrays.saves_output[start]))
            return max(own, background + rest)
        if len(items) == 1:
            raise ValueError(f"the level ending at stage {end} ends with a region")
        forward = arrays.region_forward_peak(first.start, first.stop, end)
        rest = level_peak(items[1:], first.stop, end, 0)
        body = level_peak(first.body, first.start, first.stop - 1, 1)
        return max(forward, int(arrays.activation[start]) + rest, body)

    return level_peak(plan, 0, arrays.n_stages - 1, 0)
