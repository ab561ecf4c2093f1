"""Two real RL jobs on one group, under each grant policy: the convoy, and its end.

Under ``fifo`` a job keeps its lease from ``train`` into its next ``sample`` only when nobody
waits, and two jobs can phase-lock: B trains, A trains, B samples, A samples, and both compute
rewards at once while the group idles (with these times most fifo runs do; the fifo case asserts
only the policy's rule, never a carry). Under ``phase_aware`` (the default) the lease is carried
into the sample past the waiter, so each job's GPU work is one block and one job's rewards run
during the other's block. Checked on the jobs' own records (phase intervals and grants), not
on wall time, so a loaded machine slows both runs alike without changing the verdict. The two
policies' pairs run at the same time, each on its own group (their phases mostly sleep).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest
from temporalio.client import Client
from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer
from timeslice.cli.stack import JobWorker, Stack
from timeslice.protocol.group import GrantPolicy, GroupConfig, GroupStatus, group_workflow_id
from timeslice.protocol.rl_job import RLJobResult
from timeslice.transport.connection import connect, connect_config

from tests.helpers import Interval, assert_no_overlap, run_simulated_jobs

EPOCHS = 9
# The epochs the checks skip. A job's first grant waits for the other job's preparation and
# initial checkpoint, and the group's waiting-share rule counts that wait: it refuses carries
# past the job that waited longer until the shares even out (2 to 3 epochs, seen in runs of this
# test). What is checked is the steady state after that.
WARMUP = 3
SIZE = 1 << 20
# The demo's shape, shortened: the rewards (off the GPU) take longer than both GPU phases
# together, so two jobs can interleave completely.
OPTIONS = {"sample_s": 0.3, "reward_s": 1.2, "train_s": 0.5, "state_bytes": SIZE,
           "snapshot_s": 0.05}  # fmt: skip


POLICIES = (GrantPolicy.PHASE_AWARE, GrantPolicy.FIFO)
Run = tuple[str, list[RLJobResult], GroupStatus]


@pytest.fixture(scope="module")
def runs(
    server: EmbeddedServer, worker: None, tmp_path_factory: pytest.TempPathFactory
) -> dict[GrantPolicy, Run]:
    """Each policy's pair of jobs, both pairs at once: the group, the results, its status."""
    groups = {policy: f"g-{policy.value}-{uuid.uuid4().hex[:8]}" for policy in POLICIES}
    tmp = tmp_path_factory.mktemp("phase-aware")
    with Stack(tmp, address=server.address) as stack:
        stack.job_workers(
            *(
                JobWorker((job,), "simulated", ("--threads", "1"))
                for group in groups.values()
                for job in _jobs(group)
            )
        )

        async def both() -> list[tuple[list[RLJobResult], GroupStatus]]:
            client = await connect(connect_config(server.address))
            return list(await asyncio.gather(*(_run_pair(client, groups[p], p) for p in POLICIES)))

        done = asyncio.run(both())
    return {p: (groups[p], *pair) for p, pair in zip(POLICIES, done, strict=True)}


def _jobs(group: str) -> list[str]:
    return [f"{group}-a", f"{group}-b"]


async def _run_pair(
    client: Client, group: str, policy: GrantPolicy
) -> tuple[list[RLJobResult], GroupStatus]:
    await start_group(
        client, GroupConfig(group_id=group, memory_bytes=4 * SIZE, grant_policy=policy)
    )
    results = await run_simulated_jobs(
        client, _jobs(group), group, OPTIONS, epochs=EPOCHS, checkpoint_every=EPOCHS
    )
    status = await client.get_workflow_handle(group_workflow_id(group)).query(
        "status", result_type=GroupStatus
    )
    return results, status


def _rewards_intervals(result: RLJobResult) -> list[tuple[float, float]]:
    """Each epoch's rewards phase: it starts as the sample ends (one workflow round trip
    later, the same for both jobs) and runs for its recorded time."""
    spans = []
    for record in result.records[WARMUP:]:
        sample = next(h for h in record.holds if h.phase == "sample")
        spans.append((sample.mono_end, sample.mono_end + record.phase_s["rewards"]))
    return spans


def _overlap_fraction(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The share of job a's rewards time during which job b also computed rewards."""
    both = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)
    return both / sum(e - s for s, e in a)


def _switches_per_epoch_per_job(results: list[RLJobResult], group: str) -> float:
    """Grants of the group that changed the job holding it (from the jobs' GPU phases, in
    order), per epoch per job: 2 in the convoy, 1 when each job's phases are one block."""
    holds = sorted(
        (h.mono_start, r.job_id)
        for r in results
        for record in r.records[WARMUP:]
        for h in record.holds
        if h.group_id == group
    )
    changes = sum(1 for (_, x), (_, y) in itertools.pairwise(holds) if x != y)
    return changes / ((EPOCHS - WARMUP) * len(results))


@pytest.mark.parametrize("policy", POLICIES)
def test_two_jobs_on_one_group_do_not_phase_lock(
    runs: dict[GrantPolicy, Run], policy: GrantPolicy
) -> None:
    group, results, status = runs[policy]
    for result in results:
        assert [r.epoch for r in result.records] == list(range(EPOCHS))
    assert_no_overlap(
        [
            Interval(r.job_id, h.token or 0, h.mono_start, h.mono_end)
            for r in results
            for record in r.records
            for h in record.holds
        ]
    )
    a, b = (_rewards_intervals(r) for r in results)
    overlap = max(_overlap_fraction(a, b), _overlap_fraction(b, a))
    switches = _switches_per_epoch_per_job(results, group)
    carries = [h.carry for r in results for record in r.records for h in record.holds if h.carry]
    print(
        f"{policy}: rewards overlap {overlap:.2f}, switches/epoch/job {switches:.2f}, "
        f"carried {status.stats.carried}, answers {sorted(set(carries))}"
    )
    if policy is GrantPolicy.PHASE_AWARE:
        assert overlap < 0.45, f"the jobs phase-locked: rewards overlap {overlap:.2f}"
        assert switches <= 1.25, f"{switches:.2f} switches per epoch per job"
        assert status.stats.carried >= 1
    else:
        # fifo never carries a lease past a waiter. Whether its jobs then phase-lock is a
        # knife-edge with these times (each job's GPU block, 0.8 s, ends within milliseconds of
        # the other's rewards): most runs convoy (overlap 0.6-0.9, 2 switches per epoch per
        # job), one in about eight here interleaved instead, so the convoy is printed above,
        # not asserted; BENCHMARKS.md ("Phase-aware grants") measures it over whole runs.
        assert status.stats.carried == 0
        # Every answer is fifo's: keep when nobody waits, release to a waiter otherwise.
        assert carries, "no job asked to carry its lease: the check below would pass unasked"
        odd = {c for c in carries if not c.startswith(("fifo: ", "carrying into "))}
        assert not odd, f"answers fifo does not give: {sorted(odd)}"
