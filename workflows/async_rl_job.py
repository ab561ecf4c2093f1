"""AsyncRLJobWorkflow: one RL job whose sampler and trainer run at the same time.

Two loops in one workflow run (docs/architecture.md, "Asynchronous RL jobs"): the sampler loop
leases the sampler group, samples a batch with the newest published weights, releases, scores
it and hands its id to the trainer; the trainer loop takes the oldest batch handed over, leases
the trainer group, trains one step, publishes the weights every ``sync_every`` steps, releases,
and checkpoints every ``checkpoint_every`` steps. The sampler starts a batch only if no batch
can be trained more than ``max_staleness`` steps after the weights it is sampled with.

Failure model as for ``RLJobWorkflow``: a phase of either loop that fails (a dead process, a
lost lease, the user's code) stops the other loop, hands every lease back and rewinds the job
to its last checkpoint; batches in flight are dropped and counted, never trained twice.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType
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
    carried_async_input,
)
from timeslice.protocol.group import (
    JOB_KEY,
    PHASE_KEY,
    GrantNotice,
    MalformedMessage,
    QueueTarget,
    SnapshotTarget,
    job_task_queue,
    parse_message,
)
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    PREPARE_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeInput,
    DescribeResult,
    JobQuery,
    JobSignal,
    JobSpecModel,
    LeaseOrder,
    Phase,
    PhaseInput,
    PhaseResult,
    PrepareInput,
    PrepareResult,
    protocol_mismatch,
    rl_job_workflow_id,
)
from timeslice.workflows.group_lease import GroupLeases, end_order
from timeslice.workflows.job_leases import JobLeases

# The sync job's rules for reading activity failures and results, shared so both job kinds end
# (or rewind) on the same failures.
from timeslice.workflows.rl_job import (
    JOB_PROTOCOL_V5,
    _ending_the_job,
    _failure,
    _InvalidResult,
    _validated,
)

_NO_RETRY = RetryPolicy(maximum_attempts=1)
_NO_WAIT_LIMIT_S = 30 * 86_400.0
_DEFAULT_TTL_S = 20.0
_STOP_GRACE = timedelta(seconds=5)
# The error type a worker answers for an activity it does not have.
_NOT_REGISTERED = "NotFoundError"

R = TypeVar("R", bound=BaseModel)


class _LoopFailed(Exception):
    """A phase of either loop failed; the job rewinds to its last checkpoint."""


def _parse_input(raw: tuple[Any, ...]) -> AsyncRLJobInput:
    """The bare config (``temporal`` CLI ``--input``), or config and state (continue-as-new)."""
    first = raw[0] if raw else None
    if isinstance(first, dict) and "config" in first:
        return parse_message(AsyncRLJobInput, raw, ASYNC_RL_JOB_WORKFLOW_TYPE)
    return AsyncRLJobInput(config=parse_message(AsyncRLJobConfig, raw, ASYNC_RL_JOB_WORKFLOW_TYPE))


def _checkpoint_label(ref: CheckpointRef | None) -> str:
    if ref is None:
        return "none"
    return "initial state" if ref.epochs_done == 0 else f"after step {ref.epochs_done - 1}"


@workflow.defn(name=ASYNC_RL_JOB_WORKFLOW_TYPE)
class AsyncRLJobWorkflow:
    @workflow.init
    def __init__(self, *raw: Any) -> None:
        self._input_error: str | None = None
        try:
            inp = _parse_input(raw)
        except MalformedMessage as err:
            self._input_error = str(err)
            inp = AsyncRLJobInput(
                config=AsyncRLJobConfig(
                    job_id="invalid",
                    workload="simulated",
                    sampler_group="invalid",
                    trainer_group="invalid-trainer",
                    epochs=1,
                )
            )
        self._config = inp.config
        self._state = inp.state or AsyncRLJobState()
        self._status = "starting"
        self._phase = "starting"
        self._sampler_phase = "starting"
        self._steps_this_run = 0
        self._backends: dict[str, list[str]] = {"sampler": [], "trainer": []}
        self._leases = GroupLeases(
            self._config.job_id, priority=self._config.priority, ttl_s=self._config.lease_ttl_s
        )
        # The job protocol the run speaks: decided in run, before any other command.
        self._protocol = JOB_PROTOCOL_VERSION
        self._ledger = JobLeases(self._config, protocol=self._protocol)
        # The pipeline of this run (never carried: a rewind or the run's end empties it).
        self._queue: list[QueuedBatch] = []
        self._in_flight = 0  # batches being sampled or scored
        self._training = False  # a batch is in the trainer's hands
        self._draining = False  # the sampler starts no new batch
        self._run_target = 0  # the step this run's loops stop at

    # ---------------------------------------------------------------- main loop

    @workflow.run
    async def run(self, *raw: Any) -> AsyncRLJobResult:
        if self._input_error is not None:
            raise ApplicationError(self._input_error, type="InvalidConfig", non_retryable=True)
        cfg = self._config
        expected_id = rl_job_workflow_id(cfg.job_id)
        if workflow.info().workflow_id != expected_id:
            raise ApplicationError(
                f"an RL job workflow must have the id {expected_id!r} (from job_id "
                f"{cfg.job_id!r}), not {workflow.info().workflow_id!r}; start jobs with "
                "`timeslice job start --mode async` or `timeslice.jobs.start_async_rl_job`",
                type="InvalidConfig",
                non_retryable=True,
            )
        # Async jobs that began under v4 keep speaking it (their processes answered v4); v5
        # changed nothing of theirs, but a process speaks one version.
        self._protocol = JOB_PROTOCOL_VERSION if workflow.patched(JOB_PROTOCOL_V5) else 4
        self._ledger.protocol = self._protocol
        workflow.upsert_search_attributes([JOB_KEY.value_set(cfg.job_id)])
        try:
            return await self._run()
        except asyncio.CancelledError:
            await self._release_all()
            raise

    async def _run(self) -> AsyncRLJobResult:
        cfg, state = self._config, self._state
        state.lease_secret = await self._leases.draw_secret(state.lease_secret)
        if not await self._describe():
            return self._stopped_waiting()
        self._status = "stopping" if state.stop_requested else "running"
        self._set_phase("running")
        while True:
            try:
                if not state.prepared:
                    await self._prepare()
                if state.epochs_done >= cfg.epochs or state.stop_requested:
                    await self._release_all()
                    break
                if self._steps_this_run >= cfg.continue_as_new_every or (
                    workflow.info().is_continue_as_new_suggested()
                ):
                    await self._continue_as_new()
                    continue  # a stop that came while handlers drained ends the job instead
                await self._run_loops()
            except _LoopFailed as failed:
                await self._release_all()
                state.failures += 1
                if state.failures > cfg.max_failures:
                    raise ApplicationError(
                        f"job {cfg.job_id}: step {state.epochs_done} failed {state.failures} "
                        f"times in a row (max_failures={cfg.max_failures}); last failure: "
                        f"{failed}",
                        type="JobFailed",
                        non_retryable=True,
                    ) from None
                workflow.logger.warning(
                    "async job %s failed at step %d (%s); rewinding to the last checkpoint",
                    cfg.job_id,
                    state.epochs_done,
                    failed,
                )
                self._rewind()
                if not await self._describe():
                    return self._stopped_waiting()
        self._drop_pipeline()  # a stop: what was handed over and not trained
        if state.last_checkpoint is None or state.last_checkpoint.epochs_done != state.epochs_done:
            try:
                await self._final_checkpoint()
            except _LoopFailed as failed:
                workflow.logger.warning("final checkpoint failed (%s); ending at the last", failed)
                await self._release_all()
                self._rewind()
        self._status = "stopped" if state.epochs_done < cfg.epochs else "completed"
        self._set_phase(self._status)
        self._sampler_phase = self._status
        return self._result()

    def _stopped_waiting(self) -> AsyncRLJobResult:
        self._status = "stopped"
        self._set_phase("stopped while waiting for job processes")
        return self._result()

    def _result(self) -> AsyncRLJobResult:
        cfg, state = self._config, self._state
        phase_s, wait_s = state.totals()
        return AsyncRLJobResult(
            job_id=cfg.job_id,
            epochs_done=state.epochs_done,
            stopped=state.epochs_done < cfg.epochs,
            last_checkpoint=state.last_checkpoint,
            rewinds=state.rewinds,
            redone_epochs=state.redone_epochs,
            records=state.records,
            rewards=state.rewards,
            rewards_from=state.rewards_from,
            next_batch=state.next_batch,
            dropped_batches=state.dropped_batches,
            stale_dropped=state.stale_dropped,
            staleness_counts=state.staleness_counts,
            max_staleness=cfg.max_staleness,
            syncs=state.syncs,
            sync_bytes=state.sync_bytes,
            sync_s=state.sync_s,
            loads=state.loads,
            load_bytes=state.load_bytes,
            load_s=state.load_s,
            phase_s=phase_s,
            wait_s=wait_s,
        )

    # ---------------------------------------------------------------- the two loops

    async def _run_loops(self) -> None:
        """Run both loops until this run's last step is trained (or a stop, or a failure)."""
        cfg, state = self._config, self._state
        self._run_target = min(
            cfg.epochs, state.epochs_done + cfg.continue_as_new_every - self._steps_this_run
        )
        self._draining = False
        sampler = asyncio.ensure_future(self._sampler_loop())
        trainer = asyncio.ensure_future(self._trainer_loop())
        loops = [trainer, sampler]
        await workflow.wait(loops, return_when=asyncio.FIRST_COMPLETED)
        if trainer.done() and trainer.exception() is None:
            if not sampler.done() and state.stop_requested:
                # Stopped: no step will train the batch in hand, so its sampling stops too.
                sampler.cancel()
                await workflow.wait([sampler])
                if not sampler.cancelled():
                    sampler.exception()  # retrieved: the stop is what ended the loop
                return
            await workflow.wait([sampler])  # it stops after the batch in hand (draining)
            if sampler.exception() is None:
                return
        failed = next(t for t in loops if t.done() and t.exception() is not None)
        self._draining = True
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

    def _may_sample(self) -> bool:
        """A new batch is trained at step ``ahead`` at the latest (batches are trained in the
        order they were handed over) with weights no older than ``published``."""
        state = self._state
        ahead = state.epochs_done + int(self._training) + len(self._queue) + self._in_flight
        return ahead < self._run_target and ahead - state.published <= self._config.max_staleness

    async def _sampler_loop(self) -> None:
        cfg, state = self._config, self._state
        while True:
            self._sampler_phase = "waiting (staleness bound)"
            await workflow.wait_condition(lambda: self._draining or self._may_sample())
            if self._draining:
                self._sampler_phase = "idle"
                return
            batch = state.next_batch
            state.next_batch += 1
            self._in_flight += 1
            version = state.published
            order = self._new_order(cfg.sampler_group)
            self._sampler_phase = f"batch {batch} · sample"
            sampled = await self._execute(
                ASYNC_SAMPLE_ACTIVITY,
                AsyncPhaseInput(
                    phase=self._phase_input(batch, "sample", order, "always"),
                    batch=batch,
                    weights_version=version,
                ),
                AsyncPhaseResult,
                self._budget(cfg.sample_timeout_s, order),
                f"batch {batch} · sample · {cfg.sampler_group} · weights v{version}",
            )
            await self._settle(order, sampled.phase)
            if sampled.load_bytes or sampled.load_s:
                state.loads += 1
                state.load_bytes += sampled.load_bytes
                state.load_s += sampled.load_s
            self._sampler_phase = f"batch {batch} · rewards"
            scored = await self._execute(
                ASYNC_SCORE_ACTIVITY,
                AsyncPhaseInput(phase=self._phase_input(batch, "rewards", None), batch=batch),
                AsyncPhaseResult,
                cfg.reward_timeout_s,
                f"batch {batch} · rewards · no GPU",
            )
            self._in_flight -= 1
            self._queue.append(
                QueuedBatch(
                    batch=batch,
                    weights_version=sampled.weights_version
                    if sampled.weights_version is not None
                    else version,
                    reward_mean=scored.phase.metrics.get("reward_mean"),
                    sample=sampled.phase,
                    rewards_s=scored.phase.seconds,
                    rewards_metrics=scored.phase.metrics,
                    load_s=sampled.load_s,
                    load_bytes=sampled.load_bytes,
                )
            )

    async def _trainer_loop(self) -> None:
        state = self._state
        try:
            while state.epochs_done < self._run_target and not state.stop_requested:
                self._set_phase("waiting for a batch", search=False)
                await workflow.wait_condition(lambda: bool(self._queue) or state.stop_requested)
                if state.stop_requested:
                    break
                await self._train_one(self._queue.pop(0))
        finally:
            self._draining = True

    async def _train_one(self, batch: QueuedBatch) -> None:
        cfg, state = self._config, self._state
        step = state.epochs_done
        staleness = step - batch.weights_version
        if staleness > cfg.max_staleness:  # the admission rule makes this unreachable
            state.stale_dropped += 1
            state.dropped_batches += 1
            workflow.logger.warning(
                "job %s dropped batch %d: staleness %d > %d",
                cfg.job_id,
                batch.batch,
                staleness,
                cfg.max_staleness,
            )
            return
        done = step + 1
        publish = done % cfg.sync_every == 0 and done < cfg.epochs
        checkpoint_due = done % cfg.checkpoint_every == 0 or done == cfg.epochs
        self._training = True
        order = self._new_order(cfg.trainer)
        self._set_phase(f"step {step} · train", search=False)
        trained = await self._execute(
            ASYNC_TRAIN_ACTIVITY,
            AsyncPhaseInput(
                phase=self._phase_input(
                    step, "train", order, "never" if checkpoint_due else "always"
                ),
                batch=batch.batch,
                publish_version=done if publish else None,
            ),
            AsyncPhaseResult,
            self._budget(cfg.train_timeout_s, order),
            f"step {step} · train · batch {batch.batch} (weights v{batch.weights_version}, "
            f"staleness {staleness}) · {cfg.trainer}",
        )
        await self._settle(order, trained.phase)
        state.epochs_done = done
        self._steps_this_run += 1
        self._training = False
        if publish:
            state.published = done
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
        self._publish_details()

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
        self._state.dropped_batches += len(self._queue) + self._in_flight + int(self._training)
        self._queue.clear()
        self._in_flight = 0
        self._training = False

    # ---------------------------------------------------------------- phases

    def _phase_input(
        self, epoch: int, phase: Phase, order: LeaseOrder | None, release: str = "never"
    ) -> PhaseInput:
        cfg = self._config
        timeout = {
            "sample": cfg.sample_timeout_s,
            "rewards": cfg.reward_timeout_s,
            "train": cfg.train_timeout_s,
        }[phase]
        ttl = (order.ttl_s if order else None) or _DEFAULT_TTL_S
        return PhaseInput(
            job_id=cfg.job_id,
            epoch=epoch,
            phase=phase,
            lease=order,
            timeout_s=timeout,
            release=release,  # type: ignore[arg-type]
            group_backends=self._backends_for(order.group_id) if order else [],
            lease_check_s=max(0.5, min(5.0, ttl / 4)),
        )

    def _budget(self, timeout_s: float, order: LeaseOrder | None) -> float:
        """A phase that takes its own lease waits for it inside its activity."""
        waits = order is not None and order.token is None
        return timeout_s + ((self._config.acquire_timeout_s or _NO_WAIT_LIMIT_S) if waits else 0)

    async def _execute(
        self, activity: str, arg: Any, result_type: type[R], timeout_s: float, summary: str
    ) -> R:
        """Run ``activity`` on the job's process; a failure fails the loop (a rewind), or the
        job for failures a rewind cannot cure. Leases this workflow holds (preparing, a final
        checkpoint) are watched: the work is stopped once one is lost."""
        cfg = self._config
        work = asyncio.ensure_future(
            workflow.execute_activity(
                activity,
                arg,
                task_queue=job_task_queue(cfg.job_id, 0),
                start_to_close_timeout=timedelta(seconds=timeout_s),
                schedule_to_start_timeout=timedelta(seconds=cfg.heartbeat_timeout_s),
                heartbeat_timeout=timedelta(seconds=cfg.heartbeat_timeout_s),
                retry_policy=_NO_RETRY,
                # A cancelled phase's work must have stopped before the lease moves on.
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary=summary,
            )
        )
        held = list(self._ledger.held.values())
        try:
            if held:
                watch = asyncio.ensure_future(
                    workflow.wait_condition(lambda: self._leases.any_lost(held) is not None)
                )
                try:
                    await workflow.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
                if not work.done():
                    lost = self._leases.any_lost(held)
                    work.cancel()
                    await workflow.wait([work])
                    if not work.cancelled():
                        work.exception()
                    raise _LoopFailed(f"{lost}; the job's work under it was stopped")
            raw = await work
        except asyncio.CancelledError:
            work.cancel()
            await workflow.wait([work])
            raise
        except ActivityError as err:
            ending = _ending_the_job(err, cfg.job_id)
            if ending is not None:
                raise ending from None
            raise _LoopFailed(_failure(err)) from None
        try:
            return _validated(result_type, raw, activity)
        except _InvalidResult as err:
            raise _LoopFailed(f"InvalidResult: {err}") from None

    # ---------------------------------------------------------------- leases

    def _backends_for(self, group_id: str) -> list[str]:
        cfg = self._config
        names: list[str] = []
        if group_id == cfg.sampler_group:
            names += self._backends["sampler"]
        if group_id == cfg.trainer:
            names += [n for n in self._backends["trainer"] if n not in names]
        return names

    def _bytes_on(self, group_id: str) -> int | None:
        sizes = self._state.backend_bytes
        names = self._backends_for(group_id)
        if not sizes:
            return self._state.state_bytes
        if any(sizes.get(name) is None for name in names):
            return None
        return sum(sizes[name] or 0 for name in names)

    def _snapshot_target(self, group_id: str) -> SnapshotTarget | None:
        names = self._backends_for(group_id)
        if not names:
            return None
        return SnapshotTarget(
            queues=[QueueTarget(task_queue=job_task_queue(self._config.job_id, 0), backends=names)]
        )

    def _new_order(self, group_id: str) -> LeaseOrder:
        request_id = f"{self._config.job_id}:{workflow.uuid4()}"
        return self._ledger.new_order(
            group_id,
            request_id=request_id,
            key=self._leases.new_key(request_id),
            state_bytes=self._bytes_on(group_id),
        )

    async def _acquire(self, group_id: str, purpose: str) -> GrantNotice:
        """A lease this workflow holds itself (preparing, a final checkpoint)."""
        self._set_phase(f"waiting for {group_id} ({purpose})", search=False)
        self._ledger.asking(group_id, workflow.now())
        try:
            lease = await self._leases.acquire(
                group_id,
                self._config.acquire_timeout_s,
                snapshot=self._snapshot_target(group_id),
                state_bytes=self._bytes_on(group_id),
                restores_itself=True,
            )
        except ApplicationError as err:
            raise ApplicationError(
                f"job {self._config.job_id}: {err.message}", type=err.type, non_retryable=True
            ) from None
        self._ledger.hold(lease, key=self._leases.key_of(lease), now=workflow.now())
        return lease

    async def _release(self, lease: GrantNotice) -> None:
        if lease.group_id in self._ledger.held:
            await self._leases.release(lease)
            self._ledger.released(lease.group_id)

    async def _end_order(self, order: LeaseOrder) -> None:
        """End a lease the process took (or asked for) when the process cannot."""
        await end_order(order)
        self._ledger.ended(order)

    async def _release_all(self) -> None:
        everything = self._ledger.hand_back()
        for order in everything.orders:
            await self._end_order(order)
        for lease in everything.leases:
            await self._release(lease)

    async def _settle(self, order: LeaseOrder, result: PhaseResult) -> None:
        after = self._ledger.after_phase(order, result)
        if after.release is not None:
            await self._release(after.release)
        elif after.end is not None:
            await self._end_order(after.end)

    # ---------------------------------------------------------------- preparing and rewinding

    async def _describe(self) -> bool:
        """Wait for the job's process and check it runs this job's workload in async mode;
        False if the job was stopped before it answered."""
        cfg = self._config
        self._set_phase("waiting for job processes", search=False)
        describing = asyncio.ensure_future(
            workflow.execute_activity(
                ASYNC_DESCRIBE_ACTIVITY,
                DescribeInput(
                    job_id=cfg.job_id,
                    options=cfg.workload_options,
                    chain_id=workflow.info().first_execution_run_id,
                    protocol=self._protocol,
                ),
                task_queue=job_task_queue(cfg.job_id, 0),
                schedule_to_close_timeout=timedelta(seconds=cfg.process_wait_s),
                start_to_close_timeout=timedelta(seconds=30),
                # A job process of a release before async jobs has no such activity: that is
                # no process still starting, and waiting would not change it.
                retry_policy=RetryPolicy(non_retryable_error_types=[_NOT_REGISTERED]),
                summary=f"wait for the job process · {cfg.workload} (async)",
            )
        )
        stopped = asyncio.ensure_future(self._stopped_without_processes())
        await workflow.wait([describing, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not describing.done():
            describing.cancel()
            await workflow.wait([describing])
            if not describing.cancelled():
                describing.exception()
            return False
        stopped.cancel()
        try:
            raw = await describing
        except ActivityError as err:
            ending = _ending_the_job(err, cfg.job_id)
            if ending is not None:
                raise ending from None
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == _NOT_REGISTERED:
                raise ApplicationError(
                    f"job {cfg.job_id}: its job process serves no async jobs (a Timeslice "
                    "release before them): run job workers of the same release as the control "
                    "workers (docs/upgrading.md)",
                    type="ProtocolMismatch",
                    non_retryable=True,
                ) from None
            raise
        try:
            found = _validated(DescribeResult, raw, "the job process")
        except _InvalidResult as err:
            raise ApplicationError(
                f"job {cfg.job_id}: {err}", type="InvalidResult", non_retryable=True
            ) from None
        mismatch = protocol_mismatch(self._protocol, found.protocol)
        if mismatch is not None:
            raise ApplicationError(
                f"job {cfg.job_id}: {mismatch}", type="ProtocolMismatch", non_retryable=True
            )
        if found.workload != cfg.workload:
            raise ApplicationError(
                f"the job process of {cfg.job_id} runs workload {found.workload!r}, but the "
                f"job's config asks for {cfg.workload!r}; start `timeslice job worker` with "
                "the same --workload",
                type="InvalidConfig",
                non_retryable=True,
            )
        self._backends = {"sampler": found.sampler_backends, "trainer": found.trainer_backends}
        return True

    async def _stopped_without_processes(self) -> None:
        await workflow.wait_condition(lambda: self._state.stop_requested)
        await workflow.sleep(_STOP_GRACE)

    async def _prepare(self) -> None:
        """Build (or rebuild) the process's state from the last checkpoint, holding both groups."""
        cfg, state = self._config, self._state
        checkpoint = state.last_checkpoint
        spec = JobSpecModel(
            job_id=cfg.job_id,
            workload=cfg.workload,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            group_size=cfg.group_size,
            options=cfg.workload_options,
        )
        homes = {name: cfg.sampler_group for name in self._backends["sampler"]}
        homes.update({name: cfg.trainer for name in self._backends["trainer"]})
        try:
            for group in cfg.groups():
                await self._acquire(group, "prepare")
            self._set_phase("prepare")
            result = await self._execute(
                PREPARE_ACTIVITY,
                PrepareInput(
                    spec=spec,
                    checkpoint=checkpoint,
                    homes=homes,
                    lease_keys=self._ledger.held_keys(),
                    leases=self._ledger.held_orders(),
                ),
                PrepareResult,
                cfg.train_timeout_s,
                f"prepare · from {_checkpoint_label(checkpoint)}",
            )
            state.state_bytes = result.state_bytes
            state.backend_bytes = dict(result.backend_bytes)
            state.epochs_done = result.epochs_done
            state.published = result.epochs_done
            if checkpoint is None:  # a rewind needs somewhere to go back to, even step 0
                held = self._ledger.held_order(cfg.trainer)
                assert held is not None
                await self._checkpoint(state.epochs_done, held)
        finally:
            await self._release_all()
        state.prepared = True

    def _rewind(self) -> None:
        state = self._state
        self._drop_pipeline()
        back_to = state.last_checkpoint.epochs_done if state.last_checkpoint else 0
        state.redone_epochs += state.drop_records_from(back_to)
        state.rewinds += 1
        state.epochs_done = state.published = back_to
        state.prepared = False

    async def _checkpoint(self, steps_done: int, lease: LeaseOrder) -> None:
        """Save under ``lease`` (the trainer's state lives there); a lease the process holds is
        released by the process once the checkpoint is written."""
        release = lease.held_by == "process"
        self._set_phase("checkpoint", search=False)
        ref = await self._execute(
            CHECKPOINT_ACTIVITY,
            CheckpointInput(
                job_id=self._config.job_id,
                epochs_done=steps_done,
                backends=self._backends_for(lease.group_id),
                lease=lease,
                release=release,
            ),
            CheckpointRef,
            self._config.checkpoint_timeout_s,
            f"checkpoint · {_checkpoint_label(CheckpointRef(epochs_done=steps_done, path=''))} "
            f"· {lease.group_id}",
        )
        if release:
            self._ledger.checkpointed(lease)
        self._state.last_checkpoint = ref

    async def _final_checkpoint(self) -> None:
        """Stopped between steps: save what was trained since the last checkpoint."""
        cfg = self._config
        lease = await self._acquire(cfg.trainer, "checkpoint")
        try:
            held = self._ledger.held_order(cfg.trainer)
            assert held is not None
            await self._checkpoint(self._state.epochs_done, held)
        finally:
            await self._release(lease)

    async def _continue_as_new(self) -> None:
        await self._release_all()
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._state.stop_requested:
            return
        self._state.runs += 1
        carried, size, shed = carried_async_input(self._config, self._state)
        if shed:
            workflow.logger.warning(
                "job %s shed %d of its oldest records and rewards so that its continue-as-new "
                "input fits (%d bytes now)",
                self._config.job_id,
                shed,
                size,
            )
        workflow.continue_as_new(carried)

    # ---------------------------------------------------------------- visibility

    def _set_phase(self, phase: str, *, search: bool = True) -> None:
        self._phase = phase
        if search:
            workflow.upsert_search_attributes([PHASE_KEY.value_set(phase)])
        self._publish_details()

    def _publish_details(self) -> None:
        cfg, state = self._config, self._state
        last = state.records[-1].reward_mean if state.records else None
        lines = [
            f"**step**: {min(state.epochs_done, cfg.epochs)} / {cfg.epochs} (async, "
            f"max staleness {cfg.max_staleness}, sync every {cfg.sync_every})",
            f"**trainer**: {self._phase} on {cfg.trainer}",
            f"**sampler**: {self._sampler_phase} on {cfg.sampler_group}",
            f"**weights published**: v{state.published} · batches queued: {len(self._queue)}",
            f"**reward mean**: {'-' if last is None else f'{last:.3f}'}",
            f"**last checkpoint**: {_checkpoint_label(state.last_checkpoint)}",
        ]
        if state.rewinds or state.dropped_batches:
            lines.append(
                f"**rewinds**: {state.rewinds} ({state.redone_epochs} steps redone, "
                f"{state.dropped_batches} batches dropped)"
            )
        workflow.set_current_details("\n\n".join(lines))

    @workflow.query(name=JobQuery.PROGRESS)
    def progress(self) -> AsyncRLJobProgress:
        cfg, state = self._config, self._state
        rewards = list(state.rewards)
        return AsyncRLJobProgress(
            job_id=cfg.job_id,
            status=self._status,  # type: ignore[arg-type]
            epoch=state.epochs_done,
            epochs=cfg.epochs,
            phase=self._phase,
            sampler_phase=self._sampler_phase,
            reward_mean=rewards[-1] if rewards else None,
            rewards=rewards,
            rewards_from=state.rewards_from,
            published=state.published,
            queued=len(self._queue),
            next_batch=state.next_batch,
            dropped_batches=state.dropped_batches,
            stale_dropped=state.stale_dropped,
            staleness_counts=list(state.staleness_counts),
            rewinds=state.rewinds,
            last_checkpoint=state.last_checkpoint,
            forged_notices=self._leases.forged_notices,
        )

    @workflow.signal(name=JobSignal.STOP)
    def stop(self, *_ignored: Any) -> None:
        """Finish the step in hand, checkpoint, and complete (any argument is ignored)."""
        self._state.stop_requested = True
        if self._status == "running":
            self._status = "stopping"


__all__ = ["AsyncRLJobWorkflow"]
