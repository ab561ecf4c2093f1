"""The ``torch`` backend: move registered tensors to host DRAM and back, in place.

The unit of work is a tensor *storage*, not a tensor: views, tied weights and optimizer state that
share memory are moved once, and every tensor object (parameters, optimizer state, anything a
hook captured) stays the same Python object. Snapshot copies each storage into a host buffer
(on CUDA: pinned buffers in one host arena, reused across switches, asynchronous copies on a
side stream; ``reserve_host_buffers`` prepares the arena before the first switch), then
shrinks the storage to zero bytes, which frees the device memory; restore grows it back and
copies the bytes home. Work goes chunk by chunk, freeing as it goes, so peak memory never holds
a second full copy of the state. Given the group's device room (``SnapshotRequest.room``), the
chunks stream: a snapshot gives each chunk's room back as soon as its memory is freed (on CUDA,
handed back to the driver), and a restore takes room for each chunk before it grows it, so one
job's eviction and the next job's restore run at once (PCIe is full duplex) within the group's
declared memory (``snapshot/device_room.py``).

On a machine without CUDA the same code runs on CPU tensors, which is how the tests run it.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from timeslice.protocol.group import SnapshotReport
from timeslice.snapshot.base import (
    BlockingBackend,
    Capability,
    Health,
    SnapshotError,
    SnapshotRequest,
    move_report,
)
from timeslice.snapshot.device_room import DeviceRoom
from timeslice.snapshot.hugepages import advise_huge_pages

try:
    import torch
except ImportError as err:  # a clean message instead of a bare ImportError deep in a worker
    raise ImportError(
        "the torch snapshot backend needs PyTorch: pip install 'timeslice[torch]'"
    ) from err

# After the check above: the arena needs torch too, and a missing torch must get its message.
from timeslice.snapshot.host_arena import (
    ArenaTimes,
    HostArena,
    available_host_bytes,
    page_offsets,
)

Mode = Literal["offload", "discard"]
KeepHostBuffers = Literal["cuda", "all"]
# A reservation ahead of the first switch leaves this share of available host memory free;
# past it the buffers are made at the first switch instead, as the switch needs them anyway.
RESERVE_AT_MOST = 0.8
log = logging.getLogger("timeslice.snapshot.torch")


@dataclass
class _Entry:
    """One storage to move, and its host buffer once allocated."""

    names: list[str]
    storage: torch.UntypedStorage
    nbytes: int
    device: torch.device
    host: torch.Tensor | None = None
    evicted: bool = False


class TorchBackend(BlockingBackend):
    """Snapshot / restore registered modules, optimizers and tensors.

    Args:
        mode: ``"offload"`` copies the state to host DRAM and back; ``"discard"`` frees it and
            restores zero-filled storage (for state the job rebuilds, such as a KV cache).
        include: Shell-style patterns over the qualified names (``"policy.layers.0.lora_A*"``)
            of what moves; with neither ``include`` nor ``exclude``, everything registered.
        exclude: Patterns of names that stay where they are.
        chunk_bytes: Storages are moved and freed this many bytes at a time, so peak memory
            never holds a second full copy of the state (and a restore beside another job's
            eviction follows it this many bytes behind).
        keep_host_buffers: Which storages keep their host buffer between switches, in one host
            arena made once (pinned for CUDA state): ``"cuda"`` (device state; CPU state's
            buffer is freed at each restore, since CPU memory is what the state is made of) or
            ``"all"`` (CPU state too: twice its memory, every switch as fast as the rest).

    Raises:
        ValueError: A mode, chunk size or ``keep_host_buffers`` it does not know.
    """

    name = "torch"
    capabilities = frozenset({Capability.KNOWS_SIZE, Capability.STREAMS})

    def __init__(
        self,
        *,
        mode: Mode = "offload",
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        chunk_bytes: int = 256 * 1024 * 1024,
        keep_host_buffers: KeepHostBuffers = "cuda",
    ) -> None:
        if mode not in ("offload", "discard"):
            raise ValueError(f"mode must be 'offload' or 'discard', not {mode!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
        if keep_host_buffers not in ("cuda", "all"):
            raise ValueError(
                f"keep_host_buffers must be 'cuda' or 'all', not {keep_host_buffers!r}"
            )
        self.keep_host_buffers: KeepHostBuffers = keep_host_buffers
        self.chunk_bytes = chunk_bytes
        self.mode: Mode = mode
        self.include = list(include or [])
        self.exclude = list(exclude or [])
        self._tensors: dict[str, torch.Tensor] = {}
        self._entries: list[_Entry] | None = None
        # The kept host buffers' memory; the entries' ``host`` tensors are views into it.
        self._arena: HostArena | None = None
        # Where the last arena's preparation went, read by benchmarks and logs.
        self.arena_times: ArenaTimes | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ registration

    def register_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Register one tensor to move (its storage, shared with any view or tied weight).

        Args:
            name: Its qualified name, which ``include`` / ``exclude`` patterns match.
            tensor: The tensor; it stays the same object across every snapshot and restore.

        Raises:
            TypeError: ``tensor`` is not a ``torch.Tensor``.
            SnapshotError: The state is evicted now (register before the first switch).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        with self._lock:
            if any(e.evicted for e in self._entries or []):
                raise SnapshotError("cannot register tensors while the state is evicted")
            self._tensors[name] = tensor
            self._entries = None
            self._arena = None  # the next plan's storages get an arena of their own

    def register_module(self, name: str, module: torch.nn.Module) -> None:
        """Register a module's parameters and buffers, named ``name.<their names>``.

        Args:
            name: The prefix of their names (``"policy"``: ``"policy.lm_head.weight"`` ...).
            module: The module.

        Raises:
            SnapshotError: As :meth:`register_tensor` raises it.
        """
        for pname, param in module.named_parameters(prefix=name):
            self.register_tensor(pname, param)
        for bname, buf in module.named_buffers(prefix=name):
            self.register_tensor(bname, buf)

    def register_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """Register the optimizer's state tensors (Adam's moments, step counters ...), named
        ``name.state.<parameter index>.<key>``.

        Call after at least one step, or after creating the state by hand: optimizers create it
        lazily.

        Args:
            name: The prefix of their names.
            optimizer: The optimizer.

        Raises:
            SnapshotError: As :meth:`register_tensor` raises it.
        """
        index = {id(p): i for i, p in enumerate(_params(optimizer))}
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.register_tensor(f"{name}.state.{index.get(id(param), '?')}.{key}", value)

    def selected_names(self) -> list[str]:
        """The names of the registered tensors a snapshot moves (after ``include`` / ``exclude``).

        Returns:
            Names, in registration order.
        """
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
        """Whether anything is registered and selected; what, where, and whether it is out.

        Returns:
            Ok with the storages, bytes, devices and residency; not ok when nothing is selected.
        """
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

    def resides_on_host(self) -> bool:
        """Whether every selected storage is CPU memory (a model trained on the CPU): a
        switch then frees no device memory (``snapshot.base.on_host``).

        Returns:
            True if something is selected and all of it is on the CPU.
        """
        entries = self._plan()
        return bool(entries) and all(e.device.type == "cpu" for e in entries)

    def reserve_host_buffers(self, *, background: bool = True) -> ArenaTimes | None:
        """Make the kept host buffers now, so the first switch costs what later ones do.

        Call once everything is registered (a later registration drops the arena). The
        arena is made only if it fits in ``RESERVE_AT_MOST`` of the host's available memory;
        otherwise the first switch makes it, as it does without this call.

        Args:
            background: Return at once and prepare the arena on a thread of its own; a
                snapshot that comes first waits for it.

        Returns:
            Where the time went (allocation, faulting pages in, pinning); None when running
            in the background, when there was nothing to prepare, or when it would not fit.
        """
        if background:
            thread = threading.Thread(
                target=self.reserve_host_buffers,
                kwargs={"background": False},
                name="timeslice-host-arena",
                daemon=True,
            )
            thread.start()
            return None
        with self._lock:
            wanted = [e for e in self._plan() if self._keeps(e) and e.host is None]
            need = page_offsets([e.nbytes for e in wanted])[1]
            free = available_host_bytes()
            if not wanted or (free is not None and need > RESERVE_AT_MOST * free):
                if wanted:
                    log.warning(
                        "not reserving %d bytes of host buffers ahead (%d available): the "
                        "first switch makes them",
                        need,
                        free,
                    )
                return None
            return self._make_arena(wanted)

    def _keeps(self, e: _Entry) -> bool:
        return e.device.type == "cuda" or self.keep_host_buffers == "all"

    def _make_arena(self, entries: list[_Entry]) -> ArenaTimes:
        """One arena holding a host buffer for each of ``entries`` (which have none)."""
        offsets, total = page_offsets([e.nbytes for e in entries])
        arena = HostArena(total, pin=any(e.device.type == "cuda" for e in entries))
        for e, offset in zip(entries, offsets, strict=True):
            e.host = arena.view(offset, e.nbytes)
        # Entries given buffers by an earlier arena keep them: their views keep it alive.
        self._arena = arena
        self.arena_times = arena.times
        return arena.times

    # ------------------------------------------------------------ snapshot / restore

    def snapshot_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Copy each selected storage to its host buffer (``offload``) and shrink it to zero
        bytes, chunk by chunk, freeing device memory as it goes.

        Args:
            request: The job; only its id is reported.

        Returns:
            Mode ``offload`` (bytes copied) or ``discard`` (bytes freed).
        """
        started = time.perf_counter()
        with self._lock:
            entries = [e for e in self._plan() if not e.evicted]
            if self.mode == "offload":
                unbuffered = [e for e in entries if self._keeps(e) and e.host is None]
                if unbuffered:  # no reservation came first (or it did not fit)
                    self._make_arena(unbuffered)
            moved = 0
            cuda = any(e.device.type == "cuda" for e in entries)
            for chunk in self._chunks(entries):
                if self.mode == "offload":
                    moved += self._copy(chunk, to_host=True)
                for e in chunk:
                    e.storage.resize_(0)
                    e.evicted = True
                if request.room is not None:
                    if cuda:  # the next job's restore can use it only once the driver has it
                        torch.cuda.empty_cache()
                    request.room.give(sum(e.nbytes for e in chunk))
            if cuda:
                torch.cuda.empty_cache()  # hand the memory back to the driver for the next job
            freed = sum(e.nbytes for e in entries)
        freed_or_moved = moved if self.mode == "offload" else freed
        return move_report(self.name, request.job_id, self.mode, freed_or_moved, started)

    def restore_sync(self, request: SnapshotRequest) -> SnapshotReport:
        """Grow each evicted storage back and copy its bytes home (``offload``; ``discard``
        leaves them zero), into the same tensor objects.

        Args:
            request: The job; only its id is reported.

        Returns:
            The bytes copied back (``offload``) or re-allocated (``discard``).

        Raises:
            RuntimeError: torch could not grow a storage (out of device memory) or copy into
                it; the chunk it was in is evicted again and its room given back.
        """
        started = time.perf_counter()
        with self._lock:
            entries = [e for e in self._plan() if e.evicted]
            moved = 0
            for chunk in self._chunks(entries):
                nbytes = sum(e.nbytes for e in chunk)
                if request.room is not None:  # waits while the device has no room for it
                    request.room.take(nbytes)
                try:
                    for e in chunk:
                        e.storage.resize_(e.nbytes)
                        if e.device.type == "cpu":
                            advise_huge_pages(e.storage.data_ptr(), e.nbytes)
                    if self.mode == "offload":
                        moved += self._copy(chunk, to_host=False)
                    else:
                        for e in chunk:
                            e.storage.fill_(0)  # discarded state comes back as zeros
                except BaseException:
                    # Out of device memory part-way, say: the chunk stays evicted (its bytes
                    # are still in their host buffers) and its room goes back, so the next
                    # eviction and restore see the state as it is.
                    self._undo_restore(chunk, request.room, nbytes)
                    raise
                for e in chunk:
                    e.evicted = False
                    if not self._keeps(e):
                        e.host = None  # CPU state needs no pool: give the memory back now
        back = moved if self.mode == "offload" else sum(e.nbytes for e in entries)
        return move_report(self.name, request.job_id, self.mode, back, started)

    @staticmethod
    def _undo_restore(chunk: list[_Entry], room: DeviceRoom | None, nbytes: int) -> None:
        """Shrink a chunk whose restore failed back to nothing and give its room back."""
        cuda = [e for e in chunk if e.device.type == "cuda"]
        if cuda:  # a copy into these storages may still be queued on the side stream
            torch.cuda.synchronize(cuda[0].device)
        for e in chunk:
            e.storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        if room is not None:
            room.give(nbytes)

    def hold_in(self, room: DeviceRoom) -> None:
        """Count the selected storages that are on the device now in ``room``.

        Args:
            room: The group's device room.
        """
        with self._lock:
            room.hold(sum(e.nbytes for e in self._plan() if not e.evicted))

    @property
    def evicted(self) -> bool:
        """Whether a snapshot has the state out now."""
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
                # Only state whose buffer is not kept gets here (CPU state): kept buffers
                # come from the arena, made before the first copy.
                e.host = torch.empty(e.nbytes, dtype=torch.uint8)
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
