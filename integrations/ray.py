"""Ranks that are Ray actors: time-slice a Ray program's worker group, on any number of nodes.

Ray-based RL frameworks (veRL, OpenRLHF, NeMo-RL, SkyRL) keep a job's GPU state in Ray actors,
one per GPU, and a driver calls them as a group. Here an actor becomes one rank of a Timeslice
job with one added line, a base class:

.. code-block:: python

    from timeslice.integrations.ray import TimeSlicedRank

    @ray.remote(num_gpus=1)
    class PolicyWorker(TimeSlicedRank):  # the added line: TimeSlicedRank as a base
        ...

The actor then serves its rank's task queue (``timeslice-job-<job>-<rank>``) from a thread of
its own, on whatever node Ray placed it: the group's evictions and restores of the job reach
every rank at once, each in its own actor, so a switch of an N-rank job costs about what one
rank's does. Two ways in (docs/ray.md):

* **the RL job workflow drives the ranks**: :class:`RayRanks` with ``workload=`` makes each
  actor a job process (``ranks = N`` in the job's config; the phases run in the actors);
* **a Ray driver keeps its loop**: :class:`RayRanks` without a workload serves each actor's
  own state (:meth:`TimeSlicedRank.timeslice_state`), and :meth:`RayRanks.client` gives the
  driver an orchestrator client whose evictions and restores go to the actors, so the driver
  wraps the calls it makes already: ``with client.on_accelerators(): ray.get(...)``.

This module imports nothing of Ray until a caller uses it; without Ray installed that call
raises ImportError naming the extra (``pip install 'timeslice[ray]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from temporalio.client import Client
from temporalio.worker import Worker
from timeslice.activities.async_job import AsyncJobRuntime
from timeslice.activities.job_runtime import JobRuntime
from timeslice.errors import InvalidArgumentError, TimesliceError
from timeslice.protocol.group import QueueTarget, SnapshotTarget, check_id, job_task_queue
from timeslice.session.engine import LoopThread
from timeslice.session.snapshot_activities import SnapshotActivities
from timeslice.snapshot.base import Capability, SnapshotBackend, SnapshotRequest
from timeslice.transport.connection import connect, connect_config
from timeslice.workloads.registry import load_workload

if TYPE_CHECKING:
    from timeslice.orchestrator import TimeSliceOrchestratorClient
    from timeslice.protocol.group import SnapshotReport

log = logging.getLogger("timeslice.integrations.ray")

RAY_EXTRA = "pip install 'timeslice[ray]'"
#: How long a rank's serving (connecting, starting its worker) may take.
SERVE_TIMEOUT_S = 120.0


def require_ray() -> Any:
    """The ``ray`` module, or ImportError naming the extra that brings it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"timeslice.integrations.ray needs Ray: {RAY_EXTRA}") from err
    return ray


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks' process group meets: rank 0's address and a port free there."""

    addr: str
    port: int


@dataclass(frozen=True)
class RankServing:
    """What one actor serves: its rank of a job, and how to reach Temporal.

    Attributes:
        address: The Temporal server's ``HOST:PORT``.
        namespace: The Temporal namespace (None: ``TEMPORAL_NAMESPACE``, then ``default``).
        job_id: The job this actor is a rank of.
        rank: This actor's rank (0 .. world_size - 1).
        world_size: The job's ranks.
        workload: A workload (built-in name or ``MODULE:FACTORY``) the actor runs as the RL job
            workflow's job process; None: the actor serves its own state
            (:meth:`TimeSlicedRank.timeslice_state`) for a driver's client.
        checkpoint_dir: Where a workload's checkpoints go (shared by every node's ranks).
        keep_checkpoints: Checkpoints a workload keeps.
        rendezvous: Rank 0's address for the ranks' process group (``MASTER_ADDR`` /
            ``MASTER_PORT``), or None.
        threads: torch's intra-op threads in the actor (None: as it is).
    """

    address: str
    job_id: str
    rank: int
    world_size: int
    namespace: str | None = None
    workload: str | None = None
    checkpoint_dir: str = ".timeslice/checkpoints"
    keep_checkpoints: int = 3
    rendezvous: Rendezvous | None = None
    threads: int | None = None


@dataclass(frozen=True)
class RankPlace:
    """Where a rank landed and what it serves."""

    rank: int
    job_id: str
    task_queue: str
    node_id: str
    node_ip: str
    pid: int
    #: The states the group evicts and restores on this rank's queue.
    states: tuple[str, ...]


class ActorTorchState:
    """A ``torch`` backend over every ``torch.nn.Module`` and ``torch.optim.Optimizer`` among
    an actor's attributes, looked for again before each eviction (an optimizer creates its
    state at its first step; a module may be set after ``__init__``)."""

    name = "torch"
    capabilities = frozenset({Capability.KNOWS_SIZE})

    def __init__(self, owner: object) -> None:
        from timeslice.snapshot.torch_backend import TorchBackend

        self._owner = owner
        self.backend = TorchBackend()
        self._known: dict[str, int] = {}  # registered name -> id() of its tensor

    def _discover(self) -> None:
        import torch

        found: dict[str, torch.Tensor] = {}
        for attr, value in vars(self._owner).items():
            if attr.startswith("_timeslice"):
                continue
            if isinstance(value, torch.nn.Module):
                found.update(dict(value.named_parameters(prefix=attr)))
                found.update(dict(value.named_buffers(prefix=attr)))
            elif isinstance(value, torch.optim.Optimizer):
                for i, state in enumerate(value.state.values()):
                    for key, tensor in state.items():
                        if isinstance(tensor, torch.Tensor):
                            found[f"{attr}.state.{i}.{key}"] = tensor
        for name, tensor in found.items():
            if self._known.get(name) != id(tensor):
                self.backend.register_tensor(name, tensor)
                self._known[name] = id(tensor)

    @property
    def registered_bytes(self) -> int:
        if not self.backend.evicted:
            self._discover()
        return self.backend.registered_bytes

    def health(self) -> Any:
        return self.backend.health()

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        if not self.backend.evicted:
            self._discover()  # on the device now: whatever exists is what moves
        return await self.backend.snapshot(request)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        return await self.backend.restore(request)


class _Served:
    """One actor's serving: a Temporal worker on a loop thread of its own, on its rank's queue."""

    def __init__(
        self,
        serving: RankServing,
        runtime: JobRuntime | None,
        backends: dict[str, SnapshotBackend] | None,
    ) -> None:
        self.serving = serving
        self.runtime = runtime
        self.backends = backends
        self.task_queue = job_task_queue(serving.job_id, serving.rank)
        self.thread = LoopThread(f"timeslice-rank-{serving.rank}")
        self.worker: Worker | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def states(self) -> tuple[str, ...]:
        if self.runtime is not None:
            workload = self.runtime.workload
            return tuple(dict.fromkeys([*workload.sampler_backends, *workload.trainer_backends]))
        return tuple(self.backends or {})

    def start(self) -> None:
        try:
            self.thread.submit(self._start()).result(timeout=SERVE_TIMEOUT_S)
        except BaseException:
            self.stop(timeout_s=5.0)  # no loop thread left behind by a serving that failed
            raise

    async def _start(self) -> None:
        client: Client = await connect(connect_config(self.serving.address, self.serving.namespace))
        if self.runtime is not None:
            self.runtime.attach(client)
            activities = self.runtime.activities()
        else:
            moves = SnapshotActivities(self.backends or {}, job_id=self.serving.job_id)
            activities = [moves.snapshot, moves.restore]
        self.worker = Worker(
            client,
            task_queue=self.task_queue,
            activities=activities,
            # A workload's phases run one at a time (the workflow's order); grants, evictions
            # and describes arrive beside them.
            max_concurrent_activities=16,
            graceful_shutdown_timeout=timedelta(seconds=2),
        )
        self._task = asyncio.create_task(self.worker.run())
        log.info(
            "rank %d of job %s serves %s", self.serving.rank, self.serving.job_id, self.task_queue
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            self.thread.submit(self._stop()).result(timeout=timeout_s)
        self.thread.stop()

    async def _stop(self) -> None:
        if self.worker is not None:
            await self.worker.shutdown()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.runtime is not None:
            try:
                await self.runtime.depart()
            except (TimeoutError, TimesliceError) as err:  # the groups fall back on time-outs
                log.warning("job %s: could not tell its groups: %s", self.serving.job_id, err)
            # A workload may hold what outlives the job in this process (grpo-dp: its process
            # group, rank 0's store and its port); the actor may serve another job next.
            close = getattr(self.runtime.workload, "close", None)
            if callable(close):
                await asyncio.to_thread(close)


def _set_rank_env(serving: RankServing) -> None:
    """The variables a data-parallel workload reads (torchrun's names)."""
    os.environ["RANK"] = str(serving.rank)
    os.environ["WORLD_SIZE"] = str(serving.world_size)
    if serving.rendezvous is not None:
        os.environ["MASTER_ADDR"] = serving.rendezvous.addr
        os.environ["MASTER_PORT"] = str(serving.rendezvous.port)


class TimeSlicedRank:
    """A base class that makes a Ray actor class one rank of a Timeslice job.

    It adds methods, all named ``timeslice_*`` so they stay clear of the actor's own, and
    leaves ``__init__`` and the actor's methods as they are. The driver (:class:`RayRanks`)
    calls ``timeslice_serve`` on every rank; from then on a thread of the actor serves the
    rank's task queue: the group's evictions and restores of this rank's state, and, with a
    workload, the RL job workflow's phases. Override :meth:`timeslice_state` to choose what a
    switch moves (by default every torch module and optimizer among the actor's attributes).
    """

    def timeslice_state(self) -> dict[str, SnapshotBackend]:
        """The state a switch evicts from this rank and restores, by backend name.

        Returns:
            By default ``{"torch": ActorTorchState(self)}``: every ``torch.nn.Module`` and
            ``torch.optim.Optimizer`` attribute of the actor, to host memory and back (the
            same tensor objects). Override to move less (``TorchBackend(include=...)``), or
            more (``VllmSleepBackend``, ``CollectivesBackend`` for a process group).
        """
        return {"torch": ActorTorchState(self)}

    def timeslice_serve(self, serving: RankServing) -> RankPlace:
        """Start serving this rank's task queue (call once per actor; :class:`RayRanks` does).

        Args:
            serving: The job, the rank, the Temporal server, and a workload or none.

        Returns:
            Where the rank landed (node, process) and the states it serves.

        Raises:
            TimesliceError: The actor serves a rank already, or the server cannot be reached.
            ValueError: A bad job id, rank or workload.
        """
        if getattr(self, "_timeslice_served", None) is not None:
            raise TimesliceError(
                f"this actor serves {self._timeslice_served.task_queue} already; "  # type: ignore[attr-defined]
                "call timeslice_stop() first"
            )
        if not 0 <= serving.rank < serving.world_size:
            raise ValueError(f"rank {serving.rank} is not in 0..{serving.world_size - 1}")
        check_id("job id", serving.job_id)
        _set_rank_env(serving)
        if serving.threads is not None:
            import torch

            torch.set_num_threads(serving.threads)
        runtime: JobRuntime | None = None
        backends: dict[str, SnapshotBackend] | None = None
        if serving.workload is not None:
            runtime = AsyncJobRuntime(
                job_id=serving.job_id,
                rank=serving.rank,
                workload=load_workload(serving.workload),
                workload_ref=serving.workload,
                checkpoint_dir=Path(serving.checkpoint_dir),
                keep_checkpoints=serving.keep_checkpoints,
            )
        else:
            backends = self.timeslice_state()
            bad = [n for n, b in backends.items() if not isinstance(b, SnapshotBackend)]
            if bad or not backends:
                raise TimesliceError(
                    f"timeslice_state() must return snapshot backends by name, got {bad or {}}"
                )
        served = _Served(serving, runtime, backends)
        served.start()
        self._timeslice_served: _Served | None = served
        return self.timeslice_place()

    def timeslice_place(self) -> RankPlace:
        """Where this rank runs and what it serves (a cheap call: also a liveness probe)."""
        served: _Served | None = getattr(self, "_timeslice_served", None)
        if served is None:
            raise TimesliceError("this actor serves no rank yet: call timeslice_serve()")
        ray = require_ray()
        return RankPlace(
            rank=served.serving.rank,
            job_id=served.serving.job_id,
            task_queue=served.task_queue,
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            states=served.states,
        )

    def timeslice_stop(self) -> None:
        """Stop serving: the rank's worker ends, and a workload's groups hear it left."""
        served: _Served | None = getattr(self, "_timeslice_served", None)
        self._timeslice_served = None
        if served is not None:
            served.stop()

    def timeslice_free_port(self) -> Rendezvous:
        """This node's address and a port free on it now (rank 0's, for the rendezvous)."""
        ray = require_ray()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return Rendezvous(ray.util.get_node_ip_address(), port)

    def timeslice_rendezvous(self, rendezvous: Rendezvous) -> None:
        """Meet the ranks there from the next process-group build on (rank 0 moved)."""
        os.environ["MASTER_ADDR"] = rendezvous.addr
        os.environ["MASTER_PORT"] = str(rendezvous.port)

    def timeslice_workload(self, method: str, *args: Any) -> Any:
        """Call a public method of the workload this rank runs (inspection: a digest of its
        weights, its record of moves); raises TimesliceError without a workload."""
        served: _Served | None = getattr(self, "_timeslice_served", None)
        if served is None or served.runtime is None:
            raise TimesliceError("this actor runs no workload")
        if method.startswith("_"):
            raise InvalidArgumentError(f"{method!r} is not a public method of the workload")
        return getattr(served.runtime.workload, method)(*args)


class RankActor(TimeSlicedRank):
    """An actor that is nothing but a rank: it runs the workload :class:`RayRanks` names.

    ``ray.remote(RankActor).options(num_gpus=1)`` (or custom resources) places one per GPU.
    """


class RayRanks:
    """The actors that are one job's ranks, from the driver's side.

    Args:
        actors: One actor per rank, in rank order; each an instance of a
            :class:`TimeSlicedRank` class.
        job_id: The job's id.
        address: The Temporal server's ``HOST:PORT`` (as the actors reach it).
        namespace: The Temporal namespace.
        workload: A workload the actors run for the RL job workflow (``ranks`` in the job's
            config = the number of actors); None: the actors serve their own state for a
            driver's client (:meth:`client`).
        checkpoint_dir: Where a workload's checkpoints go; every node must see the same
            directory.
        keep_checkpoints: Checkpoints a workload keeps.
        threads: torch's intra-op threads in each actor (None: as it is).
        rendezvous: Give the ranks rank 0's address for a process group of theirs
            (``MASTER_ADDR`` / ``MASTER_PORT``, beside ``RANK`` and ``WORLD_SIZE``).

    Raises:
        ImportError: Ray is not installed (the message names the extra).
        InvalidArgumentError: No actors, or a bad job id.
    """

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        job_id: str,
        address: str,
        namespace: str | None = None,
        workload: str | None = None,
        checkpoint_dir: str | Path = ".timeslice/checkpoints",
        keep_checkpoints: int = 3,
        threads: int | None = None,
        rendezvous: bool = True,
    ) -> None:
        self._ray = require_ray()
        if not actors:
            raise InvalidArgumentError("RayRanks needs at least one actor")
        try:
            self.job_id = check_id("job id", job_id)
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None
        self.actors = list(actors)
        self.address = address
        self.namespace = namespace
        self.workload = workload
        # What every rank serves but its rank and the rendezvous of the moment.
        self._serving_of_rank_0 = RankServing(
            address=address,
            job_id=job_id,
            rank=0,
            world_size=len(self.actors),
            namespace=namespace,
            workload=workload,
            checkpoint_dir=str(checkpoint_dir),
            keep_checkpoints=keep_checkpoints,
            threads=threads,
        )
        self._wants_rendezvous = rendezvous and len(self.actors) > 1
        self.rendezvous: Rendezvous | None = None
        self.places: list[RankPlace | None] = [None] * len(self.actors)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        #: Ranks replaced by fresh actors (rank, when), by :meth:`supervise` or :meth:`replace`.
        self.replaced: list[tuple[int, float]] = []

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def driver_rank(self) -> int:
        """The rank the driver's own client takes: one past the actors', so its task queue
        (its grants) is none of theirs."""
        return self.world_size

    def _serving(self, rank: int) -> RankServing:
        return dataclasses.replace(self._serving_of_rank_0, rank=rank, rendezvous=self.rendezvous)

    def serve(self, timeout_s: float = SERVE_TIMEOUT_S) -> list[RankPlace]:
        """Start every rank's serving, all at once; returns where each landed.

        Raises:
            TimesliceError: A rank could not serve (the actor's error is in the message).
        """
        ray = self._ray
        if self._wants_rendezvous and self.rendezvous is None:
            self.rendezvous = ray.get(
                self.actors[0].timeslice_free_port.remote(), timeout=timeout_s
            )
        calls = [a.timeslice_serve.remote(self._serving(r)) for r, a in enumerate(self.actors)]
        try:
            places = ray.get(calls, timeout=timeout_s)
        except ray.exceptions.RayError as err:
            raise TimesliceError(f"job {self.job_id}: a rank could not serve: {err}") from err
        self.places = list(places)
        return list(places)

    def snapshot_target(self) -> SnapshotTarget:
        """Every rank's queue with the states it serves: what a driver's client hands the
        group, so that switches move the actors' state (not the driver's)."""
        if self.workload is not None:
            raise InvalidArgumentError(
                "the ranks run a workload: the RL job workflow names their queues itself"
            )
        if any(p is None for p in self.places):
            raise InvalidArgumentError("call serve() first")
        return SnapshotTarget(
            queues=[
                QueueTarget(task_queue=p.task_queue, backends=list(p.states))
                for p in self.places
                if p is not None
            ]
        )

    def client(self, group_id: str | None = None, **kwargs: Any) -> TimeSliceOrchestratorClient:
        """The driver's orchestrator client for this job: its acquires and releases are the
        driver's, the group's evictions and restores go to the actors.

        Args:
            group_id: The group ``on_accelerators`` and ``acquire`` use by default.
            **kwargs: Other ``TimeSliceOrchestratorClient`` arguments (``priority``,
                ``lease_ttl``, ``state_bytes`` ...).
        """
        from timeslice.orchestrator import TimeSliceOrchestratorClient

        return TimeSliceOrchestratorClient(
            self.address,
            job_id=self.job_id,
            group_id=group_id,
            namespace=self.namespace,
            rank=self.driver_rank,
            snapshot_target=self.snapshot_target(),
            **kwargs,
        )

    # ---------------------------------------------------------------- faults

    def dead_ranks(self, timeout_s: float = 5.0) -> list[int]:
        """The ranks whose actor is dead now (a busy actor counts as alive)."""
        ray = self._ray
        probes = {a.timeslice_place.remote(): r for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=timeout_s)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                pass  # unreachable for now (restarting, its node slow): not known dead
            except ray.exceptions.RayActorError:
                dead.append(probes[ref])
        return sorted(dead)

    def replace(self, rank: int, actor: Any, timeout_s: float = SERVE_TIMEOUT_S) -> RankPlace:
        """Put a fresh actor in ``rank``'s place and serve it; a new rank 0 moves the
        rendezvous, and every other rank is told before it meets the ranks again."""
        ray = self._ray
        with self._lock:
            self.actors[rank] = actor
            if rank == 0 and self._wants_rendezvous:
                self.rendezvous = ray.get(actor.timeslice_free_port.remote(), timeout=timeout_s)
                others = [a for r, a in enumerate(self.actors) if r != 0]
                for ref in [a.timeslice_rendezvous.remote(self.rendezvous) for a in others]:
                    with contextlib.suppress(ray.exceptions.RayError):  # dead: replaced next
                        ray.get(ref, timeout=timeout_s)
            place = ray.get(actor.timeslice_serve.remote(self._serving(rank)), timeout=timeout_s)
            self.places[rank] = place
            self.replaced.append((rank, time.monotonic()))
        log.info(
            "job %s: rank %d replaced by a fresh actor on node %s", self.job_id, rank, place.node_id
        )
        return place

    def supervise(self, make_actor: Callable[[int], Any], *, every_s: float = 1.0) -> None:
        """Replace dead ranks with fresh actors (``make_actor(rank)``), in a thread, until
        :meth:`close`. The RL job workflow meanwhile rewinds the job to its last checkpoint
        and waits for every rank's queue to be served again."""

        def watch() -> None:
            while not self._stop.wait(every_s):
                try:
                    for rank in self.dead_ranks(timeout_s=every_s):
                        if self._stop.is_set():
                            return
                        self.replace(rank, make_actor(rank))
                except Exception as err:  # keep watching: the next round may do better
                    log.warning("job %s: supervising its ranks: %s", self.job_id, err)

        self._supervisor = threading.Thread(
            target=watch, name=f"timeslice-ranks-{self.job_id}", daemon=True
        )
        self._supervisor.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop supervising and stop every live rank's serving (its groups hear it left)."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=timeout_s)
        ray = self._ray
        refs = [a.timeslice_stop.remote() for a in self.actors]
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(refs, timeout=timeout_s)


__all__ = [
    "ActorTorchState",
    "RankActor",
    "RankPlace",
    "RankServing",
    "RayRanks",
    "Rendezvous",
    "TimeSlicedRank",
    "require_ray",
]
