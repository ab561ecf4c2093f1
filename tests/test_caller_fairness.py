"""A noisy neighbour slows itself, never evicts a holder (issue 36: 3,000 updates in 90 s from
one caller made a holder at TTL 10 s lose its lease; at TTL 1 s, jobs rewound 12 times in 16
epochs). Real server, control worker and clients: a buggy job spins try-locks from many threads
on two groups whose holders renew at TTL 1 s and 10 s; the group refuses its excess at the
validator, saying why, the client stops sending for as long as the group asks, and each
holder keeps its lease to its release. The flood lasts FLOOD_S and until the group has refused
the flooder on each group (a condition, not a length: a slow machine floods longer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from timeslice.protocol.group import CALLER_UPDATES_PER_S

from tests.helpers import wait_for

FLOOD_S = 10.0
# Two processes of one buggy job (a client each, so twice what one client lets in at once),
# three threads each per group: each thread alone tries far more than the caller's budget
# (a try-lock answers in milliseconds). The flooders are processes of their own, as a
# neighbour's are: run as threads of the test's process they competed with the holders'
# renewer for one interpreter, and at TTL 1 s on a loaded 2-core machine (three test workers)
# the holder lost its lease once.
NOISY_PROCESSES = 2
THREADS_PER_GROUP = 3
FLOODER = Path(__file__).with_name("try_lock_flooder.py")


class Flooder:
    """A `try_lock_flooder.py` process; the groups it has been refused on, as it says so."""

    def __init__(self, address: str, job_id: str, groups: list[str]) -> None:
        cmd = [sys.executable, str(FLOODER), "--address", address, "--job-id", job_id,
               "--threads-per-group", str(THREADS_PER_GROUP)]  # fmt: skip
        for group in groups:
            cmd += ["--group", group]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def refused_on(self) -> set[str]:
        return {line.removeprefix("refused ") for line in self.lines if line.startswith("refused ")}

    def stop(self) -> dict[str, Any]:
        """Close its stdin; its summary once it has stopped."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=90) == 0, self.lines
        self._reader.join(10)
        return json.loads(self.lines[-1])


def test_a_try_lock_flood_beside_holders_at_ttl_1_and_10_s(
    address: str, make_client: Callable[..., Any]
) -> None:
    tag = uuid.uuid4().hex[:6]
    groups = {1.0: f"flood-1s-{tag}", 10.0: f"flood-10s-{tag}"}
    holders = {
        ttl: make_client(job_id=f"holder-{int(ttl)}s-{tag}", lease_ttl=ttl) for ttl in groups
    }
    leases = {ttl: holders[ttl].acquire(group, timeout=60) for ttl, group in groups.items()}
    flooders = [
        Flooder(address, f"noisy-{tag}", list(groups.values())) for _ in range(NOISY_PROCESSES)
    ]
    started = time.monotonic()
    try:
        wait_for(
            lambda: (
                time.monotonic() - started >= FLOOD_S
                and set(groups.values()) <= set().union(*(f.refused_on() for f in flooders))
            ),
            timeout=FLOOD_S + 90,
            what="the flood's length and a refusal of it on each group",
        )
    finally:
        summaries = [flooder.stop() for flooder in flooders]
    statuses = {ttl: holders[ttl].group_status(group) for ttl, group in groups.items()}
    held = {ttl: leases[ttl].valid for ttl in groups}
    for ttl in groups:
        assert holders[ttl].release(leases[ttl]) is False  # released, never revoked
    seen: Counter[str] = sum((Counter(summary["seen"]) for summary in summaries), Counter())
    said = [summary for summary in summaries if summary["first_refusal"] is not None]
    print(
        f"\nflood: {dict(seen)}; refused at the groups: "
        f"{[s.stats.rate_limited for s in statuses.values()]}; holders valid {held}"
    )
    assert seen["granted"] == 0
    assert seen["refused"] > 0 and said, seen
    first = said[0]
    assert f"sent more than {CALLER_UPDATES_PER_S:g} updates/s" in first["first_refusal"], first
    assert 0 < first["retry_after_s"] <= 1.0 / CALLER_UPDATES_PER_S + 0.1, first
    for ttl, status in statuses.items():
        assert status.holder is not None and status.holder.token == leases[ttl].token, ttl
        assert status.stats.expired == 0 and status.stats.leases == 1, (ttl, status.stats)
        assert status.stats.rate_limited > 0, ttl
    assert all(held.values()), held
