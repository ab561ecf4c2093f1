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
import re
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from timeslice.errors import InvalidArgumentError, LeaseRevokedError
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
from timeslice.session.arguments import check_timeout
from timeslice.session.engine import Engine
from timeslice.session.lease import Lease
from timeslice.session.lease_session import SessionSettings
from timeslice.snapshot.base import Capability, SnapshotBackend, SnapshotError, on_host
from timeslice.snapshot.processes import JOB_ENV, process_start_time
from timeslice.snapshot.registration import JOB_TOKEN_ENV, AgentRegistration
from timeslice.snapshot.registry import BACKENDS, Placement, create, node_agent_backends
from timeslice.transport.connection import connect_config

F = TypeVar("F", bound=Callable[..., Any])
D = TypeVar("D", bound=Callable[..., Any] | type)


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


def _elsewhere(target: SnapshotTarget | None, own_queue: str) -> list[QueueTarget]:
    """The queues of a ``snapshot_target`` given to a client (other processes' state)."""
    if target is None:
        return []
    if not isinstance(target, SnapshotTarget):
        raise InvalidArgumentError(f"snapshot_target must be a SnapshotTarget, not {target!r}")
    if any(q.task_queue == own_queue for q in target.queues):
        raise InvalidArgumentError(
            f"snapshot_target names {own_queue!r}, this client's own task queue (its grants): "
            "give the client a rank none of those processes has"
        )
    return list(target.queues)


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
    """What both clients share: argument checks, the engine, ``held``, ``on_accelerators``."""

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
        snapshot_target: SnapshotTarget | None = None,
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
        settings = SessionSettings(
            connect_config=connect_config(target, namespace, profile=profile, api_key=api_key),
            job_id=self.job_id,
            task_queue=self.task_queue,
            priority=self.priority,
            lease_ttl_s=ttl,
            snapshot_target=self._snapshot_target(backends, node, node_backends, snapshot_target),
            state_bytes=state_bytes,
            rpc_retry_s=check_timeout(rpc_retry, "rpc_retry") or 0.0,
        )
        self._engine = Engine(
            settings,
            backends=backends,
            # The node agent checkpoints this process only once it registered itself there.
            agent=AgentRegistration(node, self.job_id, self._job_token)
            if node is not None and _whole_process(node_backends or node_agent_backends())
            else None,
        )
        self._session = self._engine.session

    def _snapshot_target(
        self,
        backends: dict[str, SnapshotBackend],
        node: str | None,
        node_backends: list[str] | None,
        elsewhere: SnapshotTarget | None = None,
    ) -> SnapshotTarget | None:
        """This process's queue for in-process backends, plus its node agent's if asked, plus
        the queues of other processes that hold the job's state (``elsewhere``)."""
        queues = _elsewhere(elsewhere, self.task_queue)
        if backends:
            queues.append(
                QueueTarget(
                    task_queue=self.task_queue,
                    backends=list(backends),
                    on_host=all(on_host(b) for b in backends.values()),
                )
            )
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

    # The calls both clients make, as coroutines for the client's own loop: the blocking
    # client runs them with ``run_sync``, the async one awaits them with ``run_async``.

    def _acquiring(
        self, group_id: str | None, timeout: float | None, priority: int | None, ttl: float | None
    ) -> Coroutine[Any, Any, Lease]:
        group, timeout, priority = self._acquire_args(group_id, timeout, priority)
        return self._session.acquire(group, timeout, priority, _checked_ttl(ttl, "ttl"))

    def _status_of(self, group_id: str | None) -> Coroutine[Any, Any, GroupStatus]:
        group, _, _ = self._acquire_args(group_id, None, None)
        return self._session.group_status(group)

    def _creating(
        self, group_id: str | None, settings: dict[str, Any]
    ) -> Coroutine[Any, Any, bool]:
        config = _group_config(self._acquire_args(group_id, None, None)[0], settings)
        return self._session.create_group(config)

    @property
    def held(self) -> dict[str, Lease]:
        """The leases this client holds now, by group id."""
        return dict(self._session.held)

    @property
    def address(self) -> str:
        """The Temporal server's ``HOST:PORT`` this client talks to."""
        return str(self._session.settings.connect_config["target_host"])

    def on_accelerators(
        self, group_id: str | None = None, timeout: float | None = None, priority: int | None = None
    ) -> _AcceleratorScope:
        """Hold a group around a function (decorator) or a block (``with``, ``async with``).

        The lease is acquired on entry and released on exit, also when the body raises; a
        revocation found at the release (``LeaseRevokedError``) is raised only if the body
        itself succeeded. A sync function or ``with`` block needs the blocking client.

        Args:
            group_id: The group; defaults to the constructor's ``group_id``.
            timeout: As for ``acquire``.
            priority: As for ``acquire``.

        Returns:
            A scope usable as ``@decorator``, ``with scope as lease`` or
            ``async with scope as lease``.

        Raises:
            InvalidArgumentError: No group given, or a malformed argument (raised at once,
                not at the first call).
        """
        self._acquire_args(group_id, timeout, priority)  # fail fast on bad arguments
        return _AcceleratorScope(self, group_id, timeout, priority)


class TimeSliceOrchestratorClient(_ClientBase):
    """The blocking client: take and hand back GPU groups from a training loop.

    Its calls block the calling thread; grants are taken and leases renewed on the client's
    own event-loop thread, so a loop that keeps its thread busy with GPU work keeps its lease.
    A lease is handed back by ``release``, by ``close`` (also at interpreter exit), or lost
    after its TTL when the process dies.

    Args:
        target: The Temporal server's ``HOST:PORT``. Defaults to ``TEMPORAL_ADDRESS`` (or the
            profile's address), then ``localhost:7233``.
        job_id: This job's id (1-100 letters, digits, ``.``, ``_`` or ``-``), the same in
            every process of the job. Defaults to a unique ``job-<12 hex digits>``.
        group_id: The group that ``acquire``, ``release``, ``group_status`` and
            ``on_accelerators`` use when they are not given one.
        namespace: The Temporal namespace. Defaults to ``TEMPORAL_NAMESPACE`` (or the
            profile's), then ``default``.
        rank: This process's rank within the job (an integer >= 0); it names the process's
            task queue, ``timeslice-job-<job_id>-<rank>``.
        priority: The priority of this client's requests, from -100 to 100 (higher first;
            a waiter gains one level per ``aging_s`` of waiting).
        lease_ttl: Seconds a lease lives without renewal (1 to 3600). None: the group's
            ``default_ttl_s`` (20 s unless the group was created otherwise).
        snapshot_backends: What a group may evict from this process when another job takes
            the group: backend names this process can build by name (``noop``,
            ``simulated``) or backend objects (``TorchBackend``, ``JaxBackend``,
            ``VllmSleepBackend``, your own ``SnapshotBackend``). None: nothing is evicted.
        node: The name of this node's agent (``timeslice agent --node NAME``), to evict
            through it as well (whole-process backends such as ``cuda-checkpoint``).
        node_backends: The agent's backends to use (needs ``node``). None: every backend
            the agent may run.
        snapshot_target: Queues of other processes that hold this job's state and serve its
            evictions and restores (the job's Ray actors: ``timeslice.integrations.ray``);
            the group moves their state as well as this process's.
        state_bytes: The job's declared device footprint in bytes, which lets a group whose
            ``memory_bytes`` holds two states overlap an eviction with the next restore.
        profile: The Temporal client-configuration profile to read defaults from.
        api_key: An API key for the Temporal server (Temporal Cloud).
        rpc_retry: Seconds a call keeps retrying a server that does not answer (a restart)
            before it raises ``ServerUnreachableError``.

    Raises:
        InvalidArgumentError: An argument is malformed (an id, the rank, the priority, a TTL,
            a backend this process cannot run, ``node_backends`` without ``node``, a process
            not launched for its job with ``node=`` and a whole-process backend, a
            ``snapshot_target`` naming this client's own queue). Nothing is
            sent: the constructor connects to nothing; the first call (or ``connect``) does.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Check the arguments (see the class docstring) and prepare the engine; connects to
        nothing yet."""
        super().__init__(*args, **kwargs)
        # A process that exits without closing still withdraws its requests and releases.
        atexit.register(_close_quietly, weakref.ref(self))

    def connect(self) -> TimeSliceOrchestratorClient:
        """Connect and start serving grants now (otherwise the first call does it).

        Returns:
            This client, connected.

        Raises:
            ServerUnreachableError: No Temporal server answered within ``rpc_retry`` seconds.
            ClientClosedError: The client was closed.
        """
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
        """Wait until this job holds the group, and return the lease.

        When another job's state is resident, the group evicts it first (or beside this
        job's work, when the group's memory holds both states), and restores this job's state
        if it was evicted earlier; a job whose state is resident is granted without a switch.

        Args:
            group_id: The group; defaults to the constructor's ``group_id``.
            timeout: Seconds to wait (at most 366 days); ``0`` is a try-lock (granted only if
                the group is free and nobody waits); None waits without limit.
            priority: This request's priority (-100 to 100); defaults to the client's.
            ttl: Seconds the lease lives without renewal (1 to 3600); defaults to the
                client's ``lease_ttl``, then the group's ``default_ttl_s``.

        Returns:
            The lease (``Lease``): ``token`` is the group's fencing token, ``valid`` a
            conservative local view of whether it is still held.

        Raises:
            InvalidArgumentError: No group given, or a malformed argument; nothing was sent.
            AcquireTimeoutError: Not granted within ``timeout``; the request was withdrawn.
            RateLimitedError: A try-lock (``timeout=0``) while this job sends the group more
                updates than its rate allows (it says when to try again); any other acquire
                waits that out instead.
            GrantLostError: The group gave the grant up before this process took it (it was
                paused or did not answer in time); nothing is held, acquire again.
            JobFaultedError: The group could not restore (or evict) this job's state.
            NoControlWorkerError: No control worker (``timeslice worker``) serves the groups.
            GroupNotAnsweringError: The group's workflow task keeps failing.
            ServerUnreachableError: The Temporal server did not answer within ``rpc_retry``.
            ClientClosedError: The client was closed, also by another thread meanwhile.
        """
        return self._engine.run_sync(self._acquiring(group_id, timeout, priority, ttl), leases=True)

    def release(
        self,
        lease: Lease | None = None,
        *,
        next_phase: str | None = None,
        expected_s: float | None = None,
        phases: Sequence[tuple[float, float]] | None = None,
    ) -> bool:
        """Hand the group to the next waiter, or keep it for this holder's next phase.

        If another job takes the group next, this job's registered state is evicted before
        that job is granted (or beside its work, when the group's memory holds both states).
        When this holder's next GPU phase on the same group follows at once, say so:
        ``release(lease, next_phase="train", expected_s=0.8)`` asks the group to keep the
        lease for that phase, and it decides by its grant policy (``GroupConfig.grant_policy``:
        kept when nobody waits; under ``phase_aware`` also past waiters, within its bounds).

        Args:
            lease: The lease to end; None: the only lease this client holds.
            next_phase: The name of this holder's next GPU phase on the same group, if it
                follows at once; None: a plain release.
            expected_s: That phase's expected length, as you measured it; without it the
                lease is kept only when nobody waits.
            phases: The GPU phases this holder ran under the lease since it was granted (or
                since its last release that kept it), each ``(start, end)`` in
                ``time.monotonic()`` seconds. The group keeps up to four per lease (closer ones
                merged, their time kept) and ``timeslice report`` counts them as the lease's
                phase time, the rest as overhead; ``[]``: none ran. None: not reported, the
                whole lease counts as the phase.

        Returns:
            True if the lease was kept (go on under it; release it again later), False if it
            was released (acquire again for the next phase). A plain release returns False.

        Raises:
            InvalidArgumentError: ``lease`` is not a ``Lease`` (a group id, say), or
                ``next_phase`` / ``expected_s`` / ``phases`` are malformed (the lease stays
                held).
            NotHolderError: The client does not hold that lease (already released, another
                client's), or holds none or several and none was given.
            LeaseRevokedError: The lease had ended at the group while held (its TTL ran out
                without renewal); it is released all the same.
            ServerUnreachableError: The Temporal server did not answer within ``rpc_retry``.
        """
        return self._engine.run_sync(
            self._session.release(
                lease, next_phase=next_phase, expected_s=expected_s, phases=phases
            )
        )

    yield_ = release

    def group_status(self, group_id: str | None = None) -> GroupStatus:
        """What the group is doing now: holder, queue, resident job, counters, recent leases.

        Args:
            group_id: The group; defaults to the constructor's ``group_id``.

        Returns:
            The group's ``GroupStatus``, brought forward from the group's last workflow task
            to this host's clock.

        Raises:
            InvalidArgumentError: No group given, or a malformed id.
            UnknownGroupError: No such group exists (a group is created by its first acquire).
            TimesliceError: The group's workflow could not answer the query.
            ServerUnreachableError: The Temporal server did not answer within ``rpc_retry``.
        """
        return self._engine.run_sync(self._status_of(group_id))

    def snapshot(self) -> list[SnapshotReport]:
        """Standalone, no group involved: evict this job's registered state now, and wait.

        For frameworks with a scheduler of their own; runs a ``SnapshotJobWorkflow`` on the
        control worker, which calls every queue of this job's snapshot target.

        Returns:
            One ``SnapshotReport`` per backend: what it moved (or dropped), in how long.

        Raises:
            InvalidArgumentError: The client has no snapshot backend and no ``node``, or
                holds a lease (release it first).
            SnapshotFailedError: A backend failed on at least one of the job's queues.
        """
        return self._engine.run_sync(self._session.snapshot_job("snapshot"))

    def restore(self) -> list[SnapshotReport]:
        """Standalone, no group involved: restore this job's evicted state, and wait.

        Returns:
            One ``SnapshotReport`` per backend.

        Raises:
            InvalidArgumentError: The client has no snapshot backend and no ``node``, or
                holds a lease.
            SnapshotFailedError: A backend failed on at least one of the job's queues.
        """
        return self._engine.run_sync(self._session.snapshot_job("restore"))

    def create_group(self, group_id: str | None = None, **settings: Any) -> bool:
        """Create a group with settings fixed for its lifetime.

        Groups are otherwise created with defaults by their first acquire.

        Args:
            group_id: The group; defaults to the constructor's ``group_id``.
            **settings: ``GroupConfig`` fields: ``memory_bytes`` (the device memory for two
                states at once, which lets evictions overlap restores), ``default_ttl_s``,
                ``aging_s``, ``grant_ack_timeout_s``, ``snapshot_timeout_s``,
                ``max_parked_waits`` ...

        Returns:
            True if this call created the group; False if it existed already (its settings
            are unchanged).

        Raises:
            InvalidArgumentError: No group given, or a setting that ``GroupConfig`` refuses.
            NoControlWorkerError: No control worker serves the groups.
            ServerUnreachableError: The Temporal server did not answer within ``rpc_retry``.
        """
        return self._engine.run_sync(self._creating(group_id, settings))

    def close(self) -> None:
        """Release held leases, withdraw waiting requests, tell the groups this job left, and
        stop the client's worker. Idempotent; every later call raises ``ClientClosedError``.

        A lease that cannot be released (the server is down, the group does not answer) is
        logged and ends at the group when its TTL runs out.

        Raises:
            TimesliceError: Called from the client's own event loop (a snapshot backend's
                code, say), where the blocking call would wait for itself.
        """
        thread = self._engine.thread
        if thread.loop.is_running():
            self._engine.run_sync(self._engine.close())
            thread.stop()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        """The client itself; ``close`` runs when the block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _twin_of(blocking: Any) -> Callable[[D], D]:
    """Document an async twin by its blocking original: the twin's own docstring says what it
    is, and the original's Args / Returns / Raises sections, written once there, are added to
    it (both sit at the same depth, so the indentation agrees). Under ``python -OO`` there are
    no docstrings to share."""
    doc = blocking.__doc__ or ""
    sections = re.search(r"\n[ ]*(Args|Returns|Raises):", doc)

    def document(twin: D) -> D:
        if sections is not None and twin.__doc__ is not None:
            twin.__doc__ = f"{twin.__doc__.rstrip()}\n{doc[sections.start() :]}"
        return twin

    return document


@_twin_of(TimeSliceOrchestratorClient)
class AsyncTimeSliceOrchestratorClient(_ClientBase):
    """The asyncio twin of ``TimeSliceOrchestratorClient``: the same calls as coroutines.

    For async training loops. The client still runs its own event-loop thread (grants,
    renewals), so the caller's loop never has to be free for the lease to be kept. It takes
    the blocking client's arguments (the Args and Raises below are that client's).
    """

    @_twin_of(TimeSliceOrchestratorClient.connect)
    async def connect(self) -> AsyncTimeSliceOrchestratorClient:
        """Connect and start serving grants now (otherwise the first call does it)."""
        await self._engine.run_async(self._engine.start())
        return self

    @_twin_of(TimeSliceOrchestratorClient.acquire)
    async def acquire(
        self,
        group_id: str | None = None,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        ttl: float | None = None,
    ) -> Lease:
        """Wait until this job holds the group, and return the lease (as
        :meth:`TimeSliceOrchestratorClient.acquire`, without blocking the caller's loop)."""
        return await self._engine.run_async(
            self._acquiring(group_id, timeout, priority, ttl), leases=True
        )

    @_twin_of(TimeSliceOrchestratorClient.release)
    async def release(
        self,
        lease: Lease | None = None,
        *,
        next_phase: str | None = None,
        expected_s: float | None = None,
        phases: Sequence[tuple[float, float]] | None = None,
    ) -> bool:
        """Hand the group to the next waiter, or keep it for this holder's next phase (as
        :meth:`TimeSliceOrchestratorClient.release`)."""
        return await self._engine.run_async(
            self._session.release(
                lease, next_phase=next_phase, expected_s=expected_s, phases=phases
            )
        )

    yield_ = release

    @_twin_of(TimeSliceOrchestratorClient.group_status)
    async def group_status(self, group_id: str | None = None) -> GroupStatus:
        """What the group is doing now: holder, queue, resident job, counters, recent leases."""
        return await self._engine.run_async(self._status_of(group_id))

    @_twin_of(TimeSliceOrchestratorClient.snapshot)
    async def snapshot(self) -> list[SnapshotReport]:
        """Standalone, no group involved: evict this job's registered state now, and wait (as
        :meth:`TimeSliceOrchestratorClient.snapshot`)."""
        return await self._engine.run_async(self._session.snapshot_job("snapshot"))

    @_twin_of(TimeSliceOrchestratorClient.restore)
    async def restore(self) -> list[SnapshotReport]:
        """Standalone, no group involved: restore this job's evicted state, and wait."""
        return await self._engine.run_async(self._session.snapshot_job("restore"))

    @_twin_of(TimeSliceOrchestratorClient.create_group)
    async def create_group(self, group_id: str | None = None, **settings: Any) -> bool:
        """Create a group with settings fixed for its lifetime (as
        :meth:`TimeSliceOrchestratorClient.create_group`)."""
        return await self._engine.run_async(self._creating(group_id, settings))

    async def close(self) -> None:
        """Release held leases, withdraw waiting requests, tell the groups this job left, and
        stop the client's worker. Idempotent; every later call raises ``ClientClosedError``.

        It raises nothing of its own: a lease that cannot be released (the server is down, the
        group does not answer) is logged and ends at the group when its TTL runs out."""
        thread = self._engine.thread
        if thread.loop.is_running():
            await self._engine.run_async(self._engine.close())
            thread.stop()

    async def __aenter__(self) -> AsyncTimeSliceOrchestratorClient:
        """The client itself; ``close`` runs when the block ends."""
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
        self._began = 0.0  # when the body began, under the lease (time.monotonic())

    # blocking ------------------------------------------------------------

    def __enter__(self) -> Lease:
        owner = self._owner
        if not isinstance(owner, TimeSliceOrchestratorClient):
            raise TypeError("use `async with` with AsyncTimeSliceOrchestratorClient")
        group, timeout, priority = owner._acquire_args(*self._args)
        self.lease = owner._engine.run_sync(
            owner._session.acquire(group, timeout, priority, None), leases=True
        )
        self._began = time.monotonic()
        return self.lease

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        lease, self.lease = self.lease, None
        assert lease is not None
        engine = self._owner._engine
        phases = [(self._began, time.monotonic())]  # the body ran on the accelerators
        _release_after(
            lambda: engine.run_sync(engine.session.release(lease, phases=phases)),
            failed=exc is not None,
        )

    # async ---------------------------------------------------------------

    async def __aenter__(self) -> Lease:
        owner = self._owner
        group, timeout, priority = owner._acquire_args(*self._args)
        self.lease = await owner._engine.run_async(
            owner._session.acquire(group, timeout, priority, None), leases=True
        )
        self._began = time.monotonic()
        return self.lease

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        lease, self.lease = self.lease, None
        assert lease is not None
        engine = self._owner._engine
        phases = [(self._began, time.monotonic())]  # the body ran on the accelerators
        try:
            await engine.run_async(engine.session.release(lease, phases=phases))
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
