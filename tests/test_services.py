"""A service started by `timeslice.cli.services` never blocks on its own stdout.

The Temporal SDK's core logs its warnings to stdout; a control worker whose stdout pipe nobody
read stopped in the middle of a workflow task once 64 KiB of them had piled up, and every group
and job it served stalled for good (bench/scale.py, 200 jobs x 50 groups on a loaded machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timeslice.cli.services import start_process, stop_service

from tests.helpers import wait_for

# Says it is ready, then writes far more than a pipe holds (about 1 MiB), then exits.
_CHATTY = "print('ready', flush=True)\nfor i in range(20_000): print(f'line {i:05d} ' + 'x' * 40)"


def test_a_service_that_writes_past_a_full_pipe_runs_on(tmp_path: Path) -> None:
    log = tmp_path / "chatty.log"
    proc = start_process([sys.executable, "-c", _CHATTY], "ready", log)
    try:
        # Without the drain the child blocks in a write once ~64 KiB sit in the pipe.
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the service blocked writing to its stdout") from None
    finally:
        stop_service(proc)
    assert code == 0
    # Its ready line and what it wrote after it are in its log, to the last line.
    wait_for(lambda: "line 19999" in log.read_text(), timeout=30, what="the last line logged")
    lines = log.read_text().splitlines()
    assert lines[0] == "ready" and len(lines) == 20_001
