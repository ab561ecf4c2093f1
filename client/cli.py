"""The ``timeslice`` command: server, worker, agent, job, setup, status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from timeslice.connection import connect, connect_config
from timeslice.errors import TimesliceError
from timeslice.plan import cli as plan_cli
from timeslice.server import DEFAULT_DB, EmbeddedServer

if TYPE_CHECKING:
    from temporalio.worker import Worker

log = logging.getLogger("timeslice")
T = TypeVar("T")


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", help="Temporal HOST:PORT (default: $TEMPORAL_ADDRESS, then localhost:7233)"
    )
    parser.add_argument("--namespace", help="Temporal namespace (default: $TEMPORAL_NAMESPACE)")
    parser.add_argument("--profile", help="temporal CLI config profile ($TEMPORAL_PROFILE)")


def _metrics_address(value: str) -> str:
    from timeslice.telemetry import parse_metrics_address

    try:
        parse_metrics_address(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _add_metrics_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=_metrics_address,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default host 0.0.0.0; "
        "default: no endpoint); see docs/observability.md",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="timeslice", description="Co-operative GPU time-slicing for RL jobs, on Temporal."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    server = sub.add_parser("server", help="run the embedded Temporal server (dev server + UI)")
    server.add_argument("--port", type=int, default=7233, help="gRPC port (default 7233)")
    server.add_argument("--ui-port", type=int, default=8233, help="Web UI port (default 8233)")
    server.add_argument("--ip", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    server.add_argument(
        "--db", type=Path, default=DEFAULT_DB, help=f"SQLite database file (default {DEFAULT_DB})"
    )
    server.add_argument(
        "--dynamic-config",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="server dynamic config value, e.g. limit.historyCount.suggestContinueAsNew=200",
    )

    worker = sub.add_parser("worker", help="run the control worker (GPU-group workflows)")
    _add_metrics_arg(worker)
    _add_connection_args(worker)

    agent = sub.add_parser("agent", help="run the node agent (transparent snapshots on a node)")
    agent.add_argument("--node", required=True, help="this node's name (task queue suffix)")
    agent.add_argument(
        "--lock-timeout", type=float, default=10.0, help="cuda-checkpoint lock time-out, s"
    )
    agent.add_argument(
        "--simulated-bytes",
        type=int,
        default=None,
        help="also serve the `simulated` backend, reporting this many bytes per switch",
    )
    agent.add_argument(
        "--simulated-seconds", type=float, default=0.0, help="duration of a simulated switch"
    )
    _add_metrics_arg(agent)
    _add_connection_args(agent)

    setup = sub.add_parser("setup", help="register Timeslice's search attributes on a cluster")
    _add_connection_args(setup)

    _add_job_parsers(sub)
    plan_cli.add_parser(sub)

    report = sub.add_parser(
        "report", help="utilization, switches and waits per group; phase times per job"
    )
    report.add_argument("--group", action="append", default=[], help="a group (repeatable)")
    report.add_argument("--job", action="append", default=[], help="a job (repeatable)")
    report.add_argument(
        "--out",
        type=Path,
        default=Path(".timeslice/report"),
        help="folder for report.txt, report.html (interactive), timeline.png and trace.json "
        "(default .timeslice/report)",
    )
    report.add_argument(
        "--trace",
        type=Path,
        help="also write the timeline here in Chrome's trace-event format (Perfetto, "
        "chrome://tracing)",
    )
    report.add_argument("--text-only", action="store_true", help="print the tables, write nothing")
    _add_connection_args(report)

    status = sub.add_parser("status", help="show a GPU group's holder, queue and utilization")
    status.add_argument("group_id")
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    _add_connection_args(status)
    return parser


def _add_job_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    job = sub.add_parser("job", help="RL jobs: serve a job's phases, start, follow, stop")
    jobs = job.add_subparsers(dest="job_command", required=True)

    worker = jobs.add_parser("worker", help="serve one rank of an RL job (its model and phases)")
    worker.add_argument("--job-id", required=True)
    worker.add_argument("--rank", type=int, default=0, help="this process's rank (default 0)")
    worker.add_argument("--workload", required=True, help="grpo-toy, simulated, or MODULE:FACTORY")
    worker.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(".timeslice/checkpoints"),
        help="where checkpoints go (shared storage when ranks span nodes)",
    )
    worker.add_argument("--keep-checkpoints", type=int, default=3, help="per job (default 3)")
    worker.add_argument("--threads", type=int, help="torch CPU threads for this process")
    _add_metrics_arg(worker)
    _add_connection_args(worker)

    start = jobs.add_parser("start", help="start an RLJobWorkflow")
    start.add_argument("--config", type=Path, help="JSON file with the job config (RLJobConfig)")
    start.add_argument("--job-id")
    start.add_argument("--workload", help="grpo-toy, simulated, or MODULE:FACTORY")
    start.add_argument("--sampler-group")
    start.add_argument("--trainer-group", help="default: the sampler group")
    start.add_argument("--epochs", type=int)
    start.add_argument("--batch-size", type=int)
    start.add_argument("--group-size", type=int)
    start.add_argument("--seed", type=int)
    start.add_argument("--priority", type=int)
    start.add_argument("--ranks", type=int)
    start.add_argument("--lease-ttl", type=float, dest="lease_ttl_s")
    start.add_argument("--checkpoint-every", type=int)
    start.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="workload option, e.g. --option lr=0.003 (repeatable)",
    )
    start.add_argument("--wait", action="store_true", help="show progress until the job ends")
    _add_connection_args(start)

    progress = jobs.add_parser("progress", help="show a job's epoch, phase and rewards")
    progress.add_argument("job_id")
    progress.add_argument("--json", action="store_true")
    _add_connection_args(progress)

    stop = jobs.add_parser("stop", help="finish the current epoch, checkpoint, and stop")
    stop.add_argument("job_id")
    _add_connection_args(stop)


_START_FIELDS = (
    "job_id",
    "workload",
    "sampler_group",
    "trainer_group",
    "epochs",
    "batch_size",
    "group_size",
    "seed",
    "priority",
    "ranks",
    "lease_ttl_s",
    "checkpoint_every",
)


def _job_config_data(args: argparse.Namespace) -> dict[str, object]:
    data: dict[str, object] = {}
    if args.config is not None:
        try:
            loaded = json.loads(args.config.read_text())
        except OSError as err:
            raise TimesliceError(f"--config {args.config}: {err.strerror}") from err
        except json.JSONDecodeError as err:
            raise TimesliceError(f"--config {args.config}: not valid JSON ({err})") from err
        if not isinstance(loaded, dict):
            raise TimesliceError(f"--config {args.config}: expected a JSON object")
        data.update(loaded)
    for name in _START_FIELDS:
        value = getattr(args, name)
        if value is not None:
            data[name] = value
    if args.option:
        options = dict(data.get("workload_options") or {})  # type: ignore[call-overload]
        options.update(_key_json_pairs("--option", args.option))
        data["workload_options"] = options
    return data


def _key_json_pairs(flag: str, items: list[str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TimesliceError(f"{flag} {item!r}: use KEY=JSON, e.g. some.key=200")
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError as err:
            raise TimesliceError(f"{flag} {item!r}: value is not JSON ({err})") from err
    return values


async def _run_job_worker(args: argparse.Namespace) -> int:
    from timeslice.telemetry import worker_telemetry
    from timeslice.workers.job import build_job_runtime, build_job_worker
    from timeslice.workflows.protocol import job_task_queue

    try:
        runtime = build_job_runtime(
            args.job_id, args.rank, args.workload, args.checkpoint_dir, args.keep_checkpoints
        )
    except ValueError as err:
        raise TimesliceError(str(err)) from err
    if args.threads is not None:
        if args.threads < 1:
            raise TimesliceError(f"--threads must be >= 1, not {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    config = connect_config(args.address, args.namespace, profile=args.profile)
    async with worker_telemetry("timeslice-job-worker", args.metrics_port) as metrics:
        client = await connect(config, runtime=metrics.runtime if metrics else None)
        worker = build_job_worker(client, runtime)
        print(
            f"job {args.job_id} rank {args.rank}: workload {args.workload} on task queue "
            f"{job_task_queue(args.job_id, args.rank)!r}; Ctrl-C to stop",
            flush=True,
        )
        if metrics:
            print(f"metrics at {metrics.url}", flush=True)
        return await _serve(worker)


async def _run_job_start(args: argparse.Namespace) -> int:
    from timeslice.jobs import follow_job, parse_job_config, start_rl_job

    config = parse_job_config(_job_config_data(args))
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    handle = await start_rl_job(client, config)
    print(f"started job {config.job_id}: workflow {handle.id} (run {handle.result_run_id})")
    if not args.wait:
        print(f"follow it with: timeslice job progress {config.job_id}")
        return 0
    result = await follow_job(client, config.job_id, lambda line: print(line, flush=True))
    rewards = [r for r in result.rewards if r is not None]
    state = "stopped" if result.stopped else "completed"
    print(f"job {config.job_id} {state} after {result.epochs_done} epochs", end="")
    print(f"; reward {rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "")
    return 0


async def _run_job_progress(args: argparse.Namespace) -> int:
    from timeslice.jobs import describe_progress
    from timeslice.workflows.rl_protocol import RLJobProgress, rl_job_workflow_id

    workflow_id = _job_workflow_id(args.job_id, rl_job_workflow_id)  # before any connection
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    handle = client.get_workflow_handle(workflow_id)
    progress = await _rpc_job(args.job_id, handle.query("progress", result_type=RLJobProgress))
    print(progress.model_dump_json(indent=2) if args.json else describe_progress(progress))
    return 0


async def _run_job_stop(args: argparse.Namespace) -> int:
    from timeslice.workflows.rl_protocol import rl_job_workflow_id

    workflow_id = _job_workflow_id(args.job_id, rl_job_workflow_id)  # before any connection
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    handle = client.get_workflow_handle(workflow_id)
    await _rpc_job(args.job_id, handle.signal("stop"))
    print(f"asked job {args.job_id} to stop after its current epoch")
    return 0


def _job_workflow_id(job_id: str, to_id: Callable[[str], str]) -> str:
    try:
        return to_id(job_id)
    except ValueError as err:
        raise TimesliceError(str(err)) from err


async def _rpc_job(job_id: str, call: Awaitable[T]) -> T:
    from temporalio.service import RPCError, RPCStatusCode

    try:
        return await call
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise TimesliceError(f"no job {job_id!r} (workflow rl-job-{job_id})") from err
        raise


def _dynamic_config(items: list[str]) -> dict[str, object]:
    return _key_json_pairs("--dynamic-config", items)


def run_server(args: argparse.Namespace) -> int:
    server = EmbeddedServer(
        port=args.port,
        ui_port=args.ui_port,
        db=args.db,
        ip=args.ip,
        dynamic_config=_dynamic_config(args.dynamic_config),
        log_path=args.db.parent / "server.log",
    )
    print(f"starting Temporal dev server (database {args.db}) ...", flush=True)
    server.start()
    print(f"Temporal server ready at {server.address}", flush=True)
    print(f"Web UI: {server.ui_url}", flush=True)
    print(f"log: {server.log_path}; press Ctrl-C to stop", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        code = server.wait()
        print(f"Temporal server exited with code {code}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:
        print("stopping Temporal server ...", flush=True)
        server.stop()
        return 0


async def _run_worker(args: argparse.Namespace) -> int:
    from timeslice.telemetry import worker_telemetry
    from timeslice.workers.control import build_control_worker, check_search_attributes

    config = connect_config(args.address, args.namespace, profile=args.profile)
    async with worker_telemetry("timeslice-worker", args.metrics_port) as metrics:
        client = await connect(config, runtime=metrics.runtime if metrics else None)
        await check_search_attributes(client)
        worker = build_control_worker(client)
        print(
            f"control worker on task queue 'timeslice' at {config['target_host']} "
            f"(namespace {client.namespace}); Ctrl-C to stop",
            flush=True,
        )
        if metrics:
            print(f"metrics at {metrics.url}", flush=True)
        return await _serve(worker)


async def _run_agent(args: argparse.Namespace) -> int:
    from timeslice.snapshot.simulated import SimulatedBackend
    from timeslice.telemetry import worker_telemetry
    from timeslice.workers.node_agent import build_node_agent
    from timeslice.workflows.protocol import node_task_queue

    try:
        queue = node_task_queue(args.node)
        extra = (
            [SimulatedBackend(nbytes=args.simulated_bytes, snapshot_s=args.simulated_seconds)]
            if args.simulated_bytes is not None
            else []
        )
    except ValueError as err:
        raise TimesliceError(str(err)) from err
    config = connect_config(args.address, args.namespace, profile=args.profile)
    async with worker_telemetry("timeslice-agent", args.metrics_port) as metrics:
        client = await connect(config, runtime=metrics.runtime if metrics else None)
        agent = build_node_agent(
            client, args.node, extra_backends=extra, lock_timeout_s=args.lock_timeout
        )
        health = agent.health()
        names = [h.backend for h in health]
        print(
            f"node agent on task queue {queue!r} with backends {names}; Ctrl-C to stop",
            flush=True,
        )
        for h in health:
            print(f"  {h.backend}: {'ok' if h.ok else 'UNAVAILABLE'} - {h.detail}", flush=True)
        if metrics:
            print(f"metrics at {metrics.url}", flush=True)
        return await _serve(agent.worker)


async def _serve(worker: Worker) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        await stop.wait()
        print("stopping ...", flush=True)
    return 0


async def _run_setup(args: argparse.Namespace) -> int:
    from timeslice.workers.control import register_search_attributes

    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    added = await register_search_attributes(client)
    print(f"registered {added}" if added else "search attributes already registered")
    return 0


async def _run_report(args: argparse.Namespace) -> int:
    from timeslice.report import collect_report, format_text, write_report, write_trace

    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    print("reading groups and jobs from Temporal ...", file=sys.stderr, flush=True)
    report = await collect_report(client, groups=args.group or None, jobs=args.job or None)
    print(format_text(report))
    if args.trace is not None:
        print(f"wrote {write_trace(report, args.trace)}")
    if not args.text_only:
        files = write_report(report, args.out)
        print(f"wrote {files.text}, {files.html}, {files.png} and {files.trace}")
    return 0


async def _run_status(args: argparse.Namespace) -> int:
    from timeslice.orchestrator import AsyncTimeSliceOrchestratorClient

    client = AsyncTimeSliceOrchestratorClient(
        target=args.address, namespace=args.namespace, profile=args.profile, job_id="status-cli"
    )
    try:
        status = await client.group_status(args.group_id)
    finally:
        await client.close()
    if args.json:
        print(status.model_dump_json(indent=2))
        return 0
    holder = status.holder
    print(f"group {status.group_id}")
    held = f"{holder.job_id} (token {holder.token}, {holder.held_s:.1f} s)" if holder else "none"
    print(f"  holder:      {held}")
    print(f"  resident:    {status.resident_job or 'none'}")
    print(f"  queue:       {', '.join(w.job_id for w in status.queue) or 'empty'}")
    print(f"  utilization: {status.utilization:.1%} of {status.wall_s:.0f} s")
    print(
        f"  leases:      {status.stats.leases}, switches {status.stats.switches}, "
        f"expired {status.stats.expired}, stale messages {status.stats.stale_messages}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "server":
            return run_server(args)
        if args.command == "job":
            runner = {
                "worker": _run_job_worker,
                "start": _run_job_start,
                "progress": _run_job_progress,
                "stop": _run_job_stop,
            }[args.job_command]
            with contextlib.suppress(KeyboardInterrupt):
                return asyncio.run(runner(args))
            return 130
        runner = {
            "worker": _run_worker,
            "agent": _run_agent,
            "setup": _run_setup,
            "status": _run_status,
            "report": _run_report,
            "plan": plan_cli.run,
        }[args.command]
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(runner(args))
        return 130
    except TimesliceError as err:
        print(f"timeslice {args.command}: error: {err}", file=sys.stderr)
        return 2


def entry() -> None:
    """Console-script entry: run, flush, and exit without interpreter teardown.

    The Temporal SDK's native threads can touch Python during interpreter finalization and
    crash a process that finished its work (temporalio/sdk-python#300); nothing is left to
    clean up once the command has returned, so skip that phase.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
