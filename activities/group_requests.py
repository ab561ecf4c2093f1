"""Starting a GPU group's workflow from outside it: signal-with-start of a request.

Signal-with-start is a client call (servers refuse it from inside a workflow by default), so a
requester *workflow* runs it as the local activity below, on the worker that runs the requester.
"""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from timeslice.workflows.protocol import (
    CONTROL_TASK_QUEUE,
    GROUP_WORKFLOW_TYPE,
    REQUEST_GROUP_ACTIVITY,
    GroupConfig,
    GroupInput,
    GroupRequest,
    group_workflow_id,
)

GROUP_KEY = SearchAttributeKey.for_keyword("TimesliceGroup")


async def start_group(client: Client, config: GroupConfig, **signal: Any) -> None:
    """Start a group's workflow (with ``start_signal``: signal-with-start)."""
    await client.start_workflow(
        GROUP_WORKFLOW_TYPE,
        GroupInput(config=config).model_dump(mode="json"),
        id=group_workflow_id(config.group_id),
        task_queue=CONTROL_TASK_QUEUE,
        search_attributes=TypedSearchAttributes([SearchAttributePair(GROUP_KEY, config.group_id)]),
        static_summary=f"GPU group {config.group_id}",
        **signal,
    )


@activity.defn(name=REQUEST_GROUP_ACTIVITY)
async def request_group(req: GroupRequest) -> None:
    await start_group(
        activity.client(),
        GroupConfig(group_id=req.group_id),
        start_signal="request",
        start_signal_args=[req.request],
    )
