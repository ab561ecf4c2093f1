"""One host allocation for a job's evicted storages, made ready before the first switch.

A job's first switch used to be 15-20x slower than the others on a GPU (1.66 s and 2.35 s for
3 GB states, against 0.08-0.12 s): its host buffers were allocated, faulted in and pinned
while the next job waited. Public figures agree that pinning dominates (vLLM's sleep spent
9.2 s of 17.4 s pinning 61.68 GiB). An arena does that work once, ahead of time, off the
switch's path:

- one plain allocation of exactly the state's bytes (each storage at a page-aligned offset),
  not one per storage through torch's pinned caching allocator, which rounds every block up
  to a power of two (a 3 GB state could hold 4 GB pinned);
- every page faulted in by writing it (torch's threaded fill), with transparent huge pages
  asked for where the kernel offers them;
- on CUDA, registered as pinned memory with ``cudaHostRegister`` in one call, and
  unregistered when the arena is freed (the way torch's own checkpoint stager pins).

Host memory grows by the state's size and no more (plus at most a page per storage).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from timeslice.snapshot.hugepages import advise_huge_pages

PAGE = 4096


def page_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each size's offset in an arena that starts every block on a page; and the total."""
    offsets, end = [], 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"a block size must be >= 0, not {size}")
        offsets.append(end)
        end += -(-size // PAGE) * PAGE
    return offsets, end


def available_host_bytes() -> int | None:
    """What Linux says could be allocated without swapping (MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class ArenaTimes:
    """Where an arena's preparation went (seconds), for benchmarks and logs."""

    bytes: int
    allocate_s: float
    fault_in_s: float
    pin_s: float
    pinned: bool


class HostArena:
    """``nbytes`` of host memory, faulted in, pinned when ``pin`` (CUDA), handed out as views.

    Args:
        nbytes: The arena's size (``page_offsets``' total for the blocks it will hold).
        pin: Register the memory with the CUDA driver, so device copies go by DMA and can run
            asynchronously. Needs a CUDA device.

    Raises:
        RuntimeError: The driver refused to pin the memory (the message has its CUDA error).
    """

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        started = time.perf_counter()
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        allocated = time.perf_counter()
        advise_huge_pages(self.buffer.data_ptr(), nbytes)
        self.buffer.zero_()  # faults every page in now, on torch's threads, not at a switch
        faulted = time.perf_counter()
        self.pinned = False
        if pin and nbytes > 0:
            _register(self.buffer.data_ptr(), nbytes)
            self.pinned = True
            # Unregistered before the memory goes back to the allocator (the finalizer holds
            # the buffer itself, so it runs first).
            weakref.finalize(self, _unregister, self.buffer)
        self.times = ArenaTimes(
            bytes=nbytes,
            allocate_s=allocated - started,
            fault_in_s=faulted - allocated,
            pin_s=time.perf_counter() - faulted,
            pinned=self.pinned,
        )

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The arena's bytes [offset, offset + nbytes), as a uint8 tensor sharing its memory."""
        if offset < 0 or offset + nbytes > self.buffer.numel():
            raise ValueError(
                f"block [{offset}, {offset + nbytes}) lies outside the arena's "
                f"{self.buffer.numel()} bytes"
            )
        return self.buffer[offset : offset + nbytes]


def _register(address: int, nbytes: int) -> None:
    cuda_host_register_portable = 1  # the pages are pinned for every CUDA context
    err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, cuda_host_register_portable))
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed with cudaError {err} "
            "(pinned memory may be limited: see `ulimit -l` and the container's memlock limit)"
        )


def _unregister(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
