"""The async job's activities: a job process's sampler and trainer, running at the same time.

``AsyncJobRuntime`` is the job runtime (activities/job_runtime.py) with the async phases beside
the sync ones: it describes, prepares and checkpoints as for a sync job, and runs each async
phase through the same lease, fence and supervision path (``JobRuntime._phase``), so a phase's
lease is taken, checked, renewed and released exactly as a sync phase's. Sampler and trainer
phases run concurrently (two activities, two threads); they use different states (the sampler
group's, the trainer group's), so neither waits for the other.

The process keeps what the workflow cannot see: the batches (sampled, scored) by id, the weights
version published to host memory and the one its sampler runs. Each phase checks that the
process is where the workflow believes it is, and answers ``JobStateLost`` when it is not (the
process restarted, or a phase failed midway): the workflow then rewinds to its last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.activities.job_runtime import JobRuntime, refusal
from timeslice.protocol.async_rl_job import (
    ASYNC_DESCRIBE_ACTIVITY,
    ASYNC_SAMPLE_ACTIVITY,
    ASYNC_SCORE_ACTIVITY,
    ASYNC_TRAIN_ACTIVITY,
    AsyncPhaseInput,
    AsyncPhaseResult,
)
from timeslice.protocol.rl_job import (
    PREPARE_ACTIVITY,
    STATE_LOST,
    DescribeInput,
    DescribeResult,
    PrepareInput,
    PrepareResult,
)
from timeslice.workloads.base import AsyncWorkload, PhaseContext

BatchStage = Literal["sampled", "scored"]


def _state_lost(message: str) -> ApplicationError:
    return ApplicationError(message, type=STATE_LOST, non_retryable=True)


class AsyncJobRuntime(JobRuntime):
    """One rank of one job, sync or async: the sync job's activities and the async ones."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._batches: dict[int, BatchStage] = {}
        # The newest weights version in host memory, and the one the sampler runs (None: no
        # state, or a sampling failed while loading).
        self._published: int | None = None
        self._sampler_version: int | None = None

    def activities(self) -> list[Callable[..., Any]]:
        """The sync job's activities and the async phases, for the job worker to register."""
        async_phases = [self.async_describe, self.async_sample, self.async_score, self.async_train]
        return super().activities() + async_phases

    def _async_workload(self) -> AsyncWorkload:
        workload = self.workload
        if not isinstance(workload, AsyncWorkload):
            raise refusal(
                f"workload {self.workload_ref!r} has no async mode (it is not a "
                "timeslice.workloads.AsyncWorkload); run the job in sync mode",
                "InvalidConfig",
            )
        return workload

    # ---------------------------------------------------------------- activities

    @activity.defn(name=ASYNC_DESCRIBE_ACTIVITY)
    async def async_describe(self, inp: DescribeInput) -> DescribeResult:
        """``describe`` for an async job: refused (``InvalidConfig``) by a sync-only workload."""
        self._check_job(inp.job_id)
        self._async_workload()
        self._next_phase = {}  # each loop asks ahead for its own next step
        return await self.describe(inp)

    @activity.defn(name=PREPARE_ACTIVITY)
    async def prepare(self, inp: PrepareInput) -> PrepareResult:
        """The sync job's ``prepare``, and for an async job a reset of its pipeline too: a
        (re)preparation loads the checkpoint, which leaves the sampler with the trainer's
        weights and no batch."""
        prepared = await super().prepare(inp)
        if isinstance(self.workload, AsyncWorkload):
            self.workload.drop_batches()
        self._batches.clear()
        self._published = self._sampler_version = prepared.epochs_done
        return prepared

    @activity.defn(name=ASYNC_SAMPLE_ACTIVITY)
    async def async_sample(self, inp: AsyncPhaseInput) -> AsyncPhaseResult:
        """Sample batch ``inp.batch`` under the sampler lease, loading newer published weights
        first; ``JobStateLost`` if the process cannot have the weights asked for."""
        workload = self._async_workload()
        loaded: dict[str, float] = {}

        def check() -> None:
            if self._spec is None or self._published is None:
                raise _state_lost(
                    f"job {self.job_id}: batch {inp.batch} needs the job's state, but "
                    f"{self._where()}"
                )
            if inp.weights_version > self._published:
                raise _state_lost(
                    f"job {self.job_id}: batch {inp.batch} needs weights version "
                    f"{inp.weights_version}, but this process published {self._published}"
                )

        def sample(batch: int, ctx: PhaseContext) -> dict[str, float]:
            # The newest weights published (never older than those the workflow asked for).
            version = self._published
            assert version is not None
            if version != self._sampler_version:
                self._sampler_version = None  # until the load is complete
                started = time.monotonic()
                loaded["bytes"] = workload.load_weights(version, ctx)
                loaded["seconds"] = time.monotonic() - started
                self._sampler_version = version
            loaded["version"] = version
            return workload.sample_batch(batch, ctx)

        try:
            result = await self._phase(inp.phase, check, sample)
        except BaseException:
            if "version" not in loaded:
                self._sampler_version = None
            raise
        self._batches[inp.batch] = "sampled"
        return AsyncPhaseResult(
            phase=result,
            batch=inp.batch,
            weights_version=int(loaded["version"]),
            load_s=loaded.get("seconds", 0.0),
            load_bytes=int(loaded.get("bytes", 0)),
        )

    @activity.defn(name=ASYNC_SCORE_ACTIVITY)
    async def async_score(self, inp: AsyncPhaseInput) -> AsyncPhaseResult:
        """Score a sampled batch (no lease); ``JobStateLost`` if it is not held sampled here."""
        workload = self._async_workload()

        def check() -> None:
            if self._spec is None or self._batches.get(inp.batch) != "sampled":
                raise _state_lost(
                    f"job {self.job_id}: batch {inp.batch} is not held sampled here "
                    f"({self._where()})"
                )

        result = await self._phase(inp.phase, check, workload.score_batch)
        self._batches[inp.batch] = "scored"
        return AsyncPhaseResult(phase=result, batch=inp.batch)

    @activity.defn(name=ASYNC_TRAIN_ACTIVITY)
    async def async_train(self, inp: AsyncPhaseInput) -> AsyncPhaseResult:
        """Train one step on a scored batch under the trainer lease (at most once per batch),
        then publish the weights if asked; ``JobStateLost`` if the process is elsewhere."""
        workload = self._async_workload()
        step = inp.phase.epoch
        synced: dict[str, float] = {}

        def check() -> None:
            self._expect(step)
            if self._batches.get(inp.batch) != "scored":
                raise _state_lost(
                    f"job {self.job_id}: step {step} trains on batch {inp.batch}, which this "
                    "process does not hold scored (never sampled here, or trained already)"
                )

        def train(step: int, ctx: PhaseContext) -> dict[str, float]:
            # Taken before the step: a batch is trained on at most once, even by a step that
            # fails midway (the rewind drops it).
            del self._batches[inp.batch]
            metrics = workload.train_batch(step, inp.batch, ctx)
            if inp.publish_version is not None:
                started = time.monotonic()
                synced["bytes"] = workload.publish_weights(inp.publish_version, ctx)
                synced["seconds"] = time.monotonic() - started
                self._published = inp.publish_version
            return metrics

        result = await self._phase(inp.phase, check, train)
        self._epochs_done = step + 1
        return AsyncPhaseResult(
            phase=result,
            batch=inp.batch,
            published_version=inp.publish_version,
            sync_s=synced.get("seconds", 0.0),
            sync_bytes=int(synced.get("bytes", 0)),
        )
