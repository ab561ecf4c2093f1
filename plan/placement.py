"""Where a pool puts a job (docs/pools.md, "The decision rule"): the planner's simulator, asked
about each place the job could go.

A job with a profile goes where the pool's predicted GPU-phase utilization (the mean over the
groups in use, as ``timeslice plan`` scores an assignment) is highest among the places where
every profiled job's predicted slowdown (its simulated completion beside the others over its
alone) stays within the pool's bound; with no such place it waits in the pool's queue, unless
it asked to be placed anyway (then: the place whose worst slowdown is least). A job
without a profile goes where it disturbs least: the place with the least predicted demand. Each
simulation runs every job for at most ``SIM_EPOCHS`` epochs from the same start: a steady-state
estimate, not a forecast of the jobs' remaining work.

``place_pool_job`` is the pool workflow's activity; ``decide`` is the pure rule it runs.
``plan_pool_move`` and ``decide_move`` weigh moving one placed job (docs/pools.md, "Moving
jobs"): the move with the largest predicted gain in pool utilization over the pool's horizon,
less the move's cost, among those that keep every job within the bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from temporalio import activity
from temporalio.exceptions import ApplicationError
from timeslice.errors import InvalidArgumentError
from timeslice.plan.profile import JobProfile, parse_profile
from timeslice.plan.simulator import DEFAULT_MOVE_BYTES_PER_S, GroupSpec, Outcome, simulate
from timeslice.plan.simulator import Placement as SimPlacement
from timeslice.protocol.pool import (
    MOVE_DECISION_ACTIVITY,
    PLACE_JOB_ACTIVITY,
    MoveInput,
    MoveOutcome,
    PlaceInput,
    Placement,
    PlaceOutcome,
    PoolJob,
    TenantLimits,
    tenant_holds,
)
from timeslice.protocol.utilization import demand_bound

SIM_EPOCHS = 12
#: The least predicted gain in pool utilization a move must bring, whatever its cost: a
#: move also costs a preparation from the checkpoint, which no profile states, so moves for a
#: point or less (seen: +0 points, "gains 1.0 s over 600 s") are churn.
MIN_MOVE_GAIN = 0.02


class InvalidProfile(ValueError):
    """A job's declared profile that cannot be placed (it says why)."""


class QuotaBelowDemand(ValueError):
    """A job whose demand alone is more than its tenant's quota: it could never be placed."""


@dataclass(frozen=True)
class Prediction:
    """One place's simulated figures: the pool's GPU-phase utilization (the mean over its groups
    in use of each group's GPU-phase share while its jobs ran) and each profiled job's
    slowdown."""

    placement: Placement
    utilization: float
    slowdowns: dict[str, float]

    @property
    def worst(self) -> float:
        return max(self.slowdowns.values(), default=1.0)


def job_profile(job: PoolJob) -> JobProfile | None:
    """The job's profile under its own id, checked; None if it has none."""
    if job.profile is None:
        return None
    try:
        profile = parse_profile({**job.profile, "job_id": job.job_id}, f"job {job.job_id}")
    except (InvalidArgumentError, ValueError) as err:
        raise InvalidProfile(str(err)) from None
    if profile.mode != job.mode:
        raise InvalidProfile(
            f"job {job.job_id} runs {job.mode} but its profile says mode {profile.mode}"
        )
    return profile


def placed_profile(job: PoolJob) -> JobProfile | None:
    """A placed job's profile as the placement weighs it: one that does not parse counts as
    none (its demand unknown, its groups not weighed), so one job's bad profile refuses no
    other job's placement (before, every placement after it failed with its error)."""
    try:
        return job_profile(job)
    except InvalidProfile:
        return None


def candidates(groups: Sequence[str], mode: str) -> list[Placement]:
    """Every place a job could run: one group (sync), or two different ones (async)."""
    if mode == "sync":
        return [Placement(sampler_group=g, trainer_group=g) for g in groups]
    if len(groups) < 2:
        raise InvalidProfile("an async job needs two groups (sampler and trainer); the pool has 1")
    return [
        Placement(sampler_group=s, trainer_group=t) for s, t in itertools.permutations(groups, 2)
    ]


def _groups_of(placement: Placement) -> set[str]:
    return {placement.sampler_group, placement.trainer_group}


class Predictor:
    """Simulates the pool's profiled jobs (at most ``SIM_EPOCHS`` epochs each), caching each
    job's run alone."""

    def __init__(self, inp: PlaceInput) -> None:
        self.specs = {g.name: GroupSpec(memory_bytes=g.memory_bytes) for g in inp.groups}
        self.placed: list[tuple[JobProfile, Placement]] = []
        for job in inp.placed:
            profile = placed_profile(job)
            if profile is not None and job.placement is not None:
                self.placed.append((profile, job.placement))
        self._alone: dict[str, float] = {}

    def _run(self, jobs: Sequence[tuple[JobProfile, Placement]], groups: set[str]) -> Outcome:
        sims = [
            SimPlacement(p, at.sampler_group, at.trainer_group, epochs=min(p.epochs, SIM_EPOCHS))
            for p, at in jobs
        ]
        return simulate(sims, groups={g: self.specs.get(g, GroupSpec()) for g in groups})

    def alone_s(self, profile: JobProfile) -> float:
        if profile.job_id not in self._alone:
            groups = ("alone-s", "alone-t") if profile.is_async else ("alone", "alone")
            at = Placement(sampler_group=groups[0], trainer_group=groups[1])
            outcome = self._run([(profile, at)], set(groups))
            self._alone[profile.job_id] = outcome.jobs[profile.job_id].completion_s
        return self._alone[profile.job_id]

    def predict(
        self,
        extra: Sequence[tuple[JobProfile, Placement]],
        *,
        without: str | None = None,
    ) -> Prediction | None:
        """The pool's figures with ``extra`` added (and the job ``without`` left out)."""
        jobs = [*(j for j in self.placed if j[0].job_id != without), *extra]
        if not jobs:
            return None
        outcome = self._run(jobs, set(self.specs))
        slowdowns = {
            p.job_id: outcome.jobs[p.job_id].completion_s / max(self.alone_s(p), 1e-9)
            for p, _ in jobs
        }
        placement = extra[-1][1] if extra else jobs[-1][1]
        # Each group's GPU-phase share while its jobs ran (`timeslice status`'s definition),
        # averaged over the groups in use, as `timeslice plan` scores an assignment: packing
        # jobs onto fewer groups within the bound scores higher than spreading them thin.
        used = [g.utilization for g in outcome.groups.values()]
        share = sum(used) / len(used) if used else 0.0
        return Prediction(placement, share, slowdowns)


def _demand(inp: PlaceInput, group: str) -> tuple[float, int]:
    """A group's predicted demand (its profiled jobs' GPU shares there, summed) and how many
    jobs of unknown demand (no profile) it holds."""
    shares, unknown = [], 0
    for job in inp.placed:
        if job.placement is None or group not in _groups_of(job.placement):
            continue
        if job.demand is None:
            unknown += 1
        else:
            shares.append(job.demand)
    return demand_bound(shares), unknown


def _without_profile(inp: PlaceInput, places: list[Placement]) -> PlaceOutcome:
    def load(at: Placement) -> tuple[float, int, str]:
        figures = [_demand(inp, g) for g in sorted(_groups_of(at))]
        return sum(d for d, _ in figures), sum(u for _, u in figures), at.sampler_group

    best = min(places, key=load)
    demand, unknown, _ = load(best)
    where = _where(best)
    return PlaceOutcome(
        placement=best,
        reason=f"placed {inp.job.job_id} on {where} (no profile): least predicted demand there "
        f"({demand:.2f}, {unknown} other jobs without a profile)",
    )


def _where(at: Placement) -> str:
    if at.sampler_group == at.trainer_group:
        return at.sampler_group
    return f"{at.sampler_group} (sampler) + {at.trainer_group} (trainer)"


def _over_quota(inp: PlaceInput, profile: JobProfile | None) -> str | None:
    """Why the job waits for its tenant's quota (None: it is within it). Raises
    ``QuotaBelowDemand`` for a job that no room in the pool would ever let in."""
    job = inp.job
    limits = inp.tenants.get(job.tenant_name) or TenantLimits()
    if limits.quota is None:
        return None
    need = job.charged(profile.duty if profile is not None else None)
    tenant = job.tenant_name
    if need > limits.quota + 1e-9:
        raise QuotaBelowDemand(
            f"job {job.job_id} needs {need:.2f} groups' worth of GPU demand, more than tenant "
            f"{tenant}'s whole quota {limits.quota:g}: raise the quota or declare a profile"
        )
    held = tenant_holds(inp.placed, tenant)
    if held + need <= limits.quota + 1e-9:
        return None
    return (
        f"queued {job.job_id}: tenant {tenant} holds {held:.2f} of its quota {limits.quota:g} "
        f"groups' worth and {job.job_id} needs {need:.2f}"
    )


def decide(inp: PlaceInput) -> PlaceOutcome:
    """Where ``inp.job`` goes, or why it waits (``placement`` None). Raises ``InvalidProfile``
    and ``QuotaBelowDemand``."""
    job = inp.job
    places = candidates([g.name for g in inp.groups], job.mode)
    profile = job_profile(job)
    over = _over_quota(inp, profile)  # never placed past its quota, place_anyway or not
    if over is not None:
        return PlaceOutcome(placement=None, reason=over)
    if profile is None:
        return _without_profile(inp, places)
    predictor = Predictor(inp)
    before = predictor.predict([])
    unknown = {g for g in (gr.name for gr in inp.groups) if _demand(inp, g)[1]}
    # A group holding a job of unknown demand cannot be checked against the bound.
    checkable = [at for at in places if not (_groups_of(at) & unknown)]
    predictions = [predictor.predict([(profile, at)]) for at in checkable or places]
    fits = [p for p in predictions if p is not None and p.worst <= inp.max_slowdown + 1e-9]
    if fits and checkable:
        best = max(fits, key=lambda p: (p.utilization, -p.worst))
        verb = "placed"
    elif job.place_anyway:
        best = min((p for p in predictions if p is not None), key=lambda p: p.worst)
        verb = "placed anyway"
    else:
        worst = min(p.worst for p in predictions if p is not None)
        why = (
            f"every group holds a job without a profile (pool bound {inp.max_slowdown:g}x)"
            if not checkable
            else f"no group takes it within the pool's bound {inp.max_slowdown:g}x (the best "
            f"place predicts a job at {worst:.2f}x)"
        )
        return PlaceOutcome(placement=None, reason=f"queued {job.job_id}: {why}")
    gain = (best.utilization - (before.utilization if before else 0.0)) * 100
    return PlaceOutcome(
        placement=best.placement,
        demand=profile.duty,
        reason=f"{verb} {job.job_id} on {_where(best.placement)}: pool utilization "
        f"{gain:+.0f} points (to {best.utilization:.0%}), {job.job_id} "
        f"{best.slowdowns[job.job_id]:.2f}x, worst job {best.worst:.2f}x",
    )


def move_cost_s(profile: JobProfile) -> float:
    """A move's cost in the moved job's GPU time: each of its states taken off the old group's
    device and brought onto the new one's (its profile's move times, or its bytes at the
    planner's default bandwidth)."""
    cost = 0.0
    for state in profile.states:
        default = state.bytes / DEFAULT_MOVE_BYTES_PER_S
        cost += (state.snapshot_s if state.snapshot_s is not None else default) + (
            state.restore_s if state.restore_s is not None else default
        )
    return cost


def decide_move(inp: MoveInput) -> MoveOutcome:
    """The one move worth making now, or none and why. A move of job J to place P counts if
    every profiled job stays within the pool's bound there and either

    - it makes room for a queued job Q (the first of ``inp.queued`` that fits, within its
      tenant's quota, on a place sharing a group with J's old one, every job within the bound
      with J moved and Q there): its gain is Q's GPU share alone times the horizon (the GPU
      time Q runs instead of waiting), plus any utilization gain; or
    - the pool's predicted utilization rises by ``MIN_MOVE_GAIN`` or more: its gain is that
      rise times the horizon (seconds of GPU phases over the horizon, per group in use); or
    - a job is over the bound now (its profile drifted) and the move brings every job back
      within it: its gain is the GPU-phase seconds the jobs run more over the horizon (each
      job's GPU share over its slowdown, after less before; ``_served_gain``);

    and that gain exceeds the move's cost (``move_cost_s``). Of those, the largest gain less
    cost goes. Groups holding a job without a profile are not weighed (their demand is
    unknown). Raises ``InvalidProfile``."""
    as_place = PlaceInput(
        groups=inp.groups, max_slowdown=inp.max_slowdown, placed=inp.placed,
        job=PoolJob(job_id="-"),
    )  # fmt: skip
    predictor = Predictor(as_place)
    before = predictor.predict([])
    if before is None:
        return MoveOutcome(reason="no move: the pool has no profiled job yet")
    # A job placed without a profile that has not sent a measured one (or one that does not
    # parse): demand unknown.
    unknown = {
        g
        for j in inp.placed
        if j.placement is not None and placed_profile(j) is None
        for g in _groups_of(j.placement)
    }
    profiles = {p.job_id: (p, at) for p, at in predictor.placed}
    demands = {job_id: p.duty for job_id, (p, _) in profiles.items()}
    waiting = _admissible(inp)
    # A job over the bound (a profile drifted, or a job placed anyway): a move that brings
    # every job back within it counts by the GPU time the slowed jobs get back.
    over = before.worst > inp.max_slowdown + 1e-9
    best: _Move | None = None
    for job_id in inp.movable:
        if job_id not in profiles:
            continue
        profile, here = profiles[job_id]
        cost = move_cost_s(profile)
        for at in candidates([g.name for g in inp.groups], profile.mode):
            if at == here or _groups_of(at) & unknown:
                continue
            after = predictor.predict([(profile, at)], without=job_id)
            if after is None or after.worst > inp.max_slowdown + 1e-9:
                continue
            gain = after.utilization - before.utilization
            room = _room_made(inp, predictor, waiting, (profile, at), here, unknown)
            if room is not None:
                queued, admitted = room
                net = (queued.duty + max(gain, 0.0)) * inp.horizon_s - cost
                move = _Move(net, cost, job_id, at, after, queued.job_id, admitted)
            elif gain >= MIN_MOVE_GAIN:
                move = _Move(gain * inp.horizon_s - cost, cost, job_id, at, after)
            elif over:
                served = _served_gain(demands, before, after) * inp.horizon_s
                move = _Move(served - cost, cost, job_id, at, after, restores_bound=True)
            else:
                continue
            if move.net > 0 and (best is None or move.net > best.net):
                best = move
    if best is None:
        broken = (
            f"; worst job {before.worst:.2f}x, over the bound, and no move brings every job "
            "back within it for more than it costs"
            if over
            else ""
        )
        return MoveOutcome(
            reason=f"no move: none gains {MIN_MOVE_GAIN:.0%} of pool utilization or more, or "
            f"makes room for a queued job, and more than it costs over {inp.horizon_s:g} s, "
            f"within the bound {inp.max_slowdown:g}x (pool utilization {before.utilization:.0%})"
            f"{broken}",
            demands=demands,
        )
    gain = (best.after.utilization - before.utilization) * 100
    job_id, after = best.job_id, best.after
    why = f"moved {job_id} to {_where(best.placement)}"
    if best.makes_room_for is not None and best.admitted is not None:
        q = best.makes_room_for
        why += (
            f" to make room for {q} (then {q} {best.admitted.slowdowns[q]:.2f}x, worst job "
            f"{best.admitted.worst:.2f}x)"
        )
    elif best.restores_bound:
        why += f" to bring the pool back within its bound (worst job was {before.worst:.2f}x)"
    return MoveOutcome(
        job_id=job_id,
        placement=best.placement,
        reason=f"{why}: pool utilization {gain:+.0f} points (to {after.utilization:.0%}), "
        f"{job_id} {after.slowdowns[job_id]:.2f}x, worst job {after.worst:.2f}x; gains "
        f"{best.net + best.cost:.1f} s over {inp.horizon_s:g} s, costs {best.cost:.1f} s",
        demands=demands,
        makes_room_for=best.makes_room_for,
    )


@dataclass(frozen=True)
class _Move:
    net: float
    cost: float
    job_id: str
    placement: Placement
    after: Prediction
    makes_room_for: str | None = None
    admitted: Prediction | None = None
    restores_bound: bool = False


def _served_gain(duties: dict[str, float], before: Prediction, after: Prediction) -> float:
    """The GPU-phase seconds a second the pool's jobs run more after a move than before: each
    job runs its GPU share (alone) divided by its slowdown."""
    return sum(
        duty * (1 / after.slowdowns[job_id] - 1 / before.slowdowns[job_id])
        for job_id, duty in duties.items()
        if job_id in after.slowdowns and job_id in before.slowdowns
    )


#: How many of the queue's first jobs a move is weighed for (each costs simulations).
QUEUE_LOOKAHEAD = 2


def _admissible(inp: MoveInput) -> list[JobProfile]:
    """The queue's first jobs with a profile that their tenants' quotas let in now."""
    found: list[JobProfile] = []
    for job in inp.queued:
        profile = placed_profile(job)  # a bad one is refused at its own placement, not here
        if profile is None:
            continue
        check = PlaceInput(
            groups=inp.groups, max_slowdown=inp.max_slowdown, placed=inp.placed, job=job,
            tenants=inp.tenants,
        )  # fmt: skip
        try:
            if _over_quota(check, profile) is not None:
                continue
        except QuotaBelowDemand:
            continue
        found.append(profile)
        if len(found) == QUEUE_LOOKAHEAD:
            break
    return found


def _room_made(
    inp: MoveInput,
    predictor: Predictor,
    waiting: list[JobProfile],
    moved: tuple[JobProfile, Placement],
    here: Placement,
    unknown: set[str],
) -> tuple[JobProfile, Prediction] | None:
    """The first waiting job that fits once ``moved`` is moved: on a place sharing a group
    with the one it leaves (only there did room appear), every job within the bound."""
    freed = _groups_of(here)
    names = [g.name for g in inp.groups]
    for queued in waiting:
        for at in candidates(names, queued.mode):
            if not (_groups_of(at) & freed) or _groups_of(at) & unknown:
                continue
            with_it = predictor.predict([moved, (queued, at)], without=moved[0].job_id)
            if with_it is not None and with_it.worst <= inp.max_slowdown + 1e-9:
                return queued, with_it
    return None


@activity.defn(name=MOVE_DECISION_ACTIVITY)
async def plan_pool_move(inp: MoveInput) -> MoveOutcome:
    """The pool's weighing of a move; a profile that cannot be simulated fails non-retryably."""
    try:
        return decide_move(inp)
    except InvalidProfile as err:
        raise ApplicationError(str(err), type="InvalidProfile", non_retryable=True) from None


@activity.defn(name=PLACE_JOB_ACTIVITY)
async def place_pool_job(inp: PlaceInput) -> PlaceOutcome:
    """The pool's decision for one job; a profile that cannot be placed, or a job above its
    tenant's whole quota, fails non-retryably."""
    try:
        return decide(inp)
    except InvalidProfile as err:
        raise ApplicationError(str(err), type="InvalidProfile", non_retryable=True) from None
    except QuotaBelowDemand as err:
        raise ApplicationError(str(err), type="QuotaBelowDemand", non_retryable=True) from None
