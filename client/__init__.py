"""Timeslice: co-operative GPU time-slicing for RL post-training jobs, built on Temporal.

from timeslice import TimeSliceOrchestratorClient
"""

from timeslice.errors import (
    AcquireTimeoutError,
    InvalidArgumentError,
    JobFaultedError,
    LeaseRevokedError,
    NotHolderError,
    ServerUnreachableError,
    SnapshotFailedError,
    TimesliceError,
    UnknownGroupError,
)
from timeslice.lease import Lease
from timeslice.orchestrator import AsyncTimeSliceOrchestratorClient, TimeSliceOrchestratorClient
from timeslice.workflows.protocol import GroupStatus

__all__ = [
    "AcquireTimeoutError",
    "AsyncTimeSliceOrchestratorClient",
    "GroupStatus",
    "InvalidArgumentError",
    "JobFaultedError",
    "Lease",
    "LeaseRevokedError",
    "NotHolderError",
    "ServerUnreachableError",
    "SnapshotFailedError",
    "TimeSliceOrchestratorClient",
    "TimesliceError",
    "UnknownGroupError",
]
