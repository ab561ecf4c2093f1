"""A job's lease session: how one process of a job takes, keeps and hands back GPU-group leases.

Acquire (the parked ask, the grant taken from the inbox or confirmed late), renew (the
heartbeats), release, withdraw, the reports of its own evictions, departure, and a group's
status: async code with no loop of its own, run on whichever event loop hosts it. The embedded
client hosts it on a loop thread of its own, whose worker serves the job's queue
(``timeslice.session.engine.Engine``); a job process hosts it on its job worker's loop, and that
worker serves the queue (``activities/job_runtime.py``). How it retries a call is
``retry.py``'s; why a group does not answer, ``diagnosis.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span
from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import (
    AcquireTimeoutError,
    ClientClosedError,
    GrantLostError,
    GroupNotAnsweringError,
    InvalidArgumentError,
    JobFaultedError,
    LeaseRevokedError,
    NoControlWorkerError,
    NotHolderError,
    RateLimitedError,
    ServerUnreachableError,
    SnapshotFailedError,
    TimesliceError,
    UnknownGroupError,
)
from timeslice.protocol.group import (
    CONTROL_TASK_QUEUE,
    GROUP_KEY,
    RATE_LIMITED,
    AcquireAnswer,
    AcquireCall,
    AcquireOutcome,
    AcquireRequest,
    CancelRequest,
    DepartRequest,
    GrantNotice,
    GroupConfig,
    GroupQuery,
    GroupSignal,
    GroupStatus,
    GroupUpdate,
    LeaseReturn,
    MovedReport,
    NextPhase,
    RenewRequest,
    ReturnAnswer,
    SnapshotJobInput,
    SnapshotJobResult,
    SnapshotReport,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
)
from timeslice.session import diagnosis
from timeslice.session.arguments import check_next_phase
from timeslice.session.grants import (
    Delivery,
    Grant,
    GrantInbox,
    grant_from_update,
    validity_if_fresh,
    with_ask_bound,
)
from timeslice.session.group_start import start_group
from timeslice.session.lease import Lease, phases_since_grant
from timeslice.session.retry import UPDATE_GIVE_UP_S, Retrying, RpcRetries
from timeslice.transport.connection import connect
from timeslice.transport.renewals import (
    Recorded,
    RenewalPath,
    counted_from_signal,
    group_renewal_rule,
    send_renewal,
)
from timeslice.transport.telemetry import end_span, tracer
from timeslice.transport.updates import UNPROCESSED_UPDATE, send_update
from timeslice.workflows.snapshot_job import SNAPSHOT_JOB_WORKFLOW_TYPE

log = logging.getLogger("timeslice.client")
T = TypeVar("T")
_KEYS_KEEP = 1024
CLOSED = "this client is closed: create a new TimeSliceOrchestratorClient to use the groups again"
STATUS_TIMEOUT = timedelta(seconds=10)
# A waiter whose grant comes by activity asks again this often (see LeaseSession._ask).
REASK_QUEUED_S = 15.0
# The most an acquire that gives up spends withdrawing its request.
WITHDRAW_S = 5.0
# An acquire that ended in NoControlWorkerError withdraws its request for this long at most
# (less if its own time-out is shorter: the group drops the request then anyway).
ORPHAN_WITHDRAW_S = 60.0


def _orphan_withdraw_s(timeout: float | None) -> float:
    return (
        ORPHAN_WITHDRAW_S if timeout is None else max(WITHDRAW_S, min(timeout, ORPHAN_WITHDRAW_S))
    )


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a task's outcome as read: what it ended with is of no interest to anyone."""
    if not task.cancelled():
        task.exception()


# Updates of this process on their way into one group at once (see LeaseSession._gate).
UPDATES_ENTERING = 2

# How long close() waits for acquires that other threads are waiting in to end.
CLOSE_ACQUIRES_S = WITHDRAW_S + 2.0


class _Default:
    """Marks an argument left out (None is a meaningful value for it)."""


DEFAULT = _Default()


@dataclass
class SessionSettings:
    """What one job process's lease session asks the groups with.

    Args:
        connect_config: How to reach Temporal (``timeslice.transport.connection``'s
            ``connect_config``); a job process that attaches its worker's client names only
            ``target_host``, for messages.
        job_id: The job's id, the same in every process of the job.
        task_queue: This process's queue: grants and evictions come there.
        priority: Its requests' priority, unless an acquire gives one.
        lease_ttl_s: Its leases' TTL, unless an acquire gives one (None: the group's default).
        snapshot_target: What a group may evict of this job, unless an acquire says otherwise.
        state_bytes: The job's declared device footprint, unless an acquire says otherwise.
        rpc_retry_s: How long a call retries a server that does not answer.
    """

    connect_config: dict[str, Any]
    job_id: str
    task_queue: str
    priority: int = 0
    lease_ttl_s: float | None = None
    snapshot_target: SnapshotTarget | None = None
    state_bytes: int | None = None
    rpc_retry_s: float = 60.0


class LeaseSession:
    """One job process's leases and requests; every coroutine runs on the loop that hosts it."""

    def __init__(
        self,
        settings: SessionSettings,
        *,
        serve: Callable[[Client], Awaitable[None]] | None = None,
    ) -> None:
        """``serve``: called with the connected client before each lease is asked for and
        each standalone eviction, to make sure this job's task queue is served (grants,
        evictions); the embedded client's host starts its worker there. None: the caller's
        own worker serves the queue (a job process)."""
        self.settings = settings
        # Named in every request and message: short names for the settings'.
        self.job_id = settings.job_id
        self.task_queue = settings.task_queue
        self._serve = serve
        self.retries = RpcRetries(
            server=self._server,
            bound_s=settings.rpc_retry_s,
            not_answering=self._not_answering,
        )
        self.held: dict[str, Lease] = {}
        # group id -> the key of this job's last lease there: its reports and departure carry it
        self.last_keys: dict[str, str] = {}
        # group id -> this job's own evictions off its device that the group let wait for the
        # job's next release there (ReturnAnswer.report_with_next), or for its departure
        self.late_evictions: dict[str, list[SnapshotReport]] = {}
        self._keys: OrderedDict[str, str] = OrderedDict()
        # Grants that come as activities on this job's queue: whoever serves it runs the inbox's
        # deliver_grant.
        self.inbox = GrantInbox()
        self._client: Client | None = None
        self._connecting: asyncio.Future[Client] | None = None
        self._heartbeats: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Future[None]] = set()
        # The asks of acquires (parked updates): close() cancels what is left of them.
        self._asks: set[asyncio.Future[None]] = set()
        # Acquires under way: close() ends them (ClientClosedError) and waits for them.
        self._acquiring: set[asyncio.Task[Any]] = set()
        self._known_groups: set[str] = set()
        # group id -> until when (monotonic) it told this process to send it nothing it could
        # refuse (per-caller fairness): every thread's calls wait, a try-lock raises.
        self._quiet_until: dict[str, float] = {}
        self._quiet_why: dict[str, str] = {}  # the group's word for it, repeated to every call
        # group id -> its renewal rule, once it answered (transport.renewals.group_renewal_rule)
        self._renewal_rules: dict[str, bool] = {}
        self._gates: dict[str, asyncio.Semaphore] = {}
        self._closed = False
        # group id -> its lease's (timeslice.lease, timeslice.hold) spans, ended by release
        self._spans: dict[str, tuple[Span, Span]] = {}

    # ------------------------------------------------------------ plumbing

    @property
    def closed(self) -> bool:
        return self._closed

    def attach(self, client: Client) -> None:
        """Use ``client`` (a job process's) instead of connecting."""
        future: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        future.set_result(client)
        self._connecting = future
        self._client = client

    async def connected(self) -> Client:
        """The Temporal client, connected on first use (no worker: enough for queries)."""
        if self._closed:
            raise ClientClosedError(CLOSED)
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(connect(self.settings.connect_config))
        try:
            self._client = await asyncio.shield(self._connecting)
        except BaseException:
            if self._connecting.done():
                self._connecting = None  # let a later call try again
            raise
        return self._client

    async def start(self) -> Client:
        """Connect, and make sure this job's task queue is served (grants, evictions)."""
        client = await self.connected()
        if self._serve is not None:
            await self._serve(client)
        return client

    def _server(self) -> str:
        """The Temporal server's address as the settings say now (a job process's is set when
        it attaches its worker's client)."""
        return str(self.settings.connect_config["target_host"])

    def _client_now(self) -> Client:
        assert self._client is not None
        return self._client

    def _group_handle(self, group_id: str) -> WorkflowHandle[Any, Any]:
        assert self._client is not None
        return self._client.get_workflow_handle(group_workflow_id(group_id))

    # ------------------------------------------------------------ acquire / release

    async def acquire(
        self,
        group_id: str,
        timeout: float | None,
        priority: int | None,
        ttl_s: float | None,
        **request: Any,
    ) -> Lease:
        """Traced as a ``timeslice.lease`` span (under the caller's current span) holding
        ``timeslice.acquire`` (request to grant) and ``timeslice.hold`` (grant to release).

        ``request``: what a job process sets per lease (``request_id``, ``snapshot``,
        ``state_bytes``, ``restores_itself``); see :meth:`_acquire`."""
        attributes = {"timeslice.group_id": group_id, "timeslice.job_id": self.job_id}
        lease_span = tracer().start_span("timeslice.lease", attributes=attributes)
        in_lease = trace.set_span_in_context(lease_span)
        me = asyncio.current_task()
        if me is not None:
            self._acquiring.add(me)
        try:
            with tracer().start_as_current_span(
                "timeslice.acquire", context=in_lease, attributes=attributes
            ) as acquire_span:
                lease = await self._acquire(group_id, timeout, priority, ttl_s, **request)
                acquire_span.set_attributes(
                    {"timeslice.token": lease.token, "timeslice.waited_s": lease.waited_s}
                )
        except BaseException as err:
            end_span(lease_span, err)
            raise
        finally:
            self._acquiring.discard(me)  # type: ignore[arg-type]
        lease_span.set_attribute("timeslice.token", lease.token)
        hold = tracer().start_span(
            "timeslice.hold",
            context=in_lease,
            attributes={**attributes, "timeslice.token": lease.token},
        )
        self._spans[group_id] = (lease_span, hold)
        with trace.use_span(hold):  # the heartbeat's renewals are part of the hold
            self._heartbeats[group_id] = asyncio.create_task(self._heartbeat(lease))
        return lease

    async def _acquire(
        self,
        group_id: str,
        timeout: float | None,
        priority: int | None,
        ttl_s: float | None,
        *,
        request_id: str | None = None,
        key: str | None = None,
        snapshot: SnapshotTarget | _Default | None = DEFAULT,
        state_bytes: int | _Default | None = DEFAULT,
        restores_itself: bool = False,
    ) -> Lease:
        """Ask ``group_id`` for a lease and wait for its grant (see :meth:`acquire`).

        ``request_id`` and ``key``: a request the job's workflow named (a job process);
        None: new ones. ``snapshot`` and ``state_bytes``: DEFAULT, the session's settings."""
        if group_id in self.held:
            raise InvalidArgumentError(
                f"job {self.job_id} already holds group {group_id!r} (token "
                f"{self.held[group_id].token}); release it before acquiring it again"
            )
        await self.start()
        if self._closed:
            raise ClientClosedError(CLOSED)
        # Only this process knows the key; the group holds its hash (docs/security.md).
        key = key or secrets.token_urlsafe(24)
        settings = self.settings
        request = AcquireRequest(
            request_id=request_id or f"{self.job_id}:{uuid.uuid4().hex}",
            key_hash=lease_key_hash(key),
            job_id=self.job_id,
            reply_task_queue=self.task_queue,
            priority=settings.priority if priority is None else priority,
            ttl_s=ttl_s if ttl_s is not None else settings.lease_ttl_s,
            # A try-lock's request must not time out before the group grants it.
            timeout_s=timeout or None,
            snapshot=settings.snapshot_target if isinstance(snapshot, _Default) else snapshot,
            state_bytes=settings.state_bytes if isinstance(state_bytes, _Default) else state_bytes,
            restores_itself=restores_itself,
        )
        asked = time.monotonic()
        grant = await self._grant_of(group_id, request, key, timeout, asked)
        if request_id is None:  # created here: queued after `asked`
            grant = with_ask_bound(grant, asked)
        lease = await self._lease_from(grant, group_id, key, asked)
        self.held[group_id] = lease
        self.last_keys[group_id] = key
        return lease

    async def _grant_of(
        self,
        group_id: str,
        request: AcquireRequest,
        key: str,
        timeout: float | None,
        asked: float,
    ) -> Grant:
        """Queue ``request`` at the group and wait for its grant within ``timeout``; the
        request is withdrawn whenever the acquire ends without one."""
        rid = request.request_id
        granted = self.inbox.expect(rid, key)
        # Kept a while after the acquire ends: a grant that raced its give-up is handed back
        # with it.
        self._keys[rid] = key
        while len(self._keys) > _KEYS_KEEP:
            self._keys.popitem(last=False)
        accepted = asyncio.Event()  # the group took the request (a control worker runs it)
        # The ask is not cancelled when the acquire ends: the group answers a parked wait as
        # soon as the request is granted or gone, and an RPC abandoned mid-flight would outlive
        # its event loop. close() cancels what is left of it.
        asking = self._track(
            self._ask(group_id, request, granted, accepted, asked, only_if_free=timeout == 0),
            self._asks,
        )
        await self._wait_for_grant(group_id, rid, granted, asking, timeout, asked)
        # (Once the grant came, what stopped the ask later no longer matters.)
        if asking.done() and asking.exception() is not None and not granted.done():
            self.inbox.discard(rid)
            asking.result()  # raises it
        return await self._take_grant(group_id, rid, timeout, accepted)

    async def _wait_for_grant(
        self,
        group_id: str,
        rid: str,
        granted: asyncio.Future[Any],
        asking: asyncio.Future[None],
        timeout: float | None,
        asked: float,
    ) -> None:
        """Wait until the grant comes, the ask fails, or ``timeout`` (counted from ``asked``)
        runs out; a try-lock (timeout 0) waits for the group's answer. An acquire that ends
        here in an error (cancelled, say) withdraws its request first."""
        try:
            wait_s = None if timeout == 0 else timeout
            await asyncio.wait({granted, asking}, timeout=wait_s, return_when="FIRST_COMPLETED")
            if asking.done() and not granted.done() and timeout != 0:
                asking.result()  # raises what stopped the request from being queued
                remaining = None if timeout is None else timeout - (time.monotonic() - asked)
                if remaining is None or remaining > 0:
                    await asyncio.wait({granted}, timeout=remaining)
        except NoControlWorkerError:
            self.inbox.discard(rid)
            # Nothing serves the group now (or its worker is reconnecting after a server
            # restart), but the request may be queued there already: withdrawn in the
            # background once a control worker answers, within the request's own time-out, so
            # its grant does not hold the group for grant_ack_timeout_s with nobody to take it.
            self._track(self._withdraw(group_id, rid, within_s=_orphan_withdraw_s(timeout)))
            raise
        except BaseException:
            self.inbox.discard(rid)
            # Shielded and tracked: a cancelled acquire still withdraws, and close() waits for it.
            await asyncio.shield(self._track(self._withdraw(group_id, rid)))
            raise

    async def _take_grant(
        self, group_id: str, rid: str, timeout: float | None, accepted: asyncio.Event
    ) -> Grant:
        """The grant the inbox holds for ``rid``; without one the request is withdrawn and the
        acquire fails with why: the group never took it, or it was not granted in time."""
        try:
            grant = self.inbox.withdraw(rid)
        except (GrantLostError, ClientClosedError):
            await self._withdraw(group_id, rid)
            raise
        if grant is not None:
            return grant
        if not accepted.is_set():
            # Nothing took the request: the withdrawal would wait on nothing as well, so it
            # goes on in the background and the acquire keeps to its time-out.
            self._track(self._withdraw(group_id, rid))
            raise await self._not_answering(
                group_id, f"acquire {group_id}: the group took no request in {timeout} s"
            )
        if timeout == 0:
            # A try-lock the group answered without a grant queued nothing (only_if_free):
            # nothing to withdraw, and one update a try-lock, not two.
            raise AcquireTimeoutError(
                f"group {group_id!r} is held or has waiters: not granted to job "
                f"{self.job_id} (timeout=0 only takes a free group)"
            )
        await self._withdraw(group_id, rid)
        raise AcquireTimeoutError(
            f"group {group_id!r} was not granted to job {self.job_id} within {timeout} s; "
            "the request was withdrawn"
        )

    async def _lease_from(self, grant: Grant, group_id: str, key: str, asked: float) -> Lease:
        """The lease ``grant`` gives, valid from the grant's own time if it came fresh, or
        once a renewal confirmed it (:meth:`_confirm_late`)."""
        notice = grant.notice
        if notice.fault is not None:
            raise JobFaultedError(f"group {group_id!r} refused job {self.job_id}: {notice.fault}")
        lease = Lease(
            group_id=group_id,
            job_id=self.job_id,
            token=notice.token,
            request_id=notice.request_id,
            ttl_s=notice.ttl_s,
            waited_s=notice.waited_s,
            confirm_within_s=notice.confirm_within_s,
            asked_at=asked,
            key=key,
            memory_bytes=notice.memory_bytes,
        )
        valid_until = validity_if_fresh(grant, notice.ttl_s)
        if grant.confirmed_until is not None:
            # Confirmed by a renewal as it was taken (a grant by activity): held until then.
            lease.valid_until = grant.confirmed_until
            lease.confirm_within_s = None
        elif valid_until is not None:
            # The fast path: no round trip. Valid from the grant's own time, and never past
            # the group's deadline for confirming it (the first renewal comes well before).
            lease.valid_until = valid_until
        else:
            await self._confirm_late(lease, grant)
        return lease

    async def _confirm_late(self, lease: Lease, grant: Grant) -> None:
        """A grant taken late (the process was paused, or the group's time is unknown) is used
        only once a renewal confirmed it: the group's answer is authoritative, and the lease is
        valid from when that renewal was sent. A grant the group gave up is withdrawn."""
        age = grant.age_s
        late = "at an unknown time" if age is None else f"{age:.1f} s after it was made"
        sent = time.monotonic()
        try:
            result = await self.retries.call(
                f"confirm the grant of {lease.group_id}",
                lambda: send_renewal(
                    self._client_now(),
                    lease.group_id,
                    RenewRequest(request_id=lease.request_id, token=lease.token, key=lease.key),
                    every_s=lease.ttl_s / 3,
                    give_up_after_s=UPDATE_GIVE_UP_S,
                ),
                group_id=lease.group_id,
            )
        except BaseException:
            await asyncio.shield(self._track(self._withdraw(lease.group_id, lease.request_id)))
            raise
        if not result.valid:
            await self._withdraw(lease.group_id, lease.request_id)
            raise GrantLostError(
                f"group {lease.group_id!r} granted job {self.job_id} (token {lease.token}), but "
                f"the grant reached this process {late} and the group had given it up by then "
                f"({result.reason}): this process was paused or did not answer in time. "
                "Nothing is held; acquire again"
            )
        log.info("grant of %s taken %s: confirmed by a renewal", lease.group_id, late)
        lease.valid_until = sent + result.ttl_s
        lease.confirm_within_s = None  # confirmed

    async def _ask(
        self,
        group_id: str,
        request: AcquireRequest,
        granted: asyncio.Future[Any],
        accepted: asyncio.Event,
        asked: float,
        *,
        only_if_free: bool = False,
    ) -> None:
        """Queue ``request`` and park on the group until it is granted (the fast path).

        An ``acquire`` update carries the request and, if the group has a free parking place,
        waits there: the grant is its result. Asking again is safe (idempotent by request id),
        so a retry after the group continued as new, or after a dropped RPC, parks again. When
        the group parks no more waits, the grant comes as an activity on this process's queue,
        and the request is asked again every ``REASK_QUEUED_S``: a grant whose activity this
        process missed (it was paused, its worker not polling) is ended by the group as
        undelivered, and only asking again tells the waiter so.
        A group that does not exist yet is created by signal-with-start of the request.
        """
        call = AcquireCall(request=request, only_if_free=only_if_free)
        # Retried while the acquire wants it (its own time-out ends it); a wait parks for long,
        # so a failing group is timed from its first failure, not from the first ask.
        retrying = Retrying(f"acquire {group_id}", group_id=group_id, quiet=True)
        # One update id until the group answers: an ask whose answer was lost (its poll gave
        # up through a long outage) is sent again as the same update, so the server hands back
        # the one the group parked, whose result the grant becomes. A new id would be a second
        # ask, answered "queued" while the grant went to the first, which nobody awaited.
        update_id = str(uuid.uuid4())
        while not granted.done():
            try:
                answer = await self._send_ask(group_id, call, accepted, update_id)
            except RateLimitedError:
                if call.only_if_free:
                    raise  # a try-lock is told at once: the group wants no more of them now
                continue  # the next ask waits out the group's quiet time
            except (RPCError, WorkflowUpdateRPCTimeoutOrCancelledError) as err:
                if granted.done():
                    # The grant came another way (its activity) while this ask was in flight:
                    # whatever ended the ask (the group's run ended, say) is no reason to act,
                    # least of all to create the group again with a request already granted.
                    return
                if not isinstance(err, RPCError):  # the poll for its result timed out
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # ... because this ask was cancelled: it ends here
                    await retrying.pause()
                elif err.status == RPCStatusCode.NOT_FOUND:
                    await self._create_with_request(group_id, request)
                else:
                    await self.retries.after(err, retrying)
                continue
            accepted.set()
            self._known_groups.add(group_id)
            if await self._answered(group_id, answer, call, granted, asked, retrying):
                return
            update_id = str(uuid.uuid4())  # answered: the next ask is a new one

    async def _send_ask(
        self, group_id: str, call: AcquireCall, accepted: asyncio.Event, update_id: str
    ) -> AcquireAnswer:
        """One ``acquire`` update, parked until the group answers. A refusal by the group
        becomes a typed error; an RPC failure is raised as it came, for :meth:`_ask`. While
        the group wants nothing more of this caller, a try-lock is refused here, without a
        call, and any other ask waits."""
        await self._quiet(group_id, fail=call.only_if_free)
        gate = self._gate(group_id)
        await gate.acquire()
        admitted = False

        def taken() -> None:  # a parked ask leaves the gate once the group took it
            nonlocal admitted
            accepted.set()
            if not admitted:
                admitted = True
                gate.release()

        try:
            return await send_update(
                self._client_now(),
                group_workflow_id(group_id),
                GroupUpdate.ACQUIRE,
                call,
                AcquireAnswer,
                wait_for_completion=False,  # it parks until granted
                on_slow=self._check_control_worker,
                on_accepted=taken,
                update_id=update_id,
            )
        except WorkflowUpdateFailedError as err:
            limited = self._limited(err, group_id)
            if limited is not None:
                raise limited from err
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type == UNPROCESSED_UPDATE:
                raise GroupNotAnsweringError(
                    f"acquire {group_id}: the control worker left the request unprocessed "
                    f"time after time ({cause}); see the control worker's log"
                ) from err
            raise InvalidArgumentError(
                f"group {group_id!r} refused the request: {err.cause or err}"
            ) from err
        finally:
            if not admitted:
                admitted = True
                gate.release()

    def _gate(self, group_id: str) -> asyncio.Semaphore:
        """What bounds this process's updates on their way into ``group_id`` (every one but
        the holder's renewals and releases): ``UPDATES_ENTERING``. Temporal takes at most 10
        updates in flight per workflow and refuses the rest, which then retry: a process that
        sent more from many threads would crowd out everyone else's, a holder's renewals
        among them (docs/security.md, per-caller fairness)."""
        gate = self._gates.get(group_id)
        if gate is None:
            gate = self._gates[group_id] = asyncio.Semaphore(UPDATES_ENTERING)
        return gate

    async def _answered(
        self,
        group_id: str,
        answer: AcquireAnswer,
        call: AcquireCall,
        granted: asyncio.Future[Any],
        asked: float,
        retrying: Retrying,
    ) -> bool:
        """Act on the group's answer to an ask; True when the ask is over (granted, or gone
        and not to be asked again), False to ask again."""
        if answer.outcome == AcquireOutcome.GRANTED and answer.notice is not None:
            if self._take(answer.notice) is not Delivery.FORGED:
                return True
            # Not the group's answer: ask again (idempotent), the real grant still comes.
            await retrying.pause()
            return False
        if answer.outcome == AcquireOutcome.GONE:
            if call.only_if_free or granted.done():
                return True
            # Not withdrawn by us, so ended by the group: granted while this process did not
            # answer, and given up (or its own time-out passed there).
            waited = time.monotonic() - asked
            timeout_s = call.request.timeout_s
            if timeout_s is not None and waited >= timeout_s - 1.0:
                return True  # the acquire's own time-out ends it
            raise GrantLostError(
                f"group {group_id!r} no longer has job {self.job_id}'s request "
                f"(asked {waited:.0f} s ago): it granted it while this process did not answer "
                "(paused, or its worker not polling) and gave the grant up as undelivered. "
                "Nothing is held; acquire again"
            )
        if answer.outcome == AcquireOutcome.QUEUED:
            # The grant comes by activity; asking again now and then is how a waiter whose
            # grant was given up learns it (not hand-off polling: the grant never waits for it).
            await asyncio.wait({granted}, timeout=REASK_QUEUED_S)
        return False

    async def _check_control_worker(self) -> None:
        """Raise NoControlWorkerError if no control worker polls the groups' task queue."""
        await diagnosis.check_control_worker(self._client_now(), self._server())

    def _take(self, notice: GrantNotice) -> Delivery:
        """A grant that came as an update's result; one nobody waits for any more is handed
        back at once (the acquire gave up, and its cancel may have crossed the grant). One
        without its group's proof is dropped by the inbox, and the request stays queued."""
        delivery = self.inbox.accept(grant_from_update(notice))
        if delivery is Delivery.UNWANTED and notice.fault is None:
            self._track(self._withdraw(notice.group_id, notice.request_id))
        return delivery

    async def _not_answering(self, group_id: str, what: str) -> TimesliceError:
        """Why ``group_id`` took no update (``diagnosis.not_answering``)."""
        return await diagnosis.not_answering(self._client_now(), group_id, what)

    async def _create_with_request(self, group_id: str, request: AcquireRequest) -> None:
        client = await self.connected()
        try:
            await self.retries.call(
                f"acquire {group_id}",
                lambda: start_group(
                    client,
                    GroupConfig(group_id=group_id),
                    start_signal=GroupSignal.REQUEST,
                    start_signal_args=[request],
                ),
            )
        except WorkflowAlreadyStartedError:
            pass  # created meanwhile (a retried start whose first attempt got through): ask it
        except RPCError as err:
            if GROUP_KEY.name in str(err):
                raise TimesliceError(
                    f"the Temporal namespace lacks Timeslice's search attributes ({err}); "
                    "run `timeslice setup` once against this cluster"
                ) from err
            raise
        self._known_groups.add(group_id)

    async def _update(
        self,
        what: str,
        group_id: str,
        name: GroupUpdate,
        arg: Any,
        result_type: type[T],
        *,
        give_up_after_s: float | None = None,
    ) -> T:
        """Send an update (retried as ``retries`` says); one the group refuses for this
        caller's rate is sent again once its quiet time is over, within ``give_up_after_s``."""
        give_up_s = give_up_after_s or UPDATE_GIVE_UP_S
        deadline = time.monotonic() + give_up_s
        gate = self._gate(group_id)

        async def send() -> T:
            async with gate:
                return await send_update(
                    self._client_now(),
                    group_workflow_id(group_id),
                    name,
                    arg,
                    result_type,
                    give_up_after_s=give_up_s,
                )

        while True:
            await self._quiet(group_id, deadline=deadline)
            try:
                return await self.retries.call(what, send, group_id=group_id)
            except WorkflowUpdateFailedError as err:
                limited = self._limited(err, group_id)
                if limited is None:
                    raise
                if time.monotonic() + limited.retry_after_s > deadline:
                    raise limited from err

    def _limited(self, err: WorkflowUpdateFailedError, group_id: str) -> RateLimitedError | None:
        """The group's refusal of an update for this caller's rate, as a typed error (and
        the group's quiet time noted), or None for any other failure."""
        cause = err.cause
        if not (isinstance(cause, ApplicationError) and cause.type == RATE_LIMITED):
            return None
        details = cause.details
        wait_s = details[0] if details and isinstance(details[0], int | float) else 1.0
        wait_s = min(max(float(wait_s), 0.0), 60.0)
        until = time.monotonic() + wait_s
        if until > self._quiet_until.get(group_id, 0.0):
            self._quiet_until[group_id] = until
            self._quiet_why[group_id] = cause.message
        return RateLimitedError(cause.message, retry_after_s=wait_s)

    async def _quiet(
        self, group_id: str, *, fail: bool = False, deadline: float | None = None
    ) -> None:
        """Wait out the quiet time ``group_id`` asked of this caller (none: return at once);
        with ``fail``, raise ``RateLimitedError`` instead of waiting, and past ``deadline``
        too."""
        left = self._quiet_until.get(group_id, 0.0) - time.monotonic()
        if left <= 0:
            return
        if fail or (deadline is not None and time.monotonic() + left > deadline):
            raise RateLimitedError(
                f"not sent: {left:.2f} s more to wait for group {group_id!r}, which said: "
                f"{self._quiet_why.get(group_id, 'send less')}",
                retry_after_s=left,
            )
        await asyncio.sleep(left)

    async def _depart(self, group_id: str) -> None:
        key = self.last_keys.get(group_id)
        if key is None:
            return  # never held it: nothing of ours is resident there
        late = self.late_evictions.pop(group_id, [])
        if late:  # the group counts every byte moved, so those that waited go first
            await self.report_moved(group_id, late)
        try:
            await self._update(
                f"depart {group_id}",
                group_id,
                GroupUpdate.DEPART,
                DepartRequest(job_id=self.job_id, key=key),
                bool,
            )
        except (RPCError, TimesliceError, WorkflowUpdateFailedError) as err:
            log.debug("depart from %s: %s", group_id, err)

    def _track(
        self, coro: Coroutine[Any, Any, None], also: set[asyncio.Future[None]] | None = None
    ) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        for tracked in (self._background, also):
            if tracked is not None:
                tracked.add(task)
                task.add_done_callback(tracked.discard)
        return task

    async def snapshot_job(self, action: str) -> list[SnapshotReport]:
        """Snapshot or restore this job on all its queues and wait (no group involved)."""
        if self.settings.snapshot_target is None:
            raise InvalidArgumentError(
                f"job {self.job_id} registered no snapshot backend: pass snapshot_backends= "
                "or node= to the client"
            )
        if self.held:
            raise InvalidArgumentError(
                f"job {self.job_id} holds {sorted(self.held)}: release before a standalone "
                f"{action} (a group would not evict a holder either)"
            )
        client = await self.start()
        inp = SnapshotJobInput(
            job_id=self.job_id, action=action, target=self.settings.snapshot_target
        )
        try:
            result = await client.execute_workflow(
                SNAPSHOT_JOB_WORKFLOW_TYPE,
                inp.model_dump(mode="json"),
                id=f"snapshot-{self.job_id}-{uuid.uuid4().hex[:8]}",
                task_queue=CONTROL_TASK_QUEUE,
                result_type=SnapshotJobResult,
                static_summary=f"{action} {self.job_id}",
            )
        except WorkflowFailureError as err:
            raise SnapshotFailedError(str(err.cause or err)) from err
        return result.reports

    async def create_group(self, config: GroupConfig) -> bool:
        client = await self.connected()
        try:
            await self.retries.call(
                f"create {config.group_id}", lambda: start_group(client, config)
            )
        except WorkflowAlreadyStartedError:
            return False
        self._known_groups.add(config.group_id)
        return True

    async def _withdraw(
        self, group_id: str, request_id: str, *, within_s: float = WITHDRAW_S
    ) -> None:
        """Tell the group to drop a request; a grant that raced with it is released at once."""
        key = self._keys.get(request_id)
        if key is None:
            log.warning(
                "no key kept for request %s on %s: cannot withdraw it", request_id, group_id
            )
            return
        try:
            # Bounded: a group nobody answers for must not hold the acquire past its time-out.
            # A request that stays queued is granted to nobody waiting: declined, or given up
            # as undelivered.
            await asyncio.wait_for(
                self._update(
                    f"cancel {group_id}",
                    group_id,
                    GroupUpdate.CANCEL,
                    CancelRequest(request_id=request_id, key=key),
                    type(None),
                    give_up_after_s=within_s,
                ),
                within_s,
            )
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                log.warning("could not withdraw request %s from %s: %s", request_id, group_id, err)
            # No such group: the request never reached one (closed while it was created).
        except (TimesliceError, WorkflowUpdateFailedError, TimeoutError) as err:
            log.warning("could not withdraw request %s from %s: %s", request_id, group_id, err)

    def resolve_lease(self, lease: Lease | None) -> Lease:
        if lease is not None and not isinstance(lease, Lease):
            hint = (
                " (a group id: release takes the Lease that acquire returned, or nothing "
                "when one lease is held)"
                if isinstance(lease, str)
                else ""
            )
            raise InvalidArgumentError(
                f"release takes the Lease acquire returned (or nothing), not "
                f"{type(lease).__name__} {lease!r}{hint}"
            )
        if lease is None:
            if len(self.held) != 1:
                held = sorted(self.held) or "none"
                raise NotHolderError(
                    f"job {self.job_id} holds {len(self.held)} leases ({held}); "
                    "pass the lease to release"
                )
            return next(iter(self.held.values()))
        if self.held.get(lease.group_id) is not lease:
            raise NotHolderError(
                f"job {self.job_id} does not hold this lease on {lease.group_id!r} (token "
                f"{lease.token}); it was already released or belongs to another client"
            )
        return lease

    async def release(
        self,
        lease: Lease | None,
        *,
        next_phase: str | None = None,
        expected_s: float | None = None,
        phases: Sequence[tuple[float, float]] | None = None,
    ) -> bool:
        """Yield the lease; LeaseRevokedError if the group had revoked it meanwhile.
        ``phases``: the GPU phases run under it, (start, end) on ``time.monotonic()``.

        With ``next_phase`` (the name of this holder's next GPU phase, on the same group,
        following at once) the group may keep the lease for that phase instead, by its grant
        policy: always when nobody waits, and under ``phase_aware`` within its bounds when
        others do, which needs ``expected_s`` (the phase's expected length, as this holder
        measured it; without it the lease is kept only when nobody waits). Returns whether the
        lease was kept: it is then still held and renewed, and the caller goes on under it."""
        carry = check_next_phase(next_phase, expected_s)
        lease = self.resolve_lease(lease)
        answer = await self.release_lease(
            lease,
            keep_if_uncontended=next_phase is not None,
            carry_into=carry,
            phases=None if phases is None else phases_since_grant(lease, phases),
        )
        if answer.valid and not answer.released:
            return True
        if answer.valid and not lease.revoked_by_group:
            # The group held the lease until this release, whatever this process's renewals
            # met meanwhile (a storm, a control worker down): released, not revoked.
            if lease.revoked_reason is not None:
                log.warning(
                    "released %s (token %s), which the group still held though this process "
                    "had stopped renewing it: %s",
                    lease.group_id,
                    lease.token,
                    lease.revoked_reason,
                )
            return False
        if lease.revoked_reason is None:
            lease.revoked_reason = "the group no longer held it when it was released"
        raise LeaseRevokedError(
            f"the lease on {lease.group_id!r} (token {lease.token}) was revoked while held: "
            f"{lease.revoked_reason}"
        )

    async def release_lease(
        self,
        lease: Lease,
        *,
        restored: list[SnapshotReport] | None = None,
        evicted: list[SnapshotReport] | None = None,
        keep_if_uncontended: bool = False,
        carry_into: NextPhase | None = None,
        evicts_itself: bool = False,
        reports_with_next: bool = False,
        phases: list[tuple[float, float]] | None = None,
    ) -> ReturnAnswer:
        """End ``lease`` (or keep it, if asked and nobody waits, or carried into
        ``carry_into`` by the group's grant policy); the answer says whether the group wants
        this process to move its state out (``evicts_itself``), and whether its report may
        wait for the next release there (``reports_with_next``: see :meth:`report_moved`).
        Evictions whose reports waited go with this release."""
        late = self.late_evictions.pop(lease.group_id, [])
        ret = LeaseReturn(
            request_id=lease.request_id,
            token=lease.token,
            key=lease.key,
            restored=list(restored or []),
            evicted=list(evicted or []),
            keep_if_uncontended=keep_if_uncontended,
            carry_into=carry_into,
            evicts_itself=evicts_itself,
            reports_with_next=reports_with_next and evicts_itself,
            late_evictions=late,
            phases=phases,
        )
        sent = time.monotonic()
        try:
            answer = await self._send_release(lease, ret)
        except BaseException:
            self._keep_late(lease.group_id, late)  # not taken: they go with the next message
            raise
        if not answer.valid:
            # Not taken: the attempts share one update id, so one that landed would have been
            # answered as it was (valid); and one that landed in a run since continued as new
            # is answered released by the next run, which keeps the leases released. So the
            # lease had ended otherwise: revoked. The reports go with the next message.
            self._keep_late(lease.group_id, late)
        if answer.released or not answer.valid:
            self._drop(lease)
        else:
            lease.valid_until = sent + lease.ttl_s  # kept: the group renewed it
            lease.releasing = False
            self._renew_again(lease)
        return answer

    def _renew_again(self, lease: Lease) -> None:
        """A lease the group kept although its renewals here had given up (the control worker
        was down past the TTL, and this release reached the group before it processed the
        expiry): it is valid again from the release's sending, so it is renewed again."""
        heartbeat = self._heartbeats.get(lease.group_id)
        if lease.revoked_reason is None or lease.revoked_by_group:
            return
        if heartbeat is not None and not heartbeat.done():
            return
        log.info("lease on %s kept by its group after local renewals gave up", lease.group_id)
        lease.revoked_reason = None
        spans = self._spans.get(lease.group_id)
        with trace.use_span(spans[1]) if spans is not None else contextlib.nullcontext():
            self._heartbeats[lease.group_id] = asyncio.create_task(self._heartbeat(lease))

    async def _send_release(self, lease: Lease, ret: LeaseReturn) -> ReturnAnswer:
        """Send ``ret`` (retried); its answer. A release that cannot be sent drops the lease
        here (this process no longer renews it) and raises."""
        spans = self._spans.get(lease.group_id)
        lease.releasing = True
        # One id for every attempt: an attempt that landed but whose answer was lost is
        # answered again by the server as it was, not handled a second time.
        update_id = str(uuid.uuid4())

        async def call() -> ReturnAnswer:
            try:
                return await send_update(
                    self._client_now(),
                    group_workflow_id(lease.group_id),
                    GroupUpdate.RELEASE,
                    ret,
                    ReturnAnswer,
                    update_id=update_id,
                )
            except WorkflowUpdateFailedError as err:
                # A holder's release is never refused for its rate; one of a lease the group
                # no longer holds may be.
                limited = self._limited(err, lease.group_id)
                if limited is None:
                    raise
                raise limited from err

        try:
            with (
                trace.use_span(spans[1], record_exception=False, set_status_on_exception=False)
                if spans
                else contextlib.nullcontext()
            ):
                answer = await self.retries.call(
                    f"release {lease.group_id}", call, group_id=lease.group_id
                )
        except (GroupNotAnsweringError, NoControlWorkerError) as err:
            self._drop(lease, err)
            raise type(err)(
                f"{err}. This process no longer holds or renews the lease on "
                f"{lease.group_id!r} (token {lease.token}): the group ends it when its TTL "
                f"({lease.ttl_s:g} s) has run out, once it answers again"
            ) from err.__cause__
        except BaseException as err:
            self._drop(lease, err)
            raise
        return answer

    def forget(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and let it go without a release (the group revokes it when
        its TTL runs out): what is left when even the release could not be sent."""
        self._drop(lease)

    def _drop(self, lease: Lease, err: BaseException | None = None) -> None:
        """This process no longer holds ``lease``: stop renewing it, close its spans."""
        if self.held.get(lease.group_id) is lease:
            del self.held[lease.group_id]
        lease.released = True
        heartbeat = self._heartbeats.pop(lease.group_id, None)
        if heartbeat is not None:
            heartbeat.cancel()
        spans = self._spans.pop(lease.group_id, None)
        revoked = None if lease.revoked_reason is None else f"revoked: {lease.revoked_reason}"
        for span in reversed(spans or ()):
            end_span(span, err, message=revoked)

    def _keep_late(self, group_id: str, reports: list[SnapshotReport]) -> None:
        if reports:
            self.late_evictions.setdefault(group_id, [])[:0] = reports

    async def report_moved(
        self,
        group_id: str,
        evicted: list[SnapshotReport],
        error: str | None = None,
        *,
        with_next: bool = False,
    ) -> None:
        """Tell ``group_id`` that this job's state left its device (with the key of the job's
        last lease there, which only its processes know). ``with_next``: the group let the
        report wait (``ReturnAnswer.report_with_next``): it goes with this job's next release
        there, or its departure, instead of a message of its own (a failure goes at once)."""
        key = self.last_keys.get(group_id)
        if key is None:
            return  # the group has our state only through leases we never took: it asks us
        if with_next and error is None:
            self.late_evictions.setdefault(group_id, []).extend(evicted)
            return
        report = MovedReport(job_id=self.job_id, key=key, evicted=evicted, error=error)
        try:
            await self._update(
                f"report to {group_id}", group_id, GroupUpdate.MOVED, report, type(None)
            )
        except (RPCError, TimesliceError, WorkflowUpdateFailedError) as err:
            # The group falls back on its own snapshot activity, which finds nothing to move.
            log.warning("cannot tell %s that %s's state moved: %s", group_id, self.job_id, err)

    async def _heartbeat(self, lease: Lease) -> None:
        """Renew every TTL/3; the first renewal also confirms a grant taken from an update,
        so it comes before the group's confirmation deadline (holds shorter than that are
        confirmed by their release and never renew)."""
        interval = lease.ttl_s / 3
        path = RenewalPath()
        rule = asyncio.ensure_future(self._renewal_rule(lease.group_id))

        def recorded(sent: float) -> None:
            group_renews = rule.done() and not rule.cancelled() and rule.result()
            lease.valid_until = counted_from_signal(
                lease.valid_until,
                sent,
                time.monotonic(),
                lease.ttl_s,
                group_renews=group_renews,
                answered=lease.answered_at,
            )

        try:
            await self._renew_until_lost(lease, interval, path, recorded)
        finally:
            rule.cancel()

    async def _renewal_rule(self, group_id: str) -> bool:
        """The group's renewal rule (``transport.renewals.counted_from_signal``), asked once."""
        known = self._renewal_rules.get(group_id)
        if known is None:
            try:
                known = await group_renewal_rule(self._client_now(), group_id)
            except Exception as err:  # not known: renewals count from answers, as before
                log.debug("renewal rule of %s: %s", group_id, err)
                return False
            if known is not None:
                self._renewal_rules[group_id] = known
        return bool(known)

    async def _renew_until_lost(
        self, lease: Lease, interval: float, path: RenewalPath, recorded: Recorded
    ) -> None:
        # Well before the lease's local validity ends: for a grant not yet confirmed, that is
        # the group's deadline for confirming it.
        wait = max(0.05, min(interval, (lease.valid_until - time.monotonic()) / 3))
        while True:
            await asyncio.sleep(wait)
            sent = time.monotonic()
            try:
                # By update, or by signal when other callers fill the group's in-flight updates.
                result = await send_renewal(
                    self._client_now(),
                    lease.group_id,
                    RenewRequest(request_id=lease.request_id, token=lease.token, key=lease.key),
                    every_s=interval,
                    # An update not answered within half the time left goes by signal.
                    update_within_s=max(0.05, min(interval, (lease.valid_until - sent) / 2)),
                    # A renewal by signal keeps trying a TTL past the lease's local validity
                    # (its answer may come late, and valid).
                    give_up_after_s=lease.ttl_s + max(0.0, lease.valid_until - sent),
                    path=path,
                    on_recorded=recorded,
                )
            except Exception as err:  # any failure to renew is retried until the lease runs out
                if lease.releasing:
                    wait = interval  # the release decides; it ends this task if it ends the lease
                    continue
                if time.monotonic() >= lease.valid_until:
                    lease.revoked_reason = f"could not renew before the TTL ran out ({err})"
                    log.error("lease on %s lost: %s", lease.group_id, lease.revoked_reason)
                    return
                log.warning("renewing lease on %s failed: %s; retrying", lease.group_id, err)
                wait = min(interval, 1.0)
                continue
            if not result.valid:
                if lease.releasing:
                    # This process's own release reached the group first (a renewal racing its
                    # release): no revocation. The release's answer says what became of it.
                    log.debug(
                        "renewal on %s crossed its release: %s", lease.group_id, result.reason
                    )
                    wait = interval
                    continue
                lease.revoked_reason = result.reason
                lease.revoked_by_group = True
                log.error("lease on %s revoked: %s", lease.group_id, result.reason)
                return
            # Never shorter than a signal sent since made it (both bound the group's expiry).
            lease.valid_until = max(lease.valid_until, sent + result.ttl_s)
            lease.answered_at = sent
            wait = interval

    # ------------------------------------------------------------ status and shutdown

    async def group_status(self, group_id: str) -> GroupStatus:
        await self.connected()
        try:
            status: GroupStatus = await self.retries.call(
                f"status {group_id}",
                lambda: self._group_handle(group_id).query(
                    GroupQuery.STATUS, result_type=GroupStatus, rpc_timeout=STATUS_TIMEOUT
                ),
            )
            # The query answers as of the group's last workflow task: bring it to now.
            return status.advanced_to(datetime.now(UTC))
        except ServerUnreachableError:
            await self._check_control_worker()  # the likely reason: say so
            raise
        except WorkflowQueryFailedError as err:
            raise TimesliceError(
                f"group {group_id!r} could not answer its status ({err}); see the control "
                f"worker's log and the workflow {group_workflow_id(group_id)} in the Web UI"
            ) from err
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise UnknownGroupError(
                    f"no GPU group {group_id!r} exists "
                    f"(no workflow {group_workflow_id(group_id)}); "
                    "a group is created by its first acquire"
                ) from err
            raise

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Acquires other threads wait in end now (they withdraw their requests, bounded).
        self.inbox.close(ClientClosedError(CLOSED + " (closed while this acquire waited)"))
        if self._acquiring:
            await asyncio.wait(self._acquiring, timeout=CLOSE_ACQUIRES_S)
            for task in self._acquiring:
                task.cancel()
        for ask in list(self._asks):
            ask.cancel()  # a parked wait nobody awaits any more
            # Its end is nobody's news: the SDK ends a cancelled poll for an update's result
            # with an error, which asyncio would print as never retrieved.
            ask.add_done_callback(_retrieved)
        for lease in list(self.held.values()):
            try:
                await asyncio.wait_for(self.release(lease), timeout=5)
            except Exception as err:  # the others are released all the same
                log.warning("releasing %s on close: %s", lease.group_id, err)
        for task in self._heartbeats.values():
            task.cancel()
        for group_id in self._known_groups:
            # Our state leaves the device with this process: nothing to evict any more.
            self._track(self._depart(group_id))
        if self._background:
            await asyncio.wait(self._background, timeout=10)

    def drop_client(self) -> None:
        """Let go of the Temporal client (its native objects go with the last reference)."""
        self._client = self._connecting = None
