"""RLJobWorkflow: one RL job whose GPU phases take turns on shared GPU groups.

Each epoch: lease the sampler group → ``sample`` → release; ``compute_rewards`` with no lease;
lease the trainer group → ``train`` (→ ``save_checkpoint`` every N epochs) → release. The phases
run as activities in the job's own processes (task queue ``timeslice-job-<job>-<rank>``), which
keep the model and trajectories; only metrics cross Temporal.

Failure model: a phase that fails for any reason — its process died (heartbeat or pick-up
time-out), the process restarted and lost its in-memory state, the lease was revoked, the user's
code raised — releases the lease and *rewinds* the job to its last checkpoint: the job waits for
its processes, re-prepares them from the checkpoint while holding all its groups, and re-runs the
epochs since. Epochs are therefore applied to the model exactly once, and nothing is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError
from temporalio.workflow import ActivityCancellationType
from timeslice.protocol.group import (
    JOB_KEY,
    PHASE_KEY,
    GrantNotice,
    MalformedMessage,
    NextPhase,
    QueueTarget,
    SnapshotReport,
    SnapshotTarget,
    explain_validation_error,
    job_task_queue,
    parse_message,
)
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    PREPARE_ACTIVITY,
    REWARDS_ACTIVITY,
    RL_JOB_WORKFLOW_TYPE,
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeInput,
    DescribeResult,
    EpochRecord,
    JobQuery,
    JobSignal,
    JobSpecModel,
    LeaseOrder,
    Phase,
    PhaseInput,
    PhaseResult,
    PrepareInput,
    PrepareResult,
    RLJobConfig,
    RLJobInput,
    RLJobProgress,
    RLJobResult,
    RLJobState,
    carried_rl_job_input,
    protocol_mismatch,
    rl_job_workflow_id,
)
from timeslice.workflows.group_lease import GroupLeases, end_order
from timeslice.workflows.job_leases import JobLeases, Release

# workflow.patched ids of job protocols v3 and v4 (see JOB_PROTOCOL_VERSION).
JOB_PROTOCOL_V3 = "job-protocol-v3"
# v4: a train followed by the next epoch's sample on the same group asks the group to carry
# its lease into that sample (PhaseInput.carry_into), with the sample's expected length.
JOB_PROTOCOL_V4 = "job-protocol-v4"
# v5: a phase's result says whether the process sent the acquire of the order it was told to ask
# ahead (PhaseResult.asked_ahead). A train whose lease the group carries into the next sample
# does not send it, and the workflow forgets that order instead of signalling the group a cancel
# for a request it never had (two events and a workflow task of the job an epoch, and the
# group's signal and task).
JOB_PROTOCOL_V5 = "job-protocol-v5"
# workflow.patched id: TimeslicePhase is upserted when the job's state changes, not at every
# phase, and TimesliceJob only when the start did not set it (jobs that began before upsert as
# they did). A filter reads the state; the phase of the moment is the progress query's.
SEARCHED_STATES_ONLY = "searched-states-only"
# What TimeslicePhase says while a job runs its epochs: one value for all their phases (an
# upsert per phase was 3-4 history events per epoch, read by no filter).
_RUNNING = "running"
_SEARCHED_AS_RUNNING = frozenset({"sample", "rewards", "train", "checkpoint"})
_PHASE_ACTIVITIES: dict[str, str] = {
    "sample": SAMPLE_ACTIVITY,
    "rewards": REWARDS_ACTIVITY,
    "train": TRAIN_ACTIVITY,
}
_NO_RETRY = RetryPolicy(maximum_attempts=1)
# A phase that waits for its lease without a limit still needs an activity time-out; its
# heartbeat, not this, is what notices a dead process.
_NO_WAIT_LIMIT_S = 30 * 86_400.0
_DEFAULT_TTL_S = 20.0
# How long a job stopped while waiting for its processes still waits for them.
_STOP_GRACE = timedelta(seconds=5)
# Failures that waiting or rewinding would not change (a phase's own acquire timing out, a
# faulted job, a bad config, a job process of another release): the job fails at once, with
# the workflow-side error type each activity-side type becomes.
_ENDS_THE_JOB = {
    "AcquireTimeoutError": "AcquireTimeout",
    "JobFaultedError": "JobFaulted",
    "InvalidConfig": "InvalidConfig",
    "WrongJob": "InvalidConfig",
    "ProcessTaken": "ProcessTaken",
    "ProtocolMismatch": "ProtocolMismatch",
}


def _ending_the_job(err: ActivityError, job_id: str) -> ApplicationError | None:
    """The job's own non-retryable failure for an activity failure in ``_ENDS_THE_JOB``, or
    None if a rewind may still cure it."""
    cause = err.cause
    if not (isinstance(cause, ApplicationError) and cause.type in _ENDS_THE_JOB):
        return None
    return ApplicationError(
        f"job {job_id}: {cause.message}", type=_ENDS_THE_JOB[cause.type], non_retryable=True
    )


class _EpochFailed(Exception):
    """A phase failed; the job rewinds to its last checkpoint."""


R = TypeVar("R", bound=BaseModel)


def _validated(model: type[R], raw: Any, what: str) -> R:
    """An activity's result as ``model``, or ``_InvalidResult`` saying what was wrong.

    Results are taken raw and validated here rather than by the data converter: a result that
    does not parse (a rogue poller on the job's queue, a job process of a release whose models
    differ) would otherwise fail the workflow *task* on every replay, and the job would hang."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise _InvalidResult(
            f"{what} returned an invalid {model.__name__} ({explain_validation_error(err)}); "
            "is a process of another Timeslice release, or something that is no job process, "
            "polling the job's task queue?"
        ) from None


class _InvalidResult(Exception):
    """An activity's result did not parse."""


def _parse_input(raw: tuple[Any, ...]) -> RLJobInput:
    """The job's input: users start jobs with the bare config (temporal CLI --input), and
    continue-as-new carries state too (an RLJobInput)."""
    first = raw[0] if raw else None
    if isinstance(first, dict) and "config" in first:
        return parse_message(RLJobInput, raw, "RLJobWorkflow")
    return RLJobInput(config=parse_message(RLJobConfig, raw, "RLJobWorkflow"))


def _searched(key: SearchAttributeKey[str]) -> str | None:
    """The workflow's value of a keyword search attribute (as started, continued or upserted)."""
    return workflow.info().typed_search_attributes.get(key)


def _failure(err: ActivityError) -> str:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type or 'error'}: {cause.message}"
    if isinstance(cause, TimeoutError):
        return f"{cause.type.name.lower() if cause.type else 'timed out'}: {cause.message}"
    return str(cause or err)


@workflow.defn(name=RL_JOB_WORKFLOW_TYPE)
class RLJobWorkflow:
    @workflow.init
    def __init__(self, *raw: Any) -> None:
        # Taken raw and validated here rather than by the data converter, so bad input (or no
        # argument, or several) fails the workflow once, with a message, instead of failing its
        # task forever.
        self._input_error: str | None = None
        try:
            inp = _parse_input(raw)
        except MalformedMessage as err:
            self._input_error = str(err)
            inp = RLJobInput(
                config=RLJobConfig(
                    job_id="invalid", workload="simulated", sampler_group="invalid", epochs=1
                )
            )
        self._config = inp.config
        self._state = inp.state or RLJobState()
        self._status = "starting"
        self._phase = "starting"
        self._epochs_this_run = 0
        self._backends: dict[str, list[str]] = {"sampler": [], "trainer": []}
        self._protocol = JOB_PROTOCOL_VERSION
        self._searched_states_only = True  # decided in run, before any upsert
        self._leases = GroupLeases(
            self._config.job_id, priority=self._config.priority, ttl_s=self._config.lease_ttl_s
        )
        # Which leases the job holds, keeps, carries or has asked for, and what each phase
        # does with its lease (the protocol is set in run, before any lease is taken).
        self._ledger = JobLeases(self._config, protocol=self._protocol)

    # ---------------------------------------------------------------- main loop

    @workflow.run
    async def run(self, *raw: Any) -> RLJobResult:
        if self._input_error is not None:
            raise ApplicationError(self._input_error, type="InvalidConfig", non_retryable=True)
        cfg = self._config
        expected_id = rl_job_workflow_id(cfg.job_id)
        if workflow.info().workflow_id != expected_id:
            # Temporal keeps one open run per workflow id: that is what stops two workflows
            # from driving one job's processes at once.
            raise ApplicationError(
                f"an RL job workflow must have the id {expected_id!r} (from job_id "
                f"{cfg.job_id!r}), not {workflow.info().workflow_id!r}; start jobs with "
                "`timeslice job start` or `timeslice.jobs.start_rl_job`",
                type="InvalidConfig",
                non_retryable=True,
            )
        # Runs that began before v3 (leases fenced by the process itself) keep their processes'
        # protocol, so their histories replay. Decided first thing, before any other command:
        # asked later (after the lease secret's local activity) a query's replay was once seen
        # to miss the marker.
        if workflow.patched(JOB_PROTOCOL_V5):
            self._protocol = JOB_PROTOCOL_VERSION
        elif workflow.patched(JOB_PROTOCOL_V4):
            self._protocol = 4
        else:
            self._protocol = 3 if workflow.patched(JOB_PROTOCOL_V3) else 2
        self._ledger.protocol = self._protocol
        self._searched_states_only = workflow.patched(SEARCHED_STATES_ONLY)
        if not self._searched_states_only or _searched(JOB_KEY) != cfg.job_id:
            workflow.upsert_search_attributes([JOB_KEY.value_set(cfg.job_id)])
        try:
            return await self._run()
        except asyncio.CancelledError:
            await self._release_all()
            raise

    async def _run(self) -> RLJobResult:
        cfg, state = self._config, self._state
        state.lease_secret = await self._leases.draw_secret(state.lease_secret)
        if not await self._describe():
            return self._stopped_waiting()
        self._status = "stopping" if state.stop_requested else "running"
        while True:
            try:
                if not state.prepared:
                    await self._prepare()
                if state.epochs_done >= cfg.epochs or state.stop_requested:
                    await self._release_all()
                    break
                if self._epochs_this_run >= cfg.continue_as_new_every or (
                    workflow.info().is_continue_as_new_suggested()
                ):
                    await self._continue_as_new()
                    continue  # a stop that came while handlers drained ends the job instead
                await self._run_epoch(state.epochs_done)
                state.failures = 0
            except _EpochFailed as failed:
                await self._release_all()
                state.failures += 1
                if state.failures > cfg.max_failures:
                    raise ApplicationError(
                        f"job {cfg.job_id}: epoch {state.epochs_done} failed {state.failures} "
                        f"times in a row (max_failures={cfg.max_failures}); last failure: "
                        f"{failed}",
                        type="JobFailed",
                        non_retryable=True,
                    ) from None
                workflow.logger.warning(
                    "job %s epoch %d failed (%s); rewinding to the last checkpoint",
                    cfg.job_id,
                    state.epochs_done,
                    failed,
                )
                self._rewind()
                if not await self._describe():
                    return self._stopped_waiting()
        if state.last_checkpoint is None or state.last_checkpoint.epochs_done != state.epochs_done:
            try:
                await self._final_checkpoint()
            except _EpochFailed as failed:
                # The process lost what it trained since the last checkpoint: the job ends
                # there, stopped, rather than failing.
                workflow.logger.warning("final checkpoint failed (%s); ending at the last", failed)
                await self._release_all()
                self._rewind()
        self._status = "stopped" if state.epochs_done < cfg.epochs else "completed"
        self._set_phase(self._status)
        return self._result()

    def _stopped_waiting(self) -> RLJobResult:
        """The job was stopped while no process served it: it ends where it stands, with
        nothing to checkpoint (its last checkpoint, if any, is what it keeps)."""
        self._status = "stopped"
        self._set_phase("stopped while waiting for job processes")
        return self._result()

    def _result(self) -> RLJobResult:
        cfg, state = self._config, self._state
        phase_s, wait_s = state.totals()
        return RLJobResult(
            job_id=cfg.job_id,
            epochs_done=state.epochs_done,
            stopped=state.epochs_done < cfg.epochs,
            last_checkpoint=state.last_checkpoint,
            rewinds=state.rewinds,
            redone_epochs=state.redone_epochs,
            records=state.records,
            rewards=state.rewards,
            rewards_from=state.rewards_from,
            phase_s=phase_s,
            wait_s=wait_s,
        )

    async def _run_epoch(self, epoch: int) -> None:
        """Sample (on the lease carried from the last epoch, asked for ahead, or asked now);
        compute the rewards while the trainer lease is asked for; train, and checkpoint when
        one is due; the next epoch's sample is asked for as the epoch's last step ends."""
        record = EpochRecord(epoch=epoch, reward_mean=None)
        await self._sample(epoch, record)
        # One rank: the trainer lease is asked for as soon as the rewards are computed.
        train_order = self._new_order(self._config.trainer) if self._ledger.solo else None
        rewarded = await self._run_phase(epoch, "rewards", None, prefetch=train_order)
        self._note(record, rewarded, "rewards", False)
        record.reward_mean = rewarded.metrics.get("reward_mean")
        asked_ahead = await self._train(epoch, record, train_order)
        self._end_epoch(record, asked_ahead)

    async def _sample(self, epoch: int, record: EpochRecord) -> None:
        lease = self._ledger.sample_lease()
        if lease.needless is not None:
            await self._end_order(lease.needless)  # the lease was kept: not needed
        order = lease.order or await self._order(self._config.sampler_group, "sample", record)
        sampled: PhaseResult | None = None
        try:
            sampled = await self._run_phase(
                epoch, "sample", order, release=self._ledger.sample_release()
            )
        finally:
            await self._settle(order, sampled)
        self._note(record, sampled, "sample", lease.carried)

    async def _train(
        self, epoch: int, record: EpochRecord, order: LeaseOrder | None
    ) -> LeaseOrder | None:
        """Train under ``order`` (None: asked for now), then checkpoint if one is due (or the
        job stops with the lease still held). Returns the next sample's order, asked ahead."""
        cfg, state = self._config, self._state
        done = epoch + 1
        plan = self._ledger.plan_train(
            done,
            stop_requested=state.stop_requested,
            epochs_this_run=self._epochs_this_run,
            records=state.records,
            current=record,
        )
        ahead = self._new_order(cfg.sampler_group) if plan.asks_ahead else None
        if order is None:
            order = await self._order(cfg.trainer, "train", record)
        trained: PhaseResult | None = None
        train_asks = None if plan.checkpoint_due else ahead
        try:
            trained = await self._run_phase(
                epoch,
                "train",
                order,
                release=plan.release,
                prefetch=train_asks,
                carry_into=plan.carry_into,
            )
            self._ledger.asked_ahead(train_asks, trained.asked_ahead)
            self._note(record, trained, "train", False)
            if order.held_by == "process":
                await self._settle(order, trained, keep=plan.release == "if_contended")
            if plan.checkpoint_due or (state.stop_requested and not trained.released):
                held = self._ledger.checkpoint_lease(order)
                if held is not None:
                    await self._checkpoint(done, held, prefetch=ahead)
        finally:
            if order.held_by == "workflow" or trained is None:
                await self._settle(order, trained)
        return ahead

    def _end_epoch(self, record: EpochRecord, asked_ahead: LeaseOrder | None) -> None:
        state = self._state
        self._ledger.epoch_ended(asked_ahead)
        state.epochs_done = record.epoch + 1
        self._epochs_this_run += 1
        state.add_record(record)
        self._publish_details()

    async def _settle(
        self, order: LeaseOrder, result: PhaseResult | None, *, keep: bool = False
    ) -> None:
        """After a GPU phase: end what the ledger says the process did not (a failed phase's
        lease, a workflow-held lease)."""
        after = self._ledger.after_phase(order, result, keep=keep)
        if after.release is not None:
            await self._release(
                after.release,
                restored=result.restored if result else None,
                evicted=result.evicted if result else None,
            )
        elif after.end is not None:
            await self._end_order(after.end)

    # ---------------------------------------------------------------- preparing and rewinding

    async def _describe(self) -> bool:
        """Wait for every rank's process and check it runs this job's workload; False if the
        job was stopped before every process answered (a job whose process never comes must
        still end on `job stop`)."""
        cfg = self._config
        self._set_phase("waiting for job processes", search=False)
        protocol = self._protocol
        describing = asyncio.gather(
            *(
                workflow.execute_activity(
                    DESCRIBE_ACTIVITY,
                    DescribeInput(
                        job_id=cfg.job_id,
                        options=cfg.workload_options,
                        chain_id=workflow.info().first_execution_run_id,
                        protocol=protocol,
                    ),
                    task_queue=job_task_queue(cfg.job_id, rank),
                    schedule_to_close_timeout=timedelta(seconds=cfg.process_wait_s),
                    start_to_close_timeout=timedelta(seconds=30),
                    summary=f"wait for rank {rank} · {cfg.workload}",
                )
                for rank in range(cfg.ranks)
            )
        )
        stopped = asyncio.ensure_future(self._stopped_without_processes())
        await workflow.wait([describing, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not describing.done():
            describing.cancel()
            with contextlib.suppress(asyncio.CancelledError, ActivityError):
                await describing
            return False
        stopped.cancel()
        try:
            raws: list[Any] = await describing
        except ActivityError as err:
            ending = _ending_the_job(err, cfg.job_id)
            if ending is not None:
                raise ending from None
            raise
        try:
            results = [
                _validated(DescribeResult, raw, f"the job process of rank {rank}")
                for rank, raw in enumerate(raws)
            ]
        except _InvalidResult as err:
            raise ApplicationError(
                f"job {cfg.job_id}: {err}", type="InvalidResult", non_retryable=True
            ) from None
        for rank, found in enumerate(results):
            mismatch = protocol_mismatch(protocol, found.protocol)
            if mismatch is not None:
                raise ApplicationError(
                    f"job {cfg.job_id} rank {rank}: {mismatch}",
                    type="ProtocolMismatch",
                    non_retryable=True,
                )
            if found.workload != cfg.workload:
                raise ApplicationError(
                    f"the job process of {cfg.job_id} rank {rank} runs workload "
                    f"{found.workload!r}, but the job's config asks for {cfg.workload!r}; "
                    "start `timeslice job worker` with the same --workload",
                    type="InvalidConfig",
                    non_retryable=True,
                )
        self._backends = {
            "sampler": results[0].sampler_backends,
            "trainer": results[0].trainer_backends,
        }
        return True

    async def _stopped_without_processes(self) -> None:
        """Returns once a stop has been asked for and the processes still have not answered
        for a while: live ones answer at once, and get to checkpoint what they trained."""
        await workflow.wait_condition(lambda: self._state.stop_requested)
        await workflow.sleep(_STOP_GRACE)

    async def _prepare(self) -> None:
        """Build (or rebuild) the processes' state from the last checkpoint, holding all groups."""
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
        try:
            for group in cfg.groups():
                await self._acquire(group, "prepare", None)
            self._set_phase("prepare")
            results = await self._on_all_ranks(
                PREPARE_ACTIVITY,
                PrepareInput(
                    spec=spec,
                    checkpoint=checkpoint,
                    homes=self._homes(),
                    lease_keys=self._ledger.held_keys(),
                    leases=self._ledger.held_orders(),
                ),
                PrepareResult,
                cfg.train_timeout_s,
                f"prepare · from {_checkpoint_label(checkpoint)}",
            )
            sizes = [r.state_bytes for r in results]
            state.state_bytes = None if None in sizes else sum(s or 0 for s in sizes)
            state.backend_bytes = {
                name: None
                if any(r.backend_bytes.get(name) is None for r in results)
                else sum(r.backend_bytes[name] or 0 for r in results)
                for name in results[0].backend_bytes
            }
            state.epochs_done = results[0].epochs_done
            if checkpoint is None:  # a rewind needs somewhere to go back to, even epoch 0
                held = self._ledger.held_order(cfg.trainer)
                assert held is not None
                await self._checkpoint(state.epochs_done, held)
        finally:
            await self._release_all()
        state.prepared = True

    def _rewind(self) -> None:
        state = self._state
        back_to = state.last_checkpoint.epochs_done if state.last_checkpoint else 0
        lost = state.drop_records_from(back_to)
        state.redone_epochs += lost + 1  # + the epoch that failed midway
        state.rewinds += 1
        state.epochs_done = back_to
        state.prepared = False

    def _homes(self) -> dict[str, str]:
        """Where each state lives once prepared: the trainer's on the trainer group, the rest
        on the sampler group."""
        cfg = self._config
        homes = {name: cfg.sampler_group for name in self._backends["sampler"]}
        homes.update({name: cfg.trainer for name in self._backends["trainer"]})
        return homes

    async def _checkpoint(
        self, epochs_done: int, lease: LeaseOrder, *, prefetch: LeaseOrder | None = None
    ) -> None:
        """Save under ``lease`` (its state lives there); a lease the process holds is released
        by the process once the checkpoint is written."""
        group_id = lease.group_id
        self._set_phase("checkpoint")
        release = lease.held_by == "process"
        if prefetch is not None:
            self._ledger.asked_ahead(prefetch, None)  # asked once the checkpoint released
        refs = await self._on_all_ranks(
            CHECKPOINT_ACTIVITY,
            CheckpointInput(
                job_id=self._config.job_id,
                epochs_done=epochs_done,
                backends=self._backends_for(group_id),
                lease=lease,
                release=release,
                prefetch=prefetch,
                prefetch_backends=self._backends_for(prefetch.group_id) if prefetch else [],
            ),
            CheckpointRef,
            self._config.checkpoint_timeout_s,
            f"checkpoint · {_checkpoint_label(CheckpointRef(epochs_done=epochs_done, path=''))} "
            f"· {group_id}",
        )
        if release:
            self._ledger.checkpointed(lease)
        self._state.last_checkpoint = refs[0]

    async def _final_checkpoint(self) -> None:
        """Stopped between epochs: save what was trained since the last checkpoint."""
        cfg = self._config
        lease = await self._acquire(cfg.trainer, "checkpoint", None)
        try:
            held = self._ledger.held_order(cfg.trainer)
            assert held is not None
            await self._checkpoint(self._state.epochs_done, held)
        finally:
            await self._release(lease)

    async def _continue_as_new(self) -> None:
        await self._release_all()  # a lease's renewal does not survive the run
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._state.stop_requested:
            return
        self._state.runs += 1
        carried, size, shed = carried_rl_job_input(self._config, self._state)
        if shed:
            workflow.logger.warning(
                "job %s shed %d of its oldest records and rewards so that its continue-as-new "
                "input fits (%d bytes now)",
                self._config.job_id,
                shed,
                size,
            )
        workflow.continue_as_new(carried)

    # ---------------------------------------------------------------- leases and phases

    def _backends_for(self, group_id: str) -> list[str]:
        """The job's state that lives on ``group_id``: the sampler's, the trainer's, or both."""
        cfg = self._config
        names: list[str] = []
        if group_id == cfg.sampler_group:
            names += self._backends["sampler"]
        if group_id == cfg.trainer:
            names += [n for n in self._backends["trainer"] if n not in names]
        return names

    def _bytes_on(self, group_id: str) -> int | None:
        """What the job's states on ``group_id`` occupy on its device (None: unknown)."""
        sizes = self._state.backend_bytes
        names = self._backends_for(group_id)
        if not sizes:  # not prepared yet (or prepared by an older worker): the whole state
            return self._state.state_bytes
        if any(sizes.get(name) is None for name in names):
            return None
        return sum(sizes[name] or 0 for name in names)

    def _snapshot_target(self, group_id: str) -> SnapshotTarget | None:
        cfg = self._config
        names = self._backends_for(group_id)
        if not names:
            return None
        return SnapshotTarget(
            queues=[
                QueueTarget(task_queue=job_task_queue(cfg.job_id, rank), backends=names)
                for rank in range(cfg.ranks)
            ]
        )

    async def _order(self, group_id: str, purpose: str, record: EpochRecord) -> LeaseOrder:
        """The lease for a GPU phase on ``group_id``.

        With one rank, an order the process fills itself when the phase's activity starts
        (nothing is awaited here); with several, a lease this workflow acquires now."""
        cfg = self._config
        if cfg.ranks > 1:
            await self._acquire(group_id, purpose, record)
            held = self._ledger.held_order(group_id)
            assert held is not None
            return held
        return self._new_order(group_id)

    def _new_order(self, group_id: str) -> LeaseOrder:
        """A lease the job process will ask for (the ledger keeps it, to take it back if the
        phase never runs)."""
        request_id = f"{self._config.job_id}:{workflow.uuid4()}"
        return self._ledger.new_order(
            group_id,
            request_id=request_id,
            key=self._leases.new_key(request_id),
            state_bytes=self._bytes_on(group_id),
        )

    async def _acquire(
        self, group_id: str, purpose: str, record: EpochRecord | None
    ) -> GrantNotice:
        """Take a lease this workflow holds (grant by signal, renewal by timer)."""
        self._set_phase(f"waiting for {group_id} ({purpose})", search=False)
        self._ledger.asking(group_id, workflow.now())
        try:
            lease = await self._leases.acquire(
                group_id,
                self._config.acquire_timeout_s,
                snapshot=self._snapshot_target(group_id),
                state_bytes=self._bytes_on(group_id),
                # The job process restores its in-process state itself before each leased
                # activity, so a grant never waits for a restore activity.
                restores_itself=True,
            )
        except ApplicationError as err:
            raise ApplicationError(
                f"job {self._config.job_id}: {err.message}", type=err.type, non_retryable=True
            ) from None
        waited_s = self._ledger.hold(lease, key=self._leases.key_of(lease), now=workflow.now())
        if record is not None:
            record.wait_s[purpose] = waited_s
        return lease

    async def _release(
        self,
        lease: GrantNotice,
        restored: list[SnapshotReport] | None = None,
        evicted: list[SnapshotReport] | None = None,
    ) -> None:
        if lease.group_id in self._ledger.held:
            await self._leases.release(lease, restored=restored, evicted=evicted)
            # Only now: a cancellation during the signal must not lose the release.
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

    async def _run_phase(
        self,
        epoch: int,
        phase: Phase,
        lease: LeaseOrder | None,
        release: Release = "never",
        prefetch: LeaseOrder | None = None,
        carry_into: NextPhase | None = None,
    ) -> PhaseResult:
        cfg = self._config
        self._set_phase(phase)
        timeout = {
            "sample": cfg.sample_timeout_s,
            "rewards": cfg.reward_timeout_s,
            "train": cfg.train_timeout_s,
        }[phase]
        where = f" · {lease.group_id}" if lease else " · no GPU"
        # A phase that takes its own lease waits for it inside the activity.
        waits = lease is not None and lease.token is None
        budget = timeout + ((cfg.acquire_timeout_s or _NO_WAIT_LIMIT_S) if waits else 0.0)
        ttl = (lease.ttl_s if lease else None) or _DEFAULT_TTL_S
        inp = PhaseInput(
            job_id=cfg.job_id,
            epoch=epoch,
            phase=phase,
            lease=lease,
            timeout_s=timeout,
            release=release,
            group_backends=self._backends_for(lease.group_id) if lease else [],
            lease_check_s=max(0.5, min(5.0, ttl / 4)),
            prefetch=prefetch,
            prefetch_backends=self._backends_for(prefetch.group_id) if prefetch else [],
            carry_into=carry_into,
        )
        results = await self._on_all_ranks(
            _PHASE_ACTIVITIES[phase], inp, PhaseResult, budget, f"epoch {epoch} · {phase}{where}"
        )
        return results[0]

    async def _on_all_ranks(
        self, activity: str, arg: Any, result_type: type[R], timeout_s: float, summary: str
    ) -> list[R]:
        """Run ``activity`` on every rank's process at once; any failure fails the epoch, and
        so does the loss of a lease this workflow holds (the work stops before it goes on)."""
        cfg = self._config
        tasks = [
            asyncio.ensure_future(
                workflow.execute_activity(
                    activity,
                    arg,
                    task_queue=job_task_queue(cfg.job_id, rank),
                    start_to_close_timeout=timedelta(seconds=timeout_s),
                    schedule_to_start_timeout=timedelta(seconds=cfg.heartbeat_timeout_s),
                    heartbeat_timeout=timedelta(seconds=cfg.heartbeat_timeout_s),
                    retry_policy=_NO_RETRY,
                    # A cancelled rank's work must have stopped before the lease moves on.
                    cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                    summary=summary if cfg.ranks == 1 else f"{summary} · rank {rank}",
                )
            )
            for rank in range(cfg.ranks)
        ]
        held = list(self._ledger.held.values())
        gathered = asyncio.gather(*tasks)
        try:
            lost = await self._first_lost(gathered, held)
            if lost is not None:
                await self._cancel_all(tasks)
                if gathered.done() and not gathered.cancelled():
                    gathered.exception()  # retrieved: the lease's loss is what failed the work
                raise _EpochFailed(f"{lost}; the job's work under it was stopped")
            raws = await gathered
        except ActivityError as err:
            await self._cancel_all(tasks)
            ending = _ending_the_job(err, cfg.job_id)
            if ending is not None:
                raise ending from None
            raise _EpochFailed(_failure(err)) from None
        try:
            return [
                _validated(result_type, raw, f"{activity} on rank {rank}")
                for rank, raw in enumerate(raws)
            ]
        except _InvalidResult as err:
            raise _EpochFailed(f"InvalidResult: {err}") from None

    async def _first_lost(self, work: asyncio.Future[Any], held: list[GrantNotice]) -> str | None:
        """Wait for ``work``; if one of the ``held`` leases is lost first, why (else None)."""
        if not held:
            await workflow.wait([work])  # its outcome is read by the caller
            return None
        watch = asyncio.ensure_future(
            workflow.wait_condition(lambda: self._leases.any_lost(held) is not None)
        )
        try:
            await workflow.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        return None if work.done() else self._leases.any_lost(held)

    async def _cancel_all(self, tasks: list[asyncio.Future[Any]]) -> None:
        for task in tasks:
            task.cancel()
        await workflow.wait(tasks)  # deterministic, unlike asyncio.wait

    def _note(self, record: EpochRecord, result: PhaseResult, phase: str, carried: bool) -> None:
        record.phase_s[result.phase] = result.seconds
        record.metrics.update({f"{result.phase}.{k}": v for k, v in result.metrics.items()})
        if result.group_id is not None:
            # The record keeps the hold, not the process's answer for the order asked ahead.
            record.holds.append(result.model_copy(update={"asked_ahead": None}))
            if phase not in record.wait_s:  # else the workflow timed its own acquire
                record.wait_s[phase] = 0.0 if carried else result.waited_s

    # ---------------------------------------------------------------- visibility

    def _set_phase(self, phase: str, *, search: bool = True) -> None:
        self._phase = phase
        if search and not self._searched_states_only:
            workflow.upsert_search_attributes([PHASE_KEY.value_set(phase)])
        elif search:
            state = _RUNNING if phase in _SEARCHED_AS_RUNNING else phase
            if _searched(PHASE_KEY) != state:  # a continued run starts with its last value
                workflow.upsert_search_attributes([PHASE_KEY.value_set(state)])
        self._publish_details()

    def _publish_details(self) -> None:
        cfg, state = self._config, self._state
        last = state.records[-1].reward_mean if state.records else None
        lines = [
            f"**epoch**: {min(state.epochs_done, cfg.epochs)} / {cfg.epochs}",
            f"**phase**: {self._phase}",
            f"**reward mean**: {'-' if last is None else f'{last:.3f}'}",
            f"**groups**: sample on {cfg.sampler_group}, train on {cfg.trainer}",
            f"**last checkpoint**: {_checkpoint_label(state.last_checkpoint)}",
        ]
        if state.rewinds:
            lines.append(f"**rewinds**: {state.rewinds} ({state.redone_epochs} epochs redone)")
        workflow.set_current_details("\n\n".join(lines))

    @workflow.query(name=JobQuery.PROGRESS)
    def progress(self) -> RLJobProgress:
        cfg, state = self._config, self._state
        phase_s, wait_s = state.totals()
        rewards = list(state.rewards)
        return RLJobProgress(
            job_id=cfg.job_id,
            status=self._status,  # type: ignore[arg-type]
            epoch=state.epochs_done,
            epochs=cfg.epochs,
            phase=self._phase,
            reward_mean=rewards[-1] if rewards else None,
            rewards=rewards,
            rewards_from=state.rewards_from,
            phase_s=phase_s,
            wait_s=wait_s,
            rewinds=state.rewinds,
            last_checkpoint=state.last_checkpoint,
            shed_records=state.shed_records,
            forged_notices=self._leases.forged_notices,
        )

    @workflow.signal(name=JobSignal.STOP)
    def stop(self, *_ignored: Any) -> None:
        """Finish the current epoch, checkpoint, and complete (any argument is ignored: a
        signal handler that raised would fail the workflow task)."""
        self._state.stop_requested = True
        if self._status == "running":
            self._status = "stopping"


def _checkpoint_label(ref: CheckpointRef | None) -> str:
    if ref is None:
        return "none"
    return "initial state" if ref.epochs_done == 0 else f"after epoch {ref.epochs_done - 1}"


__all__ = ["RLJobWorkflow"]
