"""Record a GpuGroupWorkflow history whose switch streams: the grant does not wait for the
holder's eviction although the group's memory holds only one of the two jobs' states.

    .venv/bin/python -m tests.histories.record_streamed

Two "jobs" (this recorder, speaking the group's updates) name one device room in their
snapshot targets, each declaring the group's whole memory. Job a holds the group; b waits
(restoring itself); a releases, evicting itself. The group grants b at once, before a's report
(the `streamed-switches` patch), telling b the declared memory; a reports its eviction after
b's grant; b releases. The history, `gpu_group_streamed_run0.json`, holds the patch's marker;
`tests/test_replay.py` replays it and checks that the marker is there. Re-record only when the
workflow changes on purpose; the other recorders leave this file alone.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
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

from tests.conftest import start_worker, stop_process

HERE = Path(__file__).resolve().parent
OUT = HERE / "gpu_group_streamed_run0.json"
GROUP = "recorded-streamed"
ROOM = "5d1f0c4e9a7b4e0f8c3a2b1d6e5f4a3b"
MEMORY = 1 << 30


def _request(job: str) -> AcquireRequest:
    return AcquireRequest(
        request_id=f"{job}-1",
        job_id=job,
        reply_task_queue=job_task_queue(job),
        key_hash=lease_key_hash(_key(job)),
        snapshot=SnapshotTarget(
            queues=[QueueTarget(task_queue=job_task_queue(job), backends=["simulated"], room=ROOM)]
        ),
        state_bytes=MEMORY,
        restores_itself=True,
    )


def _key(job: str) -> str:
    return f"the-lease-key-of-job-{job}"


async def drive(address: str) -> None:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    await start_group(client, GroupConfig(group_id=GROUP, memory_bytes=MEMORY))
    group = client.get_workflow_handle(group_workflow_id(GROUP))

    async def acquire(job: str) -> AcquireAnswer:
        return await group.execute_update(
            GroupUpdate.ACQUIRE, AcquireCall(request=_request(job)), result_type=AcquireAnswer
        )

    first = await acquire("a")
    assert first.notice is not None and first.notice.memory_bytes == MEMORY, first
    waiting = asyncio.ensure_future(acquire("b"))
    for _ in range(600):
        status = await group.query("status", result_type=GroupStatus)
        if status.queue:
            break
        await asyncio.sleep(0.1)
    answer = await group.execute_update(
        GroupUpdate.RELEASE,
        LeaseReturn(request_id="a-1", token=first.notice.token, key=_key("a"), evicts_itself=True),
        result_type=ReturnAnswer,
    )
    assert answer.evict, answer
    # Granted before a's report of its eviction: the restore streams behind it.
    second = await asyncio.wait_for(waiting, 60)
    assert second.notice is not None and second.notice.memory_bytes == MEMORY, second
    evicted = SnapshotReport(job_id="a", backend="simulated", mode="simulated", bytes=MEMORY,
                             seconds=0.1)  # fmt: skip
    await group.execute_update(
        GroupUpdate.MOVED, MovedReport(job_id="a", key=_key("a"), evicted=[evicted])
    )
    await group.execute_update(
        GroupUpdate.RELEASE,
        LeaseReturn(request_id="b-1", token=second.notice.token, key=_key("b")),
        result_type=ReturnAnswer,
    )
    status = await group.query("status", result_type=GroupStatus)
    assert status.stats.streamed_switches == 1 and status.resident_job == "b", status
    OUT.write_text((await group.fetch_history()).to_json())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        worker = start_worker(server.address, Path(tmp) / "worker.log")
        try:
            asyncio.run(drive(server.address))
            print(f"wrote {OUT}")
        finally:
            stop_process(worker)
            server.stop()


if __name__ == "__main__":
    main()
