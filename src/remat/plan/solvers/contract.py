"""The solver contract and registry: configured in ``__init__``, called on a problem."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from remat.errors import BudgetTooSmall, InvalidBudget, RematError
from remat.plan.profile import ChainProfile
from remat.plan.schedule import Schedule
from remat.units import MIB

__all__ = ["Solver", "available_solvers", "get_solver", "numba_available", "register_solver", "solve"]


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

    def minimum_bytes(self, profile: ChainProfile) -> int:
        """The smallest budget in bytes within which this solver plans the chain of ``profile``."""
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
    solver: str | Solver = "optimal",
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
            raise TypeError("options go to the solver's constructor when a solver instance is given")
        instance = solver
    return instance(profile, budget_bytes)


def default_slots(n_stages: int) -> int:
    """Memory slots of the dynamic program for a chain of `n_stages`: as many as keep the
    solve well under a second."""
    if not numba_available():
        return 500
    # The dynamic program costs about n^3 * slots; 200 stages x 500 slots solve in a
    # fraction of a second, so shorter chains can afford finer memory.
    return int(min(20000, max(500, 200**3 * 500 // max(1, n_stages) ** 3)))


def numba_available() -> bool:
    """Whether numba can be imported (the fast implementation of the dynamic program)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- helpers


def _validated_budget_bytes(budget_bytes: Any) -> int | None:
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
        f"budget of {budget_bytes} bytes ({budget_bytes / MIB:.2f} MiB); the smallest budget "
        f"it can fit is {minimum_bytes} bytes ({minimum_bytes / MIB:.2f} MiB). {advice}"
    )
    return BudgetTooSmall(message, budget_bytes=budget_bytes, minimum_bytes=minimum_bytes)


_ADVICE_OPTIMAL = "Raise the budget, or, if the model allows it, split it into more stages or use a smaller batch."
_ADVICE_BASELINE = "Raise the budget or use the 'optimal' solver, which needs less memory."
