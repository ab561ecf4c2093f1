"""GpuGroupWorkflow: the mutex of one GPU group, with a durable, fair wait queue.

The decisions live in :class:`~timeslice.workflows.group_book.GroupBook`; this file is the story
of the protocol on Temporal:

- processes send **updates** — ``acquire`` (queue a request and park until it is granted: the
  grant is the update's result), ``release_lease`` (the answer says whether to move the state
  out), ``renew``, ``cancel_request``, ``report_moved``, ``depart_job``;
- requester *workflows* send **signals** (``request``, ``release``, ``renew_lease``, ``cancel``)
  and get their grant by signal;
- the main loop grants the best waiter whenever the group is free, running the switch's
  snapshot / restore activities on the jobs' queues, and expires leases and waiters on durable
  timers — nothing polls.

See docs/architecture.md for why processes use updates (continue-as-new) and how a grant travels.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from timeslice.protocol.group import (
    CARRY_CEILING_BYTES,
    DELIVER_GRANT_ACTIVITY,
    GRANT_SIGNAL,
    GROUP_WORKFLOW_TYPE,
    RATE_LIMITED,
    AcquireAnswer,
    AcquireCall,
    AcquireOutcome,
    AcquireRequest,
    CancelRequest,
    DepartRequest,
    GrantAck,
    GrantNotice,
    GroupConfig,
    GroupInput,
    GroupQuery,
    GroupSignal,
    GroupState,
    GroupStats,
    GroupStatus,
    GroupUpdate,
    HolderView,
    LeaseOutcome,
    LeaseReturn,
    MalformedMessage,
    MovedReport,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    ReturnAnswer,
    parse_message,
)
from timeslice.protocol.group import GROUP_MESSAGE_ABOUT as ABOUT
from timeslice.workflows.deadline_timer import DeadlineTimer
from timeslice.workflows.group_book import GroupBook, GroupMessage
from timeslice.workflows.group_patches import (
    AGENT_QUEUES_WAITED_FOR,
    AUTHENTICATED_GRANT_ANSWERS,
    BOUNDED_GRANT_DELIVERY,
    CONFIRMED_GRANT_OUTLIVES_DELIVERY,
    EVICTION_REPORTS_FOR_STAGING,
    FAULT_ONLY_ASKED_EVICTION,
    LATE_RENEWAL_RENEWS,
    ONE_DEADLINE_TIMER,
    PATCHES_AT_START,
    PHASE_AWARE_GRANTS,
    STREAMED_SWITCHES,
    UNCONFIRMED_EVICTIONS_KEPT,
)
from timeslice.workflows.group_switch import GroupSwitch
from timeslice.workflows.inputs import fail_on_bad_input, parse_input

_DELIVERY_START_TO_CLOSE = timedelta(seconds=30)
_PARK_TIMEOUT_S = 120.0
M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")


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
        self.held_share = meter.create_gauge_float(
            "timeslice_group_held_share", "share of the group's life spent held (0-1)", "1"
        )
        self._acquire_wait = meter.create_histogram_float(
            "timeslice_acquire_wait_seconds", "from request to grant", "s"
        )
        self._hold = meter.create_histogram_float(
            "timeslice_hold_seconds", "from grant to the end of the lease, by outcome", "s"
        )
        self._switch = meter.create_histogram_float(
            "timeslice_switch_seconds", "evicting the resident job and restoring the next", "s"
        )
        self._bytes_moved = meter.create_counter(
            "timeslice_moved_bytes", "bytes moved by evictions and restores", "By"
        )
        self._revoked = meter.create_counter(
            "timeslice_leases_revoked", "leases revoked because they expired unrenewed"
        )
        self.rate_limited = meter.create_counter(
            "timeslice_rate_limited_updates",
            "updates refused because their caller sent past its rate (no history kept)",
        )
        self._stale = {
            "release": meter.create_counter(
                "timeslice_stale_releases", "releases naming a lease the group does not know"
            ),
            "renew": meter.create_counter(
                "timeslice_stale_renewals", "renewals of a lease that is no longer held"
            ),
            "forged": meter.create_counter(
                "timeslice_forged_messages",
                "releases, renewals, cancels, reports and departures with a wrong lease key, "
                "and grant deliveries answered without the request's key",
            ),
        }

    # GroupBook's Observer
    def granted(self, waited_s: float) -> None:
        self._acquire_wait.record(waited_s)

    def lease_ended(self, outcome: LeaseOutcome, held_s: float) -> None:
        self._hold.record(held_s, {"outcome": outcome.value})
        if outcome is LeaseOutcome.EXPIRED:
            self._revoked.add(1)

    def stale(self, kind: str) -> None:
        self._stale[kind].add(1)

    def moved(self, direction: str, nbytes: int) -> None:
        self._bytes_moved.add(nbytes, {"direction": direction})

    def switched(self, seconds: float) -> None:
        self._switch.record(seconds)


def _parses_within_budget(model: type[GroupMessage], what: str) -> Callable[..., None]:
    """An update validator (as ``inputs.parses``) that also refuses a caller past its rate."""

    # Its parameters must be the update method's, annotations included (Temporal checks).
    def validate(self, *raw: Any) -> None:
        self._within_budget(parse_message(model, raw, what))

    return validate


@workflow.defn(name=GROUP_WORKFLOW_TYPE)
class GpuGroupWorkflow:
    @workflow.init
    def __init__(self, *raw: Any) -> None:
        # First, before any handler can ask a patch (group_patches.PATCHES_AT_START).
        self._patched_at_start = workflow.patched(PATCHES_AT_START)
        reports_for_staging = workflow.patched(EVICTION_REPORTS_FOR_STAGING)
        evictions_kept = workflow.patched(UNCONFIRMED_EVICTIONS_KEPT)
        agents_waited_for = workflow.patched(AGENT_QUEUES_WAITED_FOR)
        inp, self._input_error = parse_input(
            GroupInput,
            raw,
            "GpuGroupWorkflow",
            lambda: GroupInput(config=GroupConfig(group_id="invalid-input")),
        )
        self._config = inp.config
        self._metrics = _GroupMetrics(self._config.group_id)
        self._book = GroupBook(
            self._config,
            inp.state or GroupState(stats=GroupStats(created_at=workflow.now())),
            self._metrics,
        )
        self._book.policy_gate = lambda: self._patched(PHASE_AWARE_GRANTS)
        self._book.residency.stream_gate = lambda: self._patched(STREAMED_SWITCHES)
        self._book.late_renewal_gate = self._late_renewal_renews
        self._book.reports_for_staging = reports_for_staging
        self._book.residency.keeps_unconfirmed = evictions_kept
        self._late_renewal: bool | None = None  # the LATE_RENEWAL_RENEWS patch's answer, once asked
        self._wake = False
        # Fault notices live nowhere else, so they hold up continue-as-new; so does any
        # delivery activity (its completion arriving during continue-as-new would fail it).
        self._fault_notices_in_flight = 0
        self._delivery_tasks: set[asyncio.Task[None]] = set()
        # request id -> the answer for its parked `acquire` update (None while undecided)
        self._parked: dict[str, AcquireAnswer | None] = {}
        self._closing = False
        self._unfit_logged = False
        # With ONE_DEADLINE_TIMER: the deadlines that are not the book's, by what waits on them.
        self._park_deadlines: dict[str, datetime] = {}
        self._timer = DeadlineTimer(self._deadline_passed)
        self._switch = GroupSwitch(
            self._book,
            self._config,
            wake=self._wake_up,
            one_timer=self._one_timer,
            set_timer=self._set_timer,
            patched=self._patched,
        )
        self._switch.agents_waited_for = agents_waited_for

    # ---------------------------------------------------------------- main loop

    @workflow.run
    async def run(self, *raw: Any) -> None:
        fail_on_bad_input(self._input_error)
        holder = self._book.state.holder
        if holder is not None and not holder.delivered and holder.confirm_by is None:
            # Granted by activity or signal in the last run, not yet confirmed: deliver again
            # (the process's inbox answers a duplicate grant as accepted).
            notice = self._book.holder_notice()
            assert notice is not None
            self._start_delivery(notice)
        self._publish_details()
        one_timer = self._one_timer()
        while True:
            await self._grant_if_free()
            self._switch.stage_next()
            self._publish_details()
            if self._quiescent() and workflow.info().is_continue_as_new_suggested():
                await self._continue_as_new()
            deadline = self._book.next_deadline()
            if one_timer:
                if deadline is None or deadline > workflow.now():
                    self._set_timer()
                    await workflow.wait_condition(lambda: self._wake)
            else:
                timeout = None if deadline is None else (deadline - workflow.now()).total_seconds()
                if timeout is None or timeout > 0:
                    with contextlib.suppress(TimeoutError):
                        await workflow.wait_condition(lambda: self._wake, timeout=timeout)
            self._wake = False
            self._book.expire(workflow.now())

    def _patched(self, patch_id: str) -> bool:
        """Whether this run takes ``patch_id``'s branch: always, in a run that recorded
        PATCHES_AT_START; otherwise as ``workflow.patched`` answers (groups from before it)."""
        return self._patched_at_start or workflow.patched(patch_id)

    def _one_timer(self) -> bool:
        return self._patched(ONE_DEADLINE_TIMER)

    def _wake_up(self) -> None:
        self._wake = True

    def _set_timer(self) -> None:
        """Keep the one timer set for the earliest deadline still ahead."""
        now = workflow.now()
        ahead = [
            d
            for d in (self._book.next_deadline(), self._switch.report_deadline)
            if d is not None and d > now
        ]
        ahead.extend(d for d in self._park_deadlines.values() if d > now)
        if ahead:
            self._timer.set_for(min(ahead))

    def _deadline_passed(self) -> None:
        # The waits see the time move on (their conditions read workflow.now()); the main loop
        # expires what is due. The next deadline gets the timer now, even while the main loop
        # is busy with a switch and cannot set it.
        self._wake = True
        self._set_timer()

    def _quiescent(self) -> bool:
        return (
            self._fault_notices_in_flight == 0
            and self._book.switching_for is None
            and not self._delivery_tasks
            and not self._switch.evictions
            and self._switch.staging is None
        )

    async def _continue_as_new(self) -> None:
        if not self._carriable():
            return  # checked first: parked waits told to retry would retry for nothing
        # Parked waits must finish before this run ends: they are told to ask again, and their
        # requests travel in the carried queue.
        self._closing = True
        for request_id, answer in self._parked.items():
            if answer is None:
                self._parked[request_id] = AcquireAnswer(outcome=AcquireOutcome.RETRY)
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._closing = False
        if self._quiescent() and self._carriable():
            workflow.continue_as_new(self._book.accounts.next_run_input())

    def _carriable(self) -> bool:
        """Whether the next run's input fits Temporal's payload limit (shedding the oldest
        history first if it is over the budget, which only a state carried from before the
        bounds can be). If not even that does, the group keeps serving in this run rather than
        send an input the server refuses: a continue-as-new task failing forever."""
        book = self._book
        _, size, shed = book.accounts.carried_input()
        if shed:
            workflow.logger.warning(
                "group %s shed its %d oldest lease and switch records so that its "
                "continue-as-new input fits (%d bytes now)",
                self._config.group_id,
                shed,
                size,
            )
        if size <= CARRY_CEILING_BYTES:
            return True
        if not self._unfit_logged:
            self._unfit_logged = True
            workflow.logger.error(
                "group %s cannot continue as new: its state takes %d bytes, over %d even "
                "without history; it keeps serving in this run",
                self._config.group_id,
                size,
                CARRY_CEILING_BYTES,
            )
        return False

    # ---------------------------------------------------------------- granting

    async def _grant_if_free(self) -> None:
        book = self._book
        while book.state.holder is None and book.state.queue:
            waiter = book.take_next(workflow.now())
            assert waiter is not None
            request = waiter.request
            try:
                fault = await self._switch.switch_to(request)
            finally:
                if book.switch_cancelled:
                    book.switching_for = book.switching_key_hash = None
            if book.switch_cancelled:
                continue
            now = workflow.now()
            rid = request.request_id
            parked = self._parked.get(rid, False) is None
            if fault is None:
                notice = book.grant(waiter, now, parked=parked)
            else:
                notice = book.refuse(waiter, fault, now)
            if parked:
                # The fast path: the grant is the result of the waiter's parked update, sent
                # back from this very workflow task with no task dispatch on the way.
                self._parked[rid] = AcquireAnswer(outcome=AcquireOutcome.GRANTED, notice=notice)
            else:
                self._start_delivery(notice)

    def _start_delivery(self, notice: GrantNotice) -> None:
        if notice.fault is not None:
            self._fault_notices_in_flight += 1
        delivery = asyncio.create_task(self._deliver(notice))
        self._delivery_tasks.add(delivery)
        delivery.add_done_callback(self._delivery_tasks.discard)

    async def _deliver(self, notice: GrantNotice) -> None:
        outcome: LeaseOutcome | None = None
        bounded = False  # a delivery by signal: its outcome is the server's, never forged
        # The process's answer, if it presented the request's key (see GrantAck).
        answer_key: str | None = None
        answered = False
        if notice.reply_workflow_id is not None:
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
        else:
            # A lost waiter (its process took the task and stopped) holds the group for the
            # confirmation window counted from the grant, not for a 30-s delivery and a
            # window after it (docs/architecture.md, "Limits").
            bounded = self._patched(BOUNDED_GRANT_DELIVERY)
            ack_timeout = timedelta(seconds=self._config.grant_ack_timeout_s)
            try:
                # Results are validated here, not by the converter: a malformed reply from one
                # process must not fail the group's workflow task.
                raw_ack = await workflow.execute_activity(
                    DELIVER_GRANT_ACTIVITY,
                    notice,
                    task_queue=notice.reply_task_queue,
                    schedule_to_start_timeout=ack_timeout,
                    start_to_close_timeout=ack_timeout if bounded else _DELIVERY_START_TO_CLOSE,
                    retry_policy=RetryPolicy(maximum_attempts=1),
                    summary=f"grant {self._config.group_id} to {notice.job_id} · "
                    f"token {notice.token}",
                )
                ack = GrantAck.model_validate(raw_ack)
                answered, answer_key = True, ack.key
                if not ack.accepted:
                    outcome = LeaseOutcome.REJECTED
            except (ActivityError, ValidationError) as err:
                workflow.logger.warning(
                    "job %s did not take its grant of %s (%s); skipping it",
                    notice.job_id,
                    self._config.group_id,
                    err.cause if isinstance(err, ActivityError) else err,
                )
                outcome = LeaseOutcome.DEAD
        if notice.fault is not None:
            self._fault_notices_in_flight -= 1
        self._wake = True
        holder = self._book.state.holder
        if notice.fault is not None or holder is None or holder.token != notice.token:
            return  # released, cancelled or revoked while the grant was on its way
        now = workflow.now()
        if (
            notice.reply_task_queue is not None
            and self._patched(AUTHENTICATED_GRANT_ANSWERS)
            and not self._book.leases.answer_is_proven(notice.token, answer_key)
        ):
            # Anyone in the namespace can complete or fail an activity by its id: an outcome
            # without the key may hide a grant the process took, so it ends nothing. The
            # holder's renewal or release confirms the lease, or it ends as dead.
            if answered:
                self._book.leases.forged_answer()
            self._book.leases.unconfirmed(notice.token, now, from_grant=bounded)
        elif outcome is None:
            self._book.leases.confirm(notice.token, now)
        elif holder.delivered and self._patched(CONFIRMED_GRANT_OUTLIVES_DELIVERY):
            # The holder confirmed the grant by a renewal while this activity was on its way
            # (it took the grant by asking again): it holds it, whatever became of the activity.
            workflow.logger.info(
                "job %s confirmed its grant of %s before its delivery ended (%s); kept",
                notice.job_id,
                self._config.group_id,
                outcome.value,
            )
        else:
            self._book.end_lease(outcome, now)

    # ---------------------------------------------------------------- updates (processes)

    # Every handler takes its argument raw (``*raw``) and parses it itself: a missing, extra,
    # undecodable or invalid argument must not fail the workflow task. Updates are refused by
    # their validator (the sender gets the reason); signals are dropped and counted.

    @workflow.update(name=GroupUpdate.ACQUIRE, description=ABOUT[GroupUpdate.ACQUIRE])
    async def acquire(self, *raw: Any) -> AcquireAnswer:
        book = self._book
        call = parse_message(AcquireCall, raw, "the acquire update")
        self._spend(call)
        request = call.request
        refusal = book.refusal(request)
        if refusal is not None:  # the validator refuses it first; a replay finds the same
            raise ApplicationError(refusal, type="QueueFull", non_retryable=True)
        rid = request.request_id
        if book.leases.holds(rid):
            return AcquireAnswer(outcome=AcquireOutcome.GRANTED, notice=book.holder_notice())
        if book.leases.done(rid):
            return AcquireAnswer(outcome=AcquireOutcome.GONE)
        busy = book.state.holder is not None or book.state.queue or book.switching_for
        if call.only_if_free and busy and not book.known(rid):
            return AcquireAnswer(outcome=AcquireOutcome.GONE)
        if book.enqueue(request, workflow.now()):
            self._wake = True
        if self._closing:
            return AcquireAnswer(outcome=AcquireOutcome.RETRY)  # park on the next run
        if (
            not call.park
            or request.reply_workflow_id is not None
            or rid in self._parked
            or len(self._parked) >= self._config.max_parked_waits
        ):
            return AcquireAnswer(outcome=AcquireOutcome.QUEUED)
        self._parked[rid] = None
        if self._one_timer():
            give_up_at = workflow.now() + timedelta(seconds=_PARK_TIMEOUT_S)
            self._park_deadlines[rid] = give_up_at
            self._set_timer()
            try:
                await workflow.wait_condition(
                    lambda: (
                        self._parked.get(rid) is not None
                        or book.settled(rid)
                        or workflow.now() >= give_up_at
                    )
                )
            finally:
                self._park_deadlines.pop(rid, None)
        else:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self._parked.get(rid) is not None or book.settled(rid),
                    timeout=_PARK_TIMEOUT_S,
                )
        answer = self._parked.pop(rid, None)
        if answer is not None:
            return answer
        if book.leases.holds(rid):  # granted by another path while parked
            return AcquireAnswer(outcome=AcquireOutcome.GRANTED, notice=book.holder_notice())
        if book.settled(rid):
            return AcquireAnswer(outcome=AcquireOutcome.GONE)
        return AcquireAnswer(outcome=AcquireOutcome.RETRY)

    @acquire.validator
    def _validate_acquire(self, *raw: Any) -> None:
        call = parse_message(AcquireCall, raw, "the acquire update")
        self._within_budget(call)
        refusal = self._book.refusal(call.request)
        if refusal is not None:
            raise ValueError(refusal)

    def _within_budget(self, message: GroupMessage) -> None:
        """Refuse an update whose caller has sent past its rate (validators only)."""
        over = self._book.over_budget(message, workflow.now())
        if over is not None:
            self._metrics.rate_limited.add(1)
            raise ApplicationError(
                over.explain(self._config.group_id),
                over.wait_s,
                type=RATE_LIMITED,
                non_retryable=True,
            )

    def _spend(self, message: GroupMessage) -> None:
        self._book.spend_budget(message, workflow.now())

    def _obey(self, message: M, act: Callable[[M, datetime], R]) -> R:
        """Have the book act on a valid message now, and wake the main loop to follow up."""
        result = act(message, workflow.now())
        self._wake = True
        return result

    @workflow.update(name=GroupUpdate.RELEASE, description=ABOUT[GroupUpdate.RELEASE])
    def release_lease(self, *raw: Any) -> ReturnAnswer:
        ret = parse_message(LeaseReturn, raw, "the release_lease update")
        self._spend(ret)
        return self._obey(ret, self._book.release)

    release_lease.validator(_parses_within_budget(LeaseReturn, "the release_lease update"))

    @workflow.update(name=GroupUpdate.RENEW, description=ABOUT[GroupUpdate.RENEW])
    def renew(self, *raw: Any) -> RenewResult:
        renew = parse_message(RenewRequest, raw, "the renew update")
        self._spend(renew)
        return self._obey(renew, self._book.renew)

    @renew.validator
    def _validate_renew(self, *raw: Any) -> None:
        renew = parse_message(RenewRequest, raw, "the renew update")
        if renew.token <= 0:
            raise ValueError(f"invalid fencing token {renew.token}")
        self._within_budget(renew)

    @workflow.update(name=GroupUpdate.CANCEL, description=ABOUT[GroupUpdate.CANCEL])
    def cancel_request(self, *raw: Any) -> None:
        cancel = parse_message(CancelRequest, raw, "the cancel_request update")
        self._spend(cancel)
        self._obey(cancel, self._cancel)

    def _cancel(self, cancel: CancelRequest, now: datetime) -> None:
        self._book.cancel(cancel.request_id, cancel.key, now)

    cancel_request.validator(_parses_within_budget(CancelRequest, "the cancel_request update"))

    @workflow.update(name=GroupUpdate.MOVED, description=ABOUT[GroupUpdate.MOVED])
    def report_moved(self, *raw: Any) -> None:
        report = parse_message(MovedReport, raw, "the report_moved update")
        self._spend(report)
        awaited = report.job_id == self._switch.awaiting_eviction_of
        asked_only = report.error is None or self._patched(FAULT_ONLY_ASKED_EVICTION)
        self._book.moved(
            report, workflow.now(), marked=not awaited, faults_only_if_asked=asked_only
        )
        self._wake = True

    report_moved.validator(_parses_within_budget(MovedReport, "the report_moved update"))

    @workflow.update(name=GroupUpdate.DEPART, description=ABOUT[GroupUpdate.DEPART])
    def depart_job(self, *raw: Any) -> bool:
        depart = parse_message(DepartRequest, raw, "the depart_job update")
        self._spend(depart)
        return self._obey(depart, lambda d, _: self._book.depart(d.job_id, d.key))

    depart_job.validator(_parses_within_budget(DepartRequest, "the depart_job update"))

    # ---------------------------------------------------------------- signals (workflows)

    def _signal_arg(self, model: type[M], raw: tuple[Any, ...], name: str) -> M | None:
        """The signal's message, or None (dropped and counted) if it is not a valid one."""
        try:
            return parse_message(model, raw, f"the {name} signal")
        except MalformedMessage as err:
            self._book.accounts.dropped("malformed")
            workflow.logger.warning("group %s dropped %s", self._config.group_id, err)
            return None

    @workflow.signal(name=GroupSignal.REQUEST, description=ABOUT[GroupSignal.REQUEST])
    def request(self, *raw: Any) -> None:
        request = self._signal_arg(AcquireRequest, raw, GroupSignal.REQUEST)
        if request is None:
            return
        refusal = self._book.refusal(request)
        if refusal is not None:
            self._book.accounts.dropped("refused")
            workflow.logger.warning("dropped request %s: %s", request.request_id, refusal)
        elif self._book.enqueue(request, workflow.now()):
            self._wake = True

    @workflow.signal(name=GroupSignal.RELEASE, description=ABOUT[GroupSignal.RELEASE])
    def release(self, *raw: Any) -> None:
        release = self._signal_arg(ReleaseRequest, raw, GroupSignal.RELEASE)
        if release is not None:
            self._obey(release, self._book.release_by_signal)

    @workflow.signal(name=GroupSignal.RENEW, description=ABOUT[GroupSignal.RENEW])
    def renew_lease(self, *raw: Any) -> None:
        renew = self._signal_arg(RenewRequest, raw, GroupSignal.RENEW)
        if renew is not None:
            self._obey(renew, self._book.renew)

    @workflow.signal(name=GroupSignal.CANCEL, description=ABOUT[GroupSignal.CANCEL])
    def cancel(self, *raw: Any) -> None:
        cancel = self._signal_arg(CancelRequest, raw, GroupSignal.CANCEL)
        if cancel is not None:
            self._obey(cancel, self._cancel)

    # ---------------------------------------------------------------- queries and the UI

    @workflow.query(name=GroupQuery.HOLDER, description=ABOUT[GroupQuery.HOLDER])
    def holder(self) -> HolderView | None:
        return self._book.holder_view(workflow.now())

    @workflow.query(name=GroupQuery.STATUS, description=ABOUT[GroupQuery.STATUS])
    def status(self) -> GroupStatus:
        return self._book.status(workflow.now())

    @workflow.query(name=GroupQuery.RENEWAL_RULE, description=ABOUT[GroupQuery.RENEWAL_RULE])
    def renewal_rule(self) -> bool:
        # The SDK keeps a patch's first answer for the rest of the run: a run that replayed a
        # late renewal down the old branch stays on it. Not asked yet, it is asked live (no
        # history to replay), which takes the new branch.
        return self._late_renewal is not False

    def _late_renewal_renews(self) -> bool:
        self._late_renewal = self._patched(LATE_RENEWAL_RENEWS)
        return self._late_renewal

    def _publish_details(self) -> None:
        now = workflow.now()
        self._metrics.queue_depth.set(len(self._book.state.queue))
        self._metrics.held_share.set(self._book.held_share(now))
        workflow.set_current_details(self._book.details(now))


__all__ = ["GpuGroupWorkflow"]
