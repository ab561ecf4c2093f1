"""Shared test helpers: processes, logs, the overlap checker, condition waits."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.service import RPCError
from timeslice.cli import warm_start
from timeslice.jobs import parse_job_config, start_rl_job
from timeslice.protocol.rl_job import RLJobResult

REPO = Path(__file__).resolve().parent.parent
CONTENDER = REPO / "tests" / "contender.py"
T = TypeVar("T")


def skip_unless_installed(*names: str, reason: str | None = None) -> None:
    """Skip the calling test module unless every package named is installed, without
    importing it (``pytest.importorskip`` imports: seconds of CPU for TRL or JAX, paid at
    collection by every pytest worker, where only the one that runs the module needs it)."""
    import pytest

    for name in names:
        if importlib.util.find_spec(name) is None:
            pytest.skip(reason or f"{name} is not installed", allow_module_level=True)


PROBE_FIRST_PAUSE_S = 0.05
PROBE_LAST_PAUSE_S = 0.25


def wait_for(probe: Callable[[], T | None], *, timeout: float = 60.0, what: str = "condition") -> T:
    """Re-evaluate ``probe`` until it returns something truthy; fail after ``timeout`` seconds.

    Probes come every 50 ms at first, then less often, up to every 250 ms: many probes open a
    Temporal connection and query a workflow, which costs the server and the control worker
    CPU that the other pytest workers' tests share (a 20-s wait was 400 of them)."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    pause = PROBE_FIRST_PAUSE_S
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except Exception as err:  # a probe may fail while the system settles
            last_error = err
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        pause = min(pause * 1.5, PROBE_LAST_PAUSE_S)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what} (last error: {last_error})"
    )


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(path: Path, event: str, job: str | None = None) -> list[dict]:
    return [r for r in read_log(path) if r["event"] == event and (job is None or r["job"] == job)]


@dataclass
class Interval:
    job: str
    token: int
    start: float
    end: float


def hold_intervals(records: list[dict]) -> list[Interval]:
    """Pair each process's acquired / releasing events into hold intervals."""
    open_by_job: dict[str, dict] = {}
    intervals: list[Interval] = []
    for r in sorted(records, key=lambda r: r["t"]):
        if r["event"] == "acquired":
            assert r["job"] not in open_by_job, f"{r['job']} acquired twice without releasing"
            open_by_job[r["job"]] = r
        elif r["event"] == "releasing":
            start = open_by_job.pop(r["job"])
            assert start["token"] == r["token"]
            intervals.append(Interval(r["job"], r["token"], start["t"], r["t"]))
    return intervals


def assert_no_overlap(intervals: list[Interval]) -> None:
    """Independent mutual-exclusion check over the processes' own monotonic-clock logs."""
    ordered = sorted(intervals, key=lambda i: i.start)
    for before, after in itertools.pairwise(ordered):
        assert before.end <= after.start, f"hold intervals overlap: {before} and {after}"
        # One lease may cover consecutive phases of its job (an RL job carries its trainer
        # lease on to the next sampling): same job, same token. Otherwise tokens increase.
        same_lease = before.token == after.token and before.job == after.job
        assert before.token < after.token or same_lease, (
            f"fencing tokens not increasing: {before} {after}"
        )


def checked_holds(log: Path) -> list[Interval]:
    """The hold intervals the processes logged in ``log``, checked never to overlap."""
    intervals = hold_intervals(read_log(log))
    assert_no_overlap(intervals)
    return intervals


def spawn_contenders(
    address: str, group: str, jobs: list[str], log: Path, *extra: str
) -> list[subprocess.Popen]:
    """A contender process per job of ``jobs``, all on ``group`` with the same arguments."""
    return [spawn_contender(address, group, job, log, *extra) for job in jobs]


def spawn_contender(
    address: str, group: str, job: str, log: Path, *extra: str, stderr: IO[bytes] | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(CONTENDER),
        "--address",
        address,
        "--group",
        group,
        "--job-id",
        job,
        "--log",
        str(log),
        *extra,
    ]
    if warm_start.enabled() and stderr is None:  # forked from a process that imported it
        return warm_start.WarmProcess(cmd[2:], script=CONTENDER, pipe_stdout=False)  # type: ignore[return-value]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(cmd, env=env, stderr=stderr)


def run_cli(
    *argv: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`timeslice ARGV` as a process of its own, run to its end: exit code, stdout, stderr.
    Forked warm where the suite enables it (timeslice.cli.warm_start: the same `main`, without
    a second of imports per command), else `python -m timeslice.cli` as a user types it."""
    if warm_start.enabled():
        return warm_start.run(argv, timeout=timeout, env=env)
    return subprocess.run(
        [sys.executable, "-m", "timeslice.cli", *argv],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def finish(procs: list[subprocess.Popen], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        remaining = max(1.0, deadline - time.monotonic())
        try:
            code = p.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"process {p.args} did not finish in {timeout} s") from None
        assert code == 0, f"process {p.args} exited with {code}"


def new_namespace(address: str, prefix: str) -> str:
    """A fresh namespace on the server at ``address``, with `timeslice setup` run in it."""
    import uuid

    from timeslice.cli.server import temporal_binary

    namespace = f"{prefix}-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [str(temporal_binary()), "operator", "namespace", "create", "--address", address,
         "--namespace", namespace],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip

    def set_up() -> bool:  # a new namespace takes a moment to reach every service
        setup = run_cli("setup", "--address", address, "--namespace", namespace, timeout=60)
        return setup.returncode == 0

    wait_for(set_up, timeout=60, what="`timeslice setup` in the new namespace")
    return namespace


async def run_rl_jobs(client: Client, configs: list[dict[str, Any]]) -> list[RLJobResult]:
    """Start an RL job per config, in order, and wait for every one's result."""
    handles = [await start_rl_job(client, parse_job_config(config)) for config in configs]
    return list(await asyncio.gather(*(handle.result() for handle in handles)))


async def run_simulated_jobs(
    client: Client,
    jobs: list[str],
    group: str,
    options: dict[str, Any],
    *,
    epochs: int,
    checkpoint_every: int,
) -> list[RLJobResult]:
    """``simulated`` RL jobs on ``group`` (sampler and trainer), run to their results."""
    configs = [
        {"job_id": job, "workload": "simulated", "workload_options": options,
         "sampler_group": group, "epochs": epochs, "checkpoint_every": checkpoint_every}
        for job in jobs
    ]  # fmt: skip
    return await run_rl_jobs(client, configs)


def declared_profile(options: dict[str, Any], epochs: int) -> dict[str, Any]:
    """The profile a ``simulated`` job with these workload options declares (its config's
    ``profile``): ``plan.simulator.rl_profile``'s three phases, without the job id, which the
    pool adds."""
    from timeslice.plan.simulator import rl_profile

    profile = rl_profile(
        "-",
        sample_s=options["sample_s"],
        rewards_s=options["reward_s"],
        train_s=options["train_s"],
        epochs=epochs,
    )
    return profile.model_dump(mode="json", exclude={"job_id"}, exclude_none=True)


async def cancel_in_phase(handle: Any, in_phase: Callable[[], Awaitable[bool]]) -> list[str]:
    """Cancel a job's run once ``in_phase()`` holds (a query that fails meanwhile, the group's
    workflow not started yet, reads as not yet), wait for the run to end cancelled, and return
    its ``activities_and_signals``."""

    async def there() -> bool:
        with contextlib.suppress(RPCError):
            return await in_phase()
        return False

    while not await there():
        await asyncio.sleep(0.1)
    await handle.cancel()
    with contextlib.suppress(WorkflowFailureError):
        await handle.result()
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED
    return await activities_and_signals(handle)


async def activities_and_signals(handle: Any) -> list[str]:
    """A workflow's activity events and the signals it sent, in history order
    (``activity_task_scheduled``, ``activity_task_canceled``, ``signal release``, ...)."""
    order: list[str] = []
    async for event in handle.fetch_history_events():
        kind = event.WhichOneof("attributes") or ""
        if kind.startswith("activity_task_"):
            order.append(kind.removesuffix("_event_attributes"))
        elif kind == "signal_external_workflow_execution_initiated_event_attributes":
            attributes = event.signal_external_workflow_execution_initiated_event_attributes
            order.append(f"signal {attributes.signal_name}")
    return order


def assert_the_phase_ended_before_the_lease_went_back(order: list[str]) -> None:
    """In a cancelled job's ``activities_and_signals``: its last activity (the phase it was
    cancelled in) was asked to cancel and ended so before the job sent its group anything
    that hands a lease back."""
    last = max(i for i, kind in enumerate(order) if kind == "activity_task_scheduled")
    after = order[last:]
    assert "activity_task_cancel_requested" in after, order
    assert "activity_task_canceled" in after, order
    ended = after.index("activity_task_canceled")
    signals = [i for i, kind in enumerate(after) if kind.startswith("signal ")]
    assert signals and ended < min(signals), after
