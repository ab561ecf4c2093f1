"""The ``cuda-checkpoint`` backend: transparent checkpoint of whole CUDA processes, by PID.

Through the CUDA driver's checkpoint API (``cuCheckpointProcessLock / Checkpoint / Restore /
Unlock / GetState``, driver 570 or newer) via cuda-python's ``cuda.bindings.driver``. Snapshot
locks each registered process (with a time-out: a lock waits for in-flight CUDA work), then
checkpoints it, which moves its device memory into its own host memory; restore reverses both.
The state is checked before every step, and every PID is checked to still be the process that
registered it. A job's processes move all or nothing: when one fails, those already moved are
moved back (restored and unlocked after a failed checkpoint, checkpointed again after a failed
restore) before the failure is reported, and the report says what could not be moved back.
Bytes are measured as the change in each process's resident memory.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import time
from enum import IntEnum
from types import ModuleType
from typing import Any, Protocol

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotError, SnapshotRequest, move_report
from timeslice.snapshot.gpu_env import (
    MIN_CUDA_VERSION,
    checkpoint_blockers,
    cuda_text,
    install_advice,
    package_version,
    probe_driver,
)
from timeslice.snapshot.processes import (
    ProcessIdentity,
    ProcessMismatchError,
    process_start_time,
    resident_bytes,
)

log = logging.getLogger(__name__)

MIN_DRIVER_VERSION = MIN_CUDA_VERSION  # CUDA 12.8, shipped with driver 570: the first with this API


class CudaCheckpointUnavailable(SnapshotError):
    """No cuda-python, no driver with the checkpoint API, or bindings that do not fit it."""


class ProcessState(IntEnum):
    """CUprocessState (CHECKPOINTING and RESTORING are reported by CUDA 13 drivers)."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


# Every cuda.bindings.driver call this module makes: parameter names, and the names of the
# values after the CUresult in the tuple it returns (from the "Returns" section cuda-bindings
# generates into each docstring). `call_shape_drift` checks an installed cuda-bindings against
# this table; the tests check that the table covers every call below.
DRIVER_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cuInit": (("Flags",), ()),
    "cuDriverGetVersion": ((), ("driverVersion",)),
    "cuGetErrorName": (("error",), ("pStr",)),
    "cuCheckpointProcessGetState": (("pid",), ("state",)),
    "cuCheckpointProcessLock": (("pid", "args"), ()),
    "cuCheckpointProcessCheckpoint": (("pid", "args"), ()),
    "cuCheckpointProcessRestore": (("pid", "args"), ()),
    "cuCheckpointProcessUnlock": (("pid", "args"), ()),
}
# Struct fields this module sets, and the CUprocessState members it maps by value.
DRIVER_STRUCT_FIELDS: dict[str, tuple[str, ...]] = {"CUcheckpointLockArgs": ("timeoutMs",)}
PROCESS_STATE_MEMBERS = {f"CU_PROCESS_STATE_{s.name}": s.value for s in ProcessState}


def _returned_names(doc: str | None) -> tuple[str, ...] | None:
    """Names in a numpydoc "Returns" section after the leading CUresult; None if there is none."""
    lines = (doc or "").splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() != "Returns" or set(lines[i + 1].strip()) != {"-"}:
            continue
        # Entries sit at the header's indent, their descriptions deeper; older releases indent
        # the whole docstring, so the indent is taken from the header, not assumed.
        indent = len(line) - len(line.lstrip())
        names = []
        for entry in lines[i + 2 :]:
            if not entry.strip():
                break
            if len(entry) - len(entry.lstrip()) == indent:
                names.append(entry.strip().split(" :")[0])
        return tuple(names[1:]) if names[:1] == ["CUresult"] else None
    return None


def call_shape_drift(
    driver: ModuleType,
    calls: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = DRIVER_CALLS,
    fields: dict[str, tuple[str, ...]] = DRIVER_STRUCT_FIELDS,
    states: dict[str, int] = PROCESS_STATE_MEMBERS,
) -> list[str]:
    """How an installed ``cuda.bindings.driver`` differs from the calls this backend makes."""
    drift = []
    for name, (params, returns) in calls.items():
        fn = getattr(driver, name, None)
        if fn is None:
            drift.append(f"{name} is missing")
            continue
        try:
            found = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            drift.append(f"{name} has no inspectable signature")
            continue
        if found != params:
            drift.append(f"{name}{found} instead of {name}{params}")
        returned = _returned_names(fn.__doc__)
        if returned != returns:
            drift.append(f"{name} returns (CUresult, {returned}) instead of (CUresult, {returns})")
    for struct, names in fields.items():
        cls = getattr(driver, struct, None)
        if cls is None:
            drift.append(f"{struct} is missing")
            continue
        try:
            instance = cls()
        except Exception as err:
            drift.append(f"{struct}() raised {type(err).__name__}: {err}")
            continue
        for field in names:
            try:
                setattr(instance, field, 1234)
                ok = int(getattr(instance, field)) == 1234
            except (AttributeError, TypeError, ValueError):
                ok = False
            if not ok:
                drift.append(f"{struct}.{field} cannot be set to an integer")
    enum = getattr(driver, "CUprocessState", None)
    if enum is None:
        drift.append("CUprocessState is missing")
    else:
        for member, value in states.items():
            found_value = getattr(enum, member, None)
            if found_value is None:
                # The CUDA 12 bindings stop at FAILED; the later states are CUDA 13 additions.
                if value <= ProcessState.FAILED:
                    drift.append(f"CUprocessState.{member} is missing")
            elif int(found_value) != value:
                drift.append(f"CUprocessState.{member} is {int(found_value)}, not {value}")
    return drift


class CheckpointDriver(Protocol):
    def state(self, pid: int) -> ProcessState: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int) -> None: ...
    def unlock(self, pid: int) -> None: ...


class CudaDriverApi:
    """The real driver, through cuda-python's ``cuda.bindings.driver``.

    Construction checks, in order: the bindings import, their call shapes match this module's,
    they fit the driver's CUDA major, ``cuInit`` succeeds and the driver has the checkpoint API.
    Any failure, whatever the bindings raise, becomes ``CudaCheckpointUnavailable`` saying why
    and what to install.
    """

    def __init__(self) -> None:
        found = probe_driver()
        bindings = package_version("cuda-bindings")
        advice = install_advice(found, bindings)
        try:
            from cuda.bindings import driver
        except Exception as err:  # an ImportError, or a broken install raising anything else
            why = "; ".join(checkpoint_blockers(bindings, found))
            raise CudaCheckpointUnavailable(
                f"cannot import cuda.bindings.driver ({type(err).__name__}: {err}); {why}. "
                f"To use it: {advice}"
            ) from err
        self._d = driver
        self.bindings_version = bindings or str(
            getattr(sys.modules.get("cuda.bindings"), "__version__", "unknown")
        )
        drift = call_shape_drift(driver)
        if drift:
            raise CudaCheckpointUnavailable(
                f"cuda-bindings {self.bindings_version} does not have the calls this backend "
                f"makes: {'; '.join(drift)}. To use it: {advice}"
            )
        blockers = checkpoint_blockers(self.bindings_version, found)
        if found.cuda_version is not None and blockers:
            raise CudaCheckpointUnavailable(f"{'; '.join(blockers)}. To use it: {advice}")
        try:
            self._call("cuInit", 0)
            version = self._call("cuDriverGetVersion")
        except SnapshotError as err:
            # Without a driver, cuda-bindings 12.9+ raises cuda.pathfinder's
            # DynamicLibNotFoundError from cuInit and 12.8 a RuntimeError: neither is an
            # ImportError nor a CUresult; _call turns both into a SnapshotError.
            why = "; ".join(blockers) or found.describe()
            raise CudaCheckpointUnavailable(f"{err}; {why}. To use it: {advice}") from err
        if version < MIN_DRIVER_VERSION:
            raise CudaCheckpointUnavailable(
                f"the CUDA driver supports CUDA {cuda_text(version)}; the checkpoint API needs "
                f"12.8 (driver 570) or newer. To use it: {advice}"
            )
        self.found = found
        self.cuda_version = version

    def describe(self) -> str:
        module = self.found.kernel_module or "(kernel module version unknown)"
        return (
            f"NVIDIA driver {module} (CUDA {cuda_text(self.cuda_version)}), "
            f"cuda-bindings {self.bindings_version}"
        )

    def _check(self, what: str, result: Any) -> int:
        err, *value = result
        if int(err) != 0:
            _, name = self._d.cuGetErrorName(err)
            raise SnapshotError(f"{what} failed: {name.decode() if name else int(err)}")
        return int(value[0]) if value else 0

    def _call(self, what: str, *args: Any) -> int:
        try:
            return self._check(what, getattr(self._d, what)(*args))
        except SnapshotError:
            raise
        except Exception as err:  # the bindings raise, not return, when the library is gone
            raise SnapshotError(f"{what} raised {type(err).__name__}: {err}") from err

    def state(self, pid: int) -> ProcessState:
        value = self._call("cuCheckpointProcessGetState", pid)
        try:
            return ProcessState(value)
        except ValueError:
            raise SnapshotError(f"process {pid} is in unknown CUDA state {value}") from None

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self._d.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int) -> None:
        self._call("cuCheckpointProcessRestore", pid, None)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, None)


class CudaCheckpointBackend:
    """Checkpoints the request's processes: the node agent fills them from the processes that
    registered themselves with it (``WHOLE_PROCESS``); each is checked again to be that very
    process just before its state is touched."""

    name = "cuda-checkpoint"
    capabilities = frozenset({Capability.WHOLE_PROCESS})

    def __init__(
        self, driver: CheckpointDriver | None = None, *, lock_timeout_s: float = 10.0
    ) -> None:
        if lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0, not {lock_timeout_s}")
        self._driver = driver
        self.lock_timeout_s = lock_timeout_s
        # Job id -> its turn: one move of a job at a time, held by the thread that makes the
        # driver calls, so a move whose activity was cancelled (it timed out at the group)
        # keeps the job's processes until its calls have ended.
        self._turns: dict[str, threading.Lock] = {}
        self._turns_guard = threading.Lock()
        # Job id -> the processes its last checkpoint here moved out, until they are restored:
        # a process of the job that registered since never was, and its restore leaves it be.
        self._out: dict[str, frozenset[ProcessIdentity]] = {}

    @property
    def driver(self) -> CheckpointDriver:
        """The driver's checkpoint API: the one given, or the real one (cuda-python), loaded on
        first use.

        Raises:
            CudaCheckpointUnavailable: The real driver cannot be loaded here (the message says
                what to install).
        """
        if self._driver is None:
            self._driver = CudaDriverApi()
        return self._driver

    def health(self) -> Health:
        """Whether the driver's checkpoint API loads here.

        Returns:
            ``Health`` ok with the driver found, or not ok saying why it cannot load.
        """
        try:
            driver = self.driver
        except Exception as err:  # a health check reports; it never stops the agent
            return Health(self.name, False, str(err))
        found = driver.describe() if isinstance(driver, CudaDriverApi) else type(driver).__name__
        return Health(self.name, True, f"{found}: checkpoint API available")

    def _expect(self, pid: int, expected: ProcessState, step: str) -> None:
        state = self.driver.state(pid)
        if state is not expected:
            raise SnapshotError(
                f"cannot {step} process {pid}: its CUDA state is {state.name}, "
                f"expected {expected.name}"
            )

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        """Lock and checkpoint each of the request's processes (by PID), all or none.

        Args:
            request: The job and, filled by the node agent, its processes on this node.

        Returns:
            Mode ``checkpoint``: the device bytes the processes held.

        Raises:
            ProcessMismatchError: No process registered, or one is no longer the process that
                registered.
            SnapshotError: A process failed (those already checkpointed are restored first).
        """
        return await self._in_turn(request, checkpoint=True)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        """Restore and unlock each process checkpointed, all or none.

        Args:
            request: As for :meth:`snapshot`.

        Returns:
            Mode ``restore``: the bytes brought back.

        Raises:
            ProcessMismatchError: As :meth:`snapshot` raises it.
            SnapshotError: A process failed (those restored already are checkpointed again).
        """
        return await self._in_turn(request, checkpoint=False)

    async def _in_turn(self, request: SnapshotRequest, *, checkpoint: bool) -> SnapshotReport:
        """Run the move in a thread, in the job's turn; a move cancelled before its turn came
        never runs (a restore asked by a switch the group has given up on would otherwise run
        after the eviction that followed it)."""
        abandoned = threading.Event()
        try:
            return await asyncio.to_thread(self._run_in_turn, request, checkpoint, abandoned)
        except asyncio.CancelledError:
            abandoned.set()  # begun: it ends as it would (a driver call cannot be stopped)
            raise

    def _run_in_turn(
        self, request: SnapshotRequest, checkpoint: bool, abandoned: threading.Event
    ) -> SnapshotReport:
        with self._turns_guard:
            turn = self._turns.setdefault(request.job_id, threading.Lock())
        with turn:
            if abandoned.is_set():
                verb = "checkpoint" if checkpoint else "restore"
                raise SnapshotError(
                    f"{verb} of job {request.job_id} abandoned by its caller while another "
                    "move of the job ran; not started"
                )
            return self._run(request, checkpoint=checkpoint)

    def _run(self, request: SnapshotRequest, *, checkpoint: bool) -> SnapshotReport:
        """All or nothing: if any process fails, those already moved (and the one that failed,
        if it was touched) are moved back before the failure is reported, so a job is never
        left half checkpointed (some of its processes still holding the device) or half
        restored (some running beside the next holder)."""
        job_id = request.job_id
        if not request.processes:
            raise ProcessMismatchError(f"job {job_id} registered no process on this node")
        started = time.perf_counter()
        moved = 0
        done: list[ProcessIdentity] = []
        processes = request.processes if checkpoint else self._to_restore(request)
        for identity in sorted(processes, key=lambda i: i.pid):
            touched: list[ProcessIdentity] = []
            try:
                moved += self._move(job_id, identity, checkpoint=checkpoint, touched=touched)
            except Exception as err:
                if not done and not touched:
                    raise  # nothing was moved: nothing to roll back
                raise self._rolled_back(err, [*done, *touched], checkpoint=checkpoint) from err
            done.append(identity)
        if checkpoint:
            self._out[job_id] = frozenset(done)
        else:
            self._out.pop(job_id, None)
        mode = "checkpoint" if checkpoint else "restore"
        return move_report(self.name, job_id, mode, moved, started)

    def _to_restore(self, request: SnapshotRequest) -> tuple[ProcessIdentity, ...]:
        """The request's processes less those that registered after the job's checkpoint here
        and run: they were never checkpointed (a rank that started again meanwhile), and
        restoring them would fail the job's restore. Without a record of that checkpoint (the
        agent started since) every process is restored, and one not checkpointed fails."""
        out = self._out.get(request.job_id)
        if out is None:
            return request.processes
        since = [
            p
            for p in request.processes
            if p not in out and self.driver.state(p.pid) is ProcessState.RUNNING
        ]
        for identity in since:
            log.info(
                "job %s: process %d registered after its checkpoint and runs; not restored",
                request.job_id,
                identity.pid,
            )
        return tuple(p for p in request.processes if p not in since)

    def _move(
        self,
        job_id: str,
        identity: ProcessIdentity,
        *,
        checkpoint: bool,
        touched: list[ProcessIdentity],
    ) -> int:
        """Checkpoint (or restore) one process; the bytes it moved. ``touched`` gets the
        process once a call that changes its state has been made."""
        pid = identity.pid
        if process_start_time(pid) != identity.start_time:
            raise ProcessMismatchError(
                f"PID {pid} of job {job_id} now belongs to another process; refusing"
            )
        before = resident_bytes(pid)
        if checkpoint:
            self._expect(pid, ProcessState.RUNNING, "lock")
            touched.append(identity)
            self.driver.lock(pid, int(self.lock_timeout_s * 1000))
            self._expect(pid, ProcessState.LOCKED, "checkpoint")
            self.driver.checkpoint(pid)
            self._expect(pid, ProcessState.CHECKPOINTED, "confirm the checkpoint of")
        else:
            self._expect(pid, ProcessState.CHECKPOINTED, "restore")
            touched.append(identity)
            self.driver.restore(pid)
            self._expect(pid, ProcessState.LOCKED, "unlock")
            self.driver.unlock(pid)
            self._expect(pid, ProcessState.RUNNING, "confirm the restore of")
        return abs(resident_bytes(pid) - before)

    def _rolled_back(
        self, err: Exception, touched: list[ProcessIdentity], *, checkpoint: bool
    ) -> SnapshotError:
        """Move ``touched`` back (latest first) to where they were before this snapshot (or
        restore); the error to report, saying what was rolled back and what could not be."""
        origin = ProcessState.RUNNING if checkpoint else ProcessState.CHECKPOINTED
        back, stuck = [], []
        for identity in reversed(touched):
            left = self._return_to(identity, origin)
            if left is None:
                back.append(identity.pid)
            else:
                stuck.append(left)
        verb = "checkpoint" if checkpoint else "restore"
        said = f"{verb} failed: {err}"
        if back:
            said += f"; rolled back process(es) {sorted(back)} to {origin.name}"
        if stuck:
            said += f"; could not roll back: {'; '.join(stuck)}"
        return SnapshotError(said)

    def _return_to(self, identity: ProcessIdentity, origin: ProcessState) -> str | None:
        """Drive one process back to ``origin``; None once it is there, else what is left."""
        pid = identity.pid
        steps = _TOWARDS[origin]
        try:
            if process_start_time(pid) != identity.start_time:
                return f"PID {pid} now belongs to another process; left alone"
            for _ in range(len(steps) + 1):
                state = self.driver.state(pid)
                if state is origin:
                    return None
                step = steps.get(state)
                if step is None:
                    return f"process {pid} is {state.name}"
                if step == "lock":
                    self.driver.lock(pid, int(self.lock_timeout_s * 1000))
                else:
                    getattr(self.driver, step)(pid)
            return f"process {pid} is {self.driver.state(pid).name}"
        except Exception as err:  # a rollback reports what it could not do; it never hides
            return f"process {pid}: {err}"  # the failure that started it


# From each state, the driver call that brings a process one step closer to RUNNING (rolling
# back a checkpoint) or to CHECKPOINTED (rolling back a restore).
_TOWARDS: dict[ProcessState, dict[ProcessState, str]] = {
    ProcessState.RUNNING: {ProcessState.CHECKPOINTED: "restore", ProcessState.LOCKED: "unlock"},
    ProcessState.CHECKPOINTED: {ProcessState.RUNNING: "lock", ProcessState.LOCKED: "checkpoint"},
}
