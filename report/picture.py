"""The timeline as a picture (PNG, matplotlib): the whole run above, a zoomed window below.

One lane per job — its phases coloured (sample, rewards, train), its waits for a group and its
state moving back — and one per group: who held it (coloured by job) and its switches.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from timeslice.errors import TimesliceError
from timeslice.report.colours import KIND_COLOURS, KIND_NAMES, job_colours
from timeslice.report.model import Lane, Report, Span
from timeslice.report.text import utilization_line

if TYPE_CHECKING:
    from matplotlib.axes import Axes


class MissingDependencyError(TimesliceError, ImportError):
    """An optional library the report needs is not installed."""


def zoom_window(report: Report, seconds: float = 20.0) -> tuple[float, float]:
    """A window of ``seconds`` in the middle of the run (past the start-up), in seconds from
    the start of the report's window: what the lower panel shows in detail."""
    spans = [s for s in report.spans if s.kind in ("sample", "train")]
    if not spans:
        return 0.0, seconds
    origin = report.window[0]
    first = min(s.start for s in spans)
    last = max(s.end for s in spans)
    middle = ((first - origin).total_seconds() + (last - origin).total_seconds()) / 2
    start = max((first - origin).total_seconds(), middle - seconds / 2)
    return start, start + seconds


def write_png(report: Report, path: Path, *, zoom_s: float = 20.0) -> Path:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise MissingDependencyError(
            "timeline.png needs matplotlib: pip install 'timeslice[report]'"
        ) from err
    lanes = report.lanes
    # The window the tables cover (Report.window): the groups' lives, their idle time too.
    origin, until = report.window
    colours = job_colours(report)
    span_s = max(1.0, (until - origin).total_seconds())
    # A run longer than the window gets a second panel: a window in its middle, in detail.
    zoomed = span_s > 1.5 * zoom_s
    height = 1.2 + 0.45 * max(1, len(lanes)) + 0.2 * min(5, len(report.groups))
    fig = Figure(figsize=(13, 1.0 + (2 if zoomed else 1) * height), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if zoomed else 1, 1, squeeze=False)[:, 0]
    overview = axes[0]
    _draw(overview, lanes, origin, colours)
    shown = [
        "a simulated run (timeslice plan): predicted, not measured"
        if report.simulated
        else "the whole run: from the first group's creation to the report, as in the tables"
    ]
    shown += [
        f"{g.group_id}: utilization {utilization_line(g, simulated=report.simulated)}"
        for g in report.groups[:4]
    ]
    if len(report.groups) > 4:
        shown.append(f"... and {len(report.groups) - 4} more groups (report.txt)")
    overview.set_title(
        "\n".join(shown),
        loc="left",
        fontsize="medium",
    )
    overview.set_xlim(0, span_s * 1.01)
    if zoomed:
        window = zoom_window(report, zoom_s)
        _draw(axes[1], lanes, origin, colours)
        axes[1].set_title(f"{window[0]:.0f} to {window[1]:.0f} s in detail", loc="left",
                          fontsize="medium")  # fmt: skip
        axes[1].set_xlim(*window)
    axes[-1].set_xlabel(
        "seconds from the start of the simulated run"
        if report.simulated
        else f"seconds from {origin:%H:%M:%S} UTC"
    )
    handles = [
        Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k], hatch="///", edgecolor="#b0b0b0")
        if k == "idle"
        else Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k])
        for k in legend_kinds(report)
    ]
    holders = {s.job_id for s in report.spans if s.kind == "lease"}
    handles += [
        Patch(facecolor=c, label=f"held by {job}") for job, c in colours.items() if job in holders
    ]
    overview.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    if not report.spans:
        overview.text(0.5, 0.5, "nothing recorded", transform=overview.transAxes, ha="center")
    fig.suptitle("GPU phases per job, holders and switches per group", x=0.01, ha="left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def legend_kinds(report: Report) -> list[str]:
    """The kinds of span the picture draws, in the palette's order: its legend lists those."""
    present = {s.kind for s in report.spans}
    return [k for k in KIND_COLOURS if k in present]


# What each lane draws, in order (waits first, phases over them, switches last, thin, so they
# show on top; idle hatched), and how tall.
LAYERS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("idle",), 0.7),
    (("waiting",), 0.5),
    (("lease", "sample", "phase", "rewards", "train"), 0.7),
    (("switching", "moved"), 0.9),
)


def bars(lane: Lane, origin: datetime) -> list[tuple[str, float, float]]:
    """(kind, start, width) in seconds from ``origin`` of every bar ``lane`` draws."""
    return [
        (s.kind, (s.start - origin).total_seconds(), max(s.seconds, 1e-4))
        for kinds, _ in LAYERS
        for s in lane.spans
        if s.kind in kinds
    ]


def _draw(ax: Axes, lanes: list[Lane], origin: datetime, colours: dict[str, str]) -> None:
    def colour(span: Span) -> str:
        if span.kind == "lease":
            return colours.get(span.job_id or "", "#7f7f7f")
        return KIND_COLOURS[span.kind]

    for y, lane in enumerate(lanes):
        drawn = bars(lane, origin)
        for kinds, height in LAYERS:
            spans = [s for s in lane.spans if s.kind in kinds]
            if spans:
                ax.broken_barh(
                    [(start, width) for kind, start, width in drawn if kind in kinds],
                    (y - height / 2, height),
                    facecolors=[colour(s) for s in spans],
                    linewidth=0.5 if kinds == ("idle",) else 0,
                    edgecolor="#b0b0b0" if kinds == ("idle",) else None,
                    hatch="///" if kinds == ("idle",) else None,
                )
    ax.set_yticks(range(len(lanes)), [f"{lane.name} ({lane.kind})" for lane in lanes])
    ax.set_ylim(-0.6, max(1, len(lanes)) - 0.4)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
