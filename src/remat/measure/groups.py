"""Which stage calls plan as one stage, and where a recompute region may not start or cross."""

from __future__ import annotations

from remat.measure.instrument import StageMeasurement

__all__ = ["group_stages", "region_limits"]


def group_stages(stages: list[StageMeasurement]) -> list[tuple[int, int]]:
    """(first, stop) stage indices of each planned stage."""
    groups: list[tuple[int, int]] = []
    for index, stage in enumerate(stages):
        # A stage that modifies its input in place cannot start a region (the region would
        # keep an input that changes); nor can one that takes no activation from the stage
        # before it. A stage that keeps nothing for its backward (a view, a pooling to one
        # value) has nothing to recompute: it rides with the stage before. A stage that
        # only does not keep its input is a stage of its own: the planner's model knows
        # what holds each activation (saves_input / saves_output).
        # A stage whose input the model changed in place keeps its own group where it can:
        # a region must not cross that boundary (NOTE [stage outputs changed in place]).
        keeps_nothing = not stage.saved_storages and not stage.input_changed
        fuse = index > 0 and (stage.modifies_input or not stage.input_storages or keeps_nothing)
        if fuse and groups:
            groups[-1] = (groups[-1][0], index + 1)
        else:
            groups.append((index, index + 1))
    return groups


def region_limits(stages: list[StageMeasurement], groups: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The profile's region breaks and pinned stages (in groups) from what each stage saw.

    A group whose first stage's input was changed in place by the model's code is a
    break: a region may start there but not cross it. A group with such a stage inside
    (it also modifies that input itself, so it was fused) can be neither replayed nor
    start a region: it is pinned; so is the first group when the chain input is changed
    in place (there is no group before to fuse it with), and a group after one of whose
    stages the model's code cannot be replayed (NOTE [glue that changes an earlier
    activation]).
    """
    breaks: list[int] = []
    pinned: list[int] = []
    for index, (first, stop) in enumerate(groups):
        if index > 0 and stages[first].input_changed:
            breaks.append(index)
        # the first group's input changed in place cannot be kept for a region either
        if (
            any(stages[stage].input_changed for stage in range(first + 1, stop))
            or (index == 0 and stages[0].modifies_input)
            or not all(stages[stage].glue_replayable for stage in range(first, stop))
        ):
            pinned.append(index)
    return breaks, pinned
