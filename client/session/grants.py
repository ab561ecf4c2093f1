"""Grant delivery by activity: the group wakes a waiting acquire on its process's own queue.

Most grants travel as the result of the waiter's parked ``acquire`` update; this activity
carries the rest (the group parks only a few waits at a time).

The activity's answer closes the race between a grant and a give-up: whichever of the two reaches
the waiting future first wins, on one event loop with no await in between; a grant that finds its
waiter gone answers ``accepted=False`` and the group releases it at once.

Every grant is taken with the times that bound it (:class:`Grant`): when the group made it and
until when the group waits for it to be confirmed, on this process's monotonic clock. A grant
reaching a paused process late is then known to be late (docs/architecture.md, local validity).

Whoever can act in the namespace can schedule this activity on a process's queue (or answer
its ``acquire`` update), and ``status`` shows request ids and tokens; so a notice is taken only
with the proof its group made under the request's key hash (``notice_is_proven``). One without
is dropped and counted, and the acquire keeps waiting for the real grant.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from temporalio import activity
from timeslice.errors import GrantLostError
from timeslice.protocol.group import (
    DELIVER_GRANT_ACTIVITY,
    GrantAck,
    GrantNotice,
    GroupQuery,
    GroupStatus,
    GroupUpdate,
    RenewRequest,
    RenewResult,
    group_workflow_id,
    lease_key_hash,
    notice_is_proven,
)
from timeslice.transport.updates import send_update

log = logging.getLogger("timeslice.grants")

_ACCEPTED_KEEP = 1024
# The clock assumption (docs/architecture.md): this host's wall clock and the Temporal server's
# agree within this much. A server time is moved this much earlier when read on the local
# clock, so every bound derived from one errs on the safe side.
CLOCK_SKEW_S = 0.5
# A grant taken later than this after the group made it (its time read on the local clock) is
# confirmed by a renewal before use; a fresh one costs no round trip.
LATE_GRANT_S = 1.0
# An activity that reaches its handler with less than this left of its start-to-close time may
# complete too late for the group to count it: it is declined instead of used.
DELIVERY_MARGIN_S = 5.0


async def _ask_the_group(
    notice: GrantNotice, key: str, grant: Grant
) -> tuple[bool | None, float | None]:
    """Whether the group itself holds what a proven ``notice`` says, asked before the notice
    is used: a notice's proof is made from the request's key hash, which a reader of the
    group's history sees (docs/security.md). A grant: a renewal under ``key`` (which also
    confirms it at the group: the lease is then valid until the renewal's sending plus its
    TTL). A fault: is the job faulted there? None (and the notice is taken on its proof, as
    before) when the group does not answer within what is left of the delivery's window.

    Returns:
        (held, the lease's local validity from the renewal, if one was answered)
    """
    workflow_id = group_workflow_id(notice.group_id)
    within_s = 2.0
    if grant.confirm_by is not None:
        within_s = grant.confirm_by - delivery_margin(grant) - time.monotonic()
    if within_s < 0.2:
        return None, None
    sent = time.monotonic()
    try:
        client = activity.client()
        if notice.fault is not None:
            status = await asyncio.wait_for(
                client.get_workflow_handle(workflow_id).query(
                    GroupQuery.STATUS, result_type=GroupStatus
                ),
                within_s,
            )
            return notice.job_id in status.faulted_jobs, None
        renewed = await asyncio.wait_for(
            send_update(
                client,
                workflow_id,
                GroupUpdate.RENEW,
                RenewRequest(request_id=notice.request_id, token=notice.token, key=key),
                RenewResult,
                give_up_after_s=within_s,
            ),
            within_s,
        )
    except Exception as err:  # no answer proves nothing: the grant is taken on its proof
        log.warning("could not ask group %r about its grant: %s", notice.group_id, err)
        return None, None
    if not renewed.valid:
        return False, None
    return True, sent + renewed.ttl_s


def local_time_of(instant: datetime, *, wall_now: datetime, mono_now: float) -> float:
    """The monotonic-clock time of a server-clock ``instant``, no later than the true one
    (given the clock assumption); an instant that seems to lie ahead is taken as now."""
    age = max(0.0, (wall_now - instant).total_seconds())
    return mono_now - age - CLOCK_SKEW_S


@dataclass(frozen=True)
class Grant:
    """A grant as this process took it; times on the monotonic clock.

    ``granted_at``: no later than when the group made it (None: unknown). ``confirm_by``: from
    then on the group may have ended it as undelivered unless it was confirmed (by a renewal or
    release for a parked update's grant; by the activity's own completion for an activity's):
    None when unknown. A lease's local validity never runs past either bound."""

    notice: GrantNotice
    taken_at: float
    granted_at: float | None
    confirm_by: float | None
    # A renewal this process sent as it took the grant found it held: valid until then, with
    # no confirmation to wait for (a grant taken by activity: see GrantInbox.deliver_grant).
    confirmed_until: float | None = None

    @property
    def age_s(self) -> float | None:
        """How long after the grant it was taken, counting the clock allowance."""
        return None if self.granted_at is None else self.taken_at - self.granted_at


def grant_from_update(notice: GrantNotice) -> Grant:
    """A grant that came as an ``acquire`` update's result (parked, or a re-ask)."""
    mono_now, wall_now = time.monotonic(), datetime.now(UTC)
    granted = (
        None
        if notice.granted_at is None
        else local_time_of(notice.granted_at, wall_now=wall_now, mono_now=mono_now)
    )
    confirm_by = (
        None
        if granted is None or notice.confirm_within_s is None
        else granted + notice.confirm_within_s
    )
    return Grant(notice=notice, taken_at=mono_now, granted_at=granted, confirm_by=confirm_by)


def _grant_from_activity(notice: GrantNotice, info: activity.Info) -> Grant:
    mono_now, wall_now = time.monotonic(), datetime.now(UTC)
    made = notice.granted_at or info.current_attempt_scheduled_time
    granted = local_time_of(made, wall_now=wall_now, mono_now=mono_now)
    # The group counts the grant taken once this activity completes with this process's
    # answer, or once the holder renews; it may end it as undelivered when the activity times
    # out (its start-to-close time), and when the grant is confirm_within_s old without
    # either (an outcome anyone could have sent ends nothing sooner): the earlier bounds it.
    bounds = []
    if info.start_to_close_timeout is not None:
        started = local_time_of(info.started_time, wall_now=wall_now, mono_now=mono_now)
        bounds.append(started + info.start_to_close_timeout.total_seconds())
    if notice.confirm_within_s is not None:
        bounds.append(granted + notice.confirm_within_s)
    confirm_by = min(bounds) if bounds else None
    return Grant(notice=notice, taken_at=mono_now, granted_at=granted, confirm_by=confirm_by)


def delivery_margin(grant: Grant) -> float:
    """How long before its ``confirm_by`` a grant taken by activity is declined rather than
    used: its answer might reach the group too late. ``DELIVERY_MARGIN_S``, or a third of the
    grant's window where that is shorter (a group with a short ``grant_ack_timeout_s``)."""
    if grant.granted_at is None or grant.confirm_by is None:
        return DELIVERY_MARGIN_S
    return min(DELIVERY_MARGIN_S, max(0.0, grant.confirm_by - grant.granted_at) / 3)


def with_ask_bound(grant: Grant, asked: float) -> Grant:
    """``grant`` bounded also by when this process asked: a request first sent at ``asked``
    (monotonic) was queued after it, so the group granted it no earlier than ``asked +
    waited_s`` — durations on the group's clock, no agreement of wall clocks needed. Only for
    a request this acquire created (a request id asked before, by another attempt, was queued
    earlier). The earlier of the two bounds is kept, and the deadline moves with it."""
    notice = grant.notice
    causal = asked + notice.waited_s
    if grant.granted_at is not None and grant.granted_at <= causal:
        return grant
    if grant.granted_at is None:
        confirm_by = None if notice.confirm_within_s is None else causal + notice.confirm_within_s
    else:
        confirm_by = (
            None if grant.confirm_by is None else grant.confirm_by - (grant.granted_at - causal)
        )
    return dataclasses.replace(grant, granted_at=causal, confirm_by=confirm_by)


def validity_if_fresh(grant: Grant, ttl_s: float) -> float | None:
    """Until when a lease from ``grant`` is locally valid if it was taken fresh: from the
    grant's own time, and never past the group's deadline for confirming it. None: it was taken
    late, or its times are unknown, so it must be confirmed before use."""
    age = grant.age_s
    if grant.granted_at is None or grant.confirm_by is None or age is None:
        return None
    if age > LATE_GRANT_S + CLOCK_SKEW_S:
        return None
    return min(grant.granted_at + ttl_s, grant.confirm_by)


class Delivery(StrEnum):
    """What became of a notice handed to the inbox."""

    TAKEN = "taken"  # handed to its waiting acquire (or the same grant again)
    UNWANTED = "unwanted"  # nobody waits for its request (any more)
    FORGED = "forged"  # its proof is missing or wrong: no group made it


@dataclass
class _Expected:
    future: asyncio.Future[Grant]
    key: str

    @property
    def key_hash(self) -> str:
        return lease_key_hash(self.key)


class GrantInbox:
    def __init__(self) -> None:
        self._waiting: dict[str, _Expected] = {}
        # A group that continued as new re-delivers a grant it had not yet seen taken:
        # request id -> (token, lease key).
        self._accepted: OrderedDict[str, tuple[int, str]] = OrderedDict()
        # Requests given up lately, with their keys: a grant that raced the give-up is
        # declined with the key, so the group ends it at once.
        self._withdrawn: OrderedDict[str, str] = OrderedDict()
        self._closed: BaseException | None = None
        # Notices dropped because their proof was missing or wrong (or, for a fault, because
        # the group had not faulted the job).
        self.forged = 0
        # Grants with a good proof that the group did not hold when they came: made by a reader
        # of the group's history (docs/security.md), or given up by the group meanwhile.
        self.not_held = 0

    def expect(self, request_id: str, key: str) -> asyncio.Future[Grant]:
        """Wait for the grant of ``request_id``, whose lease key is ``key``: only a notice
        proven under its hash is taken."""
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        if self._closed is not None:
            future.set_exception(self._closed)
        self._waiting[request_id] = _Expected(future, key)
        return future

    def _stop_waiting(self, request_id: str) -> asyncio.Future[Grant] | None:
        expected = self._waiting.pop(request_id, None)
        if expected is None:
            return None
        self._withdrawn[request_id] = expected.key
        while len(self._withdrawn) > _ACCEPTED_KEEP:
            self._withdrawn.popitem(last=False)
        return expected.future

    def withdraw(self, request_id: str) -> Grant | None:
        """Stop waiting for ``request_id``; return its grant if one had already arrived (or
        raise why none will: GrantLostError, ClientClosedError)."""
        future = self._stop_waiting(request_id)
        if future is not None and future.done() and not future.cancelled():
            return future.result()
        if future is not None:
            future.cancel()
        return None

    def discard(self, request_id: str) -> None:
        """Stop waiting for ``request_id``, whatever became of it."""
        future = self._stop_waiting(request_id)
        if future is None:
            return
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: nobody else will read it
        else:
            future.cancel()

    def close(self, why: BaseException) -> None:
        """End every wait with ``why`` (the client is closing); later waits end at once."""
        self._closed = why
        for expected in self._waiting.values():
            if not expected.future.done():
                expected.future.set_exception(why)

    def _forged(self, notice: GrantNotice) -> Delivery:
        self.forged += 1
        log.warning(
            "dropped a %s of group %r for request %r (token %s) whose proof is %s: no group "
            "made it; still waiting for the real one",
            "fault notice" if notice.fault is not None else "grant",
            notice.group_id,
            notice.request_id,
            notice.token,
            "missing" if notice.proof is None else "wrong",
        )
        return Delivery.FORGED

    def proven(self, notice: GrantNotice) -> bool:
        """Whether ``notice`` carries its group's proof under the key of a request this
        process made (waiting, taken or given up lately)."""
        key = self._key_of(notice)
        return key is not None and notice_is_proven(notice, lease_key_hash(key))

    def _key_of(self, notice: GrantNotice) -> str | None:
        expected = self._waiting.get(notice.request_id)
        if expected is not None:
            return expected.key
        accepted = self._accepted.get(notice.request_id)
        if accepted is not None:
            return accepted[1]
        return self._withdrawn.get(notice.request_id)

    def accept(self, grant: Grant) -> Delivery:
        """Hand a grant to its waiting acquire, if its proof holds."""
        notice = grant.notice
        accepted = self._accepted.get(notice.request_id)
        if accepted is not None and accepted[0] == notice.token:
            if not notice_is_proven(notice, lease_key_hash(accepted[1])):
                return self._forged(notice)
            return Delivery.TAKEN  # the same grant delivered again (e.g. after continue-as-new)
        expected = self._waiting.get(notice.request_id)
        if expected is None or expected.future.done():
            return Delivery.UNWANTED
        if not notice_is_proven(notice, expected.key_hash):
            return self._forged(notice)  # the wait is not consumed
        expected.future.set_result(grant)
        if notice.fault is None:
            self._accepted[notice.request_id] = (notice.token, expected.key)
            while len(self._accepted) > _ACCEPTED_KEEP:
                self._accepted.popitem(last=False)
        return Delivery.TAKEN

    def answer_key(self, notice: GrantNotice) -> str | None:
        """The key to answer ``notice``'s group with: only for a notice that group made
        (proven under the key's hash), so a forger never learns a key from an answer."""
        key = self._key_of(notice)
        if key is None or not notice_is_proven(notice, lease_key_hash(key)):
            return None
        return key

    def _waits_for(self, notice: GrantNotice) -> bool:
        expected = self._waiting.get(notice.request_id)
        return expected is not None and not expected.future.done()

    def _not_the_groups(self, notice: GrantNotice) -> GrantAck:
        """A proven notice the group itself disowns (its holder is another, or the job is not
        faulted there): dropped, never answered with the key; the wait goes on."""
        if notice.fault is not None:
            self.forged += 1  # a group that refused a job faults it first: no group made it
        else:
            self.not_held += 1
        log.warning(
            "dropped a %s of group %r for request %r (token %s): its proof holds, but the "
            "group %s; still waiting for the request's own grant",
            "fault notice" if notice.fault is not None else "grant",
            notice.group_id,
            notice.request_id,
            notice.token,
            "has not faulted this job"
            if notice.fault is not None
            else "does not hold it (a grant no group made, or one it has given up)",
        )
        return GrantAck(accepted=False)

    def lose(self, request_id: str, why: str) -> None:
        """End the wait for ``request_id``: its grant came, but too late to be used."""
        expected = self._waiting.get(request_id)
        if expected is not None and not expected.future.done():
            expected.future.set_exception(GrantLostError(why))

    @activity.defn(name=DELIVER_GRANT_ACTIVITY)
    async def deliver_grant(self, notice: GrantNotice) -> GrantAck:
        # The key makes the answer the process's own (anyone can complete an activity by its
        # id); it goes only with a notice its group made.
        key = self.answer_key(notice)
        accepted = self._accepted.get(notice.request_id)
        if key is not None and accepted is not None and accepted[0] == notice.token:
            return GrantAck(accepted=True, key=key)  # taken already (e.g. by asking again)
        grant = _grant_from_activity(notice, activity.info())
        if (
            key is not None
            and notice.fault is None
            and grant.confirm_by is not None
            and grant.taken_at > grant.confirm_by - delivery_margin(grant)
        ):
            # This process was paused (or stalled) while the task waited for it: its answer
            # might reach the group after the activity timed out, when the group has already
            # given the grant up and granted the next waiter. Declined, never used.
            late = grant.age_s or 0.0
            activity.logger.warning(
                "grant of %s (token %s) reached this process %.1f s after it was made, too "
                "late to be confirmed; declining",
                notice.group_id,
                notice.token,
                late,
            )
            self.lose(
                notice.request_id,
                f"the grant of group {notice.group_id!r} (token {notice.token}) reached this "
                f"process {late:.1f} s after it was made, too late to be confirmed (the "
                "process was paused or stalled): it was declined and the group grants the next "
                "waiter; acquire again",
            )
            return GrantAck(accepted=False, key=key)
        if key is not None and self._waits_for(notice):
            held, confirmed_until = await _ask_the_group(notice, key, grant)
            if held is False:
                return self._not_the_groups(notice)
            if confirmed_until is not None:
                grant = dataclasses.replace(grant, confirmed_until=confirmed_until)
        delivery = self.accept(grant)
        if delivery is Delivery.UNWANTED and notice.fault is None:
            activity.logger.info(
                "grant of %s (token %s) arrived after the acquire gave up; declining",
                notice.group_id,
                notice.token,
            )
        # A fault notice taken is not a lease: nothing for the group to confirm.
        return GrantAck(
            accepted=delivery is Delivery.TAKEN and notice.fault is None,
            key=self.answer_key(notice),
        )
