"""What the GPU group counts: its leases, waits, switches and bytes, the records it keeps of
them, and what of it all the next run carries.

One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces: it keeps the accounting part
of the group's ``GroupState`` (``stats``, ``history``, ``switch_history``, ``wait_shares``) and
reports what the metrics count to its observer (the workflow's metrics).
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any, Literal

from timeslice.protocol.group import (
    CARRIED_STATE_BUDGET_BYTES,
    AcquireRequest,
    GroupInput,
    HeldLease,
    LeaseOutcome,
    LeaseRecord,
    SnapshotReport,
    SwitchRecord,
    encoded_size,
)
from timeslice.workflows.book_piece import BookPiece
from timeslice.workflows.grant_policy import record_wait, remember_job, waiting_share
from timeslice.workflows.residency import SwitchDone

__all__ = ["GroupAccounts", "percentile"]


def percentile(samples: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``samples`` (nearest rank).

    Args:
        samples: the values.
        q: the quantile, 0 to 1.

    Returns:
        The value, or None with no samples.
    """
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


_COUNTERS = {
    LeaseOutcome.RELEASED: "released",
    LeaseOutcome.EXPIRED: "expired",
    LeaseOutcome.CANCELLED: "cancelled",
    LeaseOutcome.REJECTED: "rejected",
    LeaseOutcome.DEAD: "dead_waiters",
}


class GroupAccounts(BookPiece):
    """The group's counts, times, bytes and records."""

    def _seconds(self, when: datetime) -> float:
        """A time as the waiting-share records keep it: seconds since the group's creation."""
        return (when - self.state.stats.created_at).total_seconds()

    def waiting_share(self, job_id: str, now: datetime) -> float:
        """The job's waiting share (:func:`~timeslice.workflows.grant_policy.waiting_share`).

        Args:
            job_id: the job.
            now: the time the share is taken at.

        Returns:
            0 to 1; 0 for a job granted nothing yet.
        """
        records = self.state.wait_shares.get(job_id)
        return waiting_share(records, self._seconds(now)) if records else 0.0

    # ------------------------------------------------------------------ leases

    def granted(self, request: AcquireRequest, enqueued_at: datetime, waited: float) -> None:
        """Count a grant and its wait (the waiting shares, the wait samples, the metrics).

        Args:
            request: the request granted.
            enqueued_at: when it reached the group.
            waited: seconds from then to the grant.
        """
        state = self.state
        state.stats.leases += 1
        record_wait(
            remember_job(state.wait_shares, request.job_id), self._seconds(enqueued_at), waited
        )
        samples = state.stats.wait_samples_s
        samples.append(waited)
        del samples[: max(0, len(samples) - self.config.wait_samples_keep)]
        self.observer.granted(waited)

    def lease_ended(self, holder: HeldLease, outcome: LeaseOutcome, now: datetime) -> None:
        """Count a lease that ended: its time held, its outcome, its record in the history.

        Args:
            holder: the lease.
            outcome: how it ended.
            now: when it ended.
        """
        state = self.state
        held = (now - holder.granted_at).total_seconds()
        stats = state.stats
        stats.busy_s += held
        setattr(stats, _COUNTERS[outcome], getattr(stats, _COUNTERS[outcome]) + 1)
        self.observer.lease_ended(outcome, held)
        if self.config.history_keep:
            state.history.append(
                LeaseRecord(
                    job_id=holder.request.job_id,
                    token=holder.token,
                    start=holder.granted_at,
                    end=now,
                    outcome=outcome,
                    phases=holder.phases,
                )
            )
            del state.history[: max(0, len(state.history) - self.config.history_keep)]

    def dropped(self, why: Literal["malformed", "refused"]) -> None:
        """Count a signal the group dropped.

        Args:
            why: ``malformed`` (not a valid message) or ``refused`` (the queue was full).
        """
        stats = self.state.stats
        if why == "malformed":
            stats.malformed_messages += 1
        else:
            stats.refused_requests += 1

    # ------------------------------------------------------------------ switches and bytes

    def count_moved(self, direction: str, reports: list[SnapshotReport]) -> int:
        """Count the bytes a move reported.

        Args:
            direction: ``evict`` or ``restore`` (the metric's label).
            reports: the backends' reports.

        Returns:
            The bytes moved.
        """
        moved = sum(r.bytes for r in reports)
        self.state.stats.bytes_moved += moved
        self.observer.moved(direction, moved)
        return moved

    def record_move(
        self,
        from_job: str | None,
        to_job: str | None,
        span: tuple[datetime, datetime],
        nbytes: int,
        *,
        overlapped: bool = False,
        by_holder: bool = False,
    ) -> None:
        """Keep the record of one move of device state (the last ``history_keep``): the
        timeline's switch marks (``SwitchRecord``).

        Args:
            from_job: the job evicted, if any.
            to_job: the job restored, if any.
            span: when the move started and ended.
            nbytes: the bytes moved.
            overlapped: it ran beside a lease (its time is not switching time).
            by_holder: a holder moved its own state (else the group's activities did).
        """
        if self.config.history_keep:
            start, end = span
            switches = self.state.switch_history
            switches.append(
                SwitchRecord(
                    from_job=from_job,
                    to_job=to_job,
                    start=start,
                    end=end,
                    bytes=nbytes,
                    overlapped=overlapped,
                    by_holder=by_holder,
                )
            )
            del switches[: max(0, len(switches) - self.config.history_keep)]

    def mark_overlapped(
        self, job_id: str, at: datetime, nbytes: int, *, by_holder: bool = False
    ) -> None:
        """Record an eviction that overlapped a lease: a mark of no width on the timeline, since
        its time was the next holder's, not switching time.

        Args:
            job_id: the job evicted.
            at: when its eviction was known to be over.
            nbytes: the bytes it moved.
            by_holder: the job evicted its own state (else the group's activity did).
        """
        self.record_move(job_id, None, (at, at), nbytes, overlapped=True, by_holder=by_holder)

    def switch_done(self, done: SwitchDone) -> None:
        """Count one switch, however its moves were split between the group and the holders.

        Args:
            done: the switch.
        """
        stats, plan, waited_for = self.state.stats, done.plan, done.waited_for
        if plan.moves or plan.evict is not None or plan.restores_itself or waited_for is not None:
            stats.switches += 1
        if plan.overlapped:
            stats.overlapped_switches += 1
        if plan.streamed:
            stats.streamed_switches += 1
        if plan.moves or waited_for is not None:
            seconds = (done.ended - done.started).total_seconds()
            stats.switching_s += seconds
            self.observer.switched(seconds)
            source = plan.evict or waited_for
            self.record_move(
                source.job_id if source is not None else None,
                done.request.job_id,
                (done.started, done.ended),
                done.moved_bytes,
                overlapped=plan.overlapped,
                by_holder=plan.evict is None and waited_for is not None,
            )

    def own_moves(
        self,
        job_id: str,
        restored: list[SnapshotReport],
        evicted: list[SnapshotReport],
        *,
        granted_at: datetime,
        now: datetime,
    ) -> None:
        """Count what a holder moved itself during its lease. Moving state is switching, not
        useful work, even when done inside a lease: its time leaves the busy time.

        Args:
            job_id: the holder's job.
            restored: its restores' reports, placed at the lease's start.
            evicted: its evictions' reports, placed at the lease's end.
            granted_at: when the lease was granted.
            now: when the lease ended.
        """
        stats = self.state.stats
        if restored:
            stats.restores += 1
        self.count_moved("restore", restored)
        self.count_moved("evict", evicted)
        seconds = sum(r.seconds for r in [*restored, *evicted])
        stats.switching_s += seconds
        stats.busy_s -= seconds
        for reports, is_restore in ((restored, True), (evicted, False)):
            if reports:
                took = timedelta(seconds=sum(r.seconds for r in reports))
                start = granted_at if is_restore else now - took
                self.record_move(
                    None if is_restore else job_id,
                    job_id if is_restore else None,
                    (start, start + took),
                    sum(r.bytes for r in reports),
                    by_holder=True,
                )

    # ------------------------------------------------------------------ continue-as-new

    def carried_input(self) -> tuple[dict[str, Any], int, int]:
        """The next run's input, shed to fit. A state reached by valid messages never needs the
        shedding (its bounds add up to the budget: ``group_state_budget``), but one carried from
        an older release may: a continue-as-new input over Temporal's payload limit would fail
        its task forever and wedge the group.

        Returns:
            ``GroupInput`` as JSON, its encoded size, and how many lease and switch records
            were shed, oldest first, to bring it within ``CARRIED_STATE_BUDGET_BYTES``.
        """
        state = self.state
        shed = 0
        while True:
            carried = GroupInput(config=self.config, state=state).model_dump(mode="json")
            size = encoded_size(carried)
            excess = size - CARRIED_STATE_BUDGET_BYTES
            if excess <= 0 or not (state.history or state.switch_history):
                break
            dropped = self._shed_history(excess)
            shed += dropped
            # The count travels with the state: its digits are measured on the next pass (so
            # they can never take it past the budget).
            state.stats.shed_records += dropped
        return carried, size, shed

    def next_run_input(self) -> dict[str, Any]:
        """Count the next run and give its input (:meth:`carried_input`'s).

        Returns:
            ``GroupInput`` as JSON, for ``workflow.continue_as_new``.
        """
        self.state.stats.runs += 1
        carried, _, _ = self.carried_input()
        return carried

    def _shed_history(self, excess: int) -> int:
        """Drop the oldest lease and switch records until ``excess`` bytes are gone."""
        state = self.state
        dropped = 0
        while excess > 0 and (state.history or state.switch_history):
            if state.history and (
                not state.switch_history or state.history[0].start <= state.switch_history[0].start
            ):
                excess -= encoded_size(state.history.pop(0)) + 1
            else:
                excess -= encoded_size(state.switch_history.pop(0)) + 1
            dropped += 1
        return dropped
