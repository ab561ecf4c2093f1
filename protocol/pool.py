"""The contract of pools (docs/pools.md): a pool is a set of GPU groups that jobs are placed on.

A pool is a ``PoolWorkflow`` whose id comes from its name (``pool_workflow_id``); each of its
groups is claimed by a ``PoolClaimWorkflow`` whose id comes from the group's name
(``claim_workflow_id``), so Temporal's one-open-run-per-id rule is what keeps a group in one
pool. A job started with ``pool`` asks the pool for its groups (``PoolUpdate.PLACE``) and tells
it when it ends (``PoolSignal.JOB_ENDED``). The pool moves a placed job by signalling it a
``MoveOrder`` (the job's ``move`` signal); the job takes it at its next checkpoint boundary and
tells the pool (``PoolSignal.JOB_MOVED``).
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from timeslice.protocol.group import MAX_STATE_BYTES, check_id

POOL_WORKFLOW = "PoolWorkflow"
CLAIM_WORKFLOW = "PoolClaimWorkflow"
CLAIM_GROUPS_ACTIVITY = "claim_pool_groups"
PLACE_JOB_ACTIVITY = "place_pool_job"
REQUEST_PLACEMENT_ACTIVITY = "request_pool_placement"
MOVE_DECISION_ACTIVITY = "plan_pool_move"
DEFAULT_MAX_SLOWDOWN = 1.25
MAX_POOL_GROUPS = 64
DECISIONS_KEPT = 32
DEFAULT_MOVE_HORIZON_S = 600.0
DEFAULT_MOVE_EVERY_EPOCHS = 5
MAX_MEASURED_PROFILE_CHARS = 16_384  # as a declared one (rl_job.MAX_PROFILE_CHARS)
#: A job placed without a profile measures one from its records of this many epochs (after
#: its first, which holds its start-up) and sends it to its pool.
MEASURED_EPOCHS = 2
#: A job whose pool knows its profile (declared, or measured and sent) compares the median
#: of its last this-many epochs with it, and sends the pool the new one when it drifted.
DRIFT_EPOCHS = 3
#: A profile drifted when its GPU seconds an epoch, or its epoch's seconds, changed by more
#: than this share of what the pool knows, and by more than DRIFT_MIN_S (so that a phase's
#: few milliseconds of jitter do not count).
PROFILE_DRIFT = 0.25
DRIFT_MIN_S = 0.05
MAX_REASON_CHARS = 300
#: The tenant of a job that names none.
DEFAULT_TENANT = "default"
MAX_TENANTS = 256
#: Ended jobs' first run ids a pool keeps, to refuse a request of theirs that comes late.
ENDED_RUNS_KEPT = 256
#: The most characters of JSON a pool's jobs' profiles take together: each placement and move
#: decision carries every placed job's profile to its activity, the pool carries them all
#: across continue-as-new, and a Temporal payload is at most 2 MB (16-KiB profiles: 61 jobs).
MAX_POOL_PROFILE_CHARS = 1_000_000


class PoolUpdate(StrEnum):
    PLACE = "place"
    READY = "ready"
    MOVE = "move"


class PoolSignal(StrEnum):
    JOB_ENDED = "job_ended"
    JOB_MOVED = "job_moved"
    JOB_PROFILED = "job_profiled"


class PoolQuery(StrEnum):
    STATUS = "status"
    OWNER = "owner"


def pool_workflow_id(pool: str) -> str:
    return f"timeslice-pool-{check_id('pool name', pool)}"


def claim_workflow_id(group_id: str) -> str:
    """The workflow whose existence says which pool holds the group."""
    return f"timeslice-pool-group-{check_id('group id', group_id)}"


_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS.update({"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40})
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]I?)?B?\s*$", re.I)


def parse_memory(text: str) -> int:
    """Bytes from ``80GiB``, ``80G``, ``16e9`` or ``1024``; ValueError saying why otherwise."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(
            f"invalid memory size {text!r}: give bytes (16e9) or a number with a unit "
            "(80GiB, 80G, 512MiB)"
        )
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if not math.isfinite(value) or value < 1 or value > MAX_STATE_BYTES:
        raise ValueError(f"invalid memory size {text!r}: between 1 byte and {MAX_STATE_BYTES}")
    return int(value)


def _checked(kind: str) -> AfterValidator:
    return AfterValidator(lambda v: check_id(kind, v))


GroupId = Annotated[str, _checked("group id")]
NodeName = Annotated[str, _checked("node")]
PoolName = Annotated[str, _checked("pool name")]
TenantName = Annotated[str, _checked("tenant")]
JobId = Annotated[str, _checked("job id")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolGroup(_Model):
    """One GPU group of a pool: its declared device memory (what the placement simulates) and
    the node it is on."""

    name: GroupId
    memory_bytes: int | None = Field(None, gt=0, le=MAX_STATE_BYTES)
    node: NodeName | None = None

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> Any:
        return parse_memory(v) if isinstance(v, str) else v

    @classmethod
    def parse(cls, text: str) -> PoolGroup:
        """``NAME[:MEMORY[:NODE]]``, as ``timeslice pool create --group`` takes it."""
        parts = text.split(":")
        if len(parts) > 3 or not parts[0]:
            raise ValueError("give NAME[:MEMORY[:NODE]]")
        name, memory, node = [*parts, None, None][:3]
        return cls(
            name=name,
            memory_bytes=parse_memory(memory) if memory else None,
            node=node or None,
        )


class TenantLimits(_Model):
    """A tenant's share of its pool: ``quota``, the most groups' worth of GPU demand its placed
    jobs may hold together (None: no limit); ``weight``, how much of the pool's room it is
    owed when jobs wait (a tenant holding less demand per weight is admitted first)."""

    quota: float | None = Field(None, gt=0, le=MAX_POOL_GROUPS, allow_inf_nan=False)
    weight: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)

    @classmethod
    def parse(cls, text: str) -> tuple[str, TenantLimits]:
        """``NAME:QUOTA[:WEIGHT]`` (``timeslice pool create --tenant``; QUOTA ``-``: none)."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError("give NAME:QUOTA[:WEIGHT], e.g. team-a:1.5:2 (QUOTA '-': no quota)")
        name, quota, weight = [*parts, None][:3]
        check_id("tenant", name)
        try:
            limits = cls(
                quota=None if quota == "-" else float(quota),  # type: ignore[arg-type]
                weight=1.0 if weight is None else float(weight),
            )
        except ValueError as err:
            if isinstance(err, ValidationError):
                raise
            raise ValueError(f"QUOTA and WEIGHT are numbers: {err}") from None
        return name, limits


class PoolConfig(_Model):
    """A pool's input: ``timeslice pool create``, ``create_pool`` or ``temporal workflow start
    --type PoolWorkflow --workflow-id timeslice-pool-NAME --input '{...}'``."""

    pool: PoolName
    groups: list[PoolGroup] = Field(max_length=MAX_POOL_GROUPS)
    max_slowdown: float = Field(
        DEFAULT_MAX_SLOWDOWN,
        ge=1.0,
        le=100.0,
        allow_inf_nan=False,
        description="no job is placed where its predicted slowdown (vs alone) exceeds this",
    )
    auto_move: bool = Field(
        True,
        description="move a placed job to another group when a job ends and the move's "
        "predicted gain over move_horizon_s exceeds its cost",
    )
    move_horizon_s: float = Field(
        DEFAULT_MOVE_HORIZON_S,
        gt=0,
        le=1e7,
        allow_inf_nan=False,
        description="the time over which a move's predicted gain is counted against its cost",
    )
    move_every_epochs: int = Field(
        DEFAULT_MOVE_EVERY_EPOCHS,
        ge=1,
        le=1_000_000,
        description="no job moves more than once in this many of its epochs",
    )
    tenants: dict[TenantName, TenantLimits] = Field(
        default_factory=dict,
        max_length=MAX_TENANTS,
        description="each tenant's quota and weight; a tenant not named has no quota, weight 1",
    )

    def limits(self, tenant: str | None) -> TenantLimits:
        return self.tenants.get(tenant or DEFAULT_TENANT) or TenantLimits()

    @model_validator(mode="after")
    def _groups(self) -> PoolConfig:
        if not self.groups:
            raise ValueError(f"pool {self.pool!r} has no groups: give at least one")
        names = [g.name for g in self.groups]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"groups named twice in pool {self.pool!r}: {repeated}")
        return self


class ClaimRequest(_Model):
    pool: PoolName
    groups: list[GroupId]


class PlaceRequest(_Model):
    """A job's request for groups (``PoolUpdate.PLACE``). ``profile``: a ``JobProfile`` as JSON
    (plan/profile.py; checked where placement runs), or None for a job without one."""

    job_id: JobId
    mode: Literal["sync", "async"] = "sync"
    profile: dict[str, Any] | None = None
    place_anyway: bool = False
    tenant: TenantName | None = None
    run_id: str | None = Field(
        None,
        max_length=64,
        description="the job's first run id: a request that arrives after that job told the "
        "pool it ended (a try in flight when it was cancelled) is refused, not placed",
    )


class PlacementCall(_Model):
    """The job workflow's request activity's input: which pool, and the request."""

    pool: PoolName
    request: PlaceRequest


class Placement(_Model):
    """Where a job runs: one group (sync), or a sampler and a trainer group (async)."""

    sampler_group: str
    trainer_group: str


class PlaceAnswer(_Model):
    """The pool's answer: a placement, or a place in its queue and why."""

    placement: Placement | None = None
    queued_because: str | None = None


class PoolJob(_Model):
    job_id: str
    mode: Literal["sync", "async"] = "sync"
    profile: dict[str, Any] | None = None
    place_anyway: bool = False
    placement: Placement | None = None
    # The job's predicted share of its groups' time in GPU phases (None: no profile).
    demand: float | None = None
    queued_because: str | None = None
    # Where a move ordered and not yet taken takes the job from (placement is where it goes).
    moving_from: Placement | None = None
    moves: int = Field(0, description="moves the job took")
    tenant: str | None = Field(None, description=f"None: {DEFAULT_TENANT!r}")

    @property
    def tenant_name(self) -> str:
        return self.tenant or DEFAULT_TENANT

    def charged(self, duty: float | None = None) -> float:
        """What the job counts against its tenant's quota: its predicted demand (its GPU share
        alone, ``duty`` if given), or, while unknown, a whole group for each group it uses."""
        known = self.demand if duty is None else duty
        if known is not None:
            return known
        return 2.0 if self.mode == "async" else 1.0


def tenant_holds(jobs: list[PoolJob], tenant: str) -> float:
    """The groups' worth of GPU demand ``tenant``'s placed jobs hold (``PoolJob.charged``)."""
    return sum(j.charged() for j in jobs if j.placement is not None and j.tenant_name == tenant)


def admission_order(waiting: list[PoolJob], placed: list[PoolJob], config: PoolConfig) -> PoolJob:
    """The queued job the pool tries first: of the tenant that holds the least demand per
    weight (weighted fair shares), the earliest in the queue."""
    return admission_queue(waiting, placed, config)[0]


def admission_queue(
    waiting: list[PoolJob], placed: list[PoolJob], config: PoolConfig
) -> list[PoolJob]:
    """The queue in the order ``admission_order`` would try it as things stand."""

    def share(job: PoolJob) -> float:
        return tenant_holds(placed, job.tenant_name) / config.limits(job.tenant).weight

    return sorted(waiting, key=lambda j: (share(j), waiting.index(j)))


class MoveOrder(_Model):
    """The pool's order to a job (its ``move`` signal): run on these groups from the next
    checkpoint boundary at least ``epochs_apart`` epochs after the job's last move."""

    pool: PoolName
    sampler_group: GroupId
    trainer_group: GroupId
    reason: str = Field("", max_length=MAX_REASON_CHARS)
    epochs_apart: int = Field(DEFAULT_MOVE_EVERY_EPOCHS, ge=1, le=1_000_000)


class JobMove(_Model):
    """A move a job took (its state's ``moves``, its progress)."""

    epoch: int = Field(ge=0, description="the first epoch run on the new groups")
    moved_from: Placement
    moved_to: Placement
    reason: str = Field("", max_length=MAX_REASON_CHARS)


#: The moves a job's state keeps (the oldest go first): its history has them all.
MOVES_KEPT = 8


class MoveRequest(_Model):
    """``PoolUpdate.MOVE``: move a placed job to another place by hand (``timeslice pool
    move``); the trainer group defaults to the sampler group (a sync job's one group)."""

    job_id: JobId
    sampler_group: GroupId
    trainer_group: GroupId | None = None


class JobMoved(_Model):
    """A job's word that it took a move (``PoolSignal.JOB_MOVED``): its groups from ``epoch``."""

    job_id: str
    placement: Placement
    epoch: int = Field(ge=0)


class JobProfiled(_Model):
    """A job sends its pool the profile it measured (``PoolSignal.JOB_PROFILED``): a
    ``JobProfile`` as JSON without its ``job_id``, from its own records; once if it was placed
    without one, and again whenever it drifted from what the pool knows (``profile_drift``)."""

    job_id: str
    profile: dict[str, Any]

    @field_validator("profile")
    @classmethod
    def _small(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Kept in the pool's state across continue-as-new, as a declared profile is.
        size = len(json.dumps(v, default=str))
        if size > MAX_MEASURED_PROFILE_CHARS:
            raise ValueError(f"profile: {size} characters of JSON; at most 16384")
        return v


class MoveInput(_Model):
    """What the move activity (plan/placement.py) decides from: the pool's placed jobs, which of
    them may move now, and how a move is weighed."""

    groups: list[PoolGroup]
    max_slowdown: float
    placed: list[PoolJob]
    movable: list[str]
    horizon_s: float
    # The queue, first to be admitted first: a move that makes room for one of them within
    # the bound counts that job's GPU time over the horizon as its gain.
    queued: list[PoolJob] = Field(default_factory=list)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)


class MoveOutcome(_Model):
    """One move, or none (``job_id`` None) and why; and each profiled job's predicted demand
    (its GPU share alone), for the pool's status."""

    job_id: str | None = None
    placement: Placement | None = None
    reason: str
    demands: dict[str, float] = Field(default_factory=dict)
    makes_room_for: str | None = Field(None, description="the queued job the move lets in")


class Decision(_Model):
    job_id: str
    reason: str


class PlaceInput(_Model):
    """What the placement activity (plan/placement.py) decides from."""

    groups: list[PoolGroup]
    max_slowdown: float
    placed: list[PoolJob]
    job: PoolJob
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)


class PlaceOutcome(_Model):
    placement: Placement | None
    demand: float | None = None
    reason: str


class JobEnded(_Model):
    job_id: str
    outcome: str = "ended"
    run_id: str | None = Field(None, max_length=64, description="the job's first run id")


class PoolStatus(_Model):
    config: PoolConfig
    jobs: list[PoolJob]
    decisions: list[Decision] = Field(default_factory=list)
    ended_runs: list[str] = Field(
        default_factory=list,
        description=f"the first run ids of the last {ENDED_RUNS_KEPT} jobs that told the pool "
        "they ended: a placement request of theirs that comes later is refused",
    )


def profile_chars(profile: dict[str, Any] | None) -> int:
    """The characters of JSON ``profile`` takes (0 for none), as its size is checked."""
    return 0 if profile is None else len(json.dumps(profile, default=str))


def profiles_past_budget(
    jobs: list[PoolJob], profile: dict[str, Any] | None, instead_of: PoolJob | None = None
) -> str | None:
    """Why a pool of ``jobs`` cannot keep ``profile`` too (in place of ``instead_of``'s), or
    None if their profiles stay within ``MAX_POOL_PROFILE_CHARS``."""
    if profile is None:
        return None
    total = profile_chars(profile) + sum(
        profile_chars(j.profile) for j in jobs if j is not instead_of
    )
    if total <= MAX_POOL_PROFILE_CHARS:
        return None
    return (
        f"the pool's jobs' profiles would take {total:,} characters of JSON, past the "
        f"{MAX_POOL_PROFILE_CHARS:,} a pool keeps (every placement carries them, and a Temporal "
        "payload is at most 2 MB): let some of its jobs end, send smaller profiles, or use "
        "another pool"
    )


def profile_seconds(profile: dict[str, Any]) -> tuple[float, float] | None:
    """A sync profile's GPU seconds an epoch and its epoch's seconds (a ``JobProfile`` as JSON:
    each phase's ``seconds`` a number or ``{"mean": ...}``); None if it does not say."""
    gpu = total = 0.0
    phases = profile.get("phases")
    if not isinstance(phases, list) or not phases:
        return None
    for phase in phases:
        seconds = phase.get("seconds") if isinstance(phase, dict) else None
        if isinstance(seconds, dict):
            seconds = seconds.get("mean")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            return None
        if not math.isfinite(seconds) or seconds < 0:
            return None
        total += seconds
        if phase.get("gpu"):
            gpu += seconds
    return gpu, total


def profile_drift(known: tuple[float, float], measured: tuple[float, float]) -> str | None:
    """How ``measured`` (GPU seconds, epoch seconds) drifted from ``known``, or None if it did
    not (both within ``PROFILE_DRIFT`` of it, or within ``DRIFT_MIN_S``)."""
    changed = []
    for what, was, now in (("GPU", known[0], measured[0]), ("epoch", known[1], measured[1])):
        if abs(now - was) > max(PROFILE_DRIFT * was, DRIFT_MIN_S):
            changed.append(f"{what} {was:.2f} -> {now:.2f} s")
    return ", ".join(changed) or None
