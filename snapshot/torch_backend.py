"""The ``torch`` backend: move registered tensors to host DRAM and back, in place.

The unit of work is a tensor *storage*, not a tensor: views, tied weights and optimizer state that
share memory are moved once, and every tensor object (parameters, optimizer state, anything a
hook captured) stays the same Python object. Snapshot copies each storage into a host buffer
(on CUDA: pinned buffers reused across switches, asynchronous copies on a side stream), then
shrinks the storage to zero bytes, which frees the device memory; restore grows it back and
copies the bytes home. Work goes chunk by chunk, freeing as it goes, so peak memory never holds
a second full copy of the state.

On a machine without CUDA the same code runs on CPU tensors, which is how the tests run it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import Capability, Health, SnapshotError, SnapshotRequest
from timeslice.snapshot.hugepages import advise_huge_pages

try:
    import torch
except ImportError as err:  # a clean message instead of a bare ImportError deep in a worker
    raise ImportError(
        "the torch snapshot backend needs PyTorch: pip install 'timeslice[torch]'"
    ) from err

Mode = Literal["offload", "discard"]


@dataclass
class _Entry:
    """One storage to move, and its host buffer once allocated."""

    names: list[str]
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor | None = None
    evicted: bool = False


class TorchBackend:
    """Snapshot / restore registered modules, optimizers and tensors.

    ``include`` / ``exclude`` are shell-style patterns over the qualified names
    (``"policy.layers.0.lora_A*"``); with neither, everything registered moves.
    """

    name = "torch"
    capabilities = frozenset({Capability.KNOWS_SIZE})

    def __init__(
        self,
        *,
        mode: Mode = "offload",
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        chunk_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        if mode not in ("offload", "discard"):
            raise ValueError(f"mode must be 'offload' or 'discard', not {mode!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.mode: Mode = mode
        self.include = list(include or [])
        self.exclude = list(exclude or [])
        self._tensors: dict[str, torch.Tensor] = {}
        self._entries: list[_Entry] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ registration

    def register_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        with self._lock:
            if any(e.evicted for e in self._entries or []):
                raise SnapshotError("cannot register tensors while the state is evicted")
            self._tensors[name] = tensor
            self._entries = None

    def register_module(self, name: str, module: torch.nn.Module) -> None:
        for pname, param in module.named_parameters(prefix=name):
            self.register_tensor(pname, param)
        for bname, buf in module.named_buffers(prefix=name):
            self.register_tensor(bname, buf)

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """Register the optimizer's state tensors (Adam's moments, step counters ...).

        Call after at least one step: optimizers create their state lazily.
        """
        index = {id(p): i for i, p in enumerate(_params(optimizer))}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.register_tensor(f"{name}.state.{index.get(id(param), '?')}.{key}", value)

    def selected_names(self) -> list[str]:
        return [n for n in self._tensors if self._selected(n)]

    def _selected(self, name: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)

    def _plan(self) -> list[_Entry]:
        if self._entries is None:
            by_storage: dict[tuple[str, int], _Entry] = {}
            for name, tensor in self._tensors.items():
                if not self._selected(name) or tensor.numel() == 0:
                    continue
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr())
                if key in by_storage:
                    by_storage[key].names.append(name)
                else:
                    by_storage[key] = _Entry([name], storage, storage.nbytes(), tensor.device)
            self._entries = list(by_storage.values())
        return self._entries

    def health(self) -> Health:
        entries = self._plan()
        if not entries:
            return Health(self.name, False, "nothing registered (or nothing selected)")
        devices = sorted({str(e.device) for e in entries})
        state = "evicted" if self.evicted else "resident"
        return Health(
            self.name,
            True,
            f"{len(entries)} storages, {self.registered_bytes} bytes on {devices}, {state}",
        )

    @property
    def registered_bytes(self) -> int:
        """Bytes that one snapshot moves: the selected tensors' distinct storages."""
        return sum(e.nbytes for e in self._plan())

    # ------------------------------------------------------------ snapshot / restore

    async def snapshot(self, request: SnapshotRequest) -> SnapshotReport:
        return await asyncio.to_thread(self.snapshot_sync, request)

    async def restore(self, request: SnapshotRequest) -> SnapshotReport:
        return await asyncio.to_thread(self.restore_sync, request)

    def snapshot_sync(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.perf_counter()
        with self._lock:
            entries = [e for e in self._plan() if not e.evicted]
            moved = 0
            for chunk in self._chunks(entries):
                if self.mode == "offload":
                    moved += self._copy(chunk, to_host=True)
                for e in chunk:
                    e.storage.resize_(0)
                    e.evicted = True
            if any(e.device.type == "cuda" for e in entries):
                torch.cuda.empty_cache()  # hand the memory back to the driver for the next job
            freed = sum(e.nbytes for e in entries)
        return SnapshotReport(
            job_id=request.job_id,
            backend=self.name,
            mode=self.mode,
            bytes=moved if self.mode == "offload" else freed,
            seconds=time.perf_counter() - started,
        )

    def restore_sync(self, request: SnapshotRequest) -> SnapshotReport:
        started = time.perf_counter()
        with self._lock:
            entries = [e for e in self._plan() if e.evicted]
            moved = 0
            for chunk in self._chunks(entries):
                for e in chunk:
                    e.storage.resize_(e.nbytes)
                    if e.device.type == "cpu":
                        advise_huge_pages(e.storage.data_ptr(), e.nbytes)
                if self.mode == "offload":
                    moved += self._copy(chunk, to_host=False)
                for e in chunk:
                    e.evicted = False
                    if e.device.type != "cuda":
                        e.host = None  # CPU state needs no pool: give the memory back now
        return SnapshotReport(
            job_id=request.job_id,
            backend=self.name,
            mode=self.mode,
            bytes=moved if self.mode == "offload" else sum(e.nbytes for e in entries),
            seconds=time.perf_counter() - started,
        )

    @property
    def evicted(self) -> bool:
        return any(e.evicted for e in self._entries or [])

    def _chunks(self, entries: list[_Entry]) -> Iterable[list[_Entry]]:
        chunk: list[_Entry] = []
        size = 0
        for e in entries:
            chunk.append(e)
            size += e.nbytes
            if size >= self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _copy(self, entries: list[_Entry], *, to_host: bool) -> int:
        cuda = [e for e in entries if e.device.type == "cuda"]
        stream = torch.cuda.Stream(device=cuda[0].device) if cuda else None
        if stream is not None:
            # The side stream must see every kernel already queued on the tensors.
            stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
        moved = 0
        for e in entries:
            if e.host is None:
                if not to_host:
                    raise SnapshotError(f"{e.names[0]}: restore without an eviction")
                e.host = torch.empty(
                    e.nbytes, dtype=torch.uint8, pin_memory=e.device.type == "cuda"
                )
                if e.device.type == "cpu":
                    advise_huge_pages(e.host.data_ptr(), e.nbytes)
            device_bytes = torch.empty(0, dtype=torch.uint8, device=e.device).set_(
                e.storage, 0, (e.nbytes,)
            )
            src, dst = (device_bytes, e.host) if to_host else (e.host, device_bytes)
            if stream is not None and e.device.type == "cuda":
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            else:
                dst.copy_(src)
            moved += e.nbytes
        if stream is not None:
            stream.synchronize()
        return moved


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
