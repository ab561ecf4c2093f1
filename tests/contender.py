"""A job process for the tests: acquire / hold / release a group N times, logging each event.

Each line of the log is JSON: {"job", "event", "token", "t"} with ``t`` from time.monotonic(),
which is one system-wide clock on Linux, so logs of several processes can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from timeslice import (
    AcquireTimeoutError,
    GrantLostError,
    JobFaultedError,
    LeaseRevokedError,
    TimeSliceOrchestratorClient,
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--first-hold", type=float, help="the first hold (default: --hold)")
    p.add_argument(
        "--until-revoked",
        action="store_true",
        help="end a hold early once the lease is no longer valid, as a fenced job does",
    )
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--ttl", type=float, default=None)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--backend", action="append", default=[])
    p.add_argument("--hold-forever", action="store_true")
    p.add_argument("--node", help="also snapshot through this node's agent")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--linger", action="store_true", help="after the work, wait for stdin EOF")
    p.add_argument("--node-backend", action="append", default=[])
    p.add_argument("--torch-mb", type=int, default=0, help="register this much state (torch)")
    p.add_argument(
        "--data-mb", type=int, default=0, help="keep this much data in host memory, checked"
    )
    p.add_argument(
        "--cuda-mb", type=int, default=0, help="keep this much data in CUDA memory, checked"
    )
    p.add_argument(
        "--start-with", type=int, default=1, help="start once this many contenders are ready"
    )
    p.add_argument("--log", required=True)
    args = p.parse_args()
    backends: list = list(args.backend)
    state = None
    if args.torch_mb:
        import torch
        from timeslice.snapshot.torch_backend import TorchBackend

        # Deterministic content, so the process can check every restore bit for bit.
        state = torch.arange(args.torch_mb * 1024 * 1024 // 4, dtype=torch.float32)
        expected_sum = float(state.double().sum())
        torch_backend = TorchBackend()
        torch_backend.register_tensor("state", state)
        backends.append(torch_backend)
    # Data written before the first grant and checked at every one (a process the node agent
    # checkpointed must find it intact), unregistered: only a whole-process backend moves it.
    data = bytes(range(256)) * (args.data_mb * 4096)
    data_digest = hashlib.sha256(data).hexdigest()
    on_device = None
    if args.cuda_mb:
        import torch

        on_device = torch.full((args.cuda_mb * 256 * 1024,), 7.0, device="cuda")
        torch.cuda.synchronize()
    client = TimeSliceOrchestratorClient(
        target=args.address,
        job_id=args.job_id,
        rank=args.rank,
        priority=args.priority,
        lease_ttl=args.ttl,
        snapshot_backends=backends or None,
        node=args.node,
        node_backends=args.node_backend or None,
    ).connect()
    with open(args.log, "a", buffering=1) as log:

        def emit(event: str, token: int | None = None, **detail: object) -> None:
            record = {"job": args.job_id, "event": event, "token": token, "t": time.monotonic()}
            log.write(json.dumps({**record, **detail}) + "\n")

        emit("ready")
        _await_ready(args.log, args.start_with)
        for iteration in range(args.iterations):
            try:
                lease = client.acquire(args.group, timeout=args.timeout)
            except AcquireTimeoutError:
                emit("timeout")
                continue
            except GrantLostError:
                emit("lost")  # granted while paused, and given up by the group meanwhile
                continue
            except JobFaultedError:
                emit("faulted")
                break
            emit("acquired", lease.token)
            if state is not None and float(state.double().sum()) != expected_sum:
                emit("corrupt", lease.token)
                return 3
            if args.data_mb or on_device is not None:
                host_ok = hashlib.sha256(data).hexdigest() == data_digest
                device_ok = on_device is None or bool((on_device == 7.0).all())
                if not (host_ok and device_ok):
                    emit("corrupt", lease.token, host=host_ok, device=device_ok)
                    return 3
                emit("data-ok", lease.token)
            if args.hold_forever:
                while True:
                    time.sleep(3600)
            hold = args.hold if iteration or args.first_hold is None else args.first_hold
            if args.until_revoked:
                until = time.monotonic() + hold
                while time.monotonic() < until and lease.valid:
                    time.sleep(0.01)
            elif hold:
                time.sleep(hold)  # stands in for the GPU phase
            emit("releasing", lease.token)
            try:
                client.release(lease)
            except LeaseRevokedError as err:  # it ran out while held: the group refused it
                emit("revoked", lease.token, reason=str(err))
        emit("done")
        if args.linger:
            sys.stdin.read()  # stay registered (resident, faulted ...) until the test lets go
    client.close()
    return 0


def _await_ready(log: str, count: int) -> None:
    """A start line for contenders that load slowly (torch): all contend from the first grant."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log) as lines:
            ready = sum(1 for line in lines if json.loads(line)["event"] == "ready")
        if ready >= count:
            return
        time.sleep(0.01)
    raise SystemExit(f"fewer than {count} contenders got ready within 120 s")


if __name__ == "__main__":
    sys.exit(main())
