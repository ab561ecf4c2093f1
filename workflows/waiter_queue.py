"""The GPU group's waiters: who is queued, in which order, until when, and what may join.

One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces: it keeps the queue part of
the group's ``GroupState`` (``queue``, ``next_seq``). The order itself is
:func:`timeslice.workflows.grant_policy.next_waiter`, which the planner's simulator calls too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from timeslice.protocol.group import (
    MAX_QUEUE_BYTES,
    MAX_REQUEST_BYTES,
    MAX_WAITERS,
    AcquireRequest,
    Waiter,
    encoded_size,
)
from timeslice.workflows.book_piece import BookPiece
from timeslice.workflows.grant_policy import next_waiter

__all__ = ["FAR_FUTURE_S", "WaiterQueue", "after"]
# Deadlines further out than this are treated as none: a datetime cannot hold them, and a
# waiter that patient is, for every purpose, waiting forever.
FAR_FUTURE_S = 10 * 365 * 86_400.0


def after(start: datetime, seconds: float | None) -> datetime | None:
    """``seconds`` after ``start``, or None for no deadline (None, not finite, or too far out).

    Args:
        start: when the time starts running.
        seconds: how long it runs (negative counts as 0).

    Returns:
        The deadline, or None when there is none.
    """
    if seconds is None or not math.isfinite(seconds) or seconds > FAR_FUTURE_S:
        return None
    return start + timedelta(seconds=max(0.0, seconds))


@dataclass(eq=False)
class WaiterQueue(BookPiece):
    """The requests waiting for the group, kept in ``state.queue`` in arrival order."""

    # Each queued request's encoded size, measured once (request id -> the request, its size):
    # the refusal runs in the acquire validator, before every acquire, and summing a full
    # queue's sizes afresh there cost ~45 us per waiter (45 ms at 1,000). A cache of this run
    # only (not state): a request is never changed in place, so the same object has the same size.
    _sizes: dict[str, tuple[AcquireRequest, int]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __len__(self) -> int:
        return len(self.state.queue)

    def has(self, request_id: str) -> bool:
        """Whether the request waits in the queue.

        Args:
            request_id: the request's id.

        Returns:
            True if a waiter holds that request.
        """
        return any(w.request.request_id == request_id for w in self.state.queue)

    def refusal(self, request: AcquireRequest) -> str | None:
        """Why a new request may not join: the queue's bounds on waiters and bytes, which keep
        what a flood of requests can make the group carry within its continue-as-new input.

        Args:
            request: the request that asks to join.

        Returns:
            The reason, for the requester to read; None if it may join.
        """
        queue = self.state.queue
        if len(queue) >= MAX_WAITERS:
            return f"group {self.config.group_id}'s queue is full ({len(queue)} waiters); ask later"
        own = encoded_size(request)
        if own > MAX_REQUEST_BYTES:
            return (
                f"the request takes {own} bytes, more than a group carries for one request "
                f"({MAX_REQUEST_BYTES}); send a smaller snapshot target (fewer queues, backends "
                "or processes, shorter names)"
            )
        size = own + self._queued_bytes()
        if size > MAX_QUEUE_BYTES:
            return (
                f"group {self.config.group_id}'s queue is full ({MAX_QUEUE_BYTES} bytes of "
                "requests); ask later, or send a smaller snapshot target"
            )
        return None

    def _queued_bytes(self) -> int:
        """The encoded bytes of every queued request (``encoded_size`` of each)."""
        queue, sizes = self.state.queue, self._sizes
        if len(sizes) > 2 * len(queue) + 64:  # forget the requests that left
            live = {w.request.request_id for w in queue}
            for rid in [rid for rid in sizes if rid not in live]:
                del sizes[rid]
        total = 0
        for w in queue:
            known = sizes.get(w.request.request_id)
            if known is None or known[0] is not w.request:
                known = sizes[w.request.request_id] = (w.request, encoded_size(w.request))
            total += known[1]
        return total

    def append(self, request: AcquireRequest, now: datetime) -> Waiter:
        """Queue a request behind the others, with the next arrival number.

        Args:
            request: the request (its idempotency is the book's to check first).
            now: when it reached the group; its ageing and time-out count from here.

        Returns:
            The new waiter.
        """
        state = self.state
        waiter = Waiter(request=request, seq=state.next_seq, enqueued_at=now)
        state.queue.append(waiter)
        state.next_seq += 1
        return waiter

    def peek_next(self, now: datetime) -> Waiter | None:
        """The waiter the group serves next (:func:`~timeslice.workflows.grant_policy.next_waiter`).

        Args:
            now: the time the order is taken at (ageing counts waiting up to it).

        Returns:
            That waiter, still queued; None if nobody waits.
        """
        return next_waiter(
            self.state.queue,
            lambda w: (w.request.priority, (now - w.enqueued_at).total_seconds(), w.seq),
            self.config.aging_s,
        )

    def remove(self, waiter: Waiter) -> None:
        """Take ``waiter`` off the queue (it is being granted).

        Args:
            waiter: a waiter that is queued.

        Raises:
            ValueError: if it is not queued.
        """
        self.state.queue.remove(waiter)

    def waiting(self, request_id: str) -> list[Waiter]:
        """The waiters of one request (none or one: a request is queued once).

        Args:
            request_id: the request's id.

        Returns:
            Those waiters.
        """
        return [w for w in self.state.queue if w.request.request_id == request_id]

    def drop(self, request_id: str) -> None:
        """Take the request's waiters off the queue (it was cancelled).

        Args:
            request_id: the request's id.
        """
        self.state.queue = [w for w in self.state.queue if w.request.request_id != request_id]

    def deadline(self) -> datetime | None:
        """The earliest time a waiter's own time-out (``AcquireRequest.timeout_s``) passes.

        Returns:
            That time, or None if no waiter has one.
        """
        deadlines = [
            d
            for w in self.state.queue
            if (d := after(w.enqueued_at, w.request.timeout_s)) is not None
        ]
        return min(deadlines) if deadlines else None

    def drop_timed_out(self, now: datetime) -> list[Waiter]:
        """Take off the queue every waiter whose own time-out has passed.

        Args:
            now: the time to judge by.

        Returns:
            The waiters dropped, in queue order.
        """
        kept: list[Waiter] = []
        dropped: list[Waiter] = []
        for w in self.state.queue:
            deadline = after(w.enqueued_at, w.request.timeout_s)
            (dropped if deadline is not None and now >= deadline else kept).append(w)
        self.state.queue = kept
        return dropped
