"""The printable plan report and its JSON form."""

from __future__ import annotations

import json

from remat.plan import PlanReport, Region, Schedule, Store, format_bytes, format_seconds, solve
from remat.testing import random_chain


def test_format_helpers() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(5 * 2**30) == "5.00 GiB"
    assert format_seconds(2.5) == "2.500 s"
    assert format_seconds(0.0123) == "12.30 ms"
    assert format_seconds(4.2e-5) == "42.0 us"
    assert format_seconds(0.0) == "0.000 s"


def test_report_text() -> None:
    profile = random_chain(2, 5, max_units=50, unit_bytes=2**20)
    plan = (Region(0, 2, (Store(0), Store(1))), Store(2), Region(3, 4, (Store(3),)), Store(4))
    schedule = Schedule.from_plan(profile, plan, budget_bytes=2**30, solver_name="manual")
    text = str(schedule)
    assert text == str(PlanReport(schedule))
    assert "remat plan: 5 stages, solver 'manual'" in text
    assert "budget:          1.00 GiB" in text
    assert format_bytes(schedule.predicted_peak_bytes) in text
    assert "of storing everything" in text and "overhead +" in text
    assert "recomputed:      3 of 5 stages, 3 extra forwards" in text
    table = text.splitlines()[-6:]
    assert table[0].split() == [
        "stage", "name", "forward", "backward", "output", "saved", "decision", "runs"
    ]  # fmt: skip
    assert table[1].split()[1] == "stage0" and table[1].split()[-2:] == ["recompute", "2"]
    assert table[3].split()[-2:] == ["keep", "1"]


def test_report_dict_is_json_able() -> None:
    profile = random_chain(4, 6, unit_bytes=1024)
    schedule = solve(profile, None, solver="inputs")
    report = schedule.report()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["solver"] == "inputs"
    assert data["n_stages"] == 6
    assert data["budget_bytes"] is None
    assert data["predicted_peak_bytes"] == schedule.predicted_peak_bytes
    assert data["baseline_peak_bytes"] == report.baseline.peak_bytes
    assert data["overhead_fraction"] == schedule.overhead_s / report.baseline.time_s
    assert [stage["kept"] for stage in data["stages"]] == [False] * 5 + [True]
    assert [stage["forward_runs"] for stage in data["stages"]] == [2] * 5 + [1]
    assert data["plan"][:3] == [{"region": [0, 1]}, {"store": 0}, {"end": [0, 1]}]
    assert "budget:          unlimited" in str(report)
    assert "PlanReport(solver='inputs'" in repr(report)
