"""A workflow that takes GPU-group leases the way the RL job workflow will (for the tests)."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError
from timeslice.workflows.group_lease import GroupLeases


@workflow.defn(name="LeaseTakingWorkflow")
class LeaseTakingWorkflow:
    """Acquire ``group`` ``rounds`` times, hold it ``hold_s`` (a durable timer), release.

    Returns one [token, start, end] per round, in workflow time (the server's clock), or
    ["timeout"] if an acquire timed out.
    """

    @workflow.run
    async def run(
        self, job_id: str, group: str, rounds: int, hold_s: float, timeout_s: float | None
    ) -> list[list]:
        leases = GroupLeases(job_id, ttl_s=3.0)
        held: list[list] = []
        for _ in range(rounds):
            try:
                lease = await leases.acquire(group, timeout=timeout_s)
            except ApplicationError as err:
                if err.type == "AcquireTimeout":
                    return [["timeout"]]
                raise
            start = workflow.now().timestamp()
            await workflow.sleep(hold_s)
            end = workflow.now().timestamp()
            await leases.release(lease)
            held.append([lease.token, start, end])
        return held


@workflow.defn(name="LeaseKeepingWorkflow")
class LeaseKeepingWorkflow:
    """Acquire ``group`` and hold it up to ``hold_s``; returns ["lost", why] if the lease was
    lost meanwhile (the workflow learns it from its renewals' answers), else ["held"]."""

    @workflow.run
    async def run(self, job_id: str, group: str, hold_s: float) -> list[str]:
        leases = GroupLeases(job_id, ttl_s=3.0)
        lease = await leases.acquire(group, timeout=60)
        try:
            await workflow.wait_condition(lambda: leases.lost(lease) is not None, timeout=hold_s)
        except TimeoutError:
            await leases.release(lease)
            return ["held"]
        why = leases.lost(lease)
        await leases.release(lease)
        return ["lost", why or ""]


@workflow.defn(name="ImpostorWorkflow")
class ImpostorWorkflow:
    """Asks a node agent to snapshot a job, as no group or snapshot workflow would (tests)."""

    @workflow.run
    async def run(self, node_queue: str, job_id: str) -> str:
        from datetime import timedelta

        from temporalio.common import RetryPolicy
        from temporalio.exceptions import ActivityError
        from timeslice.protocol.group import SNAPSHOT_ACTIVITY, SnapshotCall

        try:
            await workflow.execute_activity(
                SNAPSHOT_ACTIVITY,
                SnapshotCall(group_id="g", job_id=job_id, backends=["simulated"], reason="x"),
                task_queue=node_queue,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            return f"refused: {err.cause}"
        return "obeyed"


@workflow.defn(name="OtherReleaseJobWorkflow")
class OtherReleaseJobWorkflow:
    """Calls a job process's `describe` as an RL job workflow of another release would: one
    that sends job protocol ``protocol`` (None: one from before protocol versions)."""

    @workflow.run
    async def run(self, job_id: str, task_queue: str, protocol: int | None) -> str:
        from datetime import timedelta

        from temporalio.common import RetryPolicy
        from temporalio.exceptions import ActivityError
        from timeslice.protocol.rl_job import DESCRIBE_ACTIVITY

        call: dict[str, object] = {"job_id": job_id}
        if protocol is not None:
            call["protocol"] = protocol
        try:
            await workflow.execute_activity(
                DESCRIBE_ACTIVITY,
                call,
                task_queue=task_queue,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(maximum_attempts=1),
            )
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, ApplicationError):
                return f"{cause.type}: {cause.message}"
            return f"failed: {err}"
        return "served"


@workflow.defn(name="ForgedPhaseWorkflow")
class ForgedPhaseWorkflow:
    """Drives a fresh job process as a forger would: a lease of its own on ``own_group`` to
    prepare under, then a multi-rank phase "under" the lease another job holds on
    ``victim_group``, named by its token (which `timeslice status` shows) and a made-up key.
    Returns what each call answered ("ok" or "<error type>: <message>")."""

    @workflow.run
    async def run(
        self, job_id: str, own_group: str, victim_group: str, victim_token: int
    ) -> list[str]:
        from datetime import timedelta

        from temporalio.common import RetryPolicy
        from temporalio.exceptions import ActivityError
        from timeslice.protocol.group import job_task_queue
        from timeslice.protocol.rl_job import (
            DESCRIBE_ACTIVITY,
            JOB_PROTOCOL_VERSION,
            PREPARE_ACTIVITY,
            SAMPLE_ACTIVITY,
            DescribeInput,
            JobSpecModel,
            LeaseOrder,
            PhaseInput,
            PrepareInput,
        )

        leases = GroupLeases(job_id, ttl_s=10.0)
        own = await leases.acquire(own_group, timeout=60)
        own_order = LeaseOrder(
            group_id=own_group,
            request_id=own.request_id,
            key=leases.key_of(own),
            token=own.token,
            held_by="workflow",
            ttl_s=own.ttl_s,
        )
        forged = LeaseOrder(
            group_id=victim_group,
            request_id="forged",
            key="f" * 32,
            token=victim_token,
            held_by="workflow",
            ttl_s=10.0,
        )
        spec = JobSpecModel(job_id=job_id, workload="simulated", seed=0, batch_size=1, group_size=1)
        calls = [
            (DESCRIBE_ACTIVITY, DescribeInput(job_id=job_id, protocol=JOB_PROTOCOL_VERSION)),
            (PREPARE_ACTIVITY, PrepareInput(spec=spec, leases=[own_order])),
            (
                SAMPLE_ACTIVITY,
                PhaseInput(job_id=job_id, epoch=0, phase="sample", lease=forged, lease_check_s=0.5),
            ),
        ]
        answers = []
        for name, arg in calls:
            try:
                await workflow.execute_activity(
                    name,
                    arg,
                    task_queue=job_task_queue(job_id, 0),
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(maximum_attempts=1),
                )
                answers.append("ok")
            except ActivityError as err:
                cause = err.cause
                if isinstance(cause, ApplicationError):
                    answers.append(f"{cause.type}: {cause.message}")
                else:
                    answers.append(f"failed: {err}")
        await leases.release(own)
        return answers


@workflow.defn(name="ReleaseOnSignalWorkflow")
class ReleaseOnSignalWorkflow:
    """Acquire ``group`` with a TTL of ``ttl_s``, hold it until signalled, release; returns the
    lease's token."""

    def __init__(self) -> None:
        self._release = False

    @workflow.signal
    def release_now(self) -> None:
        self._release = True

    @workflow.run
    async def run(self, job_id: str, group: str, ttl_s: float) -> int:
        leases = GroupLeases(job_id, ttl_s=ttl_s)
        lease = await leases.acquire(group, timeout=60)
        await workflow.wait_condition(lambda: self._release)
        await leases.release(lease)
        return lease.token


@workflow.defn(name="GroupWithoutRenewalRule")
class GroupWithoutRenewalRule:
    """Stands in for a GPU group of a release before the ``renewal_rule`` query: it answers
    no query of that name (run under a group's workflow id)."""

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)
