"""The lease a client holds on a GPU group."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import MAX_PHASE_OFFSET_S, bounded_phases


@dataclass
class Lease:
    """A granted lease. ``token`` is the group's fencing token: larger means newer."""

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
    released: bool = False
    # A release of it is on its way to the group: a renewal the group answers after that
    # release found the lease ended by it, which is no revocation.
    releasing: bool = False
    # Local validity is conservative from the first moment: it runs from the grant's own time
    # (never past the group's deadline for confirming it), then from when each renewal was
    # *sent*, so it always ends before the group's own expiry (docs/architecture.md).
    valid_until: float = 0.0

    def __post_init__(self) -> None:
        if not self.valid_until:
            self.valid_until = self.acquired_at + self.ttl_s

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
        return time.monotonic() - self.acquired_at


def phases_since_grant(
    lease: Lease, phases: Sequence[tuple[float, float]], now: float | None = None
) -> list[tuple[float, float]]:
    """GPU phases run under ``lease``, given as (start, end) on ``time.monotonic()``, as the
    release reports them: (seconds from the grant, seconds), cut to the lease (from its grant
    to ``now``), at most ``MAX_LEASE_PHASES`` (the closest ones merged, their time kept).

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
        if (
            not all(
                isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
                for t in (start, end)
            )
            or end < start
        ):
            raise InvalidArgumentError(
                f"a phase must be (start, end) in time.monotonic() seconds with end >= start, "
                f"not {phase!r}"
            )
        start, end = max(start, lease.acquired_at), min(end, until)
        if end > start:
            offset = min(start - lease.acquired_at, MAX_PHASE_OFFSET_S)
            spans.append((offset, min(end - start, MAX_PHASE_OFFSET_S)))
    return bounded_phases(spans)
