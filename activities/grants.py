"""Grant delivery: the group workflow wakes a waiting acquire by an activity on its process's queue.

The activity's answer closes the race between a grant and a give-up: whichever of the two reaches
the waiting future first wins, on one event loop with no await in between; a grant that finds its
waiter gone answers ``accepted=False`` and the group releases it at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from temporalio import activity
from timeslice.workflows.protocol import DELIVER_GRANT_ACTIVITY, GrantAck, GrantNotice

_ACCEPTED_KEEP = 1024


class GrantInbox:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[GrantNotice]] = {}
        # A group that continued as new re-delivers a grant it had not yet seen taken.
        self._accepted: OrderedDict[str, int] = OrderedDict()
        # Grants taken from a parked update whose confirming activity is still on its way;
        # the worker must not shut down under it.
        self._unconfirmed: set[str] = set()
        self._all_confirmed: asyncio.Event | None = None

    def expect(self, request_id: str) -> asyncio.Future[GrantNotice]:
        future: asyncio.Future[GrantNotice] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def withdraw(self, request_id: str) -> GrantNotice | None:
        """Stop waiting for ``request_id``; return its grant if one had already arrived."""
        future = self._waiting.pop(request_id, None)
        if future is not None and future.done() and not future.cancelled():
            return future.result()
        if future is not None:
            future.cancel()
        return None

    def accept(self, notice: GrantNotice, *, confirming: bool) -> bool:
        """Hand a grant to its waiting acquire; False if nobody waits for it (any more).

        ``confirming`` is True for the activity, which the group sends for every grant.
        """
        if confirming:
            self._unconfirmed.discard(notice.request_id)
            if not self._unconfirmed and self._all_confirmed is not None:
                self._all_confirmed.set()
        elif notice.fault is None:
            self._unconfirmed.add(notice.request_id)
            if self._all_confirmed is not None:
                self._all_confirmed.clear()
        if self._accepted.get(notice.request_id) == notice.token:
            return True  # the same grant delivered again (e.g. after continue-as-new)
        future = self._waiting.get(notice.request_id)
        if future is None or future.done():
            return False
        future.set_result(notice)
        if notice.fault is not None:
            return False
        self._accepted[notice.request_id] = notice.token
        while len(self._accepted) > _ACCEPTED_KEEP:
            self._accepted.popitem(last=False)
        return True

    async def confirmed(self, timeout: float) -> bool:
        """Wait until every grant taken from an update has had its confirming activity."""
        if self._all_confirmed is None:
            self._all_confirmed = asyncio.Event()
        if not self._unconfirmed:
            return True
        self._all_confirmed.clear()
        try:
            await asyncio.wait_for(self._all_confirmed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @activity.defn(name=DELIVER_GRANT_ACTIVITY)
    async def deliver_grant(self, notice: GrantNotice) -> GrantAck:
        accepted = self.accept(notice, confirming=True)
        if not accepted and notice.fault is None:
            activity.logger.info(
                "grant of %s (token %s) arrived after the acquire gave up; declining",
                notice.group_id,
                notice.token,
            )
        return GrantAck(accepted=accepted)
