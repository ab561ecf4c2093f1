"""Record GpuGroupWorkflow histories that run the `one-deadline-timer` patch.

    .venv/bin/python -m tests.histories.record_one_timer

On a group (continue-as-new suggested early, so several runs are stored): three processes
contend (parked acquires), a waiter times out while the group is held (a deadline earlier than
the pending timer), a lease expires unrenewed (the timer fires), then two `simulated` RL jobs
share the group, moving their own state out after releasing (the wait for an eviction report).
It writes `gpu_group_one_timer_run<N>.json`; `tests/test_replay.py` replays them and checks the
patch's marker is there. Re-record only when the group workflow changes on purpose; the other
recorders leave these files alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import AcquireTimeoutError, TimeSliceOrchestratorClient
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import group_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.histories.record import _enumerate, _stop_heartbeat

HERE = Path(__file__).resolve().parent
PREFIX = "gpu_group_one_timer_run"
GROUP = "recorded-one-timer"
JOBS = ("timer-a", "timer-b")
SIZE = 1 << 20


def drive(address: str) -> None:
    clients = [
        TimeSliceOrchestratorClient(target=address, job_id=f"c{i}", snapshot_backends=["noop"])
        for i in range(3)
    ]
    clients[0].create_group(GROUP, memory_bytes=2 * SIZE)

    def contend(client: TimeSliceOrchestratorClient) -> None:
        for _ in range(4):
            client.release(client.acquire(GROUP))

    threads = [threading.Thread(target=contend, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    a, b, _ = clients
    held = a.acquire(GROUP)
    with contextlib.suppress(AcquireTimeoutError):
        b.acquire(GROUP, timeout=0.5)
    a.release(held)
    short = b.acquire(GROUP, ttl=1.0)
    b._engine.run_sync(_stop_heartbeat(b, short.group_id))  # let it expire at the group
    deadline = time.monotonic() + 30
    while b.group_status(GROUP).stats.expired == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    b._engine.held.clear()
    a.release(a.acquire(GROUP))
    for client in clients:
        client.close()
    asyncio.run(_rl_jobs(address))


async def _rl_jobs(address: str) -> None:
    client = await connect(connect_config(address))
    options = {"sample_s": 0.2, "reward_s": 0.2, "train_s": 0.1, "state_bytes": SIZE}
    handles = [
        await start_rl_job(
            client,
            parse_job_config(
                {
                    "job_id": job,
                    "workload": "simulated",
                    "workload_options": {**options, "snapshot_s": 0.02},
                    "sampler_group": GROUP,
                    "epochs": 3,
                    "checkpoint_every": 3,
                }
            ),
        )
        for job in JOBS
    ]
    for handle in handles:
        await handle.result()


async def dump(address: str) -> int:
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    written = 0
    query = f"WorkflowId = '{group_workflow_id(GROUP)}'"
    async for n, wf in _enumerate(client.list_workflows(query)):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (HERE / f"{PREFIX}{n}.json").write_text(history.to_json())
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
        procs = [start_worker(server.address, Path(tmp) / "worker.log")]
        try:
            for job in JOBS:
                procs.append(
                    start_service(
                        ["job", "worker", "--address", server.address, "--job-id", job,
                         "--workload", "simulated", "--checkpoint-dir", str(Path(tmp) / "ck")],
                        f"job {job} rank 0",
                        Path(tmp) / f"{job}.log",
                    )
                )  # fmt: skip
            for old in HERE.glob(f"{PREFIX}*.json"):
                old.unlink()
            drive(server.address)
            print(f"wrote {asyncio.run(dump(server.address))} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
