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
