"""The CLI against a real server: what it says when the namespace, the database folder or a job
is not what the user thinks, and figures that are true at the moment they are printed."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from timeslice.cli.server import free_port
from timeslice.protocol.rl_job import rl_job_workflow_id
from timeslice.transport.connection import connect, connect_config

from tests.helpers import new_namespace, run_cli, wait_for


def timeslice(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli(*argv, timeout=timeout)


def test_worker_in_a_namespace_that_does_not_exist(address: str) -> None:
    result = timeslice("worker", "--address", address, "--namespace", "no-such-namespace")
    assert result.returncode == 2
    assert "Namespace no-such-namespace is not found" in result.stderr
    assert "temporal operator namespace create" in result.stderr
    assert "Traceback" not in result.stderr


def test_server_with_an_unwritable_database_folder() -> None:
    result = timeslice("server", "--db", "/proc/nope/temporal.db", "--port", str(free_port()))
    assert result.returncode == 2
    assert "cannot write the server's database file /proc/nope/temporal.db" in result.stderr
    assert "Traceback" not in result.stderr


def test_job_progress_of_a_failed_job_exits_1(address: str, group: str) -> None:
    job = f"failed-{os.getpid()}-{free_port()}"

    async def start_failing(client: Client) -> None:
        handle = await client.start_workflow(
            "RLJobWorkflow",
            {"job_id": job, "workload": "simulated", "sampler_group": group, "epochs": 0},
            id=rl_job_workflow_id(job),
            task_queue="timeslice",
        )
        await asyncio.gather(handle.result(), return_exceptions=True)

    async def main() -> None:
        await start_failing(await connect(connect_config(address)))

    asyncio.run(main())
    result = timeslice("job", "progress", job, "--address", address)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"job {job} failed" in result.stderr and "epochs" in result.stderr
    # The report of the namespace lists it without stopping at its refused config.
    report = timeslice("report", "--address", address, "--job", job, "--text-only")
    assert report.returncode == 0, report.stdout + report.stderr
    assert job in report.stdout and "refused its config" in report.stdout


def test_status_figures_are_as_of_the_query(address: str, group: str, make_client) -> None:
    """A query answers as of the group's last workflow task; status brings it to now."""
    holder = make_client(job_id="status-now", lease_ttl=120)  # no renewal for 40 s
    lease = holder.acquire(group)
    first = holder.group_status(group)
    assert first.holder is not None

    def later() -> object | None:
        status = holder.group_status(group)  # no workflow task since the grant
        assert status.holder is not None
        return status if status.holder.held_s >= first.holder.held_s + 1.0 else None

    status = wait_for(later, timeout=60, what="the hold to grow by a second")
    assert status.held_share > 0.5 and status.wall_s >= status.holder.held_s
    out = timeslice("status", group, "--address", address)
    assert out.returncode == 0, out.stderr
    held = float(out.stdout.split("(token ")[1].split(", ")[1].split(" s)")[0])
    assert held >= status.holder.held_s, out.stdout
    holder.release(lease)


def test_report_into_an_unwritable_folder_fails_before_the_work(address: str) -> None:
    result = timeslice("report", "--address", address, "--out", "/proc/nope/report")
    assert result.returncode == 2
    assert "--out /proc/nope/report: cannot write there" in result.stderr
    assert "reading groups and jobs" not in result.stderr
    assert not Path("/proc/nope").exists()


def test_killed_server_command_takes_its_temporal_child_along(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli", "server", "--port", str(port),
         "--ui-port", str(free_port()), "--db", str(tmp_path / "t.db")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "Temporal server ready" in line:
                break
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1
        temporal = int(children[0])
        assert "temporal" in Path(f"/proc/{temporal}/cmdline").read_text()
    finally:
        proc.kill()  # SIGKILL: no handler of ours runs
        proc.wait()

    def gone() -> bool:
        try:
            state = Path(f"/proc/{temporal}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        return state == "Z"

    wait_for(gone, timeout=60, what="the temporal child to exit with its parent")


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_server_stopped_while_it_starts_stops_its_child_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Ctrl-C before the server listens (a stand-in `temporal` that never does)."""
    never_listens = tmp_path / "temporal"
    never_listens.write_text("#!/bin/sh\nexec sleep 600\n")
    never_listens.chmod(0o755)
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli", "server", "--port", str(free_port()),
         "--ui-port", str(free_port()), "--db", str(tmp_path / "t.db")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TIMESLICE_TEMPORAL_BIN": str(never_listens)},
        # As from a terminal: a shell without job control starts background commands with
        # SIGINT ignored (CI run as one), and Python then never turns it into Ctrl-C.
        preexec_fn=_sigint_as_from_a_terminal,
    )  # fmt: skip
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        wait_for(lambda: children.read_text().split(), timeout=60, what="the server's child")
        child = int(children.read_text().split()[0])
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "it had not started" in out and "Traceback" not in out, out
    assert not Path(f"/proc/{child}").exists(), "the server's child outlived it"


def test_unreachable_explicit_address_says_the_environment_was_not_used(monkeypatch) -> None:
    """The seed example names its server; TEMPORAL_ADDRESS then changes nothing: say so."""
    from timeslice import ServerUnreachableError, TimeSliceOrchestratorClient

    monkeypatch.setenv("TEMPORAL_ADDRESS", "127.0.0.1:7233")
    client = TimeSliceOrchestratorClient(target=f"127.0.0.1:{free_port()}")
    try:
        with pytest.raises(ServerUnreachableError) as err:
            client.acquire("g", timeout=1)
    finally:
        client.close()
    assert "TEMPORAL_ADDRESS=127.0.0.1:7233 is set, but an address given to the client" in str(
        err.value
    )


def test_status_of_a_group_that_cannot_answer_is_a_clear_error(address: str) -> None:
    """Something that is not a working group under a group's workflow id: no traceback."""
    group = f"broken-{free_port()}"

    async def occupy(client: Client) -> None:
        handle = await client.start_workflow(
            "RLJobWorkflow", {"nonsense": True}, id=f"gpu-group-{group}", task_queue="timeslice"
        )
        await asyncio.gather(handle.result(), return_exceptions=True)

    async def main() -> None:
        await occupy(await connect(connect_config(address)))

    asyncio.run(main())
    result = timeslice("status", group, "--address", address)
    assert result.returncode == 2, result.stdout
    assert f"group {group!r} could not answer its status" in result.stderr
    assert "Traceback" not in result.stderr


def test_backends_lists_the_registry() -> None:
    from timeslice.snapshot.registry import BACKENDS

    result = timeslice("backends", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert list(rows) == list(BACKENDS)
    assert rows["cuda-checkpoint"]["runs in"] == "node agent"
    assert rows["cuda-checkpoint"]["capabilities"] == ["whole-process"]
    assert rows["noop"]["client may name it"] and not rows["torch"]["client may name it"]
    # The dev environment has torch and cuda-bindings; vLLM only where someone installed it.
    for name in ("noop", "simulated", "torch", "cuda-checkpoint"):
        assert rows[name]["installed here"] == "yes", rows[name]
    if importlib.util.find_spec("vllm") is None:
        assert (
            rows["vllm"]["installed here"] == "no: vllm is not installed: install timeslice[vllm]"
        )
    assert rows["jax"]["extra"] == "jax" and rows["jax"]["capabilities"] == ["knows-size"]
    assert not rows["jax"]["client may name it"]  # it moves the caller's own pytrees
    jax_here = importlib.util.find_spec("jax") is not None  # `make test` installs it
    assert rows["jax"]["installed here"] == (
        "yes" if jax_here else "no: jax is not installed: install timeslice[jax]"
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["job", "start", "--job-id", "j", "--lease-ttl", "nan"], "'nan' is not a finite number"),
        (["job", "start", "--job-id", "j", "--lease-ttl", "inf"], "'inf' is not a finite number"),
        (["job", "start", "--job-id", "j", "--option", "lr=NaN"], "NaN is not a finite number"),
        (["plan", "p.json", "--groups", "1", "--aging", "nan"], "'nan' is not a finite number"),
        (["plan", "p.json", "--groups", "1", "--time-limit", "inf"], "is not a finite number"),
        (
            ["pool", "create", "p", "--group", "g", "--max-slowdown", "nan"],
            "max_slowdown: Input should be a finite number",
        ),
        (
            ["pool", "create", "p", "--group", "g", "--move-horizon", "inf"],
            "move_horizon_s: Input should be a finite number",
        ),
        (
            ["pool", "create", "p", "--group", "g", "--tenant", "t:nan"],
            "Input should be a finite number",
        ),
    ],
)
def test_numbers_that_are_not_finite_are_named_so(argv: list[str], said: str) -> None:
    """`nan` parses as a float; it must be refused as not a number, not as out of range."""
    connects = argv[0] in ("job", "pool")
    result = timeslice(*argv, "--address", "127.0.0.1:1") if connects else timeslice(*argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr
    for out_of_range in ("less than", "greater than", "Traceback"):
        assert out_of_range not in result.stderr


def _bad_workload_options(tmp: Path) -> str:
    path = tmp / "bad.json"
    path.write_text(json.dumps({"job_id": "j", "workload": "simulated", "sampler_group": "g",
                                "workload_options": "x"}))  # fmt: skip
    return str(path)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["server", "--ip", "bogus.invalid"], "'bogus.invalid' is not an IPv4 address"),
        (["report", "--pool", "x y", "--text-only"], "invalid pool name 'x y'"),
        (["report", "--job", "a/b", "--text-only"], "invalid job id 'a/b'"),
        (["plan", "profile", "j1", "--group", "x y"], "invalid group id 'x y'"),
        (["plan", "examples/profiles/light.yaml", "--groups", "1", "--json", "/proc/x/p.json"],
         "--json /proc/x: cannot write there"),
        (["agent", "--node", "n1", "--simulated-seconds", "1"], "give --simulated-bytes too"),
        (["job", "worker", "--job-id", "j", "--workload", "simulated", "--checkpoint-dir",
          "/proc/nope"], "--checkpoint-dir /proc/nope: cannot write there"),
        (["job", "start", "--config", "BAD", "--option", "sample_s=1"],
         "workload_options must be a JSON object"),
        (["job", "start", "--config", "MISSING"], "error: --config MISSING: cannot read"),
    ],
)  # fmt: skip
def test_bad_input_fails_before_any_work_in_one_line(
    argv: list[str], said: str, tmp_path: Path
) -> None:
    """Each refused at once, with exit 2 and one line saying what to fix, before connecting or
    searching: no traceback, and no work thrown away at its end."""
    argv = [_bad_workload_options(tmp_path) if a == "BAD" else a for a in argv]
    said = said.replace("MISSING", str(tmp_path / "missing.json"))
    argv = [str(tmp_path / "missing.json") if a == "MISSING" else a for a in argv]
    needs_server = argv[0] in ("report", "job", "agent") or argv[:2] == ["plan", "profile"]
    result = timeslice(*argv, *(["--address", "127.0.0.1:1"] if needs_server else []))
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def watch(*argv: str) -> tuple[subprocess.Popen[str], list[tuple[float, str]]]:
    """Run `timeslice ARGV` with its output read line by line as it comes, each line with the
    seconds since the command started."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    threading.Thread(target=read, daemon=True).start()
    return proc, lines


def said(lines: list[tuple[float, str]], text: str) -> tuple[float, str] | None:
    return next(((t, line) for t, line in lines if text in line), None)


def test_job_start_names_a_missing_job_process_and_a_mistyped_group(
    address: str, group: str, make_client: Any
) -> None:
    """No `timeslice job worker`: `job start --wait` names the command within seconds (the
    job's task queue has no poller), long before the job gives up on it (--process-wait)."""
    holder = make_client(job_id="typo-base")
    holder.release(holder.acquire(group))  # the group exists
    typo = group[:-1] + ("x" if group[-1] != "x" else "y")
    job = f"orphan-{os.getpid()}-{free_port()}"
    proc, lines = watch(
        "job", "start", "--address", address, "--job-id", job, "--workload", "simulated",
        "--sampler-group", typo, "--epochs", "1", "--process-wait", "20", "--wait",
    )  # fmt: skip
    try:
        command = f"`timeslice job worker --job-id {job} --workload simulated --address {address}`"
        hint = wait_for(lambda: said(lines, "no job process serves job"), timeout=120)
        assert command in hint[1] and f"'timeslice-job-{job}-0'" in hint[1], hint
        note = said(lines, f"no group {typo!r} exists yet")
        assert note is not None and f"Did you mean {group!r}?" in note[1], lines
        assert proc.wait(timeout=120) == 1
    finally:
        proc.kill()
    failed = said(lines, f"job {job} failed")
    assert failed is not None and "no job process served it within process_wait_s=20" in failed[1]
    assert hint[0] < failed[0], lines  # named at once, not when the wait ran out
    print(f"missing job process named {hint[0]:.1f} s after `job start` began")
    # The group was never created: the job never got as far as a lease.
    assert "Traceback" not in "\n".join(line for _, line in lines)


def test_a_missing_control_worker_is_named_within_seconds(server: Any) -> None:
    """A namespace no `timeslice worker` serves: `job start --wait`, `job progress`, `status`
    and `groups` say so with the command, instead of waiting in silence."""
    namespace = new_namespace(server.address, "noworker")
    where = ["--address", server.address, "--namespace", namespace]
    command = f"`timeslice worker --address {server.address} --namespace {namespace}`"
    job = f"unserved-{os.getpid()}"
    proc, lines = watch(
        "job", "start", *where, "--job-id", job, "--workload", "simulated",
        "--sampler-group", "gpus-0", "--epochs", "1", "--wait",
    )  # fmt: skip
    try:
        hint = wait_for(lambda: said(lines, "no control worker serves task queue"), timeout=120)
    finally:
        proc.kill()
    assert command in hint[1] and f"(namespace {namespace!r})" in hint[1], hint
    print(f"missing control worker named {hint[0]:.1f} s after `job start` began")
    for argv in (["job", "progress", job], ["status", "gpus-0"], ["groups"]):
        result = timeslice(*argv, *where, timeout=60)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert "no control worker serves task queue 'timeslice'" in result.stderr
        assert command in result.stderr and "Traceback" not in result.stderr


def test_groups_lists_each_group_with_its_holder_and_jobs(
    address: str, group: str, make_client: Any
) -> None:
    holder = make_client(job_id="lister")
    lease = holder.acquire(group)
    try:
        result = timeslice("groups", "--address", address, "--json")
    finally:
        holder.release(lease)
    assert result.returncode == 0, result.stderr
    rows = {row["group_id"]: row for row in map(json.loads, result.stdout.splitlines())}
    assert rows[group]["holder"] == "lister" and rows[group]["jobs"] == ["lister"]
    assert rows[group]["queue"] == []
    table = timeslice("groups", "--address", address)
    assert table.returncode == 0 and group in table.stdout and "utilization" in table.stdout
