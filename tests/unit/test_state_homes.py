"""Where a job process's states live: what leaves a group's device when the process departs."""

from __future__ import annotations

import asyncio
from pathlib import Path

from timeslice.activities.state_homes import StateHomes
from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import SnapshotBackend
from timeslice.snapshot.device_room import DeviceRooms
from timeslice.snapshot.simulated import SimulatedBackend

STATE = 4096


async def _no_report(group_id: str, reports: list[SnapshotReport], error: str | None) -> None:
    del group_id, reports, error


def test_a_departing_process_moves_its_states_out_through_the_room(tmp_path: Path) -> None:
    rooms = DeviceRooms(tmp_path / "rooms")
    room = rooms.room("g")
    room.set_capacity(2 * STATE)
    trace = tmp_path / "trace"
    backends: dict[str, SnapshotBackend] = {
        name: SimulatedBackend(nbytes=STATE, chunk_bytes=STATE // 4, trace=trace)
        for name in ("sampler", "trainer")
    }
    homes = StateHomes("job", _no_report, rooms)
    homes.settle(backends, {"sampler": "g", "trainer": "g"})
    assert room.status().used == 2 * STATE

    reports = asyncio.run(homes.vacate())

    # The room is free before any group hears the job left, not once the process is reaped.
    assert sorted(r.bytes for r in reports) == [STATE, STATE]
    assert room.status().used == 0 and room.status().held == {}
    assert homes.home("sampler") is None and homes.home("trainer") is None
    # The backends' own witness saw both states leave.
    assert sum(int(line.split()[2]) for line in trace.read_text().splitlines()) == 0
    assert asyncio.run(homes.vacate()) == []  # nothing left: nothing moves
