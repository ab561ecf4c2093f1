"""A GPU group's switch: the moves its book's switch plan asks for, run on the jobs' queues.

``GpuGroupWorkflow`` calls :meth:`GroupSwitch.switch_to` before each grant. It waits for a
previous holder's report of its own eviction (or evicts it with the group's own activity when
the report does not come), evicts the resident job (beside the grant when both states fit, or
when the two jobs' moves stream through one device room on their node), restores the next one,
and tells the book what happened (``workflows/group_book.py``): the book decides, this runs the
activities.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from temporalio import workflow
from timeslice.protocol.group import (
    RESTORE_ACTIVITY,
    SNAPSHOT_ACTIVITY,
    AcquireRequest,
    GroupConfig,
    ResidentJob,
    SnapshotTarget,
    is_node_queue,
)
from timeslice.workflows.group_book import GroupBook, SwitchDone, SwitchPlan
from timeslice.workflows.group_patches import (
    BOUNDED_EVICTION_REPORT_WAIT,
    FORGET_GONE_EVICTOR,
    STAGED_RESTORES,
)
from timeslice.workflows.snapshot_calls import process_gone, run_on_queues

__all__ = ["GroupSwitch"]


class _Moved(Enum):
    OK = "ok"
    GONE = "gone"  # no process picked the task up: the job's processes are gone
    FAILED = "failed"


class GroupSwitch:
    """Runs one group's switches (one at a time, from the workflow's main loop); evictions that
    overlap a grant run on as tasks of their own (``evictions``)."""

    def __init__(
        self,
        book: GroupBook,
        config: GroupConfig,
        *,
        wake: Callable[[], None],
        one_timer: Callable[[], bool],
        set_timer: Callable[[], None],
        patched: Callable[[str], bool],
    ) -> None:
        """``wake``: wakes the workflow's main loop; ``one_timer``: whether the run keeps one
        deadline timer (``ONE_DEADLINE_TIMER``); ``set_timer``: sets it for the earliest
        deadline (this one's ``report_deadline`` among them); ``patched``: whether the run
        takes a patch's branch (the workflow's answer, ``workflow.patched`` or all of them)."""
        self._book = book
        self._config = config
        self._wake = wake
        self._one_timer = one_timer
        self._set_timer = set_timer
        self._patched = patched
        # Evictions running beside the holder's lease (both states fit, or they stream).
        self.evictions: set[asyncio.Task[None]] = set()
        # A switch waiting for the previous holder's report of its own eviction: the report's
        # bytes belong to that switch's mark on the timeline.
        self.awaiting_eviction_of: str | None = None
        # With ONE_DEADLINE_TIMER: when that wait gives up.
        self.report_deadline: datetime | None = None
        # The restore of the next waiter's state, running while the holder works.
        self.staging: asyncio.Task[None] | None = None
        # A node agent's queue is waited for as long as a move may take, and its not taking a
        # move faults the job rather than reading as the job's processes gone: the workflow
        # sets it from workflow.patched(AGENT_QUEUES_WAITED_FOR) when its run starts.
        self.agents_waited_for = True

    async def switch_to(self, request: AcquireRequest) -> str | None:
        """Evict the resident job if another job takes the group, then restore the new one
        (both at once when the group's memory holds both, or when they stream), and count the
        switch.

        Args:
            request: the request about to be granted (taken off the queue).

        Returns:
            A fault message if the new holder's state could not be restored (or its job is
            faulted); None if it may be granted.
        """
        book = self._book
        started = workflow.now()
        bytes_before = book.state.stats.bytes_moved
        await self._settle_staged(request)
        for unconfirmed in book.residency.take_unconfirmed(request):
            await self._evict_late(unconfirmed)
        waited_for = await self._await_own_eviction(request)
        plan = book.residency.plan_switch(request)
        if plan.fault is not None:
            return plan.fault
        fault: str | None = None
        if plan.overlapped:
            self._evict_beside(plan)
        elif plan.evict is not None:
            await self._evict(plan)
        if plan.restore:
            fault = await self._restore(request)
        book.finish_switch(
            SwitchDone(
                dataclasses.replace(plan, fault=fault),
                request,
                started=started,
                ended=workflow.now(),
                moved_bytes=book.state.stats.bytes_moved - bytes_before,
                waited_for=waited_for,
            )
        )
        return fault

    # ------------------------------------------------------------------ staged restores

    def stage_next(self) -> None:
        """While a holder works, bring the state of the waiter served next onto the device when
        it fits beside what is there (``Residency.may_stage``): that waiter's grant then moves
        nothing, and its restore's time overlaps the holder's phase instead of following it."""
        book = self._book
        holder = book.state.holder
        if self.staging is not None or holder is None or not book.state.queue:
            return
        waiter = book.waiters.peek_next(workflow.now())
        request = waiter.request if waiter is not None else None
        if not book.residency.may_stage(request, holder.request.job_id):
            return
        if not self._patched(STAGED_RESTORES):
            return
        assert request is not None and request.snapshot is not None
        book.residency.stage(request)
        job_id, target = request.job_id, request.snapshot

        async def stage() -> None:
            try:
                bytes_before = book.state.stats.bytes_moved
                result = await self._run_snapshot(RESTORE_ACTIVITY, job_id, target)
                # Granted meanwhile (``_settle_staged`` does not wait for its own job's): its
                # process held the states until this restore was done, and its grant counted.
                still_staged = book.residency.is_staged(job_id)
                if result is _Moved.OK:
                    book.residency.staged_in(job_id)
                    moved = book.state.stats.bytes_moved - bytes_before
                    if moved:  # beside the holder's lease: a mark of no width
                        now = workflow.now()
                        book.accounts.record_move(None, job_id, (now, now), moved, overlapped=True)
                elif result is _Moved.GONE and still_staged:
                    book.forget(job_id)
                else:  # failed: _run_snapshot faulted the job, and its state is unknown
                    book.residency.drop_staged(job_id)
            finally:
                self.staging = None
                self._wake()

        self.staging = asyncio.create_task(stage())

    async def _settle_staged(self, request: AcquireRequest) -> None:
        """Before a switch to ``request``: if another job was staged (the policy now serves
        ``request`` first), wait for its restore to end and take its state off the device again.
        A restore of ``request``'s own job still running is not waited for: the job restores
        itself at its grant, and its process, which runs the staged restore, lets the phase
        use the states only once that restore is done (then nothing is left to move)."""
        book = self._book
        staged = book.state.staged
        if self.staging is not None and not (
            staged is not None and staged.job_id == request.job_id and request.restores_itself
        ):
            await workflow.wait_condition(lambda: self.staging is None)
        staged = book.state.staged
        if (
            staged is None
            or staged.job_id == request.job_id
            or book.residency.is_resident(request.job_id)
        ):
            return
        assert staged.snapshot is not None
        result = await self._run_snapshot(SNAPSHOT_ACTIVITY, staged.job_id, staged.snapshot)
        if result is _Moved.OK:
            book.residency.staged_left(staged.job_id)
        elif result is _Moved.GONE:
            book.forget(staged.job_id)
        else:
            book.residency.drop_staged(staged.job_id)

    async def _await_own_eviction(self, request: AcquireRequest) -> ResidentJob | None:
        """A previous holder still moving its state out: wait for its report unless both fit
        or the two stream (``Residency.overlaps``).

        If the report does not come in time, the group evicts it through its own snapshot
        activity. Returns the job waited for, if any."""
        book = self._book
        evicting = book.residency.eviction_to_await(request)
        if evicting is None:
            return None
        if book.state.evicting_report_later:
            # Its report comes with its next release here, not now. Its own next grant needs
            # none (its process restores only after its eviction is done); another job's
            # restore asks its process by the group's snapshot activity, which waits for the
            # eviction under way and finds nothing left to move.
            book.residency.clear_evicting()
            if evicting.job_id == request.job_id or evicting.snapshot is None:
                return None
            await self._evict_late(evicting)
            return evicting
        self.awaiting_eviction_of = evicting.job_id
        # Its process may have died right after releasing (the soak found a group idle for its
        # whole 300-s snapshot time-out so): past the time a live process has to answer a grant,
        # the group's own snapshot activity takes over. On a live process it waits for the
        # eviction under way and finds nothing left to move; on a dead one it is not picked up.
        report_wait = self._config.snapshot_timeout_s
        if self._patched(BOUNDED_EVICTION_REPORT_WAIT):
            report_wait = min(report_wait, self._config.grant_ack_timeout_s)
        try:
            if self._one_timer():
                give_up_at = workflow.now() + timedelta(seconds=report_wait)
                self.report_deadline = give_up_at
                self._set_timer()
                await workflow.wait_condition(
                    lambda: book.state.evicting is None or workflow.now() >= give_up_at
                )
            else:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: book.state.evicting is None, timeout=report_wait
                    )
        finally:
            self.awaiting_eviction_of = None
            self.report_deadline = None
        late = book.state.evicting
        if late is not None:
            book.residency.clear_evicting()
            if late.snapshot is not None:
                workflow.logger.warning(
                    "job %s did not report its own eviction; evicting it", late.job_id
                )
                await self._evict_late(late)
        return evicting

    async def _evict_late(self, late: ResidentJob) -> None:
        """Evict a previous holder whose own eviction's report is not here, by the group's
        snapshot activity (on a live process it waits for the eviction under way)."""
        assert late.snapshot is not None
        result = await self._run_snapshot(SNAPSHOT_ACTIVITY, late.job_id, late.snapshot)
        if result is _Moved.GONE and self._patched(FORGET_GONE_EVICTOR):
            # No process picked the task up: the job's processes are gone, and its
            # state with them (as in _evict), so nothing is left to restore.
            self._book.evictor_gone(late.job_id)

    def _evict_beside(self, plan: SwitchPlan) -> None:
        """Evict the previous resident while the next holder is granted and works: both
        states fit in the group's declared memory, or the next holder's restore takes room on
        the node only as this eviction frees it (a streamed switch). The copy's bytes get a mark
        of no width (it overlapped the holder's lease, which is not switching time)."""
        resident = plan.evict
        assert resident is not None and resident.snapshot is not None
        target = resident.snapshot

        async def evict() -> None:
            bytes_before = self._book.state.stats.bytes_moved
            result = await self._run_snapshot(SNAPSHOT_ACTIVITY, resident.job_id, target)
            now = workflow.now()
            self._book.eviction_done(
                resident.job_id,
                gone=result is _Moved.GONE,
                ok=result is _Moved.OK,
                now=now,
                preempted=resident.lease_expired,
            )
            moved = self._book.state.stats.bytes_moved - bytes_before
            if moved:
                self._book.accounts.mark_overlapped(resident.job_id, now, moved)
            self._wake()

        task = asyncio.create_task(evict())
        self.evictions.add(task)
        task.add_done_callback(self.evictions.discard)

    async def _evict(self, plan: SwitchPlan) -> None:
        resident = plan.evict
        assert resident is not None and resident.snapshot is not None
        result = await self._run_snapshot(SNAPSHOT_ACTIVITY, resident.job_id, resident.snapshot)
        if result is _Moved.OK:
            self._book.residency.evicted(resident.job_id, preempted=resident.lease_expired)
        elif result is _Moved.GONE:
            # Its process is gone, and its device memory with it: nothing to evict.
            self._book.forget(resident.job_id)

    async def _restore(self, request: AcquireRequest) -> str | None:
        """Restore the request's job; a fault message if that failed."""
        assert request.snapshot is not None
        result = await self._run_snapshot(RESTORE_ACTIVITY, request.job_id, request.snapshot)
        if result is _Moved.OK:
            self._book.residency.restored(request.job_id)
            return None
        fault = "restore found no process on a rank queue"
        return self._book.residency.fault(request.job_id, fault)

    @staticmethod
    def _agent_moved(target: SnapshotTarget, results: list[Any]) -> bool:
        """Whether a node agent's queue of ``target`` moved the job (its outcome a report)."""
        return any(
            is_node_queue(queue.task_queue) and not isinstance(outcome, BaseException)
            for queue, outcome in zip(target.queues, results, strict=True)
        )

    async def _run_snapshot(self, activity: str, job_id: str, target: SnapshotTarget) -> _Moved:
        verb = "evict" if activity == SNAPSHOT_ACTIVITY else "restore"
        agents = self.agents_waited_for
        results = await run_on_queues(
            activity,
            job_id,
            target,
            context=self._config.group_id,
            pickup_timeout_s=self._config.grant_ack_timeout_s,
            run_timeout_s=self._config.snapshot_timeout_s,
            agent_pickup_timeout_s=self._config.snapshot_timeout_s if agents else None,
            agents_apart=agents,
        )
        failed = [
            (queue.task_queue, r)
            for queue, r in zip(target.queues, results, strict=True)
            if isinstance(r, BaseException)
        ]
        for reports in results:
            if isinstance(reports, list):
                self._book.accounts.count_moved(verb, reports)
        if not failed:
            return _Moved.OK

        def gone(queue: str, failure: BaseException) -> bool:
            # A node agent not taking its task is down or busy: the job's processes may live.
            return process_gone(failure) and not (agents and is_node_queue(queue))

        if all(gone(q, f) for q, f in failed):
            if agents and verb == "evict" and self._agent_moved(target, results):
                # The agent found the job's processes alive and checkpointed them whole: a
                # process that did not take its own part is stopped (a hung holder), not gone.
                workflow.logger.warning(
                    "evict of job %s: its node agent checkpointed its processes; their own "
                    "queue took nothing (stopped?)",
                    job_id,
                )
                return _Moved.OK
            workflow.logger.warning("%s of job %s: no process serves its queue", verb, job_id)
            return _Moved.GONE
        queue, cause = next((q, f) for q, f in failed if not gone(q, f))
        if process_gone(cause):
            message = (
                f"{verb} failed: the node agent on {queue} did not take it within "
                f"{self._config.snapshot_timeout_s:g} s (down, or busy)"
            )
        else:
            message = f"{verb} failed: {getattr(cause, 'cause', None) or cause}"
        workflow.logger.error("job %s: %s; marking the job faulted", job_id, message)
        self._book.residency.move_failed(job_id, message)
        return _Moved.FAILED
