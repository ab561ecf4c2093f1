"""Durability: continue-as-new under contention, and a server restart mid-contention."""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.api.enums.v1 import WorkflowTaskFailedCause
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from timeslice import TimeSliceOrchestratorClient
from timeslice.cli.stack import Stack
from timeslice.protocol.group import group_workflow_id

from .helpers import checked_holds, events, finish, spawn_contenders, wait_for


def _runs(address: str, group: str) -> list[tuple[int, list[str]]]:
    """Each run's continue-as-new input size (bytes) and the causes of its failed tasks."""

    async def fetch() -> list[tuple[int, list[str]]]:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        found = []
        async for run in client.list_workflows(f"WorkflowId = '{group_workflow_id(group)}'"):
            history = await client.get_workflow_handle(run.id, run_id=run.run_id).fetch_history()
            carried, failed = 0, []
            for event in history.events:
                if event.HasField("workflow_execution_continued_as_new_event_attributes"):
                    attrs = event.workflow_execution_continued_as_new_event_attributes
                    carried = attrs.input.ByteSize()
                if event.HasField("workflow_task_failed_event_attributes"):
                    failed.append(WorkflowTaskFailedCause.Name(
                        event.workflow_task_failed_event_attributes.cause
                    ))  # fmt: skip
            found.append((carried, failed))
        return found

    return asyncio.run(fetch())


def _run_count(address: str, group: str) -> int:
    async def count() -> int:
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        runs = 0
        async for _ in client.list_workflows(f"WorkflowId = '{group_workflow_id(group)}'"):
            runs += 1
        return runs

    return asyncio.run(count())


def test_continue_as_new_under_contention_loses_nothing(tmp_path: Path):
    can_often = {"limit.historyCount.suggestContinueAsNew": 120}
    with Stack(tmp_path, dynamic_config=can_often).start() as stack:
        stack.control_worker()
        log = tmp_path / "holds.jsonl"
        jobs = ["a", "b", "c"]
        procs = spawn_contenders(
            stack.address, "can", jobs, log, "--iterations", "25", "--hold", "0.01"
        )
        finish(procs, timeout=300)
        intervals = checked_holds(log)
        assert len(intervals) == 75
        tokens = [i.token for i in intervals]
        assert len(set(tokens)) == 75  # no grant duplicated
        with TimeSliceOrchestratorClient(target=stack.address) as client:
            status = client.group_status("can")
        assert status.stats.runs > 2, "the group never continued as new"
        assert _run_count(stack.address, "can") == status.stats.runs
        assert status.stats.leases == 75 and status.stats.released == 75
        assert status.holder is None and status.queue == []
        runs = _runs(stack.address, "can")
        # The carried state is small and bounded, and no continue-as-new was rejected (a
        # rejected one makes the worker replay the whole run: the hand-off stalls).
        assert all(0 < size < 256 * 1024 for size, _ in runs if size), runs
        assert sum(1 for size, _ in runs if size) == len(runs) - 1  # all but the last continued
        assert [cause for _, failed in runs for cause in failed] == []


def test_server_restart_mid_contention_every_job_completes(tmp_path: Path):
    with Stack(tmp_path).start() as stack:
        stack.control_worker()
        server = stack.server
        assert server is not None
        log = tmp_path / "holds.jsonl"
        jobs = ["r1", "r2", "r3"]
        args = ("--iterations", "12", "--hold", "0.05", "--ttl", "60")
        procs = spawn_contenders(server.address, "restart", jobs, log, *args)
        # Every contender connected and holding its turn before the server goes: one that had not
        # connected yet would find no server at start-up, which is not what this test is about.
        wait_for(
            lambda: (
                {r["job"] for r in events(log, "acquired")} == set(jobs)
                and len(events(log, "acquired")) >= 6
            ),
            what="every contender under way",
        )
        server.stop()
        before = len(events(log, "acquired"))
        server.start()  # same port, same SQLite file
        finish(procs, timeout=300)
        intervals = checked_holds(log)
        assert before < 36, "the restart happened after the work was done"
        assert len(intervals) == 36
        assert {r["job"] for r in events(log, "done")} == set(jobs)
        with TimeSliceOrchestratorClient(target=server.address) as client:
            status = client.group_status("restart")
        assert status.stats.leases == 36
        assert status.stats.released == 36
