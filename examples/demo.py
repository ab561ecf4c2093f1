"""`make demo`: what time-slicing buys — two real GRPO jobs, first each on its own GPU group, then
both sharing one, on the embedded Temporal server.

Starts `timeslice server` (gRPC 7233, Web UI 8233), the control worker and one `timeslice job
worker` per job and run, each running the `grpo-toy` workload (a small transformer learning to
sort digits with GRPO, torch on the CPU, one thread each). Every epoch samples (a GPU phase),
computes rewards — here with a verifier latency, as real verifiers and tools have, during which
the group is free for the other job — and trains (a GPU phase). The same two jobs, with the same
seeds, run **dedicated** (two groups, one each) and then **shared** (one group, taking turns,
every switch moving a job's state out and the next one's in). The demo ends with the two runs side
by side — group utilization, each job's completion time and reward curve, switches and bytes
moved — read from the runs' own records, and the shared run's report: its tables, a timeline
picture, an interactive HTML page and a trace file (Perfetto) under .timeslice/demo-report/.

    .venv/bin/python examples/demo.py            # 20 epochs, about 3 minutes on 2 cores
    .venv/bin/python examples/demo.py --quick    # 6 epochs
    .venv/bin/python examples/demo.py --device cuda   # the jobs' models on the GPU
    .venv/bin/python examples/demo.py --device cuda --option d_model=1024 --option layers=8
    .venv/bin/python examples/demo.py --workload hf-grpo --device cuda   # a transformers model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from timeslice.activities.group_requests import start_group
from timeslice.cli.server import EmbeddedServer
from timeslice.cli.services import ServiceStartError
from timeslice.cli.stack import JobWorker, Stack
from timeslice.jobs import describe_progress, parse_job_config, start_rl_job
from timeslice.protocol.group import (
    DEFAULT_GRANT_POLICY,
    GrantPolicy,
    GroupConfig,
    group_workflow_id,
)
from timeslice.protocol.rl_job import (
    JobQuery,
    RLJobProgress,
    RLJobResult,
    rl_job_workflow_id,
)
from timeslice.protocol.utilization import SINCE_CREATED, WHILE_JOBS_RAN, Utilization
from timeslice.report import Report, collect_report, format_text, human_bytes, write_report
from timeslice.report.model import GroupFigures
from timeslice.transport.connection import connect, connect_config
from timeslice.workloads.options import BUILTIN_OPTIONS

STATE = Path(".timeslice")
SPARK = "▁▂▃▄▅▆▇█"
SEEDS = (0, 1)
# Phases of about a second on one CPU thread (sampling 1,536 completions, training 4 PPO steps
# over them), and a 1.5-s verifier: each job alone keeps its group busy about half the time.
OPTIONS: dict[str, Any] = {"reward_latency_s": 1.5}
BATCH, GROUP_SIZE = 96, 16
WORKLOADS = ("grpo-toy", "hf-grpo")


@dataclass(frozen=True)
class Run:
    """One of the two runs: its jobs and the groups they sample and train on."""

    name: str
    jobs: tuple[str, ...]
    groups: tuple[str, ...]

    def group_of(self, index: int) -> str:
        return self.groups[index % len(self.groups)]


DEDICATED = Run("dedicated", ("alone-a", "alone-b"), ("gpus-a", "gpus-b"))
SHARED = Run("shared", ("shared-a", "shared-b"), ("shared-gpus",))


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))] for v in values)


async def run_jobs(
    address: str,
    run: Run,
    epochs: int,
    batch: int,
    options: dict[str, Any],
    policy: GrantPolicy = DEFAULT_GRANT_POLICY,
    workload: str = "grpo-toy",
) -> tuple[list[RLJobResult], dict[str, float]]:
    """Run the two jobs of ``run`` at once; their results and wall times (start to result)."""
    client = await connect(connect_config(address))
    for group in run.groups:  # each group under the grant policy asked for
        await start_group(client, GroupConfig(group_id=group, grant_policy=policy))
    started = time.monotonic()
    handles = []
    for index, (job, seed) in enumerate(zip(run.jobs, SEEDS, strict=True)):
        config = parse_job_config(
            {
                "job_id": job,
                "workload": workload,
                "workload_options": options,
                "batch_size": batch,
                "group_size": GROUP_SIZE,
                "sampler_group": run.group_of(index),
                "epochs": epochs,
                "seed": seed,
                "checkpoint_every": epochs,
            }
        )
        handles.append(await start_rl_job(client, config))
    where = " and ".join(run.groups)
    print(f"\n{run.name}: {len(run.jobs)} jobs on {where}; one line per epoch", flush=True)
    shown: dict[str, int] = {}
    wall: dict[str, float] = {}
    pending = {asyncio.ensure_future(h.result()): h for h in handles}
    while pending:
        done, _ = await asyncio.wait(pending, timeout=1.0)
        for future in done:
            wall[pending.pop(future).id] = time.monotonic() - started
        for handle in handles:
            with contextlib.suppress(Exception):  # a job between runs answers a moment later
                p = await handle.query(JobQuery.PROGRESS, result_type=RLJobProgress)
                if shown.get(p.job_id) != p.epoch:
                    shown[p.job_id] = p.epoch
                    print(f"  {describe_progress(p)}", flush=True)
    results = [await h.result() for h in handles]
    return results, {
        rl_job_workflow_id(r.job_id): wall[rl_job_workflow_id(r.job_id)] for r in results
    }


async def read_report(
    address: str, run: Run, dedicated_s: dict[str, float] | None = None
) -> Report:
    client = await connect(connect_config(address))
    return await collect_report(
        client, groups=list(run.groups), jobs=list(run.jobs), dedicated_s=dedicated_s
    )


def side_by_side(
    alone: Report, shared: Report, alone_wall: dict[str, float], shared_wall: dict[str, float]
) -> str:
    """The two runs' figures in two columns, read from their own records."""
    rows: list[tuple[str, str, str]] = []

    def groups(report: Report, window: Callable[[GroupFigures], Utilization]) -> str:
        return ", ".join(f"{g.group_id} {window(g).share:.0%}" for g in report.groups)

    rows.append(("GPU groups", str(len(alone.groups)), str(len(shared.groups))))
    rows.append(
        (
            f"utilization {WHILE_JOBS_RAN}",
            groups(alone, lambda g: g.while_jobs_ran),
            groups(shared, lambda g: g.while_jobs_ran),
        )
    )
    rows.append(
        (
            f"utilization {SINCE_CREATED}",
            groups(alone, lambda g: g.since_created),
            groups(shared, lambda g: g.since_created),
        )
    )
    for index in range(len(SEEDS)):
        a, s = alone.jobs[index], shared.jobs[index]
        a_wall = alone_wall[rl_job_workflow_id(a.job_id)]
        s_wall = shared_wall[rl_job_workflow_id(s.job_id)]
        rows.append(
            (
                f"job {index + 1}: completion",
                f"{a_wall:.1f} s",
                f"{s_wall:.1f} s ({s_wall / a_wall:.2f}x)",
            )
        )
        rows.append(
            (
                f"job {index + 1}: reward",
                f"{sparkline([r for r in a.rewards if r is not None])} "
                f"{a.reward_first:.2f} → {a.reward_last:.2f}",
                f"{sparkline([r for r in s.rewards if r is not None])} "
                f"{s.reward_first:.2f} → {s.reward_last:.2f}",
            )
        )
        rows.append(
            (
                f"job {index + 1}: GPU phases / waiting",
                f"{a.gpu_s:.1f} s / {a.waiting_s:.1f} s",
                f"{s.gpu_s:.1f} s / {s.waiting_s:.1f} s",
            )
        )

    def per_epoch(report: Report) -> str:
        epochs = sum(j.epochs_done for j in report.jobs)
        return f"{sum(g.switches for g in report.groups) / max(1, epochs):.2f}"

    rows.append(("switches per job per epoch", per_epoch(alone), per_epoch(shared)))
    rows.append(
        (
            "leases carried past a waiter",
            str(sum(g.carried for g in alone.groups)),
            str(sum(g.carried for g in shared.groups)),
        )
    )
    rows.append(
        (
            "switches, bytes moved",
            f"{sum(g.switches for g in alone.groups)}, "
            f"{human_bytes(sum(g.bytes_moved for g in alone.groups))}",
            f"{sum(g.switches for g in shared.groups)}, "
            f"{human_bytes(sum(g.bytes_moved for g in shared.groups))}",
        )
    )
    widths = [max(len(r[i]) for r in [("", "dedicated", "shared"), *rows]) for i in range(3)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(("", "dedicated", "shared"), widths, strict=True))
    ]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def workload_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, the value read as JSON where it parses (numbers, booleans), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main() -> int:
    # The docstring's first paragraph, whole (its first line alone stops mid-sentence).
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="6 epochs instead of 20")
    parser.add_argument("--keep", action="store_true", help="leave everything running")
    parser.add_argument("--out", type=Path, default=STATE / "demo-report")
    parser.add_argument("--state", type=Path, default=STATE, help="server database, logs")
    parser.add_argument("--port", type=int, default=7233)
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument(
        "--batch-size", type=int, default=BATCH, help="prompts per epoch (smaller: shorter phases)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="where the jobs' models compute (auto: cuda where available); on cuda every switch "
        "moves the holder's tensors to host memory and the next job's back",
    )
    parser.add_argument(
        "--grant-policy",
        choices=[p.value for p in GrantPolicy],
        default=DEFAULT_GRANT_POLICY.value,
        help="the groups' grant policy (phase_aware: a job keeps the group from train into its "
        "next sample, within bounds, even when the other waits; fifo: only when nobody waits)",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=WORKLOADS[0],
        help="what the jobs run: grpo-toy (a small torch transformer) or hf-grpo (the same "
        "GRPO on a locally made transformers causal LM; needs the trl extra)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        type=workload_option,
        metavar="KEY=VALUE",
        help="a workload option (`timeslice job options grpo-toy` lists them), e.g. "
        "d_model=1024; repeatable",
    )
    args = parser.parse_args()
    options = {**OPTIONS, "device": args.device, **dict(args.option)}
    try:  # before anything starts: a bad option fails here, with what to fix
        BUILTIN_OPTIONS[args.workload].parse(options)
    except ValueError as err:
        parser.error(str(err))
    epochs = 6 if args.quick else args.epochs
    if epochs < 2:
        raise SystemExit("--epochs must be >= 2")

    state = args.state
    state.mkdir(parents=True, exist_ok=True)
    # A fresh database and checkpoints per demo, so the figures cover this run alone.
    db = state / "demo.db"
    for stale in db.parent.glob(db.name + "*"):
        stale.unlink()
    checkpoints = state / "demo-checkpoints"
    print("starting the embedded Temporal server ...", flush=True)
    # Its control worker and the four job processes start side by side (each imports torch for
    # seconds), their logs beside the database; all stop when the demo ends.
    server = EmbeddedServer(
        port=args.port, ui_port=args.ui_port, db=db, log_path=state / "server.log"
    )
    stack = Stack(state, server=server, append=False, echo=True).start()
    print(f"  Temporal at {server.address}, Web UI {server.ui_url}", flush=True)
    try:
        try:
            stack.control_worker()
            worker_args = ("--threads", "1", "--checkpoint-dir", str(checkpoints))
            jobs = (*DEDICATED.jobs, *SHARED.jobs)
            stack.job_workers(*(JobWorker((job,), args.workload, worker_args) for job in jobs))
        except ServiceStartError as err:
            raise SystemExit(str(err)) from None
        policy = GrantPolicy(args.grant_policy)
        _, alone_wall = asyncio.run(
            run_jobs(
                server.address, DEDICATED, epochs, args.batch_size, options, policy, args.workload
            )
        )
        # Read now: a group's figures run from its creation to the report's query.
        alone = asyncio.run(read_report(server.address, DEDICATED))
        _, shared_wall = asyncio.run(
            run_jobs(
                server.address, SHARED, epochs, args.batch_size, options, policy, args.workload
            )
        )
        # The shared jobs' slowdown is against the same job's measured wall time alone.
        baseline = {
            s: alone_wall[rl_job_workflow_id(a)]
            for a, s in zip(DEDICATED.jobs, SHARED.jobs, strict=True)
        }
        shared = asyncio.run(read_report(server.address, SHARED, baseline))
        print(
            "\nthe same two jobs, dedicated groups vs one shared group "
            f"(grant policy {policy.value}):\n"
        )
        print(side_by_side(alone, shared, alone_wall, shared_wall))
        if args.device == "cpu":
            print(
                "\n(the CPU stands in for the GPUs: the two dedicated jobs computed at once on "
                "this machine's cores,\n so their phases ran slower than on a GPU each; the same "
                "seeds give the same rewards either way)"
            )
        else:
            print(
                "\n(the two dedicated groups were one physical device here: both jobs computed "
                "on it at once)"
            )
        files = write_report(shared, args.out)
        print("\nthe shared run's report (`timeslice report` prints it for any cluster):\n")
        print(format_text(shared))
        print(f"timeline picture:  {files.png}")
        print(f"interactive page:  {files.html}")
        print(f"trace (Perfetto):  {files.trace}")
        if server.ui_url:
            print("\nWeb UI (each job's Timeline tab is its phase timeline):")
            workflows = f"{server.ui_url}/namespaces/default/workflows"
            for job in (*SHARED.jobs, *DEDICATED.jobs):
                print(f"  {workflows}/{rl_job_workflow_id(job)}")
            print(f"  {workflows}/{group_workflow_id(SHARED.groups[0])}")
        if args.keep:
            print("\neverything keeps running; press Ctrl-C to stop", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                server.wait()
        return 0
    finally:
        stack.close()


def entry() -> Any:
    code = main()
    sys.stdout.flush()
    # The SDK's native threads can crash a finished process at exit (temporalio/sdk-python#300).
    os._exit(code)


if __name__ == "__main__":
    entry()
