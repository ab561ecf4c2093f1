"""``timeslice plan`` given arrivals (``JobProfile.arrive_s``, issue 34's traces): each job runs
its epochs from its arrival, unscaled, so jobs that never meet can share a group; on the
planner's real simulator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from timeslice.plan.profile import JobProfile
from timeslice.plan.search import Layout, Planner


def heavy(job_id: str, arrive_s: float = 0.0) -> JobProfile:
    return JobProfile(
        job_id=job_id,
        epochs=5,
        arrive_s=arrive_s,
        phases=[
            {"name": "sample", "gpu": True, "pool": "sampler", "seconds": 1.0},
            {"name": "rewards", "gpu": False, "seconds": 0.1},
            {"name": "train", "gpu": True, "pool": "trainer", "seconds": 1.0},
        ],
    )


def plan(*profiles: JobProfile) -> list[tuple[str, str, float]]:
    planner = Planner(list(profiles), Layout(groups=("g0", "g1")), max_slowdown=1.25)
    best = planner.search(top=1, time_limit_s=1).assignments[0]
    return [(j.job_id, j.sampler_group, j.completion_s / j.dedicated_s) for j in best.jobs]


def test_two_heavy_jobs_at_once_need_a_group_each() -> None:
    (_, ga, _), (_, gb, _) = plan(heavy("a"), heavy("b"))
    assert ga != gb


def test_a_heavy_job_that_arrives_after_another_left_shares_its_group() -> None:
    # a runs 5 epochs of 2.1 s alone: gone by 11 s; b arrives at 12 s.
    (_, ga, slow_a), (_, gb, slow_b) = plan(heavy("a"), heavy("b", arrive_s=12.0))
    assert ga == gb  # one group used: the search's first aim within the limits
    assert slow_a == pytest.approx(1.0, abs=0.02) and slow_b == pytest.approx(1.0, abs=0.02)


def test_arrivals_are_checked() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        heavy("a", arrive_s=-1.0)
    with pytest.raises(ValidationError, match="finite"):
        heavy("a", arrive_s=float("inf"))
