"""Messages of the RL job: its configuration, the job process's activities, progress, result.

Everything here crosses Temporal (workflow input, activity arguments, queries, continue-as-new),
so it is a pydantic model; this module imports nothing with I/O so workflows can use it.
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from typing import Any, ClassVar, Literal, Self

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from timeslice.protocol.group import (
    CARRIED_STATE_BUDGET_BYTES,
    MAX_BACKENDS,
    MAX_LEASE_TTL_S,
    MAX_PRIORITY,
    MIN_LEASE_TTL_S,
    MIN_PRIORITY,
    NextPhase,
    SnapshotReport,
    _Model,
    check_id,
    encoded_size,
)
from timeslice.protocol.group import (
    explain_validation_error as explain_validation_error,  # re-exported: client/jobs.py, rl_job.py
)
from timeslice.protocol.pool import MAX_REASON_CHARS, MOVES_KEPT, JobMove, MoveOrder

RL_JOB_WORKFLOW_TYPE = "RLJobWorkflow"


class JobQuery(StrEnum):
    """Queries of the RL job workflow."""

    PROGRESS = "progress"


class JobSignal(StrEnum):
    """Signals of the RL job workflow (besides the groups' grant signal, ``GRANT_SIGNAL``)."""

    STOP = "stop"
    MOVE = "move"


# The job protocol: what the RL job workflow and its job processes say to each other (the
# activities' inputs and results, and what each side expects of the other between them). Raised
# on any change an older or newer counterpart would get wrong; each side checks the other's at
# `describe` (docs/upgrading.md), so a job never runs phases across releases that disagree.
JOB_PROTOCOL_VERSION = 5

# Served by a job process on ``timeslice-job-<job_id>-<rank>``.
DESCRIBE_ACTIVITY = "timeslice.job.describe"
PREPARE_ACTIVITY = "timeslice.job.prepare"
SAMPLE_ACTIVITY = "timeslice.job.sample"
REWARDS_ACTIVITY = "timeslice.job.compute_rewards"
TRAIN_ACTIVITY = "timeslice.job.train"
CHECKPOINT_ACTIVITY = "timeslice.job.save_checkpoint"

# Error types a job process raises; the workflow rewinds to its last checkpoint on any of them.
STATE_LOST = "JobStateLost"
LEASE_REVOKED = "LeaseRevoked"
# A lease the workflow handed over is not the group's holder, as the group itself says (its
# holder query or a renewal's answer), found before any work began: a grant the group never
# made (forged with a valid-looking proof), or one that ended before the process took it.
# Nothing ran, so the workflow asks the group about the request again rather than rewind.
GRANT_NOT_HELD = "GrantNotHeld"

Phase = Literal["sample", "rewards", "train"]

# Kept small: records travel in the workflow's continue-as-new input and its progress query.
# Older epochs live on as running totals (and in the workflow runs' histories).
RECENT_EPOCH_RECORDS = 32
MAX_REWARDS = 2000
# ---- What one epoch record may carry (`bound_record` cuts it to these; what it drops is counted
# in the record): the workload's metrics are the user's, and any number of them may come back.
MAX_RECORD_METRICS = 64
MAX_METRIC_NAME = 100  # characters
MAX_RECORD_METRICS_BYTES = 8 * 1024  # the metrics, encoded
MAX_RECORD_HOLDS = 2  # the GPU phases' intervals: sample and train
MAX_RECORD_TIMES = 8  # phases in wait_s and phase_s (names at most 32 characters)
MAX_RECORD_BYTES = 20 * 1024  # the whole record, encoded: hold reports go first past it
MAX_CHECKPOINT_PATH = 4096  # Linux's PATH_MAX
MAX_CARRY_REASON = 120  # a hold's ``carry``: the group's reason, cut (it names another job)
# The most an RL job's continue-as-new input (``RLJobInput``) encodes to, by the bounds above:
# the config (its workload options at most MAX_OPTIONS_BYTES), the records, the rewards, the last
# checkpoint, the backends' sizes, running totals and counters. tests/unit/test_state_budget.py
# builds it at every limit and measures it with the real data converter.
_RL_FIXED_BYTES = 8 * 1024
_FLOAT_BYTES = 25
_BACKEND_ENTRY_BYTES = 6 * 100 + 24  # a name of 100 characters, each escaped, and its size
# A move (taken or ordered): a reason of MAX_REASON_CHARS, each escaped, and four group ids.
_MOVE_BYTES = 6 * MAX_REASON_CHARS + 4 * (100 + 32) + 128


def rl_job_state_budget() -> int:
    """The most bytes an RL job's continue-as-new input encodes to, by the bounds above."""
    return (
        _RL_FIXED_BYTES
        + MAX_OPTIONS_BYTES
        + RECENT_EPOCH_RECORDS * (MAX_RECORD_BYTES + 1)
        + MAX_REWARDS * _FLOAT_BYTES
        + 6 * MAX_CHECKPOINT_PATH
        + MAX_BACKENDS * _BACKEND_ENTRY_BYTES
        + 3 * MAX_RECORD_TIMES * 2 * (6 * 32 + _FLOAT_BYTES)  # the three totals' dicts
        + (MOVES_KEPT + 1) * _MOVE_BYTES  # the moves kept and the one ordered
    )


# The built-in workloads, by the names a job process knows them by (timeslice.workloads.registry
# maps each to its factory; a test checks the two agree). Named here, without importing them, so
# a job naming a workload that exists nowhere fails at once instead of waiting for a process.
BUILTIN_WORKLOADS = ("grpo-dp", "grpo-jax", "grpo-toy", "hf-grpo", "simulated")
_FACTORY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
# Workload options travel in every job activity's input and the job's continue-as-new input.
MAX_OPTIONS_BYTES = 64 * 1024
MAX_OPTIONS_DEPTH = 16


def check_workload(ref: str) -> str:
    """Return ``ref`` if it names a built-in workload or a MODULE:FACTORY, else ValueError."""
    if ref in BUILTIN_WORKLOADS or _FACTORY_RE.fullmatch(ref):
        return ref
    raise ValueError(
        f"unknown workload {ref!r}: use a built-in ({', '.join(BUILTIN_WORKLOADS)}) "
        "or MODULE:FACTORY, e.g. my_project.rl:make_workload"
    )


def json_size(value: Any, problem: str) -> int:
    """The length of ``value`` as JSON; ValueError starting with ``problem`` if it is not
    plain JSON (finite numbers)."""
    try:
        return len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{problem} ({err})") from None


def check_workload_options(options: dict[str, Any]) -> dict[str, Any]:
    """Return ``options`` if they are plain JSON (finite numbers), at most MAX_OPTIONS_DEPTH
    deep and MAX_OPTIONS_BYTES long; else ValueError saying which rule they break."""

    def walk(value: Any, depth: int) -> None:
        if depth > MAX_OPTIONS_DEPTH:
            raise ValueError(f"workload options nest deeper than {MAX_OPTIONS_DEPTH} levels")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"workload options must be finite numbers, not {value}")
        if isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, depth + 1)

    walk(options, 1)
    size = json_size(options, "workload options must be JSON values")
    if size > MAX_OPTIONS_BYTES:
        raise ValueError(f"workload options take {size} bytes as JSON; at most {MAX_OPTIONS_BYTES}")
    return options


MAX_PROFILE_CHARS = 16_384


def rl_job_workflow_id(job_id: str) -> str:
    """The workflow id of job ``job_id`` (sync or async): ``rl-job-<job_id>``; ValueError for
    an id that is not one."""
    return f"rl-job-{check_id('job id', job_id)}"


class RLJobConfig(_Model):
    """One RL job: what to run, where its GPU phases run, and for how long.

    The input of ``RLJobWorkflow`` (``timeslice job start``, ``timeslice.jobs.start_rl_job``
    or the ``temporal`` CLI). Parse a user's dict with ``timeslice.jobs.parse_job_config``,
    which raises ``InvalidArgumentError`` naming each bad field; a workflow started with bad
    input fails at once with a non-retryable ``InvalidInput``.

    Attributes:
        job_id: The job's id (1-100 letters, digits, ``.``, ``_``, ``-``); its workflow is
            ``rl-job-<job_id>`` and its processes serve ``timeslice-job-<job_id>-<rank>``.
        workload: A built-in name (``grpo-toy``, ``grpo-dp``, ``grpo-jax``, ``hf-grpo``,
            ``simulated``) or ``MODULE:FACTORY``; the job processes must run the same.
        workload_options: JSON options handed to the workload (at most 64 KiB as JSON).
        sampler_group: The group the ``sample`` phase runs on.
        trainer_group: The group ``train`` runs on (None: the sampler group).
        epochs: How many epochs to run (1 to 1,000,000).
        batch_size: Prompts per epoch.
        group_size: Completions per prompt (the GRPO group).
        seed: The seed every epoch's randomness is drawn from, with the epoch.
        ranks: Job processes running each phase together (1 to 64).
        priority: The priority of the job's lease requests (-100 to 100).
        lease_ttl_s: The TTL of the job's leases (None: each group's default).
        acquire_timeout_s: Give up on a group after this long (None: wait without limit);
            the job then fails as ``AcquireTimeout``.
        sample_timeout_s: The longest one ``sample`` phase may run.
        reward_timeout_s: The longest one ``compute_rewards`` phase may run.
        train_timeout_s: The longest one ``train`` phase may run.
        checkpoint_timeout_s: The longest one checkpoint may take.
        heartbeat_timeout_s: A job process silent this long is taken for dead.
        process_wait_s: How long to wait for the job processes to serve the job.
        checkpoint_every: Save a checkpoint every this many epochs.
        continue_as_new_every: Epochs per workflow run (then it continues as new).
        max_failures: Consecutive failed epochs (each rewinds to the last checkpoint)
            before the job fails.
    """

    job_id: str
    workload: str = Field(
        min_length=1,
        max_length=300,
        description="built-in name (grpo-jax, grpo-toy, hf-grpo, simulated) or MODULE:FACTORY; the "
        "job process must have been started with the same",
    )
    workload_options: dict[str, Any] = Field(default_factory=dict)
    sampler_group: str | None = Field(
        None, description="the group sample runs on (leave out with pool: the pool places the job)"
    )
    trainer_group: str | None = Field(None, description="default: the sampler group")
    pool: str | None = Field(
        None, description="a pool (docs/pools.md) that places the job, instead of its groups"
    )
    profile: dict[str, Any] | None = Field(
        None, description="with pool: the job's declared profile (plan/profile.py's JobProfile)"
    )
    place_anyway: bool = Field(
        False, description="with pool: the least bad group rather than the queue when none fits"
    )
    tenant: str | None = Field(
        None,
        description="with pool: the tenant whose quota and weight the job counts against "
        "(default: the pool's 'default' tenant)",
    )
    epochs: int = Field(ge=1, le=1_000_000)
    batch_size: int = Field(16, ge=1, le=65_536)
    group_size: int = Field(8, ge=1, le=1024, description="completions per prompt (GRPO group)")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    ranks: int = Field(1, ge=1, le=64, description="job processes (ranks) running each phase")
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    lease_ttl_s: float | None = Field(None, ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S)
    acquire_timeout_s: float | None = Field(
        None, gt=0, le=7 * 86_400, description="give up on a group after this long"
    )
    sample_timeout_s: float = Field(1800.0, gt=0, le=86_400)
    reward_timeout_s: float = Field(1800.0, gt=0, le=86_400)
    train_timeout_s: float = Field(1800.0, gt=0, le=86_400)
    checkpoint_timeout_s: float = Field(600.0, gt=0, le=86_400)
    heartbeat_timeout_s: float = Field(
        30.0, ge=2, le=3600, description="a job process silent this long is taken for dead"
    )
    process_wait_s: float = Field(
        3600.0, gt=0, le=30 * 86_400, description="how long to wait for a job process to serve"
    )
    checkpoint_every: int = Field(5, ge=1, le=1_000_000)
    continue_as_new_every: int = Field(100, ge=1, le=100_000)
    max_failures: int = Field(
        5, ge=0, le=1000, description="consecutive failed epochs before the job fails"
    )

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, v: str) -> str:
        return check_id("job id", v)

    @field_validator("workload")
    @classmethod
    def _workload(cls, v: str) -> str:
        return check_workload(v)

    @field_validator("workload_options")
    @classmethod
    def _workload_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_workload_options(v)

    @field_validator("sampler_group", "trainer_group")
    @classmethod
    def _group_id(cls, v: str | None) -> str | None:
        return None if v is None else check_id("group id", v)

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str | None) -> str | None:
        return None if v is None else check_id("pool name", v)

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str | None) -> str | None:
        return None if v is None else check_id("tenant", v)

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # Carried with the config across continue-as-new: kept small (a profile is a few
        # phases and states; plan/placement.py checks the rest).
        if v is None:
            return v
        size = json_size(v, "profile: not plain JSON")
        if size > MAX_PROFILE_CHARS:
            raise ValueError(f"profile: {size} characters of JSON; at most {MAX_PROFILE_CHARS}")
        return v

    @model_serializer(mode="wrap")
    def _omit_pool_fields(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A job without a pool encodes as before pools existed (an older reader, which refuses
        # unknown fields, still takes it).
        data = handler(self)
        if isinstance(data, dict) and self.pool is None:
            for name in ("pool", "profile", "place_anyway", "tenant"):
                data.pop(name, None)
        elif isinstance(data, dict) and self.tenant is None:
            data.pop("tenant", None)  # as a pool job encoded before tenants
        return data

    @model_validator(mode="after")
    def _groups(self) -> RLJobConfig:
        if self.sampler_group is None:
            if self.pool is None:
                raise ValueError(
                    "give sampler_group (and trainer_group) for the job's groups, or pool for a "
                    "pool to place it"
                )
            if self.trainer_group is not None:
                raise ValueError("trainer_group without sampler_group: a pool places the job")
            return self  # placed by its pool when it starts (workflows/pool_job.py)
        if self.pool is None and (
            self.profile is not None or self.place_anyway or self.tenant is not None
        ):
            raise ValueError("profile, place_anyway and tenant are for a job started with pool")
        if self.trainer_group is None:
            self.trainer_group = self.sampler_group
        return self

    @property
    def trainer(self) -> str:
        """The group the ``train`` phase runs on ("" until a pool placed the job)."""
        return self.trainer_group or self.sampler_group or ""

    @property
    def sampler(self) -> str:
        """The group the ``sample`` phase runs on ("" until a pool placed the job)."""
        return self.sampler_group or ""

    def groups(self) -> list[str]:
        """The job's groups in the one order every job acquires them in (no deadlock)."""
        return sorted({self.sampler, self.trainer})


class JobSpecModel(_Model):
    """What the job process needs to build its state (``timeslice.workloads.JobSpec``)."""

    job_id: str
    workload: str
    seed: int
    batch_size: int
    group_size: int
    options: dict[str, Any] = Field(default_factory=dict)


class CheckpointRef(_Model):
    """A saved state: the model after ``epochs_done`` epochs, under ``path`` (one dir per rank)."""

    epochs_done: int = Field(ge=0)
    path: str = Field(max_length=MAX_CHECKPOINT_PATH)


class DescribeInput(_Model):
    """The ``describe`` activity's input: which job asks, in which protocol."""

    job_id: str
    protocol: int | None = Field(
        None, description="the workflow's JOB_PROTOCOL_VERSION (None: a release before it)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="the job's workload options (they may name its states)"
    )
    chain_id: str | None = Field(
        None,
        max_length=200,
        description="the first run id of the job workflow's chain of runs (it survives "
        "continue-as-new): a job process serves one chain, and refuses any other",
    )


# Fields job processes of earlier releases sent in DescribeResult, which nothing read: their
# answers stay in running jobs' histories, so they are dropped rather than refused. Any other
# unknown field is still refused, naming it.
_RETIRED_DESCRIBE_FIELDS = ("pid", "ready")


class DescribeResult(_Model):
    """A job process's answer to ``describe``: its workload, its states, its protocol."""

    workload: str
    sampler_backends: list[str]
    trainer_backends: list[str]
    epochs_done: int | None
    protocol: int | None = Field(
        None, description="the process's JOB_PROTOCOL_VERSION (None: a release before it)"
    )

    @model_validator(mode="before")
    @classmethod
    def _drop_retired_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(f in data for f in _RETIRED_DESCRIBE_FIELDS):
            return {k: v for k, v in data.items() if k not in _RETIRED_DESCRIBE_FIELDS}
        return data


def protocol_mismatch(workflow_version: int | None, process_version: int | None) -> str | None:
    """Why a job workflow and a job process of these protocol versions cannot work together,
    or None if they can."""
    if workflow_version == process_version:
        return None

    def named(version: int | None) -> str:
        return "a release before protocol versions" if version is None else f"v{version}"

    return (
        f"the job workflow speaks job protocol {named(workflow_version)} and the job process "
        f"{named(process_version)}: run job workers of the same Timeslice release as the "
        "control workers (docs/upgrading.md)"
    )


class PrepareResult(_Model):
    """A rank's answer to ``prepare``: where it stands, and what its state occupies."""

    epochs_done: int
    state_bytes: int | None
    backend_bytes: dict[str, int | None] = Field(
        default_factory=dict, description="device bytes of each state (None: unknown)"
    )


class LeaseOrder(_Model):
    """The lease a GPU phase runs under, as the job workflow hands it to the job process.

    With no ``token`` the process acquires it itself when the activity starts: the grant comes
    straight to the process that runs the phase (the group's parked ``acquire`` update), so no
    workflow task and no activity dispatch lie between the previous holder's release and this
    phase. With a ``token`` the lease is already held: by this process (carried from the
    previous phase) or by the workflow (jobs with several ranks)."""

    group_id: str
    request_id: str = Field(min_length=1, max_length=200)
    key: str = Field(min_length=16, max_length=200, description="the lease key (docs/security.md)")
    token: int | None = Field(None, ge=1)
    held_by: Literal["process", "workflow"] = "process"
    timeout_s: float | None = Field(None, gt=0, description="give up waiting after this long")
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    ttl_s: float | None = Field(None, ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S)
    state_bytes: int | None = Field(None, ge=0)


class PrepareInput(_Model):
    """The ``prepare`` activity's input: the job's spec, the checkpoint to load, the leases."""

    spec: JobSpecModel
    checkpoint: CheckpointRef | None = None
    homes: dict[str, str] = Field(
        default_factory=dict,
        description="backend name -> the group whose device holds that state after preparing",
    )
    lease_keys: dict[str, str] = Field(
        default_factory=dict,
        description="group id -> the key of the lease the job prepared under there: what the "
        "process's later reports to that group present",
    )
    leases: list[LeaseOrder] = Field(
        default_factory=list,
        max_length=64,
        description="the leases (held by the workflow) the preparation runs under: the process "
        "checks them itself and stops once one is gone (since protocol v3)",
    )


class _OmitsWhenNone(_Model):
    """A message some of whose fields came with a later job protocol: each of them is left out
    of the encoding while None, so a message that does not use them encodes as an older
    release's did (and an older reader, which refuses unknown fields, still takes it)."""

    _omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self._omitted_when_none:
                if getattr(self, name) is None:
                    data.pop(name, None)
        return data


class PhaseInput(_OmitsWhenNone):
    """A phase activity's input: the phase, its lease order, what to do with the lease."""

    _omitted_when_none = ("carry_into",)

    job_id: str
    epoch: int = Field(ge=0)
    phase: Phase
    lease: LeaseOrder | None = Field(None, description="a GPU phase's lease; None: no GPU")
    timeout_s: float = Field(1800.0, gt=0, description="the phase's own work, once granted")
    lease_check_s: float = Field(2.0, gt=0)
    group_backends: list[str] = Field(
        default_factory=list,
        description="the job's state on the leased group: brought to its device before the "
        "phase, and moved out on a contended release (co-operative switching)",
    )
    release: Literal["always", "if_contended", "never"] = Field(
        "never",
        description="a lease the process holds: release it as soon as the phase's work is done; "
        "if_contended: keep it when nobody waits (the job's next phase is on the same group)",
    )
    prefetch: LeaseOrder | None = Field(
        None,
        description="the job's next GPU phase's lease: ask for it as soon as this step is done, "
        "one workflow round trip before that phase's activity starts",
    )
    prefetch_backends: list[str] = Field(
        default_factory=list, description="the job's state on the prefetched lease's group"
    )
    carry_into: NextPhase | None = Field(
        None,
        description="with release if_contended: the job's next GPU phase on this group and its "
        "expected length, measured from the job's records; the group's grant policy may keep "
        "the lease for it even when others wait (since protocol v4; absent from the encoded "
        "input when None, so a job of an older protocol sends what it always did)",
    )

    @property
    def group_id(self) -> str | None:
        """The leased group (None: the phase runs with no GPU)."""
        return None if self.lease is None else self.lease.group_id


class PhaseResult(_OmitsWhenNone):
    """A phase activity's result: its metrics, its interval, and what became of its lease."""

    _omitted_when_none = ("asked_ahead",)

    epoch: int
    phase: Phase
    metrics: dict[str, float]
    seconds: float
    mono_start: float = Field(description="CLOCK_MONOTONIC at the phase's start (same host)")
    mono_end: float
    wall_offset_s: float | None = Field(
        None,
        description="the process's wall clock minus its monotonic clock (seconds since the "
        "epoch): what places the monotonic times on a shared timeline (timeslice report)",
    )
    group_id: str | None = None
    token: int | None = Field(None, description="the fencing token of the lease it ran under")
    request_id: str | None = None
    waited_s: float = Field(0.0, description="from asking for the lease to its grant")
    asked_mono: float | None = Field(None, description="CLOCK_MONOTONIC when the lease was asked")
    granted_mono: float | None = None
    released_mono: float | None = Field(None, description="when the release was sent")
    released: bool = Field(False, description="the process released the lease itself")
    kept: bool = Field(
        False, description="the process still holds the lease (nobody waited, or it was carried)"
    )
    carry: str = Field(
        "",
        max_length=MAX_CARRY_REASON,
        description="the group's answer to carrying the lease into the next phase: why it was "
        "kept or released (empty: not asked)",
    )
    restored: list[SnapshotReport] = Field(
        default_factory=list, description="state the process brought back before the phase"
    )
    evicted: list[SnapshotReport] = Field(
        default_factory=list, description="state the process moved out after releasing"
    )
    asked_ahead: bool | None = Field(
        None,
        description="with a prefetch: whether the process sent its acquire (False: it still "
        "held that group, whose lease the next phase carries, so the order never reached the "
        "group and needs no cancel); None: no prefetch, or a process before protocol v5 (absent "
        "from the encoded result when None)",
    )


class CheckpointInput(_Model):
    """The ``save_checkpoint`` activity's input: after how many epochs, under which lease."""

    job_id: str
    epochs_done: int = Field(ge=0)
    backends: list[str] = Field(
        default_factory=list, description="the state the checkpoint reads (made resident first)"
    )
    lease: LeaseOrder | None = Field(
        None, description="the held lease the checkpoint runs under (its state lives there)"
    )
    release: bool = Field(False, description="release the lease (held by the process) after it")
    prefetch: LeaseOrder | None = Field(None, description="as in PhaseInput")
    prefetch_backends: list[str] = Field(default_factory=list)


class EpochRecord(_Model):
    """One epoch as the job keeps it: its metrics, times, lease waits and GPU holds."""

    epoch: int
    reward_mean: float | None
    metrics: dict[str, float] = Field(default_factory=dict)
    wait_s: dict[str, float] = Field(default_factory=dict, description="lease wait per phase")
    phase_s: dict[str, float] = Field(default_factory=dict, description="run time per phase")
    holds: list[PhaseResult] = Field(
        default_factory=list,
        description="the GPU phases' own intervals (rank 0; their metrics are in ``metrics``)",
    )
    dropped_metrics: int = Field(
        0,
        description="metrics not kept: past MAX_RECORD_METRICS or MAX_RECORD_METRICS_BYTES, "
        "names over MAX_METRIC_NAME characters, or not finite",
    )
    dropped_reports: int = Field(
        0, description="snapshot reports of the holds not kept, so the record fits"
    )


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _bounded_times(times: dict[str, float]) -> dict[str, float]:
    kept: dict[str, float] = {}
    for name, value in times.items():
        if len(kept) < MAX_RECORD_TIMES and len(name) <= 32 and _finite(value):
            kept[name] = value
    return kept


def bound_record(record: EpochRecord) -> EpochRecord:
    """``record`` cut to what one carried record may hold (in place; returned for chaining).

    Metrics beyond the caps are dropped (first ones kept) and counted in ``dropped_metrics``; a
    hold keeps its interval and reports but not its metrics (``metrics`` has them, by phase);
    past MAX_RECORD_BYTES the holds' snapshot reports go, last first (``dropped_reports``)."""
    kept: dict[str, float] = {}
    used = 2
    for seen, (name, value) in enumerate(record.metrics.items()):
        if len(kept) == MAX_RECORD_METRICS:
            record.dropped_metrics += len(record.metrics) - seen
            break
        cost = encoded_size(name) + encoded_size(value) + 2
        if (
            len(name) <= MAX_METRIC_NAME
            and _finite(value)
            and used + cost <= MAX_RECORD_METRICS_BYTES
        ):
            kept[name] = value
            used += cost
        else:
            record.dropped_metrics += 1
    record.metrics = kept
    record.wait_s = _bounded_times(record.wait_s)
    record.phase_s = _bounded_times(record.phase_s)
    holds = record.holds[:MAX_RECORD_HOLDS]
    record.holds = [
        hold.model_copy(
            update={
                "metrics": {},
                "group_id": None if hold.group_id is None else hold.group_id[:100],
                "request_id": None if hold.request_id is None else hold.request_id[:200],
                "restored": hold.restored[:MAX_BACKENDS],
                "evicted": hold.evicted[:MAX_BACKENDS],
            }
        )
        for hold in holds
    ]
    for hold in reversed(record.holds):
        for reports in (hold.evicted, hold.restored):
            while reports and encoded_size(record) > MAX_RECORD_BYTES:
                reports.pop()
                record.dropped_reports += 1
    return record


def phase_totals(records: list[EpochRecord]) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per phase, and seconds waited for a lease per phase, over ``records``."""
    phase_s: dict[str, float] = {}
    wait_s: dict[str, float] = {}
    for record in records:
        for key, value in record.phase_s.items():
            phase_s[key] = phase_s.get(key, 0.0) + value
        for key, value in record.wait_s.items():
            wait_s[key] = wait_s.get(key, 0.0) + value
    return phase_s, wait_s


class EpochTotals(_Model):
    """Running totals of epochs whose records were folded away (bounded carried state)."""

    epochs: int = 0
    phase_s: dict[str, float] = Field(default_factory=dict)
    wait_s: dict[str, float] = Field(default_factory=dict)

    def add(self, record: EpochRecord) -> None:
        """Fold ``record``'s times into the totals."""
        self.epochs += 1
        for totals, times in ((self.phase_s, record.phase_s), (self.wait_s, record.wait_s)):
            for key, value in times.items():
                if key in totals or len(totals) < MAX_RECORD_TIMES:
                    totals[key] = totals.get(key, 0.0) + value

    def merge(self, other: EpochTotals) -> None:
        """Add ``other``'s totals to these."""
        self.epochs += other.epochs
        for totals, times in ((self.phase_s, other.phase_s), (self.wait_s, other.wait_s)):
            for key, value in times.items():
                if key in totals or len(totals) < MAX_RECORD_TIMES:
                    totals[key] = totals.get(key, 0.0) + value


class RLJobState(_Model):
    """What the job must not lose: carried across continue-as-new. Bounded by
    ``rl_job_state_budget``: the records of the last RECENT_EPOCH_RECORDS epochs, each cut to
    MAX_RECORD_BYTES; running totals for the rest (those since the last checkpoint apart, for a
    rewind drops them); and the last ``MAX_REWARDS`` rewards."""

    epochs_done: int = 0
    prepared: bool = False
    last_checkpoint: CheckpointRef | None = None
    records: list[EpochRecord] = Field(default_factory=list)
    folded: EpochTotals = Field(default_factory=EpochTotals)
    unconfirmed: EpochTotals = Field(
        default_factory=EpochTotals,
        description="totals of records folded away that are newer than the last checkpoint",
    )
    unconfirmed_until: int = Field(
        0, description="the epoch after the last one folded into ``unconfirmed``"
    )
    rewards: list[float | None] = Field(default_factory=list)
    rewards_from: int = Field(0, description="the epoch of rewards[0]")
    rewinds: int = 0
    redone_epochs: int = 0
    runs: int = 1
    shed_records: int = Field(
        0,
        description="records folded early and rewards dropped, oldest first, so that a "
        "continue-as-new input fits Temporal's payload limit",
    )
    state_bytes: int | None = None
    backend_bytes: dict[str, int | None] = Field(
        default_factory=dict, description="device bytes of each state, summed over ranks"
    )
    stop_requested: bool = False
    failures: int = Field(0, description="consecutive failed epochs")
    lease_secret: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="what the job's lease keys derive from (drawn once, by a local activity)",
    )
    pending_move: MoveOrder | None = Field(
        None, description="a move its pool ordered, taken at the next checkpoint boundary"
    )
    moves: list[JobMove] = Field(
        default_factory=list, description=f"the last {MOVES_KEPT} moves the job took"
    )
    profile_sent: bool = Field(
        False, description="a job placed without a profile sent its pool the one it measured"
    )
    sent_profile_s: tuple[float, float] | None = Field(
        None,
        description="GPU and epoch seconds of the profile the job last sent its pool (None: "
        "its declared profile's, or none sent)",
    )
    sent_profile_at: int = Field(
        0, ge=0, description="epochs done when the job last sent its pool a profile"
    )

    def moved(self, move: JobMove) -> None:
        """Keep ``move`` (the last MOVES_KEPT)."""
        self.moves.append(move)
        del self.moves[:-MOVES_KEPT]

    def _confirmed_from(self) -> int:
        return self.last_checkpoint.epochs_done if self.last_checkpoint else 0

    def _fold_oldest(self) -> None:
        old = self.records.pop(0)
        if old.epoch < self._confirmed_from():
            self.folded.add(old)
        else:  # a rewind to the last checkpoint may still drop it
            self.unconfirmed.add(old)
            self.unconfirmed_until = max(self.unconfirmed_until, old.epoch + 1)

    def _confirm(self, up_to: int) -> None:
        """Epochs before ``up_to`` are kept whatever comes: their unconfirmed totals are final."""
        if self.unconfirmed.epochs and self.unconfirmed_until <= up_to:
            self.folded.merge(self.unconfirmed)
            self.unconfirmed, self.unconfirmed_until = EpochTotals(), 0

    def add_record(self, record: EpochRecord) -> None:
        """Keep ``record`` (bounded) and its reward; fold the oldest beyond the recent ones."""
        self.records.append(bound_record(record))
        self.rewards.append(record.reward_mean)
        if len(self.rewards) > MAX_REWARDS:
            drop = len(self.rewards) - MAX_REWARDS
            del self.rewards[:drop]
            self.rewards_from += drop
        self._confirm(self._confirmed_from())
        while len(self.records) > RECENT_EPOCH_RECORDS:
            self._fold_oldest()

    def drop_records_from(self, epoch: int) -> int:
        """A rewind: forget the epochs from ``epoch`` on (the records, and the totals of those
        folded since the last checkpoint). Returns how many epochs were dropped."""
        lost = sum(1 for r in self.records if r.epoch >= epoch)
        self.records = [r for r in self.records if r.epoch < epoch]
        self._confirm(epoch)
        lost += self.unconfirmed.epochs
        self.unconfirmed, self.unconfirmed_until = EpochTotals(), 0
        del self.rewards[max(0, epoch - self.rewards_from) :]
        return lost

    def totals(self) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds per phase and seconds waited per phase, over every epoch done."""
        phase_s, wait_s = phase_totals(self.records)
        for folded in (self.folded, self.unconfirmed):
            for key, value in folded.phase_s.items():
                phase_s[key] = phase_s.get(key, 0.0) + value
            for key, value in folded.wait_s.items():
                wait_s[key] = wait_s.get(key, 0.0) + value
        return phase_s, wait_s

    def bound(self) -> None:
        """Cut what a state from an older release (or a process's answer) may hold past the
        bounds: records, the backends' sizes."""
        for record in self.records:
            bound_record(record)
        while len(self.records) > RECENT_EPOCH_RECORDS:
            self._fold_oldest()
        if len(self.backend_bytes) > MAX_BACKENDS or any(
            len(name) > 100 for name in self.backend_bytes
        ):
            names = [n for n in self.backend_bytes if len(n) <= 100][:MAX_BACKENDS]
            self.backend_bytes = {n: self.backend_bytes[n] for n in names}


class RLJobInput(_Model):
    """A job workflow's input: its config, and from its second run on what it carries across
    continue-as-new (an async job's is ``AsyncRLJobInput``, which narrows both)."""

    config: RLJobConfig
    state: RLJobState | None = None

    @classmethod
    def carried(cls, config: RLJobConfig, state: RLJobState) -> tuple[dict[str, Any], int, int]:
        """The next run's input as JSON, bounded and shed to fit.

        Records and rewards are shed oldest first (records folded into the totals, which lose
        nothing; then rewards) to bring the input within CARRIED_STATE_BUDGET_BYTES. A state
        within its bounds never needs it; a continue-as-new input over Temporal's payload
        limit would fail its task forever.

        Args:
            config: The job's config, carried as it is.
            state: The job's state: bounded, and shed from, in place (``shed_records`` counts
                it).

        Returns:
            The input as JSON, its encoded size in bytes, and how many records and rewards
            were shed for it (0 for a state within its bounds).
        """
        state.bound()
        shed = 0
        while True:
            carried = cls(config=config, state=state).model_dump(mode="json")
            size = encoded_size(carried)
            if size <= CARRIED_STATE_BUDGET_BYTES or not (state.records or state.rewards):
                break
            if state.records:
                state._fold_oldest()
            else:
                drop = max(1, len(state.rewards) // 4)
                del state.rewards[:drop]
                state.rewards_from += drop
            shed += 1
        if shed:
            state.shed_records += shed
            carried = cls(config=config, state=state).model_dump(mode="json")
            size = encoded_size(carried)
        return carried, size, shed


def carried_rl_job_input(config: RLJobConfig, state: RLJobState) -> tuple[dict[str, Any], int, int]:
    """``RLJobInput.carried``: a sync job's next input, its size, and what was shed for it."""
    return RLJobInput.carried(config, state)


class RLJobProgress(_Model):
    """What the ``progress`` query answers: where the job stands, as of the workflow's last
    task (an async job answers ``AsyncRLJobProgress``, which extends it)."""

    job_id: str
    status: Literal["starting", "running", "stopping", "completed", "stopped", "failed"]
    epoch: int
    epochs: int
    phase: str
    reward_mean: float | None
    rewards: list[float | None]
    rewards_from: int = Field(0, description="the epoch of rewards[0]")
    # Defaults: an async job's progress had neither before it extended this model.
    phase_s: dict[str, float] = Field(default_factory=dict, description="totals, every epoch")
    wait_s: dict[str, float] = Field(default_factory=dict, description="totals, every epoch")
    rewinds: int
    redone_epochs: int = Field(
        0, description="epochs (an async job: steps) the rewinds threw away, to be run again"
    )
    last_checkpoint: CheckpointRef | None
    shed_records: int = Field(
        0, description="records folded early so that a continue-as-new input fits (RLJobState)"
    )
    forged_notices: int = Field(
        0,
        description="grant and fault notices this run dropped as no group's to this job: their "
        "proof was missing or wrong, or they named a request the job never made, or the job's "
        "process refused a grant that its group never made (docs/security.md)",
    )
    sampler_group: str | None = Field(None, description="where it samples now")
    trainer_group: str | None = Field(None, description="where it trains now")
    moves: list[JobMove] = Field(
        default_factory=list, description="the last moves its pool made it take (docs/pools.md)"
    )

    @classmethod
    def of(cls, config: RLJobConfig, state: RLJobState, **now: Any) -> Self:
        """The progress of a job run with ``config`` whose carried state is ``state``.

        Args:
            config: The job's config.
            state: The job's carried state: epochs, rewards, totals, what was shed.
            **now: What only the running workflow knows: ``status``, ``phase``,
                ``forged_notices`` (and an async job's pipeline, ``AsyncRLJobProgress.of``).

        Returns:
            The progress, as the ``progress`` query answers it.
        """
        phase_s, wait_s = state.totals()
        rewards = list(state.rewards)
        return cls(
            job_id=config.job_id,
            epoch=state.epochs_done,
            epochs=config.epochs,
            reward_mean=rewards[-1] if rewards else None,
            rewards=rewards,
            rewards_from=state.rewards_from,
            phase_s=phase_s,
            wait_s=wait_s,
            rewinds=state.rewinds,
            redone_epochs=state.redone_epochs,
            last_checkpoint=state.last_checkpoint,
            shed_records=state.shed_records,
            sampler_group=config.sampler_group,
            trainer_group=config.trainer or None,
            moves=list(state.moves),
            **now,
        )


# What a job's result reports of its carried state, as it is.
_RESULT_FROM_STATE = frozenset(
    {
        "epochs_done",
        "last_checkpoint",
        "rewinds",
        "redone_epochs",
        "records",
        "rewards",
        "rewards_from",
    }
)


class RLJobResult(_Model):
    """What a job workflow returns when it completes or stops (an async job returns
    ``AsyncRLJobResult``, which extends it)."""

    job_id: str
    epochs_done: int
    stopped: bool
    last_checkpoint: CheckpointRef | None
    rewinds: int
    redone_epochs: int
    records: list[EpochRecord] = Field(description="the most recent epochs' records")
    rewards: list[float | None] = Field(default_factory=list, description="per epoch")
    rewards_from: int = Field(0, description="the epoch of rewards[0]")
    phase_s: dict[str, float] = Field(default_factory=dict, description="totals, every epoch")
    wait_s: dict[str, float] = Field(default_factory=dict, description="totals, every epoch")

    @classmethod
    def of(cls, config: RLJobConfig, state: RLJobState, **extra: Any) -> Self:
        """The result of a job run with ``config`` that ended with ``state``.

        Args:
            config: The job's config.
            state: The job's carried state as the job ended.
            **extra: Fields of a subclass (``AsyncRLJobResult.of`` passes its own).

        Returns:
            The result, as the workflow returns it.
        """
        phase_s, wait_s = state.totals()
        stopped = state.epochs_done < config.epochs
        carried = state.model_dump(include=_RESULT_FROM_STATE)
        totals = {"phase_s": phase_s, "wait_s": wait_s}
        return cls(job_id=config.job_id, stopped=stopped, **totals, **carried, **extra)
