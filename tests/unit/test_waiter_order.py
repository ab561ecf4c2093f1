"""The waiter order has one home (``grant_policy.next_waiter``), and the group and the planner
agree on it: random mixes of jobs (clients and RL jobs, random priorities, phase lengths, start
times, ageing and grant policy) run in the simulator, and every request they make is fed to a
``GroupBook`` in the same order at the same times; the book must pick the same waiter as the
simulator at every grant. The mixes are drawn from fixed seeds, and they are checked to contest
the order in each of its parts (a higher priority first, ageing past a priority, first come
first served between equal scores), so a copy of the rule that drifts in any part is caught.
"""

from __future__ import annotations

import random

import pytest
from timeslice.plan.profile import JobProfile, Overheads
from timeslice.plan.simulator import GroupSpec, Placement, rl_profile, simulate
from timeslice.protocol.group import GrantPolicy, GroupConfig, Waiter
from timeslice.workflows.grant_policy import next_waiter, waiter_score

from tests.unit.test_sim_policy import replay_through_group_book

SEEDS = range(30)
# Quarter seconds add up exactly in binary: requests made at the same time have equal scores,
# which only the arrival order can part.
STEPS = (0.25, 0.5, 0.75, 1.0)


def client(job_id: str, rng: random.Random, priority: int) -> JobProfile:
    """A client job: acquire, hold, release, work off the GPU, acquire again."""
    return JobProfile.model_validate(
        {
            "job_id": job_id,
            "kind": "client",
            "epochs": rng.randint(3, 8),
            "priority": priority,
            "phases": [
                {"name": "hold", "gpu": True, "pool": "sampler", "seconds": rng.choice(STEPS)},
                {"name": "off", "gpu": False, "seconds": rng.choice((0.0, *STEPS))},
            ],
        }
    )


def random_mix(seed: int) -> tuple[list[Placement], GroupSpec, dict[str, int]]:
    """A mix of 3 to 6 jobs on one group, drawn from ``seed``."""
    rng = random.Random(seed)
    priorities = {f"j{i}": rng.choice((-1, 0, 0, 1, 2)) for i in range(rng.randint(3, 6))}
    placements = []
    for job_id, priority in priorities.items():
        if rng.random() < 0.5:
            profile = client(job_id, rng, priority)
        else:
            profile = rl_profile(
                job_id,
                sample_s=rng.choice(STEPS),
                rewards_s=rng.choice((0.0, *STEPS)),
                train_s=rng.choice(STEPS),
                epochs=rng.randint(2, 5),
                priority=priority,
            )
        placements.append(Placement(profile, "g", "g", start_s=rng.choice((0.0, 0.5, 1.0))))
    spec = GroupSpec(
        aging_s=rng.choice((0.5, 1.0, 2.5, 60.0)),
        grant_policy=rng.choice(list(GrantPolicy)),
        carry_limit_s=rng.choice((0.5, 60.0)),
    )
    return placements, spec, priorities


def picks_of(seed: int) -> list[tuple[str, list[Waiter]]]:
    """Run the seed's mix in the simulator and through a GroupBook (which asserts, grant by
    grant, that it picks the simulator's job); each grant's job and who waited then."""
    placements, spec, priorities = random_mix(seed)
    outcome = simulate(placements, groups={"g": spec}, overheads=Overheads.zero(), record=True)
    picks: list[tuple[str, list[Waiter]]] = []
    replay_through_group_book(
        outcome.events,
        GroupConfig(
            group_id="g",
            aging_s=spec.aging_s,
            grant_policy=spec.grant_policy,
            carry_limit_s=spec.carry_limit_s,
        ),
        priorities,
        picks,
    )
    assert len(picks) == outcome.groups["g"].leases
    return picks


@pytest.mark.parametrize("seed", SEEDS)
def test_the_group_book_and_the_simulator_pick_the_same_waiters(seed: int) -> None:
    picks_of(seed)


def test_the_mixes_contest_every_part_of_the_order() -> None:
    """Among the seeds' grants, some go past an earlier waiter of a lower priority, some (aged)
    past a waiter of a higher priority, and some to the first of waiters whose scores are
    equal: each part of the rule decides somewhere, so none can drift unseen."""
    by_priority = aged = first_come = 0
    for seed in SEEDS:
        for job, queued in picks_of(seed):
            [chosen] = [w for w in queued if w.request.job_id == job]
            priority, asked = chosen.request.priority, chosen.enqueued_at
            others = [w for w in queued if w is not chosen]
            by_priority += any(w.seq < chosen.seq and w.request.priority < priority for w in others)
            aged += any(w.request.priority > priority for w in others)
            first_come += any(
                w.request.priority == priority and w.enqueued_at == asked for w in others
            )
    assert min(by_priority, aged, first_come) >= 10, (by_priority, aged, first_come)


def test_the_order_itself() -> None:
    """``next_waiter`` by hand: priority, then ageing (one level per ``aging_s``), then FIFO."""
    facts = {"a": (0, 10.0, 1), "b": (1, 0.0, 2), "c": (1, 0.0, 3)}

    def pick(aging_s: float) -> str | None:
        return next_waiter(facts, lambda name: facts[name], aging_s)

    assert pick(60.0) == "b"  # the higher priority; b before c, which came after it
    assert pick(5.0) == "a"  # 10 s waited at 5 s a level: 0 + 2 > 1
    assert pick(10.0) == "a"  # 0 + 1 ties b's 1: a came first
    assert next_waiter([], lambda name: facts[name], 60.0) is None
    assert waiter_score(1, 30.0, 7, 60.0) == (1.5, -7)
