"""The benchmark's figure: the memory/time trade-off, and live memory over one training step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from remat.bench.result import BASELINE, BenchmarkResult, BenchmarkRow, StepTimeline, describe_threads
from remat.units import MIB

__all__ = ["plot_figure", "save_plot"]

_COLOURS = {"baseline": "tab:gray", "checkpoint_sequential": "tab:orange", "remat": "tab:blue"}
_MARKERS = {"baseline": "s", "checkpoint_sequential": "D", "remat": "o"}
_KIND_NAMES = (
    ("baseline", "no recompute"),
    ("checkpoint_sequential", "checkpoint_sequential"),
    ("remat", "remat (optimal schedule)"),
)
# Where a point's label may go, in offset points, tried in order until one is free.
_LABEL_OFFSETS = (
    (10, 6, "left", "bottom"),
    (10, -6, "left", "top"),
    (-10, 6, "right", "bottom"),
    (-10, -6, "right", "top"),
    (14, 18, "left", "bottom"),
    (14, -18, "left", "top"),
    (-14, 18, "right", "bottom"),
    (-14, -18, "right", "top"),
)

Box = tuple[float, float, float, float]


def save_plot(result: BenchmarkResult, path: str | Path, *, title: str | None = None) -> Path:
    """Draws the benchmark (see :func:`plot_figure`) into a PNG file.

    Args:
        result: what :func:`remat.bench.run_benchmark` returned.
        path: the image file to write.
        title: the figure's title (default: the model and device).

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'remat[cli]'``).
    """
    from matplotlib import pyplot as plt

    path = Path(path)
    figure = plot_figure(result, title=title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_figure(result: BenchmarkResult, *, title: str | None = None) -> Any:
    """The benchmark's figure, two panels (a matplotlib ``Figure``; the caller closes it).

    Left: measured peak memory against median step time for every strategy that ran,
    each point labelled. Right: live activation memory over one training step for the
    chosen remat strategy with its budget line, and for no recompute as a reference.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5.6), constrained_layout=True)
    figure.suptitle(title or _default_title(result.metadata), fontsize=13)
    ran = [row for row in result.rows if row.ran and row.median_step_s is not None]
    _draw_trade_off(left, ran)
    _draw_timelines(right, result.timelines.get(BASELINE), result.timeline)
    points = [(_step_ms(row), _peak_mib(row), row.strategy.replace("remat @ ", "@ ")) for row in ran]
    _place_labels(figure, left, points)
    return figure


def _default_title(meta: dict[str, Any]) -> str:
    shapes = " + ".join("x".join(map(str, shape)) for shape in meta.get("input_shapes", [])) or "?"
    return (
        f"remat benchmark: {meta.get('model', 'model')}, input {shapes}, on {meta.get('device', '?')} "
        f"with {describe_threads(meta)}, median of {meta.get('steps', '?')} steps"
    )


def _step_ms(row: BenchmarkRow) -> float:
    return (row.median_step_s or 0.0) * 1000


def _peak_mib(row: BenchmarkRow) -> float:
    return (row.measured_peak_bytes or 0) / MIB


def _draw_trade_off(axes: Any, ran: list[BenchmarkRow]) -> None:
    for kind, name in _KIND_NAMES:
        points = [row for row in ran if row.kind == kind]
        if points:
            axes.scatter(
                [_step_ms(row) for row in points],
                [_peak_mib(row) for row in points],
                s=70,
                color=_COLOURS[kind],
                marker=_MARKERS[kind],
                label=name,
                zorder=3,
                edgecolors="black",
                linewidths=0.6,
            )
    remat_points = sorted((row for row in ran if row.kind == "remat"), key=_peak_mib)
    if len(remat_points) > 1:
        axes.plot(
            [_step_ms(row) for row in remat_points],
            [_peak_mib(row) for row in remat_points],
            color=_COLOURS["remat"],
            alpha=0.35,
            zorder=2,
        )
    axes.set_xlabel("median step time (ms), forward + backward")
    axes.set_ylabel("measured peak activation memory (MiB)")
    axes.set_title("memory / time trade-off (lower left is better)")
    axes.grid(True, alpha=0.3)
    if ran:
        axes.set_xlim(0, max(_step_ms(row) for row in ran) * 1.35)
        axes.set_ylim(0, max(_peak_mib(row) for row in ran) * 1.25)
    axes.legend(loc="lower right", fontsize=9)


def _draw_timeline(axes: Any, timeline: StepTimeline, colour: str, linewidth: float) -> None:
    peak_mib = max(timeline.live_bytes, default=0) / MIB
    axes.plot(
        range(len(timeline.live_bytes)),
        [value / MIB for value in timeline.live_bytes],
        color=colour,
        linewidth=linewidth,
        label=f"{timeline.strategy} (peak {peak_mib:.2f} MiB)",
    )


def _draw_timelines(axes: Any, baseline: StepTimeline | None, chosen: StepTimeline | None) -> None:
    if baseline is not None:
        _draw_timeline(axes, baseline, _COLOURS["baseline"], 1.2)
    title = "live activation memory over one training step"
    if chosen is not None:
        _draw_timeline(axes, chosen, _COLOURS["remat"], 1.4)
        if chosen.budget_bytes is not None:
            budget_mib = chosen.budget_bytes / MIB
            axes.axhline(
                budget_mib, color="tab:red", linestyle="--", linewidth=1.2, label=f"budget {budget_mib:.2f} MiB"
            )
        title = f"{title}: {chosen.strategy}"
    axes.set_title(title)
    axes.set_xlabel("allocation / free event of the step")
    axes.set_ylabel("live activation memory (MiB)")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper right", fontsize=9)


def _place_labels(figure: Any, axes: Any, points: list[tuple[float, float, str]]) -> None:
    """Labels scatter points, trying a few positions around each so that labels do not overlap."""
    figure.canvas.draw()  # settle the layout: display coordinates are final from here on
    renderer = figure.canvas.get_renderer()
    frame = axes.get_window_extent(renderer)
    frame_box = (frame.x0, frame.y0, frame.x1, frame.y1)
    taken: list[Box] = []
    if points:
        for x, y in axes.transData.transform([(px, py) for px, py, _ in points]):
            taken.append((x - 7, y - 7, x + 7, y + 7))
    legend = axes.get_legend()
    if legend is not None:
        box = legend.get_window_extent(renderer)
        taken.append((box.x0, box.y0, box.x1, box.y1))
    for x, y, text in sorted(points, key=lambda point: -point[1]):
        taken.append(_label_one(axes, renderer, (x, y), text, frame_box, taken))


def _label_one(axes: Any, renderer: Any, point: tuple[float, float], text: str, frame: Box, taken: list[Box]) -> Box:
    """Places one label at the first free position around its point; returns its box."""
    for dx, dy, horizontal, vertical in _LABEL_OFFSETS:
        annotation = axes.annotate(
            text,
            point,
            xytext=(dx, dy),
            textcoords="offset points",
            ha=horizontal,
            va=vertical,
            fontsize=8.5,
            arrowprops={"arrowstyle": "-", "color": "0.55", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 4},
        )
        box = _text_box(annotation, renderer)
        if _is_free(box, frame, taken):
            return box
        annotation.remove()
    annotation = axes.annotate(text, point, xytext=_LABEL_OFFSETS[0][:2], textcoords="offset points", fontsize=8.5)
    return _text_box(annotation, renderer)


def _text_box(annotation: Any, renderer: Any) -> Box:
    from matplotlib.text import Text

    annotation.set_in_layout(False)
    annotation.update_positions(renderer)
    extent = Text.get_window_extent(annotation, renderer)  # the text, without the leader line
    return (extent.x0, extent.y0, extent.x1, extent.y1)


def _is_free(box: Box, frame: Box, taken: list[Box]) -> bool:
    inside = box[0] >= frame[0] and box[2] <= frame[2] and box[1] >= frame[1] and box[3] <= frame[3]
    return inside and not any(
        box[0] < other[2] and other[0] < box[2] and box[1] < other[3] and other[1] < box[3] for other in taken
    )
