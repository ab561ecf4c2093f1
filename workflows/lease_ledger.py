"""The GPU group's lease: who holds it, under which fencing token, until when, and which
messages about it are the holder's own.

One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces: it keeps the lease part of
the group's ``GroupState`` (``holder``, ``next_token``, ``job_keys``, ``recent_done``) — the
grant notice and its proof, confirmation, expiry and renewal, the keys that authenticate a
job's messages, and the marks of finished requests that make asking again idempotent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from datetime import datetime, timedelta

from timeslice.protocol.group import (
    JOB_KEYS_KEEP,
    RECENT_DONE_KEEP,
    RECENT_RELEASED_KEEP,
    AcquireRequest,
    GrantNotice,
    HeldLease,
    LeaseOutcome,
    Waiter,
    lease_key_hash,
    prove_notice,
)
from timeslice.workflows.book_piece import BookPiece

__all__ = ["LeaseLedger"]


def _fingerprint(request_id: str) -> str:
    """What the carried state keeps of a finished request: 16 hex digits, whatever its id's
    length, so thousands of them stay small in the continue-as-new input."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:16]


class LeaseLedger(BookPiece):
    """The group's one lease and the authentication of the messages that name it."""

    # ------------------------------------------------------------------ idempotency

    def holds(self, request_id: str) -> bool:
        """Whether the request holds the group now.

        Args:
            request_id: the request's id.

        Returns:
            True if the current lease was granted to it.
        """
        holder = self.state.holder
        return holder is not None and holder.request.request_id == request_id

    def remember_done(self, request_id: str) -> None:
        """Mark the request finished, so that a retry of it is not a new request; the oldest
        of more than ``RECENT_DONE_KEEP`` marks is forgotten.

        Args:
            request_id: the request's id.
        """
        done = self.state.recent_done
        mark = _fingerprint(request_id)
        if mark not in done:
            done.append(mark)
            del done[: max(0, len(done) - RECENT_DONE_KEEP)]

    def remember_released(self, holder: HeldLease, key: str) -> None:
        """Mark the lease released by its holder, so that the same release sent again (the
        first landed in a run since continued as new) is answered released; the oldest of
        more than ``RECENT_RELEASED_KEEP`` marks is forgotten.

        Args:
            holder: the lease its holder released.
            key: the key the release presented (the lease's own).
        """
        released = self.state.recent_released
        released.append(_fingerprint(f"{holder.request.request_id}:{holder.token}:{key}"))
        del released[: max(0, len(released) - RECENT_RELEASED_KEEP)]

    def released_before(self, request_id: str, token: int, key: str) -> bool:
        """Whether a release names a lease its holder released recently.

        Args:
            request_id: the request the release names.
            token: the fencing token it names.
            key: the lease key it presents.

        Returns:
            True if that lease, under that key, ended by its holder's release.
        """
        return _fingerprint(f"{request_id}:{token}:{key}") in self.state.recent_released

    def done(self, request_id: str) -> bool:
        """Whether the request ended recently (granted and ended, cancelled, timed out).

        Args:
            request_id: the request's id.

        Returns:
            True if a retry of it is not a new request.
        """
        return _fingerprint(request_id) in self.state.recent_done

    # ------------------------------------------------------------------ keys

    def remember_key(self, job_id: str, key_hash: str, tracked: Callable[[], set[str]]) -> None:
        """Keep the key hash of the job's latest lease: what its reports and its departure must
        match. Past ``JOB_KEYS_KEEP`` jobs the oldest key of a job the group no longer tracks
        goes first (if every job is tracked, the oldest goes).

        Args:
            job_id: the job.
            key_hash: the hash of its lease's key.
            tracked: the jobs whose state the group tracks (asked only when a key must go).
        """
        keys = self.state.job_keys
        keys.pop(job_id, None)
        keys[job_id] = key_hash  # most recent last
        while len(keys) > JOB_KEYS_KEEP:
            jobs = tracked()
            oldest = next((j for j in keys if j not in jobs), next(iter(keys)))
            del keys[oldest]
            self.state.stats.forgotten_jobs += 1

    def forget_key(self, job_id: str) -> None:
        """Drop the job's key (its processes are gone).

        Args:
            job_id: the job.
        """
        self.state.job_keys.pop(job_id, None)

    def forged_answer(self) -> None:
        """Count a forged message: a lease named with the wrong key, or a grant delivery
        answered without the request's key (not its process's answer)."""
        self.state.stats.forged_messages += 1
        self.observer.stale("forged")

    def stale(self, kind: str) -> None:
        """Count a message about a lease that is no longer held.

        Args:
            kind: ``release`` or ``renew`` (the metric's label).
        """
        self.state.stats.stale_messages += 1
        self.observer.stale(kind)

    def job_key_matches(self, job_id: str, key: str) -> bool:
        """Whether ``key`` is the key of the job's latest lease here (a mismatch is forged).

        Args:
            job_id: the job the message speaks for.
            key: the lease key it presents.

        Returns:
            True if it matches; False (and counted as forged) if not, or if the group has no
            key of the job.
        """
        expected = self.state.job_keys.get(job_id)
        if expected is None or lease_key_hash(key) != expected:
            self.forged_answer()
            return False
        return True

    def held(self, request_id: str, token: int, key: str) -> tuple[HeldLease | None, bool]:
        """The lease a message names, if it is held under this request, token *and* key.

        Args:
            request_id: the request the message names.
            token: the fencing token it names.
            key: the lease key it presents.

        Returns:
            The lease (None if it is not held so), and whether the message was forged: it
            named the lease with the wrong key (counted, never obeyed).
        """
        holder = self.state.holder
        if holder is None or holder.token != token or holder.request.request_id != request_id:
            return None, False
        if lease_key_hash(key) != holder.request.key_hash:
            self.forged_answer()
            return None, True
        return holder, False

    # ------------------------------------------------------------------ the lease

    def ttl(self, request: AcquireRequest) -> float:
        """The lease's time to live: the request's own, or the group's default.

        Args:
            request: the request the lease was granted to.

        Returns:
            Seconds.
        """
        return request.ttl_s if request.ttl_s is not None else self.config.default_ttl_s

    def take_token(self) -> int:
        """Issue the next fencing token (every grant, and every refusal, takes one).

        Returns:
            The token.
        """
        token = self.state.next_token
        self.state.next_token += 1
        return token

    def issue(self, waiter: Waiter, now: datetime, *, parked: bool) -> HeldLease:
        """Make ``waiter`` the holder under the next fencing token.

        Args:
            waiter: the waiter granted (already off the queue).
            now: the time of the grant.
            parked: the grant is a parked update's result: it is delivered once the holder
                renews or releases, and bounded by ``grant_ack_timeout_s`` until then.

        Returns:
            The new lease.
        """
        self.state.holder = HeldLease(
            request=waiter.request,
            token=self.take_token(),
            granted_at=now,
            waited_s=(now - waiter.enqueued_at).total_seconds(),
            confirm_by=now + timedelta(seconds=self.config.grant_ack_timeout_s) if parked else None,
        )
        return self.state.holder

    def extend(self, holder: HeldLease, now: datetime) -> None:
        """Run the lease's time to live again from ``now`` (a renewal, or a lease kept).

        Args:
            holder: the current lease.
            now: the time it runs from.
        """
        holder.expires_at = now + timedelta(seconds=self.ttl(holder.request))

    def end(self) -> HeldLease:
        """Take the lease away (the book records how it ended) and mark its request finished.

        Returns:
            The lease that ended.

        Raises:
            AssertionError: if nobody holds the group.
        """
        holder = self.state.holder
        assert holder is not None
        self.remember_done(holder.request.request_id)
        self.state.holder = None
        return holder

    def notice(
        self,
        request: AcquireRequest,
        token: int,
        waited: float,
        fault: str | None,
        *,
        parked: bool,
        granted_at: datetime | None = None,
        memory_bytes: int | None = None,
    ) -> GrantNotice:
        """The grant notice for ``request``, signed with its key hash, which only this group
        and the requester know: a notice anyone else sends (``status`` shows request ids and
        tokens) is dropped.

        Args:
            request: the request granted (or refused).
            token: its fencing token.
            waited: seconds it waited.
            fault: why it was refused (its job is faulted), or None for a grant.
            parked: it goes as a parked update's result.
            granted_at: the group's time of the grant, which the client's validity counts from.
            memory_bytes: the group's declared memory, for a requester whose moves go through
                a device room (``Residency.memory_for``).

        Returns:
            The notice with its proof.
        """
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
            memory_bytes=memory_bytes,
        )
        return prove_notice(notice, request.key_hash)

    def holder_notice(self, memory_bytes: int | None = None) -> GrantNotice | None:
        """The current lease's grant notice again (to deliver it again, or to answer a retry).

        Args:
            memory_bytes: what the first notice told of the group's memory
                (``Residency.memory_for``): a process that takes its grant from this one sets
                its device room's capacity from it just the same.

        Returns:
            The notice, or None if nobody holds the group.
        """
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
            memory_bytes=memory_bytes,
        )

    def confirm(self, token: int, now: datetime) -> None:
        """The holder took its grant (activity, signal, renewal or release): the TTL runs.

        Args:
            token: the fencing token the grant was issued under.
            now: when it was taken.
        """
        holder = self.state.holder
        if holder is not None and holder.token == token and not holder.delivered:
            holder.delivered = True
            holder.confirm_by = None
            self.extend(holder, now)

    def answer_is_proven(self, token: int, key: str | None) -> bool:
        """Whether a grant's answer presents the key of the lease held under ``token``.

        Args:
            token: the fencing token the grant was issued under.
            key: the key the answer presented, if any.

        Returns:
            True only if that lease is still held and the key is its request's.
        """
        holder = self.state.holder
        return (
            key is not None
            and holder is not None
            and holder.token == token
            and hmac.compare_digest(lease_key_hash(key), holder.request.key_hash)
        )

    def unconfirmed(self, token: int, now: datetime, *, from_grant: bool = False) -> None:
        """A grant whose delivery ended in an outcome anyone could have sent (a failure, an
        answer without the key): it may have been taken, so the lease is not ended on that
        word; the holder confirms it by renewing or releasing within ``grant_ack_timeout_s``,
        or is taken for dead (as a grant taken from a parked update).

        Args:
            token: the fencing token the grant was issued under.
            now: when its delivery ended.
            from_grant: the window counts from the grant (a process bounds its use of a grant
                taken by activity by the grant's time plus ``confirm_within_s``), so a
                delivery that ran out adds nothing; False: from ``now`` (groups that started
                before ``bounded-grant-delivery``).
        """
        holder = self.state.holder
        if holder is not None and holder.token == token and not holder.delivered:
            window = timedelta(seconds=self.config.grant_ack_timeout_s)
            start = holder.granted_at if from_grant else now
            holder.confirm_by = max(now, start + window)

    def deadline(self) -> datetime | None:
        """The earliest time the lease runs out or its grant goes unconfirmed too long.

        Returns:
            That time, or None if nobody holds the group (or nothing bounds the lease).
        """
        holder = self.state.holder
        if holder is None:
            return None
        deadlines = [d for d in (holder.expires_at, holder.confirm_by) if d is not None]
        return min(deadlines) if deadlines else None

    def due(self, now: datetime) -> LeaseOutcome | None:
        """How the lease ends now, if it is due: it ran out (``expired``), or its holder never
        took its grant in time (``dead``).

        Args:
            now: the time to judge by.

        Returns:
            The outcome, or None if the lease (if any) still runs.
        """
        holder = self.state.holder
        if holder is None:
            return None
        if holder.delivered and holder.expires_at is not None and now >= holder.expires_at:
            return LeaseOutcome.EXPIRED
        if not holder.delivered and holder.confirm_by is not None and now >= holder.confirm_by:
            return LeaseOutcome.DEAD
        return None
