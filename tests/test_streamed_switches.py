"""Two real RL jobs, each with a sampler and a trainer state, on a group with room for one
job's states: every switch brings in only what the next phase uses, while the previous holder's
state streams out, and at no instant are more bytes on the device than the group declares.
Three such jobs on a group with room for two jobs' states: the group brings the next waiter's
states in while the holder works (staged restores), so its grant moves nothing, again within
the declared bytes.

Checked on what the processes themselves record: the simulated backends' trace of every chunk
that arrives on and leaves the device (independent of the device room that paces them), the
phases' own restores, and the group's counters — never on wall time, so a loaded machine does
not change the verdict.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from temporalio.client import Client
from timeslice.activities.group_requests import start_group
from timeslice.protocol.group import GroupConfig, GroupStatus, group_workflow_id
from timeslice.protocol.rl_job import RLJobResult
from timeslice.snapshot.device_room import ROOM_DIR_ENV
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, stop_process
from tests.helpers import Interval, assert_no_overlap, run_simulated_jobs

EPOCHS = 4
STATE = 32 * 2**20  # per state; two per job
MEMORY = 2 * STATE  # one job's states


@pytest.fixture
def job_workers(
    address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], None]]:
    monkeypatch.setenv(ROOM_DIR_ENV, str(tmp_path / "rooms"))  # the job processes' node
    procs = []

    def start(job: str) -> None:
        args = ["job", "worker", "--address", address, "--job-id", job, "--workload", "simulated",
                "--checkpoint-dir", str(tmp_path / "ckpt"), "--threads", "1"]  # fmt: skip
        procs.append(start_service(args, f"job {job}", tmp_path / f"{job}.log"))

    yield start
    for proc in procs:
        stop_process(proc)


def trace_events(trace: Path) -> list[tuple[int, int, int, str]]:
    """(monotonic ns, pid, bytes arriving (+) or leaving (-), move or hold), in time order."""
    events = []
    for line in trace.read_text().splitlines():
        at, pid, delta, kind = line.split()
        events.append((int(at), int(pid), int(delta), kind))
    return sorted(events, key=lambda e: (e[0], e[2]))  # a departure at the same instant first


def test_a_switch_streams_only_the_next_phases_state_within_the_groups_memory(
    address: str, job_workers: Callable[[str], None], group: str, tmp_path: Path
) -> None:
    jobs = [f"{group}-a", f"{group}-b"]
    trace = tmp_path / "residency.trace"
    options = {"sample_s": 0.3, "reward_s": 0.9, "train_s": 0.5, "state_bytes": STATE,
               "snapshot_s": 0.3, "chunk_bytes": STATE // 8,
               "residency_trace": str(trace)}  # fmt: skip
    for job in jobs:
        job_workers(job)

    async def go(client: Client) -> tuple[list[RLJobResult], GroupStatus]:
        await start_group(client, GroupConfig(group_id=group, memory_bytes=MEMORY))
        results = await run_simulated_jobs(
            client, jobs, group, options, epochs=EPOCHS, checkpoint_every=EPOCHS
        )
        status = await client.get_workflow_handle(group_workflow_id(group)).query(
            "status", result_type=GroupStatus
        )
        return results, status

    async def main() -> tuple[list[RLJobResult], GroupStatus]:
        return await go(await connect(connect_config(address)))

    results, status = asyncio.run(main())
    for result in results:
        assert [r.epoch for r in result.records] == list(range(EPOCHS))
    holds = sorted(
        ((h.mono_start, r.job_id, h) for r in results for rec in r.records for h in rec.holds),
        key=lambda x: x[0],
    )
    assert_no_overlap([Interval(j, h.token or 0, h.mono_start, h.mono_end) for _, j, h in holds])

    # At no instant were more bytes on the device than the group declares (setup included).
    events = trace_events(trace)
    resident = peak = 0
    for _, _, delta, _ in events:
        resident += delta
        peak = max(peak, resident)
    assert peak <= MEMORY, f"{peak} bytes on a device that declares {MEMORY}"

    # The switches streamed: the group granted without waiting for the eviction, and a
    # restore's chunks came in while the other job's eviction was still leaving.
    assert status.stats.streamed_switches >= 1
    moves = [e for e in events if e[3] == "move"]
    interleaved = any(
        a[1] == c[1] != b[1] and a[2] < 0 < b[2] and c[2] < 0
        for a, b, c in zip(moves, moves[1:], moves[2:], strict=False)
    )
    assert interleaved, "no restore came in while another job's eviction was leaving"

    # A phase after the other job's brought in only the state it uses, not the job's two.
    after_other = [h for (_, x, _), (_, y, h) in itertools.pairwise(holds) if x != y and h.restored]
    assert after_other, "no phase followed the other job's"
    assert all(sum(r.bytes for r in h.restored) == STATE for h in after_other)
    assert status.stats.snapshot_failures == 0 and not status.faulted_jobs


def test_the_next_waiters_state_comes_in_while_the_holder_works(
    address: str, job_workers: Callable[[str], None], group: str, tmp_path: Path
) -> None:
    jobs = [f"{group}-a", f"{group}-b", f"{group}-c"]
    epochs = 3
    memory = 4 * STATE  # two jobs' states
    trace = tmp_path / "residency.trace"
    # Rewards shorter than the other jobs' GPU time: someone always waits while a job holds.
    options = {"sample_s": 0.4, "reward_s": 0.2, "train_s": 0.4, "state_bytes": STATE,
               "snapshot_s": 0.1, "chunk_bytes": STATE // 4,
               "residency_trace": str(trace)}  # fmt: skip
    for job in jobs:
        job_workers(job)

    async def main() -> tuple[list[RLJobResult], GroupStatus]:
        client = await connect(connect_config(address))
        await start_group(client, GroupConfig(group_id=group, memory_bytes=memory))
        results = await run_simulated_jobs(
            client, jobs, group, options, epochs=epochs, checkpoint_every=epochs
        )
        status = await client.get_workflow_handle(group_workflow_id(group)).query(
            "status", result_type=GroupStatus
        )
        return results, status

    results, status = asyncio.run(main())
    for result in results:
        assert [r.epoch for r in result.records] == list(range(epochs))
    holds = sorted(
        ((h.mono_start, r.job_id, h) for r in results for rec in r.records for h in rec.holds),
        key=lambda x: x[0],
    )
    assert_no_overlap([Interval(j, h.token or 0, h.mono_start, h.mono_end) for _, j, h in holds])

    # The device never held more than the group declares, staged states included.
    resident = peak = 0
    for _, _, delta, _ in trace_events(trace):
        resident += delta
        peak = max(peak, resident)
    assert peak <= memory, f"{peak} bytes on a device that declares {memory}"

    # The group staged restores, and a phase that followed another job's found its state in.
    assert status.stats.staged_restores >= 1, status.stats
    after_other = [h for (_, x, _), (_, y, h) in itertools.pairwise(holds) if x != y]
    assert any(not h.restored for h in after_other), "every switch restored at its grant"
    assert status.stats.snapshot_failures == 0 and not status.faulted_jobs
