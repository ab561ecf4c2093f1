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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import SnapshotBackend, SnapshotError, SnapshotRequest

log = logging.getLogger("timeslice.job")

# (group id, what moved out, the error if the eviction failed)
TellMoved = Callable[[str, list[SnapshotReport], str | None], Awaitable[None]]


class StateHomes:
    def __init__(self, job_id: str, tell_moved: TellMoved) -> None:
        self.job_id = job_id
        self.backends: dict[str, SnapshotBackend] = {}
        self._tell_moved = tell_moved
        # backend name -> the group whose device holds its state; None: host memory
        self._home: dict[str, str | None] = {}
        # name -> uses in progress (a phase, a checkpoint, a move, an eviction in the background)
        self._busy: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        # group id -> the last report of a move off its device, still on its way
        self._reports: dict[str, asyncio.Task[None]] = {}

    def home(self, name: str) -> str | None:
        return self._home.get(name)

    def settle(self, backends: dict[str, SnapshotBackend], homes: dict[str, str | None]) -> None:
        """After the job's state was (re)built: which backends exist and where each lives."""
        self.backends = backends
        self._home = {name: homes.get(name) for name in backends}

    @contextlib.asynccontextmanager
    async def using(
        self, names: list[str], group_id: str | None
    ) -> AsyncIterator[list[SnapshotReport]]:
        """Exclusive use of the named states, on ``group_id``'s device (moved there first;
        None: wherever they are, nothing moves). Yields what was restored."""
        wanted = {n for n in names if n in self.backends}
        async with self._changed:
            await self._changed.wait_for(lambda: not any(self._busy[n] for n in wanted))
            self._busy.update(wanted)
        try:
            restored = await self._bring(sorted(wanted), group_id)
            yield restored
        finally:
            await self._done_with(wanted)

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
        for name in names:
            home = self._home.get(name)
            if home == group_id:
                continue
            backend = self.backends[name]
            if home is not None:  # on another group's device: take it from there first
                report = await backend.snapshot(
                    SnapshotRequest(self.job_id, home, f"move to {group_id}")
                )
                moved_out.setdefault(home, []).append(report)
                self._home[name] = None
            restored.append(
                await backend.restore(
                    SnapshotRequest(self.job_id, group_id, f"restore for {group_id}")
                )
            )
            self._home[name] = group_id
        if moved_out:
            async with self._changed:
                self._changed.notify_all()  # an eviction waiting for this state has nothing to do
            for home, reports in moved_out.items():
                self._reports[home] = self._spawn(self._tell_moved(home, reports, None))
        return restored

    async def evict_for(self, names: list[str], group_id: str) -> list[SnapshotReport]:
        """Move the named states out of ``group_id``'s device (what the group's snapshot
        activity asks). States at home elsewhere or in host memory move nothing."""
        wanted = [n for n in names if n in self.backends]
        async with self._changed:
            await self._changed.wait_for(
                lambda: all(self._home.get(n) != group_id or not self._busy[n] for n in wanted)
            )
            here = [n for n in wanted if self._home.get(n) == group_id]
            self._busy.update(here)
        try:
            return await self.move_out(here, group_id, f"evict for {group_id}")
        finally:
            await self._done_with(set(here))

    async def move_out(self, names: list[str], group_id: str, reason: str) -> list[SnapshotReport]:
        """Snapshot the named states off ``group_id``'s device to host memory; the caller holds
        their use."""
        reports = []
        request = SnapshotRequest(self.job_id, group_id, reason)
        for name in names:
            if self._home.get(name) is None:
                continue
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

    def evict_in_background(self, names: list[str], group_id: str) -> None:
        """Move out states the caller is using, after the caller is done, and report it to
        ``group_id`` (a release answered ``evict``). The job's next step need not wait for
        the copy: whatever uses these states next waits for it instead."""
        owned = {n for n in names if n in self.backends}
        self._busy.update(owned)  # the caller's claim is still held: nobody slips in between

        async def evict() -> None:
            try:
                try:
                    evicted = await self.move_out(
                        sorted(owned), group_id, f"yield {group_id} (co-operative)"
                    )
                    error = None
                except SnapshotError as err:  # the group faults us or evicts by its activity
                    log.warning("co-operative eviction of %s failed: %s", self.job_id, err)
                    evicted, error = [], str(err)
                # Reported before the state is free again: the group must hear of this
                # eviction before any later restore of the same state.
                await self._tell_moved(group_id, evicted, error)
            finally:
                await self._done_with(owned)

        self._spawn(evict())

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
