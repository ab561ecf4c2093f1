"""The report as an HTML page: tables and an interactive timeline.

The timeline is a plotly figure: zoom by dragging or with the range slider, hover a bar for its
job, epoch, phase and duration. plotly.js (4.8 MB, nearly all of what a page with it inlined
weighed) is written once beside the page as ``plotly.min.js`` and loaded from there: the
page opens from its folder with no network, and holds only its own data.
"""

from __future__ import annotations

import html
from datetime import datetime
from pathlib import Path

from timeslice.errors import TimesliceError
from timeslice.report.colours import KIND_COLOURS, KIND_NAMES, job_colours
from timeslice.report.model import Report
from timeslice.report.text import (
    GROUP_HEADERS,
    JOB_HEADERS,
    JOBS_ABOUT,
    group_row,
    job_row,
    report_title,
    utilization_line,
)

PLOTLY_JS = "plotly.min.js"


class MissingPlotlyError(TimesliceError, ImportError):
    """plotly (the `report` extra) is not installed."""


def timeline_figure(report: Report) -> object:
    try:
        import plotly.graph_objects as go
    except ImportError as err:
        raise MissingPlotlyError(
            "the interactive report needs plotly: pip install 'timeslice[report]'"
        ) from err
    spans = report.spans
    origin, until = report.window  # what the tables cover, their idle time included

    def at(moment: datetime) -> float:
        return round((moment - origin).total_seconds(), 3)  # ms: the figure's data, halved

    lanes = [f"{lane.name} ({lane.kind})" for lane in report.lanes]
    lane_of = {lane.name: label for lane, label in zip(report.lanes, lanes, strict=True)}
    colours = job_colours(report)
    fig = go.Figure()
    groups: dict[str, list] = {}
    for span in spans:
        key = f"held by {span.job_id}" if span.kind == "lease" else KIND_NAMES[span.kind]
        groups.setdefault(key, []).append(span)
    for key, members in groups.items():
        first = members[0]
        colour = (
            colours.get(first.job_id or "", "#7f7f7f")
            if first.kind == "lease"
            else KIND_COLOURS[first.kind]
        )
        fig.add_trace(
            go.Bar(
                name=key,
                orientation="h",
                y=[lane_of[s.lane] for s in members],
                base=[at(s.start) for s in members],
                x=[max(round(s.seconds, 3), 1e-3) for s in members],
                marker={
                    "color": colour,
                    "line": {"width": 0},
                    "pattern": {"shape": "/"} if first.kind == "idle" else {},
                },
                width=0.9
                if first.kind in ("switching", "moved")
                else 0.5
                if first.kind == "waiting"
                else 0.7,
                # A hover's %{x} is the bar's end: its length goes in customdata.
                customdata=[
                    [s.job_id or "-", "-" if s.epoch is None else s.epoch, s.label, s.seconds]
                    for s in members
                ],
                hovertemplate=(
                    "<b>%{customdata[2]}</b><br>job %{customdata[0]} · epoch %{customdata[1]}"
                    "<br>%{customdata[3]:.3f} s from %{base:.3f} s<extra>%{fullData.name}</extra>"
                ),
            )
        )
    fig.update_layout(
        barmode="overlay",
        height=220 + 48 * max(1, len(lanes)),
        margin={"l": 10, "r": 10, "t": 90, "b": 10},
        title={
            "text": "simulated: GPU phases per job, holders and switches per group"
            if report.simulated
            else "GPU phases per job, holders and switches per group",
            "y": 0.98,
        },
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        hoverlabel={"align": "left"},
    )
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)))
    fig.update_xaxes(
        title="seconds from the start of the simulated run"
        if report.simulated
        else f"seconds from {origin:%H:%M:%S} UTC (the first group's creation)",
        range=[0, max(1.0, (until - origin).total_seconds())],
        rangeslider={"visible": True},
    )
    return fig


def _table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_plotly_js(folder: Path) -> Path:
    """``plotly.min.js`` in ``folder`` (written once: pages in one folder share it).

    Args:
        folder: Where the pages are.

    Returns:
        The script's path.
    """
    from plotly.offline import get_plotlyjs

    path = folder / PLOTLY_JS
    script = get_plotlyjs()
    if not path.exists() or path.stat().st_size != len(script.encode()):
        path.write_text(script)
    return path


def write_html(report: Report, path: Path) -> Path:
    """The page, and ``plotly.min.js`` beside it (which it loads from its folder).

    Args:
        report: What to show.
        path: Where the page goes.

    Returns:
        ``path``.
    """
    fig = timeline_figure(report)
    chart = fig.to_html(  # type: ignore[attr-defined]
        include_plotlyjs="directory",  # <script src="plotly.min.js">: written below
        full_html=False,
        div_id="timeline",
        config={"displaylogo": False},
    )
    title = report_title(report)
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in report.problems)
    notes = "".join(
        f"<li>{html.escape(g.group_id)}: {html.escape(n)}</li>"
        for g in report.groups
        for n in g.notes
    )
    utilization = "".join(
        f"<li>{html.escape(g.group_id)}: "
        f"{html.escape(utilization_line(g, simulated=report.simulated))}</li>"
        for g in report.groups
    )
    about_jobs = " ".join(html.escape(line) for line in JOBS_ABOUT)
    simulated = (
        '<p class="note"><b>A simulation</b> by <code>timeslice plan</code>: the figures are '
        "predicted from the jobs' profiles, not measured; its clock starts at 0.</p>"
        if report.simulated
        else ""
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
p.note {{ color: #555; max-width: 60em; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{simulated}
<h2>GPU groups</h2>
<p class="note">Shares of each group's wall time: <b>phases</b> (its holders' GPU phases running),
<b>lease overhead</b> (leased, no phase running), <b>switching</b> (moving state), <b>idle</b>.
They add up to 100%. Definitions: docs/report.md.</p>
{_table(GROUP_HEADERS, [group_row(g) for g in report.groups])}
{f"<ul>{notes}</ul>" if notes else ""}
<p class="note"><b>Utilization</b>: GPU phase time over the window named (docs/report.md).</p>
<ul class="utilization">{utilization}</ul>
<h2>RL jobs</h2>
<p class="note">{about_jobs}</p>
{_table(JOB_HEADERS, [job_row(j) for j in report.jobs])}
<h2>Timeline</h2>
{chart}
{f"<h2>Problems</h2><ul>{problems}</ul>" if problems else ""}
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_plotly_js(path.parent)
    path.write_text(page)
    return path
