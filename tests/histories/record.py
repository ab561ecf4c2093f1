"""Record GpuGroupWorkflow histories for the replay test (when the workflow changes on purpose).

    .venv/bin/python -m tests.histories.record

It drives a fresh embedded server through every path of the group workflow (grants, hand-offs,
evictions and restores, a time-out, a cancel, a stale release, an expiry, continue-as-new) and
writes each run's history here as JSON. Commit them: the replay test then fails on any code change
that would break workflows already running in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import AcquireTimeoutError, TimeSliceOrchestratorClient
from timeslice.server import EmbeddedServer, free_port
from timeslice.workflows.protocol import ReleaseRequest, group_workflow_id

from tests.conftest import start_worker, stop_process

HERE = Path(__file__).resolve().parent
GROUP = "recorded"


def drive(address: str) -> None:
    a = TimeSliceOrchestratorClient(target=address, job_id="ja", snapshot_backends=["noop"])
    b = TimeSliceOrchestratorClient(target=address, job_id="jb", snapshot_backends=["noop"])
    for _ in range(6):
        a.release(a.acquire(GROUP))
        b.release(b.acquire(GROUP))
    lease = a.acquire(GROUP)
    with contextlib.suppress(AcquireTimeoutError):
        b.acquire(GROUP, timeout=0.5)

    async def stale() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        handle = client.get_workflow_handle(group_workflow_id(GROUP))
        await handle.signal("release", ReleaseRequest(request_id="forged", token=lease.token - 1))

    asyncio.run(stale())
    a.release(lease)
    short = b.acquire(GROUP, ttl=1.0)
    b._engine.run_sync(_stop_heartbeat(b, short.group_id))  # let it expire at the group
    deadline = time.monotonic() + 30
    while b.group_status(GROUP).stats.expired == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    b._engine.held.clear()
    a.release(a.acquire(GROUP))
    a.close()
    b.close()


async def _stop_heartbeat(client: TimeSliceOrchestratorClient, group: str) -> None:
    client._engine._heartbeats.pop(group).cancel()


async def dump(address: str) -> int:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    written = 0
    async for wf in client.list_workflows(f"WorkflowId = '{group_workflow_id(GROUP)}'"):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (HERE / f"gpu_group_run{written}.json").write_text(history.to_json())
        written += 1
    return written


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(
            port=free_port(),
            ui_port=None,
            db=Path(tmp) / "t.db",
            dynamic_config={"limit.historyCount.suggestContinueAsNew": 100},
        ).start()
        worker = start_worker(server.address, Path(tmp) / "worker.log")
        try:
            for old in HERE.glob("gpu_group_run*.json"):
                old.unlink()
            drive(server.address)
            print(f"wrote {asyncio.run(dump(server.address))} histories to {HERE}")
        finally:
            stop_process(worker)
            server.stop()


if __name__ == "__main__":
    main()
