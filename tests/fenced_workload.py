"""A ``simulated`` workload for the fencing tests: it logs every use of the device and can hold
its setup or its sampling open until the test lets go.

Each record in ``$TIMESLICE_DEVICE_LOG`` is JSON: {"job", "pid", "event": "start" | "end",
"what", "t"} with ``t`` from time.monotonic() (one system-wide clock on Linux, so the records
compare with the contenders' logs). Options, besides ``simulated``'s: ``setup_until`` /
``sample_until`` (a path): setup / each sampling holds the device until that file exists — or
until it is told to stop (a lost lease), which is what the tests are about;
``setup_ignores_stop`` (true): the setup never checks whether it should stop, as a model load
that is one long call does.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from timeslice.workloads.base import JobSpec, PhaseContext, PhaseStopped, current_context
from timeslice.workloads.simulated import SimulatedWorkload

LOG_ENV = "TIMESLICE_DEVICE_LOG"
_OWN = ("setup_until", "sample_until", "setup_ignores_stop")


def _simulated(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in _OWN}


class FencedWorkload(SimulatedWorkload):
    name = "fenced"

    def __init__(self) -> None:
        super().__init__()
        self._job = "?"
        self._gates: dict[str, Any] = {}
        self._log: IO[str] = open(os.environ[LOG_ENV], "a", buffering=1)  # noqa: SIM115

    def _emit(self, event: str, what: str) -> None:
        record = {"job": self._job, "pid": os.getpid(), "event": event, "what": what,
                  "t": time.monotonic()}  # fmt: skip
        self._log.write(json.dumps(record) + "\n")

    def _hold_until(self, what: str, ctx: PhaseContext | None) -> None:
        gate = self._gates.get(f"{what}_until")
        while gate is not None and not Path(gate).exists():
            if ctx is None:
                time.sleep(0.05)
            else:
                ctx.wait(0.05)

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return super().state_names(_simulated(options))

    def setup(self, spec: JobSpec) -> None:
        self._job = spec.job_id
        self._gates = {k: spec.options[k] for k in _OWN if k in spec.options}
        super().setup(
            JobSpec(spec.job_id, spec.seed, spec.batch_size, spec.group_size,
                    _simulated(spec.options))
        )  # fmt: skip
        self._emit("start", "setup")
        try:
            # Setup is handed no context: it checks the one it runs under, between steps.
            ignores = self._gates.get("setup_ignores_stop", False)
            self._hold_until("setup", None if ignores else current_context())
        except PhaseStopped:
            self._emit("stopped", "setup")
            raise
        finally:
            self._emit("end", "setup")

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._emit("start", f"sample {epoch}")
        try:
            self._hold_until("sample", ctx)
            return super().sample(epoch, ctx)
        except PhaseStopped:
            self._emit("stopped", f"sample {epoch}")
            raise
        finally:
            self._emit("end", f"sample {epoch}")

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._emit("start", f"train {epoch}")
        try:
            return super().train(epoch, ctx)
        finally:
            self._emit("end", f"train {epoch}")


def create() -> FencedWorkload:
    return FencedWorkload()
