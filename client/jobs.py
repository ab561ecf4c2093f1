"""Start, follow and stop RL jobs from Python (what ``timeslice job start`` does).

from timeslice.jobs import RLJobConfig, start_rl_job
handle = await start_rl_job(client, RLJobConfig(job_id="j1", workload="grpo-toy",
                                                sampler_group="g0", epochs=30))
result = await handle.result()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from timeslice.errors import InvalidArgumentError
from timeslice.pools import pool_status
from timeslice.protocol.async_rl_job import (
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    AsyncRLJobConfig,
    AsyncRLJobProgress,
    AsyncRLJobResult,
    started_config,
)
from timeslice.protocol.group import CONTROL_TASK_QUEUE, JOB_KEY, job_task_queue
from timeslice.protocol.pool import DEFAULT_TENANT, PoolJob
from timeslice.protocol.rl_job import (
    RL_JOB_WORKFLOW_TYPE,
    JobQuery,
    RLJobConfig,
    RLJobProgress,
    RLJobResult,
    explain_validation_error,
    rl_job_workflow_id,
)
from timeslice.transport.connection import pollers
from timeslice.workloads.options import check_workload_options

# A progress line unchanged for this long is shown again, so a follower is never silent.
SILENCE_S = 10.0
# A progress query that takes longer than this is taken as unanswered (and why is looked for).
QUERY_TIMEOUT = timedelta(seconds=5)
WAITING_FOR_PROCESSES = "waiting for job processes"
P = TypeVar("P")
Res = TypeVar("Res")


JOB_MODES = ("sync", "async")
ASYNC_ONLY_FIELDS = {"max_staleness", "sync_every"}


def parse_job_config(data: dict[str, Any]) -> RLJobConfig:
    """A sync job's config, checked.

    Args:
        data: The config as JSON data (``timeslice job start --config``); ``"mode": "sync"``
            may be given.

    Returns:
        The ``RLJobConfig``.

    Raises:
        InvalidArgumentError: A field is missing or malformed (each bad field named), or an
            async job's setting (``max_staleness``, ``sync_every``) is set.
    """
    if data.get("mode") == "sync":
        data = {k: v for k, v in data.items() if k != "mode"}
    async_only = sorted(ASYNC_ONLY_FIELDS & set(data))
    if async_only:
        raise InvalidArgumentError(
            f"invalid job config: {', '.join(async_only)} set for a sync job; they are "
            'settings of async jobs: add "mode": "async" (`timeslice job start --mode async`)'
        )
    try:
        config = RLJobConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(f"invalid job config: {explain_validation_error(err)}") from err
    check_options(config)
    return config


def parse_async_job_config(data: dict[str, Any]) -> AsyncRLJobConfig:
    """An async job's config, checked.

    Args:
        data: The config as JSON data, with ``"mode": "async"``.

    Returns:
        The ``AsyncRLJobConfig``.

    Raises:
        InvalidArgumentError: A field is missing or malformed, or a rule between fields is
            broken; each is named.
    """
    try:
        config = AsyncRLJobConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(
            f"invalid async job config: {explain_validation_error(err)}"
        ) from err
    check_options(config)
    return config


def check_options(config: RLJobConfig) -> None:
    """Refuse the job's ``workload_options`` before anything starts, as its built-in workload
    would (an unknown option with the closest known name, a wrong type, a value out of
    range); a workload of your own (``MODULE:FACTORY``) is left to its process.

    Args:
        config: The job's config.

    Raises:
        InvalidArgumentError: An option the workload refuses.
    """
    try:
        check_workload_options(config.workload, config.workload_options)
    except ValueError as err:
        raise InvalidArgumentError(f"invalid job config: workload_options: {err}") from None


def parse_any_job_config(data: dict[str, Any]) -> RLJobConfig:
    """The config of a job of either mode, by its ``mode`` field.

    Args:
        data: The config as JSON data; ``mode`` is ``sync`` (the default) or ``async``.

    Returns:
        An ``AsyncRLJobConfig`` for an async job, else an ``RLJobConfig``.

    Raises:
        InvalidArgumentError: An unknown mode, or a config its mode refuses.
    """
    mode = data.get("mode", "sync")
    if mode not in JOB_MODES:
        raise InvalidArgumentError(f"invalid job config: mode must be sync or async, not {mode!r}")
    return parse_async_job_config(data) if mode == "async" else parse_job_config(data)


async def start_any_rl_job(client: Client, config: RLJobConfig) -> WorkflowHandle[Any, Any]:
    """Start the job's workflow: ``AsyncRLJobWorkflow`` for an async config, else
    ``RLJobWorkflow``.

    Args:
        client: A Temporal client (``timeslice.transport.connection.connect``).
        config: The job's config (``parse_any_job_config``).

    Returns:
        The workflow's handle.

    Raises:
        InvalidArgumentError: A workload option its workload refuses, or the job id was used
            already (its run is going on, or ended).
    """
    if isinstance(config, AsyncRLJobConfig):
        return await start_async_rl_job(client, config)
    return await start_rl_job(client, config)


async def start_async_rl_job(
    client: Client, config: AsyncRLJobConfig
) -> WorkflowHandle[Any, AsyncRLJobResult]:
    """Start ``AsyncRLJobWorkflow`` for ``config`` (id ``rl-job-<job_id>``, as a sync job's).

    Args:
        client: A Temporal client (``timeslice.transport.connection.connect``).
        config: The async job's config.

    Returns:
        The workflow's handle; its result is an ``AsyncRLJobResult``.

    Raises:
        InvalidArgumentError: A workload option its workload refuses, or the job id was used
            already (its run is going on, or ended).
    """
    return await _start_job(
        client,
        config,
        ASYNC_RL_JOB_WORKFLOW_TYPE,
        AsyncRLJobResult,
        summary=f"async RL job {config.job_id}: {config.workload}, {config.epochs} steps, "
        + (
            f"placed by pool {config.pool}"
            if config.sampler_group is None
            else f"sample on {config.sampler_group}, train on {config.trainer}"
        ),
        length=f"**steps**: {config.epochs} · max staleness {config.max_staleness} · "
        f"sync every {config.sync_every}",
    )


async def start_rl_job(client: Client, config: RLJobConfig) -> WorkflowHandle[Any, RLJobResult]:
    """Start ``RLJobWorkflow`` for ``config`` (id ``rl-job-<job_id>``, task queue ``timeslice``).

    Args:
        client: A Temporal client (``timeslice.transport.connection.connect``).
        config: The job's config.

    Returns:
        The workflow's handle; its result is an ``RLJobResult``.

    Raises:
        InvalidArgumentError: A workload option its workload refuses, or the job id was used
            already (its run is going on, or ended).
    """
    groups = (
        f"pool {config.pool}"
        if config.sampler_group is None
        else ", ".join(dict.fromkeys([config.sampler_group, config.trainer]))
    )
    return await _start_job(
        client,
        config,
        RL_JOB_WORKFLOW_TYPE,
        RLJobResult,
        summary=f"RL job {config.job_id}: {config.workload}, {config.epochs} epochs on {groups}",
        length=f"**epochs**: {config.epochs}",
    )


async def _start_job(
    client: Client,
    config: RLJobConfig,
    workflow_type: str,
    result_type: type[Res],
    *,
    summary: str,
    length: str,
) -> WorkflowHandle[Any, Res]:
    """Start a job's workflow of ``workflow_type``, its workload options checked first;
    ``summary`` and ``length`` (how long it runs, in the mode's terms) are what the Web UI shows
    of it."""
    check_options(config)
    await _check_pool(client, config)
    try:
        return await client.start_workflow(
            workflow_type,
            config.model_dump(mode="json"),
            id=rl_job_workflow_id(config.job_id),
            task_queue=CONTROL_TASK_QUEUE,
            # A job id names one run: its processes hold that run's model (see job_runtime).
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            result_type=result_type,
            search_attributes=TypedSearchAttributes([SearchAttributePair(JOB_KEY, config.job_id)]),
            static_summary=summary,
            static_details=(
                f"**workload**: {config.workload}\n\n**sampler group**: "
                f"{config.sampler_group or '(its pool places it)'}\n\n**trainer group**: "
                f"{config.trainer or '(its pool places it)'}\n\n{length} · "
                f"batch {config.batch_size}, group size {config.group_size} · seed {config.seed}"
            ),
        )
    except WorkflowAlreadyStartedError as err:
        raise InvalidArgumentError(await _used_id_message(client, config.job_id)) from err


async def _check_pool(client: Client, config: RLJobConfig) -> None:
    """A job started with a pool: the pool runs, the job names no groups of its own, and a job
    without a profile (it counts a whole group for each group it uses) fits its tenant's quota."""
    if config.pool is None:
        return
    if config.sampler_group is not None:
        raise InvalidArgumentError(
            f"job {config.job_id}: give a pool or groups (sampler_group, trainer_group), not both"
        )
    status = await pool_status(client, config.pool)
    limits = status.config.limits(config.tenant)
    if config.profile is None and limits.quota is not None:
        mode = "async" if isinstance(config, AsyncRLJobConfig) else "sync"
        need = PoolJob(job_id=config.job_id, mode=mode).charged()
        if need > limits.quota:
            tenant = config.tenant or DEFAULT_TENANT
            raise InvalidArgumentError(
                f"job {config.job_id}: without a profile it counts {need:g} groups' worth "
                f"against tenant {tenant}'s whole quota {limits.quota:g}, so pool "
                f"{config.pool} could never place it: declare its profile (--job-profile) or "
                "raise the quota; nothing started"
            )


async def _used_id_message(client: Client, job_id: str) -> str:
    workflow_id = rl_job_workflow_id(job_id)
    try:
        described = await client.get_workflow_handle(workflow_id).describe()
    except Exception:  # the message stands without the details
        described = None
    if described is None or described.status == WorkflowExecutionStatus.RUNNING:
        return (
            f"job {job_id!r} is already running (workflow {workflow_id}): follow it with "
            f"`timeslice job progress {job_id}`, stop it with `timeslice job stop {job_id}`, "
            "or start another job under a new --job-id"
        )
    status = described.status.name.lower() if described.status else "closed"
    ended = f" at {described.close_time:%Y-%m-%d %H:%M:%S} UTC" if described.close_time else ""
    return (
        f"job {job_id!r} already ran (workflow {workflow_id} {status}{ended}); a job id names "
        f"one run of a job: start a new run under a new --job-id, with its own "
        f"`timeslice job worker --job-id NEW_ID`"
    )


def job_failure(status: WorkflowExecutionStatus | None) -> str | None:
    """How a job's workflow ended badly, in words for a message.

    Args:
        status: The workflow's status (``describe().status``); None: not known.

    Returns:
        ``"failed"``, ``"was terminated"``, ``"was cancelled"``, ``"timed out"`` (or
        ``"ended <status>"``); None if it runs, completed or continued as new.
    """
    if status in (
        None,
        WorkflowExecutionStatus.RUNNING,
        WorkflowExecutionStatus.COMPLETED,
        WorkflowExecutionStatus.CONTINUED_AS_NEW,
    ):
        return None
    return {
        WorkflowExecutionStatus.FAILED: "failed",
        WorkflowExecutionStatus.TERMINATED: "was terminated",
        WorkflowExecutionStatus.CANCELED: "was cancelled",
        WorkflowExecutionStatus.TIMED_OUT: "timed out",
    }.get(status, f"ended {status.name.lower()}")


async def read_job_config(client: Client, job_id: str) -> RLJobConfig:
    """The config of a job's latest run, from that run's start input.

    Args:
        client: A connected client.
        job_id: The job.

    Returns:
        Its config (an ``AsyncRLJobConfig`` for an async job).

    Raises:
        InvalidArgumentError: The run's input is no job config (it failed at once).
        RPCError: No such job (``NOT_FOUND``), or Temporal refused the call.
    """
    handle = client.get_workflow_handle(rl_job_workflow_id(job_id))
    described = await handle.describe()
    run = client.get_workflow_handle(handle.id, run_id=described.run_id)
    async for event in run.fetch_history_events(page_size=1):
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        try:
            (raw,) = await client.data_converter.decode(payloads, [Any])
            is_async = described.workflow_type == ASYNC_RL_JOB_WORKFLOW_TYPE
            return started_config(raw, async_job=is_async)
        except (ValueError, RuntimeError) as err:
            raise InvalidArgumentError(f"job {job_id}: its start input is no job config") from err
    raise InvalidArgumentError(f"job {job_id}: its run has no history")


def no_control_worker(client: Client, flags: str = "") -> str:
    """What to say when no control worker polls: the task queue, where, and the command.

    Args:
        client: The client that found none (its namespace is named).
        flags: Connection flags to add to the command (``--address ...``), if any.

    Returns:
        The message, ending with the command that starts one.
    """
    return (
        f"no control worker serves task queue {CONTROL_TASK_QUEUE!r} (namespace "
        f"{client.namespace!r}): nothing runs the job's workflow until one does; start one "
        f"with `timeslice worker{flags}`"
    )


async def missing_job_processes(client: Client, config: RLJobConfig, flags: str = "") -> list[str]:
    """Each rank of the job whose task queue no job process polls, said with the command that
    starts one (Temporal's list of the queue's pollers: said at once, no time-out waited for).

    Args:
        client: A connected client.
        config: The job's config (its id, workload and ranks).
        flags: Connection flags to add to the command (``--address ...``), if any.

    Returns:
        One line per missing rank; empty when every rank has a process.

    Raises:
        temporalio.service.RPCError: Temporal did not answer.
    """
    lines = []
    for rank in range(config.ranks):
        queue = job_task_queue(config.job_id, rank)
        if await pollers(client, queue, activities=True):
            continue
        rank_flag = f" --rank {rank}" if config.ranks > 1 else ""
        lines.append(
            f"no job process serves job {config.job_id}{f' rank {rank}' if rank_flag else ''} "
            f"(nothing polls task queue {queue!r}): start one with `timeslice job worker "
            f"--job-id {config.job_id}{rank_flag} --workload {config.workload}{flags}`"
        )
    return lines


async def why_waiting(
    client: Client, job_id: str, config: RLJobConfig | None = None, flags: str = ""
) -> list[str]:
    """What a running job lacks to make progress: the control worker, or a job process.

    Args:
        client: A connected client.
        job_id: The job.
        config: Its config if known (else read from its history when needed).
        flags: Connection flags for the commands said.

    Returns:
        A line per missing piece, each with the command that starts it; empty if none.

    Raises:
        InvalidArgumentError: The job's start input is no job config.
        temporalio.service.RPCError: No such job (``NOT_FOUND``), or Temporal did not answer.
    """
    if not await pollers(client, CONTROL_TASK_QUEUE):
        return [no_control_worker(client, flags)]
    config = config or await read_job_config(client, job_id)
    return await missing_job_processes(client, config, flags)


def describe_progress(p: RLJobProgress) -> str:
    """One line of a sync job's progress, as ``follow_job`` and ``timeslice job progress``
    show it.

    Args:
        p: The job's progress (its ``progress`` query).

    Returns:
        ``[job] epoch E/N · phase · reward R`` (and the rewinds, if any).
    """
    reward = "-" if p.reward_mean is None else f"{p.reward_mean:.3f}"
    extra = f" · rewinds {p.rewinds}" if p.rewinds else ""
    return f"[{p.job_id}] epoch {p.epoch}/{p.epochs} · {p.phase} · reward {reward}{extra}"


async def follow_job(
    client: Client,
    job_id: str,
    show: Callable[[str], None] = print,
    *,
    poll_s: float = 1.0,
    config: RLJobConfig | None = None,
    flags: str = "",
) -> RLJobResult:
    """Show progress lines until the job ends (never silent for long), then return its result.

    Follows the job across its continue-as-new runs; a line that has not changed is shown
    again every ``SILENCE_S`` seconds, marked "(still)". A missing control worker or job
    process is said within seconds, with the command that starts it.

    Args:
        client: A Temporal client (``timeslice.transport.connection.connect``).
        job_id: The job's id.
        show: Where each line goes.
        poll_s: How often the job's progress is asked for.
        config: The job's config, if known (else read from its history when needed).
        flags: Connection flags to add to the commands said (``--address ...``).

    Returns:
        The job's ``RLJobResult``.

    Raises:
        temporalio.client.WorkflowFailureError: The job's workflow failed (or was cancelled or
            terminated).
        temporalio.service.RPCError: No such job (``NOT_FOUND``), or Temporal did not answer.
    """
    return await _follow(
        client, job_id, show, poll_s, RLJobProgress, RLJobResult, describe_progress, config, flags
    )


def describe_async_progress(p: AsyncRLJobProgress) -> str:
    """One line of an async job's progress, as ``follow_async_job`` shows it.

    Args:
        p: The job's progress (its ``progress`` query).

    Returns:
        ``[job] step S/N · trainer: phase · sampler: phase · weights vW · queued Q · reward R``
        (and the rewinds, if any).
    """
    reward = "-" if p.reward_mean is None else f"{p.reward_mean:.3f}"
    extra = f" · rewinds {p.rewinds}" if p.rewinds else ""
    return (
        f"[{p.job_id}] step {p.epoch}/{p.epochs} · trainer: {p.phase} · sampler: "
        f"{p.sampler_phase} · weights v{p.published} · queued {p.queued} · reward {reward}{extra}"
    )


async def follow_async_job(
    client: Client,
    job_id: str,
    show: Callable[[str], None] = print,
    *,
    poll_s: float = 1.0,
    config: RLJobConfig | None = None,
    flags: str = "",
) -> AsyncRLJobResult:
    """``follow_job`` for an async job, whose lines say the step, both roles' phases, the
    weights' version and the queue (``describe_async_progress``).

    Args:
        client, job_id, show, poll_s, config, flags: As for ``follow_job``.

    Returns:
        The job's ``AsyncRLJobResult``.

    Raises:
        As ``follow_job``: ``WorkflowFailureError`` when the job's workflow failed, was
        cancelled or terminated; ``RPCError`` when there is no such job or Temporal did not
        answer.
    """
    return await _follow(
        client,
        job_id,
        show,
        poll_s,
        AsyncRLJobProgress,
        AsyncRLJobResult,
        describe_async_progress,
        config,
        flags,
    )


async def _follow(
    client: Client,
    job_id: str,
    show: Callable[[str], None],
    poll_s: float,
    progress_type: type[P],
    result_type: type[Res],
    describe: Callable[[P], str],
    config: RLJobConfig | None,
    flags: str,
) -> Res:
    # No run id: follow the job across its continue-as-new runs.
    handle = client.get_workflow_handle(rl_job_workflow_id(job_id), result_type=result_type)
    last_line, last_shown = "", time.monotonic()
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        progress = None
        missing: list[str] = []
        if not await pollers(client, CONTROL_TASK_QUEUE):
            missing = [no_control_worker(client, flags)]  # a query would wait in silence
        else:
            try:
                progress = await handle.query(
                    JobQuery.PROGRESS, result_type=progress_type, rpc_timeout=QUERY_TIMEOUT
                )
            except Exception:  # the run may be between continue-as-new and its first task
                progress = None
            if progress is not None and str(getattr(progress, "phase", "")).startswith(
                WAITING_FOR_PROCESSES
            ):
                config = config or await read_job_config(client, job_id)
                missing = await missing_job_processes(client, config, flags)
        line = "\n".join([*([describe(progress)] if progress else []), *missing])
        now = time.monotonic()
        if line and (line != last_line or now - last_shown > SILENCE_S):
            show(line if line != last_line else f"{line} (still)")
            last_line, last_shown = line, now
        await asyncio.sleep(poll_s)  # a display refresh, not a synchronisation
    return await handle.result()
