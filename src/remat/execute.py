"""Running a planned schedule inside autograd, within the model's own forward.

The plan is a tree (see :mod:`remat.plan.schedule`): top-level items are stored stages
and regions; a region's body is again stored stages and nested regions. The executor
intercepts the calls of the chain's stage modules in the model's unmodified forward:

* a stored stage runs as usual;
* the first stage of a top-level region opens a recording (a recompute frame) that
  keeps the stage's inputs; the region's stages run with everything they save replaced
  by handles; the last stage closes it;
* when backward first needs one of those handles, the region's *body* is replayed from
  the kept inputs: its stored stages are run again with their saved tensors kept, and
  each nested region becomes a child frame that keeps only its own inputs, to be
  replayed in turn when backward reaches it (see NOTE [nested recompute frames]).

Each stage of a region is replayed with the RNG state it saw in the forward, so random
operations draw the same numbers even when the model's own code between stages draws
some too; normalisation statistics are updated once (the recompute guard).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

from torch import nn

from remat.manual._rng import ForwardState, autocast_cache_off, capture_forward_state, replay_forward_state
from remat.discover.chain import Chain, InputLink
from remat.errors import RematError, UnsupportedModel
from remat.discover.intercept import call_original, call_stage, intercept_stages
from remat.plan.operations import Region, Store
from remat.manual.recompute import RegionRecording, active_mode, recompute

__all__ = ["ChainExecutor", "expand_groups"]

Item = Union[Store, Region]


def expand_groups(items: Sequence[Item], groups: Sequence[tuple[int, int]]) -> tuple[Item, ...]:
    """Maps a plan over grouped stages onto the chain's stage calls."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, Store):
            first, stop = groups[item.stage]
            out.extend(Store(k) for k in range(first, stop))
        else:
            start = groups[item.start][0]
            stop = groups[item.stop - 1][1]
            out.append(Region(start, stop, expand_groups(item.body, groups)))
    return tuple(out)


class _Run:
    """The state of one forward of the chain: what the replays will need."""

    def __init__(self, executor: "ChainExecutor") -> None:
        self.executor = executor
        self.next_stage = 0
        self.previous_output: Any = None
        self.recording: RegionRecording | None = None
        self.links: dict[int, InputLink] = {}
        self.states: dict[int, ForwardState] = {}

    def call(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        executor = self.executor
        if index != self.next_stage:
            raise UnsupportedModel(
                f"stage {index} ({executor.chain.names[index]!r}) was called when stage "
                f"{self.next_stage} was expected; remat needs the chain's stages to run once each, "
                "in order, in every forward (use remat.mark for models whose forward varies)"
            )
        self.next_stage += 1
        action, region = executor.actions[index]
        if action == "store":
            out = call_original(module, args, kwargs)
        else:
            if action == "open":
                if not executor.chain.whole_model:
                    self.states[index] = capture_forward_state(
                        (args, kwargs), preserve_rng_state=executor.preserve_rng_state
                    )
                body = region.body  # type: ignore[union-attr]
                self.recording = RegionRecording(
                    _Replay(self, body),
                    (args, kwargs),
                    {},
                    preserve_rng_state=executor.preserve_rng_state,
                    observer=None if executor.observer is None or region is None else executor.observer(region),
                )
            else:
                self.links[index] = InputLink(args, kwargs, self.previous_output)
                if not executor.chain.whole_model:
                    self.states[index] = capture_forward_state(
                        (args, kwargs), preserve_rng_state=executor.preserve_rng_state
                    )
            recording = self.recording
            assert recording is not None
            with recording.stage(), autocast_cache_off():
                out = call_original(module, args, kwargs)
            if index == region.stop - 1:  # type: ignore[union-attr]
                recording.close()
                self.recording = None
        self.previous_output = out if index + 1 < len(executor.chain) else None
        return out

    # -- replay (runs during backward)
    def run_items(self, items: Sequence[Item], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out: Any = None
        for position, item in enumerate(items):
            first = item.stage if isinstance(item, Store) else item.start
            if position > 0:
                args, kwargs = self.links[first].build(out)
            if isinstance(item, Store):
                # NOTE [random state of replayed stages]
                # The model's own code between stages may draw random numbers, so each
                # stage of a model's forward is replayed from the state it started with.
                # In an nn.Sequential nothing runs between stages: the region's frame
                # replays from the region's start and the stages draw in order (a state
                # restored around each stage would rewind it for the next one).
                state = self.states.get(first)
                module = self.executor.chain.modules[first]
                if state is None:
                    out = call_stage(module, args, kwargs)
                else:
                    with replay_forward_state(state):
                        out = call_stage(module, args, kwargs)
            else:
                out = recompute(_Replay(self, item.body), args, kwargs)
        return out


class _Replay:
    """Replays a region body: the function behind a recompute frame."""

    def __init__(self, run: _Run, body: Sequence[Item]) -> None:
        self.run = run
        self.body = tuple(body)
        first = self.body[0]
        self.__qualname__ = f"stages {first.stage if isinstance(first, Store) else first.start}.."

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.run.run_items(self.body, args, kwargs)


class ChainExecutor:
    """Runs a plan over a chain's stage calls inside the model's forward.

    Args:
        chain: the stages.
        items: the plan tree, in stage-call indices (see :func:`expand_groups`).
        preserve_rng_state: replay RNG states in recomputed stages.
        observer: ``observer(region)`` gives the observer of each top-level region's
            recording (see :class:`remat.recompute.RegionRecording`); used by measurement.
    """

    def __init__(
        self,
        chain: Chain,
        items: Sequence[Item],
        *,
        preserve_rng_state: bool = True,
        observer: Callable[[Region], Any] | None = None,
    ) -> None:
        self.chain = chain
        self.items = tuple(items)
        self.preserve_rng_state = preserve_rng_state
        self.observer = observer
        self.actions: list[tuple[str, Region | None]] = [("store", None)] * len(chain)
        covered = 0
        for item in self.items:
            if isinstance(item, Store):
                self._expect(covered, item.stage)
                covered += 1
            else:
                self._expect(covered, item.start)
                self.actions[item.start] = ("open", item)
                for k in range(item.start + 1, item.stop):
                    self.actions[k] = ("inside", item)
                covered = item.stop
        if covered != len(chain):
            raise RematError(f"the plan covers {covered} of the chain's {len(chain)} stages")

    @staticmethod
    def _expect(covered: int, first: int) -> None:
        if first != covered:
            raise RematError(f"the plan skips from stage {covered} to stage {first}")

    def __call__(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs ``model(*args, **kwargs)`` with the plan applied to its chain."""
        if active_mode() is not None:
            # Inside a block that remat.recompute is already recomputing: that block's
            # frame decides what is kept, the chain runs as plain code inside it.
            return model(*args, **kwargs)
        run = _Run(self)
        with intercept_stages(self.chain, run):
            out = model(*args, **kwargs)
        if run.next_stage != len(self.chain):
            raise UnsupportedModel(
                f"the forward ran {run.next_stage} of the chain's {len(self.chain)} stages; remat "
                "needs every stage to run once per forward"
            )
        return out
