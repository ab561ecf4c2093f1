"""Snapshot / restore activities served by a job process with its in-process backends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from opentelemetry.trace import Span
from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.snapshot.base import SnapshotBackend, SnapshotError, resolve_backends
from timeslice.telemetry import meter, span
from timeslice.workflows.protocol import (
    RESTORE_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    SnapshotCall,
    SnapshotReport,
)

Guard = Callable[[list[str]], contextlib.AbstractAsyncContextManager[None]]


class SnapshotActivities:
    """``backends`` None means the process holds no state yet (a restarted job process that
    has not been prepared): there is nothing to move, and that is not an error.
    ``guard``, when given, is entered with the names of the backends a call moves: it keeps a
    snapshot from racing the process's own GPU work on that state (and only that state)."""

    def __init__(
        self, backends: dict[str, SnapshotBackend] | None, guard: Guard | None = None
    ) -> None:
        self.backends = backends
        self._guard_fn = guard

    @contextlib.asynccontextmanager
    async def _guard(self, names: list[str]) -> AsyncIterator[None]:
        if self._guard_fn is None:
            yield
        else:
            async with self._guard_fn(names):
                yield

    def _resolve(self, call: SnapshotCall) -> list[SnapshotBackend]:
        if self.backends is None:
            return []
        try:
            self.prepare(call)
            return resolve_backends(call.backends, self.backends)
        except SnapshotError as err:
            raise ApplicationError(str(err), type="SnapshotError", non_retryable=True) from err

    def prepare(self, call: SnapshotCall) -> None:
        """Hook run before the backends (the node agent registers the call's processes)."""

    @activity.defn(name=SNAPSHOT_ACTIVITY)
    async def snapshot(self, call: SnapshotCall) -> list[SnapshotReport]:
        # Composed backends snapshot in order and restore in reverse.
        with span("timeslice.snapshot", _attributes(call)) as current:
            async with self._guard(call.backends):
                reports = [await _run(b.snapshot, call) for b in self._resolve(call)]
            _record(current, "snapshot", reports)
        activity.logger.info("evicted %s: %s", call.job_id, _summary(reports))
        return reports

    @activity.defn(name=RESTORE_ACTIVITY)
    async def restore(self, call: SnapshotCall) -> list[SnapshotReport]:
        with span("timeslice.restore", _attributes(call)) as current:
            async with self._guard(call.backends):
                reports = [await _run(b.restore, call) for b in reversed(self._resolve(call))]
            _record(current, "restore", reports)
        activity.logger.info("restored %s: %s", call.job_id, _summary(reports))
        return reports


async def _run(
    step: Callable[[str], Awaitable[SnapshotReport]], call: SnapshotCall
) -> SnapshotReport:
    try:
        return await step(call.job_id)
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
