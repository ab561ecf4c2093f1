"""TimeSliceOrchestratorClient: acquire / yield a GPU group from any training loop.

Two facades over one engine: :class:`TimeSliceOrchestratorClient` (blocking calls) and
:class:`AsyncTimeSliceOrchestratorClient` (coroutines). Both offer ``on_accelerators``, usable as a
decorator of sync or ``async def`` functions and as a (sync or async) context manager.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from timeslice.connection import connect_config
from timeslice.engine import Engine, check_timeout
from timeslice.errors import InvalidArgumentError, LeaseRevokedError
from timeslice.lease import Lease
from timeslice.protocol.group import (
    MAX_ACQUIRE_TIMEOUT_S,
    MAX_LEASE_TTL_S,
    MAX_PRIORITY,
    MIN_LEASE_TTL_S,
    MIN_PRIORITY,
    GroupConfig,
    GroupStatus,
    ProcessRef,
    QueueTarget,
    SnapshotReport,
    SnapshotTarget,
    check_id,
    job_task_queue,
    node_task_queue,
)
from timeslice.snapshot.base import Capability, SnapshotBackend, SnapshotError
from timeslice.snapshot.processes import JOB_ENV, process_start_time
from timeslice.snapshot.registration import JOB_TOKEN_ENV, AgentRegistration
from timeslice.snapshot.registry import BACKENDS, Placement, create, node_agent_backends

F = TypeVar("F", bound=Callable[..., Any])


def _checked(kind: str, value: object) -> str:
    try:
        return check_id(kind, value)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None


def _group_config(group_id: str, settings: dict[str, Any]) -> GroupConfig:
    try:
        return GroupConfig(group_id=group_id, **settings)
    except ValidationError as err:
        raise InvalidArgumentError(f"invalid group settings: {err}") from None


def _whole_process(names: list[str]) -> bool:
    """Whether any of these node-agent backends checkpoints whole processes (then this process
    must register itself with the agent, which acts on nothing else). A name the registry does
    not know is an agent's own extra backend: it moves no process of this one's."""
    try:
        return any(
            Capability.WHOLE_PROCESS in BACKENDS[name].capabilities()
            for name in names
            if name in BACKENDS
        )
    except SnapshotError as err:
        raise InvalidArgumentError(f"node_backends: {err}") from None


def _checked_node_queue(node: str) -> str:
    try:
        return node_task_queue(node)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None


def _backends(spec: list[str | SnapshotBackend] | None) -> dict[str, SnapshotBackend]:
    backends: dict[str, SnapshotBackend] = {}
    for item in spec or []:
        if isinstance(item, str):
            found = BACKENDS.get(item)
            if found is None:
                by_name = sorted(n for n, e in BACKENDS.items() if e.by_name)
                raise InvalidArgumentError(
                    f"unknown snapshot backend {item!r}: name one of {by_name} or pass a "
                    "backend object"
                )
            if found.placement is Placement.NODE_AGENT:
                raise InvalidArgumentError(
                    f"snapshot backend {item!r} runs in the node agent, not in this process: "
                    f"pass node='NODE' (and node_backends=[{item!r}]) instead"
                )
            if not found.by_name:
                raise InvalidArgumentError(
                    f"snapshot backend {item!r} moves objects of yours ({found.moves}): build "
                    f"one ({found.target}) and pass the object"
                )
            backend = create(item)
        elif isinstance(item, SnapshotBackend):
            if Capability.WHOLE_PROCESS in item.capabilities:
                raise InvalidArgumentError(
                    f"snapshot backend {item.name!r} moves whole processes: the node agent runs "
                    "it (node='NODE'), not the process it would move"
                )
            backend = item
        else:
            raise InvalidArgumentError(f"not a snapshot backend: {item!r}")
        backends[backend.name] = backend
    return backends


class _ClientBase:
    def __init__(
        self,
        target: str | None = None,
        job_id: str | None = None,
        group_id: str | None = None,
        namespace: str | None = None,
        *,
        rank: int = 0,
        priority: int = 0,
        lease_ttl: float | None = None,
        snapshot_backends: list[str | SnapshotBackend] | None = None,
        node: str | None = None,
        node_backends: list[str] | None = None,
        state_bytes: int | None = None,
        profile: str | None = None,
        api_key: str | None = None,
        rpc_retry: float = 60.0,
    ) -> None:
        self.job_id = (
            _checked("job id", job_id) if job_id is not None else (f"job-{uuid.uuid4().hex[:12]}")
        )
        self.group_id = _checked("group id", group_id) if group_id is not None else None
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidArgumentError(f"rank must be an integer >= 0, not {rank!r}")
        self.priority = self._check_priority(priority)
        ttl = _checked_ttl(lease_ttl, "lease_ttl")
        self.task_queue = job_task_queue(self.job_id, rank)
        backends = _backends(snapshot_backends)
        if state_bytes is not None and (
            isinstance(state_bytes, bool) or not isinstance(state_bytes, int) or state_bytes < 0
        ):
            raise InvalidArgumentError(f"state_bytes must be an integer >= 0, not {state_bytes!r}")
        self._job_token = ""  # what proves the job to the node agent; set by _snapshot_target
        self._engine = Engine(
            connect_config=connect_config(target, namespace, profile=profile, api_key=api_key),
            job_id=self.job_id,
            task_queue=self.task_queue,
            priority=self.priority,
            lease_ttl_s=ttl,
            backends=backends,
            snapshot_target=self._snapshot_target(backends, node, node_backends),
            state_bytes=state_bytes,
            rpc_retry_s=check_timeout(rpc_retry, "rpc_retry") or 0.0,
            # The node agent checkpoints this process only once it registered itself there.
            agent=AgentRegistration(node, self.job_id, self._job_token)
            if node is not None and _whole_process(node_backends or node_agent_backends())
            else None,
        )

    def _snapshot_target(
        self,
        backends: dict[str, SnapshotBackend],
        node: str | None,
        node_backends: list[str] | None,
    ) -> SnapshotTarget | None:
        """This process's queue for in-process backends, plus its node agent's if asked."""
        queues = []
        if backends:
            queues.append(QueueTarget(task_queue=self.task_queue, backends=list(backends)))
        if node is not None:
            on_node = list(node_backends or node_agent_backends())
            processes = []
            if _whole_process(on_node):
                launched_for = os.environ.get(JOB_ENV)
                if launched_for != self.job_id:
                    raise InvalidArgumentError(
                        f"the node agent checkpoints only processes launched for their job: "
                        f"start this process with {JOB_ENV}={self.job_id} "
                        f"(it has {launched_for!r})"
                    )
                # The proof of the job the agent checks; launching with a job id anyone
                # may choose is not one.
                self._job_token = os.environ.get(JOB_TOKEN_ENV, "")
                if not self._job_token:
                    raise InvalidArgumentError(
                        f"the node agent checkpoints only processes that prove their job: "
                        f"start this process with {JOB_TOKEN_ENV} set to the job's token "
                        f"(`timeslice agent-token {self.job_id}` where the agent's key is)"
                    )
                me = os.getpid()
                processes.append(ProcessRef(pid=me, start_time=process_start_time(me)))
            queues.append(
                QueueTarget(
                    task_queue=_checked_node_queue(node), backends=on_node, processes=processes
                )
            )
        elif node_backends:
            raise InvalidArgumentError("node_backends needs node= (the node agent's name)")
        return SnapshotTarget(queues=queues) if queues else None

    @staticmethod
    def _check_priority(priority: int) -> int:
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not (MIN_PRIORITY <= priority <= MAX_PRIORITY)
        ):
            raise InvalidArgumentError(
                f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], not {priority!r}"
            )
        return priority

    def _acquire_args(
        self, group_id: str | None, timeout: float | None, priority: int | None
    ) -> tuple[str, float | None, int | None]:
        group = group_id if group_id is not None else self.group_id
        if group is None:
            raise InvalidArgumentError(
                "no group given: pass group_id here or to the client's constructor"
            )
        return (
            _checked("group id", group),
            check_timeout(timeout, maximum=MAX_ACQUIRE_TIMEOUT_S),
            None if priority is None else self._check_priority(priority),
        )

    @property
    def held(self) -> dict[str, Lease]:
        """The leases this client holds now, by group id."""
        return dict(self._engine.held)

    @property
    def address(self) -> str:
        return str(self._engine.connect_config["target_host"])

    def on_accelerators(
        self, group_id: str | None = None, timeout: float | None = None, priority: int | None = None
    ) -> _AcceleratorScope:
        """Hold ``group_id`` around a function (decorator) or a block (``with``, ``async with``)."""
        self._acquire_args(group_id, timeout, priority)  # fail fast on bad arguments
        return _AcceleratorScope(self, group_id, timeout, priority)


class TimeSliceOrchestratorClient(_ClientBase):
    """Blocking client. ``target`` defaults to TEMPORAL_ADDRESS, then localhost:7233."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A process that exits without closing still withdraws its requests and releases.
        atexit.register(_close_quietly, weakref.ref(self))

    def connect(self) -> TimeSliceOrchestratorClient:
        """Connect and start serving grants now (otherwise the first call does it)."""
        self._engine.run_sync(self._engine.start())
        return self

    def acquire(
        self,
        group_id: str | None = None,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        ttl: float | None = None,
    ) -> Lease:
        """Wait until the group is granted; raise AcquireTimeoutError after ``timeout`` seconds."""
        group, timeout, priority = self._acquire_args(group_id, timeout, priority)
        ttl = _checked_ttl(ttl, "ttl")
        return self._engine.run_sync(self._engine.acquire(group, timeout, priority, ttl))

    def release(
        self,
        lease: Lease | None = None,
        *,
        next_phase: str | None = None,
        expected_s: float | None = None,
    ) -> bool:
        """Yield the group to the next waiter (the only held lease if none is given).

        When this holder's next GPU phase on the same group follows at once, say so:
        ``release(lease, next_phase="train", expected_s=0.8)`` asks the group to keep the
        lease for that phase, and it decides by its grant policy (``GroupConfig.grant_policy``:
        kept when nobody waits; under ``phase_aware`` also past waiters, within its bounds).
        ``expected_s`` is that phase's expected length as you measured it; without it the
        lease is kept only when nobody waits. Returns True if the lease was kept (go on under
        it; release it again later), False if it was released (acquire again for the next
        phase). A plain ``release(lease)`` always releases, and returns False."""
        return self._engine.run_sync(
            self._engine.release(lease, next_phase=next_phase, expected_s=expected_s)
        )

    yield_ = release

    def group_status(self, group_id: str | None = None) -> GroupStatus:
        group, _, _ = self._acquire_args(group_id, None, None)
        return self._engine.run_sync(self._engine.group_status(group))

    def snapshot(self) -> list[SnapshotReport]:
        """Standalone: move this job's registered state off the device now, and wait."""
        return self._engine.run_sync(self._engine.snapshot_job("snapshot"))

    def restore(self) -> list[SnapshotReport]:
        """Standalone: bring this job's state back, and wait."""
        return self._engine.run_sync(self._engine.snapshot_job("restore"))

    def create_group(self, group_id: str | None = None, **settings: Any) -> bool:
        """Create a group with settings (see ``GroupConfig``: ``memory_bytes``,
        ``default_ttl_s``, ``aging_s`` ...). False if it exists already: a group's settings are
        fixed for its lifetime. Groups are otherwise created with defaults by their first
        acquire."""
        config = _group_config(self._acquire_args(group_id, None, None)[0], settings)
        return self._engine.run_sync(self._engine.create_group(config))

    def close(self) -> None:
        """Release held leases and stop the client's worker."""
        thread = self._engine.thread
        if thread is not None and thread.loop.is_running():
            self._engine.run_sync(self._engine.close())
            thread.stop()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTimeSliceOrchestratorClient(_ClientBase):
    """The asyncio twin: the same calls as coroutines, for async training loops."""

    async def connect(self) -> AsyncTimeSliceOrchestratorClient:
        await self._engine.run_async(self._engine.start())
        return self

    async def acquire(
        self,
        group_id: str | None = None,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        ttl: float | None = None,
    ) -> Lease:
        group, timeout, priority = self._acquire_args(group_id, timeout, priority)
        ttl = _checked_ttl(ttl, "ttl")
        return await self._engine.run_async(self._engine.acquire(group, timeout, priority, ttl))

    async def release(
        self,
        lease: Lease | None = None,
        *,
        next_phase: str | None = None,
        expected_s: float | None = None,
    ) -> bool:
        """As :meth:`TimeSliceOrchestratorClient.release`: True if the group kept the lease
        for ``next_phase``."""
        return await self._engine.run_async(
            self._engine.release(lease, next_phase=next_phase, expected_s=expected_s)
        )

    yield_ = release

    async def group_status(self, group_id: str | None = None) -> GroupStatus:
        group, _, _ = self._acquire_args(group_id, None, None)
        return await self._engine.run_async(self._engine.group_status(group))

    async def snapshot(self) -> list[SnapshotReport]:
        return await self._engine.run_async(self._engine.snapshot_job("snapshot"))

    async def restore(self) -> list[SnapshotReport]:
        return await self._engine.run_async(self._engine.snapshot_job("restore"))

    async def create_group(self, group_id: str | None = None, **settings: Any) -> bool:
        config = _group_config(self._acquire_args(group_id, None, None)[0], settings)
        return await self._engine.run_async(self._engine.create_group(config))

    async def close(self) -> None:
        thread = self._engine.thread
        if thread is not None and thread.loop.is_running():
            await self._engine.run_async(self._engine.close())
            thread.stop()

    async def __aenter__(self) -> AsyncTimeSliceOrchestratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _checked_ttl(ttl: float | None, name: str) -> float | None:
    """A lease TTL in the range the groups accept (None: the group's default)."""
    checked = check_timeout(ttl, name)
    if checked is not None and not MIN_LEASE_TTL_S <= checked <= MAX_LEASE_TTL_S:
        raise InvalidArgumentError(
            f"{name} must be between {MIN_LEASE_TTL_S} and {MAX_LEASE_TTL_S} s, not {checked}"
        )
    return checked


class _AcceleratorScope:
    """Decorator and context manager returned by ``on_accelerators``."""

    def __init__(
        self, owner: _ClientBase, group_id: str | None, timeout: float | None, priority: int | None
    ) -> None:
        self._owner = owner
        self._args = (group_id, timeout, priority)
        self.lease: Lease | None = None

    # blocking ------------------------------------------------------------

    def __enter__(self) -> Lease:
        owner = self._owner
        if not isinstance(owner, TimeSliceOrchestratorClient):
            raise TypeError("use `async with` with AsyncTimeSliceOrchestratorClient")
        group, timeout, priority = owner._acquire_args(*self._args)
        self.lease = owner._engine.run_sync(owner._engine.acquire(group, timeout, priority, None))
        return self.lease

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        lease, self.lease = self.lease, None
        assert lease is not None
        engine = self._owner._engine
        _release_after(lambda: engine.run_sync(engine.release(lease)), failed=exc is not None)

    # async ---------------------------------------------------------------

    async def __aenter__(self) -> Lease:
        owner = self._owner
        group, timeout, priority = owner._acquire_args(*self._args)
        self.lease = await owner._engine.run_async(
            owner._engine.acquire(group, timeout, priority, None)
        )
        return self.lease

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        lease, self.lease = self.lease, None
        assert lease is not None
        engine = self._owner._engine
        try:
            await engine.run_async(engine.release(lease))
        except LeaseRevokedError:
            if exc is None:
                raise

    # decorator -----------------------------------------------------------

    def __call__(self, fn: F) -> F:
        owner, args = self._owner, self._args
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **kw: Any) -> Any:
                async with _AcceleratorScope(owner, *args):
                    return await fn(*a, **kw)

            return async_wrapper  # type: ignore[return-value]
        if not isinstance(owner, TimeSliceOrchestratorClient):
            raise TypeError(
                f"{fn.__name__} is not `async def`: decorate it with TimeSliceOrchestratorClient"
            )

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with _AcceleratorScope(owner, *args):
                return fn(*a, **kw)

        return wrapper  # type: ignore[return-value]


def _release_after(release: Callable[[], None], *, failed: bool) -> None:
    try:
        release()
    except LeaseRevokedError:
        if not failed:  # never hide the body's own exception behind the revocation
            raise


def _close_quietly(ref: weakref.ref[TimeSliceOrchestratorClient]) -> None:
    client = ref()
    if client is None:
        return
    try:
        client.close()
    except Exception as err:  # at interpreter exit there is nobody left to raise to
        import logging

        logging.getLogger("timeslice.client").warning("closing %s at exit: %s", client.job_id, err)
