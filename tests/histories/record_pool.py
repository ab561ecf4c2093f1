"""Record PoolWorkflow and pool-placed RLJobWorkflow histories.

    .venv/bin/python -m tests.histories.record_pool PREFIX EPOCHS

A pool of two groups and two light `simulated` jobs placed without profiles (one per group),
``EPOCHS`` epochs each, a checkpoint every two. With 4 epochs (``pool_run``, recorded on the
code before pools moved jobs) nothing moves; with 8 (``pool_moves_run``) each job sends the
profile it measured and the pool moves one of them at a checkpoint boundary (the `pool-moves`
patch). Writes `<PREFIX>_pool<N>.json` and `<PREFIX>_job<N>.json`; `tests/test_replay.py`
replays them. Re-record only when the pool or the RL job workflow changes on purpose.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.pools import PoolConfig, PoolGroup, create_pool
from timeslice.protocol.pool import pool_workflow_id
from timeslice.protocol.rl_job import rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.histories.record import _enumerate

HERE = Path(__file__).resolve().parent
POOL = "recorded-pool"
JOBS = ("pool-a", "pool-b")
OPTIONS = {"sample_s": 0.1, "reward_s": 0.6, "train_s": 0.1, "state_bytes": 1 << 16}


async def drive(address: str, prefix: str, epochs: int) -> int:
    client = await connect(connect_config(address))
    groups = [PoolGroup(name=f"{POOL}-g{i}") for i in (1, 2)]
    pool = await create_pool(client, PoolConfig(pool=POOL, groups=groups))
    handles = []
    for job in JOBS:
        config = {"job_id": job, "workload": "simulated", "workload_options": OPTIONS,
                  "pool": POOL, "epochs": epochs, "checkpoint_every": 2}  # fmt: skip
        handles.append(await start_rl_job(client, parse_job_config(config)))
    await asyncio.gather(*(h.result() for h in handles))
    await pool.terminate("recorded")
    written = 0
    for kind, workflow_id in [("pool", pool_workflow_id(POOL))] + [
        (f"job{i}_", rl_job_workflow_id(job)) for i, job in enumerate(JOBS)
    ]:
        async for n, wf in _enumerate(client.list_workflows(f"WorkflowId = '{workflow_id}'")):
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            (HERE / f"{prefix}_{kind}{n}.json").write_text(history.to_json())
            written += 1
    return written


def main() -> None:
    prefix, epochs = sys.argv[1], int(sys.argv[2])
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
            for old in HERE.glob(f"{prefix}_*.json"):
                old.unlink()
            written = asyncio.run(drive(server.address, prefix, epochs))
            print(f"wrote {written} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
