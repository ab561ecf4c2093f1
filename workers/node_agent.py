"""The node agent: transparent snapshot backends for the processes of one node.

Serves task queue ``timeslice-node-<node>``. It acts only for requests that come from a GPU
group's or a standalone snapshot's workflow, and only on the processes a job registered
*themselves* with it (``timeslice.snapshot.registration``: each process connects to the
agent's Unix socket; the kernel names the peer, which must present its job's token, made from
the agent's key). A request cannot point it at any other process: the PIDs in a request are
not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.protocol.group import GROUP_WORKFLOW_TYPE, SnapshotCall, node_task_queue
from timeslice.session.snapshot_activities import SnapshotActivities
from timeslice.snapshot.base import (
    Capability,
    Health,
    SnapshotBackend,
    SnapshotError,
    SnapshotRequest,
)
from timeslice.snapshot.processes import PidRegistry
from timeslice.snapshot.registration import RegistrationServer
from timeslice.snapshot.registry import create, node_agent_backends
from timeslice.workflows.snapshot_job import SNAPSHOT_JOB_WORKFLOW_TYPE

# Who may ask: the workflows that decide switches (a group) or standalone moves.
TRUSTED_CALLERS = frozenset({GROUP_WORKFLOW_TYPE, SNAPSHOT_JOB_WORKFLOW_TYPE})


class NodeSnapshotActivities(SnapshotActivities):
    def __init__(self, backends: dict[str, SnapshotBackend], registry: PidRegistry) -> None:
        super().__init__(backends)
        self.registry = registry

    def request_for(self, call: SnapshotCall, backends: list[SnapshotBackend]) -> SnapshotRequest:
        caller = activity.info().workflow_type
        if caller not in TRUSTED_CALLERS:
            raise SnapshotError(
                f"the node agent acts only for {sorted(TRUSTED_CALLERS)} workflows, not for "
                f"{caller or 'a caller outside any workflow'}; refusing {call.job_id}'s request"
            )
        whole = any(Capability.WHOLE_PROCESS in b.capabilities for b in backends)
        # The job's registered processes, each checked to be the very process that registered;
        # the PIDs in the call are never used.
        processes = tuple(self.registry.verified(call.job_id)) if whole else ()
        return SnapshotRequest(call.job_id, call.group_id, call.reason, processes)


@dataclass
class NodeAgent:
    worker: Worker
    activities: NodeSnapshotActivities
    registration: RegistrationServer

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
    backend_options: dict[str, dict[str, Any]] | None = None,
    key_file: Path | None = None,
) -> NodeAgent:
    """The agent with the registry's node-agent backends (each built with its
    ``backend_options`` entry, e.g. ``{"cuda-checkpoint": {"lock_timeout_s": 5.0}}``) and
    ``extra_backends``. ``key_file``: the key job tokens are made with (default
    ``$TIMESLICE_AGENT_KEY_FILE``, else ``agent.key`` beside the socket, created if missing)."""
    registry = PidRegistry()
    options = backend_options or {}
    unknown = sorted(set(options) - set(node_agent_backends()))
    if unknown:
        raise SnapshotError(
            f"options for {unknown}, which the node agent does not run "
            f"(it runs {node_agent_backends()})"
        )
    backends = {name: create(name, **options.get(name, {})) for name in node_agent_backends()}
    for backend in extra_backends or []:
        if not isinstance(backend, SnapshotBackend):  # e.g. one written before `capabilities`
            raise SnapshotError(
                f"{backend!r} is not a snapshot backend: it needs a name, capabilities, "
                "snapshot(request), restore(request) and health() (timeslice.snapshot.base)"
            )
        backends[backend.name] = backend
    activities = NodeSnapshotActivities(backends, registry)
    worker = Worker(
        client,
        task_queue=node_task_queue(node),
        activities=[activities.snapshot, activities.restore],
        max_concurrent_activities=8,
    )
    return NodeAgent(worker, activities, RegistrationServer(node, registry, key_file=key_file))
