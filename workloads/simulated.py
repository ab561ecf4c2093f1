"""The ``simulated`` workload: phases that hold their lease for configured times.

For benchmarks and utilization studies: nothing is computed, but each phase takes its configured
duration, and every switch moves a simulated state of configured size and time. Options (all
optional): ``sample_s`` 1.0, ``reward_s`` 1.5, ``train_s`` 0.5, ``state_bytes`` 0 (per state),
``snapshot_s`` 0.0, ``restore_s`` (default: ``snapshot_s``), ``shared_state`` false.

Like a real sampler + trainer pair, the job has two states by default — the sampler's (moved by
switches of the sampler group) and the trainer's (the trainer group's). ``shared_state: true``
keeps one state that both groups move, for studying workloads whose state follows the lease
from group to group.
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


SHARED_STATE = "shared_state"


def parse_options(options: dict[str, Any]) -> dict[str, float]:
    known = {*DEFAULTS, "restore_s", SHARED_STATE}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"simulated workload: unknown option(s) {unknown}; known: {sorted(known)}")
    shared = options.get(SHARED_STATE, False)
    if not isinstance(shared, bool):
        raise ValueError(f"simulated workload: option {SHARED_STATE} must be true or false")
    values: dict[str, float] = {**DEFAULTS, "restore_s": options.get("snapshot_s", 0.0)}
    for key, value in options.items():
        if key == SHARED_STATE:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"simulated workload: option {key} must be a number >= 0, not {value!r}"
            )
        values[key] = float(value)
    return values


class SimulatedWorkload(Workload):
    name = "simulated"
    sampler_backends = ("sampler",)
    trainer_backends = ("trainer",)

    def __init__(self) -> None:
        self._options: dict[str, float] = {}
        self._backends: dict[str, SnapshotBackend] = {}
        self._spec: JobSpec | None = None
        self.epochs_trained = 0

    def state_names(self, options: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        parse_options(options)
        if options.get(SHARED_STATE, False):
            return ("simulated",), ("simulated",)
        return self.sampler_backends, self.trainer_backends

    def setup(self, spec: JobSpec) -> None:
        self._options = parse_options(spec.options)
        self._spec = spec
        sampler, trainer = self.state_names(spec.options)
        self._backends = {
            name: SimulatedBackend(
                nbytes=int(self._options["state_bytes"]),
                snapshot_s=self._options["snapshot_s"],
                restore_s=self._options["restore_s"],
            )
            for name in dict.fromkeys([*sampler, *trainer])
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


def create() -> SimulatedWorkload:
    return SimulatedWorkload()
