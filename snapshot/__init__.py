"""Snapshot backends: move a job's GPU state to host DRAM and back.

A backend has a name and two calls, ``snapshot(job_id)`` and ``restore(job_id)``, each returning a
:class:`~timeslice.workflows.protocol.SnapshotReport` with measured bytes and seconds.
"""

from timeslice.snapshot.base import SnapshotBackend, SnapshotError, resolve_backends
from timeslice.snapshot.noop import NoopBackend

__all__ = ["NoopBackend", "SnapshotBackend", "SnapshotError", "resolve_backends"]
