"""`timeslice plan profile` on real runs: two RL jobs sharing a group, and a client's leases.

The jobs are real RLJobWorkflows served by real `timeslice job worker` processes (the
`simulated` workload: phases hold their lease for set times, switches move a simulated state);
the profiles are read back through the CLI, from the workflows' histories.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from timeslice.activities.group_requests import start_group
from timeslice.plan.collect import completion_s, opens_for_simulation, start_for_simulation
from timeslice.plan.profile import dump_profile, load_profile
from timeslice.plan.simulator import GroupSpec, Placement, simulate
from timeslice.protocol.group import GrantPolicy, GroupConfig
from timeslice.protocol.rl_job import RLJobResult
from timeslice.transport.connection import connect, connect_config

from tests.conftest import start_service, stop_process
from tests.helpers import run_simulated_jobs

OPTIONS = {
    "sample_s": 0.3,
    "reward_s": 0.5,
    "train_s": 0.2,
    "state_bytes": 1_000_000,
    "snapshot_s": 0.05,
}
EPOCHS = 4


@pytest.fixture
def two_jobs(address: str, tmp_path: Path) -> Iterator[tuple[str, list[RLJobResult], str]]:
    """Two simulated RL jobs run to completion on one group (which holds both states)."""
    group = f"plan-{uuid.uuid4().hex[:8]}"
    jobs = [f"plan-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    serve = ["--workload", "simulated", "--checkpoint-dir", str(tmp_path / "ckpt")]
    procs = [
        start_service(
            ["job", "worker", "--address", address, "--job-id", job, *serve, "--threads", "1"],
            f"job {job} rank 0",
            tmp_path / f"{job}.log",
        )
        for job in jobs
    ]

    async def go() -> list[RLJobResult]:
        client = await connect(connect_config(address))
        # FIFO grants: what is checked is the profile. Under phase_aware whether a release
        # carries its lease past the other job turns on milliseconds, and one decision taken
        # the other way changes every grant after it: under load a prediction missed by 19%.
        # bench/plan_check.py measures the policy's predictions, on longer runs.
        await start_group(
            client,
            GroupConfig(group_id=group, memory_bytes=4 * 2_000_000, grant_policy=GrantPolicy.FIFO),
        )
        return await run_simulated_jobs(
            client, jobs, group, OPTIONS, epochs=EPOCHS, checkpoint_every=2
        )

    try:
        yield group, asyncio.run(go()), address
    finally:
        for proc in procs:
            stop_process(proc)


def plan_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "timeslice"), "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_profile_round_trips_from_real_finished_jobs(
    two_jobs: tuple[str, list[RLJobResult], str], tmp_path: Path
) -> None:
    group, results, address = two_jobs
    out = tmp_path / "profiles"
    ids = [r.job_id for r in results]
    done = plan_cli("profile", *ids, "--address", address, "--out", str(out), "--format", "json")
    assert done.returncode == 0, done.stderr
    assert "sample" in done.stdout and "GPU share" in done.stdout

    profiles = [load_profile(out / f"{job}.json") for job in ids]
    for profile, result in zip(profiles, results, strict=True):
        assert profile.job_id == result.job_id
        assert profile.kind == "rl-job" and profile.epochs == EPOCHS
        phases = {p.name: p for p in profile.phases}
        assert list(phases) == ["sample", "rewards", "train"]
        assert [(p.gpu, p.pool) for p in phases.values()] == [
            (True, "sampler"),
            (False, None),
            (True, "trainer"),
        ]
        for name, key in (("sample", "sample_s"), ("rewards", "reward_s"), ("train", "train_s")):
            seconds = phases[name].seconds
            assert seconds.samples == EPOCHS
            # Each phase holds for its set time; the clock read around it adds a little.
            assert OPTIONS[key] <= seconds.mean < OPTIONS[key] + 0.3, (name, seconds)
        assert profile.checkpoint_every == 2 and profile.checkpoint_s is not None
        states = {s.name: s for s in profile.states}
        assert {n: (s.pool, s.bytes) for n, s in states.items()} == {
            "sampler": ("sampler", OPTIONS["state_bytes"]),
            "trainer": ("trainer", OPTIONS["state_bytes"]),
        }
        # The jobs took turns, so each restored its state: its move times were measured.
        for s in states.values():
            assert s.restore_s is not None and OPTIONS["snapshot_s"] <= s.restore_s < 0.5
        source = profile.source
        assert source is not None and source.workflow_id == f"rl-job-{profile.job_id}"
        assert source.runs == 1 and source.epochs_read == EPOCHS
        assert source.sampler_group == source.trainer_group == group
        assert source.overheads is not None and source.overheads.samples > 0
        assert 0 < source.overheads.hop_s < 1.0

        # The file round-trips, in both formats.
        for suffix in (".json", ".yaml"):
            again = tmp_path / f"again{suffix}"
            dump_profile(profile, again)
            assert load_profile(again) == profile

    # The profiles predict the run they came from: each job's completion (first phase start
    # to last phase end), within 20% (bench/plan_check.py measures how close, on longer runs).
    # Four epochs of sub-second phases on two shared cores: CI saw 10.3% over (5.98 s predicted
    # for 5.42 s), a loaded run 12% under, and a run at load 7 ran 15.3% past its prediction
    # (6.09 s for 5.28 s), with nothing wrong in the profile.
    overheads = profiles[0].source.overheads  # type: ignore[union-attr]
    assert overheads is not None
    starts = {r.job_id: start_for_simulation(r) for r in results}
    origin = min(starts.values())
    opens = opens_for_simulation(results, overheads.grant_s)[group] - origin
    outcome = simulate(
        [Placement(p, group, group, start_s=starts[p.job_id] - origin) for p in profiles],
        groups={
            group: GroupSpec(
                memory_bytes=4 * 2_000_000, opens_s=opens, grant_policy=GrantPolicy.FIFO
            )
        },
        overheads=overheads,
    )
    for r in results:
        assert outcome.jobs[r.job_id].completion_s == pytest.approx(completion_s(r), rel=0.2)


def test_client_job_profile_from_the_groups_lease_history(
    make_client: Any, group: str, address: str, tmp_path: Path
) -> None:
    job = f"client-{uuid.uuid4().hex[:6]}"
    client = make_client(job_id=job, group_id=group)
    for _ in range(4):
        lease = client.acquire()
        time.sleep(0.2)
        client.release(lease)
        time.sleep(0.3)
    out = tmp_path / "profiles"
    done = plan_cli("profile", job, "--group", group, "--address", address, "--out", str(out))
    assert done.returncode == 0, done.stderr
    profile = load_profile(out / f"{job}.yaml")
    assert profile.kind == "client" and profile.epochs == 4
    hold, work = profile.phases
    assert hold.gpu and hold.seconds.samples == 4 and 0.2 <= hold.seconds.mean < 0.5
    # The gaps between leases, less the round trips of a release and an acquire.
    assert not work.gpu and 0.1 < work.seconds.mean < 0.6


def test_profile_of_an_unknown_job_says_what_to_do(address: str, tmp_path: Path) -> None:
    done = plan_cli("profile", "no-such-job-x", "--address", address, "--out", str(tmp_path))
    assert done.returncode == 2
    assert "no RL job 'no-such-job-x'" in done.stderr and "--group" in done.stderr


def test_plan_cli_answers_from_profile_files(tmp_path: Path) -> None:
    def job(name: str, s: float, r: float, t: float) -> dict[str, Any]:
        return {
            "job_id": name,
            "epochs": 10,
            "phases": [
                {"name": "sample", "gpu": True, "pool": "sampler", "seconds": s},
                {"name": "rewards", "gpu": False, "seconds": r},
                {"name": "train", "gpu": True, "pool": "trainer", "seconds": t},
            ],
        }

    folder = tmp_path / "p"
    folder.mkdir()
    for data in (job("bound-a", 10, 10, 10), job("bound-b", 10, 10, 10), job("light", 3, 30, 3)):
        (folder / f"{data['job_id']}.json").write_text(json.dumps(data))
    answer = tmp_path / "plan.json"
    done = plan_cli(str(folder), "--groups", "3", "--max-slowdown", "1.3", "--json", str(answer))
    assert done.returncode == 0, done.stderr
    assert "#1  2 group(s) used" in done.stdout
    best = json.loads(answer.read_text())["assignments"][0]
    shared = [g["jobs"] for g in best["groups"] if len(g["jobs"]) > 1]
    assert len(shared) == 1 and "light" in shared[0]

    bad = folder / "broken.yaml"
    bad.write_text("job_id: x\nepochs: 3\nphases:\n  - {name: sample, gpu: true, seconds: 1}\n")
    done = plan_cli(str(bad), "--groups", "1")
    assert done.returncode == 2
    assert "broken.yaml: invalid profile" in done.stderr
    assert "phases.0: GPU phase 'sample' needs a pool" in done.stderr


def test_plan_cli_predicts_with_the_groups_policy_and_compares(tmp_path: Path) -> None:
    """Two demo-shaped jobs (issue 21) with 3 GB states: sharing a group pays under
    phase_aware (the default), not under FIFO; --compare-policies shows both."""
    folder = tmp_path / "p"
    folder.mkdir()
    for name in ("demo-a", "demo-b"):
        profile = {
            "job_id": name,
            "epochs": 12,
            "phases": [
                {"name": "sample", "gpu": True, "pool": "sampler", "seconds": 0.2},
                {"name": "rewards", "gpu": False, "seconds": 1.5},
                {"name": "train", "gpu": True, "pool": "trainer", "seconds": 0.85},
            ],
            "states": [
                {"name": "w", "pool": "both", "bytes": 3e9, "snapshot_s": 0.1, "restore_s": 0.1}
            ],
        }
        (folder / f"{name}.json").write_text(json.dumps(profile))
    answer = tmp_path / "plan.json"
    done = plan_cli(str(folder), "--groups", "2", "--compare-policies", "--json", str(answer))
    assert done.returncode == 0, done.stderr
    assert "grant policy: phase_aware" in done.stdout
    assert "compared             phase_aware  fifo" in done.stdout
    figures = json.loads(answer.read_text())
    assert figures["grant_policy"]["policy"] == "phase_aware"
    best = figures["assignments"][0]
    under_fifo = figures["compared"]["assignments"][0]
    assert figures["compared"]["grant_policy"] == "fifo"
    assert best["groups_used"] == under_fifo["groups_used"] == 1  # the same assignment
    assert not best["violations"] and sorted(under_fifo["violations"]) == ["demo-a", "demo-b"]
    assert best["groups"][0]["utilization"] > under_fifo["groups"][0]["utilization"] + 0.1

    done = plan_cli(str(folder), "--groups", "2", "--policy", "fifo", "--json", str(answer))
    assert done.returncode == 0, done.stderr
    assert "grant policy: fifo" in done.stdout
    assert json.loads(answer.read_text())["assignments"][0]["groups_used"] == 2

    done = plan_cli(str(folder), "--groups", "2", "--policy", "lifo")
    assert done.returncode == 2 and "invalid choice: 'lifo'" in done.stderr


ASYNC_OPTIONS = {
    "sample_s": 0.3,
    "reward_s": 0.05,
    "train_s": 0.2,
    "sync_s": 0.05,
    "load_s": 0.02,
    "state_bytes": 1_000_000,
    "snapshot_s": 0.02,
}
ASYNC_STEPS = 6


def test_async_job_profiled_through_the_cli_and_planned_on_a_shared_trainer(
    address: str, tmp_path: Path
) -> None:
    """A real AsyncRLJobWorkflow (the `simulated` workload's async mode, a real job process)
    run to its end, profiled by `timeslice plan profile`, and planned by `timeslice plan`."""
    from timeslice.jobs import parse_any_job_config, start_any_rl_job
    from timeslice.plan.search import Layout, Planner
    from timeslice.protocol.async_rl_job import AsyncRLJobResult

    job = f"aplan-{uuid.uuid4().hex[:8]}"
    sampler, trainer = f"s-{job}", f"t-{job}"
    proc = start_service(
        ["job", "worker", "--address", address, "--job-id", job, "--workload", "simulated",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--threads", "1"],
        f"job {job} rank 0",
        tmp_path / f"{job}.log",
    )  # fmt: skip

    async def go() -> AsyncRLJobResult:
        client = await connect(connect_config(address))
        config = parse_any_job_config(
            {
                "mode": "async",
                "job_id": job,
                "workload": "simulated",
                "workload_options": ASYNC_OPTIONS,
                "sampler_group": sampler,
                "trainer_group": trainer,
                "epochs": ASYNC_STEPS,
                "checkpoint_every": 3,
                "max_staleness": 2,
                "sync_every": 2,
            }
        )
        handle = await start_any_rl_job(client, config)
        return await handle.result()

    try:
        done = asyncio.run(go())
    finally:
        stop_process(proc)
    assert done.epochs_done == ASYNC_STEPS and done.syncs == 2  # after steps 2 and 4

    out = tmp_path / "profiles"
    ran = plan_cli("profile", job, "--address", address, "--out", str(out), "--format", "json")
    assert ran.returncode == 0, ran.stderr
    assert "async (max_staleness 2, sync_every 2), 6 steps" in ran.stdout, ran.stdout
    profile = load_profile(out / f"{job}.json")
    assert profile.is_async and profile.kind == "rl-job" and profile.epochs == ASYNC_STEPS
    assert (profile.max_staleness, profile.sync_every) == (2, 2)
    phases = {p.name: p for p in profile.phases}
    assert [(p.gpu, p.pool) for p in phases.values()] == [
        (True, "sampler"),
        (False, None),
        (True, "trainer"),
    ]
    # Each phase holds for its set time (train: plus two 0.05-s publications over six steps;
    # sample: plus the loads of newer weights); the clock read around it adds a little.
    for name, key in (("sample", "sample_s"), ("rewards", "reward_s"), ("train", "train_s")):
        seconds = phases[name].seconds
        assert seconds.samples == ASYNC_STEPS, (name, seconds)
        assert ASYNC_OPTIONS[key] <= seconds.mean < ASYNC_OPTIONS[key] + 0.3, (name, seconds)
    sync = profile.weight_sync
    assert sync is not None and sync.publications == 2
    assert sync.publish_bytes == ASYNC_OPTIONS["state_bytes"]  # sync_bytes: state_bytes
    assert sync.publish_s is not None and 0.05 <= sync.publish_s.mean < 0.35
    assert sync.loads >= 1 and sync.load_bytes == ASYNC_OPTIONS["state_bytes"]
    assert {s.name: (s.pool, s.bytes) for s in profile.states} == {
        "sampler": ("sampler", ASYNC_OPTIONS["state_bytes"]),
        "trainer": ("trainer", ASYNC_OPTIONS["state_bytes"]),
    }
    assert profile.source is not None
    assert (profile.source.sampler_group, profile.source.trainer_group) == (sampler, trainer)
    assert profile.source.epochs_read == ASYNC_STEPS

    # The profile predicts its own run: alone on its two groups, its loops overlapping.
    overheads = profile.source.overheads
    assert overheads is not None
    alone = simulate([Placement(profile, sampler, trainer)], overheads=overheads)
    assert alone.jobs[job].completion_s == pytest.approx(completion_s(done), rel=0.15)  # type: ignore[arg-type]

    # Two such jobs, each on a sampler group of its own, one trainer group shared.
    twin = profile.model_copy(update={"job_id": f"{job}-twin"})
    dump_profile(twin, out / f"{job}-twin.json")
    answer = tmp_path / "plan.json"
    ran = plan_cli(
        str(out), "--sampler-groups", "2", "--trainer-groups", "1", "--json", str(answer)
    )
    assert ran.returncode == 0, ran.stderr
    assert "async k=2" in ran.stdout and "async jobs (mode async)" in ran.stdout, ran.stdout
    best = json.loads(answer.read_text())["assignments"][0]
    assert {(j["mode"], j["max_staleness"]) for j in best["jobs"]} == {("async", 2)}
    assert len({j["sampler_group"] for j in best["jobs"]}) == 2
    shared = next(g for g in best["groups"] if g["role"] == "trainer")
    assert len(shared["jobs"]) == 2
    # The same jobs, placed the same, as sync jobs: the trainer idles while each samples.
    as_sync = [
        p.model_copy(update={"mode": "sync", "max_staleness": None, "sync_every": None,
                             "weight_sync": None})
        for p in (profile, twin)
    ]  # fmt: skip
    placed = {j["job"]: (j["sampler_group"], j["trainer_group"]) for j in best["jobs"]}
    layout = Layout(sampler_groups=("sampler-1", "sampler-2"), trainer_groups=("trainer-1",))
    sync_plan = Planner(as_sync, layout, overheads=overheads).evaluate(placed, 60)
    sync_trainer = next(g for g in sync_plan.groups if g.role == "trainer")
    # By 0.05 at least: the overheads measured on a loaded machine narrow the gap (0.61
    # against 0.51 in one make test run at load 5; more on a quiet one).
    assert shared["utilization"] > sync_trainer.utilization + 0.05, (shared, sync_trainer)
