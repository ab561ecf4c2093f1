"""How a lease session retries the calls it repeats: which failures it retries, with what
backoff, for how long, and the typed error that ends each kind of failure.

Every call the session repeats goes through one loop (``RpcRetries.after``): the idempotent
RPCs (``RpcRetries.call``: releases, renewals that confirm a grant, creating a group, a status
query, withdrawals, departures, reports) and the parked ``acquire`` ask, which keeps its own
``Retrying`` state because it is retried for as long as its acquire wants it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import (
    GroupNotAnsweringError,
    NoControlWorkerError,
    ServerUnreachableError,
    TimesliceError,
)
from timeslice.protocol.group import CONTROL_TASK_QUEUE

# How long one update is sent again while the server does not take it.
UPDATE_GIVE_UP_S = 60.0
# How long an update whose workflow task failed is sent again before the group is reported as
# not answering.
TASK_FAILING_RETRY_S = 10.0

# What a restarting or overloaded server answers: worth another try.
TRANSIENT = {
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.DEADLINE_EXCEEDED,
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.ABORTED,
    RPCStatusCode.INTERNAL,
    RPCStatusCode.UNKNOWN,
    RPCStatusCode.CANCELLED,
}

log = logging.getLogger("timeslice.client")
T = TypeVar("T")


def task_failing(err: RPCError) -> bool:
    """The server's answer to an update whose workflow task failed ("... due to unexpected
    workflow task failure", "... due to Workflow Task in failed state")."""
    message = err.message.lower()
    return (
        err.status == RPCStatusCode.FAILED_PRECONDITION
        and "workflow task" in message
        and "fail" in message
    )


@dataclass
class Retrying:
    """One repeated call's retry state (``RpcRetries.after``): what it is (for errors and the
    log), the bounds that end it, and the next backoff."""

    what: str
    group_id: str | None = None  # an update of this group: it says why it is not answering
    give_up_at: float | None = None  # monotonic; None: retried while the caller wants it
    # Since when the group's workflow task fails (None: not yet); set at the start to count
    # the whole call.
    failing_since: float | None = None
    quiet: bool = False  # retries logged at debug level (a parked wait retries routinely)
    delay: float = 0.2

    async def pause(self) -> None:
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 2.0)


class RpcRetries:
    """A lease session's retry policy.

    Args:
        server: The Temporal server's address, as the session knows it now (for errors).
        bound_s: How long an unreachable server is retried before ``ServerUnreachableError``.
        not_answering: Says why a group took no update (``diagnosis.not_answering``): called
            with the group id and what was asked, when an update's workflow task keeps failing.
    """

    def __init__(
        self,
        *,
        server: Callable[[], str],
        bound_s: float,
        not_answering: Callable[[str, str], Awaitable[TimesliceError]],
    ) -> None:
        self.server = server
        self.bound_s = bound_s
        self.not_answering = not_answering

    async def call(
        self, what: str, call: Callable[[], Awaitable[T]], *, group_id: str | None = None
    ) -> T:
        """Run an idempotent RPC, retrying transient failures (e.g. a server restart).

        Args:
            what: What the call does, for errors and the log (``"release g1"``).
            call: Makes one try.
            group_id: The call is an update of that group, which says why it is not answering
                if its workflow task keeps failing.

        Returns:
            The first try's result that did not fail.

        Raises:
            NoControlWorkerError, GroupNotAnsweringError, ServerUnreachableError: As
                :meth:`after` decides; an RPCError that is not transient, as it came.
        """
        started = time.monotonic()
        retrying = Retrying(
            what,
            group_id=group_id,
            give_up_at=started + self.bound_s,
            failing_since=started,
        )
        while True:
            try:
                return await call()
            except RPCError as err:
                await self.after(err, retrying)

    async def after(self, err: RPCError, retrying: Retrying) -> None:
        """The one retry loop's step, for every call the session repeats: wait before the next
        try of ``retrying``'s call after ``err`` (with backoff), or raise why there is none.

        A missing control worker, and a failure that is not transient, end it at once; a group
        whose workflow task keeps failing ends it after ``TASK_FAILING_RETRY_S``; an
        unreachable server at ``retrying.give_up_at`` (None: never, the caller's own
        time-out ends it).

        Raises:
            NoControlWorkerError: No control worker polls the groups' task queue.
            GroupNotAnsweringError: The group's workflow task kept failing (or a
                ``NoControlWorkerError``, when no control worker took the update).
            ServerUnreachableError: The server did not answer by ``retrying.give_up_at``.
            RPCError: ``err`` itself, when it is not transient.
        """
        if err.status == RPCStatusCode.FAILED_PRECONDITION and "no poller" in err.message:
            raise NoControlWorkerError(
                f"{retrying.what}: no control worker is serving task queue "
                f"{CONTROL_TASK_QUEUE!r}; start one with `timeslice worker`"
            ) from err
        now = time.monotonic()
        if task_failing(err):
            # The group's workflow task failed (or timed out) with this update in it: maybe
            # once (a worker that crashed mid-task), maybe every time (a wedged group, or a
            # worker that stopped).
            if retrying.failing_since is None:
                retrying.failing_since = now
            give_up_at = retrying.failing_since + TASK_FAILING_RETRY_S
            if retrying.give_up_at is not None:
                give_up_at = min(give_up_at, retrying.give_up_at)
            if now >= give_up_at:
                if retrying.group_id is not None:
                    raise await self.not_answering(retrying.group_id, retrying.what) from err
                raise GroupNotAnsweringError(
                    f"{retrying.what}: the group is not answering "
                    f"({err.message.rstrip('.')}); see the control worker's log and the group's "
                    "workflow in the Web UI"
                ) from err
        elif err.status not in TRANSIENT:
            raise err
        elif retrying.give_up_at is not None and now >= retrying.give_up_at:
            raise ServerUnreachableError(
                f"{retrying.what}: Temporal at {self.server()} did not "
                f"answer for {self.bound_s:.0f} s ({err})"
            ) from err
        log.log(
            logging.DEBUG if retrying.quiet else logging.WARNING,
            "%s: %s; retrying in %.1f s",
            retrying.what,
            err,
            retrying.delay,
        )
        await retrying.pause()
