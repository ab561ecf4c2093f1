"""A plain Ray driver and its worker group, time-sliced by two added lines (``# timeslice``).

Each job is a driver that owns a worker group: Ray actors, one per GPU (here: per custom
resource slot, on the CPU), training one small policy data-parallel (each rank its share of
the batch, gradients averaged with ``torch.distributed``). The driver's loop is its own; it
wraps the group call it already makes in a lease of the group,
``with orchestrator.on_accelerators(): ray.get([w.update.remote(...) ...])``, and does its CPU
work (here: scoring, standing in for rewards) holding nothing. When the other job takes the
group, Timeslice evicts *the actors'* state — their torch modules and optimizer moments, and
their process group, torn down (``CollectivesBackend``) — on every rank at once, and restores
it before this job's next update. The driver's process holds none of it.

Start a server and a control worker, then run it (two jobs on one group, on a local Ray):

    .venv/bin/timeslice server
    .venv/bin/timeslice worker
    .venv/bin/python examples/ray_driver.py --group gpus-0

``--ray-address`` joins a running Ray cluster instead (its nodes need the custom resource
``--resource`` with a slot per rank of each job); ``--alone`` runs one job with no Timeslice,
which ends with the very same weights (the script prints their digests). tests/test_ray.py
runs :func:`run_job` on a two-node Ray cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import threading
import time
import uuid
from typing import Any

import ray
import torch
from timeslice.integrations.ray import ActorTorchState, RayRanks, TimeSlicedRank  # timeslice
from timeslice.snapshot.base import SnapshotBackend
from timeslice.workloads.data_parallel import DataParallelGroup, Move, RecordedBackend
from torch import nn

BATCH = 64  # examples per update, over every rank


class PolicyWorker(TimeSlicedRank):  # timeslice (1 of 2): the base class
    """One rank: a small policy and its optimizer, trained data-parallel with the others."""

    def __init__(self, seed: int, rank: int, world: int) -> None:
        torch.set_num_threads(1)
        self.seed, self.rank, self.world = seed, rank, world
        self.moves: list[Move] = []
        self.dp = DataParallelGroup("ray-driver example")
        self.policy: nn.Module | None = None

    def setup(self) -> None:
        """The initial weights (the same on every rank) and a fresh optimizer, on the device:
        the driver calls it under its first lease, so this state never shares the device
        with another job's."""
        started = time.monotonic()
        self.dp.teardown()
        self.moves.clear()  # a new state: what happened to the last one is moot
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.policy = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.moves.append(Move("*", "setup", started, time.monotonic(), 0))

    def timeslice_state(self) -> dict[str, SnapshotBackend]:
        # What a switch moves: the torch state, and the process group (torn down; rebuilt by
        # the next all-reduce). Recorded, so the tests can check when each rank moved.
        collectives = self.dp.collectives_backend()
        return {
            "torch": RecordedBackend("torch", ActorTorchState(self), self.moves),
            "collectives": RecordedBackend("collectives", collectives, self.moves),
        }

    def update(self, step: int, meeting: str) -> float:
        """One data-parallel optimizer step on this rank's share of step ``step``'s batch;
        ``meeting``: where the ranks build their process group if it was torn down (every
        rank gets the same, no other step does: the lease's fencing token and the step)."""
        assert self.policy is not None, "setup() first"
        # The rendezvous (MASTER_ADDR / MASTER_PORT) is in the environment: RayRanks sets it.
        self.dp.configure(torch.device("cpu"), rank=self.rank, world_size=self.world)
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        x = torch.randn(BATCH, 8, generator=gen)
        y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:].prod(dim=1, keepdim=True)).tanh()
        share = BATCH // self.world
        mine = slice(self.rank * share, (self.rank + 1) * share)
        loss = nn.functional.mse_loss(self.policy(x[mine]), y[mine])
        self.optimizer.zero_grad()
        loss.backward()
        self.dp.all_reduce_mean_([p.grad for p in self.policy.parameters()], meeting)
        self.optimizer.step()
        return float(loss)

    def digest(self) -> str:
        """SHA-256 of the weights (call while the state is on the device)."""
        assert self.policy is not None, "setup() first"
        digest = hashlib.sha256()
        for tensor in self.policy.state_dict().values():
            digest.update(tensor.detach().clone().numpy().tobytes())  # a copy: see grpo_dp
        return digest.hexdigest()

    def recorded_moves(self) -> list[dict[str, Any]]:
        """Its setup, and every eviction and restore of its states, on this host's clock."""
        return [dataclasses.asdict(m) for m in self.moves]


def workers(seed: int, placements: list[dict[str, Any]]) -> list[Any]:
    """The worker group: one actor per rank, placed by ``placements`` (Ray actor options)."""
    remote = ray.remote(PolicyWorker)
    world = len(placements)
    return [remote.options(**o).remote(seed, r, world) for r, o in enumerate(placements)]


def run_job(
    actors: list[Any],
    *,
    steps: int,
    job_id: str,
    address: str | None,
    group: str | None,
    score_s: float = 0.05,
    together: threading.Barrier | None = None,
) -> dict[str, Any]:
    """The driver's loop: set the worker group up, then ``steps`` updates, each followed by
    CPU work; returns the losses and the final weights' digest per rank.

    With ``group`` the group calls run under the group's lease (``address``: Temporal's);
    without, it is the plain driver. ``together``: wait there once the ranks serve (jobs
    started at once then take turns from their first step)."""
    if group is None:
        return _plain(actors, steps, score_s)
    assert address is not None
    ranks = RayRanks(actors, job_id=job_id, address=address)
    ranks.serve()  # each actor serves its rank's queue; RANK, MASTER_ADDR ... set there
    losses: list[float] = []
    try:
        with ranks.client(group_id=group) as orchestrator:
            if together is not None:
                together.wait()
            with orchestrator.on_accelerators():  # the state is made under the first lease
                ray.get([w.setup.remote() for w in actors])
            for step in range(steps):
                with orchestrator.on_accelerators() as lease:  # timeslice (2 of 2): wrap it
                    meeting = f"{lease.token}/{step}"
                    per_rank = ray.get([w.update.remote(step, meeting) for w in actors])
                losses.append(sum(per_rank) / len(per_rank))
                time.sleep(score_s)  # CPU work between GPU calls (rewards, logging): no lease
            with orchestrator.on_accelerators():  # the state home, to read it
                digests = ray.get([w.digest.remote() for w in actors])
            # The actors outlive this job: their state leaves the device before the group
            # forgets the job (closing the client tells the group the job left).
            orchestrator.snapshot()
    finally:
        ranks.close()
    return {"job_id": job_id, "losses": losses, "digests": digests}


def _plain(actors: list[Any], steps: int, score_s: float) -> dict[str, Any]:
    """The same driver without Timeslice: it tells its ranks where to meet itself."""
    if len(actors) > 1:
        meet = ray.get(actors[0].timeslice_free_port.remote())
        ray.get([w.timeslice_rendezvous.remote(meet) for w in actors])
    ray.get([w.setup.remote() for w in actors])
    losses = []
    for step in range(steps):
        per_rank = ray.get([w.update.remote(step, str(step)) for w in actors])
        losses.append(sum(per_rank) / len(per_rank))
        time.sleep(score_s)
    return {
        "job_id": "alone",
        "losses": losses,
        "digests": ray.get([w.digest.remote() for w in actors]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", help="the GPU group both jobs share (default: gpus-<random>)")
    p.add_argument("--address", default=os.environ.get("TEMPORAL_ADDRESS", "localhost:7233"))
    p.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    p.add_argument("--resource", default="example-gpu", help="custom resource, a slot per rank")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--alone", action="store_true", help="one job, no Timeslice")
    args = p.parse_args()
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
    else:
        ray.init(num_cpus=0, resources={args.resource: 4 * args.ranks}, log_to_driver=False)
    group = None if args.alone else (args.group or f"gpus-{uuid.uuid4().hex[:6]}")
    placement = [{"num_cpus": 0, "resources": {args.resource: 1}}] * args.ranks
    results: dict[int, dict[str, Any]] = {}

    seeds = (1,) if args.alone else (1, 2)
    together = threading.Barrier(len(seeds))

    def one(seed: int) -> None:
        job = f"ray-driver-{seed}-{uuid.uuid4().hex[:6]}"
        results[seed] = run_job(
            workers(seed, placement), steps=args.steps, job_id=job, address=args.address,
            group=group, together=together,
        )  # fmt: skip

    threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed, result in sorted(results.items()):
        print(json.dumps({"seed": seed, "last_loss": result["losses"][-1],
                          "digest": result["digests"][0][:16]}))  # fmt: skip


if __name__ == "__main__":
    main()
