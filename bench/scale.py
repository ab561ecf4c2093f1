"""Many RL jobs over many GPU groups on one control plane: what the control plane costs.

    .venv/bin/python bench/scale.py --jobs 40 --groups 10 --epochs 4 [--json FILE]

One embedded Temporal server, one control worker (``timeslice worker``) and one
``timeslice job worker`` process per job (one rank each), ``--jobs`` real ``RLJobWorkflow``s
running the ``simulated`` workload, job ``i`` sampling and training on group ``i % --groups``
(the profile of issue 24 by default: 0.5 s sample, 1.5 s rewards, 0.5 s train, 1 GiB states
moved in 0.02 s, group memory declared for two jobs' states). Every process is started and
serving before the first job starts, so the figures are the control plane's, not process
start-up's. It prints:

- per group: **utilization** (GPU phases' own monotonic intervals / first phase start to last
  phase end) against the **ideal** (``timeslice.plan.simulator`` with free switches, the jobs
  starting when they did: bench/replay.py's definitions);
- **lease wait** p50 / p99 / max: each GPU phase's ``waited_s`` (asking for the lease to its
  grant, a lease carried from the previous phase counting 0);
- **GPU phases per second**: GPU phases (sample, train) of all jobs / first phase start to last
  phase end;
- per lease (the groups' histories) and per epoch (the jobs' histories): history events,
  workflow tasks, timers started, search-attribute upserts and billable actions, read from every
  run of every workflow (bench/history_cost.py says what counts as an action);
- **CPU seconds per GPU phase** of the control worker and of the server: their processes' user +
  system CPU time from the first job's start to the last job's end, over the GPU phases run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from bench import boundary  # noqa: E402
from bench.handoff import cpu_model, percentile  # noqa: E402
from bench.history_cost import (  # noqa: E402
    HistoryCost,
    group_cost,
    rl_job_cost,
    steady_epochs,
    update_names,
)
from bench.replay import holds_by_group, ideal, utilization  # noqa: E402

GPU_PHASES = ("sample", "train")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the command: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
    ticks = sum(int(f) for f in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its live descendants (the dev server runs as a child)."""
    total = cpu_seconds(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += tree_cpu_seconds(int(child))
    return total


def overlaps(holds: list[Any]) -> int:
    """GPU phases on one group that began before the one before them ended (same host clock)."""
    count, end = 0, float("-inf")
    for _, hold in holds:
        count += hold.mono_start < end
        end = max(end, hold.mono_end)
    return count


def every_epoch_once(results: list[Any], epochs: int) -> bool:
    return all(
        r.epochs_done == epochs and [rec.epoch for rec in r.records] == list(range(epochs))
        for r in results
    )


def job_configs(jobs: int, groups: int, epochs: int, options: dict[str, Any], stamp: str):
    configs = []
    for i in range(jobs):
        group = f"scale-{stamp}-g{i % groups}"
        configs.append(
            {
                "job_id": f"scale-{stamp}-j{i}",
                "workload": "simulated",
                "workload_options": options,
                "sampler_group": group,
                "trainer_group": group,
                "epochs": epochs,
                "checkpoint_every": epochs,
            }
        )
    return configs


PROGRESS_EVERY_S = 15.0


async def start_groups(address: str, groups: list[str], memory_bytes: int) -> None:
    from timeslice.activities.group_requests import start_group
    from timeslice.protocol.group import GroupConfig
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    for group in groups:
        await start_group(client, GroupConfig(group_id=group, memory_bytes=memory_bytes))


async def run_jobs(address: str, configs: list[dict[str, Any]]) -> list[Any]:
    from timeslice.jobs import parse_job_config, start_rl_job
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]
    began = time.monotonic()
    results = [asyncio.ensure_future(h.result()) for h in handles]
    pending = set(results)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=PROGRESS_EVERY_S)
        print(
            f"  {time.monotonic() - began:5.0f} s: {len(results) - len(pending)} of "
            f"{len(results)} jobs done",
            flush=True,
        )
    return [r.result() for r in results]


async def history_costs(address: str, stamp: str, keep: Path | None) -> dict[str, Any]:
    """Summed over every run (continue-as-new included) of this bench's groups and jobs."""
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))

    async def histories(query: str) -> list[Any]:
        found = []
        async for wf in client.list_workflows(query):
            if stamp in wf.id:
                history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
                found.append(history)
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"{wf.id}.{wf.run_id}.json").write_text(history.to_json())
        return found

    groups = await histories("WorkflowType = 'GpuGroupWorkflow'")
    jobs = await histories("WorkflowType = 'RLJobWorkflow'")
    prepared = steady_epochs(jobs)
    return {
        "phase_boundaries": boundary.summary(boundary.boundaries(jobs, groups)),
        "group": group_cost(groups),
        "job": rl_job_cost(jobs),
        "group_updates": dict(update_names(groups)),
        "prepared_epoch_events": statistics.mean(sum(e.values()) for e in prepared)
        if prepared
        else None,
        "workflow_task_timeouts": sum(
            group_cost([h]).by_type.get("workflow_task_timed_out", 0) for h in groups + jobs
        ),
    }


def cost_figures(cost: HistoryCost, unit: str) -> dict[str, Any]:
    return {
        unit: cost.units,
        f"events_per_{unit}": round(cost.events_per_unit, 2),
        f"workflow_tasks_per_{unit}": round(cost.tasks_per_unit, 2),
        f"timers_started_per_{unit}": round(cost.timers_per_unit, 2),
        f"upserts_per_{unit}": round(cost.upserts_per_unit, 2),
        f"actions_per_{unit}": round(cost.actions_per_unit, 2),
        "events_by_type": cost.by_type,
    }


def offered_phases_per_s(args: argparse.Namespace) -> float:
    """GPU phases per second the jobs would run if nothing waited: each job's two GPU phases
    per epoch over its epoch alone."""
    return args.jobs * 2 / (args.sample_s + args.reward_s + args.train_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--reward-s", type=float, default=1.5)
    p.add_argument("--train-s", type=float, default=0.5)
    p.add_argument("--state-bytes", type=int, default=2**30, help="per state")
    p.add_argument("--snapshot-s", type=float, default=0.02)
    p.add_argument(
        "--jobs-per-process",
        type=int,
        default=1,
        help="jobs one `timeslice job worker` process serves (--job-id repeated; default 1)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--histories", type=Path, help="also write every workflow history here")
    p.add_argument(
        "--sticky-timeout",
        type=float,
        help="the control worker's --sticky-timeout (default: timeslice worker's)",
    )
    p.add_argument(
        "--sandboxed",
        action="store_true",
        help="run the control worker's workflows in Temporal's sandbox (timeslice worker "
        "--sandboxed), as before 2026-12-03",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="keep the server's database and every process's log here (default: a temporary "
        "directory, removed)",
    )
    args = p.parse_args()
    if min(args.jobs, args.groups, args.epochs, args.jobs_per_process) < 1:
        raise SystemExit("--jobs, --groups, --epochs and --jobs-per-process must be >= 1")
    if args.groups > args.jobs:
        raise SystemExit("--groups must be <= --jobs (each group needs a job)")

    from timeslice.cli.stack import JobWorker, Stack

    options: dict[str, Any] = {
        "sample_s": args.sample_s,
        "reward_s": args.reward_s,
        "train_s": args.train_s,
        "state_bytes": args.state_bytes,
        "snapshot_s": args.snapshot_s,
        "restore_s": args.snapshot_s,
    }
    stamp = str(int(time.time()))
    configs = job_configs(args.jobs, args.groups, args.epochs, options, stamp)
    groups = sorted({c["sampler_group"] for c in configs})
    # A job samples and trains on its group: two states there; memory for two jobs' states,
    # so a switch evicts beside the next holder's work (bench/replay.py's default).
    memory_bytes = 2 * 2 * args.state_bytes

    sticky = [] if args.sticky_timeout is None else ["--sticky-timeout", str(args.sticky_timeout)]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = (
        contextlib.nullcontext(str(args.workdir))
        if args.workdir is not None
        else tempfile.TemporaryDirectory()
    )
    with workdir as tmp_dir, Stack(Path(tmp_dir)).start() as stack:
        worker = stack.control_worker(*sticky, sandboxed=args.sandboxed)
        started = time.monotonic()
        per = args.jobs_per_process
        stack.job_workers(
            *(
                JobWorker(tuple(c["job_id"] for c in configs[first : first + per]))
                for first in range(0, len(configs), per)
            )
        )
        print(
            f"{len(stack.procs) - 1} job processes serving after "
            f"{time.monotonic() - started:.1f} s; "
            f"{args.jobs} jobs x {args.epochs} epochs on {args.groups} groups ...",
            flush=True,
        )
        asyncio.run(start_groups(stack.address, groups, memory_bytes))
        server_pid = stack.server_pid  # the bench reads its CPU time
        assert server_pid is not None
        cpu_before = (tree_cpu_seconds(worker.pid), tree_cpu_seconds(server_pid))
        began = time.monotonic()
        results = asyncio.run(run_jobs(stack.address, configs))
        run_s = time.monotonic() - began
        cpu_after = (tree_cpu_seconds(worker.pid), tree_cpu_seconds(server_pid))
        costs = asyncio.run(history_costs(stack.address, stamp, args.histories))

    group_c, job_c, group_updates = costs["group"], costs["job"], costs["group_updates"]
    by_group = holds_by_group(results)
    simulated = ideal(results, configs, options)
    per_group = {}
    for group, holds in sorted(by_group.items()):
        measured = utilization(holds)["utilization"]
        best = simulated.groups[group].utilization
        per_group[group.rsplit("-", 1)[1]] = {
            "utilization": round(measured, 4),
            "ideal": round(best, 4),
            "of_ideal": round(measured / best, 4),
            "phases": len(holds),
            "overlaps": overlaps(holds),
        }
    holds = [h for r in results for rec in r.records for h in rec.holds if h.phase in GPU_PHASES]
    waits = [h.waited_s for h in holds]
    span = max(h.mono_end for h in holds) - min(h.mono_start for h in holds)
    phases = len(holds)
    cpu_worker, cpu_server = (
        after - before for after, before in zip(cpu_after, cpu_before, strict=True)
    )
    utils = [g["utilization"] for g in per_group.values()]
    ideals = [g["ideal"] for g in per_group.values()]
    figures = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "profile": {**options, "jobs": args.jobs, "groups": args.groups, "epochs": args.epochs},
        "processes": f"1 server, 1 control worker, {-(-args.jobs // args.jobs_per_process)} "
        f"job workers ({args.jobs_per_process} job(s) each, one rank per job)",
        "utilization_mean": round(statistics.mean(utils), 4),
        "ideal_mean": round(statistics.mean(ideals), 4),
        "utilization_min": round(min(utils), 4),
        "groups": per_group,
        "lease_wait_s": {
            "p50": round(statistics.median(waits), 3),
            "p99": round(percentile(waits, 0.99), 3),
            "max": round(max(waits), 3),
        },
        "gpu_phases": phases,
        "gpu_phases_per_s": round(phases / span, 2),
        # What the jobs ask for: each job's GPU phases over its epoch alone (sample + rewards
        # + train), summed; and what the groups could serve (each at most 100% busy).
        "offered_gpu_phases_per_s": round(offered_phases_per_s(args), 2),
        "gpu_capacity_phases_per_s": round(args.groups * 2 / (args.sample_s + args.train_s), 2),
        "run_s": round(run_s, 1),
        "epochs_done": sum(r.epochs_done for r in results),
        "epochs_asked": args.jobs * args.epochs,
        "every_epoch_once": every_epoch_once(results, args.epochs),
        "overlaps": sum(g["overlaps"] for g in per_group.values()),
        "group_history": {
            **cost_figures(group_c, "lease"),
            "updates_per_lease": {
                name: round(n / group_c.units, 2) for name, n in sorted(group_updates.items())
            },
        },
        "rl_job_history": {
            **cost_figures(job_c, "epoch"),
            "events_per_prepared_epoch": costs["prepared_epoch_events"]
            and round(costs["prepared_epoch_events"], 2),
        },
        # A workflow task its worker did not start in time (the sticky queue's 10-s
        # schedule-to-start): the workflow stalls that long.
        "workflow_task_timeouts": costs["workflow_task_timeouts"],
        "cpu_s_per_gpu_phase": {
            "control_worker": round(cpu_worker / phases, 4),
            "server": round(cpu_server / phases, 4),
        },
        "cpu_s": {"control_worker": round(cpu_worker, 1), "server": round(cpu_server, 1)},
        "phase_boundaries": costs["phase_boundaries"],
    }
    print(
        f"utilization mean {figures['utilization_mean']:.1%} (ideal {figures['ideal_mean']:.1%}, "
        f"lowest group {figures['utilization_min']:.1%}); lease wait p50 "
        f"{figures['lease_wait_s']['p50']} s p99 {figures['lease_wait_s']['p99']} s max "
        f"{figures['lease_wait_s']['max']} s; {figures['gpu_phases_per_s']} GPU phases/s; "
        f"{figures['overlaps']} overlaps; every epoch once: {figures['every_epoch_once']}",
        flush=True,
    )
    print(
        f"group: {group_c.events_per_unit:.1f} events, {group_c.tasks_per_unit:.1f} workflow "
        f"tasks, {group_c.timers_per_unit:.2f} timers, {group_c.actions_per_unit:.1f} actions "
        f"per lease ({group_c.units} leases); job: {job_c.events_per_unit:.1f} events, "
        f"{job_c.tasks_per_unit:.1f} workflow tasks, {job_c.upserts_per_unit:.2f} upserts, "
        f"{job_c.actions_per_unit:.1f} actions per epoch ({job_c.units} epochs; "
        f"{costs['prepared_epoch_events'] or 0:.1f} events per prepared epoch); "
        f"{costs['workflow_task_timeouts']} workflow tasks timed out",
        flush=True,
    )
    print(json.dumps(figures, indent=2))
    print(boundary.table(costs["phase_boundaries"]), flush=True)
    print(
        f"offered {figures['offered_gpu_phases_per_s']} GPU phases/s (the groups could serve "
        f"{figures['gpu_capacity_phases_per_s']}); served {figures['gpu_phases_per_s']}; CPU s "
        f"per GPU phase: control worker {figures['cpu_s_per_gpu_phase']['control_worker']}, "
        f"server {figures['cpu_s_per_gpu_phase']['server']}",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
