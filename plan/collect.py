"""Profiles from real runs: RL jobs' workflow histories, and embedded clients' leases.

An RL job (``rl-job-<job>``, every run after continue-as-new) keeps its phases in its history:
each ``timeslice.job.sample | compute_rewards | train`` activity completes with a
``PhaseResult`` (the phase's own seconds, its monotonic-clock interval, when its lease was asked
for and granted, what it restored), ``timeslice.job.prepare`` says how many bytes each state
holds, ``timeslice.job.describe`` which states live on the sampler and on the trainer group,
``timeslice.job.save_checkpoint`` how long a checkpoint takes (its activity's start to
completion), and the workflow's input is the job's config. An async RL job (an
``AsyncRLJobWorkflow`` under the same id) keeps the same in its own activities'
(``timeslice.job.async_sample | async_score | async_train`` complete with an
``AsyncPhaseResult``: the phase's ``PhaseResult``, the batch, the weights version it sampled
with, and the weight publication's or load's seconds and bytes; ``async_describe`` stands for
``describe``). A process using the embedded client leaves only its leases, in the group's
``status`` (its recent ``history``).

Reading (:func:`read_rl_job`; a group's status: ``report.gather.read_group_status``) talks to
Temporal; turning what was read into
a profile (:func:`rl_job_profile`, :func:`client_profile`) is pure and unit-tested.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from timeslice.errors import InvalidArgumentError, TimesliceError
from timeslice.plan.profile import (
    JobProfile,
    Overheads,
    PhaseProfile,
    ProfileSource,
    Seconds,
    StateProfile,
    WeightSync,
)
from timeslice.protocol.async_rl_job import (
    ASYNC_DESCRIBE_ACTIVITY,
    ASYNC_RL_JOB_WORKFLOW_TYPE,
    AsyncPhaseResult,
    AsyncRLJobConfig,
)
from timeslice.protocol.group import LeaseRecord
from timeslice.protocol.rl_job import (
    CHECKPOINT_ACTIVITY,
    DESCRIBE_ACTIVITY,
    PREPARE_ACTIVITY,
    DescribeResult,
    PhaseResult,
    PrepareResult,
    RLJobConfig,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.report.gather import ASYNC_PHASE_ACTIVITIES, PHASE_ACTIVITIES, started_config

PHASE_ORDER = ("sample", "rewards", "train")
MAX_RUNS = 10_000  # continue-as-new chain guard


class NoSuchJobError(TimesliceError, LookupError):
    """No RL job workflow, and no lease of the job in the groups named."""


@dataclass
class RLJobRun:
    """What an RL job's histories hold (every run, oldest first)."""

    workflow_id: str
    config: RLJobConfig  # an AsyncRLJobConfig for an async job
    phases: list[PhaseResult] = field(default_factory=list)
    # An async job's phases as they completed (sampling and scoring: epoch = the batch id;
    # training: epoch = the step), with their weight moves and versions.
    async_phases: list[AsyncPhaseResult] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    describe: DescribeResult | None = None
    prepare: PrepareResult | None = None
    runs: int = 0
    status: str = "unknown"
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- reading Temporal


async def read_rl_job(client: Client, job_id: str) -> RLJobRun:
    """Every run of ``rl-job-<job_id>``, oldest first. Raises NoSuchJobError if none."""
    try:
        workflow_id = rl_job_workflow_id(job_id)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    try:
        latest = await client.get_workflow_handle(workflow_id).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise NoSuchJobError(f"no RL job {job_id!r} (no workflow {workflow_id})") from None
        raise
    notes: list[str] = []
    run_id: str | None = latest.raw_info.first_run_id or latest.run_id
    histories: list[list[HistoryEvent]] = []
    while run_id is not None and len(histories) < MAX_RUNS:
        handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        try:
            history = await handle.fetch_history()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND or histories or run_id == latest.run_id:
                raise
            notes.append("the first runs are past retention: read from the latest run")
            run_id = latest.run_id
            continue
        events = list(history.events)
        histories.append(events)
        run_id = _next_run(events)
    run = await decode_runs(
        client, workflow_id, histories, async_job=latest.workflow_type == ASYNC_RL_JOB_WORKFLOW_TYPE
    )
    run.status = latest.status.name.lower() if latest.status else "unknown"
    run.notes = notes + run.notes
    return run


def _next_run(events: list[HistoryEvent]) -> str | None:
    for event in reversed(events):
        if event.HasField("workflow_execution_continued_as_new_event_attributes"):
            attrs = event.workflow_execution_continued_as_new_event_attributes
            return attrs.new_execution_run_id or None
    return None


async def decode_runs(
    client: Client,
    workflow_id: str,
    histories: list[list[HistoryEvent]],
    *,
    async_job: bool = False,
) -> RLJobRun:
    config: RLJobConfig | None = None
    phases: list[PhaseResult] = []
    async_phases: list[AsyncPhaseResult] = []
    describe_activity = ASYNC_DESCRIBE_ACTIVITY if async_job else DESCRIBE_ACTIVITY
    checkpoints: list[float] = []
    describe: DescribeResult | None = None
    prepare: PrepareResult | None = None
    converter = client.data_converter
    for events in histories:
        names: dict[int, str] = {}
        started: dict[int, datetime] = {}
        for event in events:
            kind = event.event_type
            if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED and config is None:
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                (raw,) = await converter.decode(list(payloads), [dict])
                config = started_config(raw, async_job=async_job)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                names[event.event_id] = attrs.activity_type.name
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                attrs_s = event.activity_task_started_event_attributes
                started[attrs_s.scheduled_event_id] = event.event_time.ToDatetime(UTC)
            elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                done = event.activity_task_completed_event_attributes
                name = names.get(done.scheduled_event_id)
                payloads = list(done.result.payloads)
                if name in PHASE_ACTIVITIES:
                    (result,) = await converter.decode(payloads, [PhaseResult])
                    phases.append(result)
                elif name in ASYNC_PHASE_ACTIVITIES:
                    (done_async,) = await converter.decode(payloads, [AsyncPhaseResult])
                    async_phases.append(done_async)
                    phases.append(done_async.phase)
                elif name == CHECKPOINT_ACTIVITY and done.scheduled_event_id in started:
                    begun = started[done.scheduled_event_id]
                    ended = event.event_time.ToDatetime(UTC)
                    checkpoints.append((ended - begun).total_seconds())
                elif name == PREPARE_ACTIVITY:
                    (prepare,) = await converter.decode(payloads, [PrepareResult])
                elif name == describe_activity and describe is None:
                    (describe,) = await converter.decode(payloads, [DescribeResult])
    if config is None:
        raise TimesliceError(f"{workflow_id}: no start event in its history")
    if config.sampler_group is None:  # started with a pool: its phases say where it ran
        ran_on = {p.phase: p.group_id for p in phases if p.group_id}
        if "sample" in ran_on:
            config = config.model_copy(
                update={
                    "sampler_group": ran_on["sample"],
                    "trainer_group": ran_on.get("train", ran_on["sample"]),
                }
            )
    return RLJobRun(
        workflow_id=workflow_id,
        config=config,
        phases=phases,
        async_phases=async_phases,
        checkpoint_s=checkpoints,
        describe=describe,
        prepare=prepare,
        runs=len(histories),
    )


# ---------------------------------------------------------------- a finished job's figures


def completion_s(result: RLJobResult) -> float:
    """A job's completion as the planner predicts it: its first GPU phase's start to its last
    GPU phase's end (its own monotonic clock; the result's recent records)."""
    holds = [h for rec in result.records for h in rec.holds]
    return max(h.mono_end for h in holds) - min(h.mono_start for h in holds)


def _first_phase(result: RLJobResult) -> PhaseResult:
    return min((h for rec in result.records for h in rec.holds), key=lambda h: h.mono_start)


def start_for_simulation(result: RLJobResult) -> float:
    """When the simulator should start the job to line up with its real run: when its first
    GPU phase asked for its lease (its monotonic clock)."""
    first = _first_phase(result)
    return first.asked_mono if first.asked_mono is not None else first.mono_start


def opens_for_simulation(results: list[RLJobResult], grant_s: float) -> dict[str, float]:
    """Per group, when it granted the first of the jobs' first GPU phases, less ``grant_s``
    (the monotonic clock): until then the jobs' preparation held it (each prepares under
    leases of all its groups, which the simulator leaves out)."""
    opens: dict[str, float] = {}
    for result in results:
        first = _first_phase(result)
        if first.group_id is None or first.granted_mono is None:
            continue
        at = first.granted_mono - grant_s
        opens[first.group_id] = min(opens.get(first.group_id, at), at)
    return opens


# ---------------------------------------------------------------- building profiles


def measured_overheads(
    phases: list[PhaseResult], *, carried_leases: bool = True
) -> Overheads | None:
    """The protocol's costs seen in one RL job's phases (rank 0's clock; None: too few).

    - hop: rewards start - sample end (sampling releases in the background, so nothing but
      the workflow's dispatch of the next activity lies between; an async job's phases of
      one batch share its id as their epoch);
    - carry: next sample start - train end, where train kept its lease (``carried_leases`` False:
      none, an async job's loops carry no lease from one into the other);
    - request + grant: a lease's ask -> grant, over the phases that restored nothing (the
      group had not passed to another job since this job's last phase there) and whose wait
      was shorter than half the job's shortest GPU phase (no other job's phase fits in it):
      the waits of a free group. Split evenly between the way there and the way back.
    """
    by_epoch: dict[int, dict[str, PhaseResult]] = defaultdict(dict)
    for p in phases:
        by_epoch[p.epoch][p.phase] = p  # a redone epoch: its latest phases
    hops: list[float] = []
    carries: list[float] = []
    for epoch, ps in by_epoch.items():
        if "sample" in ps and "rewards" in ps:
            hops.append(ps["rewards"].mono_start - ps["sample"].mono_end)
        train, nxt = ps.get("train"), by_epoch.get(epoch + 1, {}).get("sample")
        if (
            carried_leases
            and train is not None
            and nxt is not None
            and train.kept
            and not nxt.restored
        ):
            carries.append(nxt.mono_start - train.mono_end)
    gpu = [p.seconds for p in phases if p.group_id is not None]
    trips: list[float] = []
    if gpu:
        short = min(gpu) / 2
        trips = [
            p.granted_mono - p.asked_mono
            for p in phases
            if p.granted_mono is not None
            and p.asked_mono is not None
            and not p.restored
            and 0 <= p.granted_mono - p.asked_mono < short
        ]
    hops = [h for h in hops if h >= 0]
    carries = [c for c in carries if c >= 0]
    if not hops and not carries and not trips:
        return None
    default = Overheads()
    trip = statistics.median(trips) if trips else default.request_s + default.grant_s
    return Overheads(
        request_s=trip / 2,
        grant_s=trip / 2,
        hop_s=statistics.median(hops) if hops else default.hop_s,
        carry_s=statistics.median(carries) if carries else default.carry_s,
        group_move_s=default.group_move_s,
        samples=len(hops) + len(carries) + len(trips),
    )


def rl_job_profile(run: RLJobRun, *, read_at: datetime | None = None) -> JobProfile:
    """An RL job's profile from its histories (pure)."""
    cfg = run.config
    if not run.phases:
        raise TimesliceError(
            f"job {cfg.job_id}: no completed phase in {run.workflow_id}'s history yet; "
            "profile it once it ran an epoch"
        )
    notes = list(run.notes)
    seconds: dict[str, list[float]] = defaultdict(list)
    for p in run.phases:
        seconds[p.phase].append(p.seconds)
    missing = [name for name in PHASE_ORDER if name not in seconds]
    if missing:
        raise TimesliceError(
            f"job {cfg.job_id}: no completed {' / '.join(missing)} phase yet; profile it once "
            "it ran a whole epoch"
        )
    pools = {"sample": "sampler", "train": "trainer"}
    phases = [
        PhaseProfile(
            name=name,
            gpu=name in pools,
            pool=pools.get(name),  # type: ignore[arg-type]
            seconds=Seconds.of(seconds[name]),
        )
        for name in PHASE_ORDER
    ]
    states = _states(run, notes)
    checkpoint = Seconds.of(run.checkpoint_s) if run.checkpoint_s else None
    if checkpoint is None:
        notes.append("no checkpoint completed yet: checkpoints left out of the profile")
    if cfg.ranks > 1:
        notes.append(
            f"{cfg.ranks} ranks: the workflow takes this job's leases (grant by signal), which "
            "the simulator prices like a process's"
        )
    epochs_read = len({p.epoch for p in run.phases if p.phase == "train"})
    pipeline: dict[str, Any] = {}
    if isinstance(cfg, AsyncRLJobConfig):
        pipeline = {
            "mode": "async",
            "max_staleness": cfg.max_staleness,
            "sync_every": cfg.sync_every,
            "weight_sync": _weight_sync(run.async_phases, notes),
        }
        notes.append(
            "async job: its sampler loop (sample, rewards) and trainer loop (train) run at "
            "once; the weights' publication and loads are inside the train and sample seconds"
        )
    return JobProfile(
        job_id=cfg.job_id,
        kind="rl-job",
        **pipeline,
        epochs=cfg.epochs,
        priority=cfg.priority,
        phases=phases,
        states=states,
        checkpoint_every=cfg.checkpoint_every if checkpoint is not None else None,
        checkpoint_s=checkpoint,
        source=ProfileSource(
            workflow_id=run.workflow_id,
            runs=run.runs,
            epochs_read=epochs_read,
            sampler_group=cfg.sampler_group,
            trainer_group=cfg.trainer,
            read_at=(read_at or datetime.now(UTC)).isoformat(timespec="seconds"),
            overheads=measured_overheads(run.phases, carried_leases=not pipeline),
            notes=notes,
        ),
    )


def _weight_sync(results: list[AsyncPhaseResult], notes: list[str]) -> WeightSync:
    """An async job's weight moves, and the staleness its batches were trained at (a note)."""
    publish = [r for r in results if r.phase.phase == "train" and r.published_version is not None]
    loads = [r for r in results if r.phase.phase == "sample" and (r.load_s or r.load_bytes)]
    # The weights each batch was sampled with, and the step that trained it (a redone batch
    # gets a new id, so each id is sampled and trained at most once per run read).
    sampled_with = {
        r.batch: r.weights_version
        for r in results
        if r.phase.phase == "sample" and r.weights_version is not None
    }
    staleness = [
        r.phase.epoch - sampled_with[r.batch]
        for r in results
        if r.phase.phase == "train" and r.batch in sampled_with
    ]
    if staleness:
        notes.append(
            f"staleness of the steps read: max {max(staleness)}, mean "
            f"{statistics.fmean(staleness):.2f} ({len(staleness)} steps)"
        )
    return WeightSync(
        publications=len(publish),
        publish_s=Seconds.of([r.sync_s for r in publish]) if publish else None,
        publish_bytes=max((r.sync_bytes for r in publish), default=0),
        loads=len(loads),
        load_s=Seconds.of([r.load_s for r in loads]) if loads else None,
        load_bytes=max((r.load_bytes for r in loads), default=0),
    )


def _states(run: RLJobRun, notes: list[str]) -> list[StateProfile]:
    """The job's states: where each lives (describe), its bytes (prepare), its measured
    restore seconds (the phases' restore reports)."""
    cfg = run.config
    if run.describe is None:
        notes.append("the job's states are unknown (no describe result): none in the profile")
        return []
    sampler = list(run.describe.sampler_backends)
    trainer = list(run.describe.trainer_backends)
    pool_of: dict[str, str] = {}
    for name in sampler:
        pool_of[name] = "sampler"
    for name in trainer:
        pool_of[name] = "both" if pool_of.get(name) == "sampler" else "trainer"
    sizes = dict(run.prepare.backend_bytes) if run.prepare is not None else {}
    # Which states a phase on a group may restore: RLJobWorkflow._backends_for, sorted as the
    # job process takes them, the phase's own states first (a sample's, a train's: the job
    # process brings those in before the phase starts, and the group's others behind them).
    # The reports name the backend's kind, not the state, so report i is mapped to state i of
    # the phase's own states when that many came in, else of all of the group's.
    restores: dict[str, list[float]] = defaultdict(list)
    for p in run.phases:
        if not p.restored or p.group_id is None:
            continue
        names: list[str] = []
        if p.group_id == cfg.sampler_group:
            names += sampler
        if p.group_id == cfg.trainer:
            names += [n for n in trainer if n not in names]
        names = sorted(set(names))
        own = [n for n in names if n in {"sample": sampler, "train": trainer}.get(p.phase, [])]
        in_order = [*own, *(n for n in names if n not in own)]
        for candidates in (own, in_order):
            if len(candidates) != len(p.restored):
                continue
            for name, report in zip(candidates, p.restored, strict=True):
                restores[name].append(report.seconds)
                if report.bytes and sizes.get(name) is None:
                    sizes[name] = report.bytes
            break
    states = []
    unmeasured = []
    for name, pool in pool_of.items():
        nbytes = sizes.get(name)
        if nbytes is None:
            notes.append(f"state {name}: size unknown, taken as 0 bytes")
            nbytes = 0
        nbytes *= cfg.ranks  # every rank keeps its own copy on the group's GPUs
        seen = restores.get(name)
        restore_s = statistics.median(seen) if seen else None
        if seen is None and nbytes:
            unmeasured.append(name)
        states.append(
            StateProfile(
                name=name,
                pool=pool,  # type: ignore[arg-type]
                bytes=nbytes,
                # Evictions run after the phase, in the background, and no phase result
                # carries them: a snapshot is taken to cost what a restore of the same bytes did.
                snapshot_s=restore_s,
                restore_s=restore_s,
            )
        )
    if unmeasured:
        notes.append(
            f"never restored in this run: {', '.join(unmeasured)}; the planner estimates "
            "their moves from their bytes (--move-gbps)"
        )
    elif states:
        notes.append("snapshot_s is taken equal to the measured restore_s")
    return states


def client_profile(
    job_id: str, group_id: str, records: list[LeaseRecord], overheads: Overheads | None = None
) -> JobProfile:
    """A client job's profile from its leases on one group: each lease is its GPU phase, and
    the gaps between its leases its work off the GPU — only gaps in which no other job held
    the group (else part of the gap may have been a wait), less the protocol's round trips
    (its release is awaited, then it asks again)."""
    mine = sorted((r for r in records if r.job_id == job_id), key=lambda r: r.start)
    if not mine:
        raise NoSuchJobError(f"job {job_id!r} holds no lease in group {group_id}'s history")
    others = [r for r in records if r.job_id != job_id]
    holds = [(r.end - r.start).total_seconds() for r in mine]
    ov = overheads or Overheads()
    trip = 2 * (ov.request_s + ov.grant_s)
    gaps: list[float] = []
    for prev, nxt in itertools.pairwise(mine):
        if any(o.start < nxt.start and o.end > prev.end for o in others):
            continue  # another job held the group in between: the gap may hide a wait
        gaps.append(max(0.0, (nxt.start - prev.end).total_seconds() - trip))
    notes = [
        f"read from group {group_id}'s lease history (its most recent leases: {len(mine)})",
    ]
    if not gaps:
        notes.append(
            "no gap between two of its leases without another holder: work off the GPU taken as 0 s"
        )
    return JobProfile(
        job_id=job_id,
        kind="client",
        epochs=len(mine),
        phases=[
            PhaseProfile(name="hold", gpu=True, pool="sampler", seconds=Seconds.of(holds)),
            PhaseProfile(name="work", gpu=False, seconds=Seconds.of(gaps or [0.0])),
        ],
        source=ProfileSource(
            group_id=group_id,
            epochs_read=len(mine),
            sampler_group=group_id,
            trainer_group=group_id,
            read_at=datetime.now(UTC).isoformat(timespec="seconds"),
            notes=notes,
        ),
    )
