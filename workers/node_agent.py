"""The node agent: transparent snapshot backends for the processes of one node.

Serves task queue ``timeslice-node-<node>``. It acts only on processes that a job registered with
its snapshot target, and only after checking that each is the very process (PID + start time)
and was launched for that job (``TIMESLICE_JOB_ID`` in its launch environment), so a remote
request cannot freeze an arbitrary process.
"""

from __future__ import annotations

from dataclasses import dataclass

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.activities.snapshots import SnapshotActivities
from timeslice.snapshot.base import Health, SnapshotBackend
from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend
from timeslice.snapshot.processes import (
    JOB_ENV,
    PidRegistry,
    ProcessIdentity,
    ProcessMismatchError,
    launched_for_job,
)
from timeslice.workflows.protocol import SnapshotCall, node_task_queue


class NodeSnapshotActivities(SnapshotActivities):
    def __init__(self, backends: dict[str, SnapshotBackend], registry: PidRegistry) -> None:
        super().__init__(backends)
        self.registry = registry

    def prepare(self, call: SnapshotCall) -> None:
        for ref in call.processes:
            owner = launched_for_job(ref.pid)
            if owner != call.job_id:
                raise ProcessMismatchError(
                    f"process {ref.pid} was not launched for job {call.job_id} "
                    f"({JOB_ENV}={owner!r}); refusing to touch it"
                )
            self.registry.register(call.job_id, ProcessIdentity(ref.pid, ref.start_time))


@dataclass
class NodeAgent:
    worker: Worker
    activities: NodeSnapshotActivities

    def health(self) -> list[Health]:
        """Each backend's health; one whose check raises is reported, never let through."""
        found = []
        for name, backend in self.activities.backends.items():
            try:
                found.append(backend.health())
            except Exception as err:
                found.append(
                    Health(name, False, f"health check raised {type(err).__name__}: {err}")
                )
        return found


def build_node_agent(
    client: Client,
    node: str,
    *,
    extra_backends: list[SnapshotBackend] | None = None,
    lock_timeout_s: float = 10.0,
) -> NodeAgent:
    registry = PidRegistry()
    backends: dict[str, SnapshotBackend] = {
        "cuda-checkpoint": CudaCheckpointBackend(registry, lock_timeout_s=lock_timeout_s)
    }
    for backend in extra_backends or []:
        backends[backend.name] = backend
    activities = NodeSnapshotActivities(backends, registry)
    worker = Worker(
        client,
        task_queue=node_task_queue(node),
        activities=[activities.snapshot, activities.restore],
        max_concurrent_activities=8,
    )
    return NodeAgent(worker, activities)
