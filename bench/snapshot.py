"""Snapshot / restore bandwidth of the torch or jax backend against plain copies of the bytes.

    .venv/bin/python bench/snapshot.py --gib 1
    .venv/bin/python bench/snapshot.py --backend jax --gib 1

torch:

On CPU the state is ``--tensors`` float32 tensors totalling ``--gib`` GiB. Two plain copies of
the same bytes are timed in the same run: ``dst.copy_(src)`` into preallocated, already-touched
buffers (memcpy: the ceiling) and ``src.clone()`` (a copy into fresh memory, which like a
snapshot pays for faulting the new pages in). Peak
memory is the process's maximum RSS over the snapshot / restore, against the RSS with the
state resident: it must stay well under a second full copy. On CUDA (``--device cuda``) the
ceiling is a pinned host <-> device copy in each direction (``plain_copy`` device to host, for
snapshots; ``plain_copy_back`` host to device, for restores).

jax (``--backend jax``): the state is ``--tensors`` float32 JAX arrays on the first local
device, registered in one :class:`JaxBackend` holder. Timed against, in the same run: a plain
``jax.device_put`` round trip of the same arrays to the backend's host memory kind and back
(``pinned_host`` where the platform has it; nothing deleted: the ceiling for JAX's own copy),
and a plain host copy of the same bytes with NumPy, into fresh memory (``np.array(copy=True)``)
and into preallocated, already-touched buffers (``np.copyto``: memcpy). On a CPU, device and
host memory are the same RAM: what this measures there is JAX's copy machinery, not a bus.
XLA's CPU buffers come from glibc's malloc: run with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
to have them on transparent huge pages (the output records the variable).

The first switch (torch, ``first_switch``): a fresh state of the same size, snapshot once and
then twice more, with its kept host buffers (``keep_host_buffers="all"``, which on CUDA is what
the default does) made either by the first snapshot itself (``lazy``) or ahead of it by
``reserve_host_buffers`` (``reserved``, with where that time went: allocating, faulting the
pages in, pinning). ``first_vs_steady`` is the first snapshot's time over the median of the
next two: what a job's first switch costs against every later one.

Swaps (torch): this state goes out while another job's equal state comes in, on two threads:
``overlapped_swap_s`` with no bound on memory, ``streamed_swap_s`` through a device room with
space for one state (``snapshot/device_room.py``: each incoming chunk waits for the room an
outgoing one freed), each against the slower single direction. On a GPU both directions of PCIe
run at once, so the target is close to 1; on this CPU both compete for one memory bus.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from timeslice.snapshot.base import SnapshotRequest

GIB = 1024**3


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (VmHWM) from now; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return peak_rss()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="torch", choices=["torch", "jax"])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="torch only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.gib <= 0 or args.tensors <= 0 or args.rounds <= 0:
        raise SystemExit("--gib, --tensors and --rounds must be > 0")
    result = bench_jax(args) if args.backend == "jax" else bench_torch(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def bench_torch(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from timeslice.snapshot.torch_backend import TorchBackend

    def sync(device: str) -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    total = int(args.gib * GIB)
    per = total // args.tensors // 4
    state = [torch.full((per,), float(i), device=args.device) for i in range(args.tensors)]
    nbytes = per * 4 * args.tensors
    backend = TorchBackend()
    for i, t in enumerate(state):
        backend.register_tensor(f"t{i}", t)
    resident_rss = rss()
    snap_s, rest_s = [], []
    for _ in range(args.rounds):
        sync(args.device)
        snap_s.append(backend.snapshot_sync(SnapshotRequest("bench")).seconds)
        rest_s.append(backend.restore_sync(SnapshotRequest("bench")).seconds)
    peak = peak_rss()  # before the swap below, which by design holds two jobs' states
    assert all(float(t[0]) == float(i) for i, t in enumerate(state)), "restore corrupted state"

    # The ceiling: the same bytes copied by a plain copy_ into preallocated buffers.
    pin = args.device == "cuda"
    host = [torch.empty(per, pin_memory=pin) for _ in state]

    def timed(body: Callable[[], object]) -> list[float]:
        seconds = []
        for _ in range(args.rounds):
            sync(args.device)
            started = time.perf_counter()
            body()
            sync(args.device)
            seconds.append(time.perf_counter() - started)
        return seconds

    copy_s = timed(lambda: [h.copy_(t) for h, t in zip(host, state, strict=True)])
    back_s = timed(lambda: [t.copy_(h) for h, t in zip(host, state, strict=True)])
    host.clear()
    clone_s = timed(lambda: [t.clone() for t in state])

    # An overlapped swap: this state goes out while another job's equal state comes back in.
    other = [torch.full((per,), -float(i), device=args.device) for i in range(args.tensors)]
    incoming = TorchBackend()
    for i, t in enumerate(other):
        incoming.register_tensor(f"o{i}", t)
    incoming.snapshot_sync(SnapshotRequest("other"))
    swap_s = []
    for _ in range(args.rounds):
        sync(args.device)
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            out = pool.submit(backend.snapshot_sync, SnapshotRequest("bench"))
            into = pool.submit(incoming.restore_sync, SnapshotRequest("other"))
            out.result(), into.result()
        sync(args.device)
        swap_s.append(time.perf_counter() - started)
        backend.restore_sync(SnapshotRequest("bench"))  # set up the next round: swap back, untimed
        incoming.snapshot_sync(SnapshotRequest("other"))
    # A streamed swap: the same, through a device room with space for one state only, so each
    # chunk of the incoming state comes in once the outgoing one has freed its room.
    from timeslice.snapshot.device_room import DeviceRooms

    with tempfile.TemporaryDirectory() as rooms:
        room = DeviceRooms(Path(rooms)).room("bench")
        room.set_capacity(nbytes)
        streamed_s = []
        for _ in range(args.rounds):
            backend.hold_in(room)
            sync(args.device)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                out = pool.submit(backend.snapshot_sync, SnapshotRequest("bench", room=room))
                into = pool.submit(incoming.restore_sync, SnapshotRequest("other", room=room))
                out.result(), into.result()
            sync(args.device)
            streamed_s.append(time.perf_counter() - started)
            assert room.status().peak <= nbytes, "the room held more than one state"
            incoming.snapshot_sync(SnapshotRequest("other", room=room))  # untimed, as above
            backend.restore_sync(SnapshotRequest("bench"))
    incoming.restore_sync(SnapshotRequest("other"))
    assert all(float(t[0]) == -float(i) for i, t in enumerate(other)), "swap corrupted state"

    def gbps(seconds: list[float]) -> float:
        return round(nbytes / statistics.median(seconds) / 1e9, 2)

    def first_switch(reserve: bool) -> dict[str, object]:
        fresh = [torch.full((per,), float(i), device=args.device) for i in range(args.tensors)]
        first = TorchBackend(keep_host_buffers="all")
        for i, t in enumerate(fresh):
            first.register_tensor(f"f{i}", t)
        sync(args.device)
        made = first.reserve_host_buffers(background=False) if reserve else None
        seconds = []
        for _ in range(3):
            sync(args.device)
            seconds.append(first.snapshot_sync(SnapshotRequest("first")).seconds)
            first.restore_sync(SnapshotRequest("first"))
        assert all(float(t[0]) == float(i) for i, t in enumerate(fresh)), "first switch corrupted"
        steady = statistics.median(seconds[1:])
        out: dict[str, object] = {
            "first_snapshot_s": round(seconds[0], 3),
            "steady_snapshot_s": round(steady, 3),
            "first_vs_steady": round(seconds[0] / steady, 2),
        }
        if made is not None:
            out["reserve"] = {
                "allocate_s": round(made.allocate_s, 3),
                "fault_in_s": round(made.fault_in_s, 3),
                "pin_s": round(made.pin_s, 3),
                "pinned": made.pinned,
            }
        return out

    first_switch_s = {"lazy": first_switch(False), "reserved": first_switch(True)}

    result = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "device": args.device,
        "bytes": nbytes,
        "tensors": args.tensors,
        "plain_copy_GBps": gbps(copy_s),
        "plain_copy_back_GBps": gbps(back_s),
        "plain_clone_GBps": gbps(clone_s),
        "snapshot_GBps": gbps(snap_s),
        "restore_GBps": gbps(rest_s),
        "snapshot_vs_plain": round(gbps(snap_s) / gbps(copy_s), 2),
        "restore_vs_plain": round(gbps(rest_s) / gbps(back_s), 2),
        "snapshot_vs_clone": round(gbps(snap_s) / gbps(clone_s), 2),
        "restore_vs_clone": round(gbps(rest_s) / gbps(clone_s), 2),
        "overlapped_swap_s": round(statistics.median(swap_s), 3),
        "swap_vs_larger_direction": round(
            statistics.median(swap_s) / max(statistics.median(snap_s), statistics.median(rest_s)),
            2,
        ),
        "streamed_swap_s": round(statistics.median(streamed_s), 3),
        "streamed_vs_larger_direction": round(
            statistics.median(streamed_s)
            / max(statistics.median(snap_s), statistics.median(rest_s)),
            2,
        ),
        "resident_rss_GiB": round(resident_rss / GIB, 2),
        "peak_rss_during_switches_GiB": round(peak / GIB, 2),
        "peak_extra_vs_state": round((peak - resident_rss) / nbytes, 2),
        "first_switch": first_switch_s,
    }
    return result


def bench_jax(args: argparse.Namespace) -> dict[str, object]:
    import jax
    import numpy as np
    from timeslice.snapshot.jax_backend import JaxBackend

    device = jax.local_devices()[0]
    total = int(args.gib * GIB)
    per = total // args.tensors // 4
    state = [
        jax.device_put(np.full((per,), float(i), np.float32), device) for i in range(args.tensors)
    ]
    jax.block_until_ready(state)
    nbytes = per * 4 * args.tensors
    backend = JaxBackend()
    holder = backend.register("state", state)
    del state  # from here on the holder is the only way to the arrays, as in a training loop
    host_kind = backend._host_kind(device)
    resident_rss = rss()
    # Building the state took a second copy (NumPy, then the device): count the switches only.
    reset = reset_peak_rss()
    snap_s, rest_s = [], []
    for _ in range(args.rounds):
        snap = backend.snapshot_sync(SnapshotRequest("bench"))
        rest = backend.restore_sync(SnapshotRequest("bench"))
        assert snap.bytes == rest.bytes == nbytes, (snap.bytes, rest.bytes, nbytes)
        snap_s.append(snap.seconds)
        rest_s.append(rest.seconds)
    peak = peak_rss_since_reset() if reset else peak_rss()

    # The same bytes in plain copies, each round right after one more snapshot / restore, so
    # on a shared machine every method meets the same load: a device_put round trip to the
    # same host memory kind (nothing deleted, nothing kept), and NumPy copies of the bytes into
    # fresh memory and into preallocated, touched buffers.
    put_s, back_s, fresh_s, warm_s = [], [], [], []
    buffers = [np.ones(per, np.float32) for _ in range(args.tensors)]
    for _ in range(args.rounds):
        snap_s.append(backend.snapshot_sync(SnapshotRequest("bench")).seconds)
        rest_s.append(backend.restore_sync(SnapshotRequest("bench")).seconds)
        arrays = holder.value
        to_host = [a.sharding.with_memory_kind(host_kind) for a in arrays] if host_kind else None
        started = time.perf_counter()
        hosts = jax.device_put(arrays, to_host) if to_host else [np.array(a) for a in arrays]
        jax.block_until_ready(hosts)
        middle = time.perf_counter()
        jax.block_until_ready(jax.device_put(hosts, [a.sharding for a in arrays]))
        put_s.append(middle - started)
        back_s.append(time.perf_counter() - middle)
        del hosts
        views = [np.asarray(a) for a in arrays]
        started = time.perf_counter()
        copies = [np.array(v, copy=True) for v in views]
        fresh_s.append(time.perf_counter() - started)
        del copies
        started = time.perf_counter()
        for buffer, view in zip(buffers, views, strict=True):
            np.copyto(buffer, view)
        warm_s.append(time.perf_counter() - started)
        del views, arrays
    buffers.clear()
    arrays = holder.value
    assert all(float(a[0]) == float(i) for i, a in enumerate(arrays)), "restore corrupted state"

    def gbps(seconds: list[float]) -> float:
        return round(nbytes / statistics.median(seconds) / 1e9, 2)

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}",
        "backend": "jax",
        "platform": device.platform,
        "host_memory": host_kind or "numpy",
        # glibc.malloc.hugetlb=1 puts XLA's CPU buffers (glibc malloc) on transparent huge pages
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
        "bytes": nbytes,
        "arrays": args.tensors,
        "rounds": args.rounds,
        "switch_rounds": len(snap_s),
        "snapshot_GBps": gbps(snap_s),
        "restore_GBps": gbps(rest_s),
        "device_put_to_host_GBps": gbps(put_s),
        "device_put_back_GBps": gbps(back_s),
        "host_copy_fresh_GBps": gbps(fresh_s),
        "host_copy_warm_GBps": gbps(warm_s),
        "snapshot_vs_device_put": round(gbps(snap_s) / gbps(put_s), 2),
        "restore_vs_device_put": round(gbps(rest_s) / gbps(back_s), 2),
        "snapshot_vs_host_copy_warm": round(gbps(snap_s) / gbps(warm_s), 2),
        "restore_vs_host_copy_warm": round(gbps(rest_s) / gbps(warm_s), 2),
        "snapshot_vs_host_copy_fresh": round(gbps(snap_s) / gbps(fresh_s), 2),
        "restore_vs_host_copy_fresh": round(gbps(rest_s) / gbps(fresh_s), 2),
        "resident_rss_GiB": round(resident_rss / GIB, 2),
        "peak_rss_during_switches_GiB": round(peak / GIB, 2),
        "peak_extra_vs_state": round((peak - resident_rss) / nbytes, 2),
    }


if __name__ == "__main__":
    main()
