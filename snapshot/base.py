"""The one interface every snapshot backend implements, and the request it takes.

A backend evicts a job's state from the device (to host memory, or drops it to be rebuilt)
and restores it. Add one by implementing :class:`SnapshotBackend` and giving it a row in
:mod:`timeslice.snapshot.registry` (CONTRIBUTING.md says how).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from timeslice.protocol.group import SnapshotReport

if TYPE_CHECKING:  # processes.py and device_room.py build on this module
    from timeslice.snapshot.device_room import DeviceRoom
    from timeslice.snapshot.processes import ProcessIdentity


class SnapshotError(RuntimeError):
    """An eviction or restore could not be performed; the message says what to fix."""


@dataclass(frozen=True)
class Health:
    """Whether a backend can work here, and why not if it cannot."""

    backend: str
    ok: bool
    detail: str


class Capability(StrEnum):
    """What a backend declares it can do, so callers ask instead of probing attributes."""

    #: ``registered_bytes`` says how many bytes a snapshot would move, before it moves them
    #: (the job process reports it to the group as the state's declared size).
    KNOWS_SIZE = "knows-size"
    #: Moves whole processes from outside them (by PID): it runs in the node agent and acts on
    #: the request's ``processes``, which the agent fills from the processes that registered
    #: themselves there, never from what a caller claims.
    WHOLE_PROCESS = "whole-process"
    #: Moves chunk by chunk through the device's room (``SnapshotRequest.room``): takes room
    #: for each chunk before it comes onto the device, gives it back as each chunk leaves, and
    #: counts state built on the device with ``hold_in`` (:class:`StreamingBackend`). A job
    #: process whose states on a group all stream lets the group run the next job's restore
    #: at the same time as this job's eviction, even when the device holds only one of them
    #: (``snapshot/device_room.py``).
    STREAMS = "streams"


@dataclass(frozen=True)
class SnapshotRequest:
    """One snapshot or restore: what a backend is asked to move, and why.

    A single object so the call stays stable as it grows: a new field reaches the backends that
    want it and leaves the others as they are."""

    job_id: str
    #: The group the move is for ("" for a standalone move or a job's own use).
    group_id: str = ""
    #: Why, in words ("evict for gpus-a", "restore for gpus-a", "move to gpus-b").
    reason: str = ""
    #: For a ``WHOLE_PROCESS`` backend: the job's processes on this node (a PID and its start
    #: time each, so a reused PID is never mistaken for the process that registered).
    processes: tuple[ProcessIdentity, ...] = ()
    #: For a ``STREAMS`` backend: the group's device room on this node, or None (no one to
    #: share the device with: move as fast as the copy goes).
    room: DeviceRoom | None = None


@runtime_checkable
class SnapshotBackend(Protocol):
    """The interface every backend implements: evict a job's state from the device, restore it.

    A job process calls its in-process backends (the ones a client was given as
    ``snapshot_backends=``, or a workload's ``snapshot_backends()``) when the group evicts or
    restores the job; the node agent calls whole-process ones. Calls for one job never
    overlap: a restore follows the eviction it undoes. A backend that also knows its size
    before moving anything declares ``Capability.KNOWS_SIZE`` and implements
    :class:`SizedSnapshotBackend`.

    Attributes:
        name: The backend's name, unique within a process: the snapshot target and every
            report name the backend by it (1-100 characters).
        capabilities: What the backend declares it can do (``Capability``); an empty set
            for a plain in-process backend.
    """

    name: str
    capabilities: frozenset[Capability]

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Evict the job's state from the device: copy it to host memory (or drop it, for a
        state the job rebuilds) and free the device memory it held.

        Args:
            request: The job, the group it is evicted for, why, and for a whole-process
                backend the job's processes on this node.

        Returns:
            What was moved: the backend's name, a ``mode`` (``offload``: copied out;
            ``discard``: dropped), the bytes freed or copied, and the seconds it took.

        Raises:
            SnapshotError: The state could not be evicted (the message says why). The group
                marks the job faulted, and serves the others.
        """
        ...

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Bring the state evicted by the last ``snapshot`` back onto the device, into the
        same objects where the backend can (torch tensors keep their identity).

        Args:
            request: As for ``snapshot``; ``reason`` says which group the job is restored for.

        Returns:
            What was moved back, as for ``snapshot``.

        Raises:
            SnapshotError: The state could not be restored; the job is marked faulted, and
                its next acquire raises ``JobFaultedError``.
        """
        ...

    def health(self) -> Health:
        """Whether this backend can work here (its library, device or driver is present).

        Returns:
            ``Health(backend, ok, detail)``; ``detail`` says what is missing when not ok.
        """
        ...


@runtime_checkable
class SizedSnapshotBackend(SnapshotBackend, Protocol):
    """A backend that says how many bytes an eviction would move before it moves them.

    Declared with ``Capability.KNOWS_SIZE``; the job process reports the size to the group
    as the state's declared bytes (which decides whether two states fit at once). Kept apart
    from :class:`SnapshotBackend` so a backend that cannot know its size (vLLM's sleep mode,
    a whole process) need not pretend to.
    """

    @property
    def registered_bytes(self) -> int:
        """The bytes of device state an eviction would move now (also while it is out)."""
        ...


@runtime_checkable
class StreamingBackend(SnapshotBackend, Protocol):
    """A backend that moves through the device's room (``Capability.STREAMS``): its restore
    takes room for each chunk before the chunk comes in, its eviction gives room back as each
    chunk leaves (``SnapshotRequest.room``)."""

    def hold_in(self, room: DeviceRoom) -> None:
        """Count the state that is on the device now in ``room`` (it was built there, not
        moved in): called once the state is set up on the group's device.

        Args:
            room: The group's device room.
        """
        ...


def streams(backend: SnapshotBackend) -> bool:
    """Whether ``backend`` moves through the device's room.

    Args:
        backend: Any backend.

    Returns:
        True if it declares ``Capability.STREAMS`` and has ``hold_in``.

    Raises:
        SnapshotError: It declares ``STREAMS`` but has no ``hold_in``.
    """
    return _declares(backend, Capability.STREAMS, StreamingBackend, "hold_in")


@runtime_checkable
class HostResidentBackend(SnapshotBackend, Protocol):
    """A backend that can say its state lives in host memory (torch tensors on the CPU): there
    is no device memory for a switch to free, so the group need not wait for this state's
    eviction before it restores another job's."""

    def resides_on_host(self) -> bool:
        """Whether every byte this backend moves lives in host memory now."""
        ...


def on_host(backend: SnapshotBackend) -> bool:
    """Whether ``backend``'s state lives in host memory (False for any backend that cannot
    say: its state is taken to be on a device).

    Args:
        backend: Any backend.

    Returns:
        True only for a :class:`HostResidentBackend` that says so.
    """
    return isinstance(backend, HostResidentBackend) and backend.resides_on_host()


def _declares(backend: SnapshotBackend, capability: Capability, kind: type, what: str) -> bool:
    """Whether ``backend`` declares ``capability``; a ``SnapshotError`` if it does without
    being a ``kind`` (the protocol that has ``what``)."""
    if capability not in backend.capabilities:
        return False
    if not isinstance(backend, kind):
        raise SnapshotError(
            f"snapshot backend {backend.name!r} declares {capability.value!r} but has no "
            f"{what}: implement it ({kind.__name__}) or drop the capability"
        )
    return True


class BlockingBackend:
    """A base for a backend whose moves block (device copies, driver calls): it implements
    :meth:`snapshot_sync` and :meth:`restore_sync`, and the interface's async calls run them
    in a worker thread, so the process's event loop (its Temporal worker, its heartbeats)
    goes on meanwhile."""

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Evict the job's state: :meth:`snapshot_sync`, in a worker thread.

        Args:
            request: What to move, as :meth:`SnapshotBackend.snapshot` takes it.

        Returns:
            The report ``snapshot_sync`` made.

        Raises:
            SnapshotError: From ``snapshot_sync``: the state could not be evicted.
        """
        return await asyncio.to_thread(self.snapshot_sync, request)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """:meth:`restore_sync` in a worker thread (the state back onto the device).

        Args:
            request: As for :meth:`snapshot`.

        Returns:
            ``restore_sync``'s report.

        Raises:
            SnapshotError: Whatever ``restore_sync`` raised.
        """
        return await asyncio.to_thread(self.restore_sync, request)

    def snapshot_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Evict, blocking the calling thread (see :meth:`SnapshotBackend.snapshot`).

        Args:
            request: The job and the move's reason.

        Returns:
            What was moved.

        Raises:
            SnapshotError: The state could not be evicted.
        """
        raise NotImplementedError

    def restore_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Restore, blocking the calling thread (see :meth:`SnapshotBackend.restore`).

        Args:
            request: The job and the move's reason.

        Returns:
            What was moved back.

        Raises:
            SnapshotError: The state could not be restored.
        """
        raise NotImplementedError


def move_report(backend: str, job_id: str, mode: str, moved: int, started: float) -> SnapshotReport:
    """A move's report, timed from ``started``.

    Args:
        backend: The backend's name.
        job_id: The job whose state moved.
        mode: How (``offload``, ``discard``, ``none`` ...).
        moved: The bytes moved (or freed).
        started: A ``time.perf_counter()`` reading taken as the move began.

    Returns:
        The report, its seconds those since ``started``.
    """
    return SnapshotReport(
        job_id=job_id,
        backend=backend,
        mode=mode,
        bytes=moved,
        seconds=time.perf_counter() - started,
    )


def registered_bytes(backend: SnapshotBackend) -> int | None:
    """What an eviction would move, for a backend that declares ``KNOWS_SIZE``.

    Args:
        backend: Any backend.

    Returns:
        The backend's ``registered_bytes``, or None if it does not declare
        ``Capability.KNOWS_SIZE``.

    Raises:
        SnapshotError: The backend declares ``KNOWS_SIZE`` but has no ``registered_bytes``.
    """
    if not _declares(backend, Capability.KNOWS_SIZE, SizedSnapshotBackend, "registered_bytes"):
        return None
    return int(cast(SizedSnapshotBackend, backend).registered_bytes)


def resolve_backends(
    requested: list[str], available: dict[str, SnapshotBackend]
) -> list[SnapshotBackend]:
    """The backends named in ``requested``, in order.

    Args:
        requested: Backend names, as a snapshot target lists them.
        available: The backends registered in this process, by name.

    Returns:
        The named backends, in the order asked.

    Raises:
        SnapshotError: Some names are not registered here (the message names them).
    """
    missing = [name for name in requested if name not in available]
    if missing:
        raise SnapshotError(
            f"snapshot backend(s) {missing} are not registered in this process "
            f"(registered: {sorted(available) or 'none'})"
        )
    return [available[name] for name in requested]
