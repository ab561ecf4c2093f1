"""The embedded client's engine: a job's lease session, hosted on an event loop of its own.

It runs on its own event-loop thread, so that grants are taken and leases renewed even while the
training loop keeps its own thread (or event loop) busy with GPU work; and it serves the job's
task queue with a worker of its own (the grant inbox, the snapshot activities of the client's
backends). What the leases do is the session's (``timeslice.session.lease_session``), the same
session a job process hosts on its job worker's loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Coroutine
from concurrent.futures import CancelledError, Future
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.errors import ClientClosedError, TimesliceError
from timeslice.session.lease_session import CLOSED, LeaseSession, SessionSettings
from timeslice.session.snapshot_activities import SnapshotActivities
from timeslice.snapshot.base import SnapshotBackend
from timeslice.snapshot.registration import AgentRegistration, RegistrationError
from timeslice.transport.telemetry import detached

log = logging.getLogger("timeslice.client")
T = TypeVar("T")


class LoopThread:
    """An asyncio event loop on a daemon thread; coroutines are submitted from any thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        # Returns only once the loop runs: a call made at once (``connect()`` right after the
        # constructor) would otherwise find it not yet running and take the client for closed,
        # which a loaded machine made happen (test_phase_aware_client, ClientClosedError).
        running = threading.Event()
        self.loop.call_soon(running.set)
        self._thread.start()
        running.wait()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread


class Engine:
    """Hosts one ``LeaseSession`` on ``self.thread``'s loop, and serves the job's task queue
    (grants, evictions by the client's backends) with a worker started before the first lease.
    """

    def __init__(
        self,
        settings: SessionSettings,
        *,
        backends: dict[str, SnapshotBackend],
        agent: AgentRegistration | None = None,
    ) -> None:
        """``settings``: the session's. ``backends``: what the worker's snapshot activities
        evict and restore. ``agent``: this process's registration with its node agent, made
        before any lease."""
        self.session = LeaseSession(settings, serve=self._serve)
        self.backends = backends
        self.agent = agent
        self._agent_registered = False
        self.thread = LoopThread(f"timeslice-{settings.job_id}")
        self._worker: Worker | None = None
        self._worker_task: asyncio.Task[None] | None = None

    def run_sync(self, coro: Coroutine[Any, Any, T], *, leases: bool = False) -> T:
        """Run ``coro`` on the client's loop and wait for it. ``leases``: it returns a lease,
        which is released if the caller stops waiting just as it came (see
        :meth:`_release_if_orphaned`)."""
        if self.thread.in_loop_thread:
            coro.close()
            raise TimesliceError("blocking client call made from the client's own event loop")
        if not self.thread.loop.is_running():
            coro.close()
            raise ClientClosedError(CLOSED)
        future = self.thread.submit(coro)
        try:
            return future.result()
        except CancelledError:
            if self.session.closed:  # cancelled by close() from another thread
                raise ClientClosedError(CLOSED) from None
            raise
        except BaseException:
            # e.g. KeyboardInterrupt while waiting: cancel the coroutine so it withdraws cleanly.
            future.cancel()
            if leases:
                self._release_if_orphaned(future)
            raise

    async def run_async(self, coro: Coroutine[Any, Any, T], *, leases: bool = False) -> T:
        """Await ``coro`` run on the client's loop (``leases`` as for :meth:`run_sync`)."""
        if not self.thread.loop.is_running():
            coro.close()
            raise ClientClosedError(CLOSED)
        future = self.thread.submit(coro)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            if leases:
                self._release_if_orphaned(future)
            raise

    def _release_if_orphaned(self, future: Future[Any]) -> None:
        """The caller of an acquire stopped waiting (cancelled, timed out, interrupted), and the
        acquire finished anyway, too late to be cancelled: nobody has its lease, which would be
        held and renewed until the client closed. It is released instead."""

        def done(finished: Future[Any]) -> None:
            if finished.cancelled() or finished.exception() is not None:
                return  # withdrawn, or failed: nothing is held
            if self.thread.loop.is_running():
                self.thread.submit(self._release_orphan(finished.result()))

        future.add_done_callback(done)

    async def _release_orphan(self, lease: Any) -> None:
        log.warning(
            "released the lease on %s (token %s): its acquire's caller stopped waiting as it "
            "was granted",
            lease.group_id,
            lease.token,
        )
        try:
            await self.session.release(lease)
        except Exception as err:  # the group ends it at its TTL: the renewals stopped
            log.warning("could not release the lease on %s: %s", lease.group_id, err)

    async def start(self) -> Client:
        """Connect and serve this job's task queue (grants, snapshots)."""
        return await self.session.start()

    async def _serve(self, client: Client) -> None:
        job_id, task_queue = self.session.job_id, self.session.task_queue
        if self.agent is not None and not self._agent_registered:
            # Before any lease: the node agent checkpoints only processes that registered.
            try:
                await self.agent.start()
            except RegistrationError as err:
                raise TimesliceError(str(err)) from err
            self._agent_registered = True
        if self._worker is None:
            snapshots = SnapshotActivities(self.backends, job_id=job_id)
            inbox = self.session.inbox
            self._worker = Worker(
                client,
                task_queue=task_queue,
                activities=[inbox.deliver_grant, snapshots.snapshot, snapshots.restore],
                max_concurrent_activities=16,
                graceful_shutdown_timeout=timedelta(seconds=2),
            )
            with detached():  # not under the span of the acquire that started it
                self._worker_task = asyncio.create_task(self._worker.run())
            log.info("job %s serving task queue %s", job_id, task_queue)

    async def close(self) -> None:
        if self.session.closed:
            return
        await self.session.close()
        if self._worker is not None:
            await self._worker.shutdown()
        if self._worker_task is not None:
            await asyncio.gather(self._worker_task, return_exceptions=True)
        if self.agent is not None:
            await self.agent.close()
        # Drop the SDK's native objects now, while the interpreter is whole: left to the
        # interpreter's own shutdown, their native threads can touch Python mid-finalization.
        self._worker = self._worker_task = None
        self.session.drop_client()
        gc.collect()
