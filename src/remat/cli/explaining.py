"""``remat explain``: every operation of a model's training step, and what recompute does with it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

import remat
from remat.bench.runner import call_with
from remat.cli.codes import EXIT_OK, EXIT_USAGE, fail
from remat.cli.loading import THREADS_HELP, Workload, pin_threads, warm_up
from remat.cli.render import Output, bytes_and_mib
from remat.manual import policies

__all__ = ["add_explain_command", "command_explain", "policy_from_text"]

POLICY_FORMS = "save_matmuls, save_nothing, save_all, recompute:OP[,OP...] or save:OP[,OP...]"


def policy_from_text(text: str) -> policies.Policy:
    """A policy from the command line: a name, or ``recompute:`` / ``save:`` and operation names."""
    named = {
        "save_matmuls": policies.save_matmuls,
        "save_nothing": policies.save_nothing,
        "save_all": policies.save_all,
    }
    if text in named:
        return named[text]
    kind, _, ops = text.partition(":")
    names = [op.strip() for op in ops.split(",") if op.strip()]
    if kind not in ("recompute", "save") or not names:
        fail(EXIT_USAGE, f"--policy {text!r} is not a policy; use {POLICY_FORMS} (e.g. recompute:gelu,softmax)")
    try:
        return policies.recompute_ops(*names) if kind == "recompute" else policies.save_ops(*names)
    except remat.RematError as error:
        fail(EXIT_USAGE, f"--policy {text!r}: {error}")


def add_explain_command(
    commands: Any, add_arguments: Sequence[Callable[[argparse.ArgumentParser], None]], epilog: str
) -> None:
    """Adds the ``explain`` subcommand; `add_arguments` add the options it shares with the others."""
    explain = commands.add_parser(
        "explain",
        help="list each operation of a step: kept, recomputed or freed",
        description=(
            "Run one training step of MODEL with every stage recomputed under --policy (or under the plan "
            "for --budget) and list each ATen operation of the forward and backward: its output's bytes and "
            "whether it is kept for backward, recomputed or freed, with the totals."
        ),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add in add_arguments:
        add(explain)
    how = explain.add_mutually_exclusive_group()
    how.add_argument(
        "--policy",
        default="save_matmuls",
        metavar="POLICY",
        help=f"how each stage is recomputed: {POLICY_FORMS} (default save_matmuls)",
    )
    how.add_argument("--budget", default=None, metavar="B", help="explain the automatic plan for this budget instead")
    explain.add_argument("--ops", action="store_true", help="list every operation, not only the per-operation summary")
    explain.add_argument("--json", action="store_true", help="print a JSON document instead of tables")
    explain.add_argument("--threads", type=int, default=None, metavar="N", help=THREADS_HELP)


def command_explain(args: argparse.Namespace, output: Output, workload: Workload, budget_of: Callable[..., Any]) -> int:
    """Runs ``remat explain`` on a loaded workload; `budget_of` reads ``--budget``."""
    pin_threads(args.threads)
    model = workload.model
    inputs, target = workload.make_batch()
    if args.budget is not None:
        how = f"the plan for a budget of {args.budget}"
        budget = budget_of(args.budget, allow_minimum=True)
        remat.enable(model, budget, loss_fn=workload.measurement_loss(target), output_kept=False)  # as remat plan
    else:
        policy = policy_from_text(args.policy)
        how = f"every stage recomputed under {policy!r}"
        remat.enable(model, policy=policy)
    warm_up(workload, inputs, target)  # measured, planned, its chain found: not in the step explained

    def step(batch: Any) -> torch.Tensor:
        return workload.loss_fn(call_with(model, batch), target)

    explanation = remat.explain(step, inputs)
    if args.json:
        output.raw(json.dumps({"model": workload.name, "recompute": how, **explanation.to_dict()}, indent=2))
        return EXIT_OK
    totals = explanation.totals
    output.text(f"{workload.name}: one training step, {how}")
    output.text(
        f"kept for backward by the policy {bytes_and_mib(totals['kept_bytes'])}, "
        f"recomputed in backward {bytes_and_mib(totals['recomputed_bytes'])}"
    )
    output.raw(explanation.format(ops=args.ops))
    return EXIT_OK
