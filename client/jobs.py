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
from timeslice.protocol.async_rl_job import (
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    AsyncRLJobConfig,
    AsyncRLJobProgress,
    AsyncRLJobResult,
)
from timeslice.protocol.group import CONTROL_TASK_QUEUE, JOB_KEY
from timeslice.protocol.rl_job import (
    RL_JOB_WORKFLOW_TYPE,
    JobQuery,
    RLJobConfig,
    RLJobProgress,
    RLJobResult,
    explain_validation_error,
    rl_job_workflow_id,
)

# A progress line unchanged for this long is shown again, so a follower is never silent.
SILENCE_S = 10.0
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
        return RLJobConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(f"invalid job config: {explain_validation_error(err)}") from err


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
        return AsyncRLJobConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(
            f"invalid async job config: {explain_validation_error(err)}"
        ) from err


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
        InvalidArgumentError: The job id was used already (its run is going on, or ended).
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
        InvalidArgumentError: The job id was used already (its run is going on, or ended).
    """
    return await _start_job(
        client,
        config,
        ASYNC_RL_JOB_WORKFLOW_TYPE,
        AsyncRLJobResult,
        summary=f"async RL job {config.job_id}: {config.workload}, {config.epochs} steps, "
        f"sample on {config.sampler_group}, train on {config.trainer}",
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
        InvalidArgumentError: The job id was used already (its run is going on, or ended).
    """
    groups = ", ".join(dict.fromkeys([config.sampler_group, config.trainer]))
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
    """Start a job's workflow of ``workflow_type``; ``summary`` and ``length`` (how long it
    runs, in the mode's terms) are what the Web UI shows of it."""
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
                f"**workload**: {config.workload}\n\n**sampler group**: {config.sampler_group}"
                f"\n\n**trainer group**: {config.trainer}\n\n{length} · "
                f"batch {config.batch_size}, group size {config.group_size} · seed {config.seed}"
            ),
        )
    except WorkflowAlreadyStartedError as err:
        raise InvalidArgumentError(await _used_id_message(client, config.job_id)) from err


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
) -> RLJobResult:
    """Show progress lines until the job ends (never silent for long), then return its result.

    Follows the job across its continue-as-new runs; a line that has not changed is shown
    again every ``SILENCE_S`` seconds, marked "(still)".

    Args:
        client: A Temporal client (``timeslice.transport.connection.connect``).
        job_id: The job's id.
        show: Where each line goes.
        poll_s: How often the job's progress is asked for.

    Returns:
        The job's ``RLJobResult``.

    Raises:
        temporalio.client.WorkflowFailureError: The job's workflow failed (or was cancelled or
            terminated).
        temporalio.service.RPCError: No such job (``NOT_FOUND``), or Temporal did not answer.
    """
    return await _follow(
        client, job_id, show, poll_s, RLJobProgress, RLJobResult, describe_progress
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
) -> AsyncRLJobResult:
    """``follow_job`` for an async job, whose lines say the step, both roles' phases, the
    weights' version and the queue (``describe_async_progress``).

    Args:
        client, job_id, show, poll_s: As for ``follow_job``.

    Returns:
        The job's ``AsyncRLJobResult``.

    Raises:
        As ``follow_job``: ``WorkflowFailureError`` when the job's workflow failed, was
        cancelled or terminated; ``RPCError`` when there is no such job or Temporal did not
        answer.
    """
    return await _follow(
        client, job_id, show, poll_s, AsyncRLJobProgress, AsyncRLJobResult, describe_async_progress
    )


async def _follow(
    client: Client,
    job_id: str,
    show: Callable[[str], None],
    poll_s: float,
    progress_type: type[P],
    result_type: type[Res],
    describe: Callable[[P], str],
) -> Res:
    # No run id: follow the job across its continue-as-new runs.
    handle = client.get_workflow_handle(rl_job_workflow_id(job_id), result_type=result_type)
    last_line, last_shown = "", time.monotonic()
    while (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        try:
            progress = await handle.query(JobQuery.PROGRESS, result_type=progress_type)
        except Exception:  # the run may be between continue-as-new and its first task
            progress = None
        line = describe(progress) if progress else ""
        now = time.monotonic()
        if line and (line != last_line or now - last_shown > SILENCE_S):
            show(line if line != last_line else f"{line} (still)")
            last_line, last_shown = line, now
        await asyncio.sleep(poll_s)  # a display refresh, not a synchronisation
    return await handle.result()
