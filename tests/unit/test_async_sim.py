"""The simulator's async jobs: the workflow's hand-over and staleness rule, in simulated time."""

from __future__ import annotations

import pytest
from timeslice.plan.profile import Overheads
from timeslice.plan.simulator import GroupSpec, Placement, rl_profile, simulate


def placement(
    job: str, sample_s: float, train_s: float, steps: int, trainer: str, **kw: object
) -> Placement:
    profile = rl_profile(job, sample_s=sample_s, rewards_s=0.0, train_s=train_s, epochs=steps)
    return Placement(profile, sampler_group=f"s-{job}", trainer_group=trainer, **kw)  # type: ignore[arg-type]


def test_staleness_zero_is_the_sync_schedule() -> None:
    sync = simulate([placement("j", 2.0, 1.0, 10, "t")], overheads=Overheads.zero())
    fresh = simulate(
        [placement("j", 2.0, 1.0, 10, "t", max_staleness=0)], overheads=Overheads.zero()
    )
    assert fresh.jobs["j"].epochs_done == 10
    assert fresh.jobs["j"].completion_s == pytest.approx(sync.jobs["j"].completion_s)
    assert fresh.jobs["j"].completion_s == pytest.approx(30.0)


def test_an_async_job_runs_at_its_slower_loops_pace() -> None:
    done = simulate(
        [placement("j", 2.0, 1.0, 10, "t", max_staleness=4)], overheads=Overheads.zero()
    )
    # Sampling never waits: 10 batches of 2 s, and the last step 1 s after the last batch.
    assert done.jobs["j"].completion_s == pytest.approx(21.0)
    # Busy 10 s from the first step (at 2 s) to the last end (21 s).
    assert done.groups["t"].utilization == pytest.approx(10 / 19)


def test_two_async_jobs_fill_a_shared_trainer_and_keep_their_pace() -> None:
    placements = [
        placement("a", 2.0, 1.0, 30, "shared", max_staleness=8),
        placement("b", 3.0, 1.5, 20, "shared", max_staleness=8),
    ]
    alone = {
        p.profile.job_id: simulate(
            [Placement(p.profile, p.sampler_group, f"own-{p.profile.job_id}", max_staleness=8)],
            overheads=Overheads.zero(),
        ).jobs[p.profile.job_id]
        for p in placements
    }
    shared = simulate(placements, groups={"shared": GroupSpec()}, overheads=Overheads.zero())
    assert shared.groups["shared"].utilization > 0.95
    for job, result in shared.jobs.items():
        assert result.epochs_done == alone[job].epochs_done
        assert result.completion_s <= 1.05 * alone[job].completion_s


def test_the_sampler_never_runs_more_than_max_staleness_ahead() -> None:
    k, every = 2, 3
    done = simulate(
        [placement("j", 0.5, 2.0, 12, "t", max_staleness=k, sync_every=every)],
        overheads=Overheads.zero(),
        record=True,
    )
    samples = sorted(s.start for s in done.segments if s.phase == "sample" and s.kind == "phase")
    trained_at = sorted(s.end for s in done.segments if s.phase == "train" and s.kind == "phase")
    assert len(samples) == len(trained_at) == 12
    for batch, started in enumerate(samples):
        trained = sum(1 for end in trained_at if end <= started)
        published = trained - trained % every
        assert batch - published <= k  # batch b is step b: its staleness at most k
    # The trainer is the slower loop: the bound is what holds the sampler back.
    assert any(batch - (sum(1 for e in trained_at if e <= s) // every * every) == k
               for batch, s in enumerate(samples))  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "complaint"),
    [({"max_staleness": 0, "sync_every": 2}, "sync_every"), ({"max_staleness": 1}, "two groups")],
)
def test_bad_async_placements_are_refused(kw: dict[str, int], complaint: str) -> None:
    profile = rl_profile("j", sample_s=1.0, rewards_s=0.0, train_s=1.0, epochs=2)
    with pytest.raises(ValueError, match=complaint):
        simulate([Placement(profile, "g", "t" if "sync_every" in kw else "g", **kw)])
