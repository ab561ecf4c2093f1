"""Whose state is on the GPU group's device, whose was evicted, and what a switch must move.

One of :class:`~timeslice.workflows.group_book.GroupBook`'s pieces: it keeps the residency part
of the group's ``GroupState`` (``resident``, ``evicting``, ``evicted_jobs``, ``faulted_jobs``).
Residency is sticky: a job's state stays on the device after its lease until another job
needs the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from timeslice.protocol.group import (
    EVICTED_JOBS_KEEP,
    FAULTED_JOBS_KEEP,
    MAX_FAULT_BYTES,
    STAGE_MIN_RESTORE_S,
    AcquireRequest,
    ResidentJob,
    cut_to_encoded,
    lease_key_hash,
)
from timeslice.workflows.book_piece import BookPiece

__all__ = ["Residency", "SwitchDone", "SwitchPlan"]


@dataclass(frozen=True)
class SwitchPlan:
    """What granting ``request`` moves: the resident job out, the new holder's state in."""

    fault: str | None = None
    evict: ResidentJob | None = None
    restore: bool = False
    restores_itself: bool = False
    # The resident's eviction runs beside the grant (both states fit in the group's declared
    # memory, or the switch streams): nobody waits for it, and a later request that does not
    # fit beside it (and does not stream) does.
    overlapped: bool = False
    # The grant does not wait for an eviction although the device cannot hold both jobs'
    # states: the next job's restore takes room on the node as the eviction frees it.
    streamed: bool = False

    @property
    def moves(self) -> bool:
        """Something moves before the grant (an overlapped eviction does not hold it up)."""
        return (self.evict is not None and not self.overlapped) or self.restore


@dataclass(frozen=True)
class SwitchDone:
    """A switch that ran, for the book to count: its plan (with its ``fault`` if the restore
    failed), the request it was for, when it started and ended, the bytes moved meanwhile, and
    a previous holder whose own eviction it waited for."""

    plan: SwitchPlan
    request: AcquireRequest
    started: datetime
    ended: datetime
    moved_bytes: int
    waited_for: ResidentJob | None


def _always() -> bool:
    """A gate outside a workflow (unit tests, the planner): every decision is the new one.

    Returns:
        True.
    """
    return True


@dataclass(eq=False)
class Residency(BookPiece):
    """The group's device: the resident job, an eviction under way, saved and faulted jobs."""

    # Asked before a switch streams (a decision that differs from waiting for the eviction):
    # the workflow answers with workflow.patched, so groups that started before streamed
    # switches replay as they ran.
    stream_gate: Callable[[], bool] = field(default=_always, repr=False)
    # Whether an eviction still under way stays on the books when another holder's own
    # eviction begins (``unconfirmed_evictions``): the workflow answers with workflow.patched(
    # UNCONFIRMED_EVICTIONS_KEPT) when its run starts, so older groups replay as they ran.
    keeps_unconfirmed: bool = field(default=True, repr=False)

    def is_resident(self, job_id: str) -> bool:
        """Whether the job's state is on the device (and no eviction of it is under way).

        Args:
            job_id: the job.

        Returns:
            True if it is the resident job.
        """
        resident = self.state.resident
        return resident is not None and resident.job_id == job_id

    def knows(self, job_id: str) -> bool:
        """Whether the group keeps track of the job's state: resident, evicting, evicted or
        faulted.

        Args:
            job_id: the job.

        Returns:
            True if it does.
        """
        state = self.state
        return (
            job_id in state.evicted_jobs
            or job_id in state.faulted_jobs
            or self.is_resident(job_id)
            or self.is_staged(job_id)
            or (state.evicting is not None and state.evicting.job_id == job_id)
            or any(r.job_id == job_id for r in state.unconfirmed_evictions)
        )

    def is_staged(self, job_id: str) -> bool:
        """Whether the job's state was brought onto the device (or is on its way) ahead of its
        grant, while another job holds the group.

        Args:
            job_id: the job.

        Returns:
            True if it is the staged job.
        """
        staged = self.state.staged
        return staged is not None and staged.job_id == job_id

    def tracked_jobs(self) -> set[str]:
        """The jobs whose state the group keeps track of (the holder's aside).

        Returns:
            Resident, evicting, evicted and faulted jobs.
        """
        state = self.state
        jobs = set(state.evicted_jobs) | set(state.faulted_jobs)
        for resident in (state.resident, state.evicting, state.staged):
            if resident is not None:
                jobs.add(resident.job_id)
        jobs.update(r.job_id for r in state.unconfirmed_evictions)
        return jobs

    # ------------------------------------------------------------------ planning a switch

    def both_fit(self, resident: ResidentJob | None, request: AcquireRequest) -> bool:
        """Whether ``resident``'s and ``request``'s declared states fit in the group's declared
        memory together (then an eviction and a restore may overlap).

        Args:
            resident: the job on the device (or on its way out).
            request: the request to be granted.

        Returns:
            True only if the group, the resident and the request all declared their bytes and
            they fit.
        """
        memory = self.config.memory_bytes
        return (
            memory is not None
            and resident is not None
            and resident.state_bytes is not None
            and request.state_bytes is not None
            and resident.state_bytes + request.state_bytes <= memory
        )

    def room_of(self, request: AcquireRequest) -> str | None:
        """The device room every queue of the request's snapshot target moves through.

        Args:
            request: A request.

        Returns:
            The room's id, or None if it names none or more than one.
        """
        target = request.snapshot
        rooms = {q.room for q in target.queues} if target is not None else set()
        return rooms.pop() if len(rooms) == 1 else None

    def streams(self, resident: ResidentJob | None, request: AcquireRequest) -> bool:
        """Whether ``resident``'s eviction and ``request``'s restore may run at once although
        the device does not hold both: every queue of both jobs moves through one device room
        (``snapshot/device_room.py``: the restore takes room chunk by chunk as the eviction
        frees it, never past the group's declared memory), and the request's state fits in
        that memory alone.

        Args:
            resident: the job on the device (or on its way out).
            request: the request to be granted.

        Returns:
            True if so (only for groups that started with streamed switches or after).
        """
        memory = self.config.memory_bytes
        room = self.room_of(request)
        if (
            memory is None
            or room is None
            or resident is None
            or resident.snapshot is None
            or request.state_bytes is None
            or request.state_bytes > memory
            or {q.room for q in resident.snapshot.queues} != {room}
        ):
            return False
        return self.stream_gate()

    def overlaps(self, resident: ResidentJob | None, request: AcquireRequest) -> bool:
        """Whether ``resident``'s eviction may run beside ``request``'s grant and restore:
        both states fit, the switch streams, or both live in host memory.

        Args:
            resident: the job on the device (or on its way out).
            request: the request to be granted.

        Returns:
            True if nobody need wait for the eviction.
        """
        return (
            self.both_fit(resident, request)
            or self.streams(resident, request)
            or self.both_on_host(resident, request)
        )

    @staticmethod
    def both_on_host(resident: ResidentJob | None, request: AcquireRequest) -> bool:
        """Whether every queue of both jobs says its states live in host memory (torch on the
        CPU): no device memory is freed or taken, so nothing need wait for the eviction.

        Args:
            resident: the job on the device (or on its way out).
            request: the request to be granted.

        Returns:
            True only if both named their queues and every one says ``on_host``.
        """
        targets = (resident.snapshot if resident is not None else None, request.snapshot)
        return all(t is not None and all(q.on_host for q in t.queues) for t in targets)

    def note_restore_time(self, job_id: str, seconds: float) -> None:
        """The job restored its own state here in ``seconds``: what staging its next restore
        would take off the critical path.

        Args:
            job_id: the job.
            seconds: its restore's time, all its states.
        """
        times = self.state.restore_s
        times.pop(job_id, None)  # most recent last
        times[job_id] = seconds
        while len(times) > EVICTED_JOBS_KEEP:
            del times[next(iter(times))]

    def may_stage(self, request: AcquireRequest | None, holder_job: str | None) -> bool:
        """Whether to bring ``request``'s state onto the device now, while ``holder_job`` works:
        the group declared its memory, the request's job restores itself at its grant (an RL
        job), the group evicted it, its last own restore here took long enough to repay the
        activity (``STAGE_MIN_RESTORE_S``), and its state fits beside everything still on the
        device (the resident, an eviction under way). Its grant then moves nothing.

        Args:
            request: the waiter the group serves next (None: nobody waits).
            holder_job: the job holding the group (None: it is free, and grants at once).

        Returns:
            True if the restore may start now.
        """
        state = self.state
        memory = self.config.memory_bytes
        if (
            memory is None
            or request is None
            or holder_job is None
            or state.staged is not None
            or state.unconfirmed_evictions
            or request.job_id == holder_job
            or not request.restores_itself
            or request.state_bytes is None
            or request.snapshot is None
            or not request.snapshot.queues
            or all(q.on_host for q in request.snapshot.queues)
            or request.job_id not in state.evicted_jobs
            or request.job_id in state.faulted_jobs
            or state.restore_s.get(request.job_id, 0.0) < STAGE_MIN_RESTORE_S
        ):
            return False
        evicting = state.evicting
        if evicting is not None and evicting.job_id == request.job_id:
            if not state.evicting_report_later:
                return False  # its report comes soon: stage it once the group has heard it
            # Its own eviction, reported only with its next release: its process restores
            # after that eviction is done, and the same bytes count once.
            evicting = None
        on_device = [r for r in (state.resident, evicting) if r is not None]
        if any(r.state_bytes is None for r in on_device):
            return False
        return sum(r.state_bytes or 0 for r in on_device) + request.state_bytes <= memory

    def could_stage_another(self, besides: set[str]) -> bool:
        """Whether a job not in ``besides`` may be staged here once it waits: the group
        declared its memory, evicted that job, and its own last restore here took long enough
        (the conditions of ``may_stage`` that outlast a lease).

        Args:
            besides: the jobs not to count (the releasing holder and the next one).

        Returns:
            True if such a job is known here.
        """
        state = self.state
        if self.config.memory_bytes is None:
            return False
        return any(
            job_id not in besides
            and job_id not in state.faulted_jobs
            and state.restore_s.get(job_id, 0.0) >= STAGE_MIN_RESTORE_S
            for job_id in state.evicted_jobs
        )

    def stage(self, request: AcquireRequest) -> None:
        """The group starts bringing ``request``'s state onto the device ahead of its grant
        (:meth:`may_stage` said it fits): from now on its bytes count as on the device.

        Args:
            request: the waiter the group serves next.
        """
        self.state.staged = ResidentJob(
            job_id=request.job_id, snapshot=request.snapshot, state_bytes=request.state_bytes
        )
        self.state.staged_ready = False

    def staged_in(self, job_id: str) -> None:
        """The staged job's state is on the device: its grant restores nothing (or, granted
        while the restore ran, its phase found nothing left to restore).

        Args:
            job_id: the staged job.
        """
        if self.is_staged(job_id):
            self.state.staged_ready = True
        self.state.stats.staged_restores += 1
        self.restored(job_id)

    def drop_staged(self, job_id: str | None = None) -> None:
        """Nothing is staged any more (of ``job_id``, if given): granted, forgotten, faulted.

        Args:
            job_id: the job whose staged state is no longer tracked; None for whichever.
        """
        staged = self.state.staged
        if staged is not None and (job_id is None or staged.job_id == job_id):
            self.state.staged = None
            self.state.staged_ready = False

    def staged_left(self, job_id: str) -> None:
        """The staged state was taken off the device again unused (another job was granted
        first and needed the room).

        Args:
            job_id: the staged job.
        """
        if self.is_staged(job_id):
            self.drop_staged(job_id)
            self.state.stats.staged_unused += 1
            self.evicted(job_id)

    def memory_for(self, request: AcquireRequest) -> int | None:
        """What a grant tells ``request`` of the group's memory: the declared bytes if its
        target names a device room (the room holds its restores to them), else nothing.

        Args:
            request: The request granted.

        Returns:
            Bytes, or None.
        """
        return self.config.memory_bytes if self.room_of(request) is not None else None

    def eviction_to_await(self, request: AcquireRequest) -> ResidentJob | None:
        """A previous holder still moving its state out, that ``request`` must wait for.

        Args:
            request: the request about to be granted.

        Returns:
            The job whose eviction report to wait for, or None (none under way, or both fit).
        """
        evicting = self.state.evicting
        if evicting is None:
            return None
        if evicting.job_id == request.job_id:
            return evicting  # its own state is still on its way out: restore after
        if self.overlaps(evicting, request):
            return None
        return evicting

    def plan_switch(self, request: AcquireRequest) -> SwitchPlan:
        """What granting ``request`` moves (sticky residency: nothing if it is resident). An
        eviction that may overlap the grant is counted as under way from here.

        Args:
            request: the request about to be granted.

        Returns:
            The plan; its ``fault`` is set if the request's job is faulted (no grant).
        """
        state = self.state
        resident = state.resident
        if resident is not None and resident.job_id == request.job_id:
            if request.snapshot is not None:
                resident.snapshot = request.snapshot
            return SwitchPlan()
        if request.job_id in state.faulted_jobs:
            return SwitchPlan(fault=state.faulted_jobs[request.job_id])
        evict = resident if resident is not None and resident.snapshot is not None else None
        restore = request.snapshot is not None and request.job_id in state.evicted_jobs
        restores_itself = restore and request.restores_itself
        if restores_itself:
            # Granted at once; the holder restores its own state before it uses the group.
            state.evicted_jobs.remove(request.job_id)
            restore = False
        overlapped = evict is not None and state.evicting is None and self.overlaps(evict, request)
        # Streamed: beside the resident's eviction here, or a holder's own still under way.
        beside = evict if overlapped else state.evicting
        streamed = (
            beside is not None
            and beside.job_id != request.job_id
            and not self.both_fit(beside, request)
            and self.streams(beside, request)
        )
        if overlapped:
            assert evict is not None
            state.evicting = evict
            state.evicting_key_hash = None  # the group's own activity evicts it
            state.evicting_report_later = False
            state.resident = None
            self.note_evicted(evict.job_id)
        return SwitchPlan(
            evict=evict,
            restore=restore,
            restores_itself=restores_itself,
            overlapped=overlapped,
            streamed=streamed,
        )

    def settle(self, request: AcquireRequest, fault: str | None) -> None:
        """The switch for ``request`` is over: its job is resident, unless its restore failed.

        Args:
            request: the request granted.
            fault: why its restore failed, or None.
        """
        if fault is None:
            self.state.resident = ResidentJob(
                job_id=request.job_id, snapshot=request.snapshot, state_bytes=request.state_bytes
            )
        else:
            self.state.resident = None
        self.drop_staged(request.job_id)

    # ------------------------------------------------------------------ moves

    def evicts_itself(self, job_id: str, key_hash: str, *, report_later: bool = False) -> None:
        """The resident holder, released, moves its own state out from now on; until its report
        comes, only a job whose state fits beside it may be restored.

        Args:
            job_id: the releasing holder's job (the resident).
            key_hash: its lease's key hash: only that lease's report of a failure counts.
            report_later: its report comes with its next release here (only a failure's at
                once): a switch that needs the room asks its process instead of waiting.
        """
        state = self.state
        state.stats.evictions += 1
        previous = state.evicting
        if self.keeps_unconfirmed and previous is not None and previous.job_id != job_id:
            # Its report (or the group's own activity) has not come back: it may still be on
            # the device, so it stays counted until confirmed (``take_unconfirmed``).
            state.unconfirmed_evictions = [
                *(r for r in state.unconfirmed_evictions if r.job_id != previous.job_id),
                previous,
            ][-EVICTED_JOBS_KEEP:]
        state.evicting = state.resident
        state.evicting_key_hash = key_hash
        state.evicting_report_later = report_later
        state.resident = None
        self.note_evicted(job_id)

    def left_device(self, job_id: str) -> None:
        """The job's state left the device by the job's own doing: if it was resident, it is
        evicted now.

        Args:
            job_id: the job.
        """
        if self.is_resident(job_id):
            self.evicted(job_id)
            self.state.resident = None
        elif self.is_staged(job_id):
            self.drop_staged(job_id)
            self.evicted(job_id)

    def evicted(self, job_id: str, *, preempted: bool = False) -> None:
        """The job's state left the device.

        Args:
            job_id: the job.
            preempted: the group evicted a job whose lease ran out without it yielding
                (``ResidentJob.lease_expired``).
        """
        self.state.stats.evictions += 1
        if preempted:
            self.state.stats.preemptions += 1
        self.note_evicted(job_id)

    def note_evicted(self, job_id: str) -> None:
        """The job's state is saved off the device: restore it when the job is granted next.
        Past ``EVICTED_JOBS_KEEP`` the oldest is forgotten: its next grant restores nothing (a
        job process restores in-process state itself before using it).

        Args:
            job_id: the job.
        """
        evicted = self.state.evicted_jobs
        if job_id not in evicted:
            evicted.append(job_id)
        while len(evicted) > EVICTED_JOBS_KEEP:
            del evicted[0]
            self.state.stats.forgotten_jobs += 1

    def clear_evicting(self, job_id: str | None = None) -> None:
        """No eviction (of ``job_id``, if given) is under way any more.

        Args:
            job_id: the job whose eviction ended; None for whichever.
        """
        state = self.state
        if state.evicting is not None and (job_id is None or state.evicting.job_id == job_id):
            state.evicting = None
            state.evicting_key_hash = None
            state.evicting_report_later = False
        if job_id is not None and state.unconfirmed_evictions:
            state.unconfirmed_evictions = [
                r for r in state.unconfirmed_evictions if r.job_id != job_id
            ]

    def take_unconfirmed(self, request: AcquireRequest) -> list[ResidentJob]:
        """The evictions still unconfirmed that must be confirmed (by the group's snapshot
        activity, which waits for an eviction under way and finds nothing left to move) before
        ``request`` is granted; the group stops counting all of them from here.

        Not the request's own job's (its process restores only after its own eviction is
        done), not one the group cannot reach (no snapshot target), and not one whose states
        and the request's all live in host memory (no device memory is at stake).

        Args:
            request: the request about to be granted.

        Returns:
            The jobs to confirm, oldest first.
        """
        state = self.state
        pending, state.unconfirmed_evictions = state.unconfirmed_evictions, []
        return [
            r
            for r in pending
            if r.job_id != request.job_id
            and r.snapshot is not None
            and not self.both_on_host(r, request)
        ]

    def asked_to_evict(self, job_id: str, key: str) -> bool:
        """Whether the lease under ``key`` was answered ``evict`` and its eviction is still
        awaited.

        Args:
            job_id: the job reporting.
            key: the lease key its report presents.

        Returns:
            True if so: only then does its report of a failure fault the job.
        """
        state = self.state
        return (
            state.evicting is not None
            and state.evicting.job_id == job_id
            and state.evicting_key_hash is not None
            and state.evicting_key_hash == lease_key_hash(key)
        )

    def restored(self, job_id: str) -> None:
        """The group restored the job's state onto the device.

        Args:
            job_id: the job.
        """
        self.state.stats.restores += 1
        if job_id in self.state.evicted_jobs:
            self.state.evicted_jobs.remove(job_id)

    def unsaved(self, job_id: str) -> None:
        """The job's saved state is not to be restored (its move failed: it is unknown).

        Args:
            job_id: the job.
        """
        if job_id in self.state.evicted_jobs:
            self.state.evicted_jobs.remove(job_id)

    # ------------------------------------------------------------------ faults and departures

    def fault(self, job_id: str, message: str) -> str:
        """Mark the job faulted (its state is unknown): its requests are refused with this text.
        The text quotes others' errors, so it is cut to ``MAX_FAULT_BYTES``; past
        ``FAULTED_JOBS_KEEP`` faults the oldest is forgotten.

        Args:
            job_id: the job.
            message: what went wrong.

        Returns:
            The fault's text (the first one's, if the job was faulted already).
        """
        faults = self.state.faulted_jobs
        text = faults.setdefault(
            job_id, cut_to_encoded(f"job {job_id}: {message}", MAX_FAULT_BYTES)
        )
        while len(faults) > FAULTED_JOBS_KEEP:
            del faults[next(iter(faults))]
            self.state.stats.forgotten_jobs += 1
        return text

    def move_failed(self, job_id: str, message: str) -> None:
        """An eviction or restore the group ran failed: the job is faulted, its state unknown.

        Args:
            job_id: the job.
            message: what failed, and why.
        """
        self.fault(job_id, message)
        self.state.stats.snapshot_failures += 1
        self.unsaved(job_id)
        self.drop_staged(job_id)

    def forget(self, job_id: str) -> None:
        """The job's processes are gone: drop its residency, saved state and faults (its key
        is the lease ledger's to drop).

        Args:
            job_id: the job.
        """
        state = self.state
        if self.is_resident(job_id):
            state.resident = None
        if job_id in state.evicted_jobs:
            state.evicted_jobs.remove(job_id)
        self.clear_evicting(job_id)
        self.drop_staged(job_id)
        state.restore_s.pop(job_id, None)
        state.faulted_jobs.pop(job_id, None)
        state.stats.departed += 1
