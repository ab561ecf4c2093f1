"""The report's figures and lanes, computed from what the groups and jobs recorded (no I/O).

Group figures come from the group's ``status`` (its lease, switch and wait accounting) and the
phases of the RL jobs that held it (each phase's own interval, reported by its process); job
figures from the job's phase results. docs/report.md defines every figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from timeslice.protocol.group import GroupStatus
from timeslice.protocol.rl_job import PhaseResult
from timeslice.protocol.utilization import active_window, merged, phase_time
from timeslice.report.model import GroupFigures, JobFigures, JobStatus, Lane, Span, SpanKind


@dataclass
class JobRecord:
    """What was read about one RL job: every phase it ran (all runs, rewinds included)."""

    job_id: str
    status: JobStatus
    epochs_done: int = 0
    epochs: int | None = None
    groups: list[str] = field(default_factory=list)
    phases: list[PhaseResult] = field(default_factory=list)
    # The server's time each phase's activity completed: places phases recorded without a
    # wall-clock anchor (older job processes) on the timeline.
    completed_at: list[datetime | None] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    rewinds: int = 0
    started: datetime | None = None
    ended: datetime | None = None
    note: str | None = None
    # Phase activities whose result did not read as a PhaseResult (the job refused it too).
    skipped_results: int = 0
    # False: no RL job of this id exists (a named job, or an embedded client's job id).
    found: bool = True
    # An async job: its sampler's phases and its trainer's get a lane each; each training
    # step's staleness, in the order trained (parallel to the train phases; None: unknown).
    mode: str = "sync"
    staleness: list[int | None] = field(default_factory=list)
    # Runs of the same job id before the one read (the report reads the latest run only).
    earlier_runs: int = 0
    # What a closed run failed with: its error's type and message.
    failure: str | None = None


def _wall(phase: PhaseResult, completed_at: datetime | None) -> float | None:
    """Seconds to add to the phase's monotonic times to get POSIX time."""
    if phase.wall_offset_s is not None:
        return phase.wall_offset_s
    if completed_at is not None:
        return completed_at.timestamp() - phase.mono_end
    return None


def _at(mono: float, offset: float) -> datetime:
    return datetime.fromtimestamp(mono + offset, tz=UTC)


def job_lane(job: JobRecord, phase: PhaseResult) -> str:
    """The lane a phase of ``job`` is drawn in: the job's, or for an async job its sampler's
    (sample, rewards) or its trainer's (train)."""
    if job.mode != "async":
        return job.job_id
    return f"{job.job_id} · {'trainer' if phase.phase == 'train' else 'sampler'}"


def job_spans(job: JobRecord) -> list[Span]:
    """The job's lane (an async job's two): each phase, each wait for a grant, each restore of
    its own state."""
    spans: list[Span] = []
    staleness = iter(job.staleness)
    last_gpu: tuple[str, datetime] | None = None  # a sync job's last GPU phase: group, end
    for phase, completed in zip(job.phases, job.completed_at, strict=True):
        stale = next(staleness, None) if job.mode == "async" and phase.phase == "train" else None
        offset = _wall(phase, completed)
        if offset is None:
            continue
        group = phase.group_id
        if job.mode != "async" and group is not None:
            if last_gpu is not None and last_gpu[0] != group:
                # A sync job runs on one group: a new one is a move its pool made.
                spans.append(_moved(job, phase, last_gpu, _at(phase.mono_start, offset)))
            last_gpu = (group, _at(phase.mono_end, offset))
        if phase.asked_mono is not None and phase.granted_mono is not None:
            waited = (phase.asked_mono, phase.granted_mono)
            spans.append(_job_span(job, phase, offset, "waiting", waited, f"waiting for {group}"))
        if phase.restored and phase.granted_mono is not None:
            moved = sum(r.bytes for r in phase.restored)
            restoring = (phase.granted_mono, phase.mono_start)
            label = f"state back onto {group} ({moved} B)"
            spans.append(_job_span(job, phase, offset, "switching", restoring, label))
        label = _phase_label(phase) + ("" if stale is None else f" · staleness {stale}")
        ran = (phase.mono_start, phase.mono_end)
        spans.append(_job_span(job, phase, offset, phase.phase, ran, label))
    return spans


def _moved(
    job: JobRecord, phase: PhaseResult, before: tuple[str, datetime], arrived: datetime
) -> Span:
    """The job's move from ``before``'s group (its last phase there ended then) to
    ``phase``'s, whose first phase there started at ``arrived``."""
    return Span(
        lane=job.job_id,
        kind="moved",
        start=before[1],
        end=max(arrived, before[1]),
        job_id=job.job_id,
        group_id=phase.group_id,
        epoch=phase.epoch,
        label=f"moved from {before[0]} to {phase.group_id}",
    )


def _job_span(
    job: JobRecord,
    phase: PhaseResult,
    offset: float,
    kind: SpanKind,
    mono: tuple[float, float],
    label: str,
) -> Span:
    """A span of ``phase`` on the job's lane, over ``mono`` (the process's monotonic clock,
    ``offset`` seconds behind POSIX time)."""
    return Span(
        lane=job_lane(job, phase),
        kind=kind,
        start=_at(mono[0], offset),
        end=_at(mono[1], offset),
        job_id=job.job_id,
        group_id=phase.group_id,
        epoch=phase.epoch,
        label=label,
    )


def _phase_label(phase: PhaseResult) -> str:
    """A GPU phase's label, with the group's answer when it asked to carry its lease on."""
    if phase.group_id is None:
        return phase.phase
    label = f"{phase.phase} on {phase.group_id}"
    if phase.carry:
        label += f" · {'kept' if phase.kept else 'handed on'}: {phase.carry}"
    return label


def job_figures(job: JobRecord, spans: list[Span], dedicated_s: float | None = None) -> JobFigures:
    """The job's figures from its record: its phases' own seconds, its waits for grants, the
    restores of its state, its wall time, carries asked and kept, and (async) staleness."""
    phase_s: dict[str, float] = {}
    for phase in job.phases:
        phase_s[phase.phase] = phase_s.get(phase.phase, 0.0) + (phase.mono_end - phase.mono_start)
    waiting = sum(s.seconds for s in spans if s.kind == "waiting")
    switching = sum(r.seconds for phase in job.phases for r in phase.restored)
    wall = None
    if job.started is not None:
        wall = ((job.ended or datetime.now(UTC)) - job.started).total_seconds()
    return JobFigures(
        job_id=job.job_id,
        status=job.status,
        epochs_done=job.epochs_done,
        epochs=job.epochs,
        groups=job.groups,
        phase_s=phase_s,
        waiting_s=waiting,
        switching_s=switching,
        wall_s=wall,
        dedicated_s=dedicated_s,
        rewards=job.rewards,
        rewinds=job.rewinds,
        carries_asked=sum(1 for phase in job.phases if phase.carry),
        carries_kept=sum(1 for phase in job.phases if phase.carry and phase.kept),
        note=job.note,
        failure=job.failure,
        earlier_runs=job.earlier_runs,
        mode=job.mode,
        staleness=[s for s in job.staleness if s is not None],
    )


def group_figures(
    status: GroupStatus, now: datetime | None, phases: list[Span], rl_jobs: set[str]
) -> tuple[GroupFigures, list[Span]]:
    """The group's figures over its life, and its lane.

    A status runs to the group's last event (a query sees the workflow's clock, which stands
    still between events); ``now``, the time of the query, extends it: the time since then
    was held by the holder, or idle. ``phases``: the RL jobs' GPU phases on this group; of the
    other jobs (embedded clients) the phases they reported with their releases count, and the
    leases of those that reported none count whole (:func:`client_phases`)."""
    if status.as_of is not None and now is not None:
        # The one way figures come to the reader's clock (status and report alike); a status
        # without ``as_of`` (hand-built, or from an older group) is extended below instead.
        status, now = status.advanced_to(now), None
    stats = status.stats
    end = stats.created_at + timedelta(seconds=status.wall_s)
    since = max(0.0, (now - end).total_seconds()) if now is not None else 0.0
    end += timedelta(seconds=since)
    held_s = status.holder.held_s + since if status.holder is not None else 0.0
    wall = max(status.wall_s + since, 0.0)
    busy = min(wall, max(0.0, stats.busy_s + held_s))
    switching = min(wall - busy, stats.switching_s)
    spans, held_now = group_spans(status, end, held_s)
    # A client's lease held now counts whole: its phases come with its release.
    client = client_phases(status, rl_jobs) + [s for s in held_now if s.job_id not in rl_jobs]
    phase, active, notes = _phase_time(status, [*phases, *client], end, busy)
    if stats.leases > len(status.history) and any(
        s.kind == "lease" and s.job_id not in rl_jobs for s in spans
    ):
        notes.insert(
            0,
            f"keeps its last {len(status.history)} of {stats.leases} leases: embedded clients' "
            "earlier leases count as overhead",
        )
    holder = status.holder
    figures = GroupFigures(
        group_id=status.group_id,
        start=stats.created_at,
        end=end,
        wall_s=wall,
        phase_s=phase,
        overhead_s=busy - phase,
        switching_s=switching,
        idle_s=max(0.0, wall - busy - switching),
        leases=stats.leases,
        switches=stats.switches,
        overlapped_switches=stats.overlapped_switches,
        bytes_moved=stats.bytes_moved,
        wait_p50_s=status.wait_p50_s,
        wait_p99_s=status.wait_p99_s,
        holder=holder.job_id if holder is not None else None,
        queued=len(status.queue),
        carried=stats.carried,
        preemptions=stats.preemptions,
        carrying_into=holder.carrying_into if holder is not None else None,
        notes=notes,
        active_start=None if active is None else datetime.fromtimestamp(active[0], tz=UTC),
        active_end=None if active is None else datetime.fromtimestamp(active[1], tz=UTC),
    )
    return figures, spans


def _phase_time(
    status: GroupStatus, phases: list[Span], end: datetime, busy: float
) -> tuple[float, tuple[float, float] | None, list[str]]:
    """The seconds ``phases`` ran on the group (their union, within its life and at most its
    leases' ``busy`` seconds), their first start to last end, and a note where the phases
    reported more than the leases held."""
    intervals = [(s.start.timestamp(), s.end.timestamp()) for s in phases]
    reported = sum(s.seconds for s in phases)
    phase = phase_time(intervals, (status.stats.created_at.timestamp(), end.timestamp()))
    notes = []
    if max(phase, reported) > busy + 1e-3:
        notes.append(
            f"phases reported {max(phase, reported) - busy:.3f} s more than the leases held "
            "(clocks?)"
        )
    return min(phase, busy), active_window(intervals), notes


def group_spans(status: GroupStatus, end: datetime, held_s: float) -> tuple[list[Span], list[Span]]:
    """The group's lane up to ``end``: its leases (the holder's, ``held_s`` so far, too), its
    switches and its idle time; and apart, the holder's lease span (empty without one)."""
    lane = status.group_id

    def lease(job_id: str, start: datetime, stop: datetime, label: str) -> Span:
        return Span(
            lane=lane,
            kind="lease",
            start=start,
            end=stop,
            job_id=job_id,
            group_id=lane,
            label=label,
        )

    spans = [
        lease(r.job_id, r.start, r.end, f"{r.job_id} · token {r.token} · {r.outcome}")
        for r in status.history
    ]
    holder = status.holder
    held_now = []
    if holder is not None:
        label = f"{holder.job_id} · token {holder.token} · held now"
        held_now.append(lease(holder.job_id, end - timedelta(seconds=held_s), end, label))
        spans += held_now
    spans += [
        Span(
            lane=lane,
            kind="switching",
            start=s.start,
            end=s.end,
            job_id=s.to_job or s.from_job,
            group_id=lane,
            label=f"switch {s.from_job or '-'} → {s.to_job or '-'} · {s.bytes} B"
            + (" · overlapped" if s.overlapped else "")
            + (" · by the holder" if s.by_holder else ""),
        )
        for s in status.switch_history
    ]
    spans += idle_spans(status, spans, end)
    return spans, held_now


def status_with_utilization(status: GroupStatus, figures: GroupFigures) -> GroupStatus:
    """``status`` with its ``utilization`` (both windows) filled in from ``figures``, the
    report's figures of this status (``gather.status_figures``): the group itself answers its
    held share only, as it sees leases, not the RL jobs' phases."""
    return status.model_copy(
        update={
            "utilization": figures.since_created.share,
            "utilization_while_jobs_ran": figures.while_jobs_ran.share,
        }
    )


def client_phases(status: GroupStatus, rl_jobs: set[str]) -> list[Span]:
    """The GPU phases of the group's embedded clients (jobs that are not RL jobs), in lanes of
    their own: those each reported with its release, placed from its lease's start; a lease
    whose holder reported nothing (a plain release) is its phase, whole ("lease = phase")."""
    spans = []
    for r in status.history:
        if r.job_id in rl_jobs:
            continue
        common = {"lane": r.job_id, "job_id": r.job_id, "group_id": status.group_id}
        if r.phases is None:
            spans.append(
                Span(
                    kind="phase",
                    start=r.start,
                    end=r.end,
                    label=f"lease on {status.group_id} (no phases reported)",
                    **common,
                )
            )
            continue
        for offset, seconds in r.phases:
            start = min(r.end, r.start + timedelta(seconds=offset))
            end = min(r.end, start + timedelta(seconds=seconds))
            spans.append(
                Span(
                    kind="phase",
                    start=start,
                    end=end,
                    label=f"GPU phase on {status.group_id}",
                    **common,
                )
            )
    return spans


def idle_spans(status: GroupStatus, held: list[Span], end: datetime) -> list[Span]:
    """The group's idle time as spans: the gaps between its leases and switches, from its
    creation to ``end``. A group that no longer keeps its first leases (``history_keep``) is
    drawn idle only from its oldest record on: before, the table's idle time is not known
    interval by interval."""
    stats = status.stats
    complete = len(status.history) + (1 if status.holder is not None else 0) >= stats.leases
    since = stats.created_at if complete else min((s.start for s in held), default=end)
    moments = [(s.start.timestamp(), s.end.timestamp()) for s in held]
    gaps: list[tuple[float, float]] = []
    cursor, until = since.timestamp(), end.timestamp()
    for start, stop in [*merged(moments), (until, until)]:
        if min(start, until) > cursor:
            gaps.append((cursor, min(start, until)))
        cursor = max(cursor, stop)
    return [
        Span(
            lane=status.group_id,
            kind="idle",
            start=datetime.fromtimestamp(a, tz=UTC),
            end=datetime.fromtimestamp(b, tz=UTC),
            group_id=status.group_id,
            label="idle",
        )
        for a, b in gaps
    ]


def build_lanes(job_lanes: list[Lane], group_lanes: list[Lane]) -> list[Lane]:
    """Jobs first (in the order given), then groups; spans in time order."""
    for lane in [*job_lanes, *group_lanes]:
        lane.spans.sort(key=lambda s: s.start)
    return [*job_lanes, *group_lanes]
