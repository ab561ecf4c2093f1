"""The ``timeslice`` command: server, worker, agent, job, setup, status, groups, report, plan."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from temporalio.service import RPCError, RPCStatusCode
from timeslice.cli import groups as groups_cli
from timeslice.cli import pools as pools_cli
from timeslice.cli.server import DEFAULT_DB, EmbeddedServer
from timeslice.errors import TimesliceError
from timeslice.files import read_small_file, writable_folder
from timeslice.plan import cli as plan_cli
from timeslice.transport.connection import connect, connect_config
from timeslice.workloads.registry import BUILTIN

if TYPE_CHECKING:
    from temporalio.client import WorkflowHandle
    from temporalio.worker import Worker
    from timeslice.activities.job_runtime import JobRuntime
    from timeslice.protocol.group import GroupStatus
    from timeslice.report.model import GroupFigures
    from timeslice.workloads.options import OptionInfo

log = logging.getLogger("timeslice")
T = TypeVar("T")


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", help="Temporal HOST:PORT (default: $TEMPORAL_ADDRESS, then localhost:7233)"
    )
    parser.add_argument("--namespace", help="Temporal namespace (default: $TEMPORAL_NAMESPACE)")
    parser.add_argument("--profile", help="temporal CLI config profile ($TEMPORAL_PROFILE)")


def _ipv4_address(value: str) -> str:
    """An argparse type: an IPv4 address to bind, as the dev server takes it."""
    import ipaddress

    try:
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an IPv4 address (e.g. 127.0.0.1, or 0.0.0.0 for every interface)"
        ) from None


def _metrics_address(value: str) -> str:
    from timeslice.transport.telemetry import parse_metrics_address

    try:
        parse_metrics_address(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _number(
    kind: type[int] | type[float], *, above: float | None = None, at_least: float | None = None
) -> Callable[[str], float]:
    """An argparse type: a finite number of ``kind`` within the bound, or a clear error."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be > {above:g}, not {text}")
        if at_least is not None and not value >= at_least:
            raise argparse.ArgumentTypeError(f"must be >= {at_least:g}, not {text}")
        return value

    return parse


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
    _add_server_parsers(sub)
    _add_agent_parsers(sub)
    _add_job_parsers(sub)
    plan_cli.add_parser(sub)
    _add_reading_parsers(sub)
    _add_connection_args(groups_cli.add_parser(sub))
    pools_cli.add_parser(sub, _add_connection_args)
    return parser


def _add_server_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``server`` (the embedded Temporal server) and ``worker`` (the control worker)."""
    server = sub.add_parser("server", help="run the embedded Temporal server (dev server + UI)")
    server.add_argument("--port", type=int, default=7233, help="gRPC port (default 7233)")
    server.add_argument("--ui-port", type=int, default=8233, help="Web UI port (default 8233)")
    server.add_argument(
        "--ip", type=_ipv4_address, default="127.0.0.1",
        help="IPv4 address to bind (default 127.0.0.1; 0.0.0.0: every interface)",
    )  # fmt: skip
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
    worker.add_argument(
        "--sticky-timeout",
        type=_number(float, above=0),
        default=None,
        metavar="S",
        help="how long a group's next workflow task waits for the worker that ran its last "
        "one before any control worker may take it: what a killed worker costs its groups "
        "(default 3)",
    )
    worker.add_argument(
        "--sandboxed",
        action="store_true",
        help="run the workflows in Temporal's sandbox, which checks every call they make at "
        "run time (for developing workflow code; costs CPU on every workflow task)",
    )
    _add_connection_args(worker)


def _add_agent_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``agent`` (the node agent), ``agent-token`` and ``setup``."""
    agent = sub.add_parser("agent", help="run the node agent (evicts whole processes on a node)")
    agent.add_argument("--node", required=True, help="this node's name (task queue suffix)")
    agent.add_argument(
        "--lock-timeout",
        type=_number(float, above=0),
        default=10.0,
        help="cuda-checkpoint lock time-out, s (default 10)",
    )
    agent.add_argument(
        "--simulated-bytes",
        type=_number(int, at_least=0),
        default=None,
        help="also serve the `simulated` backend, reporting this many bytes per switch",
    )
    agent.add_argument(
        "--simulated-seconds",
        type=_number(float, at_least=0),
        default=0.0,
        help="duration of a simulated switch, s (default 0)",
    )
    _add_key_file_arg(
        agent, "the key job tokens are made with", "agent.key beside the socket, created if missing"
    )
    _add_metrics_arg(agent)
    _add_connection_args(agent)

    token = sub.add_parser(
        "agent-token",
        help="print a job's node-agent token: launch the job's processes with "
        "TIMESLICE_JOB_TOKEN set to it",
    )
    token.add_argument("job_id", help="the job the token is for")
    _add_key_file_arg(token, "the agent's key", "agent.key in the agent's folder")

    setup = sub.add_parser(
        "setup",
        help="register Timeslice's search attributes in a namespace and report what it has "
        "(exit 1 if any is still missing)",
    )
    _add_connection_args(setup)


def _add_key_file_arg(parser: argparse.ArgumentParser, what: str, otherwise: str) -> None:
    """``--key-file``: the node agent's key, which job tokens are made with."""
    parser.add_argument(
        "--key-file",
        type=Path,
        default=None,
        help=f"{what} (default $TIMESLICE_AGENT_KEY_FILE, else {otherwise})",
    )


def _add_reading_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``report``, ``status`` and ``backends``: what reads the cluster and this host."""
    report = sub.add_parser(
        "report", help="utilization, switches and waits per group; phase times per job"
    )
    report.add_argument("--group", action="append", default=[], help="a group (repeatable)")
    report.add_argument("--job", action="append", default=[], help="a job (repeatable)")
    report.add_argument(
        "--pool",
        help="a pool's groups and every job it placed (moves marked on the jobs' lanes)",
    )
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
    status.add_argument(
        "--json",
        action="store_true",
        help="print the status as JSON: the group's answer (its held_share) with the "
        "utilization of its jobs' GPU phases",
    )
    _add_connection_args(status)

    backends = sub.add_parser(
        "backends",
        help="the snapshot backends: where each runs, what it moves, whether what it needs is "
        "installed here",
    )
    backends.add_argument("--json", action="store_true", help="one JSON object per backend")


_WORKLOAD_HELP = (
    f"a built-in workload ({', '.join(sorted(BUILTIN))}) or MODULE:FACTORY (your own Workload "
    "subclass); `timeslice job options WORKLOAD` lists its options"
)


def _add_job_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    job = sub.add_parser("job", help="RL jobs: serve a job's phases, start, follow, stop")
    jobs = job.add_subparsers(dest="job_command", required=True)
    _add_job_worker_parser(jobs)
    _add_job_start_parser(jobs)
    progress = jobs.add_parser(
        "progress", help="show a job's epoch, phase and rewards (exit 1 if it failed)"
    )
    progress.add_argument("job_id")
    progress.add_argument("--json", action="store_true", help="print the progress as JSON")
    _add_connection_args(progress)

    stop = jobs.add_parser(
        "stop", help="finish the current epoch (an async job: step), checkpoint, and stop"
    )
    stop.add_argument("job_id")
    _add_connection_args(stop)

    options = jobs.add_parser(
        "options",
        help="list a workload's options (--option KEY=JSON): type, default, what each does",
    )
    options.add_argument("workload", help=_WORKLOAD_HELP)


def _add_job_worker_parser(jobs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``job worker``: one rank of one job (or of several) in this process."""
    worker = jobs.add_parser("worker", help="serve one rank of an RL job (its model and phases)")
    worker.add_argument(
        "--job-id",
        required=True,
        action="append",
        dest="job_ids",
        help="the job this process serves; repeated, one process serves a rank of each job "
        "named (one workload instance each, on one event loop: for benches and light "
        "workloads; one job per process is the default)",
    )
    worker.add_argument(
        "--rank", type=_number(int, at_least=0), default=0, help="this process's rank (default 0)"
    )
    worker.add_argument("--workload", required=True, help=_WORKLOAD_HELP)
    worker.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(".timeslice/checkpoints"),
        help="where checkpoints go (shared storage when ranks span nodes; "
        "default .timeslice/checkpoints)",
    )
    worker.add_argument(
        "--keep-checkpoints",
        type=_number(int, at_least=1),
        default=3,
        help="checkpoints kept per job, newest first (default 3)",
    )
    worker.add_argument(
        "--threads", type=_number(int, at_least=1), help="torch CPU threads for this process"
    )
    worker.add_argument(
        "--keep-serving",
        action="store_true",
        help="keep serving after the run this process serves has ended (by default it exits "
        "then: a job process serves one run, and a new run needs a new process)",
    )
    _add_metrics_arg(worker)
    _add_connection_args(worker)


def _add_job_start_parser(jobs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``job start``: the job's config, from a file and flags (``_START_FIELDS``)."""
    start = jobs.add_parser(
        "start",
        help="start an RLJobWorkflow",
        description="Start an RL job (RLJobWorkflow, id rl-job-JOB_ID). Flags override the "
        "--config file's fields; `timeslice job worker` processes must serve it.",
    )
    start.add_argument("--config", type=Path, help="JSON file with the job config (RLJobConfig)")
    start.add_argument(
        "--mode",
        choices=["sync", "async"],
        help="sync (default): sample, score, train in turn; async: sampler and trainer at once "
        "on two groups (AsyncRLJobWorkflow; needs --trainer-group)",
    )
    start.add_argument(
        "--max-staleness",
        type=int,
        help="async: the most weights versions a batch's sampler may lag the trainer (default 1)",
    )
    start.add_argument(
        "--sync-every",
        type=int,
        help="async: publish the trainer's weights to the sampler every N steps (default 1)",
    )
    start.add_argument(
        "--job-id", help="the job's id: names one run (required here or in --config)"
    )
    start.add_argument("--workload", help=_WORKLOAD_HELP)
    start.add_argument("--sampler-group", help="the GPU group the sampling phase runs on")
    start.add_argument(
        "--trainer-group", help="the group training runs on (default: the sampler's)"
    )
    start.add_argument(
        "--pool", help="a pool (`timeslice pool create`) that places the job, instead of groups"
    )
    start.add_argument(
        "--job-profile",
        type=Path,
        dest="profile_file",
        help="with --pool: the job's declared profile, YAML or JSON (`timeslice plan schema`)",
    )
    start.add_argument(
        "--place-anyway",
        action="store_true",
        default=None,
        help="with --pool: the least bad group instead of the pool's queue when none fits",
    )
    start.add_argument(
        "--tenant",
        help="with --pool: the tenant whose quota and weight the job counts against",
    )
    start.add_argument("--epochs", type=int, help="epochs to run (sample, reward, train)")
    start.add_argument("--batch-size", type=int, help="prompts per epoch")
    start.add_argument("--group-size", type=int, help="completions per prompt (GRPO group)")
    start.add_argument("--seed", type=int, help="seed of the model and the data")
    start.add_argument(
        "--priority", type=int, help="lease priority: higher is served first (ages with waiting)"
    )
    start.add_argument("--ranks", type=int, help="job processes (ranks) per phase (default 1)")
    start.add_argument(
        "--lease-ttl",
        type=_number(float),
        dest="lease_ttl_s",
        help="seconds a lease lives unless renewed (default: the group's)",
    )
    start.add_argument("--checkpoint-every", type=int, help="epochs between checkpoints")
    start.add_argument(
        "--process-wait",
        type=_number(float, above=0),
        dest="process_wait_s",
        metavar="S",
        help="how long the job waits for its job processes (`timeslice job worker`) before it "
        "fails, s (default 3600); the missing ones are named at once either way",
    )
    start.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="workload option, e.g. --option lr=0.003 (repeatable)",
    )
    start.add_argument("--wait", action="store_true", help="show progress until the job ends")
    _add_connection_args(start)


_START_FIELDS = (
    "mode",
    "max_staleness",
    "sync_every",
    "job_id",
    "workload",
    "sampler_group",
    "trainer_group",
    "pool",
    "place_anyway",
    "tenant",
    "epochs",
    "batch_size",
    "group_size",
    "seed",
    "priority",
    "ranks",
    "lease_ttl_s",
    "checkpoint_every",
    "process_wait_s",
)


def _job_config_data(args: argparse.Namespace) -> dict[str, object]:
    data: dict[str, object] = {}
    if args.config is not None:
        # Its own errors name the file already.
        text = read_small_file(args.config, "--config", MAX_CONFIG_BYTES)
        try:
            loaded = json.loads(text, parse_constant=_refuse_non_finite)
        except json.JSONDecodeError as err:
            raise TimesliceError(f"--config {args.config}: not valid JSON ({err})") from err
        except ValueError as err:
            raise TimesliceError(f"--config {args.config}: {err}") from err
        if not isinstance(loaded, dict):
            raise TimesliceError(f"--config {args.config}: expected a JSON object")
        data.update(loaded)
    for name in _START_FIELDS:
        value = getattr(args, name)
        if value is not None:
            data[name] = value
    if args.profile_file is not None:
        from timeslice.plan.profile import load_profile

        data["profile"] = load_profile(args.profile_file).model_dump(
            mode="json", exclude={"job_id"}
        )
    if args.option:
        given = data.get("workload_options") or {}
        if not isinstance(given, dict):
            raise TimesliceError(
                f"workload_options must be a JSON object (name: value), not "
                f"{type(given).__name__}: {given!r:.80}"
            )
        options = dict(given)
        options.update(_key_json_pairs("--option", args.option))
        data["workload_options"] = options
    return data


MAX_CONFIG_BYTES = 1 << 20


def _refuse_non_finite(constant: str) -> float:
    """JSON's NaN / Infinity (Python's json reads them) are not numbers a setting can take."""
    raise ValueError(f"{constant} is not a finite number")


def _check_ids(*kinds: tuple[str, list[str]]) -> None:
    """Refuse a malformed id before connecting, saying what an id may hold."""
    from timeslice.protocol.group import check_id

    for kind, values in kinds:
        for value in values:
            try:
                check_id(kind, value)
            except ValueError as err:
                raise TimesliceError(str(err)) from None


def _key_json_pairs(flag: str, items: list[str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TimesliceError(f"{flag} {item!r}: use KEY=JSON, e.g. some.key=200")
        try:
            values[key] = json.loads(raw, parse_constant=_refuse_non_finite)
        except json.JSONDecodeError as err:
            raise TimesliceError(f"{flag} {item!r}: value is not JSON ({err})") from err
        except ValueError as err:
            raise TimesliceError(f"{flag} {item!r}: {err}") from err
    return values


def _limit_torch_threads(threads: int) -> None:
    """torch's CPU threads in this process, without importing torch for a workload that does
    not use it (its import is seconds of CPU, paid by every `simulated` job process): set now
    if the workload imported it, else by OMP_NUM_THREADS, which torch reads when imported."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


async def _run_job_worker(args: argparse.Namespace) -> int:
    from timeslice.protocol.group import job_task_queue
    from timeslice.transport.telemetry import worker_telemetry
    from timeslice.workers.job import build_job_runtime, build_job_worker, run_ended

    if len(set(args.job_ids)) < len(args.job_ids):
        raise TimesliceError(f"--job-id names a job twice: {' '.join(args.job_ids)}")
    # At start-up, not at the first checkpoint: one that cannot be written fails every epoch
    # that checkpoints, and the job only after max_failures rewinds of GPU time.
    writable_folder(args.checkpoint_dir, "--checkpoint-dir")
    try:
        runtimes = [
            build_job_runtime(
                job_id, args.rank, args.workload, args.checkpoint_dir, args.keep_checkpoints
            )
            for job_id in args.job_ids
        ]
    except ValueError as err:
        raise TimesliceError(str(err)) from err
    if args.threads is not None:
        _limit_torch_threads(args.threads)
    config = connect_config(args.address, args.namespace, profile=args.profile)
    async with worker_telemetry("timeslice-job-worker", args.metrics_port) as metrics:
        client = await connect(config, runtime=metrics.runtime if metrics else None)
        workers = [build_job_worker(client, runtime) for runtime in runtimes]
        for runtime in runtimes:
            print(
                f"job {runtime.job_id} rank {args.rank}: workload {args.workload} on task "
                f"queue {job_task_queue(runtime.job_id, args.rank)!r}; Ctrl-C to stop",
                flush=True,
            )
        if metrics:
            print(f"metrics {metrics.where}", flush=True)

        async def every_run_ended() -> None:
            async def one(runtime: JobRuntime) -> None:
                how = await run_ended(client, runtime)
                print(f"job {runtime.job_id} rank {args.rank}: {how}", flush=True)

            await asyncio.gather(*(one(runtime) for runtime in runtimes))
            print(
                "every run this process served has ended: exiting (--keep-serving keeps a job "
                "process up; a new run of a job needs a new one)",
                flush=True,
            )

        code = await _serve(*workers, until=None if args.keep_serving else every_run_ended())
        for runtime in runtimes:
            try:
                await runtime.depart()
            except (TimeoutError, TimesliceError) as err:  # the groups fall back on time-outs
                print(
                    f"job {runtime.job_id}: could not tell the groups this process left: {err}",
                    file=sys.stderr,
                )
        return code


async def _run_job_start(args: argparse.Namespace) -> int:
    from temporalio.client import WorkflowFailureError
    from timeslice.cli.groups import new_group_notes
    from timeslice.jobs import (
        follow_async_job,
        follow_job,
        parse_any_job_config,
        start_any_rl_job,
        why_waiting,
    )
    from timeslice.protocol.async_rl_job import AsyncRLJobConfig

    config = parse_any_job_config(_job_config_data(args))  # options too, before anything
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    flags = _connection_flags(args)
    for note in await new_group_notes(client, config):
        print(note, file=sys.stderr, flush=True)
    handle = await start_any_rl_job(client, config)
    print(f"started job {config.job_id}: workflow {handle.id} (run {handle.result_run_id})")
    if not args.wait:
        for missing in await why_waiting(client, config.job_id, config, flags):
            print(missing, file=sys.stderr)
        print(f"follow it with: timeslice job progress {config.job_id}")
        return 0
    try:
        follow = follow_async_job if isinstance(config, AsyncRLJobConfig) else follow_job
        result = await follow(
            client, config.job_id, lambda line: print(line, flush=True), config=config, flags=flags
        )
    except WorkflowFailureError as err:
        cause = err.cause
        print(
            f"job {config.job_id} failed: {getattr(cause, 'message', None) or cause or err}",
            file=sys.stderr,
        )
        return 1
    rewards = [r for r in result.rewards if r is not None]
    state = "stopped" if result.stopped else "completed"
    unit = "steps" if isinstance(config, AsyncRLJobConfig) else "epochs"
    print(f"job {config.job_id} {state} after {result.epochs_done} {unit}", end="")
    print(f"; reward {rewards[0]:.3f} -> {rewards[-1]:.3f}" if rewards else "")
    return 0


async def _run_job_progress(args: argparse.Namespace) -> int:
    from timeslice.jobs import (
        QUERY_TIMEOUT,
        WAITING_FOR_PROCESSES,
        describe_async_progress,
        describe_progress,
        job_failure,
        no_control_worker,
        why_waiting,
    )
    from timeslice.protocol.async_rl_job import ASYNC_RL_JOB_WORKFLOW_TYPE, AsyncRLJobProgress
    from timeslice.protocol.group import CONTROL_TASK_QUEUE
    from timeslice.protocol.rl_job import JobQuery, RLJobProgress, rl_job_workflow_id
    from timeslice.transport.connection import pollers

    workflow_id = _job_workflow_id(args.job_id, rl_job_workflow_id)  # before any connection
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    handle = client.get_workflow_handle(workflow_id)
    described = await _rpc_job(args.job_id, handle.describe())
    ended_badly = job_failure(described.status)
    is_async = described.workflow_type == ASYNC_RL_JOB_WORKFLOW_TYPE
    flags = _connection_flags(args)
    progress: RLJobProgress | None = None
    if not await pollers(client, CONTROL_TASK_QUEUE):
        # Any query (a closed run's too, which is replayed) would wait for one in silence.
        raise TimesliceError(f"job {args.job_id}: {no_control_worker(client, flags)}")
    try:
        progress = await handle.query(
            JobQuery.PROGRESS,
            result_type=AsyncRLJobProgress if is_async else RLJobProgress,
            rpc_timeout=QUERY_TIMEOUT,
        )
    except Exception:
        if ended_badly is None:
            raise
        progress = None  # a job that failed on its input has no progress to show
    if isinstance(progress, AsyncRLJobProgress):
        print(
            progress.model_dump_json(indent=2) if args.json else describe_async_progress(progress)
        )
    elif progress is not None:
        print(progress.model_dump_json(indent=2) if args.json else describe_progress(progress))
    if progress is not None and progress.phase.startswith(WAITING_FOR_PROCESSES):
        for missing in await why_waiting(client, args.job_id, flags=flags):
            print(missing, file=sys.stderr)
    if ended_badly is None:
        return 0
    try:
        await handle.result()
        reason = ""
    except Exception as err:  # what the workflow failed with, said once
        cause = getattr(err, "cause", None)
        reason = f": {getattr(cause, 'message', None) or cause or err}"
    print(f"job {args.job_id} {ended_badly}{reason}", file=sys.stderr)
    return 1


async def _run_job_stop(args: argparse.Namespace) -> int:
    from timeslice.protocol.rl_job import JobSignal, rl_job_workflow_id

    workflow_id = _job_workflow_id(args.job_id, rl_job_workflow_id)  # before any connection
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    handle = client.get_workflow_handle(workflow_id)
    await _rpc_job(args.job_id, handle.signal(JobSignal.STOP))
    print(f"asked job {args.job_id} to stop after its current {await _job_unit(handle)}")
    return 0


async def _job_unit(handle: WorkflowHandle[Any, Any]) -> str:
    """What one unit of the job's work is called: an epoch, or an async job's step."""
    from timeslice.protocol.async_rl_job import ASYNC_RL_JOB_WORKFLOW_TYPE

    described = await handle.describe()
    return "step" if described.workflow_type == ASYNC_RL_JOB_WORKFLOW_TYPE else "epoch"


async def _run_job_options(args: argparse.Namespace) -> int:
    from timeslice.workloads.options import BUILTIN_OPTIONS
    from timeslice.workloads.registry import load_workload

    options_type = BUILTIN_OPTIONS.get(args.workload)
    if options_type is None:
        try:  # your own workload: its module is imported to find its options class
            options_type = load_workload(args.workload).options_type
        except ValueError as err:
            raise TimesliceError(str(err)) from err
    if options_type is None:
        print(
            f"workload {args.workload!r} declares no options class (options_type); its "
            "documentation says which options it takes"
        )
        return 0
    print(format_options(args.workload, options_type.describe()))
    return 0


def format_options(workload: str, infos: list[OptionInfo]) -> str:
    """``timeslice job options``: one option a paragraph, its type, default and meaning."""
    import textwrap

    lines = [
        f"{workload}: workload options (`timeslice job start --option KEY=JSON`, or "
        '"workload_options" in the job\'s config); all optional',
        "",
    ]
    for info in infos:
        lines.append(f"  {info.name} ({info.type}, default {json.dumps(info.default)})")
        indent = " " * 6
        lines += textwrap.wrap(info.doc, 92, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)


def _connection_flags(args: argparse.Namespace) -> str:
    """The connection flags this command was given, for the commands it tells the user to run
    (the environment, TEMPORAL_ADDRESS and the rest, carries over by itself)."""
    given = [("--address", args.address), ("--namespace", args.namespace)]
    given.append(("--profile", args.profile))
    return "".join(f" {flag} {value}" for flag, value in given if value)


def _job_workflow_id(job_id: str, to_id: Callable[[str], str]) -> str:
    try:
        return to_id(job_id)
    except ValueError as err:
        raise TimesliceError(str(err)) from err


async def _rpc_job(job_id: str, call: Awaitable[T]) -> T:
    try:
        return await call
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            # Temporal answers a signal to a run that has ended NOT_FOUND too.
            if "already completed" in err.message:
                raise TimesliceError(
                    f"job {job_id!r} has already ended: `timeslice job progress {job_id}` says how"
                ) from err
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
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"starting Temporal dev server (database {args.db}) ...", flush=True)
    try:
        server.start()
    except KeyboardInterrupt:
        # Stopped while it started (Ctrl-C, or SIGTERM above): its child goes too.
        print("stopping Temporal server (it had not started) ...", flush=True)
        server.stop()
        return 130
    print(f"Temporal server ready at {server.address}", flush=True)
    print(f"Web UI: {server.ui_url}", flush=True)
    print(f"log: {server.log_path}; press Ctrl-C to stop", flush=True)
    try:
        code = server.wait()
        print(f"Temporal server exited with code {code}", file=sys.stderr)
        return code or 1
    except KeyboardInterrupt:
        print("stopping Temporal server ...", flush=True)
        server.stop()
        return 0


async def _run_worker(args: argparse.Namespace) -> int:
    from timeslice.plan.placement import place_pool_job, plan_pool_move
    from timeslice.transport.telemetry import worker_telemetry
    from timeslice.workers.control import (
        STICKY_TIMEOUT_S,
        build_control_worker,
        check_search_attributes,
    )

    config = connect_config(args.address, args.namespace, profile=args.profile)
    async with worker_telemetry("timeslice-worker", args.metrics_port) as metrics:
        client = await connect(config, runtime=metrics.runtime if metrics else None)
        await check_search_attributes(client)
        worker = build_control_worker(
            client,
            sticky_timeout_s=args.sticky_timeout or STICKY_TIMEOUT_S,
            extra_activities=[place_pool_job, plan_pool_move],
            sandboxed=args.sandboxed,
        )
        print(
            f"control worker on task queue 'timeslice' at {config['target_host']} "
            f"(namespace {client.namespace}"
            f"{'; workflows in the sandbox' if args.sandboxed else ''}); Ctrl-C to stop",
            flush=True,
        )
        if metrics:
            print(f"metrics {metrics.where}", flush=True)
        return await _serve(worker)


async def _run_agent(args: argparse.Namespace) -> int:
    from timeslice.protocol.group import node_task_queue
    from timeslice.snapshot.registration import RegistrationError
    from timeslice.snapshot.simulated import SimulatedBackend
    from timeslice.transport.telemetry import worker_telemetry
    from timeslice.workers.node_agent import build_node_agent

    if args.simulated_bytes is None and args.simulated_seconds:
        raise TimesliceError(
            "--simulated-seconds sets the simulated backend's switch time: give "
            "--simulated-bytes too (the backend serves only with its size)"
        )
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
            client,
            args.node,
            extra_backends=extra,
            backend_options={"cuda-checkpoint": {"lock_timeout_s": args.lock_timeout}},
            key_file=args.key_file,
        )
        try:
            await agent.registration.start()
        except RegistrationError as err:
            raise TimesliceError(str(err)) from err
        health = agent.health()
        names = [h.backend for h in health]
        print(
            f"node agent on task queue {queue!r} with backends {names}; Ctrl-C to stop",
            flush=True,
        )
        for h in health:
            print(f"  {h.backend}: {'ok' if h.ok else 'UNAVAILABLE'} - {h.detail}", flush=True)
        print(f"  job processes register at {agent.registration.path}", flush=True)
        if metrics:
            print(f"metrics {metrics.where}", flush=True)
        try:
            return await _serve(agent.worker)
        finally:
            await agent.registration.close()


async def _run_agent_token(args: argparse.Namespace) -> int:
    from timeslice.protocol.group import check_id
    from timeslice.snapshot.registration import (
        RegistrationError,
        job_token,
        key_path,
        load_agent_key,
    )

    try:
        check_id("job id", args.job_id)
        key = load_agent_key(args.key_file or key_path())
    except (ValueError, RegistrationError) as err:
        raise TimesliceError(str(err)) from err
    print(job_token(key, args.job_id))
    return 0


async def _serve(*workers: Worker, until: Coroutine[None, None, None] | None = None) -> int:
    """Run ``workers`` until SIGINT / SIGTERM, or until ``until`` (if given) returns."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as serving:
        for worker in workers:
            await serving.enter_async_context(worker)
        waits = {asyncio.ensure_future(stop.wait())}
        if until is not None:
            waits.add(asyncio.ensure_future(until))
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # a failure of ``until`` is the command's
        print("stopping ...", flush=True)
    return 0


async def _run_setup(args: argparse.Namespace) -> int:
    from timeslice.workers.control import set_up_namespace

    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    report = await set_up_namespace(client)
    print("\n".join(report.lines()))
    return 1 if report.missing else 0


async def _group_exists(client: Any, group: str) -> bool:
    from temporalio.service import RPCError, RPCStatusCode
    from timeslice.protocol.group import group_workflow_id

    try:
        await client.get_workflow_handle(group_workflow_id(group)).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


async def _run_report(args: argparse.Namespace) -> int:
    from timeslice.report import collect_report, format_text, write_report, write_trace

    if not args.text_only:
        writable_folder(args.out, "--out")  # before the work, not after it
    if args.trace is not None:
        writable_folder(args.trace.parent, "--trace")
    _check_ids(("group id", args.group), ("job id", args.job), ("pool name", [args.pool or "p"]))
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    print("reading groups and jobs from Temporal ...", file=sys.stderr, flush=True)
    groups, jobs = list(args.group), list(args.job)
    if args.pool is not None:
        from timeslice.pools import pool_members

        in_pool = await pool_members(client, args.pool)
        for group in in_pool[0]:  # a group no job ever leased has no workflow to read
            if group not in groups and await _group_exists(client, group):
                groups.append(group)
        jobs += [j for j in in_pool[1] if j not in jobs]
    report = await collect_report(client, groups=groups or None, jobs=jobs or None)
    print(format_text(report))
    if args.trace is not None:
        print(f"wrote {write_trace(report, args.trace)}")
    if not args.text_only:
        files = write_report(report, args.out)
        print(f"wrote {files.text}, {files.html}, {files.png} and {files.trace}")
    return 0


async def _run_groups(args: argparse.Namespace) -> int:
    client = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    return await groups_cli.run(args, client, _connection_flags(args))


async def _run_pool(args: argparse.Namespace) -> int:
    config = connect_config(args.address, args.namespace, profile=args.profile)
    return await pools_cli.run(args, lambda: connect(config), _connection_flags(args))


async def _run_backends(args: argparse.Namespace) -> int:
    from timeslice.snapshot.base import SnapshotError
    from timeslice.snapshot.registry import BACKENDS

    rows = []
    for found in BACKENDS.values():
        try:
            capabilities = [str(c) for c in sorted(found.capabilities())]
        except SnapshotError:
            capabilities = []
        missing = found.missing()
        rows.append(
            {
                "name": found.name,
                "runs in": str(found.placement),
                "moves": found.moves,
                "capabilities": capabilities,
                "extra": found.extra,
                "client may name it": found.by_name,
                "installed here": "yes" if missing is None else f"no: {missing}",
            }
        )
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        extra = f"timeslice[{row['extra']}]" if row["extra"] else "-"
        print(f"{row['name']}  (runs in the {row['runs in']}; extra {extra})")
        print(f"  moves:        {row['moves']}")
        print(f"  capabilities: {', '.join(row['capabilities']) or '-'}")
        print(f"  installed:    {row['installed here']}")
    return 0


async def _run_status(args: argparse.Namespace) -> int:
    from timeslice.cli.groups import require_control_worker
    from timeslice.orchestrator import AsyncTimeSliceOrchestratorClient
    from timeslice.protocol.group import check_id
    from timeslice.report.figures import status_with_utilization
    from timeslice.report.gather import status_figures

    try:
        check_id("group id", args.group_id)  # before any connection
    except ValueError as err:
        raise TimesliceError(str(err)) from None
    raw = await connect(connect_config(args.address, args.namespace, profile=args.profile))
    await require_control_worker(raw, _connection_flags(args))  # or the query waits for one
    client = AsyncTimeSliceOrchestratorClient(
        target=args.address, namespace=args.namespace, profile=args.profile, job_id="status-cli"
    )
    try:
        status = await client.group_status(args.group_id)  # as of now (the reader's clock)
    finally:
        await client.close()
    # Utilization counts GPU phases: the RL jobs among the holders are read for theirs, the
    # report's way, so status (its text and its JSON) and report say one figure.
    figures = await status_figures(raw, status)
    if args.json:
        print(status_with_utilization(status, figures).model_dump_json(indent=2))
    else:
        print(format_status(status, figures))
    return 0


def format_status(status: GroupStatus, figures: GroupFigures | None = None) -> str:
    """``timeslice status``: the holder, and why each waiter waits (the holder, and whether
    the grant policy carried its lease into its next phase past them); utilization in both
    windows (docs/report.md) when ``figures`` (the report's, of this status) are given, and
    the share of the group's life it was held."""
    from timeslice.protocol.utilization import SINCE_CREATED
    from timeslice.report.text import utilization_line

    holder = status.holder
    held = f"{holder.job_id} (token {holder.token}, {holder.held_s:.1f} s)" if holder else "none"
    if holder is not None and holder.carrying_into:
        held += f", carrying into {holder.carrying_into}"
    if holder is None:
        why = "granting" if status.queue else ""
    else:
        why = f"held by {holder.job_id}" + (
            f": carrying into {holder.carrying_into}" if holder.carrying_into else ""
        )
    queue = [f"{w.job_id} ({w.waited_s:.1f} s: {why})" for w in status.queue]
    stats = status.stats
    return "\n".join(
        [
            f"group {status.group_id}",
            f"  holder:      {held}",
            f"  resident:    {status.resident_job or 'none'}"
            + (f" (staged next: {status.staged_job})" if status.staged_job else ""),
            f"  queue:       {', '.join(queue) or 'empty'}",
            *([f"  utilization: {utilization_line(figures)}"] if figures is not None else []),
            f"  held:        {status.held_share:.1%} of {status.wall_s:.1f} s {SINCE_CREATED} "
            "(leases; utilization counts the GPU phases in them)",
            f"  leases:      {stats.leases}, switches {stats.switches}, carried {stats.carried}, "
            f"expired {stats.expired}, preemptions {stats.preemptions}, "
            f"stale messages {stats.stale_messages}",
        ]
    )


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
                "options": _run_job_options,
            }[args.job_command]
            with contextlib.suppress(KeyboardInterrupt):
                return asyncio.run(runner(args))
            return 130
        runner = {
            "worker": _run_worker,
            "agent": _run_agent,
            "agent-token": _run_agent_token,
            "setup": _run_setup,
            "status": _run_status,
            "backends": _run_backends,
            "report": _run_report,
            "groups": _run_groups,
            "pool": _run_pool,
            "plan": plan_cli.run,
        }[args.command]
        with contextlib.suppress(KeyboardInterrupt):
            return asyncio.run(runner(args))
        return 130
    except TimesliceError as err:
        print(f"timeslice {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RPCError as err:  # Temporal refused a call: say what it said, not a traceback
        print(f"timeslice {args.command}: error: {_explain_rpc_error(err)}", file=sys.stderr)
        return 2


def _explain_rpc_error(err: RPCError) -> str:
    said = f"Temporal answered {err.status.name}: {err.message.rstrip('.')}"
    if err.status == RPCStatusCode.NOT_FOUND and "namespace" in err.message.lower():
        return (
            f"{said}. Create the namespace (`temporal operator namespace create --namespace "
            "NAME`; deploy/ has the self-hosted step) or pick an existing one with --namespace "
            "/ $TEMPORAL_NAMESPACE"
        )
    if err.status in (RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.PERMISSION_DENIED):
        return f"{said}. Check the API key / client certificate (--profile, $TEMPORAL_*)"
    return said


def entry() -> None:
    """Console-script entry: run, flush, and exit without interpreter teardown.

    The Temporal SDK's native threads can touch Python during interpreter finalization and
    crash a process that finished its work (temporalio/sdk-python#300); nothing is left to
    clean up once the command has returned, so skip that phase.
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (`| head`): nothing is wrong
        code = 0
    with contextlib.suppress(BrokenPipeError):
        sys.stderr.flush()
    os._exit(code)
