"""A job started with ``pool``: it asks its pool for groups before its first lease, takes the
moves its pool orders at checkpoint boundaries, and tells the pool when it moved and when it
ends (docs/pools.md). Only such a job runs any of this, so a job without a pool emits the
commands it always did; the new ones are behind ``POOL_PLACEMENT`` and ``POOL_MOVES`` all the
same."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    FailureError,
    is_cancelled_exception,
)
from timeslice.protocol.async_rl_job import AsyncRLJobConfig
from timeslice.protocol.group import MalformedMessage, parse_message
from timeslice.protocol.pool import (
    DRIFT_EPOCHS,
    MEASURED_EPOCHS,
    REQUEST_PLACEMENT_ACTIVITY,
    JobEnded,
    JobMove,
    JobMoved,
    JobProfiled,
    MoveOrder,
    Placement,
    PlacementCall,
    PlaceRequest,
    PoolSignal,
    pool_workflow_id,
    profile_drift,
    profile_seconds,
)
from timeslice.protocol.rl_job import EpochRecord, JobSignal, RLJobConfig, RLJobState

# workflow.patched id of a job's placement by its pool.
POOL_PLACEMENT = "pool-placement"
# workflow.patched id of a move the job took (only a job given a move order runs it).
POOL_MOVES = "pool-moves"
# workflow.patched id: a job whose pool knows its profile sends a new one when it drifted.
POOL_PROFILE_DRIFT = "pool-profile-drift"
# workflow.patched id: an async job measures its profile (and its drift) as a sync job does.
POOL_ASYNC_PROFILES = "pool-async-profiles"

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
        tenant=config.tenant,
        run_id=workflow.info().first_execution_run_id,
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


def read_move_order(config: RLJobConfig, raw: tuple[Any, ...]) -> MoveOrder | None:
    """The move order in a ``move`` signal, if this job may take it: a sync job started with
    that pool. Anything else is dropped with a warning (a signal handler that raised would
    fail the workflow task)."""
    try:
        order = parse_message(MoveOrder, raw, JobSignal.MOVE)
    except MalformedMessage as err:
        workflow.logger.warning("job %s dropped a malformed move: %s", config.job_id, err)
        return None
    why = None
    if config.pool != order.pool:
        why = f"it was started with pool {config.pool!r}, not {order.pool!r}"
    elif isinstance(config, AsyncRLJobConfig):
        if order.sampler_group == order.trainer_group:
            why = "an async job runs its sampler and its trainer on two groups"
    elif order.sampler_group != order.trainer_group:
        why = "a sync job runs on one group"
    if why is not None:
        workflow.logger.warning("job %s dropped a move to %s: %s", config.job_id, order, why)
        return None
    return order


def move_boundary(config: RLJobConfig, state: RLJobState) -> int | None:
    """The step an async job's loops stop at to take its pending move (None: no move
    pending): its next checkpoint after the step in hand, and no sooner than the order's
    ``epochs_apart`` after its last move. Its sampler admits no batch past it, so its
    pipeline drains there (batches sampled past it are dropped, counted)."""
    order = state.pending_move
    if order is None:
        return None
    every = config.checkpoint_every
    earliest = state.epochs_done + 1
    if state.moves:
        earliest = max(earliest, state.moves[-1].epoch + order.epochs_apart)
    boundary = -(-earliest // every) * every  # the first multiple of every at or past it
    return min(boundary, config.epochs)


def move_due(state: RLJobState) -> bool:
    """Whether the job takes its pending move now: it stands at its last checkpoint (every
    epoch done is saved, so the new groups start from exactly where it is) and it last moved
    at least the order's ``epochs_apart`` epochs ago."""
    order = state.pending_move
    if order is None or state.last_checkpoint is None:
        return False
    if state.last_checkpoint.epochs_done != state.epochs_done:
        return False
    last = state.moves[-1].epoch if state.moves else None
    return last is None or state.epochs_done - last >= order.epochs_apart


async def take_move(config: C, state: RLJobState, release_all: Callable[[], Awaitable[None]]) -> C:
    """Take ``state.pending_move``: every lease handed back, the job's next preparation on
    the new groups, the move kept in its state and told to its pool. Returns the new config."""
    order = state.pending_move
    assert order is not None and config.pool is not None
    workflow.patched(POOL_MOVES)
    await release_all()
    before = Placement(sampler_group=config.sampler_group or "", trainer_group=config.trainer)
    after = Placement(sampler_group=order.sampler_group, trainer_group=order.trainer_group)
    state.pending_move = None
    if after != before:
        state.prepared = False
        state.moved(
            JobMove(epoch=state.epochs_done, moved_from=before, moved_to=after, reason=order.reason)
        )
        workflow.logger.info(
            "job %s moves from %s to %s at epoch %d: %s",
            config.job_id,
            before.sampler_group,
            after.sampler_group,
            state.epochs_done,
            order.reason,
        )
    # Told even when the order kept it where it was (a later order replaced an earlier one):
    # the pool stops counting it as moving.
    await _signal_pool(
        config,
        PoolSignal.JOB_MOVED,
        JobMoved(job_id=config.job_id, placement=after, epoch=state.epochs_done),
        "told it moved",
    )
    return config.model_copy(
        update={"sampler_group": after.sampler_group, "trainer_group": after.trainer_group}
    )


def profile_due(config: RLJobConfig, state: RLJobState) -> bool:
    """Whether a job its pool placed without a profile sends the one it measured now: once,
    after ``MEASURED_EPOCHS`` epochs past its first (which holds its start-up)."""
    return (
        config.pool is not None
        and config.profile is None
        and not state.profile_sent
        and state.epochs_done >= 1 + MEASURED_EPOCHS
    )


def measured_profile(
    config: RLJobConfig,
    state: RLJobState,
    backends: dict[str, list[str]],
    records: list[EpochRecord] | None = None,
    *,
    median: bool = False,
) -> dict[str, Any]:
    """The job's profile (plan/profile.py's JobProfile as JSON, without its job_id) from
    ``records`` (default: every record since its first epoch): each phase's mean seconds (with
    ``median``, the median: one slow epoch, a rewind's, does not move it), its states' bytes."""
    if records is None:
        records = [r for r in state.records if r.epoch >= 1]
    phases = []
    for name, gpu, pool in (("sample", True, "sampler"), ("rewards", False, None),
                            ("train", True, "trainer")):  # fmt: skip
        times = [r.phase_s[name] for r in records if name in r.phase_s]
        if not times:
            seconds = 0.0
        elif median:
            ordered, mid = sorted(times), len(times) // 2
            seconds = ordered[mid] if len(times) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        else:
            seconds = sum(times) / len(times)
        phase: dict[str, Any] = {"name": name, "gpu": gpu, "seconds": round(seconds, 4)}
        if pool is not None:
            phase["pool"] = pool
        phases.append(phase)
    # A state both loops use (one backend listed for both groups) is one state that follows
    # the job's lease, pool "both", as the profile collector writes it (plan/collect.py): two
    # of the same name make a profile the planner refuses, and with it every placement after.
    pool_of: dict[str, str] = {}
    for pool in ("sampler", "trainer"):
        for name in backends.get(pool, []):
            pool_of[name] = "both" if pool_of.get(name, pool) != pool else pool
    states = [
        {"name": name, "pool": pool, "bytes": state.backend_bytes.get(name) or 0}
        for name, pool in pool_of.items()
    ]
    profile: dict[str, Any] = {"epochs": config.epochs, "phases": phases, "states": states}
    if isinstance(config, AsyncRLJobConfig):  # its sample and train seconds hold its weight moves
        profile.update(
            mode="async", max_staleness=config.max_staleness, sync_every=config.sync_every
        )
    return profile


async def send_profile(
    config: RLJobConfig, state: RLJobState, backends: dict[str, list[str]]
) -> None:
    """Send the job's pool the profile it measured, so the pool can weigh moving it."""
    assert config.pool is not None
    state.profile_sent = True
    if not workflow.patched(POOL_MOVES):  # a run from before moves replays without it
        return
    await _send_profile(config, state, measured_profile(config, state, backends), "its profile")


def drifted_profile(
    config: RLJobConfig, state: RLJobState, backends: dict[str, list[str]]
) -> dict[str, Any] | None:
    """The profile of the job's last ``DRIFT_EPOCHS`` epochs (medians) if it drifted from the
    one its pool knows (its declared profile, or the last it sent), else None. Only a job
    placed by a pool that knows its profile checks, once ``DRIFT_EPOCHS`` epochs have run since
    it last sent one (its first epoch, which holds its start-up, is never read)."""
    if config.pool is None:
        return None
    known = state.sent_profile_s
    if known is None:
        if state.profile_sent or config.profile is None:
            return None  # not sent yet, or sent by a run from before drift was tracked
        known = profile_seconds(config.profile)
        if known is None:
            return None
    since = max(1, state.sent_profile_at)
    window = [r for r in state.records if r.epoch >= since][-DRIFT_EPOCHS:]
    if len(window) < DRIFT_EPOCHS:
        return None
    profile = measured_profile(config, state, backends, window, median=True)
    measured = profile_seconds(profile)
    if measured is None or profile_drift(known, measured) is None:
        return None
    return profile


async def send_drifted_profile(
    config: RLJobConfig, state: RLJobState, profile: dict[str, Any]
) -> None:
    """Send the job's pool ``profile`` (``drifted_profile``'s), which it then knows."""
    if not workflow.patched(POOL_PROFILE_DRIFT):  # a run from before drift replays without it
        return
    workflow.logger.info("job %s: its profile drifted; sent its pool the new one", config.job_id)
    await _send_profile(config, state, profile, "its drifted profile")


async def _send_profile(
    config: RLJobConfig, state: RLJobState, profile: dict[str, Any], what: str
) -> None:
    """Signal the job's pool ``profile``, and keep what the pool knows of it from now on."""
    state.sent_profile_s = profile_seconds(profile)
    state.sent_profile_at = state.epochs_done
    await _signal_pool(
        config,
        PoolSignal.JOB_PROFILED,
        JobProfiled(job_id=config.job_id, profile=profile),
        f"sent {what}",
    )


async def send_profile_if_due(
    config: RLJobConfig, state: RLJobState, backends: dict[str, list[str]]
) -> None:
    """After an epoch (an async job: a step): send the job's pool its measured profile if it is
    due, or its drifted profile if it drifted. An async job does either only from the
    ``POOL_ASYNC_PROFILES`` patch on (a run from before replays without)."""
    due = profile_due(config, state)
    drifted = None if due else drifted_profile(config, state, backends)
    if not due and drifted is None:
        return
    if isinstance(config, AsyncRLJobConfig) and not workflow.patched(POOL_ASYNC_PROFILES):
        return
    if due:
        await send_profile(config, state, backends)
    elif drifted is not None:
        await send_drifted_profile(config, state, drifted)


async def tell_pool(config: RLJobConfig, outcome: str) -> None:
    """Tell the job's pool it ended (``outcome``: completed, stopped, failed, cancelled), so
    its groups' room goes to the pool's queue. A pool that is gone has nobody to tell."""
    if config.pool is None or not workflow.patched(POOL_PLACEMENT):
        return
    await _signal_pool(
        config,
        PoolSignal.JOB_ENDED,
        JobEnded(
            job_id=config.job_id,
            outcome=outcome,
            run_id=workflow.info().first_execution_run_id,
        ),
        "told it ended",
    )


async def _signal_pool(config: RLJobConfig, signal: PoolSignal, message: Any, what: str) -> None:
    """Signal the job's pool; a pool that is gone (terminated) is logged, not raised."""
    assert config.pool is not None
    try:
        await workflow.get_external_workflow_handle(pool_workflow_id(config.pool)).signal(
            signal, message
        )
    except FailureError as err:
        workflow.logger.warning(
            "job %s: pool %s was not %s: %s", config.job_id, config.pool, what, err
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
