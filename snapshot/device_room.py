"""A GPU group's device memory on one node, shared by the job processes that move state onto it.

A switch between two jobs needs room on the device for the incoming job's next phase, not the
eviction of everything the holder has: with room for only one job's states, the holder's
eviction and the next job's restore can still run at once, chunk by chunk (PCIe is full
duplex), if the restore brings each chunk in only once the eviction has freed room for it. The
two moves run in two processes (each job's state lives in its own process), so they meet here:
a small ledger per group in a directory every process on the node shares (tmpfs), under a file
lock, that says how many bytes each process holds on the group's device and how many the group
declared. A restore *takes* room before each chunk comes in (waiting while there is none); an
eviction *gives* it back as each chunk leaves. So at no instant are more bytes resident than
the group declares, and an eviction's freed bytes reach the waiting restore within a wake-up,
without the group workflow in the loop (docs/architecture.md, "Streamed switches").

Wake-ups are event-driven: a waiter waits on a doorbell of its own (a FIFO in the room's
directory) that every ``give`` rings; it re-reads the ledger at least every
``RECHECK_S`` seconds, which is what notices a holder that died (its memory went with it, so
its entry is dropped: a process is named by PID and start time, so a reused PID never counts).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import select
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from timeslice.snapshot.base import SnapshotError

__all__ = ["ROOM_DIR_ENV", "DeviceRoom", "DeviceRooms", "RoomStatus", "room_directory"]

#: The directory the rooms of this node live in: every process that moves state onto a
#: group's device on this node must see the same one (the default is per user, on tmpfs).
ROOM_DIR_ENV = "TIMESLICE_ROOM_DIR"
#: A waiter re-reads the ledger at least this often, even when no doorbell rings: a holder
#: that died never rings, and its memory is free.
RECHECK_S = 0.25
#: How long a move waits for room before it fails (the holder's eviction never came).
DEFAULT_ROOM_WAIT_S = 120.0

Direction = Literal["out", "in"]


def room_directory() -> Path:
    """Where this node's rooms live: ``$TIMESLICE_ROOM_DIR``, else a per-user folder on
    ``/dev/shm`` (or the temporary directory where there is none).

    Returns:
        The directory (not created).
    """
    given = os.environ.get(ROOM_DIR_ENV)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    return base / f"timeslice-rooms-{os.getuid()}"


def _process_key() -> str:
    """This process, as ``pid:start time`` (clock ticks since boot), so a reused PID is
    never mistaken for it."""
    pid = os.getpid()
    return f"{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _alive(key: str) -> bool:
    """Whether the process ``pid:start time`` still runs. An exited process its parent has not
    reaped yet (a zombie) holds no device memory: it counts as gone."""
    pid_text, _, start = key.partition(":")
    try:
        pid = int(pid_text)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ValueError, OSError):
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and fields[19] == start


@dataclass(frozen=True)
class RoomStatus:
    """A room's ledger as read: the group's declared bytes (None: not known here yet), the
    bytes each live process holds on the device, and the most ever held at once."""

    capacity: int | None
    held: dict[str, int]
    peak: int

    @property
    def used(self) -> int:
        """The bytes held on the device now, by every process."""
        return sum(self.held.values())


class DeviceRooms:
    """This node's rooms: one per GPU group, in one directory.

    Args:
        directory: The shared directory (default: :func:`room_directory`).
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or room_directory()
        self._rooms: dict[str, DeviceRoom] = {}
        self._lock = threading.Lock()
        self._id: str | None = None

    @property
    def id(self) -> str:
        """The rooms' identity: processes that read the same one share the rooms (and so the
        devices' ledgers); the group streams a switch only between two jobs whose queues name
        the same one. Made once per directory."""
        if self._id is None:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = self.directory / "id"
            with contextlib.suppress(FileExistsError):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, uuid.uuid4().hex.encode())
                finally:
                    os.close(fd)
            text = ""
            for _ in range(100):  # another process may be between creating and writing it
                text = path.read_text().strip()
                if text:
                    break
                time.sleep(0.001)
            if not text:
                raise SnapshotError(f"{path} is empty: remove it and start the job again")
            self._id = text
        return self._id

    def room(self, group_id: str) -> DeviceRoom:
        """The room of ``group_id``'s device on this node (one object per group and process).

        Args:
            group_id: The GPU group.

        Returns:
            Its room.
        """
        with self._lock:
            room = self._rooms.get(group_id)
            if room is None:
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                room = self._rooms[group_id] = DeviceRoom(self.directory, group_id)
            return room


class DeviceRoom:
    """The ledger of one group's device on this node (module docstring).

    Args:
        directory: The node's rooms directory.
        group_id: The GPU group.
    """

    def __init__(self, directory: Path, group_id: str) -> None:
        self.group_id = group_id
        name = hashlib.sha256(group_id.encode()).hexdigest()[:32]
        self._path = directory / f"{name}.json"
        self._bells = directory / f"{name}.bells"
        self._bells.mkdir(exist_ok=True, mode=0o700)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        self._me = _process_key()
        # flock excludes other open files, not threads sharing this one.
        self._thread_lock = threading.Lock()
        self._links = {
            direction: (
                threading.Lock(),
                os.open(directory / f"{name}.{direction}.lock", os.O_RDWR | os.O_CREAT, 0o600),
            )
            for direction in ("out", "in")
        }

    # ------------------------------------------------------------ the ledger

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[dict[str, object]]:
        """The ledger, locked; written back when the block ends without an error."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 1 << 20, 0)
                data: dict[str, object] = json.loads(raw) if raw else {}
                data.setdefault("capacity", None)
                data.setdefault("held", {})
                data.setdefault("peak", 0)
                yield data
                encoded = json.dumps(data, sort_keys=True).encode()
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, encoded, 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @staticmethod
    def _held(data: dict[str, object]) -> dict[str, int]:
        held = data["held"]
        assert isinstance(held, dict)
        return held

    def status(self) -> RoomStatus:
        """The ledger as it is now.

        Returns:
            Capacity, bytes per live holder, peak.
        """
        with self._ledger() as data:
            capacity, peak = data["capacity"], data["peak"]
            assert capacity is None or isinstance(capacity, int)
            assert isinstance(peak, int)
            return RoomStatus(capacity, dict(self._held(data)), peak)

    def set_capacity(self, nbytes: int | None) -> None:
        """The group's declared device memory (from its grant): what every take is held to.

        Args:
            nbytes: Bytes; None leaves the room unbounded.
        """
        with self._ledger() as data:
            changed = data["capacity"] != nbytes
            data["capacity"] = nbytes
        if changed:
            self._ring()

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` this process already has on the device (state built there, not
        moved in): no wait, since the group granted the device for it.

        Args:
            nbytes: Bytes.
        """
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        with self._ledger() as data:
            held = self._held(data)
            held[self._me] = held.get(self._me, 0) + nbytes
            used = sum(held.values())
            peak = data["peak"]
            assert isinstance(peak, int)
            data["peak"] = max(peak, used)

    def take(self, nbytes: int, *, timeout_s: float = DEFAULT_ROOM_WAIT_S) -> float:
        """Wait until ``nbytes`` more fit in the group's declared memory, and count them as
        this process's.

        Args:
            nbytes: The bytes about to come onto the device.
            timeout_s: The longest wait.

        Returns:
            Seconds waited.

        Raises:
            SnapshotError: ``nbytes`` exceed the declared memory, or no room came in time (the
                message names who holds it).
        """
        started = time.monotonic()
        if self._try_take(nbytes):
            return 0.0
        bell = _Doorbell(self._bells)
        try:
            # Rung from here on: a give between this check and the wait is not missed.
            while not self._try_take(nbytes):
                left = timeout_s - (time.monotonic() - started)
                if left <= 0:
                    status = self.status()
                    raise SnapshotError(
                        f"no room for {nbytes} bytes on group {self.group_id!r}'s device after "
                        f"{timeout_s:.0f} s: {status.used} of {status.capacity} bytes held, by "
                        f"processes {sorted(status.held)} (pid:start time); the job holding "
                        "them did not evict its state"
                    )
                bell.wait(min(left, RECHECK_S))
        finally:
            bell.close()
        return time.monotonic() - started

    def _try_take(self, nbytes: int) -> bool:
        with self._ledger() as data:
            capacity = data["capacity"]
            assert capacity is None or isinstance(capacity, int)
            held = self._held(data)
            if capacity is not None:
                if nbytes > capacity:
                    raise SnapshotError(
                        f"{nbytes} bytes cannot fit on group {self.group_id!r}'s device, which "
                        f"declares {capacity}"
                    )
                if sum(held.values()) + nbytes > capacity:
                    # Memory of a process that is gone went with it.
                    for key in [k for k in held if k != self._me and not _alive(k)]:
                        del held[key]
                    if sum(held.values()) + nbytes > capacity:
                        return False
            held[self._me] = held.get(self._me, 0) + nbytes
            peak = data["peak"]
            assert isinstance(peak, int)
            data["peak"] = max(peak, sum(held.values()))
            return True

    def give(self, nbytes: int) -> None:
        """``nbytes`` of this process's left the device: room for whoever waits.

        Args:
            nbytes: Bytes freed.
        """
        with self._ledger() as data:
            held = self._held(data)
            left = max(0, held.get(self._me, 0) - nbytes)
            if left:
                held[self._me] = left
            else:
                held.pop(self._me, None)
        self._ring()

    def _ring(self) -> None:
        for bell in self._bells.iterdir():
            if not bell.name.startswith("."):  # one being made is not waited on yet
                _Doorbell.ring(bell)

    # ------------------------------------------------------------ the copy engines

    @contextlib.contextmanager
    def link(self, direction: Direction) -> Iterator[bool]:
        """Exclusive use of one direction of the device's host link while a chunk copies:
        two copies the same way share it (their times add up), a copy out and a copy in do not
        (the link is full duplex). The simulated backend's model of PCIe; real copies need not
        ask, the hardware does this.

        Args:
            direction: ``out`` (device to host) or ``in``.

        Yields:
            Whether it had to wait for another copy the same way.
        """
        lock, fd = self._links[direction]
        waited = not lock.acquire(blocking=False)
        if waited:
            lock.acquire()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield waited
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            lock.release()


class _Doorbell:
    """A FIFO one waiting thread sleeps on; ``ring`` wakes it (a byte written, never blocking)."""

    def __init__(self, directory: Path) -> None:
        name = f"{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:8]}"
        self.path = directory / name
        # Made under a hidden name and opened before it takes its own: a ringer takes a bell
        # with no reader for one whose waiter died, and would remove one not yet opened.
        making = directory / f".{name}"
        os.mkfifo(making, 0o600)
        # Read-write: the FIFO always has a writer, so it never reads as hung up (EOF) and
        # select wakes only when a byte comes.
        self._fd = os.open(making, os.O_RDWR | os.O_NONBLOCK)
        os.rename(making, self.path)

    def wait(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if readable:
            with contextlib.suppress(BlockingIOError):
                os.read(self._fd, 4096)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # first: a visible bell always has its reader
        os.close(self._fd)

    @staticmethod
    def ring(path: Path) -> None:
        """Wake the bell's waiter; never fails (a waiter that is gone needs no waking)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as err:
            if err.errno == errno.ENXIO:  # nobody reads it: its waiter died
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return  # or it was just closed and removed (ENOENT)
        try:
            _Doorbell.knock(fd)
        finally:
            os.close(fd)

    @staticmethod
    def knock(fd: int) -> None:
        """Write the byte that wakes the waiter, on a bell opened for writing."""
        try:
            os.write(fd, b"!")
        except BlockingIOError:
            pass  # full: it is rung already
        except BrokenPipeError:
            pass  # its waiter closed it between the open and this write: it is awake
