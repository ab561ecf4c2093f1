"""When each job's state was on a device, from its ranks' own records of their moves, and
whether two jobs' states ever were on one device (or one node) at once.

Pure functions over the records a rank keeps (``timeslice.workloads.data_parallel.Move`` as
dicts: ``state``, ``action`` — ``setup``, ``restore`` or ``evict`` — ``start``, ``end``), used by
bench/ray_ranks.py and tests/test_ray.py; tests/unit/test_residency.py shows they catch what
they look for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def residencies(moves: list[dict[str, Any]], states: Sequence[str]) -> list[tuple[float, float]]:
    """When any of a rank's states was on its device: from its setup or a restore's start
    to the end of the eviction that took the last one off (its monotonic clock)."""
    on: set[str] = set()
    start = 0.0
    out: list[tuple[float, float]] = []
    for m in sorted(moves, key=lambda m: m["start"]):
        if m["action"] in ("setup", "restore"):
            if not on:
                start = m["start"]
            on |= set(states) if m["action"] == "setup" else {m["state"]}
        elif m["action"] == "evict" and m["state"] in on:
            on.discard(m["state"])
            if not on:
                out.append((start, m["end"]))
    if on:
        out.append((start, float("inf")))
    return out


def overlaps(by_place: dict[Any, dict[str, list[tuple[float, float]]]]) -> int:
    """Pairs of different jobs' residencies that overlap on one place (a device, a node).

    ``by_place``: place -> job -> that job's residency intervals there."""
    found = 0
    for jobs in by_place.values():
        spans = sorted((s, e, job) for job, intervals in jobs.items() for s, e in intervals)
        for i, (_, end, job) in enumerate(spans):
            for s2, _, job2 in spans[i + 1 :]:
                if s2 >= end:
                    break
                found += job2 != job
    return found


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged
