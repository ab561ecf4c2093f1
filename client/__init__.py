"""Timeslice: co-operative GPU time-slicing for RL post-training jobs, built on Temporal.

from timeslice import TimeSliceOrchestratorClient

The names below load on first use (PEP 562): importing a subpackage such as
``timeslice.protocol.group`` — which every workflow does, inside Temporal's sandbox, on every
run — must not drag in the client, its Temporal worker, OpenTelemetry and the snapshot backends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from timeslice.errors import (
        AcquireTimeoutError,
        ClientClosedError,
        GrantLostError,
        GroupNotAnsweringError,
        InvalidArgumentError,
        JobFaultedError,
        LeaseRevokedError,
        NoControlWorkerError,
        NotHolderError,
        RateLimitedError,
        ServerUnreachableError,
        SnapshotFailedError,
        TimesliceError,
        UnknownGroupError,
        VersionMismatchError,
    )
    from timeslice.orchestrator import (
        AsyncTimeSliceOrchestratorClient,
        TimeSliceOrchestratorClient,
    )
    from timeslice.protocol.group import GroupStatus
    from timeslice.session.lease import Lease

_EXPORTS: dict[str, str] = {
    "AcquireTimeoutError": "timeslice.errors",
    "AsyncTimeSliceOrchestratorClient": "timeslice.orchestrator",
    "ClientClosedError": "timeslice.errors",
    "GrantLostError": "timeslice.errors",
    "GroupNotAnsweringError": "timeslice.errors",
    "GroupStatus": "timeslice.protocol.group",
    "InvalidArgumentError": "timeslice.errors",
    "JobFaultedError": "timeslice.errors",
    "Lease": "timeslice.session.lease",
    "LeaseRevokedError": "timeslice.errors",
    "NoControlWorkerError": "timeslice.errors",
    "NotHolderError": "timeslice.errors",
    "RateLimitedError": "timeslice.errors",
    "ServerUnreachableError": "timeslice.errors",
    "SnapshotFailedError": "timeslice.errors",
    "TimeSliceOrchestratorClient": "timeslice.orchestrator",
    "TimesliceError": "timeslice.errors",
    "UnknownGroupError": "timeslice.errors",
    "VersionMismatchError": "timeslice.errors",
}

__all__ = [
    "AcquireTimeoutError",
    "AsyncTimeSliceOrchestratorClient",
    "ClientClosedError",
    "GrantLostError",
    "GroupNotAnsweringError",
    "GroupStatus",
    "InvalidArgumentError",
    "JobFaultedError",
    "Lease",
    "LeaseRevokedError",
    "NoControlWorkerError",
    "NotHolderError",
    "RateLimitedError",
    "ServerUnreachableError",
    "SnapshotFailedError",
    "TimeSliceOrchestratorClient",
    "TimesliceError",
    "UnknownGroupError",
    "VersionMismatchError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'timeslice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
