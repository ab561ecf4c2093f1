"""The ``collectives`` backend: a job's collective communicators around a switch.

A data-parallel rank talks to its peers through a communicator (a ``torch.distributed`` process
group). On GPUs an NCCL communicator holds device memory of its own (buffers, streams), which
neither the torch backend (it moves registered tensors) nor cuda-checkpoint (it refuses a
process with NCCL's inter-process state) can take off the device. So a rank tears its
communicators down before its state is evicted and builds them again once it runs again. A
backend whose communicators hold no device memory (gloo on the CPU) may keep them instead.

This backend is that hook, as one more state of the job's: list it with the states the
switches of the group that runs the collectives move (a workload's ``trainer_backends``), and
every eviction tears down, every restore marks for rebuilding. The rebuild itself is the job's,
at the first collective after the restore: a rebuild is a rendezvous of every rank, and a
restore is not a moment every rank shares (each rank of an RL job restores as its own phase
starts), while the first collective of a phase is.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotRequest


class CollectivesBackend:
    """Tears a job's communicators down on eviction; their owner rebuilds them after restore.

    Args:
        teardown: Destroys the communicators (``torch.distributed.destroy_process_group``);
            called in a thread, only while they are built.
        is_built: Whether the communicators exist now (the owner builds them lazily).
        keep: Keep the communicators across switches (backends that hold no device memory,
            such as gloo on the CPU): every call then moves nothing.
        nbytes: The device bytes the communicators hold, if known (NCCL's buffers); 0 where
            they hold none (gloo) or where it is not known.

    Raises:
        ValueError: A negative ``nbytes``.
    """

    name = "collectives"
    capabilities = frozenset({Capability.KNOWS_SIZE})

    def __init__(
        self,
        teardown: Callable[[], None],
        is_built: Callable[[], bool],
        *,
        keep: bool = False,
        nbytes: int = 0,
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        self._teardown, self._is_built = teardown, is_built
        self.keep, self.nbytes = keep, nbytes
        #: Communicators torn down by an eviction, and restores after which they are rebuilt
        #: at their next use (the job's own count of rebuilds is its owner's).
        self.teardowns = self.restores = 0
        self._lock = threading.Lock()

    @property
    def registered_bytes(self) -> int:
        """The configured ``nbytes``."""
        return self.nbytes

    def health(self) -> Health:
        """Always ready: whether communicators are kept or torn down on eviction.

        Returns:
            A healthy ``Health`` saying which.
        """
        what = "kept across switches" if self.keep else "torn down on every eviction"
        return Health(self.name, True, f"communicators {what}")

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Tear the job's communicators down (unless ``keep``), freeing what they hold on the
        device; nothing is copied.

        Args:
            request: The eviction: the job it is for.

        Returns:
            A ``discard`` report: ``nbytes`` when communicators were torn down, else 0.
        """
        started = time.perf_counter()
        torn = False
        if not self.keep:
            torn = await asyncio.to_thread(self._tear_down)
        return self._report(request, started, torn)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Count the restore; the owner rebuilds its communicators at the next collective,
        where every rank meets.

        Args:
            request: The restore: the job it is for.

        Returns:
            A report of 0 bytes (nothing is brought back here).
        """
        started = time.perf_counter()
        # Nothing to build yet: the owner rebuilds at the first collective, with every rank.
        with self._lock:
            self.restores += 1
        return self._report(request, started, False)

    def _tear_down(self) -> bool:
        with self._lock:
            if not self._is_built():
                return False
            self._teardown()
            self.teardowns += 1
            return True

    def _report(self, request: SnapshotRequest, started: float, moved: bool) -> SnapshotReport:
        return SnapshotReport(
            job_id=request.job_id,
            backend=self.name,
            mode="discard",
            bytes=self.nbytes if moved else 0,
            seconds=time.perf_counter() - started,
        )
