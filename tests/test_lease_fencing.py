"""One holder at a time under every fault, for the leases an RL job works under.

Every check here is on the processes' own CLOCK_MONOTONIC records: the job process logs each
use of the device (tests/fenced_workload.py), contenders log their holds (tests/contender.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker
from timeslice import TimeSliceOrchestratorClient
from timeslice.activities.group_requests import draw_secret, renew_lease, request_group
from timeslice.activities.job_runtime import FENCED_EXIT_STATUS
from timeslice.cli.stack import Stack
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import LeaseOutcome, job_task_queue
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    PREPARE_ACTIVITY,
    SAMPLE_ACTIVITY,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.report import collect_report
from timeslice.transport.connection import connect, connect_config
from timeslice.workers.sandbox import workflow_runner

from tests.conftest import start_service, stop_process
from tests.fenced_workload import LOG_ENV
from tests.helpers import Interval, finish, hold_intervals, read_log, spawn_contender, wait_for
from tests.requester_workflows import ForgedPhaseWorkflow
from tests.test_soak import TcpProxy

WORKLOAD = "tests.fenced_workload:create"
FAST = {"sample_s": 0.05, "reward_s": 0.05, "train_s": 0.05}


def _job_worker(address: str, job: str, workload: str, tmp: Path, *extra: str) -> subprocess.Popen:
    return start_service(
        ["job", "worker", "--address", address, "--job-id", job, "--workload", workload,
         "--checkpoint-dir", str(tmp / "checkpoints"), "--threads", "1", *extra],
        f"job {job} rank 0",
        tmp / f"{job}.log",
    )  # fmt: skip


def _device_intervals(log: Path, died_at: float | None = None) -> list[Interval]:
    """The job process's uses of the device: each start to its end (same process); one left
    open by a process that exited ends at ``died_at``."""
    open_by_pid: dict[int, dict] = {}
    found = []
    for r in read_log(log):
        if r["event"] == "start":
            assert r["pid"] not in open_by_pid, f"{r} started inside another use"
            open_by_pid[r["pid"]] = r
        elif r["event"] == "end":
            start = open_by_pid.pop(r["pid"])
            found.append(Interval(f"{r['job']} {start['what']}", 0, start["t"], r["t"]))
    if died_at is not None and len(open_by_pid) == 1:
        [(_, start)] = open_by_pid.items()
        found.append(Interval(f"{start['job']} {start['what']}", 0, start["t"], died_at))
    elif open_by_pid:
        raise AssertionError(f"uses of the device that never ended: {open_by_pid}")
    return found


def _assert_apart(job: list[Interval], others: list[Interval]) -> None:
    for a in job:
        for b in others:
            assert a.end <= b.start or b.end <= a.start, f"{a} overlaps {b}"


def _events(log: Path, event: str, what: str | None = None) -> list[dict]:
    return [r for r in read_log(log) if r["event"] == event and what in (None, r.get("what"))]


def _start_job(address: str, config: dict[str, Any]) -> None:
    async def go() -> None:
        await start_rl_job(await connect(connect_config(address)), parse_job_config(config))

    asyncio.run(go())


def _job_result(address: str, job: str) -> RLJobResult:
    async def go() -> RLJobResult:
        client = await connect(connect_config(address))
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
        return await handle.result()

    return asyncio.run(go())


def _queued(address: str, group: str) -> bool:
    with TimeSliceOrchestratorClient(target=address) as client:
        return bool(client.group_status(group).queue)


@pytest.mark.parametrize("setup_checks", [True, False], ids=["setup-stops", "setup-ignores"])
def test_control_worker_outage_during_prepare_never_lets_two_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup_checks: bool
) -> None:
    """The control worker is killed (-9) while a job prepares under a lease its workflow holds
    (TTL 5 s), with a client waiting, and comes back 12 s later: the group then expires the
    job's lease and grants the client. The job process must have stopped preparing on its own,
    while nothing of Temporal's side ran — a setup that checks its context stops; one that never
    does is stopped by the process exiting. The job then rewinds and runs every epoch once."""
    with Stack(tmp_path).start() as stack:
        worker = stack.control_worker()
        device, holds, gate = tmp_path / "device.jsonl", tmp_path / "holds.jsonl", tmp_path / "go"
        monkeypatch.setenv(LOG_ENV, str(device))
        job, group = "outage", "gP"
        job_proc = stack.job_worker(job, WORKLOAD, "--threads", "1")
        options = {**FAST, "setup_until": str(gate), "setup_ignores_stop": not setup_checks}
        _start_job(stack.address, {
            "job_id": job, "workload": WORKLOAD, "sampler_group": group, "epochs": 2,
            "lease_ttl_s": 5, "workload_options": options,
        })  # fmt: skip
        wait_for(lambda: _events(device, "start", "setup"), timeout=120, what="the job's setup")
        [client] = stack.adopt(
            spawn_contender(stack.address, group, "client", holds, "--hold", "1")
        )
        wait_for(lambda: _queued(stack.address, group), timeout=180, what="the client queued")
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        killed = time.monotonic()
        # Nothing of Temporal's side runs now: the job process stops by its own reckoning.
        exited_at = None
        if setup_checks:
            [stopped] = wait_for(
                lambda: _events(device, "stopped", "setup"), timeout=60, what="the setup stopped"
            )
            stopped_at = stopped["t"]
        else:
            wait_for(lambda: job_proc.poll() is not None, timeout=60, what="the job process exit")
            stopped_at = exited_at = time.monotonic()  # no earlier than the exit itself
            assert job_proc.returncode == FENCED_EXIT_STATUS
            assert "did not stop when told to" in (tmp_path / f"{job}.log").read_text()
        assert stopped_at - killed < 5.0, "the setup ran on past its lease's TTL"
        # The outage is the fault itself, and must outlast the TTL; it is not waited on for
        # anything to happen.
        wait_for(lambda: time.monotonic() - killed >= 12.0, timeout=30, what="a 12-s outage")
        worker = stack.control_worker()
        gate.touch()  # the setup that comes after the rewind runs through
        if not setup_checks:  # as its supervisor would, once it exited
            stack.job_worker(job, WORKLOAD, "--threads", "1")
        finish([client], timeout=120)
        done = _job_result(stack.address, job)
        assert [r.epoch for r in done.records] == [0, 1] and done.epochs_done == 2
        assert done.rewinds >= 1
        client_holds = hold_intervals(read_log(holds))
        assert len(client_holds) == 1
        job_uses = _device_intervals(device, died_at=exited_at)
        assert len([u for u in job_uses if u.job.endswith("setup")]) == 2
        _assert_apart(job_uses, client_holds)
        # The client was granted only after the job's lease ended at the group: expired, or
        # (a renewal handled before the expiry renews it) released by the rewinding job.
        with TimeSliceOrchestratorClient(target=stack.address) as status_client:
            records = status_client.group_status(group).history
        [outage_lease] = [r for r in records if r.job_id == job][:1]
        client_starts = [r.start for r in records if r.job_id == "client"]
        assert client_starts and outage_lease.end <= min(client_starts), records
        assert outage_lease.outcome in (LeaseOutcome.EXPIRED, LeaseOutcome.RELEASED), records


def test_forged_phase_under_another_jobs_token_is_refused(
    address: str, tmp_path: Path, make_client: Any
) -> None:
    """A forger prepares a fresh job process under a lease of its own, then hands it a
    multi-rank phase "under" the lease another job holds — its token, read off `timeslice
    status`, with a made-up key. The process compares the key with the group's holder and
    refuses; the victim's lease is untouched."""
    job = f"forged-{uuid.uuid4().hex[:8]}"
    own, victim = f"own-{job}", f"victim-{job}"
    proc = _job_worker(address, job, "simulated", tmp_path)
    try:
        holder = make_client(job_id="victim")
        lease = holder.acquire(victim)
        assert holder.group_status(victim).holder.token == lease.token  # what status shows

        async def forge() -> list[str]:
            client = await connect(connect_config(address))
            queue = f"forger-{uuid.uuid4().hex[:8]}"
            async with Worker(
                client,
                task_queue=queue,
                workflows=[ForgedPhaseWorkflow],
                activities=[request_group, draw_secret, renew_lease],
                workflow_runner=workflow_runner(),
            ):
                return await client.execute_workflow(
                    ForgedPhaseWorkflow.run,
                    args=[job, own, victim, lease.token],
                    id=f"forger-{uuid.uuid4().hex[:8]}",
                    task_queue=queue,
                )

        described, prepared, sampled = asyncio.run(forge())
        assert (described, prepared) == ("ok", "ok")
        # Refused before any work, as the group's word says: GrantNotHeld (a job workflow asks
        # the group again rather than rewind).
        assert sampled.startswith("GrantNotHeld: ") and "not starting" in sampled, sampled
        assert "the lease key does not match" in sampled, sampled
        status = holder.group_status(victim)
        assert status.holder is not None and status.holder.token == lease.token
        holder.release(lease)
    finally:
        stop_process(proc)


async def _rogue_activities(job: str, garbage_in: str) -> list[Any]:
    """A poller on the job's task queue that is no job process: it answers like one, except
    that ``garbage_in``'s result is no valid result at all."""

    def answer(name: str, valid: dict[str, Any]) -> Any:
        @activity.defn(name=name)
        async def rogue(*_: Any) -> dict[str, Any]:
            return {"nonsense": True} if name == garbage_in else valid

        return rogue

    return [
        answer(DESCRIBE_ACTIVITY, {
            "workload": "simulated", "sampler_backends": ["sampler"],
            "trainer_backends": ["trainer"], "pid": 1, "ready": False, "epochs_done": None,
            "protocol": JOB_PROTOCOL_VERSION,
        }),
        answer(PREPARE_ACTIVITY, {"epochs_done": 0, "state_bytes": None}),
        answer(CHECKPOINT_ACTIVITY, {"epochs_done": 0, "path": "/nowhere"}),
        answer(SAMPLE_ACTIVITY, {}),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("garbage_in", "failure"),
    [(SAMPLE_ACTIVITY, "JobFailed"), (DESCRIBE_ACTIVITY, "InvalidResult")],
    ids=["phase", "describe"],
)
def test_a_malformed_activity_result_fails_the_job_not_its_workflow_task(
    address: str, group: str, garbage_in: str, failure: str
) -> None:
    job = f"rogue-{uuid.uuid4().hex[:8]}"

    async def go() -> tuple[BaseException, list[str]]:
        client = await connect(connect_config(address))
        async with Worker(
            client,
            task_queue=job_task_queue(job, 0),
            activities=await _rogue_activities(job, garbage_in),
        ):
            handle = await start_rl_job(client, parse_job_config({
                "job_id": job, "workload": "simulated", "sampler_group": group, "epochs": 1,
                "max_failures": 0,
            }))  # fmt: skip
            with pytest.raises(WorkflowFailureError) as failed:
                # A wedged job (its workflow task failing on every try) never ends: bounded.
                await asyncio.wait_for(handle.result(), 120)
        history = await handle.fetch_history()
        task_failures = [
            str(e.workflow_task_failed_event_attributes.failure.message)
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        ]
        # A report over the job (as over a namespace that holds it) reads what it can and
        # says what it left out; a raw ValidationError here once failed test_report's
        # namespace-wide report, when the two tests shared a server.
        report = await collect_report(client, groups=[], jobs=[job])
        notes.extend(j.note or "" for j in report.jobs)
        return failed.value.cause, task_failures

    notes: list[str] = []
    cause, task_failures = asyncio.run(go())
    if garbage_in == SAMPLE_ACTIVITY:
        assert notes == ["1 phase result(s) unreadable, left out"], notes
    assert task_failures == []
    assert isinstance(cause, ApplicationError) and cause.non_retryable
    assert cause.type == failure
    assert "returned an invalid" in cause.message and "nonsense" in cause.message, cause.message
    assert "polling the job's task queue" in cause.message


def test_job_worker_that_exits_departs_its_groups(
    address: str, group: str, tmp_path: Path, make_client: Any
) -> None:
    """A job process that exits normally takes its state with it: it tells its group, and the
    group's next holder waits for no eviction nobody would pick up (15 s, grant_ack_timeout_s)."""
    job = f"exits-{uuid.uuid4().hex[:8]}"
    # --keep-serving: the test ends it itself (SIGTERM), after it saw the job resident; a job
    # process that exits on its own when the run ends departs the same way (test_rl_jobs).
    proc = _job_worker(address, job, "simulated", tmp_path, "--keep-serving")
    try:
        _start_job(address, {
            "job_id": job, "workload": "simulated", "sampler_group": group, "epochs": 1,
            "workload_options": {**FAST, "state_bytes": 1024},
        })  # fmt: skip
        assert _job_result(address, job).epochs_done == 1
        client = make_client(job_id="next")
        assert client.group_status(group).resident_job == job
    finally:
        proc.send_signal(signal.SIGTERM)  # a normal exit (Ctrl-C does the same)
        assert proc.wait(timeout=60) == 0
    status = wait_for(
        lambda: (s := client.group_status(group)).resident_job is None and s,
        timeout=30,
        what="the group to forget the departed job",
    )
    assert status.stats.departed == 1
    lease = client.acquire(group, timeout=60)
    assert lease.waited_s < 5.0, f"the next holder waited {lease.waited_s:.1f} s"
    client.release(lease)


class StallingProxy(TcpProxy):
    """A TCP relay whose connections can all be stalled: while ``stalled``, nothing passes in
    either direction (it is held, not lost), as on a network path that stops forwarding."""

    stalled = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    while self.stalled:
                        await asyncio.sleep(0.02)
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_job_process_cut_off_from_temporal_stops_its_phase_in_time(
    address: str, group: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job process whose connection stalls mid-sample (TTL 6 s, heartbeat 10 s) cannot
    renew nor check its lease: it must stop the phase by its own bound before the group
    grants the waiting client, not when the phase would have ended."""
    job = f"stall-{uuid.uuid4().hex[:8]}"
    device, holds, gate = tmp_path / "device.jsonl", tmp_path / "holds.jsonl", tmp_path / "go"
    monkeypatch.setenv(LOG_ENV, str(device))
    with StallingProxy(address) as proxy:
        proc = _job_worker(proxy.address, job, WORKLOAD, tmp_path)
        client: subprocess.Popen | None = None
        try:
            _start_job(address, {
                "job_id": job, "workload": WORKLOAD, "sampler_group": group, "epochs": 1,
                "lease_ttl_s": 6, "heartbeat_timeout_s": 10,
                "workload_options": {**FAST, "sample_until": str(gate)},
            })  # fmt: skip
            wait_for(lambda: _events(device, "start", "sample 0"), timeout=120, what="sampling")
            client = spawn_contender(address, group, "client", holds, "--hold", "1")
            wait_for(lambda: _queued(address, group), timeout=180, what="the client queued")
            proxy.stalled = True
            stalled_at = time.monotonic()
            [stopped] = wait_for(
                lambda: _events(device, "stopped", "sample 0"), timeout=60, what="the stop"
            )
            assert stopped["t"] - stalled_at < 6.0, "the phase ran on past its lease's TTL"
            finish([client], timeout=120)  # granted once the job's lease expired, and done
            client = None
            proxy.stalled = False
            gate.touch()
            done = _job_result(address, job)
        finally:
            proxy.stalled = False
            if client is not None:
                client.kill()
            stop_process(proc)
    assert [r.epoch for r in done.records] == [0] and done.rewinds >= 1
    _assert_apart(_device_intervals(device), hold_intervals(read_log(holds)))
