"""The protocol simulator against schedules worked out by hand (times in the comments)."""

from __future__ import annotations

import pytest
from timeslice.plan.profile import JobProfile, Overheads, StateProfile
from timeslice.plan.simulator import GroupSpec, Outcome, Placement, rl_profile, simulate
from timeslice.protocol.group import GrantPolicy, GroupConfig
from timeslice.workflows.grant_policy import CarryLimits

ZERO = Overheads.zero()
FIFO = {"g": GroupSpec(grant_policy=GrantPolicy.FIFO)}


def rl(job: str, s: float, r: float, t: float, epochs: int = 1, **kw: object) -> JobProfile:
    return rl_profile(job, sample_s=s, rewards_s=r, train_s=t, epochs=epochs, **kw)  # type: ignore[arg-type]


def on(group: str, profile: JobProfile, start: float = 0.0) -> Placement:
    return Placement(profile, group, group, start_s=start)


def holds(outcome: Outcome, group: str = "g") -> list[tuple[str, float, float]]:
    return [(j, round(a, 6), round(b, 6)) for j, a, b in outcome.groups[group].holds]


def state(name: str = "s", nbytes: int = 10, snap: float = 0.2, rest: float = 0.3) -> StateProfile:
    return StateProfile(name=name, pool="sampler", bytes=nbytes, snapshot_s=snap, restore_s=rest)


def test_fifo_release_and_carry_over_when_nobody_waits() -> None:
    a = rl("a", 2, 1, 1, epochs=2)
    b = rl("b", 1.5, 2.7, 0.5, epochs=2)
    out = simulate([on("g", a), on("g", b, start=0.5)], groups=FIFO, overheads=ZERO)
    # a samples 0-2; b asked at 0.5 and gets the group at 2; a's train (asked at 3) waits for
    # b's release at 3.5. At 4.5 nobody waits: a keeps the lease and samples 4.5-6.5. b asked
    # for its train at 6.2: granted at 6.5; at 7 nobody waits, b keeps it and samples 7-8.5.
    # a (asked at 7.5) trains 8.5-9.5; b's last train, asked at 11.2, finds the group free.
    assert holds(out) == [
        ("a", 0, 2),
        ("b", 2, 3.5),
        ("a", 3.5, 4.5),
        ("a", 4.5, 6.5),
        ("b", 6.5, 7),
        ("b", 7, 8.5),
        ("a", 8.5, 9.5),
        ("b", 11.2, 11.7),
    ]
    assert out.groups["g"].utilization == pytest.approx(10 / 11.7)
    assert out.jobs["a"].completion_s == pytest.approx(9.5)
    assert out.jobs["b"].completion_s == pytest.approx(9.7)
    assert out.groups["g"].switches == 5  # a→b, b→a, a→b, b→a, a→b


FIRST_HOLDS = [("a", 0, 1), ("b", 1, 1.8), ("a", 2, 4), ("b", 4, 5)]


@pytest.mark.parametrize(
    ("policy", "later_holds"),
    [
        # a asks again at 4 and waits for b's release at 5, and so on.
        (GrantPolicy.FIFO, [("a", 5, 6), ("b", 6, 6.8), ("a", 7, 9), ("b", 9, 10)]),
        # At 5 b (waited 0.9 + 1.7 s since 0.1: share 0.53) carries past a (its two grants
        # came at once: share 0; its wait since 4 is what max_carries bounds) into its
        # sample 5-5.8; then a samples 5.8-6.8, b trains 6.8-7.8, a 7.8-9.8.
        (
            GrantPolicy.PHASE_AWARE,
            [("b", 5, 5.8), ("a", 5.8, 6.8), ("b", 6.8, 7.8), ("a", 7.8, 9.8)],
        ),
    ],
)
def test_lease_is_not_carried_past_a_waiter_that_waited_more(
    policy: GrantPolicy, later_holds: list[tuple[str, float, float]]
) -> None:
    a = rl("a", 1, 1, 2, epochs=2)
    b = rl("b", 0.8, 0.5, 1, epochs=2)
    groups = {"g": GroupSpec(grant_policy=policy)}
    out = simulate([on("g", a), on("g", b, start=0.1)], groups=groups, overheads=ZERO, record=True)
    # a trains 2-4 while b (asked at 2.3) waits: at 4 a's lease goes to b, not to a's next
    # sampling. Under phase_aware too: b waited 0.9 s for its one grant (asked at 0.1), a 0 s
    # for its two, so at 4 b's waiting share 0.9 / 3.9 = 0.23 is above a's 0 + the slack.
    assert holds(out) == FIRST_HOLDS + later_holds
    [carry] = [e for e in out.events if e.carry_into is not None and e.time == 4]
    assert not carry.kept
    assert ("b waited more" if policy is GrantPolicy.PHASE_AWARE else "fifo") in carry.reason


@pytest.mark.parametrize(
    ("policy", "a_holds", "b_holds"),
    [
        # b samples 0-0.5; a (asked at 0.1, waited 0.4 s) samples 0.5-1.5, trains 2.5-3.5.
        # b asked for its train at 3 and waits: at 3.5 FIFO hands it the group (3.5-4); a asks
        # again, samples 4-5 and trains 6-7.
        (GrantPolicy.FIFO, [(0.5, 1.5), (2.5, 3.5), (4, 5), (6, 7)], [(0, 0.5), (3.5, 4)]),
        # phase_aware: a's share 0.4 / 3.4 = 0.12 is not below b's 0 (b never waited): a
        # carries its lease into its sample (3.5-4.5); b trains 4.5-5, a's last train 5.5-6.5.
        (
            GrantPolicy.PHASE_AWARE,
            [(0.5, 1.5), (2.5, 3.5), (3.5, 4.5), (5.5, 6.5)],
            [(0, 0.5), (4.5, 5)],
        ),
    ],
)
def test_a_lease_is_carried_past_a_waiter_that_waited_less(
    policy: GrantPolicy,
    a_holds: list[tuple[float, float]],
    b_holds: list[tuple[float, float]],
) -> None:
    a = rl("a", 1, 1, 1, epochs=2)
    b = rl("b", 0.5, 2.5, 0.5)
    out = simulate(
        [on("g", b), on("g", a, start=0.1)],
        groups={"g": GroupSpec(grant_policy=policy)},
        overheads=ZERO,
    )
    assert [(x, y) for j, x, y in holds(out) if j == "a"] == a_holds
    assert [(x, y) for j, x, y in holds(out) if j == "b"] == b_holds
    assert out.groups["g"].carried == (1 if policy is GrantPolicy.PHASE_AWARE else 0)


def test_group_spec_mirrors_the_group_config() -> None:
    spec, config = GroupSpec(), GroupConfig(group_id="g")
    assert spec.limits == CarryLimits(
        config.grant_policy, config.max_carries, config.carry_limit_s, config.share_slack
    )
    assert spec.aging_s == config.aging_s
    assert GroupSpec(grant_policy="fifo").grant_policy is GrantPolicy.FIFO  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use one of fifo, phase_aware"):
        GroupSpec(grant_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_carries"):
        GroupSpec(max_carries=-1)


def client_job(job: str, hold: float, priority: int = 0) -> JobProfile:
    return JobProfile.model_validate(
        {
            "job_id": job,
            "kind": "client",
            "epochs": 1,
            "priority": priority,
            "phases": [{"name": "hold", "gpu": True, "pool": "sampler", "seconds": hold}],
        }
    )


@pytest.mark.parametrize(
    ("aging_s", "h_priority", "order"),
    [
        # At 10: l (priority 0, waited 9 s) scores 0 + 9/2 = 4.5; h (2, waited 4 s) 2 + 4/2 = 4.
        (2.0, 2, ["x", "l", "h"]),
        # h at priority 3 scores 5 > 4.5.
        (2.0, 3, ["x", "h", "l"]),
        # Ageing too slow to matter: priority decides.
        (1000.0, 2, ["x", "h", "l"]),
    ],
)
def test_priority_with_ageing(aging_s: float, h_priority: int, order: list[str]) -> None:
    jobs = [
        on("g", client_job("x", 10)),
        on("g", client_job("l", 1), start=1),
        on("g", client_job("h", 1, priority=h_priority), start=6),
    ]
    out = simulate(jobs, groups={"g": GroupSpec(aging_s=aging_s)}, overheads=ZERO)
    assert [j for j, _, _ in holds(out)] == order
    assert [round(a, 6) for _, a, _ in holds(out)] == [0, 10, 11]


def test_protocol_costs_of_a_job_alone() -> None:
    ov = Overheads(request_s=0.01, grant_s=0.02, hop_s=0.03, carry_s=0.1, group_move_s=0)
    out = simulate([on("g", rl("a", 1, 1, 1, epochs=2))], overheads=ov)
    # Asked at 0, granted at 0.01, grant in the process at 0.03: sample 0.03-1.03. Rewards
    # start a hop later (1.06-2.06) and ask for the train lease as they end: granted in the
    # process at 2.09, when the train activity starts too. The lease is kept: the next sample
    # starts carry_s after train (3.19). The last train is asked at 5.22, runs 5.25-6.25.
    assert holds(out) == [
        ("a", 0.03, 1.03),
        ("a", 2.09, 3.09),
        ("a", 3.19, 4.19),
        ("a", 5.25, 6.25),
    ]
    assert out.jobs["a"].completion_s == pytest.approx(6.22)
    assert out.groups["g"].utilization == pytest.approx(4 / 6.22)


@pytest.mark.parametrize(
    ("memory", "staged", "expected"),
    [
        # b prepared last, so its state is on the device and a's is not. Not both fit: each
        # switch waits for the eviction (0.2; at first the group's own, of b) before the
        # grant, then the next job restores its state (0.3) before its phase.
        (None, True, [("a", 0.5, 1.5), ("b", 2, 3), ("a", 3.5, 4.5), ("b", 5, 6)]),
        # Both fit: the grant comes at once; the restore overlaps the eviction.
        (20, False, [("a", 0.3, 1.3), ("b", 1.6, 2.6), ("a", 2.9, 3.9), ("b", 4.2, 5.2)]),
        # ... and a waiter that restored here before is staged while the holder works: a,
        # asking at 2.3, comes in 2.3-2.6 during b's phase and starts at b's release. b asks
        # at 3.6 as a releases, so its restore is not hidden (3.6-3.9).
        (20, True, [("a", 0.3, 1.3), ("b", 1.6, 2.6), ("a", 2.6, 3.6), ("b", 3.9, 4.9)]),
    ],
)
def test_cooperative_switches_overlapped_or_not(
    memory: int | None, staged: bool, expected: list[tuple[str, float, float]]
) -> None:
    a = rl("a", 1, 1, 1, states=[state()])
    b = rl("b", 1, 1, 1, states=[state()])
    out = simulate(
        [on("g", a), on("g", b, start=0.5)],
        groups={"g": GroupSpec(memory_bytes=memory, staged_restores=staged)},
        overheads=ZERO,
    )
    assert holds(out) == expected
    assert out.groups["g"].bytes_moved == 8 * 10  # 4 evictions, 4 restores
    # Counted as the real group counts them (GroupStats): a's and b's second restores were
    # staged (b's started as a released, so its grant still waited for it), both used.
    staged_restores = 2 if memory is not None and staged else 0
    assert out.groups["g"].staged_restores == staged_restores
    assert out.groups["g"].staged_unused == 0


def test_restore_waits_for_own_eviction_and_sticky_state_is_evicted_by_the_group() -> None:
    a = rl("a", 1, 0.05, 1, states=[state(snap=0.5)])
    b = rl("b", 0.1, 5, 0.1, states=[state(snap=0.5)])
    out = simulate(
        [on("g", a), on("g", b, start=0.5)],
        groups={"g": GroupSpec(memory_bytes=20)},
        overheads=ZERO,
        record=True,
    )
    # The group evicts b (prepared last) beside a's grant at 0; a restores 0-0.3, samples
    # 0.3-1.3, then evicts 1.3-1.8 while b restores 1.3-1.6 and samples 1.6-1.7. a, granted at
    # 1.7, restores only after its own eviction ends (1.8-2.1), trains 2.1-3.1 and keeps its
    # state on the device (nobody waits). b's train, asked at 6.7: the group evicts a beside
    # the grant.
    assert holds(out) == [("a", 0.3, 1.3), ("b", 1.6, 1.7), ("a", 2.1, 3.1), ("b", 7, 7.1)]
    evictions = [(s.job_id, s.start, s.end) for s in out.segments if s.kind == "evict"]
    assert [(j, round(x, 6), round(y, 6)) for j, x, y in evictions] == [
        ("b", 0, 0.5),
        ("a", 1.3, 1.8),
        ("b", 1.7, 2.2),
        ("a", 6.7, 7.2),
    ]


def test_a_job_alone_never_moves_its_state() -> None:
    alone = simulate([on("g", rl("a", 1, 2, 1, epochs=5, states=[state()]))], overheads=ZERO)
    bare = simulate([on("g", rl("a", 1, 2, 1, epochs=5))], overheads=ZERO)
    assert alone.groups["g"].bytes_moved == 0
    assert alone.jobs["a"].completion_s == bare.jobs["a"].completion_s == pytest.approx(20)


def test_checkpoint_holds_the_lease() -> None:
    a = rl("a", 1, 1, 1, checkpoint_every=1, checkpoint_s=0.5)
    b = rl("b", 1, 1, 1)
    out = simulate([on("g", a), on("g", b, start=2.5)], overheads=ZERO)
    # b asks at 2.5 while a trains 2-3; a writes its checkpoint 3-3.5 under the lease.
    assert holds(out)[:3] == [("a", 0, 1), ("a", 2, 3), ("b", 3.5, 4.5)]


def test_a_state_follows_the_lease_between_groups() -> None:
    shared = StateProfile(name="w", pool="both", bytes=10, snapshot_s=0.2, restore_s=0.3)
    a = rl("a", 1, 1, 1, states=[shared])
    out = simulate([Placement(a, "s", "t")], overheads=ZERO)
    # Prepared on the sampler group; before train it leaves s (0.2) and comes to t (0.3).
    assert holds(out, "s") == [("a", 0, 1)]
    assert holds(out, "t") == [("a", 2.5, 3.5)]


def test_disaggregated_pools_pipeline_two_jobs() -> None:
    a = rl("a", 1, 0.5, 1, epochs=3)
    b = rl("b", 1, 0.5, 1, epochs=3)
    out = simulate([Placement(a, "s", "t"), Placement(b, "s", "t", start_s=0.1)], overheads=ZERO)
    # b samples while a computes rewards and trains: a 0-1, b 1-2, a 2.5-3.5, b 3.5-4.5, ...
    assert holds(out, "s")[:4] == [("a", 0, 1), ("b", 1, 2), ("a", 2.5, 3.5), ("b", 3.5, 4.5)]
    assert holds(out, "t")[:2] == [("a", 1.5, 2.5), ("b", 2.5, 3.5)]


def test_same_profile_same_result_and_seeded_draws_differ() -> None:
    p = JobProfile.model_validate(
        {
            "job_id": "a",
            "epochs": 20,
            "phases": [
                {
                    "name": "sample",
                    "gpu": True,
                    "pool": "sampler",
                    "seconds": {"mean": 1, "stdev": 0.3, "min": 0.5, "max": 1.5},
                },
                {"name": "rewards", "gpu": False, "seconds": 1},
                {"name": "train", "gpu": True, "pool": "trainer", "seconds": 1},
            ],
        }
    )
    first = simulate([on("g", p)]).jobs["a"].completion_s
    assert simulate([on("g", p)]).jobs["a"].completion_s == first
    drawn = simulate([on("g", p)], seed=1).jobs["a"].completion_s
    assert drawn != first
    assert simulate([on("g", p)], seed=1).jobs["a"].completion_s == drawn


def test_repeated_job_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="job ids repeat"):
        simulate([on("g", rl("a", 1, 1, 1)), on("h", rl("a", 1, 1, 1))])


def test_a_group_opens_late_and_keeps_first_come_first_served() -> None:
    jobs = [on("g", client_job("x", 1)), on("g", client_job("y", 1), start=0.5)]
    out = simulate(jobs, groups={"g": GroupSpec(opens_s=2)}, overheads=ZERO)
    # Both asked before the group opened at 2: x (first to ask) goes first.
    assert holds(out) == [("x", 2, 3), ("y", 3, 4)]
