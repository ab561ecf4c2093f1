"""The ``simulated`` backend: a switch that costs configured time and reports configured bytes.

For CPU-only clusters, tests and utilization studies: nothing moves, but the group sees a switch
of realistic duration and size (e.g. 16 GiB at 25 GB/s).

It streams as a real copy does: chunk by chunk, each taking its share of the move's time. Given
the group's device room (``SnapshotRequest.room``, ``snapshot/device_room.py``), a restore takes
room for each chunk before it comes in and an eviction gives it back as each chunk leaves, and
each chunk holds one direction of the device's link while it copies: so an eviction and a
restore at once take the longer of their times (PCIe is full duplex), limited by the memory the
eviction has freed so far, and two moves the same way take the sum of theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotRequest, move_report
from timeslice.snapshot.device_room import DeviceRoom, Direction

#: The default chunk: 64 chunks for a 4 GiB state.
DEFAULT_CHUNK_BYTES = 64 * 2**20


class SimulatedBackend:
    """Moves nothing, but takes the configured time and reports the configured bytes.

    Args:
        nbytes: The bytes each eviction and restore reports (its ``registered_bytes``).
        snapshot_s: Seconds an eviction takes.
        restore_s: Seconds a restore takes (None: as long as an eviction).
        chunk_bytes: A move goes this many bytes at a time.
        trace: A file to append each chunk's arrival on the device (``+bytes``) and departure
            (``-bytes``) to, one line each: the monotonic time (ns), this process's id, the
            bytes, and ``move`` (or ``hold``: state counted where it was built, ``hold_in``).
            A witness of what was resident when, independent of the room's own ledger (the
            tests sum it).
        state_on_host: The state stands for one in host memory (torch on the CPU): the job
            process tells its groups a switch frees no device memory.

    Raises:
        ValueError: A negative size or duration, or a chunk size that is not positive.
    """

    name = "simulated"
    capabilities = frozenset({Capability.KNOWS_SIZE, Capability.STREAMS})

    def __init__(
        self,
        *,
        nbytes: int = 0,
        snapshot_s: float = 0.0,
        restore_s: float | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        trace: Path | None = None,
        state_on_host: bool = False,
    ) -> None:
        for label, value in (("nbytes", nbytes), ("snapshot_s", snapshot_s)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, not {value}")
        if restore_s is not None and restore_s < 0:
            raise ValueError(f"restore_s must be >= 0, not {restore_s}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        self.nbytes = nbytes
        self.snapshot_s = snapshot_s
        self.restore_s = snapshot_s if restore_s is None else restore_s
        self.chunk_bytes = chunk_bytes
        self.trace = trace
        self.state_on_host = state_on_host
        self._out: set[str] = set()  # jobs whose (simulated) state is in host memory

    @property
    def registered_bytes(self) -> int:
        """The configured ``nbytes``."""
        return self.nbytes

    def resides_on_host(self) -> bool:
        """Whether the simulated state stands for one in host memory (torch on the CPU), whose
        switches free no device memory.

        Returns:
            ``state_on_host``.
        """
        return self.state_on_host

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

    def hold_in(self, room: DeviceRoom) -> None:
        """Count the state in ``room``: it was built on that device, not moved there.

        Args:
            room: The device's room.
        """
        if not self._out and self.nbytes:
            self._witness(self.nbytes, "hold")
            room.hold(self.nbytes)

    def leaving(self, job_id: str) -> None:
        """The job's process exits with its state on the device, which its exit frees (a room
        takes the share back once it finds the process gone): the trace records it leaving,
        as ``exit``; nothing is copied.

        Args:
            job_id: The job whose state goes with its process.
        """
        if job_id not in self._out:
            self._out.add(job_id)
            self._witness(-self.nbytes, "exit")

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Take ``snapshot_s`` as if ``nbytes`` were copied out chunk by chunk (giving each
        chunk's room back as it leaves), and mark the job's state out.

        Args:
            request: The job whose (simulated) state leaves the device, and its room.

        Returns:
            Mode ``simulated``: ``nbytes`` in ``snapshot_s`` seconds, or 0 bytes at once when the
            job's state was out already.
        """
        job_id = request.job_id
        moves = job_id not in self._out
        self._out.add(job_id)
        return await self._pretend(request, "out", self.snapshot_s, moves)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Take ``restore_s`` as if the state came back chunk by chunk (each once there is room
        for it), and mark it in.

        Args:
            request: The job whose state returns, and its room.

        Returns:
            ``nbytes`` in ``restore_s`` seconds (and any wait for room); 0 bytes at once if
            nothing was out.
        """
        job_id = request.job_id
        moves = job_id in self._out
        report = await self._pretend(request, "in", self.restore_s, moves)
        # In only once it came: a restore that found no room stays out, to be brought again.
        self._out.discard(job_id)
        return report

    async def _pretend(
        self, request: SnapshotRequest, direction: Direction, seconds: float, moves: bool
    ) -> SnapshotReport:
        # Like a real backend, moving state that is already where it should be is free.
        started = time.perf_counter()
        if moves:
            # A thread, as a real copy blocks one: waits for room or for the link block it.
            await asyncio.to_thread(self._copy, request.room, direction, seconds)
        return move_report(
            self.name, request.job_id, "simulated", self.nbytes if moves else 0, started
        )

    def _copy(self, room: DeviceRoom | None, direction: Direction, seconds: float) -> None:
        """Each chunk takes its share of ``seconds`` once it may start: when the previous
        chunk's copy ends, and (given a room) when there is room for it and the link's
        direction is free. A chunk that may start at once starts when the previous one ended
        on the schedule, not when this thread got round to it, so the bookkeeping between
        chunks does not add up to time the copy engine would not spend."""
        sizes = self._chunk_sizes()
        per_chunk = seconds / len(sizes)
        scheduled = time.monotonic()  # when the previous chunk's copy ended
        taken = 0  # a restore's room so far: given back if it fails part-way, as torch's is
        for size in sizes:
            ready = scheduled
            if room is not None and direction == "in":
                try:
                    if room.take(size) > 0:
                        ready = max(ready, time.monotonic())
                except BaseException:
                    if taken:
                        self._witness(-taken)
                        room.give(taken)
                    raise
                taken += size
            if direction == "in":
                self._witness(size)
            with room.link(direction) if room is not None else _no_wait() as waited:
                if waited:  # another copy the same way had the link
                    ready = max(ready, time.monotonic())
                scheduled = ready + per_chunk
                _sleep_until(scheduled)
            if direction == "out":
                self._witness(-size)
                if room is not None:
                    room.give(size)

    def _chunk_sizes(self) -> list[int]:
        if self.nbytes == 0:
            return [0]
        whole, rest = divmod(self.nbytes, self.chunk_bytes)
        return [self.chunk_bytes] * whole + ([rest] if rest else [])

    def _witness(self, delta: int, kind: str = "move") -> None:
        if self.trace is None or delta == 0:
            return
        line = f"{time.monotonic_ns()} {os.getpid()} {delta:+d} {kind}\n".encode()
        fd = os.open(self.trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _no_wait() -> Iterator[bool]:
    yield False


def _sleep_until(deadline: float) -> None:
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)  # stands in for the copy, by design
