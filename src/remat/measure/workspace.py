"""Memory a device's allocator hands out inside one operator and takes back before it returns.

NOTE [device workspaces]
A CUDA kernel library can ask the caching allocator for scratch memory that is no tensor:
cuDNN's convolutions take a workspace for the length of one call. The exact tracker follows
tensors and does not see it, and neither does a step sized on fake tensors;
``torch.cuda.max_memory_allocated`` does. On a ResNet-50 at its smallest budget the
allocator went 39 MiB (3.7%) over a budget the tensors kept.

:class:`WorkspaceProbe` reads the allocator around every operator of a real pass: what is
allocated before and after it, and the most allocated during it (the allocator's peak,
started again at the call). A workspace the library keeps between calls (cuBLAS's own,
made once per stream) is still allocated when the operator returns: part of what is live
before every later step, not of a step's transient. A workspace matters where it stands
above the stretch's peak: taken at a moment with less allocated, it adds nothing. The
probe gives, for each stretch of the pass (a stage's forward, a group's backward), how far
the most allocated during an operator rose above the most allocated between operators;
the stage's transient bytes take that on top (what else is alive is the same all through
the stretch in a planned step as in the pass). A stretch the pass runs without grad (the
forward of a group whose backward it does not run, the code after a group) does not hold
what a planned forward keeps for its backward: there each operator's workspace is counted
whole, which stands on at most the planned stretch's peak. The runs of a stage under each
policy (NOTE [timing store options]) repeat its operators beside what the group holds, and
are left out. Counted instead as the sum of what each
call allocated and gave back (which leaves the peak statistics alone), a stack of
convolutions came out at twice its workspace: cuDNN allocates more than once in a call.

The timing pass runs the probe on its first pass over a GPU (whose times are dropped, NOTE
[a cold device]); with ``torch.backends.cudnn.benchmark`` on, that first call of each
shape tries cuDNN's algorithms, with workspaces of their own, and the probe runs on a
second pass, before a third is timed (:func:`with_workspaces` adds what it found). A
plain measuring step (``measure="plain"``) has no stretch of its own per stage: it adds
the largest workspace of the step to every stage (the safe side; with cuDNN's benchmark on,
that step is each shape's first call, and its trials make the figure far too high). A
shape whose times are scaled from a timed one runs no pass: it takes the timed shape's
largest workspace, grown with the work, for every stage (:func:`with_reference_workspace`).

What this leaves: the allocator's peak statistics count from the probe's last operator
after measuring. The pass that finds the workspaces runs before they are known, kept to
the budget by the tensors alone: on a model with convolutions the first step (the
measuring one) can go over its budget by a workspace, the steps after it within it (a
pass after the probe's keeps to it with them, and where the probe's pass timed a backward
that does not fit with them, that is warned: :func:`timed_passes`). A
group whose backward that pass does not run (it would not fit the budget) is charged the
largest workspace the pass saw, not its backward's own, which can be larger; with cuDNN's
benchmark on, that backward's algorithm is chosen at the first planned step, in a
workspace as large as the free memory allows, and kept at every step after it.
``measure="estimated"`` runs nothing real and counts no workspace.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.measure.assemble import ChainMeasurement
    from remat.measure.timing import TimingPass

__all__ = [
    "WorkspaceProbe",
    "allocator_counters",
    "probe_for",
    "timed_passes",
    "timing_passes",
    "with_reference_workspace",
    "with_workspaces",
]


class AllocatorCounters(Protocol):
    """What the probe reads of a device's allocator."""

    def allocated(self) -> int:
        """Bytes allocated now."""

    def restart_peak(self) -> None:
        """Starts the peak again from what is allocated now."""

    def peak_and_allocated(self) -> tuple[int, int]:
        """The most bytes allocated at once since :meth:`restart_peak`, and bytes allocated now."""


class _CudaCounters:
    """CUDA's caching allocator, read as one nested table per call (``torch.cuda.memory_stats``
    builds and flattens a table of every statistic for each figure)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _allocated_bytes(self) -> dict[str, int]:
        return torch.cuda.memory_stats_as_nested_dict(self.device)["allocated_bytes"]["all"]

    def allocated(self) -> int:
        return int(self._allocated_bytes()["current"])

    def restart_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_and_allocated(self) -> tuple[int, int]:
        allocated = self._allocated_bytes()
        return int(allocated["peak"]), int(allocated["current"])


def allocator_counters(device: torch.device) -> AllocatorCounters | None:
    """The counters of `device`'s allocator (None: none to read, as on the CPU)."""
    return _CudaCounters(device) if device.type == "cuda" else None


class WorkspaceProbe(TorchDispatchMode):
    """Notes the workspaces of the operators run under it (NOTE [device workspaces]).

    Around each operator the allocator's peak is started again, and read when it returns:
    the most it held during the call. :meth:`take` gives how far the highest of these rose
    above the highest allocated count between operators, since the last call: what the
    workspaces add to the peak of that stretch of the pass (0 where none was taken at its
    peak's height).

    .. warning:: The allocator's peak statistics (``torch.cuda.max_memory_allocated``) are
        started again at each operator: after the probe they count from its last one.

    Args:
        counters: the device allocator's counters (see :func:`allocator_counters`).
    """

    def __init__(self, counters: AllocatorCounters) -> None:
        super().__init__()
        self._counters = counters
        self._peak_live = 0  # since the last take
        self._peak_inside = 0
        self._largest = 0
        #: the most one operator held above what was allocated around it, since the probe began
        self.largest_seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        counters = self._counters
        live_before = counters.allocated()
        counters.restart_peak()
        out = func(*args, **(kwargs or {}))
        inside, live_after = counters.peak_and_allocated()
        around = max(live_before, live_after)
        self._peak_live = max(self._peak_live, around)
        self._peak_inside = max(self._peak_inside, inside)
        self._largest = max(self._largest, inside - around)
        self.largest_seen = max(self.largest_seen, self._largest)
        return out

    def take(self, *, stored: bool = True) -> int:
        """What the workspaces add to the peak of the stretch since the last call.

        Args:
            stored: the stretch ran as the planned step runs it (with grad, keeping what
                its backward needs): the bytes the operators' peaks rose above the most
                allocated between operators. Otherwise (a forward without grad, whose
                saved tensors do not pile up as a planned one's do) the largest workspace
                of one operator, which stands on at most the planned stretch's peak.
        """
        added = max(0, self._peak_inside - self._peak_live) if stored else self._largest
        self._peak_live = self._peak_inside = self._largest = 0
        return added


def timing_passes(device: torch.device) -> tuple[int, int | None]:
    """How many times the timing pass runs on `device`, and which run carries the probe.

    The last run's times are kept (NOTE [a cold device]); on a GPU the probe runs on a run
    before it (NOTE [device workspaces]), on none (None) where the allocator cannot be read,
    and on the only one, the timed one, on another device whose allocator can (a stand-in's).
    """
    if device.type != "cuda":
        return (1, 0) if allocator_counters(device) is not None else (1, None)
    if torch.backends.cudnn.benchmark:
        return 3, 1
    return 2, 0


def probe_for(device: torch.device) -> WorkspaceProbe | None:
    """A probe of `device`'s allocator, or None where it cannot be read."""
    counters = allocator_counters(device)
    return WorkspaceProbe(counters) if counters is not None else None


def with_workspaces(
    measurement: ChainMeasurement,
    forward_bytes: Sequence[int],
    backward_bytes: Sequence[int],
    largest_bytes: int = 0,
) -> ChainMeasurement:
    """The measurement with each stage call's workspaces added to its group's transient bytes.

    Args:
        measurement: the measurement (its profile's stages are its groups of stage calls).
        forward_bytes: what workspaces add to each stage call's forward.
        backward_bytes: what workspaces add to each stage call's backward.
        largest_bytes: the largest workspace of one operator (kept in the profile's
            metadata for shapes timed from this one, :func:`with_reference_workspace`).
    """
    profile = measurement.profile
    forward = _by_group(measurement.groups, forward_bytes)
    backward = _by_group(measurement.groups, backward_bytes)
    if not any(forward) and not any(backward) and not largest_bytes:
        return measurement
    metadata = {
        **profile.metadata,
        "workspace_bytes": max(forward + backward),
        "workspace_largest_bytes": max(largest_bytes, *forward, *backward),
    }
    profile = dataclasses.replace(
        profile,
        forward_temp_bytes=tuple(t + w for t, w in zip(profile.forward_temp_bytes, forward, strict=True)),
        backward_temp_bytes=tuple(t + w for t, w in zip(profile.backward_temp_bytes, backward, strict=True)),
        metadata=metadata,
    )
    return dataclasses.replace(measurement, profile=profile)


def _by_group(groups: Sequence[tuple[int, int]], per_call: Sequence[int]) -> list[int]:
    """The largest of each group's stage calls."""
    return [max(per_call[a:b], default=0) for a, b in groups]


def with_reference_workspace(
    measurement: ChainMeasurement, reference: ChainMeasurement, work_ratio: float
) -> ChainMeasurement:
    """A measurement whose times were scaled from `reference` (no pass ran on its shape),
    with the reference's largest workspace, grown with the work (not shrunk), charged to
    every stage: the safe side (NOTE [device workspaces])."""
    largest = reference.profile.metadata.get("workspace_largest_bytes", 0)
    if not largest:
        return measurement
    nbytes = math.ceil(largest * max(1.0, work_ratio))
    n_calls = len(measurement.stages)
    return with_workspaces(measurement, [nbytes] * n_calls, [nbytes] * n_calls, nbytes)


def timed_passes(
    device: torch.device,
    run: Callable[[frozenset[int] | None, WorkspaceProbe | None], TimingPass],
    decide: Callable[[ChainMeasurement, tuple[int, ...]], frozenset[int] | None] | None,
    sized: ChainMeasurement,
    needs: tuple[int, ...],
) -> tuple[TimingPass, ChainMeasurement]:
    """Runs the timing pass as often as `device` needs (:func:`timing_passes`), the probe on one.

    Args:
        device: the device the step runs on.
        run: runs one pass, timing the backward of the groups it is given (None: all),
            with the probe it is given, if any.
        decide: the groups whose backward a pass may time, from the sized measurement and
            what each group needs with its backward (None: all, with no budget).
        sized: the sized measurement.
        needs: what each group needs with its backward, rehearsed on fake tensors.

    Returns:
        The last pass, and the sized measurement with the workspaces the probe found.

    Once the workspaces are known, the groups are decided again with them: a pass after
    the probe's keeps to the budget with them. Where the probe's own pass timed a backward
    that does not fit with them, it went over the budget by them, which is warned.
    """
    passes, probed = timing_passes(device)
    groups = decide(sized, needs) if decide is not None else None
    for index in range(passes):
        timing = run(groups, probe_for(device) if index == probed else None)
        if index != probed:
            continue
        forward, backward, largest = timing.workspaces
        sized = with_workspaces(sized, forward, backward, largest)
        if decide is None or not sized.profile.metadata.get("workspace_bytes"):
            continue
        added = list(map(max, _by_group(sized.groups, forward), _by_group(sized.groups, backward)))
        again = decide(sized, tuple(need + extra for need, extra in zip(needs, added, strict=True)))
        over = sorted(set(range(len(needs)) if groups is None else groups) - again) if again is not None else []
        if over:
            warnings.warn(
                f"remat: the measuring step went over the budget by up to {format_bytes(max(added[g] for g in over))}: "
                "workspaces the device's kernels take outside any tensor (cuDNN's), unknown before it ran; "
                "the steps after it are planned with them (NOTE [device workspaces])",
                RuntimeWarning,
                stacklevel=2,
            )
        groups = again
    return timing, sized
