"""Snapshot backends: evict a job's GPU state to host DRAM, and restore it.

A backend has a name, declared capabilities and two calls, ``snapshot(request)`` and
``restore(request)``, each taking a :class:`SnapshotRequest` (the job, the group, why, and for a
whole-process backend the processes) and returning a
:class:`~timeslice.protocol.group.SnapshotReport` with measured bytes and seconds.
:mod:`timeslice.snapshot.registry` lists the backends Timeslice ships; the ``torch`` backend
lives in :mod:`timeslice.snapshot.torch_backend` (it imports torch).
"""

from timeslice.snapshot.base import (
    Capability,
    Health,
    SizedSnapshotBackend,
    SnapshotBackend,
    SnapshotError,
    SnapshotRequest,
    resolve_backends,
)
from timeslice.snapshot.noop import NoopBackend
from timeslice.snapshot.simulated import SimulatedBackend

__all__ = [
    "Capability",
    "Health",
    "NoopBackend",
    "SimulatedBackend",
    "SizedSnapshotBackend",
    "SnapshotBackend",
    "SnapshotError",
    "SnapshotRequest",
    "resolve_backends",
]
