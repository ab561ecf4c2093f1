"""A job process that dies right after releasing, while it moves its own state out.

The soak found this on a loaded machine: an RL job's process released its lease (the group
answered "evict yourself", another job waiting) and was killed before it reported the eviction.
The group waited for that report as long as ``snapshot_timeout_s`` (300 s by default) with the
next job queued and the device idle. Now it waits only ``grant_ack_timeout_s`` for the report,
then runs its own snapshot activity, which no process picks up: the job's state died with it,
and the waiter is granted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.rl_job import JobQuery, JobSignal, RLJobProgress, rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, stop_process
from tests.helpers import events, spawn_contender, wait_for

pytest.importorskip("torch")

GRANT_ACK_S = 3.0
# Far beyond what this test waits: only the bounded wait for the report can grant in time.
SNAPSHOT_TIMEOUT_S = 900.0
# The dying job's own eviction: longer than the test, so the process is killed inside it.
EVICTION_S = 600.0


def test_a_process_dead_right_after_releasing_does_not_hold_the_waiter(
    address: str, group: str, make_client, tmp_path: Path
) -> None:
    make_client(job_id="creator").create_group(
        group, grant_ack_timeout_s=GRANT_ACK_S, snapshot_timeout_s=SNAPSHOT_TIMEOUT_S
    )
    job = f"dies-{group}"
    process = start_service(
        ["job", "worker", "--address", address, "--job-id", job, "--rank", "0",
         "--workload", "simulated", "--checkpoint-dir", str(tmp_path / "checkpoints"),
         "--threads", "1"],
        f"job {job} rank 0",
        tmp_path / "job.log",
    )  # fmt: skip
    config = parse_job_config(
        {
            "job_id": job,
            "workload": "simulated",
            # A long first sample, so the waiter queues behind it; then the job's own
            # eviction, in the background of its process, far longer than this test.
            "workload_options": {"sample_s": 4.0, "reward_s": 0.1, "train_s": 0.1,
                                 "snapshot_s": EVICTION_S, "state_bytes": 1024},
            "sampler_group": group,
            "epochs": 2,
            "lease_ttl_s": 30,
            "heartbeat_timeout_s": 5,
        }
    )  # fmt: skip
    waiter_log = tmp_path / "waiter.jsonl"
    observer = make_client(job_id="observer")
    waiter = None
    try:

        async def start(client) -> None:
            await start_rl_job(client, config)

        _run(address, start)
        wait_for(
            lambda: (
                _phase(address, job) == "sample"
                and (h := observer.group_status(group).holder) is not None
                and h.job_id == job
            ),
            timeout=120,
            what="the job holding the group for its first sample",
        )
        waiter = spawn_contender(address, group, "waiter", waiter_log, "--timeout", "240")
        wait_for(
            lambda: any(w.job_id == "waiter" for w in observer.group_status(group).queue),
            timeout=120,
            what="the waiter queued behind the job",
        )
        # The job's sample ends: it releases, is told to evict itself (the waiter is next),
        # and starts its 600-s eviction. The group has taken the waiter off its queue and
        # waits for the job's report before it grants.
        status = wait_for(
            lambda: (
                (s := observer.group_status(group)).holder is None
                and all(w.job_id != "waiter" for w in s.queue)
                and s.stats.evictions == 1
                and s
            ),
            timeout=120,
            what="the job released and the group waiting for its eviction report",
        )
        assert not events(waiter_log, "acquired"), status
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        killed = time.monotonic()
        acquired = wait_for(
            lambda: events(waiter_log, "acquired"),
            timeout=120,
            what="the waiter granted after the job's process died",
        )
        waited_after_kill = acquired[0]["t"] - killed
        # The report wait (3 s) plus the group's own snapshot activity not being picked up
        # (3 s), with room for a loaded machine; without the bound it is 900 s.
        assert waited_after_kill < 90, waited_after_kill
        after = observer.group_status(group)
        assert after.resident_job != job, after
        assert job not in after.faulted_jobs, after.faulted_jobs
    finally:
        if waiter is not None:
            try:
                waiter.wait(60)
            except subprocess.TimeoutExpired:
                waiter.kill()  # still waiting: the assertion above says why
                waiter.wait()
        stop_process(process)

        async def stop(client) -> None:
            await client.get_workflow_handle(rl_job_workflow_id(job)).signal(JobSignal.STOP)

        _run(address, stop)


def _run(address: str, coro_fn):
    async def main():
        return await coro_fn(await connect(connect_config(address)))

    return asyncio.run(main())


def _phase(address: str, job: str) -> str:
    async def query(client) -> str:
        handle = client.get_workflow_handle(rl_job_workflow_id(job))
        progress = await handle.query(JobQuery.PROGRESS, result_type=RLJobProgress)
        return progress.phase

    return _run(address, query)
