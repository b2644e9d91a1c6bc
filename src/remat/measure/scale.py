"""Times for a new input shape, from a shape that was timed.

Sizing a step on fake tensors is exact for any shape, and cheap; timing it is not (it
runs the model). For a new shape of the same model, each planned stage's time is the
time measured on a reference shape, scaled by how much more work the stage does now:
its floating-point operations where the tracker counts them (matrix products,
convolutions, attention, so an attention whose cost grows with the square of the
sequence scales that way), else the bytes it produces and keeps (elementwise stages).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from remat.measure.assemble import ChainMeasurement
from remat.measure.instrument import StageMeasurement
from remat.measure.workspace import with_reference_workspace
from remat.plan.key import shape_family

logger = logging.getLogger("remat")

__all__ = ["SCALING_RANGE", "ShapeTimings", "as_scaled_from", "scaled_times", "work_ratio"]


def _work(stages: Sequence[StageMeasurement]) -> tuple[int, int]:
    """(flops, bytes produced and kept) of these stages' forwards."""
    flops = sum(stage.forward_work.flops for stage in stages)
    produced = sum(
        sum(stage.output_storages.values()) + sum(nbytes for nbytes, _ in stage.saved_storages.values())
        for stage in stages
    )
    return flops, produced


def _ratio(reference: Sequence[StageMeasurement], target: Sequence[StageMeasurement]) -> float:
    (flops_a, bytes_a), (flops_b, bytes_b) = _work(reference), _work(target)
    if flops_a > 0 and flops_b > 0:
        return flops_b / flops_a
    if bytes_a > 0 and bytes_b > 0:
        return bytes_b / bytes_a
    return 1.0


def as_scaled_from(reference: ChainMeasurement, target: ChainMeasurement, ratio: float) -> ChainMeasurement:
    """`target`, whose times were scaled from `reference` by `ratio` of its work, with what
    no pass on its own shape measured taken from the reference: the inputs the model
    holds (its code holds the same ones at every shape) and the device's workspaces (NOTE
    [device workspaces])."""
    target = dataclasses.replace(target, input_held_until=reference.input_held_until)
    return with_reference_workspace(target, reference, ratio)


def work_ratio(reference: ChainMeasurement, target: ChainMeasurement) -> float:
    """How much more work the whole chain does in `target` than in `reference`."""
    return _ratio(reference.stages, target.stages)


def scaled_times(reference: ChainMeasurement, target: ChainMeasurement) -> list[tuple[float, float]]:
    """Per stage of `target`, (forward, backward) seconds scaled from the timed `reference`.

    Both must measure the same chain (the same stages, in the same order). Stages are
    scaled group by group where both are grouped alike (a group's time can be measured
    as a whole), else one by one.
    """
    names = [stage.name for stage in reference.stages]
    if names != [stage.name for stage in target.stages]:
        raise ValueError("times can only be scaled between measurements of the same chain of stages")
    if target.groups == reference.groups:
        units = target.groups
    else:
        units = [(index, index + 1) for index in range(len(names))]
    times: list[tuple[float, float]] = []
    for first, stop in units:
        ratio = _ratio(reference.stages[first:stop], target.stages[first:stop])
        times.extend(
            (stage.forward_time_s * ratio, stage.backward_time_s * ratio) for stage in reference.stages[first:stop]
        )
    return times


#: A new shape whose work is within this factor of a timed shape's is not timed itself.
SCALING_RANGE = 2.0


class ShapeTimings:
    """Which input shapes of a model were timed; times for the others, scaled from them.

    Shapes fall into families (:func:`remat.plan.key.shape_family`: the same model, setup
    and inputs but for their sizes). A new shape is timed when its family has fewer than
    `limit` timed shapes and none within ``SCALING_RANGE`` of its work; otherwise its
    times are scaled from the timed shape nearest in work. The first step at a scaled
    shape checks the estimate (:meth:`verify`); a forward off by more than that range
    has its shape timed at the next step, while the family has timings left.

    Args:
        limit: the most shapes timed per family.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"timed_shapes is at least 1 (the first shape is timed), got {limit}")
        self.limit = limit
        self.timed: dict[Hashable, dict[Hashable, ChainMeasurement]] = {}
        self.counts = {"timed": 0, "scaled": 0, "estimated": 0}
        self._estimated: set[Hashable] = set()  # shapes planned once on estimated times
        self._unverified: dict[Hashable, float] = {}  # key -> predicted forward seconds
        self._retime: set[Hashable] = set()

    def known_times(
        self, key: Hashable, sized: ChainMeasurement
    ) -> tuple[list[tuple[float, float]], float, ChainMeasurement] | None:
        """Scaled times for the shape `key` sized as `sized`, the work ratio and the timed
        measurement they come from; None to time it."""
        if key in self._retime:
            return None
        timed = self.timed.get(shape_family(key), {})
        names = [stage.name for stage in sized.stages]
        # (the shape itself, if it was timed before its setup was forgotten: NOTE [setups kept])
        candidates = [m for m in timed.values() if [s.name for s in m.stages] == names]
        if not candidates or any(m.held_outputs for m in candidates):
            # what the model holds across stages is in bytes of the timed shape: timed again
            return None
        reference = min(candidates, key=lambda m: abs(math.log(work_ratio(m, sized) or 1.0)))
        ratio = work_ratio(reference, sized)
        if len(timed) < self.limit and not 1 / SCALING_RANGE <= ratio <= SCALING_RANGE:
            return None
        return scaled_times(reference, sized), ratio, reference

    def record(self, key: Hashable, measurement: ChainMeasurement, *, scaled: bool, estimated: bool = False) -> None:
        """Notes how the shape `key` was measured (`estimated`: its times come from a cost
        model, and it is timed at its next training step)."""
        self.counts["estimated" if estimated else "scaled" if scaled else "timed"] += 1
        if estimated:
            self._estimated.add(key)
            self._retime.add(key)
        elif scaled:
            self._unverified[key] = sum(measurement.profile.forward_time_s)
        else:
            self.timed.setdefault(shape_family(key), {})[key] = measurement
            self._retime.discard(key)
            self._unverified.pop(key, None)

    def verified_call(self, key: Hashable, forward: Callable[[], Any], model: nn.Module) -> Any:
        """Runs `forward`, the first forward at the shape `key` whose times were scaled, and
        checks them against its own (:meth:`verify`); returns its output."""
        synchronize = torch.cuda.synchronize if any(p.is_cuda for p in model.parameters()) else None
        if synchronize is not None:
            synchronize()
        started = time.perf_counter()
        out = forward()
        if synchronize is not None:
            synchronize()
        ratio, retime = self.verify(key, time.perf_counter() - started)
        logger.info(
            "remat checked the scaled times of this shape: its forward took x%.2f the estimate%s",
            ratio,
            "; the shape is timed at its next step" if retime else "",
        )
        return out

    def forget(self, key: Hashable, *, times: bool) -> None:
        """Drops what is known of the shape `key`, whose setup is no longer kept; with `times`, the
        timed shapes of its family too (a stage was replaced). Timed shapes are kept otherwise: they
        are what others are scaled from (at most `limit` a family)."""
        if times:
            self.timed.pop(shape_family(key), None)
        self._estimated.discard(key)
        self._retime.discard(key)
        self._unverified.pop(key, None)

    def was_estimated(self, key: Hashable) -> bool:
        """Whether the shape `key` was planned on estimated times before (it is timed now)."""
        return key in self._estimated

    def must_retime(self, key: Hashable) -> bool:
        """Whether the shape `key` is to be timed again (its scaled times were off)."""
        return key in self._retime

    def unverified(self, key: Hashable) -> bool:
        """Whether the shape `key` has scaled times not yet checked by a step."""
        return key in self._unverified

    def verify(self, key: Hashable, forward_s: float) -> tuple[float, bool]:
        """Checks the scaled times of `key` against a forward that took `forward_s` seconds.

        Returns the measured-over-predicted ratio and whether the shape must be timed.
        """
        predicted = self._unverified.pop(key)
        ratio = forward_s / predicted if predicted > 0 else 1.0
        off = not 1 / SCALING_RANGE <= ratio <= SCALING_RANGE
        retime = off and len(self.timed.get(shape_family(key), {})) < self.limit
        if retime:
            self._retime.add(key)
        return ratio, retime
