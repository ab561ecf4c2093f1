"""RLJobWorkflow: one RL job whose GPU phases take turns on shared GPU groups.

Each epoch: lease the sampler group → ``sample`` → release; ``compute_rewards`` with no lease;
lease the trainer group → ``train`` (→ ``save_checkpoint`` every N epochs) → release. The phases
run as activities in the job's own processes (task queue ``timeslice-job-<job>-<rank>``), which
keep the model and trajectories; only metrics cross Temporal.

The lifecycle, the failure model (a failed phase rewinds the job to its last checkpoint, so
every epoch is applied to the model exactly once), the lease ledger and the handlers are every
RL job workflow's (``workflows/job_base.py``); this module is the epoch: which lease each phase
runs under, what it asks for ahead, what it carries into the next.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from timeslice.protocol.rl_job import (
    DESCRIBE_ACTIVITY,
    JOB_PROTOCOL_VERSION,
    REWARDS_ACTIVITY,
    RL_JOB_WORKFLOW_TYPE,
    SAMPLE_ACTIVITY,
    TRAIN_ACTIVITY,
    EpochRecord,
    LeaseOrder,
    PhaseInput,
    PhaseResult,
    RLJobConfig,
    RLJobResult,
    RLJobState,
)
from timeslice.workflows.job_base import JOB_PROTOCOL_V5, JobWorkflowBase

# workflow.patched ids of job protocols v3 and v4 (see JOB_PROTOCOL_VERSION; v5's,
# JOB_PROTOCOL_V5, is both job kinds', in job_base.py).
JOB_PROTOCOL_V3 = "job-protocol-v3"
# v4: a train followed by the next epoch's sample on the same group asks the group to carry
# its lease into that sample (PhaseInput.carry_into), with the sample's expected length.
JOB_PROTOCOL_V4 = "job-protocol-v4"
# workflow.patched id: TimeslicePhase is upserted when the job's state changes, not at every
# phase, and TimesliceJob only when the start did not set it (jobs that began before upsert as
# they did). A filter reads the state; the phase of the moment is the progress query's.
SEARCHED_STATES_ONLY = "searched-states-only"
_PHASE_ACTIVITIES: dict[str, str] = {
    "sample": SAMPLE_ACTIVITY,
    "rewards": REWARDS_ACTIVITY,
    "train": TRAIN_ACTIVITY,
}


@workflow.defn(name=RL_JOB_WORKFLOW_TYPE)
class RLJobWorkflow(JobWorkflowBase[RLJobConfig, RLJobState]):
    """One RL job, an epoch at a time: sample, rewards, train (and checkpoint)."""

    _HOW_TO_START = "`timeslice job start` or `timeslice.jobs.start_rl_job`"
    _DESCRIBE_ACTIVITY = DESCRIBE_ACTIVITY

    @workflow.init
    def __init__(self, *raw: Any) -> None:
        super().__init__(*raw)
        # An epoch began and has not ended: a rewind now redoes it too.
        self._epoch_under_way = False

    @workflow.run
    async def run(self, *raw: Any) -> RLJobResult:
        """Run the job to its last epoch, or until it is stopped.

        Args:
            *raw: The job's input: an ``RLJobConfig`` (as JSON), or an ``RLJobInput`` after
                continue-as-new; validated here.

        Returns:
            The job's result, completed or stopped.

        Raises:
            ApplicationError: Non-retryable: bad input (``InvalidConfig``), a job process of
                another release (``ProtocolMismatch``), ``max_failures`` failed epochs in a row
                (``JobFailed``), an acquire that timed out (``AcquireTimeout``), ...
        """
        return await self._start()

    def _choose_versions(self) -> tuple[int, bool]:
        # Runs that began before v3 (leases fenced by the process itself) keep their processes'
        # protocol, so their histories replay.
        if workflow.patched(JOB_PROTOCOL_V5):
            protocol = JOB_PROTOCOL_VERSION
        elif workflow.patched(JOB_PROTOCOL_V4):
            protocol = 4
        else:
            protocol = 3 if workflow.patched(JOB_PROTOCOL_V3) else 2
        return protocol, workflow.patched(SEARCHED_STATES_ONLY)

    async def _advance(self) -> None:
        self._epoch_under_way = True
        await self._run_epoch(self._state.epochs_done)
        self._epoch_under_way = False

    # ---------------------------------------------------------------- an epoch

    async def _run_epoch(self, epoch: int) -> None:
        """Sample (on the lease carried from the last epoch, asked for ahead, or asked now);
        compute the rewards while the trainer lease is asked for; train, and checkpoint when
        one is due; the next epoch's sample is asked for as the epoch's last step ends."""
        record = EpochRecord(epoch=epoch, reward_mean=None)
        await self._sample(epoch, record)
        # One rank: the trainer lease is asked for as soon as the rewards are computed.
        train_order = self._new_order(self._config.trainer) if self._ledger.solo else None
        rewarded = await self._run_phase(
            self._phase_input(epoch, "rewards", None, prefetch=train_order)
        )
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
                self._phase_input(epoch, "sample", order, self._ledger.sample_release())
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
            epochs_this_run=self._done_this_run,
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
                self._phase_input(epoch, "train", order, plan.release, train_asks, plan.carry_into)
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
        self._done_this_run += 1
        state.failures = 0
        state.add_record(record)
        self._publish_details()

    def _rewind(self) -> None:
        super()._rewind()
        if self._epoch_under_way:  # not a failed prepare, move or final checkpoint
            self._state.redone_epochs += 1
            self._epoch_under_way = False

    # ---------------------------------------------------------------- leases and phases

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

    async def _run_phase(self, inp: PhaseInput) -> PhaseResult:
        """Run one phase of the epoch on every rank (``inp`` from ``_phase_input``)."""
        self._set_phase(inp.phase)
        lease = inp.lease
        where = f" · {lease.group_id}" if lease else " · no GPU"
        results = await self._on_all_ranks(
            _PHASE_ACTIVITIES[inp.phase],
            inp,
            PhaseResult,
            self._budget(inp.phase, lease),
            f"epoch {inp.epoch} · {inp.phase}{where}",
        )
        return results[0]

    def _note(self, record: EpochRecord, result: PhaseResult, phase: str, carried: bool) -> None:
        record.phase_s[result.phase] = result.seconds
        record.metrics.update({f"{result.phase}.{k}": v for k, v in result.metrics.items()})
        if result.group_id is not None:
            # The record keeps the hold, not the process's answer for the order asked ahead.
            record.holds.append(result.model_copy(update={"asked_ahead": None}))
            if phase not in record.wait_s:  # else the workflow timed its own acquire
                record.wait_s[phase] = 0.0 if carried else result.waited_s

    # ---------------------------------------------------------------- visibility

    def _details(self) -> list[str]:
        cfg, state = self._config, self._state
        last = state.records[-1].reward_mean if state.records else None
        lines = [
            f"**epoch**: {min(state.epochs_done, cfg.epochs)} / {cfg.epochs}",
            f"**phase**: {self._phase}",
            f"**reward mean**: {'-' if last is None else f'{last:.3f}'}",
            f"**groups**: sample on {cfg.sampler_group}, train on {cfg.trainer}",
            f"**last checkpoint**: {self._checkpoint_label(state.last_checkpoint)}",
        ]
        if state.rewinds:
            lines.append(f"**rewinds**: {state.rewinds} ({state.redone_epochs} epochs redone)")
        return lines


__all__ = ["JOB_PROTOCOL_V5", "SEARCHED_STATES_ONLY", "RLJobWorkflow"]
