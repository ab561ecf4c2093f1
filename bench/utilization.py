"""GPU-group utilization: N simulated RL jobs sharing one group versus each on its own group.

Every job is a real ``RLJobWorkflow`` served by a real ``timeslice job worker`` process running
the ``simulated`` workload: phases hold their lease for fixed times (default sample 1.0 s,
rewards 1.5 s with no lease, train 0.5 s, i.e. a 50% GPU duty cycle) and every switch moves a
simulated state (default 4 GiB in 0.1 s each way, about PCIe Gen5 speed).

Utilization of a group = time its GPU phases ran (the activities' own intervals) / wall time
from the group's first phase start to its last phase end. The ideal is the same profile with
zero switching cost, simulated FIFO (it keeps the profile's ramp-up and tail); the upper bound
is min(1, N * duty).

    .venv/bin/python bench/utilization.py --jobs 2 --epochs 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.handoff import cpu_model  # noqa: E402


def ideal_utilization(jobs: int, epochs: int, sample: float, reward: float, train: float) -> float:
    """The same profile on one group with zero switching cost, FIFO, as a tiny simulation.

    Unlike min(1, N * duty) this keeps the profile's own ramp-up and tail (the last job's
    final reward phase leaves the group idle however fast switches are).
    """
    free_at = 0.0
    ready = [(0.0, job, 0, "sample") for job in range(jobs)]  # (ready time, job, epoch, phase)
    busy = 0.0
    first, last = None, 0.0
    while ready:
        ready.sort()
        at, job, epoch, phase = ready.pop(0)
        start = max(at, free_at)
        length = sample if phase == "sample" else train
        free_at = start + length
        busy += length
        first = start if first is None else first
        last = free_at
        if phase == "sample":
            ready.append((free_at + reward, job, epoch, "train"))
        elif epoch + 1 < epochs:
            ready.append((free_at, job, epoch + 1, "sample"))
    return busy / (last - (first or 0.0))


def group_utilization(results: list[Any], group: str) -> dict[str, float]:
    holds = [
        (h.mono_start, h.mono_end)
        for r in results
        for rec in r.records
        for h in rec.holds
        if h.group_id == group
    ]
    start, end = min(s for s, _ in holds), max(e for _, e in holds)
    busy = sum(e - s for s, e in holds)
    return {"busy_s": busy, "wall_s": end - start, "utilization": busy / (end - start)}


async def run_jobs(
    address: str, configs: list[dict[str, Any]], memory_bytes: int | None
) -> tuple[list[Any], list[float]]:
    from timeslice.activities.group_requests import start_group
    from timeslice.connection import connect, connect_config
    from timeslice.jobs import parse_job_config, start_rl_job
    from timeslice.workflows.protocol import GroupConfig

    client = await connect(connect_config(address))
    for group in sorted({c["sampler_group"] for c in configs}):
        # Declaring the device memory lets a switch evict and restore at the same time.
        await start_group(client, GroupConfig(group_id=group, memory_bytes=memory_bytes))
    started = time.monotonic()
    handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]

    async def finish(handle: Any) -> tuple[Any, float]:
        result = await handle.result()
        return result, time.monotonic() - started

    done = await asyncio.gather(*(finish(h) for h in handles))
    return [r for r, _ in done], [t for _, t in done]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--sample-s", type=float, default=1.0)
    p.add_argument("--reward-s", type=float, default=1.5)
    p.add_argument("--train-s", type=float, default=0.5)
    p.add_argument("--state-bytes", type=int, default=4 * 2**30)
    p.add_argument("--switch-s", type=float, default=0.1, help="simulated snapshot = restore time")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="do not declare group memory for two states (evict, then restore)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--records", type=Path, help="write every job's epoch records here (JSON)")
    p.add_argument("--modes", default="dedicated,shared", help="which runs (default both)")
    args = p.parse_args()
    if args.jobs < 1 or args.epochs < 1:
        raise SystemExit("--jobs and --epochs must be >= 1")

    from timeslice.server import EmbeddedServer, free_port

    from tests.conftest import start_service, start_worker, stop_process

    options = {
        "sample_s": args.sample_s,
        "reward_s": args.reward_s,
        "train_s": args.train_s,
        "state_bytes": args.state_bytes,
        "snapshot_s": args.switch_s,
    }
    duty = (args.sample_s + args.train_s) / (args.sample_s + args.reward_s + args.train_s)
    stamp = int(time.time())

    def configs(mode: str) -> list[dict[str, Any]]:
        shared = f"shared-{stamp}"
        return [
            {
                "job_id": f"{mode}-{stamp}-{i}",
                "workload": "simulated",
                "workload_options": options,
                "sampler_group": shared if mode == "shared" else f"dedicated-{stamp}-{i}",
                "epochs": args.epochs,
                "checkpoint_every": args.epochs,
            }
            for i in range(args.jobs)
        ]

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        server = EmbeddedServer(port=free_port(), ui_port=None, db=tmp / "t.db").start()
        procs = [start_worker(server.address, tmp / "worker.log")]
        try:
            for mode in args.modes.split(","):
                jobs = configs(mode)
                for job in jobs:
                    procs.append(
                        start_service(
                            ["job", "worker", "--address", server.address, "--job-id",
                             job["job_id"], "--workload", "simulated",
                             "--checkpoint-dir", str(tmp / "ckpt")],
                            f"job {job['job_id']} rank 0",
                            tmp / f"{job['job_id']}.log",
                        )
                    )  # fmt: skip
                print(f"{mode}: {args.jobs} jobs x {args.epochs} epochs ...", flush=True)
                memory = None if args.no_overlap else 2 * max(args.state_bytes, 1)
                results, completion = asyncio.run(run_jobs(server.address, jobs, memory))
                groups = sorted({j["sampler_group"] for j in jobs})
                per_group = {g: group_utilization(results, g) for g in groups}
                figures[mode] = {
                    "groups": len(groups),
                    "utilization": [round(u["utilization"], 3) for u in per_group.values()],
                    "mean_utilization": round(
                        sum(u["utilization"] for u in per_group.values()) / len(groups), 3
                    ),
                    "job_completion_s": [round(t, 1) for t in completion],
                    "rewinds": sum(r.rewinds for r in results),
                }
                print(json.dumps(figures[mode]), flush=True)
                if args.records:
                    dump = [r.model_dump(mode="json") for r in results]
                    args.records.with_suffix(f".{mode}.json").write_text(json.dumps(dump))
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            server.stop()

    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "profile": {
            **options,
            "duty": round(duty, 3),
            "jobs": args.jobs,
            "epochs": args.epochs,
            "overlapped_switches": not args.no_overlap,
        },
        "ideal_shared_utilization": round(
            ideal_utilization(args.jobs, args.epochs, args.sample_s, args.reward_s, args.train_s),
            3,
        ),
        "upper_bound_utilization": round(min(1.0, args.jobs * duty), 3),
        **figures,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
