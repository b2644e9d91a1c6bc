"""Progress shown while the command measures a model."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from remat.cli.render import Output

__all__ = ["measuring_progress"]


@contextlib.contextmanager
def measuring_progress(name: str, output: Output) -> Iterator[Callable[[str], None]]:
    """A progress bar over the measurement's phases, fed by the library's log records."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from remat.measure.step import MEASURING_PHASES

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=output.err, transient=True) as progress:
        task = progress.add_task(f"measuring {name}: a warm-up step", total=MEASURING_PHASES + 1)

        def show(what: str, done: int = 0) -> None:
            progress.update(task, completed=done, description=f"measuring {name}: {what}")

        class _Phases(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                phase = getattr(record, "remat_phase", None)
                if phase is not None:
                    show(phase[2], phase[0])

        handler, logger = _Phases(logging.DEBUG), logging.getLogger("remat")
        level = logger.level
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        try:
            yield show
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
