"""Forged grant and fault notices are refused, and the real grant is still taken (issue 20).

`timeslice status` shows every waiting request id and the holder's token. Before grants
carried proof, a `timeslice_grant` signal naming them made a queued RL job run its prepare
inside another job's lease (3 s of overlap), after which it dropped the real grant and the
group idled for its TTL; a forged fault notice failed the job. Here a real RLJobWorkflow, a
real client process and a real group meet each forgery a namespace writer can send.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.worker import Worker
from timeslice.errors import AcquireTimeoutError
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import (
    DELIVER_GRANT_ACTIVITY,
    GRANT_SIGNAL,
    AcquireAnswer,
    AcquireCall,
    AcquireRequest,
    GrantAck,
    GrantNotice,
    GroupStatus,
    LeaseOutcome,
    LeaseRecord,
    LeaseReturn,
    QueueTarget,
    RenewRequest,
    RenewResult,
    ReturnAnswer,
    SnapshotTarget,
    group_workflow_id,
    job_task_queue,
    lease_key_hash,
    prove_notice,
)
from timeslice.protocol.rl_job import RLJobProgress, RLJobResult, rl_job_workflow_id
from timeslice.snapshot import NoopBackend
from timeslice.transport.updates import send_update
from timeslice.workers.sandbox import workflow_runner

from tests.conftest import start_service, stop_process
from tests.forger_workflows import GrantForgerWorkflow, RogueGroupWorkflow
from tests.helpers import wait_for

FAST = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05}
FORGER_QUEUE = "test-forgers"


@pytest.fixture
def job_process(address: str, tmp_path: Path) -> Iterator[Callable[[str], None]]:
    """Start a `timeslice job worker` (simulated workload) for a job; stopped at the end."""
    procs: list[subprocess.Popen] = []

    def start(job_id: str) -> None:
        args = ["job", "worker", "--address", address, "--job-id", job_id]
        args += ["--workload", "simulated", "--threads", "1"]
        args += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
        procs.append(start_service(args, f"job {job_id} rank 0", tmp_path / f"{job_id}.log"))

    yield start
    for proc in procs:
        stop_process(proc)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def forgeries(notice: GrantNotice) -> list[GrantNotice]:
    """What a caller who read `status` can send: no proof, a made-up one, a fault."""
    return [
        notice,
        notice.model_copy(update={"proof": "0" * 64}),
        notice.model_copy(update={"fault": f"job {notice.job_id}: restore failed (forged)"}),
    ]


def lease_of(history: list[LeaseRecord], job: str) -> LeaseRecord:
    [record] = [r for r in history if r.job_id == job]
    return record


async def eventually(probe: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    """Await ``probe()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await probe()):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)
    return value


async def _connect(address: str) -> Client:
    return await Client.connect(address, data_converter=pydantic_data_converter)


def test_a_queued_rl_job_drops_forged_grants_and_faults_and_takes_the_real_grant(
    address: str, job_process: Callable[[str], None], group: str, make_client: Callable[..., Any]
) -> None:
    job = unique("forged")
    job_process(job)
    holder = make_client(job_id=unique("holder"))
    held = holder.acquire(group, timeout=60)
    config = {
        "job_id": job,
        "workload": "simulated",
        "workload_options": FAST,
        "sampler_group": group,
        "epochs": 1,
        "max_failures": 0,
    }

    async def forge() -> tuple[str, RLJobProgress]:
        client = await _connect(address)
        handle = await start_rl_job(client, parse_job_config(config))
        group_handle = client.get_workflow_handle(group_workflow_id(group))

        async def queued_behind_holder() -> GroupStatus | None:
            with contextlib.suppress(RPCError):  # the group may not exist yet
                status = await group_handle.query("status", result_type=GroupStatus)
                return status if any(w.job_id == job for w in status.queue) else None
            return None

        status = await eventually(queued_behind_holder, "the job's request in the queue")
        queued = [w for w in status.queue if w.job_id == job]
        assert status.holder is not None and status.holder.token == held.token
        notice = GrantNotice(
            group_id=group,
            request_id=queued[0].request_id,
            job_id=job,
            reply_workflow_id=rl_job_workflow_id(job),
            token=status.holder.token,
            ttl_s=20.0,
            waited_s=1.0,
        )
        for forged in forgeries(notice):
            await handle.signal(GRANT_SIGNAL, forged)
        # And one for a request the job never made: dropped, and counted as forged too (it
        # used to be dropped uncounted).
        never_made = notice.model_copy(update={"request_id": f"{job}:never-made"})
        await handle.signal(GRANT_SIGNAL, never_made)

        async def counted() -> RLJobProgress | None:
            seen = await handle.query("progress", result_type=RLJobProgress)
            done_waiting = not seen.phase.startswith("waiting for")
            return seen if seen.forged_notices >= 4 or done_waiting else None

        seen = await eventually(counted, "the job to count the forged notices")
        # Still waiting, still queued: no forgery consumed the wait or failed the job.
        status = await group_handle.query("status", result_type=GroupStatus)
        assert [w.request_id for w in status.queue if w.job_id == job] == [queued[0].request_id]
        return queued[0].request_id, seen

    _, seen = asyncio.run(forge())
    assert seen.forged_notices == 4
    assert seen.status != "failed" and seen.phase == f"waiting for {group} (prepare)"
    assert seen.phase_s.get("prepare", 0.0) == 0.0  # prepare did not run in the holder's lease

    holder.release(held)

    async def finish() -> RLJobResult:
        client = await _connect(address)
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
        return await handle.result()

    done = asyncio.run(finish())
    assert done.epochs_done == 1 and not done.stopped
    history = holder.group_status(group).history
    first = lease_of(history, holder.job_id)
    jobs = [r for r in history if r.job_id == job]
    assert jobs and all(r.start >= first.end and r.token > first.token for r in jobs)
    assert all(r.outcome is LeaseOutcome.RELEASED for r in history)


async def request_in_history(client: Client, group: str, job: str) -> AcquireRequest:
    """The job's request as the group's history holds it (with its key hash): what any reader
    of the namespace's histories sees, unless payloads are encrypted."""
    handle = client.get_workflow_handle(group_workflow_id(group))
    async for event in handle.fetch_history_events():
        if not event.HasField("workflow_execution_update_accepted_event_attributes"):
            continue
        accepted = event.workflow_execution_update_accepted_event_attributes.accepted_request
        if accepted.input.name != "acquire":
            continue
        [payload] = accepted.input.args.payloads
        call = AcquireCall.model_validate_json(payload.data)
        if call.request.job_id == job:
            return call.request
    raise AssertionError(f"no request of {job} in the history of {group}")


async def _request_of(address: str, group: str, job: str) -> AcquireRequest:
    return await request_in_history(await _connect(address), group, job)


FORGERIES = 20


def test_forged_grants_with_a_proof_read_off_the_history_cost_a_job_nothing(
    address: str, job_process: Callable[[str], None], group: str, make_client: Callable[..., Any]
) -> None:
    """A namespace reader lifts a queued RL job's key hash from the group's history and signs
    grants with it: the job takes each (the proof holds), its process refuses it before any
    work (the group's holder is another), and the job asks the group again, finds its request
    still queued, counts the grant as forged and waits for the real one. It used to cost a
    rewind each, and with max_failures=0 the first one failed the job; so did a fault notice
    so signed."""
    job = unique("proven-forgeries")
    job_process(job)
    holder = make_client(job_id=unique("holder"))
    held = holder.acquire(group, timeout=60)
    config = {
        "job_id": job,
        "workload": "simulated",
        "workload_options": FAST,
        "sampler_group": group,
        "epochs": 1,
        "max_failures": 0,
    }

    async def forge() -> RLJobProgress:
        client = await _connect(address)
        handle = await start_rl_job(client, parse_job_config(config))
        group_handle = client.get_workflow_handle(group_workflow_id(group))

        async def queued() -> bool:
            with contextlib.suppress(RPCError):
                status = await group_handle.query("status", result_type=GroupStatus)
                return any(w.job_id == job for w in status.queue)
            return False

        await eventually(queued, "the job's request in the queue")
        request = await request_in_history(client, group, job)
        for i in range(1, FORGERIES + 1):
            notice = GrantNotice(
                group_id=group,
                request_id=request.request_id,
                job_id=job,
                reply_workflow_id=rl_job_workflow_id(job),
                token=held.token,  # what `timeslice status` shows
                ttl_s=20.0,
                waited_s=1.0,
            )
            await handle.signal(GRANT_SIGNAL, prove_notice(notice, request.key_hash))

            async def counted(i: int = i) -> RLJobProgress | None:
                seen = await handle.query("progress", result_type=RLJobProgress)
                return seen if seen.forged_notices >= i else None

            await eventually(counted, f"forgery {i} refused and counted")
        # And a fault notice so signed: it used to fail the job (JobFaulted) at once.
        fault = notice.model_copy(update={"fault": f"job {job}: restore failed (forged)"})
        await handle.signal(GRANT_SIGNAL, prove_notice(fault, request.key_hash))

        async def fault_counted() -> RLJobProgress | None:
            seen = await handle.query("progress", result_type=RLJobProgress)
            return seen if seen.forged_notices > FORGERIES else None

        await eventually(fault_counted, "the forged fault dropped and counted")
        return await handle.query("progress", result_type=RLJobProgress)

    seen = asyncio.run(forge())
    assert seen.forged_notices == FORGERIES + 1 and seen.status == "running"
    assert seen.rewinds == 0 and seen.phase_s.get("prepare", 0.0) == 0.0
    holder.release(held)

    async def finish() -> RLJobResult:
        client = await _connect(address)
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
        return await handle.result()

    done = asyncio.run(finish())
    print(f"\n{FORGERIES} proven forgeries: {done.rewinds} rewinds, epochs {done.epochs_done}")
    assert done.epochs_done == 1 and done.rewinds == 0
    history = holder.group_status(group).history
    first = lease_of(history, holder.job_id)
    assert all(r.start >= first.end for r in history if r.job_id == job)


async def _deliver(address: str, task_queue: str, notices: list[GrantNotice]) -> list[GrantAck]:
    client = await _connect(address)
    async with Worker(
        client,
        task_queue=FORGER_QUEUE,
        workflows=[GrantForgerWorkflow],
        workflow_runner=workflow_runner(),
    ):
        return await client.execute_workflow(
            GrantForgerWorkflow.run,
            args=[task_queue, notices],
            id=unique("grant-forger"),
            task_queue=FORGER_QUEUE,
            result_type=list[GrantAck],
        )


def test_a_client_waiting_for_a_group_declines_forged_grant_activities(
    address: str, group: str, make_client: Callable[..., Any]
) -> None:
    holder = make_client(job_id=unique("holder"))
    held = holder.acquire(group, timeout=60)
    waiter = make_client(job_id=unique("waiter"))
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(waiter.acquire, group, 120)
        status: GroupStatus = wait_for(
            lambda: (s := holder.group_status(group)).queue and s,
            what="the waiter's request in the group's queue",
        )
        [queued] = status.queue
        assert status.holder is not None
        notice = GrantNotice(
            group_id=group,
            request_id=queued.request_id,
            job_id=waiter.job_id,
            reply_task_queue=waiter.task_queue,
            token=status.holder.token,
            ttl_s=20.0,
            waited_s=1.0,
        )
        # And signed with the request's key hash, as a reader of the group's history can: the
        # process asks the group before it uses either (the group holds neither).
        request = asyncio.run(_request_of(address, group, waiter.job_id))
        proven = [
            prove_notice(n, request.key_hash)
            for n in (notice, notice.model_copy(update={"fault": "restore failed (forged)"}))
        ]
        acks = asyncio.run(_deliver(address, waiter.task_queue, [*forgeries(notice), *proven]))
        assert [a.accepted for a in acks] == [False] * 5 and all(a.key is None for a in acks)
        inbox = waiter._engine.session.inbox
        assert (inbox.forged, inbox.not_held) == (4, 1)
        assert not pending.done()  # neither granted nor failed by a forged fault
        assert [w.request_id for w in holder.group_status(group).queue] == [queued.request_id]
        holder.release(held)
        lease = pending.result(timeout=120)
    assert lease.request_id == queued.request_id and lease.token > held.token
    waiter.release(lease)
    history = holder.group_status(group).history
    assert lease_of(history, waiter.job_id).start >= lease_of(history, holder.job_id).end


def test_a_made_up_answer_to_a_clients_acquire_is_not_a_lease(
    address: str, make_client: Callable[..., Any]
) -> None:
    """Whoever stands at a group's workflow id answers its updates; an answer without the
    proof of the request it answers is refused, and the client asks again."""
    group = unique("rogue")

    async def stand_in(run_client: Callable[[Client], Any]) -> Any:
        client = await _connect(address)
        async with Worker(
            client,
            task_queue=FORGER_QUEUE,
            workflows=[RogueGroupWorkflow],
            workflow_runner=workflow_runner(),
        ):
            handle = await client.start_workflow(
                RogueGroupWorkflow.run, id=group_workflow_id(group), task_queue=FORGER_QUEUE
            )
            try:
                result = await asyncio.to_thread(run_client)
                answered = await handle.query("answered", result_type=int)
            finally:
                await handle.terminate()
            return result, answered

    waiter = make_client(job_id=unique("waiter"))

    def acquire() -> BaseException | None:
        try:
            waiter.acquire(group, timeout=20)
        except AcquireTimeoutError as err:
            return err
        return None

    timed_out, answered = asyncio.run(stand_in(acquire))
    assert isinstance(timed_out, AcquireTimeoutError)
    assert waiter.held == {}
    assert waiter._engine.session.inbox.forged >= 2 and answered >= 2  # it asked again, and again


@pytest.mark.parametrize("forged", ["failure", "refusal"])
def test_a_forged_outcome_of_a_grants_delivery_does_not_end_the_lease_its_process_took(
    address: str, group: str, make_client: Callable[..., Any], forged: str
) -> None:
    """Anyone in the namespace can complete or fail an activity by its id. A process took its
    grant and has not answered yet; a forged failure or refusal of that delivery must not end
    its lease (the group used to grant the next waiter at once: two holders)."""
    holder = make_client(job_id=unique("holder"))
    holder.create_group(group, max_parked_waits=0)  # every grant by activity
    held = holder.acquire(group, timeout=60)
    later = make_client(job_id=unique("later"))
    slow, key = unique("slow"), "the-slow-process's-own-key-0123"
    rid = f"{slow}:r"

    async def scenario() -> tuple[GrantNotice, Any, GroupStatus]:
        client = await _connect(address)
        group_id = group_workflow_id(group)
        handle = client.get_workflow_handle(group_id)
        took, answer = asyncio.Event(), asyncio.Event()
        notices: list[GrantNotice] = []

        # A process that takes its grant and is slow to say so (a loaded machine).
        @activity.defn(name=DELIVER_GRANT_ACTIVITY)
        async def deliver_grant(notice: GrantNotice) -> GrantAck:
            notices.append(notice)
            took.set()
            await answer.wait()
            return GrantAck(accepted=True, key=key)

        async with Worker(client, task_queue=job_task_queue(slow), activities=[deliver_grant]):
            try:
                request = AcquireRequest(
                    request_id=rid,
                    key_hash=lease_key_hash(key),
                    job_id=slow,
                    reply_task_queue=job_task_queue(slow),
                )
                call = AcquireCall(request=request, park=False)
                await send_update(client, group_id, "acquire", call, AcquireAnswer)
                waiting = asyncio.create_task(asyncio.to_thread(later.acquire, group, 120))

                async def both_queued() -> bool:
                    status = await handle.query("status", result_type=GroupStatus)
                    return {w.job_id for w in status.queue} == {slow, later.job_id}

                await eventually(both_queued, "both requests queued")
                await asyncio.to_thread(holder.release, held)
                await asyncio.wait_for(took.wait(), timeout=120)
                [notice] = notices
                description = await handle.describe()
                [delivery] = description.raw_description.pending_activities
                outcome = client.get_async_activity_handle(
                    workflow_id=group_id,
                    run_id=description.run_id,
                    activity_id=delivery.activity_id,
                )
                if forged == "failure":
                    await outcome.fail(RuntimeError("forged: the process is gone"))
                else:
                    await outcome.complete(GrantAck(accepted=False))
                after = await handle.query("status", result_type=GroupStatus)
                # The process that took the grant proves it holds: its renewal is valid.
                renew = RenewRequest(request_id=rid, token=notice.token, key=key)
                renewed = await send_update(client, group_id, "renew", renew, RenewResult)
                assert renewed.valid, renewed.reason
                assert not waiting.done()
                ret = LeaseReturn(request_id=rid, token=notice.token, key=key)
                returned = await send_update(client, group_id, "release_lease", ret, ReturnAnswer)
                assert returned.valid and returned.released
                return notice, await waiting, after
            finally:
                answer.set()

    notice, lease, after = asyncio.run(scenario())
    assert after.holder is not None and after.holder.token == notice.token  # not ended
    assert [w.job_id for w in after.queue] == [later.job_id]  # and nobody else granted
    assert after.stats.forged_messages == (1 if forged == "refusal" else 0)
    assert lease.token > notice.token
    later.release(lease)
    history = later.group_status(group).history
    assert [(r.job_id, r.outcome) for r in history] == [
        (holder.job_id, LeaseOutcome.RELEASED),
        (slow, LeaseOutcome.RELEASED),
        (later.job_id, LeaseOutcome.RELEASED),
    ]
    assert lease_of(history, later.job_id).start >= lease_of(history, slow).end


def test_a_request_naming_another_jobs_queue_cannot_move_that_jobs_state(
    address: str, group: str, make_client: Callable[..., Any]
) -> None:
    """A request may name any job and any snapshot target. One for a made-up job whose target
    is another job's process queue used to make the group's eviction of the made-up job move
    the other job's state out (the process ignored the call's job), after which that job was
    granted without its state and never restored."""
    victim_backend = NoopBackend()
    observer = make_client(job_id=unique("observer"))
    observer.create_group(group)
    victim = make_client(job_id=unique("victim"), snapshot_backends=[victim_backend])
    fake = unique("fake")
    victims_queue = SnapshotTarget(
        queues=[QueueTarget(task_queue=victim.task_queue, backends=["noop"])]
    )

    async def request_as_fake_job() -> None:
        client = await _connect(address)
        request = AcquireRequest(
            request_id=f"{fake}:r",
            key_hash=lease_key_hash("the-fake-jobs-own-key-0123456"),
            job_id=fake,
            # Nobody takes its grant (no such workflow): it ends at once, its job resident.
            reply_workflow_id=unique("nobody"),
            snapshot=victims_queue,
        )
        await client.get_workflow_handle(group_workflow_id(group)).signal("request", request)

    asyncio.run(request_as_fake_job())
    wait_for(
        lambda: (s := observer.group_status(group)).resident_job == fake and s.holder is None,
        what="the made-up job resident",
    )
    victim.release(victim.acquire(group, timeout=120))  # the group evicts the made-up job first
    status = observer.group_status(group)
    assert victim_backend.snapshots == 0  # the victim's state was not moved for it
    assert fake in status.faulted_jobs and "WrongJob" in status.faulted_jobs[fake]
    assert status.stats.snapshot_failures == 1
