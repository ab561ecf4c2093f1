"""Which jobs should share which groups: a search over assignments, scored by the simulator.

Two layouts:

- **colocated** (``groups``): each job samples and trains on one group. Jobs on different
  groups never meet, so an assignment's figures are its groups' figures, each simulated once
  and cached by the set of jobs on it.
- **disaggregated** (``sampler_groups`` + ``trainer_groups``): each job samples on one sampler
  group and trains on one trainer group. A job links its two groups, so the jobs and groups
  linked together (a connected component) are simulated together, cached by their placement.

An async RL job (a profile with ``mode: async``) needs two groups, its loops running at once:
its sampler loop on a sampler group and its trainer loop on a trainer group (disaggregated),
or on two different groups of ``groups`` (colocated: a pool's groups, where sync jobs share
them with it). It is simulated as the workflow runs it (both loops, the staleness bound), and
measured against a sampler group and a trainer group of its own.

An assignment is *feasible* when every job's predicted slowdown (its completion / its
completion alone on a group of its own) is within its limit. Assignments are ranked by:
fewest limit violations, then fewest groups used (most GPUs saved), then the smallest sum of
slowdowns, then the highest mean utilization. The search builds a greedy assignment (most
GPU-bound jobs first, each joining the group where it slows things down least without
breaking a limit, else opening a group), improves it by moving, swapping and merging while
that helps, restarts from shuffled orders while time remains, and keeps the best distinct
assignments it met. Long jobs are simulated on a scaled-down number of epochs (the same
fraction for every job in one simulation), which keeps their relative lengths.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from timeslice.plan.profile import JobProfile, Overheads
from timeslice.plan.simulator import (
    DEFAULT_MOVE_BYTES_PER_S,
    GroupSpec,
    Outcome,
    Placement,
    simulate,
)
from timeslice.protocol.group import DEFAULT_AGING_S, GrantPolicy
from timeslice.protocol.utilization import demand_bound

DEFAULT_MAX_SLOWDOWN = 1.5
COARSE_MARGIN = 0.05
MAX_SWAPS = 160

# Where each job runs: job id -> (its sampler group, its trainer group).
PlacementMap = dict[str, tuple[str, str]]
# A placement's score, lower is better (compared as tuples).
Scorer = Callable[[PlacementMap], tuple[float, ...]]


@dataclass(frozen=True)
class Layout:
    """The groups on offer. ``groups`` for colocated jobs, or sampler and trainer pools."""

    groups: tuple[str, ...] = ()
    sampler_groups: tuple[str, ...] = ()
    trainer_groups: tuple[str, ...] = ()
    memory_bytes: int | None = None
    aging_s: float = DEFAULT_AGING_S
    gpus_per_group: int = 1
    # Every group's settings but its memory and ageing: the grant policy and its bounds
    # (GroupConfig's defaults).
    policy: GroupSpec = field(default_factory=GroupSpec)

    def __post_init__(self) -> None:
        pooled = bool(self.sampler_groups) or bool(self.trainer_groups)
        if pooled and self.groups:
            raise ValueError("give either groups, or sampler and trainer groups, not both")
        if pooled and not (self.sampler_groups and self.trainer_groups):
            raise ValueError("disaggregated pools need at least one sampler and one trainer group")
        if not pooled and not self.groups:
            raise ValueError("no groups to place jobs on")
        names = [*self.groups, *self.sampler_groups, *self.trainer_groups]
        if len(set(names)) != len(names):
            raise ValueError(
                f"group names repeat: {sorted({n for n in names if names.count(n) > 1})}"
            )
        if self.gpus_per_group < 1:
            raise ValueError("gpus_per_group must be >= 1")

    @property
    def disaggregated(self) -> bool:
        return bool(self.sampler_groups)

    def spec(self) -> GroupSpec:
        return dataclasses.replace(
            self.policy, memory_bytes=self.memory_bytes, aging_s=self.aging_s
        )

    def with_policy(self, policy: GrantPolicy | str) -> Layout:
        """The same groups under another grant policy (same bounds)."""
        return dataclasses.replace(
            self, policy=dataclasses.replace(self.policy, grant_policy=GrantPolicy(policy))
        )


@dataclass
class JobPlan:
    job_id: str
    sampler_group: str
    trainer_group: str
    completion_s: float
    dedicated_s: float
    max_slowdown: float
    epochs_simulated: int
    epochs: int
    mode: str = "sync"
    max_staleness: int | None = None

    @property
    def groups_alone(self) -> int:
        """The groups it has to itself in the baseline: an async job's loops need two."""
        return 2 if self.mode == "async" else 1

    @property
    def slowdown(self) -> float:
        return self.completion_s / self.dedicated_s if self.dedicated_s > 0 else 1.0

    @property
    def ok(self) -> bool:
        return self.slowdown <= self.max_slowdown + 1e-9


@dataclass
class GroupPlan:
    group_id: str
    role: str  # "shared", "sampler" or "trainer"
    jobs: list[str]
    utilization: float  # while jobs ran (timeslice.protocol.utilization)
    switches: int
    demand_bound: float = 0.0  # the jobs' summed GPU demand here, capped at 1


@dataclass
class Assignment:
    groups: list[GroupPlan]
    jobs: list[JobPlan]
    gpus_per_group: int

    @property
    def groups_used(self) -> int:
        return sum(1 for g in self.groups if g.jobs)

    @property
    def gpus_used(self) -> int:
        return self.groups_used * self.gpus_per_group

    @property
    def gpus_dedicated(self) -> int:
        """Groups of its own per job (one; an async job two): the baseline slowdowns are
        measured against."""
        return sum(j.groups_alone for j in self.jobs) * self.gpus_per_group

    @property
    def gpus_saved(self) -> int:
        return self.gpus_dedicated - self.gpus_used

    @property
    def violations(self) -> list[JobPlan]:
        return [j for j in self.jobs if not j.ok]

    @property
    def mean_utilization(self) -> float:
        used = [g.utilization for g in self.groups if g.jobs]
        return sum(used) / len(used) if used else 0.0

    def key(self) -> tuple[float, ...]:
        excess = sum(max(0.0, j.slowdown - j.max_slowdown) for j in self.jobs)
        return (
            len(self.violations),
            round(excess, 6),
            self.groups_used,
            round(sum(j.slowdown for j in self.jobs), 6),
            -round(self.mean_utilization, 6),
        )


@dataclass
class PlanResult:
    assignments: list[Assignment]
    layout: Layout
    overheads: Overheads
    evaluated: int
    simulations: int
    seconds: float
    notes: list[str] = field(default_factory=list)


class Planner:
    def __init__(
        self,
        profiles: Sequence[JobProfile],
        layout: Layout,
        *,
        overheads: Overheads | None = None,
        move_bytes_per_s: float = DEFAULT_MOVE_BYTES_PER_S,
        max_slowdown: float | None = DEFAULT_MAX_SLOWDOWN,
        limits: dict[str, float] | None = None,
        sim_epochs: int = 12,
        final_epochs: int = 60,
        seed: int = 0,
    ) -> None:
        ids = [p.job_id for p in profiles]
        if not profiles:
            raise ValueError("no profiles to plan")
        if len(set(ids)) != len(ids):
            raise ValueError(f"job ids repeat: {sorted({i for i in ids if ids.count(i) > 1})}")
        unknown = sorted(set(limits or {}) - set(ids))
        if unknown:
            raise ValueError(f"--max-slowdown names jobs with no profile: {unknown}")
        if layout.disaggregated:
            clients = [p.job_id for p in profiles if p.kind == "client"]
            if clients:
                raise ValueError(
                    f"client jobs hold one group, not a sampler and a trainer pool: {clients}"
                )
        else:
            async_jobs = [p.job_id for p in profiles if p.is_async]
            if async_jobs and len(layout.groups) < 2:
                raise ValueError(
                    f"async jobs run their sampler and trainer loops at once, on two groups: "
                    f"{async_jobs}; give at least two groups"
                )
        self.profiles = {p.job_id: p for p in profiles}
        self.layout = layout
        self.overheads = overheads or Overheads()
        self.move_bps = move_bytes_per_s
        self.limit: dict[str, float] = {}
        for p in profiles:
            chosen = (limits or {}).get(p.job_id, p.max_slowdown)
            if chosen is None:
                chosen = max_slowdown if max_slowdown is not None else math.inf
            self.limit[p.job_id] = chosen
        self.sim_epochs = sim_epochs
        self.final_epochs = final_epochs
        # A trace: jobs arrive over time and leave when their epochs are done, so each runs
        # every epoch from its arrival (scaling epochs would move its departure).
        self.arrivals = any(p.arrive_s > 0 for p in profiles)
        self.rng = random.Random(seed)
        self.simulations = 0
        self._dedicated: dict[tuple[str, int], float] = {}
        self._cache: dict[tuple[object, ...], tuple[Outcome, dict[str, int]]] = {}
        self._summaries: dict[tuple[object, ...], _Summary] = {}

    # ------------------------------------------------------------ simulating

    def _epochs(self, jobs: Iterable[str], cap: int) -> dict[str, int]:
        """Every job's epochs scaled by one factor, so the longest runs at most ``cap``."""
        jobs = list(jobs)
        if self.arrivals:
            return {j: self.profiles[j].epochs for j in jobs}
        longest = max(self.profiles[j].epochs for j in jobs)
        f = min(1.0, cap / longest)
        return {j: max(1, round(self.profiles[j].epochs * f)) for j in jobs}

    def _run(
        self, placements: list[Placement], groups: Iterable[str], record: bool = False
    ) -> Outcome:
        self.simulations += 1
        spec = self.layout.spec()
        return simulate(
            placements,
            groups={g: spec for g in groups},
            overheads=self.overheads,
            move_bytes_per_s=self.move_bps,
            record=record,
        )

    def dedicated_s(self, job: str, epochs: int) -> float:
        key = (job, epochs)
        if key not in self._dedicated:
            profile = self.profiles[job]
            # A sync job alone on one group; an async job's loops on a group each.
            groups = ["alone-sampler", "alone-trainer"] if profile.is_async else ["alone"]
            alone = Placement(profile, groups[0], groups[-1], epochs=epochs)
            self._dedicated[key] = self._run([alone], groups).jobs[job].completion_s
        return self._dedicated[key]

    def _component(
        self, members: tuple[tuple[str, str, str], ...], cap: int
    ) -> tuple[Outcome, dict[str, int]]:
        """Simulate jobs placed (job, sampler group, trainer group) that share groups."""
        key = (cap, members)
        hit = self._cache.get(key)
        if hit is None:
            epochs = self._epochs((m[0] for m in members), cap)
            placements = [
                Placement(
                    self.profiles[j], s, t, start_s=self.profiles[j].arrive_s, epochs=epochs[j]
                )
                for j, s, t in members
            ]
            groups = {g for _, s, t in members for g in (s, t)}
            hit = (self._run(placements, groups), epochs)
            self._cache[key] = hit
        return hit

    def evaluate(self, placement: PlacementMap, cap: int) -> Assignment:
        """Figures of one assignment (job -> (sampler group, trainer group))."""
        jobs: list[JobPlan] = []
        util: dict[str, tuple[float, int]] = {}
        for members in _components(placement):
            outcome, epochs = self._component(members, cap)
            for job, s, t in members:
                jobs.append(
                    JobPlan(
                        job_id=job,
                        sampler_group=s,
                        trainer_group=t,
                        completion_s=outcome.jobs[job].completion_s,
                        dedicated_s=self.dedicated_s(job, epochs[job]),
                        max_slowdown=self.limit[job],
                        epochs_simulated=epochs[job],
                        epochs=self.profiles[job].epochs,
                        mode=self.profiles[job].mode,
                        max_staleness=self.profiles[job].max_staleness,
                    )
                )
            for gid, g in outcome.groups.items():
                util[gid] = (g.utilization, g.switches)
        layout = self.layout
        roles = (
            [("sampler", g) for g in layout.sampler_groups]
            + [("trainer", g) for g in layout.trainer_groups]
            if layout.disaggregated
            else [("shared", g) for g in layout.groups]
        )
        groups = []
        for role, gid in roles:
            index = 0 if role in ("shared", "sampler") else 1
            on = sorted(
                j
                for j, pt in placement.items()
                if (pt[index] == gid if layout.disaggregated else gid in pt)
            )
            u, switches = util.get(gid, (0.0, 0))
            shares = (self.profiles[j].gpu_share(_pools_on(placement[j], gid)) for j in on)
            bound = demand_bound(shares)
            groups.append(GroupPlan(gid, role, on, u if on else 0.0, switches, bound))
        jobs.sort(key=lambda j: j.job_id)
        return Assignment(groups=groups, jobs=jobs, gpus_per_group=layout.gpus_per_group)

    def timeline(self, assignment: Assignment) -> Outcome:
        """The assignment's simulated run, every interval recorded, at full length (capped
        by ``final_epochs`` like its figures)."""
        placement = {j.job_id: (j.sampler_group, j.trainer_group) for j in assignment.jobs}
        epochs = self._epochs(placement, self.final_epochs)
        placements = [
            Placement(self.profiles[j], s, t, start_s=self.profiles[j].arrive_s, epochs=epochs[j])
            for j, (s, t) in placement.items()
        ]
        groups = {g for s, t in placement.values() for g in (s, t)}
        return self._run(placements, groups, record=True)

    # ------------------------------------------------------------ searching

    def _summary(self, members: tuple[tuple[str, str, str], ...], cap: int) -> _Summary:
        key = (cap, members)
        hit = self._summaries.get(key)
        if hit is None:
            outcome, epochs = self._component(members, cap)
            violations, excess, slowdowns = 0, 0.0, 0.0
            for job, _, _ in members:
                dedicated = self.dedicated_s(job, epochs[job])
                slow = outcome.jobs[job].completion_s / dedicated if dedicated > 0 else 1.0
                # Short simulations see relatively longer tails (jobs alone after the others
                # finished), so they predict a little less slowdown than long ones: they are
                # held to a slightly tighter limit.
                over = slow - self.limit[job] + (COARSE_MARGIN if cap < self.final_epochs else 0.0)
                if over > 1e-9:
                    violations += 1
                    excess += over
                slowdowns += slow
            utils = tuple(g.utilization for g in outcome.groups.values())
            hit = _Summary(violations, excess, slowdowns, utils)
            self._summaries[key] = hit
            # The full outcome is kept only as long as the summary needs it.
            self._cache.pop((cap, members), None)
        return hit

    def _key(self, placement: PlacementMap, cap: int) -> tuple[float, ...]:
        """Assignment.key() from cached per-component summaries (what the search compares)."""
        violations, excess, slowdowns, utils = 0, 0.0, 0.0, 0.0
        groups = 0
        for members in _components(placement):
            s = self._summary(members, cap)
            violations += s.violations
            excess += s.excess
            slowdowns += s.slowdowns
            utils += sum(s.utils)
            groups += len(s.utils)
        return (
            violations,
            round(excess, 6),
            groups,
            round(slowdowns, 6),
            -round(utils / groups, 6) if groups else 0.0,
        )

    def _hopeless(self, placement: PlacementMap, groups: Iterable[str]) -> bool:
        """Some group among ``groups`` surely breaks a limit: its jobs' GPU shares there add up
        to more than the loosest limit among them. (Sharing a group, each job gets through
        at most its share of it: sum of duty / slowdown <= 1.)"""
        if self.arrivals:  # jobs that never meet share nothing: only a simulation can tell
            return False
        for gid in groups:
            load, loosest = 0.0, 1.0
            for job, (s, t) in placement.items():
                if gid in (s, t):
                    load += self._share(job, gid == s, gid == t)
                    loosest = max(loosest, self.limit[job])
            if load > loosest * 1.05:
                return True
        return False

    def _fits(self, job: str, slot: tuple[str, str]) -> bool:
        """Whether ``job`` can run on ``slot``: on colocated groups a sync job samples and
        trains on one group and an async job's loops run on two (pools keep them apart)."""
        if self.layout.disaggregated:
            return True
        return (slot[0] != slot[1]) == self.profiles[job].is_async

    def _share(self, job: str, sampler: bool, trainer: bool) -> float:
        pools = {pool for pool, on in (("sampler", sampler), ("trainer", trainer)) if on}
        return self.profiles[job].gpu_share(pools)

    def search(self, *, top: int = 3, time_limit_s: float = 5.0) -> PlanResult:
        """The best ``top`` assignments: searched on short simulations (``sim_epochs``), the
        best few then polished and ranked on long ones (``final_epochs``)."""
        started = time.perf_counter()
        deadline = started + time_limit_s
        coarse_until = started + 0.6 * time_limit_s
        Seen = dict[tuple[tuple[str, ...], ...], tuple[tuple[float, ...], PlacementMap]]
        seen: Seen = {}
        evaluated = 0

        def scorer(cap: int, into: Seen) -> Scorer:
            def score(placement: PlacementMap) -> tuple[float, ...]:
                nonlocal evaluated
                evaluated += 1
                key = self._key(placement, cap)
                if len(placement) == len(self.profiles):  # not the greedy's partial ones
                    into.setdefault(_canonical(placement, self.layout), (key, dict(placement)))
                return key

            return score

        coarse = scorer(self.sim_epochs, seen)
        order = sorted(self.profiles, key=lambda j: -self.profiles[j].duty)
        restarts = stale = 0
        best: tuple[float, ...] | None = None
        converged = True
        while True:
            placement = self._greedy(order, coarse)
            done = self._improve(placement, coarse, coarse_until)
            converged = converged and (done or restarts > 0)
            key = coarse(placement)
            stale = 0 if best is None or key < best else stale + 1
            best = key if best is None or key < best else best
            restarts += 1
            if time.perf_counter() > coarse_until or stale >= 2 or len(self.profiles) <= 2:
                break
            order = list(self.profiles)
            self.rng.shuffle(order)
        timed_out = not converged
        # Near a limit, short and long simulations can disagree: the best few are scored
        # again on long ones, and a limit the short ones hid is repaired there.
        finals: Seen = {}
        fine = scorer(self.final_epochs, finals)
        for _, candidate in sorted(seen.values(), key=lambda kv: kv[0])[: top * 2]:
            if finals and time.perf_counter() > deadline:
                timed_out = True
                break
            placement = dict(candidate)
            if fine(placement)[0] > 0:
                self._repair(placement, fine, deadline)
        chosen = sorted(finals.values(), key=lambda kv: kv[0])[:top]
        assignments = [self.evaluate(p, self.final_epochs) for _, p in chosen]
        notes = []
        if timed_out:
            notes.append(
                f"stopped at the time limit ({time_limit_s:g} s) after {restarts} restart(s): "
                "a longer --time-limit may find better"
            )
        return PlanResult(
            assignments=assignments,
            layout=self.layout,
            overheads=self.overheads,
            evaluated=evaluated,
            simulations=self.simulations,
            seconds=time.perf_counter() - started,
            notes=notes,
        )

    def _repair(
        self,
        placement: PlacementMap,
        score: Scorer,
        deadline: float,
    ) -> None:
        """Move jobs out of groups where a limit breaks, one best move at a time."""
        current = score(placement)
        while current[0] > 0 and time.perf_counter() < deadline:
            summaries = [self._summary(m, self.final_epochs) for m in _components(placement)]
            crowded = {
                job
                for members, s in zip(_components(placement), summaries, strict=True)
                if s.violations
                for job, _, _ in members
            }
            best: tuple[tuple[float, ...], PlacementMap] | None = None
            for candidate, _ in self._neighbours(placement, only=crowded):
                key = score(candidate)
                if key < current and (best is None or key < best[0]):
                    best = (key, candidate)
                if time.perf_counter() > deadline:
                    break
            if best is None:
                return
            current = best[0]
            placement.clear()
            placement.update(best[1])

    def _greedy(self, order: list[str], score: Scorer) -> PlacementMap:
        """Each job in turn onto the slot (group, or sampler x trainer pair) scoring best;
        slots that surely break a limit only when nothing else is left."""
        placement: PlacementMap = {}
        for job in order:
            candidates = self._candidate_slots(placement, job)
            hopeful = [
                slot for slot in candidates if not self._hopeless({**placement, job: slot}, slot)
            ]
            best: tuple[tuple[float, ...], tuple[str, str]] | None = None
            for slot in hopeful or candidates:
                key = score({**placement, job: slot})
                if best is None or key < best[0]:
                    best = (key, slot)
            assert best is not None
            placement[job] = best[1]
        return placement

    def _improve(
        self,
        placement: PlacementMap,
        score: Scorer,
        deadline: float,
    ) -> bool:
        """First-improvement local search; False if the deadline stopped it."""
        current = score(placement)
        improved = True
        while improved:
            improved = False
            feasible = current[0] == 0
            for candidate, changed in self._neighbours(placement):
                if time.perf_counter() > deadline:
                    return False
                if feasible and self._hopeless(candidate, changed):
                    continue  # cannot beat a feasible assignment
                key = score(candidate)
                if key < current:
                    placement.clear()
                    placement.update(candidate)
                    current = key
                    improved = True
                    break
        return True

    def _neighbours(
        self, placement: PlacementMap, only: set[str] | None = None
    ) -> Iterable[tuple[PlacementMap, tuple[str, ...]]]:
        """Candidate assignments one step away, with the groups whose jobs changed.
        ``only``: just moves of these jobs."""
        jobs = list(placement)
        self.rng.shuffle(jobs)
        layout = self.layout
        if only is not None:
            for job in jobs:
                if job in only:
                    yield from self._moves(placement, job)
            return
        # Merges first: they save a group.
        if layout.disaggregated:
            for index in (0, 1):
                used = sorted({pt[index] for pt in placement.values()})
                for a, b in itertools.permutations(used, 2):
                    merged = {
                        j: _with(pt, index, b) if pt[index] == a else pt
                        for j, pt in placement.items()
                    }
                    yield merged, (b,)
        else:
            used = sorted({g for pt in placement.values() for g in pt})
            for a, b in itertools.combinations(used, 2):
                merged = {
                    j: (b if pt[0] == a else pt[0], b if pt[1] == a else pt[1])
                    for j, pt in placement.items()
                }
                if all(self._fits(j, pt) for j, pt in merged.items()):
                    yield merged, (b,)
        for job in jobs:
            yield from self._moves(placement, job)
        # Swaps of two jobs' groups: all of them for small problems, a random sample of
        # MAX_SWAPS for large ones (most of a converged pass would be swaps that do not help).
        pairs = list(itertools.combinations(jobs, 2))
        if len(pairs) > MAX_SWAPS:
            pairs = self.rng.sample(pairs, MAX_SWAPS)
        for a, b in pairs:
            pa, pb = placement[a], placement[b]
            if pa == pb:
                continue
            changed = (*pa, *pb)
            if self._fits(a, pb) and self._fits(b, pa):
                yield {**placement, a: pb, b: pa}, changed
            if layout.disaggregated:
                yield {**placement, a: (pb[0], pa[1]), b: (pa[0], pb[1])}, changed
                yield {**placement, a: (pa[0], pb[1]), b: (pb[0], pa[1])}, changed

    def _moves(
        self, placement: PlacementMap, job: str
    ) -> Iterable[tuple[PlacementMap, tuple[str, ...]]]:
        """``job`` to another group (of the unused ones, just one: they are alike); with
        pools, its sampler or its trainer group, one at a time."""
        s_now, t_now = placement[job]
        others = [pt for j, pt in placement.items() if j != job]
        if not self.layout.disaggregated:
            used = {g for pt in others for g in pt}
            if not self.profiles[job].is_async:
                for g in _choices(self.layout.groups, used):
                    if g != s_now:
                        yield {**placement, job: (g, g)}, (g,)
                return
            for g in _choices(self.layout.groups, used, fresh=2):  # one loop at a time
                if g not in (s_now, t_now):
                    yield {**placement, job: (g, t_now)}, (g,)
                    yield {**placement, job: (s_now, g)}, (g,)
            return
        for g in _choices(self.layout.sampler_groups, {pt[0] for pt in others}):
            if g != s_now:
                yield {**placement, job: (g, t_now)}, (g,)
        for g in _choices(self.layout.trainer_groups, {pt[1] for pt in others}):
            if g != t_now:
                yield {**placement, job: (s_now, g)}, (g,)

    def _candidate_slots(self, placement: PlacementMap, job: str) -> list[tuple[str, str]]:
        """Where the greedy tries ``job``: every used group and one unused; with pools, the
        three least loaded sampler and trainer groups in use and one unused of each."""
        layout = self.layout
        if not layout.disaggregated:
            used = {g for pt in placement.values() for g in pt}
            if not self.profiles[job].is_async:
                return [(g, g) for g in _choices(layout.groups, used)]
            choices = _choices(layout.groups, used, fresh=2)
            return [(s, t) for s in choices for t in choices if s != t]
        picks = []
        for index, pool in ((0, layout.sampler_groups), (1, layout.trainer_groups)):
            load: dict[str, float] = {}
            for j, pt in placement.items():
                load[pt[index]] = load.get(pt[index], 0.0) + self._share(j, index == 0, index == 1)
            used = sorted(load, key=lambda g: load[g])[:3]
            fresh = [g for g in pool if g not in load][:1]
            picks.append(used + fresh)
        return [(s, t) for s in picks[0] for t in picks[1]]


def _choices(pool: Sequence[str], used: set[str], fresh: int = 1) -> list[str]:
    """The groups of ``pool`` in use, and the first ``fresh`` unused ones (an async job on
    colocated groups may open two)."""
    unused = [g for g in pool if g not in used][:fresh]
    return [g for g in pool if g in used] + unused


@dataclass(frozen=True)
class _Summary:
    violations: int
    excess: float
    slowdowns: float
    utils: tuple[float, ...]


def _with(pt: tuple[str, str], index: int, group: str) -> tuple[str, str]:
    return (group, pt[1]) if index == 0 else (pt[0], group)


def _pools_on(groups: tuple[str, str], group_id: str) -> set[str]:
    """The pools (sampler, trainer) a job placed on ``groups`` runs on ``group_id``."""
    sampler, trainer = groups
    return {pool for pool, g in (("sampler", sampler), ("trainer", trainer)) if g == group_id}


def _components(placement: PlacementMap) -> list[tuple[tuple[str, str, str], ...]]:
    """Jobs linked through shared groups, each component sorted (a cache key)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in placement.values():
        parent[find(s)] = find(t)
    comps: dict[str, list[tuple[str, str, str]]] = {}
    for job, (s, t) in placement.items():
        comps.setdefault(find(s), []).append((job, s, t))
    return [tuple(sorted(c)) for c in comps.values()]


def _canonical(placement: PlacementMap, layout: Layout) -> tuple[tuple[str, ...], ...]:
    """The assignment up to renaming groups of one pool (which group is which does not
    matter, only who shares with whom)."""
    if not layout.disaggregated:
        blocks: dict[str, list[str]] = {}
        for job, (s, t) in placement.items():
            if s == t:
                blocks.setdefault(s, []).append(job)
            else:  # an async job's two loops
                blocks.setdefault(s, []).append(f"{job}/sampler")
                blocks.setdefault(t, []).append(f"{job}/trainer")
        return tuple(sorted(tuple(sorted(b)) for b in blocks.values()))
    samplers: dict[str, list[str]] = {}
    trainers: dict[str, list[str]] = {}
    for job, (s, t) in placement.items():
        samplers.setdefault(s, []).append(job)
        trainers.setdefault(t, []).append(job)
    return (
        ("samplers",),
        *sorted(tuple(sorted(b)) for b in samplers.values()),
        ("trainers",),
        *sorted(tuple(sorted(b)) for b in trainers.values()),
    )


def plan(
    profiles: Sequence[JobProfile],
    layout: Layout,
    *,
    top: int = 3,
    time_limit_s: float = 5.0,
    **options: object,
) -> PlanResult:
    """Search assignments of ``profiles`` to ``layout``'s groups; the best ``top``."""
    planner = Planner(profiles, layout, **options)  # type: ignore[arg-type]
    return planner.search(top=top, time_limit_s=time_limit_s)
