"""cuda-checkpoint backend: PID identity checks, the driver state machine and its error paths.

The state-machine tests drive the backend through a stand-in for the CUDA driver
(tests/fake_cuda_driver.py) that keeps each process's checkpoint state as the driver documents
it; the processes themselves are real.
The `gpu` tests run the real driver API on real CUDA processes (tests/gpu/run.sh), the rollback
of a job whose second process fails included. Missing bindings or driver, and
the bindings' call shapes: tests/test_gpu_readiness.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot import SnapshotError, SnapshotRequest
from timeslice.snapshot.cuda_checkpoint import CudaCheckpointBackend, ProcessState
from timeslice.snapshot.processes import (
    PidRegistry,
    ProcessIdentity,
    ProcessMismatchError,
    process_start_time,
)

from .fake_cuda_driver import DriverStateMachine


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


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


def test_a_process_registered_twice_stays_registered_until_both_close(child):
    """One process with two registrations (two clients of its job, each its own connection to
    the agent): closing one leaves the process registered, so an eviction still finds it."""
    registry = PidRegistry()
    real = ProcessIdentity.of(child.pid)
    registry.register("job-a", real)
    registry.register("job-a", real)
    registry.unregister("job-a", real)
    assert registry.verified("job-a") == [real]
    registry.unregister("job-a", real)
    with pytest.raises(ProcessMismatchError, match="registered no process"):
        registry.verified("job-a")
    registry.unregister("job-a", real)  # a third close changes nothing


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


@pytest.fixture
def two_children():
    """Two real processes, lower PID first (the order the backend moves them in)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)
    ]
    yield sorted(procs, key=lambda p: p.pid)
    for proc in procs:
        proc.kill()
        proc.wait()


def test_checkpoint_failing_on_the_second_process_rolls_the_first_back(two_children):
    first, second = (ProcessIdentity.of(p.pid) for p in two_children)
    job = request_for(first, second)
    driver = DriverStateMachine(failures={("checkpoint", second.pid): "CUDA_ERROR_OUT_OF_MEMORY"})
    backend = CudaCheckpointBackend(driver)
    with pytest.raises(SnapshotError) as failed:
        asyncio.run(backend.snapshot(job))
    message = str(failed.value)
    assert "checkpoint failed: cuCheckpointProcessCheckpoint failed: CUDA_ERROR_OUT_OF_MEMORY" in (
        message
    )
    assert f"rolled back process(es) {sorted([first.pid, second.pid])} to RUNNING" in message
    assert "could not" not in message
    # Nobody is left checkpointed or locked: the second is unlocked, the first restored.
    assert driver.states == {first.pid: ProcessState.RUNNING, second.pid: ProcessState.RUNNING}
    assert driver.calls[-3:] == [
        ("unlock", second.pid),
        ("restore", first.pid),
        ("unlock", first.pid),
    ]
    # The job can be moved once the driver works again.
    driver.failures.clear()
    asyncio.run(backend.snapshot(job))
    assert set(driver.states.values()) == {ProcessState.CHECKPOINTED}


def test_restore_failing_on_the_second_process_checkpoints_the_first_again(two_children):
    """Half a job running beside the next holder is worse than a job not restored: the
    first process goes back to CHECKPOINTED, so the device stays free, and the failure is
    reported (the group then marks the job faulted)."""
    first, second = (ProcessIdentity.of(p.pid) for p in two_children)
    job = request_for(first, second)
    driver = DriverStateMachine()
    backend = CudaCheckpointBackend(driver)
    asyncio.run(backend.snapshot(job))
    driver.failures[("restore", second.pid)] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(SnapshotError) as failed:
        asyncio.run(backend.restore(job))
    message = str(failed.value)
    assert "restore failed: cuCheckpointProcessRestore failed: CUDA_ERROR_OUT_OF_MEMORY" in message
    assert "to CHECKPOINTED" in message and "could not" not in message
    assert driver.states == {
        first.pid: ProcessState.CHECKPOINTED,
        second.pid: ProcessState.CHECKPOINTED,
    }
    assert driver.calls[-2:] == [("lock", first.pid), ("checkpoint", first.pid)]
    driver.failures.clear()
    asyncio.run(backend.restore(job))
    assert set(driver.states.values()) == {ProcessState.RUNNING}


def test_a_process_registered_while_its_job_was_checkpointed_is_left_running(two_children):
    """A rank of the job started again (and registered) while the job was out: it was never
    checkpointed, so the job's restore brings back the process it checkpointed and leaves the
    new one be, instead of failing on it and checkpointing the first again."""
    first, second = (ProcessIdentity.of(p.pid) for p in two_children)
    driver = DriverStateMachine()
    backend = CudaCheckpointBackend(driver)
    asyncio.run(backend.snapshot(request_for(first)))
    report = asyncio.run(backend.restore(request_for(first, second)))
    assert report.mode == "restore"
    assert driver.states == {first.pid: ProcessState.RUNNING, second.pid: ProcessState.RUNNING}
    assert driver.calls == [("lock", first.pid), ("checkpoint", first.pid),
                            ("restore", first.pid), ("unlock", first.pid)]  # fmt: skip
    # Both are the job's from now on: the next eviction moves both.
    asyncio.run(backend.snapshot(request_for(first, second)))
    assert set(driver.states.values()) == {ProcessState.CHECKPOINTED}
    asyncio.run(backend.restore(request_for(first, second)))
    assert set(driver.states.values()) == {ProcessState.RUNNING}


def test_a_rollback_that_fails_says_which_process_is_left_where(two_children):
    first, second = (ProcessIdentity.of(p.pid) for p in two_children)
    driver = DriverStateMachine(
        failures={
            ("checkpoint", second.pid): "CUDA_ERROR_OUT_OF_MEMORY",
            ("restore", first.pid): "CUDA_ERROR_UNKNOWN",
        }
    )
    with pytest.raises(SnapshotError) as failed:
        asyncio.run(CudaCheckpointBackend(driver).snapshot(request_for(first, second)))
    message = str(failed.value)
    assert f"rolled back process(es) [{second.pid}] to RUNNING" in message
    assert f"could not roll back: process {first.pid}: " in message
    assert "CUDA_ERROR_UNKNOWN" in message
    assert driver.states[first.pid] is ProcessState.CHECKPOINTED


def test_a_failure_before_any_process_is_touched_rolls_nothing_back(two_children):
    first, second = (ProcessIdentity.of(p.pid) for p in two_children)
    changed = ProcessIdentity(first.pid, first.start_time + 1)
    driver = DriverStateMachine()
    with pytest.raises(ProcessMismatchError, match="now belongs to another process"):
        asyncio.run(CudaCheckpointBackend(driver).snapshot(request_for(changed, second)))
    assert driver.calls == []

    class NoDriver(DriverStateMachine):
        def state(self, pid: int) -> ProcessState:
            raise SnapshotError("cuCheckpointProcessGetState failed: CUDA_ERROR_NOT_INITIALIZED")

    with pytest.raises(SnapshotError, match="CUDA_ERROR_NOT_INITIALIZED") as failed:
        asyncio.run(CudaCheckpointBackend(NoDriver()).snapshot(request_for(first, second)))
    # The very error, not one caused by itself (Temporal's failure converter would recurse).
    assert failed.value.__cause__ is None and "rolled back" not in str(failed.value)


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


ROLLBACK_GIB = 1
ROLLBACK_CHILD = GPU_CHILD.replace(f"({GPU_GIB} * 256", f"({ROLLBACK_GIB} * 256")


def _rolled_back(message: str, to: str) -> set[int]:
    """The PIDs a rollback report says it moved back to state ``to``."""
    found = re.search(rf"rolled back process\(es\) \[([\d, ]+)\] to {to}", message)
    return {int(pid) for pid in found.group(1).split(",")} if found else set()


@pytest.mark.gpu
def test_real_cuda_checkpoint_rollback_when_the_second_process_fails():
    """A job of two processes whose second has no CUDA context, so the real driver fails on
    it: the first, checkpointed by then, is restored and unlocked (a failed checkpoint), or
    checkpointed again (a failed restore), and its device memory is intact afterwards."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda_proc = subprocess.Popen(
        [sys.executable, "-c", ROLLBACK_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    spawned: list[subprocess.Popen] = []
    try:
        assert cuda_proc.stdout.readline().strip() == "ready"
        # The backend moves processes in PID order: the CUDA one must come first.
        for _ in range(5):
            spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]))
            if spawned[-1].pid > cuda_proc.pid:
                break
        else:
            pytest.skip("PIDs wrapped around: no process with a PID above the CUDA one")
        cuda_id, plain_id = ProcessIdentity.of(cuda_proc.pid), ProcessIdentity.of(spawned[-1].pid)
        backend = CudaCheckpointBackend(lock_timeout_s=5.0)
        health = backend.health()
        assert health.ok, health.detail
        job = SnapshotRequest("gpu-job", processes=(cuda_id, plain_id))
        alone = SnapshotRequest("gpu-job", processes=(cuda_id,))

        with pytest.raises(SnapshotError) as failed:
            asyncio.run(backend.snapshot(job))
        print(f"cuda-checkpoint rollback of a failed checkpoint: {failed.value}")
        assert cuda_proc.pid in _rolled_back(str(failed.value), "RUNNING")
        assert "could not roll back" not in str(failed.value)
        assert backend.driver.state(cuda_proc.pid) is ProcessState.RUNNING

        free_running = torch.cuda.mem_get_info()[0]
        asyncio.run(backend.snapshot(alone))
        with pytest.raises(SnapshotError) as failed:
            asyncio.run(backend.restore(job))
        print(f"cuda-checkpoint rollback of a failed restore: {failed.value}")
        assert cuda_proc.pid in _rolled_back(str(failed.value), "CHECKPOINTED")
        assert backend.driver.state(cuda_proc.pid) is ProcessState.CHECKPOINTED
        freed = torch.cuda.mem_get_info()[0] - free_running
        assert freed >= ROLLBACK_GIB * 1024**3, f"only {freed} bytes are free again"

        asyncio.run(backend.restore(alone))
        cuda_proc.stdin.write("\n")
        cuda_proc.stdin.flush()
        assert cuda_proc.stdout.readline().strip() == "ok"
    finally:
        for proc in [cuda_proc, *spawned]:
            proc.kill()
            proc.wait()


def _a_thread_waits_in(function: str) -> bool:
    """Whether some thread's innermost Python frame is ``function`` (blocked in a C call it
    made, such as acquiring a lock)."""
    return any(f.f_code.co_name == function for f in sys._current_frames().values())


class _SlowCheckpoint(DriverStateMachine):
    """A driver whose checkpoint call takes until the test lets it end (a slow device)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.go = threading.Event(), threading.Event()

    def checkpoint(self, pid: int) -> None:
        self.entered.set()
        self.go.wait(60)
        super().checkpoint(pid)


def test_moves_of_one_job_take_turns_and_one_abandoned_before_its_turn_never_runs(child):
    """The group's eviction timed out (its activity cancelled) while the driver still
    checkpoints; the job's next restore must wait for that checkpoint to end, not fail on a
    process still LOCKED (or restore beside it), and a restore cancelled while it waited its
    turn (its switch given up) must never run."""
    job = request_for(ProcessIdentity.of(child.pid))
    driver = _SlowCheckpoint()
    backend = CudaCheckpointBackend(driver)

    async def scenario() -> tuple[SnapshotReport, bool, bool]:
        eviction = asyncio.create_task(backend.snapshot(job))
        await asyncio.to_thread(driver.entered.wait, 60)
        eviction.cancel()  # timed out at the group; the driver call goes on
        given_up = asyncio.create_task(backend.restore(job))
        await asyncio.sleep(0)  # its thread asked for the job's turn
        given_up.cancel()
        restore = asyncio.create_task(backend.restore(job))
        # Until it has failed (moving beside the checkpoint) or waits for the job's turn.
        while not (restore.done() or _a_thread_waits_in("_run_in_turn")):
            await asyncio.sleep(0.01)
        driver.go.set()
        report = await asyncio.wait_for(restore, timeout=60)
        await asyncio.gather(eviction, given_up, return_exceptions=True)
        return report, eviction.cancelled(), given_up.cancelled()

    report, eviction_cancelled, given_up_cancelled = asyncio.run(scenario())
    assert eviction_cancelled and given_up_cancelled
    assert report.mode == "restore"
    pid = child.pid
    assert driver.calls == [("lock", pid), ("checkpoint", pid), ("restore", pid), ("unlock", pid)]
    assert driver.states[pid] is ProcessState.RUNNING
