"""Snapshot / restore bandwidth of the torch backend against a plain copy of the same bytes.

    .venv/bin/python bench/snapshot.py --gib 1

On CPU the state is ``--tensors`` float32 tensors totalling ``--gib`` GiB. Two plain copies of
the same bytes are timed in the same run: ``dst.copy_(src)`` into preallocated, already-touched
buffers (memcpy: the ceiling) and ``src.clone()`` (a copy into fresh memory, which like a
snapshot pays for faulting the new pages in). Peak
memory is the process's maximum RSS over the snapshot / restore, against the RSS with the
state resident: it must stay well under a second full copy. On CUDA (``--device cuda``) the
ceiling is a pinned host <-> device copy in each direction (``plain_copy`` device to host, for
snapshots; ``plain_copy_back`` host to device, for restores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.torch_backend import TorchBackend

GIB = 1024**3


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.gib <= 0 or args.tensors <= 0 or args.rounds <= 0:
        raise SystemExit("--gib, --tensors and --rounds must be > 0")

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
    incoming.restore_sync(SnapshotRequest("other"))
    assert all(float(t[0]) == -float(i) for i, t in enumerate(other)), "swap corrupted state"

    def gbps(seconds: list[float]) -> float:
        return round(nbytes / statistics.median(seconds) / 1e9, 2)

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
        "resident_rss_GiB": round(resident_rss / GIB, 2),
        "peak_rss_during_switches_GiB": round(peak / GIB, 2),
        "peak_extra_vs_state": round((peak - resident_rss) / nbytes, 2),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
