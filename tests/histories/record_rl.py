"""Record RLJobWorkflow histories (and its group's) for the replay test.

    .venv/bin/python -m tests.histories.record_rl

Two `simulated` RL jobs share a group that declares memory for both states, so the histories
hold co-operative switches (self-restores, evictions after release, `moved` reports), carried
leases, checkpoints and a continue-as-new. Re-record only when a workflow changes on purpose.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from temporalio.client import Client
from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import GroupConfig, group_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.histories.record import _enumerate

HERE = Path(__file__).resolve().parent
GROUP = "recorded-rl"
JOBS = ("rec-a", "rec-b")
SIZE = 1 << 20


async def drive(address: str) -> None:
    client = await connect(connect_config(address))
    await start_group(client, GroupConfig(group_id=GROUP, memory_bytes=2 * SIZE))
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
                    "checkpoint_every": 2,
                    "continue_as_new_every": 2,
                }
            ),
        )
        for job in JOBS
    ]
    for handle in handles:
        await handle.result()


async def dump(client: Client) -> int:
    written = 0
    queries = {
        "rl_job_run": "WorkflowType = 'RLJobWorkflow'",
        "gpu_group_coop_run": f"WorkflowId = '{group_workflow_id(GROUP)}'",
    }
    for prefix, query in queries.items():
        async for n, wf in _enumerate(client.list_workflows(query)):
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            (HERE / f"{prefix}{n}.json").write_text(history.to_json())
            written += 1
    return written


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
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
            for old in [*HERE.glob("rl_job_run*.json"), *HERE.glob("gpu_group_coop_run*.json")]:
                old.unlink()
            asyncio.run(drive(server.address))

            async def write() -> int:
                return await dump(await connect(connect_config(server.address)))

            print(f"wrote {asyncio.run(write())} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
