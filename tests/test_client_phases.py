"""Embedded clients report the GPU phases they ran with their release (`on_accelerators`: the
decorated call's span; `release(lease, phases=...)`), against a real server: the group keeps
them with its lease records, and the report splits the clients' leases into phases and
overhead and draws a lane per client job. A plain acquire / release stays "lease = phase"."""

from __future__ import annotations

import asyncio
import time

import pytest
from timeslice.report import Report, collect_report
from timeslice.transport.connection import connect, connect_config


def read_report(address: str, group: str, jobs: list[str]) -> Report:
    async def main() -> Report:
        client = await connect(connect_config(address))
        return await collect_report(client, groups=[group], jobs=jobs)

    return asyncio.run(main())


def test_clients_phases_split_their_leases_and_get_lanes(address, group, make_client) -> None:
    jobs = ["phases-a", "phases-b", "phases-plain"]
    a, b, plain = (make_client(job_id=j) for j in jobs)

    def busy() -> int:
        # Some work in the body, so the phase is not empty once rounded to the millisecond
        # the group keeps (50,000 additions once took under 0.5 ms and read as 0.0 s).
        return sum(range(1_000_000))

    work_a, work_b = a.on_accelerators(group)(busy), b.on_accelerators(group)(busy)
    for _ in range(3):
        work_a()
        work_b()
        plain.release(plain.acquire(group))  # reports nothing: its lease is its phase
    # A phase given by hand, placed from the lease's grant, and one outside it is cut.
    lease = a.acquire(group)
    begun = time.monotonic()
    busy()
    a.release(lease, phases=[(begun, time.monotonic()), (begun - 60.0, begun - 30.0)])

    status = a.group_status(group)
    records = {j: [r for r in status.history if r.job_id == j] for j in jobs}
    assert [len(records[j]) for j in jobs] == [4, 3, 3]
    for job in ("phases-a", "phases-b"):
        for record in records[job]:
            assert record.phases is not None and len(record.phases) == 1, record
            (offset, seconds) = record.phases[0]
            held = (record.end - record.start).total_seconds()
            assert offset >= 0 and seconds > 0 and offset + seconds <= held + 1e-3, record
    assert all(r.phases is None for r in records["phases-plain"])

    report = read_report(address, group, jobs)
    lanes = {lane.name: lane for lane in report.lanes if lane.kind == "job"}
    assert {"phases-a", "phases-b", "phases-plain"} <= set(lanes)
    for job, count in (("phases-a", 4), ("phases-b", 3), ("phases-plain", 3)):
        assert [s.kind for s in lanes[job].spans] == ["phase"] * count, job
    (g,) = report.groups
    # The reporting clients' leases are more than their phases: the phase share is below the
    # lease share, by the time the grant and the release travelled.
    leased = g.phase_s + g.overhead_s
    assert 0 < g.phase_s < leased and g.overhead_s > 0
    plain_s = sum(s.seconds for s in lanes["phases-plain"].spans)
    phases_s = sum(s.seconds for j in ("phases-a", "phases-b") for s in lanes[j].spans)
    assert g.phase_s == pytest.approx(plain_s + phases_s, abs=1e-3)
