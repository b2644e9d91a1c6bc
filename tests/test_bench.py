"""``remat.bench``: the side-by-side benchmark behind ``remat bench``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from remat.automatic import Checkpointable
from remat.bench import (
    BASELINE,
    CHECKPOINT_SEQUENTIAL,
    BenchmarkResult,
    run_benchmark,
    save_plot,
)
from remat.errors import RematError, UnsupportedModel
from remat.models import mlp_chain

WIDTH = 16


def make_batch() -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, WIDTH, generator=generator)
    return (inputs,), torch.randn(8, WIDTH, generator=generator)


def tiny_model() -> nn.Sequential:
    return mlp_chain(depth=6, width=WIDTH)


@pytest.fixture(scope="module")
def result() -> BenchmarkResult:
    torch.manual_seed(0)
    return run_benchmark(
        tiny_model, make_batch, F.mse_loss, budgets=(1.0, "0.5", "min", 1), steps=2, warmup=1, threads=1
    )


def test_rows_cover_every_strategy_in_order(result: BenchmarkResult) -> None:
    assert [row.strategy for row in result.rows] == [
        BASELINE,
        CHECKPOINT_SEQUENTIAL,
        "remat @ 1.0",
        "remat @ 0.5",
        "remat @ min",
        "remat @ 1",
        "remat @ ckpt-seq memory",
    ]
    assert result.row(CHECKPOINT_SEQUENTIAL).segments == 3  # ceil(sqrt(6))
    with pytest.raises(KeyError, match="no strategy"):
        result.row("remat @ 42")


def test_every_remat_step_fits_its_budget(result: BenchmarkResult) -> None:
    ran = [row for row in result.rows if row.kind == "remat" and row.ran]
    assert len(ran) == 4
    for row in ran:
        assert row.budget_bytes is not None and row.measured_peak_bytes is not None
        assert row.measured_peak_bytes <= row.budget_bytes
        assert row.fits_budget is True
        assert row.predicted_peak_bytes is not None and row.predicted_peak_bytes <= row.budget_bytes
        assert row.predicted_overhead_ratio is not None and row.predicted_overhead_ratio >= 1.0
    smallest = result.row("remat @ min")
    assert smallest.measured_peak_bytes < result.row(BASELINE).measured_peak_bytes  # type: ignore[operator]
    assert smallest.recomputed_forwards and smallest.recomputed_forwards > 0


def test_the_ckpt_seq_budget_is_what_checkpoint_sequential_measured(result: BenchmarkResult) -> None:
    assert result.row("remat @ ckpt-seq memory").budget_bytes == result.row(CHECKPOINT_SEQUENTIAL).measured_peak_bytes


def test_an_infeasible_budget_is_a_row_with_an_error(result: BenchmarkResult) -> None:
    row = result.row("remat @ 1")
    assert not row.ran
    assert row.error is not None and "minimum" in row.error
    assert row.median_step_s is None and row.step_times_s == []


def test_times_and_overheads(result: BenchmarkResult) -> None:
    baseline = result.row(BASELINE)
    assert baseline.overhead_ratio == 1.0
    for row in result.rows:
        if row.ran:
            assert len(row.step_times_s) == 2
            assert row.median_step_s is not None and row.median_step_s > 0
            assert row.overhead_ratio == pytest.approx(row.median_step_s / baseline.median_step_s)  # type: ignore[operator]


def test_timelines_of_the_baseline_and_the_tightest_plan(result: BenchmarkResult) -> None:
    assert result.chosen_strategy == "remat @ min"
    assert result.timeline is not None and result.timeline.strategy == "remat @ min"
    assert set(result.timelines) == {BASELINE, "remat @ min"}
    assert max(result.timeline.live_bytes) == result.row("remat @ min").measured_peak_bytes
    assert max(result.timelines[BASELINE].live_bytes) == result.row(BASELINE).measured_peak_bytes
    assert result.timeline.budget_bytes == result.row("remat @ min").budget_bytes


def test_json_and_markdown(result: BenchmarkResult) -> None:
    document = json.loads(result.to_json())
    assert document["format"] == "remat.benchmark"
    assert len(document["rows"]) == len(result.rows)
    assert document["metadata"]["threads"] == 1
    assert document["metadata"]["n_stages"] == 6
    markdown = result.to_markdown()
    assert markdown.splitlines()[0].startswith("| strategy | budget | measured peak |")
    assert "| remat @ min |" in markdown
    assert "remat @ 1: infeasible" in markdown


def test_model_is_left_as_it_was_and_threads_restored() -> None:
    model = tiny_model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    threads = torch.get_num_threads()
    calls: list[tuple[int, int, str]] = []
    run_benchmark(
        model,
        make_batch,
        F.mse_loss,
        budgets=("min",),
        steps=1,
        warmup=0,
        threads=1,
        include_checkpoint_sequential=False,
        progress=lambda done, total, label: calls.append((done, total, label)),
    )
    assert torch.get_num_threads() == threads
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert calls[0] == (0, 3, BASELINE)
    assert calls[-1] == (3, 3, "done")


def test_save_plot_writes_a_png(result: BenchmarkResult, tmp_path) -> None:
    path = save_plot(result, tmp_path / "figure.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figure_shows_every_strategy_and_both_step_timelines(result: BenchmarkResult, tmp_path) -> None:
    """What the image shows: points and labels for the strategies that ran, two memory curves
    and the budget line, and pixels that are not blank in either panel."""
    from matplotlib import image
    from matplotlib import pyplot as plt

    from remat.bench import plot_figure

    ran = [row for row in result.rows if row.ran and row.median_step_s is not None]
    figure = plot_figure(result)
    try:
        trade_off, timelines = figure.axes
        points = sum(len(collection.get_offsets()) for collection in trade_off.collections)
        assert points == len(ran)
        labels = sorted(text.get_text() for text in trade_off.texts)
        assert labels == sorted(row.strategy.replace("remat @ ", "@ ") for row in ran)
        curves = [line.get_label() for line in timelines.get_lines()]
        chosen = result.timeline
        assert chosen is not None and chosen.budget_bytes is not None
        assert len(curves) == 3  # no recompute, the chosen remat strategy, its budget line
        assert curves[0].startswith(BASELINE) and curves[1].startswith(chosen.strategy)
        assert curves[2].startswith("budget")
        assert list(timelines.get_lines()[1].get_ydata()) == [value / 2**20 for value in chosen.live_bytes]
    finally:
        plt.close(figure)
    pixels = image.imread(save_plot(result, tmp_path / "figure.png"))
    height, width = pixels.shape[:2]
    assert (height, width) == (616, 1540)  # 14 x 5.6 inches at 110 dpi
    for panel in (pixels[:, : width // 2], pixels[:, width // 2 :]):
        rgb = panel[..., :3]
        not_white = (rgb < 0.95).any(axis=-1).mean()
        colours = len({tuple(pixel) for pixel in (rgb[::4, ::4] * 255).astype(int).reshape(-1, 3)})
        assert not_white > 0.03, not_white
        assert colours > 20, colours


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"steps": 0}, ValueError), ({"warmup": -1}, ValueError)],
)
def test_bad_arguments(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        run_benchmark(tiny_model, make_batch, F.mse_loss, **kwargs)


def test_needs_a_module() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        run_benchmark(lambda: object(), make_batch, F.mse_loss)  # type: ignore[arg-type, return-value]


def test_a_model_without_a_chain_is_rejected_with_a_hint() -> None:
    with pytest.raises(UnsupportedModel, match="remat.mark"):
        run_benchmark(lambda: nn.Linear(WIDTH, WIDTH), make_batch, F.mse_loss, steps=1)


class _LoopModel(nn.Module):
    """Blocks called in a loop from an explicit forward: no checkpoint_sequential baseline."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_any_model_runs_without_the_sequential_baseline() -> None:
    result = run_benchmark(_LoopModel, make_batch, F.mse_loss, budgets=("min",), steps=1)
    names = [row.strategy for row in result.rows]
    assert names == ["no recompute", "remat @ min"]
    row = result.row("remat @ min")
    baseline = result.row("no recompute")
    assert row.fits_budget
    assert row.measured_peak_bytes < baseline.measured_peak_bytes


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(self.norm(x))


def test_nested_plans_split_the_blocks() -> None:
    blocks = [nn.Sequential(_Residual(), _Residual()) for _ in range(3)]
    result = run_benchmark(
        lambda: nn.Sequential(*blocks), make_batch, F.mse_loss, budgets=("min",), steps=1, nested=True
    )
    assert result.metadata["nested"] is True
    # each residual block runs its norm and its product as two stages
    assert result.metadata["n_planned_stages"] > 6
    assert result.row("remat @ min").fits_budget


def test_a_budget_that_cannot_be_planned_is_a_row_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Checkpointable.plan_for

    def failing(self: Checkpointable, mem_limit: object = ...) -> object:
        if mem_limit == 0.5:
            raise RematError("the solver failed")
        return original(self, mem_limit)

    monkeypatch.setattr(Checkpointable, "plan_for", failing)
    result = run_benchmark(
        tiny_model, make_batch, F.mse_loss, budgets=(0.5, "min"), steps=1, warmup=0, include_checkpoint_sequential=False
    )
    assert result.row("remat @ 0.5").error == "planning failed: the solver failed"
    assert result.row("remat @ min").ran


def test_a_failing_checkpoint_sequential_is_a_row_with_an_error() -> None:
    # torch's checkpoint_sequential rejects an in-place ReLU at a segment boundary; remat
    # fuses it with the stage before and runs.
    def model() -> nn.Sequential:
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(inplace=True)]
        # 24 stages, 5 segments of 4: the third segment starts with an in-place ReLU
        return nn.Sequential(*layers)

    result = run_benchmark(model, make_batch, F.mse_loss, budgets=("min",), steps=1, threads=1)
    checkpoint = result.row("checkpoint_sequential sqrt(n)")
    assert checkpoint.error is not None and checkpoint.measured_peak_bytes is None
    assert result.row("remat @ min").fits_budget
