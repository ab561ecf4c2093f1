"""Who gets a GPU group when: the waiter order and the grant policies, as pure decisions over
plain numbers.

The group workflow (through :class:`~timeslice.workflows.group_book.GroupBook`) and the planner's
simulator (:mod:`timeslice.plan.simulator`) both decide with this module, so a prediction and
the real group cannot drift apart. Nothing here knows Temporal, datetimes or processes: times
are seconds on any one clock.

Two policies (``GroupConfig.grant_policy``):

- ``fifo``: a lease released between two GPU phases of one job is kept only when nobody waits.
  With two RL jobs this phase-locks them: B trains, A trains, B samples, A samples, both
  compute rewards at once while the group idles, and every epoch costs two switches per job.
- ``phase_aware`` (the default): a holder whose next GPU phase on this group follows at once
  (an RL job's ``train`` then its next ``sample``) *carries* its lease into that phase even
  when someone waits, so each job's GPU work is one block followed by its off-GPU work, and
  the blocks of different jobs interleave with each other's off-GPU time.

The bounds a carry must pass (every one is enforced here, and tested):

- **Starvation**: a lease crosses at most ``max_carries`` phase boundaries while a waiter
  waits (default 1), and only into a phase the holder states will take at most
  ``carry_limit_s``. So a waiter is held off by at most ``max_carries`` extra phases per lease
  ahead of it: with ``n`` leases granted before it under FIFO order (priority and ageing keep
  their meaning), it waits for at most ``n * (1 + max_carries)`` phases.
- **Priority**: a lease is never carried past a waiter that asked with a higher priority than
  the holder's lease (ageing orders waiters as before; it does not stop a carry, which the
  bound above limits anyway).
- **Fairness** (waiting shares): a job's *waiting share* is the time it spent waiting for its
  last ``WAIT_RECORDS_KEEP`` grants over the time since the first of them was asked for. A
  lease is carried past waiters only while the holder's waiting share is within
  ``share_slack`` of every waiter's: a job that has waited less than the others, in proportion
  to its time on the group, cannot hold them off. The carry is what makes jobs wait, so this
  keeps the extra waiting that carries cause spread across the jobs, instead of falling on the
  job whose off-GPU time is shortest (which is what an unconditional carry does: it slowed a
  heavy job 1.16x -> 1.30x beside a light one, in the simulator).

The **waiter order** (:func:`next_waiter`) is the same under both policies: the highest
``priority + waited / aging_s``, first come first served among equals. Ordering by the off-GPU
time that follows a request (longest first) was tried in the simulator on the benchmark mixes
and changed no figure, so it is not built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from timeslice.protocol.group import (
    DEFAULT_CARRY_LIMIT_S,
    DEFAULT_GRANT_POLICY,
    DEFAULT_MAX_CARRIES,
    DEFAULT_SHARE_SLACK,
    WAIT_RECORDS_KEEP,
    WAIT_SHARE_JOBS_KEEP,
    GrantPolicy,
)

W = TypeVar("W")


@dataclass(frozen=True)
class CarryLimits:
    """A group's bounds on carrying a lease past waiters (from its ``GroupConfig``)."""

    policy: GrantPolicy = DEFAULT_GRANT_POLICY
    max_carries: int = DEFAULT_MAX_CARRIES
    carry_limit_s: float = DEFAULT_CARRY_LIMIT_S
    share_slack: float = DEFAULT_SHARE_SLACK


@dataclass(frozen=True)
class Carry:
    """What a group decided about a holder's ask to keep its lease into its next phase."""

    keep: bool
    # Why, in words a status line can show ("carrying into sample", "fifo: 1 waiting", ...).
    reason: str
    # The lease is kept past at least one waiter: it counts towards ``max_carries``.
    contended: bool = False


def waiter_score(priority: int, waited_s: float, seq: int, aging_s: float) -> tuple[float, int]:
    """A waiter's place in the order: the highest score is served next.

    Args:
        priority: the priority its request asked with.
        waited_s: seconds since its request reached the group.
        seq: its arrival number on the group (the earlier, the smaller).
        aging_s: the group's seconds of waiting worth one priority level.

    Returns:
        ``(priority + waited_s / aging_s, -seq)``: ageing lifts a waiter one level per
        ``aging_s`` of waiting, and between equal levels the earlier arrival comes first.
    """
    return (priority + waited_s / aging_s, -seq)


def next_waiter(
    waiters: Iterable[W], facts: Callable[[W], tuple[int, float, int]], aging_s: float
) -> W | None:
    """The waiter a free group serves next: ``GroupBook``'s and the simulator's one rule.

    Args:
        waiters: the group's waiters, in whatever form the caller keeps them.
        facts: a waiter's ``(priority, waited_s, seq)`` now (see :func:`waiter_score`).
        aging_s: the group's ``aging_s``.

    Returns:
        The waiter with the highest :func:`waiter_score`, or None when nobody waits.
    """
    return max(waiters, key=lambda w: waiter_score(*facts(w), aging_s), default=None)


def waiting_share(records: Sequence[float], now: float) -> float:
    """A job's waiting share from its flat ``[asked_at, waited_s, ...]`` records: time waited
    over time since the first recorded ask (0 with no records or no time passed)."""
    if len(records) < 2:
        return 0.0
    span = now - records[0]
    if span <= 0:
        return 0.0
    waited = sum(records[1::2])
    return min(1.0, max(0.0, waited / span))


def record_wait(records: list[float], asked_at: float, waited_s: float) -> None:
    """Add one grant's wait to a job's flat records, keeping the last ``WAIT_RECORDS_KEEP``."""
    records.extend((asked_at, max(0.0, waited_s)))
    del records[: max(0, len(records) - 2 * WAIT_RECORDS_KEEP)]


def remember_job(shares: dict[str, list[float]], job_id: str) -> list[float]:
    """The records of ``job_id``, now the most recently granted; forgets the least recently
    granted jobs beyond ``WAIT_SHARE_JOBS_KEEP``."""
    records = shares.pop(job_id, [])
    shares[job_id] = records
    while len(shares) > WAIT_SHARE_JOBS_KEEP:
        del shares[next(iter(shares))]
    return records


def decide_carry(
    limits: CarryLimits,
    *,
    next_phase: str,
    next_phase_s: float,
    carries: int,
    holder_share: float,
    waiters: Iterable[tuple[str, float, int]],
    holder_priority: int = 0,
) -> Carry:
    """Whether a holder keeps its lease into its next GPU phase on this group.

    Args:
        limits: the group's policy and bounds.
        next_phase: the phase's name (for the reason).
        next_phase_s: how long the holder says that phase will take.
        carries: phase boundaries this lease already crossed while someone waited.
        holder_share: the holder's waiting share now (:func:`waiting_share`).
        waiters: ``(job_id, waiting share, priority)`` of each other job's request waiting
            for the group (its priority as asked, ageing aside). The
            share is of its recorded grants: its current wait is what ``max_carries`` bounds
            (counting it made the share rule refuse the carries that help both jobs: 70.6% ->
            55.7% on the demo pair in the simulator).
        holder_priority: the priority the holder's lease was asked with.

    Returns:
        The decision and its reason; nobody waiting is always a keep (as under FIFO).
    """
    others = list(waiters)
    if not others:
        return Carry(True, f"carrying into {next_phase}")
    if limits.policy is GrantPolicy.FIFO:
        return Carry(False, f"fifo: {len(others)} waiting")
    if carries >= limits.max_carries:
        return Carry(False, f"carried {carries} phase(s) past waiters already")
    if next_phase_s > limits.carry_limit_s:
        limit = limits.carry_limit_s
        return Carry(False, f"{next_phase} expected {next_phase_s:.1f} s > carry limit {limit:g} s")
    higher = [job for job, _, priority in others if priority > holder_priority]
    if higher:
        return Carry(False, f"{higher[0]} waits with a higher priority")
    worst_job, worst, _ = max(others, key=lambda w: w[1])
    if holder_share + limits.share_slack < worst:
        return Carry(
            False,
            f"{worst_job} waited more (share {worst:.2f} > {holder_share:.2f} + "
            f"{limits.share_slack:g})",
        )
    return Carry(True, f"carrying into {next_phase}", contended=True)
