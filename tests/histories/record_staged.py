"""Record a GpuGroupWorkflow history with a staged restore: while one job holds the group, the
group brings the next waiter's state onto the device (both fit in its declared memory), and that
waiter's grant moves nothing.

    .venv/bin/python -m tests.histories.record_staged

Two "jobs" (this recorder, speaking the group's updates; job b's snapshot activities served
here by the job processes' own ``SnapshotActivities`` over a ``simulated`` backend). b holds the
group (reporting a 0.1-s restore of its own), releases evicting itself as a waits, and reports
that eviction; a holds; b asks again.
The group restores b's state while a holds (the `staged-restores` patch); a releases, b is
granted with nothing to restore, and releases. The history, `gpu_group_staged_run0.json`, holds
the patch's marker; `tests/test_replay.py` replays it and checks that the marker is there.
Re-record only when the workflow changes on purpose; the other recorders leave this file alone.
Recorded before the `patches-at-start` patch: a group recorded now asks no other patch, so
re-recording would lose the marker this file is kept for (``record_patches_at_start.py``
records the same run down that patch's branch).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker
from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.protocol.group import (
    AcquireAnswer,
    AcquireCall,
    AcquireRequest,
    GroupConfig,
    GroupStatus,
    GroupUpdate,
    LeaseReturn,
    MovedReport,
    QueueTarget,
    ReturnAnswer,
    SnapshotReport,
    SnapshotTarget,
    group_workflow_id,
    job_task_queue,
    lease_key_hash,
)
from timeslice.session.snapshot_activities import SnapshotActivities
from timeslice.snapshot.simulated import SimulatedBackend

from tests.conftest import start_worker, stop_process

HERE = Path(__file__).resolve().parent
OUT = HERE / "gpu_group_staged_run0.json"
GROUP = "recorded-staged"
STATE = 1 << 20
MEMORY = 2 * STATE  # both jobs' states


def _request(job: str, n: int) -> AcquireRequest:
    return AcquireRequest(
        request_id=f"{job}-{n}",
        job_id=job,
        reply_task_queue=job_task_queue(job),
        key_hash=lease_key_hash(_key(job)),
        snapshot=SnapshotTarget(
            queues=[QueueTarget(task_queue=job_task_queue(job), backends=["simulated"])]
        ),
        state_bytes=STATE,
        restores_itself=True,
    )


def _key(job: str) -> str:
    return f"the-lease-key-of-job-{job}"


def _evicted(job: str) -> MovedReport:
    report = SnapshotReport(job_id=job, backend="simulated", mode="simulated", bytes=STATE,
                            seconds=0.01)  # fmt: skip
    return MovedReport(job_id=job, key=_key(job), evicted=[report])


async def drive(address: str, out: Path) -> None:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    await start_group(client, GroupConfig(group_id=GROUP, memory_bytes=MEMORY))
    group = client.get_workflow_handle(group_workflow_id(GROUP))

    async def acquire(job: str, n: int) -> AcquireAnswer:
        call = AcquireCall(request=_request(job, n))
        return await group.execute_update(GroupUpdate.ACQUIRE, call, result_type=AcquireAnswer)

    async def status_until(done: object) -> GroupStatus:
        for _ in range(600):
            status = await group.query("status", result_type=GroupStatus)
            if done(status):  # type: ignore[operator]
                return status
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the group never got there: {status}")

    async def release(
        job: str, n: int, token: int, restored: list[SnapshotReport] | None = None
    ) -> ReturnAnswer:
        ret = LeaseReturn(request_id=f"{job}-{n}", token=token, key=_key(job), evicts_itself=True,
                          restored=restored or [])  # fmt: skip
        return await group.execute_update(GroupUpdate.RELEASE, ret, result_type=ReturnAnswer)

    b1 = await acquire("b", 1)
    assert b1.notice is not None, b1
    a_waits = asyncio.ensure_future(acquire("a", 1))
    await status_until(lambda s: s.queue)
    # b restored its own state in its lease (0.1 s): long enough for the group to stage the next.
    restored = SnapshotReport(job_id="b", backend="simulated", mode="simulated", bytes=STATE,
                              seconds=0.1)  # fmt: skip
    assert (await release("b", 1, b1.notice.token, [restored])).evict
    a1 = await asyncio.wait_for(a_waits, 60)
    assert a1.notice is not None, a1
    await group.execute_update(GroupUpdate.MOVED, _evicted("b"))
    b_waits = asyncio.ensure_future(acquire("b", 2))
    # While a holds, the group restores b's state beside a's.
    await status_until(lambda s: s.stats.staged_restores == 1)
    assert (await release("a", 1, a1.notice.token)).evict
    b2 = await asyncio.wait_for(b_waits, 60)
    assert b2.notice is not None, b2
    await group.execute_update(GroupUpdate.MOVED, _evicted("a"))
    await group.execute_update(
        GroupUpdate.RELEASE,
        LeaseReturn(request_id="b-2", token=b2.notice.token, key=_key("b")),
        result_type=ReturnAnswer,
    )
    status = await group.query("status", result_type=GroupStatus)
    assert status.resident_job == "b" and status.stats.staged_restores == 1, status
    assert status.stats.restores == 2 and not status.faulted_jobs, status
    out.write_text((await group.fetch_history()).to_json())


async def serve_b_and_drive(address: str, out: Path) -> None:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    backend = SimulatedBackend(nbytes=STATE, snapshot_s=0.01)
    moves = SnapshotActivities({"simulated": backend}, job_id="b")
    async with Worker(
        client,
        task_queue=job_task_queue("b"),
        activities=[moves.snapshot, moves.restore],
    ):
        await drive(address, out)


def main(out: Path = OUT) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        worker = start_worker(server.address, Path(tmp) / "worker.log")
        try:
            asyncio.run(serve_b_and_drive(server.address, out))
            print(f"wrote {out}")
        finally:
            stop_process(worker)
            server.stop()


if __name__ == "__main__":
    main()
