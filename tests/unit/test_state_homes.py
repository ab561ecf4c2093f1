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


class _OutOfMemory(SimulatedBackend):
    """A backend whose restore fails as torch's does when the device is full."""

    async def restore(self, request):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA out of memory (injected)")


def test_a_state_brought_in_behind_a_phase_that_fails_with_a_backend_error_fails_no_phase():
    """The restore of the job's next state behind a phase fails with the backend's own error
    (torch's out of memory is a RuntimeError): the phase, whose work is done, is not failed
    for it; the state is left where it was, for its next use to restore."""

    async def scenario() -> tuple[list[SnapshotReport], str | None]:
        homes = StateHomes("job", _told)
        first, second = SimulatedBackend(nbytes=10), _OutOfMemory(nbytes=10)
        homes.settle({"a": first, "b": second}, {"a": None, "b": None})
        async with homes.using(["a", "b"], "g", first=["a"], ahead=True):
            # the phase's work, under "a"; then, as the job process does, what came behind it
            reports = await homes.brought_ahead("g")
        return reports, homes.home("b")

    reports, home = asyncio.run(scenario())
    assert reports == [] and home is None


class _StuckOnDevice(SimulatedBackend):
    """A backend whose eviction fails with its own error, not a SnapshotError."""

    async def snapshot(self, request):  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: an illegal memory access (injected)")


def test_a_cooperative_eviction_that_fails_with_a_backend_error_is_reported_as_failed():
    """The group hears of it (and faults the job) instead of waiting for a report that the
    failed background task never sends."""
    told: list[tuple[str, list[SnapshotReport], str | None]] = []

    async def tell(group_id: str, reports: list[SnapshotReport], error: str | None, **_: object):
        told.append((group_id, reports, error))

    async def scenario() -> None:
        homes = StateHomes("job", tell)
        homes.settle({"a": _StuckOnDevice(nbytes=10)}, {"a": "g"})
        claim = homes.claim(["a"])
        homes.evict_in_background(["a"], "g")
        await claim.done()
        await asyncio.wait_for(homes.settled(), timeout=30)

    asyncio.run(scenario())
    assert len(told) == 1
    group_id, reports, error = told[0]
    assert group_id == "g" and reports == [] and error is not None and "illegal" in error


def test_a_state_taken_off_another_group_is_reported_there_when_its_restore_fails():
    """Moving a state from g1's device to g2's: it left g1 (g1's room is free) even though
    the restore on g2 failed; g1 must hear so, or it counts the state as still on its device."""
    told: list[tuple[str, list[SnapshotReport], str | None]] = []

    async def tell(group_id: str, reports: list[SnapshotReport], error: str | None, **_: object):
        told.append((group_id, reports, error))

    async def scenario() -> tuple[str | None, str | None]:
        homes = StateHomes("job", tell)
        homes.settle({"a": _OutOfMemory(nbytes=10)}, {"a": "g1"})
        failed = None
        try:
            await homes.bring({"a": "g2"})
        except RuntimeError as err:
            failed = str(err)
        await asyncio.wait_for(homes.settled(), timeout=30)
        return failed, homes.home("a")

    failed, home = asyncio.run(scenario())
    assert failed is not None and "out of memory" in failed
    assert home is None  # in host memory: neither device holds it
    assert [(g, [r.bytes for r in reports], e) for g, reports, e in told] == [("g1", [10], None)]
