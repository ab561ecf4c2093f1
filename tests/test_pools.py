"""Pools (docs/pools.md): real jobs placed by a real pool, and the bad input it refuses.

Three ``simulated`` jobs whose declared profiles are nearly all GPU (two on one group would run
each ~1.8x slower than alone, past the pool's 1.25x bound) go to a pool of two groups: two are
placed at once, one per group, and the third waits in the pool's queue until one of them ends,
then runs on the group that one freed. Checked on the jobs' own records (every epoch once, no
two holds of a group overlapping) and on the pool's decisions.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from timeslice.cli.stack import JobWorker, Stack
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_any_job_config, parse_job_config, start_any_rl_job, start_rl_job
from timeslice.pools import PoolConfig, PoolGroup, create_pool, pool_status
from timeslice.protocol.async_rl_job import AsyncRLJobResult
from timeslice.protocol.group import CONTROL_TASK_QUEUE
from timeslice.protocol.pool import (
    MAX_POOL_PROFILE_CHARS,
    POOL_WORKFLOW,
    JobEnded,
    PlaceAnswer,
    PlaceRequest,
    PoolSignal,
    PoolStatus,
    PoolUpdate,
    pool_workflow_id,
    profile_chars,
)
from timeslice.protocol.rl_job import RL_JOB_WORKFLOW_TYPE, RLJobResult, rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.helpers import Interval, assert_no_overlap, run_cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

EPOCHS = 3
OPTIONS = {"sample_s": 0.25, "reward_s": 0.02, "train_s": 0.25, "state_bytes": 1 << 16}
# What the jobs declare: their phases as the options set them (the GPU ~95% of an epoch).
PROFILE = {
    "epochs": EPOCHS,
    "phases": [
        {"name": "sample", "gpu": True, "pool": "sampler", "seconds": 0.25},
        {"name": "rewards", "gpu": False, "seconds": 0.02},
        {"name": "train", "gpu": True, "pool": "trainer", "seconds": 0.25},
    ],
}


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _job(job_id: str, pool: str, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "workload": "simulated",
        "workload_options": OPTIONS,
        "pool": pool,
        "epochs": EPOCHS,
        "checkpoint_every": EPOCHS,
        **extra,
    }


def _cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--address", address, timeout=60)


def test_a_full_pool_queues_a_job_until_another_ends(
    stack: Stack, address: str, tmp_path: Path
) -> None:
    pool, uid = f"pool-{_uid()}", _uid()
    groups = [f"pg1-{uid}", f"pg2-{uid}"]
    jobs = [f"pj{i}-{uid}" for i in range(3)]
    created = _cli(address, "pool", "create", pool, "--group", f"{groups[0]}:1GiB:node-a",
                   "--group", groups[1])  # fmt: skip
    assert created.returncode == 0, created.stderr

    async def run() -> tuple[list[RLJobResult], Any]:
        client = await connect(connect_config(address))
        handles = []
        for job in jobs:
            handles.append(
                await start_rl_job(client, parse_job_config(_job(job, pool, profile=PROFILE)))
            )
            if len(handles) == 2:  # both placed before the third asks: the third must queue
                await _wait_async(lambda: _placed(client, pool, 2))
        await _wait_async(lambda: _known(client, pool, 3))
        # Their processes start only now: no job can end before the third is in the queue.
        await asyncio.to_thread(
            stack.job_workers, *(JobWorker((j,), "simulated", ("--threads", "1")) for j in jobs)
        )
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        return results, await pool_status(client, pool)

    results, status = asyncio.run(run())
    for result in results:
        assert result.epochs_done == EPOCHS
        assert [r.epoch for r in result.records] == list(range(EPOCHS))  # every epoch once
    holds = {
        g: [
            Interval(r.job_id, h.token or 0, h.mono_start, h.mono_end)
            for r in results
            for rec in r.records
            for h in rec.holds
            if h.group_id == g
        ]
        for g in groups
    }
    for intervals in holds.values():
        assert_no_overlap(intervals)
    used = {h.group_id for r in results for rec in r.records for h in rec.holds}
    assert used == set(groups)
    reasons = [d.reason for d in status.decisions]
    queued = next(i for i, r in enumerate(reasons) if r.startswith(f"queued {jobs[2]}"))
    placed = next(i for i, r in enumerate(reasons) if r.startswith(f"placed {jobs[2]} on "))
    first_end = next(i for i, r in enumerate(reasons) if " completed: " in r)
    assert queued < first_end < placed, reasons
    # The third job ran on the group of the job that ended first, after that job's last hold.
    ender = reasons[first_end].split(" ")[0]
    ender_group = {h.group_id for r in results if r.job_id == ender for rec in r.records
                   for h in rec.holds}  # fmt: skip
    third = [h for r in results if r.job_id == jobs[2] for rec in r.records for h in rec.holds]
    assert {h.group_id for h in third} == ender_group
    ender_last = max(i.end for i in holds[next(iter(ender_group))] if i.job == ender)
    assert min(h.mono_start for h in third) >= ender_last
    assert status.jobs == []  # every job told the pool it ended
    shown = _cli(address, "pool", "status", pool)
    assert shown.returncode == 0, shown.stderr
    assert f"queued {jobs[2]}: no group takes it within the pool's bound 1.25x" in shown.stdout
    assert "node-a" in shown.stdout and "1.0 GiB" in shown.stdout
    # The report reads a job whose first input named a pool, not groups.
    report = _cli(address, "report", "--job", jobs[2], "--text-only", "--out", str(tmp_path))
    assert report.returncode == 0, report.stderr
    # So does `timeslice plan profile`: its profile says where its pool ran it.
    profiled = _cli(address, "plan", "profile", jobs[2], "--out", str(tmp_path), "--format",
                    "json")  # fmt: skip
    assert profiled.returncode == 0, profiled.stderr
    source = json.loads((tmp_path / f"{jobs[2]}.json").read_text())["source"]
    assert source["sampler_group"] == source["trainer_group"] in ender_group


def test_an_async_job_is_placed_on_two_groups_of_its_pool(stack: Stack, address: str) -> None:
    """An async job without a profile: its sampler and trainer on two different groups of the
    pool (the least demand), every step once, its measured profile sent after its first
    steps, and the pool told when it ended."""
    pool, uid = f"apool-{_uid()}", _uid()
    groups = [f"ag1-{uid}", f"ag2-{uid}", f"ag3-{uid}"]
    job = f"aj-{uid}"
    stack.job_workers(JobWorker((job,), "simulated", ("--threads", "1")))

    async def run() -> tuple[AsyncRLJobResult, Any]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=g) for g in groups]))
        config = parse_any_job_config(
            _job(job, pool, mode="async", max_staleness=1, epochs=4, checkpoint_every=4)
        )
        handle = await start_any_rl_job(client, config)
        result = await handle.result()
        return AsyncRLJobResult.model_validate(result.model_dump()), await pool_status(client, pool)

    result, status = asyncio.run(run())
    assert result.epochs_done == 4
    assert [r.epoch for r in result.records] == list(range(4))
    sample = {h.group_id for r in result.records for h in r.holds if h.phase == "sample"}
    train = {h.group_id for r in result.records for h in r.holds if h.phase == "train"}
    assert len(sample) == len(train) == 1 and sample != train and sample | train <= set(groups)
    assert status.jobs == []
    assert any(d.reason.startswith(f"placed {job} on ") and "(sampler)" in d.reason
               for d in status.decisions), status.decisions  # fmt: skip
    # Placed without a profile, it measured one after its first steps, as a sync job does.
    assert f"{job} measured its profile" in [d.reason for d in status.decisions]


def test_a_job_that_fails_tells_its_pool(address: str) -> None:
    """A placed job that fails (no process ever serves it) frees its group: the job queued
    behind it is placed there."""
    pool, uid = f"fpool-{_uid()}", _uid()
    first, second = f"fj1-{uid}", f"fj2-{uid}"

    async def run() -> list[str]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=f"fg-{uid}")]))
        # No job process serves them: each fails once it waited process_wait_s for one; the
        # first waits long enough for the second to be queued behind it.
        lonely = {"profile": PROFILE, "process_wait_s": 1.5}
        config = _job(first, pool, **{**lonely, "process_wait_s": 4.0})
        handle = await start_rl_job(client, parse_job_config(config))
        await _wait_async(lambda: _placed(client, pool, 1))
        behind = await start_rl_job(client, parse_job_config(_job(second, pool, **lonely)))
        await _wait_async(lambda: _known(client, pool, 2))
        for job in (handle, behind):
            with pytest.raises(WorkflowFailureError):
                await job.result()
        status = await pool_status(client, pool)
        assert status.jobs == []
        return [d.reason for d in status.decisions]

    reasons = asyncio.run(run())
    order = [
        next(i for i, r in enumerate(reasons) if r.startswith(prefix))
        for prefix in (f"placed {first}", f"queued {second}", f"{first} failed",
                       f"placed {second}", f"{second} failed")
    ]  # fmt: skip
    assert order == sorted(order), reasons


def test_a_cancelled_job_leaves_its_pool(address: str) -> None:
    """A job cancelled while it waits in the queue, and one cancelled while placed, both leave
    the pool's record."""
    pool, uid = f"cpool-{_uid()}", _uid()
    jobs = [f"cj1-{uid}", f"cj2-{uid}"]

    async def run() -> list[str]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=f"cg-{uid}")]))
        handles = []
        for job in jobs:  # no process serves them: the first waits for one, placed
            config = _job(job, pool, profile=PROFILE, process_wait_s=120)
            handles.append(await start_rl_job(client, parse_job_config(config)))
            await _wait_async(lambda: _known(client, pool, len(handles)))
        for left, handle in enumerate(reversed(handles)):  # the queued one first
            await handle.cancel()
            await _wait_async(lambda left=left: _known(client, pool, len(handles) - 1 - left))
        return [d.reason for d in (await pool_status(client, pool)).decisions]

    reasons = asyncio.run(run())
    assert reasons[1].startswith(f"queued {jobs[1]}"), reasons
    assert reasons[2:] == [f"{jobs[1]} cancelled: its groups are free",
                           f"{jobs[0]} cancelled: its groups are free"], reasons  # fmt: skip


def test_a_placement_request_that_comes_after_its_job_ended_is_refused(address: str) -> None:
    """A job cancelled while its placement request's try was in flight told the pool it
    ended; the try reaches the pool after that and must not put the job back (it stayed
    there, holding room, before). A later run of the same job id is placed."""
    pool, uid = f"epool-{_uid()}", _uid()
    job = f"ej-{uid}"

    def request(run_id: str) -> PlaceRequest:
        return PlaceRequest(job_id=job, profile=PROFILE, run_id=run_id)

    async def run() -> tuple[str, PlaceAnswer, PoolStatus]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=f"eg-{uid}")]))
        handle = client.get_workflow_handle(pool_workflow_id(pool))
        ended = JobEnded(job_id=job, outcome="cancelled", run_id="first-run")
        await handle.signal(PoolSignal.JOB_ENDED, ended)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(PoolUpdate.PLACE, request("first-run"))
        status_after_refusal = await pool_status(client, pool)
        assert status_after_refusal.jobs == []
        again = await handle.execute_update(
            PoolUpdate.PLACE, request("second-run"), result_type=PlaceAnswer
        )
        return str(refused.value.cause), again, await pool_status(client, pool)

    refusal, again, status = asyncio.run(run())
    assert f"job {job}'s run first-run has ended: not placed" in refusal
    assert again.placement is not None
    assert [j.job_id for j in status.jobs] == [job]
    assert status.ended_runs == ["first-run"]


def test_a_pool_refuses_a_job_whose_profile_would_take_it_past_its_budget(address: str) -> None:
    """Every placement carries the pool's jobs' profiles to its activity: past Temporal's
    2-MB payload the pool was wedged. The job past the budget is refused, saying why, and the
    pool goes on answering."""
    pool, uid = f"bpool-{_uid()}", _uid()
    # 16 KiB as a profile is allowed at most (source notes are the planner's free text).
    big = {**PROFILE, "source": {"notes": ["x" * 16_000]}}
    fits = MAX_POOL_PROFILE_CHARS // profile_chars(big)

    async def run() -> tuple[int, str, PoolStatus]:
        client = await connect(connect_config(address))
        config = PoolConfig(pool=pool, groups=[PoolGroup(name=f"bg-{uid}")], auto_move=False)
        await create_pool(client, config)
        handle = client.get_workflow_handle(pool_workflow_id(pool))
        for n in range(fits + 1):
            request = PlaceRequest(job_id=f"bj{n}-{uid}", profile=big, run_id=f"run-{n}")
            try:
                await handle.execute_update(PoolUpdate.PLACE, request, result_type=PlaceAnswer)
            except WorkflowUpdateFailedError as err:
                return n, str(err.cause), await pool_status(client, pool)
        return fits + 1, "", await pool_status(client, pool)

    refused_at, why, status = asyncio.run(run())
    assert refused_at == fits, why
    assert "characters of JSON, past the 1,000,000 a pool keeps" in why
    assert len(status.jobs) == fits
    assert status.decisions[-1].reason.startswith(f"refused bj{fits}-{uid}: the pool's jobs'")


async def _known(client: Client, pool: str, n: int) -> bool:
    return len((await pool_status(client, pool)).jobs) == n


async def _wait_async(probe: Any, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await probe():
        assert loop.time() < deadline, "timed out waiting for the pool to place two jobs"
        await asyncio.sleep(0.05)


async def _placed(client: Client, pool: str, n: int) -> bool:
    status = await pool_status(client, pool)
    return sum(1 for j in status.jobs if j.placement is not None) >= n


def test_bad_pools_and_pool_jobs_are_refused(address: str) -> None:
    uid = _uid()

    async def run() -> None:
        client = await connect(connect_config(address))
        await _refusals_before_anything_starts(client, uid)
        await _refusals_of_workflows_started_by_hand(client, uid)

    asyncio.run(run())


async def _refusals_before_anything_starts(client: Client, uid: str) -> None:
    taken = f"taken-{uid}"
    await create_pool(client, PoolConfig(pool=f"first-{uid}", groups=[PoolGroup(name=taken)]))
    second = f"second-{uid}"
    with pytest.raises(InvalidArgumentError, match=f"'{taken}' \\(pool 'first-{uid}'\\)"):
        await create_pool(client, PoolConfig(pool=second, groups=[PoolGroup(name=taken)]))
    with pytest.raises(InvalidArgumentError, match="exists already"):
        await create_pool(client, PoolConfig(pool=f"first-{uid}", groups=[PoolGroup(name="x")]))
    unknown = parse_job_config(_job(f"nojob-{uid}", f"nopool-{uid}"))
    with pytest.raises(InvalidArgumentError, match=f"no pool 'nopool-{uid}' runs"):
        await start_rl_job(client, unknown)
    both = parse_job_config(_job(f"both-{uid}", f"first-{uid}", sampler_group="g"))
    with pytest.raises(InvalidArgumentError, match="not both"):
        await start_rl_job(client, both)
    for job_id in (f"nojob-{uid}", f"both-{uid}"):  # nothing was started
        with pytest.raises(Exception, match="not found"):
            await client.get_workflow_handle(rl_job_workflow_id(job_id)).describe()
    assert not await _exists(client, pool_workflow_id(second))


async def _exists(client: Client, workflow_id: str) -> bool:
    try:
        await client.get_workflow_handle(workflow_id).describe()
    except Exception:
        return False
    return True


async def _failure(client: Client, workflow: str, workflow_id: str, arg: Any) -> str:
    """Start ``workflow`` as the ``temporal`` CLI would (raw JSON) and return its failure."""
    handle = await client.start_workflow(
        workflow, arg, id=workflow_id, task_queue=CONTROL_TASK_QUEUE
    )
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    cause = failed.value.cause
    assert getattr(cause, "non_retryable", False), cause
    return str(getattr(cause, "message", cause))


async def _refusals_of_workflows_started_by_hand(client: Client, uid: str) -> None:
    empty = f"empty-{uid}"
    why = await _failure(
        client, POOL_WORKFLOW, pool_workflow_id(empty), {"pool": empty, "groups": []}
    )
    assert "has no groups" in why
    other = f"other-{uid}"
    why = await _failure(
        client, POOL_WORKFLOW, pool_workflow_id(other),
        {"pool": other, "groups": [{"name": f"taken-{uid}"}]},
    )  # fmt: skip
    assert f"already in pool 'first-{uid}'" in why
    memory = f"mem-{uid}"
    why = await _failure(
        client, POOL_WORKFLOW, pool_workflow_id(memory),
        {"pool": memory, "groups": [{"name": f"m-{uid}", "memory_bytes": "80Q"}]},
    )  # fmt: skip
    assert "invalid memory size '80Q'" in why
    job = f"lost-{uid}"
    why = await _failure(
        client, RL_JOB_WORKFLOW_TYPE, rl_job_workflow_id(job), _job(job, f"nopool-{uid}")
    )
    assert f"no pool 'nopool-{uid}' runs" in why
    job = f"badprofile-{uid}"
    bad = {**PROFILE, "phases": [{**PROFILE["phases"][0], "seconds": -1}]}
    why = await _failure(
        client, RL_JOB_WORKFLOW_TYPE, rl_job_workflow_id(job),
        _job(job, f"first-{uid}", profile=bad),
    )  # fmt: skip
    assert "invalid profile" in why and "seconds" in why, why
    status = await pool_status(client, f"first-{uid}")
    assert status.jobs == []  # the refused job is not left in the pool


def test_a_tenant_at_its_quota_waits_while_another_tenants_job_runs(
    stack: Stack, address: str
) -> None:
    """A tenant with a quota of one group's worth: its second job waits in the queue though
    the pool has a free group, which another tenant's job takes; it is placed when its first
    ended, never beside it."""
    pool, uid = f"tpool-{_uid()}", _uid()
    groups = [f"tg1-{uid}", f"tg2-{uid}", f"tg3-{uid}"]
    a1, a2, b1 = f"ta1-{uid}", f"ta2-{uid}", f"tb1-{uid}"
    created = _cli(address, "pool", "create", pool, *(x for g in groups for x in ("--group", g)),
                   "--tenant", "team-a:1", "--tenant", "team-b:-:2", "--tenant", "tiny:0.5",
                   )  # fmt: skip
    assert created.returncode == 0, created.stderr
    bad = _cli(address, "pool", "create", f"x{pool}", "--group", f"x{groups[0]}",
               "--tenant", "team-a:1:0")  # fmt: skip
    assert bad.returncode == 2 and "--tenant 'team-a:1:0'" in bad.stderr, bad

    async def run() -> tuple[list[RLJobResult], PoolStatus, str]:
        client = await connect(connect_config(address))
        # Without a profile a job counts a whole group: above tiny's whole quota, refused.
        never = parse_job_config(_job(f"tiny-{uid}", pool, tenant="tiny"))
        with pytest.raises(InvalidArgumentError, match="could never place it"):
            await start_rl_job(client, never)
        handles = []
        for job, tenant in ((a1, "team-a"), (a2, "team-a"), (b1, "team-b")):
            config = _job(job, pool, profile=PROFILE, tenant=tenant)
            handles.append(await start_rl_job(client, parse_job_config(config)))
            known = len(handles)  # each placed or queued before the next asks
            await _wait_async(lambda known=known: _known(client, pool, known))
        shown = _cli(address, "pool", "status", pool).stdout
        await asyncio.to_thread(
            stack.job_workers,
            *(JobWorker((j,), "simulated", ("--threads", "1")) for j in (a1, a2, b1)),
        )
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        return results, await pool_status(client, pool), shown

    results, status, shown = asyncio.run(run())
    reasons = [d.reason for d in status.decisions]
    at = {r.split(" ")[1]: i for i, r in enumerate(reasons) if r.startswith("placed ")}
    queued = next(i for i, r in enumerate(reasons) if r.startswith(f"queued {a2}: tenant team-a"))
    ended = next(i for i, r in enumerate(reasons) if r.startswith(f"{a1} completed"))
    assert at[a1] < queued < at[b1] < ended < at[a2], reasons  # b1 went on while a2 waited
    assert "holds 0.96 of its quota 1 groups' worth and" in reasons[queued], reasons[queued]
    holds = {r.job_id: [h for rec in r.records for h in rec.holds] for r in results}
    assert min(h.mono_start for h in holds[a2]) >= max(h.mono_end for h in holds[a1])
    for result in results:
        assert [r.epoch for r in result.records] == list(range(EPOCHS))
    assert "team-a" in shown and "team-b" in shown and "tenant" in shown, shown
    assert not any(f"tiny-{uid}" in r for r in reasons), reasons  # nothing started
    assert status.jobs == []


def test_a_pool_created_again_without_a_group_leaves_that_group_to_another_pool(
    address: str,
) -> None:
    """A pool deleted (terminated) and created again under its name without one of its groups
    no longer holds that group: its old claim is stale, and another pool takes the group over
    (only that claim's run is ended, so two pools taking one stale claim over at once cannot
    end each other's new claims)."""
    from timeslice.session.pool_claims import group_owner

    uid = _uid()
    pool, other, kept, left = f"rp-{uid}", f"rq-{uid}", f"rg1-{uid}", f"rg2-{uid}"

    async def run() -> tuple[str | None, str | None]:
        client = await connect(connect_config(address))
        both = [PoolGroup(name=kept), PoolGroup(name=left)]
        await create_pool(client, PoolConfig(pool=pool, groups=both))

        async def owned_by(group: str, owner: str) -> bool:
            return await group_owner(client, group) == owner

        await _wait_async(lambda: owned_by(left, pool))
        await client.get_workflow_handle(pool_workflow_id(pool)).terminate("deleted")
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=kept)]))
        await create_pool(client, PoolConfig(pool=other, groups=[PoolGroup(name=left)]))
        await _wait_async(lambda: owned_by(left, other))
        await _wait_async(lambda: owned_by(kept, pool))
        return await group_owner(client, left), await group_owner(client, kept)

    assert asyncio.run(run()) == (other, pool)


def test_a_queued_job_is_placed_once_a_placed_jobs_measured_profile_leaves_room(
    address: str,
) -> None:
    """One group: a job placed without a profile fills it (its demand unknown), so a profiled
    job queues. When the first job's measured profile comes (light: 2% GPU), the queue is
    tried again and the queued job placed beside it, without waiting for a job to end."""
    from timeslice.protocol.pool import JobProfiled, PoolSignal

    uid = _uid()
    pool, first, second = f"qp-{uid}", f"qa-{uid}", f"qb-{uid}"
    light = {**PROFILE, "phases": [
        {"name": "sample", "gpu": True, "pool": "sampler", "seconds": 0.01},
        {"name": "rewards", "gpu": False, "seconds": 1.0},
        {"name": "train", "gpu": True, "pool": "trainer", "seconds": 0.01},
    ]}  # fmt: skip

    async def run() -> list[str]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=f"qg-{uid}")]))
        handles = []
        for job, profile in ((first, None), (second, PROFILE)):  # no process serves them
            config = _job(job, pool, process_wait_s=120)
            if profile is not None:
                config["profile"] = profile
            handles.append(await start_rl_job(client, parse_job_config(config)))
            known = len(handles)
            await _wait_async(lambda known=known: _known(client, pool, known))
        await _wait_async(lambda: _placed(client, pool, 1))
        status = await pool_status(client, pool)
        assert [j.placement is None for j in status.jobs] == [False, True], status.jobs
        await client.get_workflow_handle(pool_workflow_id(pool)).signal(
            PoolSignal.JOB_PROFILED, JobProfiled(job_id=first, profile=light)
        )
        await _wait_async(lambda: _placed(client, pool, 2))
        for handle in handles:
            await handle.cancel()
        return [d.reason for d in (await pool_status(client, pool)).decisions]

    reasons = asyncio.run(run())
    assert any(r.startswith(f"placed {second}") for r in reasons), reasons
