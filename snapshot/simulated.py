"""The ``simulated`` backend: a switch that costs configured time and reports configured bytes.

For CPU-only clusters, tests and utilization studies: nothing moves, but the group sees a switch
of realistic duration and size (e.g. 16 GiB at 25 GB/s).
"""

from __future__ import annotations

import asyncio
import time

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotRequest, move_report


class SimulatedBackend:
    """Moves nothing, but takes the configured time and reports the configured bytes.

    Args:
        nbytes: The bytes each eviction and restore reports (its ``registered_bytes``).
        snapshot_s: Seconds an eviction takes.
        restore_s: Seconds a restore takes (None: as long as an eviction).

    Raises:
        ValueError: A negative size or duration.
    """

    name = "simulated"
    capabilities = frozenset({Capability.KNOWS_SIZE})

    def __init__(
        self, *, nbytes: int = 0, snapshot_s: float = 0.0, restore_s: float | None = None
    ) -> None:
        for label, value in (("nbytes", nbytes), ("snapshot_s", snapshot_s)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, not {value}")
        if restore_s is not None and restore_s < 0:
            raise ValueError(f"restore_s must be >= 0, not {restore_s}")
        self.nbytes = nbytes
        self.snapshot_s = snapshot_s
        self.restore_s = snapshot_s if restore_s is None else restore_s
        self._out: set[str] = set()  # jobs whose (simulated) state is in host memory

    @property
    def registered_bytes(self) -> int:
        """The configured ``nbytes``."""
        return self.nbytes

    @property
    def evicted(self) -> bool:
        """Whether any job's state is out (a job process serves one job)."""
        return bool(self._out)

    def health(self) -> Health:
        """Always able; the detail says the size and time a switch pretends.

        Returns:
            ``Health(ok=True)`` with ``nbytes`` and ``snapshot_s`` in its detail.
        """
        return Health(self.name, True, f"{self.nbytes} bytes in {self.snapshot_s} s per switch")

    async def _pretend(self, job_id: str, seconds: float, moves: bool) -> SnapshotReport:
        # Like a real backend, moving state that is already where it should be is free.
        started = time.perf_counter()
        if moves:
            await asyncio.sleep(seconds)  # stands in for the copy, by design
        return move_report(self.name, job_id, "simulated", self.nbytes if moves else 0, started)

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Sleep ``snapshot_s`` as if ``nbytes`` were copied out, and mark the job's state out.

        Args:
            request: The job whose (simulated) state leaves the device.

        Returns:
            Mode ``simulated``: ``nbytes`` in ``snapshot_s`` seconds, or 0 bytes at once when the
            job's state was out already.
        """
        job_id = request.job_id
        moves = job_id not in self._out
        self._out.add(job_id)
        return await self._pretend(job_id, self.snapshot_s, moves)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Sleep ``restore_s`` as if the state came back, and mark it in.

        Args:
            request: The job whose state returns.

        Returns:
            ``nbytes`` in ``restore_s`` seconds; 0 bytes at once if nothing was out.
        """
        job_id = request.job_id
        moves = job_id in self._out
        self._out.discard(job_id)
        return await self._pretend(job_id, self.restore_s, moves)
