"""The Ray integration's parts that need no Ray cluster: its imports, the collectives hook,
a client's snapshot target of other processes' queues, a data-parallel rank's settings."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

import pytest
from timeslice import TimeSliceOrchestratorClient
from timeslice.errors import InvalidArgumentError
from timeslice.protocol.group import QueueTarget, SnapshotTarget, job_task_queue
from timeslice.snapshot.base import SnapshotRequest
from timeslice.snapshot.collectives import CollectivesBackend

REPO = Path(__file__).resolve().parents[2]
REQUEST = SnapshotRequest("job", "gpus", "evict for gpus")


def test_the_integration_imports_no_ray_until_it_is_used() -> None:
    """Every ``import ray`` of the module is inside a function: importing it never needs Ray."""
    tree = ast.parse((REPO / "integrations" / "ray.py").read_text())
    top_level = [
        alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ] + [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module]
    assert not [name for name in top_level if name == "ray" or name.startswith("ray.")]


def test_without_ray_the_first_use_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from timeslice.integrations import ray as integration

    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray imports
    with pytest.raises(ImportError, match=r"pip install 'timeslice\[ray\]'"):
        integration.RayRanks([object()], job_id="j", address="localhost:7233")


def test_collectives_are_torn_down_on_eviction_and_left_to_their_owner_on_restore() -> None:
    built = [True]
    torn: list[int] = []

    def teardown() -> None:
        torn.append(1)
        built[0] = False

    hook = CollectivesBackend(teardown, lambda: built[0])
    evicted = asyncio.run(hook.snapshot(REQUEST))
    assert torn == [1] and hook.teardowns == 1 and evicted.mode == "discard"
    assert asyncio.run(hook.snapshot(REQUEST)).bytes == 0 and torn == [1]  # nothing built
    asyncio.run(hook.restore(REQUEST))
    assert built == [False] and hook.restores == 1  # the next collective rebuilds, not this


def test_kept_collectives_are_never_torn_down() -> None:
    hook = CollectivesBackend(lambda: pytest.fail("torn down"), lambda: True, keep=True)
    assert asyncio.run(hook.snapshot(REQUEST)).bytes == 0
    with pytest.raises(ValueError, match="nbytes"):
        CollectivesBackend(lambda: None, lambda: True, nbytes=-1)


def _actor_queues(job: str, ranks: int) -> SnapshotTarget:
    queues = [
        QueueTarget(task_queue=job_task_queue(job, r), backends=["torch"]) for r in range(ranks)
    ]
    return SnapshotTarget(queues=queues)


def test_a_client_evicts_through_the_queues_it_is_given() -> None:
    client = TimeSliceOrchestratorClient(
        "localhost:7233", job_id="j", rank=2, snapshot_target=_actor_queues("j", 2)
    )
    try:
        target = client._engine.session.settings.snapshot_target
        assert target is not None
        assert [q.task_queue for q in target.queues] == [job_task_queue("j", r) for r in (0, 1)]
    finally:
        client.close()


def test_a_client_refuses_a_target_naming_its_own_queue_or_not_a_target() -> None:
    with pytest.raises(InvalidArgumentError, match="own task queue"):
        TimeSliceOrchestratorClient(
            "localhost:7233", job_id="j", rank=1, snapshot_target=_actor_queues("j", 2)
        )
    with pytest.raises(InvalidArgumentError, match="must be a SnapshotTarget"):
        TimeSliceOrchestratorClient("localhost:7233", job_id="j", snapshot_target=["q"])  # type: ignore[arg-type]


def test_a_data_parallel_rank_says_which_variable_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from timeslice.workloads.data_parallel import DataParallelGroup

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    group = DataParallelGroup("grpo-dp")
    with pytest.raises(ValueError, match="RANK is not set"):
        group.configure(torch.device("cpu"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        group.configure(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"RANK=3 must be in 0\.\.WORLD_SIZE-1=1"):
        group.configure(torch.device("cpu"), rank=3)
    alone = DataParallelGroup("grpo-dp")
    alone.configure(torch.device("cpu"), rank=0, world_size=1)
    grad = torch.ones(3)
    alone.all_reduce_mean_([grad], "k")  # one rank: nothing to meet, nothing changes
    assert grad.tolist() == [1.0, 1.0, 1.0] and not alone.built()


def test_grpo_dp_refuses_a_batch_that_does_not_split(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from timeslice.workloads.base import JobSpec
    from timeslice.workloads.grpo_dp import GrpoDpWorkload

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="batch_size 8 does not split into 3"):
        GrpoDpWorkload().setup(JobSpec("j", 1, 8, 2, {}))
    with pytest.raises(ValueError, match="'collectives' = 'sometimes' is invalid"):
        GrpoDpWorkload().state_names({"collectives": "sometimes"})
