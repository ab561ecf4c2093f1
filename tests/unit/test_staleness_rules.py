"""An async job's staleness rules live once (``timeslice.protocol.staleness``), and the two that
use them agree: the workflow's pipeline (``workflows/async_pipeline.py``, what
``AsyncRLJobWorkflow``'s loops call) and the planner's simulator (``plan/simulator.py``'s
``_Gate``, what its async jobs' actors call).

Hypothesis drives both with the same random sequences of the loops' moves — the sampler asks to
start a batch, hands a batch over; the trainer asks for a batch, ends its step — over random
``max_staleness``, ``sync_every`` and lengths, and checks after every move that they decide the
same (may the sampler start? may the trainer?) and stand at the same place (steps trained,
weights published, batches queued), and that no batch is trained staler than the bound.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pydantic import ValidationError
from timeslice.plan.simulator import Placement, _Gate, _Job, rl_profile, simulate
from timeslice.protocol import staleness
from timeslice.protocol.async_rl_job import AsyncRLJobConfig, AsyncRLJobState, QueuedBatch
from timeslice.protocol.rl_job import PhaseResult
from timeslice.workflows.async_pipeline import Pipeline

from tests.unit.test_async_job_state import GOOD

SAMPLED = PhaseResult(epoch=0, phase="sample", metrics={}, seconds=1.0, mono_start=0, mono_end=1)


class BothPipelines(RuleBasedStateMachine):
    """The workflow's pipeline and the simulator's gate, moved in step."""

    @initialize(steps=st.integers(1, 12), max_staleness=st.integers(0, 4), data=st.data())
    def start(self, steps: int, max_staleness: int, data: st.DataObject) -> None:
        sync_every = data.draw(st.integers(1, max_staleness + 1), label="sync_every")
        self.max_staleness = max_staleness
        # The workflow's side: its state, and its pipeline for a run that ends with the job.
        self.state = AsyncRLJobState()
        self.pipeline = Pipeline(max_staleness, sync_every, steps, run_target=steps)
        # The simulator's side: the gate its two actors share, and the actors themselves.
        self.gate = _Gate(steps, max_staleness, sync_every)
        placement = Placement(
            rl_profile("j", sample_s=1.0, rewards_s=1.0, train_s=1.0, epochs=steps),
            "s",
            "t",
            max_staleness=max_staleness,
            sync_every=sync_every,
        )
        self.sampler = _Job(placement, 1.0, role="sampler", gate=self.gate)
        self.trainer = _Job(placement, 1.0, role="trainer", gate=self.gate)
        self.sampling: tuple[int, int] | None = None  # the sampler's batch and its weights
        self.publishing: bool | None = None  # the trainer's step in hand: does it publish?
        self.trained_staleness: list[int] = []

    @precondition(lambda self: self.sampling is None)
    @rule()
    def sampler_asks(self) -> None:
        may = self.pipeline.may_sample(self.state)
        assert may == self.gate.may_start(self.sampler), "the two gates disagree"
        if may:
            self.sampling = self.pipeline.start_batch(self.state)
            self.gate.start(self.sampler)

    @precondition(lambda self: self.sampling is not None)
    @rule()
    def sampler_hands_over(self) -> None:
        assert self.sampling is not None
        batch, version = self.sampling
        self.pipeline.hand_over(QueuedBatch(batch=batch, weights_version=version, sample=SAMPLED))
        self.gate.end(self.sampler)
        self.sampling = None

    @precondition(lambda self: self.publishing is None)
    @rule()
    def trainer_asks(self) -> None:
        may = bool(self.pipeline.queue)
        assert may == self.gate.may_start(self.trainer)
        if may:
            _, stale = self.pipeline.take(self.state)
            self.trained_staleness.append(stale)
            self.publishing = self.pipeline.publishes(self.state)
            self.gate.start(self.trainer)

    @precondition(lambda self: self.publishing is not None)
    @rule()
    def trainer_ends_its_step(self) -> None:
        assert self.publishing is not None
        self.pipeline.trained(self.state, published=self.publishing)
        self.gate.end(self.trainer)
        self.publishing = None

    @invariant()
    def they_stand_at_the_same_place(self) -> None:
        gate, state, pipeline = self.gate, self.state, self.pipeline
        assert (state.epochs_done, state.published) == (gate.trained, gate.published)
        assert (len(pipeline.queue), pipeline.training) == (gate.queued, gate.training)
        assert (pipeline.in_flight == 1) == gate.sampling
        assert all(s <= self.max_staleness for s in self.trained_staleness)

    @invariant()
    def the_job_never_waits_for_good(self) -> None:
        """Some move is always possible until the last step is trained (sync_every within
        max_staleness + 1 is what the config requires)."""
        stuck = (
            self.sampling is None
            and self.publishing is None
            and not self.pipeline.queue
            and not self.pipeline.may_sample(self.state)
        )
        assert not stuck or self.state.epochs_done == self.pipeline.steps


BothPipelines.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_the_workflow_and_the_simulator_decide_alike = BothPipelines.TestCase


def test_config_profile_and_simulator_refuse_a_rare_sync_in_one_sentence() -> None:
    """Weights published less often than every max_staleness + 1 steps leave the sampler
    waiting for good: the job's config, the planner's profile and its simulator say so alike."""
    assert staleness.sync_every_problem(2, 3) is None
    sentence = staleness.sync_every_problem(2, 4)
    assert sentence is not None and "use sync_every <= max_staleness + 1 (3)" in sentence
    said = re.escape(sentence)
    with pytest.raises(ValidationError, match=said):
        AsyncRLJobConfig.model_validate(GOOD | {"max_staleness": 2, "sync_every": 4})
    times = {"sample_s": 1.0, "rewards_s": 0.0, "train_s": 1.0, "epochs": 4}
    with pytest.raises(ValidationError, match=said):
        rl_profile("j", **times, max_staleness=2, sync_every=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=said):
        simulate([Placement(rl_profile("j", **times), "s", "t", max_staleness=2, sync_every=4)])  # type: ignore[arg-type]


def test_the_gate_counts_the_batch_in_training_and_those_in_flight() -> None:
    """A batch started now is trained after the one in training, those queued and those in
    flight: with max_staleness 1 and nothing published, one batch ahead is the most."""
    assert staleness.trained_by(0, training=True, queued=0, in_flight=0) == 1
    assert staleness.trained_by(3, training=False, queued=2, in_flight=1) == 6
    assert staleness.may_sample(1, published=0, max_staleness=1, limit=10)
    assert not staleness.may_sample(2, published=0, max_staleness=1, limit=10)
    assert not staleness.may_sample(10, published=10, max_staleness=1, limit=10)
    # Every sync_every steps, never after the last.
    assert [staleness.publishes_after(d, sync_every=2, steps=6) for d in range(1, 7)] == [
        False,
        True,
        False,
        True,
        False,
        False,
    ]
