"""A recompute frame whose first forward spans several stage calls: the executor's regions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat.manual import _selective
from remat.manual._frames import _STACK, _Context, _Root
from remat.manual._tensors import RecomputeOptions
from remat.manual.policies import save_nothing

__all__ = ["RegionRecording"]


class RegionRecording:
    """A recomputed region whose first forward spans several calls (used by the executor).

    The executor of a plan cannot wrap a region of a user's forward in one function call:
    the region starts in one stage call and ends in another, with the user's own code in
    between. It opens a recording with the function that *replays* the region from its
    kept inputs, and runs each of the region's stage calls inside :meth:`stage`, with the
    user's code that follows it up to the next stage call (which the replay runs again).

    An `observer` (used by measurement) is told of every tensor the region discards,
    ``observer.on_discarded(tensor)``, and of each recompute of the region,
    ``observer.on_recompute(started: bool)`` before and after it, and of each use of a
    saved tensor by backward, ``observer.on_unpacked(index, tensor)`` (its index in discard
    order, and the tensor given back).
    """

    def __init__(
        self,
        function: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        preserve_rng_state: bool = True,
        observer: Any = None,
    ) -> None:
        options = RecomputeOptions(save_nothing, preserve_rng_state=preserve_rng_state)
        self._root = _Root(function, args, kwargs, options)
        self._root.observer = observer

    def stage(self) -> _DiscardingStage:
        """Context manager: the tensors saved inside it are recomputed in backward."""
        return _DiscardingStage(self._root)

    def close(self) -> None:
        """Ends the region's first forward."""
        self._root.end_first_forward()


class _DiscardingStage:
    def __init__(self, root: _Root) -> None:
        self._root = root
        self._recording: Any = None
        self._unnumbered: Any = None  # while the glue after the stage runs

    def __enter__(self) -> None:
        _STACK.push(_Context("discard", self._root))
        self._recording = self._root.state_log.recording()
        self._recording.__enter__()

    def stage_returned(self) -> None:
        """The stage call returned; the user's code that follows still discards what it saves.

        Its module calls are not recorded: the replay runs that code again as the torch
        calls it made (see remat.discover.glue), not as module calls.
        """
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.__exit__(None, None, None)
            self._unnumbered = _selective.blocks_unnumbered()
            self._unnumbered.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._recording is not None:
                self._recording.__exit__(*exc)
                self._recording = None
        finally:
            if self._unnumbered is not None:
                self._unnumbered.__exit__(None, None, None)
                self._unnumbered = None
            _STACK.pop()
