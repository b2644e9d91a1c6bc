"""Solvers: from a chain profile and a memory budget to a recompute schedule.

Every solver follows one contract (:class:`Solver`): its configuration goes to
``__init__``, the problem to ``__call__(profile, budget_bytes)``, which returns a
:class:`~remat.plan.schedule.Schedule`. Solvers are registered under lowercase names:

=============  ===============================================================
``"optimal"``  the dynamic program: the fastest schedule that fits the budget
``"auto"``     the dynamic program, with the implementation picked by size
``"none"``     store everything (no recomputation)
``"inputs"``   keep only the input of every stage, recompute the rest
``"periodic"`` ``torch.utils.checkpoint.checkpoint_sequential``'s segments
=============  ===============================================================

>>> schedule = get_solver("optimal", slots=500)(profile, 2 * 2**30)  # doctest: +SKIP
>>> print(schedule)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from remat.errors import BudgetTooSmall, InvalidBudget, RematError
from remat.plan.profile import ChainProfile
from remat.plan.operations import PlanItem as Item, PlanTree as Plan, Region, Store
from remat.plan.schedule import Schedule

__all__ = [
    "AutoSolver",
    "OptimalSolver",
    "PeriodicSolver",
    "Solver",
    "StoreEverythingSolver",
    "StoreInputsSolver",
    "available_solvers",
    "get_solver",
    "numba_available",
    "register_solver",
    "solve",
    "store_everything_plan",
]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024
_INT_INFINITY = np.int64(2**62)


@runtime_checkable
class Solver(Protocol):
    """What every solver is: configured once, then called on problems.

    Implementations take their options as keyword arguments of ``__init__`` and solve in
    ``__call__``. A solver that cannot fit the budget raises
    :class:`~remat.errors.BudgetTooSmall` with the smallest budget it could fit.
    """

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Plans the chain of ``profile`` within ``budget_bytes`` (None: unlimited).

        Raises:
            BudgetTooSmall: no schedule of this solver fits the budget.
            InvalidBudget: the budget is not a whole number of bytes >= 0, nor None.
        """
        ...


# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., Solver]] = {}


def register_solver(name: str, factory: Callable[..., Solver], *, replace: bool = False) -> None:
    """Registers a solver under a lowercase name, for :func:`get_solver` and :func:`solve`.

    Args:
        name: the lowercase name, e.g. ``"my-heuristic"``.
        factory: a class (or function) whose keyword arguments are the solver's options
            and which returns a :class:`Solver`.
        replace: allow replacing a solver already registered under ``name``.

    Raises:
        ValueError: the name is empty or not lowercase, or is taken and ``replace`` is False.
    """
    if not isinstance(name, str) or not name or name != name.lower() or name != name.strip():
        raise ValueError(f"solver names are non-empty lowercase strings, got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a solver named {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = factory


def available_solvers() -> tuple[str, ...]:
    """Returns the names of the registered solvers, sorted."""
    return tuple(sorted(_REGISTRY))


def get_solver(name: str, **options: Any) -> Solver:
    """Makes the solver registered under ``name`` with the given options.

    Args:
        name: a name from :func:`available_solvers` (case does not matter).
        **options: the solver's options, e.g. ``slots=1000`` for ``"optimal"``.

    Raises:
        RematError: no solver has that name (the message lists the valid names).
        TypeError: an option is not one the solver takes.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _REGISTRY:
        raise RematError(
            f"unknown solver {name!r}; the solvers are {', '.join(map(repr, available_solvers()))}"
        ) from None
    return _REGISTRY[key](**options)


def solve(
    profile: ChainProfile,
    budget_bytes: int | None = None,
    *,
    solver: str | Solver = "auto",
    **options: Any,
) -> Schedule:
    """Plans a chain under a memory budget: the one-call form of the solver registry.

    Args:
        profile: the chain profile (measured, or loaded with :meth:`ChainProfile.load`).
        budget_bytes: the most bytes the activations, saved values and gradients of the
            chain may occupy at once; None for no limit (store everything).
        solver: a registered solver name, or a solver instance (then ``options`` must be
            empty).
        **options: options of the named solver.

    Returns:
        The schedule, with its predicted peak, time and report (``print(schedule)``).

    Raises:
        BudgetTooSmall: nothing fits; ``.minimum_bytes`` is the smallest budget that does.
        InvalidBudget: the budget is not a whole number of bytes >= 0, nor None.
        RematError: the solver name is unknown.
    """
    if isinstance(solver, str):
        instance = get_solver(solver, **options)
    else:
        if options:
            raise TypeError(
                "options go to the solver's constructor when a solver instance is given"
            )
        instance = solver
    return instance(profile, budget_bytes)


def numba_available() -> bool:
    """Whether numba can be imported (the fast implementation of the dynamic program)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- helpers


def _check_budget(budget_bytes: Any) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise InvalidBudget(
            f"budget_bytes must be a whole number of bytes or None, got {budget_bytes!r}; "
            "parse strings such as '512MiB' and fractions with remat.parse_budget first"
        )
    if budget_bytes < 0:
        raise InvalidBudget(f"budget_bytes must be >= 0, got {budget_bytes}")
    return int(budget_bytes)


def _budget_too_small(
    solver_name: str, profile: ChainProfile, budget_bytes: int, minimum_bytes: int, advice: str
) -> BudgetTooSmall:
    message = (
        f"solver {solver_name!r}: no schedule of the {profile.n_stages}-stage chain fits the "
        f"budget of {budget_bytes} bytes ({budget_bytes / _MIB:.2f} MiB); the smallest budget "
        f"it can fit is {minimum_bytes} bytes ({minimum_bytes / _MIB:.2f} MiB). {advice}"
    )
    return BudgetTooSmall(message, budget_bytes=budget_bytes, minimum_bytes=minimum_bytes)


def store_everything_plan(n_stages: int) -> Plan:
    """Returns the plan that stores every stage (no recomputation)."""
    return tuple(Store(stage) for stage in range(n_stages))


def _fixed_plan_schedule(
    solver_name: str, profile: ChainProfile, budget_bytes: Any, plan: Plan, advice: str
) -> Schedule:
    budget = _check_budget(budget_bytes)
    schedule = Schedule.from_plan(profile, plan, budget_bytes=budget, solver_name=solver_name)
    if budget is not None and schedule.predicted_peak_bytes > budget:
        raise _budget_too_small(
            solver_name, profile, budget, schedule.predicted_peak_bytes, advice
        ) from None
    return schedule


_ADVICE_OPTIMAL = (
    "Raise the budget, or, if the model allows it, split it into more stages or use a "
    "smaller batch."
)
_ADVICE_BASELINE = "Raise the budget or use the 'optimal' solver, which needs less memory."


# ---------------------------------------------------------------------------- baselines


class StoreEverythingSolver:
    """``"none"``: store every stage, recompute nothing (the fastest schedule)."""

    name: ClassVar[str] = "none"

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the store-everything schedule if it fits the budget.

        Raises:
            BudgetTooSmall: its peak is above the budget (``minimum_bytes`` is that peak).
        """
        plan = store_everything_plan(profile.n_stages)
        return _fixed_plan_schedule(self.name, profile, budget_bytes, plan, _ADVICE_BASELINE)


class StoreInputsSolver:
    """``"inputs"``: keep only the input of every stage and recompute each stage once.

    Every stage but the last is a one-stage region; the last stage is stored, since a
    region there would be recomputed right after it ran.
    """

    name: ClassVar[str] = "inputs"

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the keep-inputs schedule if it fits the budget.

        Raises:
            BudgetTooSmall: its peak is above the budget (``minimum_bytes`` is that peak).
        """
        plan = self.plan_of(profile.n_stages)
        return _fixed_plan_schedule(self.name, profile, budget_bytes, plan, _ADVICE_BASELINE)

    @staticmethod
    def plan_of(n_stages: int) -> Plan:
        """The keep-inputs plan of a chain of ``n_stages`` stages."""
        return tuple(Region(stage, stage + 1, (Store(stage),)) for stage in range(n_stages - 1)) + (
            Store(n_stages - 1),
        )


class PeriodicSolver:
    """``"periodic"``: equal segments, as ``torch.utils.checkpoint.checkpoint_sequential``.

    The chain is cut into ``segments`` segments of ``n // segments`` stages, the last one
    taking the remainder. Every segment but the last is a region whose body stores all its
    stages; the last segment is stored.

    Args:
        segments: the number of segments; default ``ceil(sqrt(n))``. Clipped to ``n``.

    Raises:
        ValueError: ``segments`` is not a positive integer.
    """

    name: ClassVar[str] = "periodic"

    def __init__(self, *, segments: int | None = None) -> None:
        if segments is not None and (
            isinstance(segments, bool) or not isinstance(segments, numbers.Integral) or segments < 1
        ):
            raise ValueError(f"segments must be a positive integer or None, got {segments!r}")
        self.segments = None if segments is None else int(segments)

    def plan(self, n_stages: int) -> Plan:
        """Returns the periodic plan of a chain of ``n_stages`` stages."""
        segments = self.segments if self.segments is not None else math.isqrt(n_stages - 1) + 1
        segments = min(segments, n_stages)
        size = n_stages // segments
        items: list[Item] = []
        for start in range(0, size * (segments - 1), size):
            body = tuple(Store(stage) for stage in range(start, start + size))
            items.append(Region(start, start + size, body))
        items.extend(Store(stage) for stage in range(size * (segments - 1), n_stages))
        return tuple(items)

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the periodic schedule if it fits the budget.

        Raises:
            BudgetTooSmall: its peak is above the budget (``minimum_bytes`` is that peak).
        """
        plan = self.plan(profile.n_stages)
        return _fixed_plan_schedule(self.name, profile, budget_bytes, plan, _ADVICE_BASELINE)


# ---------------------------------------------------------------------------- the dynamic program

# NOTE [memory accounting of the dynamic program]
# The program is exact with respect to simulate() (schedule.py) for every plan tree in which
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
# The least peak of the whole chain, computed in exact bytes, is BudgetTooSmall.minimum_bytes;
# at any budget from it on a plan is returned: the least-peak plan when rounding to slots
# leaves the time program nothing, or when that plan happens to be faster.


@dataclass(frozen=True)
class _ChainArrays:
    """The sizes of a chain in whole units (slots or bytes) and the derived peak terms."""

    n_stages: int
    unit_bytes: int
    activation: np.ndarray  # (n+1,) int64, activation[0] = 0
    gradient: np.ndarray  # (n+1,) int64
    saved: np.ndarray  # (n,) int64
    forward_temp: np.ndarray  # (n,) int64
    backward_temp: np.ndarray  # (n,) int64
    saves_input: np.ndarray  # (n,) int64 0/1
    saves_output: np.ndarray  # (n,) int64 0/1
    first_forward: np.ndarray  # (n,) int64: x_{a+1} + S_a + ft_a
    discard_forward: np.ndarray  # (n,) int64: x_k + x_{k+1} + S_k + ft_k
    outer_gradient: np.ndarray  # (n,) int64: G of a subproblem ending at b (0 for b = n-1)
    store_background: np.ndarray  # (n, 2) int64: bg of "store a" for h = 0, 1
    store_backward: np.ndarray  # (n, 2) int64: peak of backward(a) of "store a", a < b
    single_peak: np.ndarray  # (n, 2) int64: peak of the one-stage subproblem (a, a, h)
    forward_backward_s: np.ndarray  # (n,) float64: forward + backward seconds
    forward_prefix_s: np.ndarray  # (n+1,) float64: cumulative forward seconds
    base_s: np.ndarray  # (n, n) float64: store-everything seconds of stages a..b

    @classmethod
    def from_profile(cls, profile: ChainProfile, unit_bytes: int) -> _ChainArrays:
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
        store_backward = (
            store_background + output_kept + (gradient[1:] + gradient[:-1] + backward_temp)[:, None]
        )
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
                keep[last]
                + output_kept[last]
                + saved[last]
                + gradient[n]
                + gradient[last]
                + backward_temp[last],
            ]
        )
        forward_s = np.asarray(profile.forward_time_s, dtype=np.float64)
        forward_backward_s = forward_s + np.asarray(profile.backward_time_s, dtype=np.float64)
        forward_prefix_s = np.concatenate(([0.0], np.cumsum(forward_s)))
        base_s = np.zeros((n, n), dtype=np.float64)
        for stop in range(n):
            base_s[stop, stop] = forward_backward_s[stop]
            for start in range(stop - 1, -1, -1):
                base_s[start, stop] = forward_backward_s[start] + base_s[start + 1, stop]
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
            outer_gradient=outer_gradient,
            store_background=store_background,
            store_backward=store_backward,
            single_peak=single_peak,
            forward_backward_s=forward_backward_s,
            forward_prefix_s=forward_prefix_s,
            base_s=base_s,
        )

    def store_own_peak(self, start: int, stop: int, held: int) -> int:
        """The peak of "store start" without the rest of the subproblem (start..stop)."""
        if start == stop:
            return int(self.single_peak[start, held])
        forward = self.activation[start] + self.outer_gradient[stop] + self.first_forward[start]
        return int(max(forward, self.store_backward[start, held]))

    def region_forward_peak(self, start: int, stop: int, end: int) -> int:
        """The peak of the forwards of region [start, stop) in a subproblem ending at ``end``."""
        inner = self.first_forward[start]
        if stop > start + 1:
            inner = max(inner, int(self.discard_forward[start + 1 : stop].max()))
        return int(self.activation[start] + self.outer_gradient[end] + inner)


def _plan_peak_units(arrays: _ChainArrays, plan: Plan) -> int:
    """The peak of a plan by the dynamic program's accounting (in the units of ``arrays``).

    Used to check that the accounting agrees with :func:`simulate`.

    Raises:
        ValueError: a level of the plan ends with a region (outside the program's family).
    """

    def level_peak(items: tuple[Item, ...], start: int, end: int, held: int) -> int:
        first = items[0]
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


# ------------------------------------------------------------ min-max program: least peaks


def _least_peaks_numpy(arrays: _ChainArrays) -> tuple[np.ndarray, np.ndarray]:
    """Returns (least peak, store-everything peak) of every subproblem, shape (n, n, 2)."""
    n = arrays.n_stages
    least = np.full((n, n, 2), _INT_INFINITY, dtype=np.int64)
    saturation = np.full((n, n, 2), _INT_INFINITY, dtype=np.int64)
    for start in range(n):
        least[start, start] = arrays.single_peak[start]
        saturation[start, start] = arrays.single_peak[start]
    for length in range(2, n + 1):
        for start in range(0, n - length + 1):
            end = start + length - 1
            activation = arrays.activation[start]
            outer = activation + arrays.outer_gradient[end]
            inner = np.maximum.accumulate(
                np.concatenate(
                    ([arrays.first_forward[start]], arrays.discard_forward[start + 1 : end])
                )
            )
            region = np.maximum(
                np.maximum(outer + inner, activation + least[start + 1 : end + 1, end, 0]),
                least[start, start:end, 1],
            ).min()
            held_next = arrays.saves_output[start]
            for held in (0, 1):
                own = max(outer + arrays.first_forward[start], arrays.store_backward[start, held])
                background = arrays.store_background[start, held]
                store = max(own, background + least[start + 1, end, held_next])
                least[start, end, held] = min(store, region)
                saturation[start, end, held] = max(
                    own, background + saturation[start + 1, end, held_next]
                )
    return least, saturation


@functools.lru_cache(maxsize=1)
def _numba_kernels() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Compiles (once; cached on disk) the numba kernels of the two programs."""
    import numba

    @numba.njit(cache=True)
    def least_peaks(  # pragma: no cover - compiled
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
                    saturation[start, end, held] = max(
                        own, background + saturation[start + 1, end, held_next]
                    )
        return least, saturation

    @numba.njit(cache=True)
    def costs(  # pragma: no cover - compiled
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
                high = min(
                    budget_units + 1, max(saturation[start, end, 0], saturation[start, end, 1])
                )
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
                            target[index] = min(
                                target[index], recompute_s + rest_row[index] + body_row[index]
                            )
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
                                target[index] = min(
                                    target[index], recompute_s + rest_row[index] + body_base
                                )
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

    return least_peaks, costs


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
            _INT_INFINITY,
        )
    return _least_peaks_numpy(arrays)


# ------------------------------------------------------------ the time program


class _CostTable(Protocol):
    def lookup(
        self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray
    ) -> np.ndarray:
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

    def lookup(
        self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray
    ) -> np.ndarray:
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

    def lookup(
        self, starts: np.ndarray, ends: np.ndarray, helds: np.ndarray, memories: np.ndarray
    ) -> np.ndarray:
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
    offsets[:, :, 1] = (np.cumsum(lengths_body) - lengths_body).reshape(
        lengths.shape[:2]
    ) + lengths_rest.sum()
    return offsets, int(lengths_rest.sum() + lengths_body.sum())


def _costs_numba(
    arrays: _ChainArrays, budget_units: int, least: np.ndarray, saturation: np.ndarray
) -> _JaggedCosts:
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
                inner = np.maximum.accumulate(
                    np.concatenate(
                        ([arrays.first_forward[start]], arrays.discard_forward[start + 1 : end])
                    )
                )
                recompute_s = (
                    arrays.forward_prefix_s[start + 1 : end + 1] - arrays.forward_prefix_s[start]
                )
                rest = table[0, start + 1 : end + 1, end, : width - activation]
                body = table[1, start, start:end, activation:]
                options = recompute_s[:, None] + rest + body
                options[memory[None, activation:] < (outer + inner)[:, None]] = np.inf
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
                    store[background:] = (
                        arrays.forward_backward_s[start] + following[: width - background]
                    )
                store[: min(own, width)] = np.inf
                table[held, start, end] = np.minimum(store, region)
    return _DenseCosts(table)


# ------------------------------------------------------------ reconstruction


@dataclass
class _Frame:
    """A level of the plan being built: its items so far and the subproblem left."""

    items: list[Item]
    origin: int
    start: int
    end: int
    held: int
    memory: int
    parent: _Frame | None


def _build_plan(
    arrays: _ChainArrays, memory: int, choose: Callable[[int, int, int, int], int]
) -> Plan:
    """Builds the plan from the top-level problem, asking ``choose`` at every subproblem.

    ``choose(start, end, held, memory)`` returns 0 for "store start" or the stop of the
    region to open. Iterative, so that deep nestings do not hit Python's recursion limit.
    """
    root = _Frame([], 0, 0, arrays.n_stages - 1, 0, memory, None)
    stack = [root]
    while stack:
        frame = stack[-1]
        if frame.start > frame.end:
            stack.pop()
            if frame.parent is not None:
                region = Region(frame.origin, frame.end + 1, tuple(frame.items))
                frame.parent.items.append(region)
            continue
        start = frame.start
        stop = choose(start, frame.end, frame.held, frame.memory)
        if stop == 0:
            frame.items.append(Store(start))
            frame.memory -= int(arrays.store_background[start, frame.held])
            frame.held = int(arrays.saves_output[start])
            frame.start = start + 1
        else:
            stack.append(_Frame([], start, start, stop - 1, 1, frame.memory, frame))
            frame.memory -= int(arrays.activation[start])
            frame.held = 0
            frame.start = stop
    return tuple(root.items)


def _fastest_choice(arrays: _ChainArrays, costs: _CostTable) -> Callable[[int, int, int, int], int]:
    """Picks, at each subproblem, the option of least cost (storing on near-ties)."""
    relative_tolerance = 1e-12

    def choose(start: int, end: int, held: int, memory: int) -> int:
        if start == end:
            return 0
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
        stops = np.arange(start + 1, end + 1)
        inner = np.maximum.accumulate(
            np.concatenate(([arrays.first_forward[start]], arrays.discard_forward[start + 1 : end]))
        )
        activation = int(arrays.activation[start])
        feasible = memory >= activation + arrays.outer_gradient[end] + inner
        recompute_s = arrays.forward_prefix_s[stops] - arrays.forward_prefix_s[start]
        rest = costs.lookup(
            stops, np.full_like(stops, end), np.zeros_like(stops), np.array(memory - activation)
        )
        body = costs.lookup(
            np.full_like(stops, start), stops - 1, np.ones_like(stops), np.array(memory)
        )
        regions = np.where(feasible, recompute_s + rest + body, np.inf)
        best_index = int(np.argmin(regions))
        best = float(regions[best_index])
        if math.isinf(store) and math.isinf(best):
            raise RematError(
                f"internal error: subproblem ({start}, {end}, {held}) has no plan within "
                f"{memory} slots"
            )
        if store <= best + relative_tolerance * abs(best):
            return 0
        return int(stops[best_index])

    return choose


def _least_peak_choice(
    arrays: _ChainArrays, least: np.ndarray
) -> Callable[[int, int, int, int], int]:
    """Picks "store" at each subproblem if it fits in memory, else the shortest region that does."""

    def choose(start: int, end: int, held: int, memory: int) -> int:
        if start == end:
            return 0
        background = int(arrays.store_background[start, held])
        store = max(
            arrays.store_own_peak(start, end, held),
            background + int(least[start + 1, end, arrays.saves_output[start]]),
        )
        if store <= memory:
            return 0
        activation = int(arrays.activation[start])
        inner = np.maximum.accumulate(
            np.concatenate(([arrays.first_forward[start]], arrays.discard_forward[start + 1 : end]))
        )
        peaks = np.maximum(
            np.maximum(
                activation + arrays.outer_gradient[end] + inner,
                activation + least[start + 1 : end + 1, end, 0],
            ),
            least[start, start:end, 1],
        )
        fitting = np.flatnonzero(peaks <= memory)
        if fitting.size == 0:
            raise RematError(
                f"internal error: no plan of ({start}, {end}, {held}) within {memory} bytes"
            )
        return start + 1 + int(fitting[0])

    return choose


#: Chains up to this length get a second, relaxed pass of the dynamic program.
_RELAXED_PASS_MAX_STAGES = 120


def _baseline_plans(n_stages: int) -> list[Plan]:
    """Store-inputs and the periodic plans with 2 .. 2*sqrt(n) segments."""
    plans: list[Plan] = [StoreInputsSolver.plan_of(n_stages)] if n_stages > 1 else []
    for segments in range(2, min(n_stages, 2 * (math.isqrt(n_stages) + 1)) + 1):
        plans.append(PeriodicSolver(segments=segments).plan(n_stages))
    return plans


def _plan_time_s(profile: ChainProfile, plan: Plan) -> float:
    """The time of a plan from its forward counts, without simulating it."""
    counts = [0] * profile.n_stages
    pending: list[Item] = list(plan)
    while pending:
        item = pending.pop()
        if isinstance(item, Store):
            counts[item.stage] += 1
        else:
            for stage in range(item.start, item.stop):
                counts[stage] += 1
            pending.extend(item.body)
    return math.fsum(
        [count * forward_s for count, forward_s in zip(counts, profile.forward_time_s, strict=True)]
        + list(profile.backward_time_s)
    )


# ------------------------------------------------------------ the solvers


def _resolve_implementation(implementation: str | None) -> str:
    if implementation is None:
        return "numba" if numba_available() else "numpy"
    if implementation not in ("numba", "numpy"):
        raise ValueError(f"implementation must be 'numba', 'numpy' or None, got {implementation!r}")
    if implementation == "numba" and not numba_available():
        raise RematError(
            "the numba implementation needs numba: pip install 'remat[fast]' "
            "(or pass implementation='numpy')"
        )
    return implementation


class OptimalSolver:
    """``"optimal"``: the fastest schedule that fits the budget, by dynamic programming.

    The program (see ``NOTE [memory accounting of the dynamic program]`` in this module)
    considers every plan tree of :mod:`remat.plan.schedule` and agrees exactly with
    :func:`~remat.plan.schedule.simulate` when the sizes are whole slots. Sizes are rounded
    up to slots of ``ceil(budget / slots)`` bytes, so the plan's real peak never exceeds the
    budget; more slots waste less of the budget and take longer.

    Args:
        slots: the number of memory slots the budget is divided into (default 500).
        implementation: ``"numba"`` (compiled, fast), ``"numpy"`` (no compiler, slower and
            memory-hungry on long chains), or None for numba when it is installed.

    Raises:
        ValueError: ``slots`` is not a positive integer or ``implementation`` is unknown.
        RematError: ``implementation="numba"`` without numba installed.
    """

    name: ClassVar[str] = "optimal"
    slots: int
    implementation: str

    def __init__(self, *, slots: int = 500, implementation: str | None = None) -> None:
        if isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        self.slots = int(slots)
        self.implementation = _resolve_implementation(implementation)

    def minimum_bytes(self, profile: ChainProfile) -> int:
        """The smallest budget in bytes for which this solver returns a schedule.

        It is the least peak of any plan tree (computed exactly, in bytes).
        """
        arrays = _ChainArrays.from_profile(profile, unit_bytes=1)
        least, _ = _least_peaks(arrays, self._implementation_for(profile))
        return int(least[0, profile.n_stages - 1, 0])

    def _implementation_for(self, profile: ChainProfile) -> str:
        return self.implementation

    def __call__(self, profile: ChainProfile, budget_bytes: int | None) -> Schedule:
        """Returns the fastest schedule whose simulated peak fits the budget.

        Raises:
            BudgetTooSmall: the budget is below the least peak of any schedule.
            InvalidBudget: the budget is not a whole number of bytes >= 0, nor None.
        """
        budget = _check_budget(budget_bytes)
        n = profile.n_stages
        everything = Schedule.from_plan(
            profile, store_everything_plan(n), budget_bytes=budget, solver_name=self.name
        )
        if budget is None or everything.predicted_peak_bytes <= budget:
            return everything
        implementation = self._implementation_for(profile)
        exact = _ChainArrays.from_profile(profile, unit_bytes=1)
        least_exact, _ = _least_peaks(exact, implementation)
        minimum = int(least_exact[0, n - 1, 0])
        if budget < minimum:
            raise _budget_too_small(self.name, profile, budget, minimum, _ADVICE_OPTIMAL)
        least_choice = _least_peak_choice(exact, least_exact)
        fastest = self._fastest_plan(profile, budget, implementation)
        best: Schedule | None = None
        if fastest is not None:
            best = self._checked_schedule(profile, fastest, budget)
        # A least-peak plan always fits; it is only faster when rounding to slots hid it.
        # (The one built for the minimum itself too: whatever fits the minimum fits here.)
        for least_plan in {_build_plan(exact, budget, least_choice), _build_plan(exact, minimum, least_choice)}:
            if best is None or _plan_time_s(profile, least_plan) < best.predicted_time_s * (1.0 - 1e-12):
                best = self._checked_schedule(profile, least_plan, budget)
        assert best is not None
        # Rounding up to slots also rejects plans whose exact peak is within a few slots of
        # the budget. Where it is cheap, solve once more with the budget raised by that much
        # and keep the result if its exact peak fits and it is faster.
        if n <= _RELAXED_PASS_MAX_STAGES:
            unit = max(1, -(-budget // self.slots))
            relaxed = self._fastest_plan(profile, budget + (2 * n + 2) * unit, implementation)
            if relaxed is not None and _plan_time_s(profile, relaxed) < best.predicted_time_s * (1.0 - 1e-12):
                candidate = Schedule.from_plan(profile, relaxed, budget_bytes=budget, solver_name=self.name)
                if candidate.predicted_peak_bytes <= budget:
                    best = candidate
        # Rounding sizes up to slots can also hide a simple plan that fits to the byte: the
        # baselines are checked exactly, so the result is never slower than one that fits.
        for plan in _baseline_plans(n):
            if _plan_time_s(profile, plan) < best.predicted_time_s * (1.0 - 1e-12):
                candidate = Schedule.from_plan(profile, plan, budget_bytes=budget, solver_name=self.name)
                if candidate.predicted_peak_bytes <= budget:
                    best = candidate
        return best

    def _checked_schedule(self, profile: ChainProfile, plan: Plan, budget: int) -> Schedule:
        schedule = Schedule.from_plan(profile, plan, budget_bytes=budget, solver_name=self.name)
        if schedule.predicted_peak_bytes > budget:
            raise RematError(
                f"internal error in solver {self.name!r}: the plan's simulated peak "
                f"{schedule.predicted_peak_bytes} bytes exceeds the budget {budget} bytes; "
                "please report this with the saved profile"
            )
        return schedule

    def _fastest_plan(self, profile: ChainProfile, budget: int, implementation: str) -> Plan | None:
        unit = max(1, -(-budget // self.slots))
        arrays = _ChainArrays.from_profile(profile, unit_bytes=unit)
        budget_units = budget // unit
        least, saturation = _least_peaks(arrays, implementation)
        n = profile.n_stages
        if least[0, n - 1, 0] > budget_units:
            logger.info(
                "solver %r: with %d slots of %d bytes the rounding leaves no plan within %d "
                "bytes; using the least-peak plan",
                self.name,
                self.slots,
                unit,
                budget,
            )
            return None
        costs: _CostTable
        if implementation == "numba":
            costs = _costs_numba(arrays, budget_units, least, saturation)
        else:
            costs = _costs_numpy(arrays, budget_units)
        return _build_plan(arrays, budget_units, _fastest_choice(arrays, costs))


class AutoSolver(OptimalSolver):
    """``"auto"``: the dynamic program, with the implementation chosen by problem size.

    Small problems use numpy (no compilation); larger ones numba when it is installed.

    Args:
        slots: the number of memory slots (see :class:`OptimalSolver`).
        numpy_work_limit: the largest ``n_stages ** 3 * slots`` solved with numpy when
            numba is available.
    """

    name: ClassVar[str] = "auto"

    def __init__(self, *, slots: int = 500, numpy_work_limit: int = 10**8) -> None:
        super().__init__(slots=slots, implementation="numpy")
        self.numpy_work_limit = int(numpy_work_limit)
        self._numba = numba_available()

    def _implementation_for(self, profile: ChainProfile) -> str:
        small = profile.n_stages**3 * self.slots <= self.numpy_work_limit
        return "numpy" if small or not self._numba else "numba"


register_solver("optimal", OptimalSolver)
register_solver("auto", AutoSolver)
register_solver("none", StoreEverythingSolver)
register_solver("inputs", StoreInputsSolver)
register_solver("periodic", PeriodicSolver)
