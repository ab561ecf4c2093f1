"""A discrete-event simulator of RL jobs taking turns on GPU groups.

Each job runs ``epochs`` times: sample (holding its sampler group), compute rewards (holding
nothing), train (holding its trainer group). A group serves its requests first come, first
served, the way ``GpuGroupWorkflow`` does for equal priorities. ``switch_s`` charges a fixed
cost whenever a group passes to a different job than its last holder; with 0 the result is the
*ideal*: what the same jobs would reach if switches were free. The benchmarks compare measured
runs against it (bench/replay.py), with the same ramp-up and tail as the real run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class JobProfile(BaseModel):
    """One job's phases: seconds each, and the groups its GPU phases hold."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    sample_s: float = Field(ge=0)
    rewards_s: float = Field(ge=0)
    train_s: float = Field(ge=0)
    sampler_group: str
    trainer_group: str
    epochs: int = Field(ge=1)
    start_s: float = Field(0.0, ge=0, description="when the job asks for its first group")


@dataclass
class GroupOutcome:
    busy_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0
    switches: int = 0
    holds: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.first_start is None else self.last_end - self.first_start

    @property
    def utilization(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Outcome:
    groups: dict[str, GroupOutcome]
    completion_s: dict[str, float]


def simulate(jobs: list[JobProfile], *, switch_s: float = 0.0) -> Outcome:
    """Run ``jobs`` to completion; every group FIFO by request time."""
    groups: dict[str, GroupOutcome] = {}
    free_at: dict[str, float] = {}
    last_holder: dict[str, str] = {}
    completion: dict[str, float] = {}
    # (request time, tie-break, job index, epoch, phase)
    pending: list[tuple[float, int, int, int, str]] = []
    seq = 0
    for index, job in enumerate(jobs):
        heapq.heappush(pending, (job.start_s, seq, index, 0, "sample"))
        seq += 1
    while pending:
        asked, _, index, epoch, phase = heapq.heappop(pending)
        job = jobs[index]
        group = job.sampler_group if phase == "sample" else job.trainer_group
        hold = job.sample_s if phase == "sample" else job.train_s
        outcome = groups.setdefault(group, GroupOutcome())
        start = max(asked, free_at.get(group, 0.0))
        if last_holder.get(group, job.job_id) != job.job_id:
            start += switch_s
            outcome.switches += 1
        end = start + hold
        free_at[group], last_holder[group] = end, job.job_id
        outcome.busy_s += hold
        outcome.first_start = start if outcome.first_start is None else outcome.first_start
        outcome.last_end = max(outcome.last_end, end)
        outcome.holds.append((job.job_id, start, end))
        if phase == "sample":
            heapq.heappush(pending, (end + job.rewards_s, seq, index, epoch, "train"))
        elif epoch + 1 < job.epochs:
            heapq.heappush(pending, (end, seq, index, epoch + 1, "sample"))
        else:
            completion[job.job_id] = end - job.start_s
        seq += 1
    return Outcome(groups=groups, completion_s=completion)
