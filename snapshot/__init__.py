"""Snapshot backends: move a job's GPU state to host DRAM and back.

A backend has a name and two calls, ``snapshot(job_id)`` and ``restore(job_id)``, each returning a
:class:`~timeslice.workflows.protocol.SnapshotReport` with measured bytes and seconds. The
``torch`` backend lives in :mod:`timeslice.snapshot.torch_backend` (it imports torch).
"""

from timeslice.snapshot.base import Health, SnapshotBackend, SnapshotError, resolve_backends
from timeslice.snapshot.noop import NoopBackend
from timeslice.snapshot.simulated import SimulatedBackend

__all__ = [
    "Health",
    "NoopBackend",
    "SimulatedBackend",
    "SnapshotBackend",
    "SnapshotError",
    "resolve_backends",
]
