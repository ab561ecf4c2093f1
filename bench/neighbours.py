"""What a neighbour can cost a holder: a flood beside it, and a waiter that is lost.

    .venv/bin/python bench/neighbours.py --seconds 90 --out DIR

One embedded Temporal server and one control worker. Each flood runs for ``--seconds`` beside
a holder at TTL 1 s on one group and one at TTL 10 s on another; each holder renews every third
of its TTL as a client's heartbeat does (the ``renew`` update; its ``renew_lease`` signal and
``holder`` query when the update is refused for capacity or slow; ``--renew-by-update-only``:
the update alone, resent until taken, as before) and times every answer (sent to answered).
Two floods:

- ``client``: a buggy job using the Timeslice client, ``--threads`` threads per group spinning
  ``acquire(group, timeout=0)`` (try-locks). Its client keeps two updates at a time on their
  way into a group and obeys the group's refusals (per-caller fairness).
- ``raw``: a hostile caller sending cheap updates (try-lock acquires, each a new request id
  under one job) with ``--raw-concurrency`` in flight per group at once, ignoring refusals.

Then the lost waiter: a group at the default ``grant_ack_timeout_s`` (15 s), every grant by
activity; a waiter's process takes its delivery and stops (its handler never answers) while
another waits behind it: how long the group stays held by nobody.

Prints and writes ``DIR/neighbours.json``: per flood and TTL, renewals answered (count, p50,
p99, max), whether the holder kept its lease (no expiry, its release valid), the flooder's
updates sent, refused by the group and refused by its own client; the lost waiter's idle s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


async def hold(
    client: Any, group: str, ttl: float, stop: asyncio.Event, by_update_only: bool
) -> dict[str, Any]:
    """A holder renewing every ttl/3 (by update, by signal when that is refused or slow, as a
    client's heartbeat does; ``by_update_only``: by update alone), timing each answer."""
    from timeslice.protocol.group import (
        AcquireAnswer,
        AcquireCall,
        AcquireRequest,
        GroupConfig,
        GroupStatus,
        LeaseReturn,
        RenewRequest,
        RenewResult,
        ReturnAnswer,
        group_workflow_id,
        lease_key_hash,
    )
    from timeslice.session.group_start import start_group
    from timeslice.transport.renewals import RenewalPath, send_renewal
    from timeslice.transport.updates import send_update

    wid = group_workflow_id(group)
    key = f"the-holders-own-key-{uuid.uuid4().hex}"
    await start_group(client, GroupConfig(group_id=group))
    request = AcquireRequest(
        request_id=f"holder:{group}",
        job_id=f"holder-{int(ttl)}s",
        reply_task_queue="holder-queue",
        key_hash=lease_key_hash(key),
        ttl_s=ttl,
    )
    answer = await send_update(client, wid, "acquire", AcquireCall(request=request), AcquireAnswer)
    assert answer.notice is not None
    token = answer.notice.token
    renew = RenewRequest(request_id=request.request_id, token=token, key=key)
    answered: list[float] = []
    lost = None
    path = RenewalPath()
    while not stop.is_set() and lost is None:
        sent = time.monotonic()
        try:
            if by_update_only:  # as before the fallback: resent until the group takes it
                result = await send_update(client, wid, "renew", renew, RenewResult)
            else:  # as the client's heartbeat does
                result = await send_renewal(client, group, renew, every_s=ttl / 3, path=path)
        except Exception as err:  # a renewal that never came back is the bench's finding
            lost = repr(err)
            break
        answered.append(time.monotonic() - sent)
        if not result.valid:
            lost = result.reason
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, ttl / 3 - (time.monotonic() - sent)))
    ret = LeaseReturn(request_id=request.request_id, token=token, key=key)
    released = await send_update(client, wid, "release_lease", ret, ReturnAnswer)
    status = await client.get_workflow_handle(wid).query("status", result_type=GroupStatus)
    return {
        "ttl_s": ttl,
        "renewals": len(answered),
        "p50_s": percentile(answered, 0.5),
        "p99_s": percentile(answered, 0.99),
        "max_s": max(answered, default=None),
        "lost": lost,
        "kept": lost is None and released.valid and status.stats.expired == 0,
        "rate_limited_at_group": getattr(status.stats, "rate_limited", None),
    }


def client_flood(address: str, groups: list[str], seconds: float, threads: int) -> Counter:
    """A buggy job's try-lock loops through the Timeslice client."""
    from timeslice import AcquireTimeoutError, TimesliceError, TimeSliceOrchestratorClient

    client = TimeSliceOrchestratorClient(target=address, job_id="noisy").connect()
    seen: Counter = Counter()
    until = time.monotonic() + seconds

    def spin(group: str) -> None:
        while time.monotonic() < until:
            try:
                client.release(client.acquire(group, timeout=0))
                seen["granted"] += 1
            except AcquireTimeoutError:
                seen["held"] += 1
            except TimesliceError as err:
                seen[type(err).__name__] += 1

    workers = [threading.Thread(target=spin, args=(g,)) for g in groups for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    client.close()
    return seen


async def raw_flood(client: Any, groups: list[str], seconds: float, concurrency: int) -> Counter:
    """A hostile caller's cheap updates, ignoring every refusal."""
    from temporalio.client import WorkflowUpdateFailedError
    from timeslice.protocol.group import (
        AcquireAnswer,
        AcquireCall,
        AcquireRequest,
        group_workflow_id,
        lease_key_hash,
    )
    from timeslice.transport.updates import send_update

    seen: Counter = Counter()
    until = time.monotonic() + seconds

    async def spin(group: str) -> None:
        while time.monotonic() < until:
            rid = f"noisy:{uuid.uuid4().hex}"
            request = AcquireRequest(
                request_id=rid,
                job_id="noisy",
                reply_task_queue="noisy-queue",
                key_hash=lease_key_hash(f"key-of-{rid}"),
            )
            call = AcquireCall(request=request, only_if_free=True)
            try:
                await send_update(client, group_workflow_id(group), "acquire", call, AcquireAnswer)
                seen["taken"] += 1
            except WorkflowUpdateFailedError:
                seen["refused"] += 1
            except Exception as err:  # what a flood meets is the bench's finding
                seen[type(err).__name__] += 1

    await asyncio.gather(*(spin(g) for g in groups for _ in range(concurrency)))
    return seen


async def flood_run(address: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    from timeslice.transport.connection import connect, connect_config

    client = await connect(connect_config(address))
    tag = uuid.uuid4().hex[:6]
    groups = {1.0: f"{kind}-1s-{tag}", 10.0: f"{kind}-10s-{tag}"}
    stop = asyncio.Event()
    holders = [
        asyncio.create_task(hold(client, g, ttl, stop, args.renew_by_update_only))
        for ttl, g in groups.items()
    ]
    await asyncio.sleep(1.0)  # both holding before the flood
    if kind == "client":
        seen = await asyncio.to_thread(
            client_flood, address, list(groups.values()), args.seconds, args.threads
        )
    else:
        seen = await raw_flood(client, list(groups.values()), args.seconds, args.raw_concurrency)
    stop.set()
    return {"flood": kind, "flooder": dict(seen), "holders": await asyncio.gather(*holders)}


async def lost_waiter(address: str) -> dict[str, Any]:
    """The group's idle time behind a waiter whose process took its delivery and stopped."""
    from temporalio import activity
    from temporalio.worker import Worker
    from timeslice import TimeSliceOrchestratorClient
    from timeslice.protocol.group import (
        DELIVER_GRANT_ACTIVITY,
        AcquireAnswer,
        AcquireCall,
        AcquireRequest,
        group_workflow_id,
        job_task_queue,
        lease_key_hash,
    )
    from timeslice.transport.connection import connect, connect_config
    from timeslice.transport.updates import send_update

    group = f"lost-{uuid.uuid4().hex[:6]}"
    holder = TimeSliceOrchestratorClient(target=address, job_id="holder").connect()
    holder.create_group(group, max_parked_waits=0)
    lease = holder.acquire(group)

    @activity.defn(name=DELIVER_GRANT_ACTIVITY)
    async def deliver_grant(notice: Any) -> None:  # hints resolve at module level
        await asyncio.Event().wait()  # took the task, never answers: a stopped process
        raise AssertionError("unreachable")

    client = await connect(connect_config(address))
    async with Worker(client, task_queue=job_task_queue("lost"), activities=[deliver_grant]):
        request = AcquireRequest(
            request_id="lost:r",
            job_id="lost",
            reply_task_queue=job_task_queue("lost"),
            key_hash=lease_key_hash("the-lost-process-key-0123456789"),
        )
        call = AcquireCall(request=request, park=False)
        await send_update(client, group_workflow_id(group), "acquire", call, AcquireAnswer)
        nxt = TimeSliceOrchestratorClient(target=address, job_id="next").connect()
        waiting = asyncio.create_task(asyncio.to_thread(nxt.acquire, group))
        while len(holder.group_status(group).queue) < 2:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(holder.release, lease)
        released = time.monotonic()
        granted = await waiting
        waited = time.monotonic() - released
    nxt.release(granted)
    [dead] = [r for r in holder.group_status(group).history if r.job_id == "lost"]
    holder.close()
    nxt.close()
    return {"idle_s": (dead.end - dead.start).total_seconds(), "next_waited_s": waited}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=90.0, help="each flood's length")
    p.add_argument("--threads", type=int, default=16, help="client flood: threads per group")
    p.add_argument("--raw-concurrency", type=int, default=16, help="raw flood: per group")
    p.add_argument("--floods", default="client,raw", help="which floods, comma-separated")
    p.add_argument("--no-lost-waiter", action="store_true")
    p.add_argument(
        "--renew-by-update-only",
        action="store_true",
        help="holders renew by update alone, resent until taken (before the signal fallback)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from timeslice.cli.server import EmbeddedServer, free_port
    from timeslice.cli.services import start_service, stop_service

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedServer(port=free_port(), ui_port=None, db=tmp / "t.db").start()
        worker = start_service(
            ["worker", "--address", server.address], "control worker", tmp / "worker.log"
        )
        try:
            runs = []
            for kind in filter(None, args.floods.split(",")):
                runs.append(asyncio.run(flood_run(server.address, kind, args)))
                print(json.dumps(runs[-1]), flush=True)  # kept should a later part fail
            lost = None if args.no_lost_waiter else asyncio.run(lost_waiter(server.address))
        finally:
            stop_service(worker)
            server.stop()
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": f"{os.cpu_count()} cores, {platform.machine()}",
        "load": os.getloadavg(),
        "seconds": args.seconds,
        "renewals": "update only" if args.renew_by_update_only else "update, else signal",
        "floods": runs,
        "lost_waiter": lost,
    }
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "neighbours.json").write_text(json.dumps(report, indent=2))
    sys.stdout.flush()
    os._exit(0)  # temporalio/sdk-python#300


if __name__ == "__main__":
    main()
