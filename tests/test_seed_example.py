"""The seed example runs unchanged (but for the address) as two processes sharing two groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .helpers import REPO, Interval, assert_no_overlap

SEED = REPO / "examples" / "seed_example.py"


def test_seed_example_two_processes(address: str, tmp_path: Path):
    source = SEED.read_text()
    assert source.count('target="localhost:7233"') == 1
    script = tmp_path / "seed_example.py"
    script.write_text(source.replace('target="localhost:7233"', f'target="{address}"'))
    log = tmp_path / "holds.jsonl"
    env = {**os.environ, "TIMESLICE_EXAMPLE_LOG": str(log), "TIMESLICE_EXAMPLE_EPOCHS": "4"}
    procs = [
        subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
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
