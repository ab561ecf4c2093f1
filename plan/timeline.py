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
from timeslice.protocol.utilization import Interval, merged, phase_time
from timeslice.report.model import GroupFigures, JobFigures, Lane, Report, Span


def _outside(intervals: list[Interval], covered: list[Interval]) -> float:
    """Seconds of ``intervals`` (disjoint, in order) that ``covered`` (likewise) leaves out."""
    total = 0.0
    for start, end in intervals:
        inside = sum(max(0.0, min(end, c_end) - max(start, c_start)) for c_start, c_end in covered)
        total += max(0.0, end - start - inside)
    return total


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


def to_report(outcome: Outcome, assignment: Assignment, origin: datetime | None = None) -> Report:
    """The simulated run as a report (figures as ``docs/report.md`` defines them)."""
    drawing = _Drawing(outcome, assignment, origin or datetime.now(UTC))
    for segment in outcome.segments:
        drawing.add(segment)
    return Report(
        generated_at=drawing.at,
        simulated=True,
        groups=drawing.group_figures(),
        jobs=drawing.job_figures(),
        lanes=[*drawing.job_lanes.values(), *drawing.group_lanes.values()],
    )


class _Drawing:
    """A simulated run's lanes and tallies, segment by segment, on a clock from ``at``."""

    def __init__(self, outcome: Outcome, assignment: Assignment, at: datetime) -> None:
        self.outcome, self.at = outcome, at
        self.plans = {j.job_id: j for j in assignment.jobs}
        async_jobs = {j.job_id for j in assignment.jobs if j.mode == "async"}
        lanes = {j for j in outcome.jobs if j not in async_jobs}
        lanes |= {f"{j} · {loop}" for j in async_jobs for loop in ("sampler", "trainer")}
        self.job_lanes = {j: Lane(name=j, kind="job") for j in sorted(lanes)}
        self.group_lanes = {g: Lane(name=g, kind="group") for g in sorted(outcome.groups)}
        self.phase_s: dict[str, dict[str, float]] = {j: {} for j in outcome.jobs}
        self.waiting = dict.fromkeys(outcome.jobs, 0.0)
        self.moving = dict.fromkeys(outcome.jobs, 0.0)
        # Per group, the intervals of its leases and of its moves: a move beside a lease (an
        # overlapped or staged one) is no switching time, as in the report of a real run.
        self.leases_on: dict[str, list[Interval]] = {g: [] for g in outcome.groups}
        self.moves_on: dict[str, list[Interval]] = {g: [] for g in outcome.groups}

    def when(self, seconds: float) -> datetime:
        return self.at + timedelta(seconds=seconds)

    def job_of(self, actor: str) -> str:
        """An async job's loops are actors of their own (``JOB · sampler``, ``JOB · trainer``),
        drawn in a lane each as the report draws a real async job; figures are the job's."""
        return actor if actor in self.outcome.jobs else actor.rpartition(" · ")[0]

    def add(self, s: Segment) -> None:
        """One simulated interval: on its job's lane, its group's, and in the tallies."""
        job = self.job_of(s.job_id)
        kind = _span_kind(s)
        if kind is not None and not (s.kind == "evict" and s.group_id is not None):
            label = f"epoch {s.epoch} · {s.phase}" + (f" · {s.group_id}" if s.group_id else "")
            self.job_lanes[s.job_id].spans.append(
                self._span(s, s.job_id, kind, label if s.kind == "phase" else f"{label} ({s.kind})")
            )
        seconds = s.end - s.start
        if s.kind == "phase":
            name = s.phase if s.group_id is not None else "rewards"
            self.phase_s[job][name] = self.phase_s[job].get(name, 0.0) + seconds
        elif s.kind == "wait":
            self.waiting[job] += seconds
        elif s.kind == "restore":
            self.moving[job] += seconds
        if s.group_id is not None and s.kind in ("lease", "restore", "evict"):
            leased = s.kind == "lease"
            self.group_lanes[s.group_id].spans.append(
                self._span(
                    s,
                    s.group_id,
                    "lease" if leased else "switching",
                    s.job_id if leased else f"{s.job_id} {s.kind}",
                )
            )
            (self.leases_on if leased else self.moves_on)[s.group_id].append((s.start, s.end))

    def _span(self, s: Segment, lane: str, kind: str, label: str) -> Span:
        return Span(
            lane=lane,
            kind=kind,  # type: ignore[arg-type]
            start=self.when(s.start),
            end=self.when(s.end),
            job_id=self.job_of(s.job_id),
            group_id=s.group_id,
            epoch=s.epoch,
            label=label,
        )

    def group_figures(self) -> list[GroupFigures]:
        figures = []
        for gid, g in sorted(self.outcome.groups.items()):
            wall = g.wall_s
            leases = merged(self.leases_on[gid])
            leased = min(phase_time(leases), wall)
            switching = min(_outside(merged(self.moves_on[gid]), leases), wall - leased)
            overhead = max(0.0, leased - g.busy_s)
            figures.append(
                GroupFigures(
                    group_id=gid,
                    start=self.when(g.first_start or 0.0),
                    end=self.when(g.last_end),
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
                    # Its first phase's start to its last phase's end: the window of its
                    # utilization while jobs ran, as the plan's table prints it.
                    active_start=self.when(g.first_start or 0.0),
                    active_end=self.when(g.last_end),
                )
            )
        return figures

    def job_figures(self) -> list[JobFigures]:
        figures = []
        segments = self.outcome.segments
        for jid, r in sorted(self.outcome.jobs.items()):
            plan = self.plans.get(jid)
            groups = {s.group_id for s in segments if self.job_of(s.job_id) == jid and s.group_id}
            figures.append(
                JobFigures(
                    job_id=jid,
                    status="completed",
                    epochs_done=r.epochs_done,
                    epochs=r.epochs_done,
                    groups=sorted(groups),
                    phase_s=self.phase_s[jid],
                    waiting_s=self.waiting[jid],
                    switching_s=self.moving[jid],
                    wall_s=r.completion_s,
                    dedicated_s=plan.dedicated_s if plan is not None else None,
                    dedicated_from="simulated",
                    note="simulated",
                )
            )
        return figures


def write_timeline(outcome: Outcome, assignment: Assignment, html_path: Path) -> list[Path]:
    """``html_path`` (the report's interactive page) and ``html_path`` + ``.json`` (the rows).
    The JSON is written first: it needs nothing installed, the page needs plotly."""
    html_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path = html_path.with_name(html_path.name + ".json")
    rows_path.write_text(json.dumps(timeline_rows(outcome), indent=1) + "\n")
    from timeslice.report import write_html

    return [rows_path, write_html(to_report(outcome, assignment), html_path)]
