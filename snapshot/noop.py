"""The ``noop`` backend: nothing to move (CPU-only groups, tests); it still reports a real call."""

from __future__ import annotations

import time

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotRequest


class NoopBackend:
    """Evicts nothing and restores nothing, and reports each call (``mode="none"``, 0 bytes):
    for groups of CPU-only jobs and for tests. ``snapshots`` and ``restores`` count the calls."""

    name = "noop"
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self) -> None:
        self.snapshots = 0
        self.restores = 0

    def health(self) -> Health:
        return Health(self.name, True, "nothing to move")

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.perf_counter()
        self.snapshots += 1
        return SnapshotReport(
            job_id=request.job_id,
            backend=self.name,
            mode="none",
            bytes=0,
            seconds=time.perf_counter() - started,
        )

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.perf_counter()
        self.restores += 1
        return SnapshotReport(
            job_id=request.job_id,
            backend=self.name,
            mode="none",
            bytes=0,
            seconds=time.perf_counter() - started,
        )
