"""The ``cuda-checkpoint`` backend: transparent checkpoint of whole CUDA processes, by PID.

Through the CUDA driver's checkpoint API (``cuCheckpointProcessLock / Checkpoint / Restore /
Unlock / GetState``, driver 570 or newer) via cuda-python's ``cuda.bindings.driver``. Snapshot
locks each registered process (with a time-out: a lock waits for in-flight CUDA work), then
checkpoints it, which moves its device memory into its own host memory; restore reverses both.
The state is checked before every step, and every PID is checked to still be the process that
registered it. Bytes are measured as the change in each process's resident memory.
"""

from __future__ import annotations

import asyncio
import time
from enum import IntEnum
from typing import Protocol

from timeslice.snapshot.base import Health, SnapshotError
from timeslice.snapshot.processes import PidRegistry, resident_bytes
from timeslice.workflows.protocol import SnapshotReport

MIN_DRIVER_VERSION = 12080  # CUDA 12.8, shipped with driver 570: the first with this API


class CudaCheckpointUnavailable(SnapshotError):
    """cuda-python or a driver with the checkpoint API is missing."""


class ProcessState(IntEnum):
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CheckpointDriver(Protocol):
    def state(self, pid: int) -> ProcessState: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...


class CudaDriverApi:
    """The real driver, through cuda-python."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as err:
            raise CudaCheckpointUnavailable(
                "the cuda-checkpoint backend needs cuda-python: pip install 'timeslice[cuda]'"
            ) from err
        self._d = driver
        missing = [
            name
            for name in (
                "cuCheckpointProcessLock",
                "cuCheckpointProcessCheckpoint",
                "cuCheckpointProcessRestore",
                "cuCheckpointProcessUnlock",
                "cuCheckpointProcessGetState",
            )
            if not hasattr(driver, name)
        ]
        if missing:
            raise CudaCheckpointUnavailable(
                f"this cuda-python lacks {missing}; install cuda-python >= 12.8"
            )
        self._check("cuInit", driver.cuInit(0))
        version = self._check("cuDriverGetVersion", driver.cuDriverGetVersion())
        if version < MIN_DRIVER_VERSION:
            raise CudaCheckpointUnavailable(
                f"the CUDA driver supports CUDA {version // 1000}.{version % 1000 // 10}; the "
                "checkpoint API needs 12.8 (driver 570) or newer"
            )

    def _check(self, what: str, result: tuple) -> int:
        err, *value = result
        if int(err) != 0:
            _, name = self._d.cuGetErrorName(err)
            raise SnapshotError(f"{what} failed: {name.decode() if name else int(err)}")
        return int(value[0]) if value else 0

    def state(self, pid: int) -> ProcessState:
        return ProcessState(
            self._check("cuCheckpointProcessGetState", self._d.cuCheckpointProcessGetState(pid))
        )

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self._d.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._check("cuCheckpointProcessLock", self._d.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        self._check(
            "cuCheckpointProcessCheckpoint", self._d.cuCheckpointProcessCheckpoint(pid, None)
        )

    def restore(self, pid: int) -> None:
        self._check("cuCheckpointProcessRestore", self._d.cuCheckpointProcessRestore(pid, None))

    def unlock(self, pid: int) -> None:
        self._check("cuCheckpointProcessUnlock", self._d.cuCheckpointProcessUnlock(pid, None))


class CudaCheckpointBackend:
    name = "cuda-checkpoint"

    def __init__(
        self,
        registry: PidRegistry,
        driver: CheckpointDriver | None = None,
        *,
        lock_timeout_s: float = 10.0,
    ) -> None:
        if lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0, not {lock_timeout_s}")
        self.registry = registry
        self._driver = driver
        self.lock_timeout_s = lock_timeout_s

    @property
    def driver(self) -> CheckpointDriver:
        if self._driver is None:
            self._driver = CudaDriverApi()
        return self._driver

    def health(self) -> Health:
        try:
            self.driver  # noqa: B018 - constructing the driver is the check
        except SnapshotError as err:
            return Health(self.name, False, str(err))
        return Health(self.name, True, "CUDA driver checkpoint API available")

    def _expect(self, pid: int, expected: ProcessState, step: str) -> None:
        state = self.driver.state(pid)
        if state is not expected:
            raise SnapshotError(
                f"cannot {step} process {pid}: its CUDA state is {state.name}, "
                f"expected {expected.name}"
            )

    async def snapshot(self, job_id: str) -> SnapshotReport:
        return await asyncio.to_thread(self._run, job_id, checkpoint=True)

    async def restore(self, job_id: str) -> SnapshotReport:
        return await asyncio.to_thread(self._run, job_id, checkpoint=False)

    def _run(self, job_id: str, *, checkpoint: bool) -> SnapshotReport:
        started = time.perf_counter()
        moved = 0
        for identity in self.registry.verified(job_id):
            pid = identity.pid
            before = resident_bytes(pid)
            if checkpoint:
                self._expect(pid, ProcessState.RUNNING, "lock")
                self.driver.lock(pid, int(self.lock_timeout_s * 1000))
                self._expect(pid, ProcessState.LOCKED, "checkpoint")
                self.driver.checkpoint(pid)
                self._expect(pid, ProcessState.CHECKPOINTED, "confirm the checkpoint of")
            else:
                self._expect(pid, ProcessState.CHECKPOINTED, "restore")
                self.driver.restore(pid)
                self._expect(pid, ProcessState.LOCKED, "unlock")
                self.driver.unlock(pid)
                self._expect(pid, ProcessState.RUNNING, "confirm the restore of")
            moved += abs(resident_bytes(pid) - before)
        return SnapshotReport(
            job_id=job_id,
            backend=self.name,
            mode="checkpoint" if checkpoint else "restore",
            bytes=moved,
            seconds=time.perf_counter() - started,
        )
