"""Grant delivery by activity: the group wakes a waiting acquire on its process's own queue.

Most grants travel as the result of the waiter's parked ``acquire`` update; this activity
carries the rest (the group parks only a few waits at a time).

The activity's answer closes the race between a grant and a give-up: whichever of the two reaches
the waiting future first wins, on one event loop with no await in between; a grant that finds its
waiter gone answers ``accepted=False`` and the group releases it at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from temporalio import activity
from timeslice.protocol.group import DELIVER_GRANT_ACTIVITY, GrantAck, GrantNotice

_ACCEPTED_KEEP = 1024


class GrantInbox:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[GrantNotice]] = {}
        # A group that continued as new re-delivers a grant it had not yet seen taken.
        self._accepted: OrderedDict[str, int] = OrderedDict()

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

    def accept(self, notice: GrantNotice) -> bool:
        """Hand a grant to its waiting acquire; False if nobody waits for it (any more)."""
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

    @activity.defn(name=DELIVER_GRANT_ACTIVITY)
    async def deliver_grant(self, notice: GrantNotice) -> GrantAck:
        accepted = self.accept(notice)
        if not accepted and notice.fault is None:
            activity.logger.info(
                "grant of %s (token %s) arrived after the acquire gave up; declining",
                notice.group_id,
                notice.token,
            )
        return GrantAck(accepted=accepted)
