"""Acquire and release GPU groups from inside a workflow (the RL job workflow's side).

The group grants a workflow requester by a ``timeslice_grant`` signal; the requester renews on a
durable timer and releases by signal. A request goes as the group's ``acquire`` update (not
parked) through the ``timeslice.request_group`` activity, which creates a missing group by
signal-with-start (a client call). A renewal goes as the group's ``renew`` update, through the
``timeslice.renew_lease`` activity, so it is answered: a lease the group no longer holds (it
expired while the control worker was down, say) is *lost*, and the requester learns it
(:meth:`GroupLeases.lost`, :meth:`GroupLeases.any_lost`) instead of working on under a lease
someone else now holds. Both are activities of their own, not local activities, so the
requester's workflow task never waits for the group's (``GROUP_CALLS_AS_ACTIVITIES``). The
worker running the requester must register both activities (the control worker does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from timeslice.protocol.group import (
    DRAW_SECRET_ACTIVITY,
    GRANT_SIGNAL,
    RENEW_LEASE_ACTIVITY,
    REQUEST_GROUP_ACTIVITY,
    AcquireAnswer,
    AcquireOutcome,
    AcquireRequest,
    CancelRequest,
    GrantNotice,
    GroupRequest,
    GroupSignal,
    LeaseRenewal,
    MalformedMessage,
    ReleaseRequest,
    RenewRequest,
    RenewResult,
    SnapshotReport,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
    notice_is_proven,
    parse_message,
)
from timeslice.protocol.rl_job import LeaseOrder

# workflow.patched id: requester workflows that started before it replay taking grants unproven.
GRANT_NOTICE_PROOFS = "grant-notice-proofs"
# workflow.patched id: requesters that started before it replay with renewals by signal, which
# the group never answers.
ANSWERED_RENEWALS = "answered-lease-renewals"
# workflow.patched id: a renewer cancelled while its renewal's local activity is in flight
# stops. Before it, the SDK's ActivityError for that cancel read as an unanswered renewal, the
# renewer carried on, and the release (or continue-as-new) awaiting it waited forever, holding
# the group (bench/scale.py, 200 jobs on 50 groups: 124 never ended).
RENEWER_OBEYS_CANCEL = "renewer-obeys-cancel"
# workflow.patched id: a request and a renewal go to the group as activities of their own, not
# local activities. A local activity keeps its workflow task (and the worker's task slot) open
# until it ends, and these wait for the group's workflow task: with more requesters than task
# slots (200 jobs preparing at once on 100 slots), or any task queued past its time-out, the
# requesters' tasks timed out, their runs were evicted and replayed, and the control plane did
# less the more it was asked (bench/scale.py at 200 x 50 stalled at 24 jobs done). An activity
# waits in an activity slot, and its workflow task completes at once. From the same patch on,
# a request whose activity failed is taken back (it may have reached the group), where before
# its grant came later, was dropped, and held the group for a TTL.
GROUP_CALLS_AS_ACTIVITIES = "group-calls-as-activities"
# workflow.patched id: a fault notice (whose proof a reader of the group's history can make) is
# checked by asking the group about the request again before it fails the job.
FAULTS_ASKED_AGAIN = "fault-notices-asked-again"
# workflow.patched id: a wait for a grant without a time-out starts a timer anyway (a day's,
# started again if it fires), whose summary names the wait (acquire's wait_label): the wait is a
# labelled row of the requester's timeline in the Web UI, not a gap. Two events a wait (started,
# cancelled with the grant's task); requesters that started before it replay without the timer.
LABELLED_LEASE_WAITS = "labelled-lease-waits"
_LABEL_TIMER_S = 86_400.0
# A renewal that failed (no answer: the group's worker is down, the server unreachable) is tried
# again this soon, until the lease's TTL since the last answered renewal runs out.
_RENEW_RETRY_S = 1.0
# How long a request's activity may try to reach the group (sent again, same request id, while
# it is not answered: the group takes a request once).
_REQUEST_TIMEOUT = timedelta(seconds=60)


async def end_order(order: LeaseOrder) -> None:
    """End a lease a job process took (or asked for) when the process cannot: a failed
    phase, a stop, a continue-as-new. A known token releases it; otherwise cancel takes the
    request back, or ends a grant it had (both are no-ops if the process did it)."""
    handle = workflow.get_external_workflow_handle(group_workflow_id(order.group_id))
    if order.token is not None:
        await handle.signal(
            GroupSignal.RELEASE,
            ReleaseRequest(request_id=order.request_id, token=order.token, key=order.key),
        )
    else:
        await handle.signal(
            GroupSignal.CANCEL, CancelRequest(request_id=order.request_id, key=order.key)
        )


class GroupLeases:
    """Create inside a workflow (``__init__`` or ``run``, before its first command); it
    registers the grant signal, unless the workflow declares a handler of its own that calls
    ``on_grant`` (the RL job workflows do, so that the handler has a description)."""

    def __init__(
        self,
        job_id: str,
        *,
        priority: int = 0,
        ttl_s: float | None = None,
        snapshot: SnapshotTarget | None = None,
        state_bytes: int | None = None,
        register_grant_signal: bool = True,
    ) -> None:
        self.job_id = job_id
        self.priority = priority
        self.ttl_s = ttl_s
        self.snapshot = snapshot
        self.state_bytes = state_bytes
        self._grants: dict[str, GrantNotice] = {}
        # request id -> the summary of its wait's timer (acquire's wait_label)
        self._wait_labels: dict[str, str] = {}
        self._renewers: dict[str, asyncio.Task[None]] = {}
        # request id -> why its lease was lost (the group said so, or no renewal was answered
        # within its TTL); kept until the lease is released or forgotten.
        self._lost: dict[str, str] = {}
        # request id -> its lease key (drawn from the workflow's deterministic randomness)
        self._keys: dict[str, str] = {}
        # request id -> the request (asked again when its process refuses the grant)
        self._requests: dict[str, tuple[str, AcquireRequest]] = {}
        # requests whose lease a renewal of this workflow's confirmed at the group
        self._confirmed: set[str] = set()
        # Drawn once by a local activity (recorded in the history, so replay-safe): lease keys
        # derive from it, not from the workflow's randomness, which its run id reproduces.
        self.secret: str | None = None
        # Grant and fault notices dropped because their proof was missing or wrong, or because
        # they named a request this workflow never made.
        self.forged_notices = 0
        if register_grant_signal:
            workflow.set_signal_handler(GRANT_SIGNAL, self.on_grant)
        # Decided once, as the requester starts (before any other command of its run).
        self._answered_renewals = workflow.patched(ANSWERED_RENEWALS)
        self._calls_as_activities = workflow.patched(GROUP_CALLS_AS_ACTIVITIES)

    async def draw_secret(self, carried: str | None = None) -> str:
        """The secret lease keys derive from: ``carried`` (from the previous run of a
        continued-as-new workflow), the one drawn already, or a new one."""
        if carried is not None:
            self.secret = carried
        if self.secret is None:
            self.secret = await workflow.execute_local_activity(
                DRAW_SECRET_ACTIVITY,
                start_to_close_timeout=timedelta(seconds=10),
                result_type=str,
                summary="draw the lease-key secret",
            )
        return self.secret

    def new_key(self, request_id: str) -> str:
        """The lease key of ``request_id``: 32 hex digits of HMAC-SHA256 under the secret
        (``draw_secret`` first). Only this workflow (and its history) can know it."""
        if self.secret is None:
            raise RuntimeError("GroupLeases.draw_secret() must run before keys are made")
        mac = hmac.new(bytes.fromhex(self.secret), request_id.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def key_of(self, lease: GrantNotice) -> str:
        return self._keys[lease.request_id]

    def on_grant(self, *raw: Any) -> None:
        """Take a group's grant (or fault) notice of a lease this workflow asked for: the
        ``timeslice_grant`` signal's handler. Taken raw: a malformed notice is dropped, never
        raised into the workflow task; so is one for a request this workflow did not make, and
        one whose proof is missing or wrong (counted in ``forged_notices``)."""
        try:
            notice = parse_message(GrantNotice, raw, f"the {GRANT_SIGNAL} signal")
        except MalformedMessage as err:
            workflow.logger.warning("job %s dropped %s", self.job_id, err)
            return
        key = self._keys.get(notice.request_id)
        if key is None:
            # A request this workflow made and let go (a grant that raced its give-up) is
            # proven under the key its secret gives; any other notice is no group's to it.
            late = self.secret is not None and notice_is_proven(
                notice, lease_key_hash(self.new_key(notice.request_id))
            )
            if not late:
                self.forged_notices += 1
            workflow.logger.warning(
                "job %s dropped a %s for request %r, %s",
                self.job_id,
                "fault notice" if notice.fault is not None else "grant",
                notice.request_id,
                "which it had given up" if late else "which it did not make (counted as forged)",
            )
            return
        # Histories from before grants carried proofs replay as they ran (their grants have
        # none); every new run checks.
        if workflow.patched(GRANT_NOTICE_PROOFS) and not notice_is_proven(
            notice, lease_key_hash(key)
        ):
            # Not made by the group: its request id and token are in anyone's `status`. The
            # wait goes on, and the real grant is taken when it comes.
            self.forged_notices += 1
            workflow.logger.warning(
                "job %s dropped a %s for request %r (token %s) whose proof is %s: it was not "
                "made by group %r",
                self.job_id,
                "fault notice" if notice.fault is not None else "grant",
                notice.request_id,
                notice.token,
                "missing" if notice.proof is None else "wrong",
                notice.group_id,
            )
            return
        self._grants[notice.request_id] = notice

    async def _signal(self, group_id: str, name: GroupSignal, arg: object) -> None:
        await workflow.get_external_workflow_handle(group_workflow_id(group_id)).signal(name, arg)

    async def acquire(
        self,
        group_id: str,
        timeout: float | None = None,
        *,
        snapshot: SnapshotTarget | None = None,
        state_bytes: int | None = None,
        restores_itself: bool = False,
        wait_label: str | None = None,
    ) -> GrantNotice:
        """Wait for the group; raises ApplicationError type ``AcquireTimeout`` or ``JobFaulted``.

        ``snapshot`` / ``state_bytes`` override the defaults for this request (a job moves
        different state on its sampler group than on its trainer group). ``wait_label``: the
        summary of the wait's timer (with a ``timeout``), the row the wait for the grant is on
        the workflow's timeline in the Web UI (default ``wait for GROUP``).
        """
        await self.draw_secret()
        request_id = f"{self.job_id}:{workflow.uuid4()}"
        key = self.new_key(request_id)
        request = AcquireRequest(
            request_id=request_id,
            key_hash=lease_key_hash(key),
            job_id=self.job_id,
            reply_workflow_id=workflow.info().workflow_id,
            priority=self.priority,
            ttl_s=self.ttl_s,
            timeout_s=timeout,
            snapshot=snapshot or self.snapshot,
            state_bytes=state_bytes if state_bytes is not None else self.state_bytes,
            restores_itself=restores_itself,
        )
        rid = request.request_id
        if wait_label is not None:
            self._wait_labels[rid] = wait_label
        # Known before the request goes out: its grant may arrive with the request's answer.
        self._keys[rid] = key
        cancel = CancelRequest(request_id=rid, key=key)
        try:
            await self._ask(group_id, request)
        except BaseException:
            if self._calls_as_activities:
                # It may have reached the group: take it back, or its grant holds the group
                # for a TTL with nobody to use it.
                await self._signal(group_id, GroupSignal.CANCEL, cancel)
            del self._keys[rid]
            raise
        self._requests[rid] = (group_id, request)
        return await self._granted(group_id, rid, timeout)

    async def _ask(self, group_id: str, request: AcquireRequest) -> AcquireAnswer | None:
        """Queue ``request`` at the group (creating the group if it does not exist): the
        ``request_group`` activity (a local one in runs from before
        ``group-calls-as-activities``). The group's answer, or None where the answer was not
        kept (a group it started, a history from before answers were read)."""
        call = GroupRequest(group_id=group_id, request=request)
        summary = f"request {group_id}"
        if self._calls_as_activities:
            raw = await workflow.execute_activity(
                REQUEST_GROUP_ACTIVITY,
                call,
                start_to_close_timeout=_REQUEST_TIMEOUT,
                summary=summary,
            )
        else:
            raw = await workflow.execute_local_activity(
                REQUEST_GROUP_ACTIVITY,
                call,
                start_to_close_timeout=timedelta(seconds=30),
                summary=summary,
            )
        try:
            return None if raw is None else AcquireAnswer.model_validate(raw)
        except ValidationError:
            return None

    async def _granted(self, group_id: str, rid: str, timeout: float | None) -> GrantNotice:
        """Wait for the grant of the request ``rid`` asked for; renew it once taken."""
        key = self._keys[rid]
        cancel = CancelRequest(request_id=rid, key=key)
        label = self._wait_labels.get(rid) or f"wait for {group_id}"
        try:
            # The timer of the time-out carries the label: the wait is a row of the timeline.
            if timeout is None and workflow.patched(LABELLED_LEASE_WAITS):
                while rid not in self._grants:
                    with contextlib.suppress(TimeoutError):
                        await workflow.wait_condition(
                            lambda: rid in self._grants,
                            timeout=_LABEL_TIMER_S,
                            timeout_summary=label,
                        )
            else:
                await workflow.wait_condition(
                    lambda: rid in self._grants, timeout=timeout, timeout_summary=label
                )
        except asyncio.CancelledError:
            # The requester is being cancelled: take the request (or a racing grant) back.
            await self._signal(group_id, GroupSignal.CANCEL, cancel)
            raise
        except TimeoutError:
            # The group drops it too (and ends a grant that raced this), so it never leaks.
            await self._signal(group_id, GroupSignal.CANCEL, cancel)
            raise ApplicationError(
                f"group {group_id!r} was not granted to job {self.job_id} within {timeout} s",
                type="AcquireTimeout",
            ) from None
        notice = self._grants.pop(rid)
        self._wait_labels.pop(rid, None)
        if notice.fault is not None:
            if await self._fault_is_forged(group_id, rid):
                return await self._granted(group_id, rid, timeout)
            raise ApplicationError(notice.fault, type="JobFaulted", non_retryable=True)
        self._renewers[rid] = asyncio.create_task(self._renew(group_id, notice))
        return notice

    async def _fault_is_forged(self, group_id: str, rid: str) -> bool:
        """Whether a fault notice for ``rid`` is none of the group's: its proof holds, but a
        reader of the group's history can make that (docs/security.md), and a fault fails the
        job. The group is asked about the request again: one it refused is gone, one it still
        queues (or holds) was never refused. Runs from before this take the fault as it is."""
        if rid not in self._requests or not workflow.patched(FAULTS_ASKED_AGAIN):
            return False
        answer = await self._ask(*self._requests[rid])
        if answer is None or answer.outcome is AcquireOutcome.GONE:
            return False
        self.forged_notices += 1
        workflow.logger.warning(
            "job %s dropped a fault notice of %s: the group still has its request (%s)",
            self.job_id,
            group_id,
            answer.outcome.value,
        )
        if answer.notice is not None:
            self.on_grant(answer.notice)  # granted meanwhile: taken with its proof
        return True

    async def _renew(self, group_id: str, notice: GrantNotice) -> None:
        rid = notice.request_id
        renew = RenewRequest(request_id=rid, token=notice.token, key=self._keys[rid])
        interval = notice.ttl_s / 3
        # Held for sure until then, as far as this workflow can tell: from the grant's arrival
        # at first, then from each answered renewal's sending.
        held_until = workflow.now() + timedelta(seconds=notice.ttl_s)
        wait = interval
        while True:
            await workflow.sleep(wait)
            if not self._answered_renewals:
                await self._signal(group_id, GroupSignal.RENEW, renew)
                continue
            sent = workflow.now()
            answer = await self._renew_once(group_id, renew, interval)
            if isinstance(answer, RenewResult) and answer.valid:
                held_until = sent + timedelta(seconds=answer.ttl_s)
                self._confirmed.add(rid)
                wait = interval
                continue
            if isinstance(answer, RenewResult):
                self._lose(rid, group_id, f"the group revoked it: {answer.reason}")
                return
            if workflow.now() >= held_until:
                self._lose(
                    rid,
                    group_id,
                    f"no renewal was answered within its TTL ({notice.ttl_s:g} s): {answer}",
                )
                return
            wait = min(
                interval, _RENEW_RETRY_S, max(0.1, (held_until - workflow.now()).total_seconds())
            )

    async def _renew_once(
        self, group_id: str, renew: RenewRequest, interval: float
    ) -> RenewResult | str:
        """The group's answer to one renewal, or why none came."""
        renewal = LeaseRenewal(group_id=group_id, renew=renew, give_up_after_s=max(1.0, interval))
        within = timedelta(seconds=max(2.0, interval + 1.0))
        once = RetryPolicy(maximum_attempts=1)
        summary = f"renew {group_id}"
        try:
            if self._calls_as_activities:
                # The answer's window counts from the scheduling: a renewal that waited for a
                # worker is as unanswered as one that waited for the group.
                return await workflow.execute_activity(
                    RENEW_LEASE_ACTIVITY,
                    renewal,
                    schedule_to_close_timeout=within,
                    retry_policy=once,
                    result_type=RenewResult,
                    summary=summary,
                )
            return await workflow.execute_local_activity(
                RENEW_LEASE_ACTIVITY,
                renewal,
                start_to_close_timeout=within,
                retry_policy=once,
                result_type=RenewResult,
                summary=summary,
            )
        except ActivityError as err:
            if isinstance(err.cause, CancelledError) and workflow.patched(RENEWER_OBEYS_CANCEL):
                raise asyncio.CancelledError() from err  # forget() cancelled this renewer
            return str(err.cause or err)

    def _lose(self, request_id: str, group_id: str, why: str) -> None:
        self._lost[request_id] = why
        self._renewers.pop(request_id, None)
        workflow.logger.warning("job %s lost its lease on %s: %s", self.job_id, group_id, why)

    def confirmed(self, lease: GrantNotice) -> bool:
        """Whether a renewal of this workflow's found ``lease`` held at the group (else the
        grant is still only as good as its proof, which a reader of the group's history can
        make: docs/security.md)."""
        return lease.request_id in self._confirmed

    async def recheck(self, lease: GrantNotice, timeout: float | None) -> GrantNotice | None:
        """Ask the group about ``lease``'s request again, after the job's process refused the
        lease (the group's holder is another): still queued, the grant was none of the
        group's (counted in ``forged_notices``) and the real one is waited for, up to
        ``timeout``; held, it is the group's; gone, it ended before it was used (None).

        Args:
            lease: The grant this workflow took.
            timeout: How long to wait for the real grant (None: as long as it takes).

        Returns:
            The lease the group granted the request (renewed from now on), or None.

        Raises:
            ApplicationError: ``AcquireTimeout``, the real grant did not come in time.
        """
        rid = lease.request_id
        renewer = self._renewers.pop(rid, None)
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        self._lost.pop(rid, None)
        if rid not in self._requests:
            return None  # asked by another run: nothing to ask again with
        group_id, request = self._requests[rid]
        answer = await self._ask(group_id, request)
        outcome = None if answer is None else answer.outcome
        if outcome is AcquireOutcome.GRANTED and answer is not None and answer.notice is not None:
            self.on_grant(answer.notice)  # taken only with its proof, as every notice
        elif outcome is AcquireOutcome.QUEUED:
            self.forged_notices += 1
            workflow.logger.warning(
                "job %s: its process refused the grant of %s (token %s), and the group still "
                "has the request queued: no group made that grant; waiting for the real one",
                self.job_id,
                group_id,
                lease.token,
            )
        else:
            workflow.logger.warning(
                "job %s: its process refused the grant of %s (token %s), which the group no "
                "longer holds (%s)",
                self.job_id,
                group_id,
                lease.token,
                "gone" if outcome is None else outcome.value,
            )
            self._forget_request(rid)
            return None
        return await self._granted(group_id, rid, timeout)

    def lost(self, lease: GrantNotice) -> str | None:
        """Why ``lease`` was lost, or None while it is (as far as this workflow knows) held."""
        return self._lost.get(lease.request_id)

    def any_lost(self, leases: list[GrantNotice]) -> str | None:
        """Why the first of ``leases`` that was lost was, or None."""
        for lease in leases:
            why = self._lost.get(lease.request_id)
            if why is not None:
                return f"the lease on {lease.group_id} (token {lease.token}) was lost: {why}"
        return None

    def _forget_request(self, rid: str) -> None:
        self._keys.pop(rid, None)
        self._lost.pop(rid, None)
        self._requests.pop(rid, None)
        self._confirmed.discard(rid)

    async def forget(self, lease: GrantNotice) -> None:
        """Stop renewing ``lease`` without releasing it (someone else already released it)."""
        self._forget_request(lease.request_id)
        renewer = self._renewers.pop(lease.request_id, None)
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    async def release(
        self,
        lease: GrantNotice,
        *,
        restored: list[SnapshotReport] | None = None,
        evicted: list[SnapshotReport] | None = None,
    ) -> None:
        """Release; ``restored`` / ``evicted``: what the holder moved itself, for accounting."""
        key = self._keys[lease.request_id]
        await self.forget(lease)
        release = ReleaseRequest(
            request_id=lease.request_id,
            token=lease.token,
            key=key,
            restored=list(restored or []),
            evicted=list(evicted or []),
        )
        await self._signal(lease.group_id, GroupSignal.RELEASE, release)
