"""Data-parallel ranks for a workload: who this rank is, its process group, and switches.

A data-parallel job runs one process per rank; each samples its share of the batch and the
ranks average their gradients, so every rank ends each step with the same weights. The ranks
find each other the way ``torchrun`` and Ray's trainers tell them: the environment variables
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``timeslice.integrations.ray``
sets them in each rank's actor; set them yourself for ``timeslice job worker`` processes).

The process group (:class:`DataParallelGroup`) is built at the first collective of a phase and
torn down by :meth:`DataParallelGroup.collectives_backend`'s evictions, so a switch never
leaves a communicator on the device (docs/ray.md says what NCCL needs). Three choices make a
rebuild robust to ranks that died and were replaced:

* the group is a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object of this workload's, not
  the process's default group: ``init_process_group`` names each group from a per-process
  counter that a failed build advances and only a successful ``destroy_process_group`` resets,
  so a survivor of a lost rank and that rank's fresh replacement would meet under different
  keys (seen: a rewound job whose every rebuild timed out);
* each build meets under a key every rank of the phase shares and no other build uses: the
  fencing token of the lease the phase runs under (the RL job workflow hands every rank the
  same one), with the epoch and phase;
* rank 0 keeps one store for its process's life (the keys never repeat), and the others
  connect to ``MASTER_ADDR`` / ``MASTER_PORT`` afresh at each build, so a replaced rank 0
  (a new address) is found at the next one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, SnapshotBackend, SnapshotRequest
from timeslice.snapshot.collectives import CollectivesBackend
from timeslice.snapshot.device_room import DeviceRoom

RANK_ENV = ("RANK", "WORLD_SIZE")
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT")
DIST_BACKENDS = ("auto", "gloo", "nccl")


def _env_int(name: str, workload: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(
            f"{workload}: the environment variable {name} is not set; a data-parallel rank "
            f"needs {', '.join(RANK_ENV + RENDEZVOUS_ENV)} (torchrun's; "
            "timeslice.integrations.ray sets them in each rank's actor)"
        )
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{workload}: {name}={raw!r} is not an integer") from None


class CollectiveError(RuntimeError):
    """A collective or a build of the process group failed (a rank is gone, or late); the
    group is torn down, and the next collective builds it again."""


class DataParallelGroup:
    """This process's rank, and its process group, built lazily and torn down on eviction.

    Args:
        workload: The workload's name, for messages.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (NCCL for a CUDA device, else gloo).
        timeout_s: How long a collective (and a build's rendezvous) waits for the others.
        keep: Keep the group across switches (gloo on the CPU holds no device memory);
            False tears it down at every eviction, as NCCL needs.
    """

    def __init__(
        self, workload: str, *, backend: str = "auto", timeout_s: float = 60.0, keep: bool = False
    ) -> None:
        if backend not in DIST_BACKENDS:
            raise ValueError(f"{workload}: backend {backend!r} is not one of {DIST_BACKENDS}")
        self.workload = workload
        self.backend = backend
        self.timeout_s = timeout_s
        self.keep = keep
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        #: Process groups built, for tests and logs.
        self.builds = 0
        self._lock = threading.RLock()
        self._group: Any = None
        self._server: Any = None  # rank 0's store, for the process's life
        self._server_at: tuple[str, int] | None = None
        self._collectives: CollectivesBackend | None = None

    def configure(
        self, device: torch.device, *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        """Set this rank's place: ``rank`` and ``world_size``, or from the environment
        (``RANK``, ``WORLD_SIZE``); the rendezvous is read from it at each build.

        Raises:
            ValueError: A variable is missing or out of range (saying which).
        """
        if rank is None:
            rank = _env_int("RANK", self.workload)
        world = _env_int("WORLD_SIZE", self.workload) if world_size is None else world_size
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"{self.workload}: RANK={rank} must be in 0..WORLD_SIZE-1={world - 1}")
        for name in RENDEZVOUS_ENV:
            if world > 1 and not os.environ.get(name):
                raise ValueError(f"{self.workload}: {name} is not set (the rendezvous of rank 0)")
        self.rank, self.world_size, self.device = rank, world, device

    @property
    def dist_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.device.type == "cuda" else "gloo"

    def built(self) -> bool:
        """Whether the process group exists now."""
        return self._group is not None

    def _store(self) -> Any:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        timeout = timedelta(seconds=self.timeout_s)
        if self.rank != 0:
            return dist.TCPStore(addr, port, self.world_size, False, timeout)
        if self._server is None or self._server_at != (addr, port):
            self._server = dist.TCPStore(addr, port, self.world_size, True, timeout, False)
            self._server_at = (addr, port)
        return self._server

    def ensure(self, key: str) -> None:
        """Build the process group if it is not built: a rendezvous with every other rank
        under ``key``, which they all share and no other build uses (see the module)."""
        with self._lock:
            if self._group is not None or self.world_size == 1:
                return
            failure = None
            try:
                store = dist.PrefixStore(f"timeslice/{key}/", self._store())
                timeout = timedelta(seconds=self.timeout_s)
                if self.dist_backend == "nccl":
                    options = dist.ProcessGroupNCCL.Options()
                    options._timeout = timeout
                    group = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
                else:
                    group = dist.ProcessGroupGloo(store, self.rank, self.world_size, timeout)
            except Exception as err:  # raised below, without this frame's references
                failure = f"building the process group under {key!r} failed: {err}"
            if failure is not None:
                raise CollectiveError(f"{self.workload} rank {self.rank}: {failure}")
            self._group = group
            self.builds += 1

    def teardown(self) -> None:
        """Destroy the process group (its communicators and their device memory), if built."""
        with self._lock:
            group, self._group = self._group, None
            if group is not None:
                with contextlib.suppress(Exception):  # a broken group goes all the same
                    group.shutdown()

    def close(self) -> None:
        """Tear down, and let rank 0's store go (the workload is done)."""
        with self._lock:
            self.teardown()
            self._server = self._server_at = None

    def _run(self, tensor: torch.Tensor, key: str) -> None:
        """All-reduce (sum) ``tensor`` in place; a failure tears the group down."""
        self.ensure(key)
        failure = None
        try:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            self._group.allreduce([tensor], options).wait()
        except Exception as err:  # raised below, without the broken group's references
            failure = f"an all-reduce under {key!r} failed: {err}"
        if failure is not None:
            self.teardown()
            raise CollectiveError(f"{self.workload} rank {self.rank}: {failure}")

    def all_reduce_mean_(self, tensors: list[torch.Tensor], key: str) -> None:
        """Average ``tensors`` over the ranks, in place, in one collective (every rank ends
        with the same bytes); ``key`` as for :meth:`ensure`."""
        if self.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._run(flat, key)
        flat.div_(self.world_size)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_reduce_sum(self, values: list[float], key: str) -> list[float]:
        """The sums of ``values`` over the ranks (small metrics)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._run(t, key)
        return [float(v) for v in t.cpu()]

    def collectives_backend(self) -> CollectivesBackend:
        """The hook into the job's switches: a ``collectives`` state whose eviction tears the
        group down (unless ``keep``); the next collective after a restore rebuilds it."""
        if self._collectives is None:
            self._collectives = CollectivesBackend(self.teardown, self.built, keep=self.keep)
        return self._collectives


@dataclass(frozen=True)
class Move:
    """One eviction or restore of one state by this rank, on this host's monotonic clock."""

    state: str  # the workload's name for it ("trainer")
    action: str  # "evict" or "restore"
    start: float
    end: float
    bytes: int


class RecordedBackend:
    """A backend that records when each of its moves ran (``moves``), for checking that no
    two jobs' states were on one device at once; it moves what ``inner`` moves."""

    def __init__(self, state: str, inner: SnapshotBackend, log: list[Move]) -> None:
        self.state = state
        self.inner = inner
        self.name = inner.name
        self.capabilities: frozenset[Capability] = frozenset(inner.capabilities)
        self._log = log

    @property
    def registered_bytes(self) -> int:
        return int(self.inner.registered_bytes)  # type: ignore[attr-defined]

    def health(self) -> Any:
        return self.inner.health()

    def hold_in(self, room: DeviceRoom) -> None:
        """Count the state built on the device in ``room``, as ``inner`` does: this backend
        declares ``inner``'s capabilities, streaming through a device room among them.

        Args:
            room: The group's device room.
        """
        self.inner.hold_in(room)  # type: ignore[attr-defined]

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.monotonic()
        report = await self.inner.snapshot(request)
        self._log.append(Move(self.state, "evict", started, time.monotonic(), report.bytes))
        return report

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.monotonic()
        report = await self.inner.restore(request)
        self._log.append(Move(self.state, "restore", started, time.monotonic(), report.bytes))
        return report
