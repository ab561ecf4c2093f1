"""Snapshot / restore activities served by a process with its in-process backends: an embedded
client, a job process, the node agent.

They sit beside the engine (which serves them for an embedded client) so that nothing in the
client imports the activities package; a job process hands them its state homes as a
:class:`StateMover`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterator
from typing import Protocol, TypeVar

from opentelemetry.trace import Span
from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.protocol.group import (
    RESTORE_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    SnapshotCall,
    SnapshotReport,
)
from timeslice.snapshot.base import (
    SnapshotBackend,
    SnapshotError,
    SnapshotRequest,
    resolve_backends,
)
from timeslice.transport.telemetry import meter, span

T = TypeVar("T")


class StateMover(Protocol):
    """What moves a job process's states on a group's behalf (``activities/state_homes.py``'s
    ``StateHomes``): it knows which group's device each state is on."""

    @property
    def backends(self) -> dict[str, SnapshotBackend]: ...

    async def evict_for(self, names: list[str], group_id: str) -> list[SnapshotReport]: ...

    async def restore_for(self, names: list[str], group_id: str) -> list[SnapshotReport]: ...


class SnapshotActivities:
    """``backends`` None means the process holds no state yet (a restarted job process that
    has not been prepared): there is nothing to move, and that is not an error.
    ``homes``, when given (a job process), moves the state instead: it knows which group's
    device each state is on, so an eviction for one group never waits for the job's work on
    another, and never races the job's own use of the state on the same group."""

    def __init__(
        self,
        backends: dict[str, SnapshotBackend] | None,
        homes: StateMover | None = None,
        *,
        job_id: str | None = None,
    ) -> None:
        """``job_id``: the one job this process's state belongs to (a client or job process);
        a call for any other job is refused. None for a node agent, which serves many jobs and
        checks each call against the processes registered for it."""
        self.backends = backends
        self._homes = homes
        self.job_id = job_id

    def _resolve(self, call: SnapshotCall) -> tuple[list[SnapshotBackend], SnapshotRequest]:
        if self.job_id is not None and call.job_id != self.job_id:
            # A request may name any job and any snapshot target: one for job X naming this
            # process's queue must not move this job's state when the group evicts X.
            raise ApplicationError(
                f"this process holds job {self.job_id!r}'s state, not {call.job_id!r}'s: "
                "it moves no other job's state",
                type="WrongJob",
                non_retryable=True,
            )
        available = self._homes.backends if self._homes is not None else self.backends
        if not available:
            return [], SnapshotRequest(call.job_id, call.group_id, call.reason)
        try:
            backends = resolve_backends(call.backends, available)
            return backends, self.request_for(call, backends)
        except SnapshotError as err:
            raise ApplicationError(str(err), type=type(err).__name__, non_retryable=True) from err

    def request_for(self, call: SnapshotCall, backends: list[SnapshotBackend]) -> SnapshotRequest:
        """What the backends are asked; the node agent checks the caller and names the job's
        processes (only those that registered themselves with it, never the call's)."""
        return SnapshotRequest(call.job_id, call.group_id, call.reason)

    @activity.defn(name=SNAPSHOT_ACTIVITY)
    async def snapshot(self, call: SnapshotCall) -> list[SnapshotReport]:
        # Composed backends snapshot in order and restore in reverse.
        with span("timeslice.snapshot", _attributes(call)) as current, _heartbeating():
            backends, request = self._resolve(call)
            if self._homes is not None:
                reports = await _checked(self._homes.evict_for(call.backends, call.group_id))
            else:
                reports = [await _checked(b.snapshot(request)) for b in backends]
            _record(current, "snapshot", reports)
        activity.logger.info("evicted %s: %s", call.job_id, _summary(reports))
        return reports

    @activity.defn(name=RESTORE_ACTIVITY)
    async def restore(self, call: SnapshotCall) -> list[SnapshotReport]:
        with span("timeslice.restore", _attributes(call)) as current, _heartbeating():
            backends, request = self._resolve(call)
            if self._homes is not None:
                reports = await _checked(self._homes.restore_for(call.backends, call.group_id))
            else:
                reports = [await _checked(b.restore(request)) for b in reversed(backends)]
            _record(current, "restore", reports)
        activity.logger.info("restored %s: %s", call.job_id, _summary(reports))
        return reports


HEARTBEAT_EVERY_S = 1.0


@contextlib.contextmanager
def _heartbeating() -> Iterator[None]:
    """Heartbeat while the move runs (a wait for the state to be free included): the group
    takes a process that stops heartbeating for gone, and does not wait out the run time-out."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    task = asyncio.ensure_future(beat())
    try:
        yield
    finally:
        task.cancel()


async def _checked(moving: Awaitable[T]) -> T:
    try:
        return await moving
    except SnapshotError as err:  # the backend's own verdict: retrying will not change it
        raise ApplicationError(str(err), type=type(err).__name__, non_retryable=True) from err


_SECONDS = meter().create_histogram(
    "timeslice_snapshot_seconds", unit="s", description="one backend's snapshot or restore"
)


def _attributes(call: SnapshotCall) -> dict[str, object]:
    return {
        "timeslice.job_id": call.job_id,
        "timeslice.group_id": call.group_id,
        "timeslice.backends": list(call.backends),
        "timeslice.reason": call.reason,
    }


def _record(current: Span, action: str, reports: list[SnapshotReport]) -> None:
    current.set_attribute("timeslice.bytes", sum(r.bytes for r in reports))
    for r in reports:
        current.add_event(
            f"{r.backend} {action}",
            {"timeslice.mode": r.mode, "timeslice.bytes": r.bytes, "timeslice.seconds": r.seconds},
        )
        _SECONDS.record(r.seconds, {"action": action, "backend": r.backend})


def _summary(reports: list[SnapshotReport]) -> str:
    return ", ".join(f"{r.backend} {r.bytes} B in {r.seconds:.3f} s" for r in reports)
