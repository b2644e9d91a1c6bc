"""How many remat functions one measured step calls, and how often the call crosses modules.

``python benchmarks/call_profile.py`` measures a 13-stage MLP chain (one step of
``Checkpointable.measure``) under ``sys.setprofile`` and counts:

* calls: every call of a Python function defined in ``src/remat``, except the model zoo
  under ``src/remat/models`` (there it is the user model's own code, not remat's);
* switches: consecutive remat calls whose functions live in different modules.

It is a structural figure (how tangled the measured path is), not a timing.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

import remat
from remat.models import mlp_chain

_PACKAGE = str(Path(remat.__file__).resolve().parent)
_MODELS = "models/"  # the user model's code in this benchmark: not counted


def profile_measurement(depth: int = 13, width: int = 64, batch: int = 16) -> tuple[int, int, Counter[str]]:
    """Returns (calls, switches, calls per module) of one measurement of an MLP chain."""
    torch.manual_seed(0)
    model = mlp_chain(depth, width)
    wrapper = remat.Checkpointable(model, 0.5)
    sample = torch.randn(batch, width)
    calls = 0
    switches = 0
    per_module: Counter[str] = Counter()
    last_module: str | None = None

    def on_event(frame, event, _arg):  # type: ignore[no-untyped-def]
        nonlocal calls, switches, last_module
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if not filename.startswith(_PACKAGE):
            return
        module = filename[len(_PACKAGE) + 1 :]
        if module.startswith(_MODELS):
            return
        calls += 1
        per_module[module] += 1
        if last_module is not None and module != last_module:
            switches += 1
        last_module = module

    sys.setprofile(on_event)
    try:
        wrapper.measure(sample)
    finally:
        sys.setprofile(None)
    return calls, switches, per_module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=13)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    profile_measurement(options.depth)  # warm-up: lazy imports and first-call paths
    calls, switches, per_module = profile_measurement(options.depth)
    print(
        f"one measured step of a {options.depth}-stage chain: {calls} remat calls, {switches} switches between modules"
    )
    for module, count in per_module.most_common():
        print(f"  {count:6d}  {module}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
