"""The GPU-group lease protocol against a real server, control worker and client processes."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import (
    AsyncTimeSliceOrchestratorClient,
    InvalidArgumentError,
    TimeSliceOrchestratorClient,
)
from timeslice.protocol.group import (
    CONTROL_TASK_QUEUE,
    GROUP_WORKFLOW_TYPE,
    AcquireRequest,
    GroupConfig,
    GroupInput,
    GroupQuery,
    GroupSignal,
    GroupUpdate,
    LeaseOutcome,
    LeaseReturn,
    QueueTarget,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    ReturnAnswer,
    SnapshotJobInput,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
)
from timeslice.snapshot import NoopBackend, SimulatedBackend
from timeslice.workflows.snapshot_job import SNAPSHOT_JOB_WORKFLOW_TYPE

from .helpers import (
    assert_no_overlap,
    events,
    finish,
    hold_intervals,
    read_log,
    spawn_contender,
    wait_for,
)


def queued_jobs(client: TimeSliceOrchestratorClient, group: str) -> list[str]:
    return [w.job_id for w in client.group_status(group).queue]


def test_processes_contending_never_overlap(address: str, group: str, tmp_path: Path, make_client):
    log = tmp_path / "holds.jsonl"
    jobs = [f"job{i}" for i in range(4)]
    procs = [
        spawn_contender(address, group, job, log, "--iterations", "10", "--hold", "0.02")
        for job in jobs
    ]
    finish(procs)
    intervals = hold_intervals(read_log(log))
    assert len(intervals) == 40
    assert {i.job for i in intervals} == set(jobs)
    assert_no_overlap(intervals)
    status = make_client().group_status(group)
    assert status.stats.leases == 40
    assert status.stats.released == 40
    assert status.holder is None and status.queue == []
    assert status.stats.stale_messages == 0


def _queue_in_order(address, group, tmp_path, make_client, specs):
    """Hold the group, queue one process per (job, priority) in order, then release."""
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    log = tmp_path / "order.jsonl"
    procs = []
    for job, priority in specs:
        procs.append(
            spawn_contender(address, group, job, log, "--priority", str(priority), "--hold", "0.01")
        )
        wait_for(lambda job=job: job in queued_jobs(holder, group), what=f"{job} queued")
    holder.release(lease)
    finish(procs)
    return [r["job"] for r in sorted(events(log, "acquired"), key=lambda r: r["t"])]


def test_fifo_within_a_priority(address, group, tmp_path, make_client):
    order = _queue_in_order(address, group, tmp_path, make_client, [("b", 0), ("c", 0), ("d", 0)])
    assert order == ["b", "c", "d"]


def test_higher_priority_first(address, group, tmp_path, make_client):
    specs = [("low1", 0), ("low2", 0), ("high", 5), ("mid", 2)]
    order = _queue_in_order(address, group, tmp_path, make_client, specs)
    assert order == ["high", "mid", "low1", "low2"]


async def _raw_client(address: str) -> Client:
    return await Client.connect(address, data_converter=pydantic_data_converter)


def test_stale_token_release_and_renew_are_ignored(address, group, make_client):
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)

    guess = "not-the-holders-key-0123456789"

    async def send_stale() -> RenewResult:
        handle = (await _raw_client(address)).get_workflow_handle(group_workflow_id(group))
        for token in (lease.token - 1, lease.token + 7):
            await handle.signal(
                "release", ReleaseRequest(request_id="forged", token=token, key=guess)
            )
        # The holder's own request id and token, seen in `timeslice status`: without its key
        # the release is refused (before, this ended someone else's lease).
        await handle.signal(
            "release",
            ReleaseRequest(request_id=lease.request_id, token=lease.token, key=guess),
        )
        return await handle.execute_update(
            "renew",
            RenewRequest(request_id="forged", token=lease.token + 7, key=guess),
            result_type=RenewResult,
        )

    renewed = asyncio.run(send_stale())
    assert not renewed.valid
    status = wait_for(
        lambda: (s := holder.group_status(group)).stats.stale_messages == 3 and s,
        what="stale messages counted",
    )
    assert status.stats.forged_messages == 1
    assert status.holder is not None and status.holder.token == lease.token
    assert lease.valid
    holder.release(lease)
    assert holder.group_status(group).stats.released == 1


def test_a_release_sent_again_is_answered_released_not_revoked(address, group, make_client):
    """A release whose answer was lost is sent again; if its first sending landed in a run
    that has since continued as new, the next run never saw its update id and handles it
    afresh (here: a new update id). It is answered released, as the lease was, not "not
    valid", which the holder must read as a lease revoked under it; the wrong key is not."""
    holder = make_client(job_id="released-once")
    lease = holder.acquire(group)
    holder.release(lease)

    async def send_again(key: str) -> ReturnAnswer:
        handle = (await _raw_client(address)).get_workflow_handle(group_workflow_id(group))
        again = LeaseReturn(request_id=lease.request_id, token=lease.token, key=key)
        return await handle.execute_update(
            GroupUpdate.RELEASE, again, id=str(uuid.uuid4()), result_type=ReturnAnswer
        )

    answer = asyncio.run(send_again(lease.key))
    assert answer.valid and answer.released and not answer.evict
    forged = asyncio.run(send_again("not-the-holders-key-0123456789"))
    assert not forged.valid and not forged.released
    assert holder.group_status(group).stats.released == 1


def test_timed_out_acquire_is_never_granted_later(address, group, tmp_path, make_client):
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    log = tmp_path / "timeout.jsonl"
    proc = spawn_contender(address, group, "impatient", log, "--timeout", "1.0")
    finish([proc])
    assert [r["event"] for r in read_log(log)] == ["ready", "timeout", "done"]
    wait_for(lambda: queued_jobs(holder, group) == [], what="the timed-out request left the queue")
    holder.release(lease)
    again = holder.acquire(group, timeout=30)  # the group still works, and it is ours
    status = holder.group_status(group)
    assert [r.job_id for r in status.history] == ["holder"]
    assert status.stats.leases == 2
    assert status.stats.cancelled + status.stats.timed_out >= 1
    holder.release(again)


def test_grant_that_races_a_give_up_is_released_at_once(address, group, make_client):
    """A grant reaching a process that no longer waits is declined and the group moves on."""
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    gone = make_client(job_id="gone")

    abandoned_id, abandoned_key = f"abandoned-{uuid.uuid4().hex}", "the-abandoned-request's-key"

    async def give_up() -> None:
        # The process serves its queue but no longer waits for this request: exactly the state
        # of an acquire that gave up just before its grant arrived (it still knows the key, and
        # declines with it, so the group ends the grant at once).
        gone._engine.session.inbox.expect(abandoned_id, abandoned_key)
        gone._engine.session.inbox.withdraw(abandoned_id)

    gone._engine.run_sync(give_up())

    async def enqueue_abandoned_request() -> None:
        handle = (await _raw_client(address)).get_workflow_handle(group_workflow_id(group))
        await handle.signal(
            "request",
            AcquireRequest(
                request_id=abandoned_id,
                key_hash=lease_key_hash(abandoned_key),
                job_id="gone",
                reply_task_queue=gone.task_queue,
            ),
        )

    asyncio.run(enqueue_abandoned_request())
    wait_for(lambda: queued_jobs(holder, group) == ["gone"], what="abandoned request queued")
    next_waiter = make_client(job_id="next")
    # Queue "next" behind it from another thread by acquiring asynchronously.
    result: dict = {}

    async def acquire_next() -> None:
        result["lease"] = await asyncio.to_thread(next_waiter.acquire, group, 60)

    async def scenario() -> None:
        task = asyncio.create_task(acquire_next())
        await asyncio.to_thread(
            wait_for, lambda: "next" in queued_jobs(holder, group), what="next queued"
        )
        await asyncio.to_thread(holder.release, lease)
        await task

    asyncio.run(scenario())
    status = holder.group_status(group)
    assert status.holder is not None and status.holder.job_id == "next"
    assert status.stats.rejected == 1
    outcomes = [(r.job_id, r.outcome) for r in status.history]
    assert outcomes == [("holder", LeaseOutcome.RELEASED), ("gone", LeaseOutcome.REJECTED)]
    next_waiter.release(result["lease"])


def test_cancelled_acquire_leaves_the_queue(address, group, make_client):
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)

    async def cancel_waiting_acquire() -> None:
        async with AsyncTimeSliceOrchestratorClient(target=address, job_id="canceller") as client:
            task = asyncio.create_task(client.acquire(group))
            await asyncio.to_thread(
                wait_for, lambda: "canceller" in queued_jobs(holder, group), what="queued"
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_waiting_acquire())
    wait_for(lambda: queued_jobs(holder, group) == [], what="cancelled request removed")
    holder.release(lease)
    status = holder.group_status(group)
    assert status.stats.cancelled == 1
    assert [r.job_id for r in status.history] == ["holder"]


def test_killed_holder_loses_the_lease_after_its_ttl(address, group, tmp_path, make_client):
    log = tmp_path / "kill.jsonl"
    victim_err = tmp_path / "victim.stderr"
    with victim_err.open("wb") as err:
        victim = spawn_contender(
            address, group, "victim", log, "--ttl", "3", "--hold-forever", stderr=err
        )
    wait_for(lambda: events(log, "acquired", "victim"), what="victim holds the group")
    waiter = spawn_contender(address, group, "survivor", log, "--hold", "0.01")
    observer = make_client(job_id="observer")
    wait_for(lambda: queued_jobs(observer, group) == ["survivor"], what="survivor queued")
    # A grant taken from a parked update is confirmed by the holder's first renewal (TTL / 3
    # after it); until then the group bounds it by grant_ack_timeout_s (15 s), not the TTL.
    # Killed before that renewal, the victim ends DEAD after 15 s (seen on a loaded machine);
    # this test is about a holder whose TTL runs.
    wait_for(
        lambda: (
            (holder := observer.group_status(group).holder) is not None
            and holder.expires_in_s is not None
        ),
        what="the victim's grant confirmed by its first renewal",
    )
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    finish([waiter], timeout=120)
    status = observer.group_status(group)
    said = (status.stats, status.history, victim_err.read_text(errors="replace")[-3000:])
    assert status.stats.expired == 1, said
    assert [(r.job_id, r.outcome) for r in status.history][:2] == [
        ("victim", LeaseOutcome.EXPIRED),
        ("survivor", LeaseOutcome.RELEASED),
    ]
    taken_at = events(log, "acquired", "survivor")[0]["t"]
    # Renewals come every TTL / 3 = 1 s, so the lease outlives the kill by at least ~2 s.
    assert taken_at - killed_at >= 1.5


def test_dead_waiter_is_skipped(address, group, tmp_path, make_client):
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    log = tmp_path / "dead.jsonl"
    doomed = spawn_contender(address, group, "doomed", log)
    wait_for(lambda: queued_jobs(holder, group) == ["doomed"], what="doomed queued")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    alive = spawn_contender(address, group, "alive", log, "--hold", "0.01")
    wait_for(lambda: queued_jobs(holder, group) == ["doomed", "alive"], what="alive queued")
    holder.release(lease)
    finish([alive], timeout=120)
    status = holder.group_status(group)
    assert status.stats.dead_waiters == 1
    assert ("doomed", LeaseOutcome.DEAD) in [(r.job_id, r.outcome) for r in status.history]


def test_sticky_residency_and_eviction_calls(address, group, make_client):
    backend_a, backend_b = NoopBackend(), NoopBackend()
    a = make_client(job_id="ja", snapshot_backends=[backend_a])
    b = make_client(job_id="jb", snapshot_backends=[backend_b])
    for _ in range(2):  # nobody else waits: A's state stays resident, nothing moves
        a.release(a.acquire(group))
    assert (backend_a.snapshots, backend_a.restores) == (0, 0)
    b.release(b.acquire(group))  # A is evicted, B had never been evicted
    assert (backend_a.snapshots, backend_b.restores) == (1, 0)
    a.release(a.acquire(group))  # B evicted, A restored
    assert (backend_b.snapshots, backend_a.restores) == (1, 1)
    status = a.group_status(group)
    assert (status.stats.evictions, status.stats.restores, status.stats.switches) == (2, 1, 2)
    assert status.resident_job == "ja"


def test_the_group_and_a_standalone_eviction_explain_themselves(address, group, make_client):
    """What the Web UI and ``temporal workflow metadata`` show: every group handler's
    description and the group's details; a SnapshotJobWorkflow's details."""
    job = make_client(job_id="explained", snapshot_backends=[NoopBackend()])
    lease = job.acquire(group)
    standalone = f"snapshot-explained-{uuid.uuid4().hex[:8]}"

    async def metadata() -> tuple[WorkflowMetadata, WorkflowMetadata]:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        group_md = await client.get_workflow_handle(group_workflow_id(group)).query(
            "__temporal_workflow_metadata", result_type=WorkflowMetadata
        )
        target = SnapshotTarget(queues=[QueueTarget(task_queue=job.task_queue, backends=["noop"])])
        await client.execute_workflow(
            SNAPSHOT_JOB_WORKFLOW_TYPE,
            SnapshotJobInput(job_id="explained", action="snapshot", target=target),
            id=standalone,
            task_queue=CONTROL_TASK_QUEUE,
        )
        snapshot_md = await client.get_workflow_handle(standalone).query(
            "__temporal_workflow_metadata", result_type=WorkflowMetadata
        )
        return group_md, snapshot_md

    group_md, snapshot_md = asyncio.run(metadata())
    job.release(lease)
    definition = group_md.definition
    handlers = [  # the SDK's own queries (stack traces, this metadata) aside
        h
        for h in (
            *definition.signal_definitions,
            *definition.update_definitions,
            *definition.query_definitions,
        )
        if not h.name.startswith("__")
    ]
    assert {h.name for h in handlers} == {
        m.value for kind in (GroupSignal, GroupUpdate, GroupQuery) for m in kind
    }
    assert all(h.description for h in handlers), [h.name for h in handlers if not h.description]
    assert "**holder**: explained" in group_md.current_details
    assert snapshot_md.current_details == f"**snapshot** job explained on {job.task_queue}"


def test_job_without_backend_is_never_evicted(address, group, make_client):
    plain = make_client(job_id="plain")
    other = make_client(job_id="other", snapshot_backends=["noop"])
    plain.release(plain.acquire(group))
    other.release(other.acquire(group))
    status = plain.group_status(group)
    assert status.stats.evictions == 0 and status.stats.switches == 0


def test_waiting_ages_priority_so_nothing_starves(address, group, tmp_path, make_client):
    """With aging_s=0.5, a priority-0 waiter that waited 2 s outranks a fresh priority-2 one."""

    async def create_group() -> None:
        client = await _raw_client(address)
        config = GroupInput(config=GroupConfig(group_id=group, aging_s=0.5))
        await client.start_workflow(
            GROUP_WORKFLOW_TYPE,
            config.model_dump(mode="json"),
            id=group_workflow_id(group),
            task_queue=CONTROL_TASK_QUEUE,
        )

    asyncio.run(create_group())
    holder = make_client(job_id="holder")
    lease = holder.acquire(group)
    log = tmp_path / "ageing.jsonl"
    patient = spawn_contender(address, group, "patient", log, "--hold", "0.01")

    def patient_waited(seconds: float) -> bool:
        queue = holder.group_status(group).queue
        return bool(queue) and queue[0].job_id == "patient" and queue[0].waited_s >= seconds

    wait_for(lambda: patient_waited(2.0), what="patient waited 2 s")
    urgent = spawn_contender(address, group, "urgent", log, "--priority", "2", "--hold", "0.01")
    wait_for(lambda: "urgent" in queued_jobs(holder, group), what="urgent queued")
    holder.release(lease)
    finish([patient, urgent])
    order = [r["job"] for r in sorted(events(log, "acquired"), key=lambda r: r["t"])]
    assert order == ["patient", "urgent"]


def test_torch_state_is_evicted_and_restored_on_every_switch(address, group, tmp_path):
    pytest.importorskip("torch")
    log = tmp_path / "torch.jsonl"
    # Both start contending together (loading torch takes a while), so every release has a
    # waiter and the holder alternates.
    args = ["--iterations", "4", "--hold", "0.05", "--torch-mb", "4", "--start-with", "2"]
    procs = [spawn_contender(address, group, job, log, *args) for job in ("ta", "tb")]
    finish(procs)
    assert not events(log, "corrupt")  # each process checks its state after every grant
    intervals = hold_intervals(read_log(log))
    assert_no_overlap(intervals)
    holders = [i.job for i in sorted(intervals, key=lambda i: i.start)]
    changes = sum(1 for a, b in itertools.pairwise(holders) if a != b)
    with TimeSliceOrchestratorClient(target=address) as client:
        stats = client.group_status(group).stats
    assert changes >= 3
    # Every change of holder evicts the previous one, except possibly the last: a process
    # that finished first departs, taking its state with it, so there is nothing to evict.
    assert stats.evictions in (changes - 1, changes)
    assert stats.evictions + stats.departed >= changes
    assert stats.restores == changes - 1  # the second job's first grant had nothing saved
    assert stats.bytes_moved == (stats.evictions + stats.restores) * 4 * 1024 * 1024


def test_closed_job_departs_and_is_not_evicted(address, group, make_client):
    leaver = make_client(job_id="leaver", snapshot_backends=["noop"])
    leaver.release(leaver.acquire(group))
    leaver.close()
    stayer = make_client(job_id="stayer", snapshot_backends=["noop"])
    wait_for(lambda: stayer.group_status(group).stats.departed == 1, what="leaver departed")
    stayer.release(stayer.acquire(group, timeout=30))
    stats = stayer.group_status(group).stats
    assert (stats.evictions, stats.restores, stats.snapshot_failures) == (0, 0, 0)


def test_resident_job_killed_is_forgotten_not_waited_for(address, group, tmp_path, make_client):
    log = tmp_path / "killed.jsonl"
    victim = spawn_contender(
        address, group, "victim", log, "--backend", "noop", "--ttl", "3", "--hold-forever"
    )
    wait_for(lambda: events(log, "acquired", "victim"), what="victim holds the group")
    next_job = make_client(job_id="next", snapshot_backends=["noop"], lease_ttl=5)
    # The grant reaches the process before the group hears it was taken (its TTL starts then);
    # a kill in between would end the lease as an undelivered grant, not by expiry.
    wait_for(
        lambda: (h := next_job.group_status(group).holder) and h.expires_in_s is not None,
        what="the group saw the victim take its grant",
    )
    victim.kill()  # SIGKILL: no release, no depart; its lease must expire, its state is gone
    victim.wait()
    next_job.release(next_job.acquire(group, timeout=120))
    status = next_job.group_status(group)
    assert status.stats.expired == 1
    assert status.stats.departed == 1 and status.stats.evictions == 0
    assert status.faulted_jobs == {}


def _switch_schedules(address: str, group: str) -> list[tuple[str, int]]:
    """(activity type, completed-task event id that scheduled it) for every snapshot / restore."""

    async def fetch() -> list[tuple[str, int]]:
        client = await _raw_client(address)
        history = await client.get_workflow_handle(group_workflow_id(group)).fetch_history()
        return [
            (
                e.activity_task_scheduled_event_attributes.activity_type.name,
                e.activity_task_scheduled_event_attributes.workflow_task_completed_event_id,
            )
            for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name
            in ("timeslice.snapshot", "timeslice.restore")
        ]

    return asyncio.run(fetch())


@pytest.mark.parametrize(("memory", "overlapped"), [(10, True), (7, False)])
def test_switch_overlaps_only_when_both_states_fit(address, group, make_client, memory, overlapped):
    creator = make_client()
    assert creator.create_group(group, memory_bytes=memory) is True
    assert creator.create_group(group, memory_bytes=memory) is False  # settings are fixed
    a = make_client(
        job_id="oa", state_bytes=4, snapshot_backends=[SimulatedBackend(nbytes=4, snapshot_s=0.2)]
    )
    b = make_client(
        job_id="ob", state_bytes=4, snapshot_backends=[SimulatedBackend(nbytes=4, snapshot_s=0.2)]
    )
    a.release(a.acquire(group))
    b.release(b.acquire(group))  # evicts A; B has nothing to restore
    a.release(a.acquire(group))  # evicts B and restores A

    def settled():  # an overlapped eviction is counted when it is done, after the grant
        stats = a.group_status(group).stats
        return stats if stats.evictions == 2 else None

    stats = wait_for(settled, what="both evictions counted")
    assert stats.restores == 1
    # Overlapped: both switches evict beside the grant; sequential: neither.
    assert stats.overlapped_switches == (2 if overlapped else 0)
    first, *second_switch = _switch_schedules(address, group)
    assert first[0] == "timeslice.snapshot"  # A out
    scheduled = dict(second_switch)  # B out, A back in
    assert set(scheduled) == {"timeslice.snapshot", "timeslice.restore"}
    # Overlapped: one workflow task schedules both; sequential: the restore waits for the evict.
    assert (scheduled["timeslice.snapshot"] == scheduled["timeslice.restore"]) is overlapped


def test_group_settings_are_validated(address, make_client):
    with pytest.raises(InvalidArgumentError, match="invalid group settings"):
        make_client().create_group("settings-check", memory_bytes=-1)
    with pytest.raises(InvalidArgumentError, match="invalid group settings"):
        make_client().create_group("settings-check", colour="blue")
