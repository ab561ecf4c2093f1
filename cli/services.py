"""Start and stop `timeslice` service processes (worker, agent, job worker) from Python.

What the demo, the screenshot script, the benchmarks and the tests use to run real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from timeslice.errors import TimesliceError


class ServiceStartError(TimesliceError):
    """A `timeslice` command exited or said something else before it said it was serving."""


def start_service(
    args: list[str],
    ready: str,
    log: Path,
    *,
    append: bool = True,
    echo: bool = False,
    drain: bool = True,
) -> subprocess.Popen[str]:
    """Start `timeslice ARGS` and wait for its first line, which must contain ``ready``.

    Its stderr goes to ``log`` (appended, or truncated with ``append=False``); ``echo`` prints
    the ready line. With ``drain`` (the default) whatever it writes to stdout after that line
    is copied to ``log`` too, by a thread of this process; without it the caller reads
    ``proc.stdout`` itself and must keep reading it."""
    return start_process(
        [sys.executable, "-m", "timeslice.cli", *args],
        ready,
        log,
        append=append,
        echo=echo,
        drain=drain,
        name=f"`timeslice {' '.join(args[:2])}`",
    )


def start_process(
    command: list[str],
    ready: str,
    log: Path,
    *,
    append: bool = True,
    echo: bool = False,
    drain: bool = True,
    name: str | None = None,
) -> subprocess.Popen[str]:
    """Start ``command`` as :func:`start_service` starts a `timeslice` command.

    Why the drain: a pipe holds 64 KiB. A process whose stdout is a pipe nobody reads blocks
    in its next write once that fills, whatever thread writes. The Temporal SDK's core logs its
    own warnings to stdout (a workflow task over 5 s, under load), so a control worker left
    that way stopped in the middle of a workflow task and every group and job it served
    stalled for good (bench/scale.py, 200 jobs on a loaded machine)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=log.open("ab" if append else "wb"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if ready not in line:
        proc.kill()
        raise ServiceStartError(f"{name or command[0]} failed to start: {line!r}; see {log}")
    if echo:
        print(f"  {line.strip()}", flush=True)
    if drain:
        threading.Thread(
            target=_copy_lines, args=(proc.stdout, log), name=f"drain {log.name}", daemon=True
        ).start()
    return proc


def _copy_lines(source: IO[str], log: Path) -> None:
    """Copy ``source`` to the end of ``log`` until it ends (the process exited)."""
    with log.open("a") as sink:
        for line in source:
            sink.write(line)
            sink.flush()


def stop_service(proc: subprocess.Popen[str], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
