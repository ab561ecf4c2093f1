"""The pool's client calls, run as activities (a workflow cannot make them): claiming a pool's
groups (docs/pools.md, "One pool per group"), and a job's request for its groups."""

from __future__ import annotations

from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.service import RPCError, RPCStatusCode
from timeslice.protocol.pool import (
    CLAIM_GROUPS_ACTIVITY,
    REQUEST_PLACEMENT_ACTIVITY,
    ClaimRequest,
    PlaceAnswer,
    Placement,
    PlacementCall,
    PoolUpdate,
    claim_workflow_id,
    pool_workflow_id,
)
from timeslice.session.pool_claims import claim_group

__all__ = ["claim_pool_groups", "request_pool_placement"]


@activity.defn(name=CLAIM_GROUPS_ACTIVITY)
async def claim_pool_groups(req: ClaimRequest) -> None:
    """Claim every group of a new pool, or none: a refusal releases what this call claimed."""
    client = activity.client()
    started: list[str] = []
    try:
        for group_id in req.groups:
            if await claim_group(client, req.pool, group_id):
                started.append(group_id)
    except BaseException:
        for group_id in started:
            await client.get_workflow_handle(claim_workflow_id(group_id)).terminate(
                f"pool {req.pool!r} was refused"
            )
        raise


@activity.defn(name=REQUEST_PLACEMENT_ACTIVITY)
async def request_pool_placement(call: PlacementCall) -> Placement:
    """Ask ``pool`` where the job runs. A queued job's request fails retryably, saying why, so
    the job workflow's retry policy asks again (no history event per try) until it is placed;
    a pool that does not run, or refuses the job, fails it non-retryably."""
    pool, req = call.pool, call.request
    handle = activity.client().get_workflow_handle(pool_workflow_id(pool))
    try:
        answer = await handle.execute_update(PoolUpdate.PLACE, req, result_type=PlaceAnswer)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        why = cause.message if isinstance(cause, ApplicationError) else str(cause or err)
        raise ApplicationError(
            f"pool {pool!r} refused job {req.job_id!r}: {why}",
            type="PlacementRefused",
            non_retryable=True,
        ) from None
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        raise ApplicationError(
            f"no pool {pool!r} runs: create it with `timeslice pool create {pool} --group ...`",
            type="UnknownPool",
            non_retryable=True,
        ) from None
    if answer.placement is None:
        raise ApplicationError(
            f"waiting in pool {pool!r}'s queue: {answer.queued_because}",
            type="Queued",
            category=ApplicationErrorCategory.BENIGN,  # the worker logs it at debug, not warning
        )
    return answer.placement
