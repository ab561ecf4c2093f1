"""Starting a GPU group's workflow from outside it: signal-with-start of a request.

Signal-with-start is a client call (servers refuse it from inside a workflow by default), so a
requester *workflow* runs it as the local activity below, on the worker that runs the requester.
"""

from __future__ import annotations

import secrets

from temporalio import activity
from temporalio.service import RPCError, RPCStatusCode
from timeslice.protocol.group import (
    DRAW_SECRET_ACTIVITY,
    RENEW_LEASE_ACTIVITY,
    REQUEST_GROUP_ACTIVITY,
    AcquireAnswer,
    AcquireCall,
    GroupConfig,
    GroupRequest,
    GroupSignal,
    GroupUpdate,
    LeaseRenewal,
    RenewResult,
    group_workflow_id,
)
from timeslice.session.group_start import start_group
from timeslice.transport.renewals import send_renewal
from timeslice.transport.updates import send_update

__all__ = ["draw_secret", "renew_lease", "request_group", "start_group"]


@activity.defn(name=DRAW_SECRET_ACTIVITY)
async def draw_secret() -> str:
    """256 bits from the operating system's CSPRNG, for a workflow's lease keys: a workflow's
    own randomness is seeded from its run id, which anyone who can list workflows sees."""
    return secrets.token_hex(32)


@activity.defn(name=REQUEST_GROUP_ACTIVITY)
async def request_group(req: GroupRequest) -> AcquireAnswer | None:
    """Queue a requester workflow's request: an update to a running group (one that meets the
    group's continue-as-new is retried on the next run), signal-with-start of a new one. The
    group's answer says where the request stands (queued, granted — the notice — or gone);
    None for a group started with it. Asking again is safe: a request is queued once."""
    client = activity.client()
    try:
        return await send_update(
            client,
            group_workflow_id(req.group_id),
            GroupUpdate.ACQUIRE,
            AcquireCall(request=req.request, park=False),
            AcquireAnswer,
        )
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
    await start_group(
        client,
        GroupConfig(group_id=req.group_id),
        start_signal=GroupSignal.REQUEST,
        start_signal_args=[req.request],
    )
    return None


@activity.defn(name=RENEW_LEASE_ACTIVITY)
async def renew_lease(req: LeaseRenewal) -> RenewResult:
    """Renew a requester workflow's lease by the group's ``renew`` update (by its signal and
    ``holder`` query when other callers fill the group's in-flight updates:
    transport/renewals.py), so the workflow learns whether the lease was still held."""
    return await send_renewal(
        activity.client(),
        req.group_id,
        req.renew,
        every_s=req.give_up_after_s / 3,
        give_up_after_s=req.give_up_after_s,
    )
