"""``timeslice report``: how GPU groups were shared, and what sharing cost each RL job.

report = await collect_report(client)                    # every running group, recent jobs
print(format_text(report))
files = write_report(report, Path("report"))             # text, HTML, PNG, trace

Gathering (``gather``) reads groups and jobs from Temporal; ``figures`` computes the figures
(docs/report.md defines each once); ``text``, ``page``, ``picture`` and ``trace`` render them.
The picture needs matplotlib and the page plotly (the ``report`` extra); text and the trace
need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from timeslice.report.gather import DEFAULT_MAX_JOBS, collect_report
from timeslice.report.model import GroupFigures, JobFigures, Lane, Report, Span
from timeslice.report.page import MissingPlotlyError, write_html
from timeslice.report.picture import MissingDependencyError, write_png
from timeslice.report.text import format_text, human_bytes
from timeslice.report.trace import trace_events, write_trace


@dataclass(frozen=True)
class ReportFiles:
    text: Path
    html: Path
    png: Path
    trace: Path


def write_report(report: Report, folder: Path) -> ReportFiles:
    """report.txt, report.html (interactive), timeline.png and trace.json under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "report.txt"
    text.write_text(format_text(report))
    return ReportFiles(
        text=text,
        html=write_html(report, folder / "report.html"),
        png=write_png(report, folder / "timeline.png"),
        trace=write_trace(report, folder / "trace.json"),
    )


__all__ = [
    "DEFAULT_MAX_JOBS",
    "GroupFigures",
    "JobFigures",
    "Lane",
    "MissingDependencyError",
    "MissingPlotlyError",
    "Report",
    "ReportFiles",
    "Span",
    "collect_report",
    "format_text",
    "human_bytes",
    "trace_events",
    "write_html",
    "write_png",
    "write_report",
    "write_trace",
]
