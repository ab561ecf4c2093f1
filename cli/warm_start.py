"""Warm starts: `timeslice` service processes forked from a process that has imported them.

A `timeslice job worker`, `worker` or `agent` spends its first second of CPU importing Python
(the Temporal SDK, pydantic, the protocol's models) before it does anything; a test suite that
starts hundreds of them pays that hundreds of times on two cores. A warm start forks each from
a fork server (``multiprocessing``'s ``forkserver``) that imported those modules once and
started no thread: the child is a real, separate process with its own pid, signals, sockets and
Temporal runtime, running the same ``timeslice.cli.main`` as ``python -m timeslice.cli``, only
without the imports. What differs from a cold start is the interpreter's own start-up (site,
``-m``): the tests run short commands warm too (``run``: a command's exit code, stdout and
stderr, as ``subprocess.run`` gives them), and keep cold the few that test start-up itself
(`python -m timeslice.cli` as a user types it, the README's blocks, the demo).

Off unless asked for (``enable()``; the test suite's conftest does): the demo and the benchmarks
start their processes as a user does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

# What every service imports before it serves; nothing here may start a thread or a runtime
# (a fork would copy it half-alive): these only define.
PRELOAD = (
    "__main__",  # the parent's script, imported once here rather than in every child
    "timeslice.cli.main",
    "timeslice.workers.job",
    "timeslice.workers.control",
    "timeslice.transport.telemetry",
    "temporalio.client",
    "temporalio.worker",
    "timeslice.cli.warm_torch",  # torch and its workloads, where installed
)

_context: Any = None


def enable() -> None:
    """Start services warm in this process from now on (the fork server starts at first use)."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        _context = context


def enabled() -> bool:
    return _context is not None


class WarmProcess:
    """A forked process, handled as a ``subprocess.Popen`` is: pid, stdout, poll, wait,
    terminate, kill, send_signal, returncode.

    It runs `python -m timeslice.cli ARGS`, or with ``script`` `python SCRIPT ARGS`, in this
    process's working directory and environment (as they are now). Its stdout is a pipe
    (``stdout``) unless ``pipe_stdout`` is false (then the fork server's, which is this
    process's); its stderr goes to the file ``log`` (appended, or truncated with
    ``append=False``), else to the fork server's."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path | None = None,
        *,
        append: bool = True,
        script: Path | None = None,
        pipe_stdout: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        assert _context is not None, "warm_start.enable() first"
        self.args = [str(script)] if script else ["timeslice"]
        self.args += list(args)
        read, write = _context.Pipe(duplex=False) if pipe_stdout else (None, None)
        environ = dict(os.environ if env is None else env)
        plan = _Plan(
            list(args), None if script is None else str(script), environ,
            os.getcwd(), write, None if log is None else str(log), append,
        )  # fmt: skip
        self._process = _context.Process(target=_run, args=(plan,), name=" ".join(self.args))
        self._process.start()
        self.pid: int = self._process.pid
        self.stdout: IO[str] | None = None
        if read is not None and write is not None:
            write.close()
            self.stdout = open(  # noqa: SIM115 (closed when the process is waited for)
                os.dup(read.fileno()), encoding="utf-8", errors="replace"
            )
            read.close()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code  # its stdout stays open, as Popen's does: what it printed is still to read

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run(
    args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`timeslice ARGS` run warm to its end, as ``subprocess.run(..., capture_output=True,
    text=True, timeout=...)`` runs it cold: its exit code, stdout and stderr; TimeoutExpired
    (the process killed) past ``timeout`` seconds."""
    with tempfile.TemporaryDirectory(prefix="timeslice-warm-") as tmp:
        stderr_path = Path(tmp) / "stderr"
        process = WarmProcess(args, stderr_path, append=False, env=env)
        stdout = process.stdout
        assert stdout is not None
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(stdout.read()), daemon=True)
        reader.start()
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            reader.join(5)
            stdout.close()
        stderr = stderr_path.read_text(encoding="utf-8", errors="replace")
    return subprocess.CompletedProcess(process.args, code, "".join(out), stderr)


@dataclass
class _Plan:
    """What the forked child becomes (pickled to it by the fork server)."""

    args: list[str]
    script: str | None
    env: dict[str, str]
    cwd: str
    stdout: Connection | None
    log: str | None  # stderr's file; None: the fork server's stderr
    append: bool


def _run(plan: _Plan) -> None:
    """In the forked child: become `python -m timeslice.cli ARGS` (or `python SCRIPT ARGS`)
    started with the plan's environment in its directory; does not return."""
    os.chdir(plan.cwd)
    os.environ.clear()
    os.environ.update(plan.env)
    # As the interpreter sets it up: the script's folder (or, for -m, the working directory)
    # first, then $PYTHONPATH.
    first = [str(Path(plan.script).parent) if plan.script else plan.cwd]
    first += [p for p in plan.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [*first, *(p for p in sys.path if p not in first and p != "")]
    with open(os.devnull, "rb") as null:
        os.dup2(null.fileno(), 0)
    if plan.stdout is not None:
        os.dup2(plan.stdout.fileno(), 1)
        plan.stdout.close()
    if plan.log is not None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if plan.append else os.O_TRUNC)
        err = os.open(plan.log, flags, 0o644)
        os.dup2(err, 2)
        os.close(err)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    if plan.script is not None:
        sys.argv = [plan.script, *plan.args]
        runpy.run_path(plan.script, run_name="__main__")  # ends in sys.exit: the exit code
        sys.exit(0)
    from timeslice.cli import main

    sys.argv = [str(Path(main.__file__).with_name("__main__.py")), *plan.args]
    main.entry()  # exits the process
