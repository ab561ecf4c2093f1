"""Snapshot / restore activities served by a job process with its in-process backends."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.snapshot.base import SnapshotBackend, SnapshotError, resolve_backends
from timeslice.workflows.protocol import (
    RESTORE_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    SnapshotCall,
    SnapshotReport,
)


class SnapshotActivities:
    def __init__(self, backends: dict[str, SnapshotBackend]) -> None:
        self.backends = backends

    def _resolve(self, call: SnapshotCall) -> list[SnapshotBackend]:
        try:
            return resolve_backends(call.backends, self.backends)
        except SnapshotError as err:
            raise ApplicationError(str(err), type="SnapshotError", non_retryable=True) from err

    @activity.defn(name=SNAPSHOT_ACTIVITY)
    async def snapshot(self, call: SnapshotCall) -> list[SnapshotReport]:
        # Composed backends snapshot in order and restore in reverse.
        reports = [await b.snapshot(call.job_id) for b in self._resolve(call)]
        activity.logger.info("evicted %s: %s", call.job_id, _summary(reports))
        return reports

    @activity.defn(name=RESTORE_ACTIVITY)
    async def restore(self, call: SnapshotCall) -> list[SnapshotReport]:
        reports = [await b.restore(call.job_id) for b in reversed(self._resolve(call))]
        activity.logger.info("restored %s: %s", call.job_id, _summary(reports))
        return reports


def _summary(reports: list[SnapshotReport]) -> str:
    return ", ".join(f"{r.backend} {r.bytes} B in {r.seconds:.3f} s" for r in reports)
