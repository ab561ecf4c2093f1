"""Grant delivery by activity: the group wakes a waiting acquire on its process's own queue.

Most grants travel as the result of the waiter's parked ``acquire`` update; this activity
carries the rest (the group parks only a few waits at a time).

The activity's answer closes the race between a grant and a give-up: whichever of the two reaches
the waiting future first wins, on one event loop with no await in between; a grant that finds its
waiter gone answers ``accepted=False`` and the group releases it at once.

Whoever can act in the namespace can schedule this activity on a process's queue (or answer
its ``acquire`` update), and ``status`` shows request ids and tokens; so a notice is taken only
with the proof its group made under the request's key hash (``notice_is_proven``). One without
is dropped and counted, and the acquire keeps waiting for the real grant.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from temporalio import activity
from timeslice.protocol.group import (
    DELIVER_GRANT_ACTIVITY,
    GrantAck,
    GrantNotice,
    lease_key_hash,
    notice_is_proven,
)

log = logging.getLogger("timeslice.grants")
_ACCEPTED_KEEP = 1024


class Delivery(StrEnum):
    """What became of a notice handed to the inbox."""

    TAKEN = "taken"  # handed to its waiting acquire (or the same grant again)
    UNWANTED = "unwanted"  # nobody waits for its request (any more)
    FORGED = "forged"  # its proof is missing or wrong: no group made it


@dataclass
class _Expected:
    future: asyncio.Future[GrantNotice]
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
        # Notices dropped because their proof was missing or wrong.
        self.forged = 0

    def expect(self, request_id: str, key: str) -> asyncio.Future[GrantNotice]:
        """Wait for the grant of ``request_id``, whose lease key is ``key``: only a notice
        proven under its hash is taken."""
        future: asyncio.Future[GrantNotice] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Expected(future, key)
        return future

    def withdraw(self, request_id: str) -> GrantNotice | None:
        """Stop waiting for ``request_id``; return its grant if one had already arrived."""
        expected = self._waiting.pop(request_id, None)
        if expected is None:
            return None
        self._withdrawn[request_id] = expected.key
        while len(self._withdrawn) > _ACCEPTED_KEEP:
            self._withdrawn.popitem(last=False)
        future = expected.future
        if future.done() and not future.cancelled():
            return future.result()
        future.cancel()
        return None

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

    def accept(self, notice: GrantNotice) -> Delivery:
        """Hand a notice to its waiting acquire, if its proof holds."""
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
        expected.future.set_result(notice)
        if notice.fault is None:
            self._accepted[notice.request_id] = (notice.token, expected.key)
            while len(self._accepted) > _ACCEPTED_KEEP:
                self._accepted.popitem(last=False)
        return Delivery.TAKEN

    def answer_key(self, notice: GrantNotice) -> str | None:
        """The key to answer ``notice``'s group with: only for a notice that group made
        (proven under the key's hash), so a forger never learns a key from an answer."""
        accepted = self._accepted.get(notice.request_id)
        expected = self._waiting.get(notice.request_id)
        key = (
            expected.key
            if expected is not None
            else accepted[1]
            if accepted is not None
            else self._withdrawn.get(notice.request_id)
        )
        if key is None or not notice_is_proven(notice, lease_key_hash(key)):
            return None
        return key

    @activity.defn(name=DELIVER_GRANT_ACTIVITY)
    async def deliver_grant(self, notice: GrantNotice) -> GrantAck:
        delivery = self.accept(notice)
        if delivery is Delivery.UNWANTED and notice.fault is None:
            activity.logger.info(
                "grant of %s (token %s) arrived after the acquire gave up; declining",
                notice.group_id,
                notice.token,
            )
        # A fault notice taken is not a lease: nothing for the group to confirm. The key makes
        # the answer the process's own (anyone can complete an activity by its id).
        return GrantAck(
            accepted=delivery is Delivery.TAKEN and notice.fault is None,
            key=self.answer_key(notice),
        )
