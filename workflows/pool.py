"""PoolWorkflow: a pool of GPU groups that places the jobs sent to it (docs/pools.md).

The pool holds its groups, the jobs it placed (with their groups and predicted demand), the
jobs waiting in its queue (with why) and its last decisions. It decides nothing itself: each
decision is the placement activity's (plan/placement.py, the planner's simulator), which is not
deterministic enough to run in a workflow (the planner's search is time-bounded) and may not be
imported by one (layering). One decision runs at a time (a lock), so two jobs asking at once are
placed one after the other, each seeing the other's place.

PoolClaimWorkflow: one per claimed group, its id from the group's name, so a second pool that
claims the group finds it taken (Temporal keeps one open run per workflow id).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from timeslice.protocol.group import MalformedMessage, parse_message
from timeslice.protocol.pool import (
    CLAIM_GROUPS_ACTIVITY,
    CLAIM_WORKFLOW,
    DECISIONS_KEPT,
    PLACE_JOB_ACTIVITY,
    POOL_WORKFLOW,
    ClaimRequest,
    Decision,
    JobEnded,
    PlaceAnswer,
    PlaceInput,
    PlaceOutcome,
    PlaceRequest,
    PoolConfig,
    PoolJob,
    PoolQuery,
    PoolSignal,
    PoolStatus,
    PoolUpdate,
    pool_workflow_id,
)

_ACTIVITY_TIMEOUT = timedelta(seconds=60)


def _refusal(err: ActivityError) -> str:
    cause = err.cause
    return cause.message if isinstance(cause, ApplicationError) else str(err)


@workflow.defn(name=POOL_WORKFLOW)
class PoolWorkflow:
    """A pool's groups, placed jobs, queue and decisions; it runs until it is terminated."""

    @workflow.init
    def __init__(self, *raw: Any) -> None:
        # Taken raw and validated here, so bad input fails the workflow once, saying why.
        self._input_error: str | None = None
        try:
            carried = raw[0] if raw and isinstance(raw[0], dict) and "config" in raw[0] else None
            status = (
                parse_message(PoolStatus, raw, POOL_WORKFLOW)
                if carried is not None
                else PoolStatus(config=parse_message(PoolConfig, raw, POOL_WORKFLOW), jobs=[])
            )
        except MalformedMessage as err:
            self._input_error = str(err)
            status = PoolStatus(config=PoolConfig(pool="invalid", groups=[{"name": "g"}]), jobs=[])
        self._status = status
        self._claimed = carried is not None  # a continued run's groups were claimed before
        self._lock = asyncio.Lock()

    @workflow.run
    async def run(self, *raw: Any) -> None:
        """Claim the pool's groups, then serve placements until terminated.

        Raises:
            ApplicationError: Non-retryable: bad input (``InvalidPool``), a workflow id that is
                not the pool's, a group another pool holds (``GroupInAnotherPool``).
        """
        if self._input_error is not None:
            raise ApplicationError(self._input_error, type="InvalidPool", non_retryable=True)
        config = self._status.config
        if workflow.info().workflow_id != pool_workflow_id(config.pool):
            raise ApplicationError(
                f"a pool's workflow id is {pool_workflow_id(config.pool)!r}, not "
                f"{workflow.info().workflow_id!r}: start pools with `timeslice pool create`",
                type="InvalidPool",
                non_retryable=True,
            )
        if not self._claimed:
            try:
                await workflow.execute_activity(
                    CLAIM_GROUPS_ACTIVITY,
                    ClaimRequest(pool=config.pool, groups=[g.name for g in config.groups]),
                    start_to_close_timeout=_ACTIVITY_TIMEOUT,
                )
            except ActivityError as err:
                raise ApplicationError(
                    _refusal(err), type="GroupInAnotherPool", non_retryable=True
                ) from None
            self._claimed = True
        workflow.set_current_details(self._details())
        await workflow.wait_condition(
            lambda: (
                workflow.info().is_continue_as_new_suggested() and workflow.all_handlers_finished()
            )
        )
        workflow.continue_as_new(self._status.model_dump(mode="json"))

    @workflow.update(name=PoolUpdate.PLACE)
    async def place(self, *raw: Any) -> PlaceAnswer:
        """Place a job (or queue it, saying why). Asked again, it answers what it decided:
        a job's request is retried until it is placed."""
        req = parse_message(PlaceRequest, raw, PoolUpdate.PLACE)
        await workflow.wait_condition(lambda: self._claimed)
        async with self._lock:
            job = self._job(req.job_id)
            if job is None:
                job = PoolJob(**req.model_dump())
                self._status.jobs.append(job)
                refused = await self._decide(job)
                if refused is not None:
                    self._status.jobs.remove(job)
                    raise ApplicationError(refused, type="PlacementRefused", non_retryable=True)
            return PlaceAnswer(placement=job.placement, queued_because=job.queued_because)

    @place.validator
    def _check_place(self, *raw: Any) -> None:
        parse_message(PlaceRequest, raw, PoolUpdate.PLACE)

    @workflow.update(name=PoolUpdate.READY)
    async def ready(self) -> None:
        """Answers once the pool holds its groups (``create_pool`` waits for it)."""
        await workflow.wait_condition(lambda: self._claimed)

    @workflow.signal(name=PoolSignal.JOB_ENDED)
    async def job_ended(self, *raw: Any) -> None:
        """A job of the pool ended (completed, stopped or failed): its groups have room, so the
        queue is tried again, in arrival order."""
        try:
            ended = parse_message(JobEnded, raw, PoolSignal.JOB_ENDED)
        except MalformedMessage as err:
            workflow.logger.warning("dropped a malformed job_ended: %s", err)
            return
        async with self._lock:
            job = self._job(ended.job_id)
            if job is None:
                return
            self._status.jobs.remove(job)
            self._note(ended.job_id, f"{ended.job_id} {ended.outcome}: its groups are free")
            for waiting in [j for j in self._status.jobs if j.placement is None]:
                await self._decide(waiting)

    @workflow.query(name=PoolQuery.STATUS)
    def status(self) -> PoolStatus:
        return self._status

    def _job(self, job_id: str) -> PoolJob | None:
        return next((j for j in self._status.jobs if j.job_id == job_id), None)

    async def _decide(self, job: PoolJob) -> str | None:
        """Ask the placement activity where ``job`` goes; None, or why it was refused."""
        config = self._status.config
        try:
            outcome = await workflow.execute_activity(
                PLACE_JOB_ACTIVITY,
                PlaceInput(
                    groups=config.groups,
                    max_slowdown=config.max_slowdown,
                    placed=[j for j in self._status.jobs if j.placement is not None],
                    job=job,
                ),
                result_type=PlaceOutcome,
                start_to_close_timeout=_ACTIVITY_TIMEOUT,
                retry_policy=RetryPolicy(non_retryable_error_types=["InvalidProfile"]),
            )
        except ActivityError as err:
            self._note(job.job_id, f"refused {job.job_id}: {_refusal(err)}")
            return _refusal(err)
        job.placement, job.demand = outcome.placement, outcome.demand
        job.queued_because = None if outcome.placement is not None else outcome.reason
        self._note(job.job_id, outcome.reason)
        return None

    def _note(self, job_id: str, reason: str) -> None:
        self._status.decisions.append(Decision(job_id=job_id, reason=reason))
        del self._status.decisions[:-DECISIONS_KEPT]
        workflow.set_current_details(self._details())

    def _details(self) -> str:
        config = self._status.config
        placed = [j for j in self._status.jobs if j.placement is not None]
        queued = [j.job_id for j in self._status.jobs if j.placement is None]
        lines = [
            f"**pool** {config.pool}: {len(config.groups)} groups, bound "
            f"{config.max_slowdown:g}x; {len(placed)} jobs placed, queue: "
            f"{', '.join(queued) or '-'}"
        ]
        lines += [f"- {d.reason}" for d in self._status.decisions[-5:]]
        return "\n".join(lines)


@workflow.defn(name=CLAIM_WORKFLOW)
class PoolClaimWorkflow:
    """Says which pool holds a group (its input, and the ``owner`` query) for as long as it
    runs; claiming the group again fails while it does."""

    @workflow.init
    def __init__(self, *raw: Any) -> None:
        self._pool = raw[0] if raw and isinstance(raw[0], str) else ""

    @workflow.run
    async def run(self, *raw: Any) -> None:
        if not self._pool:
            raise ApplicationError(
                "a claim takes the pool's name", type="InvalidPool", non_retryable=True
            )
        await workflow.wait_condition(lambda: False)

    @workflow.query(name=PoolQuery.OWNER)
    def owner(self) -> str:
        return self._pool
