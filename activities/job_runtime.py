"""The activities a job process serves: one RL job rank's model, phases and checkpoints.

The process holds the state the workflow cannot see (model, optimizer, trajectories), so every
activity first checks that the process is where the workflow believes it is — "the model after
epoch N, with epoch N sampled" — and answers ``JobStateLost`` when it is not (it restarted, or a
phase failed midway). The workflow then rewinds to its last checkpoint. GPU phases,
preparation, checkpoints and snapshots take one lock, so a snapshot never races the process's
own GPU work; the rewards phase (no lease, CPU only) does not, so a switch never waits for it.

GPU phases take their lease themselves: the workflow hands the activity a lease order, the
process asks the group through the same lease session as the embedded client (the grant is the
result of a parked update), runs the phase, and releases — so the group's hand-off from one
job's phase to the next involves one workflow task of the group and nothing of either job's
workflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from timeslice.activities.state_homes import StateHomes
from timeslice.errors import TimesliceError
from timeslice.protocol.group import (
    DEFAULT_LEASE_TTL_S,
    GroupQuery,
    GroupUpdate,
    HolderView,
    NextPhase,
    QueueTarget,
    RenewRequest,
    RenewResult,
    SnapshotReport,
    SnapshotTarget,
    group_workflow_id,
    job_task_queue,
    lease_fingerprint,
    lease_key_hash,
)
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    GRANT_NOT_HELD,
    JOB_PROTOCOL_VERSION,
    LEASE_REVOKED,
    MAX_CARRY_REASON,
    PREPARE_ACTIVITY,
    REWARDS_ACTIVITY,
    SAMPLE_ACTIVITY,
    STATE_LOST,
    TRAIN_ACTIVITY,
    CheckpointInput,
    CheckpointRef,
    DescribeInput,
    DescribeResult,
    LeaseOrder,
    PhaseInput,
    PhaseResult,
    PrepareInput,
    PrepareResult,
    protocol_mismatch,
)
from timeslice.session.lease import Lease
from timeslice.session.lease_session import LeaseSession, SessionSettings
from timeslice.session.snapshot_activities import SnapshotActivities
from timeslice.snapshot.base import registered_bytes
from timeslice.snapshot.device_room import DeviceRooms
from timeslice.transport.telemetry import meter, span
from timeslice.transport.updates import send_update
from timeslice.workflows.job_leases import process_lease_source, process_prefetches
from timeslice.workloads.base import JobSpec, PhaseContext, PhaseStopped, Workload

log = logging.getLogger("timeslice.job")
T = TypeVar("T")

HEARTBEAT_EVERY_S = 1.0
# A phase's first heartbeat waits until the phase has run this share of its heartbeat time-out
# (``_heartbeat``).
FIRST_HEARTBEAT_AFTER = 0.25
# Exit status of a job process that stopped itself because work it could not interrupt ran on
# past its lease (see LeaseFence): the GPU is freed with the process.
FENCED_EXIT_STATUS = 75

_PHASE_SECONDS = meter().create_histogram(
    "timeslice_phase_seconds", unit="s", description="one phase's (or checkpoint's) work"
)


def _state_lost(message: str) -> ApplicationError:
    return ApplicationError(message, type=STATE_LOST, non_retryable=True)


def refusal(message: str, error_type: str) -> ApplicationError:
    """An expected refusal (another run, a bad config, another release): one line in the
    process's log, and an error the SDK logs without a traceback (a benign failure) and that
    ends the job with this message."""
    log.warning("refused (%s): %s", error_type, message)
    return ApplicationError(
        message,
        type=error_type,
        non_retryable=True,
        category=ApplicationErrorCategory.BENIGN,
    )


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
        rooms: DeviceRooms | None = None,
    ) -> None:
        """``rooms``: the node's device rooms, which the job's streaming states move through
        (default: ``$TIMESLICE_ROOM_DIR``'s, see ``snapshot/device_room.py``)."""
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
        self._all_backends = list(
            dict.fromkeys([*workload.sampler_backends, *workload.trainer_backends])
        )
        # phase -> the states it uses (a phase brings these in first; see StateHomes.using)
        self._phase_states: dict[str, list[str]] = {}
        # step -> the GPU phase after it: an epoch alternates sample and train, and a
        # checkpoint is followed by the next sample (an async job's loops say nothing here).
        self._next_phase = {"sample": "train", "train": "sample", "checkpoint": "sample"}
        # The same lease session as the embedded client's, hosted on this worker's event loop:
        # it asks groups for leases, renews them and releases them; its inbox takes grants that
        # come as activities on this rank's queue, which this worker serves.
        self.session = LeaseSession(
            SessionSettings(
                connect_config={"target_host": "(the job worker's Temporal client)"},
                job_id=job_id,
                task_queue=job_task_queue(job_id, rank),
            )
        )
        self.homes = StateHomes(
            job_id, self.session.report_moved, rooms if rooms is not None else DeviceRooms()
        )
        self.snapshots = SnapshotActivities(None, self.homes, job_id=job_id)
        # Restores done under a lease this process keeps, reported when it is released.
        self._unreported: dict[str, list[SnapshotReport]] = {}
        # request id -> the acquire of a lease asked for ahead of its phase (see _prefetch)
        self._prefetched: dict[str, asyncio.Future[tuple[Lease, float, float]]] = {}
        self._background: set[asyncio.Future[None]] = set()
        # (workflow id, first run id) of the job workflow this process serves (see _bind).
        self._served: tuple[str, str] | None = None
        # Set once a workflow bound this process: (workflow id, the run that bound it), so the
        # job worker can tell when that run (and the runs it continues as) has ended.
        self.bound = asyncio.Event()
        self.bound_run: tuple[str, str] | None = None

    def attach(self, client: Client) -> None:
        """Use the job worker's client (call from its event loop, before serving)."""
        self.session.settings.connect_config = {
            "target_host": client.service_client.config.target_host
        }
        self.session.attach(client)

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.describe,
            self.prepare,
            self.sample,
            self.compute_rewards,
            self.train,
            self.save_checkpoint,
            self.session.inbox.deliver_grant,
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
        """Refuse another job's call, and (once bound) any workflow but the one it serves."""
        if job_id != self.job_id:
            raise refusal(f"this process serves job {self.job_id!r}, not {job_id!r}", "WrongJob")
        caller = activity.info().workflow_id
        if self._served is not None and caller != self._served[0]:
            raise self._taken(f"workflow {caller!r}")

    def _bind(self, chain_id: str | None) -> None:
        """Serve the calling workflow's chain of runs from now on; refuse a second chain.

        Two workflows driving one process would interleave their epochs on one model; a new
        run of the job (same id, after the first ended) would find the model where the first
        left it. A chain is one workflow id and its first run id (continue-as-new keeps both);
        a restarted process binds to whichever chain calls it first."""
        chain = (activity.info().workflow_id or "", chain_id or "")
        if self._served is None:
            self._served = chain
            self.bound_run = (chain[0], activity.info().workflow_run_id or "")
            self.bound.set()
            log.info("serving workflow %s (runs from %s)", *chain)
            return
        same_id = chain[0] == self._served[0]
        # A workflow of an older release sends no chain id: its workflow id must do.
        if not same_id or (chain[1] and self._served[1] and chain[1] != self._served[1]):
            raise self._taken(f"workflow {chain[0]!r} (runs from {chain[1] or '?'})")

    def _taken(self, caller: str) -> ApplicationError:
        workflow_id, first_run = self._served or ("", "")
        return refusal(
            f"job process {os.getpid()} (job {self.job_id} rank {self.rank}) already serves "
            f"workflow {workflow_id!r} (runs from {first_run}) and refuses {caller}: a job "
            f"process serves one run of its job; restart `timeslice job worker --job-id "
            f"{self.job_id}` to serve a new one",
            "ProcessTaken",
        )

    # ---------------------------------------------------------------- activities

    @activity.defn(name=DESCRIBE_ACTIVITY)
    async def describe(self, inp: DescribeInput) -> DescribeResult:
        self._check_job(inp.job_id)
        mismatch = protocol_mismatch(inp.protocol, JOB_PROTOCOL_VERSION)
        if mismatch is not None:  # before binding: a process of the right release may follow
            raise refusal(mismatch, "ProtocolMismatch")
        self._bind(inp.chain_id)
        try:
            sampler, trainer = self.workload.state_names(inp.options)
        except ValueError as err:
            raise refusal(str(err), "InvalidConfig") from None
        self._all_backends = list(dict.fromkeys([*sampler, *trainer]))
        self._phase_states = {"sample": list(sampler), "train": list(trainer)}
        return DescribeResult(
            workload=self.workload_ref,
            sampler_backends=list(sampler),
            trainer_backends=list(trainer),
            epochs_done=self._epochs_done,
            protocol=JOB_PROTOCOL_VERSION,
        )

    @activity.defn(name=PREPARE_ACTIVITY)
    async def prepare(self, inp: PrepareInput) -> PrepareResult:
        self._check_job(inp.spec.job_id)
        if not any(order.token for order in inp.leases):
            # A job prepares holding all its groups: a call with no lease to check is no job's.
            raise ApplicationError(
                f"job {self.job_id}: a preparation runs under the job's leases, and none was "
                "handed to this process; not starting",
                type=LEASE_REVOKED,
                non_retryable=True,
            )
        spec = JobSpec(
            job_id=inp.spec.job_id,
            seed=inp.spec.seed,
            batch_size=inp.spec.batch_size,
            group_size=inp.spec.group_size,
            options=dict(inp.spec.options),
        )
        fences: list[LeaseFence] = [WorkflowLeaseFence(o) for o in inp.leases if o.token]
        # Before anything touches the device (the state's restore included).
        await _confirm(self, fences)
        async with _keep_alive(), self.homes.using(self._all_backends, None):
            if self._spec is not None and self._spec != spec:
                raise refusal(
                    f"job {self.job_id}: this process was prepared with {self._spec}, now asked "
                    f"for {spec}; restart the job process to change the job's settings",
                    "InvalidConfig",
                )
            if inp.checkpoint is None and self._spec is not None and self._epochs_done != 0:
                raise _state_lost(f"job {self.job_id}: no checkpoint to rewind to; {self._where()}")
            # The job holds its groups under the workflow's leases: reports to those groups
            # about this job's state carry their keys.
            self.session.last_keys.update(inp.lease_keys)
            # A re-preparation (a rewind) loads into the states where the job holds its groups.
            await self.homes.bring(inp.homes)

            def build() -> PrepareResult:
                if self._spec is None:
                    log.info("setting up %s for job %s", self.workload_ref, self.job_id)
                    self.workload.setup(spec)
                    self._spec = spec
                    self._epochs_done = 0
                    self.homes.settle(self.workload.snapshot_backends(), dict(inp.homes))
                if inp.checkpoint is not None:
                    path = self._rank_dir(Path(inp.checkpoint.path))
                    log.info("loading checkpoint %s", path)
                    self.workload.load(path)
                    self._epochs_done = inp.checkpoint.epochs_done
                self._sampled = self._rewarded = None
                return PrepareResult(
                    epochs_done=self._epochs_done or 0,
                    state_bytes=self.workload.state_bytes(),
                    backend_bytes={
                        name: registered_bytes(backend)
                        for name, backend in self.workload.snapshot_backends().items()
                    },
                )

            return await self._supervise(
                build, PhaseContext(0, "prepare"), fences, _check_every(fences)
            )

    @activity.defn(name=SAMPLE_ACTIVITY)
    async def sample(self, inp: PhaseInput) -> PhaseResult:
        check = functools.partial(self._expect, inp.epoch)
        result = await self._phase(inp, check, self.workload.sample)
        self._sampled = inp.epoch
        return result

    @activity.defn(name=REWARDS_ACTIVITY)
    async def compute_rewards(self, inp: PhaseInput) -> PhaseResult:
        check = functools.partial(self._expect, inp.epoch, sampled=True)
        result = await self._phase(inp, check, self.workload.compute_rewards)
        self._rewarded = inp.epoch
        return result

    @activity.defn(name=TRAIN_ACTIVITY)
    async def train(self, inp: PhaseInput) -> PhaseResult:
        check = functools.partial(self._expect, inp.epoch, sampled=True, rewarded=True)
        result = await self._phase(inp, check, self.workload.train)
        self._epochs_done = inp.epoch + 1
        self._sampled = self._rewarded = None
        return result

    @activity.defn(name=CHECKPOINT_ACTIVITY)
    async def save_checkpoint(self, inp: CheckpointInput) -> CheckpointRef:
        self._check_job(inp.job_id)
        epoch_dir = self.checkpoint_dir / self.job_id / f"epoch-{inp.epochs_done:06d}"
        group_id = inp.lease.group_id if inp.lease is not None else None
        lease = self._owned(inp.lease) if inp.release else None
        try:
            fences = self._fences(inp.lease, lease)
            await _confirm(self, fences)
            async with _keep_alive(), self.homes.using(inp.backends, group_id) as restored:
                self._expect(inp.epochs_done)

                def save() -> None:
                    final = self._rank_dir(epoch_dir)
                    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
                    shutil.rmtree(partial, ignore_errors=True)
                    partial.mkdir(parents=True)
                    self.workload.save(partial)
                    shutil.rmtree(final, ignore_errors=True)  # a re-save after a rewind
                    partial.rename(final)
                    self._prune()

                ctx = PhaseContext(inp.epochs_done, "checkpoint")
                await self._supervise(save, ctx, fences, _check_every(fences))
                if lease is not None:
                    # A state the last phase did not use may have come back for the checkpoint.
                    self._yield_in_background(lease, inp.backends, restored)
                    lease = None
        finally:
            if lease is not None:  # failed: the group must not wait for this lease's TTL
                await self._abandon(lease)
        if inp.prefetch is not None:
            self._prefetch(inp.prefetch, inp.prefetch_backends, self._phase_after("checkpoint"))
        log.info("checkpoint after %d epochs: %s", inp.epochs_done, epoch_dir)
        return CheckpointRef(epochs_done=inp.epochs_done, path=str(epoch_dir.resolve()))

    # ---------------------------------------------------------------- running phases

    async def _phase(
        self,
        inp: PhaseInput,
        check: Callable[[], None],
        step: Callable[[int, PhaseContext], dict[str, float]],
    ) -> PhaseResult:
        """One phase of an epoch: ``check`` that this process is where the workflow believes,
        take the phase's lease (unless the workflow holds it), run ``step`` under it, hand it
        back as the workflow ordered, and ask ahead for the next phase's lease."""
        self._check_job(inp.job_id)
        async with _keep_alive():
            check()
            order = inp.lease
            lease, asked, granted = await self._lease_for(order, inp.group_backends)
            owned = lease is not None
            token = lease.token if lease is not None else (order.token if order else None)
            try:
                fences = self._fences(order, lease)
                await _confirm(self, fences)
                self._refuse_if_gone(fences)  # a lease asked ahead may have ended meanwhile
                # Only GPU phases use the state: the rewards phase runs while other jobs hold
                # the group, and a switch that evicts this job must not wait for it.
                names = inp.group_backends if order is not None else []
                # The phase waits only for its own states; the job's others on this group
                # come in behind it when its next phase follows here under this lease.
                uses = [n for n in names if n in self._phase_states.get(inp.phase, names)]
                async with self.homes.using(
                    names, inp.group_id, first=uses, ahead=inp.carry_into is not None
                ) as restored:
                    self._refuse_if_gone(fences)  # the restore may have waited long for room
                    started = time.monotonic()
                    metrics = await self._run_step(inp, step, fences, token)
                    ended = time.monotonic()
                    # Reported with this lease (the next phase's bytes, moved under it).
                    ahead = await self.homes.brought_ahead(inp.group_id)
                    released_at = time.monotonic()
                    released, kept, carry = await self._hand_back(
                        lease, inp, names, [*restored, *ahead]
                    )
                    lease = None
            finally:
                if lease is not None:  # the phase failed: hand the group on now, not at its TTL
                    await self._abandon(lease)
            asked_ahead = None
            if inp.prefetch is not None:
                asked_ahead = self._prefetch(
                    inp.prefetch, inp.prefetch_backends, self._phase_after(inp.phase)
                )
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
            wall_offset_s=time.time() - time.monotonic(),
            group_id=inp.group_id,
            token=token,
            request_id=order.request_id if order is not None else None,
            waited_s=(granted - asked) if asked is not None and granted is not None else 0.0,
            asked_mono=asked,
            granted_mono=granted,
            released_mono=released_at if released else None,
            released=released,
            kept=kept and owned,
            carry=carry,
            restored=restored,
            asked_ahead=asked_ahead,
        )

    async def _run_step(
        self,
        inp: PhaseInput,
        step: Callable[[int, PhaseContext], dict[str, float]],
        fences: list[LeaseFence],
        token: int | None,
    ) -> dict[str, float]:
        """Run the phase's work, supervised under ``fences`` (the lease's fencing ``token`` in its
        context); work that failed may have left the state halfway, and then only a checkpoint
        fixes it."""
        ctx = PhaseContext(inp.epoch, inp.phase, lease_token=token)
        try:
            return await self._supervise(
                lambda: step(inp.epoch, ctx), ctx, fences, inp.lease_check_s, inp.timeout_s
            )
        except BaseException:
            self._sampled = self._rewarded = None
            if inp.phase == "train":
                self._epochs_done = None
            raise

    async def _hand_back(
        self,
        lease: Lease | None,
        inp: PhaseInput,
        names: list[str],
        restored: list[SnapshotReport],
    ) -> tuple[bool, bool, str]:
        """What becomes of the phase's own lease, as the workflow ordered (``inp.release``):
        released in the background ("always"), released unless the group keeps it for the next
        phase ("if_contended"), or kept. Returns (released, kept, the group's carry reason)."""
        if lease is None:
            return False, False, ""
        if inp.release == "always":
            # Sent now, answered after this activity returns: the job's next step does not
            # wait for the group's answer (nor for an eviction it asks).
            self._yield_in_background(lease, names, restored)
            return True, False, ""
        if inp.release == "if_contended":
            # keep_if_uncontended says what a group of any release understands; carry_into
            # lets the group's grant policy keep it past waiters too.
            return await self._yield(
                lease,
                names,
                restored=restored,
                keep_if_uncontended=True,
                carry_into=inp.carry_into,
            )
        self._unreported.setdefault(lease.request_id, []).extend(restored)
        return False, True, ""

    # ---------------------------------------------------------------- leases

    async def _lease_for(
        self, order: LeaseOrder | None, names: list[str]
    ) -> tuple[Lease | None, float | None, float | None]:
        """The lease a phase runs under: (this process's lease or None, asked, granted).

        A new order is acquired here — the grant comes straight to this process; a carried
        one must still be valid; a workflow's lease is the workflow's to renew and release."""
        source = process_lease_source(
            order, prefetched=order is not None and order.request_id in self._prefetched
        )
        if order is None or source == "none" or source == "workflow":
            return None, None, None
        if source == "carried":
            return self._owned(order), None, None
        if source == "prefetched":  # asked for when the job's previous step ended
            return await self._prefetched.pop(order.request_id)
        return await self._acquire_order(order, names)

    async def _acquire_order(
        self, order: LeaseOrder, names: list[str]
    ) -> tuple[Lease, float, float]:
        stale = self.session.held.get(order.group_id)
        if stale is not None:
            # The workflow moved on from it (a failure, a rewind): hand it back first.
            await self._abandon(stale)
        asked = time.monotonic()
        try:
            lease = await self.session.acquire(
                order.group_id,
                order.timeout_s,
                order.priority,
                order.ttl_s,
                request_id=order.request_id,
                key=order.key,
                snapshot=SnapshotTarget(
                    queues=[
                        QueueTarget(
                            task_queue=self.session.task_queue,
                            backends=names,
                            room=self.homes.room_id(names),
                            on_host=self.homes.on_host(names),
                        )
                    ]
                )
                if names
                else None,
                state_bytes=order.state_bytes,
                restores_itself=True,
            )
        except TimesliceError as err:
            raise ApplicationError(
                f"job {self.job_id}: {err}", type=type(err).__name__, non_retryable=True
            ) from None
        # What the group's device room holds this job's restores to (streamed switches).
        self.homes.set_memory(order.group_id, lease.memory_bytes)
        return lease, asked, time.monotonic()

    def _refuse_if_gone(self, fences: list[LeaseFence]) -> None:
        """Start no work (and no restore) under a lease this process can no longer vouch for:
        revoked, or past its local bound (a lease asked ahead whose renewals failed while the
        job was off the GPU, say). The phase fails with ``LeaseRevoked`` and nothing ran."""
        now = time.monotonic()
        for fence in fences:
            why = fence.gone(now)
            if why is not None:
                raise ApplicationError(
                    f"job {self.job_id}: {why}; not starting", type=LEASE_REVOKED,
                    non_retryable=True,
                )  # fmt: skip

    def _fences(self, order: LeaseOrder | None, lease: Lease | None) -> list[LeaseFence]:
        """What fences work under ``order``: this process's own lease, or the workflow's."""
        if lease is not None:
            return [OwnLeaseFence(lease)]
        if order is not None and order.held_by == "workflow" and order.token is not None:
            # The job's latest lease there: what this process's reports and departure carry.
            self.session.last_keys[order.group_id] = order.key
            return [WorkflowLeaseFence(order)]
        return []

    async def depart(self, timeout_s: float = 10.0) -> None:
        """A normal exit: hand back what this process still holds and tell each group the job
        was resident on that its state leaves the device with the process — so the group's
        next holder does not wait for an eviction nobody picks up."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)
        try:
            # An eviction still running in the background reports its bytes to its group
            # before the process says it left (the group counts every byte moved once).
            await asyncio.wait_for(self.homes.settled(), timeout_s)
        except TimeoutError:
            log.warning(
                "job %s: an eviction outlasted %s s; leaving without it", self.job_id, timeout_s
            )
        self.homes.leaving()
        for lease in list(self.session.held.values()):
            await self._abandon(lease)
        groups = list(self.session.last_keys)
        if groups:
            departures = [self.session._depart(group_id) for group_id in groups]
            await asyncio.wait_for(asyncio.gather(*departures), timeout_s)
            log.info("departed %s", ", ".join(groups))

    def _owned(self, order: LeaseOrder | None) -> Lease:
        """A lease this process holds and still may use (carried from the previous phase)."""
        lease = self.session.held.get(order.group_id) if order is not None else None
        if order is None or lease is None or lease.token != order.token or not lease.valid:
            where = "no lease" if order is None else f"the lease on {order.group_id}"
            raise ApplicationError(
                f"job {self.job_id}: {where} (token {order.token if order else None}) is no "
                "longer held by this process; not starting",
                type=LEASE_REVOKED,
                non_retryable=True,
            )
        return lease

    def _phase_after(self, step: str) -> str | None:
        """The GPU phase a lease asked for ahead after ``step`` is for (None: not known)."""
        return self._next_phase.get(step)

    def _prefetch(self, order: LeaseOrder, names: list[str], phase: str | None = None) -> bool:
        """Ask for the job's next GPU phase's lease now, as this step ends: the request
        reaches the group one workflow round trip sooner than if the next phase's activity
        asked when it starts, and the grant waits in this process for that activity. The
        workflow cancels the request if the phase never comes. Returns whether the acquire
        went out (now or before): not while this process still holds the group, whose lease
        the next phase carries; the workflow then forgets the order rather than cancel it.

        Once granted, the states that phase (``phase``) uses come in at once: a grant that
        arrives while the job is still off the GPU (its rewards) finds the switch's restore
        done when the phase starts, instead of starting it then."""
        if process_prefetches(
            order,
            asked=order.request_id in self._prefetched,
            holds_group=order.group_id in self.session.held,
        ):
            uses = [n for n in names if n in self._phase_states.get(phase or "", [])]

            async def ask() -> tuple[Lease, float, float]:
                granted = await self._acquire_order(order, names)
                if uses:
                    self.homes.bring_early(uses, order.group_id)
                return granted

            asking = asyncio.ensure_future(ask())
            # Retrieved by the phase; a failure is raised there (or the workflow cancels it).
            asking.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._prefetched[order.request_id] = asking
        return order.request_id in self._prefetched

    def _yield_in_background(
        self, lease: Lease, names: list[str], restored: list[SnapshotReport]
    ) -> None:
        """Release ``lease`` without waiting for the answer; the states it covers stay
        claimed until the answer (and the eviction it may ask for) is done."""
        claim = self.homes.claim(names)
        # No longer this process's to use: a lease asked for next on the same group must not
        # find it and hand it back a second time.
        if self.session.held.get(lease.group_id) is lease:
            del self.session.held[lease.group_id]

        async def release() -> None:
            try:
                await self._yield(lease, names, restored=restored, keep_if_uncontended=False)
            finally:
                await claim.done()

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _yield(
        self,
        lease: Lease,
        names: list[str],
        *,
        restored: list[SnapshotReport] | None = None,
        keep_if_uncontended: bool,
        carry_into: NextPhase | None = None,
    ) -> tuple[bool, bool, str]:
        """Release ``lease`` (or keep it when nobody waits and that was asked); if another job
        takes the group, move this job's state out and report it (co-operative eviction).

        The group decides in the workflow task that grants the next holder; when both states
        fit in the group's declared memory the next holder's restore overlaps this eviction,
        otherwise the group waits for the report. Returns (released, kept, the group's reason
        for a carry it was asked for)."""
        restored = [*self._unreported.get(lease.request_id, []), *(restored or [])]
        try:
            answer = await self.session.release_lease(
                lease,
                restored=restored,
                keep_if_uncontended=keep_if_uncontended,
                carry_into=carry_into,
                evicts_itself=bool(names),
                reports_with_next=True,
            )
        except Exception as err:  # the group revokes it at its TTL (renewals stopped)
            log.warning("cannot release %s from the job process: %s", lease.group_id, err)
            self.session.forget(lease)
            return False, False, ""
        if not answer.valid:
            self._unreported.pop(lease.request_id, None)
            return False, False, ""
        # Valid, kept or not: the group counted what this release reported (kept, it would
        # count them a second time at the next one).
        self._unreported.pop(lease.request_id, None)
        if not answer.released:
            return False, True, answer.reason[:MAX_CARRY_REASON]
        if answer.evict:
            # The copy runs after this activity returns: the job's next step (rewards, or a
            # phase on another group) does not wait for it; the next use of this state does.
            self.homes.evict_in_background(
                names, lease.group_id, report_with_next=answer.report_with_next
            )
        return True, False, answer.reason[:MAX_CARRY_REASON]

    async def _abandon(self, lease: Lease) -> None:
        self._unreported.pop(lease.request_id, None)
        with contextlib.suppress(Exception):
            await asyncio.shield(self.session.release_lease(lease))

    async def _supervise(
        self,
        work: Callable[[], T],
        ctx: PhaseContext,
        fences: list[LeaseFence],
        lease_check_s: float,
        timeout_s: float | None = None,
    ) -> T:
        """:meth:`_supervised` in a ``timeslice.phase.<phase>`` span (under the activity's)."""
        attributes = {
            "timeslice.job_id": self.job_id,
            "timeslice.rank": self.rank,
            "timeslice.epoch": ctx.epoch,
            "timeslice.group_id": fences[0].group_id if fences else None,
            "timeslice.token": fences[0].token if fences else None,
        }
        started = time.monotonic()
        with span(f"timeslice.phase.{ctx.phase}", attributes):
            result = await self._supervised(work, ctx, fences, lease_check_s, timeout_s)
        _PHASE_SECONDS.record(time.monotonic() - started, {"phase": ctx.phase, "job": self.job_id})
        return result

    async def _supervised(
        self,
        work: Callable[[], T],
        ctx: PhaseContext,
        fences: list[LeaseFence],
        lease_check_s: float,
        timeout_s: float | None,
    ) -> T:
        """Run ``work`` in a thread; heartbeat; stop it if a lease goes (or cannot be
        confirmed in time: see LeaseFence), its time is up or we are cancelled."""
        await _confirm(self, fences)
        running = asyncio.ensure_future(asyncio.to_thread(ctx.run, work))
        next_check = time.monotonic() + lease_check_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        checking: asyncio.Future[Any] | None = None
        lost = False
        try:
            while True:
                now = time.monotonic()
                wake = HEARTBEAT_EVERY_S
                if fences:
                    due = _exit_at(ctx, fences) if lost else min(f.stop_at() for f in fences)
                    wake = min(wake, max(0.01, due - now))
                done, _ = await asyncio.wait({running}, timeout=wake)
                if done:
                    break
                _heartbeat(ctx.latest_progress())
                now = time.monotonic()
                if deadline is not None and now >= deadline and not ctx.stopped:
                    ctx.stop(f"its time ran out ({timeout_s:g} s)")
                for fence in fences:
                    why = fence.gone(now)
                    if why is not None and not lost:
                        lost = True
                        log.warning("job %s %s: stopping: %s", self.job_id, ctx.phase, why)
                        ctx.stop(why)
                if lost:
                    self._fence_or_exit(ctx, fences)
                if checking is not None and checking.done():
                    checking = None
                    next_check = time.monotonic() + lease_check_s
                if fences and checking is None and now >= next_check and not lost:
                    # In the background: a check that hangs (a stalled connection) must not
                    # hold up the bound above.
                    checking = asyncio.ensure_future(
                        asyncio.gather(
                            *(f.check(self, max(0.5, lease_check_s)) for f in fences),
                            return_exceptions=True,
                        )
                    )
        except asyncio.CancelledError:
            # Never leave a phase running past its activity: a snapshot would race it.
            ctx.stop("the activity was cancelled")
            await self._await_stopped(running, ctx, fences)
            raise
        finally:
            if checking is not None:
                checking.cancel()
        try:
            return running.result()
        except PhaseStopped as stopped:
            raise ApplicationError(
                f"job {self.job_id} {ctx.phase} of epoch {ctx.epoch} stopped: {stopped}",
                type=LEASE_REVOKED,
                non_retryable=True,
            ) from None

    async def _await_stopped(
        self, running: asyncio.Future[Any], ctx: PhaseContext, fences: list[LeaseFence]
    ) -> None:
        """Wait for stopped work to end, fencing it as the loop above does."""
        while not running.done():
            wake = HEARTBEAT_EVERY_S
            if fences:
                wake = min(wake, max(0.01, _exit_at(ctx, fences) - time.monotonic()))
            with contextlib.suppress(BaseException):
                await asyncio.wait({asyncio.shield(running)}, timeout=wake)
            if not running.done():
                self._fence_or_exit(ctx, fences)
        with contextlib.suppress(BaseException):
            running.result()

    def _fence_or_exit(self, ctx: PhaseContext, fences: list[LeaseFence]) -> None:
        """Work told to stop (a lease lost) that still runs when its lease may end at the
        group — the code does not check its context (a model load, a checkpoint write) — is
        stopped the only way there is: this process exits, and its device memory and GPU work
        go with it. The job workflow sees a dead process and rewinds."""
        if not fences or not ctx.stopped or time.monotonic() < _exit_at(ctx, fences):
            return
        log.critical(
            "job %s rank %d: %s did not stop when told to (%s) and its lease may now pass to "
            "another holder; exiting so that nothing of it runs on the GPU any more",
            self.job_id,
            self.rank,
            ctx.phase,
            ctx.stop_reason,
        )
        logging.shutdown()
        os._exit(FENCED_EXIT_STATUS)

    async def _holder(self, group_id: str) -> HolderView | None:
        handle = activity.client().get_workflow_handle(group_workflow_id(group_id))
        return await handle.query(GroupQuery.HOLDER, result_type=HolderView | None)  # type: ignore[arg-type]

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


def _check_every(fences: list[LeaseFence]) -> float:
    """How often work under ``fences`` checks them: four times a TTL, at most every 5 s."""
    return max(0.5, min([5.0, *(f.ttl_s / 4 for f in fences)]))


class LeaseFence:
    """Whether work may go on under one lease, by this process's own reckoning.

    The process decides for itself: it runs on while the control worker (and with it the job
    workflow and the group) is down, or while Temporal cannot be reached. A check that gets no
    answer counts as "still held" only until ``held_until`` — a local bound that always ends
    before the group's own expiry, because it runs from when an answer that extended the lease
    was *sent* — and the work is told to stop ``margin_s`` before it."""

    def __init__(self, group_id: str, token: int, ttl_s: float) -> None:
        self.group_id = group_id
        self.token = token
        self.ttl_s = ttl_s
        self.margin_s = max(0.2, min(5.0, ttl_s / 4))
        self.revoked: str | None = None

    @property
    def name(self) -> str:
        return f"the lease on {self.group_id} (token {self.token})"

    def held_until(self) -> float:
        raise NotImplementedError

    def stop_at(self) -> float:
        return self.held_until() - self.margin_s

    def gone(self, now: float) -> str | None:
        """Why the work must stop now, or None."""
        if self.revoked is not None:
            return f"{self.name} was revoked: {self.revoked}"
        if now >= self.stop_at():
            since = now - (self.held_until() - self.ttl_s)
            return (
                f"{self.name} was not confirmed within its {self.ttl_s:g}-s TTL (the group "
                f"last answered {since:.1f} s ago): it may pass to another holder"
            )
        return None

    async def check(self, runtime: JobRuntime, timeout_s: float) -> None:
        raise NotImplementedError


class OwnLeaseFence(LeaseFence):
    """A lease this process holds (its lease session renews it): ``Lease.valid`` is the bound, and
    the holder query notices a revocation sooner than the next renewal would."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(lease.group_id, lease.token, lease.ttl_s)
        self.lease = lease
        # A grant not yet confirmed is valid only until the group's deadline for confirming
        # it (grant_ack_timeout_s, which may be far shorter than the TTL); the session renews a
        # third of the way in. The margin fits that window, or the work would stop before the
        # first renewal could extend it.
        window = lease.valid_until - time.monotonic()
        self.margin_s = max(0.2, min(self.margin_s, window / 4))

    def held_until(self) -> float:
        lease = self.lease
        if lease.released or lease.revoked_reason is not None:
            return 0.0
        return lease.valid_until

    def gone(self, now: float) -> str | None:
        if self.revoked is None and self.lease.revoked_reason is not None:
            self.revoked = self.lease.revoked_reason
        return super().gone(now)

    async def check(self, runtime: JobRuntime, timeout_s: float) -> None:
        try:
            holder = await asyncio.wait_for(runtime._holder(self.group_id), timeout_s)
        except Exception as err:  # no answer is no proof the lease is gone: the bound decides
            log.warning("cannot check the lease on %s: %s", self.group_id, err)
            return
        why = _not_this_lease(holder, self.token, self.lease.key)
        if why is not None:
            self.revoked = why


class WorkflowLeaseFence(LeaseFence):
    """A lease the job workflow holds and renews (preparing, checkpoints, several ranks).

    The process renews it too, by the group's ``renew`` update: the answer comes from the
    group's workflow task, so "sent + TTL" is a bound the group's expiry never precedes (a
    query's answer is as of the group's last task, which may be long past). Before any work,
    the holder query tells whether the lease handed over is the group's current one at all —
    by its key, not only its token, which anyone may read off `timeslice status`."""

    def __init__(self, order: LeaseOrder) -> None:
        assert order.token is not None
        super().__init__(order.group_id, order.token, order.ttl_s or DEFAULT_LEASE_TTL_S)
        self.order = order
        self._held_until = 0.0

    def held_until(self) -> float:
        return self._held_until

    @property
    def confirmed(self) -> bool:
        return self._held_until > 0

    async def confirm(self, runtime: JobRuntime) -> None:
        """Before the work starts: the lease must be the group's current one, and renewed
        (tried for up to half its TTL: a slow answer is no lost lease)."""
        timeout_s = _check_every([self])
        give_up = time.monotonic() + self.ttl_s / 2
        problem = ""
        while True:
            _heartbeat()
            try:
                holder = await asyncio.wait_for(runtime._holder(self.group_id), timeout_s)
            except Exception as err:
                problem = f"its group could not be asked ({err})"
            else:
                why = _not_this_lease(holder, self.token, self.order.key)
                if why is not None:
                    raise self._refusal(why, not_held=True)
                await self.check(runtime, timeout_s)
                if self.revoked is not None:
                    raise self._refusal(self.revoked, not_held=True)
                if self._held_until > time.monotonic():
                    return
                problem = "its renewal was not answered"
            if time.monotonic() >= give_up:
                raise self._refusal(problem)
            await asyncio.sleep(min(1.0, timeout_s))

    def _refusal(self, why: str, *, not_held: bool = False) -> ApplicationError:
        """Why no work starts: the group says the lease is not its holder's (``not_held``:
        ``GrantNotHeld``, nothing ran, the workflow asks again), or it could not be confirmed
        in time (``LeaseRevoked``)."""
        return ApplicationError(
            f"{self.name}, handed to this process, is not held: {why}; not starting",
            type=GRANT_NOT_HELD if not_held else LEASE_REVOKED,
            non_retryable=True,
        )

    async def check(self, runtime: JobRuntime, timeout_s: float) -> None:
        order = self.order
        renew = RenewRequest(request_id=order.request_id, token=self.token, key=order.key)
        sent = time.monotonic()
        try:
            answer = await asyncio.wait_for(
                send_update(
                    activity.client(),
                    group_workflow_id(self.group_id),
                    GroupUpdate.RENEW,
                    renew,
                    RenewResult,
                    give_up_after_s=timeout_s,
                ),
                timeout_s,
            )
        except Exception as err:  # the bound decides
            log.warning("cannot renew the lease on %s: %s", self.group_id, err)
            return
        if not answer.valid:
            self.revoked = answer.reason
        else:
            self._held_until = max(self._held_until, sent + answer.ttl_s)


def _exit_at(ctx: PhaseContext, fences: list[LeaseFence]) -> float:
    """When work that was told to stop, and still runs, makes the process exit: halfway from
    the stop to the local bound, and never sooner than that after the stop was asked."""
    margin = max(f.margin_s for f in fences)
    bound = min(f.held_until() for f in fences) - margin / 2
    return max(bound, ctx.stopped_at + margin / 2)


async def _confirm(runtime: JobRuntime, fences: list[LeaseFence]) -> None:
    """Confirm the workflow's leases among ``fences`` that are not confirmed yet."""
    for fence in fences:
        if isinstance(fence, WorkflowLeaseFence) and not fence.confirmed:
            await fence.confirm(runtime)


def _not_this_lease(holder: HolderView | None, token: int, key: str) -> str | None:
    """Why the group's current holder is not the lease of ``token`` and ``key``, or None."""
    if holder is None:
        return "the group has no holder"
    if holder.token != token:
        return f"the group's holder has token {holder.token}"
    if holder.fingerprint and holder.fingerprint != lease_fingerprint(lease_key_hash(key), token):
        return "the lease key does not match the group's holder's"
    return None


def _heartbeat(*details: Any) -> None:
    """Heartbeat, once the activity has run ``FIRST_HEARTBEAT_AFTER`` of its heartbeat time-out.

    The SDK sends an activity's first heartbeat at once, and each is a write on the server;
    a phase shorter than its heartbeat time-out needs none (the time-out counts from the
    activity's start), and most phases are: they cost the server 1.7 heartbeats per GPU phase
    (BENCHMARKS.md, "Phase boundaries: the control worker outside the sandbox"). Later ones the
    SDK throttles to one per 0.8 time-outs, as before. A cancellation reaches a phase with a
    heartbeat's answer, so one asked in its first quarter time-out arrives at that point (the
    phase's own lease checks stop its work sooner when the lease goes). The age is read on
    the server's clock (the attempt's start) against this host's: a quarter of the time-out
    leaves three quarters for skew."""
    info = activity.info()
    timeout = info.heartbeat_timeout
    young = (
        timeout
        and info.started_time is not None
        and datetime.now(UTC) - info.started_time < timeout * FIRST_HEARTBEAT_AFTER
    )
    if not young:
        activity.heartbeat(*details)


@contextlib.asynccontextmanager
async def _keep_alive(every_s: float = HEARTBEAT_EVERY_S) -> AsyncIterator[None]:
    """Heartbeat for the whole activity: lock waits, restores and evictions included."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every_s)
            _heartbeat()

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
