"""The report as aligned text tables (what ``timeslice report`` prints)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from timeslice.report.model import GroupFigures, JobFigures, Report


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _secs(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def reward_span(job: JobFigures) -> str:
    if job.reward_first is None or job.reward_last is None:
        return "-"
    return f"{job.reward_first:.3f} → {job.reward_last:.3f}"


GROUP_HEADERS = (
    "group",
    "wall s",
    "phases",
    "lease overhead",
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
    "switching s",
    "wall s",
    "alone s",
    "slowdown",
    "reward first → last",
)


# What the job table says, and what its slowdown is against (docs/report.md, "Jobs").
JOBS_ABOUT = (
    "RL jobs (each job id's latest run): own phase times, time waiting for grants and moving "
    "state back;",
    "slowdown = wall time / the same job's wall time alone, only where that was measured "
    "(`make demo` runs each job alone first) or simulated (`timeslice plan --html`); '-': no "
    "such baseline",
)


def group_row(g: GroupFigures) -> tuple[str, ...]:
    return (
        g.group_id,
        _secs(g.wall_s),
        _pct(g.fraction(g.phase_s)),
        _pct(g.fraction(g.overhead_s)),
        _pct(g.fraction(g.switching_s)),
        _pct(g.fraction(g.idle_s)),
        str(g.leases),
        str(g.switches),
        human_bytes(g.bytes_moved),
        _secs(g.wait_p50_s, 3),
        _secs(g.wait_p99_s, 3),
    )


def utilization_line(g: GroupFigures, *, simulated: bool = False) -> str:
    """Both windows, labelled: the same words `timeslice status` prints (docs/report.md). A
    simulated group (``timeslice plan``) has no life before its first phase: one window."""
    return str(g.while_jobs_ran) if simulated else f"{g.since_created}; {g.while_jobs_ran}"


def job_row(j: JobFigures) -> tuple[str, ...]:
    epochs = str(j.epochs_done) if j.epochs is None else f"{j.epochs_done}/{j.epochs}"
    slowdown = j.slowdown
    alone = j.dedicated_s or None
    return (
        j.job_id,
        j.status,
        epochs,
        _secs(j.phase_s.get("sample"), 2),
        _secs(j.phase_s.get("rewards"), 2),
        _secs(j.phase_s.get("train"), 2),
        _secs(j.waiting_s, 2),
        _secs(j.switching_s, 2),
        _secs(j.wall_s),
        _secs(alone),
        "-" if slowdown is None else f"{slowdown:.2f}x",
        reward_span(j),
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned columns: the first (a name) left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _group_notes(g: GroupFigures) -> list[str]:
    """What the group's row cannot say: who holds it, waits, carries, overlaps, preemptions."""
    carrying = f": carrying into {g.carrying_into}" if g.carrying_into else ""
    said = [
        f"held by {g.holder}{carrying}" if g.holder is not None else None,
        f"{g.queued} waiting" if g.queued else None,
        f"{g.carried} leases carried past waiters into their next phase" if g.carried else None,
        f"{g.overlapped_switches} overlapped switches" if g.overlapped_switches else None,
        f"{g.preemptions} preempted (a lease ran out without yielding; the group evicted its "
        "holder)"
        if g.preemptions
        else None,
    ]
    return [n for n in said if n is not None] + g.notes


def _job_notes(j: JobFigures) -> list[str]:
    """What the job's row cannot say: its time alone, rewinds, carries, staleness, a note."""
    asked, kept = j.carries_asked, j.carries_kept
    stale = j.staleness
    said = [
        f"alone: {j.dedicated_s:.1f} s {j.dedicated_from}" if j.dedicated_s else None,
        f"{j.status}: {j.failure}" if j.failure else None,
        f"the latest run of this job id; {j.earlier_runs} earlier run(s) left out"
        if j.earlier_runs
        else None,
        f"{j.rewinds} rewinds" if j.rewinds else None,
        f"lease kept into the next phase {kept} of {asked} times asked" if asked else None,
        f"async: staleness max {max(stale)}, mean {sum(stale) / len(stale):.2f}" if stale else None,
        j.note or None,
    ]
    return [n for n in said if n is not None]


def _notes(rows: Iterable[tuple[str, list[str]]]) -> list[str]:
    """A line for each name that has notes."""
    return [f"  {name}: {', '.join(notes)}" for name, notes in rows if notes]


def report_title(report: Report) -> str:
    """What the report is of: a real run (when it was read) or a simulated one."""
    if report.simulated:
        return (
            "timeslice plan · a simulated run (predicted from profiles, not measured) · "
            f"{report.generated_at:%Y-%m-%d %H:%M:%S} UTC"
        )
    return f"timeslice report · {report.generated_at:%Y-%m-%d %H:%M:%S} UTC"


def format_text(report: Report) -> str:
    out = [report_title(report), ""]
    out.append(
        "GPU groups: shares of each group's wall time (docs/report.md): GPU phases running, "
        "leased with no phase running, moving state, idle"
    )
    out += (
        table(GROUP_HEADERS, [group_row(g) for g in report.groups]) if report.groups else ["  none"]
    )
    out += _notes((g.group_id, _group_notes(g)) for g in report.groups)
    if report.groups:
        out += ["", "Utilization: GPU phase time / the window named (docs/report.md)"]
        out += [
            f"  {g.group_id}: {utilization_line(g, simulated=report.simulated)}"
            for g in report.groups
        ]
    out += ["", *JOBS_ABOUT]
    out += table(JOB_HEADERS, [job_row(j) for j in report.jobs]) if report.jobs else ["  none"]
    out += _notes((j.job_id, _job_notes(j)) for j in report.jobs)
    if report.problems:
        out += ["", "Problems", *(f"  {p}" for p in report.problems)]
    return "\n".join(out) + "\n"
