"""grpo-dp: grpo-toy trained data-parallel over N ranks with ``torch.distributed``.

One policy, N processes (``ranks = N`` in the job's config, one ``timeslice job worker`` or one
Ray actor per rank): each rank samples its share of every epoch's batch (the whole batch's
prompts are drawn from ``(seed, epoch)`` on every rank, and rank ``r`` takes the ``r``-th
slice, whole GRPO groups each, so advantages stay local), computes the rewards of its share,
and in ``train`` the ranks average their gradients with one all-reduce per optimizer step
before clipping and stepping — so every rank ends every step with the same weights, bit for
bit. Collectives run on gloo on the CPU and NCCL on a GPU (``dist_backend``).

A rank's completions are sampled with randomness from ``(seed, epoch, rank)``; nothing depends
on when a switch evicts or restores the rank, so a job time-sliced with others ends with the
same weights and rewards as the same job alone.

Around switches the process group is one more of the job's states, ``collectives``, moved
with the trainer's (:class:`~timeslice.workloads.data_parallel.DataParallelGroup`): an
eviction tears it down (option ``collectives = "rebuild"``, what NCCL needs) and the first
all-reduce after the restore builds it again; ``"keep"`` keeps a gloo group across switches.

The ranks find each other through ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (``timeslice.integrations.ray`` sets them in each rank's actor).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from timeslice.snapshot.base import SnapshotBackend
from timeslice.workloads.base import JobSpec, PhaseContext
from timeslice.workloads.data_parallel import DataParallelGroup, Move, RecordedBackend
from timeslice.workloads.grpo_toy import GrpoToyWorkload
from timeslice.workloads.options import GrpoDpOptions

NAME = GrpoDpOptions.workload


class GrpoDpWorkload(GrpoToyWorkload):
    """grpo-toy over N data-parallel ranks; its process group moves with the trainer."""

    name = NAME
    sampler_backends = ("sampler",)
    trainer_backends = ("trainer", "collectives")
    #: The options a job's ``workload_options`` parse as.
    options_type = GrpoDpOptions

    def __init__(self) -> None:
        super().__init__()
        self.opts = GrpoDpOptions()
        self.dp: DataParallelGroup | None = None
        self._batch_size = 0  # every rank's prompts together
        self._moves: list[Move] = []
        self._recorded: dict[str, SnapshotBackend] | None = None
        self._meeting = ""  # the key the ranks build their group under in this phase

    def setup(self, spec: JobSpec) -> None:
        """Join the job's ranks (``torch.distributed`` from the rank's environment), then build
        grpo-toy for this rank's share of the batch, with the ``collectives`` backend beside the
        trainer's.

        Args:
            spec: The job: its seed, sizes and options (:class:`GrpoDpOptions`).

        Raises:
            ValueError: A bad option, or a batch that does not split into equal shares.
        """
        opts = GrpoDpOptions.parse(spec.options)
        dp = DataParallelGroup(
            NAME,
            backend=opts.dist_backend,
            timeout_s=opts.collective_timeout_s,
            keep=opts.collectives == "keep",
        )
        dp.configure(opts.torch_device())
        if spec.batch_size % dp.world_size:
            raise ValueError(
                f"{NAME}: batch_size {spec.batch_size} does not split into {dp.world_size} "
                "equal shares; use a multiple of the ranks"
            )
        started = time.monotonic()
        # The parent holds this rank's share: its batch is the rank's prompts.
        super().setup(dataclasses.replace(spec, batch_size=spec.batch_size // dp.world_size))
        self.dp, self._batch_size = dp, spec.batch_size
        backends: dict[str, SnapshotBackend] = {
            **super().snapshot_backends(),
            "collectives": dp.collectives_backend(),
        }
        self._recorded = {
            name: RecordedBackend(name, backend, self._moves) for name, backend in backends.items()
        }
        self._moves.append(Move("*", "setup", started, time.monotonic(), 0))

    def snapshot_backends(self) -> dict[str, SnapshotBackend]:  # type: ignore[override]
        """grpo-toy's backends and ``collectives``, each recording its moves (:meth:`moves`).

        Returns:
            The backends by state name.

        Raises:
            RuntimeError: :meth:`setup` has not run.
        """
        if self._recorded is None:
            raise RuntimeError(f"{NAME}: snapshot_backends() called before setup()")
        return self._recorded

    def _dp(self) -> DataParallelGroup:
        if self.dp is None:
            raise RuntimeError(f"{NAME}: setup() has not run")
        return self.dp

    def _draw_prompts(self, epoch: int) -> tuple[torch.Tensor, torch.Generator]:
        dp, share = self._dp(), self._spec().batch_size
        gen = self._generator(epoch)
        shape = (self._batch_size, self.opts.seq_len)
        every = torch.randint(0, self.opts.digits, shape, generator=gen)
        mine = every[dp.rank * share : (dp.rank + 1) * share]
        seed = (self._spec().seed * 1_000_003 + epoch) * 1_000_033 + dp.rank + 1
        return mine, torch.Generator(device="cpu").manual_seed(seed % (1 << 63))

    def _reduce_gradients(self) -> None:
        params = list(self.policy.parameters())
        for p in params:
            if p.grad is None:  # no path from this share's loss: it still takes part
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        self._dp().all_reduce_mean_(grads, self._meeting)

    def train(self, epoch: int, ctx: PhaseContext) -> dict[str, float]:
        """grpo-toy's train step on this rank's share, gradients averaged over the ranks.

        Args:
            epoch: The epoch whose rollouts to train on.
            ctx: The phase: its lease token names where the ranks meet to rebuild their group.

        Returns:
            grpo-toy's metrics, and ``batch_reward_mean`` over every rank's share.
        """
        # Where the ranks meet if the group must be built: the same for every rank of this
        # phase (the lease's fencing token), and for no other phase.
        self._meeting = f"{ctx.lease_token}/{epoch}/{ctx.phase}"
        stats = super().train(epoch, ctx)
        ro = self._rollout
        assert ro is not None and ro.rewards is not None
        sums = [float(ro.rewards.sum()), float(ro.rewards.numel())]
        total, count = self._dp().all_reduce_sum(sums, self._meeting)
        return {**stats, "batch_reward_mean": total / count}

    def _meta(self) -> dict[str, Any]:
        dp = self._dp()
        return {**super()._meta(), "rank": dp.rank, "world_size": dp.world_size}

    def load(self, directory: Path) -> None:
        """Rewind to a checkpoint of this rank (its process group is rebuilt at next use).

        Args:
            directory: The checkpoint's folder.

        Raises:
            ValueError: The checkpoint is another rank's, or of another world size.
        """
        dp = self._dp()
        # Whatever group this process had is gone with the rewind: its peers may be new.
        dp.teardown()
        meta = torch.load(Path(directory) / "meta.pt", weights_only=True)
        if (meta.get("rank"), meta.get("world_size")) != (dp.rank, dp.world_size):
            raise ValueError(
                f"{NAME}: checkpoint {directory} is rank {meta.get('rank')} of "
                f"{meta.get('world_size')}, this process is rank {dp.rank} of {dp.world_size}"
            )
        super().load(directory)

    # ------------------------------------------------------------ inspection (tests, benches)

    def moves(self) -> list[dict[str, Any]]:
        """Every eviction and restore of this rank's states (and its setup), in order.

        Returns:
            One dict per move: state, action ("evict" or "restore"), start, end, bytes.
        """
        return [dataclasses.asdict(m) for m in self._moves]

    def weights_digest(self) -> str:
        """SHA-256 of the trainer's policy weights: equal on every rank after each step.

        Returns:
            The digest, in hex.

        Raises:
            RuntimeError: The trainer's state is evicted (another job holds the device).
        """
        trainer = self.snapshot_backends()["trainer"]
        if getattr(trainer, "inner", trainer).evicted:
            raise RuntimeError(f"{NAME}: the trainer's state is evicted; read its checkpoint")
        return policy_digest(self.policy.state_dict())

    def collective_builds(self) -> int:
        """Process groups this rank built (one per rebuild after a switch, and the first).

        Returns:
            The count.
        """
        return self._dp().builds

    def close(self) -> None:
        """Destroy the process group and rank 0's store (the process may serve another job)."""
        if self.dp is not None:
            self.dp.close()


def policy_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over a policy's ``state_dict`` (names and bytes): what "the same weights" means
    across ranks, runs and checkpoints (``trainer.pt``'s ``"policy"``)."""
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        # A copy: .numpy() would mark the tensor's own storage not resizable, which the torch
        # backend's eviction needs.
        digest.update(tensor.detach().cpu().clone().numpy().tobytes())
    return digest.hexdigest()


def create() -> GrpoDpWorkload:
    """The factory a job process calls to build this workload."""
    return GrpoDpWorkload()
