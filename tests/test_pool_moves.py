"""Pools that move jobs (docs/pools.md, "Moving jobs"): real jobs, a real pool, real processes.

Two light ``simulated`` jobs (most of an epoch is rewards, off the GPU) sent to a pool of two
groups without profiles are placed where they disturb least, one per group. Each measures its
profile after its first epochs and sends it to the pool; once both are known, the pool predicts
that one group holds both within its bound at a higher utilization, and moves one of them at
its next checkpoint boundary. A move by hand (``timeslice pool move``) is taken the same way,
and a job process killed right after its job moved resumes on the new group. Checked on the
jobs' own records: every epoch once, the epochs before the move on the old group and the rest
on the new one, no two holds of a group overlapping.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from timeslice.cli.stack import JobWorker, Stack
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_any_job_config, parse_job_config, start_any_rl_job, start_rl_job
from timeslice.pools import (
    PoolConfig,
    PoolGroup,
    create_pool,
    move_pool_job,
    pool_decisions,
    pool_status,
)
from timeslice.protocol.async_rl_job import AsyncRLJobProgress, AsyncRLJobResult
from timeslice.protocol.pool import PoolStatus
from timeslice.protocol.rl_job import RLJobProgress, RLJobResult, rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.helpers import Interval, assert_no_overlap, declared_profile, run_cli

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

# Light jobs: two fit one group well within the 1.25x bound (predicted 1.11x each).
OPTIONS = {"sample_s": 0.1, "reward_s": 0.6, "train_s": 0.1, "state_bytes": 1 << 16}


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _job(job_id: str, pool: str, epochs: int, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "workload": "simulated",
        "workload_options": OPTIONS,
        "pool": pool,
        "epochs": epochs,
        "checkpoint_every": 2,
        **extra,
    }


async def _until(probe: Callable[[], Awaitable[bool]], what: str, timeout: float = 90) -> None:
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + timeout, 0.05
    while not await probe():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(pause)
        pause = min(0.25, pause * 1.5)


async def _progress(client: Client, job: str) -> RLJobProgress:
    handle = client.get_workflow_handle(rl_job_workflow_id(job))
    return await handle.query("progress", result_type=RLJobProgress)


def _groups_by_epoch(result: RLJobResult) -> dict[int, set[str]]:
    return {r.epoch: {h.group_id for h in r.holds if h.group_id} for r in result.records}


def _assert_no_overlap_on(groups: list[str], results: list[RLJobResult]) -> None:
    for group in groups:
        assert_no_overlap(
            [
                Interval(r.job_id, h.token or 0, h.mono_start, h.mono_end)
                for r in results
                for rec in r.records
                for h in rec.holds
                if h.group_id == group
            ]
        )


def _assert_moved_once(result: RLJobResult, progress: RLJobProgress, old: str, new: str) -> None:
    """Every epoch once; those before the move on ``old``, the rest on ``new``."""
    assert [r.epoch for r in result.records] == list(range(result.epochs_done))
    (move,) = progress.moves
    assert (move.moved_from.sampler_group, move.moved_to.sampler_group) == (old, new)
    assert move.epoch > 0 and move.epoch % 2 == 0  # a checkpoint boundary
    for epoch, used in _groups_by_epoch(result).items():
        assert used == ({old} if epoch < move.epoch else {new}), (epoch, used, move)


def test_jobs_placed_without_profiles_are_packed_once_they_measured_them(
    stack: Stack, address: str, tmp_path: Path
) -> None:
    pool, uid = f"mpool-{_uid()}", _uid()
    groups = [f"mg1-{uid}", f"mg2-{uid}"]
    jobs = [f"mj{i}-{uid}" for i in range(2)]
    epochs = 8
    stack.job_workers(*(JobWorker((j,), "simulated", ("--threads", "1")) for j in jobs))

    async def run() -> tuple[list[RLJobResult], list[RLJobProgress], PoolStatus, list[str]]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=g) for g in groups]))
        handles = [
            await start_rl_job(client, parse_job_config(_job(j, pool, epochs))) for j in jobs
        ]
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        progress = [await _progress(client, j) for j in jobs]
        return results, progress, await pool_status(client, pool), await _events(client, pool)

    results, progress, status, events = asyncio.run(run())
    reasons = [d.reason for d in status.decisions]
    # Placed where they disturb least: one per group.
    first = {
        r.split(" ")[1]: r.split(" ")[3]
        for r in reasons
        if r.startswith("placed ") and "(no profile)" in r
    }
    assert set(first) == set(jobs) and set(first.values()) == set(groups), reasons
    assert sum(1 for r in reasons if r.endswith(" measured its profile")) == 2, reasons
    moved = [p for p in progress if p.moves]
    assert len(moved) == 1, [(p.job_id, p.moves) for p in progress]  # one move packs them
    (mover,) = moved
    (stayer,) = [p for p in progress if not p.moves]
    order = next(r for r in reasons if r.startswith(f"moved {mover.job_id} to "))
    worst = float(order.split("worst job ")[1].split("x")[0])
    assert "pool utilization +" in order and worst <= 1.25, order  # within the pool's bound
    result = {r.job_id: r for r in results}
    _assert_moved_once(result[mover.job_id], mover, first[mover.job_id], first[stayer.job_id])
    assert _groups_by_epoch(result[stayer.job_id]) == {
        e: {first[stayer.job_id]} for e in range(epochs)
    }
    _assert_no_overlap_on(groups, results)
    assert any(r.startswith(f"{mover.job_id} moved from ") for r in reasons), reasons
    assert status.jobs == []
    # Each decision is an event of the pool's history, as the Web UI lists them.
    assert events == reasons, (events, reasons)
    # `timeslice report --pool`: a lane per group and per job, the move marked on the mover's.
    shown = run_cli("report", "--pool", pool, "--text-only", "--trace", str(tmp_path / "t.json"),
                    "--address", address, timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert all(name in shown.stdout for name in [*jobs, *groups]), shown.stdout
    trace = json.loads((tmp_path / "t.json").read_text())
    moved = [e for e in trace["traceEvents"] if e.get("name") == "moved"]
    assert len(moved) == 1 and moved[0]["args"]["what"] == (
        f"moved from {first[mover.job_id]} to {first[stayer.job_id]}"
    ), moved


def test_a_job_moved_by_hand_resumes_on_its_new_group_after_its_process_is_killed(
    stack: Stack, address: str
) -> None:
    pool, uid = f"hpool-{_uid()}", _uid()
    groups = [f"hg1-{uid}", f"hg2-{uid}"]
    mover, other = f"hj-move-{uid}", f"hj-stay-{uid}"
    epochs = 6
    procs = {
        job: stack.job_workers(JobWorker((job,), "simulated", ("--threads", "1")))[0]
        for job in (mover, other)
    }
    created = run_cli("pool", "create", pool, "--group", groups[0], "--group", groups[1],
                      "--no-auto-move", "--address", address, timeout=60)  # fmt: skip
    assert created.returncode == 0, created.stderr

    async def run() -> tuple[list[RLJobResult], RLJobProgress, PoolStatus]:
        client = await connect(connect_config(address))
        handles = [
            await start_rl_job(
                client, parse_job_config(_job(job, pool, epochs, heartbeat_timeout_s=3))
            )
            for job in (mover, other)
        ]
        await _until(lambda: _placed(client, pool, 2), "both jobs placed", timeout=60)
        status = await pool_status(client, pool)
        at = {j.job_id: j.placement.sampler_group for j in status.jobs if j.placement}
        with pytest.raises(InvalidArgumentError, match=r"is on .* already"):
            await move_pool_job(client, pool, mover, at[mover])
        with pytest.raises(InvalidArgumentError, match="not in pool"):
            await move_pool_job(client, pool, mover, f"elsewhere-{uid}")
        await _until(lambda: _epoch_at_least(client, mover, 1), f"{mover} past its first epoch")
        moved = run_cli("pool", "move", pool, mover, at[other], "--address", address,
                        timeout=60)  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        assert f"moved {mover} to {at[other]} by hand" in moved.stdout
        await _until(lambda: _has_moved(client, mover), f"{mover} took its move")
        proc = procs[mover]
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
        await asyncio.to_thread(
            stack.job_workers, JobWorker((mover,), "simulated", ("--threads", "1"))
        )
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        return results, await _progress(client, mover), await pool_status(client, pool)

    results, progress, status = asyncio.run(run())
    result = {r.job_id: r for r in results}
    reasons = [d.reason for d in status.decisions]
    placed_on = {r.split(" ")[1]: r.split(" ")[3] for r in reasons if r.startswith("placed ")}
    _assert_moved_once(result[mover], progress, placed_on[mover], placed_on[other])
    assert result[mover].rewinds >= 1  # the killed process: back to the move's checkpoint
    _assert_no_overlap_on(groups, results)
    assert result[other].epochs_done == epochs and result[other].rewinds == 0
    assert not any(r.startswith("moved ") and "by hand" not in r for r in reasons), reasons
    shown = run_cli("pool", "move", pool, mover, groups[0], "--address", address, timeout=60)
    assert shown.returncode != 0 and "has placed no job" in shown.stderr, shown


def test_a_job_that_arrives_and_waits_gets_room_made_by_a_move(stack: Stack, address: str) -> None:
    """Two light jobs spread over the pool's two groups (one moved there by hand); a heavy job
    arrives that fits beside neither (predicted 1.38x): the pool orders one light job
    onto the other's group to make room for it, and places it on the group that frees."""
    pool, uid = f"qpool-{_uid()}", _uid()
    groups = [f"qg1-{uid}", f"qg2-{uid}"]
    lights, heavy = [f"ql{i}-{uid}" for i in range(2)], f"qh-{uid}"
    light_epochs, heavy_epochs = 16, 4
    heavy_options = {"sample_s": 1.0, "reward_s": 0.02, "train_s": 1.0, "state_bytes": 1 << 16}
    stack.job_workers(*(JobWorker((j,), "simulated", ("--threads", "1")) for j in [*lights, heavy]))

    async def run() -> tuple[list[RLJobResult], PoolStatus]:
        client = await connect(connect_config(address))
        config = PoolConfig(
            pool=pool, groups=[PoolGroup(name=g) for g in groups], move_every_epochs=1
        )
        await create_pool(client, config)
        light_profile = declared_profile(OPTIONS, light_epochs)
        handles = [
            await start_rl_job(
                client, parse_job_config(_job(j, pool, light_epochs, profile=light_profile))
            )
            for j in lights
        ]
        await _until(lambda: _placed(client, pool, 2), "both light jobs placed", timeout=60)
        status = await pool_status(client, pool)
        at = {j.job_id: j.placement.sampler_group for j in status.jobs if j.placement}
        assert at[lights[0]] == at[lights[1]], at  # packed as they arrive
        spare = next(g for g in groups if g != at[lights[1]])
        await _until(lambda: _epoch_at_least(client, lights[1], 1), "a light job's first epoch")
        await move_pool_job(client, pool, lights[1], spare)
        await _until(lambda: _has_moved(client, lights[1]), "the hand move taken")
        await _until(lambda: _settled(client, pool), "the pool saw the move")
        heavy_profile = declared_profile(heavy_options, heavy_epochs)
        heavy_config = _job(heavy, pool, heavy_epochs, profile=heavy_profile)
        heavy_config["workload_options"] = heavy_options
        handles.append(await start_rl_job(client, parse_job_config(heavy_config)))
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        return results, await pool_status(client, pool)

    results, status = asyncio.run(run())
    reasons = [d.reason for d in status.decisions]
    queued = next(i for i, r in enumerate(reasons) if r.startswith(f"queued {heavy}: "))
    made = next(i for i, r in enumerate(reasons) if f" to make room for {heavy} " in r)
    mover = reasons[made].split(" ")[1]
    assert mover in lights and queued < made, reasons
    freed = next(g for g in groups if f"moved {mover} to {g} " not in reasons[made])
    placed = next(i for i, r in enumerate(reasons) if r.startswith(f"placed {heavy} on "))
    assert placed > made and reasons[placed].startswith(f"placed {heavy} on {freed}:"), reasons
    result = {r.job_id: r for r in results}
    assert _groups_by_epoch(result[heavy]) == {e: {freed} for e in range(heavy_epochs)}
    for r in results:
        assert [rec.epoch for rec in r.records] == list(range(r.epochs_done)), r.job_id
    assert result[lights[0]].epochs_done == result[lights[1]].epochs_done == light_epochs
    _assert_no_overlap_on(groups, results)


@pytest.mark.long
def test_a_job_whose_profile_drifts_past_the_bound_is_moved_off_its_neighbour(
    stack: Stack, address: str
) -> None:
    """Two light jobs declare their profiles and are packed onto one group; from its epoch 3
    one job's GPU phases take eight times as long (its responses lengthened), so its
    neighbour would run past the pool's bound. It tells its pool the profile of its last
    epochs, and the pool moves one of the two to the other group: the bound kept, though the
    pool's predicted utilization falls."""
    pool, uid = f"dpool-{_uid()}", _uid()
    groups = [f"dg1-{uid}", f"dg2-{uid}"]
    steady, drifting = f"dj-steady-{uid}", f"dj-drift-{uid}"
    epochs = {steady: 20, drifting: 10}
    drift = {**OPTIONS, "gpu_scale_from": 3, "gpu_scale": 8}
    stack.job_workers(*(JobWorker((j,), "simulated", ("--threads", "1")) for j in epochs))

    async def run() -> tuple[list[RLJobResult], list[RLJobProgress], PoolStatus]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=g) for g in groups]))
        handles = []
        for job, n in epochs.items():
            config = _job(job, pool, n, profile=declared_profile(OPTIONS, n))
            if job == drifting:
                config["workload_options"] = drift
            handles.append(await start_rl_job(client, parse_job_config(config)))
        results = list(await asyncio.gather(*(h.result() for h in handles)))
        progress = [await _progress(client, j) for j in epochs]
        return results, progress, await pool_status(client, pool)

    results, progress, status = asyncio.run(run())
    reasons = [d.reason for d in status.decisions]
    placed_on = {
        r.split(" ")[1]: r.split(" ")[3].rstrip(":") for r in reasons if r.startswith("placed ")
    }
    assert placed_on[steady] == placed_on[drifting], reasons  # packed while both were light
    drifted = next(i for i, r in enumerate(reasons) if r.startswith(f"{drifting}'s profile"))
    assert "drifted: GPU 0.20 -> 1.6" in reasons[drifted], reasons[drifted]
    assert not any("profile drifted" in r for r in reasons if r.startswith(steady)), reasons
    ordered = [i for i, r in enumerate(reasons) if r.startswith("moved ") and " to " in r]
    (order,) = [i for i in ordered if "back within its bound" in reasons[i]]
    assert order > drifted and len(ordered) == 1, reasons
    was = float(reasons[order].split("worst job was ")[1].split("x")[0])
    worst = float(reasons[order].split("worst job ")[2].split("x")[0])
    assert was > 1.25 >= worst, reasons[order]
    (mover,) = [p for p in progress if p.moves]
    spare = next(g for g in groups if g != placed_on[mover.job_id])
    result = {r.job_id: r for r in results}
    _assert_moved_once(result[mover.job_id], mover, placed_on[mover.job_id], spare)
    for job, n in epochs.items():
        assert result[job].epochs_done == n and result[job].rewinds == 0, job
    _assert_no_overlap_on(groups, results)


@pytest.mark.long
def test_an_async_job_moved_by_hand_runs_both_loops_on_its_new_groups(
    stack: Stack, address: str
) -> None:
    """An async job placed on two groups of a pool of three is moved by hand (`timeslice pool
    move --trainer-group`): its sampler to the third group, its trainer to where its sampler
    was. Both loops stop at its next checkpoint (batches sampled past it are dropped) and run
    on from it on the new groups: every step once, those before the move sampled and trained
    on the old groups, the rest on the new, no two holds of a group overlapping."""
    pool, uid = f"apool-{_uid()}", _uid()
    groups = [f"ag1-{uid}", f"ag2-{uid}", f"ag3-{uid}"]
    job, steps = f"aj-move-{uid}", 10
    stack.job_workers(JobWorker((job,), "simulated", ("--threads", "1")))

    async def run() -> tuple[AsyncRLJobResult, AsyncRLJobProgress, PoolStatus, str]:
        client = await connect(connect_config(address))
        await create_pool(client, PoolConfig(pool=pool, groups=[PoolGroup(name=g) for g in groups]))
        config = _job(job, pool, steps, mode="async", max_staleness=1)
        handle = await start_any_rl_job(client, parse_any_job_config(config))
        await _until(lambda: _placed(client, pool, 1), "the job placed", timeout=60)
        (placed,) = (await pool_status(client, pool)).jobs
        assert placed.placement is not None
        old = placed.placement
        spare = next(g for g in groups if g not in {old.sampler_group, old.trainer_group})
        refused = run_cli("pool", "move", pool, job, spare, "--address", address, timeout=60)
        assert refused.returncode != 0 and "two groups" in refused.stderr, refused
        await _until(lambda: _async_step_at_least(client, job, 1), f"{job} past its first step")
        moved = run_cli("pool", "move", pool, job, spare, "--trainer-group", old.sampler_group,
                        "--address", address, timeout=60)  # fmt: skip
        assert moved.returncode == 0, moved.stderr
        result = AsyncRLJobResult.model_validate((await handle.result()).model_dump())
        progress = await client.get_workflow_handle(rl_job_workflow_id(job)).query(
            "progress", result_type=AsyncRLJobProgress
        )
        return result, progress, await pool_status(client, pool), moved.stdout

    result, progress, status, said = asyncio.run(run())
    (move,) = progress.moves
    old, new = move.moved_from, move.moved_to
    assert new.sampler_group not in {old.sampler_group, old.trainer_group}, move
    assert new.trainer_group == old.sampler_group, move
    assert f"moved {job} to {new.sampler_group} (sampler) + {new.trainer_group} (trainer)" in said
    assert move.epoch > 0 and move.epoch % 2 == 0  # a checkpoint boundary
    assert result.epochs_done == steps
    assert [r.epoch for r in result.records] == list(range(steps))
    for record in result.records:
        at = old if record.epoch < move.epoch else new
        used = {h.phase: h.group_id for h in record.holds}
        assert used == {"sample": at.sampler_group, "train": at.trainer_group}, (record, move)
    _assert_no_overlap_on(groups, [result])
    reasons = [d.reason for d in status.decisions]
    assert any(r.startswith(f"{job} moved from {old.sampler_group} (sampler) + ") for r in reasons)


async def _settled(client: Client, pool: str) -> bool:
    """Every job the pool placed is where the pool thinks it is (no move under way)."""
    status = await pool_status(client, pool)
    return all(j.moving_from is None for j in status.jobs)


async def _placed(client: Client, pool: str, count: int) -> bool:
    status = await pool_status(client, pool)
    return sum(1 for j in status.jobs if j.placement is not None) == count


async def _epoch_at_least(client: Client, job: str, epoch: int) -> bool:
    return (await _progress(client, job)).epoch >= epoch


async def _async_step_at_least(client: Client, job: str, step: int) -> bool:
    handle = client.get_workflow_handle(rl_job_workflow_id(job))
    return (await handle.query("progress", result_type=AsyncRLJobProgress)).epoch >= step


async def _has_moved(client: Client, job: str) -> bool:
    progress = await _progress(client, job)
    return bool(progress.moves) and progress.epoch > progress.moves[-1].epoch


async def _events(client: Client, pool: str) -> list[str]:
    """The decisions the pool's history records as events (its memo upserts)."""
    return [d.reason for d in await pool_decisions(client, pool)]
