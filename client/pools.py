"""Pools of GPU groups from Python (what ``timeslice pool`` does; docs/pools.md).

from timeslice.pools import PoolConfig, PoolGroup, create_pool
await create_pool(client, PoolConfig(pool="p", groups=[PoolGroup(name="g1"),
                                                      PoolGroup(name="g2", memory_bytes="80GiB")]))
# then: start_rl_job(client, RLJobConfig(job_id="j1", pool="p", ...))
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import CONTROL_TASK_QUEUE, check_id, explain_validation_error
from timeslice.protocol.pool import (
    POOL_WORKFLOW,
    Decision,
    MoveRequest,
    PoolConfig,
    PoolGroup,
    PoolQuery,
    PoolStatus,
    PoolUpdate,
    pool_workflow_id,
)
from timeslice.session.pool_claims import group_owner

__all__ = [
    "PoolConfig",
    "PoolGroup",
    "create_pool",
    "move_pool_job",
    "parse_pool_config",
    "pool_decisions",
    "pool_members",
    "pool_status",
    "require_pool",
]


def parse_pool_config(data: dict[str, Any]) -> PoolConfig:
    """A pool's config, checked (``InvalidArgumentError`` naming each problem)."""
    try:
        return PoolConfig.model_validate(data)
    except ValidationError as err:
        why = explain_validation_error(err).replace("Value error, ", "")
        raise InvalidArgumentError(f"invalid pool: {why}") from None


async def _running(client: Client, pool: str) -> bool:
    try:
        described = await client.get_workflow_handle(pool_workflow_id(pool)).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return described.status == WorkflowExecutionStatus.RUNNING


async def create_pool(client: Client, config: PoolConfig) -> WorkflowHandle[Any, Any]:
    """Start the pool's workflow (id ``timeslice-pool-<pool>``) once its groups are checked;
    return once it holds them.

    Raises:
        InvalidArgumentError: The pool runs already, or a group is in another running pool
            (nothing is started). A pool created at the same moment elsewhere is caught by the
            pool's own claim of its groups, which then fails it.
    """
    if await _running(client, config.pool):
        raise InvalidArgumentError(
            f"pool {config.pool!r} exists already: `timeslice pool status {config.pool}`"
        )
    taken = {g.name: await group_owner(client, g.name) for g in config.groups}
    taken = {g: owner for g, owner in taken.items() if owner is not None}
    if taken:
        which = ", ".join(f"{g!r} (pool {owner!r})" for g, owner in sorted(taken.items()))
        raise InvalidArgumentError(f"groups already in another pool: {which}; nothing started")
    try:
        handle = await client.start_workflow(
            POOL_WORKFLOW,
            config.model_dump(mode="json"),
            id=pool_workflow_id(config.pool),
            task_queue=CONTROL_TASK_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            static_summary=f"pool {config.pool}: " + ", ".join(g.name for g in config.groups),
        )
    except WorkflowAlreadyStartedError as err:
        raise InvalidArgumentError(f"pool {config.pool!r} exists already") from err
    try:
        await handle.execute_update(PoolUpdate.READY)
    except (WorkflowUpdateFailedError, RPCError):
        try:
            await handle.result()
        except WorkflowFailureError as err:
            why = getattr(err.cause, "message", None) or str(err.cause or err)
            raise InvalidArgumentError(f"pool {config.pool!r} refused: {why}") from None
        raise
    return handle


async def require_pool(client: Client, pool: str) -> None:
    """Raise ``InvalidArgumentError`` if no pool of that name runs."""
    if not await _running(client, pool):
        raise InvalidArgumentError(
            f"no pool {pool!r} runs: create it with `timeslice pool create {pool} --group NAME`"
        )


async def pool_status(client: Client, pool: str) -> PoolStatus:
    """The pool's groups, jobs (placed and queued) and last decisions."""
    await require_pool(client, pool)
    return await client.get_workflow_handle(pool_workflow_id(pool)).query(
        PoolQuery.STATUS, result_type=PoolStatus
    )


async def _pool_history(client: Client, pool: str) -> AsyncIterator[Any]:
    """Every event of the pool's workflow, every run of it in the order they started.

    Raises:
        InvalidArgumentError: No pool of that name was ever started.
    """
    check_id("pool name", pool)
    runs = [run async for run in client.list_workflows(f"WorkflowId = '{pool_workflow_id(pool)}'")]
    if not runs:
        raise InvalidArgumentError(
            f"no pool {pool!r}: create it with `timeslice pool create {pool} --group NAME`"
        )
    for run in sorted(runs, key=lambda r: r.start_time):
        history = await client.get_workflow_handle(run.id, run_id=run.run_id).fetch_history()
        for event in history.events:
            yield event


def _decision_memo(event: Any) -> Any:
    """A decision event's memo fields (a memo upsert of the pool's), or None."""
    if not event.HasField("workflow_properties_modified_event_attributes"):
        return None
    return event.workflow_properties_modified_event_attributes.upserted_memo.fields


async def pool_members(client: Client, pool: str) -> tuple[list[str], list[str]]:
    """The pool's groups, and every job it took a decision about (its decision events, every
    run of its workflow: jobs that ended included), in the order it first decided on each.

    Raises:
        InvalidArgumentError: No pool of that name was ever started.
    """
    jobs: dict[str, None] = {}
    groups: dict[str, None] = {}
    async for event in _pool_history(client, pool):
        if event.HasField("workflow_execution_started_event_attributes"):
            started = event.workflow_execution_started_event_attributes
            if started.input.payloads:
                data = json.loads(started.input.payloads[0].data)
                config = data.get("config", data)
                groups.update((g["name"], None) for g in config.get("groups", []))
        memo = _decision_memo(event)
        if memo is not None and "job" in memo:
            job = json.loads(memo["job"].data)
            if job != "-":
                jobs[job] = None
    return list(groups), list(jobs)


async def pool_decisions(client: Client, pool: str) -> list[Decision]:
    """Every decision the pool took, from its history's decision events (every run of its
    workflow), where its status keeps only the last ``DECISIONS_KEPT``.

    Raises:
        InvalidArgumentError: No pool of that name was ever started.
    """
    found: list[Decision] = []
    async for event in _pool_history(client, pool):
        memo = _decision_memo(event)
        if memo is not None and "decision" in memo:
            found.append(
                Decision(
                    job_id=json.loads(memo["job"].data) if "job" in memo else "-",
                    reason=json.loads(memo["decision"].data),
                )
            )
    return found


async def move_pool_job(
    client: Client, pool: str, job_id: str, group: str, trainer_group: str | None = None
) -> Decision:
    """Move a job the pool placed to other groups of the pool (``timeslice pool move``): a
    sync job to ``group``, an async job's sampler to ``group`` and its trainer to
    ``trainer_group``. The job takes it at its next checkpoint boundary (docs/pools.md,
    "Moving jobs").

    Returns:
        The pool's decision, as ``timeslice pool status`` lists it.

    Raises:
        InvalidArgumentError: No such pool, a job it has not placed, a group not in it, an
            async job given one group (or a sync job two), or the job's groups already.
    """
    try:
        request = MoveRequest(job_id=job_id, sampler_group=group, trainer_group=trainer_group)
    except ValidationError as err:
        why = explain_validation_error(err).replace("Value error, ", "")
        raise InvalidArgumentError(f"invalid move: {why}") from None
    await require_pool(client, pool)
    handle = client.get_workflow_handle(pool_workflow_id(pool))
    try:
        return await handle.execute_update(
            PoolUpdate.MOVE, request.model_dump(mode="json"), result_type=Decision
        )
    except WorkflowUpdateFailedError as err:
        why = getattr(err.cause, "message", None) or str(err.cause or err)
        raise InvalidArgumentError(f"pool {pool!r} refused the move: {why}") from None
