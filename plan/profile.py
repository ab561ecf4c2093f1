"""A job's phase profile: what ``timeslice plan`` predicts from.

A profile says, for one job: its phases in the order one epoch runs them (seconds each, as a
distribution; on the GPU or not; on its sampler or its trainer pool), the states it keeps on a
group's device (bytes, snapshot and restore seconds), how many epochs it runs, and when it
checkpoints. ``timeslice plan profile JOB`` writes one from a real run; one can also be written
by hand, in YAML or JSON, for a job that has not run yet::

    job_id: grpo-7b
    epochs: 200
    phases:
      - {name: sample, gpu: true, pool: sampler, seconds: 40}
      - {name: rewards, gpu: false, seconds: 55}
      - {name: train, gpu: true, pool: trainer, seconds: {mean: 20, p90: 24}}
    states:
      - {name: sampler, pool: sampler, bytes: 16e9, snapshot_s: 0.7, restore_s: 0.6}
      - {name: trainer, pool: trainer, bytes: 48e9}

An async RL job (``mode: async``, an ``AsyncRLJobWorkflow``) runs two loops at once: its
sampler loop (the phases off the trainer pool: sample, then rewards) and its trainer loop (the
trainer pool's phases: train), the sampler at most ``max_staleness`` weights versions ahead,
the weights published every ``sync_every`` steps; ``epochs`` counts training steps::

    job_id: grpo-async
    mode: async
    max_staleness: 8
    sync_every: 1
    epochs: 400
    phases:
      - {name: sample, gpu: true, pool: sampler, seconds: 2.0}
      - {name: rewards, gpu: false, seconds: 0.02}
      - {name: train, gpu: true, pool: trainer, seconds: 1.0}

A profile without ``mode`` is a sync job's (files written before async jobs still load).
``timeslice plan schema`` prints the JSON schema. Every file crossing into the planner goes
through :func:`load_profile`, which names the file, the field and the problem.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from timeslice.errors import InvalidArgumentError
from timeslice.files import read_small_file
from timeslice.protocol.staleness import sync_every_problem

PROFILE_VERSION = 1
Pool = Literal["sampler", "trainer"]
StatePool = Literal["sampler", "trainer", "both"]
Kind = Literal["rl-job", "client"]
Mode = Literal["sync", "async"]
# AsyncRLJobConfig's bound (timeslice.protocol.async_rl_job.MAX_STALENESS; kept here so that the
# planner reads profiles without the job protocol).
MAX_STALENESS = 256


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Seconds of something measured or estimated: finite, never negative.
Duration = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class Seconds(_Model):
    """A phase's duration: the mean the simulator uses, and the spread seen (when measured).

    A plain number is accepted for ``mean`` alone (``seconds: 40``)."""

    mean: Duration
    stdev: Duration | None = None
    min: Duration | None = None
    p50: Duration | None = None
    p90: Duration | None = None
    max: Duration | None = None
    samples: int = Field(0, ge=0, description="how many measurements (0: written by hand)")

    @model_validator(mode="before")
    @classmethod
    def _number(cls, data: Any) -> Any:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"mean": data}
        return data

    @model_validator(mode="after")
    def _ordered(self) -> Seconds:
        order = [(k, getattr(self, k)) for k in ("min", "p50", "p90", "max")]
        known = [(k, v) for k, v in order if v is not None]
        for (k1, v1), (k2, v2) in itertools.pairwise(known):
            if v1 > v2:
                raise ValueError(f"{k1} ({v1}) is above {k2} ({v2})")
        low, high = self.min, self.max
        if (low is not None and self.mean < low - 1e-9) or (
            high is not None and self.mean > high + 1e-9
        ):
            raise ValueError(f"mean {self.mean} lies outside min..max ({low}..{high})")
        return self

    @classmethod
    def of(cls, values: Sequence[float]) -> Seconds:
        """Summarise measured durations."""
        if not values:
            raise ValueError("no durations to summarise")
        ordered = sorted(values)
        return cls(
            mean=statistics.fmean(ordered),
            stdev=statistics.stdev(ordered) if len(ordered) > 1 else 0.0,
            min=ordered[0],
            p50=statistics.median(ordered),
            p90=_quantile(ordered, 0.9),
            max=ordered[-1],
            samples=len(ordered),
        )


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (what numpy calls 'linear')."""
    if len(ordered) == 1:
        return ordered[0]
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class PhaseProfile(_Model):
    """One step of an epoch. A GPU phase holds a lease of its pool's group while it runs."""

    name: str = Field(min_length=1, max_length=64)
    gpu: bool
    pool: Pool | None = Field(
        None, description="the group a GPU phase runs on: the job's sampler or trainer group"
    )
    seconds: Seconds

    @model_validator(mode="after")
    def _pool(self) -> PhaseProfile:
        if self.gpu and self.pool is None:
            raise ValueError(f"GPU phase {self.name!r} needs a pool (sampler or trainer)")
        if not self.gpu and self.pool is not None:
            raise ValueError(f"phase {self.name!r} is not on the GPU: leave out its pool")
        return self


def _byte_count(v: Any) -> Any:
    """A byte count as a profile may write it: YAML reads ``16e9`` as a float (or, without a
    decimal point, a string); a whole number written that way is meant."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


class StateProfile(_Model):
    """A state the job keeps on a group's device, moved out when another job takes the group.

    ``pool``: the group it lives on (``both``: one state that follows the job's lease between
    its sampler and trainer groups). Move times left out are estimated from ``bytes`` and the
    planner's move bandwidth (``--move-gbps``)."""

    name: str = Field(min_length=1, max_length=128)
    pool: StatePool
    bytes: int = Field(ge=0)
    snapshot_s: Duration | None = None
    restore_s: Duration | None = None

    @field_validator("bytes", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        return _byte_count(v)


class Overheads(_Model):
    """What the protocol itself costs, beyond phases and state moves (seconds).

    The defaults are this project's measurements on the embedded server (BENCHMARKS.md);
    ``timeslice plan profile`` measures them on the jobs it reads."""

    request_s: Duration = Field(
        0.015, description="a process's acquire or release reaches its group"
    )
    grant_s: Duration = Field(0.015, description="the group's answer (a grant) reaches the process")
    hop_s: Duration = Field(
        0.035, description="one step of an RL job ends -> its next step's activity starts"
    )
    carry_s: Duration = Field(
        0.075, description="a kept lease: train ends -> the next sampling starts (the group idles)"
    )
    group_move_s: Duration = Field(
        0.04, description="dispatch of a snapshot / restore activity the group runs itself"
    )
    samples: int = Field(0, ge=0, description="hand-offs and hops measured (0: defaults)")

    @classmethod
    def zero(cls) -> Overheads:
        """Free protocol: the ideal the benchmarks compare against."""
        return cls(request_s=0, grant_s=0, hop_s=0, carry_s=0, group_move_s=0)


class ProfileSource(_Model):
    """Where a measured profile came from."""

    workflow_id: str | None = None
    group_id: str | None = Field(None, description="a client job: the group whose leases were read")
    runs: int = Field(0, ge=0, description="workflow runs read (continue-as-new)")
    epochs_read: int = Field(0, ge=0)
    sampler_group: str | None = None
    trainer_group: str | None = None
    read_at: str | None = None
    overheads: Overheads | None = Field(None, description="the protocol's costs seen in this run")
    notes: list[str] = Field(default_factory=list)


class WeightSync(_Model):
    """An async job's weight publications (trainer -> host memory, under the trainer lease,
    every ``sync_every`` steps) and loads (host -> sampler, under the sampler lease, before the
    first batch sampled with newer weights), as measured. Their time is part of the train and
    sample phases' seconds (the phases ran them); these fields say how much, per move."""

    publications: int = Field(0, ge=0, description="publications measured")
    publish_s: Seconds | None = Field(None, description="one publication")
    publish_bytes: int = Field(0, ge=0, description="bytes one publication moved")
    loads: int = Field(0, ge=0, description="loads into the sampler measured")
    load_s: Seconds | None = Field(None, description="one load")
    load_bytes: int = Field(0, ge=0, description="bytes one load moved")

    @field_validator("publish_bytes", "load_bytes", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> Any:
        return _byte_count(v)


class JobProfile(_Model):
    """One job, as the planner sees it (``timeslice plan schema`` prints this as JSON schema)."""

    version: Literal[1] = PROFILE_VERSION
    job_id: str = Field(min_length=1, max_length=200)
    kind: Kind = Field(
        "rl-job",
        description="rl-job: an RLJobWorkflow (phases take their own leases, ask ahead, carry "
        "the lease train -> sample, move their own state); client: a process using the "
        "embedded client (acquire, hold, release; the group moves its state)",
    )
    mode: Mode = Field(
        "sync",
        description="sync: one phase after the other; async: an AsyncRLJobWorkflow, whose "
        "sampler loop (the phases off the trainer pool) and trainer loop (the trainer pool's) "
        "run at once, on two groups",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        le=MAX_STALENESS,
        description="async: the most weights versions a batch's sampler may lag its trainer",
    )
    sync_every: int | None = Field(
        None, ge=1, le=MAX_STALENESS + 1, description="async: steps between weight publications"
    )
    weight_sync: WeightSync | None = Field(None, description="async: weight moves measured")
    epochs: int = Field(ge=1, le=10_000_000, description="epochs (async: training steps)")
    priority: int = Field(0, ge=-100, le=100)
    max_slowdown: float | None = Field(
        None, ge=1.0, allow_inf_nan=False, description="at most this much slower than dedicated"
    )
    phases: list[PhaseProfile] = Field(min_length=1, description="one epoch, in order")
    states: list[StateProfile] = Field(default_factory=list)
    checkpoint_every: int | None = Field(None, ge=1)
    arrive_s: float = Field(
        0.0,
        ge=0,
        le=1e7,
        allow_inf_nan=False,
        description="a trace: when the job arrives, seconds after the first job (timeslice "
        "plan then runs every job's epochs from its arrival, unscaled, so jobs leave when "
        "they would)",
    )
    checkpoint_s: Seconds | None = Field(
        None, description="a checkpoint, written under the trainer lease after train"
    )
    source: ProfileSource | None = None

    @model_validator(mode="after")
    def _consistent(self) -> JobProfile:
        names = [p.name for p in self.phases]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"phase names repeat: {dup}")
        if not any(p.gpu for p in self.phases):
            raise ValueError("no GPU phase: a job that never holds a group has nothing to plan")
        states = [s.name for s in self.states]
        dup = sorted({n for n in states if states.count(n) > 1})
        if dup:
            raise ValueError(f"state names repeat: {dup}")
        if self.kind == "client" and any(p.pool == "trainer" for p in self.phases):
            raise ValueError("a client job has one group: give its GPU phases pool 'sampler'")
        if self.checkpoint_every is not None and self.checkpoint_s is None:
            raise ValueError("checkpoint_every needs checkpoint_s (how long one takes)")
        if self.mode == "sync":
            given = [
                name
                for name in ("max_staleness", "sync_every", "weight_sync")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: only for an async job; add mode: async (or leave "
                    "them out)"
                )
            return self
        if self.kind != "rl-job":
            raise ValueError("an async job is an RL job: kind rl-job, not client")
        if self.max_staleness is None:
            raise ValueError("an async job needs max_staleness (0 to 256)")
        if self.sync_every is None:
            self.sync_every = 1  # AsyncRLJobConfig's default
        problem = sync_every_problem(self.max_staleness, self.sync_every)
        if problem is not None:
            raise ValueError(problem)
        if not any(p.gpu and p.pool == "trainer" for p in self.phases) or not any(
            p.gpu and p.pool == "sampler" for p in self.phases
        ):
            raise ValueError(
                "an async job needs a GPU phase on each pool: its sampler loop's (pool sampler) "
                "and its trainer loop's (pool trainer)"
            )
        return self

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    def loop_s(self, loop: Literal["sampler", "trainer"]) -> float:
        """An async job's loop: the trainer pool's phases, or all the others."""
        return sum(
            p.seconds.mean for p in self.phases if (p.pool == "trainer") == (loop == "trainer")
        )

    @property
    def cycle_s(self) -> float:
        """One epoch's share of the job's time alone: a sync job's phases in turn; an async
        job's slower loop (with ``max_staleness`` 0 its loops take turns: the phases in turn)."""
        if not self.is_async or not self.max_staleness:
            return self.epoch_s
        return max(self.loop_s("sampler"), self.loop_s("trainer"))

    @property
    def gpu_s(self) -> float:
        return sum(p.seconds.mean for p in self.phases if p.gpu)

    @property
    def epoch_s(self) -> float:
        return sum(p.seconds.mean for p in self.phases)

    @property
    def duty(self) -> float:
        """The GPU share of an epoch when the job runs alone (protocol costs left out); an
        async job's: the busier of its two groups'."""
        if self.is_async:
            return max(self.gpu_share({"sampler"}), self.gpu_share({"trainer"}))
        return self.gpu_s / self.epoch_s if self.epoch_s > 0 else 1.0

    def gpu_share(self, pools: set[str]) -> float:
        """The share of the job's time alone spent in GPU phases on the groups of ``pools``
        (``sampler``, ``trainer``): this job's term of a group's demand bound."""
        on = sum(p.seconds.mean for p in self.phases if p.gpu and p.pool in pools)
        cycle = self.cycle_s
        return min(1.0, on / cycle) if cycle > 0 else 1.0

    def pools(self) -> set[str]:
        return {p.pool for p in self.phases if p.pool is not None}


def profile_schema() -> dict[str, Any]:
    return JobProfile.model_json_schema()


def explain(err: ValidationError) -> str:
    """One line per problem, naming the field path: what to fix in the file."""
    lines = []
    for e in err.errors():
        where = ".".join(str(part) for part in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def parse_profile(data: Any, where: str) -> JobProfile:
    if not isinstance(data, dict):
        raise InvalidArgumentError(
            f"{where}: a profile is a mapping (job_id, epochs, phases, ...), not "
            f"{type(data).__name__}"
        )
    try:
        return JobProfile.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(
            f"{where}: invalid profile ({err.error_count()} problem"
            f"{'s' if err.error_count() > 1 else ''}):\n{explain(err)}"
        ) from None


def load_profiles(path: Path) -> list[JobProfile]:
    """Profiles in a YAML or JSON file: one mapping, or a list of them."""
    data = _decode(read_small_file(path, "profile"), path)
    items = data if isinstance(data, list) else [data]
    if not items:
        raise InvalidArgumentError(f"{path}: no profile in the file")
    return [
        parse_profile(item, f"{path}" if len(items) == 1 else f"{path} (profile {i + 1})")
        for i, item in enumerate(items)
    ]


def load_profile(path: Path) -> JobProfile:
    profiles = load_profiles(path)
    if len(profiles) != 1:
        raise InvalidArgumentError(f"{path}: holds {len(profiles)} profiles, expected one")
    return profiles[0]


def _decode(text: str, path: Path) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise InvalidArgumentError(
                f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
            ) from None
    try:
        import yaml
    except ImportError:
        raise InvalidArgumentError(
            f"{path}: reading YAML needs PyYAML (pip install pyyaml), or write the profile as "
            "JSON (.json)"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise InvalidArgumentError(f"{path}: not valid YAML{at}: {problem}") from None


def load_overheads(path: Path) -> Overheads:
    """The protocol's costs from a YAML / JSON file (the fields of :class:`Overheads`)."""
    data = _decode(read_small_file(path, "overheads"), path)
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{path}: overheads are a mapping (request_s, grant_s, ...)")
    try:
        return Overheads.model_validate(data)
    except ValidationError as err:
        raise InvalidArgumentError(f"{path}: invalid overheads:\n{explain(err)}") from None


def dump_profile(profile: JobProfile, path: Path) -> None:
    """Write as JSON (.json) or YAML (anything else)."""
    data = profile.model_dump(mode="json", exclude_none=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n")
        return
    try:
        import yaml
    except ImportError:
        raise InvalidArgumentError(
            f"{path}: writing YAML needs PyYAML (pip install pyyaml); write JSON instead "
            "(a .json file; `timeslice plan profile --format json`)"
        ) from None
    path.write_text(yaml.safe_dump(data, sort_keys=False))
