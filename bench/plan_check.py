"""Check `timeslice plan`'s predictions against real runs: utilization per group, slowdown per job.

1. **Dedicated runs.** Four kinds of `simulated` RL job — real ``RLJobWorkflow``s served by
   real ``timeslice job worker`` processes on the embedded server, every switch moving a
   simulated 4 GiB state in 0.1 s each way — each run alone on a group of its own, all at
   once. Each job is then profiled from its workflow history, exactly as
   ``timeslice plan profile`` does (``timeslice.plan.collect``).
2. **Mixes.** The same kinds, under new job ids, share groups: several mixes on one group and
   one on disaggregated sampler and trainer pools (groups declare memory for two states, so
   switches overlap eviction and restore, as in ``bench/replay.py``).
3. **Prediction.** Each mix through the simulator (``timeslice.plan.simulator``) from the
   dedicated runs' profiles alone, with the protocol costs measured in them (their median),
   lined up with the real mix: each job asks for its first lease when it did there, and each
   group grants its first lease no earlier than it did there (before, the jobs' preparation
   held it, which the model leaves out). The profiles never saw a switch (a job alone
   keeps its state on the device), so their move times come from the state's bytes and the
   device's copy rate (here the simulated one: 4 GiB per 0.1 s) — what ``--move-gbps`` says.
4. **Measured.** A group's utilization while jobs ran (``timeslice.protocol.utilization``) =
   its GPU phases' run time (their own monotonic-clock intervals) / its first phase start to
   its last phase end, printed beside its **demand bound** (each job's GPU share there alone,
   from its dedicated profile, summed, capped at 100%); a job's completion = its first
   phase start to its last phase end; slowdown = completion in the mix / completion of the same
   kind alone in step 1. Predicted figures are computed the same way on the simulated run.

5. **Policy.** ``--policy`` (default ``phase_aware``, ``GroupConfig``'s): the groups of the mixes
   are created with that ``grant_policy`` and the predictions made under it.

    .venv/bin/python bench/plan_check.py --epochs 8 --json plan_check.json [--policy fifo]

Prints one line per group (utilization: predicted, measured, error in points) and per job
(slowdown: predicted, measured, error in %), and the worst of each.
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

from timeslice.protocol.utilization import WHILE_JOBS_RAN, demand_bound  # noqa: E402

from bench.handoff import cpu_model  # noqa: E402
from bench.replay import (  # noqa: E402
    POLICIES,
    group_stats,
    holds_by_group,
    run_jobs,
    utilization,
)

STATE_BYTES = 4 * 2**30
MOVE_S = 0.1
# Kinds of job: (sample, rewards, train) seconds. GPU share alone: 83%, 85%, 29%, 54%.
KINDS: dict[str, tuple[float, float, float]] = {
    "gen": (1.5, 0.5, 1.0),
    "bound": (1.0, 0.4, 1.2),
    "light": (0.6, 2.4, 0.4),
    "mid": (0.8, 1.2, 0.6),
}
# Mixes: (name, layout, kinds). one-group: every job samples and trains on one group;
# disaggregated: one sampler group and one trainer group for all.
MIXES: list[tuple[str, str, list[str]]] = [
    ("complementary pair", "one-group", ["gen", "light"]),
    ("gpu-bound pair", "one-group", ["gen", "bound"]),
    ("three on one group", "one-group", ["bound", "light", "mid"]),
    ("four on two pools", "disaggregated", ["gen", "bound", "light", "mid"]),
]


def options(kind: str) -> dict[str, Any]:
    sample_s, reward_s, train_s = KINDS[kind]
    return {
        "sample_s": sample_s,
        "reward_s": reward_s,
        "train_s": train_s,
        "state_bytes": STATE_BYTES,
        "snapshot_s": MOVE_S,
    }


def config(job_id: str, kind: str, sampler: str, trainer: str, epochs: int) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "workload": "simulated",
        "workload_options": options(kind),
        "sampler_group": sampler,
        "trainer_group": trainer,
        "epochs": epochs,
        "checkpoint_every": epochs,
    }


def memory_for(configs: list[dict[str, Any]]) -> dict[str, int]:
    """Room for the two largest footprints on each group (switches overlap, as in replay)."""
    footprints: dict[str, list[int]] = {}
    for c in configs:
        states = 2 if c["sampler_group"] == c["trainer_group"] else 1
        for g in {c["sampler_group"], c["trainer_group"]}:
            footprints.setdefault(g, []).append(states * STATE_BYTES)
    return {g: sum(sorted(f)[-2:]) if len(f) > 1 else 2 * f[0] for g, f in footprints.items()}


class Bench:
    def __init__(self, stack: Any, epochs: int, policy: str = POLICIES[0]) -> None:
        self.stack = stack  # a timeslice.cli.stack.Stack with its control worker
        self.address: str = stack.address
        self.epochs = epochs
        self.policy = policy

    def run(self, configs: list[dict[str, Any]]) -> list[Any]:
        from timeslice.cli.stack import JobWorker

        procs = self.stack.job_workers(*(JobWorker((c["job_id"],)) for c in configs))
        try:
            memory: dict[str, int | None] = dict(memory_for(configs))
            return asyncio.run(run_jobs(self.address, configs, memory, self.policy))
        finally:
            for proc in reversed(procs):
                self.stack.stop(proc)

    def profiles(self, results: list[Any]) -> dict[str, Any]:
        from timeslice.plan.collect import read_rl_job, rl_job_profile
        from timeslice.transport.connection import connect, connect_config

        async def read() -> dict[str, Any]:
            client = await connect(connect_config(self.address))
            return {r.job_id: rl_job_profile(await read_rl_job(client, r.job_id)) for r in results}

        return asyncio.run(read())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=POLICIES[0],
        help=f"the groups' grant_policy, and the predictions' (default {POLICIES[0]})",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument(
        "--profiles-out", type=Path, help="write the dedicated runs' profiles here (YAML)"
    )
    p.add_argument(
        "--profiles-only",
        action="store_true",
        help="stop after the dedicated runs and their profiles (how examples/profiles/ was made)",
    )
    args = p.parse_args()
    if args.profiles_only and args.profiles_out is None:
        raise SystemExit("--profiles-only needs --profiles-out")
    if args.epochs < 2:
        raise SystemExit("--epochs must be >= 2")

    from timeslice.cli.stack import Stack
    from timeslice.plan.cli import describe_profile, pick_overheads
    from timeslice.plan.collect import (
        completion_s,
        opens_for_simulation,
        start_for_simulation,
    )
    from timeslice.plan.profile import dump_profile
    from timeslice.plan.simulator import GroupSpec, Placement, simulate
    from timeslice.protocol.group import GrantPolicy

    stamp = str(int(time.time()))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir, Stack(Path(tmp_dir)).start() as stack:
        stack.control_worker()
        bench = Bench(stack, args.epochs, args.policy)
        policy = GrantPolicy(args.policy)
        print(f"dedicated: {len(KINDS)} jobs, each alone on its group ...", flush=True)
        own = {kind: f"own-{kind}-{stamp}" for kind in KINDS}
        alone = [
            config(f"{kind}-{stamp}", kind, own[kind], own[kind], args.epochs) for kind in KINDS
        ]
        dedicated = bench.run(alone)
        profiles = bench.profiles(dedicated)
        by_kind = {kind: profiles[f"{kind}-{stamp}"] for kind in KINDS}
        measured_alone = {kind: completion_s(r) for kind, r in zip(KINDS, dedicated, strict=True)}
        for profile in profiles.values():
            print(describe_profile(profile), flush=True)
        if args.profiles_out is not None:
            args.profiles_out.mkdir(parents=True, exist_ok=True)
            for kind, profile in by_kind.items():
                # Named after its kind, not the run's job id.
                named = profile.model_copy(update={"job_id": kind})
                dump_profile(named, args.profiles_out / f"{kind}.yaml")
            print(f"wrote {len(by_kind)} profiles to {args.profiles_out}", flush=True)
            if args.profiles_only:
                return
        overheads, origin = pick_overheads(list(profiles.values()), None)
        move_bps = STATE_BYTES / MOVE_S

        def predict(placements: list[Any], groups: dict[str, GroupSpec]) -> Any:
            return simulate(
                placements, groups=groups, overheads=overheads, move_bytes_per_s=move_bps
            )

        predicted_alone = {
            kind: predict([Placement(prof, "own", "own")], {"own": GroupSpec(grant_policy=policy)})
            .jobs[prof.job_id]
            .completion_s
            for kind, prof in by_kind.items()
        }
        mixes = []
        for index, (name, layout, kinds) in enumerate(MIXES):
            print(f"mix {name}: {', '.join(kinds)} ({layout}) ...", flush=True)
            configs = []
            for i, kind in enumerate(kinds):
                if layout == "one-group":
                    sampler = trainer = f"mix{index}-{stamp}"
                else:
                    sampler, trainer = f"mix{index}-s-{stamp}", f"mix{index}-t-{stamp}"
                configs.append(
                    config(f"m{index}-{i}-{kind}-{stamp}", kind, sampler, trainer, args.epochs)
                )
            results = bench.run(configs)
            origin_mono = min(start_for_simulation(r) for r in results)
            opens = opens_for_simulation(results, overheads.grant_s)
            placements = [
                Placement(
                    by_kind[kind].model_copy(update={"job_id": c["job_id"]}),
                    c["sampler_group"],
                    c["trainer_group"],
                    start_s=start_for_simulation(r) - origin_mono,
                )
                for kind, c, r in zip(kinds, configs, results, strict=True)
            ]
            memory = memory_for(configs)
            specs = {
                g: GroupSpec(
                    memory_bytes=m,
                    opens_s=opens.get(g, origin_mono) - origin_mono,
                    grant_policy=policy,
                )
                for g, m in memory.items()
            }
            outcome = predict(placements, specs)
            # The groups' own counters, to line up with the model's.
            real_stats = asyncio.run(group_stats(stack.address, sorted(memory)))
            groups = []
            for group, holds in sorted(holds_by_group(results).items()):
                measured = utilization(holds)["utilization"]
                predicted = outcome.groups[group].utilization
                model, real = outcome.groups[group], real_stats[group]
                bound = demand_bound(
                    pl.profile.gpu_share(
                        {
                            pool
                            for pool, g in (
                                ("sampler", pl.sampler_group),
                                ("trainer", pl.trainer_group),
                            )
                            if g == group
                        }
                    )
                    for pl in placements
                    if group in (pl.sampler_group, pl.trainer_group)
                )
                groups.append(
                    {
                        "group": group.removesuffix(f"-{stamp}"),
                        "predicted": round(predicted, 4),
                        "measured": round(measured, 4),
                        "error_points": round((predicted - measured) * 100, 2),
                        "demand_bound": round(bound, 4),
                        # What the groups did, predicted / measured: where they part, the
                        # model's group and the real one decided differently.
                        "carried": [model.carried, real.carried],
                        "staged_restores": [model.staged_restores, real.staged_restores],
                        "staged_unused": [model.staged_unused, real.staged_unused],
                    }
                )
            jobs = []
            for kind, r in zip(kinds, results, strict=True):
                measured = completion_s(r) / measured_alone[kind]
                predicted = outcome.jobs[r.job_id].completion_s / predicted_alone[kind]
                jobs.append(
                    {
                        "job": kind,
                        "predicted": round(predicted, 4),
                        "measured": round(measured, 4),
                        "error_pct": round((predicted / measured - 1) * 100, 2),
                        "completion_s": round(completion_s(r), 2),
                        "predicted_completion_s": round(outcome.jobs[r.job_id].completion_s, 2),
                    }
                )
            mixes.append({"mix": name, "layout": layout, "groups": groups, "jobs": jobs})
            for g in groups:
                print(
                    f"  {g['group']}: utilization {WHILE_JOBS_RAN} predicted "
                    f"{g['predicted']:.1%}, measured {g['measured']:.1%} "
                    f"({g['error_points']:+.1f} points); demand bound "
                    f"{g['demand_bound']:.1%} (the jobs' GPU share alone, summed, capped)",
                    flush=True,
                )
                print(
                    "    predicted / measured: "
                    + ", ".join(
                        f"{key.replace('_', ' ')} {g[key][0]} / {g[key][1]}"
                        for key in ("carried", "staged_restores", "staged_unused")
                    ),
                    flush=True,
                )
            for j in jobs:
                print(
                    f"  {j['job']}: slowdown predicted {j['predicted']:.3f}x, measured "
                    f"{j['measured']:.3f}x ({j['error_pct']:+.1f}%)",
                    flush=True,
                )

    util_errors = [abs(g["error_points"]) for m in mixes for g in m["groups"]]
    slow_errors = [abs(j["error_pct"]) for m in mixes for j in m["jobs"]]
    summary = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "epochs": args.epochs,
        "grant_policy": args.policy,
        "kinds": {
            k: dict(zip(("sample_s", "reward_s", "train_s"), v, strict=True))
            for k, v in KINDS.items()
        },
        "state": {"bytes": STATE_BYTES, "move_s": MOVE_S},
        "overheads": overheads.model_dump(),
        "overheads_from": origin,
        "dedicated_completion_s": {k: round(v, 2) for k, v in measured_alone.items()},
        "predicted_dedicated_s": {k: round(v, 2) for k, v in predicted_alone.items()},
        "mixes": mixes,
        "utilization_error_points": {
            "max": round(max(util_errors), 2),
            "mean": round(statistics.fmean(util_errors), 2),
        },
        "slowdown_error_pct": {
            "max": round(max(slow_errors), 2),
            "mean": round(statistics.fmean(slow_errors), 2),
        },
        "run_s": round(time.monotonic() - started, 1),
    }
    print(
        json.dumps(
            {k: summary[k] for k in ("utilization_error_points", "slowdown_error_pct", "run_s")}
        )
    )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
