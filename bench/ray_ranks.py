"""Ranks that are Ray actors, on several Ray nodes of this machine: the issue's three figures.

1. Two grpo-dp jobs of 4 ranks each, spread over 2 nodes, on one group: overlaps of two jobs'
   states on one rank's device (and on one node: every rank of the job going out evicted
   before the incoming job's rank there restores), epochs run, and whether each job ends with
   the weights and rewards of the same training run alone (no Timeslice, same seeds).
2. A switch of a 4-rank job against a 1-rank job's, with the same per-rank state (the
   ``simulated`` workload's timed moves): from the outgoing job's phase end to the incoming
   job's phase start, eviction and restore included.
3. The hand-off between two 4-rank jobs against two 1-rank jobs' (no state): the same gap.

The Ray nodes are ``ray.cluster_utils.Cluster`` nodes (a raylet each, distinct node ids), with
a custom resource per node standing in for its GPUs. Tests import the helpers
(tests/test_ray.py). Run: ``.venv/bin/python bench/ray_ranks.py`` (BENCHMARKS.md has runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from temporalio.client import Client  # noqa: E402
from timeslice.integrations.ray import RankActor, RayRanks, Rendezvous  # noqa: E402
from timeslice.jobs import parse_job_config, start_rl_job  # noqa: E402
from timeslice.protocol.rl_job import RLJobResult  # noqa: E402
from timeslice.transport.connection import connect, connect_config  # noqa: E402

from bench.residency import overlaps, residencies, union  # noqa: E402

#: The custom resource that places an actor on node ``i`` (its "GPU slots").
NODE_RESOURCE = "timeslice-node-{}"
#: A tiny policy: the figures are about switches and collectives, not the model.
TINY = {"d_model": 16, "layers": 1, "heads": 2}


# ---------------------------------------------------------------------------- the cluster


class LocalCluster:
    """Several Ray nodes on this machine, each with ``slots`` of its own custom resource.

    Lean on purpose (a shared two-core machine): actors ask for no CPU, no worker is started
    ahead of need, no dashboard, a small object store, node failures found within about two
    seconds. Each node declares two CPUs only because a raylet starts at most that many
    worker processes at once (one with none)."""

    def __init__(self, nodes: int = 2, slots: int = 8) -> None:
        self.slots = slots
        self.count = nodes
        self.cluster: Cluster | None = None
        self.nodes: list[Any] = []

    def _node_args(self, i: int) -> dict[str, Any]:
        return {
            "num_cpus": 2,
            "resources": {NODE_RESOURCE.format(i): self.slots},
            "object_store_memory": 80 * 1024 * 1024,
        }

    def start(self) -> LocalCluster:
        # Rank actors import this module and the tests' helpers by name.
        path = os.environ.get("PYTHONPATH", "")
        if str(REPO) not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), path) if p)
        head = {
            **self._node_args(0),
            "include_dashboard": False,
            "_system_config": {
                "health_check_initial_delay_ms": 1000,
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 4,
                "prestart_worker_first_driver": False,
                "enable_worker_prestart": False,
            },
        }
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.nodes = [self.cluster.head_node]
        for i in range(1, self.count):
            self.nodes.append(self.cluster.add_node(**self._node_args(i)))
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="ERROR")
        return self

    def on_node(self, i: int) -> dict[str, Any]:
        """Actor options that place one rank on node ``i``."""
        return {"num_cpus": 0, "resources": {NODE_RESOURCE.format(i): 1}}

    def kill_raylet(self, i: int) -> None:
        """SIGKILL node ``i``'s raylet (its actors die with it)."""
        self.nodes[i].kill_raylet()

    def restart_node(self, i: int) -> None:
        """A fresh node in node ``i``'s place (same resource, a new node id)."""
        assert self.cluster is not None
        self.nodes[i] = self.cluster.add_node(**self._node_args(i))

    def shutdown(self) -> None:
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


class BenchRank(RankActor):
    """A rank actor that can also train grpo-dp alone, without Timeslice: the reference."""

    def reference(
        self, spec: dict[str, Any], epochs: int, rank: int, world: int, rendezvous: Rendezvous
    ) -> dict[str, Any]:
        """Train ``epochs`` epochs of grpo-dp as rank ``rank`` of ``world`` in this process,
        with no lease and no switch; the weights' digest and rank 0's rewards."""
        import torch
        from timeslice.workloads.base import JobSpec, PhaseContext
        from timeslice.workloads.grpo_dp import GrpoDpWorkload

        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR=rendezvous.addr,
            MASTER_PORT=str(rendezvous.port),
        )
        workload = GrpoDpWorkload()
        workload.setup(JobSpec(**spec))
        rewards = []
        try:
            for epoch in range(epochs):
                workload.sample(epoch, PhaseContext(epoch, "sample"))
                scored = workload.compute_rewards(epoch, PhaseContext(epoch, "rewards"))
                workload.train(epoch, PhaseContext(epoch, "train"))
                rewards.append(scored["reward_mean"])
            return {"digest": workload.weights_digest(), "rewards": rewards}
        finally:
            workload.close()


def rank_actors(cluster: LocalCluster, nodes: Sequence[int], actor: type = BenchRank) -> list[Any]:
    """One actor per rank, rank ``r`` on node ``nodes[r]``."""
    remote = ray.remote(actor)
    return [remote.options(**cluster.on_node(n)).remote() for n in nodes]


# ---------------------------------------------------------------------------- jobs


def job_config(job_id: str, group: str, ranks: int, **extra: Any) -> dict[str, Any]:
    """A small grpo-dp job (overrides in ``extra``)."""
    return {
        "job_id": job_id,
        "workload": "grpo-dp",
        "workload_options": dict(TINY),
        "sampler_group": group,
        "epochs": 3,
        "batch_size": 8,
        "group_size": 2,
        "seed": 1,
        "ranks": ranks,
        "checkpoint_every": 2,
        **extra,
    }


async def run_jobs(address: str, configs: list[dict[str, Any]]) -> list[RLJobResult]:
    """Start the jobs and wait for all of them."""
    client: Client = await connect(connect_config(address))
    handles = [await start_rl_job(client, parse_job_config(c)) for c in configs]
    return list(await asyncio.gather(*(h.result() for h in handles)))


def references(actors: list[Any], config: dict[str, Any]) -> dict[str, Any]:
    """The job trained alone by its own (not yet serving) actors: digest, rank 0's rewards."""
    spec = {
        "job_id": config["job_id"],
        "seed": config["seed"],
        "batch_size": config["batch_size"],
        "group_size": config["group_size"],
        "options": config["workload_options"],
    }
    rendezvous = ray.get(actors[0].timeslice_free_port.remote())
    world = len(actors)
    outs = ray.get(
        [
            a.reference.remote(spec, config["epochs"], r, world, rendezvous)
            for r, a in enumerate(actors)
        ]
    )
    assert len({o["digest"] for o in outs}) == 1, "the ranks of the reference run disagree"
    return outs[0]


def checkpoint_digests(result: RLJobResult, world: int) -> list[str]:
    """Each rank's policy digest from the job's final checkpoint."""
    import torch
    from timeslice.workloads.grpo_dp import policy_digest

    assert result.last_checkpoint is not None
    assert result.last_checkpoint.epochs_done == result.epochs_done
    root = Path(result.last_checkpoint.path)
    return [
        policy_digest(torch.load(root / f"rank-{r}" / "trainer.pt", weights_only=True)["policy"])
        for r in range(world)
    ]


# ---------------------------------------------------------------------------- residency


def residency_overlaps(
    ranks: dict[str, RayRanks], nodes: dict[str, Sequence[int]]
) -> dict[str, int]:
    """Overlaps of two jobs' states per rank's device (rank ``r``'s slot ``r % 2`` on its node)
    and per node (all of a job's ranks there), from every rank's record of its moves."""
    per_device: dict[Any, dict[str, list[tuple[float, float]]]] = {}
    per_node: dict[Any, dict[str, list[tuple[float, float]]]] = {}
    for job, rr in ranks.items():
        for rank, actor in enumerate(rr.actors):
            moves = ray.get(actor.timeslice_workload.remote("moves"))
            states = ("sampler", "trainer", "collectives")
            spans = residencies(moves, states)
            node = nodes[job][rank]
            per_device.setdefault((node, rank % 2), {}).setdefault(job, []).extend(spans)
            per_node.setdefault(node, {}).setdefault(job, []).extend(spans)
    node_unions = {n: {j: union(s) for j, s in jobs.items()} for n, jobs in per_node.items()}
    return {"device": overlaps(per_device), "node": overlaps(node_unions)}


# ---------------------------------------------------------------------------- hand-offs


def handoffs(results: list[RLJobResult], group: str) -> list[float]:
    """Gaps from one job's phase end to another job's next phase start on ``group`` (rank 0's
    clock): a hand-off, with the state moves of the switch in it."""
    holds = sorted(
        (h.mono_start, h.mono_end, r.job_id)
        for r in results
        for rec in r.records
        for h in rec.holds
        if h.group_id == group and h.mono_start is not None and h.mono_end is not None
    )
    return [
        after[0] - before[1]
        for before, after in itertools.pairwise(holds)
        if after[2] != before[2] and after[0] >= before[1]
    ]


# ---------------------------------------------------------------------------- where it goes

# The steps of a hand-off, in order, as the group's and the incoming job's histories show them.
STEPS = ("released", "evicting", "evicted", "granted", "grant taken", "phase scheduled")


async def _events(client: Client, workflow_id: str) -> list[tuple[float, str]]:
    """(server time, step) of a workflow's events that mark a hand-off's steps."""
    from temporalio.api.enums.v1 import EventType as E
    from timeslice.protocol.group import GRANT_SIGNAL, SNAPSHOT_ACTIVITY, GroupSignal, GroupUpdate
    from timeslice.protocol.rl_job import SAMPLE_ACTIVITY, TRAIN_ACTIVITY

    history = await client.get_workflow_handle(workflow_id).fetch_history()
    types: dict[int, str] = {}
    updates: dict[str, str] = {}
    out: list[tuple[float, str]] = []
    for e in history.events:
        at = e.event_time.ToDatetime().replace(tzinfo=UTC).timestamp()
        if e.event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            name = e.workflow_execution_signaled_event_attributes.signal_name
            step = {GroupSignal.RELEASE.value: "released", GRANT_SIGNAL: "grant taken"}.get(name)
        elif e.event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
            request = e.workflow_execution_update_accepted_event_attributes.accepted_request
            updates[request.meta.update_id] = request.input.name
            step = "released" if request.input.name == GroupUpdate.RELEASE else None
        elif e.event_type == E.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED:
            update_id = e.workflow_execution_update_completed_event_attributes.meta.update_id
            step = "granted" if updates.get(update_id) == GroupUpdate.ACQUIRE else None
        elif e.event_type == E.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            name = e.signal_external_workflow_execution_initiated_event_attributes.signal_name
            step = "granted" if name == GRANT_SIGNAL else None
        elif e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            kind = e.activity_task_scheduled_event_attributes.activity_type.name
            types[e.event_id] = kind
            step = {SNAPSHOT_ACTIVITY: "evicting", SAMPLE_ACTIVITY: "phase scheduled",
                    TRAIN_ACTIVITY: "phase scheduled"}.get(kind)  # fmt: skip
        elif e.event_type == E.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            done = types.get(e.activity_task_completed_event_attributes.scheduled_event_id)
            step = "evicted" if done == SNAPSHOT_ACTIVITY else None
        else:
            step = None
        if step is not None:
            out.append((at, step))
    return out


async def handoff_steps(address: str, results: list[RLJobResult], group: str) -> dict[str, float]:
    """The median seconds of each step of the hand-offs between ``results``' jobs on
    ``group``: from the outgoing phase's end to the first of each step after it (the last
    eviction's completion for "evicted"), then to the incoming phase's start."""
    from timeslice.protocol.group import group_workflow_id
    from timeslice.protocol.rl_job import rl_job_workflow_id

    client = await connect(connect_config(address))
    events = {r.job_id: await _events(client, rl_job_workflow_id(r.job_id)) for r in results}
    events["group"] = await _events(client, group_workflow_id(group))
    holds = sorted(
        (h.mono_start + h.wall_offset_s, h.mono_end + h.wall_offset_s, r.job_id)
        for r in results
        for rec in r.records
        for h in rec.holds
        if h.group_id == group and h.wall_offset_s is not None
    )
    segments: dict[str, list[float]] = {}
    for (_, ended, before), (started, _, after) in itertools.pairwise(holds):
        if before == after or started < ended:
            continue
        marks = [("phase ended", ended)]
        seen = sorted(events["group"] + events[after])
        for step in STEPS:
            at = [t for t, s in seen if s == step and marks[-1][1] - 0.05 <= t <= started]
            if at:
                marks.append((step, max(at) if step == "evicted" else min(at)))
        marks.append(("phase started", started))
        for (_, t0), (step, t1) in itertools.pairwise(marks):
            segments.setdefault(f"to {step}", []).append(t1 - t0)
    return {k: round(1000 * statistics.median(v), 1) for k, v in segments.items()}


@contextlib.contextmanager
def stack(tmp: Path) -> Iterator[str]:
    """A Temporal dev server and a control worker; yields the server's address."""
    from timeslice.cli.server import EmbeddedServer, free_port
    from timeslice.cli.services import start_service, stop_service

    server = EmbeddedServer(
        port=free_port(), ui_port=None, db=tmp / "temporal.db", log_path=tmp / "server.log"
    ).start()
    worker = start_service(
        ["worker", "--address", server.address], "control worker on task queue", tmp / "w.log"
    )
    try:
        yield server.address
    finally:
        stop_service(worker)
        server.stop()


# ---------------------------------------------------------------------------- the bench


def two_dp_jobs(
    cluster: LocalCluster,
    address: str,
    tmp: Path,
    epochs: int,
    actors: list[list[Any]] | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """Figure 1: two 4-rank grpo-dp jobs over 2 nodes on one group (``actors``: each job's
    ranks, 0 and 1 on node 0, 2 and 3 on node 1; default: new ones)."""
    group = group or f"g-{uuid.uuid4().hex[:8]}"
    nodes = [0, 0, 1, 1]
    jobs = {f"dp{i}-{uuid.uuid4().hex[:6]}": i + 1 for i in range(2)}
    configs = {j: job_config(j, group, 4, seed=seed, epochs=epochs) for j, seed in jobs.items()}
    given = actors or [rank_actors(cluster, nodes) for _ in jobs]
    actors_of = dict(zip(jobs, given, strict=True))
    alone = {j: references(actors_of[j], configs[j]) for j in jobs}
    ranks = {
        j: RayRanks(actors_of[j], job_id=j, address=address, workload="grpo-dp", checkpoint_dir=tmp)
        for j in jobs
    }
    places = {j: [p.node_id for p in rr.serve()] for j, rr in ranks.items()}
    started = time.monotonic()
    results = asyncio.run(run_jobs(address, list(configs.values())))
    wall = time.monotonic() - started
    found = residency_overlaps(ranks, {j: nodes for j in jobs})
    out: dict[str, Any] = {
        "group": group,
        "wall_s": round(wall, 1),
        "overlaps": found,
        "jobs": {},
    }
    for result in results:
        digests = checkpoint_digests(result, 4)
        rewards = [r.reward_mean for r in result.records]
        out["jobs"][result.job_id] = {
            "nodes": places[result.job_id],
            "epochs": [r.epoch for r in result.records],
            "rewinds": result.rewinds,
            "ranks_agree": len(set(digests)) == 1,
            "identical_to_alone": digests[0] == alone[result.job_id]["digest"]
            and rewards == alone[result.job_id]["rewards"],
            "rebuilds": ray.get(
                [a.timeslice_workload.remote("collective_builds") for a in actors_of[result.job_id]]
            ),
        }
    for rr in ranks.values():
        rr.close()
    return out


def switch_pairs(
    actors: list[list[Any]], address: str, tmp: Path, options: dict[str, Any], epochs: int
) -> tuple[list[float], dict[str, float]]:
    """Two simulated jobs (``actors``: each job's ranks; rank r of both on one device)
    alternating on one group: their hand-offs (seconds), and where they went."""
    group = f"g-{uuid.uuid4().hex[:8]}"
    ranks = len(actors[0])
    made = {}
    for i, mine in enumerate(actors):
        job = f"sw{ranks}-{i}-{uuid.uuid4().hex[:6]}"
        rr = RayRanks(mine, job_id=job, address=address, workload="simulated", checkpoint_dir=tmp)
        rr.serve()
        made[job] = rr
    configs = [
        {
            "job_id": job,
            "workload": "simulated",
            "workload_options": options,
            "sampler_group": group,
            "epochs": epochs,
            "ranks": ranks,
            "checkpoint_every": epochs,
        }
        for job in made
    ]
    results = asyncio.run(run_jobs(address, configs))
    for rr in made.values():
        rr.close()
    return handoffs(results, group), asyncio.run(handoff_steps(address, results, group))


def summary(gaps: list[float]) -> dict[str, float]:
    ordered = sorted(gaps)
    return {
        "n": len(ordered),
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4, help="epochs of the two grpo-dp jobs")
    p.add_argument("--switch-epochs", type=int, default=8, help="epochs of each switch pair")
    p.add_argument("--state-mib", type=int, default=1024, help="simulated state per rank")
    p.add_argument("--move-s", type=float, default=0.5, help="simulated eviction (= restore)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ray-ranks-"))
    cluster = LocalCluster(nodes=2, slots=8).start()
    out: dict[str, Any] = {}
    try:
        with stack(tmp) as address:
            # Eight actors, four a node: each 4-rank job has two ranks on each node; the
            # 1-rank jobs are two of them, on one node.
            pool = rank_actors(cluster, [0, 0, 0, 0, 1, 1, 1, 1])
            four = [[pool[0], pool[1], pool[4], pool[5]], [pool[2], pool[3], pool[6], pool[7]]]
            one = [[pool[0]], [pool[2]]]
            out["two_dp_jobs"] = two_dp_jobs(
                cluster, address, tmp / "ckpt", args.epochs, actors=four
            )
            print(json.dumps(out["two_dp_jobs"], indent=1), flush=True)
            moving = {
                "sample_s": 0.3,
                "reward_s": 0.0,
                "train_s": 0.3,
                "state_bytes": args.state_mib << 20,
                "snapshot_s": args.move_s,
            }
            still = {"sample_s": 0.3, "reward_s": 0.0, "train_s": 0.3}
            for name, options in (("switch", moving), ("handoff", still)):
                row = {}
                for ranks, actors in ((1, one), (4, four)):
                    gaps, steps = switch_pairs(actors, address, tmp, options, args.switch_epochs)
                    row[f"{ranks}_rank"] = {**summary(gaps), "steps_ms": steps}
                row["ratio_p50"] = round(row["4_rank"]["p50_ms"] / row["1_rank"]["p50_ms"], 2)
                out[name] = row
                print(name, json.dumps(row), flush=True)
    finally:
        cluster.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
