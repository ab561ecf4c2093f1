"""grpo-toy's async mode on real torch, driven in-process: stale batches, and staleness 0.

The job's schedule (tests/test_async_jobs.py runs it through real processes) is played here by
hand: batch ``b`` is sampled once the trainer has published ``max(0, b - K)`` steps, so every
batch from the K-th on is trained K steps after the weights that sampled it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from timeslice.workloads.base import PhaseContext  # noqa: E402
from timeslice.workloads.grpo_toy import GrpoToyWorkload  # noqa: E402

from tests.test_grpo_toy import all_equal, make, run_epoch, spec, trainer_state  # noqa: E402

#: Seed 0 measures +0.086 (0.108 -> 0.194) over 30 steps with every batch two steps stale (the
#: sync job: +0.33 .. +0.48 for seeds 0-3, tests/test_grpo_toy.py): stale batches' ratios clip
#: more, and it learns more slowly, but it learns. The run is deterministic (seeded).
ASYNC_REWARD_RISE = 0.05


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
