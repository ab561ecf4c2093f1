"""The pools' decision rule (plan/placement.py) and their input checks, on the planner's real
simulator: no server, no process."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from timeslice.plan.placement import InvalidProfile, Predictor, candidates, decide, job_profile
from timeslice.protocol.pool import (
    PlaceInput,
    Placement,
    PoolConfig,
    PoolGroup,
    PoolJob,
    parse_memory,
)
from timeslice.protocol.rl_job import RLJobConfig

BOUND = 1.25


def profile(gpu_s: float, cpu_s: float, epochs: int = 6, mode: str = "sync") -> dict[str, Any]:
    extra = {"mode": "async", "max_staleness": 1} if mode == "async" else {}
    return {
        **extra,
        "epochs": epochs,
        "phases": [
            {"name": "sample", "gpu": True, "pool": "sampler", "seconds": gpu_s / 2},
            {"name": "rewards", "gpu": False, "seconds": cpu_s},
            {"name": "train", "gpu": True, "pool": "trainer", "seconds": gpu_s / 2},
        ],
    }


HEAVY = profile(0.9, 0.1)  # 90% GPU: two on one group run ~1.8x slower than alone
LIGHT = profile(0.2, 0.8)  # 20% GPU


def groups(*names: str) -> list[PoolGroup]:
    return [PoolGroup(name=n) for n in names]


def placed(job_id: str, at: str, prof: dict[str, Any] | None, demand: float | None) -> PoolJob:
    return PoolJob(
        job_id=job_id,
        profile=prof,
        placement=Placement(sampler_group=at, trainer_group=at),
        demand=demand,
    )


def ask(pool: list[PoolGroup], jobs: list[PoolJob], job: PoolJob) -> Any:
    return decide(PlaceInput(groups=pool, max_slowdown=BOUND, placed=jobs, job=job))


def test_heavy_jobs_spread_then_queue_past_the_bound() -> None:
    pool = groups("g1", "g2")
    first = ask(pool, [], PoolJob(job_id="a", profile=HEAVY))
    assert first.placement is not None and first.demand == pytest.approx(0.9)
    jobs = [placed("a", first.placement.sampler_group, HEAVY, first.demand)]
    second = ask(pool, jobs, PoolJob(job_id="b", profile=HEAVY))
    assert second.placement is not None
    assert second.placement.sampler_group != first.placement.sampler_group
    assert "pool utilization +" in second.reason and "b 1.00x" in second.reason
    jobs.append(placed("b", second.placement.sampler_group, HEAVY, second.demand))
    third = ask(pool, jobs, PoolJob(job_id="c", profile=HEAVY))
    assert third.placement is None
    assert third.reason.startswith("queued c: no group takes it within the pool's bound 1.25x")
    # Room appears when a job ends: the queued job is placed where it left.
    again = ask(pool, jobs[1:], PoolJob(job_id="c", profile=HEAVY))
    assert again.placement == first.placement


def test_place_anyway_takes_the_least_bad_group() -> None:
    pool = groups("g1", "g2")
    jobs = [placed("a", "g1", HEAVY, 0.9), placed("b", "g2", profile(0.6, 0.4), 0.6)]
    outcome = ask(pool, jobs, PoolJob(job_id="c", profile=HEAVY, place_anyway=True))
    assert outcome.placement == Placement(sampler_group="g2", trainer_group="g2")
    assert outcome.reason.startswith("placed anyway c on g2")


def test_the_chosen_place_predicts_the_highest_utilization_within_the_bound() -> None:
    pool = groups("g1", "g2", "g3")
    jobs = [
        placed("a", "g1", profile(0.5, 0.5), 0.5),
        placed("b", "g2", LIGHT, 0.2),
    ]
    inp = PlaceInput(
        groups=pool, max_slowdown=BOUND, placed=jobs, job=PoolJob(job_id="c", profile=LIGHT)
    )
    outcome = decide(inp)
    assert outcome.placement is not None
    predictor = Predictor(inp)
    new = job_profile(inp.job)
    assert new is not None
    figures = {
        at.sampler_group: predictor.predict([(new, at)])
        for at in candidates(["g1", "g2", "g3"], "sync")
    }
    within = {g: p for g, p in figures.items() if p is not None and p.worst <= BOUND}
    best = max(within, key=lambda g: within[g].utilization)
    assert outcome.placement.sampler_group == best
    # Sharing a group with a light job, within the bound, beats a group of its own.
    assert best != "g3"


def test_a_job_without_a_profile_goes_where_demand_is_least() -> None:
    pool = groups("g1", "g2")
    jobs = [placed("a", "g1", HEAVY, 0.9), placed("b", "g2", LIGHT, 0.2)]
    outcome = ask(pool, jobs, PoolJob(job_id="c"))
    assert outcome.placement == Placement(sampler_group="g2", trainer_group="g2")
    assert outcome.demand is None and "(no profile): least predicted demand" in outcome.reason
    # A group holding a job of unknown demand is not checked against the bound: a profiled
    # job goes elsewhere, or waits.
    jobs = [placed("x", "g1", None, None), placed("b", "g2", HEAVY, 0.9)]
    waits = ask(pool, jobs, PoolJob(job_id="d", profile=HEAVY))
    assert waits.placement is None


def test_an_async_job_gets_two_groups() -> None:
    pool = groups("g1", "g2", "g3")
    async_profile = profile(0.6, 0.1, mode="async")
    outcome = ask(pool, [], PoolJob(job_id="a", mode="async", profile=async_profile))
    assert outcome.placement is not None
    assert outcome.placement.sampler_group != outcome.placement.trainer_group
    with pytest.raises(InvalidProfile, match="needs two groups"):
        ask(groups("g1"), [], PoolJob(job_id="a", mode="async"))
    with pytest.raises(InvalidProfile, match="profile says mode sync"):
        ask(pool, [], PoolJob(job_id="b", mode="async", profile=HEAVY))


def test_a_bad_profile_is_refused() -> None:
    bad = {**HEAVY, "phases": [{"name": "sample", "gpu": True, "seconds": -1}]}
    with pytest.raises(InvalidProfile, match="seconds"):
        ask(groups("g1"), [], PoolJob(job_id="a", profile=bad))


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("1024", 1024), ("16e9", 16 * 10**9), ("80GiB", 80 * 2**30), ("80G", 80 * 10**9),
     ("512 MiB", 512 * 2**20), ("1.5T", 1.5 * 10**12)],
)  # fmt: skip
def test_memory_sizes(text: str, nbytes: float) -> None:
    assert parse_memory(text) == int(nbytes)


@pytest.mark.parametrize("text", ["", "80Q", "-1G", "0", "GiB", "nan", "1e40"])
def test_bad_memory_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="invalid memory size"):
        parse_memory(text)


def test_pool_inputs_are_checked() -> None:
    assert PoolGroup.parse("g1:80GiB:node-a") == PoolGroup(
        name="g1", memory_bytes=80 * 2**30, node="node-a"
    )
    assert PoolGroup.parse("g1") == PoolGroup(name="g1")
    with pytest.raises(ValueError, match="NAME\\[:MEMORY\\[:NODE\\]\\]"):
        PoolGroup.parse("g1:1:n:x")
    with pytest.raises(ValidationError, match="has no groups"):
        PoolConfig(pool="p", groups=[])
    with pytest.raises(ValidationError, match="named twice"):
        PoolConfig(pool="p", groups=groups("g", "g"))
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        PoolConfig(pool="p", groups=groups("g"), max_slowdown=0.9)


def test_a_job_names_its_groups_or_its_pool() -> None:
    base = {"job_id": "j", "workload": "simulated", "epochs": 1}
    with pytest.raises(ValidationError, match="or pool"):
        RLJobConfig.model_validate(base)
    with pytest.raises(ValidationError, match="trainer_group without sampler_group"):
        RLJobConfig.model_validate({**base, "pool": "p", "trainer_group": "t"})
    with pytest.raises(ValidationError, match="are for a job started with pool"):
        RLJobConfig.model_validate({**base, "sampler_group": "g", "profile": HEAVY})
    pooled = RLJobConfig.model_validate({**base, "pool": "p", "profile": HEAVY})
    assert pooled.sampler_group is None and pooled.profile == HEAVY
    # A job without a pool encodes as before pools existed.
    plain = RLJobConfig.model_validate({**base, "sampler_group": "g"}).model_dump()
    assert not {"pool", "profile", "place_anyway"} & set(plain)


def test_a_placed_jobs_profile_that_does_not_parse_refuses_no_other_job() -> None:
    """A placed job's measured profile the planner refuses (two states of one name, say)
    counts as no profile: its group is not weighed, and another job is placed elsewhere
    instead of being refused with the first job's error."""
    bad = {**HEAVY, "states": [{"name": "policy", "pool": "sampler", "bytes": 1},
                               {"name": "policy", "pool": "trainer", "bytes": 1}]}  # fmt: skip
    with pytest.raises(InvalidProfile):
        job_profile(PoolJob(job_id="a", profile=bad))
    jobs = [placed("a", "g1", bad, None)]
    outcome = ask(groups("g1", "g2"), jobs, PoolJob(job_id="b", profile=HEAVY))
    assert outcome.placement is not None and outcome.placement.sampler_group == "g2"
