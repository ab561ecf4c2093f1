"""``timeslice plan``: which jobs should share which GPU groups.

    timeslice plan profile JOB... [--group G] [--out DIR]    profiles from real runs
    timeslice plan schema                                     the profile file's JSON schema
    timeslice plan PROFILE... --groups N [options]            the best assignments

``cli/main.py`` registers the command with :func:`add_parser` and runs it with :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from timeslice.errors import InvalidArgumentError
from timeslice.files import writable_folder
from timeslice.protocol.group import (
    DEFAULT_AGING_S,
    DEFAULT_GRANT_POLICY,
    MAX_STATE_BYTES,
    GrantPolicy,
    check_id,
)
from timeslice.protocol.utilization import WHILE_JOBS_RAN

if TYPE_CHECKING:
    from timeslice.plan.profile import JobProfile, Overheads
    from timeslice.plan.search import Assignment, JobPlan, Layout, Planner, PlanResult

    # The other grant policy's name, and the assignments found predicted under it.
    Compared = tuple[str, list[Assignment]]

USAGE = """\
timeslice plan profile JOB... [--group GROUP] [--out DIR] [--format yaml|json]
       timeslice plan schema
       timeslice plan PROFILE... (--groups N | --sampler-groups N --trainer-groups N) [options]"""

PROFILE_SUFFIXES = (".yaml", ".yml", ".json")


def _finite(text: str) -> float:
    """An argparse type: a finite number ("nan" and "inf" parse as floats, yet mean nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = subparsers.add_parser(
        "plan",
        usage=USAGE,
        help="which jobs should share which GPU groups, predicted from phase profiles",
        description="Profile jobs from their real runs (`plan profile JOB...`), or search the "
        "assignments of profiled jobs to GPU groups and print the best few: utilization per "
        "group, slowdown per job against a group of its own, GPUs saved. docs/plan.md has more.",
    )
    plan.add_argument(
        "items",
        nargs="+",
        metavar="PROFILE",
        help="profile files (YAML / JSON) or folders of them; or `profile JOB...`; or `schema`",
    )
    _add_placement_args(plan)
    _add_model_args(plan)
    _add_output_args(plan)
    _add_profile_args(plan)


def _add_placement_args(plan: argparse.ArgumentParser) -> None:
    """Where the jobs may run: the groups, their memory and their grant policy."""
    where = plan.add_argument_group("where the jobs may run")
    where.add_argument("--groups", help="N groups, or their names comma-separated (colocated)")
    where.add_argument("--sampler-groups", help="N sampler groups, or their names")
    where.add_argument("--trainer-groups", help="N trainer groups, or their names")
    where.add_argument(
        "--group-memory",
        type=_finite,
        metavar="BYTES",
        help="device memory of a group: where two jobs' states fit, switches overlap "
        "eviction and restore (default: not declared)",
    )
    where.add_argument("--gpus-per-group", type=int, default=1, help="for GPUs saved (default 1)")
    where.add_argument(
        "--aging",
        type=_finite,
        default=DEFAULT_AGING_S,
        metavar="S",
        help=f"the groups' aging_s (default {DEFAULT_AGING_S:g})",
    )
    where.add_argument(
        "--policy",
        choices=[p.value for p in GrantPolicy],
        default=DEFAULT_GRANT_POLICY.value,
        help="the groups' grant_policy, which predictions and the recommendation use (default "
        f"{DEFAULT_GRANT_POLICY}, GroupConfig's default; its bounds are GroupConfig's defaults)",
    )
    where.add_argument(
        "--compare-policies",
        action="store_true",
        help="also predict the assignments shown under the other grant policy, side by side",
    )


def _add_model_args(plan: argparse.ArgumentParser) -> None:
    """The jobs' limits and priorities, and the cost model's inputs."""
    limits = plan.add_argument_group("limits and priorities")
    limits.add_argument(
        "--max-slowdown",
        action="append",
        default=[],
        metavar="[JOB=]X",
        help="at most X times slower than alone on a group of its own; X alone sets it for "
        "jobs whose profile has no max_slowdown (default 1.5); repeatable",
    )
    limits.add_argument(
        "--priority",
        action="append",
        default=[],
        metavar="JOB=N",
        help="the job's priority on its groups (overrides its profile); repeatable",
    )
    model = plan.add_argument_group("the model")
    model.add_argument(
        "--overheads",
        type=Path,
        metavar="FILE",
        help="the protocol's costs (YAML / JSON, fields of Overheads); default: the median of "
        "those measured in the profiles, else this project's measurements",
    )
    model.add_argument(
        "--move-gbps",
        type=_finite,
        default=25.0,
        help="host <-> device copy rate for states with no measured move time (default 25)",
    )


def _add_output_args(plan: argparse.ArgumentParser) -> None:
    """How many assignments, the search's time and seed, and the files written."""
    out = plan.add_argument_group("output")
    out.add_argument("--top", type=int, default=3, help="how many assignments (default 3)")
    out.add_argument(
        "--time-limit", type=_finite, default=5.0, metavar="S", help="search time (default 5 s)"
    )
    out.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    out.add_argument("--json", type=Path, metavar="FILE", help="also write the answer as JSON")
    out.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="draw the recommended assignment's simulated run as a timeline (and FILE.json)",
    )


def _add_profile_args(plan: argparse.ArgumentParser) -> None:
    """``plan profile``'s: which groups to read, where profiles go, and the connection."""
    prof = plan.add_argument_group("plan profile")
    prof.add_argument(
        "--group",
        action="append",
        default=[],
        help="a group whose lease history to read client (non-RL) jobs from; repeatable",
    )
    prof.add_argument(
        "--out",
        type=Path,
        default=Path(".timeslice/profiles"),
        help="folder for the profiles (default .timeslice/profiles)",
    )
    prof.add_argument("--format", choices=("yaml", "json"), default="yaml")
    conn = plan.add_argument_group("Temporal (plan profile)")
    conn.add_argument(
        "--address", help="Temporal HOST:PORT (default: $TEMPORAL_ADDRESS, then localhost:7233)"
    )
    conn.add_argument("--namespace", help="Temporal namespace (default: $TEMPORAL_NAMESPACE)")
    conn.add_argument("--profile", help="temporal CLI config profile ($TEMPORAL_PROFILE)")


def _ids(kind: str, values: list[str]) -> None:
    for value in values:
        try:
            check_id(kind, value)
        except ValueError as err:
            raise InvalidArgumentError(str(err)) from None


async def run(args: argparse.Namespace) -> int:
    head, rest = args.items[0], args.items[1:]
    if head == "profile":
        if not rest:
            raise InvalidArgumentError("plan profile: name at least one job")
        # Before connecting: a bad id or folder fails at once, not after the reads.
        _ids("job id", rest)
        _ids("group id", args.group)
        writable_folder(args.out, "--out")
        return await _profile(args, rest)
    if head == "schema":
        from timeslice.plan.profile import profile_schema

        print(json.dumps(profile_schema(), indent=2))
        return 0
    return _plan(args)


# ---------------------------------------------------------------- plan profile


async def _profile(args: argparse.Namespace, jobs: list[str]) -> int:
    from timeslice.plan.collect import (
        NoSuchJobError,
        client_profile,
        read_rl_job,
        rl_job_profile,
    )
    from timeslice.plan.profile import dump_profile
    from timeslice.report.gather import read_group_status
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    statuses = {g: await read_group_status(client, g) for g in args.group}
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[JobProfile, Path]] = []
    for job in jobs:
        try:
            profile = rl_job_profile(await read_rl_job(client, job))
        except NoSuchJobError:
            holding = [g for g, s in statuses.items() if any(r.job_id == job for r in s.history)]
            if not holding:
                where = (
                    f" nor in the lease history of {', '.join(args.group)}" if args.group else ""
                )
                raise NoSuchJobError(
                    f"no RL job {job!r} (workflow rl-job-{job}){where}; for a job using the "
                    "embedded client, name the group it used with --group"
                ) from None
            if len(holding) > 1:
                raise InvalidArgumentError(
                    f"job {job!r} holds leases in several groups ({', '.join(holding)}): "
                    "profile it with one --group"
                ) from None
            g = holding[0]
            profile = client_profile(job, g, statuses[g].history)
        path = args.out / f"{job}.{args.format}"
        dump_profile(profile, path)
        written.append((profile, path))
    for profile, path in written:
        print(describe_profile(profile))
        print(f"  -> {path}")
    if statuses:
        from timeslice.report.gather import status_figures
        from timeslice.report.text import utilization_line

        now = datetime.now(UTC)
        for g, status in statuses.items():  # what `timeslice status` and `report` print
            figures = await status_figures(client, status.advanced_to(now))
            print(f"group {g}: utilization {utilization_line(figures)}")
    return 0


def describe_profile(p: JobProfile) -> str:
    def span(seconds: object) -> str:
        from timeslice.plan.profile import Seconds

        assert isinstance(seconds, Seconds)
        if seconds.samples > 1 and seconds.p90 is not None:
            return f"{seconds.mean:.2f} s (p90 {seconds.p90:.2f}, n={seconds.samples})"
        return f"{seconds.mean:.2f} s"

    if p.is_async:
        lines = [
            f"{p.job_id}: {p.kind}, async (max_staleness {p.max_staleness}, sync_every "
            f"{p.sync_every}), {p.epochs} steps, alone: sampler busy "
            f"{p.gpu_share({'sampler'}):.0%}, trainer busy {p.gpu_share({'trainer'}):.0%}"
        ]
    else:
        lines = [f"{p.job_id}: {p.kind}, {p.epochs} epochs, GPU share {p.duty:.0%} alone"]
    for ph in p.phases:
        where = f"GPU, {ph.pool}" if ph.gpu else "off the GPU"
        if p.is_async:
            where += ", trainer loop" if ph.pool == "trainer" else ", sampler loop"
        lines.append(f"  {ph.name:<10} {span(ph.seconds):<34} {where}")
    sync = p.weight_sync
    if sync is not None:
        lines.append(
            f"  weights: {sync.publications} publication(s)"
            + (
                f" of {_gb(sync.publish_bytes)}, {span(sync.publish_s)} each"
                if sync.publish_s is not None
                else ""
            )
            + f"; {sync.loads} load(s) into the sampler"
            + (
                f" of {_gb(sync.load_bytes)}, {span(sync.load_s)} each"
                if sync.load_s is not None
                else ""
            )
        )
    for s in p.states:
        moves = (
            f"snapshot {s.snapshot_s:.3f} s, restore {s.restore_s:.3f} s"
            if s.snapshot_s is not None and s.restore_s is not None
            else "move time not measured"
        )
        lines.append(f"  state {s.name} ({s.pool}): {_gb(s.bytes)}, {moves}")
    if p.source is not None:
        ov = p.source.overheads
        if ov is not None:
            lines.append(
                f"  protocol: hop {ov.hop_s * 1000:.0f} ms, request + grant "
                f"{(ov.request_s + ov.grant_s) * 1000:.0f} ms, carried lease "
                f"{ov.carry_s * 1000:.0f} ms ({ov.samples} measurements)"
            )
        for note in p.source.notes:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------- plan


def load_all(items: list[str]) -> list[JobProfile]:
    from timeslice.plan.profile import load_profiles

    profiles: list[JobProfile] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.suffix.lower() in PROFILE_SUFFIXES)
            if not files:
                raise InvalidArgumentError(f"{path}: no profile files (*.yaml, *.yml, *.json)")
        elif path.exists():
            files = [path]
        else:
            raise InvalidArgumentError(f"{path}: no such profile file or folder")
        for f in files:
            profiles.extend(load_profiles(f))
    ids = [p.job_id for p in profiles]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise InvalidArgumentError(f"several profiles for job(s) {dup}: give each job once")
    return profiles


# The most groups a layout may name: the search's work grows with them, and a planned pool
# larger than this is not one the planner's model was measured on.
MAX_GROUPS = 256


def _names(value: str, flag: str, prefix: str) -> tuple[str, ...]:
    """``value`` as group names: N (a whole number, 1..MAX_GROUPS: N groups named
    ``prefix-1`` ...), or the names, comma-separated, each a valid group id."""
    value = value.strip()
    if re.fullmatch(r"[+-]?\d+", value):
        n = int(value)
        if not 1 <= n <= MAX_GROUPS:
            raise InvalidArgumentError(
                f"{flag} {value}: a number of groups is 1..{MAX_GROUPS}, not {n}"
            )
        return tuple(f"{prefix}-{i + 1}" for i in range(n))
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if not names:
        raise InvalidArgumentError(f"{flag}: give a number of groups or their names")
    if len(names) > MAX_GROUPS:
        raise InvalidArgumentError(f"{flag}: {len(names)} groups, more than {MAX_GROUPS}")
    for name in names:
        try:
            check_id("group name", name)
        except ValueError as err:
            raise InvalidArgumentError(f"{flag}: {err}") from None
    return names


# GroupConfig's bound on aging_s.
MAX_AGING_S = 366 * 86_400.0


def _within(flag: str, value: float, low: float, high: float) -> float:
    """``value`` if ``low <= value <= high``; else InvalidArgumentError naming ``flag``."""
    if not low <= value <= high:
        raise InvalidArgumentError(f"{flag} {value:g}: must be within {low:g}..{high:g}")
    return value


def layout_from_args(args: argparse.Namespace) -> Layout:
    from timeslice.plan.search import Layout
    from timeslice.plan.simulator import GroupSpec

    pooled = args.sampler_groups is not None or args.trainer_groups is not None
    if pooled and args.groups is not None:
        raise InvalidArgumentError("give --groups, or --sampler-groups and --trainer-groups")
    if pooled and (args.sampler_groups is None or args.trainer_groups is None):
        raise InvalidArgumentError(
            "disaggregated pools need both --sampler-groups and --trainer-groups"
        )
    if not pooled and args.groups is None:
        raise InvalidArgumentError(
            "how many groups? give --groups N (or sampler and trainer pools)"
        )
    memory = None
    if args.group_memory is not None:
        memory = int(_within("--group-memory", args.group_memory, 1, MAX_STATE_BYTES))
    _within("--aging", args.aging, 1e-3, MAX_AGING_S)
    _within("--gpus-per-group", args.gpus_per_group, 1, 1024)
    try:
        policy = GroupSpec(grant_policy=getattr(args, "policy", DEFAULT_GRANT_POLICY))
        if pooled:
            return Layout(
                sampler_groups=_names(args.sampler_groups, "--sampler-groups", "sampler"),
                trainer_groups=_names(args.trainer_groups, "--trainer-groups", "trainer"),
                memory_bytes=memory,
                aging_s=args.aging,
                gpus_per_group=args.gpus_per_group,
                policy=policy,
            )
        return Layout(
            groups=_names(args.groups, "--groups", "group"),
            memory_bytes=memory,
            aging_s=args.aging,
            gpus_per_group=args.gpus_per_group,
            policy=policy,
        )
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None


def _limits(items: list[str]) -> tuple[float | None, dict[str, float]]:
    default: float | None = None
    per_job: dict[str, float] = {}
    for item in items:
        job, sep, raw = item.rpartition("=")
        try:
            value = float(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"--max-slowdown {item!r}: use X or JOB=X with X a number, e.g. 1.3"
            ) from None
        if not value >= 1.0:
            raise InvalidArgumentError(f"--max-slowdown {item!r}: X must be >= 1 (1 = no slowdown)")
        if sep:
            per_job[job] = value
        else:
            default = value
    return default, per_job


def _priorities(items: list[str], profiles: list[JobProfile]) -> list[JobProfile]:
    known = {p.job_id for p in profiles}
    changes: dict[str, int] = {}
    for item in items:
        job, sep, raw = item.rpartition("=")
        if not sep or not job:
            raise InvalidArgumentError(f"--priority {item!r}: use JOB=N, e.g. grpo-a=2")
        if job not in known:
            raise InvalidArgumentError(f"--priority {item!r}: no profile for job {job!r}")
        try:
            changes[job] = int(raw)
        except ValueError:
            raise InvalidArgumentError(f"--priority {item!r}: N must be a whole number") from None
        if not -100 <= changes[job] <= 100:
            raise InvalidArgumentError(f"--priority {item!r}: N must be within -100..100")
    return [
        p.model_copy(update={"priority": changes[p.job_id]}) if p.job_id in changes else p
        for p in profiles
    ]


def pick_overheads(profiles: list[JobProfile], path: Path | None) -> tuple[Overheads, str]:
    """The overheads the simulator uses, and where they came from."""
    from timeslice.plan.profile import Overheads, load_overheads

    if path is not None:
        return load_overheads(path), f"from {path}"
    measured = [
        p.source.overheads
        for p in profiles
        if p.source is not None and p.source.overheads is not None and p.source.overheads.samples
    ]
    if not measured:
        return Overheads(), "defaults: no profile carries measured ones"
    fields = ("request_s", "grant_s", "hop_s", "carry_s", "group_move_s")
    median = {f: statistics.median(getattr(o, f) for o in measured) for f in fields}
    samples = sum(o.samples for o in measured)
    return Overheads(**median, samples=samples), f"measured in {len(measured)} profile(s)"


def _plan(args: argparse.Namespace) -> int:
    from timeslice.plan.search import DEFAULT_MAX_SLOWDOWN, Planner

    profiles = _priorities(args.priority, load_all(args.items))
    layout = layout_from_args(args)
    # Before the search, which may run for minutes: its answer must have somewhere to go.
    for flag, path in (("--json", args.json), ("--html", args.html)):
        if path is not None:
            writable_folder(path.resolve().parent, flag)
    default, per_job = _limits(args.max_slowdown)
    overheads, origin = pick_overheads(profiles, args.overheads)
    _within("--move-gbps", args.move_gbps, 1e-3, 1e4)
    _within("--top", args.top, 1, 1000)
    _within("--time-limit", args.time_limit, 1e-3, 3600)
    try:
        planner = Planner(
            profiles,
            layout,
            overheads=overheads,
            move_bytes_per_s=args.move_gbps * 1e9,
            max_slowdown=default if default is not None else DEFAULT_MAX_SLOWDOWN,
            limits=per_job,
            seed=args.seed,
        )
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    result = planner.search(top=args.top, time_limit_s=args.time_limit)
    compared = compare_policies(planner, result) if args.compare_policies else None
    print(format_plan(result, origin, compared))
    if args.json is not None:
        args.json.write_text(json.dumps(plan_json(result, origin, compared), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.html is not None and result.assignments:
        from timeslice.plan.timeline import write_timeline

        outcome = planner.timeline(result.assignments[0])
        for path in write_timeline(outcome, result.assignments[0], args.html):
            print(f"wrote {path}")
    return 0 if result.assignments and not result.assignments[0].violations else 1


def compare_policies(planner: Planner, result: PlanResult) -> Compared:
    """The assignments found, predicted again under the other grant policy (same groups,
    same bounds, same epochs)."""
    from timeslice.plan.search import Planner

    ours = result.layout.policy.grant_policy
    other = next(p for p in GrantPolicy if p is not ours)
    rival = Planner(
        list(planner.profiles.values()),
        result.layout.with_policy(other),
        overheads=planner.overheads,
        move_bytes_per_s=planner.move_bps,
        limits=planner.limit,
        sim_epochs=planner.sim_epochs,
        final_epochs=planner.final_epochs,
    )
    return other.value, [
        rival.evaluate(
            {j.job_id: (j.sampler_group, j.trainer_group) for j in a.jobs}, planner.final_epochs
        )
        for a in result.assignments
    ]


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def describe_policy(layout: Layout) -> str:
    spec = layout.policy
    if spec.grant_policy is GrantPolicy.FIFO:
        return "fifo (a lease is kept into its holder's next phase only when nobody waits)"
    return (
        "phase_aware (a lease may be carried past waiters into its holder's next phase: "
        f"max_carries {spec.max_carries}, carry_limit_s {spec.carry_limit_s:g}, share_slack "
        f"{spec.share_slack:g})"
    )


def format_plan(result: PlanResult, origin: str, compared: Compared | None = None) -> str:
    ov = result.overheads
    layout = result.layout
    n_jobs = len(result.assignments[0].jobs) if result.assignments else 0
    if layout.disaggregated:
        where = (
            f"{len(layout.sampler_groups)} sampler + {len(layout.trainer_groups)} trainer groups"
        )
    else:
        where = f"{len(layout.groups)} groups"
    lines = [
        f"plan for {n_jobs} jobs on {where} (predicted by simulation)",
        f"protocol costs ({origin}): request {ov.request_s * 1000:.0f} ms, grant "
        f"{ov.grant_s * 1000:.0f} ms, hop {ov.hop_s * 1000:.0f} ms, carried lease "
        f"{ov.carry_s * 1000:.0f} ms",
        f"grant policy: {describe_policy(layout)}",
        f"searched {result.evaluated} assignments ({result.simulations} simulations) in "
        f"{result.seconds:.2f} s",
    ]
    lines += [f"note: {n}" for n in result.notes]
    for rank, a in enumerate(result.assignments, 1):
        lines.append("")
        verdict = "" if not a.violations else f"; BREAKS {len(a.violations)} LIMIT(S)"
        lines.append(
            f"#{rank}  {a.groups_used} group(s) used: {a.gpus_used} of {a.gpus_dedicated} GPUs "
            f"(saves {a.gpus_saved}), mean utilization {WHILE_JOBS_RAN} "
            f"{_pct(a.mean_utilization)}{verdict}"
        )
        rows = [("group", "role", f"utilization {WHILE_JOBS_RAN}", "demand bound", "jobs")]
        rows += [
            (g.group_id, g.role, _pct(g.utilization), _pct(g.demand_bound), ", ".join(g.jobs))
            for g in a.groups
            if g.jobs
        ]
        lines += _table(rows)
        rows = [("job", "mode", "slowdown", "limit", "alone", "shared", "groups")]
        for j in a.jobs:
            groups = (
                j.sampler_group
                if j.sampler_group == j.trainer_group
                else (f"{j.sampler_group} / {j.trainer_group}")
            )
            limit = "-" if j.max_slowdown == float("inf") else f"{j.max_slowdown:.2f}x"
            mark = "" if j.ok else "  over"
            rows.append(
                (
                    j.job_id,
                    _mode(j),
                    f"{j.slowdown:.2f}x{mark}",
                    limit,
                    f"{j.dedicated_s:.1f} s",
                    f"{j.completion_s:.1f} s",
                    groups,
                )
            )
        lines += _table(rows)
        if compared is not None:
            lines += _comparison(
                a, compared[1][rank - 1], layout.policy.grant_policy.value, compared[0]
            )
    scaled = [j for a in result.assignments[:1] for j in a.jobs if j.epochs_simulated < j.epochs]
    if scaled:
        lines.append("")
        shown = ", ".join(f"{j.job_id} {j.epochs_simulated} of {j.epochs}" for j in scaled[:4])
        lines.append(
            "long jobs are simulated on fewer epochs, the same fraction for all (times above "
            f"are for those): {shown}{' ...' if len(scaled) > 4 else ''}"
        )
    async_jobs = [j for a in result.assignments[:1] for j in a.jobs if j.mode == "async"]
    if async_jobs:
        lines.append("")
        lines.append(
            "async jobs (mode async): sampler and trainer loops simulated at once, the sampler "
            "at most max_staleness (k) weights versions ahead; alone = on a sampler group and a "
            "trainer group of their own"
        )
    if not result.assignments:
        lines.append("no assignment found")
    return "\n".join(lines)


def _mode(job: JobPlan) -> str:
    return f"async k={job.max_staleness}" if job.mode == "async" else "sync"


def _comparison(ours: Assignment, theirs: Assignment, our_name: str, their_name: str) -> list[str]:
    """The same assignment under both policies: utilization per group, slowdown per job."""
    rows = [("compared", our_name, their_name)]
    other_groups = {g.group_id: g for g in theirs.groups}
    rows += [
        (
            f"{g.group_id} utilization",
            _pct(g.utilization),
            _pct(other_groups[g.group_id].utilization),
        )
        for g in ours.groups
        if g.jobs
    ]
    other_jobs = {j.job_id: j for j in theirs.jobs}
    rows += [
        (f"{j.job_id} slowdown", f"{j.slowdown:.2f}x", f"{other_jobs[j.job_id].slowdown:.2f}x")
        for j in ours.jobs
    ]
    rows.append(
        (
            "limits broken",
            str(len(ours.violations)),
            str(len(theirs.violations)),
        )
    )
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]


def _assignment_json(a: Assignment) -> dict[str, object]:
    return {
        "groups_used": a.groups_used,
        "gpus_used": a.gpus_used,
        "gpus_saved": a.gpus_saved,
        "mean_utilization": a.mean_utilization,
        "violations": [j.job_id for j in a.violations],
        "groups": [
            {
                "group": g.group_id,
                "role": g.role,
                "jobs": g.jobs,
                "utilization": g.utilization,
                "utilization_window": WHILE_JOBS_RAN,
                "demand_bound": g.demand_bound,
                "switches": g.switches,
            }
            for g in a.groups
            if g.jobs
        ],
        "jobs": [
            {
                "job": j.job_id,
                "mode": j.mode,
                "max_staleness": j.max_staleness,
                "sampler_group": j.sampler_group,
                "trainer_group": j.trainer_group,
                "slowdown": j.slowdown,
                "max_slowdown": None if j.max_slowdown == float("inf") else j.max_slowdown,
                "dedicated_s": j.dedicated_s,
                "shared_s": j.completion_s,
                "epochs_simulated": j.epochs_simulated,
            }
            for j in a.jobs
        ],
    }


def plan_json(
    result: PlanResult, origin: str, compared: Compared | None = None
) -> dict[str, object]:
    spec = result.layout.policy
    answer: dict[str, object] = {
        "generated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "grant_policy": {
            "policy": spec.grant_policy.value,
            "max_carries": spec.max_carries,
            "carry_limit_s": spec.carry_limit_s,
            "share_slack": spec.share_slack,
        },
        "overheads": result.overheads.model_dump(),
        "overheads_from": origin,
        "searched": result.evaluated,
        "simulations": result.simulations,
        "seconds": round(result.seconds, 3),
        "notes": result.notes,
        "assignments": [_assignment_json(a) for a in result.assignments],
    }
    if compared is not None:
        # The same assignments, in the same order, predicted under the other policy.
        answer["compared"] = {
            "grant_policy": compared[0],
            "assignments": [_assignment_json(a) for a in compared[1]],
        }
    return answer
