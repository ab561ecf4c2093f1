"""`make demo`: two real GRPO jobs time-slicing one GPU group, on the embedded Temporal server.

Starts `timeslice server` (gRPC 7233, Web UI 8233), the control worker, a node agent, and two
`timeslice job worker` processes running the `grpo-toy` workload (a small transformer learning
to sort digits with GRPO, on torch, on the CPU). Two `RLJobWorkflow`s then share one group:
each job holds it only to sample and to train, yields it during reward computation, and every
switch moves the resident job's state out (torch backend) and the next one's back in.

Live progress while they run, then a summary: each job's reward curve, the group's utilization,
switches and bytes moved, links into the Web UI, and the report (`timeslice report`): its text
tables, a timeline picture (PNG) and an HTML version under .timeslice/demo-report/. `--keep`
leaves everything running so the UI can be browsed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from timeslice.connection import connect, connect_config
from timeslice.jobs import describe_progress, parse_job_config, start_rl_job
from timeslice.report import (
    GroupReport,
    Report,
    collect_report,
    format_text,
    human_bytes,
    write_report,
)
from timeslice.server import EmbeddedServer
from timeslice.services import ServiceStartError, start_service
from timeslice.workflows.protocol import group_workflow_id
from timeslice.workflows.rl_protocol import RLJobProgress, RLJobResult, rl_job_workflow_id

STATE = Path(".timeslice")
GROUP = "shared-gpus"
JOBS = ("grpo-a", "grpo-b")
SPARK = "▁▂▃▄▅▆▇█"


def start(args: list[str], ready: str, log: Path) -> subprocess.Popen[str]:
    try:
        return start_service(args, ready, log, append=False, echo=True)
    except ServiceStartError as err:
        raise SystemExit(str(err)) from None


def sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


async def run_jobs(address: str, epochs: int) -> tuple[list[RLJobResult], Report]:
    client = await connect(connect_config(address))
    handles = []
    for seed, job in enumerate(JOBS):
        config = parse_job_config(
            {
                "job_id": job,
                "workload": "grpo-toy",
                "sampler_group": GROUP,
                "epochs": epochs,
                "seed": seed,
                "checkpoint_every": 10,
            }
        )
        handles.append(await start_rl_job(client, config))
    print(f"started {len(JOBS)} RL jobs sharing group {GROUP!r}; progress:", flush=True)
    shown: dict[str, str] = {}
    last_print = time.monotonic()
    pending = {asyncio.ensure_future(h.result()) for h in handles}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=1.0)
        for handle in handles:
            with contextlib.suppress(Exception):  # a job between runs answers a moment later
                p = await handle.query("progress", result_type=RLJobProgress)
                line = describe_progress(p)
                # One line per finished epoch, so the output stays readable.
                key = f"{p.epoch}"
                if shown.get(p.job_id) != key:
                    shown[p.job_id] = key
                    print(f"  {line}", flush=True)
                    last_print = time.monotonic()
        if time.monotonic() - last_print > 10:
            print("  ... still running", flush=True)
            last_print = time.monotonic()
    results = [await h.result() for h in handles]
    report = await collect_report(client, groups=[GROUP], jobs=list(JOBS))
    return results, report


def summarize(results: list[RLJobResult], group: GroupReport, ui_url: str | None) -> None:
    print("\nreward (mean over each epoch's completions):")
    for result in results:
        rewards = [r for r in result.rewards if r is not None]
        head = sum(rewards[:5]) / len(rewards[:5])
        tail = sum(rewards[-5:]) / len(rewards[-5:])
        print(
            f"  {result.job_id}: {sparkline(rewards)}  first 5 epochs {head:.3f} -> "
            f"last 5 {tail:.3f} ({result.epochs_done} epochs)"
        )
    for result in results:
        gpu = result.phase_s.get("sample", 0) + result.phase_s.get("train", 0)
        waited = sum(result.wait_s.values())
        print(f"  {result.job_id}: GPU phases {gpu:.1f} s, waited for the group {waited:.1f} s")
    print(
        f"  ({group.switches} switches, {human_bytes(group.bytes_moved)} moved. "
        "grpo-toy's phases last tens of milliseconds,\n   so Temporal's round trips dominate "
        "its wall time; with phases of seconds they fade: bench/replay.py)"
    )
    if ui_url:
        print("\nWeb UI:")
        print(f"  {ui_url}/namespaces/default/workflows")
        for job in JOBS:
            print(f"  {ui_url}/namespaces/default/workflows/{rl_job_workflow_id(job)}")
        print(f"  {ui_url}/namespaces/default/workflows/{group_workflow_id(GROUP)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--keep", action="store_true", help="leave everything running")
    args = parser.parse_args()
    if args.epochs < 5:
        raise SystemExit("--epochs must be >= 5 (the summary compares first and last 5)")

    STATE.mkdir(exist_ok=True)
    # A fresh database and checkpoints per demo, so the figures cover this run alone.
    db = STATE / "demo.db"
    for stale in db.parent.glob(db.name + "*"):
        stale.unlink()
    checkpoints = STATE / "demo-checkpoints"
    print("starting the embedded Temporal server ...", flush=True)
    server = EmbeddedServer(port=7233, ui_port=8233, db=db, log_path=STATE / "server.log")
    server.start()
    print(f"  Temporal at {server.address}, Web UI {server.ui_url}", flush=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        address = ["--address", server.address]
        procs.append(start(["worker", *address], "control worker", STATE / "worker.log"))
        procs.append(
            start(["agent", "--node", "demo-node", *address], "node agent", STATE / "agent.log")
        )
        for job in JOBS:
            cmd = ["job", "worker", "--job-id", job, "--workload", "grpo-toy", "--threads", "1"]
            cmd += ["--checkpoint-dir", str(checkpoints), *address]
            procs.append(start(cmd, f"job {job}", STATE / f"{job}.log"))
        results, report = asyncio.run(run_jobs(server.address, args.epochs))
        summarize(results, report.groups[0], server.ui_url)
        files = write_report(report, STATE / "demo-report")
        print("\nthe report (`timeslice report` prints it for any cluster):\n")
        print(format_text(report))
        print(f"\ntimeline picture: {files.png}\nHTML report:      {files.html}")
        if args.keep:
            print("\neverything keeps running; press Ctrl-C to stop", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.wait()
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


def entry() -> Any:
    code = main()
    sys.stdout.flush()
    # The SDK's native threads can crash a finished process at exit (temporalio/sdk-python#300).
    os._exit(code)


if __name__ == "__main__":
    entry()
