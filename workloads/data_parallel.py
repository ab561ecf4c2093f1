"""Data-parallel ranks for a workload: who this rank is, its process group, and switches.

A data-parallel job runs one process per rank; each samples its share of the batch and the
ranks average their gradients, so every rank ends each step with the same weights. The ranks
find each other the way ``torchrun`` and Ray's trainers tell them: the environment variables
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``timeslice.integrations.ray``
sets them in each rank's actor; set them yourself for ``timeslice job worker`` processes).

The process group is this process's default ``torch.distributed`` group, built at the first
collective and torn down by :meth:`DataParallelGroup.collectives_backend`'s evictions, so a
switch never leaves a communicator on the device (docs/ray.md says what NCCL needs). A build
reads ``MASTER_ADDR`` / ``MASTER_PORT`` again, so a rank whose peers moved (a replaced rank 0)
finds them at the next one.
"""

from __future__ import annotations

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


class DataParallelGroup:
    """This process's rank, and its process group, built lazily and torn down on eviction.

    Args:
        workload: The workload's name, for messages.
        backend: ``"gloo"``, ``"nccl"`` or ``"auto"`` (NCCL for a CUDA device, else gloo).
        timeout_s: How long a collective (and the build's rendezvous) waits for the others.
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
        #: Process groups built in this process, for tests and logs.
        self.builds = 0
        self._lock = threading.Lock()
        self._built = False
        self._collectives: CollectivesBackend | None = None

    def configure(self, device: torch.device) -> None:
        """Read this rank's place from the environment (``RANK``, ``WORLD_SIZE``).

        Raises:
            ValueError: A variable is missing or out of range (saying which).
        """
        rank, world = _env_int("RANK", self.workload), _env_int("WORLD_SIZE", self.workload)
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
        return self._built

    def ensure(self) -> None:
        """Build the process group if it is not built: a rendezvous with every other rank, so
        call it where every rank is (the first collective of a phase)."""
        with self._lock:
            if self._built or self.world_size == 1:
                return
            if dist.is_initialized():
                raise RuntimeError(
                    f"{self.workload}: this process already has a default process group that "
                    "this workload did not build; a data-parallel rank owns its process's group"
                )
            addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
            extra: dict[str, Any] = {}
            if self.dist_backend == "nccl":
                extra["device_id"] = self.device
            dist.init_process_group(
                self.dist_backend,
                init_method=f"tcp://{addr}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.timeout_s),
                **extra,
            )
            self._built = True
            self.builds += 1

    def teardown(self) -> None:
        """Destroy the process group (its communicators and their device memory), if built."""
        with self._lock:
            if self._built:
                self._built = False
                dist.destroy_process_group()

    def all_reduce_mean_(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the ranks, in place, in one collective (every rank ends
        with the same bytes)."""
        if self.world_size == 1 or not tensors:
            return
        self.ensure()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(self.world_size)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The sums of ``values`` over the ranks (small metrics)."""
        if self.world_size == 1:
            return list(values)
        self.ensure()
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
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
