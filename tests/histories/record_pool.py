"""Record PoolWorkflow and pool-placed RLJobWorkflow histories.

    .venv/bin/python -m tests.histories.record_pool PREFIX EPOCHS
    .venv/bin/python -m tests.histories.record_pool pool_moves_queue queue
    .venv/bin/python -m tests.histories.record_pool pool_moves_drift drift
    .venv/bin/python -m tests.histories.record_pool pool_moves_async async
    .venv/bin/python -m tests.histories.record_pool pool_moves_async_profiled async

A pool of two groups and two light `simulated` jobs placed without profiles (one per group),
``EPOCHS`` epochs each, a checkpoint every two. With 4 epochs (``pool_run``, recorded on the
code before pools moved jobs) nothing moves; with 8 (``pool_moves_run``) each job sends the
profile it measured and the pool moves one of them at a checkpoint boundary (the `pool-moves`
patch). ``queue`` (``pool_moves_queue``): the two jobs declare their profiles and are placed on
one group, one is moved to the other by hand, and a heavy job arrives that fits beside neither:
the pool moves a light job to make room for it (the `pool-moves-for-queue` patch). ``drift``
(``pool_moves_drift``): the two jobs declare light profiles and are packed onto one group; from its
epoch 3 one job's GPU phases take eight times as long, it sends its pool the drifted profile,
and the pool moves one of them to bring its bound back (the `pool-profile-drift` patch).
``async`` (``pool_moves_async``): an async job placed on two of three groups is moved by hand,
its sampler to the third and its trainer to where its sampler was (the `pool-async-moves`
patch; recorded before async jobs measured their profiles). Recorded again after
(``pool_moves_async_profiled``), the job sends its measured profile after its third step
(the `pool-async-profiles` patch). Writes
`<PREFIX>_pool<N>.json` and `<PREFIX>_job<N>.json`; `tests/test_replay.py`
replays them. Re-record only when the pool or the RL job workflow changes on purpose.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from temporalio.client import Client
from timeslice.cli.server import EmbeddedServer, free_port
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.pools import PoolConfig, PoolGroup, create_pool
from timeslice.protocol.pool import pool_workflow_id
from timeslice.protocol.rl_job import rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, start_worker, stop_process
from tests.helpers import declared_profile
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
    return await _write(client, prefix, JOBS)


HEAVY = "pool-heavy"
HEAVY_OPTIONS = {"sample_s": 1.0, "reward_s": 0.02, "train_s": 1.0, "state_bytes": 1 << 16}


async def drive_queue(address: str, prefix: str) -> int:
    """The queue scenario (tests/test_pool_moves.py's, recorded)."""
    from timeslice.pools import move_pool_job, pool_status
    from timeslice.protocol.rl_job import RLJobProgress

    client = await connect(connect_config(address))
    groups = [PoolGroup(name=f"{POOL}-g{i}") for i in (1, 2)]
    pool = await create_pool(client, PoolConfig(pool=POOL, groups=groups, move_every_epochs=1))
    handles = []
    for job in JOBS:
        config = {"job_id": job, "workload": "simulated", "workload_options": OPTIONS,
                  "pool": POOL, "epochs": 12, "checkpoint_every": 2,
                  "profile": declared_profile(OPTIONS, 12)}  # fmt: skip
        handles.append(await start_rl_job(client, parse_job_config(config)))

    async def until(probe: Callable[[], Awaitable[bool]]) -> None:
        for _ in range(1200):
            if await probe():
                return
            await asyncio.sleep(0.1)
        raise SystemExit("the queue scenario did not reach its next step in 120 s")

    async def placed() -> bool:
        return sum(1 for j in (await pool_status(client, POOL)).jobs if j.placement) == 2

    async def moved() -> bool:
        handle = client.get_workflow_handle(rl_job_workflow_id(JOBS[1]))
        progress = await handle.query("progress", result_type=RLJobProgress)
        return bool(progress.moves) and progress.epoch > progress.moves[-1].epoch

    async def settled() -> bool:
        return all(j.moving_from is None for j in (await pool_status(client, POOL)).jobs)

    await until(placed)
    status = await pool_status(client, POOL)
    here = next(j.placement.sampler_group for j in status.jobs if j.job_id == JOBS[1])
    spare = next(g.name for g in groups if g.name != here)
    await move_pool_job(client, POOL, JOBS[1], spare)
    await until(moved)
    await until(settled)
    config = {"job_id": HEAVY, "workload": "simulated", "workload_options": HEAVY_OPTIONS,
              "pool": POOL, "epochs": 4, "checkpoint_every": 2,
              "profile": declared_profile(HEAVY_OPTIONS, 4)}  # fmt: skip
    handles.append(await start_rl_job(client, parse_job_config(config)))
    await asyncio.gather(*(h.result() for h in handles))
    reasons = [d.reason for d in (await pool_status(client, POOL)).decisions]
    if not any(f"to make room for {HEAVY}" in r for r in reasons):
        raise SystemExit(f"no move made room for {HEAVY}: {reasons}")
    await pool.terminate("recorded")
    return await _write(client, prefix, (*JOBS, HEAVY))


async def drive_drift(address: str, prefix: str) -> int:
    """The drift scenario (tests/test_pool_moves.py's, recorded)."""
    from timeslice.pools import pool_status

    client = await connect(connect_config(address))
    groups = [PoolGroup(name=f"{POOL}-g{i}") for i in (1, 2)]
    pool = await create_pool(client, PoolConfig(pool=POOL, groups=groups))
    handles = []
    for job, epochs in zip(JOBS, (16, 8), strict=True):
        options = OPTIONS if job == JOBS[0] else {**OPTIONS, "gpu_scale_from": 3, "gpu_scale": 8}
        config = {"job_id": job, "workload": "simulated", "workload_options": options,
                  "pool": POOL, "epochs": epochs, "checkpoint_every": 2,
                  "profile": declared_profile(OPTIONS, epochs)}  # fmt: skip
        handles.append(await start_rl_job(client, parse_job_config(config)))
    await asyncio.gather(*(h.result() for h in handles))
    reasons = [d.reason for d in (await pool_status(client, POOL)).decisions]
    if not any("back within its bound" in r for r in reasons):
        raise SystemExit(f"no move brought the pool back within its bound: {reasons}")
    await pool.terminate("recorded")
    return await _write(client, prefix, JOBS)


async def drive_async(address: str, prefix: str) -> int:
    """The async move (tests/test_pool_moves.py's, recorded)."""
    from timeslice.jobs import parse_any_job_config, start_any_rl_job
    from timeslice.pools import move_pool_job, pool_status

    client = await connect(connect_config(address))
    groups = [PoolGroup(name=f"{POOL}-g{i}") for i in (1, 2, 3)]
    pool = await create_pool(client, PoolConfig(pool=POOL, groups=groups))
    config = {"job_id": JOBS[0], "workload": "simulated", "workload_options": OPTIONS,
              "pool": POOL, "epochs": 8, "checkpoint_every": 2, "mode": "async",
              "max_staleness": 1}  # fmt: skip
    handle = await start_any_rl_job(client, parse_any_job_config(config))
    for _ in range(600):
        jobs = (await pool_status(client, POOL)).jobs
        if jobs and jobs[0].placement is not None:
            break
        await asyncio.sleep(0.1)
    else:
        raise SystemExit("the async job was not placed in 60 s")
    old = jobs[0].placement
    assert old is not None
    spare = next(g.name for g in groups if g.name not in {old.sampler_group, old.trainer_group})
    await move_pool_job(client, POOL, JOBS[0], spare, old.sampler_group)
    await handle.result()
    reasons = [d.reason for d in (await pool_status(client, POOL)).decisions]
    if not any(r.startswith(f"{JOBS[0]} moved from ") for r in reasons):
        raise SystemExit(f"the async job did not move: {reasons}")
    await pool.terminate("recorded")
    return await _write(client, prefix, JOBS[:1])


async def _write(client: Client, prefix: str, jobs: tuple[str, ...]) -> int:
    written = 0
    for kind, workflow_id in [("pool", pool_workflow_id(POOL))] + [
        (f"job{i}_", rl_job_workflow_id(job)) for i, job in enumerate(jobs)
    ]:
        async for n, wf in _enumerate(client.list_workflows(f"WorkflowId = '{workflow_id}'")):
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            (HERE / f"{prefix}_{kind}{n}.json").write_text(history.to_json())
            written += 1
    return written


def main() -> None:
    prefix, epochs = sys.argv[1], sys.argv[2]
    jobs = (*JOBS, HEAVY) if epochs == "queue" else JOBS[:1] if epochs == "async" else JOBS
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(port=free_port(), ui_port=None, db=Path(tmp) / "t.db").start()
        procs = [start_worker(server.address, Path(tmp) / "worker.log")]
        try:
            for job in jobs:
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
            if epochs == "queue":
                written = asyncio.run(drive_queue(server.address, prefix))
            elif epochs == "drift":
                written = asyncio.run(drive_drift(server.address, prefix))
            elif epochs == "async":
                written = asyncio.run(drive_async(server.address, prefix))
            else:
                written = asyncio.run(drive(server.address, prefix, int(epochs)))
            print(f"wrote {written} histories to {HERE}")
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()


if __name__ == "__main__":
    main()
