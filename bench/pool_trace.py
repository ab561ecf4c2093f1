"""A pool that moves jobs against one that does not, side by side on one trace (issue 34).

    .venv/bin/python bench/pool_trace.py [--trace bench/pool_trace.json] [--scale 1] [--json F]
    .venv/bin/python bench/pool_trace.py --modes plan     # the planner's best placement, run

``--modes plan`` runs instead the best static placement ``timeslice plan``'s search finds when it
is given every job's profile and arrival up front (``JobProfile.arrive_s``): each job started at
its arrival on the group the plan gives it, no pool.

One embedded Temporal server, one control worker and ``timeslice job worker`` processes (two
jobs each, ``--jobs-per-process``; each shape's run alone in one of its own), all started and
serving before the first job starts. Two pools of the trace's
groups each: **on** (moves weighed when a job ends or measures its profile) and **off**
(``--no-auto-move``). Every job of the trace (``bench/pool_trace.json``: ``simulated`` jobs of
several shapes arriving over time, some declaring their profiles) is started into both pools at
its arrival time, so both run the same trace at once on the same machine. It prints, per pool:

- **completion**: each job's last GPU phase end less its arrival (its start call), summed over
  the jobs, and the **makespan** (first arrival to last phase end);
- **utilization**: each group's GPU-phase share while its jobs ran (``timeslice status``'s
  definition), averaged over the groups the pool used (what the pool's placement maximises),
  and the pool's **occupancy**: GPU-phase seconds over (groups x makespan);
- **alone**: before the trace, one job of each shape runs alone on groups of its own (all
  shapes at once, ``--alone-epochs``): its first GPU phase start to last GPU phase end over its
  epochs is the shape's **seconds per epoch alone**, control-plane costs and checkpoints in it;
- **served per group vs one job per group**: the makespan of the same arrivals run one job per
  group (an async job: two), each for its epochs times its shape's seconds per epoch alone (first
  come, first served; computed from the measured rates), over the pool's makespan;
- **slowdown**: each job's first GPU phase start to last GPU phase end over its epochs times its
  shape's seconds per epoch alone (a queue's wait is not in it), and against its phases' sum
  (no control-plane cost counted alone: an upper bound);
- **moves**: each job's moves (its progress) and the pool's decisions; **overlaps** (GPU phases on
  one group that began before the one before them ended) and whether every epoch ran once.
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench.handoff import cpu_model  # noqa: E402
from bench.replay import holds_by_group, utilization  # noqa: E402
from bench.scale import overlaps  # noqa: E402

GPU_PHASES = ("sample", "train")
MODES = ("on", "off", "plan")


def load_trace(path: Path) -> dict[str, Any]:
    trace = json.loads(path.read_text())
    for job in trace["jobs"]:
        if job["shape"] not in trace["shapes"]:
            raise SystemExit(f"{path}: job {job['id']} has an unknown shape {job['shape']!r}")
    return trace


def epoch_s(shape: dict[str, Any], scale: float) -> float:
    return (shape["sample_s"] + shape["reward_s"] + shape["train_s"]) * scale


def job_config(job: dict[str, Any], shape: dict[str, Any], pool: str, job_id: str,
               scale: float) -> dict[str, Any]:  # fmt: skip
    phases = {k: shape[k] * scale for k in ("sample_s", "reward_s", "train_s")}
    config: dict[str, Any] = {
        "job_id": job_id,
        "workload": "simulated",
        "workload_options": {**phases, "state_bytes": 1 << 20},
        "pool": pool,
        "epochs": job["epochs"],
        "checkpoint_every": 2,
        **async_fields(shape),
    }
    if shape["profile"]:
        config["profile"] = {
            "epochs": job["epochs"],
            **async_fields(shape),
            "phases": [
                {"name": "sample", "gpu": True, "pool": "sampler", "seconds": phases["sample_s"]},
                {"name": "rewards", "gpu": False, "seconds": phases["reward_s"]},
                {"name": "train", "gpu": True, "pool": "trainer", "seconds": phases["train_s"]},
            ],
        }
    return config


def is_async(shape: dict[str, Any]) -> bool:
    return shape.get("mode", "sync") == "async"


def async_fields(shape: dict[str, Any]) -> dict[str, Any]:
    """An async shape's mode and pipeline bounds, as a job config and a profile both take them."""
    if not is_async(shape):
        return {}
    return {
        "mode": "async",
        "max_staleness": shape.get("max_staleness", 1),
        "sync_every": shape.get("sync_every", 1),
    }


def trace_profiles(trace: dict[str, Any], scale: float) -> list[Any]:
    """Every job of the trace as ``timeslice plan`` takes it: its phases, epochs and arrival."""
    from timeslice.plan.profile import JobProfile

    profiles = []
    for job in trace["jobs"]:
        shape = trace["shapes"][job["shape"]]
        phases = [
            {
                "name": "sample",
                "gpu": True,
                "pool": "sampler",
                "seconds": shape["sample_s"] * scale,
            },
            {"name": "rewards", "gpu": False, "seconds": shape["reward_s"] * scale},
            {"name": "train", "gpu": True, "pool": "trainer", "seconds": shape["train_s"] * scale},
        ]
        profiles.append(
            JobProfile(
                job_id=job["id"],
                epochs=job["epochs"],
                arrive_s=job["arrive_s"] * scale,
                phases=phases,
                **async_fields(shape),
            )
        )
    return profiles


def planned_groups(trace: dict[str, Any], scale: float, time_limit_s: float) -> dict[str, Any]:
    """The planner's best static placement of the trace (job -> group index) and its figures."""
    from timeslice.plan.search import Layout, Planner
    from timeslice.protocol.pool import DEFAULT_MAX_SLOWDOWN

    groups = tuple(f"g{i}" for i in range(trace["groups"]))
    planner = Planner(trace_profiles(trace, scale), Layout(groups=groups),
                      max_slowdown=DEFAULT_MAX_SLOWDOWN)  # fmt: skip
    best = planner.search(top=1, time_limit_s=time_limit_s).assignments[0]
    return {
        "groups": {j.job_id: (j.sampler_group, j.trainer_group) for j in best.jobs},
        "predicted_utilization": round(best.mean_utilization, 4),
        "predicted_slowdown_max": round(max(j.completion_s / j.dedicated_s for j in best.jobs), 3),
        "within_bound": not best.violations,
    }


def one_job_per_group_makespan(trace: dict[str, Any], scale: float,
                               alone_s: dict[str, float]) -> float:  # fmt: skip
    """The trace's arrivals run one job per group (an async job: two), first come first
    served, each for its epochs times its shape's measured seconds per epoch alone."""
    free = [0.0] * trace["groups"]
    ends = []
    for job in sorted(trace["jobs"], key=lambda j: j["arrive_s"]):
        shape = trace["shapes"][job["shape"]]
        slots = sorted(range(len(free)), key=lambda i: free[i])[: 2 if is_async(shape) else 1]
        start = max([job["arrive_s"] * scale, *(free[i] for i in slots)])
        end = start + job["epochs"] * alone_s[job["shape"]]
        for i in slots:
            free[i] = end
        ends.append(end)
    return max(ends)


def gpu_span(result: Any) -> tuple[float, float]:
    """A job's first GPU phase start and last GPU phase end (its own process's clock)."""
    holds = [h for rec in result.records for h in rec.holds if h.phase in GPU_PHASES]
    return min(h.mono_start for h in holds), max(h.mono_end for h in holds)


async def run_alone(address: str, trace: dict[str, Any], stamp: str, scale: float,
                    epochs: int) -> dict[str, float]:  # fmt: skip
    """Each shape's seconds per epoch alone: one job of each shape on groups of its own (all
    shapes at once, before the trace), its first GPU phase start to its last GPU phase end
    over its epochs. Control-plane costs, checkpoints and the start-up are in it, as they
    are in the trace's jobs."""
    from timeslice.jobs import parse_any_job_config, start_any_rl_job
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    handles = {}
    for name, shape in trace["shapes"].items():
        job_id = alone_job_id(stamp, name)
        config = job_config({"epochs": epochs}, shape, "", job_id, scale)
        config.pop("pool"), config.pop("profile", None)
        config["sampler_group"] = f"{job_id}-s"
        if is_async(shape):
            config["trainer_group"] = f"{job_id}-t"
        handles[name] = await start_any_rl_job(client, parse_any_job_config(config))
    alone: dict[str, float] = {}
    for name, handle in handles.items():
        first, last = gpu_span(await handle.result())
        alone[name] = (last - first) / epochs
    return alone


def alone_job_id(stamp: str, shape: str) -> str:
    return f"alone-{stamp}-{shape}"


Planned = dict[str, tuple[str, str]]  # job -> (sampler group, trainer group)


async def run_trace(address: str, trace: dict[str, Any], pools: dict[str, str], stamp: str,
                    scale: float, plan: Planned | None) -> dict[str, Any]:  # fmt: skip
    from timeslice.jobs import parse_any_job_config, start_any_rl_job
    from timeslice.pools import pool_decisions, pool_status
    from timeslice.protocol.async_rl_job import AsyncRLJobProgress
    from timeslice.protocol.rl_job import RLJobProgress, rl_job_workflow_id
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    began = time.monotonic()
    arrivals: dict[str, float] = {}

    async def finish(job: dict[str, Any], mode: str, handle: Any) -> Any:
        result = await handle.result()
        job_id = result.job_id
        progress_type = (
            AsyncRLJobProgress if is_async(trace["shapes"][job["shape"]]) else RLJobProgress
        )
        progress = await client.get_workflow_handle(rl_job_workflow_id(job_id)).query(
            "progress", result_type=progress_type
        )
        print(f"  {time.monotonic() - began:6.1f} s: {job_id} done, moves {len(progress.moves)}",
              flush=True)  # fmt: skip
        return job, mode, result, progress

    async def arrive(mode: str) -> list[Any]:
        """The trace's jobs into one pool, in order: each at its arrival time, and each known
        to the pool (placed or queued) before the next arrives."""
        waiting = []
        for job in sorted(trace["jobs"], key=lambda j: j["arrive_s"]):
            await asyncio.sleep(max(0.0, began + job["arrive_s"] * scale - time.monotonic()))
            job_id = f"{mode}-{stamp}-{job['id']}"
            config = job_config(job, trace["shapes"][job["shape"]], pools[mode], job_id, scale)
            if mode == "plan":  # on the group the plan gave it, no pool
                assert plan is not None
                config.pop("pool"), config.pop("profile", None)
                sampler, trainer = plan[job["id"]]
                config["sampler_group"] = f"{pools[mode]}-{sampler}"
                config["trainer_group"] = f"{pools[mode]}-{trainer}"
            arrivals[job_id] = time.monotonic()
            handle = await start_any_rl_job(client, parse_any_job_config(config))
            while mode != "plan" and not any(
                j.job_id == job_id for j in (await pool_status(client, pools[mode])).jobs
            ):
                await asyncio.sleep(0.05)
            waiting.append(asyncio.ensure_future(finish(job, mode, handle)))
        return list(await asyncio.gather(*waiting))

    finished = [item for batch in await asyncio.gather(*(arrive(m) for m in pools))
                for item in batch]  # fmt: skip
    statuses = {
        mode: await pool_status(client, pool) for mode, pool in pools.items() if mode != "plan"
    }
    decisions = {
        mode: [d.reason for d in await pool_decisions(client, pool)]
        for mode, pool in pools.items()
        if mode != "plan"
    }
    return {
        "finished": finished,
        "arrivals": arrivals,
        "statuses": statuses,
        "decisions": decisions,
    }


def pool_figures(mode: str, run: dict[str, Any], trace: dict[str, Any], scale: float,
                 baseline_s: float, alone_s: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    mine = [(job, result, progress) for job, m, result, progress in run["finished"] if m == mode]
    results = [result for _, result, _ in mine]
    arrivals = run["arrivals"]
    by_group = holds_by_group(results)
    gpu = {g: [(j, h) for j, h in holds if h.phase in GPU_PHASES] for g, holds in by_group.items()}
    jobs: dict[str, Any] = {}
    for job, result, progress in mine:
        groups = {h.group_id for rec in result.records for h in rec.holds if h.phase in GPU_PHASES}
        first, last = gpu_span(result)
        phase_sum = job["epochs"] * epoch_s(trace["shapes"][job["shape"]], scale)
        jobs[job["id"]] = {
            "shape": job["shape"],
            "completion_s": round(last - arrivals[result.job_id], 2),
            "queued_s": round(first - arrivals[result.job_id], 2),
            "slowdown": round((last - first) / (job["epochs"] * alone_s[job["shape"]]), 3),
            "slowdown_vs_phase_sum": round((last - first) / phase_sum, 3),
            "moves": len(progress.moves),
            "groups": sorted(g.rsplit("-", 1)[1] for g in groups),
            "every_epoch_once": [r.epoch for r in result.records] == list(range(job["epochs"])),
        }
    start = min(arrivals[r.job_id] for r in results)
    end = max(h.mono_end for holds in gpu.values() for _, h in holds)
    makespan = end - start
    phase_s = sum(h.mono_end - h.mono_start for holds in gpu.values() for _, h in holds)
    per_group = {g.rsplit("-", 1)[1]: utilization(holds)["utilization"] for g, holds in gpu.items()}
    return {
        "completion_total_s": round(sum(j["completion_s"] for j in jobs.values()), 1),
        "makespan_s": round(makespan, 1),
        "utilization_groups_in_use": round(statistics.mean(per_group.values()), 4),
        "groups_used": len(per_group),
        "utilization_per_group": {g: round(u, 4) for g, u in sorted(per_group.items())},
        "occupancy": round(phase_s / (trace["groups"] * makespan), 4),
        "served_per_group_vs_one_job_per_group": round(baseline_s / makespan, 3),
        "slowdown_max": max(j["slowdown"] for j in jobs.values()),
        "slowdown_vs_phase_sum_max": max(j["slowdown_vs_phase_sum"] for j in jobs.values()),
        "moves": sum(j["moves"] for j in jobs.values()),
        "moves_max_per_job": max(j["moves"] for j in jobs.values()),
        "overlaps": sum(overlaps(holds) for holds in gpu.values()),
        "every_epoch_once": all(j["every_epoch_once"] for j in jobs.values()),
        "jobs": jobs,
        "decisions": run["decisions"].get(mode, []),
    }


LABELS = {"on": "pool, moves on", "off": "pool, moves off", "plan": "planned placement"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=REPO / "bench" / "pool_trace.json")
    p.add_argument("--scale", type=float, default=1.0, help="times every phase and arrival")
    p.add_argument(
        "--modes",
        default="on,off",
        help="what runs at once: on (a pool that moves jobs), off (one that does not), plan "
        "(the planner's best placement, no pool); default on,off",
    )
    p.add_argument("--plan-time-limit", type=float, default=20.0, help="the planner's search, s")
    p.add_argument(
        "--jobs-per-process",
        type=int,
        default=2,
        help="jobs a `timeslice job worker` process serves (users run one a job; six a "
        "process slowed their last job 1.36x in most runs: BENCHMARKS.md)",
    )
    p.add_argument(
        "--alone-epochs", type=int, default=4, help="each shape's run alone, before the trace"
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--workdir", type=Path, help="keep the server's database and logs here")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes: one or more of {', '.join(MODES)}, each once")
    if not 0.05 <= args.scale <= 100 or args.jobs_per_process < 1 or args.alone_epochs < 1:
        raise SystemExit(
            "--scale must be within [0.05, 100], --jobs-per-process and --alone-epochs >= 1"
        )
    trace = load_trace(args.trace)
    planned = planned_groups(trace, args.scale, args.plan_time_limit) if "plan" in modes else None
    if planned is not None:
        print(f"planned: {planned}", flush=True)

    from timeslice.cli.stack import JobWorker, Stack
    from timeslice.pools import PoolConfig, PoolGroup, create_pool
    from timeslice.transport.connection import connect, connect_config

    stamp = str(int(time.time()))
    pools = {mode: f"trace-{mode}-{stamp}" for mode in modes}
    job_ids = [f"{mode}-{stamp}-{job['id']}" for job in trace["jobs"] for mode in modes]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = str(args.workdir) if args.workdir else tempfile.mkdtemp(prefix="pool-trace-")
    alone_ids = tuple(alone_job_id(stamp, shape) for shape in trace["shapes"])
    with Stack(Path(workdir)).start() as stack:
        stack.control_worker()
        per = args.jobs_per_process
        stack.job_workers(
            *(JobWorker((job,)) for job in alone_ids),  # alone: a process of its own, too
            *(JobWorker(tuple(job_ids[i : i + per])) for i in range(0, len(job_ids), per)),
        )
        print(f"each shape alone for {args.alone_epochs} epochs ...", flush=True)
        alone = asyncio.run(run_alone(stack.address, trace, stamp, args.scale, args.alone_epochs))
        print("seconds per epoch alone: " + ", ".join(f"{k} {v:.2f}" for k, v in alone.items()))

        async def create() -> None:
            client = await connect(connect_config(stack.address))
            for mode, pool in pools.items():
                if mode == "plan":
                    continue
                groups = [PoolGroup(name=f"{pool}-g{i}") for i in range(trace["groups"])]
                config = PoolConfig(pool=pool, groups=groups, auto_move=mode == "on")
                await create_pool(client, config)

        asyncio.run(create())
        print(f"{len(job_ids)} jobs: " + ", ".join(f"{LABELS[m]} ({pools[m]})" for m in modes)
              + f", {trace['groups']} groups each ...", flush=True)  # fmt: skip
        plan = planned["groups"] if planned is not None else None
        run = asyncio.run(run_trace(stack.address, trace, pools, stamp, args.scale, plan))

    baseline = one_job_per_group_makespan(trace, args.scale, alone)
    figures: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg()[0],
        "trace": str(
            args.trace.relative_to(REPO) if args.trace.is_relative_to(REPO) else args.trace
        ),
        "scale": args.scale,
        "alone_epochs": args.alone_epochs,
        "seconds_per_epoch_alone": {k: round(v, 3) for k, v in alone.items()},
        "one_job_per_group_makespan_s": round(baseline, 1),
        **{mode: pool_figures(mode, run, trace, args.scale, baseline, alone) for mode in modes},
    }
    if planned is not None:
        figures["plan"]["predicted"] = planned
    for mode in modes:
        f = figures[mode]
        print(
            f"{LABELS[mode]}: completion {f['completion_total_s']} s in all, makespan "
            f"{f['makespan_s']} s; utilization {f['utilization_groups_in_use']:.1%} over "
            f"{f['groups_used']} groups in use, occupancy {f['occupancy']:.1%}; served per group "
            f"{f['served_per_group_vs_one_job_per_group']}x one job per group; slowdown max "
            f"{f['slowdown_max']} (against its phases' sum {f['slowdown_vs_phase_sum_max']}); "
            f"moves {f['moves']} (max {f['moves_max_per_job']} a job); "
            f"overlaps {f['overlaps']}; every epoch once: {f['every_epoch_once']}"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
