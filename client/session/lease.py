"""The lease a client holds on a GPU group."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import MAX_PHASE_OFFSET_S, bounded_phases
from timeslice.session.arguments import finite_number


@dataclass
class Lease:
    """A granted lease on a GPU group, as ``acquire`` returns it.

    Attributes:
        group_id: The group held.
        job_id: The job that holds it.
        token: The group's fencing token: larger means newer. Work that a newer holder may
            have overtaken can be refused by it (``timeslice status`` shows the holder's).
        request_id: The request it granted.
        ttl_s: Seconds it lives at the group without renewal (the client renews it every
            third of that).
        waited_s: Seconds from the request to the grant, on the group's clock.
        acquired_at: When this process took the grant (``time.monotonic()``).
        confirm_within_s: For a grant taken from a parked update: the group takes the holder
            for dead unless a renewal or the release comes within this many seconds.
        asked_at: When the request was sent (``time.monotonic()``).
        revoked_reason: Why it is lost: the group revoked it, or this process could not renew
            it before its local validity ran out (the group may then still hold it until its
            TTL, and a release ends it as usual); None while neither happened.
        released: Whether this process let it go (released, or gave it up).
        valid_until: Until when it is held for certain (``time.monotonic()``): from the grant's
            own time, then from when each renewal was sent, so it always ends before the
            group's own expiry (docs/architecture.md, "Local validity").
        memory_bytes: The group's declared device memory, if the request named a device room
            (what the room holds this holder's restores to); None otherwise.
    """

    group_id: str
    job_id: str
    token: int
    request_id: str
    ttl_s: float
    waited_s: float
    acquired_at: float = field(default_factory=time.monotonic)
    # A grant taken from a parked update: the group counts it delivered once it is renewed
    # or released, and takes the holder for dead if neither comes within this many seconds.
    confirm_within_s: float | None = None
    # When the request was sent (monotonic clock), for timing the wait.
    asked_at: float | None = None
    # The secret the lease's release and renewals present; never shown.
    key: str = field(default="", repr=False)
    revoked_reason: str | None = None
    # The group itself said the lease is gone (a renewal answered not valid), as opposed to
    # renewals that went unanswered here.
    revoked_by_group: bool = field(default=False, repr=False)
    released: bool = False
    # A release of it is on its way to the group: a renewal the group answers after that
    # release found the lease ended by it, which is no revocation.
    releasing: bool = False
    # Local validity is conservative from the first moment: it runs from the grant's own time
    # (never past the group's deadline for confirming it), then from when each renewal was
    # *sent*, so it always ends before the group's own expiry (docs/architecture.md).
    valid_until: float = 0.0
    memory_bytes: int | None = None
    # When the last renewal the group answered valid was sent (the grant, until one was):
    # renewal signals the server recorded count only for a while after it.
    answered_at: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not self.valid_until:
            self.valid_until = self.acquired_at + self.ttl_s
        if not self.answered_at:
            self.answered_at = self.acquired_at

    @property
    def valid(self) -> bool:
        """True while the lease is held, not revoked and certainly not expired at the group."""
        return (
            not self.released
            and self.revoked_reason is None
            and time.monotonic() < self.valid_until
        )

    @property
    def held_s(self) -> float:
        """Seconds since this process took the grant."""
        return time.monotonic() - self.acquired_at


def phases_since_grant(
    lease: Lease, phases: Sequence[tuple[float, float]], now: float | None = None
) -> list[tuple[float, float]]:
    """GPU phases run under ``lease``, as the release reports them.

    Args:
        lease: The lease they ran under.
        phases: Each phase's (start, end) on ``time.monotonic()``.
        now: Where the lease's span ends (``time.monotonic()``); None: now.

    Returns:
        (seconds from the grant, seconds) for each, cut to the lease (from its grant to
        ``now``), at most ``MAX_LEASE_PHASES`` (the closest ones merged, their time kept).

    Raises:
        InvalidArgumentError: A phase is not two finite numbers with its end at or after its
            start (nothing is sent; the lease stays held).
    """
    until = time.monotonic() if now is None else now
    spans: list[tuple[float, float]] = []
    for phase in phases:
        try:
            start, end = phase
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"phases must be (start, end) pairs of time.monotonic() seconds, not {phase!r}"
            ) from None
        if not (finite_number(start) and finite_number(end)) or end < start:
            raise InvalidArgumentError(
                f"a phase must be (start, end) in time.monotonic() seconds with end >= start, "
                f"not {phase!r}"
            )
        start, end = max(start, lease.acquired_at), min(end, until)
        if end > start:
            offset = min(start - lease.acquired_at, MAX_PHASE_OFFSET_S)
            spans.append((offset, min(end - start, MAX_PHASE_OFFSET_S)))
    return bounded_phases(spans)
