"""The control worker: runs the GPU-group and RL-job workflows on task queue ``timeslice``."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.activities.group_requests import request_group
from timeslice.errors import TimesliceError
from timeslice.workers.sandbox import workflow_runner
from timeslice.workflows.gpu_group import GpuGroupWorkflow
from timeslice.workflows.protocol import CONTROL_TASK_QUEUE, SEARCH_ATTRIBUTES
from timeslice.workflows.rl_job import RLJobWorkflow
from timeslice.workflows.snapshot_job import SnapshotJobWorkflow

WORKFLOWS = [GpuGroupWorkflow, SnapshotJobWorkflow, RLJobWorkflow]

_TYPES = {
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Text": IndexedValueType.INDEXED_VALUE_TYPE_TEXT,
}


async def missing_search_attributes(client: Client) -> list[str]:
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    return [name for name in SEARCH_ATTRIBUTES if name not in resp.custom_attributes]


async def check_search_attributes(client: Client) -> None:
    """Fail with a clear message if the namespace lacks Timeslice's search attributes."""
    missing = await missing_search_attributes(client)
    if missing:
        raise TimesliceError(
            f"namespace {client.namespace!r} lacks the search attributes {missing}; "
            "run `timeslice setup` once against this cluster (the embedded server has them)"
        )


async def register_search_attributes(client: Client) -> list[str]:
    """Register whichever of Timeslice's search attributes are missing; return their names."""
    missing = await missing_search_attributes(client)
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=client.namespace,
                search_attributes={name: _TYPES[SEARCH_ATTRIBUTES[name]] for name in missing},
            )
        )
    return missing


def build_control_worker(client: Client, *, max_cached_workflows: int = 1000) -> Worker:
    return Worker(
        client,
        task_queue=CONTROL_TASK_QUEUE,
        workflows=WORKFLOWS,
        activities=[request_group],
        max_cached_workflows=max_cached_workflows,
        workflow_runner=workflow_runner(),
    )
