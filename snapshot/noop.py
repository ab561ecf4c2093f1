"""The ``noop`` backend: nothing to move (CPU-only groups, tests); it still reports a real call."""

from __future__ import annotations

import time

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotRequest, move_report


class NoopBackend:
    """Evicts nothing and restores nothing, and reports each call (``mode="none"``, 0 bytes):
    for groups of CPU-only jobs and for tests. ``snapshots`` and ``restores`` count the calls."""

    name = "noop"
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self) -> None:
        self.snapshots = 0
        self.restores = 0

    def health(self) -> Health:
        """Always able: there is nothing to move.

        Returns:
            ``Health(ok=True)``.
        """
        return Health(self.name, True, "nothing to move")

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Count an eviction (``snapshots``); nothing leaves the device.

        Args:
            request: The job evicted.

        Returns:
            A report of mode ``none``, 0 bytes, the call's own seconds.
        """
        started = time.perf_counter()
        self.snapshots += 1
        return move_report(self.name, request.job_id, "none", 0, started)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Count a restore (``restores``); nothing comes back, as nothing left.

        Args:
            request: The job restored.

        Returns:
            As :meth:`snapshot`'s.
        """
        started = time.perf_counter()
        self.restores += 1
        return move_report(self.name, request.job_id, "none", 0, started)
