"""Hand-off latency of a GPU group on the embedded server.

Two client processes ping-pong one group: each acquires, holds for ``--hold`` seconds, releases,
and asks again, so every release has a waiter. The hand-off is the time from the holder's
release call to the next holder's acquire returning (both on the system-wide monotonic clock).
Then one process alone measures an uncontended acquire + release.

    .venv/bin/python bench/handoff.py --handoffs 400
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path


def player(args: argparse.Namespace) -> None:
    from timeslice import TimeSliceOrchestratorClient

    client = TimeSliceOrchestratorClient(target=args.address, job_id=args.job).connect()
    records = []
    for _ in range(args.rounds):
        t0 = time.monotonic()
        lease = client.acquire(args.group)
        t1 = time.monotonic()
        if args.hold:
            time.sleep(args.hold)
        t2 = time.monotonic()
        client.release(lease)
        t3 = time.monotonic()
        records.append(
            {
                "job": args.job,
                "token": lease.token,
                "asked": t0,
                "got": t1,
                "release": t2,
                "released": t3,
            }
        )
    client.close()
    Path(args.out).write_text(json.dumps(records))


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def spawn(address: str, group: str, job: str, rounds: int, hold: float, out: Path):
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "player",
            "--address",
            address,
            "--group",
            group,
            "--job",
            job,
            "--rounds",
            str(rounds),
            "--hold",
            str(hold),
            "--out",
            str(out),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="driver", choices=["driver", "player"])
    p.add_argument("--address")
    p.add_argument("--group", default="bench")
    p.add_argument("--job")
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--out")
    p.add_argument("--handoffs", type=int, default=400, help="hand-offs to measure (>= 200)")
    p.add_argument("--hold", type=float, default=0.005, help="seconds each holder keeps the group")
    p.add_argument(
        "--sandboxed",
        action="store_true",
        help="run the control worker's workflows in Temporal's sandbox (timeslice worker "
        "--sandboxed), as before 2026-12-03",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = p.parse_args()
    if args.role == "player":
        player(args)
        return

    from timeslice.cli.stack import Stack

    with tempfile.TemporaryDirectory() as tmp_dir, Stack(Path(tmp_dir)).start() as stack:
        tmp = Path(tmp_dir)
        stack.control_worker(sandboxed=args.sandboxed)
        rounds = args.handoffs // 2 + 10  # a few extra for warm-up
        print(f"ping-pong: 2 processes x {rounds} rounds on {stack.address} ...", flush=True)
        procs = [
            spawn(stack.address, "pingpong", f"p{i}", rounds, args.hold, tmp / f"p{i}.json")
            for i in range(2)
        ]
        for proc in procs:
            if proc.wait() != 0:
                raise SystemExit("a ping-pong player failed")
        records = sorted(
            (r for i in range(2) for r in json.loads((tmp / f"p{i}.json").read_text())),
            key=lambda r: r["token"],
        )
        handoffs = [
            (after["got"] - before["release"]) * 1000
            for before, after in itertools.pairwise(records)
            if before["job"] != after["job"] and after["asked"] < before["release"]
        ][10:]  # drop warm-up
        print("uncontended: 1 process ...", flush=True)
        solo = spawn(stack.address, "solo", "solo", 210, 0.0, tmp / "solo.json")
        if solo.wait() != 0:
            raise SystemExit("the uncontended player failed")
        solo_records = json.loads((tmp / "solo.json").read_text())[10:]
        uncontended = [(r["released"] - r["asked"]) * 1000 for r in solo_records]

    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, "
        f"Python {platform.python_version()}",
        "handoffs": len(handoffs),
        "handoff_p50_ms": round(statistics.median(handoffs), 1),
        "handoff_p99_ms": round(percentile(handoffs, 0.99), 1),
        "handoff_max_ms": round(max(handoffs), 1),
        "uncontended_samples": len(uncontended),
        "uncontended_p50_ms": round(statistics.median(uncontended), 1),
        "uncontended_p99_ms": round(percentile(uncontended, 0.99), 1),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
