"""A discrete-event simulator of jobs taking turns on GPU groups, by the real protocol's rules.

What it models, each rule taken from the code it stands for:

- **the group** (``workflows/group_book.py``): one holder at a time; the next holder is the
  waiter with the highest ``priority + waited / aging_s``, first come first served among
  equals (``grant_policy.next_waiter``, called here as ``GroupBook`` calls it); sticky
  residency (a release with nobody waiting leaves the state on the device); when the group's
  ``memory_bytes`` holds both jobs' states the next holder is granted at once and its restore
  overlaps the eviction, otherwise the grant waits for the eviction's report; while a holder
  works, the waiter served next (an RL job the group evicted, whose last restore here took at
  least ``STAGE_MIN_RESTORE_S``) has its states restored beside the lease when they fit
  beside the holder's and an eviction under way (a staged restore, ``GroupSwitch.stage_next``);
  a staged job passed over is evicted again before the other job's grant.
- **the grant policy** (``workflows/grant_policy.py``, called here, not copied): a holder whose
  next GPU phase on the same group follows at once asks to *carry* its lease into it (what
  ``LeaseReturn.carry_into`` says), stating that phase's length (the step's mean: a job knows
  its phases from its own records). Nobody waiting, the lease is kept under every policy;
  under ``fifo`` it goes to a waiter; under ``phase_aware`` (the default) :func:`decide_carry`
  keeps it past waiters within the group's ``max_carries`` (counted per lease),
  ``carry_limit_s`` and the waiting-share rule, the shares recorded at each grant as
  ``GroupBook.grant`` does (the time the request reached the group, and the wait until the
  grant), of other jobs than the holder's own;
- **RL jobs** (``workflows/rl_job.py``, ``activities/job_runtime.py``): each GPU phase takes its
  own lease; the lease of a job's next GPU phase is asked for as its previous step ends
  (prefetch); a GPU phase releases as it ends, except that a phase followed by a GPU phase on
  the same group asks to carry its lease into it (the grant policy above); a checkpoint runs
  under the trainer lease after train every ``checkpoint_every`` epochs and at the end (that
  lease is released after it, carrying nothing); the job moves its own state: it restores
  before its phase and, when its release is answered "evict", evicts after it (co-operative
  switching); a state another group holds is moved out of there first (states move with the
  lease).
- **async RL jobs** (``workflows/async_rl_job.py``; a :class:`Placement` with
  ``max_staleness``, which a profile with ``mode: async`` gives by itself): two loops at
  once, each an actor of its own — the sampler loop (the phases off the trainer pool, in
  order) and the trainer loop (the trainer pool's phases) — handing batches over in order.
  The sampler starts a batch only while no batch would be trained more than
  ``max_staleness`` steps after the weights it is sampled with (the weights are published
  every ``sync_every`` steps), the trainer trains one batch per step; every GPU phase asks
  for its lease as its activity starts and releases as it ends (no ask ahead, no carry),
  and the trainer checkpoints as a sync job's does.
- **client jobs** (``timeslice.TimeSliceOrchestratorClient``): acquire, hold, release (the
  release is awaited, and carries nothing: a plain acquire), work off the GPU, acquire again;
  the group evicts and restores their state with its own activities.
- **the protocol's own costs** (:class:`~timeslice.plan.profile.Overheads`): a message's way
  to the group and back, a job's hop from one activity to the next, the carried lease's gap.

With :meth:`Overheads.zero` and no states it is the *ideal* the benchmarks compare against:
what the same jobs reach under the same grant policy when switching costs nothing
(``bench/replay.py``, which prints beside it the jobs' summed GPU demand, the bound no policy
beats).

Figures: a group's **utilization while jobs ran** (``timeslice.protocol.utilization``, the
definition `timeslice status` and `timeslice report` use) = the time GPU phases ran on it /
wall time from its first phase start to its last phase end (restores, evictions,
checkpoints and gaps count as not busy); a job's **completion** = its first phase start to
its last phase end. With ``record=True`` the outcome also lists each group's asks, grants and
releases (:class:`GroupEvent`), which ``tests/unit/test_sim_policy.py`` replays through
``GroupBook``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack

from timeslice.plan.profile import JobProfile, Overheads, Seconds, StateProfile
from timeslice.protocol.group import (
    DEFAULT_AGING_S,
    DEFAULT_CARRY_LIMIT_S,
    DEFAULT_GRANT_POLICY,
    DEFAULT_MAX_CARRIES,
    DEFAULT_SHARE_SLACK,
    STAGE_MIN_RESTORE_S,
    GrantPolicy,
)
from timeslice.protocol.staleness import may_sample, publishes_after, sync_every_problem, trained_by
from timeslice.protocol.utilization import WHILE_JOBS_RAN, Utilization
from timeslice.workflows.grant_policy import (
    Carry,
    CarryLimits,
    decide_carry,
    next_waiter,
    record_wait,
    remember_job,
    waiting_share,
)

DEFAULT_MOVE_BYTES_PER_S = 25e9  # a host <-> device copy over PCIe Gen4 x16, roughly
SegmentKind = Literal["phase", "restore", "evict", "checkpoint", "wait", "lease"]
GroupEventKind = Literal["ask", "grant", "release"]


@dataclass(frozen=True)
class Placement:
    """A job on its groups (its sampler and trainer pools may be one group)."""

    profile: JobProfile
    sampler_group: str
    trainer_group: str
    start_s: float = 0.0
    epochs: int | None = None  # default: the profile's
    # An async RL job (None: sync): the staleness bound and the steps between weight syncs.
    # Left out, they are the profile's (an async profile places an async job).
    max_staleness: int | None = None
    sync_every: int | None = None

    def __post_init__(self) -> None:
        p = self.profile
        if self.max_staleness is None and p.is_async:
            object.__setattr__(self, "max_staleness", p.max_staleness)
        if self.sync_every is None:
            object.__setattr__(self, "sync_every", (p.sync_every if p.is_async else None) or 1)

    @property
    def steps_between_syncs(self) -> int:
        return self.sync_every or 1

    def group_of(self, pool: str) -> str:
        return self.sampler_group if pool == "sampler" else self.trainer_group


@dataclass(frozen=True)
class GroupSpec:
    """A group's settings, as its ``GroupConfig`` has them (same defaults)."""

    memory_bytes: int | None = None
    aging_s: float = DEFAULT_AGING_S
    # The group grants nothing before this (the jobs' preparation held it; bench/plan_check.py
    # lines a simulated run up with a real one this way).
    opens_s: float = 0.0
    grant_policy: GrantPolicy = DEFAULT_GRANT_POLICY
    max_carries: int = DEFAULT_MAX_CARRIES
    carry_limit_s: float = DEFAULT_CARRY_LIMIT_S
    share_slack: float = DEFAULT_SHARE_SLACK
    # The group stages the next waiter's restore while the holder works (groups that started
    # before the ``staged-restores`` patch do not).
    staged_restores: bool = True

    def __post_init__(self) -> None:
        try:
            policy = GrantPolicy(self.grant_policy)
        except ValueError:
            names = ", ".join(p.value for p in GrantPolicy)
            raise ValueError(f"grant policy {self.grant_policy!r}: use one of {names}") from None
        object.__setattr__(self, "grant_policy", policy)
        if self.max_carries < 0 or self.carry_limit_s <= 0 or not 0 <= self.share_slack <= 1:
            raise ValueError(
                "max_carries must be >= 0, carry_limit_s > 0 and share_slack within 0..1"
            )

    @property
    def limits(self) -> CarryLimits:
        return CarryLimits(
            self.grant_policy, self.max_carries, self.carry_limit_s, self.share_slack
        )


@dataclass(frozen=True)
class Segment:
    """One interval of the simulated timeline: a phase (on its group, or none), a state moving
    in or out, a checkpoint, a job waiting for its grant, or a group leased to a job."""

    job_id: str
    group_id: str | None
    phase: str
    epoch: int
    start: float
    end: float
    kind: SegmentKind = "phase"


@dataclass(frozen=True)
class GroupEvent:
    """What a group saw (recorded with ``record=True``): a request reaching it, a grant, or a
    release; a release that asked to carry names the next phase, its stated length, and the
    decision (kept or not, and why)."""

    time: float
    group_id: str
    job_id: str
    event: GroupEventKind
    carry_into: str | None = None
    expected_s: float = 0.0
    kept: bool = False
    reason: str = ""


@dataclass
class GroupResult:
    busy_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0
    leases: int = 0
    switches: int = 0
    carried: int = 0  # leases kept past waiters into their holder's next phase
    bytes_moved: int = 0
    staged_restores: int = 0  # a waiter's states brought in while the holder worked
    staged_unused: int = 0  # ... and taken off again: another job was granted first
    holds: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.first_start is None else self.last_end - self.first_start

    @property
    def while_jobs_ran(self) -> Utilization:
        """The one definition (``timeslice.protocol.utilization``): phase time over the first
        phase's start to the last phase's end (a simulated group has no life before)."""
        return Utilization(self.busy_s, self.wall_s, WHILE_JOBS_RAN)

    @property
    def utilization(self) -> float:
        return self.while_jobs_ran.share


@dataclass
class JobResult:
    job_id: str
    first_start: float | None = None
    last_end: float = 0.0
    epochs_done: int = 0
    waited_s: float = 0.0

    @property
    def completion_s(self) -> float:
        return 0.0 if self.first_start is None else self.last_end - self.first_start


@dataclass
class Outcome:
    groups: dict[str, GroupResult]
    jobs: dict[str, JobResult]
    segments: list[Segment]
    events: list[GroupEvent] = field(default_factory=list)

    @property
    def completion_s(self) -> dict[str, float]:
        return {j: r.completion_s for j, r in self.jobs.items()}


# ---------------------------------------------------------------- internal state


class _State:
    __slots__ = (
        "arrives_at",
        "bytes",
        "free_at",
        "name",
        "pool",
        "restore_s",
        "snapshot_s",
        "where",
    )

    def __init__(self, state: StateProfile, move_bps: float) -> None:
        self.name = state.name
        self.pool = state.pool
        self.bytes = state.bytes
        estimate = state.bytes / move_bps if move_bps > 0 else 0.0
        self.snapshot_s = estimate if state.snapshot_s is None else state.snapshot_s
        self.restore_s = estimate if state.restore_s is None else state.restore_s
        self.where: str | None = None  # the group whose device holds it; None: host memory
        self.free_at = 0.0  # an eviction in flight ends then
        self.arrives_at = 0.0  # a staged restore brings it onto ``where``'s device then


class _Step:
    __slots__ = ("gpu", "group", "last_gpu", "mean", "name", "seconds", "states")

    def __init__(self, name: str, gpu: bool, group: str | None, seconds: Seconds) -> None:
        self.name = name
        self.gpu = gpu
        self.group = group
        self.seconds = seconds
        self.mean = seconds.mean
        self.states: tuple[_State, ...] = ()
        self.last_gpu = False  # the epoch's last GPU phase (a checkpoint may follow)


class _Gate:
    """An async job's hand-over between its two loops: the workflow's queue, its staleness
    gate and its ``sync_every`` rule, decided by ``timeslice.protocol.staleness`` as the
    workflow's pipeline decides them (``workflows/async_pipeline.py``;
    tests/unit/test_staleness_rules.py checks that the two agree)."""

    def __init__(self, steps: int, max_staleness: int, sync_every: int) -> None:
        self.steps = steps
        self.max_staleness = max_staleness
        self.sync_every = sync_every
        self.queued = self.trained = self.published = 0
        self.sampling = self.training = False
        self.waiting: list[_Job] = []

    def may_start(self, job: _Job) -> bool:
        if job.role == "trainer":
            return self.queued > 0
        # The one sampler samples one batch at a time: none is in flight when it asks.
        step = trained_by(self.trained, training=self.training, queued=self.queued, in_flight=0)
        return may_sample(
            step, published=self.published, max_staleness=self.max_staleness, limit=self.steps
        )

    def start(self, job: _Job) -> None:
        if job.role == "trainer":
            self.queued -= 1
            self.training = True
        else:
            self.sampling = True

    def end(self, job: _Job) -> None:
        if job.role == "trainer":
            self.training = False
            self.trained += 1
            if publishes_after(self.trained, sync_every=self.sync_every, steps=self.steps):
                self.published = self.trained
        else:
            self.sampling = False
            self.queued += 1


class _Job:
    __slots__ = (
        "asked_at",
        "ckpt",
        "ckpt_every",
        "client",
        "epoch",
        "epochs",
        "gate",
        "gate_passed",
        "grant_at",
        "held",
        "id",
        "index",
        "priority",
        "ready_at",
        "result",
        "role",
        "start_s",
        "states",
        "steps",
    )

    def __init__(
        self,
        placement: Placement,
        move_bps: float,
        *,
        role: str | None = None,
        gate: _Gate | None = None,
    ) -> None:
        p = placement.profile
        # An async job's loop is an actor of its own: the trainer's phases, or the others.
        self.role = role
        self.gate = gate
        self.gate_passed = False
        self.id = p.job_id if role is None else f"{p.job_id} · {role}"
        self.client = p.kind == "client"
        self.priority = p.priority
        self.epochs = placement.epochs or p.epochs
        self.start_s = placement.start_s
        phases = [
            ph for ph in p.phases if role is None or (ph.pool == "trainer") == (role == "trainer")
        ]
        self.states = [
            _State(s, move_bps)
            for s in p.states
            if role is None or s.pool == "both" or (s.pool == "trainer") == (role == "trainer")
        ]
        self.steps = [
            _Step(ph.name, ph.gpu, placement.group_of(ph.pool) if ph.pool else None, ph.seconds)
            for ph in phases
        ]
        for step in self.steps:
            if step.group is not None:
                step.states = tuple(self.states_on(step.group, placement))
        gpu_steps = [s for s in self.steps if s.gpu]
        if gpu_steps:
            gpu_steps[-1].last_gpu = True
        self.ckpt_every = p.checkpoint_every if role != "sampler" else None
        self.ckpt = p.checkpoint_s if role != "sampler" else None
        self.epoch = 0
        self.index = 0
        self.held: set[str] = set()
        self.ready_at: float | None = None
        self.grant_at: float | None = None
        self.asked_at: float | None = None
        self.result = JobResult(job_id=self.id)

    def states_on(self, group: str, placement: Placement) -> list[_State]:
        """The job's states that live on ``group`` (what ``RLJobWorkflow._backends_for``
        names there): both pools' when one group serves both."""
        return [s for s in self.states if s.pool == "both" or placement.group_of(s.pool) == group]

    @property
    def step(self) -> _Step:
        return self.steps[self.index]


class _Waiter:
    __slots__ = ("asked", "enqueued", "job", "seq")

    def __init__(self, job: _Job, enqueued: float, seq: int, asked: float) -> None:
        self.job = job
        self.enqueued = enqueued
        self.seq = seq
        self.asked = asked


class _Group:
    __slots__ = (
        "carries",
        "evicted",
        "evicting",
        "holder",
        "id",
        "last_holder",
        "lease_start",
        "queue",
        "resident",
        "restore_s",
        "result",
        "shares",
        "spec",
        "staged",
        "states",
        "switching",
    )

    def __init__(self, group_id: str, spec: GroupSpec) -> None:
        self.id = group_id
        self.spec = spec
        self.holder: _Job | None = None
        self.last_holder: _Job | None = None
        self.queue: list[_Waiter] = []
        self.resident: _Job | None = None
        # (job, when its eviction's report reaches the group)
        self.evicting: tuple[_Job, float] | None = None
        self.switching = False
        self.lease_start = 0.0
        self.states: dict[str, list[_State]] = {}  # job id -> its states that live here
        self.result = GroupResult()
        # The grant policy's memory: the holder's lease crossed this many phase boundaries
        # past waiters; job id -> flat [asked_at, waited_s, ...] of its last grants.
        self.carries = 0
        self.shares: dict[str, list[float]] = {}
        self.evicted: set[str] = set()  # jobs this group evicted (Residency.evicted_jobs)
        self.restore_s: dict[str, float] = {}  # job id -> its last own restore here
        self.staged: _Job | None = None


# ---------------------------------------------------------------- the simulation


class Simulation:
    def __init__(
        self,
        placements: Sequence[Placement],
        *,
        groups: dict[str, GroupSpec] | None = None,
        overheads: Overheads | None = None,
        move_bytes_per_s: float = DEFAULT_MOVE_BYTES_PER_S,
        seed: int | None = None,
        record: bool = False,
    ) -> None:
        ids = [p.profile.job_id for p in placements]
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
        self.ov = overheads if overheads is not None else Overheads()
        self.rng = random.Random(seed) if seed is not None else None
        self.record = record
        self.segments: list[Segment] = []
        self.events: list[GroupEvent] = []
        self.jobs: list[_Job] = []
        placed: list[Placement] = []
        # An async job's actors, by the job's id: their results are merged into the job's.
        self.async_jobs: dict[str, list[_Job]] = {}
        for p in placements:
            if p.max_staleness is None:
                self.jobs.append(_Job(p, move_bytes_per_s))
                placed.append(p)
                continue
            if p.sampler_group == p.trainer_group:
                raise ValueError(f"async job {p.profile.job_id}: its loops need two groups")
            problem = (
                "max_staleness must be >= 0 and sync_every >= 1"
                if p.max_staleness < 0 or p.steps_between_syncs < 1
                else sync_every_problem(p.max_staleness, p.steps_between_syncs)
            )
            if problem is not None:
                raise ValueError(f"async job {p.profile.job_id}: {problem}")
            gate = _Gate(p.epochs or p.profile.epochs, p.max_staleness, p.steps_between_syncs)
            actors = [_Job(p, move_bytes_per_s, role=r, gate=gate) for r in ("sampler", "trainer")]
            if not all(a.steps and any(s.gpu for s in a.steps) for a in actors):
                raise ValueError(
                    f"async job {p.profile.job_id}: needs GPU phases on both pools (a sampler "
                    "loop and a trainer loop)"
                )
            self.async_jobs[p.profile.job_id] = actors
            self.jobs += actors
            placed += [p, p]
        placements = placed
        specs = groups or {}
        self.groups: dict[str, _Group] = {}
        for job, placement in zip(self.jobs, placements, strict=True):
            for step in job.steps:
                if step.group is not None and step.group not in self.groups:
                    self.groups[step.group] = _Group(step.group, specs.get(step.group, GroupSpec()))
            for gid in {placement.sampler_group, placement.trainer_group} & self.groups.keys():
                self.groups[gid].states[job.id] = job.states_on(gid, placement)
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._place_states(placements)

    def _place_states(self, placements: Sequence[Placement]) -> None:
        """After preparing, each state is at home (its pool's group). Preparing holds the
        group, so each job that prepares there evicts the one before: the last to start (the
        last to prepare) keeps its state on the device, the others' wait in host memory."""
        order = sorted(range(len(self.jobs)), key=lambda i: (-self.jobs[i].start_s, -i))
        for i in order:
            job, placement = self.jobs[i], placements[i]
            for state in job.states:
                home = self.groups.get(
                    placement.group_of("sampler" if state.pool == "both" else state.pool)
                )
                if home is None:
                    continue
                if home.resident is None or home.resident is job:
                    home.resident = job
                    state.where = home.id

    # ------------------------------------------------------------ event queue

    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self) -> Outcome:
        for job in self.jobs:
            self._at(job.start_s, self._ready, job)
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            fn(t, *args)
        for job in self.jobs:
            if job.epoch < job.epochs:
                raise RuntimeError(f"simulation stalled: job {job.id} at epoch {job.epoch}")
        jobs = {j.id: j.result for j in self.jobs if j.gate is None}
        for job_id, actors in self.async_jobs.items():
            merged = JobResult(job_id=job_id, epochs_done=actors[1].result.epochs_done)
            starts = [a.result.first_start for a in actors if a.result.first_start is not None]
            merged.first_start = min(starts) if starts else None
            merged.last_end = max(a.result.last_end for a in actors)
            merged.waited_s = sum(a.result.waited_s for a in actors)
            jobs[job_id] = merged
        return Outcome(
            groups={g.id: g.result for g in self.groups.values()},
            jobs=jobs,
            segments=self.segments,
            events=self.events,
        )

    def _duration(self, step: _Step) -> float:
        if self.rng is None or not step.seconds.stdev:
            return step.mean
        seconds = step.seconds
        low = seconds.min if seconds.min is not None else 0.0
        high = seconds.max if seconds.max is not None else float("inf")
        return min(high, max(low, self.rng.gauss(seconds.mean, seconds.stdev)))

    def _segment(
        self, job: _Job, group: str | None, phase: str, start: float, end: float, kind: SegmentKind
    ) -> None:
        if self.record and end > start:
            self.segments.append(Segment(job.id, group, phase, job.epoch, start, end, kind))

    # ------------------------------------------------------------ a job's steps

    def _ready(self, t: float, job: _Job) -> None:
        """The job's current step may start (its activity is dispatched, or its loop got there)."""
        gate = job.gate
        if gate is not None and job.index == 0 and not job.gate_passed:
            if not gate.may_start(job):
                if job not in gate.waiting:
                    gate.waiting.append(job)  # the other loop's next step end wakes it
                return
            gate.start(job)
            job.gate_passed = True
        step = job.step
        if not step.gpu:
            end = t + self._duration(step)
            self._ran(job, t, end)
            if self.record:
                self._segment(job, None, step.name, t, end, "phase")
            self._at(end, self._cpu_end, job)
            return
        assert step.group is not None
        if step.group in job.held and job.grant_at is None:
            self._begin_gpu(t, job)  # a carried lease
            return
        if job.asked_at is None and step.group not in job.held:
            self._ask(t, job, step.group)  # not asked ahead: ask now
        job.ready_at = t
        if job.grant_at is not None:
            self._begin_gpu(max(t, job.grant_at), job)

    def _ask(self, t: float, job: _Job, group: str) -> None:
        job.asked_at = t
        self._at(t + self.ov.request_s, self._request, self.groups[group], job, t)

    def _granted(self, t: float, job: _Job, group: _Group) -> None:
        """The grant reached the job's process."""
        if job.asked_at is not None:
            job.result.waited_s += t - job.asked_at
        job.asked_at = None
        job.held.add(group.id)
        job.grant_at = t
        if job.ready_at is not None:
            self._begin_gpu(max(t, job.ready_at), job)

    def _begin_gpu(self, t: float, job: _Job) -> None:
        step = job.step
        assert step.group is not None
        group = self.groups[step.group]
        if self.record and job.ready_at is not None and t > job.ready_at:
            self._segment(job, group.id, step.name, job.ready_at, t, "wait")
        job.ready_at = job.grant_at = None
        start = t
        restored_s: float | None = None
        for state in step.states:
            if state.where == group.id:
                t = max(t, state.arrives_at)  # a staged restore still under way
                continue
            restored_s = (restored_s or 0.0) + state.restore_s
            t = max(t, state.free_at)  # its own eviction still under way: restore after it
            if state.where is not None:
                # On another group's device (a state that follows the lease): out of there
                # first, and that group hears it left.
                t += state.snapshot_s
                self._left(self.groups[state.where], job)
            t += state.restore_s
            state.where = group.id
            group.result.bytes_moved += state.bytes
        if restored_s is not None:
            group.restore_s[job.id] = restored_s
        if self.record:
            self._segment(job, group.id, step.name, start, t, "restore")
        end = t + self._duration(step)
        result = group.result
        result.busy_s += end - t
        result.first_start = t if result.first_start is None else min(result.first_start, t)
        result.last_end = max(result.last_end, end)
        result.holds.append((job.id, t, end))
        self._ran(job, t, end)
        if self.record:
            self._segment(job, group.id, step.name, t, end, "phase")
        self._at(end, self._gpu_end, job)

    def _left(self, group: _Group, job: _Job) -> None:
        if group.resident is job and all(s.where != group.id for s in group.states[job.id]):
            group.resident = None

    def _ran(self, job: _Job, start: float, end: float) -> None:
        r = job.result
        r.first_start = start if r.first_start is None else min(r.first_start, start)
        r.last_end = max(r.last_end, end)

    def _next_step(self, job: _Job) -> _Step | None:
        """The step after the current one (the next epoch's first), None after the last."""
        if job.index + 1 < len(job.steps):
            return job.steps[job.index + 1]
        return job.steps[0] if job.epoch + 1 < job.epochs else None

    def _advance(self, t: float, job: _Job) -> None:
        """Move to the next step, ready at ``t``."""
        job.index += 1
        if job.index == len(job.steps):
            job.index = 0
            job.epoch += 1
            job.result.epochs_done = job.epoch
            gate = job.gate
            if gate is not None:
                gate.end(job)
                job.gate_passed = False
                waiting, gate.waiting = gate.waiting, []
                for other in waiting:
                    self._at(t, self._ready, other)
            if job.epoch >= job.epochs:
                return
        self._at(t, self._ready, job)

    def _prefetch(self, t: float, job: _Job, nxt: _Step | None) -> None:
        """An RL job asks for its next GPU phase's lease as this step ends."""
        if job.gate is not None:
            return  # an async job's phases ask as their activity starts
        if not job.client and nxt is not None and nxt.gpu and nxt.group not in job.held:
            assert nxt.group is not None
            self._ask(t, job, nxt.group)

    def _cpu_end(self, t: float, job: _Job) -> None:
        nxt = self._next_step(job)
        self._prefetch(t, job, nxt)
        self._advance(t + (0.0 if job.client else self.ov.hop_s), job)

    def _gpu_end(self, t: float, job: _Job) -> None:
        ov = self.ov
        step = job.step
        assert step.group is not None
        group = self.groups[step.group]
        nxt = self._next_step(job)
        if job.client:
            self._release(t, job, group, carry=None)
            self._advance(t + ov.request_s + ov.grant_s, job)  # the client awaits its release
            return
        done = job.epoch + 1
        if (
            step.last_gpu
            and job.ckpt_every is not None
            and job.ckpt is not None
            and (done % job.ckpt_every == 0 or done == job.epochs)
        ):
            # The checkpoint is written under the lease, which is released after it.
            begin = t + ov.hop_s
            end = begin + job.ckpt.mean
            self._segment(job, group.id, "checkpoint", begin, end, "checkpoint")
            self._release(end, job, group, carry=None)
            self._prefetch(end, job, nxt)
            self._advance(end + ov.hop_s, job)
            return
        if nxt is not None and nxt.gpu and nxt.group == group.id and job.gate is None:
            # Asks to carry the lease into the next phase (the grant policy decides); the
            # process awaits the answer, then its next activity is dispatched: the group idles
            # for the carried lease's gap.
            self._release(t, job, group, carry=nxt)
            self._advance(t + max(ov.carry_s, ov.request_s + ov.grant_s), job)
            return
        self._release(t, job, group, carry=None)  # sent in the background
        self._prefetch(t, job, nxt)
        self._advance(t + ov.hop_s, job)

    def _release(self, t: float, job: _Job, group: _Group, *, carry: _Step | None) -> None:
        """``carry``: the next GPU phase on this group, which the lease is asked to carry into."""
        if carry is None:
            # No longer the process's to use from now on: a lease asked for next on the same
            # group is a new one (``_yield_in_background``).
            job.held.discard(group.id)
        self._at(t + self.ov.request_s, self._released, group, job, carry)

    # ------------------------------------------------------------ the group

    def _event(self, t: float, group: _Group, job: _Job, event: GroupEventKind, **kw: Any) -> None:
        if self.record:
            self.events.append(GroupEvent(t, group.id, job.id, event, **kw))

    def _request(self, t: float, group: _Group, job: _Job, asked: float) -> None:
        self._event(t, group, job, "ask")
        self._seq += 1
        group.queue.append(_Waiter(job, t, self._seq, asked))
        self._decide(t, group)
        self._stage(t, group)

    def _best(self, t: float, group: _Group) -> _Waiter | None:
        """The waiter the group serves next, by the group's own rule (``next_waiter``)."""
        return next_waiter(
            group.queue, lambda w: (w.job.priority, t - w.enqueued, w.seq), group.spec.aging_s
        )

    def _share(self, group: _Group, job: _Job, t: float) -> float:
        records = group.shares.get(job.id)
        return waiting_share(records, t) if records else 0.0

    def _carry(self, t: float, group: _Group, job: _Job, into: _Step) -> Carry:
        """The grant policy's answer to the holder's ask to keep its lease into ``into``
        (``GroupBook._carry`` asks the same of the same function)."""
        waiters = [
            (w.job.id, self._share(group, w.job, t), w.job.priority)
            for w in group.queue
            if w.job is not job
        ]
        return decide_carry(
            group.spec.limits,
            next_phase=into.name,
            next_phase_s=into.mean,
            carries=group.carries,
            holder_share=self._share(group, job, t),
            waiters=waiters,
            holder_priority=job.priority,
        )

    def _released(self, t: float, group: _Group, job: _Job, carry: _Step | None) -> None:
        if group.holder is not job:
            return
        if carry is not None:
            decision = self._carry(t, group, job, carry)
            self._event(
                t,
                group,
                job,
                "release",
                carry_into=carry.name,
                expected_s=carry.mean,
                kept=decision.keep,
                reason=decision.reason,
            )
            if decision.keep:
                if decision.contended:
                    group.carries += 1
                    group.result.carried += 1
                return  # kept: the job's next phase runs under the same lease
        else:
            self._event(t, group, job, "release")
        group.holder = None
        job.held.discard(group.id)
        if self.record:
            self._segment(job, group.id, "lease", group.lease_start, t, "lease")
        if carry is not None:
            # Released after all: the process asks for the next phase's lease once it hears.
            self._ask(t + self.ov.grant_s, job, group.id)
        best = self._best(t, group)
        if best is not None and best.job is not job and group.resident is job and not job.client:
            # Co-operative eviction: the holder moves its state out once it hears "evict".
            self._evict(t + self.ov.grant_s, group, job)
        self._decide(t, group)

    def _fit(self, group: _Group, a: _Job, b: _Job) -> bool:
        memory = group.spec.memory_bytes
        if memory is None:
            return False
        size = sum(s.bytes for s in group.states.get(a.id, ())) + sum(
            s.bytes for s in group.states.get(b.id, ())
        )
        return size <= memory

    def _evict(self, t: float, group: _Group, job: _Job) -> float:
        """Move ``job``'s states out of ``group``'s device from ``t``; returns when done."""
        moving = [s for s in group.states.get(job.id, ()) if s.where == group.id]
        end = t + sum(s.snapshot_s for s in moving)
        for state in moving:
            state.where = None
            state.free_at = max(state.free_at, end)
            group.result.bytes_moved += state.bytes
        if group.resident is job:
            group.resident = None
        if group.staged is job:
            group.staged = None
        group.evicted.add(job.id)
        group.evicting = (job, end + self.ov.request_s)
        self._segment(job, group.id, "evict", t, end, "evict")
        return end

    def _decide(self, t: float, group: _Group) -> None:
        if group.holder is not None or group.switching:
            return
        if t < group.spec.opens_s:
            if not group.queue[1:]:  # the first waiter: come back when the group opens
                self._at(group.spec.opens_s, self._decide, group)
            return
        best = self._best(t, group)
        if best is None:
            return
        group.queue.remove(best)
        job = best.job
        grant_at = t
        staged = group.staged
        if staged is not None and staged is not job and group.resident is not job:
            # Another job was staged: the group takes its states off the device again first.
            group.result.staged_unused += 1
            begin = max([t, *(s.arrives_at for s in group.states.get(staged.id, ()))])
            grant_at = self._evict(begin + self.ov.group_move_s, group, staged) + self.ov.request_s
        elif staged is job:
            group.staged = None
        group.evicted.discard(job.id)
        resident = group.resident
        if resident is not None and resident is not job:
            # Sticky residency met a different job: the group evicts with its own activity,
            # beside the grant when both states fit, else before it.
            fit = self._fit(group, resident, job)
            end = self._evict(t + self.ov.group_move_s, group, resident)
            if not fit:
                grant_at = max(grant_at, end + self.ov.request_s)
        elif group.evicting is not None and group.evicting[1] > t:
            other, reported = group.evicting
            if other is not job and not self._fit(group, other, job):
                grant_at = max(grant_at, reported)  # wait for the eviction's report
        if job.client:
            missing = [s for s in group.states.get(job.id, ()) if s.where != group.id]
            if missing:
                begin = max([grant_at, *(s.free_at for s in missing)]) + self.ov.group_move_s
                grant_at = begin + sum(s.restore_s for s in missing)
                for state in missing:
                    state.where = group.id
                    group.result.bytes_moved += state.bytes
                self._segment(job, group.id, "restore", begin, grant_at, "restore")
        group.resident = job
        if grant_at > t:
            group.switching = True
            self._at(grant_at, self._grant, group, job, best.enqueued)
        else:
            self._grant(t, group, job, best.enqueued)

    def _grant(self, t: float, group: _Group, job: _Job, enqueued: float) -> None:
        group.switching = False
        group.holder = job
        group.lease_start = t
        group.carries = 0
        # The wait as GroupBook.grant records it: from reaching the group to the grant.
        record_wait(remember_job(group.shares, job.id), enqueued, t - enqueued)
        self._event(t, group, job, "grant")
        group.result.leases += 1
        if group.last_holder is not None and group.last_holder is not job:
            group.result.switches += 1
        group.last_holder = job
        self._at(t + self.ov.grant_s, self._granted, job, group)
        self._stage(t, group)

    def _stage(self, t: float, group: _Group) -> None:
        """While a holder works, restore the next waiter's states beside its lease when they
        fit (``Residency.may_stage``, ``GroupSwitch.stage_next``)."""
        holder = group.holder
        memory = group.spec.memory_bytes
        if holder is None or group.staged is not None or memory is None:
            return
        if not group.spec.staged_restores:
            return
        best = self._best(t, group)
        if best is None or best.job is holder or best.job.client:
            return
        job = best.job
        mine = group.states.get(job.id, ())
        missing = [s for s in mine if s.where != group.id]
        if (
            not missing
            or job.id not in group.evicted
            or group.restore_s.get(job.id, 0.0) < STAGE_MIN_RESTORE_S
        ):
            return
        on_device = [holder]
        if group.evicting is not None:
            other, reported = group.evicting
            if other is not job and reported > t:
                on_device.append(other)
                if not self._fits(group, [*on_device, job]):
                    self._at(reported, self._stage, group)  # once its report is in
                    return
        if not self._fits(group, [*on_device, job]):
            return
        group.staged = job
        group.result.staged_restores += 1
        group.evicted.discard(job.id)
        begin = max([t + self.ov.group_move_s, *(s.free_at for s in missing)])
        end = begin + sum(s.restore_s for s in missing)
        for state in missing:
            state.where = group.id
            state.arrives_at = end
            group.result.bytes_moved += state.bytes
        if self.record:
            self._segment(job, group.id, "staged", begin, end, "restore")

    def _fits(self, group: _Group, jobs: list[_Job]) -> bool:
        memory = group.spec.memory_bytes
        size = sum(s.bytes for j in jobs for s in group.states.get(j.id, ()))
        return memory is not None and size <= memory


class SimulationSettings(TypedDict, total=False):
    """:func:`simulate`'s settings (those :class:`Simulation` takes), each optional."""

    groups: dict[str, GroupSpec] | None
    overheads: Overheads | None
    move_bytes_per_s: float
    seed: int | None
    record: bool


def simulate(placements: Sequence[Placement], **settings: Unpack[SimulationSettings]) -> Outcome:
    """Run every placed job to its last epoch. ``overheads`` default: the measured ones
    (:class:`Overheads`); :meth:`Overheads.zero` with no states gives the ideal. ``seed``
    draws each phase's duration from its measured spread instead of using its mean; ``groups``
    declares groups' memory; ``record`` keeps every interval (``Outcome.segments``)."""
    return Simulation(placements, **settings).run()


def rl_profile(
    job_id: str,
    *,
    sample_s: float,
    rewards_s: float,
    train_s: float,
    epochs: int,
    states: Sequence[StateProfile] = (),
    priority: int = 0,
    checkpoint_every: int | None = None,
    checkpoint_s: float | None = None,
    max_staleness: int | None = None,
    sync_every: int | None = None,
) -> JobProfile:
    """A profile of the RL job's three phases from plain numbers (tests, bench/replay.py);
    with ``max_staleness``, an async job's."""
    extra: dict[str, Any] = {}
    if max_staleness is not None:
        extra = {"mode": "async", "max_staleness": max_staleness, "sync_every": sync_every}
    return JobProfile.model_validate(
        {
            **extra,
            "job_id": job_id,
            "epochs": epochs,
            "priority": priority,
            "phases": [
                {"name": "sample", "gpu": True, "pool": "sampler", "seconds": sample_s},
                {"name": "rewards", "gpu": False, "seconds": rewards_s},
                {"name": "train", "gpu": True, "pool": "trainer", "seconds": train_s},
            ],
            "states": [s.model_dump() for s in states],
            "checkpoint_every": checkpoint_every,
            "checkpoint_s": checkpoint_s,
        }
    )
