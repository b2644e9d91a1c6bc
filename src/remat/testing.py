"""Helpers for testing code that plans or runs recompute schedules.

:func:`random_chain` makes chain profiles with random but valid costs, reproducible from a
seed, for table-driven and property-based tests of solvers; :func:`all_plans` enumerates
every plan tree of a short chain, for brute-force checks.
"""

from __future__ import annotations

import functools

import numpy as np

from remat.plan.operations import PlanTree, Region, Store
from remat.plan.options import StoreOption
from remat.plan.profile import ChainProfile

__all__ = ["all_plans", "random_chain"]


def all_plans(n_stages: int, options: tuple[str, ...] = ()) -> tuple[PlanTree, ...]:
    """Returns every valid plan tree of a chain of ``n_stages`` stages.

    There are 2, 8, 48, 352 and 2880 of them for 1 to 5 stages: use it on short chains.
    With store ``options`` (names), a stored stage is also stored under each of them.

    Raises:
        ValueError: ``n_stages`` < 1.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    return _level_plans(0, n_stages, tuple(options))


@functools.cache
def _body_plans(start: int, stop: int, options: tuple[str, ...]) -> tuple[PlanTree, ...]:
    # Plans of [start, stop) whose first item is not the region [start, stop) itself.
    if start == stop:
        return ((),)
    plans: list[PlanTree] = [
        (Store(start, option),) + rest for option in (None, *options) for rest in _level_plans(start + 1, stop, options)
    ]
    for region_stop in range(start + 1, stop):
        for body in _body_plans(start, region_stop, options):
            for rest in _level_plans(region_stop, stop, options):
                plans.append((Region(start, region_stop, body),) + rest)
    return tuple(plans)


@functools.cache
def _level_plans(start: int, stop: int, options: tuple[str, ...]) -> tuple[PlanTree, ...]:
    if start == stop:
        return ((),)
    bodies = _body_plans(start, stop, options)
    return bodies + tuple((Region(start, stop, body),) for body in bodies)


def random_chain(
    rng_or_seed: np.random.Generator | int,
    n_stages: int,
    *,
    max_units: int = 8,
    unit_bytes: int = 1,
    zero_probability: float = 0.15,
    flag_probability: float = 0.7,
    max_time_s: float = 1.0,
    integer_times: bool = False,
    store_options: int = 0,
) -> ChainProfile:
    """Makes a chain profile with random costs.

    Every size is a whole number of ``unit_bytes`` between 0 and ``max_units`` units (0 with
    probability ``zero_probability``), so that a solver whose slot is ``unit_bytes`` sees
    the sizes exactly. Times are positive.

    Args:
        rng_or_seed: a numpy random generator, or a seed for a new one.
        n_stages: the number of stages (at least 1).
        max_units: the largest size, in units.
        unit_bytes: the size of a unit in bytes.
        zero_probability: the chance that a size is 0 (exercises edge cases).
        flag_probability: the chance that a stage saves its input, and its output.
        max_time_s: the largest forward or backward time.
        integer_times: draw whole seconds from 1 to ``max_time_s`` (exact sums, for tests
            that compare times for equality).
        store_options: how many store options (``option0`` ..) to give the stages: each
            keeps at most the stage's saved bytes, applies to a stage with probability
            0.8, and adds a time of its own.

    Returns:
        The profile, named ``stage0 .. stage{n-1}``, with ``metadata["seed"]`` when a seed
        was given.

    Raises:
        ValueError: ``n_stages`` < 1, ``max_units`` < 0 or ``unit_bytes`` < 1.
    """
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if max_units < 0 or unit_bytes < 1:
        raise ValueError(f"need max_units >= 0 and unit_bytes >= 1, got {max_units}, {unit_bytes}")
    metadata: dict[str, object] = {"generator": "remat.testing.random_chain"}
    if isinstance(rng_or_seed, np.random.Generator):
        rng = rng_or_seed
    else:
        rng = np.random.default_rng(rng_or_seed)
        metadata["seed"] = int(rng_or_seed)

    def sizes(count: int) -> tuple[int, ...]:
        values = rng.integers(0, max_units + 1, size=count)
        values[rng.random(count) < zero_probability] = 0
        return tuple(int(value) * unit_bytes for value in values)

    def times(count: int) -> tuple[float, ...]:
        if integer_times:
            return tuple(float(value) for value in rng.integers(1, max(1, int(max_time_s)) + 1, count))
        return tuple(float(value) for value in rng.uniform(0.05, 1.0, count) * max_time_s)

    forward_s, backward_s = times(n_stages), times(n_stages)
    activation, gradient, saved = sizes(n_stages + 1), sizes(n_stages + 1), sizes(n_stages)
    saves_input = tuple(bool(flag) for flag in rng.random(n_stages) < flag_probability)
    saves_output = tuple(bool(flag) for flag in rng.random(n_stages) < flag_probability)
    forward_temp, backward_temp = sizes(n_stages), sizes(n_stages)
    options = []
    for index in range(store_options):
        kept = [int(rng.integers(0, nbytes // unit_bytes + 1)) * unit_bytes for nbytes in saved]
        applies = rng.random(n_stages) < 0.8
        options.append(
            StoreOption(
                f"option{index}",
                tuple(nbytes if flag else None for nbytes, flag in zip(kept, applies, strict=True)),
                tuple(bool(flag) for flag in rng.random(n_stages) < flag_probability / 2),
                times(n_stages),
            )
        )
    return ChainProfile(
        names=tuple(f"stage{index}" for index in range(n_stages)),
        forward_time_s=forward_s,
        backward_time_s=backward_s,
        activation_bytes=activation,
        gradient_bytes=gradient,
        saved_bytes=saved,
        saves_input=saves_input,
        saves_output=saves_output,
        forward_temp_bytes=forward_temp,
        backward_temp_bytes=backward_temp,
        metadata=metadata,
        store_options=tuple(options),
    )
