"""A buggy job process for the tests: try-locks (``acquire(timeout=0)``) groups from many threads
as fast as each answer comes back, until its stdin closes.

It prints ``refused GROUP`` the first time a group refuses it for its rate (flushed, so a test
can wait on it), and at the end one JSON line: its counts and the first refusal's text and
``retry_after_s`` (the group's own word; later ones may be the client's).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter

from timeslice import AcquireTimeoutError, RateLimitedError, TimeSliceOrchestratorClient


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--group", action="append", required=True)
    p.add_argument("--threads-per-group", type=int, default=3)
    args = p.parse_args()
    client = TimeSliceOrchestratorClient(target=args.address, job_id=args.job_id).connect()
    seen: Counter[str] = Counter()
    said: list[RateLimitedError] = []
    lock = threading.Lock()
    stop = threading.Event()

    def flood(group: str) -> None:
        while not stop.is_set():
            try:
                lease = client.acquire(group, timeout=0)
            except AcquireTimeoutError:
                outcome = "held"
            except RateLimitedError as err:
                outcome = "refused"
                with lock:
                    if not said:
                        said.append(err)
            else:  # the holder is there all along: this would be a second holder
                outcome = "granted"
                client.release(lease)
            with lock:
                seen[outcome] += 1
                if outcome == "refused":
                    seen[f"refused {group}"] += 1
                    if seen[f"refused {group}"] == 1:
                        print(f"refused {group}", flush=True)

    threads = [
        threading.Thread(target=flood, args=(group,), daemon=True)
        for group in args.group
        for _ in range(args.threads_per_group)
    ]
    for thread in threads:
        thread.start()
    print("flooding", flush=True)
    sys.stdin.read()  # until the test closes it
    stop.set()
    for thread in threads:
        thread.join(60)
    first = said[0] if said else None
    summary = {
        "seen": dict(seen),
        "first_refusal": None if first is None else str(first),
        "retry_after_s": None if first is None else first.retry_after_s,
    }
    print(json.dumps(summary), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
