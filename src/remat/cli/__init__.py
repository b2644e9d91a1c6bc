"""The ``remat`` command (documented below, in ``__doc__``, built with its exit-code table)."""

from remat.cli.codes import (
    EXIT_BAD_BUDGET,
    EXIT_BAD_MODEL,
    EXIT_BUDGET_TOO_SMALL,
    EXIT_CANNOT_WRITE,
    EXIT_INTERRUPTED,
    EXIT_MISSING_DEPENDENCY,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_UNKNOWN_MODEL,
    EXIT_UNSUPPORTED_MODEL,
    EXIT_USAGE,
    exit_code_table,
)
from remat.cli.main import main

__doc__ = (  # the exit codes come from the one table in remat.cli.codes
    """The ``remat`` command: see a model's recompute plan, and benchmark it, from the shell.

Subcommands::

    remat models                      the ready-made models, with parameter counts
    remat plan MODEL [--budget B]     measure MODEL, solve, print the plan (or --json)
    remat bench MODEL [--budgets ..]  no recompute vs checkpoint_sequential vs remat:
                                      exact peak memory and step time, table/JSON/PNG
    remat demo [--out DIR]            a bench of resnet_small on the CPU, with a PNG

MODEL is a name from ``remat models``, or ``package.module:function``: a function with no
arguments that returns an ``nn.Module``, or a tuple ``(model, sample_input)``. A
model without a sample input needs ``--input-shape C,H,W``: the input is then a random
float tensor of shape ``(batch, C, H, W)``. Catalogue models train on synthetic data with
their own loss; a user's model trains on its input with the sum of its output as the loss.

Exit codes:

"""
    + exit_code_table(markup=True)
    + """

Every error is one line on stderr, ``remat: error: ...``; ``--debug`` shows the traceback.
The command is the output layer of remat: the only place that prints.
"""
)

__all__ = [
    "EXIT_BAD_BUDGET",
    "EXIT_BAD_MODEL",
    "EXIT_BUDGET_TOO_SMALL",
    "EXIT_CANNOT_WRITE",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEPENDENCY",
    "EXIT_OK",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_UNKNOWN_MODEL",
    "EXIT_UNSUPPORTED_MODEL",
    "EXIT_USAGE",
    "main",
]
