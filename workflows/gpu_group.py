"""GpuGroupWorkflow: the mutex of one GPU group, with a durable, fair wait queue.

Requesters *signal* the group (request / release / cancel) and renew by a short update; the
group delivers a grant as an activity task on the waiting process's own task queue, so a hand-off
costs one workflow task and one activity dispatch, with no polling. See docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError
    from timeslice.workflows.protocol import (
        DELIVER_GRANT_ACTIVITY,
        GRANT_SIGNAL,
        GROUP_WORKFLOW_TYPE,
        RESTORE_ACTIVITY,
        SNAPSHOT_ACTIVITY,
        AcquireRequest,
        CancelRequest,
        DepartRequest,
        GrantAck,
        GrantNotice,
        GrantWait,
        GrantWaitOutcome,
        GroupConfig,
        GroupInput,
        GroupState,
        GroupStats,
        GroupStatus,
        HeldLease,
        HolderView,
        LeaseOutcome,
        LeaseRecord,
        MovedReport,
        ReleaseRequest,
        RenewRequest,
        RenewResult,
        ResidentJob,
        SnapshotTarget,
        SwitchRecord,
        Waiter,
        WaiterView,
        WaitGrant,
    )
    from timeslice.workflows.snapshot_calls import never_started, run_on_queues

_RECENT_DONE_KEEP = 2048
_DELIVERY_START_TO_CLOSE = timedelta(seconds=30)
_PARK_TIMEOUT_S = 120.0


class _Moved(Enum):
    OK = "ok"
    GONE = "gone"  # no process picked the task up: the job's processes are gone
    FAILED = "failed"


class _GroupMetrics:
    """The group's Prometheus metrics (docs/observability.md), labelled with its group id.

    Recorded through the workflow's metric meter, which drops recordings while replaying; no
    command comes of it. On a worker without a metrics endpoint they are no-ops.
    """

    def __init__(self, group_id: str) -> None:
        meter = workflow.metric_meter().with_additional_attributes({"group": group_id})
        self.queue_depth = meter.create_gauge(
            "timeslice_queue_depth", "requests waiting for the group"
        )
        self.utilization = meter.create_gauge_float(
            "timeslice_group_utilization", "share of the group's life spent held (0-1)", "1"
        )
        self.acquire_wait = meter.create_histogram_float(
            "timeslice_acquire_wait_seconds", "from request to grant", "s"
        )
        self.hold = meter.create_histogram_float(
            "timeslice_hold_seconds", "from grant to the end of the lease, by outcome", "s"
        )
        self.switch = meter.create_histogram_float(
            "timeslice_switch_seconds", "evicting the resident job and restoring the next", "s"
        )
        self.bytes_moved = meter.create_counter(
            "timeslice_moved_bytes", "bytes moved by evictions and restores", "By"
        )
        self.revoked = meter.create_counter(
            "timeslice_leases_revoked", "leases revoked because they expired unrenewed"
        )
        self.stale_releases = meter.create_counter(
            "timeslice_stale_releases", "releases naming a lease the group does not know"
        )
        self.stale_renewals = meter.create_counter(
            "timeslice_stale_renewals", "renewals of a lease that is no longer held"
        )


def _percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@workflow.defn(name=GROUP_WORKFLOW_TYPE)
class GpuGroupWorkflow:
    @workflow.init
    def __init__(self, raw_input: dict[str, Any]) -> None:
        # Validated here rather than by the data converter: a decoding error would fail the
        # workflow *task* and retry forever; bad input must fail the workflow, once, clearly.
        self._input_error: str | None = None
        try:
            inp = GroupInput.model_validate(raw_input)
        except ValidationError as err:
            self._input_error = f"invalid GpuGroupWorkflow input: {err}"
            inp = GroupInput(config=GroupConfig(group_id="invalid-input"))
        self._config = inp.config
        self._state = inp.state or GroupState(stats=GroupStats(created_at=workflow.now()))
        self._wake = False
        # Grants in flight need not hold up continue-as-new (the next run re-delivers an
        # undelivered lease; delivery is idempotent), but fault notices live nowhere else.
        self._fault_notices_in_flight = 0
        self._delivery_tasks: set[asyncio.Task[None]] = set()
        self._switching_for: str | None = None
        # request id -> the answer for its parked wait_grant update (None while undecided)
        self._parked: dict[str, GrantWait | None] = {}
        self._closing = False
        self._switch_cancelled = False
        self._metrics = _GroupMetrics(self._config.group_id)

    # ---------------------------------------------------------------- main loop

    @workflow.run
    async def run(self, raw_input: dict[str, Any]) -> None:
        if self._input_error is not None:
            raise ApplicationError(self._input_error, type="InvalidInput", non_retryable=True)
        holder = self._state.holder
        if holder is not None and not holder.delivered:
            self._start_delivery(self._notice(holder.request, holder.token, holder.waited_s, None))
        self._publish_details()
        while True:
            await self._grant_if_free()
            self._publish_details()
            if self._quiescent() and workflow.info().is_continue_as_new_suggested():
                # Parked waits must finish before this run ends: tell them to wait again on
                # the next run (their requests travel in the carried queue).
                self._closing = True
                for request_id, answer in self._parked.items():
                    if answer is None:
                        self._parked[request_id] = GrantWait(outcome=GrantWaitOutcome.RETRY)
                await workflow.wait_condition(workflow.all_handlers_finished)
                self._closing = False
                if self._quiescent():
                    self._state.stats.runs += 1
                    carried = GroupInput(config=self._config, state=self._state)
                    workflow.continue_as_new(carried.model_dump(mode="json"))
            deadline = self._next_deadline()
            timeout = None if deadline is None else (deadline - workflow.now()).total_seconds()
            if timeout is None or timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(lambda: self._wake, timeout=timeout)
            self._wake = False
            self._expire()

    def _quiescent(self) -> bool:
        return self._fault_notices_in_flight == 0 and self._switching_for is None

    def _next_deadline(self) -> datetime | None:
        deadlines = [
            w.enqueued_at + timedelta(seconds=w.request.timeout_s)
            for w in self._state.queue
            if w.request.timeout_s is not None
        ]
        holder = self._state.holder
        if holder is not None and holder.expires_at is not None:
            deadlines.append(holder.expires_at)
        return min(deadlines) if deadlines else None

    def _expire(self) -> None:
        now = workflow.now()
        holder = self._state.holder
        if holder is not None and holder.expires_at is not None and now >= holder.expires_at:
            workflow.logger.warning(
                "lease %s of job %s expired without renewal; revoking",
                holder.token,
                holder.request.job_id,
            )
            self._end_lease(LeaseOutcome.EXPIRED)
        kept: list[Waiter] = []
        for w in self._state.queue:
            t = w.request.timeout_s
            if t is not None and now >= w.enqueued_at + timedelta(seconds=t):
                self._state.stats.timed_out += 1
                self._remember_done(w.request.request_id)
            else:
                kept.append(w)
        self._state.queue = kept

    # ---------------------------------------------------------------- granting

    def _peek_next(self) -> Waiter | None:
        now = workflow.now()

        def score(w: Waiter) -> tuple[float, int]:
            waited = (now - w.enqueued_at).total_seconds()
            return (w.request.priority + waited / self._config.aging_s, -w.seq)

        return max(self._state.queue, key=score, default=None)

    def _pick_next(self) -> Waiter:
        best = self._peek_next()
        assert best is not None
        self._state.queue.remove(best)
        return best

    async def _grant_if_free(self) -> None:
        while self._state.holder is None and self._state.queue:
            waiter = self._pick_next()
            request = waiter.request
            self._switching_for = request.request_id
            self._switch_cancelled = False
            try:
                fault = await self._switch_to(request)
            finally:
                self._switching_for = None
            if self._switch_cancelled:
                continue
            now = workflow.now()
            token = self._state.next_token
            self._state.next_token += 1
            waited = (now - waiter.enqueued_at).total_seconds()
            if fault is None:
                self._state.holder = HeldLease(
                    request=request, token=token, granted_at=now, waited_s=waited
                )
                self._state.stats.leases += 1
                self._metrics.acquire_wait.record(waited)
                samples = self._state.stats.wait_samples_s
                samples.append(waited)
                del samples[: max(0, len(samples) - self._config.wait_samples_keep)]
            else:
                self._remember_done(request.request_id)
            notice = self._notice(request, token, waited, fault)
            if self._parked.get(request.request_id, False) is None:
                # Fast path: the grant is the result of the waiter's parked update, sent back
                # from this very workflow task with no dispatch on the way. The activity below
                # still runs, off the hand-off's path: it confirms the process took the grant
                # (starting its TTL) or finds it dead.
                self._parked[request.request_id] = GrantWait(
                    outcome=GrantWaitOutcome.GRANTED, notice=notice
                )
            self._start_delivery(notice)

    def _notice(
        self, request: AcquireRequest, token: int, waited: float, fault: str | None
    ) -> GrantNotice:
        return GrantNotice(
            group_id=self._config.group_id,
            request_id=request.request_id,
            job_id=request.job_id,
            reply_task_queue=request.reply_task_queue,
            reply_workflow_id=request.reply_workflow_id,
            token=token,
            ttl_s=self._ttl(request),
            waited_s=waited,
            fault=fault,
        )

    def _start_delivery(self, notice: GrantNotice) -> None:
        if notice.fault is not None:
            self._fault_notices_in_flight += 1
        delivery = asyncio.create_task(self._deliver(notice))
        self._delivery_tasks.add(delivery)
        delivery.add_done_callback(self._delivery_tasks.discard)

    def _ttl(self, request: AcquireRequest) -> float:
        return request.ttl_s if request.ttl_s is not None else self._config.default_ttl_s

    async def _deliver(self, notice: GrantNotice) -> None:
        if notice.reply_workflow_id is not None:
            await self._deliver_to_workflow(notice)
            return
        try:
            # Results are validated here, not by the converter: a malformed reply from one
            # process must not fail the group's workflow task.
            raw_ack = await workflow.execute_activity(
                DELIVER_GRANT_ACTIVITY,
                notice,
                task_queue=notice.reply_task_queue,
                schedule_to_start_timeout=timedelta(seconds=self._config.grant_ack_timeout_s),
                start_to_close_timeout=_DELIVERY_START_TO_CLOSE,
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"grant {self._config.group_id} to {notice.job_id} · token {notice.token}",
            )
            ack = GrantAck.model_validate(raw_ack)
            outcome = None if ack.accepted else LeaseOutcome.REJECTED
        except (ActivityError, ValidationError) as err:
            workflow.logger.warning(
                "job %s did not take its grant of %s (%s); skipping it",
                notice.job_id,
                self._config.group_id,
                err.cause or err,
            )
            outcome = LeaseOutcome.DEAD
        self._settle_delivery(notice, outcome)

    async def _deliver_to_workflow(self, notice: GrantNotice) -> None:
        """A workflow requester gets its grant by signal; a failed signal means it is gone."""
        assert notice.reply_workflow_id is not None
        outcome: LeaseOutcome | None = None
        try:
            handle = workflow.get_external_workflow_handle(notice.reply_workflow_id)
            await handle.signal(GRANT_SIGNAL, notice)
        except Exception as err:  # any failure to signal: the requester is closed or gone
            workflow.logger.warning(
                "workflow %s did not take its grant of %s (%s); skipping it",
                notice.reply_workflow_id,
                self._config.group_id,
                err,
            )
            outcome = LeaseOutcome.DEAD
        self._settle_delivery(notice, outcome)

    def _settle_delivery(self, notice: GrantNotice, outcome: LeaseOutcome | None) -> None:
        """Record a finished delivery: the lease's TTL starts, or the lease ends (``outcome``)."""
        if notice.fault is not None:
            self._fault_notices_in_flight -= 1
        self._wake = True
        holder = self._state.holder
        if notice.fault is not None or holder is None or holder.token != notice.token:
            return  # released, cancelled or revoked while the grant was on its way
        if outcome is None:
            holder.delivered = True
            holder.expires_at = workflow.now() + timedelta(seconds=notice.ttl_s)
        else:
            self._end_lease(outcome)

    # ---------------------------------------------------------------- residency

    async def _switch_to(self, request: AcquireRequest) -> str | None:
        """Evict the resident job if another job takes the group, then restore the new one
        (both at once when the group's memory holds both). Returns a fault message if the new
        holder's state could not be restored."""
        state = self._state
        resident = state.resident
        if resident is not None and resident.job_id == request.job_id:
            if request.snapshot is not None:
                resident.snapshot = request.snapshot
            return None
        if request.job_id in state.faulted_jobs:
            return state.faulted_jobs[request.job_id]
        await self._await_own_eviction(request)
        if request.job_id in state.faulted_jobs:
            return state.faulted_jobs[request.job_id]
        resident = state.resident
        evict = resident is not None and resident.snapshot is not None
        restore = request.snapshot is not None and request.job_id in state.evicted_jobs
        restores_itself = restore and request.restores_itself
        if restores_itself:
            # Granted at once; the holder restores its own state before it uses the group.
            state.evicted_jobs.remove(request.job_id)
            restore = False
        started = workflow.now()
        bytes_before = state.stats.bytes_moved
        overlapped = evict and restore and self._both_fit(resident, request)
        fault: str | None = None
        if overlapped:
            state.stats.overlapped_switches += 1
            _, fault = await asyncio.gather(self._evict(), self._restore(request))
        else:
            if evict:
                await self._evict()
            if restore:
                fault = await self._restore(request)
        if evict or restore or restores_itself:
            # One switch, however its moves are split between the group and the holders
            # (the holders' own moves add their time and bytes when they release).
            state.stats.switches += 1
        if evict or restore:
            ended = workflow.now()
            state.stats.switching_s += (ended - started).total_seconds()
            self._metrics.switch.record((ended - started).total_seconds())
            self._record_switch(
                SwitchRecord(
                    from_job=resident.job_id if evict and resident is not None else None,
                    to_job=request.job_id,
                    start=started,
                    end=ended,
                    bytes=state.stats.bytes_moved - bytes_before,
                    overlapped=overlapped,
                )
            )
        state.resident = (
            None
            if fault is not None
            else ResidentJob(
                job_id=request.job_id, snapshot=request.snapshot, state_bytes=request.state_bytes
            )
        )
        return fault

    async def _await_own_eviction(self, request: AcquireRequest) -> None:
        """A previous holder still moving its state out: wait for it unless both fit.

        The holder was told the next waiter fits beside it, but the waiter granted may differ
        (priorities, ageing, cancellations). If its `moved` report does not come in time, the
        group evicts it through its own snapshot activity."""
        evicting = self._state.evicting
        if evicting is None or evicting.job_id == request.job_id:
            return
        if self._both_fit(evicting, request):
            return
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._state.evicting is None, timeout=self._config.snapshot_timeout_s
            )
        evicting = self._state.evicting
        if evicting is not None:
            self._state.evicting = None
            if evicting.snapshot is not None:
                workflow.logger.warning(
                    "job %s did not report its own eviction; evicting it", evicting.job_id
                )
                await self._run_snapshot(SNAPSHOT_ACTIVITY, evicting.job_id, evicting.snapshot)

    def _record_switch(self, record: SwitchRecord) -> None:
        if self._config.history_keep:
            switches = self._state.switch_history
            switches.append(record)
            del switches[: max(0, len(switches) - self._config.history_keep)]

    def _both_fit(self, resident: ResidentJob | None, request: AcquireRequest) -> bool:
        memory = self._config.memory_bytes
        return (
            memory is not None
            and resident is not None
            and resident.state_bytes is not None
            and request.state_bytes is not None
            and resident.state_bytes + request.state_bytes <= memory
        )

    async def _evict(self) -> None:
        state = self._state
        resident = state.resident
        assert resident is not None and resident.snapshot is not None
        result = await self._run_snapshot(SNAPSHOT_ACTIVITY, resident.job_id, resident.snapshot)
        if result is _Moved.OK:
            state.stats.evictions += 1
            if resident.job_id not in state.evicted_jobs:
                state.evicted_jobs.append(resident.job_id)
        elif result is _Moved.GONE:
            # Its process is gone, and its device memory with it: nothing to evict.
            self._forget(resident.job_id)

    async def _restore(self, request: AcquireRequest) -> str | None:
        """Restore the request's job; a fault message if that failed."""
        assert request.snapshot is not None
        state = self._state
        result = await self._run_snapshot(RESTORE_ACTIVITY, request.job_id, request.snapshot)
        if result is _Moved.OK:
            state.stats.restores += 1
            state.evicted_jobs.remove(request.job_id)
            return None
        return self._fault(request.job_id, "restore found no process on a rank queue")

    def _fault(self, job_id: str, message: str) -> str:
        return self._state.faulted_jobs.setdefault(job_id, f"job {job_id}: {message}")

    def _forget(self, job_id: str) -> None:
        """The job's processes are gone: drop its residency, saved state and faults."""
        state = self._state
        if state.resident is not None and state.resident.job_id == job_id:
            state.resident = None
        if job_id in state.evicted_jobs:
            state.evicted_jobs.remove(job_id)
        if state.evicting is not None and state.evicting.job_id == job_id:
            state.evicting = None
        state.faulted_jobs.pop(job_id, None)
        state.stats.departed += 1

    async def _run_snapshot(self, activity: str, job_id: str, target: SnapshotTarget) -> _Moved:
        verb = "evict" if activity == SNAPSHOT_ACTIVITY else "restore"
        results = await run_on_queues(
            activity,
            job_id,
            target,
            context=self._config.group_id,
            pickup_timeout_s=self._config.grant_ack_timeout_s,
            run_timeout_s=self._config.snapshot_timeout_s,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for reports in results:
            if isinstance(reports, list):
                self._state.stats.bytes_moved += sum(r.bytes for r in reports)
                self._metrics.bytes_moved.add(sum(r.bytes for r in reports), {"direction": verb})
        if not failures:
            return _Moved.OK
        if all(never_started(f) for f in failures):
            workflow.logger.warning("%s of job %s: no process serves its queue", verb, job_id)
            return _Moved.GONE
        cause = next(f for f in failures if not never_started(f))
        message = f"{verb} failed: {getattr(cause, 'cause', None) or cause}"
        workflow.logger.error("job %s: %s; marking the job faulted", job_id, message)
        self._fault(job_id, message)
        self._state.stats.snapshot_failures += 1
        if job_id in self._state.evicted_jobs:
            self._state.evicted_jobs.remove(job_id)
        return _Moved.FAILED

    # ---------------------------------------------------------------- bookkeeping

    def _end_lease(self, outcome: LeaseOutcome) -> None:
        holder = self._state.holder
        assert holder is not None
        now = workflow.now()
        stats = self._state.stats
        stats.busy_s += (now - holder.granted_at).total_seconds()
        self._metrics.hold.record(
            (now - holder.granted_at).total_seconds(), {"outcome": outcome.value}
        )
        if outcome is LeaseOutcome.EXPIRED:
            self._metrics.revoked.add(1)
        counter = {
            LeaseOutcome.RELEASED: "released",
            LeaseOutcome.EXPIRED: "expired",
            LeaseOutcome.CANCELLED: "cancelled",
            LeaseOutcome.REJECTED: "rejected",
            LeaseOutcome.DEAD: "dead_waiters",
        }[outcome]
        setattr(stats, counter, getattr(stats, counter) + 1)
        if self._config.history_keep:
            history = self._state.history
            history.append(
                LeaseRecord(
                    job_id=holder.request.job_id,
                    token=holder.token,
                    start=holder.granted_at,
                    end=now,
                    outcome=outcome,
                )
            )
            del history[: max(0, len(history) - self._config.history_keep)]
        self._remember_done(holder.request.request_id)
        self._state.holder = None
        self._wake = True

    def _remember_done(self, request_id: str) -> None:
        done = self._state.recent_done
        if request_id not in done:
            done.append(request_id)
            del done[: max(0, len(done) - _RECENT_DONE_KEEP)]

    def _known(self, request_id: str) -> bool:
        state = self._state
        return (
            request_id in state.recent_done
            or request_id == self._switching_for
            or (state.holder is not None and state.holder.request.request_id == request_id)
            or any(w.request.request_id == request_id for w in state.queue)
        )

    # ---------------------------------------------------------------- messages

    @workflow.signal
    def request(self, request: AcquireRequest) -> None:
        if self._known(request.request_id):
            return  # a retried request: acquire is idempotent by request id
        self._state.queue.append(
            Waiter(request=request, seq=self._state.next_seq, enqueued_at=workflow.now())
        )
        self._state.next_seq += 1
        self._wake = True

    @workflow.signal
    def release(self, release: ReleaseRequest) -> None:
        holder = self._state.holder
        if holder is not None and holder.token == release.token:
            self._account_own_moves(holder.request.job_id, release)
            self._end_lease(LeaseOutcome.RELEASED)
        elif release.request_id not in self._state.recent_done:
            self._state.stats.stale_messages += 1
            self._metrics.stale_releases.add(1)

    def _account_own_moves(self, job_id: str, release: ReleaseRequest) -> None:
        """A holder that evicted or restored its own state: residency and accounting follow."""
        state, stats = self._state, self._state.stats
        moved = release.evicted + release.restored
        if not moved and not release.evicting:
            return
        if release.restored:
            stats.restores += 1
        if release.evicting and state.resident is not None and state.resident.job_id == job_id:
            # Its own eviction runs from now on; the bytes come with its `moved` signal, and
            # until then only a job whose state fits beside it may be restored.
            stats.evictions += 1
            state.evicting = state.resident
            state.resident = None
            if job_id not in state.evicted_jobs:
                state.evicted_jobs.append(job_id)
        if release.evicted and state.resident is not None and state.resident.job_id == job_id:
            stats.evictions += 1
            state.resident = None
            if job_id not in state.evicted_jobs:
                state.evicted_jobs.append(job_id)
        stats.bytes_moved += sum(r.bytes for r in moved)
        self._metrics.bytes_moved.add(sum(r.bytes for r in release.evicted), {"direction": "evict"})
        self._metrics.bytes_moved.add(
            sum(r.bytes for r in release.restored), {"direction": "restore"}
        )
        # Moving state is switching, not useful work, even when done inside a lease.
        seconds = sum(r.seconds for r in moved)
        stats.switching_s += seconds
        stats.busy_s -= seconds
        holder = state.holder
        assert holder is not None
        for reports, restored in ((release.restored, True), (release.evicted, False)):
            if reports:
                took = timedelta(seconds=sum(r.seconds for r in reports))
                start = holder.granted_at if restored else workflow.now() - took
                self._record_switch(
                    SwitchRecord(
                        from_job=None if restored else job_id,
                        to_job=job_id if restored else None,
                        start=start,
                        end=start + took,
                        bytes=sum(r.bytes for r in reports),
                        by_holder=True,
                    )
                )

    @workflow.signal
    def moved(self, report: MovedReport) -> None:
        """A holder's eviction after an ``evicting`` release finished: count its bytes.

        Its time is not switching time: it overlapped the next holder's restore and work, so
        its mark on the timeline has no width. A failed eviction faults the job: its state may
        still be on the device."""
        state = self._state
        if state.evicting is not None and state.evicting.job_id == report.job_id:
            state.evicting = None
            self._wake = True
        moved = sum(r.bytes for r in report.evicted)
        state.stats.bytes_moved += moved
        self._metrics.bytes_moved.add(moved, {"direction": "evict"})
        now = workflow.now()
        if moved:
            self._record_switch(
                SwitchRecord(
                    from_job=report.job_id,
                    to_job=None,
                    start=now,
                    end=now,
                    bytes=moved,
                    overlapped=True,
                    by_holder=True,
                )
            )
        if report.error is not None:
            state.stats.snapshot_failures += 1
            self._fault(report.job_id, f"its own eviction failed: {report.error}")

    @workflow.signal
    def depart(self, depart: DepartRequest) -> None:
        """A job's processes closed: its state left the device with them."""
        holder = self._state.holder
        if holder is not None and holder.request.job_id == depart.job_id:
            return  # still holding: its release (or expiry) comes first
        state = self._state
        known = (
            depart.job_id in state.evicted_jobs
            or depart.job_id in state.faulted_jobs
            or (state.resident is not None and state.resident.job_id == depart.job_id)
        )
        if known:
            self._forget(depart.job_id)
            self._wake = True

    @workflow.signal
    def cancel(self, cancel: CancelRequest) -> None:
        state = self._state
        rid = cancel.request_id
        if state.holder is not None and state.holder.request.request_id == rid:
            self._end_lease(LeaseOutcome.CANCELLED)
        elif rid == self._switching_for:
            self._switch_cancelled = True
            state.stats.cancelled += 1
        else:
            before = len(state.queue)
            state.queue = [w for w in state.queue if w.request.request_id != rid]
            if len(state.queue) != before:
                state.stats.cancelled += 1
        self._remember_done(rid)
        self._wake = True

    @workflow.update
    async def wait_grant(self, wait: WaitGrant) -> GrantWait:
        """Park until the request is granted or gone; the answer is the grant itself."""
        request_id = wait.request_id
        self._parked[request_id] = None
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: self._parked.get(request_id) is not None or self._settled(request_id),
                timeout=_PARK_TIMEOUT_S,
            )
        answer = self._parked.pop(request_id, None)
        if answer is not None:
            return answer
        if self._settled(request_id):
            return GrantWait(outcome=GrantWaitOutcome.GONE)
        return GrantWait(outcome=GrantWaitOutcome.RETRY)

    @wait_grant.validator
    def _validate_wait_grant(self, wait: WaitGrant) -> None:
        if self._closing:
            raise ValueError("the group is continuing as new; wait again on the next run")
        if wait.request_id in self._parked:
            raise ValueError(f"request {wait.request_id} is already parked")
        if len(self._parked) >= self._config.max_parked_waits:
            raise ValueError("enough waits are parked; this grant comes as an activity")

    def _settled(self, request_id: str) -> bool:
        """Nothing more to wait for: the request is done, or holds the group (granted by
        activity before the wait was parked)."""
        holder = self._state.holder
        return request_id in self._state.recent_done or (
            holder is not None and holder.request.request_id == request_id
        )

    @workflow.signal
    def renew_lease(self, renew: RenewRequest) -> None:
        """Renewal by signal, for workflow requesters (a workflow cannot send updates)."""
        self.renew(renew)

    @workflow.update
    def renew(self, renew: RenewRequest) -> RenewResult:
        holder = self._state.holder
        if holder is None or holder.token != renew.token:
            self._state.stats.stale_messages += 1
            self._metrics.stale_renewals.add(1)
            return RenewResult(valid=False, reason="the lease is no longer held (expired or moved)")
        ttl = self._ttl(holder.request)
        if holder.delivered:
            holder.expires_at = workflow.now() + timedelta(seconds=ttl)
            self._wake = True
        return RenewResult(valid=True, ttl_s=ttl)

    @renew.validator
    def _validate_renew(self, renew: RenewRequest) -> None:
        if renew.token <= 0:
            raise ValueError(f"invalid fencing token {renew.token}")

    @workflow.query
    def holder(self) -> HolderView | None:
        """The current lease only: what a running phase checks its fencing token against."""
        holder = self._state.holder
        if holder is None:
            return None
        now = workflow.now()
        return HolderView(
            job_id=holder.request.job_id,
            token=holder.token,
            held_s=(now - holder.granted_at).total_seconds(),
            expires_in_s=None
            if holder.expires_at is None
            else (holder.expires_at - now).total_seconds(),
            waiting=len(self._state.queue),
            request_id=holder.request.request_id,
            next_fits=self._next_fits(holder.request),
        )

    def _next_fits(self, holding: AcquireRequest) -> bool:
        after = self._peek_next()
        return after is not None and self._both_fit(
            ResidentJob(job_id=holding.job_id, snapshot=None, state_bytes=holding.state_bytes),
            after.request,
        )

    @workflow.query
    def status(self) -> GroupStatus:
        now = workflow.now()
        state = self._state
        stats = state.stats
        busy, wall = self._busy_and_wall(now)
        return GroupStatus(
            group_id=self._config.group_id,
            holder=self.holder(),
            queue=[
                WaiterView(
                    job_id=w.request.job_id,
                    request_id=w.request.request_id,
                    priority=w.request.priority,
                    waited_s=(now - w.enqueued_at).total_seconds(),
                )
                for w in state.queue
            ],
            resident_job=state.resident.job_id if state.resident else None,
            faulted_jobs=dict(state.faulted_jobs),
            utilization=min(1.0, busy / wall),
            wall_s=wall,
            idle_s=max(0.0, wall - busy - stats.switching_s),
            wait_p50_s=_percentile(stats.wait_samples_s, 0.50),
            wait_p99_s=_percentile(stats.wait_samples_s, 0.99),
            stats=stats,
            history=list(state.history),
            switch_history=list(state.switch_history),
        )

    def _busy_and_wall(self, now: datetime) -> tuple[float, float]:
        stats, holder = self._state.stats, self._state.holder
        busy = stats.busy_s + ((now - holder.granted_at).total_seconds() if holder else 0.0)
        return busy, max((now - stats.created_at).total_seconds(), 1e-9)

    def _publish_details(self) -> None:
        state = self._state
        holder = state.holder
        busy, wall = self._busy_and_wall(workflow.now())
        self._metrics.queue_depth.set(len(state.queue))
        self._metrics.utilization.set(min(1.0, busy / wall))
        queue = ", ".join(f"{w.request.job_id} (p{w.request.priority})" for w in state.queue)
        lines = [
            f"**holder**: {holder.request.job_id} · token {holder.token}"
            if holder
            else "**holder**: none",
            f"**resident**: {state.resident.job_id if state.resident else 'none'}",
            f"**queue**: {queue or 'empty'}",
            f"**leases**: {state.stats.leases} · switches {state.stats.switches}",
            f"**utilization so far**: {min(1.0, busy / wall):.0%}",
        ]
        workflow.set_current_details("\n\n".join(lines))


__all__ = ["GpuGroupWorkflow"]
