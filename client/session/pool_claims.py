"""A pool's claim on its groups (docs/pools.md, "One pool per group"): one
``PoolClaimWorkflow`` per group, its id from the group's name, so Temporal's one open run per
workflow id keeps a group in one pool. The pool's claim activity (``activities/pool_requests.py``)
and ``timeslice.pools`` (its check before it starts a pool) both read claims here."""

from __future__ import annotations

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from timeslice.protocol.group import CONTROL_TASK_QUEUE
from timeslice.protocol.pool import CLAIM_WORKFLOW, PoolQuery, claim_workflow_id, pool_workflow_id


async def group_owner(client: Client, group_id: str) -> str | None:
    """The running pool that holds ``group_id``, or None (a claim whose pool no longer runs
    holds nothing)."""
    try:
        owner = await client.get_workflow_handle(claim_workflow_id(group_id)).query(
            PoolQuery.OWNER, result_type=str
        )
        described = await client.get_workflow_handle(pool_workflow_id(owner)).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return owner if described.status == WorkflowExecutionStatus.RUNNING else None


async def claim_group(client: Client, pool: str, group_id: str) -> bool:
    """Claim one group for ``pool``; True if this call started the claim."""
    workflow_id = claim_workflow_id(group_id)
    for _ in range(2):
        try:
            await client.start_workflow(
                CLAIM_WORKFLOW, pool, id=workflow_id, task_queue=CONTROL_TASK_QUEUE
            )
            return True
        except WorkflowAlreadyStartedError:
            pass
        owner = await group_owner(client, group_id)
        if owner == pool:
            return False
        if owner is not None:
            raise ApplicationError(
                f"group {group_id!r} is already in pool {owner!r}: a group belongs to one pool",
                type="GroupInAnotherPool",
                non_retryable=True,
            )
        # A claim left by a pool that no longer runs: it is taken over.
        await client.get_workflow_handle(workflow_id).terminate(f"taken over by pool {pool!r}")
    raise ApplicationError(f"group {group_id!r}: its claim could not be taken over")
