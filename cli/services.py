"""Start and stop `timeslice` service processes (worker, agent, job worker) from Python.

What the demo, the screenshot script, the benchmarks and the tests use to run real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from timeslice.errors import TimesliceError


class ServiceStartError(TimesliceError):
    """A `timeslice` command exited or said something else before it said it was serving."""


def start_service(
    args: list[str], ready: str, log: Path, *, append: bool = True, echo: bool = False
) -> subprocess.Popen[str]:
    """Start `timeslice ARGS` and wait for its first line, which must contain ``ready``.

    Its stderr goes to ``log`` (appended, or truncated with ``append=False``); ``echo`` prints
    the ready line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("ab" if append else "wb"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if ready not in line:
        proc.kill()
        raise ServiceStartError(
            f"`timeslice {' '.join(args[:2])}` failed to start: {line!r}; see {log}"
        )
    if echo:
        print(f"  {line.strip()}", flush=True)
    return proc


def stop_service(proc: subprocess.Popen[str], timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
