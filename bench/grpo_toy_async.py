"""Do async grpo-toy jobs learn as the sync job does? Real jobs, a shared trainer, rewards.

Two (``--jobs``) grpo-toy jobs, each sampling on a group of its own, both training on one
shared trainer group: first as ``AsyncRLJobWorkflow``s (``--max-staleness``, weights published
every step), then as sync ``RLJobWorkflow``s with the same seeds, options and steps. Every job
is served by a real ``timeslice job worker`` process on the embedded dev server. Per job it
prints the reward at the start and at the end (the mean of the first and of the last
``--window`` steps' rewards), the staleness of its batches, and for async jobs how many steps
trained with the decoupled objective (the workload's own count of policy versions behind, which
must equal the workflow's staleness).

    .venv/bin/python bench/grpo_toy_async.py --steps 30 --max-staleness 2
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
from bench.replay import groups_of, run_jobs  # noqa: E402


def job_configs(args: argparse.Namespace, mode: str, stamp: str) -> list[dict[str, Any]]:
    options: dict[str, Any] = {"stale_objective": args.stale_objective}
    if args.reward_latency_s:
        options["reward_latency_s"] = args.reward_latency_s
    configs = []
    for i in range(args.jobs):
        sampler, trainer = groups_of("shared-trainer", i, f"{mode}-{stamp}", mode)
        config: dict[str, Any] = {
            "job_id": f"grpo-{mode}-{stamp}-{i}",
            "workload": "grpo-toy",
            "workload_options": options,
            "sampler_group": sampler,
            "trainer_group": trainer,
            "epochs": args.steps,
            "checkpoint_every": args.steps,
            "seed": args.seed + i,
            "batch_size": args.batch_size,
            "group_size": args.group_size,
        }
        if mode == "async":
            config.update(mode="async", max_staleness=args.max_staleness, sync_every=1)
        configs.append(config)
    return configs


def run_mode(args: argparse.Namespace, mode: str, stamp: str, tmp: Path) -> tuple[list[Any], float]:
    from timeslice.cli.stack import JobWorker, Stack

    configs = job_configs(args, mode, stamp)
    with Stack(tmp / mode).start() as stack:
        stack.control_worker()
        stack.job_workers(*(JobWorker((c["job_id"],), "grpo-toy") for c in configs))
        print(f"{mode}: {args.jobs} grpo-toy jobs x {args.steps} steps ...", flush=True)
        memory = {g: None for c in configs for g in (c["sampler_group"], c["trainer_group"])}
        started = time.monotonic()
        results = asyncio.run(run_jobs(stack.address, configs, memory))
        return results, time.monotonic() - started


def summarize(result: Any, window: int, seed: int) -> dict[str, Any]:
    rewards = [r for r in result.rewards if r is not None]
    if len(rewards) < 2 * window:
        raise SystemExit(f"{result.job_id}: {len(rewards)} rewards, fewer than 2 x --window")
    start, end = statistics.mean(rewards[:window]), statistics.mean(rewards[-window:])
    summary: dict[str, Any] = {
        "job_id": result.job_id,
        "seed": seed,
        "steps": result.epochs_done,
        "reward_start": round(start, 4),
        "reward_end": round(end, 4),
        "rise": round(end - start, 4),
        "rewinds": result.rewinds,
    }
    if getattr(result, "mode", "sync") == "async":
        staleness = [rec.staleness for rec in result.records]
        lags = [rec.metrics.get("train.policy_lag") for rec in result.records]
        decoupled = sum(rec.metrics.get("train.decoupled", 0.0) for rec in result.records)
        summary.update(
            staleness_max=max(staleness),
            staleness_mean=round(statistics.mean(staleness), 2),
            staleness_counts=list(result.staleness_counts),
            decoupled_steps=int(decoupled),
            lag_matches_staleness=lags == [float(s) for s in staleness],
            dropped_batches=result.dropped_batches,
        )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="job i has seed SEED + i")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--window", type=int, default=5, help="steps averaged at start and end")
    p.add_argument("--reward-latency-s", type=float, default=0.0)
    p.add_argument(
        "--stale-objective",
        choices=("decoupled", "ppo"),
        default="decoupled",
        help="grpo-toy's objective for stale batches (async jobs)",
    )
    p.add_argument("--modes", default="async,sync", help="which runs, in order")
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = p.parse_args()
    modes = args.modes.split(",")
    if args.jobs < 1 or args.steps < 2 * args.window or not set(modes) <= {"async", "sync"}:
        raise SystemExit("need --jobs >= 1, --steps >= 2 x --window, --modes from async,sync")

    stamp = str(int(time.time()))
    out: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory() as tmp_dir:
        for mode in modes:
            results, elapsed = run_mode(args, mode, stamp, Path(tmp_dir))
            jobs = [
                summarize(r, args.window, args.seed + i)
                for i, r in enumerate(sorted(results, key=lambda r: r.job_id))
            ]
            for j in jobs:
                extra = (
                    f"; staleness max {j['staleness_max']}, mean {j['staleness_mean']}, "
                    f"decoupled steps {j['decoupled_steps']}, "
                    f"lag = staleness: {j['lag_matches_staleness']}"
                    if mode == "async"
                    else ""
                )
                print(
                    f"  {mode} seed {j['seed']}: reward {j['reward_start']:.3f} -> "
                    f"{j['reward_end']:.3f} ({j['rise']:+.3f}){extra}",
                    flush=True,
                )
            out[mode] = {"run_s": round(elapsed, 1), "jobs": jobs}
    out["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
