"""Why a group does not answer: no control worker polls the groups' task queue, or the group's
workflow task keeps failing. A lease session asks here before it raises
``NoControlWorkerError`` or ``GroupNotAnsweringError``, so that the error says which of the two
it is and where to look."""

from __future__ import annotations

import asyncio
import contextlib

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import WorkflowTaskFailedCause
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.client import Client
from temporalio.service import RPCError
from timeslice.errors import GroupNotAnsweringError, NoControlWorkerError, TimesliceError
from timeslice.protocol.group import CONTROL_TASK_QUEUE, group_workflow_id
from timeslice.transport.connection import control_workers_polling

# The most each question here may take: it only explains an error already decided.
ASK_S = 5.0


async def check_control_worker(client: Client, server: str) -> None:
    """Raise if no control worker polls the groups' task queue: with none, no group ever
    answers (an update or a query would wait in silence).

    Args:
        client: The session's Temporal client.
        server: The Temporal server's address, for the message.

    Raises:
        NoControlWorkerError: The groups' task queue has no poller.
    """
    if not await control_workers_polling(client):
        raise NoControlWorkerError(
            f"no control worker serves task queue {CONTROL_TASK_QUEUE!r} in namespace "
            f"{client.namespace!r} at {server}: start one with "
            "`timeslice worker` (nothing answers for the GPU groups until one runs)"
        )


async def not_answering(client: Client, group_id: str, what: str) -> TimesliceError:
    """Why the group took no update: its workflow task failing (the group's history says
    so), or no control worker running it (the task queue may still list one that stopped
    moments ago, or one that took the group's task and never answered).

    Args:
        client: The session's Temporal client.
        group_id: The group that did not answer.
        what: What was asked of it, to start the message with (``"acquire g1: ..."``).

    Returns:
        The error to raise: ``GroupNotAnsweringError`` with the task's failure, else
        ``NoControlWorkerError`` (with the pollers the task queue lists, if it answered).
    """
    failure: str | None = None
    with contextlib.suppress(RPCError, TimeoutError):
        failure = await asyncio.wait_for(last_task_failure(client, group_id), ASK_S)
    where = f"workflow {group_workflow_id(group_id)} in namespace {client.namespace!r}"
    if failure is not None:
        return GroupNotAnsweringError(
            f"{what}: the group is not answering: its workflow task fails ({failure}); see "
            f"the control worker's log and {where} in the Web UI"
        )
    pollers: int | None = None
    with contextlib.suppress(RPCError, TimeoutError):
        pollers = await asyncio.wait_for(control_workers_polling(client), ASK_S)
    listed = (
        ""
        if pollers is None
        else f" (the task queue lists {pollers} poller(s): a worker that stopped moments "
        "ago stays listed for a while)"
    )
    return NoControlWorkerError(
        f"{what}: no control worker took it on task queue {CONTROL_TASK_QUEUE!r}{listed}; "
        f"start one with `timeslice worker`, or see its log ({where})"
    )


async def last_task_failure(client: Client, group_id: str) -> str | None:
    """What the group's last workflow task failed with, if its last one failed (rather than
    completed, or timed out on a worker that stopped)."""
    page = await client.workflow_service.get_workflow_execution_history_reverse(
        GetWorkflowExecutionHistoryReverseRequest(
            namespace=client.namespace,
            execution=WorkflowExecution(workflow_id=group_workflow_id(group_id)),
            maximum_page_size=50,
        )
    )
    for event in page.history.events:
        if event.HasField("workflow_task_failed_event_attributes"):
            failed = event.workflow_task_failed_event_attributes
            return failed.failure.message or WorkflowTaskFailedCause.Name(failed.cause)
        if event.HasField("workflow_task_completed_event_attributes") or event.HasField(
            "workflow_task_timed_out_event_attributes"
        ):
            return None
    return None
