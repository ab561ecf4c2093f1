"""A pool's claim on its groups (docs/pools.md, "One pool per group"): one
``PoolClaimWorkflow`` per group, its id from the group's name, so Temporal's one open run per
workflow id keeps a group in one pool. The pool's claim activity (``activities/pool_requests.py``)
and ``timeslice.pools`` (its check before it starts a pool) both read claims here."""

from __future__ import annotations

import contextlib

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from timeslice.protocol.group import CONTROL_TASK_QUEUE
from timeslice.protocol.pool import (
    CLAIM_WORKFLOW,
    PoolQuery,
    PoolStatus,
    claim_workflow_id,
    pool_workflow_id,
)


async def group_owner(client: Client, group_id: str) -> str | None:
    """The running pool that holds ``group_id``, or None (a claim whose pool no longer runs,
    or no longer lists the group, holds nothing)."""
    claim = await _claim_of(client, group_id)
    return claim[0] if claim is not None and claim[2] else None


async def _claim_of(client: Client, group_id: str) -> tuple[str, str, bool] | None:
    """The group's open claim: (its pool, its run id, whether it still holds the group: that
    pool runs and lists the group; a pool deleted and created again without it does not), or
    None if there is no open claim."""
    handle = client.get_workflow_handle(claim_workflow_id(group_id))
    try:
        described = await handle.describe()
        if described.status != WorkflowExecutionStatus.RUNNING:
            return None
        claim = client.get_workflow_handle(handle.id, run_id=described.run_id)
        owner = await claim.query(PoolQuery.OWNER, result_type=str)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    pool = client.get_workflow_handle(pool_workflow_id(owner))
    try:
        if (await pool.describe()).status != WorkflowExecutionStatus.RUNNING:
            return owner, described.run_id, False
        status = await pool.query(PoolQuery.STATUS, result_type=PoolStatus)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return owner, described.run_id, False
        raise
    return owner, described.run_id, any(g.name == group_id for g in status.config.groups)


async def claim_group(client: Client, pool: str, group_id: str) -> bool:
    """Claim one group for ``pool``; True if this call started the claim."""
    workflow_id = claim_workflow_id(group_id)
    for _ in range(3):
        try:
            await client.start_workflow(
                CLAIM_WORKFLOW, pool, id=workflow_id, task_queue=CONTROL_TASK_QUEUE
            )
            return True
        except WorkflowAlreadyStartedError:
            pass
        claim = await _claim_of(client, group_id)
        if claim is None:
            continue  # it closed meanwhile: start ours
        owner, run_id, holds = claim
        if owner == pool:
            return False
        if holds:
            raise ApplicationError(
                f"group {group_id!r} is already in pool {owner!r}: a group belongs to one pool",
                type="GroupInAnotherPool",
                non_retryable=True,
            )
        # A claim left by a pool that no longer holds the group: taken over. Only that very
        # run is ended: a claim another pool started meanwhile (taking over the same stale
        # one) is left alone, and is found holding the group on the next turn.
        with contextlib.suppress(RPCError):  # ended already, by whoever took it over first
            await client.get_workflow_handle(workflow_id, run_id=run_id).terminate(
                f"taken over by pool {pool!r}"
            )
    raise ApplicationError(f"group {group_id!r}: its claim could not be taken over")
