"""The job worker: one rank of one RL job, serving its phases on ``timeslice-job-<job>-<rank>``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Worker
from timeslice.activities.async_job import AsyncJobRuntime
from timeslice.activities.job_runtime import JobRuntime
from timeslice.protocol.group import job_task_queue
from timeslice.workloads.registry import load_workload

DEFAULT_CHECKPOINT_DIR = Path(".timeslice/checkpoints")
# How long to wait before asking again when the server did not answer while the process waits
# for the end of its run (a restart of the server, say).
_RETRY_S = 2.0

log = logging.getLogger("timeslice.job")


def build_job_runtime(
    job_id: str,
    rank: int,
    workload_ref: str,
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    keep_checkpoints: int = 3,
) -> JobRuntime:
    """Load the workload once; raises ValueError with what to fix for bad arguments."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, not {rank}")
    job_task_queue(job_id, rank)  # raises, naming the rule, for an invalid job id
    # Serves sync jobs and, for a workload with an async mode, async ones.
    return AsyncJobRuntime(
        job_id=job_id,
        rank=rank,
        workload=load_workload(workload_ref),
        workload_ref=workload_ref,
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=keep_checkpoints,
    )


def build_job_worker(client: Client, runtime: JobRuntime) -> Worker:
    """Call from the event loop the worker will run on (the runtime's engine lives there)."""
    runtime.attach(client)
    return Worker(
        client,
        task_queue=job_task_queue(runtime.job_id, runtime.rank),
        activities=runtime.activities(),
        # Phases run one at a time (the workflow's order); grants, snapshots and describes
        # arrive beside them.
        max_concurrent_activities=16,
    )


async def run_ended(client: Client, runtime: JobRuntime) -> str:
    """Wait until the run this process serves has ended, and say how.

    A job process serves one run of its job (and the runs it continues as new as); it waits
    here for the first workflow to bind it, then for that run's close event (Temporal's long
    poll of the history, following continue-as-new), never for a poll of its own.

    Args:
        client: The job worker's client.
        runtime: The rank it serves.

    Returns:
        How the run ended, in words: ``workflow rl-job-j1 completed``, ``... failed: ...``.
    """
    await runtime.bound.wait()
    assert runtime.bound_run is not None
    workflow_id, run_id = runtime.bound_run
    handle = client.get_workflow_handle(workflow_id, run_id=run_id or None)
    while True:
        try:
            await handle.result(follow_runs=True)
            return f"workflow {workflow_id} completed"
        except WorkflowFailureError as err:
            cause = err.cause
            what = getattr(cause, "type", None) or type(cause).__name__
            message = getattr(cause, "message", None) or str(cause)
            return f"workflow {workflow_id} ended ({what}: {message})"
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return f"workflow {workflow_id} is gone ({err.message})"
            log.warning("cannot learn whether %s ended: %s; asking again", workflow_id, err)
            await asyncio.sleep(_RETRY_S)
