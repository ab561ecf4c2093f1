"""Record an RLJobWorkflow history down the `phases-end-with-a-cancelled-job` patch.

    .venv/bin/python -m tests.histories.record_rl_cancelled

One `simulated` RL job whose run is cancelled while it samples (a 60-s sample): the workflow
cancels the sample's activity and waits for its end before it hands its lease back. Writes
`rl_job_cancelled_run0.json`; `tests/test_replay.py` replays it and checks the patch's marker
is there. Re-record only when the RL job workflow changes on purpose.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import GroupConfig, HolderView, group_workflow_id
from timeslice.protocol.rl_job import RLJobProgress
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.helpers import cancel_in_phase

OUT = Path(__file__).resolve().parent / "rl_job_cancelled_run0.json"
GROUP = "recorded-rl-cancelled"
JOB = "cancelled-a"


async def drive(address: str) -> None:
    client = await connect(connect_config(address))
    await start_group(client, GroupConfig(group_id=GROUP))
    config = {
        "job_id": JOB,
        "workload": "simulated",
        "workload_options": {"sample_s": 60.0, "reward_s": 0.05, "train_s": 0.05},
        "sampler_group": GROUP,
        "epochs": 1,
    }
    handle = await start_rl_job(client, parse_job_config(config))
    group = client.get_workflow_handle(group_workflow_id(GROUP))

    async def sampling() -> bool:
        held = await group.query("holder", result_type=HolderView | None)
        progress = await handle.query("progress", result_type=RLJobProgress)
        return held is not None and held.job_id == JOB and progress.phase == "sample"

    await cancel_in_phase(handle, sampling)
    OUT.write_text((await handle.fetch_history()).to_json())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        procs = [start_worker(server.address, Path(tmp) / "worker.log")]
        try:
            procs.append(
                start_service(
                    ["job", "worker", "--address", server.address, "--job-id", JOB,
                     "--workload", "simulated", "--checkpoint-dir", str(Path(tmp) / "ck")],
                    f"job {JOB} rank 0",
                    Path(tmp) / "job.log",
                )
            )  # fmt: skip
            asyncio.run(drive(server.address))
            print(f"wrote {OUT}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
