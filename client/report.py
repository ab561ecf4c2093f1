"""``timeslice report``: how GPU groups were shared, and what sharing cost each RL job.

report = await collect_report(client)                  # every running group, recent jobs
print(format_text(report))
files = write_report(report, Path("report"))           # report.txt, report.html, timeline.png

Per group (from its ``status`` query): busy / switching / idle fractions of its wall time,
switches, bytes moved, acquire-wait percentiles, and its recent leases and switches (a Gantt
chart). Per job (from its result, or its ``progress`` query while it runs): epochs, phase time
totals, lease waits, reward first → last, and the slowdown against its dedicated time.

The PNG needs matplotlib (``pip install 'timeslice[report]'``); text and HTML need nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import InvalidArgumentError, TimesliceError, UnknownGroupError
from timeslice.workflows.protocol import (
    GROUP_WORKFLOW_TYPE,
    GroupStatus,
    SwitchRecord,
    check_id,
    group_workflow_id,
)
from timeslice.workflows.rl_protocol import (
    RL_JOB_WORKFLOW_TYPE,
    RLJobProgress,
    RLJobResult,
    rl_job_workflow_id,
)

PHASES = ("sample", "rewards", "train")
DEFAULT_MAX_JOBS = 50
QUERY_TIMEOUT = timedelta(seconds=15)  # a workflow no worker serves never answers
# Colours of jobs in the timeline (matplotlib's tab10), and of switches.
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#7f7f7f",
)
SWITCH_COLOUR = "#111111"


class MissingDependencyError(TimesliceError, ImportError):
    """An optional library the report needs is not installed."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LeaseSpan(_Model):
    job_id: str
    token: int
    start: datetime
    end: datetime
    outcome: str = Field(description="a LeaseOutcome, or 'held' for the lease held now")


class GroupReport(_Model):
    """One GPU group over its whole life: ``start`` (creation) to ``end`` (the report's query).

    busy = time some job held the lease; switching = time spent moving jobs' state in and out
    (by the group between holders, or by a holder inside its own lease, which then does not
    count as busy); idle = the rest. The three are disjoint, so the fractions sum to 1.
    ``leases`` and ``switch_marks`` are the most recent ones the group keeps (its
    ``history_keep``), for the timeline.
    """

    group_id: str
    start: datetime
    end: datetime
    wall_s: float
    busy_s: float
    switching_s: float
    idle_s: float
    lease_count: int
    switches: int
    overlapped_switches: int
    bytes_moved: int
    wait_p50_s: float | None
    wait_p99_s: float | None
    holder: str | None
    queued: int
    leases: list[LeaseSpan]
    switch_marks: list[SwitchRecord]

    @property
    def busy(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def switching(self) -> float:
        return self.switching_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def idle(self) -> float:
        return self.idle_s / self.wall_s if self.wall_s > 0 else 0.0


JobStatus = Literal[
    "running", "completed", "failed", "cancelled", "terminated", "timed_out", "unknown"
]


class JobReport(_Model):
    """One RL job (all its continue-as-new runs).

    ``dedicated_s`` is the sum of the job's own phase times (sample + rewards + train over its
    recorded epochs): what the job would take alone on a dedicated GPU with zero waiting. It
    leaves out start-up, preparing, checkpoints and dispatch, and the phases of epochs redone
    after a rewind, so even a job alone has a ``slowdown`` (= ``wall_s / dedicated_s``) a
    little above 1. ``wall_s`` runs from the first run's start to the close (or now).
    """

    job_id: str
    status: JobStatus
    epochs_done: int
    epochs: int | None = Field(None, description="the target, when known (running jobs)")
    phase_s: dict[str, float] = Field(default_factory=dict)
    wait_s: dict[str, float] = Field(default_factory=dict, description="lease wait per purpose")
    reward_first: float | None = None
    reward_last: float | None = None
    rewinds: int = 0
    wall_s: float | None = None
    note: str | None = None

    @property
    def waiting_s(self) -> float:
        return sum(self.wait_s.values())

    @property
    def dedicated_s(self) -> float | None:
        total = sum(self.phase_s.get(p, 0.0) for p in PHASES)
        return total if total > 0 else None

    @property
    def slowdown(self) -> float | None:
        dedicated = self.dedicated_s
        if dedicated is None or self.wall_s is None:
            return None
        return self.wall_s / dedicated


class Report(_Model):
    generated_at: datetime
    groups: list[GroupReport]
    jobs: list[JobReport]
    problems: list[str] = Field(default_factory=list, description="what could not be read")


@dataclass(frozen=True)
class ReportFiles:
    text: Path
    html: Path
    png: Path


# ---------------------------------------------------------------- collecting


def group_report(status: GroupStatus, now: datetime | None = None) -> GroupReport:
    """Summarise one group's ``status`` (pure: no I/O).

    A status runs to the group's last event (a query sees the workflow's clock, which stands
    still between events); ``now``, the time of the query, extends it: the time since then
    was held by the holder, or idle.
    """
    stats = status.stats
    end = stats.created_at + timedelta(seconds=status.wall_s)
    since = max(0.0, (now - end).total_seconds()) if now is not None else 0.0
    end += timedelta(seconds=since)
    held_s = status.holder.held_s + since if status.holder is not None else 0.0
    wall = max(status.wall_s + since, 0.0)
    busy = min(wall, stats.busy_s + held_s)
    switching = min(wall - busy, stats.switching_s)
    leases = [
        LeaseSpan(job_id=r.job_id, token=r.token, start=r.start, end=r.end, outcome=r.outcome)
        for r in status.history
    ]
    if status.holder is not None:
        leases.append(
            LeaseSpan(
                job_id=status.holder.job_id,
                token=status.holder.token,
                start=end - timedelta(seconds=held_s),
                end=end,
                outcome="held",
            )
        )
    return GroupReport(
        group_id=status.group_id,
        start=stats.created_at,
        end=end,
        wall_s=wall,
        busy_s=busy,
        switching_s=switching,
        idle_s=max(0.0, wall - busy - switching),
        lease_count=stats.leases,
        switches=stats.switches,
        overlapped_switches=stats.overlapped_switches,
        bytes_moved=stats.bytes_moved,
        wait_p50_s=status.wait_p50_s,
        wait_p99_s=status.wait_p99_s,
        holder=status.holder.job_id if status.holder is not None else None,
        queued=len(status.queue),
        leases=leases,
        switch_marks=list(status.switch_history),
    )


def job_report_from_result(
    result: RLJobResult, *, status: JobStatus = "completed", wall_s: float | None = None
) -> JobReport:
    """Summarise a finished job from its result (pure: no I/O)."""
    rewards = [r for r in result.rewards if r is not None]
    return JobReport(
        job_id=result.job_id,
        status=status,
        epochs_done=result.epochs_done,
        phase_s=dict(result.phase_s),
        wait_s=dict(result.wait_s),
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        rewinds=result.rewinds,
        wall_s=wall_s,
        note="stopped early" if result.stopped else None,
    )


def job_report_from_progress(
    progress: RLJobProgress, *, status: JobStatus = "running", wall_s: float | None = None
) -> JobReport:
    """Summarise a job from its ``progress`` query (pure: no I/O)."""
    rewards = [r for r in progress.rewards if r is not None]
    return JobReport(
        job_id=progress.job_id,
        status=status,
        epochs_done=progress.epoch,
        epochs=progress.epochs,
        phase_s=dict(progress.phase_s),
        wait_s=dict(progress.wait_s),
        reward_first=rewards[0] if rewards else None,
        reward_last=rewards[-1] if rewards else None,
        rewinds=progress.rewinds,
        wall_s=wall_s,
        note=None if status == "running" else f"phase: {progress.phase}",
    )


async def collect_report(
    client: Client,
    *,
    groups: list[str] | None = None,
    jobs: list[str] | None = None,
    max_jobs: int = DEFAULT_MAX_JOBS,
) -> Report:
    """Query groups and RL jobs into a :class:`Report`.

    ``groups``: group ids (workflow ``gpu-group-<id>``); None: every running group workflow.
    ``jobs``: job ids (workflow ``rl-job-<id>``, latest run); None: the ``max_jobs`` most
    recently started RL job workflows. A finished job is read from its result; a running one
    (or one that failed) from its ``progress`` query.

    A named group that does not exist raises UnknownGroupError, a malformed id
    InvalidArgumentError; a discovered group that does not answer its query, and a named job
    that does not exist, are noted in ``Report.problems`` / the job's ``note`` instead.
    """
    for kind, ids in (("group id", groups), ("job id", jobs)):
        for value in ids or []:
            try:
                check_id(kind, value)
            except ValueError as err:
                raise InvalidArgumentError(str(err)) from None
    now = datetime.now(UTC)
    named = groups is not None
    if groups is None:
        groups = await _discover(client, GROUP_WORKFLOW_TYPE, "gpu-group-", running_only=True)
    if jobs is None:
        jobs = (await _discover(client, RL_JOB_WORKFLOW_TYPE, "rl-job-"))[:max_jobs]
    answers = await asyncio.gather(
        *(_group_status(client, g) for g in groups), return_exceptions=True
    )
    queried = datetime.now(UTC)
    group_reports: list[GroupReport] = []
    problems: list[str] = []
    for group_id, answer in zip(groups, answers, strict=True):
        if isinstance(answer, GroupStatus):
            group_reports.append(group_report(answer, queried))
        elif named or not isinstance(answer, Exception):
            raise answer
        else:
            problems.append(f"group {group_id}: no status ({answer})")
    job_reports = await asyncio.gather(*(_job(client, j, now) for j in jobs))
    return Report(generated_at=now, groups=group_reports, jobs=list(job_reports), problems=problems)


async def _discover(
    client: Client, workflow_type: str, prefix: str, *, running_only: bool = False
) -> list[str]:
    """Ids (without ``prefix``) of workflows of a type, most recently started first, once each."""
    query = f'WorkflowType="{workflow_type}"'
    if running_only:
        query += ' AND ExecutionStatus="Running"'
    seen: dict[str, datetime] = {}
    async for execution in client.list_workflows(query):
        if not execution.id.startswith(prefix):
            continue
        key = execution.id[len(prefix) :]
        started = execution.start_time
        if key not in seen or started > seen[key]:
            seen[key] = started
    return sorted(seen, key=lambda k: seen[k], reverse=True)


async def _group_status(client: Client, group_id: str) -> GroupStatus:
    handle = client.get_workflow_handle(group_workflow_id(group_id))
    try:
        return await handle.query("status", result_type=GroupStatus, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise UnknownGroupError(
                f"no GPU group {group_id!r} (no workflow {group_workflow_id(group_id)})"
            ) from err
        raise


_STATUS_NAMES: dict[WorkflowExecutionStatus, JobStatus] = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}


async def _job(client: Client, job_id: str, now: datetime) -> JobReport:
    workflow_id = rl_job_workflow_id(job_id)
    handle = client.get_workflow_handle(workflow_id, result_type=RLJobResult)
    try:
        latest = await handle.describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return JobReport(
                job_id=job_id, status="unknown", epochs_done=0, note=f"no workflow {workflow_id}"
            )
        raise
    started = latest.start_time
    first_run_id = latest.raw_info.first_run_id
    if first_run_id and first_run_id != latest.run_id:
        with contextlib.suppress(RPCError):  # past retention: count from the latest run
            first = client.get_workflow_handle(workflow_id, run_id=first_run_id)
            started = (await first.describe()).start_time
    status = _STATUS_NAMES.get(latest.status, "unknown") if latest.status else "unknown"
    closed = latest.close_time
    wall_s = ((closed or now) - started).total_seconds() if started else None
    latest_handle = client.get_workflow_handle(
        workflow_id, run_id=latest.run_id, result_type=RLJobResult
    )
    if status == "completed":
        result = await latest_handle.result()
        return job_report_from_result(result, wall_s=wall_s)
    try:
        progress = await latest_handle.query(
            "progress", result_type=RLJobProgress, rpc_timeout=QUERY_TIMEOUT
        )
    except Exception as err:  # a closed run needs a worker to answer; report what we know
        return JobReport(
            job_id=job_id, status=status, epochs_done=0, wall_s=wall_s, note=f"no progress: {err}"
        )
    return job_report_from_progress(progress, status=status, wall_s=wall_s)


# ---------------------------------------------------------------- tables


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _secs(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _reward(job: JobReport) -> str:
    if job.reward_first is None or job.reward_last is None:
        return "-"
    return f"{job.reward_first:.3f} → {job.reward_last:.3f}"


GROUP_HEADERS = (
    "group",
    "wall s",
    "busy",
    "switching",
    "idle",
    "leases",
    "switches",
    "moved",
    "wait p50 s",
    "wait p99 s",
)
JOB_HEADERS = (
    "job",
    "status",
    "epochs",
    "sample s",
    "rewards s",
    "train s",
    "waiting s",
    "wall s",
    "slowdown",
    "reward first → last",
)


def group_rows(report: Report) -> list[tuple[str, ...]]:
    return [
        (
            g.group_id,
            _secs(g.wall_s, 1),
            _pct(g.busy),
            _pct(g.switching),
            _pct(g.idle),
            str(g.lease_count),
            str(g.switches),
            human_bytes(g.bytes_moved),
            _secs(g.wait_p50_s, 3),
            _secs(g.wait_p99_s, 3),
        )
        for g in report.groups
    ]


def job_rows(report: Report) -> list[tuple[str, ...]]:
    rows = []
    for j in report.jobs:
        epochs = str(j.epochs_done) if j.epochs is None else f"{j.epochs_done}/{j.epochs}"
        slowdown = j.slowdown
        rows.append(
            (
                j.job_id,
                j.status,
                epochs,
                _secs(j.phase_s.get("sample")),
                _secs(j.phase_s.get("rewards")),
                _secs(j.phase_s.get("train")),
                _secs(j.waiting_s),
                _secs(j.wall_s, 1),
                "-" if slowdown is None else f"{slowdown:.2f}x",
                _reward(j),
            )
        )
    return rows


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned columns: the first (a name) left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def format_text(report: Report) -> str:
    """The report as aligned text tables (what ``timeslice report`` prints)."""
    out = [f"timeslice report · {report.generated_at:%Y-%m-%d %H:%M:%S} UTC", ""]
    out.append("GPU groups (fractions of wall time since the group was created)")
    out += _table(GROUP_HEADERS, group_rows(report)) if report.groups else ["  none"]
    for g in report.groups:
        extra = []
        if g.holder is not None:
            extra.append(f"held by {g.holder}")
        if g.queued:
            extra.append(f"{g.queued} waiting")
        if g.overlapped_switches:
            extra.append(f"{g.overlapped_switches} overlapped switches")
        if extra:
            out.append(f"  {g.group_id}: {', '.join(extra)}")
    out += ["", "RL jobs (slowdown = wall time / sum of the job's own phase times)"]
    out += _table(JOB_HEADERS, job_rows(report)) if report.jobs else ["  none"]
    for j in report.jobs:
        extra = []
        if j.rewinds:
            extra.append(f"{j.rewinds} rewinds")
        if j.note:
            extra.append(j.note)
        if extra:
            out.append(f"  {j.job_id}: {', '.join(extra)}")
    if report.problems:
        out += ["", "Problems", *(f"  {p}" for p in report.problems)]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- timeline


@dataclass(frozen=True)
class _Bar:
    job_id: str
    start: float
    end: float
    label: str


@dataclass(frozen=True)
class _Row:
    group_id: str
    label: str
    leases: list[_Bar]
    switches: list[_Bar]


@dataclass(frozen=True)
class Timeline:
    """The chart's data in seconds from the first lease: one row per group."""

    rows: list[_Row]
    colours: dict[str, str]
    span_s: float


def _switch_label(s: SwitchRecord) -> str:
    how = " · overlapped" if s.overlapped else " · by the holder" if s.by_holder else ""
    took = (s.end - s.start).total_seconds()
    return (
        f"switch {s.from_job or '-'} → {s.to_job or '-'} · {took:.3f} s"
        f" · {human_bytes(s.bytes)}{how}"
    )


def timeline(report: Report) -> Timeline:
    starts = [lease.start for g in report.groups for lease in g.leases]
    origin = min(starts) if starts else report.generated_at
    colours: dict[str, str] = {}
    for lease in sorted((x for g in report.groups for x in g.leases), key=lambda x: x.start):
        colours.setdefault(lease.job_id, PALETTE[len(colours) % len(PALETTE)])

    def sec(t: datetime) -> float:
        return (t - origin).total_seconds()

    rows = []
    for g in report.groups:
        leases = [
            _Bar(
                x.job_id,
                sec(x.start),
                sec(x.end),
                f"{x.job_id} · token {x.token} · {sec(x.end) - sec(x.start):.3f} s · {x.outcome}",
            )
            for x in g.leases
        ]
        switches = [
            _Bar(s.to_job or s.from_job or "", sec(s.start), sec(s.end), _switch_label(s))
            for s in g.switch_marks
        ]
        label = f"{g.group_id} · busy {g.busy:.0%}"
        rows.append(_Row(g.group_id, label, leases, switches))
    ends = [b.end for r in rows for b in (*r.leases, *r.switches)]
    return Timeline(rows, colours, max([0.0, *ends]))


def write_png(report: Report, path: Path) -> Path:
    """The timeline as a PNG Gantt chart (matplotlib, Agg backend)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as err:
        raise MissingDependencyError(
            "timeline.png needs matplotlib: pip install 'timeslice[report]' (or matplotlib)"
        ) from err
    tl = timeline(report)
    fig = Figure(figsize=(11, 1.6 + 0.7 * max(1, len(tl.rows))), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for y, row in enumerate(tl.rows):
        ax.broken_barh(
            [(b.start, max(b.end - b.start, 1e-6)) for b in row.leases],
            (y - 0.35, 0.7),
            facecolors=[tl.colours[b.job_id] for b in row.leases],
            edgecolor="white",
            linewidth=0.5,
        )
        for s in row.switches:
            # A band for the switch's duration, and a tick so even an instant one shows.
            ax.broken_barh(
                [(s.start, s.end - s.start)], (y - 0.45, 0.9), facecolors=SWITCH_COLOUR, alpha=0.6
            )
            ax.vlines(s.start, y - 0.45, y + 0.45, colors=SWITCH_COLOUR, linewidth=0.9)
    ax.set_yticks(range(len(tl.rows)), [r.label for r in tl.rows])
    ax.set_ylim(-0.6, max(1, len(tl.rows)) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tl.span_s, 1.0) * 1.01)
    ax.set_xlabel("seconds from the first lease")
    ax.set_title("GPU group leases (one bar per lease, coloured by job; dark marks: switches)")
    ax.grid(axis="x", alpha=0.3)
    if not tl.rows or not any(r.leases for r in tl.rows):
        ax.text(0.5, 0.5, "no leases recorded", transform=ax.transAxes, ha="center")
    handles = [Patch(facecolor=c, label=j) for j, c in tl.colours.items()]
    handles.append(Line2D([], [], color=SWITCH_COLOUR, linewidth=2, label="switch"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _nice_step(span: float, target: int = 8) -> float:
    raw = max(span, 1e-9) / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def _svg_rect(x: float, y: float, w: float, h: float, style: str, title: str) -> str:
    return (
        f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" {style}>'
        f"<title>{html.escape(title)}</title></rect>"
    )


def timeline_svg(report: Report, width: int = 1000) -> str:
    """The same timeline as inline SVG (no scripts, no external fonts or styles)."""
    tl = timeline(report)
    left, right, top, row_h = 200, 20, 30, 34
    rows_h = row_h * max(1, len(tl.rows))
    legend_y = top + rows_h + 40
    height = legend_y + 24 * math.ceil((len(tl.colours) + 1) / 5) + 10
    span = max(tl.span_s, 1.0)
    scale = (width - left - right) / span

    def x(t: float) -> float:
        return left + t * scale

    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" role="img">',
        "<title>GPU group leases by job, with switches</title>",
    ]
    step = _nice_step(span)
    t = 0.0
    while t <= span + 1e-9:
        out.append(
            f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{top + rows_h}" '
            'stroke="#ddd"/>'
            f'<text x="{x(t):.1f}" y="{top + rows_h + 15}" text-anchor="middle">{t:g}</text>'
        )
        t += step
    out.append(
        f'<text x="{left + (width - left - right) / 2}" y="{top + rows_h + 32}" '
        'text-anchor="middle">seconds from the first lease</text>'
    )
    for i, row in enumerate(tl.rows):
        y = top + i * row_h
        out.append(
            f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" '
            f'text-anchor="end">{esc(row.label)}</text>'
        )
        for b in row.leases:
            width_px = max(0.5, (b.end - b.start) * scale)
            style = f'fill="{tl.colours[b.job_id]}" stroke="#fff" stroke-width="0.5"'
            out.append(_svg_rect(x(b.start), y + 5, width_px, row_h - 10, style, b.label))
        for b in row.switches:
            width_px = max(1.0, (b.end - b.start) * scale)
            style = f'fill="{SWITCH_COLOUR}" fill-opacity="0.7"'
            out.append(_svg_rect(x(b.start), y + 2, width_px, row_h - 4, style, b.label))
    if not any(r.leases for r in tl.rows):
        out.append(f'<text x="{left + 10}" y="{top + row_h / 2 + 4}">no leases recorded</text>')
    entries = [*tl.colours.items(), ("switch", SWITCH_COLOUR)]
    for k, (name, colour) in enumerate(entries):
        lx, ly = 10 + (k % 5) * 195, legend_y + (k // 5) * 24
        out.append(
            f'<rect x="{lx}" y="{ly}" width="14" height="14" fill="{colour}"/>'
            f'<text x="{lx + 20}" y="{ly + 12}">{esc(name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


_CSS = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f4f4; }
p.note { color: #555; max-width: 60em; }
"""


def _html_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def format_html(report: Report) -> str:
    """A self-contained HTML page: the timeline as inline SVG, and both tables."""
    when = f"{report.generated_at:%Y-%m-%d %H:%M:%S} UTC"
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>timeslice report · {when}</title>",
            f"<style>{_CSS}</style></head><body>",
            f"<h1>timeslice report</h1><p>generated {when}</p>",
            "<h2>Timeline</h2>",
            timeline_svg(report),
            "<h2>GPU groups</h2>",
            _html_table(GROUP_HEADERS, group_rows(report)),
            '<p class="note">Fractions of each group\'s wall time since it was created: busy '
            "(a job held the lease), switching (evicting / restoring state between holders), "
            "idle (the rest). Waits are the time from an acquire request to its grant.</p>",
            "<h2>RL jobs</h2>",
            _html_table(JOB_HEADERS, job_rows(report)),
            '<p class="note">Slowdown = the job\'s wall time / its dedicated time, the sum of '
            "its own sample, rewards and train phase times: what it would take alone with no "
            "waiting (start-up, preparing and checkpoints are not counted, so a job alone "
            "shows a little above 1).</p>",
            *(
                ["<h2>Problems</h2><ul>"]
                + [f"<li>{html.escape(p)}</li>" for p in report.problems]
                + ["</ul>"]
                if report.problems
                else []
            ),
            "</body></html>",
        ]
    )


def write_report(report: Report, out_dir: Path) -> ReportFiles:
    """Write ``report.txt``, ``report.html`` and ``timeline.png`` under ``out_dir``.

    Text and HTML are written first; the PNG then raises MissingDependencyError if matplotlib
    is not installed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / "report.txt"
    text.write_text(format_text(report), encoding="utf-8")
    page = out_dir / "report.html"
    page.write_text(format_html(report), encoding="utf-8")
    png = write_png(report, out_dir / "timeline.png")
    return ReportFiles(text=text, html=page, png=png)


__all__ = [
    "GroupReport",
    "JobReport",
    "LeaseSpan",
    "MissingDependencyError",
    "Report",
    "ReportFiles",
    "collect_report",
    "format_html",
    "format_text",
    "group_report",
    "human_bytes",
    "job_report_from_progress",
    "job_report_from_result",
    "timeline",
    "timeline_svg",
    "write_png",
    "write_report",
]
