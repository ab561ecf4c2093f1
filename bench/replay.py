"""Run a phase profile through real RL jobs and compare each group with its zero-switch-cost ideal.

Every job is a real ``RLJobWorkflow`` served by a real ``timeslice job worker`` process running
the ``simulated`` workload: phases hold their lease for the profile's times, every switch moves
a simulated state of the profile's size in its snapshot / restore times. Layouts:

- ``one-group``: every job samples and trains on one shared group;
- ``disaggregated``: a shared sampler pool and a shared trainer pool;
- ``shared-trainer``: each job samples on its own group, all train on one shared group;
- ``dedicated``: each job alone on its own group (the baseline sharing is measured against).

``--mode async`` runs ``AsyncRLJobWorkflow``s instead (sampler and trainer at once, bounded
staleness): layouts ``shared-trainer`` (each job samples on its own group, all train on one) and
``dedicated`` (each job on a sampler group and a trainer group of its own). Per-job phase times
(``--sample-s-per-job``, ``--train-s-per-job``) give jobs of different shapes; each job's
training steps per second (its steps / its first phase start to its last phase end) is printed,
and the trainer's utilization also over the span when every job was running (``both_running``);
the ideal is the simulator's async jobs with free switches, started when they did.

Figures (docs/report.md defines them the same way):

- **utilization while jobs ran** of a group = the time GPU phases ran on it (the phases' own
  monotonic-clock intervals) / wall time from its first phase start to its last phase end
  (``timeslice.protocol.utilization``; a group here lives only for the run, so its other
  window, since it was created, adds only the start-up before the first phase);
- **ideal** = the same profile through ``timeslice.plan.simulator`` with free switches, under
  the grant policy the groups ran (``--policy``), the jobs starting when they did here (same
  ramp-up and tail): what this policy reaches when switching costs nothing;
- **demand bound** = the jobs' summed GPU demand on the group, capped at 100%: for each job
  on it, its GPU seconds per epoch there (sample on its sampler group, train on its trainer
  group) / its epoch alone (sample + rewards + train); no policy beats it (a policy's loss
  shows as ideal < bound);
- **switch overhead** = for every hand-off between jobs on a group (the next job asked before
  the previous one released): previous release sent → next phase started, minus the state
  moves on that path (the next job's restore, and the previous job's eviction when the group's
  memory does not hold both states);
- **switch time** = for the same hand-offs: previous release sent → the next phase's state in
  (the wait for the grant: the protocol, and the eviction where the group waits for it; then
  the restores the phase's process reports for it, their own durations, waits for room
  included), against one direction's copy of one state (``--restore-s``: every phase here
  uses one state); ``gap_s`` is release → next phase start, which also holds any time the next
  job was still off the GPU (its rewards) when granted.

``--room-for-one`` declares group memory for one job's states (two states per job unless
``--shared-state``): a switch cannot keep both jobs' whole states on the device.

    .venv/bin/python bench/replay.py --layout one-group --jobs 2 --epochs 20 [--policy fifo]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from timeslice.protocol import utilization as one_definition  # noqa: E402
from timeslice.protocol.group import DEFAULT_GRANT_POLICY, GrantPolicy  # noqa: E402
from timeslice.protocol.rl_job import RECENT_EPOCH_RECORDS  # noqa: E402

from bench import boundary  # noqa: E402
from bench.handoff import cpu_model, percentile  # noqa: E402

WHILE_JOBS_RAN = one_definition.WHILE_JOBS_RAN

LAYOUTS = ("one-group", "disaggregated", "shared-trainer", "dedicated")
ASYNC_LAYOUTS = ("shared-trainer", "dedicated")
# GroupConfig.grant_policy's values, its default first.
POLICIES = tuple(sorted((p.value for p in GrantPolicy), key=lambda p: p != DEFAULT_GRANT_POLICY))


def groups_of(layout: str, job: int, stamp: str, mode: str = "sync") -> tuple[str, str]:
    """(sampler group, trainer group) of job number ``job``."""
    if mode == "async" and layout == "dedicated":  # an async job needs two groups
        return f"dedicated-{stamp}-{job}-s", f"dedicated-{stamp}-{job}-t"
    if layout == "one-group":
        return f"shared-{stamp}", f"shared-{stamp}"
    if layout == "disaggregated":
        return f"samplers-{stamp}", f"trainers-{stamp}"
    if layout == "shared-trainer":
        return f"sampler-{stamp}-{job}", f"trainer-{stamp}"
    return f"dedicated-{stamp}-{job}", f"dedicated-{stamp}-{job}"


def holds_by_group(results: list[Any]) -> dict[str, list[Any]]:
    by_group: dict[str, list[Any]] = {}
    for result in results:
        for record in result.records:
            for hold in record.holds:
                by_group.setdefault(hold.group_id, []).append((result.job_id, hold))
    for holds in by_group.values():
        holds.sort(key=lambda jh: jh[1].mono_start)
    return by_group


def utilization(
    holds: list[Any], start: float | None = None, end: float | None = None
) -> dict[str, float]:
    """The group's utilization while jobs ran (``timeslice.protocol.utilization``), from its
    GPU phases' own monotonic-clock intervals (one host: one clock); or over [start, end],
    each phase clipped to it."""
    spans = [(h.mono_start, h.mono_end) for _, h in holds]
    if start is None and end is None:
        measured = one_definition.while_jobs_ran(spans)
        phase_s, window_s = measured.phase_s, measured.window_s
    else:
        window = one_definition.active_window(spans)
        assert window is not None, "no GPU phase to measure"
        lo = window[0] if start is None else start
        hi = window[1] if end is None else end
        phase_s, window_s = one_definition.phase_time(spans, (lo, hi)), hi - lo
    return {
        "busy_s": phase_s,
        "wall_s": window_s,
        "utilization": phase_s / window_s if window_s > 0 else 0.0,
    }


def steps_per_s(results: list[Any]) -> dict[str, float]:
    """Each job's training steps per second: its steps over its first phase start to its last
    phase end (the records a result keeps: run at most RECENT_EPOCH_RECORDS steps)."""
    rates = {}
    for r in results:
        holds = [h for rec in r.records for h in rec.holds]
        span = max(h.mono_end for h in holds) - min(h.mono_start for h in holds)
        rates[r.job_id] = len(r.records) / span
    return rates


def both_running(results: list[Any]) -> tuple[float, float]:
    """The span when every job was running: the last first phase start, the first last end."""
    spans = [
        (min(h.mono_start for rec in r.records for h in rec.holds),
         max(h.mono_end for rec in r.records for h in rec.holds))
        for r in results
    ]  # fmt: skip
    return max(s for s, _ in spans), min(e for _, e in spans)


def async_demand_bound(configs: list[dict[str, Any]]) -> dict[str, float]:
    """Per group: each async job's GPU time per step there x its steps per second alone (its
    slower loop: sample + rewards, or train), summed, capped at 1."""
    demand: dict[str, float] = {}
    for c in configs:
        o = c["workload_options"]
        period = max(o["sample_s"] + o["reward_s"], o["train_s"])
        for group, seconds in (
            (c["sampler_group"], o["sample_s"]),
            (c["trainer_group"], o["train_s"]),
        ):
            demand[group] = demand.get(group, 0.0) + seconds / period
    return {g: min(1.0, d) for g, d in demand.items()}


def switches_per_job_epoch(holds: list[Any], jobs: int) -> float:
    """Changes of holder between consecutive GPU phases on a group, per job and epoch (the
    records each result keeps)."""
    switches = sum(a != b for (a, _), (b, _) in itertools.pairwise(holds))
    epochs = len({(job, h.epoch) for job, h in holds})
    return switches / epochs if epochs else 0.0


def switch_overheads(holds: list[Any], both_fit: bool) -> list[float]:
    """Seconds from one job's release to the next job's phase start, less the state moves."""
    overheads = []
    for (prev_job, prev), (next_job, nxt) in itertools.pairwise(holds):
        if prev_job == next_job or prev.released_mono is None or nxt.asked_mono is None:
            continue
        if nxt.asked_mono >= prev.released_mono:
            continue  # nobody was waiting: not a hand-off
        moves = sum(r.seconds for r in nxt.restored)
        if not both_fit:
            moves += sum(r.seconds for r in prev.evicted)
        overheads.append(nxt.mono_start - prev.released_mono - moves)
    return overheads


def switch_times(holds: list[Any]) -> list[dict[str, float]]:
    """Per hand-off between jobs (the next job asked before the previous one released): the
    previous release sent → the next phase started, and its two parts."""
    times = []
    for (prev_job, prev), (next_job, nxt) in itertools.pairwise(holds):
        if prev_job == next_job or prev.released_mono is None or nxt.asked_mono is None:
            continue
        if nxt.asked_mono >= prev.released_mono or nxt.granted_mono is None:
            continue
        grant_wait = nxt.granted_mono - prev.released_mono
        restore = sum(r.seconds for r in nxt.restored)
        times.append(
            {
                "switch_s": grant_wait + restore,
                "grant_wait_s": grant_wait,
                "restore_s": restore,
                "gap_s": nxt.mono_start - prev.released_mono,
                "bytes_in": sum(r.bytes for r in nxt.restored),
            }
        )
    return times


def switch_summary(times: list[dict[str, float]], one_direction_s: float) -> dict[str, Any] | None:
    """p50 / p99 of each part of the switches, and the whole against one direction's copy."""
    if not times:
        return None
    summary: dict[str, Any] = {"switches": len(times), "one_direction_s": one_direction_s}
    for part in ("switch_s", "grant_wait_s", "restore_s", "gap_s"):
        values = [t[part] for t in times]
        summary[part] = {
            "p50": round(statistics.median(values), 4),
            "p99": round(percentile(values, 0.99), 4),
        }
    summary["bytes_in_p50"] = statistics.median(t["bytes_in"] for t in times)
    if one_direction_s > 0:
        summary["switch_over_one_direction_p50"] = round(
            summary["switch_s"]["p50"] / one_direction_s, 3
        )
        summary["restore_over_one_direction_p50"] = round(
            summary["restore_s"]["p50"] / one_direction_s, 3
        )
    return summary


def demand_bound(configs: list[dict[str, Any]], profile: dict[str, float]) -> dict[str, float]:
    """Per group: the jobs' GPU seconds per epoch there over their epoch alone, summed, capped
    at 1 (every job here runs ``profile``)."""
    shares: dict[str, list[float]] = {}
    for c in configs:
        profile = c.get("workload_options", profile)  # a job's own times (--*-per-job)
        epoch_s = profile["sample_s"] + profile["reward_s"] + profile["train_s"]
        gpu = {c["sampler_group"]: 0.0, c["trainer_group"]: 0.0}
        gpu[c["sampler_group"]] += profile["sample_s"]
        gpu[c["trainer_group"]] += profile["train_s"]
        for group, seconds in gpu.items():
            shares.setdefault(group, []).append(seconds / epoch_s if epoch_s > 0 else 1.0)
    return {g: one_definition.demand_bound(s) for g, s in shares.items()}


def ideal(
    results: list[Any],
    configs: list[dict[str, Any]],
    profile: dict[str, float],
    policy: str = POLICIES[0],
) -> Any:
    """The same jobs, started when they did, with free switches under ``policy``."""
    from timeslice.plan.profile import Overheads
    from timeslice.plan.simulator import GroupSpec, Placement, rl_profile, simulate
    from timeslice.protocol.group import GrantPolicy

    firsts = {r.job_id: min(h.mono_start for rec in r.records for h in rec.holds) for r in results}
    origin = min(firsts.values())
    groups = {g for c in configs for g in (c["sampler_group"], c["trainer_group"])}
    asynchronous = {c["job_id"]: c.get("mode") == "async" for c in configs}
    return simulate(
        [
            Placement(
                rl_profile(
                    c["job_id"],
                    sample_s=c["workload_options"]["sample_s"],
                    rewards_s=c["workload_options"]["reward_s"],
                    train_s=c["workload_options"]["train_s"],
                    epochs=c["epochs"],
                ),
                sampler_group=c["sampler_group"],
                trainer_group=c["trainer_group"],
                start_s=firsts[c["job_id"]] - origin,
                max_staleness=c["max_staleness"] if asynchronous[c["job_id"]] else None,
                sync_every=c.get("sync_every", 1),
            )
            for c in configs
        ],
        groups={g: GroupSpec(grant_policy=GrantPolicy(policy)) for g in groups},
        overheads=Overheads.zero(),
    )


async def run_jobs(
    address: str,
    configs: list[dict[str, Any]],
    memory: dict[str, int | None],
    policy: str = POLICIES[0],
    finished: dict[str, float] | None = None,
) -> list[Any]:
    """Start the groups and the jobs, and return the jobs' results; ``finished``, if given,
    gets each job's result time (``time.monotonic()``) by job id."""
    from timeslice.activities.group_requests import start_group
    from timeslice.jobs import parse_any_job_config, start_any_rl_job
    from timeslice.protocol.group import GrantPolicy, GroupConfig
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    for group, memory_bytes in memory.items():
        # Declaring the device memory lets a switch evict and restore at the same time.
        await start_group(
            client,
            GroupConfig(
                group_id=group, memory_bytes=memory_bytes, grant_policy=GrantPolicy(policy)
            ),
        )
    handles = [await start_any_rl_job(client, parse_any_job_config(c)) for c in configs]

    async def result_of(handle: Any) -> Any:
        result = await handle.result()
        if finished is not None:
            finished[result.job_id] = time.monotonic()
        return result

    return list(await asyncio.gather(*(result_of(h) for h in handles)))


async def group_stats(address: str, group_ids: list[str]) -> dict[str, Any]:
    """Each group's counters (``GroupStats``: switches that moved state, carried leases,
    staged restores, ...) as its status query gives them."""
    from timeslice.protocol.group import GroupQuery, GroupStatus, group_workflow_id
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    stats = {}
    for group in group_ids:
        handle = client.get_workflow_handle(group_workflow_id(group))
        stats[group] = (await handle.query(GroupQuery.STATUS, result_type=GroupStatus)).stats
    return stats


# The group counters bench/replay.py reports (GroupStats' names).
GROUP_COUNTERS = (
    "switches",
    "overlapped_switches",
    "streamed_switches",
    "carried",
    "staged_restores",
    "staged_unused",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=LAYOUTS, default="one-group")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--reward-s", type=float, default=1.5)
    p.add_argument("--train-s", type=float, default=0.5)
    p.add_argument("--state-bytes", type=int, default=4 * 2**30, help="per state")
    p.add_argument("--snapshot-s", type=float, default=0.1)
    p.add_argument("--restore-s", type=float, help="default: --snapshot-s")
    p.add_argument("--shared-state", action="store_true", help="one state for both groups")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="do not declare group memory for two jobs' states (evict, then restore)",
    )
    p.add_argument(
        "--memory-bytes",
        type=int,
        help="the memory every group declares (default: room for two jobs' states there)",
    )
    p.add_argument(
        "--room-for-one",
        action="store_true",
        help="declare group memory for one job's states, not two",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=POLICIES[0],
        help=f"the groups' grant_policy, and the ideal's (default {POLICIES[0]}, GroupConfig's)",
    )
    p.add_argument("--mode", choices=("sync", "async"), default="sync", help="the jobs' mode")
    p.add_argument("--max-staleness", type=int, default=8, help="async: the staleness bound")
    p.add_argument("--sync-every", type=int, default=1, help="async: steps between syncs")
    p.add_argument("--sync-s", type=float, default=0.0, help="async: one weight publication")
    p.add_argument("--sample-s-per-job", type=_floats, help="per-job sample times, e.g. 2.0,3.0")
    p.add_argument("--train-s-per-job", type=_floats, help="per-job train times, e.g. 1.0,1.5")
    p.add_argument("--epochs-per-job", type=_ints, help="per-job epochs (async: steps), e.g. 30,20")
    p.add_argument(
        "--sandboxed",
        action="store_true",
        help="run the control worker's workflows in Temporal's sandbox (timeslice worker "
        "--sandboxed), as before 2026-12-03",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--records", type=Path, help="write every job's result here (JSON)")
    p.add_argument("--histories", type=Path, help="also write every workflow history here")
    args = p.parse_args()
    if args.jobs < 1 or args.epochs < 1:
        raise SystemExit("--jobs and --epochs must be >= 1")
    if args.mode == "async" and args.layout not in ASYNC_LAYOUTS:
        raise SystemExit(f"--mode async runs the layouts {', '.join(ASYNC_LAYOUTS)}")
    for flag in ("sample_s_per_job", "train_s_per_job", "epochs_per_job"):
        given = getattr(args, flag)
        if given is not None and len(given) != args.jobs:
            raise SystemExit(f"--{flag.replace('_', '-')} needs {args.jobs} values (--jobs)")

    from timeslice.cli.stack import JobWorker, Stack

    restore_s = args.snapshot_s if args.restore_s is None else args.restore_s
    options: dict[str, Any] = {
        "sample_s": args.sample_s,
        "reward_s": args.reward_s,
        "train_s": args.train_s,
        "state_bytes": args.state_bytes,
        "snapshot_s": args.snapshot_s,
        "restore_s": restore_s,
        "shared_state": args.shared_state,
    }
    if args.mode == "async":
        options = {**options, "sync_s": args.sync_s, "sync_bytes": args.state_bytes}
        options.pop("shared_state")
    stamp = str(int(time.time()))
    configs = []
    for i in range(args.jobs):
        sampler, trainer = groups_of(args.layout, i, stamp, args.mode)
        job_options = dict(options)
        if args.sample_s_per_job:
            job_options["sample_s"] = args.sample_s_per_job[i]
        if args.train_s_per_job:
            job_options["train_s"] = args.train_s_per_job[i]
        epochs = args.epochs_per_job[i] if args.epochs_per_job else args.epochs
        config: dict[str, Any] = {
            "job_id": f"{args.layout}-{stamp}-{i}",
            "workload": "simulated",
            "workload_options": job_options,
            "sampler_group": sampler,
            "trainer_group": trainer,
            "epochs": epochs,
            "checkpoint_every": epochs,
        }
        if args.mode == "async":
            config.update(
                mode="async", max_staleness=args.max_staleness, sync_every=args.sync_every
            )
        configs.append(config)
    # What one job keeps on a group's device: one state, or two where it samples and trains.
    footprint: dict[str, int] = {}
    for c in configs:
        separate = c["sampler_group"] != c["trainer_group"]
        states = 1 if args.shared_state or separate else 2
        footprint[c["sampler_group"]] = states * args.state_bytes
        footprint[c["trainer_group"]] = states * args.state_bytes
    jobs_room = 1 if args.room_for_one else 2
    memory = {
        g: None if args.no_overlap else args.memory_bytes or jobs_room * b
        for g, b in footprint.items()
    }

    with tempfile.TemporaryDirectory() as tmp_dir, Stack(Path(tmp_dir)).start() as stack:
        stack.control_worker(sandboxed=args.sandboxed)
        stack.job_workers(*(JobWorker((c["job_id"],)) for c in configs))
        print(
            f"{args.layout} ({args.mode}): {args.jobs} jobs x "
            f"{args.epochs_per_job or args.epochs} epochs ...",
            flush=True,
        )
        started = time.monotonic()
        finished: dict[str, float] = {}
        results = asyncio.run(run_jobs(stack.address, configs, memory, args.policy, finished))
        elapsed = time.monotonic() - started
        job_histories, group_histories = asyncio.run(
            boundary.fetch(stack.address, stamp, args.histories)
        )
        counters = asyncio.run(group_stats(stack.address, list(memory)))

    by_group = holds_by_group(results)
    boundaries = boundary.summary(boundary.boundaries(job_histories, group_histories))
    if args.mode == "async":
        report_async(args, configs, results, by_group, memory, elapsed)
        return
    simulated = ideal(results, configs, options, args.policy)
    bounds = demand_bound(configs, options)
    overheads = [
        o
        for group, holds in by_group.items()
        for o in switch_overheads(holds, both_fit=memory[group] is not None)
    ]
    switches = switch_summary(
        [t for holds in by_group.values() for t in switch_times(holds)], restore_s
    )
    groups = {}
    for group, holds in sorted(by_group.items()):
        measured = utilization(holds)
        best = simulated.groups[group].utilization
        groups[group] = {
            "utilization": round(measured["utilization"], 4),
            "ideal": round(best, 4),
            "of_ideal": round(measured["utilization"] / best, 4),
            "demand_bound": round(bounds[group], 4),
            "of_demand_bound": round(measured["utilization"] / bounds[group], 4),
            "phases": len(holds),
            "switches_per_job_epoch": round(switches_per_job_epoch(holds, args.jobs), 3),
            "group_stats": {k: getattr(counters[group], k) for k in GROUP_COUNTERS},
        }
        print(
            f"{group}: utilization {measured['utilization']:.1%} of {measured['wall_s']:.1f} s "
            f"{WHILE_JOBS_RAN}; ideal {best:.1%} (free "
            f"switches, {args.policy}); demand bound {bounds[group]:.1%} (the jobs' GPU "
            "seconds per epoch here / their epoch alone, summed, capped at 100%)",
            flush=True,
        )
        print(
            "  the group counted: "
            + ", ".join(
                f"{k.replace('_', ' ')} {v}" for k, v in groups[group]["group_stats"].items()
            ),
            flush=True,
        )
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "layout": args.layout,
        "grant_policy": args.policy,
        "utilization_window": WHILE_JOBS_RAN,
        "ideal_is": f"the simulator with free switches under {args.policy}",
        "demand_bound_is": "sum over the group's jobs of GPU seconds per epoch on it / epoch "
        "alone (sample + rewards + train), capped at 100%",
        "profile": {**options, "jobs": args.jobs, "epochs": args.epochs},
        "group_memory_declared": not args.no_overlap,
        "group_memory_bytes": memory,
        "groups": groups,
        "switch_time": switches,
        "switches": len(overheads),
        "switch_overhead_ms": None
        if not overheads
        else {
            "p50": round(statistics.median(overheads) * 1000, 1),
            "p99": round(percentile(overheads, 0.99) * 1000, 1),
            "max": round(max(overheads) * 1000, 1),
        },
        "job_completion_is": "from the bench starting the jobs (their groups, the jobs' "
        "workflows and preparation included) to each job's result, on the bench's clock",
        "job_completion_s": {job: round(at - started, 1) for job, at in sorted(finished.items())},
        "job_phase_span_is": "the job's first kept phase start to its last phase end (its "
        "process's clock); only the last RECENT_EPOCH_RECORDS epochs' records are kept, and "
        "every figure read from the records (utilization, switches) covers those",
        "job_phase_span_s": {r.job_id: round(r_s, 1) for r, r_s in _completions(results)},
        "records_cover_epochs": {r.job_id: len(r.records) for r in results},
        "run_s": round(elapsed, 1),
        "rewinds": sum(r.rewinds for r in results),
        "phase_boundaries": boundaries,
    }
    print(json.dumps(result, indent=2))
    print(boundary.table(boundaries), flush=True)
    shed = {r.job_id: r.epochs_done - len(r.records) for r in results if r.records}
    if any(shed.values()):
        print(
            f"note: the jobs kept the records of their last {RECENT_EPOCH_RECORDS} epochs only; "
            "utilization and switches are over those epochs (the boundaries, read from the "
            "histories, over all of them)",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.records:
        args.records.write_text(json.dumps([r.model_dump(mode="json") for r in results]))


def report_async(
    args: argparse.Namespace,
    configs: list[dict[str, Any]],
    results: list[Any],
    by_group: dict[str, list[Any]],
    memory: dict[str, int | None],
    elapsed: float,
) -> None:
    bounds = async_demand_bound(configs)
    simulated = ideal(results, configs, {}, args.policy)
    start, end = both_running(results)
    overheads = [
        o
        for group, holds in by_group.items()
        for o in switch_overheads(holds, both_fit=memory[group] is not None)
    ]
    groups = {}
    for group, holds in sorted(by_group.items()):
        measured = utilization(holds)
        overlap = utilization(holds, start, end) if end > start else None
        best = simulated.groups[group].utilization
        groups[group] = {
            "utilization": round(measured["utilization"], 4),
            "both_running": None if overlap is None else round(overlap["utilization"], 4),
            "ideal": round(best, 4),
            "of_ideal": round(measured["utilization"] / best, 4),
            "demand_bound": round(bounds[group], 4),
            "phases": len(holds),
        }
        print(
            f"{group}: utilization {measured['utilization']:.1%}"
            + ("" if overlap is None else f" ({overlap['utilization']:.1%} while every job ran)")
            + f"; ideal {best:.1%} (free switches); demand bound {bounds[group]:.1%}",
            flush=True,
        )
    rates = steps_per_s(results)
    for r in results:
        staleness = [rec.staleness for rec in r.records]
        best_s = simulated.jobs[r.job_id].completion_s
        print(
            f"{r.job_id}: {rates[r.job_id]:.3f} steps/s (ideal {len(r.records) / best_s:.3f}); "
            f"staleness max {max(staleness)}, mean "
            f"{statistics.mean(staleness):.2f}; dropped batches {r.dropped_batches}",
            flush=True,
        )
    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "layout": args.layout,
        "mode": "async",
        "grant_policy": args.policy,
        "ideal_is": "the simulator's async jobs with free switches, started when they did",
        "max_staleness": args.max_staleness,
        "sync_every": args.sync_every,
        "profiles": {c["job_id"]: {**c["workload_options"], "steps": c["epochs"]} for c in configs},
        "group_memory_declared": not args.no_overlap,
        "groups": groups,
        "steps_per_s": {job: round(rate, 4) for job, rate in rates.items()},
        "ideal_steps_per_s": {
            r.job_id: round(len(r.records) / simulated.jobs[r.job_id].completion_s, 4)
            for r in results
        },
        "staleness_max": {r.job_id: max(rec.staleness for rec in r.records) for r in results},
        "dropped_batches": {r.job_id: r.dropped_batches for r in results},
        "switches": len(overheads),
        "switch_overhead_ms": None
        if not overheads
        else {
            "p50": round(statistics.median(overheads) * 1000, 1),
            "p99": round(percentile(overheads, 0.99) * 1000, 1),
        },
        "run_s": round(elapsed, 1),
        "rewinds": sum(r.rewinds for r in results),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.records:
        args.records.write_text(json.dumps([r.model_dump(mode="json") for r in results]))


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use numbers separated by commas") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use integers separated by commas") from None


def _completions(results: list[Any]) -> list[tuple[Any, float]]:
    """Each job's first phase start to its last phase end (its own clock)."""
    spans = []
    for r in results:
        holds = [h for rec in r.records for h in rec.holds]
        spans.append((r, max(h.mono_end for h in holds) - min(h.mono_start for h in holds)))
    return spans


if __name__ == "__main__":
    main()
