"""Acquire and release GPU groups from inside a workflow (the RL job workflow's side).

The group grants a workflow requester by a ``timeslice_grant`` signal; the requester renews by a
``renew_lease`` signal on a durable timer and releases by signal. A missing group is created by
the ``timeslice.request_group`` local activity (signal-with-start is a client call), so the
worker running the requester must register that activity (the control worker does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError
from timeslice.protocol.group import (
    DRAW_SECRET_ACTIVITY,
    GRANT_SIGNAL,
    REQUEST_GROUP_ACTIVITY,
    AcquireRequest,
    CancelRequest,
    GrantNotice,
    GroupRequest,
    GroupSignal,
    MalformedMessage,
    ReleaseRequest,
    RenewRequest,
    SnapshotReport,
    SnapshotTarget,
    group_workflow_id,
    lease_key_hash,
    notice_is_proven,
    parse_message,
)

# workflow.patched id: requester workflows that started before it replay taking grants unproven.
GRANT_NOTICE_PROOFS = "grant-notice-proofs"


class GroupLeases:
    """Create inside a workflow (``__init__`` or ``run``); it registers the grant signal."""

    def __init__(
        self,
        job_id: str,
        *,
        priority: int = 0,
        ttl_s: float | None = None,
        snapshot: SnapshotTarget | None = None,
        state_bytes: int | None = None,
    ) -> None:
        self.job_id = job_id
        self.priority = priority
        self.ttl_s = ttl_s
        self.snapshot = snapshot
        self.state_bytes = state_bytes
        self._grants: dict[str, GrantNotice] = {}
        self._renewers: dict[str, asyncio.Task[None]] = {}
        # request id -> its lease key (drawn from the workflow's deterministic randomness)
        self._keys: dict[str, str] = {}
        # Drawn once by a local activity (recorded in the history, so replay-safe): lease keys
        # derive from it, not from the workflow's randomness, which its run id reproduces.
        self.secret: str | None = None
        # Grant and fault notices dropped because their proof was missing or wrong.
        self.forged_notices = 0
        workflow.set_signal_handler(GRANT_SIGNAL, self._on_grant)

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

    def _on_grant(self, *raw: Any) -> None:
        # Taken raw: a malformed grant signal is dropped, never raised into the workflow task;
        # so is a grant for a request this workflow did not make.
        try:
            notice = parse_message(GrantNotice, raw, f"the {GRANT_SIGNAL} signal")
        except MalformedMessage as err:
            workflow.logger.warning("job %s dropped %s", self.job_id, err)
            return
        key = self._keys.get(notice.request_id)
        if key is None:
            workflow.logger.warning(
                "job %s dropped a grant for request %r, which it did not make",
                self.job_id,
                notice.request_id,
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
    ) -> GrantNotice:
        """Wait for the group; raises ApplicationError type ``AcquireTimeout`` or ``JobFaulted``.

        ``snapshot`` / ``state_bytes`` override the defaults for this request (a job moves
        different state on its sampler group than on its trainer group).
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
        # Known before the request goes out: its grant may arrive with the request's answer.
        self._keys[rid] = key
        try:
            await workflow.execute_local_activity(
                REQUEST_GROUP_ACTIVITY,
                GroupRequest(group_id=group_id, request=request),
                start_to_close_timeout=timedelta(seconds=30),
                summary=f"request {group_id}",
            )
        except BaseException:
            del self._keys[rid]
            raise
        cancel = CancelRequest(request_id=rid, key=key)
        try:
            await workflow.wait_condition(lambda: rid in self._grants, timeout=timeout)
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
        if notice.fault is not None:
            raise ApplicationError(notice.fault, type="JobFaulted", non_retryable=True)
        self._renewers[rid] = asyncio.create_task(self._renew(group_id, notice))
        return notice

    async def _renew(self, group_id: str, notice: GrantNotice) -> None:
        renew = RenewRequest(
            request_id=notice.request_id, token=notice.token, key=self._keys[notice.request_id]
        )
        while True:
            await workflow.sleep(notice.ttl_s / 3)
            await self._signal(group_id, GroupSignal.RENEW, renew)

    async def forget(self, lease: GrantNotice) -> None:
        """Stop renewing ``lease`` without releasing it (someone else already released it)."""
        self._keys.pop(lease.request_id, None)
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
