"""One `timeslice job worker` process serving a rank of several jobs (`--job-id` repeated), as
bench/scale.py runs many jobs without paying a process start-up for each."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.rl_job import RLJobResult
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, stop_process
from tests.helpers import Interval, assert_no_overlap, run_cli

EPOCHS = 3


def test_one_process_serves_two_jobs_on_one_group(address: str, group: str, tmp_path: Path):
    jobs = [f"fleet-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    proc = start_service(
        ["job", "worker", "--address", address, "--job-id", jobs[0], "--job-id", jobs[1],
         "--workload", "simulated", "--checkpoint-dir", str(tmp_path / "ckpt"), "--threads", "1"],
        f"job {jobs[0]} rank 0",
        tmp_path / "fleet.log",
    )  # fmt: skip

    async def run_both() -> list[RLJobResult]:
        client = await connect(connect_config(address))
        handles = [
            await start_rl_job(
                client,
                parse_job_config(
                    {
                        "job_id": job,
                        "workload": "simulated",
                        "workload_options": {"sample_s": 0.1, "reward_s": 0.1, "train_s": 0.1},
                        "sampler_group": group,
                        "epochs": EPOCHS,
                    }
                ),
            )
            for job in jobs
        ]
        return list(await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 240))

    try:
        results = asyncio.run(run_both())
    finally:
        stop_process(proc)
    for result in results:
        assert [r.epoch for r in result.records] == list(range(EPOCHS)), result
        assert result.epochs_done == EPOCHS and not result.stopped
    holds = [h for r in results for rec in r.records for h in rec.holds]
    assert {h.group_id for h in holds} == {group}
    assert len({r.job_id for r in results}) == 2
    # Both jobs' GPU phases, on their one group, never at once.
    assert_no_overlap(
        [
            Interval(job=r.job_id, token=h.token or 0, start=h.mono_start, end=h.mono_end)
            for r in results
            for rec in r.records
            for h in rec.holds
        ]
    )


def test_a_job_named_twice_is_refused_before_anything_starts(tmp_path: Path):
    result = run_cli(
        "job", "worker", "--job-id", "same", "--job-id", "same", "--workload", "simulated",
        "--address", "127.0.0.1:1", timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result
    assert "--job-id names a job twice: same same" in result.stderr
    assert "Traceback" not in result.stderr
