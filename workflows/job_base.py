"""What every RL job workflow is: the one base of ``RLJobWorkflow`` and ``AsyncRLJobWorkflow``.

An RL job workflow, sync or async, waits for its job processes (``describe``), prepares them
from its last checkpoint holding all its groups, then runs its work — one epoch at a time
(``RLJobWorkflow``), or a sampler loop and a trainer loop at once (``AsyncRLJobWorkflow``) —
until it is done or stopped, continuing as new every ``continue_as_new_every`` epochs (steps),
and checkpoints what it trained since the last checkpoint before it ends. ``JobWorkflowBase``
holds all of that; a subclass brings its work (``_advance``) and what it shows.

Failure model, the same for both: a phase that fails for any reason — its process died
(heartbeat or pick-up time-out), the process restarted and lost its in-memory state, the lease
was revoked, the user's code raised — hands every lease back and *rewinds* the job to its last
checkpoint: the job waits for its processes, re-prepares them from the checkpoint while holding
all its groups, and re-runs the epochs since. Epochs are therefore applied to the model exactly
once, and nothing is skipped. Failures a rewind would not cure end the job at once,
non-retryably (``workflows/job_failures.py`` says which).

The lease ledger (``JobLeases``, ``workflows/job_leases.py``) decides; this base sends what it
is told to (orders, releases, cancels) through ``GroupLeases`` and says so afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutType
from temporalio.exceptions import TimeoutError as TaskTimeout
from temporalio.workflow import ActivityCancellationType
from timeslice.protocol.group import (
    GRANT_SIGNAL,
    JOB_KEY,
    PHASE_KEY,
    GrantNotice,
    MalformedMessage,
    NextPhase,
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
    protocol_mismatch,
    rl_job_workflow_id,
)
from timeslice.workflows.group_lease import GroupLeases, end_order
from timeslice.workflows.job_failures import (
    GrantRefused,
    InvalidResult,
    PhaseFailed,
    ending_the_job,
    failure_text,
    refused_grant,
    validated,
)
from timeslice.workflows.job_leases import JobLeases, Release
from timeslice.workflows.pool_job import (
    ended_in_pool,
    move_due,
    needs_placement,
    placed,
    read_move_order,
    send_profile_if_due,
    take_move,
)

# workflow.patched id of job protocol v5 (see JOB_PROTOCOL_VERSION), which both job kinds speak:
# a phase's result says whether the process sent the acquire of the order it was told to ask
# ahead (PhaseResult.asked_ahead). A train whose lease the group carries into the next sample
# does not send it, and the workflow forgets that order instead of signalling the group a cancel
# for a request it never had (two events and a workflow task of the job an epoch, and the
# group's signal and task).
JOB_PROTOCOL_V5 = "job-protocol-v5"
# workflow.patched id: a lease of the workflow's that every rank refused before any work
# (GrantNotHeld) is asked for again and the activity run again, instead of a rewind.
REFUSED_GRANTS_ASKED_AGAIN = "refused-grants-asked-again"
# workflow.patched id (asked when the job's run is cancelled during a phase): the phase's
# activities are cancelled and their end awaited before any lease is handed back. Before it a
# cancelled sync job (or both loops of an async one) handed its leases back while the phases
# still ran, and the group could grant the next job beside them until the processes noticed.
PHASES_END_WITH_A_CANCELLED_JOB = "phases-end-with-a-cancelled-job"

_NO_RETRY = RetryPolicy(maximum_attempts=1)
# A phase that waits for its lease without a limit still needs an activity time-out; its
# heartbeat, not this, is what notices a dead process.
_NO_WAIT_LIMIT_S = 30 * 86_400.0
_DEFAULT_TTL_S = 20.0
# How long a job stopped while waiting for its processes still waits for them.
_STOP_GRACE = timedelta(seconds=5)


def _waited_out(err: ActivityError) -> bool:
    """An activity nobody picked up before its time-out (the server says schedule-to-start
    for one never started, the schedule-to-close time standing for both)."""
    cause = err.cause
    return isinstance(cause, TaskTimeout) and cause.type in (
        TimeoutType.SCHEDULE_TO_START,
        TimeoutType.SCHEDULE_TO_CLOSE,
    )


def searched(key: SearchAttributeKey[str]) -> str | None:
    """The workflow's value of a keyword search attribute (as started, continued or upserted)."""
    return workflow.info().typed_search_attributes.get(key)


R = TypeVar("R", bound=BaseModel)
ConfigT = TypeVar("ConfigT", bound=RLJobConfig)
StateT = TypeVar("StateT", bound=RLJobState)


class JobWorkflowBase(Generic[ConfigT, StateT]):
    """An RL job workflow's lifecycle, failure rules, lease ledger and handlers.

    A subclass is a ``@workflow.defn`` with its own ``@workflow.run`` (which returns
    ``await self._start()``) and ``@workflow.init``; it sets the class attributes below and
    brings ``_advance`` (its work), ``_choose_versions`` and ``_details``.
    """

    # What the job's input, progress and result are (the async job's extend the sync job's).
    _INPUT: ClassVar[type[RLJobInput]] = RLJobInput
    _PROGRESS: ClassVar[type[RLJobProgress]] = RLJobProgress
    _RESULT: ClassVar[type[RLJobResult]] = RLJobResult
    _STATE: ClassVar[type[RLJobState]] = RLJobState
    # One unit of the job's work, as messages name it: "epoch", or "step" (async).
    _UNIT: ClassVar[str] = "epoch"
    # How a user starts this kind of job (said when the workflow id is wrong).
    _HOW_TO_START: ClassVar[str] = ""
    # The job process's activity that describes it, and how a failed describe is retried.
    _DESCRIBE_ACTIVITY: ClassVar[str] = ""
    _DESCRIBE_RETRY: ClassVar[RetryPolicy | None] = None
    # TimeslicePhase says "checkpoint" while one runs (a sync job's, read as "running" under
    # searched-states-only); an async job's checkpoints happen inside its trainer loop.
    _SEARCHED_CHECKPOINTS: ClassVar[bool] = True
    # A cancelled coroutine running phases cancels them and waits for their end before it
    # unwinds (an async job's loop, cancelled when the other loop fails). A sync job's phases
    # are never cancelled that way, and its histories were recorded without it.
    _PHASES_END_WITH_THEIR_CALLER: ClassVar[bool] = False

    def __init__(self, *raw: Any) -> None:
        # Taken raw and validated here rather than by the data converter, so bad input (or no
        # argument, or several) fails the workflow once, with a message, instead of failing its
        # task forever.
        self._input_error: str | None = None
        try:
            inp = self._parse_input(raw)
        except MalformedMessage as err:
            self._input_error = str(err)
            inp = self._INPUT.model_validate({"config": self._placeholder_config()})
        self._config: ConfigT = inp.config  # type: ignore[assignment]
        self._state: StateT = inp.state or self._STATE()  # type: ignore[assignment]
        self._status = "starting"
        self._phase = "starting"
        self._done_this_run = 0  # epochs (steps) this run did
        self._backends: dict[str, list[str]] = {"sampler": [], "trainer": []}
        self._protocol = JOB_PROTOCOL_VERSION  # decided in _start, before any other command
        self._searched_states_only = True  # decided in _start, before any upsert
        self._leases = GroupLeases(
            self._config.job_id,
            priority=self._config.priority,
            ttl_s=self._config.lease_ttl_s,
            register_grant_signal=False,  # the grant handler below, with its description
        )
        # Which leases the job holds, keeps, carries or has asked for, and what each phase
        # does with its lease (the protocol is set in _start, before any lease is taken).
        self._ledger = JobLeases(self._config, protocol=self._protocol)

    def _parse_input(self, raw: tuple[Any, ...]) -> RLJobInput:
        """The job's input: users start jobs with the bare config (``temporal`` CLI
        ``--input``), and continue-as-new carries state too."""
        what = type(self).__name__
        first = raw[0] if raw else None
        if isinstance(first, dict) and "config" in first:
            return parse_message(self._INPUT, raw, what)
        config_type = self._INPUT.model_fields["config"].annotation
        return self._INPUT(config=parse_message(config_type, raw, what))  # type: ignore[arg-type]

    @staticmethod
    def _placeholder_config() -> dict[str, Any]:
        """A config that parses, for a run whose input did not (it fails at once)."""
        return {
            "job_id": "invalid",
            "workload": "simulated",
            "sampler_group": "invalid",
            "trainer_group": "invalid-trainer",
            "epochs": 1,
        }

    # ---------------------------------------------------------------- what a subclass brings

    def _choose_versions(self) -> tuple[int, bool]:
        """The job protocol this run speaks and whether TimeslicePhase holds states only, by
        ``workflow.patched``; called first thing in the run, before any other command."""
        raise NotImplementedError

    async def _advance(self) -> None:
        """Run the job's next stretch of work (an epoch; both loops until the run's last
        step); raises ``PhaseFailed`` for a failure a rewind may cure."""
        raise NotImplementedError

    def _details(self) -> list[str]:
        """The lines of the workflow's current details (the Web UI's summary)."""
        raise NotImplementedError

    def _after_describe(self) -> None:
        """The job's processes answered (a hook: the async job says it is running)."""

    def _progress_now(self) -> dict[str, Any]:
        """Progress fields only the running workflow knows, beyond the base's."""
        return {}

    def _not_served(self, err: ActivityError) -> ApplicationError | None:
        """A describe failure that means no process of this job's release will ever answer
        (a hook), or None."""
        return None

    # ---------------------------------------------------------------- the run

    async def _start(self) -> RLJobResult:
        """The body of the subclass's ``@workflow.run``."""
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
                f"{self._HOW_TO_START}",
                type="InvalidConfig",
                non_retryable=True,
            )
        # Decided first thing, before any other command: asked later (after the lease secret's
        # local activity) a query's replay was once seen to miss the marker.
        self._protocol, self._searched_states_only = self._choose_versions()
        self._ledger.protocol = self._protocol
        if not self._searched_states_only or searched(JOB_KEY) != cfg.job_id:
            workflow.upsert_search_attributes([JOB_KEY.value_set(cfg.job_id)])
        try:
            return await ended_in_pool(cfg, self._placed_and_run())
        except asyncio.CancelledError:
            await self._release_all()
            raise

    async def _placed_and_run(self) -> RLJobResult:
        if needs_placement(self._config):  # a job started with a pool: it asks for groups
            self._phase = f"waiting for pool {self._config.pool} to place it"
            self._config = self._ledger.config = await placed(self._config)
        return await self._run()

    async def _run(self) -> RLJobResult:
        cfg, state = self._config, self._state
        state.lease_secret = await self._leases.draw_secret(state.lease_secret)
        if not await self._describe():
            return self._stopped_waiting()
        self._status = "stopping" if state.stop_requested else "running"
        self._after_describe()
        while True:
            try:
                if not state.prepared:
                    await self._prepare()
                if state.epochs_done >= cfg.epochs or state.stop_requested:
                    await self._release_all()
                    break
                if move_due(self._state):
                    await self._move()
                    continue  # prepared again on its new groups, from the checkpoint
                await send_profile_if_due(self._config, state, self._backends)
                if self._done_this_run >= cfg.continue_as_new_every or (
                    workflow.info().is_continue_as_new_suggested()
                ):
                    await self._continue_as_new()
                    continue  # a stop that came while handlers drained ends the job instead
                await self._advance()
            except PhaseFailed as failed:
                await self._release_all()
                self._fail_or_rewind(failed)
                if not await self._describe():
                    return self._stopped_waiting()
        if state.last_checkpoint is None or state.last_checkpoint.epochs_done != state.epochs_done:
            try:
                await self._final_checkpoint()
            except PhaseFailed as failed:
                # The process lost what it trained since the last checkpoint: the job ends
                # there, stopped, rather than failing.
                workflow.logger.warning("final checkpoint failed (%s); ending at the last", failed)
                await self._release_all()
                self._rewind()
        self._status = "stopped" if state.epochs_done < cfg.epochs else "completed"
        self._set_phase(self._status)
        return self._result()

    def _fail_or_rewind(self, failed: PhaseFailed) -> None:
        cfg, state = self._config, self._state
        state.failures += 1
        if state.failures > cfg.max_failures:
            raise ApplicationError(
                f"job {cfg.job_id}: {self._UNIT} {state.epochs_done} failed {state.failures} "
                f"times in a row (max_failures={cfg.max_failures}); last failure: {failed}",
                type="JobFailed",
                non_retryable=True,
            ) from None
        workflow.logger.warning(
            "job %s failed at %s %d (%s); rewinding to the last checkpoint",
            cfg.job_id,
            self._UNIT,
            state.epochs_done,
            failed,
        )
        self._rewind()

    def _stopped_waiting(self) -> RLJobResult:
        """The job was stopped while no process served it: it ends where it stands, with
        nothing to checkpoint (its last checkpoint, if any, is what it keeps)."""
        self._status = "stopped"
        self._set_phase("stopped while waiting for job processes")
        return self._result()

    def _result(self) -> RLJobResult:
        return self._RESULT.of(self._config, self._state)

    # ---------------------------------------------------------------- preparing and rewinding

    async def _describe(self) -> bool:
        """Wait for every rank's process and check it runs this job's workload and protocol.

        Returns:
            True once every process answered; False if the job was stopped before (a job
            whose process never comes must still end on `job stop`).

        Raises:
            ApplicationError: A process of another protocol or workload, an invalid answer,
                or a failure no wait would cure: the job fails, non-retryably.
        """
        cfg = self._config
        self._set_phase("waiting for job processes", search=False)
        describing = asyncio.gather(
            *(
                workflow.execute_activity(
                    self._DESCRIBE_ACTIVITY,
                    DescribeInput(
                        job_id=cfg.job_id,
                        options=cfg.workload_options,
                        chain_id=workflow.info().first_execution_run_id,
                        protocol=self._protocol,
                    ),
                    task_queue=job_task_queue(cfg.job_id, rank),
                    schedule_to_close_timeout=timedelta(seconds=cfg.process_wait_s),
                    start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=self._DESCRIBE_RETRY,
                    summary=self._describe_summary(rank),
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
            ending = ending_the_job(err, cfg.job_id) or self._not_served(err)
            if ending is None and _waited_out(err):
                ending = self._no_process(err)
            if ending is not None:
                raise ending from None
            raise
        self._check_described(raws)
        return True

    def _no_process(self, err: ActivityError) -> ApplicationError:
        """The job waited ``process_wait_s`` for a process that never came: say which rank's
        and the command that starts it (the same failure as before, said so)."""
        cfg = self._config
        queues = ", ".join(repr(job_task_queue(cfg.job_id, r)) for r in range(cfg.ranks))
        return ApplicationError(
            f"job {cfg.job_id}: no job process served it within process_wait_s="
            f"{cfg.process_wait_s:g} s (task queue {queues}): start `timeslice job worker "
            f"--job-id {cfg.job_id} --workload {cfg.workload}` before, or with, the job",
            type="NoJobProcess",
            non_retryable=True,
        )

    def _describe_summary(self, rank: int) -> str:
        return f"wait for rank {rank} · {self._config.workload}"

    def _rank(self, rank: int) -> str:
        """How messages name a rank: only a job of several ranks has them to tell apart."""
        return f" rank {rank}" if self._config.ranks > 1 else ""

    def _check_described(self, raws: list[Any]) -> None:
        """Take the processes' answers to ``describe``: each must speak the workflow's job
        protocol and run the config's workload; the first names the job's states."""
        cfg = self._config
        try:
            results = [
                validated(DescribeResult, raw, f"the job process{self._rank(rank)}")
                for rank, raw in enumerate(raws)
            ]
        except InvalidResult as err:
            raise ApplicationError(
                f"job {cfg.job_id}: {err}", type="InvalidResult", non_retryable=True
            ) from None
        for rank, found in enumerate(results):
            mismatch = protocol_mismatch(self._protocol, found.protocol)
            if mismatch is not None:
                raise ApplicationError(
                    f"job {cfg.job_id}{self._rank(rank)}: {mismatch}",
                    type="ProtocolMismatch",
                    non_retryable=True,
                )
            if found.workload != cfg.workload:
                raise ApplicationError(
                    f"the job process of {cfg.job_id}{self._rank(rank)} runs workload "
                    f"{found.workload!r}, but the job's config asks for {cfg.workload!r}; "
                    "start `timeslice job worker` with the same --workload",
                    type="InvalidConfig",
                    non_retryable=True,
                )
        self._backends = {
            "sampler": results[0].sampler_backends,
            "trainer": results[0].trainer_backends,
        }

    async def _stopped_without_processes(self) -> None:
        """Returns once a stop has been asked for and the processes still have not answered
        for a while: live ones answer at once, and get to checkpoint what they trained."""
        await workflow.wait_condition(lambda: self._state.stop_requested)
        await workflow.sleep(_STOP_GRACE)

    async def _prepare(self) -> None:
        """Build (or rebuild) the processes' state from the last checkpoint, holding all groups."""
        cfg, state = self._config, self._state
        checkpoint = state.last_checkpoint
        # What the process builds its state from: the config's fields of the same names.
        named = cfg.model_dump(include=set(JobSpecModel.model_fields) - {"options"})
        spec = JobSpecModel(options=cfg.workload_options, **named)
        try:
            for group in cfg.groups():
                await self._acquire(group, "prepare")
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
                f"prepare · from {self._checkpoint_label(checkpoint)}",
            )
            self._prepared(results)
            if checkpoint is None:  # a rewind needs somewhere to go back to, even epoch 0
                held = self._ledger.held_order(cfg.trainer)
                assert held is not None
                await self._checkpoint(state.epochs_done, held)
        finally:
            await self._release_all()
        state.prepared = True

    def _prepared(self, results: list[PrepareResult]) -> None:
        """Take the ranks' answers to ``prepare``: the state's sizes, summed over ranks, and
        where the job stands."""
        state = self._state
        sizes = [r.state_bytes for r in results]
        state.state_bytes = None if None in sizes else sum(s or 0 for s in sizes)
        state.backend_bytes = {
            name: None
            if any(r.backend_bytes.get(name) is None for r in results)
            else sum(r.backend_bytes[name] or 0 for r in results)
            for name in results[0].backend_bytes
        }
        state.epochs_done = results[0].epochs_done

    def _homes(self) -> dict[str, str]:
        """Where each state lives once prepared: the trainer's on the trainer group, the rest
        on the sampler group."""
        cfg = self._config
        homes = {name: cfg.sampler_group for name in self._backends["sampler"]}
        homes.update({name: cfg.trainer for name in self._backends["trainer"]})
        return homes

    def _rewind(self) -> None:
        """Back to the last checkpoint: the records since go, and the processes are prepared
        again before the job goes on."""
        state = self._state
        back_to = state.last_checkpoint.epochs_done if state.last_checkpoint else 0
        state.redone_epochs += state.drop_records_from(back_to)
        state.rewinds += 1
        state.epochs_done = back_to
        state.prepared = False

    def _checkpoint_label(self, ref: CheckpointRef | None) -> str:
        if ref is None:
            return "none"
        return (
            "initial state" if ref.epochs_done == 0 else f"after {self._UNIT} {ref.epochs_done - 1}"
        )

    async def _checkpoint(
        self, epochs_done: int, lease: LeaseOrder, *, prefetch: LeaseOrder | None = None
    ) -> None:
        """Save under ``lease`` (its state lives there); a lease the process holds is released
        by the process once the checkpoint is written."""
        group_id = lease.group_id
        self._set_phase("checkpoint", search=self._SEARCHED_CHECKPOINTS)
        release = lease.held_by == "process"
        saving = CheckpointRef(epochs_done=epochs_done, path="")
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
            f"checkpoint · {self._checkpoint_label(saving)} · {group_id}",
        )
        if release:
            self._ledger.checkpointed(lease)
        self._state.last_checkpoint = refs[0]

    async def _final_checkpoint(self) -> None:
        """Stopped between epochs (steps): save what was trained since the last checkpoint."""
        cfg = self._config
        lease = await self._acquire(cfg.trainer, "checkpoint")
        try:
            held = self._ledger.held_order(cfg.trainer)
            assert held is not None
            await self._checkpoint(self._state.epochs_done, held)
        finally:
            await self._release(lease)

    async def _move(self) -> None:
        """Take the move its pool ordered, at a checkpoint boundary: hand back every lease on
        the old groups and run on the new ones, prepared again from the checkpoint just
        taken, so nothing is applied twice and nothing is lost (the process moves the state
        from the old group's device to the new one's, and tells the old group it left)."""
        self._config = self._ledger.config = await take_move(
            self._config, self._state, self._release_all
        )
        self._publish_details()

    async def _continue_as_new(self) -> None:
        await self._release_all()  # a lease's renewal does not survive the run
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._state.stop_requested:
            return
        self._state.runs += 1
        carried, size, shed = self._INPUT.carried(self._config, self._state)
        if shed:
            workflow.logger.warning(
                "job %s shed %d of its oldest records and rewards so that its continue-as-new "
                "input fits (%d bytes now)",
                self._config.job_id,
                shed,
                size,
            )
        workflow.continue_as_new(carried)

    # ---------------------------------------------------------------- leases

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
        self, group_id: str, purpose: str, record: EpochRecord | None = None
    ) -> GrantNotice:
        """Take a lease this workflow holds (grant by signal, renewal by timer); the wait is
        noted in ``record`` under ``purpose``."""
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
                wait_label=self._wait_label(group_id, purpose, record),
            )
        except ApplicationError as err:
            raise ApplicationError(
                f"job {self._config.job_id}: {err.message}", type=err.type, non_retryable=True
            ) from None
        waited_s = self._ledger.hold(lease, key=self._leases.key_of(lease), now=workflow.now())
        if record is not None:
            record.wait_s[purpose] = waited_s
        return lease

    def _wait_label(self, group_id: str, purpose: str, record: EpochRecord | None) -> str:
        """The wait for a lease as its row on the job's timeline reads (the summary of the
        timer its time-out starts): ``epoch 3 · train · waiting for gpus-0``."""
        epoch = "" if record is None else f"epoch {record.epoch} · "
        return f"{epoch}{purpose} · waiting for {group_id}"

    async def _release(self, lease: GrantNotice, after: PhaseResult | None = None) -> None:
        """Release a lease this workflow holds, with what the phase ``after`` it moved."""
        if lease.group_id in self._ledger.held:
            await self._leases.release(
                lease,
                restored=after.restored if after else None,
                evicted=after.evicted if after else None,
            )
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

    async def _settle(
        self, order: LeaseOrder, result: PhaseResult | None, *, keep: bool = False
    ) -> None:
        """After a GPU phase: end what the ledger says the process did not (a failed phase's
        lease, a workflow-held lease)."""
        after = self._ledger.after_phase(order, result, keep=keep)
        if after.release is not None:
            await self._release(after.release, result)
        elif after.end is not None:
            await self._end_order(after.end)

    # ---------------------------------------------------------------- phases

    def _phase_input(
        self,
        epoch: int,
        phase: Phase,
        lease: LeaseOrder | None,
        release: Release = "never",
        prefetch: LeaseOrder | None = None,
        carry_into: NextPhase | None = None,
    ) -> PhaseInput:
        """What a phase's activity is told: its lease, its time-out, what to do with the
        lease after, the lease to ask for ahead."""
        cfg = self._config
        ttl = (lease.ttl_s if lease else None) or _DEFAULT_TTL_S
        return PhaseInput(
            job_id=cfg.job_id,
            epoch=epoch,
            phase=phase,
            lease=lease,
            timeout_s=self._timeout_of(phase),
            release=release,
            group_backends=self._backends_for(lease.group_id) if lease else [],
            lease_check_s=max(0.5, min(5.0, ttl / 4)),
            prefetch=prefetch,
            prefetch_backends=self._backends_for(prefetch.group_id) if prefetch else [],
            carry_into=carry_into,
        )

    def _timeout_of(self, phase: Phase) -> float:
        cfg = self._config
        timeouts = {"sample": cfg.sample_timeout_s, "rewards": cfg.reward_timeout_s}
        return timeouts.get(phase, cfg.train_timeout_s)

    def _budget(self, phase: Phase, lease: LeaseOrder | None) -> float:
        """A phase's activity time-out: its own, and the wait for a lease it takes itself."""
        waits = lease is not None and lease.token is None
        return self._timeout_of(phase) + (
            (self._config.acquire_timeout_s or _NO_WAIT_LIMIT_S) if waits else 0.0
        )

    async def _on_all_ranks(
        self, activity: str, arg: Any, result_type: type[R], timeout_s: float, summary: str
    ) -> list[R]:
        """Run ``activity`` on every rank's process at once; any failure fails the phase, and
        so does the loss of a lease this workflow holds (the work stops before it goes on).

        A lease of this workflow's that every rank refused before any work (``GrantNotHeld``:
        the group's holder is another) costs no failure: the workflow asks the group about
        its request again (a grant the group never made is counted as forged, and the real
        one waited for; one that ended is asked for anew) and runs the activity again, under
        the leases it holds now (``_with_current_leases``).

        Raises:
            PhaseFailed: A rank failed, its result did not parse, or a held lease was lost.
            ApplicationError: A failure in ``_ENDS_THE_JOB``: the job fails.
        """
        while True:
            try:
                return await self._on_all_ranks_once(activity, arg, result_type, timeout_s, summary)
            except GrantRefused:
                await self._ask_again_for_refused_leases()
                arg = self._with_current_leases(arg)

    async def _on_all_ranks_once(
        self, activity: str, arg: Any, result_type: type[R], timeout_s: float, summary: str
    ) -> list[R]:
        """One run of ``activity`` on every rank (``_on_all_ranks``)."""
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
                # Lost before any renewal found it held: perhaps a grant no group made, which
                # the processes refuse before any work (their refusal may come second).
                never_held = all(
                    not self._leases.confirmed(lease)
                    for lease in held
                    if self._leases.lost(lease) is not None
                )
                if never_held and await self._every_rank_refused(tasks):
                    raise GrantRefused(lost)
                await self._cancel_all(tasks, gathered)
                raise PhaseFailed(f"{lost}; the job's work under it was stopped")
            raws = await gathered
        except asyncio.CancelledError:
            if self._PHASES_END_WITH_THEIR_CALLER or workflow.patched(
                PHASES_END_WITH_A_CANCELLED_JOB
            ):
                await self._cancel_all(tasks, gathered)
            raise
        except ActivityError as err:
            if held and refused_grant(err) and await self._every_rank_refused(tasks):
                raise GrantRefused(failure_text(err)) from None
            await self._cancel_all(tasks, gathered)
            ending = ending_the_job(err, cfg.job_id)
            if ending is not None:
                raise ending from None
            raise PhaseFailed(failure_text(err)) from None
        try:
            return [
                validated(result_type, raw, f"{activity}{self._rank(rank)}")
                for rank, raw in enumerate(raws)
            ]
        except InvalidResult as err:
            raise PhaseFailed(f"InvalidResult: {err}") from None

    async def _every_rank_refused(self, tasks: list[asyncio.Future[Any]]) -> bool:
        """Whether every rank refused a lease of this workflow's before any work
        (``GrantNotHeld``), waiting for each: a rank that ran, or failed otherwise, makes it a
        failure of the phase. Histories from before this replay as they ran (a rewind)."""
        if not workflow.patched(REFUSED_GRANTS_ASKED_AGAIN):
            return False
        await workflow.wait(tasks)  # a forged grant is refused by every rank at once
        refused = all(
            not t.cancelled() and refused_grant(t.exception())  # type: ignore[arg-type]
            for t in tasks
        )
        return refused

    async def _ask_again_for_refused_leases(self) -> None:
        """After its processes refused a lease of this workflow's (``GrantRefused``): ask the
        group again about each lease no renewal has confirmed; one still queued waits for its
        real grant, one that ended is asked for anew."""
        for group_id, lease in list(self._ledger.held.items()):
            if self._leases.confirmed(lease):
                continue
            checked = await self._leases.recheck(lease, self._config.acquire_timeout_s)
            if checked is not None:
                self._ledger.hold(checked, key=self._leases.key_of(checked), now=workflow.now())
                continue
            self._ledger.released(group_id)
            await self._acquire(group_id, "the lease again")

    def _with_current_leases(self, value: Any) -> Any:
        """``value`` (an activity's input) with each lease of this workflow's it names
        replaced by the one the workflow holds on that group now."""
        if isinstance(value, LeaseOrder):
            current = self._ledger.held_order(value.group_id)
            return current if value.held_by == "workflow" and current is not None else value
        if isinstance(value, list):
            return [self._with_current_leases(item) for item in value]
        if not isinstance(value, BaseModel):
            return value
        changed = {
            name: new
            for name in type(value).model_fields
            if (new := self._with_current_leases(getattr(value, name))) is not getattr(value, name)
        }
        if isinstance(value, PrepareInput):
            changed["lease_keys"] = self._ledger.held_keys()
        return value.model_copy(update=changed) if changed else value

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

    async def _cancel_all(
        self, tasks: list[asyncio.Future[Any]], gathered: asyncio.Future[Any]
    ) -> None:
        for task in tasks:
            task.cancel()
        await workflow.wait(tasks)  # deterministic, unlike asyncio.wait
        if gathered.done() and not gathered.cancelled():
            gathered.exception()  # retrieved: what ended the work is reported by the caller

    # ---------------------------------------------------------------- visibility

    def _set_phase(self, phase: str, *, search: bool = True) -> None:
        """The job's phase is now ``phase``; with ``search``, TimeslicePhase says so too (the
        phase, or under searched-states-only the job's state, upserted when it changes)."""
        self._phase = phase
        if search and not self._searched_states_only:
            workflow.upsert_search_attributes([PHASE_KEY.value_set(phase)])
        elif search:
            state = _RUNNING if phase in _SEARCHED_AS_RUNNING else phase
            if searched(PHASE_KEY) != state:  # a continued run starts with its last value
                workflow.upsert_search_attributes([PHASE_KEY.value_set(state)])
        self._publish_details()

    def _publish_details(self) -> None:
        workflow.set_current_details("\n\n".join(self._details()))

    @workflow.query(
        name=JobQuery.PROGRESS,
        description="Where the job stands: its status, epoch (step) and phase, its rewards, "
        "the seconds its phases ran and waited for leases, its rewinds and last checkpoint, "
        "and the records it shed to fit continue-as-new (an async job adds its pipeline). "
        "Answered from memory: it writes no history event.",
    )
    def progress(self) -> RLJobProgress:
        """The job's progress (``RLJobProgress``; an async job's ``AsyncRLJobProgress``)."""
        return self._PROGRESS.of(
            self._config,
            self._state,
            status=self._status,
            phase=self._phase,
            forged_notices=self._leases.forged_notices,
            **self._progress_now(),
        )

    @workflow.signal(
        name=GRANT_SIGNAL,
        description="A group grants a lease this workflow asked for itself (to prepare its "
        "processes, for a final checkpoint, or for every phase of a job of several ranks), or "
        "says the job was faulted. Dropped, and counted in progress.forged_notices, unless its "
        "proof matches the request's key.",
    )
    def grant(self, *raw: Any) -> None:
        """A group's grant or fault notice (``GroupLeases.on_grant`` takes it)."""
        self._leases.on_grant(*raw)

    @workflow.signal(
        name=JobSignal.STOP,
        description="Stop the job: it finishes the epoch (training step) in hand, checkpoints "
        "what it trained since its last checkpoint, and completes as stopped. Takes no "
        "argument (any is ignored).",
    )
    def stop(self, *_ignored: Any) -> None:
        """Finish the current epoch (step), checkpoint, and complete (any argument is ignored:
        a signal handler that raised would fail the workflow task)."""
        self._state.stop_requested = True
        if self._status == "running":
            self._status = "stopping"

    @workflow.signal(
        name=JobSignal.MOVE,
        description="Its pool's order to run on other groups (a MoveOrder: pool, "
        "sampler_group, trainer_group, reason, epochs_apart): taken at the next checkpoint "
        "boundary at least epochs_apart epochs after the last move; the job then prepares "
        "again on the new groups from that checkpoint. Dropped, with a warning, unless the "
        "job was started with that pool.",
    )
    def move(self, *raw: Any) -> None:
        """Keep the pool's move order for the next checkpoint boundary (``take_move``)."""
        order = read_move_order(self._config, raw)
        if order is not None:
            self._state.pending_move = order
            self._move_ordered()

    def _move_ordered(self) -> None:
        """A move order was kept (an async job's loops stop at its boundary); a sync job
        checks ``move_due`` between epochs."""


# What TimeslicePhase says while a job runs its epochs under searched-states-only: one value for
# all their phases (an upsert per phase was 3-4 history events per epoch, read by no filter).
_RUNNING = "running"
_SEARCHED_AS_RUNNING = frozenset({"sample", "rewards", "train", "checkpoint"})


__all__ = ["JOB_PROTOCOL_V5", "JobWorkflowBase", "searched"]
