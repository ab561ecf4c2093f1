"""One durable timer for the earliest of a workflow's deadlines (the group's: lease expiry,
grant confirmation, waiter and park time-outs, an eviction report)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from temporalio import workflow

__all__ = ["DeadlineTimer"]


class DeadlineTimer:
    """One pending durable timer, set for the earliest deadline the group knows of.

    ``workflow.wait_condition(timeout=...)`` starts a timer on every call and cancels it when
    the condition wins first: on a busy group, three timers started and cancelled per lease.
    This timer is replaced only when a deadline earlier than it appears; a later deadline waits
    for it to fire (one early wake, which sets the timer for what is then the earliest)."""

    def __init__(self, fired: Callable[[], None]) -> None:
        self._fired = fired
        self._handle: asyncio.TimerHandle | None = None
        self._at: datetime | None = None

    def set_for(self, deadline: datetime | None) -> None:
        """Ring at ``deadline`` too, if it is ahead and earlier than the time set.

        Args:
            deadline: the time, or None (nothing to set).
        """
        if deadline is None or (self._at is not None and self._at <= deadline):
            return
        now = workflow.now()
        if deadline <= now:
            return  # overdue: whoever waits for it acts on it now
        if self._handle is not None:
            self._handle.cancel()
        self._at = deadline
        delay = (deadline - now).total_seconds()
        self._handle = asyncio.get_running_loop().call_later(delay, self._ring)

    def _ring(self) -> None:
        self._handle = self._at = None
        self._fired()
