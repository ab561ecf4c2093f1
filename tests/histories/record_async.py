"""Record AsyncRLJobWorkflow histories for the replay test.

    .venv/bin/python -m tests.histories.record_async

One `simulated` async job (sampler and trainer on groups of their own, staleness 2, weights
every 2 steps): its job process is killed (-9) after step 3, so the first run (stored last:
the listing is newest first) holds a failure of both loops and a rewind from the last
checkpoint; the job then continues as new, so a second run is stored too. Re-record only when
the workflow changes on purpose.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path

from temporalio.client import Client
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_any_job_config, start_any_rl_job
from timeslice.protocol.async_rl_job import ASYNC_RL_JOB_WORKFLOW_TYPE, AsyncRLJobProgress
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.histories.record import _enumerate

HERE = Path(__file__).resolve().parent
JOB = "rec-async"


def job_worker(address: str, tmp: Path) -> object:
    return start_service(
        ["job", "worker", "--address", address, "--job-id", JOB, "--workload", "simulated",
         "--checkpoint-dir", str(tmp / "ck")],
        f"job {JOB} rank 0",
        tmp / f"{JOB}.log",
    )  # fmt: skip


async def drive(address: str, tmp: Path, procs: list) -> None:
    client = await connect(connect_config(address))
    config = parse_any_job_config(
        {
            "mode": "async",
            "job_id": JOB,
            "workload": "simulated",
            "workload_options": {"sample_s": 0.1, "reward_s": 0.05, "train_s": 0.2},
            "sampler_group": "recorded-sampler",
            "trainer_group": "recorded-trainer",
            "epochs": 8,
            "checkpoint_every": 2,
            "continue_as_new_every": 5,
            "max_staleness": 2,
            "sync_every": 2,
            "heartbeat_timeout_s": 3,
        }
    )
    handle = await start_any_rl_job(client, config)
    while (await handle.query("progress", result_type=AsyncRLJobProgress)).epoch < 3:
        await asyncio.sleep(0.1)
    procs[-1].send_signal(signal.SIGKILL)
    procs[-1].wait()
    procs.append(job_worker(address, tmp))
    done = await handle.result()
    assert done.rewinds >= 1 and done.epochs_done == 8, done


async def dump(client: Client) -> int:
    written = 0
    query = f"WorkflowType = '{ASYNC_RL_JOB_WORKFLOW_TYPE}'"
    async for n, wf in _enumerate(client.list_workflows(query)):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        (HERE / f"async_rl_job_run{n}.json").write_text(history.to_json())
        written += 1
    return written


def main() -> None:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        server = EmbeddedServer(port=free_port(), ui_port=None, db=tmp / "t.db").start()
        procs = [start_worker(server.address, tmp / "worker.log")]
        try:
            procs.append(job_worker(server.address, tmp))
            for old in HERE.glob("async_rl_job_run*.json"):
                old.unlink()
            asyncio.run(drive(server.address, tmp, procs))

            async def write() -> int:
                return await dump(await connect(connect_config(server.address)))

            print(f"wrote {asyncio.run(write())} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
