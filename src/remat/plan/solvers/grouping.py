"""Long chains planned over groups of consecutive stages: the merged chain and its plans.

The dynamic program costs about ``n**3 * slots`` (``arrays.py``). Past a length it cannot
solve quickly, :class:`~remat.plan.solvers.optimal.OptimalSolver` plans over groups of
consecutive stages instead: a plan of the merged chain stores a group by storing each of
its stages, and its regions start and stop at group boundaries.
"""

from __future__ import annotations

import numpy as np

from remat.plan.operations import Offload, PlanItem, PlanTree, Region, Store
from remat.plan.options import StoreOption
from remat.plan.profile import ChainProfile

__all__: list[str] = []


# NOTE [merged stages]
# A group g runs the stages s .. e-1 of the chain. Its merged stage has x_s as input, x_e as
# output, the summed times, saves_input of stage s and saves_output of stage e-1, and
#   S_g  = sum of S_i + sum over s < k < e of x_k where stage k saves its input or stage
#          k-1 its output (what storing the group keeps until its backward);
#   ft_g = the largest forward of a stage i of the group stored, counted with x_s live,
#          the saved bytes of the stages before it and their kept outputs, x_i and
#          x_{i+1} + S_i + ft_i, less x_s + x_e + S_g (0 if negative);
#   bt_g = the largest backward of a stage i stored, with the saved bytes of the stages up
#          to i, their kept activations, x_{i+1} if stage i saves it, G_{i+1} and
#          G_i + bt_i, less S_g + [x_e if stage e-1 saves it] + G_e + G_s (0 if negative).
# Every operation of a merged stage (forward storing, discarding or checkpointing it, its
# backward) expands into the operations of its stages, and each of those peaks at most where
# the merged operation does, by simulate()'s model (simulate.py), with the same bytes live
# before it and after the last one: ft_g bounds the discarding forwards too, since each
# stored forward counts x_i + x_{i+1} + S_i + ft_i and x_s. So the expanded plan peaks at
# most where the merged plan does on the merged chain, and takes exactly its time: a plan
# the program finds within the budget on the merged chain is within it on the chain. The
# program is exact on the merged chain; over the chain it is optimal among the plans whose
# regions start and stop at group boundaries. A region of the merged chain crosses a break
# or holds a pinned stage of the chain exactly when it crosses a merged break (one at a
# group's first stage) or holds a pinned group (one with a pinned stage or a break inside).


def group_starts(profile: ChainProfile, n_groups: int) -> tuple[int, ...]:
    """The first stage of each of about ``n_groups`` groups of consecutive stages.

    Groups are of near-equal length; each boundary moves, within half a group of where even
    lengths would put it, to the smallest activation (a cheaper checkpoint). The region
    breaks of the profile are boundaries too, unless there are more than half as many as
    groups: a break inside a group then pins the group (see :func:`merged_profile`).
    """
    n = profile.n_stages
    if n_groups >= n:
        return tuple(range(n))
    length = n / n_groups
    reach = max(0, int(length // 2))
    activation = np.asarray(profile.activation_bytes, dtype=np.int64)
    breaks = profile.region_breaks if len(profile.region_breaks) <= n_groups // 2 else ()
    chosen = {0, *breaks}
    previous = 0
    for index in range(1, n_groups):
        nominal = int(round(index * length))
        low, high = max(previous + 1, nominal - reach), min(n - 1, nominal + reach)
        if low > high:
            continue
        window = activation[low : high + 1]
        # Smallest activation, the nearest to the even boundary on ties.
        distance = np.abs(np.arange(low, high + 1) - nominal)
        best = low + int(np.lexsort((distance, window))[0])
        chosen.add(best)
        previous = best
    return tuple(sorted(chosen))


def merged_profile(profile: ChainProfile, starts: tuple[int, ...]) -> ChainProfile:
    """The chain of the groups that begin at ``starts`` (see NOTE [merged stages]).

    A region break at a group's first stage is a break of the merged chain; one inside a
    group pins the group (a region holding it would cross the break), as does a pinned
    stage.

    Args:
        profile: the chain.
        starts: the first stage of each group, increasing, starting at 0.
    """
    n = profile.n_stages
    bounds = (*starts, n)
    x = profile.activation_bytes
    grad = profile.gradient_bytes
    saved_all, forward_temp, backward_temp = [], [], []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        # kept[k]: x_k (s < k < e) is kept until a backward of the group when stored.
        kept = {k: x[k] if (profile.saves_input[k] or profile.saves_output[k - 1]) else 0 for k in range(s + 1, e)}
        saved = sum(profile.saved_bytes[s:e]) + sum(kept.values())
        forward_peak = 0
        backward_peak = 0
        for i in range(s, e):
            # What the stored stages before i hold: their saved bytes and kept activations.
            before = sum(profile.saved_bytes[s:i]) + sum(kept[k] for k in range(s + 1, i + 1))
            frontier = x[i] if i > s and not kept[i] else 0
            forward_peak = max(
                forward_peak,
                x[s] + before + frontier + x[i + 1] + profile.saved_bytes[i] + profile.forward_temp_bytes[i],
            )
            output = x[i + 1] if profile.saves_output[i] else 0
            backward_peak = max(
                backward_peak,
                before + profile.saved_bytes[i] + output + grad[i + 1] + grad[i] + profile.backward_temp_bytes[i],
            )
        saved_all.append(saved)
        forward_temp.append(max(0, forward_peak - (x[s] + x[e] + saved)))
        last_output = x[e] if profile.saves_output[e - 1] else 0
        backward_temp.append(max(0, backward_peak - (saved + last_output + grad[e] + grad[s])))
    group_of = np.searchsorted(np.asarray(bounds), np.arange(n), side="right") - 1
    return ChainProfile(
        names=tuple(
            profile.names[s] if e - s == 1 else f"{profile.names[s]}..{profile.names[e - 1]}"
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ),
        forward_time_s=tuple(sum(profile.forward_time_s[s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)),
        backward_time_s=tuple(sum(profile.backward_time_s[s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)),
        activation_bytes=tuple(x[k] for k in bounds),
        gradient_bytes=tuple(grad[k] for k in bounds),
        saved_bytes=tuple(saved_all),
        saves_input=tuple(profile.saves_input[s] for s in starts),
        saves_output=tuple(profile.saves_output[e - 1] for e in bounds[1:]),
        forward_temp_bytes=tuple(forward_temp),
        backward_temp_bytes=tuple(backward_temp),
        metadata=dict(profile.metadata),
        region_breaks=tuple(starts.index(k) for k in profile.region_breaks if k in starts),
        pinned_stages=tuple(
            sorted(
                {int(group_of[g]) for g in profile.pinned_stages}
                | {int(group_of[k]) for k in profile.region_breaks if k not in starts}
            )
        ),
        glue_spans=tuple(sorted({(int(group_of[a]), int(group_of[b])) for a, b in profile.glue_spans})),
        offload_time_per_byte_s=profile.offload_time_per_byte_s,
        store_options=tuple(_merged_option(option, bounds) for option in profile.store_options),
    )


def _merged_option(option: StoreOption, bounds: tuple[int, ...]) -> StoreOption:
    """A store option of the merged chain: a group of one stage keeps the stage's; a longer
    group has none (it is stored whole or recomputed)."""
    single = [e - s == 1 for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return StoreOption(
        option.name,
        tuple(option.saved_bytes[s] if one else None for s, one in zip(bounds[:-1], single, strict=True)),
        tuple(option.saves_output[s] and one for s, one in zip(bounds[:-1], single, strict=True)),
        tuple(option.extra_time_s[s] if one else 0.0 for s, one in zip(bounds[:-1], single, strict=True)),
    )


def expanded_plan(plan: PlanTree, starts: tuple[int, ...], n_stages: int) -> PlanTree:
    """The plan over stages of a plan over the groups that begin at ``starts``.

    A stored group becomes its stages stored; a region over groups, the region over their
    stages, with its body expanded. Iterative, so that deep nestings do not recurse.

    Raises:
        ValueError: the plan offloads a group (merged plans store or recompute).
    """
    bounds = (*starts, n_stages)
    root: list[PlanItem] = []
    # Each entry: the items left to expand, the list they expand into, and (for a region)
    # the region to close with that list once they are done.
    stack: list[tuple[list[PlanItem], list[PlanItem], Region | None, list[PlanItem] | None]] = [
        (list(reversed(plan)), root, None, None)
    ]
    while stack:
        pending, into, region, parent = stack[-1]
        if not pending:
            stack.pop()
            if region is not None and parent is not None:
                parent.append(Region(bounds[region.start], bounds[region.stop], tuple(into)))
            continue
        item = pending.pop()
        if isinstance(item, Offload):
            raise ValueError(f"group {item.stage} is offloaded: a plan over groups stores or recomputes")
        if isinstance(item, Store):  # (an option is only on a group of one stage)
            into.extend(Store(stage, item.option) for stage in range(bounds[item.stage], bounds[item.stage + 1]))
        else:
            stack.append((list(reversed(item.body)), [], item, into))
    return tuple(root)
