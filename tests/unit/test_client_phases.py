"""Embedded clients report their GPU phases with their release (issue 25): bounded, a field old
groups never see when empty, kept by the group with the lease, split by the report into phase
time and overhead, one lane per client job."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import (
    MAX_LEASE_PHASES,
    GroupStats,
    GroupStatus,
    LeaseOutcome,
    LeaseRecord,
    LeaseReturn,
    bounded_phases,
)
from timeslice.report.figures import client_phases, group_figures
from timeslice.session.lease import Lease, phases_since_grant

from tests.unit.test_group_book import at, book, grant_next, key, request

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_release_without_phases_encodes_as_before() -> None:
    plain = LeaseReturn(request_id="a:r", key=key("a:r"), token=1)
    assert "phases" not in plain.model_dump(mode="json")
    reported = LeaseReturn(request_id="a:r", key=key("a:r"), token=1, phases=[(0.25, 1.5)])
    assert reported.model_dump(mode="json")["phases"] == [[0.25, 1.5]]
    # A release of an older client (no field) reads as phases not reported; [] says none ran.
    assert LeaseReturn.model_validate(plain.model_dump(mode="json")).phases is None
    none_ran = LeaseReturn(request_id="a:r", key=key("a:r"), token=1, phases=[])
    assert none_ran.model_dump(mode="json")["phases"] == []


def test_phases_are_bounded_and_checked() -> None:
    too_many = [(float(i), 0.5) for i in range(MAX_LEASE_PHASES + 1)]
    with pytest.raises(ValueError, match="at most 4"):
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, phases=too_many)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, phases=[(-1.0, 1.0)])
    # Past the bound the two closest merge: their time is kept, summed.
    merged = bounded_phases([(0.0, 1.0), (1.05, 1.0), (4.0, 1.0), (6.0, 1.0), (9.0, 1.0)])
    assert merged == [(0.0, 2.0), (4.0, 1.0), (6.0, 1.0), (9.0, 1.0)]
    assert sum(s for _, s in merged) == 5.0
    assert bounded_phases([(0.12345, 0.98765)]) == [(0.123, 0.988)]  # to the millisecond


def test_the_client_turns_its_clock_into_offsets_from_the_grant() -> None:
    lease = Lease(group_id="g", job_id="a", token=1, request_id="a:r", ttl_s=20, waited_s=0,
                  acquired_at=100.0)  # fmt: skip
    # Cut to the lease: a phase begun before the grant counts from it, one past now ends there.
    assert phases_since_grant(lease, [(99.0, 100.5), (101.0, 102.0), (103.0, 110.0)], now=104) == [
        (0.0, 0.5),
        (1.0, 1.0),
        (3.0, 1.0),
    ]
    for bad in ([(2.0, 1.0)], [("a", 1.0)], [(1.0,)], [(float("nan"), 1.0)], [(True, 2.0)]):
        with pytest.raises(InvalidArgumentError, match="phase"):
            phases_since_grant(lease, bad, now=104)  # type: ignore[arg-type]


def test_the_group_keeps_them_with_the_lease_across_a_carried_release() -> None:
    b = book()
    b.enqueue(request("a"), at(0))
    grant_next(b, at(0))
    # Kept (nobody waits): the first segment's phase stays with the held lease.
    kept = b.release(
        LeaseReturn(
            request_id="a:r", key=key("a:r"), token=1, keep_if_uncontended=True,
            phases=[(0.5, 1.0)],
        ),
        at(2),
    )  # fmt: skip
    assert kept.valid and not kept.released
    assert b.state.holder is not None and b.state.holder.phases == [(0.5, 1.0)]
    done = b.release(
        LeaseReturn(request_id="a:r", key=key("a:r"), token=1, phases=[(2.5, 1.0)]), at(4)
    )
    assert done.released
    (record,) = b.state.history
    assert record.phases == [(0.5, 1.0), (2.5, 1.0)]
    assert (record.start, record.end) == (at(0), at(4))
    # A plain release reports nothing: the lease is the phase, and its record is as before.
    b.enqueue(request("c"), at(5))
    grant_next(b, at(5))
    b.release(LeaseReturn(request_id="c:r", key=key("c:r"), token=2), at(6))
    assert b.state.history[-1].phases is None
    assert "phases" not in b.state.history[-1].model_dump(mode="json")


def lease(job: str, token: int, start: float, end: float, phases=None) -> LeaseRecord:
    return LeaseRecord(
        job_id=job,
        token=token,
        start=T0 + timedelta(seconds=start),
        end=T0 + timedelta(seconds=end),
        outcome=LeaseOutcome.RELEASED,
        phases=phases,
    )


def status(history: list[LeaseRecord]) -> GroupStatus:
    busy = sum((r.end - r.start).total_seconds() for r in history)
    return GroupStatus(
        group_id="g", holder=None, queue=[], resident_job=None, faulted_jobs={},
        held_share=busy / 10, wall_s=10.0, idle_s=10 - busy, wait_p50_s=None, wait_p99_s=None,
        stats=GroupStats(created_at=T0, leases=len(history), busy_s=busy), history=history,
    )  # fmt: skip


def test_the_report_splits_a_reporting_clients_leases_into_phases_and_overhead() -> None:
    # Client a held 0-2 s and reported phases 0.25-1.25 and 1.5-1.75 s; client b held 3-5 s
    # and reported none (its lease is its phase).
    read = status([lease("a", 1, 0, 2, [(0.25, 1.0), (1.5, 0.25)]), lease("b", 2, 3, 5)])
    g, _ = group_figures(read, None, [], set())
    assert (g.phase_s, g.overhead_s, g.idle_s) == (3.25, 0.75, 6.0)
    assert g.utilization < read.held_share  # phases below the lease share
    lanes = {}
    for span in client_phases(read, set()):
        lanes.setdefault(span.lane, []).append((span.kind, span.start, span.end))
    assert lanes == {
        "a": [("phase", at(0.25), at(1.25)), ("phase", at(1.5), at(1.75))],
        "b": [("phase", at(3), at(5))],
    }
    # A phase reported past its lease's end is cut there; a lease that reported no phase ran
    # (the lease kept only to bring the state home, say) is overhead whole.
    late = status([lease("a", 1, 0, 2, [(1.5, 3.0)]), lease("a", 2, 3, 4, [])])
    g, _ = group_figures(late, None, [], set())
    assert (g.phase_s, g.overhead_s) == (0.5, 2.5)
