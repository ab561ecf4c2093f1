"""Where a job process's states live: on the device of one GPU group, or in host memory.

A job's sampler and trainer may run on different groups (disaggregated pools) while a workload
moves one state for both (the same weights). Then the state moves *with the lease*: before a
phase on group G, a state whose home is group H is moved out of H's device (and H is told, so
H never waits for this job to evict it) and brought to G's. Each group's residency stays true,
and the two groups stay independent: a group that evicts this job while the state is at home
elsewhere moves nothing and waits for nothing — it does not wait for this job's phase on the
other group to end (the cross-group serialisation a single lock per state caused).

Uses of a state (a phase, a checkpoint, a move) exclude each other; an eviction for group G
waits only while the state is in use *on G*.

A switch moves only what it must (docs/architecture.md, "Streamed switches"): a phase brings in
the states it uses before it starts, and the rest of the job's states on its group behind it
while it runs, only when its next phase follows there under the same lease; an eviction moves
the most recently used state out first (phases alternate, so the one used last is the one the
job's next phase here does not use). Every move of a streaming backend goes through the group's
device room on this node, so the next job's restore and this job's eviction run at once within
the group's declared memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import (
    SnapshotBackend,
    SnapshotRequest,
    StreamingBackend,
    on_host,
    streams,
)
from timeslice.snapshot.device_room import DeviceRoom, DeviceRooms

log = logging.getLogger("timeslice.job")


# (group id, what moved out, the error if the eviction failed)
class TellMoved(Protocol):
    """How a job's states tell a group they left its device (``LeaseSession.report_moved``)."""

    def __call__(
        self,
        group_id: str,
        evicted: list[SnapshotReport],
        error: str | None = None,
        *,
        with_next: bool = False,
    ) -> Awaitable[None]: ...


class StateHomes:
    def __init__(
        self, job_id: str, tell_moved: TellMoved, rooms: DeviceRooms | None = None
    ) -> None:
        """``rooms``: this node's device rooms, which streaming backends move through (None:
        every move goes as fast as it can, and the job's requests name no room)."""
        self.job_id = job_id
        self.backends: dict[str, SnapshotBackend] = {}
        self._tell_moved = tell_moved
        self._rooms = rooms
        # name -> when a phase last used it (a count): evictions move the latest first
        self._used_at: dict[str, int] = {}
        self._uses = itertools.count()
        # group id -> the restore running behind a phase there (the rest of the job's states)
        self._ahead: dict[str, asyncio.Task[list[SnapshotReport]]] = {}
        # group id -> what came in at a grant, before the phase it is for began (bring_early)
        self._early: dict[str, list[SnapshotReport]] = {}
        # backend name -> the group whose device holds its state; None: host memory
        self._home: dict[str, str | None] = {}
        # name -> uses in progress (a phase, a checkpoint, a move, an eviction in the background)
        self._busy: Counter[str] = Counter()
        # name -> the group a restore running now brings it to (its home is set only after)
        self._bringing: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        # group id -> the last report of a move off its device, still on its way
        self._reports: dict[str, asyncio.Task[None]] = {}

    def home(self, name: str) -> str | None:
        return self._home.get(name)

    def settle(self, backends: dict[str, SnapshotBackend], homes: dict[str, str | None]) -> None:
        """After the job's state was (re)built: which backends exist and where each lives
        (counted in its group's device room: it was built there)."""
        self.backends = backends
        self._home = {name: homes.get(name) for name in backends}
        for name, group_id in self._home.items():
            room = self._room_for(name, group_id)
            backend = backends[name]
            if room is not None and isinstance(backend, StreamingBackend):
                backend.hold_in(room)

    def room_id(self, names: list[str]) -> str | None:
        """The device rooms the named states move through, for the job's snapshot target: only
        if every one of them streams (else the group must wait for this job's evictions).

        Args:
            names: State names.

        Returns:
            The rooms' id, or None.
        """
        moved = [self.backends[n] for n in names if n in self.backends]
        if self._rooms is None or not moved or not all(streams(b) for b in moved):
            return None
        return self._rooms.id

    def on_host(self, names: list[str]) -> bool:
        """Whether every named state lives in host memory (``snapshot.base.on_host``): the job's
        snapshot target tells the group its evictions free no device memory.

        Args:
            names: State names.

        Returns:
            True only if there is one such state and all are.
        """
        moved = [self.backends[n] for n in names if n in self.backends]
        return bool(moved) and all(on_host(b) for b in moved)

    def set_memory(self, group_id: str, memory_bytes: int | None) -> None:
        """The group's declared memory, from its grant: what the room holds restores to."""
        if self._rooms is not None and memory_bytes is not None:
            self._rooms.room(group_id).set_capacity(memory_bytes)

    def _room_for(self, name: str, group_id: str | None) -> DeviceRoom | None:
        if self._rooms is None or group_id is None or not streams(self.backends[name]):
            return None
        return self._rooms.room(group_id)

    def _request(self, name: str, group_id: str, reason: str) -> SnapshotRequest:
        return SnapshotRequest(self.job_id, group_id, reason, room=self._room_for(name, group_id))

    @contextlib.asynccontextmanager
    async def using(
        self,
        names: list[str],
        group_id: str | None,
        *,
        first: list[str] | None = None,
        ahead: bool = False,
    ) -> AsyncIterator[list[SnapshotReport]]:
        """Exclusive use of the named states, on ``group_id``'s device (None: wherever they
        are, nothing moves). Yields what was restored before the work starts.

        ``first``: the states the work uses (default: all), brought in before it starts; with
        ``ahead``, the rest of ``names`` follow behind it while it runs (the job's next phase
        here uses them, under the same lease): :meth:`brought_ahead` has their reports. Without
        it they stay where they are, and move when a phase uses them."""
        wanted = {n for n in names if n in self.backends}
        async with self._changed:
            await self._changed.wait_for(lambda: not any(self._busy[n] for n in wanted))
            self._busy.update(wanted)
        behind: asyncio.Task[list[SnapshotReport]] | None = None
        try:
            needed = sorted(wanted if first is None else wanted & set(first))
            restored = [*self._early.pop(group_id or "", []), *await self._bring(needed, group_id)]
            for name in needed:
                self._used_at[name] = next(self._uses)
            rest = sorted(wanted - set(needed))
            if ahead and rest and group_id is not None:
                behind = asyncio.ensure_future(self._bring(rest, group_id))
                self._ahead[group_id] = behind
            yield restored
        finally:
            if behind is not None:  # nothing may move these states while it runs
                await asyncio.gather(behind, return_exceptions=True)
                if self._ahead.get(group_id or "") is behind:
                    del self._ahead[group_id or ""]
            await self._done_with(wanted)

    def bring_early(self, names: list[str], group_id: str) -> None:
        """Bring the named states to ``group_id``'s device now, in the background: the job was
        granted the group before the phase that uses them began (its lease was asked for ahead,
        and it is still off the GPU). The phase then finds them there, and reports them as its
        restores. States in use (an eviction still under way) are left for the phase to move.

        Args:
            names: The states the next phase there uses.
            group_id: The group granted.
        """
        wanted = {n for n in names if n in self.backends}
        if not wanted or any(self._busy[n] for n in wanted):
            return
        self._busy.update(wanted)  # before the phase can take them: it waits for this

        async def bring() -> None:
            try:
                reports = await self._bring(sorted(wanted), group_id)
                self._early.setdefault(group_id, []).extend(reports)
            except Exception as err:  # the phase moves them itself, or fails there
                # (a backend's own error too: torch's out of memory is a RuntimeError)
                log.warning("early restore of %s for %s failed: %s", self.job_id, group_id, err)
            finally:
                await self._done_with(wanted)

        self._spawn(bring())

    async def brought_ahead(self, group_id: str | None) -> list[SnapshotReport]:
        """Wait for the states a phase on ``group_id`` brings in behind it (``using``'s
        ``ahead``), and what they moved. A failed restore is left for the next phase that
        uses the state to do again (and to fail there, if it must).

        Args:
            group_id: The phase's group.

        Returns:
            Their reports (none if nothing was brought ahead, or it failed).
        """
        behind = self._ahead.get(group_id or "")
        if behind is None:
            return []
        try:
            return await asyncio.shield(behind)
        except Exception as err:  # torch's out of memory is a RuntimeError, not a SnapshotError
            # The phase's work is done: this state's next use restores it (or fails there).
            log.warning("bringing %s's next state to %s failed: %s", self.job_id, group_id, err)
            return []

    async def _done_with(self, names: set[str]) -> None:
        async with self._changed:
            self._busy.subtract(names)
            self._changed.notify_all()

    async def bring(self, placement: dict[str, str]) -> list[SnapshotReport]:
        """Move each named state to its group's device; the caller holds their use."""
        restored: list[SnapshotReport] = []
        for group_id in sorted(set(placement.values())):
            names = [n for n, g in placement.items() if g == group_id and n in self.backends]
            restored += await self._bring(names, group_id)
        return restored

    async def _bring(self, names: list[str], group_id: str | None) -> list[SnapshotReport]:
        restored: list[SnapshotReport] = []
        moved_out: dict[str, list[SnapshotReport]] = {}
        if group_id is None:
            return restored
        pending = self._reports.get(group_id)
        if pending is not None:
            # This group must hear that the state left before it sees it come back.
            await asyncio.gather(pending, return_exceptions=True)
        try:
            for name in names:
                home = self._home.get(name)
                if home == group_id:
                    continue
                backend = self.backends[name]
                if home is not None:  # on another group's device: take it from there first
                    request = self._request(name, home, f"move to {group_id}")
                    moved_out.setdefault(home, []).append(await backend.snapshot(request))
                    self._home[name] = None
                self._bringing[name] = group_id
                try:
                    request = self._request(name, group_id, f"restore for {group_id}")
                    restored.append(await backend.restore(request))
                    self._home[name] = group_id
                finally:
                    del self._bringing[name]
                    async with self._changed:
                        self._changed.notify_all()  # an eviction may wait for this restore
        finally:
            # Told even when a restore after them failed: the state left those devices.
            if moved_out:
                async with self._changed:
                    self._changed.notify_all()  # an eviction waiting for it has nothing to do
                for home, reports in moved_out.items():
                    self._reports[home] = self._spawn(self._tell_moved(home, reports, None))
        return restored

    async def evict_for(self, names: list[str], group_id: str) -> list[SnapshotReport]:
        """Move the named states out of ``group_id``'s device (what the group's snapshot
        activity asks). States at home elsewhere or in host memory move nothing; one on its
        way to this device (a restore at a grant that has since ended: an early restore, or
        one behind a phase) is moved out once it arrives, so the group never counts the job
        evicted while its state is still coming in. Those at home go first: the room they free
        may be what such a restore waits for."""
        wanted = [n for n in names if n in self.backends]
        reports: list[SnapshotReport] = []
        while True:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: all(self._home.get(n) != group_id or not self._busy[n] for n in wanted)
                )
                here = [n for n in wanted if self._home.get(n) == group_id]
                arriving = [n for n in wanted if self._bringing.get(n) == group_id]
                self._busy.update(here)
            try:
                reports += await self.move_out(here, group_id, f"evict for {group_id}")
            finally:
                await self._done_with(set(here))
            if not arriving:
                return reports
            async with self._changed:
                await self._changed.wait_for(
                    lambda names=tuple(arriving): all(
                        self._bringing.get(n) != group_id for n in names
                    )
                )

    async def move_out(self, names: list[str], group_id: str, reason: str) -> list[SnapshotReport]:
        """Snapshot the named states off ``group_id``'s device to host memory, the most
        recently used first (phases alternate, so it is the one the job's next phase here uses
        last, and the room it frees is what the next job's first phase takes); the caller holds
        their use."""
        reports = []
        for name in sorted(names, key=lambda n: -self._used_at.get(n, -1)):
            if self._home.get(name) is None:
                continue
            request = self._request(name, group_id, reason)
            reports.append(await self.backends[name].snapshot(request))
            self._home[name] = None
        return reports

    async def restore_for(self, names: list[str], group_id: str) -> list[SnapshotReport]:
        """Bring the named states to ``group_id``'s device (the group's restore activity)."""
        async with self.using(names, group_id) as restored:
            return restored

    def claim(self, names: list[str]) -> _Claim:
        """Keep the named states in use after the caller's own use ends (the caller holds
        them now), until the returned claim is done."""
        owned = {n for n in names if n in self.backends}
        self._busy.update(owned)
        return _Claim(self, owned)

    def evict_in_background(
        self, names: list[str], group_id: str, *, report_with_next: bool = False
    ) -> None:
        """Move out states the caller is using, after the caller is done, and report it to
        ``group_id`` (a release answered ``evict``; ``report_with_next``: the report goes with
        the job's next release there). The job's next step need not wait for the copy:
        whatever uses these states next waits for it instead."""
        owned = {n for n in names if n in self.backends}
        self._busy.update(owned)  # the caller's claim is still held: nobody slips in between

        async def evict() -> None:
            try:
                try:
                    evicted = await self.move_out(
                        sorted(owned), group_id, f"yield {group_id} (co-operative)"
                    )
                    error = None
                except Exception as err:  # the group faults us or evicts by its activity
                    log.warning("co-operative eviction of %s failed: %s", self.job_id, err)
                    evicted, error = [], str(err)
                # Reported before the state is free again: the group must hear of this
                # eviction before any later restore of the same state.
                await self._tell_moved(group_id, evicted, error, with_next=report_with_next)
            finally:
                await self._done_with(owned)

        self._spawn(evict())

    def leaving(self) -> None:
        """The process is about to exit with the states still on a device: they go with it (its
        device memory is freed at exit, and a device room takes their share back once it finds
        the process gone), so nothing is copied out for nobody. A backend that keeps its own
        record of what is on the device (``leaving(job_id)``: the simulated one's residency
        trace) is told they left."""
        for name, group_id in self._home.items():
            hook = getattr(self.backends[name], "leaving", None)
            if group_id is not None and callable(hook):
                hook(self.job_id)

    async def settled(self) -> None:
        """Wait for evictions running in the background (before the process exits)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        async def run() -> None:
            await coro

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class _Claim:
    def __init__(self, homes: StateHomes, names: set[str]) -> None:
        self._homes = homes
        self._names: set[str] | None = names

    async def done(self) -> None:
        names, self._names = self._names, None
        if names is not None:
            await self._homes._done_with(names)
