"""Workflow-side fan-out of snapshot / restore activities over a job's queues (all in parallel).

Used by the group workflow on every switch and by SnapshotJobWorkflow for standalone use.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import TimeoutError as TemporalTimeoutError
from temporalio.exceptions import TimeoutType
from timeslice.protocol.group import (
    SNAPSHOT_ACTIVITY,
    SnapshotCall,
    SnapshotReport,
    SnapshotTarget,
    is_node_queue,
)

Outcome = list[SnapshotReport] | BaseException


async def run_on_queues(
    activity: str,
    job_id: str,
    target: SnapshotTarget,
    *,
    context: str,
    pickup_timeout_s: float,
    run_timeout_s: float,
    agent_pickup_timeout_s: float | None = None,
) -> list[Outcome]:
    """Run ``activity`` on every queue of ``target``; one outcome per queue, never raising.

    Results are validated here rather than by the data converter, so a malformed answer from
    one process becomes that queue's failure instead of failing the calling workflow's task.
    ``agent_pickup_timeout_s``: how long a node agent's queue may take to pick its task up
    (an agent restarting, or busy); None: ``pickup_timeout_s``, as a job process's.
    """
    verb = "evict" if activity == SNAPSHOT_ACTIVITY else "restore"
    calls = [
        workflow.execute_activity(
            activity,
            SnapshotCall(
                group_id=context,
                job_id=job_id,
                backends=list(queue.backends),
                processes=list(queue.processes),
                reason=f"{verb} for {context}",
            ),
            task_queue=queue.task_queue,
            # A dead process never picks the task up, and one that dies (or exits) holding it
            # stops heartbeating: learn either fast, not at the run time-out. A node agent is
            # a service that comes back: its queue may be waited for longer.
            schedule_to_start_timeout=timedelta(
                seconds=agent_pickup_timeout_s
                if agent_pickup_timeout_s is not None and is_node_queue(queue.task_queue)
                else pickup_timeout_s
            ),
            heartbeat_timeout=timedelta(seconds=pickup_timeout_s),
            start_to_close_timeout=timedelta(seconds=run_timeout_s),
            retry_policy=RetryPolicy(maximum_attempts=1),
            summary=f"{verb} {job_id} · {context} · {queue.task_queue}",
        )
        for queue in target.queues
    ]
    outcomes: list[Outcome] = []
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        try:
            outcomes.append(
                outcome
                if isinstance(outcome, BaseException)
                else [SnapshotReport.model_validate(r) for r in outcome]
            )
        except (ValidationError, TypeError) as err:
            outcomes.append(err)
    return outcomes


def process_gone(error: BaseException) -> bool:
    """True if the job's process is gone: nobody picked the activity up (its queue has no live
    worker), or the process that did stopped heartbeating (it exited or died mid-move) — its
    device memory went with it either way."""
    cause = getattr(error, "cause", None)
    return isinstance(cause, TemporalTimeoutError) and cause.type in (
        TimeoutType.SCHEDULE_TO_START,
        TimeoutType.HEARTBEAT,
    )
