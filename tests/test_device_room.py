"""A group's device room on one node: restores wait for the room evictions free, across
processes, never past the declared memory; the simulated backend's moves through it take the
longer of an eviction and a restore at once, and the sum of two the same way."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from timeslice.snapshot.base import SnapshotError, SnapshotRequest
from timeslice.snapshot.device_room import DeviceRoom, DeviceRooms, _Doorbell
from timeslice.snapshot.simulated import SimulatedBackend

from tests.helpers import wait_for

GROUP = "room-test"
# A process that holds bytes in a room and gives some back when told (one line on stdin each).
HOLDER = """
import sys, time
from pathlib import Path
from timeslice.snapshot.device_room import DeviceRooms
room = DeviceRooms(Path(sys.argv[1])).room(sys.argv[2])
room.hold(int(sys.argv[3]))
print("held", flush=True)
for line in sys.stdin:
    giving = time.monotonic()
    room.give(int(line))
    print(giving, flush=True)
"""


# A process that takes and gives one chunk at a time, many times over (a stream in and out).
CHURN = """
import sys
from pathlib import Path
from timeslice.snapshot.device_room import DeviceRooms
room = DeviceRooms(Path(sys.argv[1])).room(sys.argv[2])
for _ in range(int(sys.argv[3])):
    room.take(10, timeout_s=60)
    room.give(10)
"""


def _holder(directory: Path, nbytes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), GROUP, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _bells(room: DeviceRoom) -> list[Path]:
    return list(room._bells.iterdir())


def test_a_restore_takes_room_only_once_another_process_gives_it(tmp_path: Path) -> None:
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(100)
    holder = _holder(tmp_path, 100)
    assert holder.stdin is not None and holder.stdout is not None
    took_at: list[float] = []
    taking = threading.Thread(target=lambda: took_at.append(room.take(50) and time.monotonic()))
    try:
        taking.start()
        wait_for(lambda: _bells(room), timeout=30, what="the take to wait on its doorbell")
        assert not took_at, "took room the device does not have"
        holder.stdin.write("60\n")
        holder.stdin.flush()
        gave_at = float(holder.stdout.readline())
        taking.join(timeout=30)
        assert took_at and took_at[0] >= gave_at
        status = room.status()
        assert status.used == 90 and status.peak <= 100
        assert not _bells(room), "a doorbell was left behind"
    finally:
        holder.kill()
        holder.wait()


def test_the_memory_of_a_process_that_died_is_free(tmp_path: Path) -> None:
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(100)
    holder = _holder(tmp_path, 80)
    holder.kill()
    holder.wait()
    assert room.status().used == 80  # its entry stays until someone needs the room
    room.take(60, timeout_s=30)
    assert room.status().used == 60


def test_a_take_that_cannot_fit_fails_with_who_holds_the_room(tmp_path: Path) -> None:
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(100)
    with pytest.raises(SnapshotError, match="cannot fit"):
        room.take(101)
    holder = _holder(tmp_path, 100)
    try:
        with pytest.raises(SnapshotError, match=f"processes \\['{holder.pid}:"):
            room.take(1, timeout_s=0.3)
    finally:
        holder.kill()
        holder.wait()


def test_rooms_of_one_directory_share_an_id_and_give_never_goes_below_zero(
    tmp_path: Path,
) -> None:
    assert DeviceRooms(tmp_path).id == DeviceRooms(tmp_path).id
    assert DeviceRooms(tmp_path).id != DeviceRooms(tmp_path / "other").id
    room = DeviceRooms(tmp_path).room(GROUP)
    room.take(10)  # no capacity known: nothing to wait for
    room.give(25)
    assert room.status().used == 0


def test_ringing_a_bell_whose_waiter_just_left_is_not_an_error(tmp_path: Path) -> None:
    """A give rings every waiter; one that took its room and closed its bell between the give's
    open and write must not fail the give (it failed a whole eviction once)."""
    fifo = tmp_path / "bell"
    os.mkfifo(fifo)
    waiter = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    ringer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(waiter)
    try:
        _Doorbell.knock(ringer)
    finally:
        os.close(ringer)
    _Doorbell.ring(fifo)  # nobody reads it now: the stale bell goes
    assert not fifo.exists()


def test_processes_taking_and_giving_at_once_never_overfill_the_room(tmp_path: Path) -> None:
    """Four processes stream chunks through a room with space for one more: every take waits
    its turn (doorbells made, rung and closed under one another's feet), none fails, and the
    room never held more than it has."""
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(20)
    room.hold(10)  # this process's state stays: the four share the room for one chunk
    procs = [
        subprocess.Popen([sys.executable, "-c", CHURN, str(tmp_path), GROUP, "80"])
        for _ in range(4)
    ]
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0, 0, 0]
    status = room.status()
    assert status.peak == 20 and status.used == 10
    room.give(10)
    assert room.status().used == 0
    assert not _bells(room)


def test_a_bell_being_made_is_never_taken_for_a_dead_waiters(tmp_path: Path) -> None:
    """A give that rings while a waiter has made its FIFO but not opened it yet must leave it
    be (it once removed it, and the waiter's open failed its restore)."""
    room = DeviceRooms(tmp_path).room(GROUP)
    making = room._bells / ".0-0-made-not-opened"
    os.mkfifo(making)
    room.give(0)  # rings every bell
    assert making.exists()


def _resident_peak(trace: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """The most bytes resident at once by the backends' own trace, and the trace."""
    events = []
    for line in trace.read_text().splitlines():
        at, pid, delta, _ = line.split()
        events.append((int(at), int(pid), int(delta)))
    events.sort(key=lambda e: (e[0], e[2]))  # a departure at the same instant first
    resident = peak = 0
    for _, _, delta in events:
        resident += delta
        peak = max(peak, resident)
    return peak, events


def _pair(tmp_path: Path, seconds: float) -> tuple[DeviceRoom, SimulatedBackend, SimulatedBackend]:
    size = 16 * 2**20
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(size)  # room for one of the two states
    trace = tmp_path / "trace"
    out, back = (
        SimulatedBackend(nbytes=size, snapshot_s=seconds, chunk_bytes=2**20, trace=trace)
        for _ in range(2)
    )
    return room, out, back


def test_an_eviction_and_a_restore_at_once_take_the_longer_not_the_sum(tmp_path: Path) -> None:
    seconds = 1.0
    room, out, back = _pair(tmp_path, seconds)
    out.hold_in(room)  # on the device: room full

    async def swap() -> float:
        await back.snapshot(SnapshotRequest("b"))  # out before this test's switch, no room
        started = time.monotonic()
        await asyncio.gather(
            out.snapshot(SnapshotRequest("a", GROUP, room=room)),
            back.restore(SnapshotRequest("b", GROUP, room=room)),
        )
        return time.monotonic() - started

    elapsed = asyncio.run(swap())
    peak, events = _resident_peak(tmp_path / "trace")
    assert peak <= 16 * 2**20, f"{peak} bytes resident at once, room for {16 * 2**20}"
    # The restore's chunks came in while the eviction's were still leaving ...
    last_out = max(at for at, _, delta in events if delta < 0)
    first_in = min(at for at, _, delta in events[1:] if delta > 0)
    assert first_in < last_out
    # ... so the two took about one move's time, not two (a loaded machine adds some).
    assert elapsed < 1.6 * seconds, f"{elapsed:.2f} s for two {seconds} s moves at once"
    assert room.status().used == 16 * 2**20


def test_two_evictions_at_once_share_one_direction(tmp_path: Path) -> None:
    seconds = 0.5
    room, first, second = _pair(tmp_path, seconds)
    room.set_capacity(None)
    first.hold_in(room)
    second.hold_in(room)

    async def both_out() -> float:
        started = time.monotonic()
        await asyncio.gather(
            first.snapshot(SnapshotRequest("a", GROUP, room=room)),
            second.snapshot(SnapshotRequest("b", GROUP, room=room)),
        )
        return time.monotonic() - started

    elapsed = asyncio.run(both_out())
    assert elapsed >= 0.95 * 2 * seconds, f"{elapsed:.2f} s: the link ran two copies one way"
    assert room.status().used == 0


def test_a_holder_that_exited_unreaped_holds_no_room(tmp_path: Path) -> None:
    """A job process that exits (its run ended) is a zombie until its parent reaps it, which
    may be long after; it holds no device memory, so its bytes are free at once (they were
    counted live, and the next job's restore waited out the room's time-out)."""
    room = DeviceRooms(tmp_path).room(GROUP)
    room.set_capacity(100)
    holder = _holder(tmp_path, 100)
    assert holder.stdin is not None
    try:
        holder.stdin.close()  # it exits; nobody reaps it until holder.wait() below

        def a_zombie() -> bool:
            stat = Path(f"/proc/{holder.pid}/stat").read_text()
            return stat[stat.rindex(")") + 2] == "Z"

        wait_for(a_zombie, timeout=30, what="the holder to exit")
        assert room.take(100, timeout_s=10) == 0.0  # its 100 bytes are free at once
        room.give(100)
    finally:
        holder.wait(timeout=30)


def test_a_simulated_restore_that_finds_no_room_stays_out_and_gives_back_what_it_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore whose third chunk finds no room fails: the two chunks it took go back to the
    room, and the state stays out, so the next restore moves it all (not 0 bytes)."""
    room = DeviceRooms(tmp_path).room("g")
    room.set_capacity(1000)
    room.hold(600)  # another state still on the device
    take = DeviceRoom.take
    monkeypatch.setattr(DeviceRoom, "take", lambda self, n: take(self, n, timeout_s=0.2))
    backend = SimulatedBackend(nbytes=1000, chunk_bytes=200)

    async def scenario() -> int:
        await backend.snapshot(SnapshotRequest("a", "g"))
        with pytest.raises(SnapshotError, match="no room"):
            await backend.restore(SnapshotRequest("a", "g", room=room))
        assert room.status().used == 600
        room.give(600)
        return (await backend.restore(SnapshotRequest("a", "g", room=room))).bytes

    assert asyncio.run(scenario()) == 1000
    assert room.status().used == 1000
