"""The workload interface: what a user implements around their own model.

A job process (``timeslice job worker``) builds one :class:`Workload` when it starts and calls it
from the job's activities. Trajectories, tensors and optimizer state stay inside the process;
only the small metric dicts the phases return cross Temporal.

Determinism is the workload's contract with the platform: given the same :class:`JobSpec`,
``setup`` followed by the phases of epochs 0..N must produce the same state whether or not the
state was evicted and restored, or the job resumed from a checkpoint, in between. The built-ins get
there by drawing every epoch's randomness from ``(seed, epoch)`` rather than from a running
generator.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from timeslice.snapshot.base import SnapshotBackend, registered_bytes
from timeslice.workloads.options import WorkloadOptions

T = TypeVar("T")
_running = threading.local()


class PhaseStopped(RuntimeError):
    """Raised by :meth:`PhaseContext.check` when the phase must stop (lease revoked, cancelled)."""


@dataclass(frozen=True)
class JobSpec:
    """The job's settings a workload needs (from the workflow's ``RLJobConfig``).

    Attributes:
        job_id: The job's id.
        seed: The job's seed: draw every epoch's randomness from ``(seed, epoch)``.
        batch_size: Prompts per epoch.
        group_size: Completions per prompt.
        options: The job's ``workload_options``.
    """

    job_id: str
    seed: int
    batch_size: int
    group_size: int
    options: dict[str, Any] = field(default_factory=dict)


class PhaseContext:
    """Handed to each phase: the epoch, a stop check and a progress reporter.

    Phases run in a worker thread; they call :meth:`check` between steps (it raises
    :class:`PhaseStopped` once the job's lease is revoked or the activity is cancelled) and may
    report progress, which the activity heartbeats to Temporal.
    """

    def __init__(self, epoch: int, phase: str, *, lease_token: int | None = None) -> None:
        self.epoch = epoch
        self.phase = phase
        #: The fencing token of the lease the phase runs under (None: none, or not known):
        #: every rank of a multi-rank phase gets the same, and no other lease has it, so
        #: data-parallel ranks meet under it to build a process group (grpo-dp).
        self.lease_token = lease_token
        self._stop = threading.Event()
        self._why = ""
        self._lock = threading.Lock()
        self._progress: dict[str, Any] = {}
        # When it was first told to stop (monotonic clock), and why: the first reason stands.
        self.stopped_at = 0.0

    def stop(self, why: str) -> None:
        """Tell the phase to stop (the job process does, when the lease is lost or the
        activity cancelled); the first reason given stands.

        Args:
            why: The reason, shown in the ``PhaseStopped`` that ``check`` raises.
        """
        if not self._stop.is_set():
            self.stopped_at = time.monotonic()
            self._why = why
        self._stop.set()

    @property
    def stop_reason(self) -> str:
        """Why the phase was told to stop ("" while it was not)."""
        return self._why

    def run(self, work: Callable[[], T]) -> T:
        """Run ``work`` in this thread as this context's work (see :func:`current_context`).

        Args:
            work: The phase (or preparation, or checkpoint) to run.

        Returns:
            What ``work`` returned.
        """
        _running.ctx = self
        try:
            return work()
        finally:
            _running.ctx = None

    @property
    def stopped(self) -> bool:
        """True once the phase was told to stop."""
        return self._stop.is_set()

    def check(self) -> None:
        """Call between steps: return at once while the phase may go on.

        Raises:
            PhaseStopped: The phase must stop now (its lease was lost or the activity
                cancelled); let it propagate, and the job resumes from its last checkpoint.
        """
        if self._stop.is_set():
            raise PhaseStopped(self._why)

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` unless told to stop first.

        Args:
            seconds: How long to sleep.

        Raises:
            PhaseStopped: The phase was told to stop before (or while) it slept.
        """
        if self._stop.wait(seconds):
            raise PhaseStopped(self._why)

    def progress(self, **details: Any) -> None:
        """Report progress; the job process sends the latest with the activity's heartbeats, and
        the Web UI shows it.

        Args:
            **details: Small JSON values, say ``step=3, loss=0.4``; a later value of a key
                replaces the earlier.
        """
        with self._lock:
            self._progress.update(details)

    def latest_progress(self) -> dict[str, Any]:
        """Everything reported by ``progress`` so far.

        Returns:
            The latest value of each key.
        """
        with self._lock:
            return dict(self._progress)


def current_context() -> PhaseContext | None:
    """The context of the work this thread runs for the job process — a phase, the job's
    preparation, a checkpoint — or None. Work that is not handed one (``setup``, ``load``,
    ``save``) calls its :meth:`~PhaseContext.check` between long steps, so that a lost lease
    stops it; work that never checks is stopped by the process exiting (docs/architecture.md)."""
    return getattr(_running, "ctx", None)


class Workload(ABC):
    """One RL job's model and algorithm, driven phase by phase by the job workflow.

    Subclass it, implement the abstract methods, and name it in a job's config as
    ``workload="my_package.module:factory"`` (a callable returning the workload) or add it to
    ``timeslice.workloads.registry.BUILTIN``. A job process builds one instance when it
    starts; its methods run in a worker thread of that process, one at a time. Each epoch
    runs ``sample`` (under the sampler group's lease), ``compute_rewards`` (no lease), then
    ``train`` (under the trainer group's); ``save`` runs every ``checkpoint_every`` epochs.

    An exception raised by a phase fails that phase: the job rewinds to its last checkpoint
    (``load``) and runs the epochs again; after ``max_failures`` consecutive failed epochs
    the job fails.
    A ``ValueError`` from ``state_names`` is a bad config: the job fails at once.

    Attributes:
        name: A short name shown in summaries and reports.
        sampler_backends: The keys of ``snapshot_backends()`` that the sampler group's
            switches evict and restore.
        trainer_backends: Those that the trainer group's switches evict and restore; a
            group that serves both phases evicts both.
    """

    #: Short name shown in summaries and reports.
    name: str = "workload"
    #: Backends (keys of :meth:`snapshot_backends`) that the sampler group's switches move, and
    #: those the trainer group's move; a group that serves both phases moves both. Known before
    #: :meth:`setup`, since the job asks for its first lease before its state exists.
    sampler_backends: tuple[str, ...] = ()
    trainer_backends: tuple[str, ...] = ()
    #: The class its ``JobSpec.options`` parse as (``timeslice.workloads.options``), if it
    #: declares one: ``timeslice job options`` prints it. None: options of its own making.
    options_type: ClassVar[type[WorkloadOptions] | None] = None

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The backends the sampler group's switches evict, and the trainer group's.

        Known before ``setup``: the job asks for its first lease before its state exists.

        Args:
            options: The job's ``workload_options``.

        Returns:
            ``(sampler backend names, trainer backend names)``; by default the class's
            ``sampler_backends`` and ``trainer_backends``.

        Raises:
            ValueError: An option is bad (say which); the job fails as ``InvalidConfig``.
        """
        return self.sampler_backends, self.trainer_backends

    @abstractmethod
    def setup(self, spec: JobSpec) -> None:
        """Create the initial state from ``spec`` (model from its seed, optimizer, data).

        Runs under every lease the job takes (it may put state on the device). Call
        ``current_context().check()`` between long steps, so a lost lease stops it.

        Args:
            spec: The job's id, seed, batch and group sizes and workload options.
        """

    @abstractmethod
    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Generate this epoch's rollouts, under the sampler group's lease; keep them in the
        process (only the returned metrics cross Temporal).

        Args:
            epoch: The epoch, from 0; draw its randomness from ``(seed, epoch)``.
            ctx: Call ``ctx.check()`` between steps; ``ctx.progress(...)`` to report.

        Returns:
            Metrics (name to number), recorded with the epoch.

        Raises:
            PhaseStopped: From ``ctx.check()``, when the lease is lost; let it propagate.
        """

    @abstractmethod
    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Score this epoch's rollouts, holding no lease (CPU work).

        Args:
            epoch: The epoch.
            ctx: As for ``sample``.

        Returns:
            Metrics, at least ``reward_mean``.
        """

    @abstractmethod
    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """Update the policy from this epoch's scored rollouts, under the trainer group's lease.

        Args:
            epoch: The epoch whose rollouts ``compute_rewards`` scored.
            ctx: As for ``sample``: check it between optimizer steps.

        Returns:
            Metrics (a loss, say), recorded with the epoch.

        Raises:
            PhaseStopped: From ``ctx.check()``, when the lease is lost; let it propagate.
        """

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Write everything needed to resume after the last trained epoch.

        Args:
            directory: An empty directory of the job's checkpoint folder, which the job
                process renames into place once this returns (a crash leaves no half copy).
        """

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Replace the state with the one :meth:`save` wrote.

        Args:
            directory: A directory that ``save`` filled.
        """

    @abstractmethod
    def snapshot_backends(self) -> dict[str, SnapshotBackend]:
        """The in-process backends that evict and restore this job's device state.

        Called after ``setup``.

        Returns:
            Backends by the names that ``sampler_backends`` / ``trainer_backends`` (or
            ``state_names``) use.
        """

    def state_bytes(self) -> int | None:
        """Device bytes the job's state occupies, which lets a group overlap switches.

        Returns:
            The sum of the backends' ``registered_bytes``; None when any backend cannot
            know its size (it does not declare ``Capability.KNOWS_SIZE``).
        """
        sizes = [registered_bytes(b) for b in self.snapshot_backends().values()]
        return None if None in sizes else sum(s for s in sizes if s is not None)


class AsyncWorkload(Workload):
    """A workload that also runs as an asynchronous job (``"mode": "async"``): its sampler and
    trainer run at the same time, in two threads of the job process, on two groups.

    The sync job's methods still serve sync jobs. An async job calls, for each batch,
    ``sample_batch`` (under the sampler group's lease) and ``score_batch`` (no lease), and for
    each training step ``train_batch`` on one batch scored earlier (under the trainer group's
    lease); every ``sync_every`` steps ``publish_weights`` copies the trainer's weights to host
    memory (under the trainer lease), and the next ``sample_batch`` is preceded by
    ``load_weights`` (under the sampler lease). The sampler's methods and the trainer's run
    concurrently: they must share nothing unguarded but the published weights, which the
    workload guards itself.

    ``setup`` and ``load`` leave the sampler with the trainer's weights (the version is the
    steps trained) and no batch held: a rewind drops every batch in flight.
    """

    @abstractmethod
    def sample_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Generate batch ``batch`` with the sampler's current weights; keep it in the process.

        Args:
            batch: The batch's id (drawn once per job, from 0); draw its randomness from
                ``(seed, batch)``.
            ctx: Call ``ctx.check()`` between steps.

        Returns:
            Metrics, recorded with the step that trains the batch.

        Raises:
            PhaseStopped: From ``ctx.check()``, when the lease is lost; let it propagate.
        """

    @abstractmethod
    def score_batch(self, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Score batch ``batch``'s rollouts, holding no lease (CPU work).

        Args:
            batch: A batch ``sample_batch`` made.
            ctx: As for ``sample_batch``.

        Returns:
            Metrics, at least ``reward_mean``.
        """

    @abstractmethod
    def train_batch(self, step: int, batch: int, ctx: PhaseContext) -> dict[str, float]:
        """Apply training step ``step`` on batch ``batch`` (scored), then forget the batch.

        Args:
            step: The step, from 0 (the model holds ``step`` steps before it).
            batch: A batch ``score_batch`` scored; each is trained on at most once.
            ctx: As for ``sample_batch``.

        Returns:
            Metrics (a loss, say).

        Raises:
            PhaseStopped: From ``ctx.check()``, when the lease is lost; let it propagate.
        """

    @abstractmethod
    def publish_weights(self, version: int, ctx: PhaseContext) -> int:
        """Copy the trainer's weights to host memory as ``version`` (the steps trained).

        Args:
            version: The weights' version.
            ctx: The training step's context.

        Returns:
            The bytes copied.
        """

    @abstractmethod
    def load_weights(self, version: int, ctx: PhaseContext) -> int:
        """Load the published weights ``version`` into the sampler.

        Args:
            version: A version ``publish_weights`` made (or the one ``setup``/``load`` left).
            ctx: The sampling's context.

        Returns:
            The bytes copied.
        """

    @abstractmethod
    def drop_batches(self) -> None:
        """Forget every batch held (host memory only): the job rewound."""
