"""SnapshotJobWorkflow: snapshot or restore one job and wait, without any GPU group.

For frameworks with their own scheduler: the same activities a group runs on a switch, on the
job's rank and node queues (a node agent's after the job's own on an eviction, before them on a
restore); the result is every backend's report.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError
from timeslice.protocol.group import (
    RESTORE_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    MalformedMessage,
    SnapshotJobInput,
    SnapshotJobResult,
    parse_message,
)
from timeslice.workflows.snapshot_calls import run_on_queues

SNAPSHOT_JOB_WORKFLOW_TYPE = "SnapshotJobWorkflow"
# workflow.patched id: a job with both its own queues and a node agent's is evicted through its
# own first and the agent's after, and restored the other way round (as a group does, under
# agent-queues-waited-for): the agent's checkpoint locks the whole process, and a move the
# process makes itself blocks on its CUDA calls while it is locked. Runs that started before
# replay moving both at once, as they ran.
AGENTS_APART = "snapshot-job-agents-apart"


@workflow.defn(name=SNAPSHOT_JOB_WORKFLOW_TYPE)
class SnapshotJobWorkflow:
    """Evict or restore one job's state on all its queues, and wait. It takes no messages: what
    it does shows as its current details (the Web UI, ``temporal workflow metadata``)."""

    @workflow.run
    async def run(self, *raw: Any) -> SnapshotJobResult:
        """Run the snapshot or restore activity on every queue of the job's target.

        Args:
            raw: one ``SnapshotJobInput`` (validated here).

        Returns:
            Every backend's report.

        Raises:
            ApplicationError: ``InvalidInput`` for bad input, ``SnapshotFailed`` if any queue's
                activity failed (both non-retryable).
        """
        # Taken raw and validated here, so a missing, extra or invalid argument fails the
        # workflow once with the reason instead of failing its task forever.
        try:
            inp = parse_message(SnapshotJobInput, raw, "SnapshotJobWorkflow")
        except MalformedMessage as err:
            raise ApplicationError(str(err), type="InvalidInput", non_retryable=True) from None
        agents_apart = workflow.patched(AGENTS_APART)
        activity = SNAPSHOT_ACTIVITY if inp.action == "snapshot" else RESTORE_ACTIVITY
        queues = ", ".join(q.task_queue for q in inp.target.queues)
        workflow.set_current_details(f"**{inp.action}** job {inp.job_id} on {queues}")
        outcomes = await run_on_queues(
            activity,
            inp.job_id,
            inp.target,
            context="standalone",
            pickup_timeout_s=inp.pickup_timeout_s,
            run_timeout_s=inp.run_timeout_s,
            agents_apart=agents_apart,
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            cause = getattr(failures[0], "cause", None) or failures[0]
            raise ApplicationError(
                f"{inp.action} of job {inp.job_id} failed on {len(failures)} of "
                f"{len(outcomes)} queues: {cause}",
                type="SnapshotFailed",
                non_retryable=True,
            )
        return SnapshotJobResult(reports=[r for rs in outcomes if isinstance(rs, list) for r in rs])
