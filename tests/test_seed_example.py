"""The seed example runs unchanged as two processes sharing two groups, and shows switches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from timeslice import TimeSliceOrchestratorClient

from .helpers import REPO, Interval, assert_no_overlap, wait_for

SEED = REPO / "examples" / "seed_example.py"


def test_seed_example_two_processes(address: str, tmp_path: Path):
    # Not a byte of the example changed: the server comes from TEMPORAL_ADDRESS, as a user's
    # shell (or the `temporal` CLI's conventions) would give it.
    assert "localhost:7233" not in SEED.read_text().split('"""', 2)[2]
    log = tmp_path / "holds.jsonl"
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": address,
        "TIMESLICE_EXAMPLE_LOG": str(log),
        "TIMESLICE_EXAMPLE_EPOCHS": "4",
    }
    # Held here until both processes wait for it, so they share the groups whatever their
    # start-up takes (a user starts them together, README: "& ... ; wait").
    gate = TimeSliceOrchestratorClient(target=address, job_id="seed-gate")
    lease = gate.acquire("sampler-group")
    procs = [
        subprocess.Popen([sys.executable, str(SEED)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        wait_for(
            lambda: len(gate.group_status("sampler-group").queue) == 2,
            timeout=180,
            what="both processes waiting for the sampler group",
        )
        gate.release(lease)
    finally:
        gate.close()
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all(out.count("epoch") == 4 for out in outputs)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for group in ("sampler-group", "trainer-group"):
        held = [
            Interval(r["job"], i, r["start"], r["end"])
            for i, r in enumerate(
                sorted((r for r in records if r["group"] == group), key=lambda r: r["start"])
            )
        ]
        assert len(held) == 8
        assert len({i.job for i in held}) == 2
        assert_no_overlap(held)
    # Each process registered its model: a group that passed from one to the other moved the
    # state out and back (what `timeslice status trainer-group` prints).
    reader = TimeSliceOrchestratorClient(target=address, job_id="seed-reader")
    try:
        stats = reader.group_status("trainer-group").stats
    finally:
        reader.close()
    assert stats.switches > 0 and stats.bytes_moved >= 256 << 20, stats
