"""The ``simulated`` workload: phases that hold their lease for configured times.

For benchmarks and utilization studies: nothing is computed, but each phase takes its configured
duration, and every switch moves a simulated state of configured size and time. Options (all
optional): ``sample_s`` 1.0, ``reward_s`` 1.5, ``train_s`` 0.5, ``state_bytes`` 0,
``snapshot_s`` 0.0, ``restore_s`` (default: ``snapshot_s``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from timeslice.snapshot.base import SnapshotBackend
from timeslice.snapshot.simulated import SimulatedBackend
from timeslice.workloads.base import JobSpec, PhaseContext, Workload

DEFAULTS: dict[str, float] = {
    "sample_s": 1.0,
    "reward_s": 1.5,
    "train_s": 0.5,
    "state_bytes": 0,
    "snapshot_s": 0.0,
}


def parse_options(options: dict[str, Any]) -> dict[str, float]:
    unknown = sorted(set(options) - {*DEFAULTS, "restore_s"})
    if unknown:
        raise ValueError(
            f"simulated workload: unknown option(s) {unknown}; "
            f"known: {sorted({*DEFAULTS, 'restore_s'})}"
        )
    values: dict[str, float] = {**DEFAULTS, "restore_s": options.get("snapshot_s", 0.0)}
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"simulated workload: option {key} must be a number >= 0, not {value!r}"
            )
        values[key] = float(value)
    return values


class SimulatedWorkload(Workload):
    name = "simulated"
    sampler_backends = ("simulated",)
    trainer_backends = ("simulated",)

    def __init__(self) -> None:
        self._options: dict[str, float] = {}
        self._backends: dict[str, SnapshotBackend] = {}
        self._spec: JobSpec | None = None
        self.epochs_trained = 0

    def setup(self, spec: JobSpec) -> None:
        self._options = parse_options(spec.options)
        self._spec = spec
        self._backends = {
            "simulated": SimulatedBackend(
                nbytes=int(self._options["state_bytes"]),
                snapshot_s=self._options["snapshot_s"],
                restore_s=self._options["restore_s"],
            )
        }

    def _hold(self, ctx: PhaseContext, key: str) -> None:
        ctx.progress(phase=ctx.phase, seconds=self._options[key])
        ctx.wait(self._options[key])

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._hold(ctx, "sample_s")
        assert self._spec is not None
        return {"completions": float(self._spec.batch_size * self._spec.group_size)}

    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._hold(ctx, "reward_s")
        # A stand-in learning curve, so progress displays have something to show.
        return {"reward_mean": 1.0 - 0.5 * 0.9**epoch}

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        self._hold(ctx, "train_s")
        self.epochs_trained = epoch + 1
        return {"loss": 0.5 * 0.9**epoch}

    def save(self, directory: Path) -> None:
        (directory / "simulated.json").write_text(json.dumps({"epochs": self.epochs_trained}))

    def load(self, directory: Path) -> None:
        self.epochs_trained = json.loads((directory / "simulated.json").read_text())["epochs"]

    def snapshot_backends(self) -> dict[str, SnapshotBackend]:
        return self._backends

    def state_bytes(self) -> int | None:
        return int(self._options.get("state_bytes", 0)) or None


def create() -> SimulatedWorkload:
    return SimulatedWorkload()
