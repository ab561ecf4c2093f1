"""The report as aligned text tables (what ``timeslice report`` prints)."""

from __future__ import annotations

from collections.abc import Sequence

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


def utilization_line(g: GroupFigures) -> str:
    """Both windows, labelled: the same words `timeslice status` prints (docs/report.md)."""
    return f"{g.since_created}; {g.while_jobs_ran}"


def job_row(j: JobFigures) -> tuple[str, ...]:
    epochs = str(j.epochs_done) if j.epochs is None else f"{j.epochs_done}/{j.epochs}"
    slowdown = j.slowdown
    alone = j.dedicated_s if j.dedicated_s else (j.own_s or None)
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


def format_text(report: Report) -> str:
    out = [f"timeslice report · {report.generated_at:%Y-%m-%d %H:%M:%S} UTC", ""]
    out.append(
        "GPU groups: shares of each group's wall time (docs/report.md): GPU phases running, "
        "leased with no phase running, moving state, idle"
    )
    out += (
        table(GROUP_HEADERS, [group_row(g) for g in report.groups]) if report.groups else ["  none"]
    )
    for g in report.groups:
        extra = []
        if g.holder is not None:
            carrying = f": carrying into {g.carrying_into}" if g.carrying_into else ""
            extra.append(f"held by {g.holder}{carrying}")
        if g.queued:
            extra.append(f"{g.queued} waiting")
        if g.carried:
            extra.append(f"{g.carried} leases carried past waiters into their next phase")
        if g.overlapped_switches:
            extra.append(f"{g.overlapped_switches} overlapped switches")
        if g.preemptions:
            extra.append(
                f"{g.preemptions} preempted (a lease ran out without yielding; the group "
                "evicted its holder)"
            )
        extra += g.notes
        if extra:
            out.append(f"  {g.group_id}: {', '.join(extra)}")
    if report.groups:
        out += ["", "Utilization: GPU phase time / the window named (docs/report.md)"]
        out += [f"  {g.group_id}: {utilization_line(g)}" for g in report.groups]
    out += [
        "",
        "RL jobs: own phase times, time waiting for grants and moving state back; slowdown = "
        "wall time / the job's wall time alone (measured) or / its own phase time",
    ]
    out += table(JOB_HEADERS, [job_row(j) for j in report.jobs]) if report.jobs else ["  none"]
    for j in report.jobs:
        extra = []
        if j.dedicated_s:
            extra.append(f"alone: {j.dedicated_s:.1f} s measured")
        if j.rewinds:
            extra.append(f"{j.rewinds} rewinds")
        if j.carries_asked:
            extra.append(
                f"lease kept into the next phase {j.carries_kept} of {j.carries_asked} times asked"
            )
        if j.staleness:
            mean = sum(j.staleness) / len(j.staleness)
            extra.append(f"async: staleness max {max(j.staleness)}, mean {mean:.2f}")
        if j.note:
            extra.append(j.note)
        if extra:
            out.append(f"  {j.job_id}: {', '.join(extra)}")
    if report.problems:
        out += ["", "Problems", *(f"  {p}" for p in report.problems)]
    return "\n".join(out) + "\n"
