"""Messages of the asynchronous RL job (``AsyncRLJobWorkflow``, docs/architecture.md).

An async job's sampler and trainer run at once on two groups; the sampler's weights are at most
``max_staleness`` versions behind the trainer's. Its config, state and records extend the sync
job's (``timeslice.protocol.rl_job``): one "epoch" is one training step on one batch, as in a
sync job. Everything here crosses Temporal; this module imports nothing with I/O.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator
from timeslice.protocol.group import _Model
from timeslice.protocol.rl_job import (
    EpochRecord,
    PhaseInput,
    PhaseResult,
    RLJobConfig,
    RLJobInput,
    RLJobProgress,
    RLJobResult,
    RLJobState,
)
from timeslice.protocol.staleness import sync_every_problem

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
        if self.sampler_group is None:
            pass  # its pool places it on two groups (workflows/pool_job.py)
        elif self.trainer_group is None or self.trainer_group == self.sampler_group:
            raise ValueError(
                "an async job's sampler and trainer run at once, so they need two groups: give "
                "a trainer_group other than the sampler_group (or run the job in sync mode)"
            )
        if self.ranks != 1:
            raise ValueError(f"async jobs run one rank (ranks=1), not {self.ranks}")
        problem = sync_every_problem(self.max_staleness, self.sync_every)
        if problem is not None:
            raise ValueError(problem)
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
    staleness_at_checkpoint: list[int] | None = Field(
        None,
        max_length=MAX_STALENESS + 1,
        description="staleness_counts as the last checkpoint left them: what a rewind to it "
        "goes back to (None: a checkpoint taken before this was kept)",
    )
    syncs: int = Field(0, description="weight publications: trainer -> host, trainer lease")
    sync_bytes: int = 0
    sync_s: float = 0.0
    loads: int = Field(0, description="weight loads: host -> sampler, sampler lease")
    load_bytes: int = 0
    load_s: float = 0.0

    def count_staleness(self, staleness: int) -> None:
        """Count one step trained at ``staleness``."""
        while len(self.staleness_counts) <= staleness:
            self.staleness_counts.append(0)
        self.staleness_counts[staleness] += 1

    def checkpointed(self) -> None:
        """A checkpoint holds every step counted so far: a rewind comes back to these counts."""
        self.staleness_at_checkpoint = list(self.staleness_counts)

    def rewound(self) -> None:
        """A rewind to the last checkpoint: the steps trained since no longer count (they
        are trained again)."""
        if self.staleness_at_checkpoint is not None:
            self.staleness_counts = list(self.staleness_at_checkpoint)


class AsyncRLJobInput(RLJobInput):
    """An async job workflow's input: its config, and what it carries across continue-as-new."""

    config: AsyncRLJobConfig
    state: AsyncRLJobState | None = None


def carried_async_input(
    config: AsyncRLJobConfig, state: AsyncRLJobState
) -> tuple[dict[str, Any], int, int]:
    """``AsyncRLJobInput.carried``: an async job's next input, its size, and what was shed."""
    return AsyncRLJobInput.carried(config, state)


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
    """An async phase's result: the sync phase's and the pipeline's part (weights moved)."""

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


# The pipeline's counters an async job's state carries and its result reports, as they are.
PIPELINE_COUNTERS = frozenset(
    {
        "next_batch",
        "dropped_batches",
        "stale_dropped",
        "staleness_counts",
        "syncs",
        "sync_bytes",
        "sync_s",
        "loads",
        "load_bytes",
        "load_s",
    }
)


# What an async job's progress shows of its carried state, as it is.
_PROGRESS_FROM_STATE = frozenset(
    {"published", "next_batch", "dropped_batches", "stale_dropped", "staleness_counts"}
)


class AsyncRLJobProgress(RLJobProgress):
    """An async job's ``progress``: the sync job's (``epoch`` counts training steps, ``phase``
    is the trainer loop's; ``phase_s``, ``wait_s`` and ``shed_records`` as a sync job's) and
    the pipeline's: the sampler loop's phase, the weights published, the batches queued."""

    mode: Literal["async"] = "async"
    sampler_phase: str
    published: int
    queued: int
    next_batch: int
    dropped_batches: int
    stale_dropped: int
    staleness_counts: list[int]

    @classmethod
    def of(cls, config: RLJobConfig, state: RLJobState, **now: Any) -> Self:
        """``RLJobProgress.of`` with the pipeline's carried counters from ``state`` (an
        ``AsyncRLJobState``); ``now`` adds ``sampler_phase`` and ``queued``, which only the
        running workflow knows."""
        assert isinstance(state, AsyncRLJobState)
        return super().of(config, state, **state.model_dump(include=_PROGRESS_FROM_STATE), **now)


class AsyncRLJobResult(RLJobResult):
    """What an async job workflow returns: the sync job's result (``epochs_done`` counts
    training steps, its records are ``StepRecord``s) and the pipeline's counters."""

    mode: Literal["async"] = "async"
    records: list[StepRecord] = Field(description="the most recent steps' records")  # type: ignore[assignment]
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

    @classmethod
    def of(cls, config: RLJobConfig, state: RLJobState, **extra: Any) -> Self:
        """``RLJobResult.of`` with the pipeline's counters from ``state`` (an
        ``AsyncRLJobState``) and ``config``'s ``max_staleness``."""
        assert isinstance(config, AsyncRLJobConfig) and isinstance(state, AsyncRLJobState)
        counters = state.model_dump(include=set(PIPELINE_COUNTERS))
        return super().of(config, state, max_staleness=config.max_staleness, **counters, **extra)


def started_config(raw: Any, *, async_job: bool | None = None) -> RLJobConfig:
    """An RL job's config from its workflow's start input, read as the workflow reads it: the
    bare config, or ``{config, state}`` after continue-as-new.

    Args:
        raw: The decoded input.
        async_job: Whether the workflow is an ``AsyncRLJobWorkflow``; None: the config's
            ``mode`` says.

    Returns:
        The config (an ``AsyncRLJobConfig`` for an async job).

    Raises:
        ValueError: The input is no such config (pydantic's ``ValidationError``).
    """
    carried = isinstance(raw, dict) and "config" in raw
    if async_job is None:
        body = raw["config"] if carried else raw
        async_job = isinstance(body, dict) and body.get("mode") == "async"
    if async_job:
        return (
            AsyncRLJobInput.model_validate(raw).config
            if carried
            else AsyncRLJobConfig.model_validate(raw)
        )
    return RLJobInput.model_validate(raw).config if carried else RLJobConfig.model_validate(raw)
