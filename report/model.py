"""What a report holds: figures per group and per job, and the timeline's lanes.

Every figure is defined once in docs/report.md; the text tables, the HTML page, the picture and
the trace file all read these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from timeslice.protocol.utilization import SINCE_CREATED, WHILE_JOBS_RAN, Utilization

PHASES = ("sample", "rewards", "train")

SpanKind = Literal[
    "sample",  # job lanes: a GPU phase running
    "train",
    "phase",  # an embedded client's GPU phase: reported with its release, or its whole lease
    "rewards",  # the job computing rewards, holding no group
    "waiting",  # the job waiting for a group's grant
    "switching",  # job lanes: its state coming back in; group lanes: a switch
    "moved",  # job lanes: moved by its pool to another group (last phase there to first here)
    "lease",  # group lanes: held by ``job_id``
    "idle",  # group lanes: nobody held it and nothing moved
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Span(_Model):
    lane: str = Field(description="the job's or the group's lane")
    kind: SpanKind
    start: datetime
    end: datetime
    job_id: str | None = None
    group_id: str | None = None
    epoch: int | None = None
    label: str = ""

    @property
    def seconds(self) -> float:
        return (self.end - self.start).total_seconds()


class Lane(_Model):
    name: str
    kind: Literal["job", "group"]
    spans: list[Span] = Field(default_factory=list)


class GroupFigures(_Model):
    """One GPU group over ``start`` (its creation) to ``end`` (its close, or the query).

    ``phase_s`` + ``overhead_s`` + ``switching_s`` + ``idle_s`` = ``wall_s``: the time GPU phases
    ran, the time it was leased while none ran, the time state moved, and the rest.
    ``active_start`` to ``active_end``: its first phase's start to its last phase's end, the
    window of :attr:`while_jobs_ran` (docs/report.md, "Utilization")."""

    group_id: str
    start: datetime
    end: datetime
    wall_s: float
    phase_s: float
    overhead_s: float
    switching_s: float
    idle_s: float
    leases: int
    switches: int
    overlapped_switches: int
    bytes_moved: int
    wait_p50_s: float | None
    wait_p99_s: float | None
    holder: str | None = None
    queued: int = 0
    carried: int = Field(0, description="leases carried past waiters (the grant policy)")
    preemptions: int = Field(
        0, description="holders whose lease ran out without yielding, evicted by the group"
    )
    carrying_into: str | None = Field(None, description="the holder's, at the query")
    notes: list[str] = Field(default_factory=list)
    active_start: datetime | None = Field(None, description="the first phase's start")
    active_end: datetime | None = Field(None, description="the last phase's end")

    def fraction(self, seconds: float) -> float:
        return seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def since_created(self) -> Utilization:
        """Phase time over the group's life, creation to ``end``."""
        return Utilization(self.phase_s, self.wall_s, SINCE_CREATED)

    @property
    def while_jobs_ran(self) -> Utilization:
        """Phase time over its first phase's start to its last phase's end (all its phases
        ran in that window)."""
        if self.active_start is None or self.active_end is None:
            return Utilization(0.0, 0.0, WHILE_JOBS_RAN)
        window = (self.active_end - self.active_start).total_seconds()
        return Utilization(self.phase_s, window, WHILE_JOBS_RAN)

    @property
    def utilization(self) -> float:
        """The share of the group's life (since it was created) its GPU phases ran."""
        return self.since_created.share


JobStatus = Literal[
    "running", "completed", "failed", "cancelled", "terminated", "timed_out", "unknown"
]


class JobFigures(_Model):
    """One RL job (all its runs): its own phases, what waiting and switching cost it, and how
    much longer it took than alone."""

    job_id: str
    status: JobStatus
    epochs_done: int
    epochs: int | None = None
    groups: list[str] = Field(default_factory=list)
    phase_s: dict[str, float] = Field(default_factory=dict)
    waiting_s: float = 0.0
    switching_s: float = 0.0
    wall_s: float | None = None
    dedicated_s: float | None = Field(
        None, description="the same job's wall time alone on its own group, when known"
    )
    dedicated_from: Literal["measured", "simulated"] = Field(
        "measured",
        description="where dedicated_s comes from: a real run alone (the demo runs one), or "
        "the planner's simulation of one",
    )
    rewards: list[float | None] = Field(default_factory=list, description="per epoch")
    rewinds: int = 0
    carries_asked: int = Field(0, description="GPU phases that asked to carry their lease on")
    carries_kept: int = Field(0, description="... and kept it for the next phase")
    note: str | None = None
    failure: str | None = Field(None, description="what a failed run failed with: type: message")
    earlier_runs: int = Field(
        0,
        description="runs of the same job id before the one reported (each run is its own; "
        "the report reads the latest)",
    )
    mode: Literal["sync", "async"] = "sync"
    staleness: list[int] = Field(
        default_factory=list,
        description="async jobs: each training step's staleness (the step minus the weights "
        "version its batch was sampled with), in the order trained, rewinds included",
    )

    @property
    def gpu_s(self) -> float:
        return self.phase_s.get("sample", 0.0) + self.phase_s.get("train", 0.0)

    @property
    def own_s(self) -> float:
        """The job's own phase time, sample + rewards + train: its wall time with no waiting,
        no switching and no overhead at all."""
        return sum(self.phase_s.get(p, 0.0) for p in PHASES)

    @property
    def slowdown(self) -> float | None:
        """Wall time / the same job's wall time alone (``dedicated_s``, measured or
        simulated as ``dedicated_from`` says); None without that baseline: a job's own phase
        time is no run alone, and a ratio to it would call start-up and checkpoints
        slowdown."""
        if self.wall_s is None or not self.dedicated_s:
            return None
        return self.wall_s / self.dedicated_s

    @property
    def reward_first(self) -> float | None:
        return next((r for r in self.rewards if r is not None), None)

    @property
    def reward_last(self) -> float | None:
        return next((r for r in reversed(self.rewards) if r is not None), None)


class Report(_Model):
    generated_at: datetime
    simulated: bool = Field(
        False,
        description="a run the planner simulated (`timeslice plan --html`), not one measured: "
        "its clock starts at 0 and its pages say so",
    )
    groups: list[GroupFigures]
    jobs: list[JobFigures]
    lanes: list[Lane] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list, description="what could not be read")

    @property
    def spans(self) -> list[Span]:
        return [s for lane in self.lanes for s in lane.spans]

    @property
    def window(self) -> tuple[datetime, datetime]:
        """The time the report covers: from the first group's creation (or the first span) to
        the last group's end (or the last span). The tables' group figures cover their part of
        it, and the picture, the page and the trace draw all of it, so the idle time in the
        table is there to see."""
        starts = [g.start for g in self.groups] + [s.start for s in self.spans]
        ends = [g.end for g in self.groups] + [s.end for s in self.spans]
        if not starts:
            return self.generated_at, self.generated_at
        return min(starts), max(ends)
