"""The GPU group's decisions, apart from Temporal: a composition of four named pieces.

``GroupBook`` holds a group's ``GroupState`` and answers every question the protocol asks —
who is next, what has expired, is this release valid, what a switch must move, how long the
group was held — with the time passed in. It imports nothing of Temporal, so it is unit-tested
in milliseconds (tests/unit/test_group_book.py); ``GpuGroupWorkflow`` drives it from its
handlers and runs the activities its switch plans ask for.

Each piece keeps its own part of the state and does one job; the book makes the decisions that
take more than one of them (a grant, a release, a cancel, an expiry, a report, a departure):

- ``waiters`` (:class:`~timeslice.workflows.waiter_queue.WaiterQueue`): the queue — its order
  (:func:`~timeslice.workflows.grant_policy.next_waiter`) and ageing, its bounds, time-outs;
- ``leases`` (:class:`~timeslice.workflows.lease_ledger.LeaseLedger`): the lease — fencing
  tokens, notices and their proofs, confirmation, expiry, keys, idempotency;
- ``residency`` (:class:`~timeslice.workflows.residency.Residency`): the device — resident,
  evicting, evicted and faulted jobs, switch plans;
- ``accounts`` (:class:`~timeslice.workflows.group_accounts.GroupAccounts`): counts, times,
  bytes, lease and switch records, the carried input.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from timeslice.protocol.group import (
    JOB_KEYS_KEEP,
    RECENT_DONE_KEEP,
    AcquireCall,
    AcquireRequest,
    CancelRequest,
    DepartRequest,
    GrantNotice,
    GroupConfig,
    GroupState,
    GroupStatus,
    HeldLease,
    HolderView,
    LeaseOutcome,
    LeaseReturn,
    MovedReport,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    ReturnAnswer,
    SnapshotReport,
    Waiter,
    WaiterView,
    bounded_phases,
    lease_fingerprint,
    lease_key_hash,
)
from timeslice.workflows.book_piece import Observer, SilentObserver
from timeslice.workflows.caller_budget import Caller, CallerBudgets, OverBudget
from timeslice.workflows.grant_policy import CarryLimits, decide_carry
from timeslice.workflows.group_accounts import GroupAccounts, percentile
from timeslice.workflows.lease_ledger import LeaseLedger
from timeslice.workflows.residency import Residency, SwitchDone, SwitchPlan
from timeslice.workflows.waiter_queue import WaiterQueue

__all__ = ["JOB_KEYS_KEEP", "RECENT_DONE_KEEP", "GroupBook", "SwitchDone", "SwitchPlan"]

# What the group's updates carry (per-caller fairness reads who sent it).
GroupMessage = (
    AcquireCall | LeaseReturn | RenewRequest | CancelRequest | MovedReport | DepartRequest
)


class GroupBook:
    """One group's state and every decision about it (module docstring: its pieces)."""

    def __init__(
        self, config: GroupConfig, state: GroupState, observer: Observer | None = None
    ) -> None:
        self.config = config
        self.state = state
        self.observer: Observer = observer or SilentObserver()
        self.waiters = WaiterQueue(config, state)
        self.leases = LeaseLedger(config, state, self.observer)
        self.residency = Residency(config, state)
        self.accounts = GroupAccounts(config, state, self.observer)
        # Not part of the carried state: a run's own (caller_budget.py).
        self.budgets = CallerBudgets()
        # The request a switch is running for (taken off the queue, not yet the holder).
        self.switching_for: str | None = None
        self.switching_key_hash: str | None = None
        self.switch_cancelled = False
        # Asked before a decision that differs from the FIFO one (a lease carried past
        # waiters): the workflow answers with workflow.patched, so groups that started before
        # the grant policy replay as they ran.
        self.policy_gate: Callable[[], bool] = lambda: True
        # Asked before renewing a lease whose expiry time has passed unprocessed: the workflow
        # answers with workflow.patched(LATE_RENEWAL_RENEWS), so older groups replay as they ran.
        self.late_renewal_gate: Callable[[], bool] = lambda: True
        # Whether an eviction report is asked at once where a third job could be staged
        # (``_report_can_wait``): the workflow sets it from workflow.patched(
        # EVICTION_REPORTS_FOR_STAGING) when its run starts, so older groups replay as they ran.
        self.reports_for_staging = True

    @property
    def carry_limits(self) -> CarryLimits:
        """The group's grant policy and its bounds, as ``decide_carry`` takes them."""
        c = self.config
        return CarryLimits(c.grant_policy, c.max_carries, c.carry_limit_s, c.share_slack)

    # ------------------------------------------------------------------ requests

    def known(self, request_id: str) -> bool:
        """Whether the group knows the request: queued, being switched to, holding, or done.

        Args:
            request_id: the request's id.

        Returns:
            True if asking with it again is not a new request.
        """
        return (
            self.leases.done(request_id)
            or request_id == self.switching_for
            or self.leases.holds(request_id)
            or self.waiters.has(request_id)
        )

    def settled(self, request_id: str) -> bool:
        """Whether there is nothing more to wait for: the request is done, or holds the group.

        Args:
            request_id: the request's id.

        Returns:
            True if a parked wait for it may end.
        """
        return self.leases.done(request_id) or self.leases.holds(request_id)

    def refusal(self, request: AcquireRequest) -> str | None:
        """Why a new request cannot be queued (the queue is full), or None if it can (or the
        group knows it already). Bounds what a flood of requests can make the group carry.

        Args:
            request: the request.

        Returns:
            The reason, or None.
        """
        if self.known(request.request_id):
            return None
        return self.waiters.refusal(request)

    def enqueue(self, request: AcquireRequest, now: datetime) -> bool:
        """Queue a request (acquire is idempotent).

        Args:
            request: the request.
            now: when it reached the group.

        Returns:
            False if the group knows it already (nothing queued), True if queued.
        """
        if self.known(request.request_id):
            return False
        self.waiters.append(request, now)
        return True

    def take_next(self, now: datetime) -> Waiter | None:
        """Take the best waiter off the queue: a switch to it starts.

        Args:
            now: the time the order is taken at.

        Returns:
            The waiter, or None if nobody waits.
        """
        best = self.waiters.peek_next(now)
        if best is not None:
            self.waiters.remove(best)
            self.switching_for = best.request.request_id
            self.switching_key_hash = best.request.key_hash
            self.switch_cancelled = False
        return best

    def next_deadline(self) -> datetime | None:
        """The nearest time something expires: a waiter's time-out, the holder's lease or its
        confirmation.

        Returns:
            That time, or None.
        """
        deadlines = [d for d in (self.waiters.deadline(), self.leases.deadline()) if d is not None]
        return min(deadlines) if deadlines else None

    def expire(self, now: datetime) -> None:
        """Revoke an expired lease, skip a holder that never took its grant, drop waiters whose
        own time-out has passed.

        Args:
            now: the time to judge by.
        """
        outcome = self.leases.due(now)
        if outcome is not None:
            self.end_lease(outcome, now)
        for waiter in self.waiters.drop_timed_out(now):
            self.state.stats.timed_out += 1
            self.leases.remember_done(waiter.request.request_id)

    def cancel(self, request_id: str, key: str, now: datetime) -> None:
        """Take a request back: dequeue it, or end its lease if a grant raced the give-up. Only
        its requester can: the key must match the request's (else it is counted as forged).

        Args:
            request_id: the request.
            key: the lease key its requester holds.
            now: when the cancel came.
        """
        state = self.state
        hashed = lease_key_hash(key)
        holder = state.holder
        if holder is not None and holder.request.request_id == request_id:
            if hashed != holder.request.key_hash:
                self.leases.forged_answer()
                return
            self.end_lease(LeaseOutcome.CANCELLED, now)
        elif request_id == self.switching_for:
            if hashed != self.switching_key_hash:
                self.leases.forged_answer()
                return
            self.switch_cancelled = True
            state.stats.cancelled += 1
        else:
            mine = self.waiters.waiting(request_id)
            if any(w.request.key_hash != hashed for w in mine):
                self.leases.forged_answer()
                return
            if mine:
                self.waiters.drop(request_id)
                state.stats.cancelled += 1
        self.leases.remember_done(request_id)

    # ------------------------------------------------------------------ callers

    def caller_of(self, message: GroupMessage) -> Caller | None:
        """Who sent an update, as far as its message proves (per-caller fairness): None for
        the holder's own renewal or release of its lease, which no budget limits.

        A message that presents a lease key the group knows — the holder's, a queued or
        switched-to request's, the job's last lease's — is that job's (``proven``: no one
        without the key spends its budget); one that proves nothing counts against the job it
        names (a new acquire, a report with another key) or, naming no request the group
        knows, against ``unknown``. Reads only: validators ask it.

        Args:
            message: The update's message.

        Returns:
            The caller, or None.
        """
        if isinstance(message, AcquireCall):
            return Caller(f"job {message.request.job_id} (claimed)", proven=False)
        if isinstance(message, (MovedReport, DepartRequest)):
            if self.state.job_keys.get(message.job_id) == lease_key_hash(message.key):
                return Caller(f"job {message.job_id}", proven=True)
            return Caller(f"job {message.job_id} (claimed)", proven=False)
        hashed = lease_key_hash(message.key)
        holder = self.state.holder
        if (
            holder is not None
            and holder.request.request_id == message.request_id
            and holder.request.key_hash == hashed
        ):
            lease_message = isinstance(message, RenewRequest | LeaseReturn)
            if lease_message and message.token == holder.token:
                return None  # the holder keeps or hands back its lease: never limited
            return Caller(f"job {holder.request.job_id}", proven=True)
        for waiter in self.waiters.waiting(message.request_id):
            if waiter.request.key_hash == hashed:
                return Caller(f"job {waiter.request.job_id}", proven=True)
        if message.request_id == self.switching_for and hashed == self.switching_key_hash:
            return Caller("the job switched to", proven=True)
        return Caller("unknown", proven=False)

    def over_budget(self, message: GroupMessage, now: datetime) -> OverBudget | None:
        """Whether an update's caller has sent past its budget (validators ask; a refusal
        leaves no history). Counts the refusal in ``stats.rate_limited``: the worker that
        refused it counts it, one that reloads the run from its history never sees it.

        Args:
            message: The update's message.
            now: When it is judged.

        Returns:
            Why it is refused, or None to take it.
        """
        caller = self.caller_of(message)
        over = None if caller is None else self.budgets.over(caller, now)
        if over is not None:
            self.state.stats.rate_limited += 1
        return over

    def spend_budget(self, message: GroupMessage, now: datetime) -> None:
        """An update was taken: one of its caller's budget (handlers; a replay repeats it).

        Args:
            message: The update's message.
            now: When it was taken.
        """
        caller = self.caller_of(message)
        if caller is not None:
            self.budgets.spend(caller, now)

    # ------------------------------------------------------------------ leases

    def grant(self, waiter: Waiter, now: datetime, *, parked: bool) -> GrantNotice:
        """Make ``waiter`` the holder with the next fencing token.

        A grant handed out as a parked update's result counts as delivered once the holder
        renews or releases; until then it is bounded by ``grant_ack_timeout_s``.

        Args:
            waiter: the waiter taken by :meth:`take_next`.
            now: the time of the grant.
            parked: the grant goes as the waiter's parked update's result.

        Returns:
            The grant notice, signed.
        """
        self.switching_for = self.switching_key_hash = None
        holder = self.leases.issue(waiter, now, parked=parked)
        request = waiter.request
        self.leases.remember_key(request.job_id, request.key_hash, self._tracked_jobs)
        self.accounts.granted(request, waiter.enqueued_at, holder.waited_s)
        return self.leases.notice(
            request,
            holder.token,
            holder.waited_s,
            None,
            parked=parked,
            granted_at=now,
            memory_bytes=self.residency.memory_for(request),
        )

    def holder_notice(self) -> GrantNotice | None:
        """The current lease's grant notice again, as :meth:`grant` made it (to deliver it
        again, or to answer a request asked again).

        Returns:
            The notice, or None if nobody holds the group.
        """
        holder = self.state.holder
        memory = self.residency.memory_for(holder.request) if holder is not None else None
        return self.leases.holder_notice(memory_bytes=memory)

    def refuse(self, waiter: Waiter, fault: str, now: datetime) -> GrantNotice:
        """The waiter's job is faulted: no lease, a notice saying why.

        Args:
            waiter: the waiter taken by :meth:`take_next`.
            fault: why (the job's fault).
            now: the time of the refusal.

        Returns:
            The notice, with its ``fault`` set.
        """
        self.switching_for = self.switching_key_hash = None
        token = self.leases.take_token()
        self.leases.remember_done(waiter.request.request_id)
        waited = (now - waiter.enqueued_at).total_seconds()
        return self.leases.notice(
            waiter.request, token, waited, fault, parked=False, granted_at=now
        )

    def end_lease(self, outcome: LeaseOutcome, now: datetime) -> None:
        """End the current lease: count it, record it, and free the group.

        Args:
            outcome: how it ended.
            now: when.

        Raises:
            AssertionError: if nobody holds the group.
        """
        holder = self.leases.end()
        self.accounts.lease_ended(holder, outcome, now)
        resident = self.state.resident
        if outcome is LeaseOutcome.EXPIRED and self.residency.is_resident(holder.request.job_id):
            # It never yielded: if another job takes the device before this one is granted
            # again, the group's eviction of it is a preemption.
            assert resident is not None
            resident.lease_expired = True

    def release(self, ret: LeaseReturn, now: datetime) -> ReturnAnswer:
        """A process ends (or, when nobody waits and it asks, keeps) its lease.

        Args:
            ret: the release, with what the holder moved itself and the phase it would carry
                the lease into.
            now: when it came.

        Returns:
            Whether it was valid, whether the lease ended, whether the holder is to evict its
            own state now (someone else's job is next), and why a carry was or was not kept.
        """
        holder, forged = self.leases.held(ret.request_id, ret.token, ret.key)
        if holder is None:
            if not forged and self.leases.released_before(ret.request_id, ret.token, ret.key):
                # Its first sending ended it, in a run since continued as new (in the same run
                # the server answers a sending again as it answered the first).
                return ReturnAnswer(valid=True, released=True)
            # A retried release of a lease that ended is neither stale nor forged.
            if not forged and not self.leases.done(ret.request_id):
                self.leases.stale("release")
            return ReturnAnswer(valid=False, released=False)
        self.leases.confirm(holder.token, now)
        job_id = holder.request.job_id
        self._account_own_moves(holder, ret.restored, ret.evicted, now)
        if ret.late_evictions:
            # Its eviction after an earlier lease (answered report_with_next): only bytes now.
            moved = self.accounts.count_moved("evict", ret.late_evictions)
            if moved:
                self.accounts.mark_overlapped(job_id, now, moved, by_holder=True)
        if ret.phases is not None:  # kept with the lease (a carried one reports each segment's)
            holder.phases = bounded_phases([*(holder.phases or []), *ret.phases])
        after = self.waiters.peek_next(now)
        why = ""
        if ret.carry_into is not None:
            kept, why = self._carry(holder, ret, now)
            if kept:
                return ReturnAnswer(valid=True, released=False, reason=why)
        elif ret.keep_if_uncontended and after is None:
            self.leases.extend(holder, now)
            return ReturnAnswer(valid=True, released=False)
        evict = (
            ret.evicts_itself
            and after is not None
            and after.request.job_id != job_id
            and self.residency.is_resident(job_id)
        )
        later = False
        if evict:
            assert after is not None
            later = ret.reports_with_next and self._report_can_wait(job_id, after.request)
            # Its own eviction runs from now on; until its report comes, only a job whose
            # state fits beside it may be restored.
            self.residency.evicts_itself(job_id, holder.request.key_hash, report_later=later)
        self.leases.remember_released(holder, ret.key)
        self.end_lease(LeaseOutcome.RELEASED, now)
        return ReturnAnswer(
            valid=True, released=True, evict=evict, reason=why, report_with_next=later
        )

    def _report_can_wait(self, job_id: str, after: AcquireRequest) -> bool:
        """Whether a releasing holder's eviction report may come with its next release here
        instead of at once: nothing the group does before that release needs it. The next
        holder's restore does not wait for it (its state fits beside, or they stream), and no
        third job waits whose restore might. The releasing job's own next grant does not need
        it either: its process restores its state only after its own eviction is done. Nor
        does a third job's staged restore, which cannot start beside an eviction still under
        way: where the group knows such a job, the report comes at once."""
        resident = self.state.resident
        others = {w.request.job_id for w in self.state.queue} - {job_id, after.job_id}
        if others or not self.residency.overlaps(resident, after):
            return False
        # Until the report comes, the group counts the eviction as under way, and no third
        # job's state is staged beside it: where one could be, the report is asked at once.
        return not (
            self.reports_for_staging and self.residency.could_stage_another({job_id, after.job_id})
        )

    def _carry(self, holder: HeldLease, ret: LeaseReturn, now: datetime) -> tuple[bool, str]:
        """Keep the lease into the holder's next phase if the grant policy allows: whether it
        is kept, and why."""
        assert ret.carry_into is not None
        job_id = holder.request.job_id
        share = self.accounts.waiting_share
        waiters = [
            (w.request.job_id, share(w.request.job_id, now), w.request.priority)
            for w in self.state.queue
            if w.request.job_id != job_id
        ]
        decision = decide_carry(
            self.carry_limits,
            next_phase=ret.carry_into.name,
            next_phase_s=ret.carry_into.expected_s,
            carries=holder.carries,
            holder_share=share(job_id, now),
            waiters=waiters,
            holder_priority=holder.request.priority,
        )
        if not decision.keep:
            return False, decision.reason
        if decision.contended and not self.policy_gate():
            return False, f"fifo: {len(waiters)} waiting (group started before phase-aware grants)"
        self.leases.extend(holder, now)
        if decision.contended:
            holder.carries += 1
            holder.carrying_into = ret.carry_into.name
            self.state.stats.carried += 1
        else:
            holder.carrying_into = None
        return True, decision.reason

    def release_by_signal(self, release: ReleaseRequest, now: datetime) -> None:
        """A requester workflow's release (a signal: no answer, so no eviction by the holder).

        Args:
            release: the release.
            now: when it came.
        """
        holder, forged = self.leases.held(release.request_id, release.token, release.key)
        if holder is not None:
            self._account_own_moves(holder, release.restored, release.evicted, now)
            self.end_lease(LeaseOutcome.RELEASED, now)
        elif not forged and not self.leases.done(release.request_id):
            self.leases.stale("release")

    def renew(self, renew: RenewRequest, now: datetime) -> RenewResult:
        """Renew the lease (or confirm its grant, if it was not yet taken).

        Args:
            renew: the renewal.
            now: when it came.

        Returns:
            Valid with the TTL, or not valid and why (forged, no longer held, expired).
        """
        holder, forged = self.leases.held(renew.request_id, renew.token, renew.key)
        if holder is None:
            if forged:
                return RenewResult(valid=False, reason="the lease key does not match")
            self.leases.stale("renew")
            return RenewResult(valid=False, reason="the lease is no longer held (expired or moved)")
        if (
            holder.delivered
            and holder.expires_at is not None
            and now >= holder.expires_at
            and not self.late_renewal_gate()
        ):
            # Before LATE_RENEWAL_RENEWS (group_patches.py says why it changed): a renewal
            # handled past the expiry time ended the lease even if the expiry was not processed.
            self.end_lease(LeaseOutcome.EXPIRED, now)
            return RenewResult(valid=False, reason="the lease expired before this renewal")
        if holder.delivered:
            self.leases.extend(holder, now)
        else:
            self.leases.confirm(holder.token, now)
        return RenewResult(valid=True, ttl_s=self.leases.ttl(holder.request))

    def _tracked_jobs(self) -> set[str]:
        """Jobs whose state the group keeps track of: held, resident, evicting, evicted, faulted."""
        jobs = self.residency.tracked_jobs()
        if self.state.holder is not None:
            jobs.add(self.state.holder.request.job_id)
        return jobs

    # ------------------------------------------------------------------ switches and moves

    def finish_switch(self, done: SwitchDone) -> None:
        """Count one switch and make its job resident (unless its restore failed).

        Args:
            done: the switch, as it ran.
        """
        self.accounts.switch_done(done)
        self.residency.settle(done.request, done.plan.fault)

    def eviction_done(
        self, job_id: str, *, gone: bool, ok: bool, now: datetime, preempted: bool = False
    ) -> None:
        """An eviction that ran beside a grant finished.

        Args:
            job_id: the job evicted.
            gone: the job's processes are gone, and its device memory with them.
            ok: its state was moved out (neither: it failed, and the job is faulted).
            now: when it finished.
            preempted: its lease had run out without it yielding.
        """
        self.residency.clear_evicting(job_id)
        if ok:
            self.residency.evicted(job_id, preempted=preempted)
        elif gone:
            self.forget(job_id)
        else:  # failed: the job is faulted, its state unknown
            self.residency.unsaved(job_id)

    def _account_own_moves(
        self,
        holder: HeldLease,
        restored: list[SnapshotReport],
        evicted: list[SnapshotReport],
        now: datetime,
    ) -> None:
        """A holder that moved its own state during its lease: residency and accounting follow."""
        if not restored and not evicted:
            return
        job_id = holder.request.job_id
        if restored:
            self.residency.note_restore_time(job_id, sum(r.seconds for r in restored))
        if evicted:
            self.residency.left_device(job_id)
        self.accounts.own_moves(job_id, restored, evicted, granted_at=holder.granted_at, now=now)

    def moved(
        self,
        report: MovedReport,
        now: datetime,
        *,
        marked: bool = True,
        faults_only_if_asked: bool = True,
    ) -> None:
        """A job's state left this group's device (its own eviction after a release, or a move
        to another group's device): count the bytes, forget its residency.

        Unless a switch waited for it (``marked`` False: that switch's mark carries the bytes),
        its time is not switching time here: it overlapped the next holder's restore and work
        (or belongs to the other group's switch), so its mark on the timeline has no width.

        A report that the eviction *failed* counts only from the lease the group answered
        ``evict`` (its key, while that eviction is awaited): anyone else who holds a lease under
        the job's id (docs/security.md) cannot get the job faulted. Otherwise it is stale:
        counted, never obeyed.

        Args:
            report: the job's report (its key must be its latest lease's, else it is forged).
            now: when it came.
            marked: whether to mark its bytes on the timeline.
            faults_only_if_asked: False for runs from before the rule above.
        """
        state = self.state
        job_id = report.job_id
        if not self.leases.job_key_matches(job_id, report.key):
            return
        if (
            report.error is not None
            and faults_only_if_asked
            and not self.residency.asked_to_evict(job_id, report.key)
        ):
            state.stats.stale_messages += 1
            return
        self.residency.clear_evicting(job_id)
        if report.error is None:
            self.residency.left_device(job_id)
        moved = self.accounts.count_moved("evict", report.evicted)
        if moved and marked:
            self.accounts.mark_overlapped(job_id, now, moved, by_holder=True)
        if report.error is not None:
            state.stats.snapshot_failures += 1
            self.residency.fault(job_id, f"its own eviction failed: {report.error}")

    def depart(self, job_id: str, key: str) -> bool:
        """A job's processes closed: its state left the device with them.

        Args:
            job_id: the job.
            key: its latest lease's key.

        Returns:
            Whether the group tracked its state (and forgot it now); False if it still holds
            the group or the key is not its latest lease's.
        """
        holder = self.state.holder
        if holder is not None and holder.request.job_id == job_id:
            return False  # still holding: its release (or expiry) comes first
        if not self.leases.job_key_matches(job_id, key):
            return False
        known = self.residency.knows(job_id)
        if known:
            self.forget(job_id)
        return known

    def evictor_gone(self, job_id: str) -> None:
        """The job answered ``evict`` never reported, and the group's own eviction found no
        process on its queues: its processes are gone, and its device state with them.

        Args:
            job_id: the job.
        """
        self.forget(job_id)

    def forget(self, job_id: str) -> None:
        """The job's processes are gone: drop its residency, saved state, faults and key.

        Args:
            job_id: the job.
        """
        self.residency.forget(job_id)
        self.leases.forget_key(job_id)

    # ------------------------------------------------------------------ views

    def busy_and_wall(self, now: datetime) -> tuple[float, float]:
        """The seconds the group was held (the current lease so far included), and its life.

        Args:
            now: the time the figures are taken at.

        Returns:
            ``(held seconds, seconds since the group's creation)``, the latter above 0.
        """
        stats, holder = self.state.stats, self.state.holder
        busy = stats.busy_s + ((now - holder.granted_at).total_seconds() if holder else 0.0)
        return busy, max((now - stats.created_at).total_seconds(), 1e-9)

    def held_share(self, now: datetime) -> float:
        """The share of its life the group was held (GroupStatus.held_share).

        Args:
            now: the time the share is taken at.

        Returns:
            0 to 1.
        """
        busy, wall = self.busy_and_wall(now)
        return min(1.0, max(0.0, busy / wall))

    def holder_view(self, now: datetime) -> HolderView | None:
        """The current lease as the ``holder`` query shows it (what a phase checks its fencing
        token against).

        Args:
            now: the time the view is taken at.

        Returns:
            The view, or None if nobody holds the group.
        """
        holder = self.state.holder
        if holder is None:
            return None
        return HolderView(
            job_id=holder.request.job_id,
            token=holder.token,
            held_s=(now - holder.granted_at).total_seconds(),
            expires_in_s=None
            if holder.expires_at is None
            else (holder.expires_at - now).total_seconds(),
            waiting=len(self.state.queue),
            request_id=holder.request.request_id,
            carrying_into=holder.carrying_into,
            fingerprint=lease_fingerprint(holder.request.key_hash, holder.token),
        )

    def status(self, now: datetime) -> GroupStatus:
        """The group's status: holder, queue, residency, faults, figures, records.

        Args:
            now: the time the status is taken at.

        Returns:
            What the ``status`` query answers.
        """
        state = self.state
        stats = state.stats
        busy, wall = self.busy_and_wall(now)
        return GroupStatus(
            group_id=self.config.group_id,
            holder=self.holder_view(now),
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
            staged_job=state.staged.job_id if state.staged else None,
            faulted_jobs=dict(state.faulted_jobs),
            held_share=min(1.0, max(0.0, busy / wall)),
            wall_s=wall,
            idle_s=max(0.0, wall - busy - stats.switching_s),
            wait_p50_s=percentile(stats.wait_samples_s, 0.50),
            wait_p99_s=percentile(stats.wait_samples_s, 0.99),
            stats=stats,
            history=list(state.history),
            switch_history=list(state.switch_history),
            as_of=now,
            next_deadline=self.next_deadline(),
        )

    def details(self, now: datetime) -> str:
        """The group's current details in the Temporal UI.

        Args:
            now: the time the details are taken at.

        Returns:
            Markdown: holder, resident, queue, leases and switches, the share held so far.
        """
        state = self.state
        holder = state.holder
        queue = ", ".join(f"{w.request.job_id} (p{w.request.priority})" for w in state.queue)
        lines = [
            f"**holder**: {holder.request.job_id} · token {holder.token}"
            if holder
            else "**holder**: none",
            f"**resident**: {state.resident.job_id if state.resident else 'none'}"
            + (f" · staged: {state.staged.job_id}" if state.staged else ""),
            f"**queue**: {queue or 'empty'}",
            f"**leases**: {state.stats.leases} · switches {state.stats.switches}",
            # The group sees leases, not phases: its utilization proper is `timeslice status`'s.
            f"**held so far**: {self.held_share(now):.0%} (utilization: `timeslice status`)",
        ]
        return "\n\n".join(lines)
