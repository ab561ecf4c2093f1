"""`make demo`: the embedded Temporal server, the control worker and two jobs sharing GPU groups.

Starts `timeslice server` (gRPC 7233, Web UI 8233) and `timeslice worker`, runs two processes of
the seed example (examples/seed_example.py) that contend for `sampler-group` and `trainer-group`,
then prints who held each group when and each group's utilization. `--keep` leaves the server and
worker running afterwards so the Web UI can be browsed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from timeslice import TimeSliceOrchestratorClient
from timeslice.server import EmbeddedServer

HERE = Path(__file__).resolve().parent
GROUPS = ("sampler-group", "trainer-group")


def start_worker(address: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice.cli", "worker", "--address", address],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "control worker" not in line:
        proc.kill()
        raise SystemExit("the control worker did not start")
    print(f"  {line.strip()}")
    return proc


def draw(records: list[dict], width: int = 72) -> None:
    t0 = min(r["start"] for r in records)
    t1 = max(r["end"] for r in records)
    scale = width / max(t1 - t0, 1e-9)
    jobs = sorted({r["job"] for r in records})
    letters = {job: chr(ord("A") + i) for i, job in enumerate(jobs)}
    print("\nwho held each group when (one column = %.0f ms):" % (1000 / scale))
    for group in GROUPS:
        row = [" "] * width
        for r in records:
            if r["group"] == group:
                for x in range(int((r["start"] - t0) * scale), int((r["end"] - t0) * scale) + 1):
                    row[min(x, width - 1)] = letters[r["job"]]
        print(f"  {group:14} |{''.join(row)}|")
    for job, letter in letters.items():
        print(f"  {letter} = {job}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="leave server and worker running")
    args = parser.parse_args()

    print("starting the embedded Temporal server ...")
    # A fresh database per demo, so utilization is measured over this run alone.
    db = Path(".timeslice") / "demo.db"
    for stale in db.parent.glob(db.name + "*"):
        stale.unlink()
    server = EmbeddedServer(port=7233, ui_port=8233, db=db, log_path=db.parent / "server.log")
    server.start()
    print(f"  Temporal at {server.address}, Web UI {server.ui_url}")
    worker = start_worker(server.address)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "holds.jsonl"
            env = {
                **os.environ,
                "TIMESLICE_EXAMPLE_LOG": str(log),
                "TIMESLICE_EXAMPLE_EPOCHS": str(args.epochs),
            }
            print(f"running two jobs of the seed example for {args.epochs} epochs ...")
            jobs = [
                subprocess.Popen([sys.executable, str(HERE / "seed_example.py")], env=env)
                for _ in range(2)
            ]
            if any(job.wait() != 0 for job in jobs):
                print("a job failed", file=sys.stderr)
                return 1
            records = [json.loads(line) for line in log.read_text().splitlines()]
        draw(records)
        with TimeSliceOrchestratorClient(target=server.address) as client:
            print("\ngroup utilization (busy / wall since the group's creation):")
            for group in GROUPS:
                s = client.group_status(group)
                p50 = f"{s.wait_p50_s * 1000:.0f} ms" if s.wait_p50_s is not None else "n/a"
                print(
                    f"  {group:14} {s.utilization:6.1%}  leases {s.stats.leases:3}  "
                    f"acquire wait p50 {p50}"
                )
        print(f"\nWeb UI: {server.ui_url}/namespaces/default/workflows")
        if args.keep:
            print("server and worker keep running; press Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                server.wait()
        return 0
    finally:
        worker.terminate()
        worker.wait()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
