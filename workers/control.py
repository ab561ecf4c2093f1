"""The control worker: runs the GPU-group and RL-job workflows on task queue ``timeslice``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import (
    AddSearchAttributesRequest,
    ListSearchAttributesRequest,
)
from temporalio.client import Client
from temporalio.contrib.pydantic import PydanticPayloadConverter
from temporalio.converter import DataConverter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker
from timeslice.activities.group_requests import draw_secret, renew_lease, request_group
from timeslice.activities.pool_requests import claim_pool_groups, request_pool_placement
from timeslice.errors import TimesliceError
from timeslice.protocol.group import (
    CONTROL_TASK_QUEUE,
    SEARCH_ATTRIBUTES,
    Undecodable,
    explain_validation_error,
)
from timeslice.transport.connection import control_workers_polling
from timeslice.workers.sandbox import control_workflow_runner
from timeslice.workflows.async_rl_job import AsyncRLJobWorkflow
from timeslice.workflows.gpu_group import GpuGroupWorkflow
from timeslice.workflows.pool import PoolClaimWorkflow, PoolWorkflow
from timeslice.workflows.rl_job import RLJobWorkflow
from timeslice.workflows.snapshot_job import SnapshotJobWorkflow

WORKFLOWS = [
    GpuGroupWorkflow,
    SnapshotJobWorkflow,
    RLJobWorkflow,
    AsyncRLJobWorkflow,
    PoolWorkflow,
    PoolClaimWorkflow,
]

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


@dataclasses.dataclass
class SetupReport:
    """What ``timeslice setup`` found and did in one namespace."""

    namespace: str
    added: list[str]
    present: list[str]
    # Still missing: the caller may not add search attributes (an operator must).
    missing: list[str]
    refused: str | None
    control_workers: int

    def lines(self) -> list[str]:
        out = [f"namespace {self.namespace!r}:"]
        for name in SEARCH_ATTRIBUTES:
            kind = SEARCH_ATTRIBUTES[name]
            if name in self.added:
                out.append(f"  search attribute {name} ({kind}): registered now")
            elif name in self.present:
                out.append(f"  search attribute {name} ({kind}): already registered")
            else:
                out.append(
                    f"  search attribute {name} ({kind}): MISSING — an operator can add it: "
                    f"temporal operator search-attribute create --namespace {self.namespace} "
                    f"--name {name} --type {kind}"
                )
        if self.refused:
            out.append(f"  (registering was refused: {self.refused})")
        workers = (
            f"{self.control_workers} polling"
            if self.control_workers
            else "none polling yet: start `timeslice worker` (no group answers without one)"
        )
        out.append(f"  control workers on task queue {CONTROL_TASK_QUEUE!r}: {workers}")
        return out


async def set_up_namespace(client: Client) -> SetupReport:
    """Register whichever search attributes are missing (as far as the caller may), and say
    what the namespace has: ``timeslice setup``."""
    missing = await missing_search_attributes(client)
    present = [name for name in SEARCH_ATTRIBUTES if name not in missing]
    added: list[str] = []
    refused = None
    if missing:
        try:
            added = await register_search_attributes(client)
        except RPCError as err:
            if err.status not in (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED):
                raise
            refused = f"{err.status.name}: {err.message}"
    return SetupReport(
        namespace=client.namespace,
        added=added,
        present=present,
        missing=[name for name in missing if name not in added],
        refused=refused,
        control_workers=await control_workers_polling(client),
    )


class TolerantPayloadConverter(PydanticPayloadConverter):
    """Pydantic payloads, except that a payload decoded without a type (the workflows take
    their inputs, signals and updates raw and validate them themselves) that cannot be decoded
    at all — not JSON, nested too deep, an unknown encoding — becomes an ``Undecodable`` value
    for the workflow to refuse, instead of an exception that fails the workflow task (and, for
    a workflow's start input, fails it again on every retry)."""

    def from_payloads(
        self, payloads: Sequence[Payload], type_hints: list[type] | None = None
    ) -> list[Any]:
        hints: list[Any] = list(type_hints or [])
        values: list[Any] = []
        for index, payload in enumerate(payloads):
            hint = hints[index] if index < len(hints) else None
            if hint is not None and hint is not Any:
                values.extend(super().from_payloads([payload], [hint]))
                continue
            try:
                values.extend(super().from_payloads([payload], None))
            except Exception as err:
                encoding = payload.metadata.get("encoding", b"<none>").decode(errors="replace")
                why = explain_validation_error(err) if isinstance(err, ValidationError) else err
                values.append(Undecodable(encoding=encoding, error=str(why)[:500]))
        return values


def control_data_converter(converter: DataConverter) -> DataConverter:
    """The control worker's converter: ``converter`` (its codec and failure converter kept)
    decoding untyped payloads with ``TolerantPayloadConverter``."""
    if converter.payload_converter_class is not PydanticPayloadConverter:
        return converter  # someone else's converter: left as it is
    return dataclasses.replace(converter, payload_converter_class=TolerantPayloadConverter)


# How long a group's next workflow task waits on the sticky queue of the worker that ran its
# last one before the server offers it to every control worker. The SDK's default, 10 s, is how
# long a killed control worker stalls each group it ran, even with a second worker polling; 3 s
# bounds that, and costs a live but busy worker at most a replay of the group's (short,
# continued-as-new) history when it misses the window.
STICKY_TIMEOUT_S = 3.0


def build_control_worker(
    client: Client,
    *,
    max_cached_workflows: int = 1000,
    sticky_timeout_s: float = STICKY_TIMEOUT_S,
    extra_activities: Sequence[Callable[..., Any]] = (),
    sandboxed: bool = False,
) -> Worker:
    """The control worker: the group and RL-job workflows and their activities, on
    ``CONTROL_TASK_QUEUE``.

    Args:
        client: A connected client; its converter is kept, made tolerant of undecodable
            payloads (``control_data_converter``).
        max_cached_workflows: Workflows kept in memory between their tasks.
        sticky_timeout_s: How long a workflow's task waits for this worker on its sticky queue
            before any control worker may take it (``STICKY_TIMEOUT_S``).
        extra_activities: Activities of the layers above (``timeslice worker`` passes the
            pools' placement, plan/placement.py, which this layer may not import).
        sandboxed: Run the workflows in Temporal's sandbox, which checks every call they
            make at run time for a CPU cost on every workflow task (``control_workflow_runner``).

    Raises:
        ValueError: ``sticky_timeout_s`` is not > 0.
    """
    if not sticky_timeout_s > 0:
        raise ValueError(f"sticky_timeout_s must be > 0, not {sticky_timeout_s}")
    config = client.config()
    config["data_converter"] = control_data_converter(config["data_converter"])
    return Worker(
        Client(**config),
        task_queue=CONTROL_TASK_QUEUE,
        workflows=WORKFLOWS,
        activities=[
            request_group,
            draw_secret,
            renew_lease,
            claim_pool_groups,
            request_pool_placement,
            *extra_activities,
        ],
        max_cached_workflows=max_cached_workflows,
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=sticky_timeout_s),
        workflow_runner=control_workflow_runner(sandboxed=sandboxed),
    )
