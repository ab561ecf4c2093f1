"""A job process's state homes without Temporal: real (simulated) backends, asyncio."""

from __future__ import annotations

import asyncio

from timeslice.activities.state_homes import StateHomes
from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.simulated import SimulatedBackend


async def _told(group_id: str, reports: list[SnapshotReport], error: str | None, **_: object):
    return None


def test_an_eviction_waits_for_a_restore_on_its_way_to_that_device_and_moves_it_out():
    """The group's snapshot activity arrives while an early restore (a lease asked ahead and
    granted, then ended) is still bringing the state to that group's device: the eviction waits
    for it and moves it out, instead of answering "nothing here" while the state arrives."""

    async def scenario() -> tuple[list[SnapshotReport], str | None]:
        homes = StateHomes("job", _told)
        backend = SimulatedBackend(nbytes=1000, snapshot_s=0.05, restore_s=0.3)
        homes.settle({"policy": backend}, {"policy": None})
        # Out in host memory first, as after an earlier eviction.
        await backend.snapshot(homes._request("policy", "g", "setup"))
        homes.bring_early(["policy"], "g")
        await asyncio.sleep(0)  # the restore has started
        evicted = await asyncio.wait_for(homes.evict_for(["policy"], "g"), timeout=30)
        return evicted, homes.home("policy")

    evicted, home = asyncio.run(scenario())
    assert [r.bytes for r in evicted] == [1000]
    assert home is None


def test_an_eviction_of_another_group_does_not_wait_for_a_restore_here():
    async def scenario() -> list[SnapshotReport]:
        homes = StateHomes("job", _told)
        backend = SimulatedBackend(nbytes=1000, snapshot_s=0.05, restore_s=2.0)
        homes.settle({"policy": backend}, {"policy": None})
        await backend.snapshot(homes._request("policy", "g", "setup"))
        homes.bring_early(["policy"], "g")
        await asyncio.sleep(0)
        return await asyncio.wait_for(homes.evict_for(["policy"], "other"), timeout=1.5)

    assert asyncio.run(scenario()) == []
