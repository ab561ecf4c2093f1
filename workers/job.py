"""The job worker: one rank of one RL job, serving its phases on ``timeslice-job-<job>-<rank>``."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.activities.async_job import AsyncJobRuntime
from timeslice.activities.job_runtime import JobRuntime
from timeslice.protocol.group import job_task_queue
from timeslice.workloads.registry import load_workload

DEFAULT_CHECKPOINT_DIR = Path(".timeslice/checkpoints")


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
