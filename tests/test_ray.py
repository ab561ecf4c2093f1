"""Ranks that are Ray actors, on a real two-node Ray cluster on this machine.

One cluster for the file (``ray.cluster_utils.Cluster``: a raylet per node, distinct node ids,
a custom resource per node standing in for its GPUs) and one pool of rank actors, four per
node, reused by the tests (an actor serves one job at a time; a dead one is replaced). The
RL job workflows, the groups and the control worker are the session's real ones; the ranks
train grpo-dp with gloo. The node-loss test runs last: it kills node 1.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.ray

from temporalio.client import Client, WorkflowFailureError  # noqa: E402
from timeslice.integrations.ray import RayRanks  # noqa: E402
from timeslice.jobs import parse_job_config, start_rl_job  # noqa: E402
from timeslice.protocol.group import GroupStatus, group_workflow_id  # noqa: E402
from timeslice.protocol.rl_job import RLJobProgress, RLJobResult, rl_job_workflow_id  # noqa: E402
from timeslice.transport.connection import connect, connect_config  # noqa: E402

from bench.ray_ranks import (  # noqa: E402
    LocalCluster,
    checkpoint_digests,
    job_config,
    rank_actors,
    references,
    two_dp_jobs,
)
from bench.residency import overlaps, residencies  # noqa: E402
from examples import ray_driver  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

SLOW = "tests.ray_workloads:slow_train"
STUCK = "tests.ray_workloads:stuck_eviction"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    started = LocalCluster(nodes=2, slots=8).start()
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def pool(cluster: LocalCluster) -> dict[int, list[Any]]:
    """Rank actors by node, four each, started once (their processes import torch and
    Temporal); each test's jobs are served by some of them, one job at a time."""
    return {node: rank_actors(cluster, [node] * 4) for node in (0, 1)}


def run(address: str, work: Any) -> Any:
    async def main() -> Any:
        return await work(await connect(connect_config(address)))

    return asyncio.run(main())


def progress(address: str, job: str) -> RLJobProgress:
    async def ask(client: Client) -> RLJobProgress:
        handle = client.get_workflow_handle(rl_job_workflow_id(job))
        return await handle.query("progress", result_type=RLJobProgress)

    return run(address, ask)


def group_status(address: str, group: str) -> GroupStatus:
    async def ask(client: Client) -> GroupStatus:
        handle = client.get_workflow_handle(group_workflow_id(group))
        return await handle.query("status", result_type=GroupStatus)

    return run(address, ask)


def start(address: str, config: dict[str, Any]) -> None:
    async def go(client: Client) -> None:
        await start_rl_job(client, parse_job_config(config))

    run(address, go)


def result(address: str, job: str) -> RLJobResult:
    async def wait(client: Client) -> RLJobResult:
        handle = client.get_workflow_handle(rl_job_workflow_id(job), result_type=RLJobResult)
        return await handle.result()

    return run(address, wait)


def served(actors: list[Any], job: str, address: str, workload: str, tmp: Path) -> RayRanks:
    ranks = RayRanks(actors, job_id=job, address=address, workload=workload, checkpoint_dir=tmp)
    ranks.serve()
    return ranks


def assert_every_epoch_once(done: RLJobResult, epochs: int) -> None:
    assert [r.epoch for r in done.records] == list(range(epochs))
    assert done.epochs_done == epochs


def assert_as_alone(done: RLJobResult, alone: dict[str, Any], world: int) -> None:
    """Every rank ends with the weights, and the job with the rewards, of the run alone."""
    assert checkpoint_digests(done, world) == [alone["digest"]] * world
    assert [r.reward_mean for r in done.records] == alone["rewards"]


def test_two_four_rank_jobs_share_one_group_over_two_nodes(
    cluster: LocalCluster, pool: dict[int, list[Any]], address: str, group: str, tmp_path: Path
) -> None:
    actors = [[*pool[0][0:2], *pool[1][0:2]], [*pool[0][2:4], *pool[1][2:4]]]
    found = two_dp_jobs(cluster, address, tmp_path, epochs=3, actors=actors, group=group)
    # Per rank's device and per node: every rank of the job going out evicted before the
    # incoming job's rank there restored (the ranks' own records, one host clock).
    assert found["overlaps"] == {"device": 0, "node": 0}
    for job, seen in found["jobs"].items():
        assert len(set(seen["nodes"])) == 2, f"{job}'s ranks are not on two nodes"
        assert seen["nodes"][0] == seen["nodes"][1] != seen["nodes"][2] == seen["nodes"][3]
        assert seen["epochs"] == [0, 1, 2] and seen["rewinds"] == 0
        assert seen["ranks_agree"], f"{job}: the ranks' weights differ"
        assert seen["identical_to_alone"], f"{job}: not the weights / rewards of the run alone"
        # The process group was torn down by evictions and rebuilt: more than the first build.
        assert min(seen["rebuilds"]) >= 2, seen["rebuilds"]
    status = group_status(address, group)
    assert status.stats.evictions >= 2 and status.stats.bytes_moved > 0


def test_a_ray_driver_wraps_its_calls_and_the_actors_state_moves(
    cluster: LocalCluster, pool: dict[int, list[Any]], address: str, group: str, tmp_path: Path
) -> None:
    """The plain-driver example's job (a worker group over both nodes) shares a group with a
    2-rank RL job: the driver's lease covers its calls, and what moves is its actors' state."""
    steps = 6
    workers = ray_driver.workers(1, [cluster.on_node(0), cluster.on_node(1)])
    alone = ray_driver.run_job(workers, steps=steps, job_id="alone", address=None, group=None)
    job = f"rl-{uuid.uuid4().hex[:6]}"
    config = job_config(job, group, 2, epochs=3)
    rl_actors = [pool[0][0], pool[1][0]]
    rl = served(rl_actors, job, address, "grpo-dp", tmp_path)
    driven: dict[str, Any] = {}
    rl_started = threading.Event()

    def hold_until_the_rl_job_waits(step: int) -> None:
        # The RL job starts under the driver's first step's lease and the step keeps it until
        # the job queues behind it: the release is contended (the driver's actors' state
        # leaves) and the next step brings it back. Started any earlier, the RL job could run
        # every epoch before the driver's first grant on a loaded machine (CI once saw it:
        # then nothing of the driver's ever moved, and it waited here in vain).
        if step == 0:
            start(address, config)
            rl_started.set()
            wait_for(
                lambda: bool(group_status(address, group).queue),
                timeout=180,
                what="the RL job waiting behind the driver",
            )

    def drive() -> None:
        driven.update(
            ray_driver.run_job(
                workers, steps=steps, job_id=f"driver-{job}", address=address, group=group,
                while_holding=hold_until_the_rl_job_waits,
            )
        )  # fmt: skip

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        assert rl_started.wait(timeout=300), "the driver never reached its first step"
        done = result(address, job)
        driver.join(timeout=300)
        driver_moves = ray.get([w.recorded_moves.remote() for w in workers])
        rl_moves = ray.get([a.timeslice_workload.remote("moves") for a in rl_actors])
    finally:
        rl.close()
    assert driven["losses"] == alone["losses"]
    assert driven["digests"] == alone["digests"] and len(set(alone["digests"])) == 1
    assert_every_epoch_once(done, 3)
    # What moved was the driver's actors' state: each rank evicted its torch state (bytes)
    # and its process group, and was restored; and on neither node were the two jobs'
    # ranks resident at once.
    for moves in driver_moves:
        assert {m["state"] for m in moves if m["action"] == "evict"} == {"torch", "collectives"}
        assert any(m["action"] == "restore" and m["bytes"] > 0 for m in moves)
    by_node = {
        node: {
            "driver": residencies(driver_moves[node], ("torch", "collectives")),
            job: residencies(rl_moves[node], ("sampler", "trainer", "collectives")),
        }
        for node in (0, 1)
    }
    assert overlaps(by_node) == 0
    status = group_status(address, group)
    assert status.stats.evictions >= 2 and status.stats.restores >= 1


FAULT_OPTIONS = {"collective_timeout_s": 10.0}  # a rebuild waiting for a dead rank gives up


def fault_configs(
    victim: str, other: str, group: str, victim_workload: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    def config(job: str, workload: str, seed: int) -> dict[str, Any]:
        base = job_config(job, group, 2, workload=workload, seed=seed, heartbeat_timeout_s=3)
        base["workload_options"] = {**base["workload_options"], **FAULT_OPTIONS}
        return base

    return config(victim, victim_workload, 3), config(other, "grpo-dp", 4)


def lost_and_rewound(
    cluster: LocalCluster,
    pool: dict[int, list[Any]],
    address: str,
    group: str,
    tmp: Path,
    *,
    other_nodes: tuple[int, int],
    lose: Any,
) -> tuple[RayRanks, RLJobResult, RLJobResult]:
    """A 2-rank victim (rank r on node r) and a 2-rank job that goes on, on one group; ``lose``
    strikes the victim in its second epoch's train (every rank in the phase, the group held)."""
    victim, other = f"victim-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    v_cfg, o_cfg = fault_configs(victim, other, group, SLOW)
    v_actors = [pool[0][0], pool[1][0]]
    o_actors = [pool[n][1 + i] for i, n in enumerate(other_nodes)]
    alone = {victim: references(v_actors, v_cfg), other: references(o_actors, o_cfg)}
    v, o = (
        served(v_actors, victim, address, SLOW, tmp),
        served(o_actors, other, address, "grpo-dp", tmp),
    )
    v.supervise(lambda rank: rank_actors(cluster, [rank])[0])  # fresh: rank r on node r
    try:
        start(address, v_cfg)
        start(address, o_cfg)

        def in_train() -> bool:
            seen = progress(address, victim)
            return seen.epoch >= 1 and seen.phase == "train"

        wait_for(in_train, timeout=180, what=f"{victim} training its second epoch")
        lose(v)
        done_v, done_o = result(address, victim), result(address, other)
    finally:
        v.close()
        o.close()
        pool[0][0], pool[1][0] = v.actors
    # Rewound to its last checkpoint on fresh actors: every epoch applied once, and the very
    # weights and rewards of the run alone; the other job went on, untouched.
    assert done_v.rewinds >= 1 and done_v.redone_epochs >= 1
    assert_every_epoch_once(done_v, 3)
    assert_as_alone(done_v, alone[victim], 2)
    assert_every_epoch_once(done_o, 3)
    assert done_o.rewinds == 0
    assert_as_alone(done_o, alone[other], 2)
    # The lost holder's lease was handed back, not left to run out; nobody is faulted.
    status = group_status(address, group)
    assert {r.outcome for r in status.history if r.job_id == victim} <= {"released"}
    assert not status.faulted_jobs and status.holder is None
    return v, done_v, done_o


def test_a_killed_rank_actor_rewinds_its_job_on_a_fresh_one(
    cluster: LocalCluster, pool: dict[int, list[Any]], address: str, group: str, tmp_path: Path
) -> None:
    def kill_rank_0(ranks: RayRanks) -> None:
        ray.kill(ranks.actors[0])  # rank 0: its fresh actor moves the rendezvous too

    ranks, _, _ = lost_and_rewound(
        cluster, pool, address, group, tmp_path, other_nodes=(0, 1), lose=kill_rank_0
    )
    assert 0 in {rank for rank, _ in ranks.replaced}


def test_a_rank_that_cannot_evict_faults_its_job_with_the_reason(
    pool: dict[int, list[Any]], address: str, group: str, tmp_path: Path
) -> None:
    stuck, other = f"stuck-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    s_cfg, o_cfg = fault_configs(stuck, other, group, STUCK)
    s_cfg["epochs"] = 6
    s = served([pool[0][0], pool[1][0]], stuck, address, STUCK, tmp_path)
    o = served([pool[0][1], pool[1][1]], other, address, "grpo-dp", tmp_path)
    try:
        start(address, s_cfg)
        wait_for(lambda: progress(address, stuck).epoch >= 1, timeout=120, what="stuck's epoch")
        start(address, o_cfg)  # its first grant evicts the stuck job, whose rank 1 refuses
        with pytest.raises(WorkflowFailureError) as failed:
            result(address, stuck)
        done_o = result(address, other)
        # Read before its ranks stop: a job whose processes leave is forgotten, fault and all.
        faulted = group_status(address, group).faulted_jobs
    finally:
        s.close()
        o.close()
    reason = str(failed.value.cause)
    assert "rank 1 cannot tear its process group down" in reason, reason
    assert getattr(failed.value.cause, "type", None) == "JobFaulted"
    assert "cannot tear its process group down" in faulted[stuck]
    assert_every_epoch_once(done_o, 3)


def test_a_lost_node_rewinds_its_job_on_fresh_actors(
    cluster: LocalCluster, pool: dict[int, list[Any]], address: str, group: str, tmp_path: Path
) -> None:
    """Runs last: node 1's raylet is killed (every actor there dies), a fresh node joins."""

    def lose_node_1(_: RayRanks) -> None:
        cluster.kill_raylet(1)
        cluster.restart_node(1)  # where the supervisor's fresh rank 1 will land

    ranks, _, _ = lost_and_rewound(
        cluster, pool, address, group, tmp_path, other_nodes=(0, 0), lose=lose_node_1
    )
    assert 1 in {rank for rank, _ in ranks.replaced}
