"""Messages and state of the GPU-group lease protocol.

Everything here crosses Temporal (signals, updates, queries, activity arguments, continue-as-new
input), so it is a pydantic model; this module imports nothing with I/O so workflows can use it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)
from temporalio.common import SearchAttributeKey

CONTROL_TASK_QUEUE = "timeslice"
GROUP_WORKFLOW_TYPE = "GpuGroupWorkflow"

# Activity names served by a job process on its own task queue.
DELIVER_GRANT_ACTIVITY = "timeslice.deliver_grant"
# Served by the control worker, as a local activity of requester workflows.
REQUEST_GROUP_ACTIVITY = "timeslice.request_group"
DRAW_SECRET_ACTIVITY = "timeslice.draw_secret"
# Served by the control worker too: a requester workflow's renewal, sent as an update so that it
# is answered (a signal's renewal never says whether the lease was still held).
RENEW_LEASE_ACTIVITY = "timeslice.renew_lease"
# The signal a requester *workflow* receives its grant by.
GRANT_SIGNAL = "timeslice_grant"
SNAPSHOT_ACTIVITY = "timeslice.snapshot"
RESTORE_ACTIVITY = "timeslice.restore"


class GroupUpdate(StrEnum):
    """Updates of the group workflow: what processes send.

    Processes talk to the group by update, never by signal: an update that reaches a group while
    it continues as new is retried on the next run, while a signal arriving then fails the
    continue-as-new and makes the worker replay the whole run (docs/architecture.md)."""

    ACQUIRE = "acquire"
    RELEASE = "release_lease"
    RENEW = "renew"
    CANCEL = "cancel_request"
    MOVED = "report_moved"
    DEPART = "depart_job"


class GroupSignal(StrEnum):
    """Signals of the group workflow: what requester *workflows* send (they cannot update)."""

    REQUEST = "request"
    RELEASE = "release"
    RENEW = "renew_lease"
    CANCEL = "cancel"


class GrantPolicy(StrEnum):
    """Who gets a group when (workflows/grant_policy.py explains both and their bounds)."""

    FIFO = "fifo"  # a lease is kept into the holder's next phase only when nobody waits
    PHASE_AWARE = "phase_aware"  # it may be carried past waiters, within bounds


class GroupQuery(StrEnum):
    HOLDER = "holder"
    STATUS = "status"
    RENEWAL_RULE = "renewal_rule"


# What each message of the group workflow does: its handler's description, which the Web UI
# and `temporal workflow metadata` show (tests/unit/test_contract.py: every message has one).
GROUP_MESSAGE_ABOUT: dict[str, str] = {
    GroupUpdate.ACQUIRE: (
        "Queue a lease request (idempotent by request id) and park until it is granted (the "
        "answer carries the grant notice), gone, or to be asked again; refused while the queue "
        "is full."
    ),
    GroupUpdate.RELEASE: (
        "End the caller's lease, or keep it (nobody waits and it asked, or the grant policy "
        "carries it into its next phase); the answer says whether to evict its own state now."
    ),
    GroupUpdate.RENEW: (
        "Renew the caller's lease for its TTL (the first renewal confirms a grant taken from a "
        "parked acquire); not valid once the lease is gone or with a wrong key."
    ),
    GroupUpdate.CANCEL: (
        "Take a request back: leave the queue, or end the lease if a grant raced the give-up. "
        "Only with the request's key."
    ),
    GroupUpdate.MOVED: (
        "A job reports that its state left this group's device (its own eviction after a "
        "release, or a move to another group): bytes counted, residency forgotten; a failed "
        "eviction faults the job when the group asked for it."
    ),
    GroupUpdate.DEPART: (
        "A job's processes closed: its state left the device with them, and the group forgets "
        "it. False while the job holds the group, or with a wrong key."
    ),
    GroupSignal.REQUEST: (
        "A requester workflow's lease request: queued (its grant comes by the timeslice_grant "
        "signal); dropped and counted when malformed or the queue is full."
    ),
    GroupSignal.RELEASE: "A requester workflow ends its lease (with what it moved itself).",
    GroupSignal.RENEW: (
        "A requester workflow renews its lease (its answered renewals go as the renew update)."
    ),
    GroupSignal.CANCEL: (
        "A requester workflow takes its request back (as the cancel_request update)."
    ),
    GroupQuery.HOLDER: (
        "The current lease only (job, fencing token, time held and left, waiters): what a "
        "running phase checks its token against."
    ),
    GroupQuery.STATUS: (
        "The group's status: holder, queue, resident and faulted jobs, counts, share held, wait "
        "percentiles, lease and switch records."
    ),
    GroupQuery.RENEWAL_RULE: (
        "Whether a renewal the server recorded before the lease's expiry renews it, however "
        "late the group's workflow task handles it: a holder whose renewal signal the server "
        "took in time may count its lease from that signal (transport/renewals.py)."
    ),
}


# The Web UI's search attributes, defined here once: the group's id on its workflow, the job's
# id and current phase on an RL job's workflow (`timeslice setup` registers them).
GROUP_KEY = SearchAttributeKey.for_keyword("TimesliceGroup")
JOB_KEY = SearchAttributeKey.for_keyword("TimesliceJob")
PHASE_KEY = SearchAttributeKey.for_keyword("TimeslicePhase")
SEARCH_ATTRIBUTES: dict[str, str] = {key.name: "Keyword" for key in (GROUP_KEY, JOB_KEY, PHASE_KEY)}

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
ID_RULE = "1-100 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"

DEFAULT_LEASE_TTL_S = 20.0
MAX_LEASE_TTL_S = 3600.0
MIN_LEASE_TTL_S = 1.0
MIN_PRIORITY, MAX_PRIORITY = -100, 100
# Bounds on what a message may carry: nothing a caller sends can grow a group's state or its
# workflow task without limit.
MAX_ACQUIRE_TIMEOUT_S = 366 * 86_400.0
MAX_STATE_BYTES = 2**50
MAX_QUEUES = 64
MAX_BACKENDS = 16
MAX_PROCESSES = 64
MAX_REPORTS = 64
KEY_RULE = "16-200 characters"
# The group's queue: a request beyond either bound is refused (an update) or dropped and counted
# (a signal), so no flood of requests can grow the state the group carries past what one
# continue-as-new input may hold. Bytes are counted as the data converter encodes them (JSON,
# UTF-8, control characters escaped): `encoded_size`.
MAX_WAITERS = 1000
MAX_QUEUE_BYTES = 512 * 1024
MAX_REQUEST_BYTES = 64 * 1024
# Per-caller fairness (workflows/caller_budget.py): the updates one caller may send a group,
# as a token bucket (a sustained rate and a burst). A caller is the job a message proves it
# speaks for by its lease key, or, for one that proves nothing (a new acquire names any job it
# likes), the job it claims; every unproven message also draws on one budget all of them share.
# An update past its budget is refused by the group's validator: nothing enters the history,
# and the caller is told the limit and when to send again (RATE_LIMITED). The holder's own
# renewals and releases of its lease are never refused. What a job sends in a phase (an
# acquire, a cancel, a report; renewals and releases are the holder's) is a few updates.
CALLER_UPDATES_PER_S = 20.0
CALLER_UPDATE_BURST = 40
UNPROVEN_UPDATES_PER_S = 80.0
UNPROVEN_UPDATE_BURST = 160
# The error type of an update refused for its caller's rate (its details: seconds to wait).
RATE_LIMITED = "RateLimited"

# ---- What a group carries into its next run, and why it always fits.
# Temporal refuses a payload over 2 MiB (the server's blob size limit); a continue-as-new whose
# input is larger fails its workflow task on every retry, which wedges the group for good.
PAYLOAD_LIMIT_BYTES = 2 * 1024 * 1024
# What the bounds below add up to at most (`group_state_budget`); the rest of the limit is margin
# (payload metadata, an encrypting codec's envelope). tests/unit/test_state_budget.py builds the
# state at every limit and measures it with the real data converter.
CARRIED_STATE_BUDGET_BYTES = 1536 * 1024
# The most a carried input may take and still be sent (beside metadata and a codec's envelope).
CARRY_CEILING_BYTES = PAYLOAD_LIMIT_BYTES - 128 * 1024
RECENT_DONE_KEEP = 2048  # fingerprints of finished requests (16 hex digits each)
# Fingerprints of leases their holders released (request, token and key): a release sent
# again after the first landed in a run since continued as new is answered released, not
# "not valid" as a lease that was revoked is.
RECENT_RELEASED_KEEP = 1024
JOB_KEYS_KEEP = 1024  # job id -> its last lease's key hash; jobs the group still tracks go last
EVICTED_JOBS_KEEP = 256  # jobs whose state the group saved; past it the oldest is forgotten
FAULTED_JOBS_KEEP = 64  # faults shown and refused; past it the oldest is forgotten
# A waiter's restore is staged (run while the holder works) only if its own last restore here
# took at least this long: a staged restore costs the control plane an activity (a few server
# writes and two group workflow tasks), which a restore shorter than that does not repay.
STAGE_MIN_RESTORE_S = 0.05
MAX_FAULT_BYTES = 512  # a fault's text, encoded, is cut to this (it quotes others' errors)
MAX_WAIT_SAMPLES_KEEP = 2048
# The grant policy's waiting shares (workflows/grant_policy.py): grants per job a share is
# computed over, and jobs a group remembers them for (the least recently granted go first).
WAIT_RECORDS_KEEP = 16
WAIT_SHARE_JOBS_KEEP = 32
# A group's grant policy and its bounds when its config names none: GroupConfig's defaults,
# and the planner's, the simulator's and the CLI's (one place, so they cannot drift apart).
DEFAULT_GRANT_POLICY = GrantPolicy.PHASE_AWARE
DEFAULT_MAX_CARRIES = 1
DEFAULT_CARRY_LIMIT_S = 60.0
DEFAULT_SHARE_SLACK = 0.05
# Seconds of waiting that raise a waiter by one priority level (the waiter order's ageing).
DEFAULT_AGING_S = 60.0
# The most one entry takes, encoded with its separator: ids are ASCII (ID_RULE), times at most
# "2999-12-31T23:59:59.999999-23:59", integers 20 characters, floats 24.
_ID_BYTES = 103
_LEASE_RECORD_BYTES = 384  # with MAX_LEASE_PHASES reported phases (issue 25)
_SWITCH_RECORD_BYTES = 384
_FLOAT_BYTES = 25
_FINGERPRINT_BYTES = 19
_KEY_HASH_BYTES = 67
_WAITER_OVERHEAD_BYTES = 96  # a waiter beside its request: seq, enqueued_at, field names
_LEASE_OVERHEAD_BYTES = 512  # a held lease or a resident job beside its request or target
_FIXED_BYTES = 4096  # the config, the counters, tokens, field names


def group_state_budget(history_keep: int, wait_samples_keep: int) -> int:
    """The most a group's continue-as-new input (``GroupInput``) encodes to, by its bounds."""
    return (
        _FIXED_BYTES
        + wait_samples_keep * _FLOAT_BYTES
        + MAX_QUEUE_BYTES
        + MAX_WAITERS * _WAITER_OVERHEAD_BYTES
        # the holder's request, the resident's and the evicting job's snapshot targets
        + 3 * (MAX_REQUEST_BYTES + _LEASE_OVERHEAD_BYTES)
        + EVICTED_JOBS_KEEP * _ID_BYTES
        + FAULTED_JOBS_KEEP * (_ID_BYTES + MAX_FAULT_BYTES + 1)
        + JOB_KEYS_KEEP * (_ID_BYTES + _KEY_HASH_BYTES)
        + (RECENT_DONE_KEEP + RECENT_RELEASED_KEEP) * _FINGERPRINT_BYTES
        + history_keep * (_LEASE_RECORD_BYTES + _SWITCH_RECORD_BYTES)
        + WAIT_SHARE_JOBS_KEEP * (_ID_BYTES + 2 * WAIT_RECORDS_KEEP * _FLOAT_BYTES)
    )


def _max_history_keep() -> int:
    spare = CARRIED_STATE_BUDGET_BYTES - group_state_budget(0, MAX_WAIT_SAMPLES_KEEP)
    return spare // (_LEASE_RECORD_BYTES + _SWITCH_RECORD_BYTES)


# Lease and switch records a group may keep: what fits in the budget beside everything else.
MAX_HISTORY_KEEP = _max_history_keep()
# Times a group records: timezone-aware and within these years, so no arithmetic on a carried
# time can overflow or mix naive and aware datetimes.
MIN_INSTANT = datetime(2000, 1, 1, tzinfo=UTC)
# How long past its next deadline a group's status may still be current: the workflow task that
# acts on the deadline has to be picked up and run.
STATUS_SLACK_S = 5.0
MAX_INSTANT = datetime(3000, 1, 1, tzinfo=UTC)


def _task_queue_name(value: str) -> str:
    if value.startswith("/_sys/"):
        raise ValueError("task queue names starting with '/_sys/' are reserved by Temporal")
    if not value.strip() or any(not ch.isprintable() for ch in value):
        raise ValueError("a task queue name must be printable, not blank")
    return value


def _instant(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError("a time must carry its timezone (e.g. 2026-01-01T00:00:00Z)")
    if not MIN_INSTANT <= value < MAX_INSTANT:
        raise ValueError(f"a time must lie in {MIN_INSTANT.year}-{MAX_INSTANT.year - 1}")
    return value


# A task queue a group schedules activities on: Temporal refuses reserved and blank names, and
# a refused command would fail the group's workflow task.
TaskQueueName = Annotated[
    str, StringConstraints(min_length=1, max_length=300), AfterValidator(_task_queue_name)
]
Instant = Annotated[datetime, AfterValidator(_instant)]

# GPU phases an embedded client ran under a lease, reported with its release: each
# (offset_s, seconds), the offset from the grant as the client saw it, to the millisecond.
# At most MAX_LEASE_PHASES per lease (a client with more merges its closest ones: phase time
# stays exact, their places approximate), so a lease record keeps a bounded size.
MAX_LEASE_PHASES = 4
MAX_PHASE_OFFSET_S = 366 * 86_400.0
PhaseSeconds = Annotated[float, Field(ge=0, le=MAX_PHASE_OFFSET_S, allow_inf_nan=False)]


def _to_the_millisecond(value: tuple[float, float]) -> tuple[float, float]:
    return round(value[0], 3), round(value[1], 3)


LeasePhase = Annotated[tuple[PhaseSeconds, PhaseSeconds], AfterValidator(_to_the_millisecond)]
LeasePhases = Annotated[
    list[LeasePhase] | None,
    Field(
        None,
        max_length=MAX_LEASE_PHASES,
        description="GPU phases run under the lease: (seconds from the grant, seconds); None: "
        "not reported (the lease is the phase), []: reported, none ran",
    ),
]


def bounded_phases(phases: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``phases`` in time order, at most ``MAX_LEASE_PHASES``: past it, the two with the
    smallest gap between them become one of their summed length, placed at the first (phase
    time stays exact; the later one's place is approximate)."""
    kept = sorted((round(o, 3), round(s, 3)) for o, s in phases)
    while len(kept) > MAX_LEASE_PHASES:
        gaps = [kept[i + 1][0] - sum(kept[i]) for i in range(len(kept) - 1)]
        i = gaps.index(min(gaps))
        kept[i : i + 2] = [(kept[i][0], round(kept[i][1] + kept[i + 1][1], 3))]
    return kept


def _omit_unreported_phases(data: Any, phases: list[Any] | None) -> Any:
    # A message or record without phases encodes as before they existed, so a group or client
    # of an older release (its models forbid unknown fields) still reads it, and carried
    # states keep their size.
    if phases is None and isinstance(data, dict):
        data.pop("phases", None)
    return data


@dataclass(frozen=True)
class Undecodable:
    """What the control worker's payload converter hands a workflow for a payload it cannot
    decode (not JSON, nested too deep, an unknown encoding), instead of failing the task."""

    encoding: str
    error: str


class MalformedMessage(ValueError):
    """A signal, update or workflow input that is not a valid message (update validators raise
    it to refuse the update; signal handlers drop the message and count it)."""


M = TypeVar("M", bound=BaseModel)


def explain_validation_error(err: ValidationError) -> str:
    """One line per problem, naming the field: what a user needs to fix in their JSON."""
    problems = []
    for e in err.errors():
        where = ".".join(str(part) for part in e["loc"]) or "input"
        problems.append(f"{where}: {e['msg']}")
    return "; ".join(problems)


def parse_message(model: type[M], raw: tuple[Any, ...], what: str) -> M:
    """The one argument of a signal, update or workflow input ``what``, as ``model``.

    Handlers take their arguments raw (``*raw: Any``) and parse them here, so a missing, extra,
    undecodable or invalid argument becomes a ``MalformedMessage`` saying what to fix, never an
    exception that would fail the workflow task."""
    if len(raw) != 1:
        raise MalformedMessage(
            f"{what} takes one argument ({model.__name__} as JSON), not {len(raw)}"
        )
    [value] = raw
    if isinstance(value, model):
        return value
    if isinstance(value, Undecodable):
        raise MalformedMessage(
            f"{what}: the payload could not be decoded ({value.encoding}): {value.error}"
        )
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise MalformedMessage(
            f"{what}: invalid {model.__name__}: {explain_validation_error(err)}"
        ) from None


_ANY_JSON: TypeAdapter[Any] = TypeAdapter(Any)


def to_json(value: Any) -> bytes:
    """``value`` as the data converter encodes it (pydantic's JSON)."""
    return _ANY_JSON.dump_json(value)


def encoded_size(value: BaseModel | Any) -> int:
    """Bytes ``value`` takes as the data converter encodes it (pydantic's JSON: UTF-8, control
    characters escaped), which is what Temporal's payload limit counts."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return len(to_json(value))


_CUT = " ... (cut)"


def cut_to_encoded(text: str, max_bytes: int) -> str:
    """``text``, cut so that it encodes (quotes included) to at most ``max_bytes``."""
    if len(to_json(text)) <= max_bytes:
        return text
    room = max_bytes - len(to_json(_CUT))
    kept, used = [], 0
    for ch in text:
        used += len(to_json(ch)) - 2
        if used > room:
            break
        kept.append(ch)
    return "".join(kept) + _CUT


def lease_key_hash(key: str) -> str:
    """What a request carries of its lease key: releases, renewals and cancels must present the
    key itself, which only the requester knows (docs/security.md)."""
    return hashlib.sha256(key.encode()).hexdigest()


def lease_fingerprint(key_hash: str, token: int) -> str:
    """What the holder query shows of the current lease: a value of its key hash and token,
    which a process handed the lease's key recomputes to tell that lease is the current one.
    It reveals neither the key nor its hash (what reports and departures are checked against),
    and a lease's value says nothing about the next one's."""
    return hashlib.sha256(f"timeslice-lease:{key_hash}:{token}".encode()).hexdigest()


def check_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid group / job id, else raise ValueError saying why."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"invalid {kind} {value!r}: use {ID_RULE}")
    return value


# A group or job id a message may carry: checked as it is read (``check_id``).
GroupId = Annotated[str, AfterValidator(lambda v: check_id("group id", v))]
JobId = Annotated[str, AfterValidator(lambda v: check_id("job id", v))]
# A group's declared device memory, as its config has it and as a grant passes it on.
DeviceMemory = Annotated[int, Field(gt=0, le=MAX_STATE_BYTES)]


def group_workflow_id(group_id: str) -> str:
    return f"gpu-group-{check_id('group id', group_id)}"


def job_task_queue(job_id: str, rank: int = 0) -> str:
    return f"timeslice-job-{check_id('job id', job_id)}-{rank}"


NODE_QUEUE_PREFIX = "timeslice-node-"


def node_task_queue(node: str) -> str:
    return f"{NODE_QUEUE_PREFIX}{check_id('node name', node)}"


def is_node_queue(task_queue: str) -> bool:
    """Whether ``task_queue`` is a node agent's (a long-lived service on the node), not a job
    process's: nobody taking a task there says the agent is down or busy, not that the job's
    processes are gone."""
    return task_queue.startswith(NODE_QUEUE_PREFIX)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GroupConfig(_Model):
    """Settings of one GPU group, fixed for its lifetime (carried across continue-as-new)."""

    group_id: GroupId
    default_ttl_s: float = Field(DEFAULT_LEASE_TTL_S, ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S)
    aging_s: float = Field(
        DEFAULT_AGING_S,
        gt=0,
        le=366 * 86_400.0,
        description="seconds of waiting that raise a waiter by one priority level",
    )
    grant_ack_timeout_s: float = Field(
        15.0,
        gt=0,
        le=600,
        description="a waiter whose process does not pick up its grant in "
        "this time is taken for dead and skipped",
    )
    snapshot_timeout_s: float = Field(300.0, gt=0, le=3600)
    history_keep: int = Field(
        256,
        ge=0,
        le=MAX_HISTORY_KEEP,
        description="lease and switch records kept (at most what the carried state fits)",
    )
    wait_samples_keep: int = Field(512, ge=1, le=MAX_WAIT_SAMPLES_KEEP)
    memory_bytes: DeviceMemory | None = Field(
        None,
        description="device memory of the group: when the resident job's and the "
        "next job's declared state both fit, or both jobs' moves stream through one device "
        "room and the next job's state fits, eviction and restore run at the same time",
    )
    grant_policy: GrantPolicy = Field(
        DEFAULT_GRANT_POLICY,
        description="phase_aware: a holder whose next GPU phase here follows at once keeps "
        "the lease into it even when others wait, within max_carries, carry_limit_s and the "
        "waiting-share rule; fifo: only when nobody waits",
    )
    max_carries: int = Field(
        DEFAULT_MAX_CARRIES,
        ge=0,
        le=4,
        description="phase boundaries one lease may cross while someone waits (phase_aware)",
    )
    carry_limit_s: float = Field(
        DEFAULT_CARRY_LIMIT_S,
        gt=0,
        le=MAX_LEASE_TTL_S,
        description="the longest next phase (as its holder states it) a lease is carried into "
        "past waiters",
    )
    share_slack: float = Field(
        DEFAULT_SHARE_SLACK,
        ge=0,
        le=1,
        description="a lease is carried past a waiter only while the holder's waiting share is "
        "at least the waiter's minus this",
    )
    max_parked_waits: int = Field(
        5,
        ge=0,
        le=8,
        description="waiters whose grant may come as an update result (the rest "
        "get an activity); Temporal admits 10 in-flight updates per workflow, renewals need some",
    )


class ProcessRef(_Model):
    """A process by PID and start time (clock ticks since boot), so a reused PID never matches."""

    pid: int = Field(gt=0, le=2**31)
    start_time: int = Field(ge=0, le=2**63)


BackendName = Annotated[str, StringConstraints(min_length=1, max_length=100)]
LeaseKey = Annotated[str, StringConstraints(min_length=16, max_length=200)]


def _omit_none(data: Any, model: BaseModel, names: tuple[str, ...]) -> Any:
    """``data`` (a model's encoding) without the named fields while they are None: a message
    that does not use a field added later encodes as an older release's did, so an older
    reader (whose models refuse unknown fields) still takes it."""
    if isinstance(data, dict):
        for name in names:
            if getattr(model, name) is None:
                data.pop(name, None)
    return data


class QueueTarget(_Model):
    """One task queue that snapshots part of a job: a rank's process or a node agent."""

    task_queue: TaskQueueName
    backends: list[BackendName] = Field(min_length=1, max_length=MAX_BACKENDS)
    processes: list[ProcessRef] = Field(default_factory=list, max_length=MAX_PROCESSES)
    room: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{32}$",
        description="the node's device rooms (snapshot/device_room.py) this queue's backends "
        "move through, chunk by chunk: a switch between two jobs whose queues all name the same "
        "one streams (the next job's restore runs beside this eviction, taking only the room it "
        "frees) when the group declared its memory; absent when None",
    )
    on_host: bool = Field(
        False,
        description="every state this queue moves lives in host memory (torch on the CPU): "
        "its eviction frees no device memory, so a switch to a job whose queues all say so "
        "too restores beside it, memory declared or not; absent when False",
    )

    @model_serializer(mode="wrap")
    def _omit_no_room(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = _omit_none(handler(self), self, ("room",))
        if not self.on_host and isinstance(data, dict):
            data.pop("on_host", None)  # what groups of earlier releases read
        return data


class SnapshotTarget(_Model):
    """Where and how the group evicts / restores a job: every queue in parallel."""

    queues: list[QueueTarget] = Field(min_length=1, max_length=MAX_QUEUES)


class AcquireRequest(_Model):
    request_id: str = Field(min_length=1, max_length=200)
    job_id: JobId
    reply_task_queue: TaskQueueName | None = None
    reply_workflow_id: str | None = Field(None, min_length=1, max_length=1000)
    key_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="lease_key_hash() of a key only the requester knows: what its release, "
        "renewals and cancel must present",
    )
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    ttl_s: float | None = Field(None, ge=MIN_LEASE_TTL_S, le=MAX_LEASE_TTL_S)
    timeout_s: float | None = Field(None, ge=0, le=MAX_ACQUIRE_TIMEOUT_S)
    snapshot: SnapshotTarget | None = None
    state_bytes: int | None = Field(
        None, ge=0, le=MAX_STATE_BYTES, description="declared device footprint"
    )
    restores_itself: bool = Field(
        False,
        description="the requester restores its own evicted state once granted (in-process "
        "backends), so the grant does not wait for a restore activity",
    )

    @model_validator(mode="after")
    def _one_reply_address(self) -> AcquireRequest:
        if (self.reply_task_queue is None) == (self.reply_workflow_id is None):
            raise ValueError(
                "give exactly one of reply_task_queue (a process) or reply_workflow_id (a workflow)"
            )
        return self


class GroupRequest(_Model):
    """For the request-group local activity: signal-with-start ``request`` on ``group_id``."""

    group_id: str
    request: AcquireRequest


# Co-operative switching: a holder that moves its own state (its in-process backends) reports
# it when it ends a lease, so the group's residency and accounting stay true.
EvictedReports = Annotated[
    list["SnapshotReport"],
    Field(
        default_factory=list,
        max_length=MAX_REPORTS,
        description="the holder moved its state out before releasing",
    ),
]
RestoredReports = Annotated[
    list["SnapshotReport"],
    Field(
        default_factory=list,
        max_length=MAX_REPORTS,
        description="the holder restored its own state during the lease",
    ),
]


class LeaseRef(_Model):
    """A lease as every message about it names it: the request it granted, its fencing
    token, and the key only its holder knows."""

    request_id: str = Field(min_length=1, max_length=200)
    token: int = Field(ge=0, le=2**63)
    key: LeaseKey


class LeaseEnd(LeaseRef):
    """What every message that ends a lease names: the lease (request, token, key). The two
    such messages, :class:`ReleaseRequest` (the ``release`` signal) and :class:`LeaseReturn`
    (the ``release_lease`` update), also carry the holder's own moves (``EvictedReports``,
    ``RestoredReports``); each declares those itself only because the two encode them in a
    different order, and an encoding must not change (tests/unit/test_release_shape.py)."""


class ReleaseRequest(LeaseEnd):
    """The ``release`` signal (a requester workflow's release; it is never answered)."""

    evicted: EvictedReports
    restored: RestoredReports


class MovedReport(_Model):
    """A job's state left the group's device: after a release answered ``evict``, or because the
    job's next phase needs it on another group's device (one state, two groups)."""

    job_id: str
    key: LeaseKey = Field(description="the key of the job's last lease on the group")
    evicted: list[SnapshotReport] = Field(max_length=MAX_REPORTS)
    error: str | None = Field(
        None, max_length=2000, description="the eviction failed: the state is still there"
    )


class CancelRequest(_Model):
    request_id: str = Field(min_length=1, max_length=200)
    key: LeaseKey


class DepartRequest(_Model):
    job_id: str
    key: LeaseKey = Field(description="the key of the job's last lease on the group")


class RenewRequest(LeaseRef):
    """The ``renew`` update: the holder keeps its lease for another TTL."""


class LeaseRenewal(_Model):
    """For the renew-lease local activity: the ``renew`` update of ``renew`` on ``group_id``."""

    group_id: str
    renew: RenewRequest
    give_up_after_s: float = Field(10.0, gt=0, le=600)


class RenewResult(_Model):
    valid: bool
    ttl_s: float = 0.0
    reason: str = ""


class GrantNotice(_Model):
    """Sent to the waiting process: the lease is yours (or, with ``fault``, it cannot be)."""

    group_id: str
    request_id: str
    job_id: str
    reply_task_queue: str | None = None
    reply_workflow_id: str | None = None
    token: int
    ttl_s: float
    waited_s: float
    fault: str | None = None
    confirm_within_s: float | None = Field(
        None,
        description="a grant taken from a parked update (or whose delivery's outcome was not "
        "the process's own) counts as delivered once the holder renews or releases; if neither "
        "comes within this time the holder is taken for dead",
    )
    proof: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="notice_proof() of this notice under the request's key hash: only the "
        "group the request went to (and the requester) can make it; receivers drop a notice "
        "whose proof is missing or wrong",
    )
    granted_at: Instant | None = Field(
        None,
        description="the group's (workflow) time of the grant: what its confirmation deadline "
        "and the lease's TTL count from, so a process that takes the grant late knows it is "
        "late (docs/architecture.md, local validity)",
    )
    # Only a request whose snapshot target names a device room is told: the room holds its
    # restores to it while another job's eviction streams out. Absent when None, so every other
    # notice encodes as before.
    memory_bytes: DeviceMemory | None = Field(None, description="the group's declared memory")

    @model_serializer(mode="wrap")
    def _omit_no_memory(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_none(handler(self), self, ("memory_bytes",))


# What a notice's proof is computed over starts with this, so that no other MAC made under a
# key hash (now or later) can pass for a grant.
_NOTICE_PROOF_DOMAIN = b"timeslice grant notice v1\n"


def notice_proof(notice: GrantNotice, key_hash: str) -> str:
    """HMAC-SHA256, keyed by the request's ``key_hash``, over every field of ``notice`` but
    its proof (canonical JSON: sorted keys, no spaces).

    The key hash is what the requester sent with its request: the group keeps it and the
    requester can compute it, and neither ``status``, ``holder``, the group's details nor the
    metrics show it (docs/security.md). Every field is covered, so a field added later (a
    grant time) is covered too, and no field can be altered in transit."""
    fields = notice.model_dump(mode="json", exclude={"proof"})
    # NaN and infinities (a forged notice may carry them) are written, never raised on: a
    # check that raised would fail the receiving workflow's task.
    message = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    mac = hmac.new(bytes.fromhex(key_hash), _NOTICE_PROOF_DOMAIN + message.encode(), "sha256")
    return mac.hexdigest()


def prove_notice(notice: GrantNotice, key_hash: str) -> GrantNotice:
    """``notice`` with its proof: what the group sends."""
    return notice.model_copy(update={"proof": notice_proof(notice, key_hash)})


def notice_is_proven(notice: GrantNotice, key_hash: str) -> bool:
    """Whether ``notice`` carries the proof of the request whose key hash is ``key_hash``
    (compared in constant time). A receiver drops a notice that is not: it was not made by
    the group its request went to."""
    if notice.proof is None:
        return False
    return hmac.compare_digest(notice.proof, notice_proof(notice, key_hash))


class GrantAck(_Model):
    """A process's answer to a ``deliver_grant`` activity. Anyone in the namespace can complete
    an activity by its id, so the group obeys only an answer that presents the request's key
    (which only the process knows); any other outcome leaves the grant to be confirmed by the
    holder's renewal or release."""

    accepted: bool
    key: LeaseKey | None = Field(
        None, description="the request's lease key: what makes this answer the process's own"
    )


class AcquireCall(_Model):
    """The ``acquire`` update: queue ``request`` (idempotent by request id) and, with ``park``,
    wait in the group until it is granted, so the grant comes back as this update's result."""

    request: AcquireRequest
    park: bool = True
    only_if_free: bool = Field(
        False,
        description="a try-lock: queue the request only if the group is free and nobody "
        "waits (it is then granted at once); otherwise answer GONE and queue nothing",
    )


class AcquireOutcome(StrEnum):
    GRANTED = "granted"  # ``notice`` carries the grant (or its fault)
    QUEUED = "queued"  # not parked: the grant comes by activity (or, to a workflow, by signal)
    RETRY = "retry"  # the group continued as new, or the wait ran long: send the call again
    GONE = "gone"  # the request is no longer queued (cancelled, timed out, done)


class AcquireAnswer(_Model):
    outcome: AcquireOutcome
    notice: GrantNotice | None = None


class NextPhase(_Model):
    """The holder's next GPU phase, on the same group and right after this one."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    expected_s: float = Field(
        ge=0, le=MAX_LEASE_TTL_S, allow_inf_nan=False, description="its expected length"
    )


class LeaseReturn(LeaseEnd):
    """The ``release_lease`` update: end a lease, and learn whether to move the state out.

    The group decides in the same workflow task that grants the next waiter, so a holder never
    asks who waits before releasing (a query) and never races a waiter that arrives meanwhile."""

    restored: RestoredReports
    evicted: EvictedReports
    keep_if_uncontended: bool = Field(
        False, description="keep the lease instead when nobody waits (the job's next phase uses it)"
    )
    carry_into: NextPhase | None = Field(
        None,
        description="the holder's next GPU phase follows at once here: keep the lease for it "
        "when nobody waits and, under the phase_aware policy, within its bounds when others "
        "do (implies keep_if_uncontended)",
    )
    evicts_itself: bool = Field(
        False,
        description="the holder moves its own state out (in-process backends) when another job "
        "takes the group next; the answer says whether to, and a `report_moved` follows",
    )
    reports_with_next: bool = Field(
        False,
        description="with evicts_itself: the holder can carry its eviction's report on its "
        "next release here (`late_evictions`) instead of a `report_moved` of its own; the "
        "answer says whether the group waits for it (docs/architecture.md, 'What a lease "
        "costs')",
    )
    late_evictions: EvictedReports = Field(
        default_factory=list,
        max_length=MAX_REPORTS,
        description="the holder's own eviction after an earlier lease here, answered "
        "`report_with_next`: its bytes, reported now (the state came back since)",
    )
    phases: LeasePhases

    @model_serializer(mode="wrap")
    def _omit_no_carry(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A release that says no next phase (nor folds a report) encodes as before those
        # fields, so a group of an older release (its models forbid unknown fields) takes it.
        data = handler(self)
        if isinstance(data, dict):
            if self.carry_into is None:
                data.pop("carry_into", None)
            if not self.reports_with_next:
                data.pop("reports_with_next", None)
            if not self.late_evictions:
                data.pop("late_evictions", None)
        return _omit_unreported_phases(data, self.phases)


class ReturnAnswer(_Model):
    valid: bool = Field(description="the lease was held under this token")
    released: bool = Field(description="False: kept (nobody waits, or carried) or not valid")
    reason: str = Field(
        "", max_length=300, description="why a lease asked to carry was kept or not"
    )
    evict: bool = Field(
        False,
        description="another job takes the group: move the state out now and report it; the "
        "group restores the next job at once when both states fit, else after the report",
    )
    report_with_next: bool = Field(
        False,
        description="with evict, to a release that offered it: report the eviction with the "
        "next release here, not at once (the next job's restore does not wait for it)",
    )

    @model_serializer(mode="wrap")
    def _omit_no_folding(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Only a release that offered to fold its report is answered the field: every other
        # answer encodes as before, so older clients (their models forbid unknown fields) read it.
        data = handler(self)
        if not self.report_with_next and isinstance(data, dict):
            data.pop("report_with_next", None)
        return data


class SnapshotCall(_Model):
    group_id: str
    job_id: str
    backends: list[str]
    reason: str
    processes: list[ProcessRef] = Field(default_factory=list)


class SnapshotReport(_Model):
    job_id: str = Field(max_length=100)
    backend: str = Field(max_length=100)
    mode: str = Field(max_length=100)
    bytes: int = Field(ge=0, le=MAX_STATE_BYTES)
    seconds: float = Field(ge=0, le=86_400)


class SnapshotJobInput(_Model):
    job_id: JobId
    action: Literal["snapshot", "restore"]
    target: SnapshotTarget
    pickup_timeout_s: float = Field(15.0, gt=0, le=600)
    run_timeout_s: float = Field(300.0, gt=0, le=3600)


class SnapshotJobResult(_Model):
    reports: list[SnapshotReport]


class LeaseOutcome(StrEnum):
    RELEASED = "released"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # the process had given up when its grant arrived
    DEAD = "dead"  # the process never picked up its grant


class Waiter(_Model):
    request: AcquireRequest
    seq: int
    enqueued_at: Instant


class HeldLease(_Model):
    request: AcquireRequest
    token: int
    granted_at: Instant
    waited_s: float = 0.0
    delivered: bool = False
    expires_at: Instant | None = None  # set once the process has taken the grant
    # A grant handed out as a parked update's result: the holder confirms it by its first
    # renewal or its release before this time, or is taken for dead.
    confirm_by: Instant | None = None
    # Phase boundaries this lease crossed while someone waited (grant policy), and the phase
    # it is carried into now.
    carries: int = Field(0, ge=0)
    carrying_into: str | None = None
    # GPU phases the holder reported with releases that kept the lease (carried), so far.
    phases: LeasePhases

    @model_serializer(mode="wrap")
    def _omit_no_phases(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_unreported_phases(handler(self), self.phases)


class ResidentJob(_Model):
    job_id: str
    snapshot: SnapshotTarget | None
    state_bytes: int | None = None
    lease_expired: bool = Field(
        False,
        description="its last lease ran out without a release: the group's eviction of it "
        "is a preemption",
    )


class LeaseRecord(_Model):
    """One lease that ended; ``phases``: the GPU phases its holder reported running under it
    (an embedded client's; none: the lease was its phase, or an RL job's, whose phases its
    history has)."""

    job_id: str
    token: int
    start: Instant
    end: Instant
    outcome: LeaseOutcome
    phases: LeasePhases

    @model_serializer(mode="wrap")
    def _omit_no_phases(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _omit_unreported_phases(handler(self), self.phases)


class SwitchRecord(_Model):
    """One move of device state: evicting ``from_job`` and / or restoring ``to_job``.

    Moves the group runs itself are timed by the workflow's clock. A holder's own moves
    (``by_holder``, reported in its release) are placed at its lease's start (a restore) or end
    (an eviction), with the durations they reported.
    """

    from_job: str | None
    to_job: str | None
    start: Instant
    end: Instant
    bytes: int = 0
    overlapped: bool = False
    by_holder: bool = False


class GroupStats(_Model):
    """The group's counters and times since it was created (carried across continue-as-new),
    each described below: what ``timeslice status`` and the report count from."""

    # The attribute docstrings below are the fields' descriptions (their JSON schema's too).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    created_at: Instant
    leases: int = 0
    """Leases granted."""
    released: int = 0
    """Leases their holder released."""
    stale_messages: int = 0
    """Messages naming a lease or request the group no longer holds (a stale token, a late release
    or renewal, an eviction report nobody asked for): ignored."""
    forged_messages: int = 0
    """Messages whose lease key did not match, and grant deliveries answered without the request's
    key."""
    malformed_messages: int = 0
    """Signals dropped because they were not a valid message."""
    refused_requests: int = 0
    """Requests refused because the queue was full (MAX_WAITERS, bytes)."""
    rate_limited: int = 0
    """Updates refused because their caller had sent past its rate (CALLER_UPDATES_PER_S):
    refused by the validator, so they left no history; counted by the worker that refused them
    (one that reloads the run from its history does not see those before)."""
    expired: int = 0
    """Leases revoked because their holder stopped renewing."""
    cancelled: int = 0
    """Requests taken back by their requester: waiting, switched for, or held."""
    timed_out: int = 0
    """Waiters dropped when their own time-out passed."""
    rejected: int = 0
    """Grants whose requester had given up when they came."""
    dead_waiters: int = 0
    """Grants never picked up: the requesting process is taken for dead."""
    switches: int = 0
    """Hand-overs that moved state (an eviction, a restore, or both)."""
    carried: int = 0
    """Leases kept past waiters into their holder's next phase (grant policy)."""
    overlapped_switches: int = 0
    """Switches whose eviction and restore ran at once (the memory allowed, or they streamed)."""
    streamed_switches: int = 0
    """Switches whose eviction and restore ran at once although the device holds only one of
    the two jobs' states: the restore took room as the eviction freed it (device rooms)."""
    evictions: int = 0
    """Job states moved off the device."""
    preemptions: int = 0
    """Evictions by the group of a job whose lease ran out without it yielding (a hung holder taken
    off the device)."""
    restores: int = 0
    """Job states brought back onto the device."""
    staged_restores: int = 0
    """Restores of the next waiter's state run while the holder still worked (the device had room
    for both): its grant then moved nothing."""
    staged_unused: int = 0
    """Staged states taken off the device again unused: another job was granted first."""
    snapshot_failures: int = 0
    """Evictions or restores that failed (the job is marked faulted)."""
    departed: int = 0
    """Jobs that told the group they left it for good."""
    bytes_moved: int = 0
    """Bytes evicted and restored, both ways summed."""
    busy_s: float = 0.0
    """Seconds leased (held by a holder), ended leases."""
    switching_s: float = 0.0
    """Seconds spent moving state between holders."""
    runs: int = 1
    """Workflow runs: continue-as-new counts one more."""
    shed_records: int = 0
    """Lease and switch records dropped, oldest first, so that a continue-as-new input fits
    Temporal's payload limit."""
    forgotten_jobs: int = 0
    """Evicted, faulted or key entries of jobs dropped, oldest first, past their bounds
    (EVICTED_JOBS_KEEP, FAULTED_JOBS_KEEP, JOB_KEYS_KEEP)."""
    wait_samples_s: list[float] = Field(default_factory=list)
    """The recent acquire waits (GroupConfig.wait_samples_keep)."""


class GroupState(_Model):
    """Everything the group must not lose: survives restarts and continue-as-new."""

    stats: GroupStats
    next_token: int = 1
    next_seq: int = 1
    holder: HeldLease | None = None
    queue: list[Waiter] = Field(default_factory=list)
    resident: ResidentJob | None = None
    evicted_jobs: list[str] = Field(default_factory=list)
    faulted_jobs: dict[str, str] = Field(default_factory=dict)
    # job id -> the key hash of its last lease here: what its state-moved reports and its
    # departure must match.
    job_keys: dict[str, str] = Field(default_factory=dict)
    recent_done: list[str] = Field(
        default_factory=list, description="fingerprints of recently finished requests"
    )
    recent_released: list[str] = Field(
        default_factory=list,
        description="fingerprints of leases recently released by their holders (request, "
        "token, key): a release of one sent again is answered released",
    )
    history: list[LeaseRecord] = Field(default_factory=list)
    switch_history: list[SwitchRecord] = Field(default_factory=list)
    # A holder that released with ``evicting`` and has not reported its eviction done yet.
    evicting: ResidentJob | None = None
    # The key hash of the lease that was answered ``evict``: only that lease's report of a failed
    # eviction faults the job (None: the group's own activity evicts, or a state from before).
    evicting_key_hash: str | None = None
    # That holder reports its eviction with its next release here (ReturnAnswer.report_with_next):
    # no report is waited for; a switch that needs the room asks its process by activity.
    evicting_report_later: bool = False
    # Evictions still counted under way when another holder's own eviction took ``evicting``'s
    # place (its report, or the group's own activity, had not come back yet): until each is
    # confirmed (its report, or the group's snapshot activity, which waits for the eviction
    # under way), no other job's state is restored or staged beside it.
    unconfirmed_evictions: list[ResidentJob] = Field(
        default_factory=list, max_length=EVICTED_JOBS_KEEP
    )
    # The next waiter whose state the group brought onto the device while the holder worked
    # (the device's declared memory holds both): its grant moves nothing. ``staged_ready`` is
    # False while that restore still runs.
    staged: ResidentJob | None = None
    staged_ready: bool = False
    # job id -> the seconds its last own restore here took (what staging it would save; the
    # last EVICTED_JOBS_KEEP jobs).
    restore_s: dict[str, float] = Field(default_factory=dict)
    # job id -> flat [asked_at, waited_s, ...] of its last grants, seconds since
    # stats.created_at: the grant policy's waiting shares (most recently granted last).
    wait_shares: dict[str, list[float]] = Field(default_factory=dict)


class GroupInput(_Model):
    config: GroupConfig
    state: GroupState | None = None

    @model_validator(mode="before")
    @classmethod
    def _carried_keeps_fit(cls, data: Any) -> Any:
        """A run carried from a release that allowed longer histories keeps what fits now
        (a new group is refused such settings, by GroupConfig's bounds, instead)."""
        if isinstance(data, dict) and data.get("state") is not None:
            config = data.get("config")
            if isinstance(config, dict):
                config = dict(config)
                for name, most in (
                    ("history_keep", MAX_HISTORY_KEEP),
                    ("wait_samples_keep", MAX_WAIT_SAMPLES_KEEP),
                ):
                    if isinstance(config.get(name), int) and config[name] > most:
                        config[name] = most
                data = {**data, "config": config}
        return data


class HolderView(_Model):
    job_id: str
    token: int
    held_s: float
    expires_in_s: float | None
    waiting: int = Field(0, description="requests queued behind this lease")
    request_id: str = ""
    carrying_into: str | None = Field(
        None, description="the lease was kept past waiters into the holder's next phase"
    )
    fingerprint: str = Field(
        "",
        description="lease_fingerprint() of the lease's key hash and token: a process handed "
        "a lease compares it with the one its key gives, so a token alone (which `timeslice "
        "status` shows) never passes for the lease",
    )


class WaiterView(_Model):
    job_id: str
    request_id: str
    priority: int
    waited_s: float


class GroupStatus(_Model):
    """What a group is doing: the answer of its ``status`` query (``client.group_status``,
    ``timeslice status``).

    A query answers as of the group's last workflow task (a query's ``workflow.now()`` is that
    task's time, and a query may change nothing); ``advanced_to`` brings the figures to the
    reader's clock (the clients, ``timeslice status`` and the report do so), never past
    ``next_deadline``.

    Attributes:
        group_id: The group.
        holder: The lease held now (job, token, held and remaining seconds, waiters), or None.
        queue: The waiting requests in the order they queued, each with its priority and wait
            (the best score, priority plus ageing, is granted next).
        resident_job: The job whose state is on the device now (held or not), or None.
        staged_job: The waiter whose state the group brought onto the device (or is
            bringing) ahead of its grant, beside the resident's, or None.
        faulted_jobs: Jobs whose state could not be evicted or restored, with why; their
            next acquire raises ``JobFaultedError``.
        held_share: The share of its life since creation the group was **held** (its
            lease intervals over ``wall_s``), 0-1: the upper bound of :attr:`utilization`.
            Releases before this field's rename answered it as ``utilization``; such a
            payload still reads (its ``utilization`` becomes ``held_share``).
        utilization: The share of ``wall_s`` (since the group was created) its GPU phases
            ran, 0-1 (``timeslice.protocol.utilization``; the report's ``utilization``).
            The group sees leases, not the RL jobs' phases, so it answers None: a reader
            that reads the jobs' phases fills it (``timeslice status --json``).
        utilization_while_jobs_ran: The same phase time over the first phase's start to the
            last phase's end; None as the group answers, like :attr:`utilization`.
        wall_s: Seconds since the group was created.
        idle_s: Seconds the group was held by nobody.
        wait_p50_s: The median of the recent acquire waits (None: none yet).
        wait_p99_s: Their 99th percentile.
        stats: Counters: leases, releases, expiries, time-outs, evictions, restores, bytes
            moved, busy and switching time, forged or malformed messages ...
        history: The recent lease records (job, token, start, end, outcome).
        switch_history: The recent switches (from, to, bytes, overlapped or not).
        as_of: The workflow time these figures are for.
        next_deadline: The nearest time the group acts on its own; the figures hold at
            most until then.
    """

    group_id: str
    holder: HolderView | None
    queue: list[WaiterView]
    resident_job: str | None
    staged_job: str | None = None
    faulted_jobs: dict[str, str]
    held_share: float
    wall_s: float
    idle_s: float
    wait_p50_s: float | None
    wait_p99_s: float | None
    stats: GroupStats
    history: list[LeaseRecord]
    switch_history: list[SwitchRecord] = Field(default_factory=list)
    as_of: datetime | None = Field(
        None,
        description="the workflow time these figures are for: a query answers as of the "
        "group's last workflow task, so a reader advances them to its own clock",
    )
    next_deadline: datetime | None = Field(
        None,
        description="the nearest time the group acts on its own (a lease's expiry or "
        "confirmation, a waiter's time-out): these figures hold at most until then",
    )
    utilization: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="GPU phase time over wall_s (timeslice.protocol.utilization), filled by "
        "a reader of the jobs' phases; the group itself answers None",
    )
    utilization_while_jobs_ran: float | None = Field(
        None, ge=0.0, le=1.0, description="GPU phase time over the first to the last phase"
    )

    @model_validator(mode="before")
    @classmethod
    def _held_share_was_utilization(cls, data: Any) -> Any:
        """A group of a release before the rename answers its held share as ``utilization``
        (and has no ``held_share``): read it as the held share, never as utilization."""
        if isinstance(data, dict) and "held_share" not in data and "utilization" in data:
            data = dict(data)
            data["held_share"] = data.pop("utilization")
        return data

    def advanced_to(self, now: datetime) -> GroupStatus:
        """These figures as of ``now``: the holder (if any) kept holding, waiters kept
        waiting, and the time since ``as_of`` counts as busy with a holder, idle without.

        A group runs a workflow task by its next deadline, so nothing may be extrapolated past
        it (plus ``STATUS_SLACK_S`` for that task to run): a reader whose clock runs ahead of
        the group's sees the holder's lease end at zero, never a negative time."""
        if self.as_of is None or now <= self.as_of:
            return self
        dt = (now - self.as_of).total_seconds()
        if self.next_deadline is not None:
            until = max(0.0, (self.next_deadline - self.as_of).total_seconds())
            dt = min(dt, until + STATUS_SLACK_S)
        wall = self.wall_s + dt
        busy = self.held_share * self.wall_s + (dt if self.holder is not None else 0.0)
        holder = self.holder
        if holder is not None:
            holder = holder.model_copy(
                update={
                    "held_s": holder.held_s + dt,
                    "expires_in_s": None
                    if holder.expires_in_s is None
                    else max(0.0, holder.expires_in_s - dt),
                }
            )
        return self.model_copy(
            update={
                "as_of": now,
                "holder": holder,
                "queue": [w.model_copy(update={"waited_s": w.waited_s + dt}) for w in self.queue],
                "wall_s": wall,
                "held_share": min(1.0, busy / wall) if wall > 0 else self.held_share,
                "idle_s": self.idle_s + (0.0 if self.holder is not None else dt),
                # The phases since as_of are not known here: a reader computes them anew.
                "utilization": None,
                "utilization_while_jobs_ran": None,
            }
        )


def _resolve_forward_references() -> None:
    """Resolve every model's references to models defined further down, at import.

    Left lazy, the first use would resolve them, and inside the workflow sandbox that can fail
    ("ReleaseRequest is not fully defined")."""
    for value in list(globals().values()):
        if isinstance(value, type) and issubclass(value, _Model) and value is not _Model:
            value.model_rebuild()


_resolve_forward_references()
