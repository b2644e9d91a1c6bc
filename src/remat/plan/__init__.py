"""Planning: from per-stage costs and a memory budget to a recompute schedule.

The flow is :class:`ChainProfile` (measured once, saved as JSON) -> a solver from the
registry (:func:`solve`, :func:`get_solver`) -> a :class:`Schedule` (the plan tree, its
operations and its simulated peak and time) -> a :class:`PlanReport` (``print(schedule)``).
Nothing here needs the model or its device.
"""

from remat.plan.operations import (
    InvalidPlan,
    Offload,
    Operation,
    OperationKind,
    PlanItem,
    PlanTree,
    Region,
    Store,
    operations,
    plan_from_data,
    plan_to_data,
    validate_plan,
)
from remat.plan.profile import ChainProfile, InvalidProfile
from remat.plan.report import PlanReport, StageRow, format_bytes, format_seconds
from remat.plan.schedule import Schedule
from remat.plan.simulate import SimulationResult, TimelineEntry, simulate
from remat.plan.solvers import (
    AutoSolver,
    OffloadingSolver,
    OptimalSolver,
    PeriodicSolver,
    Solver,
    StoreEverythingSolver,
    StoreInputsSolver,
    available_solvers,
    get_solver,
    numba_available,
    register_solver,
    solve,
    store_everything_plan,
)
from remat.plan.step import PLAN_FORMAT, PLAN_VERSION, BudgetSplit, Plan

__all__ = [
    "AutoSolver",
    "BudgetSplit",
    "ChainProfile",
    "InvalidPlan",
    "InvalidProfile",
    "Offload",
    "OffloadingSolver",
    "Operation",
    "OperationKind",
    "OptimalSolver",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "PeriodicSolver",
    "Plan",
    "PlanItem",
    "PlanReport",
    "PlanTree",
    "Region",
    "Schedule",
    "SimulationResult",
    "Solver",
    "StageRow",
    "Store",
    "StoreEverythingSolver",
    "StoreInputsSolver",
    "TimelineEntry",
    "available_solvers",
    "format_bytes",
    "format_seconds",
    "get_solver",
    "numba_available",
    "operations",
    "plan_from_data",
    "plan_to_data",
    "register_solver",
    "simulate",
    "solve",
    "store_everything_plan",
    "validate_plan",
]
