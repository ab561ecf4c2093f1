"""Run a phase profile through real RL jobs and compare each group with its zero-switch-cost ideal.

Every job is a real ``RLJobWorkflow`` served by a real ``timeslice job worker`` process running
the ``simulated`` workload: phases hold their lease for the profile's times, every switch moves
a simulated state of the profile's size in its snapshot / restore times. Layouts:

- ``one-group``: every job samples and trains on one shared group;
- ``disaggregated``: a shared sampler pool and a shared trainer pool;
- ``shared-trainer``: each job samples on its own group, all train on one shared group;
- ``dedicated``: each job alone on its own group (the baseline sharing is measured against).

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
  memory does not hold both states).

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

from bench.handoff import cpu_model, percentile  # noqa: E402

WHILE_JOBS_RAN = one_definition.WHILE_JOBS_RAN

LAYOUTS = ("one-group", "disaggregated", "shared-trainer", "dedicated")
POLICIES = ("phase_aware", "fifo")  # GroupConfig.grant_policy; the first is its default


def groups_of(layout: str, job: int, stamp: str) -> tuple[str, str]:
    """(sampler group, trainer group) of job number ``job``."""
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


def utilization(holds: list[Any]) -> dict[str, float]:
    """The group's utilization while jobs ran (``timeslice.protocol.utilization``), from its
    GPU phases' own monotonic-clock intervals (one host: one clock)."""
    measured = one_definition.while_jobs_ran((h.mono_start, h.mono_end) for _, h in holds)
    return {
        "busy_s": measured.phase_s,
        "wall_s": measured.window_s,
        "utilization": measured.share,
    }


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


def demand_bound(configs: list[dict[str, Any]], profile: dict[str, float]) -> dict[str, float]:
    """Per group: the jobs' GPU seconds per epoch there over their epoch alone, summed, capped
    at 1 (every job here runs ``profile``)."""
    epoch_s = profile["sample_s"] + profile["reward_s"] + profile["train_s"]
    shares: dict[str, list[float]] = {}
    for c in configs:
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
    return simulate(
        [
            Placement(
                rl_profile(
                    c["job_id"],
                    sample_s=profile["sample_s"],
                    rewards_s=profile["reward_s"],
                    train_s=profile["train_s"],
                    epochs=c["epochs"],
                ),
                sampler_group=c["sampler_group"],
                trainer_group=c["trainer_group"],
                start_s=firsts[c["job_id"]] - origin,
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
) -> list[Any]:
    from timeslice.activities.group_requests import start_group
    from timeslice.jobs import parse_job_config, start_rl_job
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
    handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]
    return list(await asyncio.gather(*(h.result() for h in handles)))


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
        "--policy",
        choices=POLICIES,
        default=POLICIES[0],
        help="the groups' grant_policy, and the ideal's (default phase_aware, GroupConfig's)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--records", type=Path, help="write every job's result here (JSON)")
    args = p.parse_args()
    if args.jobs < 1 or args.epochs < 1:
        raise SystemExit("--jobs and --epochs must be >= 1")

    from timeslice.cli.server import EmbeddedServer, free_port
    from timeslice.cli.services import start_service, stop_service

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
    stamp = str(int(time.time()))
    configs = []
    for i in range(args.jobs):
        sampler, trainer = groups_of(args.layout, i, stamp)
        configs.append(
            {
                "job_id": f"{args.layout}-{stamp}-{i}",
                "workload": "simulated",
                "workload_options": options,
                "sampler_group": sampler,
                "trainer_group": trainer,
                "epochs": args.epochs,
                "checkpoint_every": args.epochs,
            }
        )
    # What one job keeps on a group's device: one state, or two where it samples and trains.
    footprint: dict[str, int] = {}
    for c in configs:
        states = 1 if args.shared_state or c["sampler_group"] != c["trainer_group"] else 2
        footprint[c["sampler_group"]] = states * args.state_bytes
        footprint[c["trainer_group"]] = states * args.state_bytes
    memory = {g: None if args.no_overlap else 2 * b for g, b in footprint.items()}

    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        server = EmbeddedServer(port=free_port(), ui_port=None, db=tmp / "t.db").start()
        procs = [
            start_service(
                ["worker", "--address", server.address], "control worker", tmp / "worker.log"
            )
        ]
        try:
            for c in configs:
                procs.append(
                    start_service(
                        ["job", "worker", "--address", server.address, "--job-id", c["job_id"],
                         "--workload", "simulated", "--checkpoint-dir", str(tmp / "ckpt")],
                        f"job {c['job_id']} rank 0",
                        tmp / f"{c['job_id']}.log",
                    )
                )  # fmt: skip
            print(f"{args.layout}: {args.jobs} jobs x {args.epochs} epochs ...", flush=True)
            started = time.monotonic()
            results = asyncio.run(run_jobs(server.address, configs, memory, args.policy))
            elapsed = time.monotonic() - started
        finally:
            for proc in reversed(procs):
                stop_service(proc)
            server.stop()

    by_group = holds_by_group(results)
    simulated = ideal(results, configs, options, args.policy)
    bounds = demand_bound(configs, options)
    overheads = [
        o
        for group, holds in by_group.items()
        for o in switch_overheads(holds, both_fit=memory[group] is not None)
    ]
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
        }
        print(
            f"{group}: utilization {measured['utilization']:.1%} of {measured['wall_s']:.1f} s "
            f"{WHILE_JOBS_RAN}; ideal {best:.1%} (free "
            f"switches, {args.policy}); demand bound {bounds[group]:.1%} (the jobs' GPU "
            "seconds per epoch here / their epoch alone, summed, capped at 100%)",
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
        "groups": groups,
        "switches": len(overheads),
        "switch_overhead_ms": None
        if not overheads
        else {
            "p50": round(statistics.median(overheads) * 1000, 1),
            "p99": round(percentile(overheads, 0.99) * 1000, 1),
            "max": round(max(overheads) * 1000, 1),
        },
        "job_completion_s": {r.job_id: round(r_s, 1) for r, r_s in _completions(results)},
        "run_s": round(elapsed, 1),
        "rewinds": sum(r.rewinds for r in results),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.records:
        args.records.write_text(json.dumps([r.model_dump(mode="json") for r in results]))


def _completions(results: list[Any]) -> list[tuple[Any, float]]:
    """Each job's first phase start to its last phase end (its own clock)."""
    spans = []
    for r in results:
        holds = [h for rec in r.records for h in rec.holds]
        spans.append((r, max(h.mono_end for h in holds) - min(h.mono_start for h in holds)))
    return spans


if __name__ == "__main__":
    main()
