"""Reading a report from a Temporal cluster: the groups' status, the RL jobs' phases.

A group answers its ``status`` query. An RL job is read from the histories of all its runs
(continue-as-new chains them): every ``sample``, ``rewards`` and ``train`` activity's result is a
``PhaseResult`` with the phase's own interval, so the report has every phase however long the job
ran; its rewards come from its result, or its ``progress`` query while it runs.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
)
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import InvalidArgumentError, UnknownGroupError
from timeslice.protocol.async_rl_job import (
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    ASYNC_SAMPLE_ACTIVITY,
    ASYNC_SCORE_ACTIVITY,
    ASYNC_TRAIN_ACTIVITY,
    AsyncPhaseResult,
    AsyncRLJobProgress,
    AsyncRLJobResult,
    started_config,
)
from timeslice.protocol.group import (
    GROUP_WORKFLOW_TYPE,
    GroupQuery,
    GroupStatus,
    check_id,
    group_workflow_id,
)
from timeslice.protocol.rl_job import (
    REWARDS_ACTIVITY,
    RL_JOB_WORKFLOW_TYPE,
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
    JobQuery,
    PhaseResult,
    RLJobProgress,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.report.figures import (
    JobRecord,
    build_lanes,
    client_phases,
    group_figures,
    job_figures,
    job_spans,
)
from timeslice.report.model import GroupFigures, JobFigures, JobStatus, Lane, Report, Span

DEFAULT_MAX_JOBS = 50
QUERY_TIMEOUT = timedelta(seconds=15)  # a workflow no worker serves never answers
PHASE_ACTIVITIES = {SAMPLE_ACTIVITY, REWARDS_ACTIVITY, TRAIN_ACTIVITY}
# An async job's phases: their results wrap a PhaseResult (both loops' phases are read).
ASYNC_PHASE_ACTIVITIES = {ASYNC_SAMPLE_ACTIVITY, ASYNC_SCORE_ACTIVITY, ASYNC_TRAIN_ACTIVITY}

_STATUS_NAMES: dict[WorkflowExecutionStatus, JobStatus] = {
    WorkflowExecutionStatus.RUNNING: "running",
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TERMINATED: "terminated",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}


async def collect_report(
    client: Client,
    *,
    groups: list[str] | None = None,
    jobs: list[str] | None = None,
    max_jobs: int = DEFAULT_MAX_JOBS,
    dedicated_s: dict[str, float] | None = None,
) -> Report:
    """Read groups and RL jobs into a :class:`Report`.

    ``groups``: group ids; None: every running group. ``jobs``: job ids; None: the ``max_jobs``
    most recently started RL jobs. ``dedicated_s``: each job's wall time alone on its own group,
    where it was measured (the slowdown is then against it).

    A named group that does not exist raises UnknownGroupError, a malformed id
    InvalidArgumentError; a discovered group that does not answer, and a named job that does not
    exist, are noted in ``Report.problems`` / the job's ``note`` instead."""
    for kind, ids in (("group id", groups), ("job id", jobs)):
        for value in ids or []:
            try:
                check_id(kind, value)
            except ValueError as err:
                raise InvalidArgumentError(str(err)) from None
    now = datetime.now(UTC)
    named = groups is not None
    if groups is None:
        groups = await running_groups(client)
    if jobs is None:
        jobs = (await _discover(client, RL_JOB_WORKFLOW_TYPE, "rl-job-"))[:max_jobs]
    records = await asyncio.gather(*(_job(client, j, now) for j in jobs))
    answers = await asyncio.gather(
        *(read_group_status(client, g) for g in groups), return_exceptions=True
    )
    queried = datetime.now(UTC)
    problems: list[str] = []
    job_lanes: list[Lane] = []
    job_reports: list[JobFigures] = []
    for record in records:
        spans = job_spans(record)
        names = list(dict.fromkeys(s.lane for s in spans)) or [record.job_id]
        job_lanes += [
            Lane(name=name, kind="job", spans=[s for s in spans if s.lane == name])
            for name in names
        ]
        job_reports.append(job_figures(record, spans, (dedicated_s or {}).get(record.job_id)))
    # The groups' figures count every RL job that held them, not only the jobs this report
    # shows (``--job``, or the most recent ``max_jobs``): one not read would pass for an
    # embedded client, its leases whole as phases. A job with no RL job workflow is one.
    holders = {
        holder
        for answer in answers
        if isinstance(answer, GroupStatus)
        for holder in _holders(answer)
    }
    # A shown job id's earlier runs held them too (the job's own figures read its latest run
    # only): their phases count for the groups, not as leases with no phase running.
    shown = {r.job_id for r in records}
    again = {r.job_id for r in records if r.earlier_runs}
    others = await asyncio.gather(
        *(
            _job(client, j, now, progress=False, every_run=True)
            for j in sorted((holders - shown) | (holders & again))
        )
    )
    rl_jobs = {r.job_id for r in [*records, *others] if r.found}
    whole = {r.job_id for r in others}
    phase_lanes = [
        Lane(name=r.job_id, kind="job", spans=job_spans(r))
        for r in [*(r for r in records if r.job_id not in whole), *others]
        if r.found
    ]
    group_reports = []
    group_lanes: list[Lane] = []
    client_lanes: dict[str, Lane] = {}  # a lane per embedded client's job, across groups
    for group_id, answer in zip(groups, answers, strict=True):
        if isinstance(answer, GroupStatus):
            figures, spans = group_figures(
                answer, queried, gpu_phases(phase_lanes, group_id), rl_jobs
            )
            group_reports.append(figures)
            group_lanes.append(Lane(name=group_id, kind="group", spans=spans))
            for span in client_phases(answer, rl_jobs):
                lane = client_lanes.setdefault(span.lane, Lane(name=span.lane, kind="job"))
                lane.spans.append(span)
        elif named or not isinstance(answer, Exception):
            raise answer
        else:
            problems.append(f"group {group_id}: no status ({answer})")
    return Report(
        generated_at=now,
        groups=group_reports,
        jobs=job_reports,
        lanes=build_lanes([*job_lanes, *client_lanes.values()], group_lanes),
        problems=problems,
    )


def gpu_phases(job_lanes: list[Lane], group_id: str) -> list[Span]:
    """The RL jobs' GPU phases on ``group_id``: what its utilization counts of them."""
    return [
        s
        for lane in job_lanes
        for s in lane.spans
        if s.group_id == group_id and s.kind in ("sample", "train")
    ]


async def status_figures(client: Client, status: GroupStatus) -> GroupFigures:
    """The report's figures of one group from its ``status``, at the status's moment (its
    ``as_of``: bring it to now with ``GroupStatus.advanced_to`` first, as the clients do): the
    RL jobs among its holders (its lease history and its holder) are read for their phases,
    the others are embedded clients. What `timeslice status` and `timeslice plan profile
    --group` print, so they say what `timeslice report` says."""
    holders = _holders(status)
    now = datetime.now(UTC)
    records = await asyncio.gather(
        *(_job(client, j, now, progress=False, every_run=True) for j in sorted(holders))
    )
    found = [r for r in records if r.found]
    lanes = [Lane(name=r.job_id, kind="job", spans=job_spans(r)) for r in found]
    figures, _ = group_figures(
        status, status.as_of or now, gpu_phases(lanes, status.group_id), {r.job_id for r in found}
    )
    return figures


def _holders(status: GroupStatus) -> set[str]:
    """The jobs that held the group: its lease history and its holder now."""
    holders = {r.job_id for r in status.history}
    if status.holder is not None:
        holders.add(status.holder.job_id)
    return holders


async def running_groups(client: Client) -> list[str]:
    """The ids of the groups whose workflow runs (a visibility query on their workflow type),
    the most recently created first."""
    return await _discover(client, GROUP_WORKFLOW_TYPE, "gpu-group-", running_only=True)


async def _discover(
    client: Client, workflow_type: str, prefix: str, *, running_only: bool = False
) -> list[str]:
    """Ids (without ``prefix``) of workflows of a type, most recently started first, once each."""
    query = f'WorkflowType="{workflow_type}"'
    if running_only:
        query += ' AND ExecutionStatus="Running"'
    seen: dict[str, datetime] = {}
    async for execution in client.list_workflows(query):
        if not execution.id.startswith(prefix):
            continue
        key = execution.id[len(prefix) :]
        started = execution.start_time
        if key not in seen or started > seen[key]:
            seen[key] = started
    return sorted(seen, key=lambda k: seen[k], reverse=True)


async def read_group_status(client: Client, group_id: str) -> GroupStatus:
    """The group's ``status`` query answer, as of its last workflow task.

    Raises:
        UnknownGroupError: No group workflow of that id.
    """
    handle = client.get_workflow_handle(group_workflow_id(group_id))
    try:
        return await handle.query(
            GroupQuery.STATUS, result_type=GroupStatus, rpc_timeout=QUERY_TIMEOUT
        )
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise UnknownGroupError(
                f"no GPU group {group_id!r} (no workflow {group_workflow_id(group_id)})"
            ) from err
        raise


async def _job(
    client: Client, job_id: str, now: datetime, *, progress: bool = True, every_run: bool = False
) -> JobRecord:
    """One RL job's record; ``progress=False`` reads its phases only (no result, no query a
    worker must answer); ``every_run``: of every run of the job id, not only the latest (what
    a group's figures count)."""
    workflow_id = rl_job_workflow_id(job_id)
    try:
        latest = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return JobRecord(
                job_id=job_id, status="unknown", note=f"no workflow {workflow_id}", found=False
            )
        raise
    status = _STATUS_NAMES.get(latest.status, "unknown") if latest.status else "unknown"
    record = JobRecord(job_id=job_id, status=status, ended=latest.close_time)
    histories, earlier = await _latest_run(client, workflow_id, every_run=every_run)
    for history in histories:
        await _read_run(client, history.events, record)
    if histories:
        record.started = histories[0].events[0].event_time.ToDatetime(tzinfo=UTC)
    record.earlier_runs = earlier
    if not progress:
        return record
    is_async = latest.workflow_type == ASYNC_RL_JOB_WORKFLOW_TYPE
    handle = client.get_workflow_handle(
        workflow_id,
        run_id=latest.run_id,
        result_type=AsyncRLJobResult if is_async else RLJobResult,
    )
    if status in ("failed", "terminated", "cancelled", "timed_out"):
        record.failure = await _failure(handle)
    if status == "completed":
        result = await handle.result()
        record.epochs_done = result.epochs_done
        record.rewards = list(result.rewards)
        record.rewinds = result.rewinds
        if result.stopped:
            record.note = "stopped early"
        return record
    try:
        progress = await handle.query(
            JobQuery.PROGRESS,
            result_type=AsyncRLJobProgress if is_async else RLJobProgress,
            rpc_timeout=QUERY_TIMEOUT,
        )
    except Exception as err:  # a closed run needs a worker to answer; report what we know
        record.note = record.note or f"no progress: {err}"
        return record
    record.epochs_done = progress.epoch
    record.epochs = progress.epochs
    record.rewards = list(progress.rewards)
    record.rewinds = progress.rewinds
    if status != "running" and record.note is None and record.failure is None:
        record.note = f"phase: {progress.phase}"
    return record


async def _latest_run(
    client: Client, workflow_id: str, *, every_run: bool = False
) -> tuple[list[WorkflowHistory], int]:
    """The histories of a job's latest run — its workflow's latest execution and those it
    continued as new from, oldest first — and how many earlier runs of the same job id
    there were (a job id started again after its run ended: another run, left out).
    ``every_run``: every execution of the job id, oldest first, none left out."""
    query = f"WorkflowId = '{workflow_id}'"
    executions = [execution async for execution in client.list_workflows(query)]
    executions.sort(key=lambda e: e.start_time)
    chain: list[WorkflowHistory] = []
    for execution in reversed(executions):
        handle = client.get_workflow_handle(workflow_id, run_id=execution.run_id)
        history = await handle.fetch_history()
        chain.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        if not started.continued_execution_run_id and not every_run:
            break  # the first execution of this run
    return chain, len(executions) - len(chain)


async def _failure(handle: WorkflowHandle[Any, Any]) -> str | None:
    """What a closed run failed with: its error's type and message (or why it ended)."""
    try:
        await handle.result()
    except WorkflowFailureError as err:
        cause = err.cause
        kind = getattr(cause, "type", None) or type(cause).__name__
        return f"{kind}: {getattr(cause, 'message', None) or cause}"
    except Exception as err:  # a result that does not decode: the run ended, say what we know
        return str(err)
    return None


async def _read_run(client: Client, events: Any, record: JobRecord) -> None:
    """Add one run's phases (and, from the first run, the job's groups) to ``record``."""
    converter = client.data_converter
    scheduled: dict[int, str] = {}
    versions: dict[int, int] = {}  # async: batch id -> the weights version it was sampled with
    for event in events:
        if (
            event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
            and not record.groups
        ):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            if payloads:
                try:
                    (raw,) = await converter.decode(payloads, [Any])
                    config = started_config(raw)
                except (ValueError, KeyError, RuntimeError):
                    # A job started with input it refused (not one config, or undecodable; it
                    # failed at once): no groups or phases to report, and it must not stop the
                    # report of the others. (pydantic's ValidationError is a ValueError.)
                    record.note = "refused its config (invalid input)"
                    return
                # A job started with a pool names no groups: its phases do (below).
                record.groups = sorted({g for g in (config.sampler_group, config.trainer) if g})
                record.epochs = config.epochs
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = attrs.activity_type.name
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = event.activity_task_completed_event_attributes
            activity_type = scheduled.get(attrs.scheduled_event_id)
            if activity_type not in PHASE_ACTIVITIES | ASYNC_PHASE_ACTIVITIES:
                continue
            try:
                if activity_type in ASYNC_PHASE_ACTIVITIES:
                    (wrapped,) = await converter.decode(attrs.result.payloads, [AsyncPhaseResult])
                    phase = wrapped.phase
                    record.mode = "async"
                    if wrapped.weights_version is not None:  # a sampling: the batch's weights
                        versions[wrapped.batch] = wrapped.weights_version
                    if phase.phase == "train":
                        sampled_with = versions.get(wrapped.batch)
                        record.staleness.append(
                            None if sampled_with is None else phase.epoch - sampled_with
                        )
                else:
                    (phase,) = await converter.decode(attrs.result.payloads, [PhaseResult])
            except ValueError:
                # A result the job refused (a job process of another release, or a forged or
                # malformed answer: the job failed that phase and did not use it) is no phase
                # of its run, and must not stop the report of the others.
                record.skipped_results += 1
                record.note = f"{record.skipped_results} phase result(s) unreadable, left out"
                continue
            record.phases.append(phase)
            record.completed_at.append(event.event_time.ToDatetime(tzinfo=UTC))
            if phase.group_id and phase.group_id not in record.groups:  # a pool's placement
                record.groups = sorted([*record.groups, phase.group_id])
