"""grpo-dp variants for tests/test_ray.py's faults (job processes load them by MODULE:FACTORY).

``slow_train``: grpo-dp whose ``train`` holds its lease a while before it computes (a larger
model's step), so a test can kill a rank while every rank is in the phase. It waits on the
phase's context, so a stop still stops it; the weights are grpo-dp's, bit for bit.

``stuck_eviction``: grpo-dp whose rank 1 cannot tear its process group down (an NCCL
communicator that will not be destroyed): its eviction fails, and the job is faulted.
"""

from __future__ import annotations

from timeslice.snapshot.base import SnapshotBackend, SnapshotError
from timeslice.snapshot.collectives import CollectivesBackend
from timeslice.workloads.base import PhaseContext
from timeslice.workloads.grpo_dp import GrpoDpWorkload

#: How long ``slow_train``'s train holds the lease before computing.
TRAIN_HOLD_S = 1.5
STUCK_RANK = 1


class SlowTrainDp(GrpoDpWorkload):
    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        ctx.wait(TRAIN_HOLD_S)
        return super().train(epoch, ctx)


class StuckEvictionDp(GrpoDpWorkload):
    def snapshot_backends(self) -> dict[str, SnapshotBackend]:  # type: ignore[override]
        backends = dict(super().snapshot_backends())
        rank = self._dp().rank
        if rank == STUCK_RANK:

            def refuse() -> None:
                raise SnapshotError(
                    f"rank {rank} cannot tear its process group down: a collective is still "
                    "in flight on its communicator"
                )

            backends["collectives"] = CollectivesBackend(refuse, lambda: True)
        return backends


def slow_train() -> SlowTrainDp:
    return SlowTrainDp()


def stuck_eviction() -> StuckEvictionDp:
    return StuckEvictionDp()
