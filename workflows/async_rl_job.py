"""AsyncRLJobWorkflow: one RL job whose sampler and trainer run at the same time.

Two loops in one workflow run (docs/architecture.md, "Asynchronous RL jobs"): the sampler loop
leases the sampler group, samples a batch with the newest published weights, releases, scores
it and hands its id to the trainer; the trainer loop takes the oldest batch handed over, leases
the trainer group, trains one step, publishes the weights every ``sync_every`` steps, releases,
and checkpoints every ``checkpoint_every`` steps. The sampler starts a batch only if no batch
can be trained more than ``max_staleness`` steps after the weights it is sampled with (the
pipeline's rules, ``workflows/async_pipeline.py``, decided by ``protocol/staleness.py``).

The lifecycle, the failure model, the lease ledger and the handlers are every RL job workflow's
(``workflows/job_base.py``): a phase of either loop that fails (a dead process, a lost lease,
the user's code) stops the other loop, hands every lease back and rewinds the job to its last
checkpoint; batches in flight are dropped and counted, never trained twice.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from timeslice.protocol.async_rl_job import (
    ASYNC_DESCRIBE_ACTIVITY,
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    ASYNC_SAMPLE_ACTIVITY,
    ASYNC_SCORE_ACTIVITY,
    ASYNC_TRAIN_ACTIVITY,
    AsyncPhaseInput,
    AsyncPhaseResult,
    AsyncRLJobConfig,
    AsyncRLJobInput,
    AsyncRLJobProgress,
    AsyncRLJobResult,
    AsyncRLJobState,
    QueuedBatch,
    StepRecord,
)
from timeslice.protocol.rl_job import JOB_PROTOCOL_VERSION, LeaseOrder, PrepareResult
from timeslice.workflows.async_pipeline import Pipeline
from timeslice.workflows.job_base import (
    JOB_PROTOCOL_V5,
    PHASES_END_WITH_A_CANCELLED_JOB,
    JobWorkflowBase,
)
from timeslice.workflows.job_failures import PhaseFailed
from timeslice.workflows.pool_job import move_boundary, send_profile_if_due

# The error type a worker answers for an activity it does not have.
_NOT_REGISTERED = "NotFoundError"


@workflow.defn(name=ASYNC_RL_JOB_WORKFLOW_TYPE)
class AsyncRLJobWorkflow(JobWorkflowBase[AsyncRLJobConfig, AsyncRLJobState]):
    """One async RL job: a sampler loop and a trainer loop at once, one rank, two groups."""

    _INPUT = AsyncRLJobInput
    _PROGRESS = AsyncRLJobProgress
    _RESULT = AsyncRLJobResult
    _STATE = AsyncRLJobState
    _UNIT = "step"
    _HOW_TO_START = "`timeslice job start --mode async` or `timeslice.jobs.start_async_rl_job`"
    _DESCRIBE_ACTIVITY = ASYNC_DESCRIBE_ACTIVITY
    # A job process of a release before async jobs has no such activity: that is no process
    # still starting, and waiting would not change it.
    _DESCRIBE_RETRY = RetryPolicy(non_retryable_error_types=[_NOT_REGISTERED])
    _SEARCHED_CHECKPOINTS = False
    _PHASES_END_WITH_THEIR_CALLER = True

    @workflow.init
    def __init__(self, *raw: Any) -> None:
        super().__init__(*raw)
        self._sampler_phase = "starting"
        cfg = self._config
        # The pipeline of this run (never carried: a rewind or the run's end empties it).
        self._pipeline = Pipeline(cfg.max_staleness, cfg.sync_every, cfg.epochs)

    @workflow.run
    async def run(self, *raw: Any) -> AsyncRLJobResult:
        """Run both loops to the job's last step, or until it is stopped.

        Args:
            *raw: The job's input: an ``AsyncRLJobConfig`` (as JSON), or an
                ``AsyncRLJobInput`` after continue-as-new; validated here.

        Returns:
            The job's result, completed or stopped.

        Raises:
            ApplicationError: Non-retryable, as ``RLJobWorkflow.run``'s; ``ProtocolMismatch``
                too for a job process of a release before async jobs.
        """
        result = await self._start()
        assert isinstance(result, AsyncRLJobResult)
        return result

    def _choose_versions(self) -> tuple[int, bool]:
        # Async jobs that began under v4 keep speaking it (their processes answered v4); v5
        # changed nothing of theirs, but a process speaks one version. TimeslicePhase says the
        # trainer loop's state changes (running, prepare, the end), each upserted as it comes.
        return (JOB_PROTOCOL_VERSION if workflow.patched(JOB_PROTOCOL_V5) else 4), False

    def _after_describe(self) -> None:
        self._set_phase("running")

    def _not_served(self, err: ActivityError) -> ApplicationError | None:
        cause = err.cause
        if not (isinstance(cause, ApplicationError) and cause.type == _NOT_REGISTERED):
            return None
        return ApplicationError(
            f"job {self._config.job_id}: its job process serves no async jobs (a Timeslice "
            "release before them): run job workers of the same release as the control "
            "workers (docs/upgrading.md)",
            type="ProtocolMismatch",
            non_retryable=True,
        )

    def _describe_summary(self, rank: int) -> str:
        return f"wait for the job process · {self._config.workload} (async)"

    def _prepared(self, results: list[PrepareResult]) -> None:
        super()._prepared(results)
        self._state.published = self._state.epochs_done  # the checkpoint's weights

    def _rewind(self) -> None:
        self._drop_pipeline()
        super()._rewind()
        self._state.published = self._state.epochs_done
        self._state.rewound()

    async def _checkpoint(self, epochs_done: int, lease: LeaseOrder, **kwargs: Any) -> None:
        await super()._checkpoint(epochs_done, lease, **kwargs)
        self._state.checkpointed()

    def _move_ordered(self) -> None:
        """A move its pool ordered is taken at a checkpoint: both loops stop there (the
        sampler admits no batch past it) and the job moves before it runs on."""
        boundary = move_boundary(self._config, self._state)
        if boundary is not None and boundary < self._pipeline.run_target:
            self._pipeline.run_target = boundary

    # ---------------------------------------------------------------- the two loops

    async def _advance(self) -> None:
        """Run both loops until this run's last step is trained (or a stop, or a failure)."""
        cfg, state = self._config, self._state
        self._pipeline.run_target = min(
            cfg.epochs, state.epochs_done + cfg.continue_as_new_every - self._done_this_run
        )
        self._move_ordered()
        self._pipeline.draining = False
        sampler = asyncio.ensure_future(self._sampler_loop())
        trainer = asyncio.ensure_future(self._trainer_loop())
        loops = [trainer, sampler]
        try:
            await workflow.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the job's run was cancelled
            if workflow.patched(PHASES_END_WITH_A_CANCELLED_JOB):
                # Each loop cancels its phase's activity and waits for its end, so no lease
                # is handed back (by the caller, next) while a phase still runs under it.
                for loop in loops:
                    loop.cancel()
                await workflow.wait(loops)
                for loop in loops:
                    if not loop.cancelled():
                        loop.exception()  # retrieved: the cancel is what ends the job
            raise
        if trainer.done() and trainer.exception() is None:
            if not sampler.done() and state.stop_requested:
                # Stopped: no step will train the batch in hand, so its sampling stops too.
                sampler.cancel()
                await workflow.wait([sampler])
                if not sampler.cancelled():
                    sampler.exception()  # retrieved: the stop is what ended the loop
                self._drop_pipeline()  # a stop: what was handed over and not trained
                return
            await workflow.wait([sampler])  # it stops after the batch in hand (draining)
            if sampler.exception() is None:
                # Empty after the run's last step (the gate admits no batch past it); after a
                # stop, what was handed over and not trained.
                self._drop_pipeline()
                return
        failed = next(t for t in loops if t.done() and t.exception() is not None)
        self._pipeline.draining = True
        for loop in loops:
            if not loop.done():
                loop.cancel()
        # Deterministic, unlike asyncio.wait; the cancelled loop's activity has stopped (its
        # cancellation is waited for) before any lease is handed back.
        await workflow.wait(loops)
        for loop in loops:
            if loop is not failed and not loop.cancelled():
                loop.exception()  # retrieved: the first failure is the one that counts
        raise failed.exception()  # type: ignore[misc]

    async def _sampler_loop(self) -> None:
        cfg, state, pipeline = self._config, self._state, self._pipeline
        while True:
            self._sampler_phase = "waiting (staleness bound)"
            await workflow.wait_condition(lambda: pipeline.draining or pipeline.may_sample(state))
            if pipeline.draining:
                self._sampler_phase = "idle"
                return
            batch, version = pipeline.start_batch(state)
            order = self._new_order(cfg.sampler_group)
            self._sampler_phase = f"batch {batch} · sample"
            (sampled,) = await self._on_all_ranks(
                ASYNC_SAMPLE_ACTIVITY,
                AsyncPhaseInput(
                    phase=self._phase_input(batch, "sample", order, "always"),
                    batch=batch,
                    weights_version=version,
                ),
                AsyncPhaseResult,
                self._budget("sample", order),
                f"batch {batch} · sample · {cfg.sampler_group} · weights v{version}",
            )
            self._check_result(
                pipeline.sampled_problem(sampled, state, batch=batch, asked=version), "sample"
            )
            await self._settle(order, sampled.phase)
            if sampled.load_bytes or sampled.load_s:
                state.loads += 1
                state.load_bytes += sampled.load_bytes
                state.load_s += sampled.load_s
            self._sampler_phase = f"batch {batch} · rewards"
            (scored,) = await self._on_all_ranks(
                ASYNC_SCORE_ACTIVITY,
                AsyncPhaseInput(phase=self._phase_input(batch, "rewards", None), batch=batch),
                AsyncPhaseResult,
                cfg.reward_timeout_s,
                f"batch {batch} · rewards · no GPU",
            )
            self._check_result(pipeline.scored_problem(scored, batch=batch), "rewards")
            pipeline.hand_over(
                QueuedBatch(
                    batch=batch,
                    weights_version=version
                    if sampled.weights_version is None
                    else sampled.weights_version,
                    reward_mean=scored.phase.metrics.get("reward_mean"),
                    sample=sampled.phase,
                    rewards_s=scored.phase.seconds,
                    rewards_metrics=scored.phase.metrics,
                    load_s=sampled.load_s,
                    load_bytes=sampled.load_bytes,
                )
            )

    async def _trainer_loop(self) -> None:
        state, pipeline = self._state, self._pipeline
        try:
            while state.epochs_done < pipeline.run_target and not state.stop_requested:
                self._set_phase("waiting for a batch", search=False)
                await workflow.wait_condition(lambda: bool(pipeline.queue) or state.stop_requested)
                if state.stop_requested:
                    break
                await self._train_one()
        finally:
            pipeline.draining = True

    async def _train_one(self) -> None:
        """Train one step on the oldest batch handed over, publish and checkpoint when due."""
        cfg, state, pipeline = self._config, self._state, self._pipeline
        step = state.epochs_done
        batch, staleness = pipeline.take(state)
        if not 0 <= staleness <= cfg.max_staleness:  # unreachable: the gate, the checks
            pipeline.discard()
            state.stale_dropped += 1
            state.dropped_batches += 1
            workflow.logger.warning(
                "job %s dropped batch %d: staleness %d outside 0..%d",
                cfg.job_id,
                batch.batch,
                staleness,
                cfg.max_staleness,
            )
            return
        done = step + 1
        publish = pipeline.publishes(state)
        checkpoint_due = done % cfg.checkpoint_every == 0 or done == cfg.epochs
        order = self._new_order(cfg.trainer)
        self._set_phase(f"step {step} · train", search=False)
        (trained,) = await self._on_all_ranks(
            ASYNC_TRAIN_ACTIVITY,
            AsyncPhaseInput(
                phase=self._phase_input(
                    step, "train", order, "never" if checkpoint_due else "always"
                ),
                batch=batch.batch,
                publish_version=done if publish else None,
            ),
            AsyncPhaseResult,
            self._budget("train", order),
            f"step {step} · train · batch {batch.batch} (weights v{batch.weights_version}, "
            f"staleness {staleness}) · {cfg.trainer}",
        )
        self._check_result(
            pipeline.trained_problem(
                trained, step=step, batch=batch.batch, publish=done if publish else None
            ),
            "train",
        )
        await self._settle(order, trained.phase)
        pipeline.trained(state, published=publish)
        self._done_this_run += 1
        if publish:
            state.syncs += 1
            state.sync_bytes += trained.sync_bytes
            state.sync_s += trained.sync_s
        state.count_staleness(staleness)
        state.failures = 0
        self._record(step, batch, trained, staleness)
        if checkpoint_due:
            held = self._ledger.checkpoint_lease(order)
            if held is not None:
                await self._checkpoint(done, held)
        await send_profile_if_due(cfg, state, self._backends)
        self._publish_details()

    def _check_result(self, problem: str | None, phase: str) -> None:
        """A result that does not fit what was asked touches nothing: the phase fails (the
        job rewinds, or fails once past max_failures), where using it could have failed the
        workflow's task on every replay (a negative staleness, say)."""
        if problem is not None:
            raise PhaseFailed(
                f"InvalidResult: the job process's {phase} result does not fit what it was "
                f"asked: {problem}; is something that is no job process of this job polling "
                "its task queue?"
            )

    def _record(
        self, step: int, batch: QueuedBatch, trained: AsyncPhaseResult, staleness: int
    ) -> None:
        sample, train = batch.sample, trained.phase
        metrics = {f"sample.{k}": v for k, v in sample.metrics.items()}
        metrics.update({f"rewards.{k}": v for k, v in batch.rewards_metrics.items()})
        metrics.update({f"train.{k}": v for k, v in train.metrics.items()})
        phase_s = {"sample": sample.seconds, "rewards": batch.rewards_s, "train": train.seconds}
        if batch.load_s:
            phase_s["load"] = batch.load_s
        if trained.sync_s:
            phase_s["sync"] = trained.sync_s
        self._state.add_record(
            StepRecord(
                epoch=step,
                reward_mean=batch.reward_mean,
                metrics=metrics,
                wait_s={"sample": sample.waited_s, "train": train.waited_s},
                phase_s=phase_s,
                holds=[sample, train],
                batch=batch.batch,
                weights_version=batch.weights_version,
                staleness=staleness,
                published=trained.published_version is not None,
                sync_bytes=trained.sync_bytes,
            )
        )

    def _drop_pipeline(self) -> None:
        """Batches handed over or in flight (the one in the trainer's hands included) that no
        step will train are dropped, counted."""
        self._state.dropped_batches += self._pipeline.drop()

    # ---------------------------------------------------------------- visibility

    def _sampler_now(self) -> str:
        """The sampler loop's phase; once the job ended, how it ended."""
        ended = self._status in ("stopped", "completed")
        return self._status if ended else self._sampler_phase

    def _progress_now(self) -> dict[str, Any]:
        return {"sampler_phase": self._sampler_now(), "queued": len(self._pipeline.queue)}

    def _details(self) -> list[str]:
        cfg, state = self._config, self._state
        last = state.records[-1].reward_mean if state.records else None
        queued = len(self._pipeline.queue)
        lines = [
            f"**step**: {min(state.epochs_done, cfg.epochs)} / {cfg.epochs} (async, "
            f"max staleness {cfg.max_staleness}, sync every {cfg.sync_every})",
            f"**trainer**: {self._phase} on {cfg.trainer}",
            f"**sampler**: {self._sampler_now()} on {cfg.sampler_group}",
            f"**weights published**: v{state.published} · batches queued: {queued}",
            f"**reward mean**: {'-' if last is None else f'{last:.3f}'}",
            f"**last checkpoint**: {self._checkpoint_label(state.last_checkpoint)}",
        ]
        if state.rewinds or state.dropped_batches:
            lines.append(
                f"**rewinds**: {state.rewinds} ({state.redone_epochs} steps redone, "
                f"{state.dropped_batches} batches dropped)"
            )
        return lines


__all__ = ["AsyncRLJobWorkflow"]
