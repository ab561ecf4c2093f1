"""Workflow-side fan-out of snapshot / restore activities over a job's queues (all in parallel).

Used by the group workflow on every switch and by SnapshotJobWorkflow for standalone use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError, TimeoutType
from temporalio.exceptions import TimeoutError as TemporalTimeoutError
from timeslice.protocol.group import (
    SNAPSHOT_ACTIVITY,
    QueueTarget,
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
    agents_apart: bool = False,
) -> list[Outcome]:
    """Run ``activity`` on every queue of ``target``; one outcome per queue, never raising.

    Results are validated here rather than by the data converter, so a malformed answer from
    one process becomes that queue's failure instead of failing the calling workflow's task.
    ``agent_pickup_timeout_s``: how long a node agent's queue may take to pick its task up
    (an agent restarting, or busy); None: ``pickup_timeout_s``, as a job process's.
    ``agents_apart``: with both a node agent's queues and the job's own, an eviction runs the
    job's own first and the agent's after, and a restore the agent's first and the job's own
    after, only if the agent's succeeded: an agent's checkpoint locks the whole process, and
    a move the process makes itself (CUDA calls) blocks while it is locked.
    """
    verb = "evict" if activity == SNAPSHOT_ACTIVITY else "restore"
    queues = list(target.queues)

    def call(queue: QueueTarget) -> Awaitable[Any]:
        return workflow.execute_activity(
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

    async def run(indices: list[int]) -> None:
        answers = await asyncio.gather(*(call(queues[i]) for i in indices), return_exceptions=True)
        raw.update(zip(indices, answers, strict=True))

    raw: dict[int, Any] = {}
    agents = [i for i, q in enumerate(queues) if is_node_queue(q.task_queue)]
    own = [i for i, q in enumerate(queues) if not is_node_queue(q.task_queue)]
    if agents_apart and agents and own:
        evicting = activity == SNAPSHOT_ACTIVITY
        await run(own if evicting else agents)
        if evicting or not any(isinstance(raw[i], BaseException) for i in agents):
            await run(agents if evicting else own)
        else:
            not_run = ApplicationError(
                f"not run: the node agent's restore of {job_id} failed, and its processes stay "
                "locked until one succeeds",
                type="AgentRestoreFailed",
            )
            raw.update((i, not_run) for i in own)
    else:
        await run(list(range(len(queues))))
    outcomes: list[Outcome] = []
    for outcome in (raw[i] for i in range(len(queues))):
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
