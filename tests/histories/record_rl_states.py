"""Record RLJobWorkflow histories that run the `searched-states-only` patch.

    .venv/bin/python -m tests.histories.record_rl_states

One `simulated` RL job, three epochs, continuing as new every two: its TimeslicePhase is set
at prepare, running and completed only, and the continued run carries it. Writes
`rl_job_searched_states_run<N>.json`; `tests/test_replay.py` replays them and checks the
patch's marker is there. Re-record only when the RL job workflow changes on purpose; the other
recorders leave these files alone.
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
PREFIX = "rl_job_searched_states_run"
GROUP = "recorded-rl-states"
JOB = "states-a"


async def drive(address: str, prefix: str, group: str, job: str, schedule: dict[str, int]) -> int:
    """Run one `simulated` job alone on ``group`` (``schedule``: epochs, checkpoint_every,
    continue_as_new_every) and write each run's history as ``<prefix><N>.json``."""
    client = await connect(connect_config(address))
    await start_group(client, GroupConfig(group_id=group))
    config = {
        "job_id": job,
        "workload": "simulated",
        "workload_options": {"sample_s": 0.1, "reward_s": 0.1, "train_s": 0.1},
        "sampler_group": group,
        **schedule,
    }
    await (await start_rl_job(client, parse_job_config(config))).result()
    written = 0
    query = f"WorkflowId = '{rl_job_workflow_id(job)}'"
    async for n, wf in _enumerate(client.list_workflows(query)):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (HERE / f"{prefix}{n}.json").write_text(history.to_json())
        written += 1
    return written


def record_one_job(prefix: str, group: str, job: str, schedule: dict[str, int]) -> None:
    """A scratch server, control worker and job process; replaces ``<prefix>*.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        procs = [start_worker(server.address, Path(tmp) / "worker.log")]
        try:
            procs.append(
                start_service(
                    ["job", "worker", "--address", server.address, "--job-id", job,
                     "--workload", "simulated", "--checkpoint-dir", str(Path(tmp) / "ck")],
                    f"job {job} rank 0",
                    Path(tmp) / "job.log",
                )
            )  # fmt: skip
            for old in HERE.glob(f"{prefix}*.json"):
                old.unlink()
            written = asyncio.run(drive(server.address, prefix, group, job, schedule))
            print(f"wrote {written} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


def main() -> None:
    schedule = {"epochs": 3, "checkpoint_every": 2, "continue_as_new_every": 2}
    record_one_job(PREFIX, GROUP, JOB, schedule)


if __name__ == "__main__":
    main()
