"""grpo-toy's async mode on real torch, driven in-process: stale batches, and staleness 0.

The job's schedule (tests/test_async_jobs.py runs it through real processes) is played here by
hand: batch ``b`` is sampled once the trainer has published ``max(0, b - K)`` steps, so every
batch from the K-th on is trained K steps after the weights that sampled it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from timeslice.workloads.base import PhaseContext  # noqa: E402
from timeslice.workloads.grpo_toy import GrpoToyWorkload  # noqa: E402

from tests.test_grpo_toy import all_equal, make, run_epoch, spec, trainer_state  # noqa: E402

#: Over 30 steps with every batch two steps stale, seeds 0-3 measure +0.32 .. +0.50 with the
#: decoupled objective (seed 0: 0.111 -> 0.429), as the sync job's +0.34 .. +0.49; with plain
#: PPO clipped against the stale behaviour policy, +0.09 .. +0.15 (seed 0: +0.086), which this
#: bar refuses. The run is deterministic (seeded).
ASYNC_REWARD_RISE = 0.2


def ctx(n: int, phase: str) -> PhaseContext:
    return PhaseContext(n, phase)


def run_async(w: GrpoToyWorkload, steps: int, staleness: int) -> tuple[list[float], list[int]]:
    """Rewards per step and each step's staleness, with weights published every step."""
    rewards: list[float] = []
    stale: list[int] = []
    sampled_with: dict[int, int] = {}
    loaded = 0
    next_batch = 0
    for step in range(steps):
        while next_batch <= step + staleness:
            published = step  # the trainer has published every step so far
            if loaded != published:
                w.load_weights(published, ctx(next_batch, "sample"))
                loaded = published
            w.sample_batch(next_batch, ctx(next_batch, "sample"))
            score = w.score_batch(next_batch, ctx(next_batch, "rewards"))
            sampled_with[next_batch] = loaded
            rewards.append(score["reward_mean"])
            next_batch += 1
        w.train_batch(step, step, ctx(step, "train"))
        w.publish_weights(step + 1, ctx(step, "train"))
        stale.append(step - sampled_with[step])
    return rewards[:steps], stale


def test_staleness_zero_trains_the_sync_jobs_weights() -> None:
    synced, asynced = make(spec(3)), make(spec(3))
    sync_rewards = [run_epoch(synced, e)["rewards"]["reward_mean"] for e in range(3)]
    async_rewards, stale = run_async(asynced, 3, staleness=0)
    assert stale == [0] * 3
    assert async_rewards == sync_rewards
    assert all_equal(trainer_state(asynced), trainer_state(synced))


def test_reward_rises_with_batches_two_steps_stale() -> None:
    w = make(spec(0))
    rewards, stale = run_async(w, 30, staleness=2)
    assert stale[2:] == [2] * 28  # the sampler ran two steps behind the trainer throughout
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= ASYNC_REWARD_RISE, f"first-5 {first:.3f} -> last-5 {last:.3f}: {rewards}"


def test_a_batch_is_trained_on_once() -> None:
    w = make(spec(1))
    w.sample_batch(0, ctx(0, "sample"))
    w.score_batch(0, ctx(0, "rewards"))
    w.train_batch(0, 0, ctx(0, "train"))
    with pytest.raises(RuntimeError, match="batch 0 is not held scored"):
        w.train_batch(1, 0, ctx(1, "train"))
    w.sample_batch(1, ctx(1, "sample"))
    w.drop_batches()  # a rewind
    with pytest.raises(RuntimeError, match="batch 1 was not sampled"):
        w.score_batch(1, ctx(1, "rewards"))


def test_publishing_and_loading_move_the_weights_bytes() -> None:
    w = make(spec(2))
    expected = sum(p.numel() * p.element_size() for p in w.policy.parameters())
    assert w.publish_weights(1, ctx(0, "train")) == expected
    assert w.load_weights(1, ctx(1, "sample")) == expected


def stale_batch(w: GrpoToyWorkload, lag: int) -> dict[str, float]:
    """Train ``lag`` fresh steps, then batch 0, sampled before them: its stats."""
    w.sample_batch(0, ctx(0, "sample"))
    w.score_batch(0, ctx(0, "rewards"))
    for step in range(lag):
        batch = step + 1
        w.sample_batch(batch, ctx(batch, "sample"))
        w.score_batch(batch, ctx(batch, "rewards"))
        fresh = w.train_batch(step, batch, ctx(step, "train"))
        assert (fresh["policy_lag"], fresh["decoupled"]) == (0.0, 0.0)
        w.publish_weights(step + 1, ctx(step, "train"))
        w.load_weights(step + 1, ctx(batch + 1, "sample"))
    return w.train_batch(lag, 0, ctx(lag, "train"))


def test_a_stale_batch_is_clipped_against_the_trainers_policy() -> None:
    # Plain PPO clips the stale batch's ratio (to the behaviour policy) from its first step on;
    # the decoupled objective starts at ratio 1 and clips only what this call moved.
    plain = stale_batch(make(spec(0, stale_objective="ppo")), lag=2)
    decoupled = stale_batch(make(spec(0)), lag=2)
    assert (plain["policy_lag"], plain["decoupled"]) == (2.0, 0.0)
    assert (decoupled["policy_lag"], decoupled["decoupled"]) == (2.0, 1.0)
    assert decoupled["behaviour_clip_frac"] > 0.2, decoupled
    assert decoupled["clip_frac"] < plain["clip_frac"], (decoupled, plain)
    assert 0.0 < decoupled["behaviour_weight_mean"] <= 2.0  # truncated at the cap


def test_a_checkpoint_load_leaves_the_sampler_on_the_trainers_weights(tmp_path: Path) -> None:
    w = make(spec(1))
    stale_batch(w, lag=1)  # the trainer is a version ahead of the sampler now
    w.save(tmp_path / "ck")
    w.load(tmp_path / "ck")  # a rewind: the sampler gets the trained weights
    w.sample_batch(5, ctx(5, "sample"))
    w.score_batch(5, ctx(5, "rewards"))
    after = w.train_batch(2, 5, ctx(2, "train"))
    assert (after["policy_lag"], after["decoupled"]) == (0.0, 0.0)
