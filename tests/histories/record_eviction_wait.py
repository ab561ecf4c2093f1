"""Record a GpuGroupWorkflow history whose switch waits for an eviction report that never comes.

    .venv/bin/python -m tests.histories.record_eviction_wait

A holder on a group (`grant_ack_timeout_s` 3 s) releases with another job waiting, is told to
move its own state out (`evicts_itself`), and never reports: its "process" is this recorder,
which serves nothing on the holder's task queue. The group waits for the report only
`grant_ack_timeout_s` (the `bounded-eviction-report-wait` patch), runs its own snapshot
activity, which nobody picks up, forgets the gone job (`forget-gone-evictor`) and grants the
waiter. The history, `gpu_group_eviction_wait_run0.json`, holds both patches' markers;
`tests/test_replay.py` replays it and checks that the markers are there. Re-record only when
the workflow changes on purpose; the other recorders leave this file alone.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import Lease, TimeSliceOrchestratorClient
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.protocol.group import (
    AcquireAnswer,
    AcquireCall,
    AcquireRequest,
    GroupUpdate,
    LeaseReturn,
    QueueTarget,
    ReturnAnswer,
    SnapshotTarget,
    group_workflow_id,
    job_task_queue,
    lease_key_hash,
)

from tests.conftest import start_worker, stop_process

HERE = Path(__file__).resolve().parent
OUT = HERE / "gpu_group_eviction_wait_run0.json"
GROUP = "recorded-eviction-wait"
GHOST = "ghost"
GHOST_KEY = "the-ghost-holders-own-lease-key"
WAIT_S = 120.0


def drive(address: str) -> None:
    waiter = TimeSliceOrchestratorClient(
        target=address, job_id="waiter", snapshot_backends=["noop"]
    )
    # Far beyond what this recorder waits: only the bounded report wait grants in time.
    waiter.create_group(GROUP, grant_ack_timeout_s=3.0, snapshot_timeout_s=900.0)
    token = asyncio.run(_ghost_acquires(address))
    granted: list[Lease] = []
    taker = threading.Thread(target=lambda: granted.append(waiter.acquire(GROUP, timeout=WAIT_S)))
    taker.start()
    _wait(lambda: any(w.job_id == "waiter" for w in waiter.group_status(GROUP).queue), "queued")
    answer = asyncio.run(_ghost_releases(address, token))
    assert answer.evict, answer  # told to move its state out; it never reports
    taker.join(WAIT_S + 30)
    assert granted, "the waiter was not granted"
    waiter.release(granted[0])
    status = waiter.group_status(GROUP)
    (switch,) = status.switch_history
    waited = (switch.end - switch.start).total_seconds()
    # The report wait and the unanswered snapshot activity, 3 s each; 900 s without the bound.
    assert 6.0 <= waited < 120, status
    assert status.resident_job == "waiter" and status.stats.departed == 1, status  # ghost gone
    waiter.close()


async def _ghost_acquires(address: str) -> int:
    """The ghost holder takes the group, naming a task queue nobody serves as its target."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    request = AcquireRequest(
        request_id="ghost-1",
        job_id=GHOST,
        reply_task_queue=job_task_queue(GHOST),  # its grant is the parked update's answer
        key_hash=lease_key_hash(GHOST_KEY),
        snapshot=SnapshotTarget(
            queues=[QueueTarget(task_queue=job_task_queue(GHOST), backends=["noop"])]
        ),
    )
    answer = await client.get_workflow_handle(group_workflow_id(GROUP)).execute_update(
        GroupUpdate.ACQUIRE, AcquireCall(request=request), result_type=AcquireAnswer
    )
    assert answer.notice is not None, answer
    return answer.notice.token


async def _ghost_releases(address: str, token: int) -> ReturnAnswer:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    return await client.get_workflow_handle(group_workflow_id(GROUP)).execute_update(
        GroupUpdate.RELEASE,
        LeaseReturn(request_id="ghost-1", token=token, key=GHOST_KEY, evicts_itself=True),
        result_type=ReturnAnswer,
    )


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        time.sleep(0.1)


async def dump(address: str) -> None:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    history = await client.get_workflow_handle(group_workflow_id(GROUP)).fetch_history()
    OUT.write_text(history.to_json())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        worker = start_worker(server.address, Path(tmp) / "worker.log")
        try:
            drive(server.address)
            asyncio.run(dump(server.address))
            print(f"wrote {OUT}")
        finally:
            stop_process(worker)
            server.stop()


if __name__ == "__main__":
    main()
