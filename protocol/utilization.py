"""A group's utilization and the jobs' demand bound, defined once (docs/report.md, "Utilization").

A group's **utilization** is the time its GPU phases ran divided by a stated window. Two windows
are useful, and every figure names the one it uses:

- **while jobs ran** (:data:`WHILE_JOBS_RAN`): from the first phase's start to the last phase's
  end on the group: how well the jobs kept it busy once they were there;
- **since the group was created** (:data:`SINCE_CREATED`): from the group's creation to the
  reading (or its close): what the GPUs did over the group's whole life, start-up and idle
  tail included.

`timeslice status`, `timeslice report` (its table, page and picture), `timeslice plan`, the
demo and the benchmarks all compute it here. A pure module (no I/O, no Temporal), so the
workflows, the client, the report, the planner and the benchmarks may all import it.

Times are seconds on any one clock (POSIX seconds, a process's monotonic clock, simulated
time): the caller picks the clock, the intervals and the window share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WHILE_JOBS_RAN = "while jobs ran"
SINCE_CREATED = "since the group was created"

Interval = tuple[float, float]


@dataclass(frozen=True)
class Utilization:
    """GPU phase time over a window, and which window it is."""

    phase_s: float
    window_s: float
    window: str

    @property
    def share(self) -> float:
        """``phase_s / window_s`` in [0, 1]; 0 for an empty window."""
        if self.window_s <= 0:
            return 0.0
        return min(1.0, max(0.0, self.phase_s / self.window_s))

    def __str__(self) -> str:
        return f"{self.share:.1%} of {self.window_s:.1f} s {self.window}"


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals' union as disjoint intervals in time order (empty ones dropped).

    Phases on one group never overlap when the clocks agree; a union makes a disagreement
    (two hosts' clocks, a phase placed by its completion time) count once instead of twice."""
    out: list[Interval] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def phase_time(intervals: Iterable[Interval], window: Interval | None = None) -> float:
    """Seconds covered by ``intervals`` (their union), within ``window`` when given."""
    total = 0.0
    for start, end in merged(intervals):
        if window is not None:
            start, end = max(start, window[0]), min(end, window[1])
        total += max(0.0, end - start)
    return total


def active_window(intervals: Iterable[Interval]) -> Interval | None:
    """The first phase's start to the last phase's end; None without phases."""
    spans = merged(intervals)
    if not spans:
        return None
    return spans[0][0], spans[-1][1]


def while_jobs_ran(intervals: Iterable[Interval]) -> Utilization:
    """Utilization over the first phase's start to the last phase's end."""
    spans = merged(intervals)
    window = active_window(spans)
    if window is None:
        return Utilization(0.0, 0.0, WHILE_JOBS_RAN)
    return Utilization(phase_time(spans), window[1] - window[0], WHILE_JOBS_RAN)


def since_created(intervals: Iterable[Interval], created: float, until: float) -> Utilization:
    """Utilization over the group's creation to ``until`` (the reading, or its close)."""
    window = (created, max(created, until))
    return Utilization(phase_time(intervals, window), window[1] - window[0], SINCE_CREATED)


def both(
    intervals: Iterable[Interval], created: float, until: float
) -> tuple[Utilization, Utilization]:
    """(while jobs ran, since the group was created): what status and report print."""
    spans = merged(intervals)
    return while_jobs_ran(spans), since_created(spans, created, until)


def demand_bound(shares: Iterable[float]) -> float:
    """The jobs' summed GPU demand on a group, capped at 1: each job's share of its own epoch
    that is GPU phases on this group when it runs alone, summed. No grant policy beats it; a
    utilization below it is what sharing (waits, switches, overhead) cost."""
    return min(1.0, sum(max(0.0, s) for s in shares))


__all__ = [
    "SINCE_CREATED",
    "WHILE_JOBS_RAN",
    "Interval",
    "Utilization",
    "active_window",
    "both",
    "demand_bound",
    "merged",
    "phase_time",
    "since_created",
    "while_jobs_ran",
]
