"""When a pool moves a job (plan/placement.py ``decide_move``, docs/pools.md "Moving jobs") and
when the job takes the move (workflows/pool_job.py ``move_due``): the planner's real simulator
and the job's real state model, no server, no process."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from timeslice.plan.placement import decide_move, job_profile, move_cost_s
from timeslice.protocol.pool import (
    JobMove,
    JobProfiled,
    MoveInput,
    MoveOrder,
    Placement,
    PoolConfig,
    PoolGroup,
    PoolJob,
    TenantLimits,
)
from timeslice.protocol.rl_job import CheckpointRef, RLJobState
from timeslice.workflows.pool_job import move_due

from tests.unit.test_pool_placement import BOUND, HEAVY, LIGHT, groups, placed, profile


def weigh(
    jobs: list[PoolJob],
    horizon_s: float = 600.0,
    movable: list[str] | None = None,
    memory_bytes: float | None = None,
) -> Any:
    pool = [PoolGroup(name=g, memory_bytes=memory_bytes) for g in ("g1", "g2")]
    return decide_move(
        MoveInput(
            groups=pool,
            max_slowdown=BOUND,
            placed=jobs,
            movable=[j.job_id for j in jobs] if movable is None else movable,
            horizon_s=horizon_s,
        )
    )


def with_state(prof: dict[str, Any], nbytes: float) -> dict[str, Any]:
    return {**prof, "states": [{"name": "policy", "pool": "sampler", "bytes": nbytes}]}


def test_two_light_jobs_on_two_groups_are_packed_onto_one() -> None:
    outcome = weigh([placed("a", "g1", LIGHT, None), placed("b", "g2", LIGHT, None)])
    assert outcome.job_id in {"a", "b"} and outcome.placement is not None
    other = "g2" if outcome.job_id == "a" else "g1"
    assert outcome.placement == Placement(sampler_group=other, trainer_group=other)
    assert outcome.reason.startswith(f"moved {outcome.job_id} to {other}: pool utilization +")
    worst = float(outcome.reason.split("worst job ")[1].split("x")[0])
    assert worst <= BOUND
    # Each profiled job's demand comes back for the pool's status: its GPU share alone.
    assert outcome.demands == pytest.approx({"a": 0.2, "b": 0.2})


def test_no_move_past_the_bound() -> None:
    outcome = weigh([placed("a", "g1", HEAVY, None), placed("b", "g2", HEAVY, None)])
    assert outcome.job_id is None and outcome.reason.startswith("no move: ")


def test_no_move_onto_a_group_whose_demand_is_unknown() -> None:
    outcome = weigh([placed("a", "g1", LIGHT, None), placed("b", "g2", None, None)])
    assert outcome.job_id is None
    assert outcome.demands == pytest.approx({"a": 0.2})


def test_only_the_movable_move() -> None:
    jobs = [placed("a", "g1", LIGHT, None), placed("b", "g2", LIGHT, None)]
    assert weigh(jobs, movable=["b"]).job_id == "b"
    assert weigh(jobs, movable=[]).job_id is None


def test_a_move_that_costs_more_than_it_gains_over_the_horizon_is_not_made() -> None:
    # 2.5 GB each way at the default 25 GB/s: 0.2 s of moving, against a gain of about 6
    # points of the horizon (groups with room for both jobs' states): made over 600 s, not
    # over 2 s.
    light = with_state(profile(0.1, 0.9), 2.5e9)
    jobs = [placed("a", "g1", light, None), placed("b", "g2", light, None)]
    assert move_cost_s(job_profile(jobs[0])) == pytest.approx(0.2)  # type: ignore[arg-type]
    made = weigh(jobs, horizon_s=600, memory_bytes=10e9)
    assert made.job_id is not None and "costs 0.2 s" in made.reason, made.reason
    assert weigh(jobs, horizon_s=2, memory_bytes=10e9).job_id is None


def test_a_moves_cost_uses_the_profiles_own_move_times() -> None:
    timed = {**LIGHT, "states": [{"name": "s", "pool": "sampler", "bytes": 1e9,
                                  "snapshot_s": 0.7, "restore_s": 0.6}]}  # fmt: skip
    prof = job_profile(PoolJob(job_id="j", profile=timed))
    assert prof is not None and move_cost_s(prof) == pytest.approx(1.3)


def state_at(epochs_done: int, checkpoint: int | None, moves: list[int]) -> RLJobState:
    g = Placement(sampler_group="g", trainer_group="g")
    return RLJobState(
        epochs_done=epochs_done,
        last_checkpoint=None
        if checkpoint is None
        else CheckpointRef(epochs_done=checkpoint, path="/c"),
        pending_move=MoveOrder(pool="p", sampler_group="h", trainer_group="h", epochs_apart=4),
        moves=[JobMove(epoch=e, moved_from=g, moved_to=g) for e in moves],
    )


@pytest.mark.parametrize(
    ("epochs_done", "checkpoint", "moves", "due"),
    [
        (4, 4, [], True),  # at its last checkpoint
        (5, 4, [], False),  # an epoch past it: what it trained since would be lost
        (0, None, [], False),  # nothing saved yet
        (6, 6, [4], False),  # moved 2 epochs ago; at most once in 4
        (8, 8, [4], True),
    ],
)
def test_a_job_takes_its_move_at_a_checkpoint_boundary_at_most_once_in_n_epochs(
    epochs_done: int, checkpoint: int | None, moves: list[int], due: bool
) -> None:
    assert move_due(state_at(epochs_done, checkpoint, moves)) is due
    assert not move_due(
        RLJobState(epochs_done=4, last_checkpoint=CheckpointRef(epochs_done=4, path="/c"))
    )


def test_move_inputs_are_checked() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        PoolConfig(pool="p", groups=groups("g"), move_every_epochs=0)
    with pytest.raises(ValidationError, match="greater than 0"):
        PoolConfig(pool="p", groups=groups("g"), move_horizon_s=0)
    with pytest.raises(ValidationError, match="invalid group id"):
        MoveOrder(pool="p", sampler_group="no such/group", trainer_group="g")
    with pytest.raises(ValidationError, match="at most 300 characters"):
        MoveOrder(pool="p", sampler_group="g", trainer_group="g", reason="x" * 301)
    with pytest.raises(ValidationError, match="at most 16384"):
        JobProfiled(job_id="j", profile={"x": "y" * 20_000})
    assert PoolGroup(name="g") in PoolConfig(pool="p", groups=groups("g")).groups
    assert profile(0.2, 0.8) == LIGHT


def weigh_for(jobs: list[PoolJob], queued: list[PoolJob], **tenants: TenantLimits) -> Any:
    return decide_move(
        MoveInput(
            groups=groups("g1", "g2"),
            max_slowdown=BOUND,
            placed=jobs,
            movable=[j.job_id for j in jobs],
            horizon_s=600.0,
            queued=queued,
            tenants=tenants,
        )
    )


def test_a_move_that_makes_room_for_a_queued_job_says_so_and_counts_its_gpu_time() -> None:
    spread = [placed("a", "g1", LIGHT, None), placed("b", "g2", LIGHT, None)]
    outcome = weigh_for(spread, [PoolJob(job_id="c", profile=HEAVY)])
    assert outcome.job_id in {"a", "b"} and outcome.makes_room_for == "c"
    assert f"moved {outcome.job_id} to " in outcome.reason and " to make room for c (then c " in (
        outcome.reason
    )
    # Its gain: c's 0.9 of a group over the 600 s horizon, and the packing's own.
    gains = float(outcome.reason.split("gains ")[1].split(" s")[0])
    assert gains >= 0.9 * 600
    # Without the queue, the same packing is weighed on utilization alone.
    alone = weigh_for(spread, [])
    assert alone.makes_room_for is None and gains > float(
        alone.reason.split("gains ")[1].split(" s")[0]
    )


def test_no_room_is_made_for_a_job_that_would_break_the_bound_or_its_quota() -> None:
    # A heavy beside each light: no move frees a group the queued heavy fits on.
    full = [
        placed("a", "g1", LIGHT, None),
        placed("h1", "g1", HEAVY, None),
        placed("b", "g2", LIGHT, None),
        placed("h2", "g2", HEAVY, None),
    ]
    assert weigh_for(full, [PoolJob(job_id="c", profile=HEAVY)]).makes_room_for is None
    # A tenant holding its whole quota gets no room made for its next job.
    spread = [
        placed("a", "g1", LIGHT, None).model_copy(update={"tenant": "t", "demand": 0.2}),
        placed("b", "g2", LIGHT, None).model_copy(update={"tenant": "t", "demand": 0.2}),
    ]
    over = PoolJob(job_id="c", profile=HEAVY, tenant="t")
    outcome = weigh_for(spread, [over], t=TenantLimits(quota=1.0))
    assert outcome.makes_room_for is None
    assert weigh_for(spread, [over], t=TenantLimits(quota=2.0)).makes_room_for == "c"
