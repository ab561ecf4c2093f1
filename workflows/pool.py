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
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from timeslice.protocol.group import MalformedMessage, parse_message
from timeslice.protocol.pool import (
    CLAIM_GROUPS_ACTIVITY,
    CLAIM_WORKFLOW,
    DECISIONS_KEPT,
    ENDED_RUNS_KEPT,
    MAX_REASON_CHARS,
    MOVE_DECISION_ACTIVITY,
    PLACE_JOB_ACTIVITY,
    POOL_WORKFLOW,
    ClaimRequest,
    Decision,
    JobEnded,
    JobMoved,
    JobProfiled,
    MoveInput,
    MoveOrder,
    MoveOutcome,
    MoveRequest,
    PlaceAnswer,
    PlaceInput,
    Placement,
    PlaceOutcome,
    PlaceRequest,
    PoolConfig,
    PoolJob,
    PoolQuery,
    PoolSignal,
    PoolStatus,
    PoolUpdate,
    admission_order,
    admission_queue,
    pool_workflow_id,
    profile_drift,
    profile_seconds,
    profiles_past_budget,
)
from timeslice.protocol.rl_job import JobSignal, rl_job_workflow_id

_ACTIVITY_TIMEOUT = timedelta(seconds=60)
# workflow.patched id: the pool weighs moves (a job's end or measured profile runs an activity).
POOL_MOVES = "pool-moves"
# workflow.patched id: each decision is an event of the pool's history (a memo upsert).
POOL_DECISION_EVENTS = "pool-decision-events"
# workflow.patched id: a job that arrives and waits has a move weighed for it, and every move
# weighed counts the room it makes for the queue.
POOL_MOVES_FOR_QUEUE = "pool-moves-for-queue"
# workflow.patched id: a job's drifted profile replaces the one the pool knew, and a move is
# weighed (before, a job's second profile was dropped).
POOL_PROFILE_DRIFT = "pool-profile-drift"
# workflow.patched id: async jobs are moved too (by the pool's weighing, and by hand).
POOL_ASYNC_MOVES = "pool-async-moves"
# workflow.patched id: a job's measured (or drifted) profile is followed by a try of the queue:
# its demand, known now, may leave room a queued job fits in (before, the queue was tried only
# when a job ended or moved, and a queued job waited for that).
POOL_QUEUE_AFTER_PROFILE = "pool-queue-after-profile"
# workflow.patched id, asked only when it decides: a placement request from a job run that had
# told the pool it ended is refused (before, a try in flight when the job was cancelled put the
# job back in the pool after its end, where it stayed, holding room or a place in the queue).
POOL_ENDED_RUNS_REFUSED = "pool-ended-runs-refused"
# workflow.patched id, asked only when it decides: a job whose profile would take the pool's
# jobs' profiles past MAX_POOL_PROFILE_CHARS is refused (a measured one: not kept); before,
# the next decision's activity input passed Temporal's payload limit and the pool was wedged.
POOL_PROFILE_BUDGET = "pool-profile-budget"


M = TypeVar("M", bound=BaseModel)


def _read_signal(model: type[M], raw: tuple[Any, ...], name: str) -> M | None:
    """A signal's message, or None (logged) for a malformed one: a signal handler that raised
    would fail the workflow task."""
    try:
        return parse_message(model, raw, name)
    except MalformedMessage as err:
        workflow.logger.warning("dropped a malformed %s: %s", name, err)
        return None


def _drift(known: dict[str, Any], measured: dict[str, Any]) -> str:
    """What changed between two profiles, in GPU and epoch seconds."""
    was, now = profile_seconds(known), profile_seconds(measured)
    if was is None or now is None:
        return "a new profile"
    return profile_drift(was, now) or (
        f"GPU {was[0]:.2f} -> {now[0]:.2f} s, epoch {was[1]:.2f} -> {now[1]:.2f} s"
    )


def _on(placement: Placement) -> str:
    """Where a job runs, as decisions say it: a sync job's group, an async job's two."""
    if placement.sampler_group == placement.trainer_group:
        return placement.sampler_group
    return f"{placement.sampler_group} (sampler) + {placement.trainer_group} (trainer)"


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

    @workflow.update(
        name=PoolUpdate.PLACE,
        description="A job's request for groups (PlaceRequest: job_id, mode, profile, "
        "place_anyway): answers its placement, or its place in the queue and why.",
    )
    async def place(self, *raw: Any) -> PlaceAnswer:
        """Place a job (or queue it, saying why). Asked again, it answers what it decided:
        a job's request is retried until it is placed."""
        req = parse_message(PlaceRequest, raw, PoolUpdate.PLACE)
        await workflow.wait_condition(lambda: self._claimed)
        async with self._lock:
            job = self._job(req.job_id)
            if (
                job is None
                and req.run_id in self._status.ended_runs
                and workflow.patched(POOL_ENDED_RUNS_REFUSED)
            ):
                raise ApplicationError(
                    f"job {req.job_id}'s run {req.run_id} has ended: not placed",
                    type="PlacementRefused",
                    non_retryable=True,
                )
            past_budget = (
                None if job is not None else profiles_past_budget(self._status.jobs, req.profile)
            )
            if past_budget is not None and workflow.patched(POOL_PROFILE_BUDGET):
                self._note(req.job_id, f"refused {req.job_id}: {past_budget}")
                raise ApplicationError(past_budget, type="PlacementRefused", non_retryable=True)
            if job is None:
                job = PoolJob(**req.model_dump(exclude={"run_id"}))
                self._status.jobs.append(job)
                refused = await self._decide(job)
                if refused is not None:
                    self._status.jobs.remove(job)
                    raise ApplicationError(refused, type="PlacementRefused", non_retryable=True)
                if (
                    job.placement is None
                    and self._status.config.auto_move
                    and workflow.patched(POOL_MOVES_FOR_QUEUE)
                ):
                    await self._weigh_a_move()  # a move may make room for it
            return PlaceAnswer(placement=job.placement, queued_because=job.queued_because)

    @place.validator
    def _check_place(self, *raw: Any) -> None:
        parse_message(PlaceRequest, raw, PoolUpdate.PLACE)

    @workflow.update(
        name=PoolUpdate.READY,
        description="Answers once the pool holds its groups (create_pool waits for it).",
    )
    async def ready(self) -> None:
        """Answers once the pool holds its groups (``create_pool`` waits for it)."""
        await workflow.wait_condition(lambda: self._claimed)

    @workflow.signal(
        name=PoolSignal.JOB_ENDED,
        description="A job of the pool ended (JobEnded: job_id, outcome): the queue is tried "
        "again, then a move of a placed job is weighed.",
    )
    async def job_ended(self, *raw: Any) -> None:
        """A job of the pool ended (completed, stopped or failed): its groups have room, so the
        queue is tried again, in arrival order, and then a move of a placed job is weighed."""
        ended = _read_signal(JobEnded, raw, PoolSignal.JOB_ENDED)
        if ended is None:
            return
        async with self._lock:
            if ended.run_id is not None:
                self._status.ended_runs.append(ended.run_id)
                del self._status.ended_runs[:-ENDED_RUNS_KEPT]
            job = self._job(ended.job_id)
            if job is None:
                return
            self._status.jobs.remove(job)
            self._note(ended.job_id, f"{ended.job_id} {ended.outcome}: its groups are free")
            await self._try_queue()
            if self._status.config.auto_move:
                await self._weigh_a_move()

    @workflow.signal(
        name=PoolSignal.JOB_MOVED,
        description="A job took the move the pool ordered (JobMoved: job_id, placement, "
        "epoch): the group it left has room for the queue.",
    )
    async def job_moved(self, *raw: Any) -> None:
        """A job took the move the pool ordered: the group it left has room for the queue."""
        moved = _read_signal(JobMoved, raw, PoolSignal.JOB_MOVED)
        if moved is None:
            return
        async with self._lock:
            job = self._job(moved.job_id)
            if job is None:
                return
            left = job.moving_from
            job.placement, job.moving_from = moved.placement, None
            if left is None or left == moved.placement:
                return  # the order kept it where it was: nothing freed
            job.moves += 1
            self._note(
                job.job_id,
                f"{job.job_id} moved from {_on(left)} to {_on(moved.placement)} at epoch "
                f"{moved.epoch}",
            )
            await self._try_queue()

    @workflow.signal(
        name=PoolSignal.JOB_PROFILED,
        description="A job sends the profile it measured (JobProfiled: job_id, profile), once if "
        "it was placed without one and again when it drifted: a move of it, or onto its group, "
        "is weighed.",
    )
    async def job_profiled(self, *raw: Any) -> None:
        """A job measured its profile (placed without one, or its profile drifted from what the
        pool knew): its demand is known from now on, so a move of it (or onto its group, or
        one that brings its group back within the bound) is weighed."""
        profiled = _read_signal(JobProfiled, raw, PoolSignal.JOB_PROFILED)
        if profiled is None:
            return
        async with self._lock:
            job = self._job(profiled.job_id)
            if job is None:
                return
            if job.profile is None:
                note = f"{job.job_id} measured its profile"
            elif workflow.patched(POOL_PROFILE_DRIFT):
                note = f"{job.job_id}'s profile drifted: {_drift(job.profile, profiled.profile)}"
            else:  # a pool from before drift kept the first profile a job sent
                return
            past_budget = profiles_past_budget(self._status.jobs, profiled.profile, job)
            if past_budget is not None and workflow.patched(POOL_PROFILE_BUDGET):
                self._note(job.job_id, f"{note}, not kept: {past_budget}")
                return
            job.profile, job.demand = profiled.profile, None  # its demand comes back below
            self._note(job.job_id, note)
            # Its demand comes back with the weighing, moves on or off.
            await self._weigh_a_move(order=self._status.config.auto_move)
            if workflow.patched(POOL_QUEUE_AFTER_PROFILE):
                await self._try_queue()

    @workflow.update(
        name=PoolUpdate.MOVE,
        description="Move a placed job to another group of the pool by hand (MoveRequest: "
        "job_id, sampler_group): it moves at its next checkpoint boundary.",
    )
    async def move(self, *raw: Any) -> Decision:
        """Move a placed job to another of the pool's groups by hand (``timeslice pool move``):
        the job takes it at its next checkpoint boundary. Refused, saying why, for a job the
        pool has not placed or a group not in the pool."""
        req = parse_message(MoveRequest, raw, PoolUpdate.MOVE)
        async with self._lock:
            job = self._job(req.job_id)
            to = Placement(
                sampler_group=req.sampler_group,
                trainer_group=req.trainer_group or req.sampler_group,
            )
            refused = self._move_refused(job, to)
            if refused is not None:
                raise ApplicationError(refused, type="MoveRefused", non_retryable=True)
            assert job is not None
            await self._order_move(job, to, f"moved {job.job_id} to {_on(to)} by hand")
            return self._status.decisions[-1]

    @move.validator
    def _check_move(self, *raw: Any) -> None:
        parse_message(MoveRequest, raw, PoolUpdate.MOVE)

    def _move_refused(self, job: PoolJob | None, to: Placement) -> str | None:
        names = {g.name for g in self._status.config.groups}
        pool = self._status.config.pool
        if job is None or job.placement is None:
            return f"pool {pool} has placed no job of that id: `timeslice pool status {pool}`"
        if job.mode != "sync":
            if not workflow.patched(POOL_ASYNC_MOVES):
                return f"job {job.job_id} is async: the pool does not move async jobs yet"
            if to.sampler_group == to.trainer_group:
                return (
                    f"job {job.job_id} is async: give its sampler and its trainer two groups "
                    "(--trainer-group)"
                )
        elif to.sampler_group != to.trainer_group:
            return f"job {job.job_id} is sync: it runs on one group"
        for group in sorted({to.sampler_group, to.trainer_group}):
            if group not in names:
                return f"group {group!r} is not in pool {pool} ({', '.join(sorted(names))})"
        if to == job.placement:
            return f"job {job.job_id} is on {_on(to)} already"
        return None

    async def _order_move(self, job: PoolJob, to: Placement, reason: str) -> None:
        """Tell ``job`` to move to ``to`` at its next checkpoint boundary; the pool counts it
        there from now on (its predictions), and as moving until the job says it moved."""
        config = self._status.config
        order = MoveOrder(
            pool=config.pool,
            sampler_group=to.sampler_group,
            trainer_group=to.trainer_group,
            reason=reason[:MAX_REASON_CHARS],
            epochs_apart=config.move_every_epochs,
        )
        job.moving_from = job.moving_from or job.placement
        job.placement = to
        self._note(job.job_id, reason)
        try:
            await workflow.get_external_workflow_handle(rl_job_workflow_id(job.job_id)).signal(
                JobSignal.MOVE, order
            )
        except FailureError as err:  # the job ended meanwhile: its job_ended says so
            workflow.logger.warning("job %s was not told to move: %s", job.job_id, err)

    async def _weigh_a_move(self, *, order: bool = True) -> None:
        """Ask the move activity whether one placed job should move now, and order it (with
        ``order``); either way, learn the demand of jobs whose profile just came."""
        config = self._status.config
        placed = [j for j in self._status.jobs if j.placement is not None]
        movable = [
            j.job_id
            for j in placed
            if j.profile is not None
            and j.moving_from is None
            and (j.mode == "sync" or workflow.patched(POOL_ASYNC_MOVES))
        ]
        can_move = order and bool(movable) and len(config.groups) > 1
        if not can_move and not any(j.profile is not None and j.demand is None for j in placed):
            return
        if not workflow.patched(POOL_MOVES):  # a pool's history from before moves replays
            return
        queued: list[PoolJob] = []
        # While a move is under way, the room it makes is the queue's already.
        if can_move and not any(j.moving_from for j in placed):
            waiting = [j for j in self._status.jobs if j.placement is None]
            if waiting and workflow.patched(POOL_MOVES_FOR_QUEUE):
                queued = admission_queue(waiting, placed, config)
        try:
            outcome = await workflow.execute_activity(
                MOVE_DECISION_ACTIVITY,
                MoveInput(
                    groups=config.groups,
                    max_slowdown=config.max_slowdown,
                    placed=placed,
                    movable=movable if can_move else [],
                    horizon_s=config.move_horizon_s,
                    queued=queued,
                    tenants=config.tenants,
                ),
                result_type=MoveOutcome,
                start_to_close_timeout=_ACTIVITY_TIMEOUT,
                summary="weigh a move",
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:
            workflow.logger.warning("pool %s weighed no move: %s", config.pool, _refusal(err))
            return
        for placed_job in self._status.jobs:
            placed_job.demand = outcome.demands.get(placed_job.job_id, placed_job.demand)
        job = self._job(outcome.job_id) if outcome.job_id else None
        if job is None or outcome.placement is None:
            # Not a decision the status lists: one is weighed at every job's end.
            workflow.logger.info("pool %s: %s", config.pool, outcome.reason)
            return
        await self._order_move(job, outcome.placement, outcome.reason)

    async def _try_queue(self) -> None:
        """Try each queued job once, the tenant holding the least demand per weight first
        (``admission_order``), so a tenant's jobs do not crowd another's out of freed room."""
        waiting = [j for j in self._status.jobs if j.placement is None]
        while waiting:
            placed = [j for j in self._status.jobs if j.placement is not None]
            job = admission_order(waiting, placed, self._status.config)
            waiting.remove(job)
            await self._decide(job)

    @workflow.query(
        name=PoolQuery.STATUS,
        description="The pool's config, its jobs (placed, moving, queued with why) and its "
        "last decisions.",
    )
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
                    tenants=config.tenants,
                ),
                result_type=PlaceOutcome,
                start_to_close_timeout=_ACTIVITY_TIMEOUT,
                retry_policy=RetryPolicy(
                    non_retryable_error_types=["InvalidProfile", "QuotaBelowDemand"]
                ),
                summary=f"place {job.job_id}",
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
        if workflow.patched(POOL_DECISION_EVENTS):
            # An event on the pool's timeline (Workflow Properties Modified), its memo the
            # decision: the Web UI lists each decision where it was taken.
            workflow.upsert_memo({"decision": reason, "job": job_id})

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

    @workflow.query(name=PoolQuery.OWNER, description="The pool that holds this group.")
    def owner(self) -> str:
        return self._pool
