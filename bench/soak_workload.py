"""The soak's RL workload: ``simulated`` phases that log themselves, and an applied-epoch ledger.

`bench/soak.py` starts each job process with this module on ``PYTHONPATH`` and
``TIMESLICE_SOAK_LOG_DIR`` set, and the job's config names ``soak_workload:create``. Every GPU
phase appends its start and end (system-wide monotonic clock and wall clock) to
``rl-<pid>.jsonl``, so the soak can check the job's holds against every other holder's, including
phases cut short by a kill -9 (a start with no end). Training appends its epoch to a ledger that
checkpoints carry; the soak checks that the final checkpoint's ledger is exactly 0..N-1 and that
every training step was applied to the state of exactly the epochs before it — each epoch
applied once, whatever was killed and rewound meanwhile.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from timeslice.workloads.base import JobSpec, PhaseContext, current_context
from timeslice.workloads.simulated import SimulatedWorkload

LOG_DIR_ENV = "TIMESLICE_SOAK_LOG_DIR"
LEDGER = "soak-ledger.json"
SLOW_PREPARE = "slow-prepare-"


class SoakWorkload(SimulatedWorkload):
    name = "soak"

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[int] = []
        self._job = "?"
        log_dir = os.environ.get(LOG_DIR_ENV)
        if not log_dir:
            raise ValueError(f"the soak workload needs {LOG_DIR_ENV} (set by bench/soak.py)")
        # Line-buffered: each record reaches the file as it is written, so a kill -9 loses none.
        self._log: IO[str] = open(  # noqa: SIM115 - lives as long as the process
            Path(log_dir) / f"rl-{os.getpid()}.jsonl", "a", buffering=1
        )

    def _emit(self, event: str, **fields: Any) -> None:
        record = {
            "job": self._job,
            "pid": os.getpid(),
            "event": event,
            "t": time.monotonic(),
            "wall": time.time(),
            **fields,
        }
        self._log.write(json.dumps(record) + "\n")

    def setup(self, spec: JobSpec) -> None:
        # Prepare runs under the job's leases (it builds the state on the device): a hold.
        self._job = spec.job_id
        self._emit("phase_start", epoch=-1, phase="prepare")
        try:
            super().setup(spec)
            self.applied = []
            self._emit("setup")
            self._slow_prepare()
        finally:
            self._emit("phase_end", epoch=-1, phase="prepare")

    def _slow_prepare(self) -> None:
        """A model load that takes a while, when the soak asks for one (``worker_down_in_prepare``
        writes how many seconds into ``slow-prepare-<job>``)."""
        marker = Path(os.environ[LOG_DIR_ENV]) / f"{SLOW_PREPARE}{self._job}"
        try:
            seconds = float(marker.read_text())
        except (OSError, ValueError):
            return
        self._emit("slow_prepare", seconds=seconds)
        ctx = current_context()
        if ctx is None:
            time.sleep(seconds)  # stands in for building a large model
        else:
            # A careful loader checks its stop between steps: a lost lease ends it at once
            # (a loader that never checks is stopped by its process exiting).
            ctx.wait(seconds)

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._emit("phase_start", epoch=epoch, phase="sample")
        try:
            return super().sample(epoch, ctx)
        finally:
            self._emit("phase_end", epoch=epoch, phase="sample")

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._emit("phase_start", epoch=epoch, phase="train")
        try:
            metrics = super().train(epoch, ctx)
            # Applied only once the phase's work is done: a phase stopped halfway raises above.
            self._emit("apply", epoch=epoch, steps_before=len(self.applied))
            self.applied.append(epoch)
            return metrics
        finally:
            self._emit("phase_end", epoch=epoch, phase="train")

    def save(self, directory: Path) -> None:
        # Checkpoints are written under the job's lease too (from the device state): a hold.
        self._emit("phase_start", epoch=-1, phase="checkpoint")
        try:
            super().save(directory)
            (directory / LEDGER).write_text(json.dumps({"applied": self.applied}))
            self._emit("save", steps=len(self.applied), path=str(directory))
        finally:
            self._emit("phase_end", epoch=-1, phase="checkpoint")

    def load(self, directory: Path) -> None:
        self._emit("phase_start", epoch=-1, phase="load")
        try:
            super().load(directory)
            self.applied = json.loads((directory / LEDGER).read_text())["applied"]
            self._emit("load", steps=len(self.applied), path=str(directory))
        finally:
            self._emit("phase_end", epoch=-1, phase="load")


def create() -> SoakWorkload:
    return SoakWorkload()
