"""Record GpuGroupWorkflow histories for the replay test (when the workflow changes on purpose).

    .venv/bin/python -m tests.histories.record

It drives a fresh embedded server through every path of the group workflow (grants, hand-offs,
evictions and restores, a time-out, a cancel, a stale release, an expiry, continue-as-new,
a workflow requester (grant by signal, renewal by signal),
a snapshot target naming processes on a node agent's queue, a refused snapshot and the fault
it leaves, a standalone snapshot / restore, a departure) and
writes each run's history here as JSON. Commit them: the replay test then fails on any code change
that would break workflows already running in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import AcquireTimeoutError, TimeSliceOrchestratorClient
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.protocol.group import (
    AcquireRequest,
    ProcessRef,
    QueueTarget,
    ReleaseRequest,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
    node_task_queue,
)
from timeslice.snapshot.processes import process_start_time

from tests.conftest import start_service, start_worker, stop_process
from tests.test_workflow_requesters import _run_jobs

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
GROUP = "recorded"
NODE = "recorder"


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
        forged = "not-the-holders-key-0123456789"
        await handle.signal(
            "release", ReleaseRequest(request_id="forged", token=lease.token - 1, key=forged)
        )
        # The holder's own request and token, without its key: refused and counted.
        await handle.signal(
            "release", ReleaseRequest(request_id=lease.request_id, token=lease.token, key=forged)
        )

    asyncio.run(stale())
    a.release(lease)
    short = b.acquire(GROUP, ttl=1.0)
    b._engine.run_sync(_stop_heartbeat(b, short.group_id))  # let it expire at the group
    deadline = time.monotonic() + 30
    while b.group_status(GROUP).stats.expired == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    b._engine.session.held.clear()
    a.release(a.acquire(GROUP))
    _forged_node_target(address, a)
    a.release(a.acquire(GROUP))  # evicts the forger through the agent, which refuses: a fault
    a.snapshot()
    a.restore()
    asyncio.run(_run_jobs(address, [("wf-rec", GROUP, 2, 0.1, None)]))  # a workflow requester
    a.close()
    b.close()


def _forged_node_target(address: str, grantee: TimeSliceOrchestratorClient) -> None:
    """A request whose snapshot target names a process (this one) on the node agent's queue."""
    me = os.getpid()
    target = SnapshotTarget(
        queues=[
            QueueTarget(
                task_queue=node_task_queue(NODE),
                backends=["simulated"],
                processes=[ProcessRef(pid=me, start_time=process_start_time(me))],
            )
        ]
    )

    async def send() -> None:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        await client.get_workflow_handle(group_workflow_id(GROUP)).signal(
            "request",
            AcquireRequest(
                request_id="forger-1",
                key_hash=lease_key_hash("the-forger's-own-key"),
                job_id="forger",
                reply_task_queue=grantee.task_queue,
                snapshot=target,
            ),
        )

    asyncio.run(send())
    deadline = time.monotonic() + 30
    while grantee.group_status(GROUP).resident_job != "forger" and time.monotonic() < deadline:
        time.sleep(0.1)


async def _stop_heartbeat(client: TimeSliceOrchestratorClient, group: str) -> None:
    client._engine.session._heartbeats.pop(group).cancel()


async def dump(address: str) -> int:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    written = 0
    queries = {
        "gpu_group_run": f"WorkflowId = '{group_workflow_id(GROUP)}'",
        "snapshot_job_run": "WorkflowType = 'SnapshotJobWorkflow'",
    }
    for prefix, query in queries.items():
        async for n, wf in _enumerate(client.list_workflows(query)):
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            (HERE / f"{prefix}{n}.json").write_text(history.to_json())
            written += 1
    return written


async def _enumerate(items: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    n = 0
    async for item in items:
        yield n, item
        n += 1


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(
            port=free_port(),
            ui_port=None,
            db=Path(tmp) / "t.db",
            dynamic_config={"limit.historyCount.suggestContinueAsNew": 100},
        ).start()
        worker = start_worker(server.address, Path(tmp) / "worker.log")
        agent = start_service(
            ["agent", "--node", NODE, "--address", server.address, "--simulated-bytes", "8"],
            "node agent on task queue",
            Path(tmp) / "agent.log",
        )
        try:
            for old in [*HERE.glob("gpu_group_run*.json"), *HERE.glob("snapshot_job_run*.json")]:
                old.unlink()
            drive(server.address)
            print(f"wrote {asyncio.run(dump(server.address))} histories to {HERE}")
        finally:
            stop_process(agent)
            stop_process(worker)
            server.stop()


if __name__ == "__main__":
    main()
