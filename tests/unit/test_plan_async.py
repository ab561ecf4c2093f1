"""`timeslice plan` for async RL jobs: the profile's fields, a profile built from an async job's
records, and async jobs simulated and placed by the search."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from timeslice.errors import InvalidArgumentError
from timeslice.plan.cli import describe_profile, format_plan
from timeslice.plan.collect import RLJobRun, rl_job_profile
from timeslice.plan.profile import JobProfile, dump_profile, load_profile, load_profiles
from timeslice.plan.search import Layout, Planner
from timeslice.plan.simulator import Placement, rl_profile, simulate
from timeslice.plan.timeline import timeline_rows, to_report
from timeslice.protocol.async_rl_job import AsyncPhaseResult, AsyncRLJobConfig
from timeslice.protocol.rl_job import DescribeResult, PhaseResult, PrepareResult

ASYNC = {
    "job_id": "grpo-async",
    "mode": "async",
    "max_staleness": 8,
    "sync_every": 2,
    "epochs": 40,
    "phases": [
        {"name": "sample", "gpu": True, "pool": "sampler", "seconds": 2.0},
        {"name": "rewards", "gpu": False, "seconds": 0.02},
        {"name": "train", "gpu": True, "pool": "trainer", "seconds": 1.0},
    ],
    "states": [
        {"name": "sampler", "pool": "sampler", "bytes": 4e9, "snapshot_s": 0.1, "restore_s": 0.05},
        {"name": "trainer", "pool": "trainer", "bytes": 4e9, "snapshot_s": 0.1, "restore_s": 0.05},
    ],
    "weight_sync": {"publications": 3, "publish_s": 0.2, "publish_bytes": 4e9},
}


def write(tmp_path: Path, data: Any, name: str = "p.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the profile


def test_async_profile_round_trips_and_says_it_is_async(tmp_path: Path) -> None:
    p = load_profile(write(tmp_path, ASYNC))
    assert p.is_async and (p.max_staleness, p.sync_every) == (8, 2)
    assert p.weight_sync is not None and p.weight_sync.publish_bytes == 4_000_000_000
    # Alone, its loops overlap: the slower (sampling, 2.02 s) sets the pace.
    assert p.cycle_s == pytest.approx(2.02)
    assert p.gpu_share({"trainer"}) == pytest.approx(1.0 / 2.02)
    assert p.gpu_share({"sampler"}) == pytest.approx(2.0 / 2.02)
    for name in ("again.json", "again.yaml"):
        dump_profile(p, tmp_path / name)
        assert load_profile(tmp_path / name) == p
    text = describe_profile(p)
    assert "async (max_staleness 8, sync_every 2), 40 steps" in text
    assert "trainer busy 50%" in text and "GPU, trainer, trainer loop" in text
    assert "weights: 3 publication(s) of 4.00 GB" in text


def test_a_profile_without_mode_is_a_sync_jobs(tmp_path: Path) -> None:
    """Files written before async jobs: no mode, no new fields, read as before."""
    old = {k: v for k, v in ASYNC.items() if k not in ("mode", "max_staleness", "sync_every")}
    del old["weight_sync"]
    p = load_profile(write(tmp_path, old))
    assert p.mode == "sync" and not p.is_async and p.max_staleness is None
    assert p.cycle_s == pytest.approx(3.02) and p.duty == pytest.approx(3.0 / 3.02)
    assert "GPU share" in describe_profile(p) and "loop" not in describe_profile(p)
    dump_profile(p, tmp_path / "again.json")
    assert "mode" in json.loads((tmp_path / "again.json").read_text())
    assert load_profile(tmp_path / "again.json") == p


def test_staleness_zero_takes_turns() -> None:
    p = JobProfile.model_validate({**ASYNC, "max_staleness": 0, "sync_every": 1})
    assert p.cycle_s == pytest.approx(3.02)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "sync"}, "max_staleness, sync_every, weight_sync: only for an async job"),
        ({"max_staleness": None}, "an async job needs max_staleness"),
        ({"max_staleness": 1, "sync_every": 3}, "use sync_every <= max_staleness + 1 (2)"),
        ({"max_staleness": 257}, "max_staleness"),
        ({"mode": "later"}, "mode"),
        (
            {
                "kind": "client",
                "phases": [{"name": "hold", "gpu": True, "pool": "sampler", "seconds": 1}],
            },
            "an async job is an RL job",
        ),
        (
            {"phases": [{"name": "train", "gpu": True, "pool": "trainer", "seconds": 1}]},
            "needs a GPU phase on each pool",
        ),
    ],
)
def test_bad_async_profiles_say_what_to_fix(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = {k: v for k, v in {**ASYNC, **change}.items() if v is not None}
    with pytest.raises(InvalidArgumentError) as caught:
        load_profiles(write(tmp_path, data, "bad.json"))
    assert str(caught.value).startswith(str(tmp_path / "bad.json"))
    assert message in str(caught.value)


# ---------------------------------------------------------------- from an async job's records


def phase(epoch: int, name: str, start: float, seconds: float, **kw: Any) -> PhaseResult:
    return PhaseResult(
        epoch=epoch,
        phase=name,  # type: ignore[arg-type]
        metrics={},
        seconds=seconds,
        mono_start=start,
        mono_end=start + seconds,
        **kw,
    )


def async_run() -> RLJobRun:
    """Four steps of an async job, staleness 1, weights published after steps 1 and 3."""
    cfg = AsyncRLJobConfig(
        job_id="a",
        workload="simulated",
        sampler_group="s",
        trainer_group="t",
        epochs=4,
        max_staleness=2,
        sync_every=2,
        checkpoint_every=2,
    )
    results: list[AsyncPhaseResult] = []
    for b in range(4):
        t = 1.0 * b
        version = 0 if b < 2 else 2
        load = 0.05 if b == 2 else 0.0
        sample = phase(b, "sample", t, 0.5, group_id="s", asked_mono=t - 0.03, granted_mono=t)
        results.append(
            AsyncPhaseResult(
                phase=sample,
                batch=b,
                weights_version=version,
                load_s=load,
                load_bytes=1000 if load else 0,
            )
        )
        results.append(AsyncPhaseResult(phase=phase(b, "rewards", t + 0.54, 0.1), batch=b))
    for step in range(4):
        t = 0.7 + 1.0 * step
        published = step + 1 if step in (1,) else None
        results.append(
            AsyncPhaseResult(
                # Trained with the lease kept when a checkpoint follows: no carry into a sample.
                phase=phase(step, "train", t, 0.9 + (0.2 if published else 0.0), group_id="t",
                            kept=step % 2 == 1),
                batch=step,
                published_version=published,
                sync_s=0.2 if published else 0.0,
                sync_bytes=1000 if published else 0,
            )
        )  # fmt: skip
    return RLJobRun(
        workflow_id="rl-job-a",
        config=cfg,
        phases=[r.phase for r in results],
        async_phases=results,
        checkpoint_s=[0.3, 0.3],
        describe=DescribeResult(
            workload="simulated",
            sampler_backends=["sampler"],
            trainer_backends=["trainer"],
            epochs_done=0,
        ),
        prepare=PrepareResult(
            epochs_done=0, state_bytes=2000, backend_bytes={"sampler": 1000, "trainer": 1000}
        ),
        runs=1,
    )


def test_async_profile_from_an_async_jobs_records() -> None:
    p = rl_job_profile(async_run())
    assert p.is_async and (p.max_staleness, p.sync_every, p.epochs) == (2, 2, 4)
    phases = {x.name: x for x in p.phases}
    assert [(x.name, x.pool, x.seconds.samples) for x in p.phases] == [
        ("sample", "sampler", 4),
        ("rewards", None, 4),
        ("train", "trainer", 4),
    ]
    assert phases["train"].seconds.mean == pytest.approx(0.95)
    sync = p.weight_sync
    assert sync is not None
    assert (sync.publications, sync.publish_bytes, sync.loads, sync.load_bytes) == (
        1,
        1000,
        1,
        1000,
    )
    assert sync.publish_s is not None and sync.publish_s.mean == pytest.approx(0.2)
    assert sync.load_s is not None and sync.load_s.mean == pytest.approx(0.05)
    # Each state on its own pool's group, with its bytes.
    assert {s.name: (s.pool, s.bytes) for s in p.states} == {
        "sampler": ("sampler", 1000),
        "trainer": ("trainer", 1000),
    }
    source = p.source
    assert source is not None and source.epochs_read == 4
    assert (source.sampler_group, source.trainer_group) == ("s", "t")
    # Steps 0..3 trained batches sampled with v0, v0, v2, v2: staleness 0, 1, 0, 1.
    assert any("staleness of the steps read: max 1, mean 0.50 (4 steps)" in n for n in source.notes)
    ov = source.overheads
    assert ov is not None
    assert ov.hop_s == pytest.approx(0.04)  # rewards start - sample end, per batch
    assert ov.carry_s == 0.075  # no carry measured: the loops carry no lease to each other
    assert ov.request_s + ov.grant_s == pytest.approx(0.03)


# ---------------------------------------------------------------- simulated and placed


def pair(**async_kw: Any) -> list[JobProfile]:
    """The BENCHMARKS.md async case's shapes: 2.0 s / 3.0 s sampling, 1.0 s / 1.5 s training."""
    return [
        rl_profile("a", sample_s=2.0, rewards_s=0.02, train_s=1.0, epochs=30, **async_kw),
        rl_profile("b", sample_s=3.0, rewards_s=0.02, train_s=1.5, epochs=20, **async_kw),
    ]


def test_placement_takes_the_profiles_async_settings() -> None:
    profile = rl_profile("a", sample_s=2.0, rewards_s=0.0, train_s=1.0, epochs=8, max_staleness=3)
    placed = Placement(profile, "s", "t")
    assert (placed.max_staleness, placed.sync_every) == (3, 1)
    assert Placement(profile, "s", "t", max_staleness=0).max_staleness == 0  # given: kept
    sync = rl_profile("a", sample_s=2.0, rewards_s=0.0, train_s=1.0, epochs=8)
    assert Placement(sync, "s", "t").max_staleness is None
    # An async profile simulates as an async job: its loops overlap.
    assert simulate([placed]).jobs["a"].completion_s < 8 * 2.5


def test_two_async_jobs_fill_a_shared_trainer_that_sync_jobs_leave_half_idle() -> None:
    layout = Layout(sampler_groups=("s1", "s2"), trainer_groups=("t1",))
    planner = Planner(pair(max_staleness=8), layout)
    best = planner.search(top=1, time_limit_s=2).assignments[0]
    # Sharing a sampler would slow both past 1.5x: a sampler each, the trainer shared.
    assert {(j.job_id, j.trainer_group) for j in best.jobs} == {("a", "t1"), ("b", "t1")}
    assert len({j.sampler_group for j in best.jobs}) == 2 and not best.violations
    assert {(j.job_id, j.mode, j.max_staleness) for j in best.jobs} == {
        ("a", "async", 8),
        ("b", "async", 8),
    }
    # Alone, an async job has a sampler group and a trainer group of its own.
    assert best.gpus_dedicated == 4 and best.gpus_used == 3 and best.gpus_saved == 1
    assert all(0.99 < j.slowdown < 1.1 for j in best.jobs)
    trainer = next(g for g in best.groups if g.group_id == "t1")
    # Both loops at once: each job alone keeps its trainer busy ~half its time; two fill it.
    assert trainer.demand_bound > 0.95 and trainer.utilization > 0.9
    # The same jobs, the same placement, as sync jobs: the trainer idles while they sample.
    placed = {j.job_id: (j.sampler_group, j.trainer_group) for j in best.jobs}
    as_sync = Planner(pair(), layout).evaluate(placed, planner.final_epochs)
    trainer_sync = next(g for g in as_sync.groups if g.group_id == "t1")
    assert {j.mode for j in as_sync.jobs} == {"sync"}
    assert trainer_sync.utilization < 0.6 < trainer.utilization - 0.3
    text = format_plan(planner.search(top=1, time_limit_s=2), "defaults")
    assert "async k=8" in text and "async jobs (mode async)" in text


def test_async_jobs_need_two_groups_and_a_mix_plans() -> None:
    with pytest.raises(ValueError, match=r"async jobs run their sampler and trainer loops at once"):
        Planner(pair(max_staleness=8), Layout(groups=("g1",)))
    mixed = [pair(max_staleness=4)[0], pair()[1]]  # one async, one sync
    layout = Layout(sampler_groups=("s1", "s2"), trainer_groups=("t1",))
    planner = Planner(mixed, layout)
    best = planner.search(top=1, time_limit_s=2).assignments[0]
    assert {j.job_id: j.mode for j in best.jobs} == {"a": "async", "b": "sync"}
    assert best.gpus_dedicated == 3  # the async job's two groups, the sync job's one
    # The timeline draws the async job's loops in a lane each, the sync job in one.
    outcome = planner.timeline(best)
    assert {r["job"] for r in timeline_rows(outcome)} >= {"a · sampler", "a · trainer", "b"}
    report = to_report(outcome, best)
    lanes = {lane.name for lane in report.lanes if lane.kind == "job"}
    assert lanes == {"a · sampler", "a · trainer", "b"}


def test_an_async_jobs_input_reads_bare_and_after_continue_as_new() -> None:
    from timeslice.protocol.async_rl_job import AsyncRLJobInput, AsyncRLJobState
    from timeslice.report.gather import started_config

    cfg = async_run().config
    assert isinstance(cfg, AsyncRLJobConfig)
    bare = cfg.model_dump(mode="json")
    carried = AsyncRLJobInput(config=cfg, state=AsyncRLJobState()).model_dump(mode="json")
    for raw in (bare, carried):
        for async_job in (True, None):  # the workflow's type says, or the config's mode
            read = started_config(raw, async_job=async_job)
            assert isinstance(read, AsyncRLJobConfig) and read.max_staleness == 2
    # Read as a sync job's, the async config is refused (its mode is no sync field).
    with pytest.raises(ValueError, match="mode"):
        started_config(bare, async_job=False)


def test_async_jobs_on_colocated_groups_run_their_loops_on_two_and_share_with_sync_jobs() -> None:
    """A pool's groups (colocated): an async job's loops on two different groups, never one;
    sync jobs on one each; the search shares the groups between them."""
    mixed = [
        *pair(max_staleness=2),
        rl_profile("s1", sample_s=0.5, rewards_s=3.0, train_s=0.5, epochs=20),
        rl_profile("s2", sample_s=0.5, rewards_s=3.0, train_s=0.5, epochs=20),
    ]
    planner = Planner(mixed, Layout(groups=("g0", "g1", "g2", "g3", "g4")), max_slowdown=1.5)
    result = planner.search(top=3, time_limit_s=3)
    for assignment in result.assignments:
        slots = {j.job_id: (j.sampler_group, j.trainer_group) for j in assignment.jobs}
        assert slots["a"][0] != slots["a"][1] and slots["b"][0] != slots["b"][1]
        assert slots["s1"][0] == slots["s1"][1] and slots["s2"][0] == slots["s2"][1]
        # Each group lists every job with a loop on it, an async job's trainer group too.
        for group in assignment.groups:
            assert set(group.jobs) == {j for j, pt in slots.items() if group.group_id in pt}
    best = result.assignments[0]
    assert not best.violations
    # Alone the four need six groups (two each for the async jobs); shared, fewer.
    assert best.gpus_dedicated == 6 and best.gpus_used < 6
