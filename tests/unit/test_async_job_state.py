"""The async job's config rules and its carried state: every bad value refused with what to fix;
a state at every bound, measured as the real data converter encodes it, fits the budget."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import ValidationError
from timeslice.errors import InvalidArgumentError
from timeslice.jobs import parse_any_job_config, parse_job_config
from timeslice.protocol import group as g
from timeslice.protocol import rl_job as r
from timeslice.protocol.async_rl_job import (
    MAX_STALENESS,
    AsyncPhaseResult,
    AsyncRLJobConfig,
    AsyncRLJobInput,
    AsyncRLJobProgress,
    AsyncRLJobResult,
    AsyncRLJobState,
    StepRecord,
    carried_async_input,
)
from timeslice.protocol.rl_job import (
    CheckpointRef,
    EpochTotals,
    PhaseResult,
    RLJobConfig,
    RLJobResult,
)
from timeslice.workflows.async_pipeline import Pipeline

from tests.unit.test_state_budget import BIG, HUGE, WORST, converted, encrypted, worst_record

GOOD: dict[str, Any] = {
    "mode": "async",
    "job_id": "j",
    "workload": "simulated",
    "sampler_group": "s",
    "trainer_group": "t",
    "epochs": 10,
}
LARGE = 2**63 - 1
REPO = Path(__file__).resolve().parents[2]


def test_a_good_async_config_is_an_rl_job_config_with_its_two_groups() -> None:
    config = parse_any_job_config(GOOD)
    assert isinstance(config, AsyncRLJobConfig) and isinstance(config, RLJobConfig)
    assert (config.max_staleness, config.sync_every) == (1, 1)
    assert config.groups() == ["s", "t"]
    assert not isinstance(parse_any_job_config({**GOOD, "mode": "sync"}), AsyncRLJobConfig)


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"max_staleness": 3, "sync_every": 5}, "use sync_every <= max_staleness + 1 (4)"),
        ({"max_staleness": 0, "sync_every": 2}, "sync_every=2 with max_staleness=0"),
        ({"max_staleness": MAX_STALENESS + 1}, "max_staleness"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"sync_every": 0}, "sync_every"),
        ({"max_staleness": "two"}, "max_staleness"),
        ({"trainer_group": "s"}, "need two groups"),
        ({"trainer_group": None}, "need two groups"),
        ({"ranks": 2}, "async jobs run one rank"),
        ({"mode": "later"}, "mode must be sync or async"),
    ],
)
def test_bad_async_settings_are_refused_naming_what_to_fix(
    change: dict[str, Any], complaint: str
) -> None:
    data = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(InvalidArgumentError) as refused:
        parse_any_job_config(data)
    assert complaint in str(refused.value)


def test_async_settings_on_a_sync_job_say_to_add_the_mode() -> None:
    with pytest.raises(InvalidArgumentError, match='add "mode": "async"'):
        parse_job_config({k: v for k, v in GOOD.items() if k != "mode"} | {"max_staleness": 2})


def test_a_sync_config_is_no_async_one() -> None:
    with pytest.raises(ValidationError):
        AsyncRLJobConfig.model_validate({**GOOD, "mode": "sync"})


def worst_step(step: int) -> StepRecord:
    return StepRecord(
        **worst_record(step).model_dump(),
        batch=LARGE,
        weights_version=LARGE,
        staleness=LARGE,
        published=True,
        sync_bytes=LARGE,
    )


def worst_async_input() -> AsyncRLJobInput:
    config = AsyncRLJobConfig(
        job_id="j" * 100,
        workload="simulated",
        workload_options={"o": WORST * (r.MAX_OPTIONS_BYTES // 6 - 10)},
        sampler_group="s" * 100,
        trainer_group="t" * 100,
        epochs=1_000_000,
        max_staleness=MAX_STALENESS,
        sync_every=MAX_STALENESS + 1,
    )
    state = AsyncRLJobState(
        epochs_done=BIG,
        last_checkpoint=CheckpointRef(epochs_done=2**62, path=WORST * r.MAX_CHECKPOINT_PATH),
        rewinds=BIG,
        redone_epochs=BIG,
        runs=BIG,
        state_bytes=2**50,
        backend_bytes={f"{i:02d}" + WORST * 98: 2**50 for i in range(40)},
        failures=BIG,
        lease_secret="f" * 64,
        folded=EpochTotals(epochs=BIG, phase_s={f"{i}" + WORST * 31: HUGE for i in range(20)}),
        next_batch=LARGE,
        published=LARGE,
        dropped_batches=LARGE,
        stale_dropped=LARGE,
        staleness_counts=[LARGE] * (MAX_STALENESS + 1),
        staleness_at_checkpoint=[LARGE] * (MAX_STALENESS + 1),
        syncs=LARGE,
        sync_bytes=LARGE,
        sync_s=HUGE,
    )
    kept_from = r.MAX_REWARDS + 100 - r.RECENT_EPOCH_RECORDS
    for step in range(r.MAX_REWARDS + 100):
        if step < kept_from:
            state.add_record(
                StepRecord(epoch=step, reward_mean=HUGE, batch=0, weights_version=0, staleness=0)
            )
        else:
            state.add_record(worst_step(step))
    state.unconfirmed = EpochTotals(
        epochs=BIG,
        phase_s={f"{i}" + WORST * 31: HUGE for i in range(r.MAX_RECORD_TIMES)},
        wait_s={f"{i}" + WORST * 31: HUGE for i in range(r.MAX_RECORD_TIMES)},
    )
    return AsyncRLJobInput(config=config, state=state)


def test_an_async_job_at_every_bound_fits_its_budget(capsys: pytest.CaptureFixture[str]) -> None:
    carried = worst_async_input()
    state = carried.state
    assert state is not None
    dumped, size, shed = carried_async_input(carried.config, state)
    assert shed == 0 and len(state.records) == r.RECENT_EPOCH_RECORDS
    assert all(isinstance(record, StepRecord) for record in state.records)
    size_converted = converted(dumped)
    with capsys.disabled():
        print(f"\nasync RL job at its bounds: {size_converted} bytes encoded")
    assert size < size_converted <= g.CARRIED_STATE_BUDGET_BYTES
    assert encrypted(dumped) <= g.CARRY_CEILING_BYTES
    assert AsyncRLJobInput.model_validate(dumped).state == state


def test_an_async_jobs_progress_says_what_it_shed_and_what_its_phases_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 35: an async job's progress dropped ``shed_records``, ``phase_s`` and ``wait_s``,
    so a job that shed records to fit its continue-as-new input said nothing of it."""
    monkeypatch.setattr(r, "CARRIED_STATE_BUDGET_BYTES", 10_000)
    config = AsyncRLJobConfig.model_validate(GOOD | {"epochs": 100})
    state = AsyncRLJobState()
    for step in range(32):
        state.add_record(
            StepRecord(
                epoch=step,
                reward_mean=0.5,
                metrics={f"train.metric_{i}": float(i) for i in range(20)},
                phase_s={"sample": 1.0, "train": 2.0},
                wait_s={"sample": 0.25},
                batch=step,
                weights_version=step,
                staleness=0,
            )
        )
    _, _, shed = carried_async_input(config, state)
    assert shed > 0 and len(state.records) < 32  # folded into the totals, which lose nothing
    shown = AsyncRLJobProgress.of(
        config, state, status="running", phase="waiting for a batch", sampler_phase="idle", queued=0
    )
    assert shown.shed_records == shed
    assert shown.phase_s == {"sample": 32.0, "train": 64.0} and shown.wait_s == {"sample": 8.0}
    assert (shown.epoch, shown.sampler_phase, shown.mode) == (0, "idle", "async")
    # What a client reads back is what the workflow answered.
    assert AsyncRLJobProgress.model_validate(shown.model_dump(mode="json")) == shown


def test_the_previous_releases_async_payloads_still_parse() -> None:
    """A running workflow of the previous release answers a progress without the fields the
    async progress now shares with the sync one; its result and continue-as-new input are
    unchanged, and parse as they did."""
    old_progress = {
        "job_id": "j",
        "mode": "async",
        "status": "running",
        "epoch": 3,
        "epochs": 10,
        "phase": "step 3 · train",
        "sampler_phase": "batch 5 · sample",
        "reward_mean": 0.5,
        "rewards": [0.1, 0.3, 0.5],
        "rewards_from": 0,
        "published": 2,
        "queued": 1,
        "next_batch": 6,
        "dropped_batches": 0,
        "stale_dropped": 0,
        "staleness_counts": [1, 2],
        "rewinds": 0,
        "last_checkpoint": None,
        "forged_notices": 0,
    }
    progress = AsyncRLJobProgress.model_validate(old_progress)
    assert (progress.phase_s, progress.wait_s, progress.shed_records) == ({}, {}, 0)
    old_result = {
        "job_id": "j",
        "mode": "async",
        "epochs_done": 10,
        "stopped": False,
        "last_checkpoint": {"epochs_done": 10, "path": "/c"},
        "rewinds": 0,
        "redone_epochs": 0,
        "records": [
            {"epoch": 9, "reward_mean": 0.5, "batch": 9, "weights_version": 8, "staleness": 1}
        ],
        "rewards": [0.5],
        "rewards_from": 9,
        "next_batch": 10,
        "dropped_batches": 0,
        "stale_dropped": 0,
        "staleness_counts": [1, 9],
        "max_staleness": 2,
        "syncs": 4,
        "sync_bytes": 4,
        "sync_s": 0.5,
        "loads": 4,
        "load_bytes": 4,
        "load_s": 0.5,
        "phase_s": {"train": 1.0},
        "wait_s": {},
    }
    result = AsyncRLJobResult.model_validate(old_result)
    assert isinstance(result.records[0], StepRecord) and result.records[0].staleness == 1
    assert isinstance(result, RLJobResult)  # what plan/collect.py reads of any job
    carried = AsyncRLJobInput.model_validate({"config": GOOD, "state": {"next_batch": 4}})
    assert isinstance(carried.state, AsyncRLJobState) and carried.state.next_batch == 4


def test_staleness_is_counted_by_value() -> None:
    state = AsyncRLJobState()
    for staleness in (0, 2, 2, 1):
        state.count_staleness(staleness)
    assert state.staleness_counts == [1, 1, 2]


def _replay() -> ModuleType:
    sys.path.insert(0, str(REPO))
    try:
        import bench.replay

        return bench.replay
    finally:
        sys.path.remove(str(REPO))


def test_the_async_replay_gives_each_dedicated_job_two_groups_and_bounds_the_trainer() -> None:
    replay = _replay()
    assert replay.groups_of("dedicated", 0, "x", "async") == ("dedicated-x-0-s", "dedicated-x-0-t")
    assert replay.groups_of("shared-trainer", 1, "x", "async") == ("sampler-x-1", "trainer-x")
    configs = [
        {
            "sampler_group": f"s{i}",
            "trainer_group": "t",
            "workload_options": {"sample_s": sample, "reward_s": 0.0, "train_s": train},
        }
        for i, (sample, train) in enumerate(((2.0, 1.0), (3.0, 1.5)))
    ]
    # Each loop runs at the slower of its two loops' pace: the samplers here (2 s, 3 s a step).
    bound = replay.async_demand_bound(configs)
    assert bound == pytest.approx({"s0": 1.0, "s1": 1.0, "t": 1.0})
    configs[1]["workload_options"]["sample_s"] = 6.0
    assert replay.async_demand_bound(configs)["t"] == pytest.approx(0.5 + 0.25)


def _sampled(batch: int, version: int | None) -> AsyncPhaseResult:
    phase = PhaseResult(
        epoch=batch, phase="sample", metrics={}, seconds=0.1, mono_start=0.0, mono_end=0.1
    )
    return AsyncPhaseResult(phase=phase, batch=batch, weights_version=version)


def test_a_sample_may_use_the_weights_the_step_in_training_publishes_and_no_newer() -> None:
    """The process may load the weights the trainer's step in hand publishes before the
    workflow hears the step is done; nothing newer, nothing older than asked, exists."""
    pipeline = Pipeline(max_staleness=2, sync_every=1, steps=10)
    state = AsyncRLJobState(epochs_done=3, published=3)
    assert pipeline.sampled_problem(_sampled(5, 3), state, batch=5, asked=3) is None
    assert "outside 3..3" in str(pipeline.sampled_problem(_sampled(5, 4), state, batch=5, asked=3))
    pipeline.training = True  # step 3 in hand publishes version 4
    assert pipeline.sampled_problem(_sampled(5, 4), state, batch=5, asked=3) is None
    assert "outside 3..4" in str(pipeline.sampled_problem(_sampled(5, 5), state, batch=5, asked=3))
    assert "outside 3..4" in str(pipeline.sampled_problem(_sampled(5, 2), state, batch=5, asked=3))
    assert "batch 6 is not" in str(
        pipeline.sampled_problem(_sampled(6, 3), state, batch=5, asked=3)
    )
    rare = Pipeline(max_staleness=2, sync_every=3, steps=10)  # step 3 publishes nothing
    rare.training = True
    assert "outside 3..3" in str(rare.sampled_problem(_sampled(5, 4), state, batch=5, asked=3))


def test_a_rewind_takes_back_the_staleness_of_the_steps_it_undid() -> None:
    state = AsyncRLJobState()
    state.count_staleness(0)
    state.checkpointed()
    state.count_staleness(1)
    state.count_staleness(0)
    state.rewound()  # the two steps after the checkpoint are trained again
    assert state.staleness_counts == [1]
    legacy = AsyncRLJobState(staleness_counts=[3])  # carried from before the snapshot was kept
    legacy.rewound()
    assert legacy.staleness_counts == [3]
