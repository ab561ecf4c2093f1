"""Workflows as requesters: grant by signal, renewal by timer, request and creation by activity."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker
from timeslice.activities.group_requests import draw_secret, renew_lease, request_group
from timeslice.protocol.group import (
    RENEW_LEASE_ACTIVITY,
    REQUEST_GROUP_ACTIVITY,
    GroupRequest,
    LeaseOutcome,
    LeaseRenewal,
    RenewResult,
)
from timeslice.workers.sandbox import workflow_runner

from .helpers import Interval, assert_no_overlap, wait_for
from .requester_workflows import (
    LeaseKeepingWorkflow,
    LeaseTakingWorkflow,
    ReleaseOnSignalWorkflow,
)

QUEUE = "test-requesters"


async def _run_jobs(address: str, jobs: list[tuple[str, str, int, float, float | None]]) -> list:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    async with Worker(
        client,
        task_queue=QUEUE,
        workflows=[LeaseTakingWorkflow],
        activities=[request_group, draw_secret, renew_lease],
        workflow_runner=workflow_runner(),
    ):
        handles = [
            await client.start_workflow(
                LeaseTakingWorkflow.run,
                args=list(job),
                id=f"lease-taker-{uuid.uuid4().hex[:8]}",
                task_queue=QUEUE,
            )
            for job in jobs
        ]
        return [await h.result() for h in handles]


def test_workflows_contend_with_a_process(address, group, make_client):
    process = make_client(job_id="proc")
    results = asyncio.run(
        _run_jobs(
            address,
            [
                ("wf-a", group, 3, 0.2, None),
                ("wf-b", group, 3, 0.2, None),
            ],
        )
    )
    process.release(process.acquire(group, timeout=60))
    intervals = [
        Interval(job, token, start, end)
        for job, rounds in zip(("wf-a", "wf-b"), results, strict=True)
        for token, start, end in rounds
    ]
    assert len(intervals) == 6
    assert_no_overlap(intervals)  # the workflows' own clocks: the server's
    status = process.group_status(group)
    assert status.stats.leases == 7 and status.stats.released == 7
    assert all(r.outcome == LeaseOutcome.RELEASED for r in status.history)


def test_workflow_acquire_timeout_never_leaks(address, group, make_client):
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    [result] = asyncio.run(_run_jobs(address, [("wf-late", group, 1, 0.1, 1.0)]))
    assert result == [["timeout"]]
    holder.release(lease)
    again = holder.acquire(group, timeout=30)
    status = holder.group_status(group)
    assert [r.job_id for r in status.history] == ["holder"]  # wf-late was never granted
    holder.release(again)


def test_a_request_whose_activity_failed_is_taken_back(address, group, make_client):
    """The request reached the group, then its activity failed (here: it raises after queueing
    it). The requester takes it back: before, its grant came later, the workflow dropped it as
    one it did not make, and the group stayed held by nobody for a TTL (bench/scale.py at 200
    jobs, where requests timed out under load)."""
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)

    @activity.defn(name=REQUEST_GROUP_ACTIVITY)
    async def queue_then_fail(req: GroupRequest) -> None:
        await request_group(req)
        raise ApplicationError("lost on the way back", non_retryable=True)

    async def go() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        queue = f"{QUEUE}-{uuid.uuid4().hex[:8]}"
        async with Worker(
            client,
            task_queue=queue,
            workflows=[LeaseTakingWorkflow],
            activities=[queue_then_fail, draw_secret, renew_lease],
            workflow_runner=workflow_runner(),
        ):
            handle = await client.start_workflow(
                LeaseTakingWorkflow.run,
                args=["wf-unlucky", group, 1, 0.1, None],
                id=f"lease-taker-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
            )
            with contextlib.suppress(WorkflowFailureError):
                await handle.result()

    asyncio.run(go())
    wait_for(
        lambda: holder.group_status(group).stats.cancelled == 1,
        what="the failed request taken back",
    )
    holder.release(lease)
    again = holder.acquire(group, timeout=30)  # nobody else is queued: granted at once
    status = holder.group_status(group)
    assert [r.job_id for r in status.history] == ["holder"]  # wf-unlucky was never granted
    assert status.stats.leases == 2 and not status.queue
    holder.release(again)


def test_workflow_lease_is_renewed_past_its_ttl(address, group, make_client):
    """TTL 3 s, held 7 s: only the workflow's renewal timer keeps the lease."""
    [rounds] = asyncio.run(_run_jobs(address, [("wf-long", group, 1, 7.0, None)]))
    assert len(rounds) == 1
    status = make_client().group_status(group)
    assert status.stats.expired == 0 and status.stats.released == 1


def test_workflow_learns_that_its_lease_was_lost(address, group, make_client):
    """The requester's worker is gone longer than the TTL (3 s): the group expires the lease.
    When a worker runs the requester again, its next renewal is answered "expired" and the
    workflow knows the lease is lost, instead of holding on in the belief it is renewed."""
    status_client = make_client()

    async def go() -> list[str]:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        queue = f"{QUEUE}-{uuid.uuid4().hex[:8]}"

        def requester_worker() -> Worker:
            return Worker(
                client,
                task_queue=queue,
                workflows=[LeaseKeepingWorkflow],
                activities=[request_group, draw_secret, renew_lease],
                workflow_runner=workflow_runner(),
                max_cached_workflows=0,  # the second worker replays it from its history
            )

        async with requester_worker():
            handle = await client.start_workflow(
                LeaseKeepingWorkflow.run,
                args=["wf-keeper", group, 60.0],
                id=f"lease-keeper-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
            )
            await asyncio.to_thread(
                wait_for,
                lambda: (h := status_client.group_status(group).holder) and h.job_id == "wf-keeper",
                what="the workflow holding the group",
            )
        # No worker runs the requester now: nothing renews its lease.
        await asyncio.to_thread(
            wait_for,
            lambda: status_client.group_status(group).stats.expired == 1,
            what="the group expiring the lease",
        )
        async with requester_worker():
            return await handle.result()

    outcome = asyncio.run(go())
    assert outcome[0] == "lost", f"the workflow never learned its lease was lost: {outcome}"
    assert "expired" in outcome[1] or "no longer held" in outcome[1], outcome


def test_a_release_during_a_renewal_reaches_the_group(address, group, make_client):
    """The workflow releases while its renewal's local activity is in flight (here: one that
    never answers). Releasing cancels the renewer; the SDK reports that cancel as the local
    activity's ActivityError, which the renewer once took for an unanswered renewal: it kept
    renewing, the release waited for it forever, and the workflow held the group for good
    (bench/scale.py at 200 jobs: 124 never ended)."""
    status_client = make_client()

    async def go() -> int:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        queue = f"{QUEUE}-{uuid.uuid4().hex[:8]}"
        renewing = asyncio.Event()

        @activity.defn(name=RENEW_LEASE_ACTIVITY)
        async def unanswered_renewal(req: LeaseRenewal) -> RenewResult:
            renewing.set()
            await asyncio.Event().wait()  # until cancelled, or timed out
            raise AssertionError("unreachable")

        async with Worker(
            client,
            task_queue=queue,
            workflows=[ReleaseOnSignalWorkflow],
            activities=[request_group, draw_secret, unanswered_renewal],
            workflow_runner=workflow_runner(),
        ):
            # A TTL of 30 s: the first renewal starts after 10 s and is given 11 s, the window
            # in which the release must come.
            handle = await client.start_workflow(
                ReleaseOnSignalWorkflow.run,
                args=["wf-releaser", group, 30.0],
                id=f"lease-releaser-{uuid.uuid4().hex[:8]}",
                task_queue=queue,
            )
            await asyncio.wait_for(renewing.wait(), timeout=120)
            await handle.signal(ReleaseOnSignalWorkflow.release_now)
            try:
                return await asyncio.wait_for(handle.result(), timeout=90)
            except TimeoutError:
                await handle.terminate("the release never came")
                raise AssertionError(
                    "the workflow never released: its renewer swallowed the cancel"
                ) from None

    token = asyncio.run(go())
    wait_for(
        lambda: (s := status_client.group_status(group)).holder is None and s.stats.released >= 1,
        what="the group to take the release",
    )
    assert token >= 1
