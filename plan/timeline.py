"""``timeslice plan --html``: the recommended assignment's simulated run, drawn as the report draws
a real one (``timeslice.report``: a lane per job and per group, interactive, one file).

The simulated run becomes a :class:`timeslice.report.Report` — spans on a clock that starts at
the time of writing — and goes through the report's own page. Its intervals are also written
as plain data (``FILE.json``: job, group, phase, epoch, kind, start and end in seconds), which
needs nothing installed.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

from timeslice.plan.search import Assignment
from timeslice.plan.simulator import Outcome, Segment


def timeline_rows(outcome: Outcome) -> list[dict[str, object]]:
    return [
        {
            "job": s.job_id,
            "group": s.group_id,
            "phase": s.phase,
            "epoch": s.epoch,
            "kind": s.kind,
            "start": round(s.start, 6),
            "end": round(s.end, 6),
        }
        for s in sorted(outcome.segments, key=lambda s: (s.start, s.job_id))
    ]


def _span_kind(s: Segment) -> str | None:
    """The report's kind of span for a simulated interval on a job's lane."""
    if s.kind == "wait":
        return "waiting"
    if s.kind in ("restore", "evict"):
        return "switching"
    if s.kind != "phase":
        return None
    if s.group_id is None:
        return "rewards"  # off the GPU
    return s.phase if s.phase in ("sample", "train") else "sample"


def to_report(outcome: Outcome, assignment: Assignment, origin: datetime | None = None) -> object:
    """The simulated run as a report (figures as ``docs/report.md`` defines them)."""
    from timeslice.report import GroupFigures, JobFigures, Lane, Report, Span

    at = origin or datetime.now(UTC)

    def when(seconds: float) -> datetime:
        return at + timedelta(seconds=seconds)

    plans = {j.job_id: j for j in assignment.jobs}

    def job_of(actor: str) -> str:
        """An async job's loops are actors of their own (``JOB · sampler``, ``JOB · trainer``),
        drawn in a lane each as the report draws a real async job; figures are the job's."""
        return actor if actor in outcome.jobs else actor.rpartition(" · ")[0]

    async_jobs = {j.job_id for j in assignment.jobs if j.mode == "async"}
    lanes = {j for j in outcome.jobs if j not in async_jobs}
    lanes |= {f"{j} · {loop}" for j in async_jobs for loop in ("sampler", "trainer")}
    job_lanes: dict[str, Lane] = {j: Lane(name=j, kind="job") for j in sorted(lanes)}
    group_lanes: dict[str, Lane] = {g: Lane(name=g, kind="group") for g in sorted(outcome.groups)}
    phase_s: dict[str, dict[str, float]] = {j: {} for j in outcome.jobs}
    waiting: dict[str, float] = dict.fromkeys(outcome.jobs, 0.0)
    moving: dict[str, float] = dict.fromkeys(outcome.jobs, 0.0)
    switching_on: dict[str, float] = dict.fromkeys(outcome.groups, 0.0)
    leased_on: dict[str, float] = dict.fromkeys(outcome.groups, 0.0)
    for s in outcome.segments:
        label = f"epoch {s.epoch} · {s.phase}" + (f" · {s.group_id}" if s.group_id else "")
        kind = _span_kind(s)
        job = job_of(s.job_id)
        if kind is not None and not (s.kind == "evict" and s.group_id is not None):
            job_lanes[s.job_id].spans.append(
                Span(
                    lane=s.job_id,
                    kind=kind,  # type: ignore[arg-type]
                    start=when(s.start),
                    end=when(s.end),
                    job_id=job,
                    group_id=s.group_id,
                    epoch=s.epoch,
                    label=label if s.kind == "phase" else f"{label} ({s.kind})",
                )
            )
        if s.kind == "phase":
            name = s.phase if s.group_id is not None else "rewards"
            phase_s[job][name] = phase_s[job].get(name, 0.0) + (s.end - s.start)
        elif s.kind == "wait":
            waiting[job] += s.end - s.start
        elif s.kind == "restore":
            moving[job] += s.end - s.start
        if s.group_id is not None and s.kind in ("lease", "restore", "evict"):
            group_lanes[s.group_id].spans.append(
                Span(
                    lane=s.group_id,
                    kind="lease" if s.kind == "lease" else "switching",
                    start=when(s.start),
                    end=when(s.end),
                    job_id=job,
                    group_id=s.group_id,
                    epoch=s.epoch,
                    label=f"{s.job_id}" if s.kind == "lease" else f"{s.job_id} {s.kind}",
                )
            )
            if s.kind == "lease":
                leased_on[s.group_id] += s.end - s.start
            else:
                switching_on[s.group_id] += s.end - s.start
    groups = []
    for gid, g in sorted(outcome.groups.items()):
        start = g.first_start or 0.0
        wall = g.wall_s
        switching = min(switching_on[gid], wall)
        overhead = max(0.0, min(leased_on[gid], wall) - g.busy_s - switching)
        groups.append(
            GroupFigures(
                group_id=gid,
                start=when(start),
                end=when(g.last_end),
                wall_s=wall,
                phase_s=g.busy_s,
                overhead_s=overhead,
                switching_s=switching,
                idle_s=max(0.0, wall - g.busy_s - overhead - switching),
                leases=g.leases,
                switches=g.switches,
                overlapped_switches=0,
                bytes_moved=g.bytes_moved,
                wait_p50_s=None,
                wait_p99_s=None,
                notes=["simulated by timeslice plan"],
            )
        )
    jobs = []
    for jid, r in sorted(outcome.jobs.items()):
        plan = plans.get(jid)
        jobs.append(
            JobFigures(
                job_id=jid,
                status="completed",
                epochs_done=r.epochs_done,
                epochs=r.epochs_done,
                groups=sorted(
                    {s.group_id for s in outcome.segments if job_of(s.job_id) == jid and s.group_id}
                ),
                phase_s=phase_s[jid],
                waiting_s=waiting[jid],
                switching_s=moving[jid],
                wall_s=r.completion_s,
                dedicated_s=plan.dedicated_s if plan is not None else None,
                note="simulated",
            )
        )
    return Report(
        generated_at=at,
        groups=groups,
        jobs=jobs,
        lanes=[*job_lanes.values(), *group_lanes.values()],
    )


def write_timeline(outcome: Outcome, assignment: Assignment, html_path: Path) -> list[Path]:
    """``html_path`` (the report's interactive page) and ``html_path`` + ``.json`` (the rows).
    The JSON is written first: it needs nothing installed, the page needs plotly."""
    html_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path = html_path.with_name(html_path.name + ".json")
    rows_path.write_text(json.dumps(timeline_rows(outcome), indent=1) + "\n")
    from timeslice.report import write_html

    report = to_report(outcome, assignment)
    return [rows_path, write_html(report, html_path)]  # type: ignore[arg-type]
