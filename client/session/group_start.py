"""Starting a GPU group's workflow from outside it: a plain start, or signal-with-start of its
first request. The engine and the requester workflows' activities (``activities/
group_requests.py``) both start groups this way."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from timeslice.protocol.group import (
    CONTROL_TASK_QUEUE,
    GROUP_KEY,
    GROUP_WORKFLOW_TYPE,
    GroupConfig,
    GroupInput,
    group_workflow_id,
)


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
