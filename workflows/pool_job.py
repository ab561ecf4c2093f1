"""A job started with ``pool``: it asks its pool for groups before its first lease, and tells
the pool when it ends (docs/pools.md). Only such a job runs any of this, so a job without a pool
emits the commands it always did; the new ones are behind ``POOL_PLACEMENT`` all the same."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    is_cancelled_exception,
)
from timeslice.protocol.async_rl_job import AsyncRLJobConfig
from timeslice.protocol.pool import (
    REQUEST_PLACEMENT_ACTIVITY,
    JobEnded,
    Placement,
    PlacementCall,
    PlaceRequest,
    PoolSignal,
    pool_workflow_id,
)
from timeslice.protocol.rl_job import RLJobConfig

# workflow.patched id of a job's placement by its pool.
POOL_PLACEMENT = "pool-placement"

# A job in its pool's queue asks again this often (its request activity's retries, which add
# no event to the job's history), so it starts at most this long after its place frees.
_ASK_AGAIN = RetryPolicy(
    initial_interval=timedelta(seconds=0.5),
    backoff_coefficient=1.5,
    maximum_interval=timedelta(seconds=2),
    non_retryable_error_types=["UnknownPool", "PlacementRefused"],
)

C = TypeVar("C", bound=RLJobConfig)
R = TypeVar("R")


def needs_placement(config: RLJobConfig) -> bool:
    """Whether the job asks its pool for groups now: it has a pool and no groups yet. A first
    run given both is refused (a continued run carries the groups its pool gave)."""
    if config.pool is None:
        return False
    if config.sampler_group is not None and workflow.info().continued_run_id is None:
        raise ApplicationError(
            f"job {config.job_id}: give pool or groups (sampler_group, trainer_group), not both",
            type="InvalidConfig",
            non_retryable=True,
        )
    return config.sampler_group is None


async def placed(config: C) -> C:
    """``config`` with the groups its pool gives it (waiting in the pool's queue as long as
    the pool keeps it there); a pool that does not run or refuses the job fails it,
    non-retryably, saying why."""
    assert config.pool is not None
    workflow.patched(POOL_PLACEMENT)
    request = PlaceRequest(
        job_id=config.job_id,
        mode="async" if isinstance(config, AsyncRLJobConfig) else "sync",
        profile=config.profile,
        place_anyway=config.place_anyway,
    )
    try:
        placement = await workflow.execute_activity(
            REQUEST_PLACEMENT_ACTIVITY,
            PlacementCall(pool=config.pool, request=request),
            result_type=Placement,
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=_ASK_AGAIN,
        )
    except ActivityError as err:
        if is_cancelled_exception(err):  # the job was cancelled while it waited
            raise
        cause = err.cause
        why = cause.message if isinstance(cause, ApplicationError) else str(err)
        raise ApplicationError(why, type="PoolRefused", non_retryable=True) from None
    return config.model_copy(
        update={"sampler_group": placement.sampler_group, "trainer_group": placement.trainer_group}
    )


async def tell_pool(config: RLJobConfig, outcome: str) -> None:
    """Tell the job's pool it ended (``outcome``: completed, stopped, failed, cancelled), so
    its groups' room goes to the pool's queue. A pool that is gone has nobody to tell."""
    if config.pool is None or not workflow.patched(POOL_PLACEMENT):
        return
    try:
        await workflow.get_external_workflow_handle(pool_workflow_id(config.pool)).signal(
            PoolSignal.JOB_ENDED, JobEnded(job_id=config.job_id, outcome=outcome)
        )
    except FailureError as err:
        workflow.logger.warning(
            "pool %s was not told job %s ended: %s", config.pool, config.job_id, err
        )


async def ended_in_pool(config: RLJobConfig, run: Awaitable[R]) -> R:
    """Await the job's run and tell its pool (if any) how it ended: completed or stopped,
    failed, or cancelled; a run that continues as new has not ended."""
    if config.pool is None:
        return await run
    outcome = "failed"
    try:
        result = await run
        outcome = "stopped" if getattr(result, "stopped", False) else "completed"
        return result
    except workflow.ContinueAsNewError:
        outcome = ""
        raise
    except BaseException as err:
        if isinstance(err, asyncio.CancelledError) or is_cancelled_exception(err):
            outcome = "cancelled"
        raise
    finally:
        if outcome:
            await tell_pool(config, outcome)
