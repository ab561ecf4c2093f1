"""cuda-checkpoint backend: PID identity checks, the driver state machine and its error paths.

The state-machine tests drive the backend through a stand-in for the CUDA driver that keeps
each process's checkpoint state as the driver documents it; the processes themselves are real.
The `gpu` test runs the real driver API on a real CUDA process. Missing bindings or driver, and
the bindings' call shapes: tests/test_gpu_readiness.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
from timeslice.snapshot import SnapshotError, SnapshotRequest
from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend, ProcessState
from timeslice.snapshot.processes import (
    PidRegistry,
    ProcessIdentity,
    ProcessMismatchError,
    process_start_time,
)


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


class DriverStateMachine:
    """The CUDA driver's documented checkpoint states, kept per PID."""

    def __init__(self, lock_error: str | None = None) -> None:
        self.states: dict[int, ProcessState] = {}
        self.lock_timeouts: list[int] = []
        self.lock_error = lock_error

    def state(self, pid: int) -> ProcessState:
        return self.states.setdefault(pid, ProcessState.RUNNING)

    def _move(self, pid: int, src: ProcessState, dst: ProcessState) -> None:
        if self.state(pid) is not src:
            raise SnapshotError("CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = dst

    def lock(self, pid: int, timeout_ms: int) -> None:
        self.lock_timeouts.append(timeout_ms)
        if self.lock_error:
            raise SnapshotError(f"cuCheckpointProcessLock failed: {self.lock_error}")
        self._move(pid, ProcessState.RUNNING, ProcessState.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._move(pid, ProcessState.LOCKED, ProcessState.CHECKPOINTED)

    def restore(self, pid: int) -> None:
        self._move(pid, ProcessState.CHECKPOINTED, ProcessState.LOCKED)

    def unlock(self, pid: int) -> None:
        self._move(pid, ProcessState.LOCKED, ProcessState.RUNNING)


def test_process_identity_of_a_live_and_a_gone_process(child):
    me = ProcessIdentity.of(os.getpid())
    assert me.start_time == process_start_time(os.getpid()) > 0
    assert ProcessIdentity.of(child.pid).start_time >= me.start_time
    child.kill()
    child.wait()
    with pytest.raises(ProcessMismatchError, match="is not running"):
        process_start_time(child.pid)
    with pytest.raises(ValueError, match="positive integer"):
        process_start_time(0)


def test_registry_refuses_reused_foreign_and_unregistered_pids(child):
    registry = PidRegistry()
    real = ProcessIdentity.of(child.pid)
    registry.register("job-a", real)
    assert registry.verified("job-a") == [real]
    with pytest.raises(ProcessMismatchError, match="already registered by job job-a"):
        registry.register("job-b", real)
    with pytest.raises(ProcessMismatchError, match="registered no process"):
        registry.verified("job-b")
    forged = PidRegistry()
    forged.register("job-c", ProcessIdentity(child.pid, real.start_time - 1))
    with pytest.raises(ProcessMismatchError, match="now belongs to another process"):
        forged.verified("job-c")
    child.kill()
    child.wait()
    with pytest.raises(ProcessMismatchError, match="is not running"):
        registry.verified("job-a")


def request_for(*identities: ProcessIdentity) -> SnapshotRequest:
    return SnapshotRequest("job", "gpus", "evict for gpus", identities)


def test_checkpoint_and_restore_walk_the_driver_states(child):
    job = request_for(ProcessIdentity.of(child.pid))
    driver = DriverStateMachine()
    backend = CudaCheckpointBackend(driver, lock_timeout_s=2.5)
    report = asyncio.run(backend.snapshot(job))
    assert driver.states[child.pid] is ProcessState.CHECKPOINTED
    assert driver.lock_timeouts == [2500]
    assert report.backend == "cuda-checkpoint" and report.mode == "checkpoint"
    assert report.bytes >= 0 and report.seconds >= 0
    with pytest.raises(SnapshotError, match="CUDA state is CHECKPOINTED, expected RUNNING"):
        asyncio.run(backend.snapshot(job))
    asyncio.run(backend.restore(job))
    assert driver.states[child.pid] is ProcessState.RUNNING
    with pytest.raises(SnapshotError, match="CUDA state is RUNNING, expected CHECKPOINTED"):
        asyncio.run(backend.restore(job))


def test_lock_failure_leaves_the_process_running(child):
    driver = DriverStateMachine(lock_error="CUDA_ERROR_TIMEOUT")
    backend = CudaCheckpointBackend(driver)
    with pytest.raises(SnapshotError, match="CUDA_ERROR_TIMEOUT"):
        asyncio.run(backend.snapshot(request_for(ProcessIdentity.of(child.pid))))
    assert driver.states[child.pid] is ProcessState.RUNNING


def test_backend_refuses_a_pid_that_changed_hands(child):
    """Checked again at the move, after the node agent named the process: a PID reused since
    is refused before the driver is touched."""
    changed = ProcessIdentity(child.pid, process_start_time(child.pid) + 1)
    driver = DriverStateMachine()
    with pytest.raises(ProcessMismatchError, match="now belongs to another process"):
        asyncio.run(CudaCheckpointBackend(driver).snapshot(request_for(changed)))
    assert driver.states == {}  # the driver was never touched


def test_backend_refuses_a_request_that_names_no_process():
    driver = DriverStateMachine()
    with pytest.raises(ProcessMismatchError, match="registered no process on this node"):
        asyncio.run(CudaCheckpointBackend(driver).snapshot(request_for()))
    assert driver.states == {}


def test_bad_lock_timeout():
    with pytest.raises(ValueError, match="lock_timeout_s"):
        CudaCheckpointBackend(DriverStateMachine(), lock_timeout_s=0)


GPU_GIB = int(os.environ.get("TIMESLICE_GPU_CHECKPOINT_GIB", "1"))
GPU_CHILD = textwrap.dedent(
    f"""
    import sys, torch
    x = torch.full(({GPU_GIB} * 256 * 1024 * 1024,), 7.0, device="cuda")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    print("ok" if bool((x == 7.0).all()) else "corrupt", flush=True)
    """
)


@pytest.mark.gpu
def test_real_cuda_process_checkpoint_and_restore():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc = subprocess.Popen(
        [sys.executable, "-c", GPU_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        job = SnapshotRequest("gpu-job", processes=(ProcessIdentity.of(proc.pid),))
        backend = CudaCheckpointBackend()
        health = backend.health()
        print(f"cuda-checkpoint health: {health.detail}")
        assert health.ok, health.detail
        free_before = torch.cuda.mem_get_info()[0]
        snap = asyncio.run(backend.snapshot(job))
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= GPU_GIB * 1024**3, f"only {freed} bytes of device memory were freed"
        assert snap.bytes >= GPU_GIB * 1024**3 * 0.9
        restore = asyncio.run(backend.restore(job))
        print(
            f"cuda-checkpoint of {GPU_GIB} GiB: checkpoint {snap.seconds:.2f} s, "
            f"restore {restore.seconds:.2f} s"
        )
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
    finally:
        proc.kill()
        proc.wait()
