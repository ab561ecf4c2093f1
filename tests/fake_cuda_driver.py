"""A stand-in for the CUDA driver's checkpoint API, for machines without a GPU.

Only the driver call is faked: each process's checkpoint state is kept per PID as the driver
documents it (RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock->
RUNNING; a call from any other state fails with CUDA_ERROR_ILLEGAL_STATE), and whatever calls
it (the cuda-checkpoint backend, the node agent, the group) is the real code on real processes.
``RecordingDriver`` also writes every call to a JSON-lines file, so a test in another process
can see what the node agent did and when (``t``: time.monotonic(), one clock system-wide).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from timeslice.snapshot import SnapshotError
from timeslice.snapshot.cuda_checkpoint import ProcessState


class DriverStateMachine:
    """The CUDA driver's documented checkpoint states, kept per PID. ``failures`` makes one
    call on one PID fail the way the driver does: ``{("checkpoint", pid): "CUDA_ERROR_..."}``
    (the state stays where it was); ``calls`` records every state-changing call."""

    def __init__(
        self, lock_error: str | None = None, failures: dict[tuple[str, int], str] | None = None
    ) -> None:
        self.states: dict[int, ProcessState] = {}
        self.lock_timeouts: list[int] = []
        self.lock_error = lock_error
        self.failures = dict(failures or {})
        self.calls: list[tuple[str, int]] = []

    def state(self, pid: int) -> ProcessState:
        return self.states.setdefault(pid, ProcessState.RUNNING)

    def _move(self, call: str, pid: int, src: ProcessState, dst: ProcessState) -> None:
        self.calls.append((call, pid))
        if (call, pid) in self.failures:
            raise SnapshotError(f"cuCheckpointProcess{call.title()} failed: "
                                f"{self.failures[(call, pid)]}")  # fmt: skip
        if self.state(pid) is not src:
            raise SnapshotError("CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = dst

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.lock_timeouts.append(timeout_ms)
        if self.lock_error:
            raise SnapshotError(f"cuCheckpointProcessLock failed: {self.lock_error}")
        self._move("lock", pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._move("checkpoint", pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int) -> None:
        self._move("restore", pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid: int) -> None:
        self._move("unlock", pid, ProcessState.LOCKED, ProcessState.RUNNING)


def scheduler_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped, as by SIGSTOP), "gone" if none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


class RecordingDriver(DriverStateMachine):
    """``DriverStateMachine`` that appends one JSON line per call to ``path``: the call, the
    PID, the CUDA state after it (or the error), the process's scheduler state, the time."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._lock = threading.Lock()  # the backend calls from worker threads

    def _record(self, call: str, pid: int, outcome: str) -> None:
        line = {
            "call": call,
            "pid": pid,
            "state": outcome,
            "proc": scheduler_state(pid),
            "t": time.monotonic(),
        }
        with self._lock, self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def _move(self, call: str, pid: int, src: ProcessState, dst: ProcessState) -> None:
        try:
            super()._move(call, pid, src, dst)
        except SnapshotError as err:
            self._record(call, pid, f"error: {err}")
            raise
        self._record(call, pid, self.states[pid].name)


def read_calls(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
