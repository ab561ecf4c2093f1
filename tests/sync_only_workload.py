"""A workload with no async mode (a plain ``Workload``): the simulated one's phases, delegated.

timeslice job worker --workload tests.sync_only_workload:create
"""

from __future__ import annotations

from pathlib import Path

from timeslice.snapshot.base import SnapshotBackend
from timeslice.workloads.base import JobSpec, PhaseContext, Workload
from timeslice.workloads.simulated import SimulatedWorkload


class SyncOnlyWorkload(Workload):
    name = "sync-only"
    sampler_backends = SimulatedWorkload.sampler_backends
    trainer_backends = SimulatedWorkload.trainer_backends

    def __init__(self) -> None:
        self._inner = SimulatedWorkload()

    def setup(self, spec: JobSpec) -> None:
        self._inner.setup(spec)

    def sample(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        return self._inner.sample(epoch, ctx)

    def compute_rewards(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        return self._inner.compute_rewards(epoch, ctx)

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        return self._inner.train(epoch, ctx)

    def save(self, directory: Path) -> None:
        self._inner.save(directory)

    def load(self, directory: Path) -> None:
        self._inner.load(directory)

    def snapshot_backends(self) -> dict[str, SnapshotBackend]:
        return self._inner.snapshot_backends()


def create() -> SyncOnlyWorkload:
    return SyncOnlyWorkload()
