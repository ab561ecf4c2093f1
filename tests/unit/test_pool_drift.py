"""A job whose profile drifts (docs/pools.md, "Drifting profiles"): when it tells its pool
(workflows/pool_job.py ``drifted_profile``, protocol/pool.py ``profile_drift``) and the move
that brings a pool back within its bound (plan/placement.py ``decide_move``), for a sync job
and an async one, and where an async job's loops stop to take a move (``move_boundary``): the
job's real state model and the planner's real simulator, no server, no process."""

from __future__ import annotations

from typing import Any

import pytest
from timeslice.plan.placement import decide_move, job_profile
from timeslice.protocol.async_rl_job import AsyncRLJobConfig
from timeslice.protocol.pool import (
    DRIFT_EPOCHS,
    JobMove,
    MoveInput,
    MoveOrder,
    Placement,
    PoolGroup,
    PoolJob,
    profile_drift,
    profile_seconds,
)
from timeslice.protocol.rl_job import EpochRecord, RLJobConfig, RLJobState
from timeslice.workflows.pool_job import drifted_profile, measured_profile, move_boundary

from tests.unit.test_pool_placement import BOUND, HEAVY, LIGHT, placed, profile

BACKENDS = {"sampler": ["sampler"], "trainer": ["trainer"]}


def test_a_profiles_seconds_are_its_gpu_phases_and_its_epoch() -> None:
    assert profile_seconds(profile(0.4, 1.0)) == pytest.approx((0.4, 1.4))
    as_means = {"phases": [{"name": "s", "gpu": True, "seconds": {"mean": 2.0}},
                           {"name": "r", "gpu": False, "seconds": 1}]}  # fmt: skip
    assert profile_seconds(as_means) == pytest.approx((2.0, 3.0))
    unreadable_ones: list[dict[str, Any]] = [
        {},
        {"phases": []},
        {"phases": [{"name": "s", "seconds": -1}]},
        {"phases": [{"name": "s", "seconds": True}]},
        {"phases": ["s"]},
    ]
    for unreadable in unreadable_ones:
        assert profile_seconds(unreadable) is None, unreadable


@pytest.mark.parametrize(
    ("known", "measured", "drifted"),
    [
        ((0.4, 1.4), (0.45, 1.45), None),  # within 25%
        ((0.4, 1.4), (0.6, 1.6), "GPU 0.40 -> 0.60 s"),  # the GPU phases +50%
        ((0.4, 1.4), (0.4, 2.0), "epoch 1.40 -> 2.00 s"),  # the rewards lengthened
        ((0.4, 1.4), (2.0, 3.0), "GPU 0.40 -> 2.00 s, epoch 1.40 -> 3.00 s"),
        ((0.4, 1.4), (0.2, 1.2), "GPU 0.40 -> 0.20 s"),  # shorter drifts too
        ((0.02, 0.1), (0.06, 0.14), None),  # tripled, but by less than DRIFT_MIN_S
    ],
)
def test_a_profile_drifts_past_a_quarter_and_a_few_hundredths_of_a_second(
    known: tuple[float, float], measured: tuple[float, float], drifted: str | None
) -> None:
    assert profile_drift(known, measured) == drifted


def _config(declared: dict[str, Any] | None) -> RLJobConfig:
    return RLJobConfig(job_id="j", workload="simulated", pool="p", profile=declared, epochs=40)


def _state(gpu_s: list[float], **extra: Any) -> RLJobState:
    """A job state with one record an epoch: half of each epoch's GPU seconds sampling, half
    training, 1 s of rewards."""
    records = [
        EpochRecord(epoch=e, reward_mean=None,
                    phase_s={"sample": g / 2, "rewards": 1.0, "train": g / 2})
        for e, g in enumerate(gpu_s)
    ]  # fmt: skip
    return RLJobState(epochs_done=len(gpu_s), records=records, **extra)


def test_a_job_with_a_declared_profile_sends_the_medians_of_its_last_epochs_once_they_drift() -> (
    None
):
    declared = _config(profile(0.4, 1.0))
    # Its first epoch (start-up) is never read; one slow epoch is not a drift (medians).
    assert drifted_profile(declared, _state([5.0, 0.4, 3.0, 0.4]), BACKENDS) is None
    assert drifted_profile(declared, _state([0.4, 0.4, 0.4, 0.4, 0.4]), BACKENDS) is None
    sent = drifted_profile(declared, _state([0.4, 0.4, 0.4, 2.0, 2.2]), BACKENDS)
    assert sent is not None
    assert profile_seconds(sent) == pytest.approx((2.0, 3.0))  # the medians of 0.4, 2.0, 2.2
    assert [s["name"] for s in sent["states"]] == ["sampler", "trainer"]
    assert sent["epochs"] == 40


def test_after_it_sent_one_a_job_reads_only_the_epochs_since() -> None:
    config = _config(None)
    sent_at = {"profile_sent": True, "sent_profile_s": (2.0, 3.0), "sent_profile_at": 4}
    # Fewer than DRIFT_EPOCHS epochs since it sent: nothing read yet, whatever they say.
    early = _state([0.4, 0.4, 0.4, 2.0] + [9.0] * (DRIFT_EPOCHS - 1), **sent_at)
    assert drifted_profile(config, early, BACKENDS) is None
    steady = _state([0.4, 0.4, 0.4, 2.0] + [2.1] * DRIFT_EPOCHS, **sent_at)
    assert drifted_profile(config, steady, BACKENDS) is None
    again = _state([0.4, 0.4, 0.4, 2.0] + [0.4] * DRIFT_EPOCHS, **sent_at)
    assert drifted_profile(config, again, BACKENDS) is not None


def test_a_job_its_pool_knows_no_profile_of_sends_none_on_drift() -> None:
    grown = [0.4, 0.4, 2.0, 2.0, 2.0, 2.0]
    # Placed without a profile, not yet sent: it sends its measured one (profile_due) first.
    assert drifted_profile(_config(None), _state(grown), BACKENDS) is None
    # A run from before drift was tracked sent one but did not keep what.
    assert drifted_profile(_config(None), _state(grown, profile_sent=True), BACKENDS) is None


def _weigh(jobs: list[Any], horizon_s: float = 600.0) -> Any:
    return decide_move(
        MoveInput(
            groups=[PoolGroup(name=g) for g in ("g1", "g2")],
            max_slowdown=BOUND,
            placed=jobs,
            movable=[j.job_id for j in jobs],
            horizon_s=horizon_s,
        )
    )


def test_a_drift_past_the_bound_moves_a_job_even_where_utilization_falls() -> None:
    # Two jobs packed while light; one grew heavy: its neighbour now runs past the bound.
    outcome = _weigh([placed("a", "g1", LIGHT, None), placed("b", "g1", HEAVY, None)])
    assert outcome.job_id in {"a", "b"}
    assert outcome.placement == Placement(sampler_group="g2", trainer_group="g2")
    assert f"moved {outcome.job_id} to g2 to bring the pool back within its bound" in (
        outcome.reason
    )
    was = float(outcome.reason.split("worst job was ")[1].split("x")[0])
    worst = float(outcome.reason.split("worst job ")[2].split("x")[0])
    assert was > BOUND >= worst, outcome.reason
    assert "pool utilization -" in outcome.reason  # spread: the mean per group fell


def test_a_move_back_within_the_bound_is_not_made_when_it_costs_more_than_it_gains() -> None:
    def stated(prof: dict[str, Any]) -> dict[str, Any]:  # 10 GB: 0.4 s each way
        return {**prof, "states": [{"name": "policy", "pool": "sampler", "bytes": 1e10}]}

    jobs = [placed("a", "g1", stated(LIGHT), None), placed("b", "g1", stated(HEAVY), None)]
    outcome = _weigh(jobs, horizon_s=0.5)  # a move costs 0.8 s; half a second gains less
    assert outcome.job_id is None
    assert "over the bound, and no move brings every job back within it" in outcome.reason
    assert _weigh(jobs).job_id is not None  # over 600 s it pays


def test_an_async_job_is_moved_off_a_group_it_overloads_onto_two_others() -> None:
    asynchronous = profile(0.4, 0.2, mode="async")
    jobs = [
        placed("h", "g1", HEAVY, None),
        PoolJob(
            job_id="a",
            mode="async",
            profile=asynchronous,
            placement=Placement(sampler_group="g1", trainer_group="g2"),
        ),
    ]
    outcome = decide_move(
        MoveInput(
            groups=[PoolGroup(name=g) for g in ("g1", "g2", "g3")],
            max_slowdown=BOUND,
            placed=jobs,
            movable=["a"],
            horizon_s=600.0,
        )
    )
    assert outcome.job_id == "a" and outcome.placement is not None
    at = outcome.placement
    assert at.sampler_group != at.trainer_group and "g1" not in {at.sampler_group, at.trainer_group}
    assert outcome.reason.startswith(
        f"moved a to {at.sampler_group} (sampler) + {at.trainer_group} (trainer) to bring the "
        "pool back within its bound"
    ), outcome.reason


@pytest.mark.parametrize(
    ("epochs_done", "last_move", "boundary"),
    [
        (0, None, 2),  # the next checkpoint after the step in hand
        (3, None, 4),
        (4, None, 6),  # at a checkpoint, a step may be in hand: the next one
        (5, 4, 10),  # moved at 4, at most once in 5 steps: not before 9, so 10
        (11, None, 12),  # the job's last step, whatever checkpoint_every says
    ],
)
def test_an_async_jobs_loops_stop_for_its_move_at_its_next_checkpoint(
    epochs_done: int, last_move: int | None, boundary: int
) -> None:
    config = AsyncRLJobConfig(job_id="a", workload="simulated", pool="p", epochs=12,
                              checkpoint_every=2, max_staleness=1)  # fmt: skip
    g = Placement(sampler_group="g1", trainer_group="g2")
    state = RLJobState(
        epochs_done=epochs_done,
        pending_move=MoveOrder(pool="p", sampler_group="g3", trainer_group="g1", epochs_apart=5),
        moves=[] if last_move is None else [JobMove(epoch=last_move, moved_from=g, moved_to=g)],
    )
    assert move_boundary(config, state) == boundary
    assert move_boundary(config, RLJobState(epochs_done=epochs_done)) is None


def test_an_async_jobs_measured_profile_says_so_and_is_one_the_planner_reads() -> None:
    config = AsyncRLJobConfig(job_id="a", workload="simulated", pool="p", epochs=12,
                              max_staleness=2, sync_every=3)  # fmt: skip
    sent = drifted_profile(
        AsyncRLJobConfig(**{**config.model_dump(), "profile": profile(0.4, 1.0, mode="async")}),
        _state([0.4, 0.4, 2.0, 2.0, 2.0]),
        BACKENDS,
    )
    assert sent is not None
    assert (sent["mode"], sent["max_staleness"], sent["sync_every"]) == ("async", 2, 3)
    parsed = job_profile(PoolJob(job_id="a", mode="async", profile=sent))
    assert parsed is not None and parsed.is_async
    assert parsed.loop_s("trainer") == pytest.approx(1.0)


def test_a_state_both_loops_use_is_one_state_of_pool_both_in_the_measured_profile() -> None:
    """A backend listed for the sampler and the trainer (workloads/base.py allows it) is one
    state that follows the lease, as the profile collector writes it: two states of one name
    made a profile the planner refused, and with it every placement in the pool after."""
    config = RLJobConfig(job_id="a", workload="simulated", pool="p", epochs=12)
    shared = {"sampler": ["policy", "kv"], "trainer": ["policy", "adam"]}
    state = _state([0.4, 0.4, 0.4])
    state.backend_bytes = {"policy": 100, "kv": 10, "adam": 200}
    sent = measured_profile(config, state, shared)
    assert [(s["name"], s["pool"], s["bytes"]) for s in sent["states"]] == [
        ("policy", "both", 100), ("kv", "sampler", 10), ("adam", "trainer", 200)
    ]  # fmt: skip
    parsed = job_profile(PoolJob(job_id="a", profile=sent))
    assert parsed is not None and [s.name for s in parsed.states] == ["policy", "kv", "adam"]
