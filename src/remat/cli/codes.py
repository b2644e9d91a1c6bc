"""The exit codes of the ``remat`` command, written once, and its one-line errors."""

from __future__ import annotations

from typing import NamedTuple, NoReturn

__all__ = ["EXIT_CODES", "INSTALL_HINT", "CliError", "ExitCode", "exit_code_table", "fail"]

INSTALL_HINT = "pip install 'remat[cli]'"


class ExitCode(NamedTuple):
    """One exit code of the command: its value, its constant's name and what it means."""

    code: int
    name: str
    meaning: str


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(0, "EXIT_OK", "success"),
    ExitCode(1, "EXIT_MISSING_DEPENDENCY", f"an optional dependency is missing: ``{INSTALL_HINT}``"),
    ExitCode(2, "EXIT_BUDGET_TOO_SMALL", "the budget is below the smallest feasible budget (the message gives it)"),
    ExitCode(3, "EXIT_UNKNOWN_MODEL", "unknown model name (the message lists the catalogue)"),
    ExitCode(4, "EXIT_BAD_BUDGET", "the budget cannot be read (the message lists the accepted forms)"),
    ExitCode(
        5,
        "EXIT_BAD_MODEL",
        "the model factory cannot be imported or called, does not return an ``nn.Module``, "
        "or the model fails on its input",
    ),
    ExitCode(6, "EXIT_OUT_OF_MEMORY", "out of memory on the device while building or running the model"),
    ExitCode(7, "EXIT_USAGE", "invalid command-line arguments"),
    ExitCode(8, "EXIT_UNSUPPORTED_MODEL", "remat cannot plan this model (e.g. its stages are not a chain)"),
    ExitCode(9, "EXIT_CANNOT_WRITE", "an output file cannot be written"),
    ExitCode(130, "EXIT_INTERRUPTED", "interrupted"),
)


def _code(name: str) -> int:
    return next(entry.code for entry in EXIT_CODES if entry.name == name)


EXIT_OK = _code("EXIT_OK")
EXIT_MISSING_DEPENDENCY = _code("EXIT_MISSING_DEPENDENCY")
EXIT_BUDGET_TOO_SMALL = _code("EXIT_BUDGET_TOO_SMALL")
EXIT_UNKNOWN_MODEL = _code("EXIT_UNKNOWN_MODEL")
EXIT_BAD_BUDGET = _code("EXIT_BAD_BUDGET")
EXIT_BAD_MODEL = _code("EXIT_BAD_MODEL")
EXIT_OUT_OF_MEMORY = _code("EXIT_OUT_OF_MEMORY")
EXIT_USAGE = _code("EXIT_USAGE")
EXIT_UNSUPPORTED_MODEL = _code("EXIT_UNSUPPORTED_MODEL")
EXIT_CANNOT_WRITE = _code("EXIT_CANNOT_WRITE")
EXIT_INTERRUPTED = _code("EXIT_INTERRUPTED")


def exit_code_table(*, markup: bool) -> str:
    """The table of exit codes: reStructuredText for the docstring, plain text for ``--help``."""
    width = max(len(str(entry.code)) for entry in EXIT_CODES) + 2
    if markup:
        rule = "=" * (width - 2) + "  " + "=" * 69
        rows = [f"{entry.code:<{width}}{entry.meaning}" for entry in EXIT_CODES]
        return "\n".join([rule, *rows, rule])
    return "\n".join(f"  {entry.code:<{width}}{entry.meaning.replace('``', '')}" for entry in EXIT_CODES)


class CliError(Exception):
    """An error to report as one line on stderr, with its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = " ".join(message.split())


def fail(code: int, message: str) -> NoReturn:
    """Stops the command with a one-line error and an exit code."""
    raise CliError(code, message)
