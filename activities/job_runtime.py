"""The activities a job process serves: one RL job rank's model, phases and checkpoints.

The process holds the state the workflow cannot see (model, optimizer, trajectories), so every
activity first checks that the process is where the workflow believes it is — "the model after
epoch N, with epoch N sampled" — and answers ``JobStateLost`` when it is not (it restarted, or a
phase failed midway). The workflow then rewinds to its last checkpoint. GPU phases,
preparation, checkpoints and snapshots take one lock, so a snapshot never races the process's
own GPU work; the rewards phase (no lease, CPU only) does not, so a switch never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.activities.snapshots import SnapshotActivities
from timeslice.snapshot.base import SnapshotBackend, SnapshotError, resolve_backends
from timeslice.telemetry import meter, span
from timeslice.workflows.protocol import (
    HolderView,
    MovedReport,
    ReleaseRequest,
    SnapshotReport,
    group_workflow_id,
)
from timeslice.workflows.rl_protocol import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    LEASE_REVOKED,
    PREPARE_ACTIVITY,
    REWARDS_ACTIVITY,
    SAMPLE_ACTIVITY,
    STATE_LOST,
    TRAIN_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeResult,
    PhaseInput,
    PhaseResult,
    PrepareInput,
    PrepareResult,
)
from timeslice.workloads.base import JobSpec, PhaseContext, PhaseStopped, Workload

log = logging.getLogger("timeslice.job")
T = TypeVar("T")

HEARTBEAT_EVERY_S = 1.0

_PHASE_SECONDS = meter().create_histogram(
    "timeslice_phase_seconds", unit="s", description="one phase's (or checkpoint's) work"
)


def _state_lost(message: str) -> ApplicationError:
    return ApplicationError(message, type=STATE_LOST, non_retryable=True)


class JobRuntime:
    """One rank of one job: the workload, where it stands, and its activities."""

    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        workload: Workload,
        workload_ref: str,
        checkpoint_dir: Path,
        keep_checkpoints: int = 3,
    ) -> None:
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, not {keep_checkpoints}")
        self.job_id = job_id
        self.rank = rank
        self.workload = workload
        self.workload_ref = workload_ref
        self.checkpoint_dir = checkpoint_dir
        self.keep_checkpoints = keep_checkpoints
        self._spec: JobSpec | None = None
        # Epochs applied to the model in this process; None: no state, or a phase broke it.
        self._epochs_done: int | None = None
        self._sampled: int | None = None
        self._rewarded: int | None = None
        # One lock per backend: GPU work and snapshots of the same state never overlap, while
        # a switch of one group (say the trainer's) need not wait for a phase on another.
        self._locks: dict[str, asyncio.Lock] = {}
        self._all_backends = list(
            dict.fromkeys([*workload.sampler_backends, *workload.trainer_backends])
        )
        self.snapshots = SnapshotActivities(None, self._holding)

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.describe,
            self.prepare,
            self.sample,
            self.compute_rewards,
            self.train,
            self.save_checkpoint,
            self.snapshots.snapshot,
            self.snapshots.restore,
        ]

    # ---------------------------------------------------------------- where the process stands

    def _where(self) -> str:
        if self._spec is None:
            return "this process has no state (it started after the job's last preparation)"
        if self._epochs_done is None:
            return "this process's state was left incomplete by a failed phase"
        return f"this process holds the model after {self._epochs_done} epochs"

    def _expect(self, epoch: int, *, sampled: bool = False, rewarded: bool = False) -> None:
        ok = self._spec is not None and self._epochs_done == epoch
        if sampled:
            ok = ok and self._sampled == epoch
        if rewarded:
            ok = ok and self._rewarded == epoch
        if not ok:
            needs = "sampled " if sampled else ""
            needs += "and scored " if rewarded else ""
            raise _state_lost(
                f"job {self.job_id} rank {self.rank}: epoch {epoch} needs the model after "
                f"{epoch} epochs {needs}but {self._where()}"
            )

    def _check_job(self, job_id: str) -> None:
        if job_id != self.job_id:
            raise ApplicationError(
                f"this process serves job {self.job_id!r}, not {job_id!r}",
                type="WrongJob",
                non_retryable=True,
            )

    # ---------------------------------------------------------------- activities

    @activity.defn(name=DESCRIBE_ACTIVITY)
    async def describe(self, job_id: str) -> DescribeResult:
        self._check_job(job_id)
        return DescribeResult(
            workload=self.workload_ref,
            sampler_backends=list(self.workload.sampler_backends),
            trainer_backends=list(self.workload.trainer_backends),
            pid=os.getpid(),
            ready=self._spec is not None,
            epochs_done=self._epochs_done,
        )

    @activity.defn(name=PREPARE_ACTIVITY)
    async def prepare(self, inp: PrepareInput) -> PrepareResult:
        self._check_job(inp.spec.job_id)
        spec = JobSpec(
            job_id=inp.spec.job_id,
            seed=inp.spec.seed,
            batch_size=inp.spec.batch_size,
            group_size=inp.spec.group_size,
            options=dict(inp.spec.options),
        )
        async with _keep_alive(), self._holding(self._all_backends):
            if self._spec is not None and self._spec != spec:
                raise ApplicationError(
                    f"job {self.job_id}: this process was prepared with {self._spec}, now asked "
                    f"for {spec}; restart the job process to change the job's settings",
                    type="InvalidConfig",
                    non_retryable=True,
                )
            if inp.checkpoint is None and self._spec is not None and self._epochs_done != 0:
                raise _state_lost(f"job {self.job_id}: no checkpoint to rewind to; {self._where()}")

            await self._ensure_resident(self._all_backends)

            def build() -> PrepareResult:
                if self._spec is None:
                    log.info("setting up %s for job %s", self.workload_ref, self.job_id)
                    self.workload.setup(spec)
                    self._spec = spec
                    self._epochs_done = 0
                    self.snapshots.backends = self.workload.snapshot_backends()
                if inp.checkpoint is not None:
                    path = self._rank_dir(Path(inp.checkpoint.path))
                    log.info("loading checkpoint %s", path)
                    self.workload.load(path)
                    self._epochs_done = inp.checkpoint.epochs_done
                self._sampled = self._rewarded = None
                return PrepareResult(
                    epochs_done=self._epochs_done or 0, state_bytes=self.workload.state_bytes()
                )

            return await self._supervise(build, PhaseContext(0, "prepare"), None, None, 5.0)

    @activity.defn(name=SAMPLE_ACTIVITY)
    async def sample(self, inp: PhaseInput) -> PhaseResult:
        def check() -> None:
            self._expect(inp.epoch)

        result = await self._phase(inp, check, self.workload.sample)
        self._sampled = inp.epoch
        return result

    @activity.defn(name=REWARDS_ACTIVITY)
    async def compute_rewards(self, inp: PhaseInput) -> PhaseResult:
        def check() -> None:
            self._expect(inp.epoch, sampled=True)

        result = await self._phase(inp, check, self.workload.compute_rewards)
        self._rewarded = inp.epoch
        return result

    @activity.defn(name=TRAIN_ACTIVITY)
    async def train(self, inp: PhaseInput) -> PhaseResult:
        def check() -> None:
            self._expect(inp.epoch, sampled=True, rewarded=True)

        result = await self._phase(inp, check, self.workload.train)
        self._epochs_done = inp.epoch + 1
        self._sampled = self._rewarded = None
        return result

    @activity.defn(name=CHECKPOINT_ACTIVITY)
    async def save_checkpoint(self, inp: CheckpointInput) -> CheckpointRef:
        self._check_job(inp.job_id)
        epoch_dir = self.checkpoint_dir / self.job_id / f"epoch-{inp.epochs_done:06d}"
        async with _keep_alive(), self._holding(inp.backends):
            self._expect(inp.epochs_done)
            await self._ensure_resident(inp.backends)

            def save() -> None:
                final = self._rank_dir(epoch_dir)
                partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                self.workload.save(partial)
                shutil.rmtree(final, ignore_errors=True)  # a re-save after a rewind
                partial.rename(final)
                self._prune()

            await self._supervise(save, PhaseContext(inp.epochs_done, "checkpoint"), None, None, 5)
        log.info("checkpoint after %d epochs: %s", inp.epochs_done, epoch_dir)
        return CheckpointRef(epochs_done=inp.epochs_done, path=str(epoch_dir.resolve()))

    # ---------------------------------------------------------------- running phases

    async def _phase(
        self,
        inp: PhaseInput,
        check: Callable[[], None],
        step: Callable[[int, PhaseContext], dict[str, float]],
    ) -> PhaseResult:
        self._check_job(inp.job_id)
        # Only GPU phases exclude snapshots: the rewards phase runs while other jobs hold the
        # group, and a switch that evicts this job must not wait for it.
        leased = inp.group_id is not None and inp.token is not None
        async with _keep_alive(), self._holding(inp.group_backends if leased else []):
            check()
            if leased and inp.verify_lease and not await self._holds(inp.group_id, inp.token):
                raise ApplicationError(
                    f"job {self.job_id}: the lease on {inp.group_id} (token {inp.token}) is no "
                    "longer held; not starting the phase",
                    type=LEASE_REVOKED,
                    non_retryable=True,
                )
            restored = await self._ensure_resident(inp.group_backends) if leased else []
            ctx = PhaseContext(inp.epoch, inp.phase)
            started = time.monotonic()
            try:
                metrics = await self._supervise(
                    lambda: step(inp.epoch, ctx), ctx, inp.group_id, inp.token, inp.lease_check_s
                )
            except BaseException:
                # Whatever ran may have changed the state halfway: only a checkpoint fixes that.
                self._sampled = self._rewarded = None
                if inp.phase == "train":
                    self._epochs_done = None
                raise
            ended = time.monotonic()
            released, evicted = await self._release_after(inp, restored)
        log.info(
            "epoch %d %s: %.2f s %s",
            inp.epoch,
            inp.phase,
            ended - started,
            " ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
        )
        return PhaseResult(
            epoch=inp.epoch,
            phase=inp.phase,
            metrics={k: float(v) for k, v in metrics.items()},
            seconds=ended - started,
            mono_start=started,
            mono_end=ended,
            group_id=inp.group_id,
            token=inp.token,
            released=released,
            restored=restored,
            evicted=evicted,
        )

    async def _supervise(
        self,
        work: Callable[[], T],
        ctx: PhaseContext,
        group_id: str | None,
        token: int | None,
        lease_check_s: float,
    ) -> T:
        """:meth:`_supervised` in a ``timeslice.phase.<phase>`` span (under the activity's)."""
        attributes = {
            "timeslice.job_id": self.job_id,
            "timeslice.rank": self.rank,
            "timeslice.epoch": ctx.epoch,
            "timeslice.group_id": group_id,
            "timeslice.token": token,
        }
        started = time.monotonic()
        with span(f"timeslice.phase.{ctx.phase}", attributes):
            result = await self._supervised(work, ctx, group_id, token, lease_check_s)
        _PHASE_SECONDS.record(time.monotonic() - started, {"phase": ctx.phase, "job": self.job_id})
        return result

    async def _supervised(
        self,
        work: Callable[[], T],
        ctx: PhaseContext,
        group_id: str | None,
        token: int | None,
        lease_check_s: float,
    ) -> T:
        """Run ``work`` in a thread; heartbeat; stop it if the lease goes or we are cancelled."""
        loop = asyncio.get_running_loop()
        running = asyncio.ensure_future(asyncio.to_thread(work))
        next_check = loop.time() + lease_check_s
        try:
            while True:
                done, _ = await asyncio.wait({running}, timeout=HEARTBEAT_EVERY_S)
                if done:
                    break
                activity.heartbeat(ctx.latest_progress())
                if group_id is not None and token is not None and loop.time() >= next_check:
                    next_check = loop.time() + lease_check_s
                    if not await self._holds(group_id, token):
                        ctx.stop(f"the lease on {group_id} (token {token}) was revoked")
        except asyncio.CancelledError:
            # Never leave a phase running past its activity: a snapshot would race it.
            ctx.stop("the activity was cancelled")
            with contextlib.suppress(BaseException):
                await asyncio.shield(running)
            raise
        try:
            return running.result()
        except PhaseStopped as stopped:
            raise ApplicationError(
                f"job {self.job_id} {ctx.phase} of epoch {ctx.epoch} stopped: {stopped}",
                type=LEASE_REVOKED,
                non_retryable=True,
            ) from None

    async def _holder(self, group_id: str) -> HolderView | None:
        handle = activity.client().get_workflow_handle(group_workflow_id(group_id))
        return await handle.query("holder", result_type=HolderView | None)  # type: ignore[arg-type]

    async def _holds(self, group_id: str, token: int) -> bool:
        try:
            holder = await self._holder(group_id)
        except Exception as err:  # an unreachable server is no proof the lease is gone
            log.warning("cannot check the lease on %s: %s", group_id, err)
            return True
        return holder is not None and holder.token == token

    def _backends(self) -> dict[str, SnapshotBackend]:
        return self.snapshots.backends or {}

    @contextlib.asynccontextmanager
    async def _holding(self, names: list[str]) -> AsyncIterator[None]:
        """Exclusive use of the named backends' state (locks taken in one order: no deadlock)."""
        async with contextlib.AsyncExitStack() as stack:
            for name in sorted(set(names)):
                await stack.enter_async_context(self._locks.setdefault(name, asyncio.Lock()))
            yield

    async def _ensure_resident(self, names: list[str]) -> list[SnapshotReport]:
        """Restore the named state if it is out, before the job uses the group it lives on.

        The job asks for its leases with ``restores_itself``: the group grants at once and the
        restore happens here, in the process that owns the state, off the group's path. Only
        the leased group's state comes back: the other group's may belong on a device another
        job holds now.
        """
        backends = self._backends()
        out = [backends[n] for n in names if n in backends and getattr(backends[n], "evicted", 0)]
        return [await backend.restore(self.job_id) for backend in reversed(out)]

    async def _release_after(
        self, inp: PhaseInput, restored: list[SnapshotReport]
    ) -> tuple[bool, list[SnapshotReport]]:
        """Yield the lease straight from here when the phase is done, if the workflow asked.

        The next holder's switch starts one workflow round trip sooner than if the workflow
        released after seeing this activity complete, and when someone is waiting the process
        first moves its own state out (co-operative eviction), so the group hands over without
        running a snapshot activity. Releases are fenced by the token: one the workflow also
        sends later is ignored by the group. Returns (released, what was evicted).
        """
        if inp.release == "never" or inp.group_id is None or inp.token is None:
            return False, []
        if inp.request_id is None:
            return False, []
        try:
            holder = await self._holder(inp.group_id)
        except Exception as err:  # unknown: leave it to the workflow
            log.warning("cannot see who waits on %s: %s", inp.group_id, err)
            return False, []
        if holder is None or holder.token != inp.token:
            return False, []  # revoked meanwhile: nothing of ours to release
        if inp.release == "if_contended" and holder.waiting == 0:
            return False, []
        evict = bool(holder.waiting and inp.group_backends)
        # When the group's memory holds both states, release first and evict after: the next
        # holder's restore overlaps this eviction (the lock keeps our next use after it).
        after = evict and holder.next_fits
        evicted: list[SnapshotReport] = []
        if evict and not after:
            evicted, _ = await self._evict(inp.group_backends)
        handle = activity.client().get_workflow_handle(group_workflow_id(inp.group_id))
        release = ReleaseRequest(
            request_id=inp.request_id,
            token=inp.token,
            evicted=evicted,
            restored=restored,
            evicting=after,
        )
        try:
            await handle.signal("release", release)
        except Exception as err:  # the workflow's own release will follow
            log.warning("cannot release %s from the job process: %s", inp.group_id, err)
            if after:  # it may have arrived all the same: moving out is always safe
                await self._evict(inp.group_backends)
            return False, evicted
        if after:
            evicted, error = await self._evict(inp.group_backends)
            report = MovedReport(job_id=self.job_id, evicted=evicted, error=error)
            try:  # the group waits for this before restoring a job that does not fit beside us
                await handle.signal("moved", report)
            except Exception as err:  # it falls back to its own snapshot activity
                log.warning("cannot tell %s the eviction is done: %s", inp.group_id, err)
        return True, evicted

    async def _evict(self, names: list[str]) -> tuple[list[SnapshotReport], str | None]:
        try:
            backends = resolve_backends(names, self._backends())
            return [await backend.snapshot(self.job_id) for backend in backends], None
        except SnapshotError as err:  # the group faults us, or evicts through its activity
            log.warning("co-operative eviction of %s failed: %s", self.job_id, err)
            return [], str(err)

    # ---------------------------------------------------------------- checkpoints on disk

    def _rank_dir(self, epoch_dir: Path) -> Path:
        return epoch_dir / f"rank-{self.rank}"

    def _prune(self) -> None:
        job_dir = self.checkpoint_dir / self.job_id
        epochs = sorted(p for p in job_dir.glob("epoch-*") if p.is_dir())
        for old in epochs[: -self.keep_checkpoints]:
            shutil.rmtree(self._rank_dir(old), ignore_errors=True)
            with contextlib.suppress(OSError):
                old.rmdir()  # only once every rank has pruned it


@contextlib.asynccontextmanager
async def _keep_alive(every_s: float = HEARTBEAT_EVERY_S) -> AsyncIterator[None]:
    """Heartbeat for the whole activity: lock waits, restores and evictions included."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every_s)
            activity.heartbeat()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
