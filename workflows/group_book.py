"""The GPU group's decisions, apart from Temporal: queue, leases, residency and accounting.

``GroupBook`` holds a group's ``GroupState`` and answers every question the protocol asks —
who is next, what has expired, is this release valid, what a switch must move, what the
utilization is — with the time passed in. It imports nothing of Temporal, so it is unit-tested
in milliseconds (tests/unit/test_group_book.py); ``GpuGroupWorkflow`` drives it from its
handlers and runs the activities its switch plans ask for.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from timeslice.protocol.group import (
    CARRIED_STATE_BUDGET_BYTES,
    EVICTED_JOBS_KEEP,
    FAULTED_JOBS_KEEP,
    JOB_KEYS_KEEP,
    MAX_FAULT_BYTES,
    MAX_QUEUE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_WAITERS,
    RECENT_DONE_KEEP,
    AcquireRequest,
    GrantNotice,
    GroupConfig,
    GroupInput,
    GroupState,
    GroupStatus,
    HeldLease,
    HolderView,
    LeaseOutcome,
    LeaseRecord,
    LeaseReturn,
    MovedReport,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    ResidentJob,
    ReturnAnswer,
    SnapshotReport,
    SwitchRecord,
    Waiter,
    WaiterView,
    bounded_phases,
    cut_to_encoded,
    encoded_size,
    lease_fingerprint,
    lease_key_hash,
    prove_notice,
)
from timeslice.workflows.grant_policy import (
    CarryLimits,
    decide_carry,
    record_wait,
    remember_job,
    waiting_share,
)

__all__ = ["JOB_KEYS_KEEP", "RECENT_DONE_KEEP", "GroupBook", "SwitchPlan"]
# Deadlines further out than this are treated as none: a datetime cannot hold them, and a
# waiter that patient is, for every purpose, waiting forever.
FAR_FUTURE_S = 10 * 365 * 86_400.0


class Observer(Protocol):
    """Where the book reports what metrics count (the workflow's metric meter)."""

    def granted(self, waited_s: float) -> None: ...
    def lease_ended(self, outcome: LeaseOutcome, held_s: float) -> None: ...
    def stale(self, kind: str) -> None: ...
    def moved(self, direction: str, nbytes: int) -> None: ...
    def switched(self, seconds: float) -> None: ...


class _Silent:
    def granted(self, waited_s: float) -> None: ...
    def lease_ended(self, outcome: LeaseOutcome, held_s: float) -> None: ...
    def stale(self, kind: str) -> None: ...
    def moved(self, direction: str, nbytes: int) -> None: ...
    def switched(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class SwitchPlan:
    """What granting ``request`` moves: the resident job out, the new holder's state in."""

    fault: str | None = None
    evict: ResidentJob | None = None
    restore: bool = False
    restores_itself: bool = False
    # The resident's eviction runs beside the grant (both states fit in the group's declared
    # memory): nobody waits for it, and a later request that does not fit beside it does.
    overlapped: bool = False

    @property
    def moves(self) -> bool:
        """Something moves before the grant (an overlapped eviction does not hold it up)."""
        return (self.evict is not None and not self.overlapped) or self.restore


def _fingerprint(request_id: str) -> str:
    """What the carried state keeps of a finished request: 16 hex digits, whatever its id's
    length, so thousands of them stay small in the continue-as-new input."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:16]


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _after(start: datetime, seconds: float | None) -> datetime | None:
    if seconds is None or not math.isfinite(seconds) or seconds > FAR_FUTURE_S:
        return None
    return start + timedelta(seconds=max(0.0, seconds))


_COUNTERS = {
    LeaseOutcome.RELEASED: "released",
    LeaseOutcome.EXPIRED: "expired",
    LeaseOutcome.CANCELLED: "cancelled",
    LeaseOutcome.REJECTED: "rejected",
    LeaseOutcome.DEAD: "dead_waiters",
}


class GroupBook:
    def __init__(
        self, config: GroupConfig, state: GroupState, observer: Observer | None = None
    ) -> None:
        self.config = config
        self.state = state
        self.observer: Observer = observer or _Silent()
        # The request a switch is running for (taken off the queue, not yet the holder).
        self.switching_for: str | None = None
        self.switching_key_hash: str | None = None
        self.switch_cancelled = False
        # Asked before a decision that differs from the FIFO one (a lease carried past
        # waiters): the workflow answers with workflow.patched, so groups that started before
        # the grant policy replay as they ran.
        self.policy_gate: Callable[[], bool] = lambda: True

    @property
    def carry_limits(self) -> CarryLimits:
        c = self.config
        return CarryLimits(c.grant_policy, c.max_carries, c.carry_limit_s, c.share_slack)

    def _seconds(self, when: datetime) -> float:
        """A time as the waiting-share records keep it: seconds since the group's creation."""
        return (when - self.state.stats.created_at).total_seconds()

    def waiting_share(self, job_id: str, now: datetime) -> float:
        records = self.state.wait_shares.get(job_id)
        return waiting_share(records, self._seconds(now)) if records else 0.0

    # ------------------------------------------------------------------ the queue

    def known(self, request_id: str) -> bool:
        state = self.state
        return (
            self.done(request_id)
            or request_id == self.switching_for
            or self.holds(request_id)
            or any(w.request.request_id == request_id for w in state.queue)
        )

    def holds(self, request_id: str) -> bool:
        holder = self.state.holder
        return holder is not None and holder.request.request_id == request_id

    def settled(self, request_id: str) -> bool:
        """Nothing more to wait for: the request is done, or holds the group."""
        return self.done(request_id) or self.holds(request_id)

    def refusal(self, request: AcquireRequest) -> str | None:
        """Why a new request cannot be queued (the queue is full), or None if it can (or the
        group knows it already). Bounds what a flood of requests can make the group carry."""
        if self.known(request.request_id):
            return None
        queue = self.state.queue
        if len(queue) >= MAX_WAITERS:
            return f"group {self.config.group_id}'s queue is full ({len(queue)} waiters); ask later"
        own = encoded_size(request)
        if own > MAX_REQUEST_BYTES:
            return (
                f"the request takes {own} bytes, more than a group carries for one request "
                f"({MAX_REQUEST_BYTES}); send a smaller snapshot target (fewer queues, backends "
                "or processes, shorter names)"
            )
        size = own + sum(encoded_size(w.request) for w in queue)
        if size > MAX_QUEUE_BYTES:
            return (
                f"group {self.config.group_id}'s queue is full ({MAX_QUEUE_BYTES} bytes of "
                "requests); ask later, or send a smaller snapshot target"
            )
        return None

    def enqueue(self, request: AcquireRequest, now: datetime) -> bool:
        """Queue a request; False if the group knows it already (acquire is idempotent)."""
        if self.known(request.request_id):
            return False
        state = self.state
        state.queue.append(Waiter(request=request, seq=state.next_seq, enqueued_at=now))
        state.next_seq += 1
        return True

    def peek_next(self, now: datetime) -> Waiter | None:
        """The best waiter: highest priority + waited / aging_s, FIFO among equals."""

        def score(w: Waiter) -> tuple[float, int]:
            waited = (now - w.enqueued_at).total_seconds()
            return (w.request.priority + waited / self.config.aging_s, -w.seq)

        return max(self.state.queue, key=score, default=None)

    def take_next(self, now: datetime) -> Waiter | None:
        best = self.peek_next(now)
        if best is not None:
            self.state.queue.remove(best)
            self.switching_for = best.request.request_id
            self.switching_key_hash = best.request.key_hash
            self.switch_cancelled = False
        return best

    def next_deadline(self) -> datetime | None:
        """The nearest time something expires: a waiter's time-out, the holder's lease."""
        deadlines = [
            d
            for w in self.state.queue
            if (d := _after(w.enqueued_at, w.request.timeout_s)) is not None
        ]
        holder = self.state.holder
        if holder is not None:
            for d in (holder.expires_at, holder.confirm_by):
                if d is not None:
                    deadlines.append(d)
        return min(deadlines) if deadlines else None

    def expire(self, now: datetime) -> None:
        """Revoke an expired lease, skip a holder that never took its grant, drop waiters whose
        own time-out has passed."""
        holder = self.state.holder
        if holder is not None:
            if holder.delivered and holder.expires_at is not None and now >= holder.expires_at:
                self.end_lease(LeaseOutcome.EXPIRED, now)
            elif (
                not holder.delivered and holder.confirm_by is not None and now >= holder.confirm_by
            ):
                self.end_lease(LeaseOutcome.DEAD, now)
        kept: list[Waiter] = []
        for w in self.state.queue:
            deadline = _after(w.enqueued_at, w.request.timeout_s)
            if deadline is not None and now >= deadline:
                self.state.stats.timed_out += 1
                self.remember_done(w.request.request_id)
            else:
                kept.append(w)
        self.state.queue = kept

    def _remember_key(self, job_id: str, key_hash: str) -> None:
        keys = self.state.job_keys
        keys.pop(job_id, None)
        keys[job_id] = key_hash  # most recent last
        while len(keys) > JOB_KEYS_KEEP:
            # The oldest key of a job the group no longer tracks goes first: a tracked job's
            # reports and departure must still match (if every job is tracked, the oldest goes).
            tracked = self._tracked_jobs()
            oldest = next((j for j in keys if j not in tracked), next(iter(keys)))
            del keys[oldest]
            self.state.stats.forgotten_jobs += 1

    def _tracked_jobs(self) -> set[str]:
        """Jobs whose state the group keeps track of: held, resident, evicting, evicted, faulted."""
        state = self.state
        jobs = set(state.evicted_jobs) | set(state.faulted_jobs)
        if state.holder is not None:
            jobs.add(state.holder.request.job_id)
        for resident in (state.resident, state.evicting):
            if resident is not None:
                jobs.add(resident.job_id)
        return jobs

    def _forged(self) -> None:
        self.state.stats.forged_messages += 1
        self.observer.stale("forged")

    def forged_answer(self) -> None:
        """A grant delivery was answered without the request's key: not its process's answer."""
        self._forged()

    def _job_key_matches(self, job_id: str, key: str) -> bool:
        expected = self.state.job_keys.get(job_id)
        if expected is None or lease_key_hash(key) != expected:
            self._forged()
            return False
        return True

    def remember_done(self, request_id: str) -> None:
        done = self.state.recent_done
        mark = _fingerprint(request_id)
        if mark not in done:
            done.append(mark)
            del done[: max(0, len(done) - RECENT_DONE_KEEP)]

    def done(self, request_id: str) -> bool:
        """The request ended recently (granted and ended, cancelled, timed out): a retry of it
        is not a new request."""
        return _fingerprint(request_id) in self.state.recent_done

    # ------------------------------------------------------------------ leases

    def ttl(self, request: AcquireRequest) -> float:
        return request.ttl_s if request.ttl_s is not None else self.config.default_ttl_s

    def grant(self, waiter: Waiter, now: datetime, *, parked: bool) -> GrantNotice:
        """Make ``waiter`` the holder with the next fencing token.

        A grant handed out as a parked update's result counts as delivered once the holder
        renews or releases; until then it is bounded by ``grant_ack_timeout_s``."""
        self.switching_for = self.switching_key_hash = None
        state = self.state
        token = state.next_token
        state.next_token += 1
        waited = (now - waiter.enqueued_at).total_seconds()
        state.holder = HeldLease(
            request=waiter.request,
            token=token,
            granted_at=now,
            waited_s=waited,
            confirm_by=now + timedelta(seconds=self.config.grant_ack_timeout_s) if parked else None,
        )
        state.stats.leases += 1
        self._remember_key(waiter.request.job_id, waiter.request.key_hash)
        record_wait(
            remember_job(state.wait_shares, waiter.request.job_id),
            self._seconds(waiter.enqueued_at),
            waited,
        )
        samples = state.stats.wait_samples_s
        samples.append(waited)
        del samples[: max(0, len(samples) - self.config.wait_samples_keep)]
        self.observer.granted(waited)
        return self.notice(waiter.request, token, waited, None, parked=parked, granted_at=now)

    def refuse(self, waiter: Waiter, fault: str, now: datetime) -> GrantNotice:
        """The waiter's job is faulted: no lease, a notice saying why."""
        self.switching_for = self.switching_key_hash = None
        token = self.state.next_token
        self.state.next_token += 1
        self.remember_done(waiter.request.request_id)
        waited = (now - waiter.enqueued_at).total_seconds()
        return self.notice(waiter.request, token, waited, fault, parked=False, granted_at=now)

    def notice(
        self,
        request: AcquireRequest,
        token: int,
        waited: float,
        fault: str | None,
        *,
        parked: bool,
        granted_at: datetime | None = None,
    ) -> GrantNotice:
        # Signed with the request's key hash, which only this group and the requester know:
        # a notice anyone else sends (``status`` shows request ids and tokens) is dropped.
        notice = GrantNotice(
            group_id=self.config.group_id,
            request_id=request.request_id,
            job_id=request.job_id,
            reply_task_queue=request.reply_task_queue,
            reply_workflow_id=request.reply_workflow_id,
            token=token,
            ttl_s=self.ttl(request),
            waited_s=waited,
            fault=fault,
            # A process renews this soon after taking a grant: what confirms it if its
            # delivery's outcome cannot be trusted (``unconfirmed``).
            confirm_within_s=self.config.grant_ack_timeout_s
            if parked or request.reply_task_queue is not None
            else None,
            granted_at=granted_at,
        )
        return prove_notice(notice, request.key_hash)

    def holder_notice(self) -> GrantNotice | None:
        holder = self.state.holder
        if holder is None:
            return None
        return self.notice(
            holder.request,
            holder.token,
            holder.waited_s,
            None,
            parked=not holder.delivered and holder.confirm_by is not None,
            granted_at=holder.granted_at,
        )

    def confirm(self, token: int, now: datetime) -> None:
        """The holder took its grant (activity, signal, renewal or release): the TTL runs."""
        holder = self.state.holder
        if holder is not None and holder.token == token and not holder.delivered:
            holder.delivered = True
            holder.confirm_by = None
            holder.expires_at = now + timedelta(seconds=self.ttl(holder.request))

    def answer_is_proven(self, token: int, key: str | None) -> bool:
        """Whether a grant's answer presents the key of the lease held under ``token``."""
        holder = self.state.holder
        return (
            key is not None
            and holder is not None
            and holder.token == token
            and hmac.compare_digest(lease_key_hash(key), holder.request.key_hash)
        )

    def unconfirmed(self, token: int, now: datetime) -> None:
        """A grant whose delivery ended in an outcome anyone could have sent (a failure, an
        answer without the key): it may have been taken, so the lease is not ended on that
        word; the holder confirms it by renewing or releasing within ``grant_ack_timeout_s``,
        or is taken for dead (as a grant taken from a parked update)."""
        holder = self.state.holder
        if holder is not None and holder.token == token and not holder.delivered:
            holder.confirm_by = now + timedelta(seconds=self.config.grant_ack_timeout_s)

    def end_lease(self, outcome: LeaseOutcome, now: datetime) -> None:
        state = self.state
        holder = state.holder
        assert holder is not None
        held = (now - holder.granted_at).total_seconds()
        stats = state.stats
        stats.busy_s += held
        setattr(stats, _COUNTERS[outcome], getattr(stats, _COUNTERS[outcome]) + 1)
        self.observer.lease_ended(outcome, held)
        resident = state.resident
        if (
            outcome is LeaseOutcome.EXPIRED
            and resident is not None
            and resident.job_id == holder.request.job_id
        ):
            # It never yielded: if another job takes the device before this one is granted
            # again, the group's eviction of it is a preemption.
            resident.lease_expired = True
        if self.config.history_keep:
            state.history.append(
                LeaseRecord(
                    job_id=holder.request.job_id,
                    token=holder.token,
                    start=holder.granted_at,
                    end=now,
                    outcome=outcome,
                    phases=holder.phases,
                )
            )
            del state.history[: max(0, len(state.history) - self.config.history_keep)]
        self.remember_done(holder.request.request_id)
        state.holder = None

    def _held(self, request_id: str, token: int, key: str) -> HeldLease | None:
        """The lease, if it is held under this request, token *and* key; a message naming the
        lease with the wrong key is forged (or mistyped): counted, never obeyed."""
        holder = self.state.holder
        if holder is None or holder.token != token or holder.request.request_id != request_id:
            return None
        if lease_key_hash(key) != holder.request.key_hash:
            self._forged()
            return None
        return holder

    def release(self, ret: LeaseReturn, now: datetime) -> ReturnAnswer:
        """A process ends (or, when nobody waits and it asks, keeps) its lease."""
        forged = self.state.stats.forged_messages
        holder = self._held(ret.request_id, ret.token, ret.key)
        if holder is None:
            # A retried release of a lease that ended is neither stale nor forged.
            if self.state.stats.forged_messages == forged and not self.done(ret.request_id):
                self._stale("release")
            return ReturnAnswer(valid=False, released=False)
        self.confirm(holder.token, now)
        job_id = holder.request.job_id
        self.account_own_moves(job_id, ret.restored, ret.evicted, now)
        if ret.phases is not None:  # kept with the lease (a carried one reports each segment's)
            holder.phases = bounded_phases([*(holder.phases or []), *ret.phases])
        after = self.peek_next(now)
        why = ""
        if ret.carry_into is not None:
            kept, why = self._carry(holder, ret, now)
            if kept:
                return ReturnAnswer(valid=True, released=False, reason=why)
        elif ret.keep_if_uncontended and after is None:
            holder.expires_at = now + timedelta(seconds=self.ttl(holder.request))
            return ReturnAnswer(valid=True, released=False)
        state = self.state
        evict = (
            ret.evicts_itself
            and after is not None
            and after.request.job_id != job_id
            and state.resident is not None
            and state.resident.job_id == job_id
        )
        if evict:
            # Its own eviction runs from now on; until its report comes, only a job whose
            # state fits beside it may be restored.
            assert state.resident is not None
            state.stats.evictions += 1
            state.evicting = state.resident
            state.evicting_key_hash = holder.request.key_hash
            state.resident = None
            self._note_evicted(job_id)
        self.end_lease(LeaseOutcome.RELEASED, now)
        return ReturnAnswer(valid=True, released=True, evict=evict, reason=why)

    def _carry(self, holder: HeldLease, ret: LeaseReturn, now: datetime) -> tuple[bool, str]:
        """Keep the lease into the holder's next phase if the grant policy allows: whether it
        is kept, and why."""
        assert ret.carry_into is not None
        job_id = holder.request.job_id
        waiters = [
            (w.request.job_id, self.waiting_share(w.request.job_id, now), w.request.priority)
            for w in self.state.queue
            if w.request.job_id != job_id
        ]
        decision = decide_carry(
            self.carry_limits,
            next_phase=ret.carry_into.name,
            next_phase_s=ret.carry_into.expected_s,
            carries=holder.carries,
            holder_share=self.waiting_share(job_id, now),
            waiters=waiters,
            holder_priority=holder.request.priority,
        )
        if not decision.keep:
            return False, decision.reason
        if decision.contended and not self.policy_gate():
            return False, f"fifo: {len(waiters)} waiting (group started before phase-aware grants)"
        holder.expires_at = now + timedelta(seconds=self.ttl(holder.request))
        if decision.contended:
            holder.carries += 1
            holder.carrying_into = ret.carry_into.name
            self.state.stats.carried += 1
        else:
            holder.carrying_into = None
        return True, decision.reason

    def release_by_signal(self, release: ReleaseRequest, now: datetime) -> None:
        """A requester workflow's release (a signal: no answer, so no eviction by the holder)."""
        forged = self.state.stats.forged_messages
        holder = self._held(release.request_id, release.token, release.key)
        if holder is not None:
            self.account_own_moves(holder.request.job_id, release.restored, release.evicted, now)
            self.end_lease(LeaseOutcome.RELEASED, now)
        elif self.state.stats.forged_messages == forged and not self.done(release.request_id):
            self._stale("release")

    def renew(self, renew: RenewRequest, now: datetime) -> RenewResult:
        forged = self.state.stats.forged_messages
        holder = self._held(renew.request_id, renew.token, renew.key)
        if holder is None:
            if self.state.stats.forged_messages != forged:
                return RenewResult(valid=False, reason="the lease key does not match")
            self._stale("renew")
            return RenewResult(valid=False, reason="the lease is no longer held (expired or moved)")
        if holder.delivered and holder.expires_at is not None and now >= holder.expires_at:
            # Too late: a lease that ran out stays revoked even if its expiry is not processed
            # yet (the control worker was down longer than the TTL).
            self.end_lease(LeaseOutcome.EXPIRED, now)
            return RenewResult(valid=False, reason="the lease expired before this renewal")
        ttl = self.ttl(holder.request)
        if holder.delivered:
            holder.expires_at = now + timedelta(seconds=ttl)
        else:
            self.confirm(holder.token, now)
        return RenewResult(valid=True, ttl_s=ttl)

    def _stale(self, kind: str) -> None:
        self.state.stats.stale_messages += 1
        self.observer.stale(kind)

    def cancel(self, request_id: str, key: str, now: datetime) -> None:
        """Take a request back: dequeue it, or end its lease if a grant raced the give-up. Only
        its requester can: the key must match the request's."""
        state = self.state
        hashed = lease_key_hash(key)
        holder = state.holder
        if holder is not None and holder.request.request_id == request_id:
            if hashed != holder.request.key_hash:
                self._forged()
                return
            self.end_lease(LeaseOutcome.CANCELLED, now)
        elif request_id == self.switching_for:
            if hashed != self.switching_key_hash:
                self._forged()
                return
            self.switch_cancelled = True
            state.stats.cancelled += 1
        else:
            mine = [w for w in state.queue if w.request.request_id == request_id]
            if any(w.request.key_hash != hashed for w in mine):
                self._forged()
                return
            if mine:
                state.queue = [w for w in state.queue if w.request.request_id != request_id]
                state.stats.cancelled += 1
        self.remember_done(request_id)

    # ------------------------------------------------------------------ residency

    def both_fit(self, resident: ResidentJob | None, request: AcquireRequest) -> bool:
        memory = self.config.memory_bytes
        return (
            memory is not None
            and resident is not None
            and resident.state_bytes is not None
            and request.state_bytes is not None
            and resident.state_bytes + request.state_bytes <= memory
        )

    def eviction_to_await(self, request: AcquireRequest) -> ResidentJob | None:
        """A previous holder still moving its state out, that ``request`` must wait for."""
        evicting = self.state.evicting
        if evicting is None:
            return None
        if evicting.job_id == request.job_id:
            return evicting  # its own state is still on its way out: restore after
        if self.both_fit(evicting, request):
            return None
        return evicting

    def plan_switch(self, request: AcquireRequest) -> SwitchPlan:
        """What granting ``request`` moves (sticky residency: nothing if it is resident)."""
        state = self.state
        resident = state.resident
        if resident is not None and resident.job_id == request.job_id:
            if request.snapshot is not None:
                resident.snapshot = request.snapshot
            return SwitchPlan()
        if request.job_id in state.faulted_jobs:
            return SwitchPlan(fault=state.faulted_jobs[request.job_id])
        evict = resident if resident is not None and resident.snapshot is not None else None
        restore = request.snapshot is not None and request.job_id in state.evicted_jobs
        restores_itself = restore and request.restores_itself
        if restores_itself:
            # Granted at once; the holder restores its own state before it uses the group.
            state.evicted_jobs.remove(request.job_id)
            restore = False
        overlapped = evict is not None and state.evicting is None and self.both_fit(evict, request)
        if overlapped:
            assert evict is not None
            state.evicting = evict
            state.evicting_key_hash = None  # the group's own activity evicts it
            state.resident = None
            self._note_evicted(evict.job_id)
        return SwitchPlan(
            evict=evict, restore=restore, restores_itself=restores_itself, overlapped=overlapped
        )

    def eviction_done(
        self, job_id: str, *, gone: bool, ok: bool, now: datetime, preempted: bool = False
    ) -> None:
        """An eviction that ran beside a grant finished: ``ok`` (moved out), ``gone`` (the
        job's processes are gone, and its device memory with them), or failed (faulted)."""
        state = self.state
        self.clear_evicting(job_id)
        if ok:
            self.evicted(job_id, preempted=preempted)
        elif gone:
            self.forget(job_id)
        elif job_id in state.evicted_jobs:  # failed: the job is faulted, its state unknown
            state.evicted_jobs.remove(job_id)

    def evicted(self, job_id: str, *, preempted: bool = False) -> None:
        """The job's state left the device; ``preempted``: the group evicted a job whose lease
        ran out without it yielding (``ResidentJob.lease_expired``)."""
        self.state.stats.evictions += 1
        if preempted:
            self.state.stats.preemptions += 1
        self._note_evicted(job_id)

    def _note_evicted(self, job_id: str) -> None:
        """The job's state is saved off the device: restore it when the job is granted next.
        Past EVICTED_JOBS_KEEP the oldest is forgotten: its next grant restores nothing (a job
        process restores in-process state itself before using it)."""
        evicted = self.state.evicted_jobs
        if job_id not in evicted:
            evicted.append(job_id)
        while len(evicted) > EVICTED_JOBS_KEEP:
            del evicted[0]
            self.state.stats.forgotten_jobs += 1

    def clear_evicting(self, job_id: str | None = None) -> None:
        """No eviction (of ``job_id``, if given) is under way any more."""
        state = self.state
        if state.evicting is not None and (job_id is None or state.evicting.job_id == job_id):
            state.evicting = None
            state.evicting_key_hash = None

    def asked_to_evict(self, job_id: str, key: str) -> bool:
        """The lease under ``key`` was answered ``evict`` and its eviction is still awaited."""
        state = self.state
        return (
            state.evicting is not None
            and state.evicting.job_id == job_id
            and state.evicting_key_hash is not None
            and state.evicting_key_hash == lease_key_hash(key)
        )

    def restored(self, job_id: str) -> None:
        self.state.stats.restores += 1
        if job_id in self.state.evicted_jobs:
            self.state.evicted_jobs.remove(job_id)

    def count_moved(self, direction: str, reports: list[SnapshotReport]) -> int:
        moved = sum(r.bytes for r in reports)
        self.state.stats.bytes_moved += moved
        self.observer.moved(direction, moved)
        return moved

    def finish_switch(
        self,
        plan: SwitchPlan,
        request: AcquireRequest,
        *,
        started: datetime,
        ended: datetime,
        moved_bytes: int,
        waited_for: ResidentJob | None,
    ) -> None:
        """Count one switch, however its moves were split between the group and the holders."""
        state = self.state
        if plan.moves or plan.evict is not None or plan.restores_itself or waited_for is not None:
            state.stats.switches += 1
        if plan.overlapped:
            state.stats.overlapped_switches += 1
        if plan.moves or waited_for is not None:
            seconds = (ended - started).total_seconds()
            state.stats.switching_s += seconds
            self.observer.switched(seconds)
            source = plan.evict or waited_for
            self.record_switch(
                SwitchRecord(
                    from_job=source.job_id if source is not None else None,
                    to_job=request.job_id,
                    start=started,
                    end=ended,
                    bytes=moved_bytes,
                    overlapped=plan.overlapped,
                    by_holder=plan.evict is None and waited_for is not None,
                )
            )
        if plan.fault is None:
            state.resident = ResidentJob(
                job_id=request.job_id, snapshot=request.snapshot, state_bytes=request.state_bytes
            )
        else:
            state.resident = None

    def record_switch(self, record: SwitchRecord) -> None:
        if self.config.history_keep:
            switches = self.state.switch_history
            switches.append(record)
            del switches[: max(0, len(switches) - self.config.history_keep)]

    def account_own_moves(
        self,
        job_id: str,
        restored: list[SnapshotReport],
        evicted: list[SnapshotReport],
        now: datetime,
    ) -> None:
        """A holder that moved its own state during its lease: residency and accounting follow.

        Moving state is switching, not useful work, even when done inside a lease."""
        if not restored and not evicted:
            return
        state, stats = self.state, self.state.stats
        if restored:
            stats.restores += 1
        if evicted and state.resident is not None and state.resident.job_id == job_id:
            self.evicted(job_id)
            state.resident = None
        self.count_moved("restore", restored)
        self.count_moved("evict", evicted)
        seconds = sum(r.seconds for r in [*restored, *evicted])
        stats.switching_s += seconds
        stats.busy_s -= seconds
        holder = state.holder
        granted_at = holder.granted_at if holder is not None else now
        for reports, is_restore in ((restored, True), (evicted, False)):
            if reports:
                took = timedelta(seconds=sum(r.seconds for r in reports))
                start = granted_at if is_restore else now - took
                self.record_switch(
                    SwitchRecord(
                        from_job=None if is_restore else job_id,
                        to_job=job_id if is_restore else None,
                        start=start,
                        end=start + took,
                        bytes=sum(r.bytes for r in reports),
                        by_holder=True,
                    )
                )

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
        counted, never obeyed (``faults_only_if_asked`` False: runs from before this rule)."""
        state = self.state
        job_id = report.job_id
        if not self._job_key_matches(job_id, report.key):
            return
        if (
            report.error is not None
            and faults_only_if_asked
            and not self.asked_to_evict(job_id, report.key)
        ):
            state.stats.stale_messages += 1
            return
        self.clear_evicting(job_id)
        if state.resident is not None and state.resident.job_id == job_id and report.error is None:
            self.evicted(job_id)
            state.resident = None
        moved = self.count_moved("evict", report.evicted)
        if moved and marked:
            self.record_switch(
                SwitchRecord(
                    from_job=job_id,
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
            self.fault(job_id, f"its own eviction failed: {report.error}")

    def fault(self, job_id: str, message: str) -> str:
        """Mark the job faulted (its state is unknown): its requests are refused with this text.
        The text quotes others' errors, so it is cut to MAX_FAULT_BYTES; past FAULTED_JOBS_KEEP
        faults the oldest is forgotten."""
        faults = self.state.faulted_jobs
        text = faults.setdefault(
            job_id, cut_to_encoded(f"job {job_id}: {message}", MAX_FAULT_BYTES)
        )
        while len(faults) > FAULTED_JOBS_KEEP:
            del faults[next(iter(faults))]
            self.state.stats.forgotten_jobs += 1
        return text

    def depart(self, job_id: str, key: str) -> bool:
        """A job's processes closed: its state left the device with them. False if still held
        (or the key is not its last lease's)."""
        state = self.state
        if state.holder is not None and state.holder.request.job_id == job_id:
            return False  # still holding: its release (or expiry) comes first
        if not self._job_key_matches(job_id, key):
            return False
        known = (
            job_id in state.evicted_jobs
            or job_id in state.faulted_jobs
            or (state.resident is not None and state.resident.job_id == job_id)
            or (state.evicting is not None and state.evicting.job_id == job_id)
        )
        if known:
            self.forget(job_id)
        return known

    def evictor_gone(self, job_id: str) -> None:
        """The job answered ``evict`` never reported, and the group's own eviction found no
        process on its queues: its processes are gone, and its device state with them."""
        self.forget(job_id)

    def forget(self, job_id: str) -> None:
        """The job's processes are gone: drop its residency, saved state and faults."""
        state = self.state
        if state.resident is not None and state.resident.job_id == job_id:
            state.resident = None
        if job_id in state.evicted_jobs:
            state.evicted_jobs.remove(job_id)
        self.clear_evicting(job_id)
        state.faulted_jobs.pop(job_id, None)
        state.job_keys.pop(job_id, None)
        state.stats.departed += 1

    # ------------------------------------------------------------------ continue-as-new

    def carried_input(self) -> tuple[dict[str, Any], int, int]:
        """The next run's input (``GroupInput`` as JSON), its encoded size, and how many lease
        and switch records were shed, oldest first, to bring it within CARRIED_STATE_BUDGET_BYTES.

        A state reached by valid messages never needs it (its bounds add up to the budget:
        ``group_state_budget``), but one carried from an older release may: a continue-as-new
        input over Temporal's payload limit would fail its task forever and wedge the group."""
        state = self.state
        shed = 0
        while True:
            carried = GroupInput(config=self.config, state=state).model_dump(mode="json")
            size = encoded_size(carried)
            excess = size - CARRIED_STATE_BUDGET_BYTES
            if excess <= 0 or not (state.history or state.switch_history):
                break
            shed += self._shed_history(excess)
        if shed:  # the count travels with the state (a few bytes more)
            state.stats.shed_records += shed
            carried = GroupInput(config=self.config, state=state).model_dump(mode="json")
            size = encoded_size(carried)
        return carried, size, shed

    def _shed_history(self, excess: int) -> int:
        """Drop the oldest lease and switch records until ``excess`` bytes are gone."""
        state = self.state
        dropped = 0
        while excess > 0 and (state.history or state.switch_history):
            if state.history and (
                not state.switch_history or state.history[0].start <= state.switch_history[0].start
            ):
                excess -= encoded_size(state.history.pop(0)) + 1
            else:
                excess -= encoded_size(state.switch_history.pop(0)) + 1
            dropped += 1
        return dropped

    # ------------------------------------------------------------------ views

    def busy_and_wall(self, now: datetime) -> tuple[float, float]:
        stats, holder = self.state.stats, self.state.holder
        busy = stats.busy_s + ((now - holder.granted_at).total_seconds() if holder else 0.0)
        return busy, max((now - stats.created_at).total_seconds(), 1e-9)

    def utilization(self, now: datetime) -> float:
        """The share of its life the group was held (GroupStatus.held_share)."""
        busy, wall = self.busy_and_wall(now)
        return min(1.0, max(0.0, busy / wall))

    def holder_view(self, now: datetime) -> HolderView | None:
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
        """The group's current details in the Temporal UI (markdown)."""
        state = self.state
        holder = state.holder
        queue = ", ".join(f"{w.request.job_id} (p{w.request.priority})" for w in state.queue)
        lines = [
            f"**holder**: {holder.request.job_id} · token {holder.token}"
            if holder
            else "**holder**: none",
            f"**resident**: {state.resident.job_id if state.resident else 'none'}",
            f"**queue**: {queue or 'empty'}",
            f"**leases**: {state.stats.leases} · switches {state.stats.switches}",
            # The group sees leases, not phases: its utilization proper is `timeslice status`'s.
            f"**held so far**: {self.utilization(now):.0%} (utilization: `timeslice status`)",
        ]
        return "\n\n".join(lines)
