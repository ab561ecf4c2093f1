"""Record RLJobWorkflow histories that speak job protocol v5 (the `job-protocol-v5` patch).

    .venv/bin/python -m tests.histories.record_rl_v5

One `simulated` RL job alone on its group, four epochs, continuing as new every three: each
train's lease is carried into the next sample, and the order its process was told to ask ahead
is forgotten, not cancelled (it never sent it). Writes `rl_job_protocol_v5_run<N>.json`;
`tests/test_replay.py` replays them and checks the patch's marker is there. Re-record only when
the RL job workflow changes on purpose; the other recorders leave these files alone.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.group import GroupConfig
from timeslice.protocol.rl_job import rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.histories.record import _enumerate

HERE = Path(__file__).resolve().parent
PREFIX = "rl_job_protocol_v5_run"
GROUP = "recorded-rl-v5"
JOB = "v5-a"


async def drive(address: str) -> int:
    client = await connect(connect_config(address))
    await start_group(client, GroupConfig(group_id=GROUP))
    config = {
        "job_id": JOB,
        "workload": "simulated",
        "workload_options": {"sample_s": 0.1, "reward_s": 0.1, "train_s": 0.1},
        "sampler_group": GROUP,
        "epochs": 4,
        "checkpoint_every": 4,
        "continue_as_new_every": 3,
    }
    await (await start_rl_job(client, parse_job_config(config))).result()
    written = 0
    query = f"WorkflowId = '{rl_job_workflow_id(JOB)}'"
    async for n, wf in _enumerate(client.list_workflows(query)):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (HERE / f"{PREFIX}{n}.json").write_text(history.to_json())
        written += 1
    return written


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
            for old in HERE.glob(f"{PREFIX}*.json"):
                old.unlink()
            print(f"wrote {asyncio.run(drive(server.address))} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
