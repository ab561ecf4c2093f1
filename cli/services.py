"""Start and stop `timeslice` service processes (worker, agent, job worker) from Python.

What the demo, the screenshot script, the benchmarks and the tests use to run real processes
(`timeslice.cli.stack` starts whole stacks of them). Each is `python -m timeslice.cli ARGS`,
or, once `timeslice.cli.warm_start.enable()` was called (the tests do), the same command
forked from a process that imported it already.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeAlias

from timeslice.cli import warm_start
from timeslice.errors import TimesliceError

#: A started service: a subprocess, or a warm-started one handled the same way.
ServiceProcess: TypeAlias = "subprocess.Popen[Any] | warm_start.WarmProcess"


class ServiceStartError(TimesliceError):
    """A `timeslice` command exited or said something else before it said it was serving."""


@dataclass(frozen=True)
class Service:
    """A `timeslice ARGS` process to start: ``ready`` is what its first line must contain,
    ``log`` the file its stderr goes to."""

    args: tuple[str, ...]
    ready: str
    log: Path


def spawn_service(args: Sequence[str], log: Path, *, append: bool = True) -> ServiceProcess:
    """Start `timeslice ARGS` without waiting: its stderr to ``log`` (appended, or truncated
    with ``append=False``), its stdout a pipe whose first line says it serves."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if warm_start.enabled():
        return warm_start.WarmProcess(args, log, append=append)
    with log.open("ab" if append else "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "timeslice.cli", *args],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def wait_until_serving(
    proc: ServiceProcess, service: Service, *, echo: bool = False, drain: bool = True
) -> ServiceProcess:
    """Wait for the first line of ``proc`` (started as ``service``); kill it and raise
    :class:`ServiceStartError` unless that line says it serves.

    That line is copied to its log. With ``drain`` (the default) whatever it writes to stdout
    after it is copied there too, by a thread of this process; without it the caller reads
    ``proc.stdout`` itself and must keep reading it. Why the drain: a pipe holds 64 KiB, and a
    process whose stdout is a pipe nobody reads blocks in its next write once that fills,
    whatever thread writes. The Temporal SDK's core logs its own warnings to stdout (a workflow
    task over 5 s, under load), so a control worker left that way stopped in the middle of a
    workflow task and every group and job it served stalled for good (bench/scale.py, 200 jobs
    on a loaded machine)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if service.ready not in line:
        proc.kill()
        proc.wait()
        raise ServiceStartError(
            f"`timeslice {' '.join(service.args[:2])}` failed to start: {line!r}; see {service.log}"
        )
    if echo:
        print(f"  {line.strip()}", flush=True)
    with service.log.open("a") as log:  # the log starts where the process said it serves
        log.write(line)
    if drain:
        assert proc.stdout is not None
        threading.Thread(
            target=_copy_lines,
            args=(proc.stdout, service.log),
            name=f"drain {service.log.name}",
            daemon=True,
        ).start()
    return proc


def start_service(
    args: list[str],
    ready: str,
    log: Path,
    *,
    append: bool = True,
    echo: bool = False,
    drain: bool = True,
) -> ServiceProcess:
    """Start `timeslice ARGS` and wait for its first line, which must contain ``ready``.

    Its stderr goes to ``log`` (appended, or truncated with ``append=False``); ``echo`` prints
    the ready line; ``drain``: see :func:`wait_until_serving`."""
    service = Service(tuple(args), ready, log)
    return wait_until_serving(
        spawn_service(args, log, append=append), service, echo=echo, drain=drain
    )


def start_process(
    command: list[str], ready: str, log: Path, *, append: bool = True
) -> ServiceProcess:
    """Start ``command`` (any program, not a `timeslice` one) as :func:`start_service` starts a
    `timeslice` command: its stderr to ``log``, its first line ``ready``, the rest drained."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as stderr:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return wait_until_serving(proc, Service(tuple(command), ready, log))


def _copy_lines(source: IO[str], log: Path) -> None:
    """Copy ``source`` to the end of ``log`` until it ends (the process exited)."""
    with log.open("a") as sink:
        for line in source:
            sink.write(line)
            sink.flush()


def start_services(
    services: Sequence[Service], *, append: bool = True, echo: bool = False
) -> list[ServiceProcess]:
    """Start every one of ``services`` at once, then wait until each serves.

    A process spends its first seconds importing (torch, the SDK) and connecting: side by side
    they overlap, where one after another they add up. If one fails to start, all are stopped
    and :class:`ServiceStartError` says which."""
    procs = [spawn_service(s.args, s.log, append=append) for s in services]
    try:
        for proc, service in zip(procs, services, strict=True):
            wait_until_serving(proc, service, echo=echo)
    except BaseException:
        stop_services(procs)
        raise
    return procs


def stop_service(proc: ServiceProcess, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    stop_services([proc], timeout)


def stop_services(procs: Sequence[ServiceProcess], timeout: float = 20.0) -> None:
    """SIGTERM to every one of ``procs`` at once (each shuts its worker down for a second or
    two: side by side, not one after another), then SIGKILL to any still running after
    ``timeout`` seconds."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
