"""A holder's renewal that other callers' updates cannot crowd out (issue 36).

Temporal admits a few updates in flight per workflow (``history.maxInFlightUpdates``, 10 on
the dev server) and refuses the rest with ``RESOURCE_EXHAUSTED`` before any validator of the
group's runs: a caller keeping that many on their way into a group (raw RPCs ignoring every
refusal; the group's per-caller budgets only refuse what reaches it) had the holder's
``renew`` updates refused with them, and the holder lost its lease at any TTL.

A renewal is sent as the ``renew`` update, answered as always. Refused for capacity (or not
answered in the time the caller gives it), it is sent as the group's ``renew_lease`` signal —
signals are not counted against in-flight updates — and its outcome is read off the group's
``holder`` query. Temporal answers a query only after the workflow task that handles every
event recorded before it (queries are strongly consistent: one sent while a task is pending
rides on that task), so the answer comes after the group judged the signal. The group judges it
as it judges the update (``GroupBook.renew``): a lease whose expiry the group has processed is
ended, never renewed, and one it has not is renewed from the time of the workflow task that
handles the signal (however late that task ran); so a holder still shown with the lease's token
was renewed when the signal was handled, after it was sent. The validity the answer gives is the
lease's time left as of that query's workflow task, counted from before the renewal was sent:
never past the group's own expiry. A flood that keeps the server dropping the group's workflow
tasks can still delay the answer past a short TTL, and the holder stops using the lease when its
local validity runs out (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from timeslice.protocol.group import (
    GroupQuery,
    GroupSignal,
    GroupUpdate,
    HolderView,
    RenewRequest,
    RenewResult,
    group_workflow_id,
)
from timeslice.transport.updates import send_update

log = logging.getLogger("timeslice.renewals")

# A renewal's signal may take this long (at least its interval); its holder query this long
# (at least its interval) before it is asked again. Asked again, too, when the server refuses
# it for its buffer (it holds one consistent query per workflow at a time) or drops it.
_SIGNAL_WITHIN_S = 2.0
_QUERY_WITHIN_S = 1.0
# Once an update was refused or slow, a lease's renewals go by signal this long before an
# update is tried again.
STAY_ON_SIGNALS_S = 30.0


class RenewalUnanswered(Exception):
    """A renewal by signal whose outcome the group has not shown yet (sent again later)."""


@dataclass
class RenewalPath:
    """Which way one lease's renewals go: by signal until ``by_signal_until``
    (``time.monotonic()``) once an update was refused or slow, so a flood that lasts costs one
    slow update per ``STAY_ON_SIGNALS_S``, not one per renewal."""

    by_signal_until: float = 0.0


async def send_renewal(
    client: Client,
    group_id: str,
    renew: RenewRequest,
    *,
    every_s: float,
    update_within_s: float | None = None,
    give_up_after_s: float = 60.0,
    path: RenewalPath | None = None,
) -> RenewResult:
    """The group's answer to the renewal ``renew`` of a lease on ``group_id``: by the ``renew``
    update, or, when Temporal refuses the update for capacity or it is not answered within
    ``update_within_s`` (default: ``every_s``, the holder's renewal interval), by the
    ``renew_lease`` signal and the ``holder`` query (module docstring); by signal at once
    while ``path`` says so. The validity it returns counts from a time taken before this
    call."""
    began = time.monotonic()
    if path is None or began >= path.by_signal_until:
        update = send_update(
            client,
            group_workflow_id(group_id),
            GroupUpdate.RENEW,
            renew,
            RenewResult,
            give_up_after_s=give_up_after_s,
            resend_when_full=False,
        )
        try:
            return await asyncio.wait_for(update, update_within_s or every_s)
        except TimeoutError:
            why = f"not answered within {update_within_s or every_s:.2g} s"
        except RPCError as err:
            if err.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
            why = f"refused for capacity ({err.message})"
        log.info(
            "renewals of the lease on %s go by signal for %g s: the update was %s",
            group_id,
            STAY_ON_SIGNALS_S,
            why,
        )
        if path is not None:
            path.by_signal_until = time.monotonic() + STAY_ON_SIGNALS_S
    return await renew_by_signal(
        client, group_id, renew, every_s=every_s, give_up_after_s=give_up_after_s, began=began
    )


async def renew_by_signal(
    client: Client,
    group_id: str,
    renew: RenewRequest,
    *,
    every_s: float,
    give_up_after_s: float = 60.0,
    began: float | None = None,
) -> RenewResult:
    """Renew by the ``renew_lease`` signal; the ``holder`` query sent after it says the outcome.
    The signal goes again every ``every_s`` while no answer has come, so a slow query never
    lets the group's lease run out. The validity returned counts from ``began`` (a time taken
    before this call; by default, its start)."""
    began = time.monotonic() if began is None else began
    deadline = time.monotonic() + give_up_after_s
    handle = client.get_workflow_handle(group_workflow_id(group_id))
    while True:
        signalled = time.monotonic()
        try:
            view = await _signal_then_ask(handle, renew, every_s)
            break
        except RPCError as err:
            # The server refuses a query while it holds another for the workflow, and drops
            # those it holds when it reloads the workflow (which a flood of updates makes it
            # do): asked again, after a fresh signal, until the caller's time is up.
            if time.monotonic() >= deadline:
                raise
            log.debug("renewal of %s by signal: %s (%s); again", group_id, err, err.status)
            await asyncio.sleep(min(every_s, 0.05))
    if view is None or view.request_id != renew.request_id or view.token != renew.token:
        return RenewResult(
            valid=False, reason="the lease is no longer held (expired or moved, seen by query)"
        )
    if view.expires_in_s is None or view.expires_in_s <= 0:
        raise RenewalUnanswered(f"the group shows no renewed expiry for the lease on {group_id}")
    # The query was answered by a workflow task that handled the signal sent at `signalled`
    # (or a later one): the lease runs at least expires_in_s past that task, and so past
    # `signalled` — counted here from `began`, which is no later.
    return RenewResult(valid=True, ttl_s=view.expires_in_s + (signalled - began))


async def _signal_then_ask(
    handle: WorkflowHandle[Any, Any], renew: RenewRequest, every_s: float
) -> HolderView | None:
    """Signal the renewal, then ask the ``holder`` query, signalling again every ``every_s``
    while the answer is on its way; a query not answered within an interval (at least
    ``_QUERY_WITHIN_S``) fails, to be asked again."""
    signal_within = timedelta(seconds=max(every_s, _SIGNAL_WITHIN_S))
    await handle.signal(GroupSignal.RENEW, renew, rpc_timeout=signal_within)
    answer = asyncio.ensure_future(
        handle.query(
            GroupQuery.HOLDER,
            result_type=HolderView | None,  # type: ignore[arg-type]
            rpc_timeout=timedelta(seconds=max(every_s, _QUERY_WITHIN_S)),
        )
    )
    try:
        while not (await asyncio.wait({answer}, timeout=every_s))[0]:
            await handle.signal(GroupSignal.RENEW, renew, rpc_timeout=signal_within)
    finally:
        answer.cancel()
    return answer.result()


__all__ = [
    "STAY_ON_SIGNALS_S",
    "RenewalPath",
    "RenewalUnanswered",
    "renew_by_signal",
    "send_renewal",
]
