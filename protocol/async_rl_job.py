"""Messages of the asynchronous RL job (``AsyncRLJobWorkflow``, docs/architecture.md).

An async job's sampler and trainer run at once on two groups; the sampler's weights are at most
``max_staleness`` versions behind the trainer's. Its config, state and records extend the sync
job's (``timeslice.protocol.rl_job``): one "epoch" is one training step on one batch, as in a
sync job. Everything here crosses Temporal; this module imports nothing with I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from timeslice.protocol.group import CARRIED_STATE_BUDGET_BYTES, _Model, encoded_size
from timeslice.protocol.rl_job import (
    CheckpointRef,
    EpochRecord,
    PhaseInput,
    PhaseResult,
    RLJobConfig,
    RLJobState,
)

ASYNC_RL_JOB_WORKFLOW_TYPE = "AsyncRLJobWorkflow"

# Served by the job process (`timeslice job worker`) beside the sync job's activities; an async
# job also uses the sync job's prepare and save_checkpoint activities.
ASYNC_DESCRIBE_ACTIVITY = "timeslice.job.async_describe"
ASYNC_SAMPLE_ACTIVITY = "timeslice.job.async_sample"
ASYNC_SCORE_ACTIVITY = "timeslice.job.async_score"
ASYNC_TRAIN_ACTIVITY = "timeslice.job.async_train"

# The queue of handed-over batches is at most max_staleness long (docs/architecture.md), and it
# travels in the continue-as-new input.
MAX_STALENESS = 256


class AsyncRLJobConfig(RLJobConfig):
    """An asynchronous RL job: an ``RLJobConfig`` (``epochs`` counts training steps, one batch
    each) whose sampler and trainer run at once, on two groups.

    Attributes:
        mode: ``"async"`` (what tells ``timeslice job start`` and ``parse_any_job_config`` to
            start an ``AsyncRLJobWorkflow``).
        max_staleness: The most weights versions (training steps) a batch's sampler may lag the
            trainer that trains on it (0 to 256); the sampler waits rather than exceed it.
        sync_every: Publish the trainer's weights to the sampler every this many steps (1 to
            ``max_staleness + 1``: rarer syncs would leave the sampler waiting for good).
    """

    mode: Literal["async"] = "async"
    max_staleness: int = Field(1, ge=0, le=MAX_STALENESS)
    sync_every: int = Field(1, ge=1, le=MAX_STALENESS + 1)

    @model_validator(mode="after")
    def _async_rules(self) -> AsyncRLJobConfig:
        if self.trainer_group is None or self.trainer_group == self.sampler_group:
            raise ValueError(
                "an async job's sampler and trainer run at once, so they need two groups: give "
                "a trainer_group other than the sampler_group (or run the job in sync mode)"
            )
        if self.ranks != 1:
            raise ValueError(f"async jobs run one rank (ranks=1), not {self.ranks}")
        if self.sync_every > self.max_staleness + 1:
            raise ValueError(
                f"sync_every={self.sync_every} with max_staleness={self.max_staleness}: the "
                f"sampler would wait for weights that come only every {self.sync_every} steps; "
                f"use sync_every <= max_staleness + 1 ({self.max_staleness + 1})"
            )
        return self


class QueuedBatch(_Model):
    """A batch sampled and scored, handed over to the trainer (its data stay in the process).
    Queued batches never cross continue-as-new: the sampler admits none past the run's last
    step, so the trainer has trained them all when the run ends."""

    batch: int = Field(ge=0)
    weights_version: int = Field(ge=0, description="the weights it was sampled with")
    reward_mean: float | None = None
    sample: PhaseResult
    rewards_s: float = 0.0
    rewards_metrics: dict[str, float] = Field(default_factory=dict)
    load_s: float = 0.0
    load_bytes: int = 0


class StepRecord(EpochRecord):
    """One training step (``epoch`` is the step): the batch it trained on and its staleness."""

    batch: int = Field(ge=0)
    weights_version: int = Field(ge=0, description="the weights the batch was sampled with")
    staleness: int = Field(ge=0, description="the step minus weights_version")
    published: bool = Field(False, description="the step published its weights to the sampler")
    sync_bytes: int = 0


class AsyncRLJobState(RLJobState):
    """What an async job must not lose, carried across continue-as-new: the sync job's state
    (its records are ``StepRecord``s) and the pipeline's counters."""

    records: list[StepRecord] = Field(default_factory=list)  # type: ignore[assignment]
    next_batch: int = Field(0, description="the next batch id: each id is drawn once, ever")
    published: int = Field(0, description="the newest weights version published to the sampler")
    dropped_batches: int = Field(
        0, description="batches sampled (or being sampled) that no step will train: a rewind"
    )
    stale_dropped: int = Field(0, description="batches dropped as staler than max_staleness")
    staleness_counts: list[int] = Field(
        default_factory=list,
        max_length=MAX_STALENESS + 1,
        description="steps trained at each staleness (index = staleness)",
    )
    syncs: int = Field(0, description="weight publications: trainer -> host, trainer lease")
    sync_bytes: int = 0
    sync_s: float = 0.0
    loads: int = Field(0, description="weight loads: host -> sampler, sampler lease")
    load_bytes: int = 0
    load_s: float = 0.0

    def count_staleness(self, staleness: int) -> None:
        while len(self.staleness_counts) <= staleness:
            self.staleness_counts.append(0)
        self.staleness_counts[staleness] += 1


class AsyncRLJobInput(_Model):
    config: AsyncRLJobConfig
    state: AsyncRLJobState | None = None


def carried_async_input(
    config: AsyncRLJobConfig, state: AsyncRLJobState
) -> tuple[dict[str, Any], int, int]:
    """The next run's input as JSON, its encoded size, and how many records and rewards were
    shed (oldest first) to bring it within CARRIED_STATE_BUDGET_BYTES (as
    ``carried_rl_job_input`` does for sync jobs)."""
    state.bound()
    shed = 0
    while True:
        carried = AsyncRLJobInput(config=config, state=state).model_dump(mode="json")
        size = encoded_size(carried)
        if size <= CARRIED_STATE_BUDGET_BYTES or not (state.records or state.rewards):
            break
        if state.records:
            state._fold_oldest()
        else:
            drop = max(1, len(state.rewards) // 4)
            del state.rewards[:drop]
            state.rewards_from += drop
        shed += 1
    if shed:
        state.shed_records += shed
        carried = AsyncRLJobInput(config=config, state=state).model_dump(mode="json")
        size = encoded_size(carried)
    return carried, size, shed


class AsyncPhaseInput(_Model):
    """An async phase's activity input: the sync phase's (``phase.epoch`` is the batch id for
    sampling and scoring, the step for training) and the pipeline's part."""

    phase: PhaseInput
    batch: int = Field(ge=0)
    weights_version: int = Field(
        0, ge=0, description="sample: the newest weights version the workflow knows published"
    )
    publish_version: int | None = Field(
        None, ge=1, description="train: publish the weights as this version after the step"
    )


class AsyncPhaseResult(_Model):
    phase: PhaseResult
    batch: int
    weights_version: int | None = Field(
        None, description="sample: the weights the batch was sampled with"
    )
    load_s: float = Field(0.0, description="sample: loading newer weights into the sampler")
    load_bytes: int = 0
    published_version: int | None = None
    sync_s: float = Field(0.0, description="train: publishing the weights to host memory")
    sync_bytes: int = 0


class AsyncRLJobProgress(_Model):
    job_id: str
    mode: Literal["async"] = "async"
    status: Literal["starting", "running", "stopping", "completed", "stopped", "failed"]
    epoch: int = Field(description="training steps done")
    epochs: int
    phase: str = Field(description="the trainer loop's phase")
    sampler_phase: str
    reward_mean: float | None
    rewards: list[float | None]
    rewards_from: int = 0
    published: int
    queued: int
    next_batch: int
    dropped_batches: int
    stale_dropped: int
    staleness_counts: list[int]
    rewinds: int
    last_checkpoint: CheckpointRef | None
    forged_notices: int = 0


class AsyncRLJobResult(_Model):
    job_id: str
    mode: Literal["async"] = "async"
    epochs_done: int = Field(description="training steps done")
    stopped: bool
    last_checkpoint: CheckpointRef | None
    rewinds: int
    redone_epochs: int
    records: list[StepRecord] = Field(description="the most recent steps' records")
    rewards: list[float | None] = Field(default_factory=list, description="per step")
    rewards_from: int = 0
    next_batch: int
    dropped_batches: int
    stale_dropped: int
    staleness_counts: list[int]
    max_staleness: int
    syncs: int
    sync_bytes: int
    sync_s: float
    loads: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    phase_s: dict[str, float] = Field(default_factory=dict)
    wait_s: dict[str, float] = Field(default_factory=dict)
