"""Torch for warm starts, imported once in the fork server (`timeslice.cli.warm_start`).

A forked job process that runs a torch workload (grpo-toy, grpo-dp) then skips torch's import,
3 s of CPU each on the project's machines, tens of times in the test suite. Without torch
installed this imports nothing.

A fork copies only the forking thread, so the fork server must hold no other thread when it
forks. Torch's own pools (OpenMP, intra-op, inter-op) start at first use, which the fork server
never makes; numpy's OpenBLAS, which torch imports, starts its pool when loaded unless it is
told to use one thread, so it is told so for the import alone (the children's environment is
the caller's, restored by the fork). A forked child sets its threads as any process that
imported torch before it read `--threads` does: `torch.set_num_threads`
(`timeslice.cli.main._limit_torch_threads`).
"""

from __future__ import annotations

import contextlib
import os

PRELOADED = (
    "torch",
    "timeslice.snapshot.torch_backend",
    "timeslice.workloads.grpo_toy",
)


def _preload() -> None:
    before = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        for name in PRELOADED:
            with contextlib.suppress(ImportError):
                __import__(name)
    finally:
        if before is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = before


_preload()
