"""Record a GpuGroupWorkflow history down the `patches-at-start` branch: the run asks that
patch when it starts (and the patches added after it, all in ``__init__``) and no other, and
takes every older patch's branch (staged restores among them) without their markers.

    .venv/bin/python -m tests.histories.record_patches_at_start

The run is ``record_staged.py``'s (two jobs, a staged restore, streamed evictions, the one
deadline timer). The history, `gpu_group_patches_at_start_run0.json`, holds the markers of
the patches asked at start and no other; `tests/test_replay.py` replays it and checks both.
Re-record only when the workflow changes on purpose.
"""

from __future__ import annotations

from pathlib import Path

from tests.histories import record_staged

OUT = Path(__file__).resolve().parent / "gpu_group_patches_at_start_run0.json"

if __name__ == "__main__":
    record_staged.main(OUT)
