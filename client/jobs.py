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

SILENCE_S = 10.0


JOB_MODES = ("sync", "async")
ASYNC_ONLY_FIELDS = {"max_staleness", "sync_every"}


def parse_job_config(data: dict[str, Any]) -> RLJobConfig:
    """A sync job's config (``"mode": "sync"`` may be given); InvalidArgumentError naming each
    bad field."""
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
    """An async job's config; InvalidArgumentError naming each bad field or rule."""
    try:
        return AsyncRLJobConfig.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(
            f"invalid async job config: {explain_validation_error(err)}"
        ) from err


def parse_any_job_config(data: dict[str, Any]) -> RLJobConfig:
    """The config of a job of either mode, by its ``mode`` field (default ``sync``)."""
    mode = data.get("mode", "sync")
    if mode not in JOB_MODES:
        raise InvalidArgumentError(f"invalid job config: mode must be sync or async, not {mode!r}")
    return parse_async_job_config(data) if mode == "async" else parse_job_config(data)


async def start_any_rl_job(client: Client, config: RLJobConfig) -> WorkflowHandle[Any, Any]:
    """Start the job's workflow: ``AsyncRLJobWorkflow`` for an async config, else
    ``RLJobWorkflow``."""
    if isinstance(config, AsyncRLJobConfig):
        return await start_async_rl_job(client, config)
    return await start_rl_job(client, config)


async def start_async_rl_job(
    client: Client, config: AsyncRLJobConfig
) -> WorkflowHandle[Any, AsyncRLJobResult]:
    """Start ``AsyncRLJobWorkflow`` for ``config`` (id ``rl-job-<job_id>``, as a sync job's)."""
    try:
        return await client.start_workflow(
            ASYNC_RL_JOB_WORKFLOW_TYPE,
            config.model_dump(mode="json"),
            id=rl_job_workflow_id(config.job_id),
            task_queue=CONTROL_TASK_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            result_type=AsyncRLJobResult,
            search_attributes=TypedSearchAttributes([SearchAttributePair(JOB_KEY, config.job_id)]),
            static_summary=f"async RL job {config.job_id}: {config.workload}, "
            f"{config.epochs} steps, sample on {config.sampler_group}, train on {config.trainer}",
            static_details=(
                f"**workload**: {config.workload}\n\n**sampler group**: {config.sampler_group}"
                f"\n\n**trainer group**: {config.trainer}\n\n**steps**: {config.epochs} · "
                f"max staleness {config.max_staleness} · sync every {config.sync_every} · "
                f"batch {config.batch_size}, group size {config.group_size} · seed {config.seed}"
            ),
        )
    except WorkflowAlreadyStartedError as err:
        raise InvalidArgumentError(await _used_id_message(client, config.job_id)) from err


async def start_rl_job(client: Client, config: RLJobConfig) -> WorkflowHandle[Any, RLJobResult]:
    """Start ``RLJobWorkflow`` for ``config`` (id ``rl-job-<job_id>``, task queue ``timeslice``)."""
    groups = ", ".join(dict.fromkeys([config.sampler_group, config.trainer]))
    try:
        return await client.start_workflow(
            RL_JOB_WORKFLOW_TYPE,
            config.model_dump(mode="json"),
            id=rl_job_workflow_id(config.job_id),
            task_queue=CONTROL_TASK_QUEUE,
            # A job id names one run: its processes hold that run's model (see job_runtime).
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            result_type=RLJobResult,
            search_attributes=TypedSearchAttributes([SearchAttributePair(JOB_KEY, config.job_id)]),
            static_summary=f"RL job {config.job_id}: {config.workload}, "
            f"{config.epochs} epochs on {groups}",
            static_details=(
                f"**workload**: {config.workload}\n\n**sampler group**: {config.sampler_group}"
                f"\n\n**trainer group**: {config.trainer}\n\n**epochs**: {config.epochs} · "
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
    """How a job's workflow ended badly (failed, terminated ...), or None if it did not."""
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
    """Show progress lines until the job ends (never silent for long), then return its result."""
    return await _follow(
        client, job_id, show, poll_s, RLJobProgress, RLJobResult, describe_progress
    )


def describe_async_progress(p: AsyncRLJobProgress) -> str:
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
    """``follow_job`` for an async job."""
    return await _follow(
        client, job_id, show, poll_s, AsyncRLJobProgress, AsyncRLJobResult, describe_async_progress
    )


P = TypeVar("P")
Res = TypeVar("Res")


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
