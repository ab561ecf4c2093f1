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
never past the group's own expiry.

A flood that keeps the server dropping the group's workflow tasks can delay that answer past a
short TTL. The server's own answer to the signal comes at once (it records the signal; no
workflow task is needed), and a group that states its renewal rule (the ``renewal_rule``
query: a renewal handled before the group processed the expiry renews the lease) renews on any
signal recorded before its expiry: ``counted_from_signal`` says why, and what the holder may
count from it. A group of an older release states none, and its holder waits for answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
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
# A lease counts from recorded signals for this long after the group last answered a renewal
# (or ten TTLs, if longer): the slowest answer under the test's flood came after 12.7 s.
SIGNALS_WITHOUT_ANSWER_S = 30.0
# The group's renewal rule is asked once per group, beside the lease's first renewals.
_RULE_WITHIN = timedelta(seconds=10)


#: Told the time (``time.monotonic()``) a renewal signal was sent, once the server recorded it.
Recorded = Callable[[float], None]


def counted_from_signal(
    valid_until: float,
    sent: float,
    recorded: float,
    ttl_s: float,
    *,
    group_renews: bool,
    answered: float,
) -> float:
    """A held lease's local validity after the server recorded its renewal signal.

    The signal was sent at ``sent`` and its recording answered at ``recorded`` (both
    ``time.monotonic()``). A group that renews a lease whose renewal it handles before it has
    processed the lease's expiry (``group_renews``: its ``renewal_rule`` query) renews it on
    this signal if the server recorded the signal before the group's expiry: every workflow
    task that starts after a signal is recorded carries it, and the SDK hands a task's signals
    to their handlers before timers and before the main loop (where the expiry is processed)
    runs on. The group's expiry is never before ``valid_until`` and the signal was recorded
    before ``recorded``, so a signal answered while the lease was still valid here renews it
    from a time no earlier than ``sent``: the lease then runs until ``sent + ttl_s`` at least.
    Otherwise (an old group, an answer after the local validity ran out) nothing changes.

    Each such step rests on the one before, so a local validity that ever ran past the
    group's expiry (a clock that jumped, say) would be carried on: signals count only within
    ``SIGNALS_WITHOUT_ANSWER_S`` (or ten TTLs, if longer) of ``answered``, when the last
    renewal the group itself answered was sent. Its answers are what ends such an error.

    Args:
        valid_until: the lease's local validity before this signal.
        sent: when the signal was sent.
        recorded: when the server answered that it recorded the signal.
        ttl_s: the lease's TTL at the group.
        group_renews: the group's renewal rule (see above).
        answered: when the last renewal the group answered valid was sent (or the grant).

    Returns:
        The local validity to keep (never shorter than ``valid_until``).
    """
    unanswered_too_long = recorded - answered > max(SIGNALS_WITHOUT_ANSWER_S, 10 * ttl_s)
    if not group_renews or recorded >= valid_until or unanswered_too_long:
        return valid_until
    return max(valid_until, sent + ttl_s)


async def group_renewal_rule(client: Client, group_id: str) -> bool | None:
    """The group's ``renewal_rule`` query (see ``counted_from_signal``): False for a group of a
    release before it (no such query), None if it could not be asked now."""
    handle = client.get_workflow_handle(group_workflow_id(group_id))
    try:
        rule: bool = await handle.query(
            GroupQuery.RENEWAL_RULE, result_type=bool, rpc_timeout=_RULE_WITHIN
        )
    except WorkflowQueryFailedError as err:  # an older group's worker has no such query
        log.info("group %s states no renewal rule (%s): renewals count from answers", group_id, err)
        return False
    except RPCError as err:
        log.debug("renewal rule of %s not known yet: %s", group_id, err)
        return None
    return rule


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
    on_recorded: Recorded | None = None,
) -> RenewResult:
    """The group's answer to the renewal ``renew`` of a lease on ``group_id``: by the ``renew``
    update, or, when Temporal refuses the update for capacity or it is not answered within
    ``update_within_s`` (default: ``every_s``, the holder's renewal interval), by the
    ``renew_lease`` signal and the ``holder`` query (module docstring); by signal at once
    while ``path`` says so. The validity it returns counts from a time taken before this
    call. ``on_recorded``: called with the time each renewal signal was sent, once the server
    has recorded it (see ``renew_by_signal``)."""
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
        client,
        group_id,
        renew,
        every_s=every_s,
        give_up_after_s=give_up_after_s,
        began=began,
        on_recorded=on_recorded,
    )


async def renew_by_signal(
    client: Client,
    group_id: str,
    renew: RenewRequest,
    *,
    every_s: float,
    give_up_after_s: float = 60.0,
    began: float | None = None,
    on_recorded: Recorded | None = None,
) -> RenewResult:
    """Renew by the ``renew_lease`` signal; the ``holder`` query sent after it says the outcome.
    The signal goes again every ``every_s`` while no answer has come, so a slow query never
    lets the group's lease run out. The validity returned counts from ``began`` (a time taken
    before this call; by default, its start). ``on_recorded`` is called with the time each
    signal was sent once the server answers that it recorded it: before the query's answer,
    which a flood can hold up past a short TTL (``counted_from_signal`` says what a holder
    may conclude from it)."""
    began = time.monotonic() if began is None else began
    deadline = time.monotonic() + give_up_after_s
    handle = client.get_workflow_handle(group_workflow_id(group_id))
    while True:
        signalled = time.monotonic()
        try:
            view = await _signal_then_ask(handle, renew, every_s, on_recorded)
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
    handle: WorkflowHandle[Any, Any],
    renew: RenewRequest,
    every_s: float,
    on_recorded: Recorded | None = None,
) -> HolderView | None:
    """Signal the renewal, then ask the ``holder`` query, signalling again every ``every_s``
    while the answer is on its way; a query not answered within an interval (at least
    ``_QUERY_WITHIN_S``) fails, to be asked again."""
    signal_within = timedelta(seconds=max(every_s, _SIGNAL_WITHIN_S))

    async def signal() -> None:
        sent = time.monotonic()
        await handle.signal(GroupSignal.RENEW, renew, rpc_timeout=signal_within)
        if on_recorded is not None:
            on_recorded(sent)

    await signal()
    answer = asyncio.ensure_future(
        handle.query(
            GroupQuery.HOLDER,
            result_type=HolderView | None,  # type: ignore[arg-type]
            rpc_timeout=timedelta(seconds=max(every_s, _QUERY_WITHIN_S)),
        )
    )
    try:
        while not (await asyncio.wait({answer}, timeout=every_s))[0]:
            await signal()
    finally:
        answer.cancel()
    return answer.result()


__all__ = [
    "SIGNALS_WITHOUT_ANSWER_S",
    "STAY_ON_SIGNALS_S",
    "Recorded",
    "RenewalPath",
    "RenewalUnanswered",
    "counted_from_signal",
    "group_renewal_rule",
    "renew_by_signal",
    "send_renewal",
]
