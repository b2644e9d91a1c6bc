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
``"offload"``  the dynamic program, with offload to host memory as a third choice
               (for a profile that measured the transfer: ``offload_time_per_byte_s``)
=============  ===============================================================

Every solver also tells the smallest budget it can fit, ``solver.minimum_bytes(profile)``;
below it, calling the solver raises :class:`~remat.errors.BudgetTooSmall` with that minimum.

>>> schedule = get_solver("optimal", slots=500)(profile, 2 * 2**30)  # doctest: +SKIP
>>> print(schedule)  # doctest: +SKIP

The modules, by job: ``contract`` (the protocol, the registry, budget checks), ``baselines``
(fixed plans), and the dynamic program's ``arrays`` (a chain in memory units and the
program's accounting), ``kernels`` (the peak formulas and the loops numba compiles),
``programs`` (the least-peak and time programs in numpy, or compiled), ``reconstruct``
(plans from the programs' tables) and ``optimal`` (the solvers that run it).
"""

from __future__ import annotations

from remat.plan.solvers.baselines import PeriodicSolver, StoreEverythingSolver, StoreInputsSolver, store_everything_plan
from remat.plan.solvers.contract import (
    Solver,
    available_solvers,
    default_slots,
    get_solver,
    numba_available,
    register_solver,
    solve,
)
from remat.plan.solvers.offloading import OffloadingSolver
from remat.plan.solvers.optimal import AutoSolver, OptimalSolver

__all__ = [
    "AutoSolver",
    "OffloadingSolver",
    "OptimalSolver",
    "PeriodicSolver",
    "Solver",
    "StoreEverythingSolver",
    "StoreInputsSolver",
    "available_solvers",
    "get_solver",
    "default_slots",
    "numba_available",
    "register_solver",
    "solve",
    "store_everything_plan",
]

# The built-in solvers, registered when the package is imported.
register_solver("optimal", OptimalSolver)
register_solver("auto", AutoSolver)
register_solver("none", StoreEverythingSolver)
register_solver("inputs", StoreInputsSolver)
register_solver("periodic", PeriodicSolver)
register_solver("offload", OffloadingSolver)
